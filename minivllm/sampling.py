"""Chapter 1: sampling. Logits in, one token id out: greedy, temperature, top-k, top-p, min-p, and the
adjustments a request may ask for first (logit bias, repetition, presence and frequency
penalties), plus the log-probabilities a client can read back.

`02_sampling.py` shows each step on the default model's real logits.
"""

from __future__ import annotations

import functools

import torch

from minivllm.contracts import TokenLogprob

# --8<-- [start:functions]
# --8<-- [start:greedy]
def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token id (per row, if logits is [batch, vocab])."""
    return logits.argmax(dim=-1)
# --8<-- [end:greedy]


# --8<-- [start:temperature]
def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Scale logits by 1/temperature. Temperature 0 is greedy and is handled by the caller."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 here (0 means greedy), got {temperature}")
    return logits / temperature
# --8<-- [end:temperature]


# --8<-- [start:top-k]
def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit outside the k largest to -inf. k = 0 keeps everything."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))
# --8<-- [end:top-k]


# --8<-- [start:top-p]
def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities sum to >= p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop a token if the tokens ranked above it already reach p. The top token is always
    # kept, however peaked the distribution is, and however small p: compared with float32
    # probabilities, a p below float32's range (1e-300) rounds to 0, which would drop it too.
    drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= p
    drop_sorted[..., 0] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
# --8<-- [end:top-p]


# --8<-- [start:min-p]
def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """vLLM's min_p: drop every token whose probability is below min_p times the likeliest's.
    In logits, p_i < min_p * p_max is logit_i < logit_max + log(min_p). min_p = 0 keeps everything."""
    if min_p <= 0:
        return logits
    floor = logits.max(dim=-1, keepdim=True).values + torch.log(torch.tensor(min_p, dtype=logits.dtype))
    return logits.masked_fill(logits < floor, float("-inf"))
# --8<-- [end:min-p]


# --8<-- [start:penalties]
class TokenHistory:
    """What one request has seen, as [vocab] tensors: the memory the penalties need."""

    def __init__(self, prompt_ids, vocab_size: int, device: torch.device | str = "cpu"):
        self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.prompt_seen[torch.as_tensor(list(prompt_ids), dtype=torch.long, device=device)] = True
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)

    def add(self, token_id: int) -> None:
        self.output_counts[token_id] += 1

    def copy(self) -> TokenHistory:
        """An independent copy (speculative decoding, Chapter 10, tries tokens on it)."""
        twin = object.__new__(TokenHistory)
        twin.prompt_seen, twin.output_counts = self.prompt_seen, self.output_counts.clone()
        return twin


def apply_logit_bias(logits: torch.Tensor, biases: list) -> torch.Tensor:
    """Row i gets biases[i], a sequence of (token id, amount), added to its logits."""
    bias = torch.zeros_like(logits)
    for row, pairs in enumerate(biases):
        if pairs:
            ids, amounts = zip(*pairs)
            bias[row, list(ids)] = torch.tensor(amounts, dtype=logits.dtype, device=logits.device)
    return logits + bias


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Seen tokens lose likelihood whatever their sign: positive logits are divided, negative multiplied."""
    shrunk = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, shrunk, logits)


def apply_presence_frequency(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                             frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI's two penalties: frequency per occurrence in the output, presence once if it occurred."""
    return logits - (counts * frequency + (counts > 0) * presence)


def adjust_logits(logits: torch.Tensor, params: list, histories: list) -> torch.Tensor:
    """Bias, then penalties, on a [batch, vocab] block: row i belongs to params[i] and histories[i].

    Rows whose params adjust nothing come back as they were; the others are worked on
    together, one tensor operation per adjustment, whatever the batch size.
    """
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    out = logits.float().clone()     # float32, as HF's generate does, and never in place
    index = torch.tensor(rows, device=logits.device)
    chosen = [params[i] for i in rows]
    counts = torch.stack([histories[i].output_counts for i in rows])
    seen = torch.stack([histories[i].prompt_seen for i in rows]) | (counts > 0)

    def column(name: str) -> torch.Tensor:
        return torch.tensor([[getattr(p, name)] for p in chosen], dtype=torch.float32, device=logits.device)

    block = apply_logit_bias(out[index], [p.logit_bias for p in chosen])
    block = apply_repetition_penalty(block, seen, column("repetition_penalty"))
    out[index] = apply_presence_frequency(block, counts, column("presence_penalty"), column("frequency_penalty"))
    return out
# --8<-- [end:penalties]


# --8<-- [start:logprobs]
def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: list[int]) -> list:
    """For row i: the log-probability of token_ids[i] and of the k[i] likeliest tokens.

    Computed from the logits as given (the model's own distribution, before any
    adjustment or temperature); one softmax and one top-k for the whole batch.
    """
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logits.device).unsqueeze(1))[:, 0].tolist()
    top = logprobs.topk(max(k), dim=-1) if max(k) > 0 else None
    entries = []
    for row, (token_id, lp) in enumerate(zip(token_ids, chosen)):
        alternatives = () if top is None else tuple(zip(top.indices[row, :k[row]].tolist(),
                                                        top.values[row, :k[row]].tolist()))
        entries.append(TokenLogprob(token_id, lp, alternatives))
    return entries
