"""
The GPT model, state-dict compatible with the checkpoints of every nanochat generation (see
nanochat/model/generations.py for what each one computes; the switches below are named after its fields).

- token embedding, RMSNorm (no learnable weight) right after it; untied lm_head; no biases
- [smear] every position t >= 1 adds smear_lambda * sigmoid(smear_gate(e_t[:24])) * e_{t-1} (e = the
  normed embeddings before smearing)
- per layer: [lambdas] x = resid_lambdas[i] * x + x0_lambdas[i] * x0 (x0 = the normed, smeared embedding),
  then x += attn(norm(x)); x += mlp(norm(x))
- attention: rotary embeddings (split halves), then QK RMSNorm, then [qk_scale] q, k scaled; grouped-query
  attention (n_kv_head <= n_head); sliding windows per layer from `window_pattern`
- [value_embeds] on alternate layers (always the last), v += gate * value_embeds[i](idx), gate =
  ve_gate_scale * sigmoid(ve_gate(h[:ve_gate_channels])) per kv head, h = the block's normed input
- MLP: 4x hidden, relu(x)^2
- [backout] after the last block, x -= backout_lambda * (the residual right after block n_layer // 2)
- logits: norm, lm_head, crop the padded vocab rows, float32, softcap * tanh(x / softcap)

Windows. A layer with window w lets a query at position p see key j iff j <= p and p - j <= w, i.e. w
tokens of left context plus itself. "L" layers use w = sequence_len, "S" layers the generation's short
window; the pattern is tiled over the layers and the last layer is always "L". Within a training sequence
(T <= sequence_len) an "L" layer is plain causal attention; in rollouts longer than sequence_len it
slides too, the same way in the cached and uncached paths. Generations before sliding windows (oct2025,
dec2025) attend to every earlier token however long the sequence.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.errors import UserError
from nanochat.model.attention import SequenceAttention, SharedPrefixAttention
from nanochat.model.blocks import EAGER_REGIONS, Block, norm, smear
from nanochat.model.flops import train_flops_per_token
from nanochat.model.generations import (DEFAULT_GENERATION, SMEAR_GATE_CHANNELS, get_generation, has_value_embedding,
                                        model_config_fields)
from nanochat.model.head import sampled_logprobs_and_entropy, softcapped_logits
from nanochat.model.rotary import Rotary, check_fits_rotary, rotary_tables
from nanochat.model.sampling import row_seeds, sample_next_token
from nanochat.optim.optimizers import build_optimizers
from nanochat.optim.param_groups import recipe_param_groups

VOCAB_PAD = 64          # wte and lm_head rows are padded up to a multiple of this (matmul-friendly shapes)
ROTARY_OVERSIZE = 10    # rotary tables cover 10 * sequence_len positions, so rollouts may outgrow training length
UNLIMITED_WINDOW = 1 << 62  # generations without sliding windows: every earlier token is visible


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


def short_window(sequence_len, generation):
    """The "S" window: half of sequence_len up to the value-embedding era; from mar9 on a third, then a
    quarter, rounded up to a multiple of 128 (FlashAttention's tile): 2048 -> 768 (mar9), 512 (smear)."""
    divisor = generation.short_window_divisor
    if divisor == 2:
        return sequence_len // 2
    return _ceil_div(_ceil_div(sequence_len, divisor), 128) * 128


def _ceil_div(a, b):
    return -(-a // b)


def layer_windows(config, generation=DEFAULT_GENERATION):
    """Left context (tokens before the query it may see) of each layer."""
    generation = get_generation(generation)
    if generation.short_window_divisor == 0:
        return [UNLIMITED_WINDOW] * config.n_layer
    long_window, short = config.sequence_len, short_window(config.sequence_len, generation)
    pattern = config.window_pattern.upper()
    windows = [long_window if pattern[i % len(pattern)] == "L" else short for i in range(config.n_layer)]
    windows[-1] = long_window
    return windows


class GPT(nn.Module):
    block_regions = EAGER_REGIONS  # each block's regions around its attention: eager, or compile_block_regions's

    def __init__(self, config, generation=DEFAULT_GENERATION):
        """config: the GPTConfig of a nanochat meta; generation: a name in nanochat.model.generations.GENERATIONS
        (or a Generation), which decides which parameters exist and what the forward computes."""
        super().__init__()
        self.config = config
        self.generation = gen = get_generation(generation)
        self.window_sizes = layer_windows(config, gen)
        vocab = padded_vocab_size(config.vocab_size) if gen.pad_vocab else config.vocab_size
        # registration order follows nanochat's, so state_dict() and named_parameters() list keys as it does
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab, config.n_embd),
            "h": nn.ModuleList([Block(config, i, gen) for i in range(config.n_layer)]),
        })
        self.lm_head = nn.Linear(config.n_embd, vocab, bias=False)
        add_generation_parameters(self, config, gen, vocab)
        self.rotary_len = ROTARY_OVERSIZE * config.sequence_len
        # not in the state dict (recomputed by init_weights, e.g. after building on the meta device)
        cos, sin = self._rotary_tables()
        self.register_buffer("cos", cos, persistent=False)  # (rotary_len, head_dim // 2)
        self.register_buffer("sin", sin, persistent=False)

    def _rotary_tables(self, device=None):
        gen = self.generation
        return rotary_tables(self.rotary_len, self.config.n_embd // self.config.n_head, gen.rotary_base,
                             gen.bf16_rotary_tables, device)

    def meta_model_config(self):
        """The model_config to write into a checkpoint meta: exactly the fields this generation's nanochat
        has, because it builds GPTConfig(**model_config) and refuses any field it does not know."""
        return {name: getattr(self.config, name) for name in model_config_fields(self.generation)}

    @torch.no_grad()
    def init_weights(self):
        """Initialization for training from scratch (init_parameters); also (re)computes the rotary tables on the
        model's device."""
        init_parameters(self)
        self.cos, self.sin = self._rotary_tables(self.get_device())

    def get_device(self):
        return self.transformer.wte.weight.device

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def estimate_flops(self):
        """FLOPs per token of a forward + backward pass at sequence_len: 6 per matmul weight (not the embeddings,
        scalars, smear gate; lm_head's padded rows counted), and 12 * n_head * head_dim * min(window, sequence_len)
        a layer for attention, causality ignored (the PaLM convention nanochat reports MFU with). The arithmetic is
        nanochat/model/flops.py's, which counts other row lengths too."""
        return train_flops_per_token(self, self.config.sequence_len)

    def setup_optimizers(self, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.0,
                         adam_betas=(0.8, 0.95), scalar_lr=0.5, recipe="2026-01", ortho_dtype=None):
        """The optimizers of a nanochat recipe over this model's parameters (nanochat/optim/param_groups.py says which
        parameter gets which lr, betas and weight decay); with a process group, their distributed versions."""
        groups = recipe_param_groups(self, recipe, unembedding_lr, embedding_lr, matrix_lr, weight_decay=weight_decay,
                                     adam_betas=adam_betas, scalar_lr=scalar_lr)
        return build_optimizers(recipe, groups, ortho_dtype)

    def forward(self, idx, targets=None, cache_step=None, loss_reduction="mean"):
        """idx: (B, T) int64. Returns float32 logits (B, T, vocab_size), or with targets (B, T) the
        cross-entropy (ignore_index=-1; reduction 'none' gives a flat (B*T,) tensor).

        cache_step: None for a sequence at positions 0..T-1; else a KV cache's CacheStep (nanochat/model/attention.py)
        that places the tokens after what each cache row holds, at cache_step.positions. The model writes
        nothing else of the cache: the caller advances it (attention.run_cached)."""
        logits = self.logits(self.hidden_states(idx, cache_step))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1,
                               reduction=loss_reduction)

    def logits(self, hidden):
        """(..., n_embd) final hidden states -> float32 softcapped logits (..., vocab_size). Apart from forward: RL
        takes logits only where there is a target (most positions have none: prompt, tool outputs, padding)."""
        return softcapped_logits(hidden, self.lm_head.weight, self.config.vocab_size, self.generation.softcap)

    def sampled_logprobs(self, hidden, targets):
        """(each target's log-probability, their mean entropy) as from self.logits(hidden), chunked (model/head.py)."""
        return sampled_logprobs_and_entropy(hidden, self.lm_head.weight, targets, self.config.vocab_size,
                                            self.generation.softcap)

    def hidden_states(self, idx, cache_step=None):
        """idx: (B, T) int64 -> (B, T, n_embd): the normalized output of the last block (see forward)."""
        B, T = idx.shape
        if cache_step is None:
            check_fits_rotary(T, self.rotary_len)
            return self._trunk(idx, self._rope(torch.arange(T, device=idx.device)), SequenceAttention(T, idx.device))
        if cache_step.positions.size(0) != B:
            raise ValueError(f"idx has {B} rows but the KV cache step has {cache_step.positions.size(0)}")
        previous = None
        if self.generation.smear:
            previous = cache_step.smear_previous
            cache_step.keep_smear_state(self.smear_state(idx[:, -1:]))  # for the next step
        return self._trunk(idx, self._rope(cache_step.positions), cache_step, previous)

    def smear_state(self, tokens):
        """tokens (B, 1) -> (B, 1, n_embd): what a cached forward keeps of a row's last token for smear to mix into
        the next one (its normed embedding)."""
        return norm(self.transformer.wte(tokens))

    def hidden_states_shared_prefix(self, prefix, rows, prefix_lengths=None, row_prefix=None):
        """prefix (Q, P) prompts, rows (B, S) each row's tokens after its prompt (the one; or prefix_lengths (Q,) real
        tokens of each, right-padded, row_prefix (B,) each row's: SharedPrefixAttention) -> hidden states of the prompts
        (Q, P, C) and the rows (B, S, C): hidden_states' on each whole row, each prompt through the model once."""
        P, S = prefix.size(1), rows.size(1)
        check_fits_rotary(P + S, self.rotary_len)  # every row's last position is below P + S
        context = SharedPrefixAttention(P, S, prefix.device, prefix_lengths, row_prefix)
        prefix_hidden = self._trunk(prefix, self._rope(torch.arange(P, device=prefix.device)), context)
        context.recording = False
        previous = norm(self.transformer.wte(context.last_prompt_tokens(prefix))) if self.generation.smear else None
        return prefix_hidden, self._trunk(rows, self._rope(context.positions), context, previous)

    def _rope(self, positions):
        """positions (T,) or (B, T) -> the Rotary of those positions, broadcastable to (B, T, 1, D)."""
        if positions.dim() == 1:
            return Rotary(self.cos[None, positions, None, :], self.sin[None, positions, None, :])
        return Rotary(self.cos[positions][:, :, None, :], self.sin[positions][:, :, None, :])

    def _trunk(self, idx, rope, context, smear_previous=None):
        """Embedding, blocks and final norm for tokens idx (B, T) at the positions `rope` encodes.
        context: the attention context (nanochat/model/attention.py); smear_previous: None, or
        the normed embedding (B or 1, 1, C) of the token before idx[:, 0], which smear mixes into it."""
        x = norm(self.transformer.wte(idx))
        if self.generation.smear:
            x = smear(x, self.smear_gate, self.smear_lambda, smear_previous)
        x0 = x
        backout_layer = self.config.n_layer // 2 if self.generation.backout else None
        for i, block in enumerate(self.transformer.h):
            if self.generation.lambdas:
                x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](idx) if block.attn.ve_gate is not None else None
            x = block(x, ve, rope, self.window_sizes[i], context, regions=self.block_regions)
            if i == backout_layer:
                x_backout = x
        if backout_layer is not None:
            x = x - self.backout_lambda * x_backout
        return norm(x)

    def generate(self, tokens, max_tokens, temperature=1.0, top_k=None, seed=42):
        """nanochat's naive reference sampler (naive_generate): yields max_tokens token ids after `tokens`."""
        return naive_generate(self, tokens, max_tokens, temperature, top_k, seed=seed)


