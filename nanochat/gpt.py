"""
The GPT model, state-dict compatible with nanochat checkpoints.

- token embedding, RMSNorm (no learnable weight) right after it; untied lm_head; no biases
- per layer: x = resid_lambdas[i] * x + x0_lambdas[i] * x0 (x0 = the normed embedding), then
  x += attn(norm(x)); x += mlp(norm(x))
- attention: rotary embeddings (base 10000, split halves), then QK RMSNorm; grouped-query attention
  (n_kv_head <= n_head); sliding windows per layer from `window_pattern`
- MLP: 4x hidden, relu(x)^2
- logits: norm, lm_head, crop the padded vocab rows, float32, softcap 15 * tanh(x / 15)

Windows. A layer with window w lets a query at position p see key j iff j <= p and p - j <= w, i.e. w
tokens of left context plus itself. "L" layers use w = sequence_len, "S" layers w = sequence_len // 2;
the pattern is tiled over the layers and the last layer is always "L". Within a training sequence
(T <= sequence_len) an "L" layer is plain causal attention; in rollouts longer than sequence_len it
slides too, the same way in the cached and uncached paths.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from nanochat.common import UserError

VOCAB_PAD = 64          # wte and lm_head rows are padded up to a multiple of this (matmul-friendly shapes)
LOGIT_SOFTCAP = 15.0
ROTARY_BASE = 10000
ROTARY_OVERSIZE = 10    # rotary tables cover 10 * sequence_len positions, so rollouts may outgrow training length


@dataclass
class GPTConfig:
    sequence_len: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 6          # query heads
    n_kv_head: int = 6       # key/value heads (GQA: n_head must be a multiple)
    n_embd: int = 768
    window_pattern: str = "L"

    def __post_init__(self):
        for name in ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UserError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0 or (self.n_embd // self.n_head) % 2 != 0:
            raise UserError(f"n_embd={self.n_embd} must split into n_head={self.n_head} heads of even size "
                            f"(rotary rotates pairs of channels); pick n_embd a multiple of 2 * n_head")
        if self.n_kv_head > self.n_head or self.n_head % self.n_kv_head != 0:
            raise UserError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head} "
                            f"(each key/value head serves a group of query heads)")
        if not self.window_pattern or any(c not in "SLsl" for c in self.window_pattern):
            raise UserError(f"window_pattern={self.window_pattern!r} must be a non-empty string of S (short "
                            f"window) and L (long window) characters, e.g. 'L' or 'SSSL'")


def padded_vocab_size(vocab_size):
    return (vocab_size + VOCAB_PAD - 1) // VOCAB_PAD * VOCAB_PAD


def layer_windows(config):
    """Left context (tokens before the query it may see) of each layer."""
    long_window, short_window = config.sequence_len, config.sequence_len // 2
    pattern = config.window_pattern.upper()
    windows = [long_window if pattern[i % len(pattern)] == "L" else short_window for i in range(config.n_layer)]
    windows[-1] = long_window
    return windows


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def rotary_tables(num_positions, head_dim, device=None):
    """cos, sin: (num_positions, head_dim // 2) float32. The values are rounded to bfloat16 because
    nanochat keeps its tables in bf16: checkpoints were trained with exactly these angles."""
    inv_freq = 1.0 / (ROTARY_BASE ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(num_positions, dtype=torch.float32, device=device), inv_freq)
    return angles.cos().bfloat16().float(), angles.sin().bfloat16().float()


def apply_rotary(x, cos, sin):
    """x: (B, T, H, D); cos, sin: broadcastable to (B, T, 1, D/2). Rotates channel i with channel i + D/2."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # exact (bf16-rounded tables); computes in x's precision
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, rope, mask, cache):
        """x: (B, T, C); rope: (cos, sin); mask: None = causal, else bool (T, T) or (B, 1, T, Tk), True =
        visible; cache: None, or (kv_cache, rows (B, 1), positions (B, T), Tk) to write to and read from."""
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        # autocast runs rms_norm in fp32; attend in the projections' dtype (bf16 under autocast), so a bf16
        # KV cache is read as it is instead of being converted to fp32 at every layer of every step
        q, k = norm(apply_rotary(q, *rope)).to(v.dtype), norm(apply_rotary(k, *rope)).to(v.dtype)
        if cache is not None:
            kv_cache, rows, positions, Tk = cache
            k_store, v_store = kv_cache.k[self.layer_idx], kv_cache.v[self.layer_idx]  # (B, T_max, Hkv, D)
            k_store[rows, positions] = k.to(k_store.dtype)
            v_store[rows, positions] = v.to(v_store.dtype)
            k, v = k_store[:, :Tk].to(q.dtype), v_store[:, :Tk].to(q.dtype)  # (B, Tk, Hkv, D); no copy if same dtype
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=self.n_kv_head != self.n_head)  # (B, H, T, D)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x, rope, mask, cache):
        x = x + self.attn(norm(x), rope, mask, cache)
        return x + self.mlp(norm(x))


