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
#include <vector>

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
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));

  // --8<-- [start:loop]
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / kv_heads, g = task % kv_heads, ctx = len[i];
      const float* qi = qs + (i * heads + g * group) * dim;
      scores.assign(group * ctx, 0.0f);
      for (int64_t t = 0; t < ctx; ++t) {      // scores: each key read once for the whole group
        const int64_t slot = table[i * width + t / block_size] * block_size + t % block_size;
        const float* key = ks + (slot * kv_heads + g) * dim;
        for (int64_t h = 0; h < group; ++h) {
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qi[h * dim + d] * key[d];
          scores[h * ctx + t] = s * scale;
        }
      }
      for (int64_t h = 0; h < group; ++h) {    // softmax over the context, stable
        float* row = scores.data() + h * ctx;
        const float top = *std::max_element(row, row + ctx);
        float sum = 0.0f;
        for (int64_t t = 0; t < ctx; ++t) sum += (row[t] = std::exp(row[t] - top));
        for (int64_t t = 0; t < ctx; ++t) row[t] /= sum;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = 0; t < ctx; ++t) {      // the weighted sum: each value read once for the group
        const int64_t slot = table[i * width + t / block_size] * block_size + t % block_size;
        const float* value = vs + (slot * kv_heads + g) * dim;
        for (int64_t h = 0; h < group; ++h) {
          const float p = scores[h * ctx + t];
          float* a = acc.data() + h * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += p * value[d];
        }
      }
      std::copy(acc.begin(), acc.end(), outs + (i * heads + g * group) * dim);
    }
  });
  // --8<-- [end:loop]
  return out;
}
