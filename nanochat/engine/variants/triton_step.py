"""
The static decode step with the project's Triton kernels (the decode step "triton" of nanochat/engine/decode_steps.py):
the same function as nanochat/engine/decode_batch.py's static_step (one token per row, sampled into the batch's
`sampled`), its forward written for one token a row over a SharedPromptKVCache so that each block is ten kernels:

    residual_norm   the previous block's MLP output added, the generation's lambdas, RMSNorm   (x0, lambdas)
    qkv matmul      (DecodeWeights' concatenation)
    rotary_store    rotary, q/k norm and scale, the value embedding and its gate, keys and values written
    prompt_attention (two: the rows' own keys in splits, then the prompts and the merge)
    c_proj matmul, residual_norm (the attention's output added, RMSNorm)
    c_fc matmul, relu_square, c_proj matmul

and after the blocks the final norm (with backout), the head, softcap, top-k and one sampling kernel. It computes
what GPT.hidden_states computes for a cached forward of one token (nanochat/model/gpt.py is the reference, every
generation's switches read from the model), rounding as its ops round up to the sums' order: the tests compare
rollouts token for token with the hand-written step's.
"""

import torch

from nanochat.kernels.prompt_attention import cell_rows, prompt_attention
from nanochat.kernels.residual_norm import relu_square, residual_norm
from nanochat.kernels.rotary_store import norm_result_fp32, rotary_store
from nanochat.kernels.sampling import sample_rows
from nanochat.model.blocks import smear
from nanochat.model.precision import autocast_enabled


BLOCK_RANGE = "nanochat block "  # the profiler range of each block: this, then its index


class KernelPromptStep:
    """One single-token decode step over the first rows of a SharedPromptKVCache for the Triton kernels: what every
    layer reads of the rows, made once a step (each row's absolute position, the prompt slots' cells). `cache` is the
    step's view of the rows, `whole` the cache it is a view of (the kernels write its storage, not a view)."""

    def __init__(self, cache, suffix_keys, whole):
        self.cache, self.whole, self.S = cache, whole, suffix_keys
        self.positions = cache.next_positions()[:, None]  # (B, 1)
        self.cells = cell_rows(cache.prompt_slot, cache.sample, cache.pool_k.size(1), cache.grid_columns)
        has_smear = cache.prev_embedding is not None
        self.smear_previous = cache.prev_embedding.clone() if has_smear else None

    def keep_smear_state(self, embedding):
        self.cache.prev_embedding.copy_(embedding)

    def advance(self):
        self.cache.pos.add_(self.cache.active)

    def attend_layer(self, layer, qkv, rotary, heads, qk_scale, value_embedding, window):
        """(B, heads, D) attention output of layer `layer` from its (B, heads + 2 Hkv, D) projections; rotary: the
        model's (cos, sin) tables; value_embedding: rotary_store's (ve_table, tokens, ve_gate, h, ve_scale)."""
        c, whole = self.cache, self.whole
        q = rotary_store(qkv, *rotary, self.positions[:, 0], whole.k, whole.v, layer, c.pos, heads, qk_scale,
                         *value_embedding, norm_result_fp32(qkv.dtype, qkv.device))
        return prompt_attention(q, c.pool_k[layer], c.pool_v[layer], c.pool_len, self.cells, own_k=whole.k[layer],
                                own_v=whole.v[layer], pos=c.pos, sample=c.sample, used_columns=c.rows_per_slot,
                                keys=self.S, window=window)


def compute_dtype(model, device):
    """The dtype the decode step's matmuls take their inputs in: autocast's where it is on, else the weights'."""
    if autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return model.transformer.h[0].mlp.c_fc.weight.dtype


def check_kernel_model(model):
    """A ValueError when the kernels' forward cannot compute `model` as GPT does: its token embedding must be fp32
    (the residual stream the kernels keep in fp32 is then the model's)."""
    if model.transformer.wte.weight.dtype != torch.float32:
        raise ValueError(f"the Triton kernels need the token embedding in float32, and this model's is "
                         f"{model.transformer.wte.weight.dtype}")


def add_and_norm(x, delta, norm_dtype, a=None, a_index=0, y=None, b=None, b_index=0, sign=1.0, keep_sum=False):
    """The residual_norm kernel (nanochat/kernels/residual_norm.py: its arguments by name) with what a call leaves
    out off: no lambdas (a, y, b), sign 1, no sum kept. Returns (x_new, normed, summed)."""
    return residual_norm(x, delta=delta, a=a, a_index=a_index, y=y, b=b, b_index=b_index, sign=sign,
                         keep_sum=keep_sum, norm_dtype=norm_dtype)