def _window_mask(query_pos, num_keys, window):
    """query_pos: (..., T) int64 -> bool (..., T, num_keys): key j visible iff 0 <= p - j <= window."""
    delta = query_pos[..., :, None] - torch.arange(num_keys, device=query_pos.device)
    return (delta >= 0) & (delta <= window)


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.window_sizes = layer_windows(config)
        vocab = padded_vocab_size(config.vocab_size)
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab, config.n_embd),
            "h": nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
        })
        self.lm_head = nn.Linear(config.n_embd, vocab, bias=False)
        self.resid_lambdas = nn.Parameter(torch.ones(config.n_layer))
        self.x0_lambdas = nn.Parameter(torch.zeros(config.n_layer))
        self.rotary_len = ROTARY_OVERSIZE * config.sequence_len
        # not in the state dict (recomputed by init_weights, e.g. after building on the meta device)
        cos, sin = rotary_tables(self.rotary_len, config.n_embd // config.n_head)
        self.register_buffer("cos", cos, persistent=False)  # (rotary_len, head_dim // 2)
        self.register_buffer("sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self):
        """Initialization for training from scratch; also (re)computes the rotary tables on the model's device."""
        torch.nn.init.normal_(self.transformer.wte.weight, mean=0.0, std=1.0)
        torch.nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        s = math.sqrt(3) / math.sqrt(self.config.n_embd)  # uniform with std 1/sqrt(n_embd)
        for block in self.transformer.h:
            for linear in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                torch.nn.init.uniform_(linear.weight, -s, s)
            torch.nn.init.zeros_(block.attn.c_proj.weight)
            torch.nn.init.zeros_(block.mlp.c_proj.weight)
        self.resid_lambdas.fill_(1.0)
        self.x0_lambdas.fill_(0.0)
        self.cos, self.sin = rotary_tables(self.rotary_len, self.config.n_embd // self.config.n_head, self.get_device())

    def get_device(self):
        return self.transformer.wte.weight.device

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def estimate_flops(self):
        """FLOPs per token of a forward + backward pass at sequence_len.

        Matmuls: 6 per weight (2 forward, 4 backward) for every weight except the embedding (a lookup)
        and the per-layer scalars; lm_head counts with its padded rows. Attention scores and the weighted
        sum of values: 12 * n_head * head_dim * keys per layer, with keys = min(window, sequence_len),
        ignoring that causality halves the average (the PaLM convention nanochat reports MFU with).
        """
        cfg = self.config
        excluded = self.transformer.wte.weight.numel() + self.resid_lambdas.numel() + self.x0_lambdas.numel()
        head_dim = cfg.n_embd // cfg.n_head
        attention = sum(12 * cfg.n_head * head_dim * min(w, cfg.sequence_len) for w in self.window_sizes)
        return 6 * (self.num_params() - excluded) + attention

    def setup_optimizers(self, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.0,
                         adam_betas=(0.8, 0.95), scalar_lr=0.5):
        """[AdamW for lm_head, wte and the per-layer scalars, Muon for the transformer matrices].
        With a process group, their distributed versions (which also average the gradients)."""
        from nanochat.adamw import DistAdamW
        from nanochat.muon import DistMuon, Muon

        matrix_params = list(self.transformer.h.parameters())
        # AdamW lrs were tuned at width 768; scale them like 1/sqrt(width)
        scale = (self.config.n_embd / 768) ** -0.5
        adam_groups = [
            dict(params=list(self.lm_head.parameters()), lr=unembedding_lr * scale),
            dict(params=list(self.transformer.wte.parameters()), lr=embedding_lr * scale),
            # resid_lambdas multiply the whole residual stream at every layer: far more sensitive
            dict(params=[self.resid_lambdas], lr=scalar_lr * 0.01),
            dict(params=[self.x0_lambdas], lr=scalar_lr),
        ]
        grouped = [id(p) for p in matrix_params] + [id(p) for g in adam_groups for p in g["params"]]
        if sorted(grouped) != sorted(id(p) for p in self.parameters()):
            raise RuntimeError("setup_optimizers: the optimizer groups do not cover every parameter exactly once")
        # weight decay applies to the Muon matrices only
        if dist.is_available() and dist.is_initialized():
            adamw = DistAdamW(adam_groups, betas=adam_betas, eps=1e-10, weight_decay=0.0)
            muon = DistMuon(matrix_params, lr=matrix_lr, momentum=0.95, weight_decay=weight_decay)
        else:
            adamw = torch.optim.AdamW(adam_groups, betas=adam_betas, eps=1e-10, weight_decay=0.0, fused=False)
            muon = Muon(matrix_params, lr=matrix_lr, momentum=0.95, weight_decay=weight_decay)
        optimizers = [adamw, muon]
        for opt in optimizers:
            for group in opt.param_groups:
                group["initial_lr"] = group["lr"]
        return optimizers

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean"):
        """idx: (B, T) int64. Returns float32 logits (B, T, vocab_size), or with targets (B, T) the
        cross-entropy (ignore_index=-1; reduction 'none' gives a flat (B*T,) tensor).

        With kv_cache (see nanochat.engine.KVCache), row b's tokens sit at positions pos[b] .. pos[b]+T-1;
        every layer writes its keys/values there and attends to the row's cached keys; the cache then
        advances by T."""
        logits = self.logits(self.hidden_states(idx, kv_cache))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1,
                               reduction=loss_reduction)

    def logits(self, hidden):
        """(..., n_embd) final hidden states -> float32 softcapped logits (..., vocab_size). Split from
        forward so a caller can take logits at some positions only: in RL most positions (prompt, tool
        outputs, padding) have no target, and the vocabulary-wide work dominates a small model's step."""
        logits = self.lm_head(hidden)[..., :self.config.vocab_size].float()
        return LOGIT_SOFTCAP * torch.tanh(logits / LOGIT_SOFTCAP)

    def hidden_states(self, idx, kv_cache=None):
        """idx: (B, T) int64 -> (B, T, n_embd): the normalized output of the last block (see forward)."""
        B, T = idx.shape
        if kv_cache is None:
            if T > self.rotary_len:
                raise ValueError(f"sequence of {T} tokens is longer than the rotary tables ({self.rotary_len} positions)")
            rope = (self.cos[None, :T, None, :], self.sin[None, :T, None, :])  # (1, T, 1, D/2)
            masks = self._sequence_masks(T, idx.device)
            cache = None
        else:
            if kv_cache.batch_size != B:
                raise ValueError(f"idx has {B} rows but the KV cache has {kv_cache.batch_size}")
            Tk = int(kv_cache.pos.max()) + T  # the forward's one host sync: keys 0..Tk-1 cover every row
            if Tk > kv_cache.max_seq_len or Tk > self.rotary_len:
                raise ValueError(f"KV cache overflow: {Tk} positions needed, the cache holds {kv_cache.max_seq_len} "
                                 f"and the rotary tables {self.rotary_len}")
            positions = kv_cache.pos[:, None] + torch.arange(T, device=idx.device)  # (B, T)
            rope = (self.cos[positions][:, :, None, :], self.sin[positions][:, :, None, :])  # (B, T, 1, D/2)
            if Tk == T:  # every row starts at 0 (a prefill): the uncached masks apply, causal kernels included
                masks = self._sequence_masks(T, idx.device)
            else:
                masks = {w: _window_mask(positions, Tk, w)[:, None] for w in set(self.window_sizes)}  # (B, 1, T, Tk)
            rows = torch.arange(B, device=idx.device)[:, None]  # (B, 1)
            cache = (kv_cache, rows, positions, Tk)

        x = norm(self.transformer.wte(idx))
        x0 = x
        for i, block in enumerate(self.transformer.h):
            x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            x = block(x, rope, masks[self.window_sizes[i]], cache)
        if kv_cache is not None:
            kv_cache.advance(T)
        return norm(x)

    def _sequence_masks(self, T, device):
        """Masks for positions 0..T-1 per window: None (plain causal, the fast kernel) when the window
        reaches back to position 0 from every query, else bool (T, T)."""
        return {w: None if w >= T - 1 else _window_mask(torch.arange(T, device=device), T, w)
                for w in set(self.window_sizes)}

    @torch.no_grad()
    def generate(self, tokens, max_tokens, temperature=1.0, top_k=None, seed=42):
        """Naive reference sampler: a full forward per token, no KV cache. tokens: list of ints; yields
        max_tokens token ids (it does not stop at any special token). Sampling is the engine's
        (nanochat.engine.sample_next_token, row 0's stream of `seed`), so Engine.generate with one sample
        must produce the same tokens as long as no tool output is forced."""
        from nanochat.engine import row_seed, sample_next_token

        device = self.get_device()
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)  # (1, T)
        seeds = torch.tensor([row_seed(seed & 0xFFFFFFFF, 0)], dtype=torch.long, device=device)
        for step in range(max_tokens):
            logits = self.forward(ids)[:, -1, :]  # (1, V)
            steps = torch.full((1,), step, dtype=torch.long, device=device)
            token = sample_next_token(logits, seeds, steps, temperature, top_k)  # (1,)
            ids = torch.cat([ids, token[:, None]], dim=1)
            yield int(token.item())


def scale_initial_lr(optimizers, init_lr_frac):
    """Start every param group at init_lr_frac of its lr and record that as the group's `initial_lr`, which
    the scripts' schedules multiply by lrm (nanochat's init_lr_frac). Returns the optimizers."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["lr"] * init_lr_frac
            group["initial_lr"] = group["lr"]
    return optimizers