# --8<-- [end:logprobs]


# --8<-- [start:race]
WORD = 0xFFFFFFFF    # the noise is made of 32-bit words, held in int64 so no product overflows


def mix32(x):
    """A 32-bit integer hash (a bijection that scrambles every bit), on a Python int or an int64
    tensor alike: the multipliers are below 2**31, so no product leaves int64, on any device."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & WORD
    x = x ^ (x >> 15)
    x = (x * 0x68E31DA5) & WORD
    return x ^ (x >> 16)


def noise_key(seed: int, choice: int, position: int) -> int:
    """The one number a draw's noise comes from: a request's seed, which of its answers (0 unless
    it asked for several) and the output position. Nothing else: no stream that other draws advance."""
    key = 0
    for word in (seed & WORD, (seed >> 32) & WORD, choice & WORD, position & WORD):
        key = mix32((key ^ word) + 0x9E3779B9 & WORD)
    return key


@functools.lru_cache(maxsize=8)
def _vocabulary_words(vocab: int, device: str) -> torch.Tensor:
    return mix32(mix32(torch.arange(vocab, dtype=torch.int64, device=device)))


def gumbel_noise(keys: list[int], vocab: int, device) -> torch.Tensor:
    """[len(keys), vocab] Gumbel noise, row i from keys[i] alone: a counter-based hash of (key,
    token id), computed with the same integer steps on a CPU and on a GPU, so both draw the
    same tokens for the same seeds (up to the last bit of a logarithm)."""
    keys = torch.tensor(keys, dtype=torch.int64).to(device, non_blocking=True)
    words = mix32(_vocabulary_words(vocab, str(device))[None, :] ^ keys[:, None])
    u = ((words >> 8).float() + 0.5) * 2.0 ** -24          # 24 random bits: uniform in (0, 1), never 0
    return -(-u.log()).log()


def race(log_p: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """The Gumbel-max race, one token per row: argmax(log p + g) is an exact draw from p
    (a token with p = 0, cut by top-k, top-p or a grammar, has log p = -inf and never wins).
    One batched operation for the whole step and no wait for the device."""
    return (log_p + gumbel_noise(keys, log_p.shape[-1], log_p.device)).argmax(dim=-1)
# --8<-- [end:race]


# --8<-- [start:sample]
def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A private random stream for one request, so its draws do not depend on anyone else's."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def sample_next_token(logits: torch.Tensor, params, generator: torch.Generator | None = None,
                      history: TokenHistory | None = None) -> int:
    """Pick one token id from a [vocab] logit vector according to SamplingParams.

    With a history, bias and penalties come first; a caller that already applied them
    to the whole batch (the decode loop) leaves it out.
    """
    if history is not None:
        logits = adjust_logits(logits.unsqueeze(0), [params], [history])[0]
    if params.is_greedy:
        return int(greedy(logits))
    return int(torch.multinomial(probabilities(logits, params), num_samples=1, generator=generator))


def probabilities(logits: torch.Tensor, params) -> torch.Tensor:
    """The distribution a sampled token is drawn from: temperature, top-k, top-p, softmax
    (speculative decoding, Chapter 10, compares two of them)."""
    logits = apply_temperature(logits.float(), params.temperature)
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    logits = min_p_filter(logits, params.min_p)      # vLLM's; after temperature, as vLLM applies it
    return logits.softmax(dim=-1)
# --8<-- [end:sample]
# --8<-- [end:functions]