def add_generation_parameters(model, config, gen, vocab):
    """The parameters a nanochat generation adds to the transformer and head, registered after them as nanochat
    does (state_dict() lists keys in its order): the per-layer residual lambdas, smear's gate, backout's lambda, the
    value embeddings of the layers that have one."""
    if gen.lambdas:
        model.resid_lambdas = nn.Parameter(torch.ones(config.n_layer))
        model.x0_lambdas = nn.Parameter(torch.zeros(config.n_layer))
    if gen.smear:
        model.smear_gate = nn.Linear(SMEAR_GATE_CHANNELS, 1, bias=False)
        model.smear_lambda = nn.Parameter(torch.zeros(1))
    if gen.backout:
        model.backout_lambda = nn.Parameter(torch.full((1,), 0.2))
    if gen.value_embeds:
        kv_dim = config.n_kv_head * (config.n_embd // config.n_head)
        model.value_embeds = nn.ModuleDict({str(i): nn.Embedding(vocab, kv_dim) for i in range(config.n_layer)
                                            if has_value_embedding(gen, i, config.n_layer)})


@torch.no_grad()
def naive_generate(model, tokens, max_tokens, temperature=1.0, top_k=None, seed=42):
    """Naive reference sampler: a full forward per token, no KV cache. tokens: list of ints; yields max_tokens token
    ids (it does not stop at any special token). Sampling is the engine's (nanochat.model.sampling.sample_next_token,
    row 0's stream of `seed`), so Engine.generate with one sample must produce the same tokens as long as no tool
    output is forced."""
    device = model.get_device()
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)  # (1, T)
    seeds = row_seeds(seed, [0], device)  # (1,)
    for step in range(max_tokens):
        logits = model.forward(ids)[:, -1, :]  # (1, V)
        steps = torch.full((1,), step, dtype=torch.long, device=device)
        token = sample_next_token(logits, seeds, steps, temperature, top_k)  # (1,)
        ids = torch.cat([ids, token[:, None]], dim=1)
        yield int(token.item())


