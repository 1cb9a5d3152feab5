"""
The shared-prompt decode step's attention through PyTorch's FlexAttention, a variant of the hand-written one
(nanochat/engine/shared_prompt_cache.py's SharedPromptStep) that a benchmark can put beside it (bench_rl's *_flex
configs; the decode step "flex" of nanochat/engine/decode_steps.py). Issue 57 asks which of the two a GPU runs faster;
only a GPU can say (on a CPU FlexAttention is PyTorch's unfused reference eagerly, and Inductor does not compile it
with the log-sum-exp this variant needs: docs/performance_history.md).

A row's query attends to its prompt's keys (in a prompt slot of the pool, shared by the prompt's rows) and to its
own completion's. FlexAttention takes one key tensor per call, so the two parts are two calls, each returning its
log-sum-exp, merged as one softmax over both key sets would have weighed them:
- the prompt part: the queries laid out by prompt slot, (slots, H, G, D) with row b at [prompt_slot[b], :,
  sample[b]], against the pool's (slots, Hkv, Lp, D) keys as they lie (no copy per row): one query "sequence" of G
  samples per slot;
- the own part: each row's one query against its (R, Hkv, S, D) completion keys, over every row of the cache (R),
  not only the step's: see FLEX_DYNAMIC.
Visibility is a score modification reading small tensors made once per step and window: a prompt key j is seen by
the query at grid cell (slot, g) iff j < pool_len[slot] and j >= lowest[slot, g] (its position minus the window); a
completion key j by row r iff lowest_own[r] <= j <= pos[r].
"""

import torch
from torch.nn.attention.flex_attention import flex_attention

try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # torch before 2.9
    AuxRequest = None

from nanochat.compiling.functions import compiled_so_far, maybe_compiled
from nanochat.model.precision import without_autocast

# Compiled with automatic dynamic shapes (torch.compile's dynamic=None), not dynamic=True: the first graph has every
# size static, the next makes dynamic only the sizes that changed (the step's rows, its keys, the layer's offset in
# the cache). Inductor lowers FlexAttention to its decoding kernel (short queries: the KV split across blocks) only
# where the query's batch and head sizes are static (torch/_inductor/kernel/flex/flex_decoding.py), else to its main
# kernel, whose 64 or 128 query rows a block would hold one real query of the own part. So the prompt part (batch:
# the pool's slots) stays static as it is, and the own part runs over every row of the cache, a static batch, the
# rows not in the step among them (free rows: their results are dropped).
FLEX_DYNAMIC = None


def flex_prompt_attention(q, pool_k, pool_v, pool_len, prompt_slot, sample, lowest, suffix_k, suffix_v, pos, lowest_own):
    """q: (B, H, D) the step's rows' queries (the cache's first B rows); pool_k, pool_v: (slots, Hkv, Lp, D);
    pool_len: (slots,); prompt_slot, sample: (B,) where each row's query goes in the prompt part's layout; lowest:
    (slots, G) the lowest prompt key each grid cell sees (its position minus the window; a cell no row occupies
    computes nothing used); suffix_k, suffix_v: (R, Hkv, S, D), every row of the cache (R >= B); pos: (R,) each row's
    newest completion key; lowest_own: (R,) its lowest visible one.
    Returns (B, H, D) in q's dtype: softmax over the visible prompt and completion keys together, times their values."""
    slots, G = lowest.shape
    B, H, D = q.shape
    grid = q.new_zeros(slots, H, G, D)
    grid[prompt_slot, :, sample] = q
    own_q = q.new_zeros(suffix_k.size(0), H, 1, D)  # every row of the cache: a static batch (FLEX_DYNAMIC)
    own_q[:B, :, 0] = q

    def prompt_visible(score, b, h, q_idx, kv_idx):
        return torch.where((kv_idx < pool_len[b]) & (kv_idx >= lowest[b, q_idx]), score, float("-inf"))

    def own_visible(score, b, h, q_idx, kv_idx):
        return torch.where((kv_idx <= pos[b]) & (kv_idx >= lowest_own[b]), score, float("-inf"))

    gqa = not (pool_k.shape[1] == H)  # `not ==`: a Python bool under dynamic shapes (attention.attend says why)
    with without_autocast(q.device.type):  # the inputs are in the step's dtype already; FlexAttention keeps fp32 scores
        prompt_out, prompt_lse = attention_and_lse(grid, pool_k, pool_v, prompt_visible, gqa)  # (slots, H, G, D), (.., G)
        own_out, own_lse = attention_and_lse(own_q, suffix_k, suffix_v, own_visible, gqa)  # (R, H, 1, D), (R, H, 1)
    prompt_out, prompt_lse = prompt_out[prompt_slot, :, sample].float(), prompt_lse[prompt_slot, :, sample]  # (B, H, ..)
    own_out, own_lse = own_out[:B, :, 0].float(), own_lse[:B, :, 0]  # (B, H, D), (B, H)
    # each part's weight in the joint softmax: exp(its log-sum-exp) over both (a part that sees no key: -inf, weight
    # 0; a row always sees its own newest key, so the maximum is finite)
    top = torch.maximum(prompt_lse, own_lse)
    w_prompt, w_own = (prompt_lse - top).exp()[..., None], (own_lse - top).exp()[..., None]
    return ((prompt_out * w_prompt + own_out * w_own) / (w_prompt + w_own)).to(q.dtype)


def attention_and_lse(q, k, v, score_mod, gqa):
    """FlexAttention's output and its log-sum-exp (natural log) over the keys, in the way this torch asks for it:
    return_aux from torch 2.9 (where return_lse is deprecated), return_lse before."""
    if AuxRequest is None:
        return flex_attention(q, k, v, score_mod=score_mod, enable_gqa=gqa, return_lse=True)
    out, aux = flex_attention(q, k, v, score_mod=score_mod, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    return out, aux.lse


def run_flex_prompt_attention(*args):
    """flex_prompt_attention(*args) as a decode step runs it: compiled on CUDA (eagerly FlexAttention is an unfused
    reference), with automatic dynamic shapes (FLEX_DYNAMIC); eagerly elsewhere (a CPU's Inductor does not compile it
    with the log-sum-exp); inside a compiled step, the plain function, which the step's graph takes in (with the
    step's dynamic shapes: there both parts run FlexAttention's main kernel)."""
    if torch.compiler.is_compiling():
        return flex_prompt_attention(*args)
    return maybe_compiled(flex_prompt_attention, args[0].is_cuda, dynamic=FLEX_DYNAMIC)(*args)


def flex_compile_state():
    """What compiling flex_prompt_attention did in this process, for a benchmark's report: {"compiles", "seconds",
    "failed" (why it runs eagerly, None while compiled)}; None if it was never compiled here (not on CUDA)."""
    compiled = compiled_so_far(flex_prompt_attention, FLEX_DYNAMIC)
    return compiled and {"compiles": compiled.compiles, "seconds": compiled.seconds, "failed": compiled.failed}