def kernel_hidden_states(model, idx, step):
    """idx (B,) one token a row -> (B, n_embd) the normed output of the last block, as GPT.hidden_states(idx[:, None],
    step)[:, 0] (the module docstring)."""
    gen, blocks = model.generation, model.transformer.h
    dtype = compute_dtype(model, idx.device)
    embedding = model.transformer.wte(idx)  # (B, C) fp32
    _, x, _ = add_and_norm(embedding, None, torch.float32)
    if gen.smear:
        previous = step.smear_previous
        step.keep_smear_state(x[:, None])  # the token's normed embedding (GPT.smear_state), made once here
        x = smear(x[:, None], model.smear_gate, model.smear_lambda, previous)[:, 0]
    x0, delta, kept = x, None, None
    backout_layer = model.config.n_layer // 2 if gen.backout else None
    for i, block in enumerate(blocks):
        # a named range: a profiler's trace, and the meta op count (nanochat/diagnostics/op_count.py), see the
        # blocks in it; block i is from the residual add of block i - 1's MLP output to its own MLP's output
        with torch.profiler.record_function(f"{BLOCK_RANGE}{i}"):
            keep = backout_layer == i - 1
            lambdas = dict(a=model.resid_lambdas, a_index=i, y=x0, b=model.x0_lambdas, b_index=i) if gen.lambdas else {}
            x, h, summed = add_and_norm(x, delta, dtype, keep_sum=keep, **lambdas)
            kept = summed if keep else kept
            y = _attention(model, i, h, idx, step)
            x, h, _ = add_and_norm(x, block.attn.c_proj(y), dtype)
            delta = block.mlp.c_proj(relu_square(block.mlp.c_fc(h)))
    if backout_layer == len(blocks) - 1:  # the kept residual is the last block's own output
        kept = x + delta
        x, delta = kept, None
    backout = dict(y=kept, b=model.backout_lambda, b_index=0, sign=-1.0) if backout_layer is not None else {}
    _, normed, _ = add_and_norm(x, delta, torch.float32, **backout)
    return normed


def _attention(model, i, h, idx, step):
    """Layer i's attention output (B, C) from its normed input h (B, C), in the matmuls' dtype."""
    attn = model.transformer.h[i].attn
    B = h.size(0)
    H, Hkv, D = attn.n_head, attn.n_kv_head, attn.head_dim
    qkv = attn.qkv_weight
    if qkv is not None:
        qkv = torch.nn.functional.linear(h, qkv)
    else:
        qkv = torch.cat([attn.c_q(h), attn.c_k(h), attn.c_v(h)], dim=-1)
    value_embedding = (model.value_embeds[str(i)].weight, idx, attn.ve_gate.weight, h, attn.ve_gate_scale) \
        if attn.ve_gate is not None else (None, idx, None, h, 0.0)
    y = step.attend_layer(i, qkv.view(B, H + 2 * Hkv, D), (model.cos, model.sin), H, attn.qk_scale,
                          value_embedding=value_embedding, window=model.window_sizes[i])
    return y.view(B, H * D)


def kernel_static_step(batch, rows, keys):
    """static_step (nanochat/engine/decode_batch.py) with the kernels: the same inputs, the same writes for the rows
    in use (the cache, `sampled`, the streams' draws). A static cache's free rows get a zero attention output, so
    their own position-0 keys and their `sampled` differ from static_step's: nothing reads them (admission resets
    them first). Its two halves: kernel_step_logits, then sample_step_logits."""
    _, step, logits = kernel_step_logits(batch.model, batch, rows, keys)
    sample_step_logits(batch, step, logits)


def kernel_step_logits(model, batch, rows, keys):
    """The first half of kernel_static_step: the rows' inputs (rows,), the step's KernelPromptStep and the logits
    (rows, V) fp32 of `model` (a GPT: the batch's, whose weights the kernels run) for them."""
    known, token = batch.host_inputs[:, :rows]
    inputs = torch.where(known.bool(), token, batch.sampled[:rows, 0].long())  # (rows,)
    step = batch.cache.decode_step(rows, keys)
    return inputs, step, model.logits(kernel_hidden_states(model, inputs, step))


def sample_step_logits(batch, step, logits):
    """The second half of kernel_static_step: a token a row sampled from `logits` (rows, V) into the batch's
    `sampled`, and the step's rows advanced."""
    top_k = batch.top_k
    top = (None, None)
    if batch.temperature != 0.0 and top_k is not None and 0 < top_k < logits.size(-1):
        top = torch.topk(logits, top_k, dim=-1)
    sample_rows(logits, *top, batch.seeds, batch.draws, batch.cache.active, batch.sampled, batch.temperature)
    step.advance()