@torch.no_grad()
def init_parameters(model):
    """The generation's nanochat init of a GPT's parameters, as far as this project trains from scratch: wte
    N(0, 1), lm_head N(0, 0.001), the blocks' input matrices and the value embeddings U(-s, s) with std
    1/sqrt(n_embd), output projections and value-embedding gates zero, the scalars at their starting values."""
    gen = model.generation
    torch.nn.init.normal_(model.transformer.wte.weight, mean=0.0, std=1.0)
    torch.nn.init.normal_(model.lm_head.weight, mean=0.0, std=0.001)
    s = math.sqrt(3) / math.sqrt(model.config.n_embd)  # uniform with std 1/sqrt(n_embd)
    for block in model.transformer.h:
        for linear in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
            torch.nn.init.uniform_(linear.weight, -s, s)
        torch.nn.init.zeros_(block.attn.c_proj.weight)
        torch.nn.init.zeros_(block.mlp.c_proj.weight)
        if block.attn.ve_gate is not None:
            torch.nn.init.zeros_(block.attn.ve_gate.weight)  # gate starts at scale * 1/2
    if gen.lambdas:
        model.resid_lambdas.fill_(1.0)
        model.x0_lambdas.fill_(0.0)
    if gen.value_embeds:
        for embedding in model.value_embeds.values():
            torch.nn.init.uniform_(embedding.weight, -s, s)
    if gen.smear:
        torch.nn.init.uniform_(model.smear_gate.weight, 0.0, 0.02)
        model.smear_lambda.fill_(0.0)
    if gen.backout:
        model.backout_lambda.fill_(0.2)


HEAD_DIM = 64  # fresh models: n_embd = 64 * depth (nanochat's aspect ratio), so depth heads of 64


def build_fresh_model(depth, sequence_len, vocab_size, device, window_pattern="L"):
    """A randomly initialized GPT of nanochat's shape for `depth`: width HEAD_DIM * depth, heads of HEAD_DIM."""
    n_embd = depth * HEAD_DIM
    n_head = n_embd // HEAD_DIM
    config = GPTConfig(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=depth, n_head=n_head,
                       n_kv_head=n_head, n_embd=n_embd, window_pattern=window_pattern)
    with device:
        # allocated on the target device directly (a meta-device build costs a torch._dynamo import)
        model = GPT(config)
    model.init_weights()
    return model
