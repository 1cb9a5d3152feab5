"""
Sampling with per-row random streams: one piece of code for the engine and the model's reference sampler.

Each row draws its randomness from a counter-based hash of (row seed, step, candidate) instead of a shared
torch.Generator. A row's tokens then depend only on its own seed and logits, never on which other rows share
its batch or in what order rows were admitted, and no per-row Python work is needed.

sample_with_generator is nanochat's `sample_next_token(logits, rng, ...)` over the same streams, its row seeds
drawn from the generator.
"""

import torch

_M32 = 0xFFFFFFFF


def mix32(x):
    """A 32-bit integer hash (xor-shift-multiply). Works on python ints and int64 tensors alike; all
    intermediate products stay below 2**63, so int64 tensors never overflow."""
    return _mix32_of_32_bits(x & _M32)


def _mix32_of_32_bits(x):
    """mix32(x) for x already in [0, 2**32), without the mask that would leave it as it is (a kernel per call)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def row_seed(seed, row_index):
    """The seed of sample `row_index` of a prompt seeded with `seed` (a python int in [0, 2**32))."""
    return mix32(mix32(seed) ^ mix32(row_index + 0x9E3779B9))


def row_seeds(seed, row_indices, device=None):
    """(len(row_indices),) int64: the seeds of those samples of a prompt seeded with `seed`, any python int
    (its low 32 bits count)."""
    return torch.tensor([row_seed(seed & _M32, r) for r in row_indices], dtype=torch.long, device=device)


def row_uniforms(seeds, steps, num_candidates):
    """Uniforms in (0, 1), shape (B, num_candidates), a pure function of (seed, step, candidate index).
    seeds, steps: (B,) int64."""
    base = mix32(mix32(seeds) ^ steps)  # (B,)
    cand = torch.arange(num_candidates, device=seeds.device, dtype=torch.long)
    # both below 2**32 (a vocabulary is far smaller than 2**32 - 0x632BE5AB), and so is their xor: mix32 exactly
    bits = _mix32_of_32_bits(base[:, None] ^ _mix32_of_32_bits(cand + 0x632BE5AB)[None, :])  # (B, C)
    return ((bits >> 8).float() + 0.5) / float(1 << 24)  # 24 bits: exact in float32, MPS has no float64


def sample_next_token(logits, seeds, steps, temperature=1.0, top_k=None):
    """Sample one token per row. logits: (B, V) float; seeds, steps: (B,) int64 -> (B,) int64.

    temperature 0 is argmax. Otherwise top-k (k > 0) then a draw from softmax(logits / T), done as
    Gumbel-max: argmax(logits/T + Gumbel noise) has exactly that distribution.
    """
    return sample_with_logprobs(logits, seeds, steps, temperature, top_k)[0]


def sample_with_logprobs(logits, seeds, steps, temperature=1.0, top_k=None):
    """sample_next_token's tokens (B,) with two log-probabilities of each, (B,) float32:
    - under the model's own distribution: log-softmax of the logits at temperature 1 over the whole vocabulary,
      the quantity the trainer computes for the same token (their difference is the sampler-trainer gap);
    - under the distribution actually sampled from: temperature and top-k applied (0 for greedy, which is
      deterministic), the denominator of an exact importance ratio."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits.float()
    log_normalizer = torch.logsumexp(logits, dim=-1)  # (B,): one pass, no (B, V) log-softmax written out
    if temperature == 0.0:
        tokens = torch.argmax(logits, dim=-1)
        return tokens, logits.gather(-1, tokens[:, None]).squeeze(-1) - log_normalizer, torch.zeros_like(log_normalizer)
    if top_k is not None and 0 < top_k < logits.size(-1):
        values, indices = torch.topk(logits, top_k, dim=-1)  # (B, k), sorted, so candidate order is stable
    else:
        values, indices = logits, None
    scaled = values if temperature == 1.0 else values / temperature  # x / 1 is x: no pass for it
    # Gumbel-max: argmax(scaled + g), g = -log(-log(u)), written as scaled - log(-log(u)) (the same sums exactly)
    noise = torch.log(-torch.log(row_uniforms(seeds, steps, values.size(-1))))
    choice = torch.argmax(scaled - noise, dim=-1, keepdim=True)  # (B, 1)
    tokens = (indices.gather(-1, choice) if indices is not None else choice).squeeze(-1)
    # the sampled token's logit: top-k's values are the logits' own, so no gather from the whole vocabulary
    chosen = values.gather(-1, choice).squeeze(-1)  # (B,)
    chosen_scaled = chosen if scaled is values else scaled.gather(-1, choice).squeeze(-1)
    return tokens, chosen - log_normalizer, chosen_scaled - torch.logsumexp(scaled, dim=-1)


def sample_with_generator(logits, rng, temperature=1.0, top_k=None):
    """nanochat's `sample_next_token(logits, rng, temperature, top_k)`: logits (B, V), rng a torch.Generator ->
    (B, 1) int64. The same distribution as sample_next_token (argmax at temperature 0, else softmax over the top k
    at temperature T), drawn through this module's per-row streams: each row's seed comes from `rng`, so a seeded
    generator gives reproducible tokens, though not the ones nanochat's torch.multinomial draws from that state.
    Greedy decoding leaves `rng` untouched, as nanochat's does."""
    B = logits.size(0)
    if temperature == 0.0:
        seeds = torch.zeros(B, dtype=torch.long, device=logits.device)  # argmax reads no randomness
    else:
        seeds = torch.randint(0, 1 << 32, (B,), generator=rng, device=rng.device).to(logits.device)
    steps = torch.zeros(B, dtype=torch.long, device=logits.device)  # a fresh seed per call: step 0 of its stream
    return sample_next_token(logits, seeds, steps, temperature, top_k)[:, None]
