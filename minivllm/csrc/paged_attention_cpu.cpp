// Chapter 13: decode attention that reads the KV pool where it lies.
//
// One new query per sequence attends to its cached keys and values, found through its block
// table: the key of position t sits in slot table[t / block_size] * block_size + t % block_size.
// Nothing is copied into a rectangle first; each (sequence, KV head) is one task, and the query
// heads that share the KV head (grouped-query attention) read each key and value once, together.
//
//   q [seqs, heads, head_dim]   pools [slots, kv_heads, head_dim]   float32, contiguous
//   tables [seqs, width] int64  lens [seqs] int64 (positions each sequence attends to, >= 1)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <set>
#include <vector>

constexpr int64_t kKeys = 4;   // keys scored together (the four sums in the loop below)

// --8<-- [start:loop]
// One task: the query heads of one KV head group (q, group x dim) against one sequence's ctx
// cached positions, found through its row of the block table. A function of its own, so that the
// compiler sees plain local values rather than the captures of a parallel region.
static void attend_group(const float* q, float* out, const float* ks, const float* vs, const int64_t* row,
                         int64_t ctx, int64_t block_size, int64_t kv_heads, int64_t g, int64_t group,
                         int64_t dim, std::vector<float>& scores, std::vector<float>& acc) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  const int64_t stride = (ctx + kKeys - 1) / kKeys * kKeys;   // room for a last, partial tile
  auto at = [&](const float* pool, int64_t t) {                // position t's vector of head g
    return pool + ((row[t / block_size] * block_size + t % block_size) * kv_heads + g) * dim;
  };
  scores.resize(group * stride);
  for (int64_t t = 0; t < ctx; t += kKeys) {   // scores: kKeys keys at a time, each read once for the group
    const float* key[kKeys];
    for (int64_t j = 0; j < kKeys; ++j) key[j] = at(ks, std::min(t + j, ctx - 1));   // past the end: unused
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = q + h * dim;
      float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;   // four independent sums keep the vector units busy
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t d = 0; d < dim; ++d) {
        s0 += qh[d] * key[0][d], s1 += qh[d] * key[1][d];
        s2 += qh[d] * key[2][d], s3 += qh[d] * key[3][d];
      }
      float* out_scores = scores.data() + h * stride + t;
      out_scores[0] = s0 * scale, out_scores[1] = s1 * scale, out_scores[2] = s2 * scale, out_scores[3] = s3 * scale;
    }
  }
  for (int64_t h = 0; h < group; ++h) {    // softmax over the context, stable
    float* p = scores.data() + h * stride;
    const float top = *std::max_element(p, p + ctx);
    float sum = 0.0f;
    for (int64_t t = 0; t < ctx; ++t) sum += (p[t] = std::exp(p[t] - top));
    for (int64_t t = 0; t < ctx; ++t) p[t] /= sum;
  }
  acc.assign(group * dim, 0.0f);
  for (int64_t t = 0; t < ctx; ++t) {      // the weighted sum: each value read once for the group
    const float* value = at(vs, t);
    for (int64_t h = 0; h < group; ++h) {
      const float p = scores[h * stride + t];
      float* a = acc.data() + h * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] += p * value[d];
    }
  }
  std::copy(acc.begin(), acc.end(), out);
}
// --8<-- [end:loop]

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                     torch::Tensor tables, torch::Tensor lens, int64_t block_size) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_pool.scalar_type() == at::kFloat &&
              v_pool.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "int64 tables and lengths");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "the pools must be contiguous");
  q = q.contiguous(), tables = tables.contiguous(), lens = lens.contiguous();
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_pool.size(1), slots = k_pool.size(0), width = tables.size(1);
  TORCH_CHECK(k_pool.size(2) == dim && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(tables.size(0) == n && lens.size(0) == n && block_size > 0, "one table and length per query");
  const int64_t group = heads / kv_heads;
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {          // checked here, so that the loops below never read outside the pool
    TORCH_CHECK(len[i] >= 1 && len[i] <= width * block_size, "a length beyond its block table");
    for (int64_t b = 0; b < (len[i] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table[i * width + b] >= 0 && (table[i * width + b] + 1) * block_size <= slots,
                  "a block outside the pool");
  }
  auto out = torch::empty_like(q);
  const float* qs = q.data_ptr<float>();
  const float* ks = k_pool.data_ptr<float>();
  const float* vs = v_pool.data_ptr<float>();
  float* outs = out.data_ptr<float>();

  // --8<-- [start:tasks]
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {   // torch's threads (OpenMP)
    std::vector<float> scores, acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / kv_heads, g = task % kv_heads;
      attend_group(qs + (i * heads + g * group) * dim, outs + (i * heads + g * group) * dim, ks, vs,
                   table + i * width, len[i], block_size, kv_heads, g, group, dim, scores, acc);
    }
  });
  // --8<-- [end:tasks]
  return out;
}

// How many of torch's threads a parallel_for in this file runs on: the tests' check that it was
// built with OpenMP (without it, the pragma inside at::parallel_for is ignored and loops run on one).
int64_t parallel_threads() {
  std::mutex lock;
  std::set<int> seen;
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> guard(lock);
    seen.insert(at::get_thread_num());
  });
  return static_cast<int64_t>(seen.size());
}
