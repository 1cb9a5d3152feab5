"""
The shared-prompt decode step's attention in one kernel a layer (SharedPromptKVCache's layout as it is).

A row's single query attends to its prompt's keys (a prompt slot of the pool, shared by the prompt's rows) and to its
own completion's, under the layer's window: key j at absolute position a is seen from the query at position p iff
a <= p and p - a <= window. One program per (prompt slot, kv head, chunk of the slot's cells) holds the queries of
up to 16 of the slot's rows and all the query heads of that kv head (GQA) as one block of M = 16 rows (d20's 16
samples a prompt: all of them), so the prompt's keys and values are read once for all of them, in tiles (tl.dot);
then each row's own completion keys, gathered per row. Both key sets go
through one online softmax in fp32 (the running maximum and sum rescale what was accumulated), so the result is
attention over their concatenation, as the hand-written step computes it with one softmax.

Which row sits where: `cells` (slots, columns) holds the row in each (prompt slot, sample) cell, -1 where none (made
once a step, `cell_rows`). A static cache's free rows share one spare column that no program reads: their output is
zero (the last programs of the grid write it), and they are never read.

The hand-written step (nanochat/engine/shared_prompt_cache.py) is the reference; `reference_prompt_attention` below is
the same function written with torch ops on this op's arguments, for the tests.
"""

import math

import torch

from nanochat.kernels.launch import block_size, kernel, tl

FREE_ROWS_BLOCK = 16  # rows a program of the free-row part zeroes
# 8 warps a program: with 4, Triton's sm_90 code for the d20 step spills registers (tests/support/sm90_compile.py)
ATTENTION_WARPS = 8
OWN_TILE_ROWS_KEYS = 32  # a program's query rows x own keys a tile: its (rows, keys, D) fp32 tiles stay this size
# Whether Triton's interpreter computes a bf16 tl.dot as a GPU does: not triton 3.9's (it multiplies the bits as
# integers), so on a CPU the op hands the kernel fp32 copies; tests/support/launched_numerics.py fixes the
# interpreter's dot inside the tests and sets this, so that there the kernel's bf16 path runs as launched
INTERPRETER_BF16_DOT_FIXED = False


def own_keys_a_tile(query_rows):
    """Own keys gathered a tile for a program of `query_rows` (cells x group) rows: 2 for 16 rows (d20: 16 samples,
    MHA), fewer as the rows grow, so that the tile's registers do not spill on a GPU."""
    return max(1, OWN_TILE_ROWS_KEYS // query_rows)


@kernel
def _prompt_attention_kernel(q_ptr, out_ptr, pool_k_ptr, pool_v_ptr, pool_len_ptr, cells_ptr, own_k_ptr, own_v_ptr,
                             pos_ptr, sample_ptr, rows, used_columns, columns, keys, window, scale, slots, Hkv, chunks,
                             q_sb, q_sh, pk_ss, pk_sh, pk_sn, pv_ss, pv_sh, pv_sn, ok_sb, ok_sh, ok_sn, ov_sb, ov_sh,
                             ov_sn, out_sb, out_sh,
                             REP: tl.constexpr, D: tl.constexpr, BLOCK_CELLS: tl.constexpr, BLOCK_REP: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_OWN: tl.constexpr,
                             BLOCK_FREE: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    if pid >= slots * Hkv * chunks:  # the free-row part: zero the output of rows in the spare column
        r = (pid - slots * Hkv * chunks) * BLOCK_FREE + tl.arange(0, BLOCK_FREE)
        in_rows = r < rows
        free = (tl.load(sample_ptr + r, mask=in_rows, other=0) >= used_columns) & in_rows
        for h in range(0, Hkv * REP):
            tl.store(out_ptr + r[:, None] * out_sb + h * out_sh + d[None, :],
                     tl.zeros((BLOCK_FREE, BLOCK_D), dtype=out_ptr.dtype.element_ty), mask=free[:, None] & d_ok[None, :])
    else:  # a (prompt slot, kv head, chunk of BLOCK_CELLS cells): M = cells x rep query rows
        slot = pid // (Hkv * chunks)
        kvh = (pid // chunks) % Hkv
        m = tl.arange(0, BLOCK_CELLS * BLOCK_REP)
        cell = (pid % chunks) * BLOCK_CELLS + m // BLOCK_REP
        rep = m % BLOCK_REP
        row = tl.load(cells_ptr + slot * columns + cell, mask=cell < used_columns, other=-1)
        live = (row >= 0) & (rep < REP)
        row = tl.where(live, row, 0)
        head = kvh * REP + rep
        q = tl.load(q_ptr + row[:, None] * q_sb + head[:, None] * q_sh + d[None, :], mask=live[:, None] & d_ok[None, :],
                    other=0.0)
        prompt_len = tl.load(pool_len_ptr + slot)
        own_pos = tl.load(pos_ptr + row, mask=live, other=0)  # (M,) the newest completion key's index
        any_live = tl.max(live.to(tl.int32), axis=0) > 0
        top = tl.full((BLOCK_CELLS * BLOCK_REP,), float("-inf"), dtype=tl.float32)
        total = tl.zeros((BLOCK_CELLS * BLOCK_REP,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_CELLS * BLOCK_REP, BLOCK_D), dtype=tl.float32)
        top, total, acc = _attend_prompt(q, live, prompt_len + own_pos, tl.where(any_live, prompt_len, 0), prompt_len,
                                         window, scale, top, total, acc, pool_k_ptr + slot * pk_ss + kvh * pk_sh,
                                         pool_v_ptr + slot * pv_ss + kvh * pv_sh, pk_sn, pv_sn, d, d_ok, BLOCK_N, IEEE)
        top, total, acc = _attend_own(q, live, row, own_pos, tl.where(any_live, keys, 0), window, scale, top, total,
                                      acc, own_k_ptr + kvh * ok_sh, own_v_ptr + kvh * ov_sh, ok_sb, ok_sn, ov_sb, ov_sn,
                                      d, d_ok, BLOCK_OWN)
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + row[:, None] * out_sb + head[:, None] * out_sh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None] & d_ok[None, :])


@kernel
def _softmax_step(scores, top):
    """A tile of fp32 scores (M, N) into the online softmax whose running maximum is top (M,): (probabilities, the
    factor that rescales what was accumulated, the new maximum). A row that has seen nothing yet keeps -inf."""
    new_top = tl.maximum(top, tl.max(scores, axis=1))
    base = tl.where(new_top == float("-inf"), 0.0, new_top)  # exp(-inf - 0) = 0, not exp(nan)
    return tl.exp(scores - base[:, None]), tl.exp(top - base), new_top


@kernel
def _attend_prompt(q, live, query_pos, prompt_keys, prompt_len, window, scale, top, total, acc, k_ptr, v_ptr, k_sn,
                   v_sn, d, d_ok, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """The prompt's keys and values (k_ptr, v_ptr: the slot's kv head), each tile read once for every query row."""
    for start in range(0, prompt_keys, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < prompt_len
        k = tl.load(k_ptr + n[:, None] * k_sn + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        seen = live[:, None] & n_ok[None, :] & (query_pos[:, None] - n[None, :] <= window)
        p, rescale, top = _softmax_step(tl.where(seen, scores * scale, float("-inf")), top)
        v = tl.load(v_ptr + n[:, None] * v_sn + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            update = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            update = tl.dot(p.to(v.dtype), v)
        acc = acc * rescale[:, None] + update
        total = total * rescale + tl.sum(p, axis=1)
    return top, total, acc


@kernel
def _attend_own(q, live, row, own_pos, own_keys, window, scale, top, total, acc, k_ptr, v_ptr, k_sb, k_sn, v_sb, v_sn,
                d, d_ok, BLOCK_OWN: tl.constexpr):
    """Each query row's own completion keys 0..own_keys-1 (k_ptr, v_ptr: the kv head's), gathered per row (no two
    rows share them); the probabilities rounded to the values' dtype before the weighted sum, as tl.dot takes them."""
    qf = q.to(tl.float32)
    for start in range(0, own_keys, BLOCK_OWN):
        j = start + tl.arange(0, BLOCK_OWN)
        seen = live[:, None] & (j[None, :] <= own_pos[:, None]) & (own_pos[:, None] - j[None, :] <= window)
        where3 = seen[:, :, None] & d_ok[None, None, :]
        k = tl.load(k_ptr + row[:, None, None] * k_sb + j[None, :, None] * k_sn + d[None, None, :], mask=where3, other=0.0)
        scores = tl.sum(qf[:, None, :] * k.to(tl.float32), axis=2) * scale
        p, rescale, top = _softmax_step(tl.where(seen, scores, float("-inf")), top)
        v = tl.load(v_ptr + row[:, None, None] * v_sb + j[None, :, None] * v_sn + d[None, None, :], mask=where3, other=0.0)
        update = tl.sum(p.to(v.dtype).to(tl.float32)[:, :, None] * v.to(tl.float32), axis=1)
        acc = acc * rescale[:, None] + update
        total = total * rescale + tl.sum(p, axis=1)
    return top, total, acc


def cell_rows(prompt_slot, sample, slots, columns):
    """(slots, columns) int32: the row in each (prompt slot, sample) cell, -1 where none. Free rows all land in the
    spare column (sample == columns - 1 of a static cache); which of them wins it does not matter (never read)."""
    cells = torch.full((slots, columns), -1, dtype=torch.int32, device=prompt_slot.device)
    cells[prompt_slot, sample] = torch.arange(prompt_slot.size(0), dtype=torch.int32, device=prompt_slot.device)
    return cells


@torch.library.custom_op("nanochat::prompt_attention", mutates_args=())
def prompt_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, pool_len: torch.Tensor,
                     cells: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor, pos: torch.Tensor,
                     sample: torch.Tensor, used_columns: int, keys: int, window: int) -> torch.Tensor:
    """q: (B, H, D) the step's rows' queries; pool_k, pool_v: (slots, Hkv, Lp, D) one layer's prompt pool; pool_len:
    (slots,); cells: (slots, columns) from cell_rows; own_k, own_v: (B', Hkv, capacity, D) one layer's completion
    keys, rows 0..B-1 the step's; pos: (B,) each row's newest completion key (this step's, already written); sample:
    (B,) each row's column (>= used_columns: a free row, output zero); keys: completion keys a row may see (this
    step's included); window: the layer's. Returns (B, H, D) in q's dtype."""
    B, H, D = q.shape
    slots, Hkv = pool_k.shape[:2]
    if not q.dtype == pool_k.dtype == pool_v.dtype == own_k.dtype == own_v.dtype:
        raise ValueError(f"prompt_attention takes its queries, keys and values in one dtype, got {q.dtype} queries, "
                         f"{pool_k.dtype} prompt keys and {own_k.dtype} own keys")
    out = torch.empty_like(q)
    rep = H // Hkv
    if q.device.type != "cuda" and q.dtype != torch.float32 and not INTERPRETER_BF16_DOT_FIXED:
        # Triton's interpreter (triton 3.9) multiplies the raw bits of bf16 tiles in this kernel's tl.dot: it gets
        # fp32 copies, the same values (bf16 is exact in fp32), the probabilities then unrounded (within bf16's)
        q, pool_k, pool_v, own_k, own_v = (t.float() for t in (q, pool_k, pool_v, own_k, own_v))
    ieee = q.dtype == torch.float32  # fp32 stays fp32: tl.dot would round its operands to tf32 on a GPU
    block_d, block_rep = block_size(D), block_size(rep, floor=1)
    # 16 query rows a program (tl.dot's least; more spill registers on a GPU): a slot's cells in chunks of that many
    block_cells = max(1, 16 // block_rep)
    chunks = -(-used_columns // block_cells)
    grid = (slots * Hkv * chunks + -(-B // FREE_ROWS_BLOCK),)
    _prompt_attention_kernel.on(q.device)[grid](
        q, out, pool_k, pool_v, pool_len, cells, own_k, own_v, pos, sample, B, used_columns, cells.size(1), keys,
        min(window, 2 ** 31 - 1), 1.0 / math.sqrt(D), slots, Hkv, chunks,
        q.stride(0), q.stride(1), *pool_k.stride()[:3], *pool_v.stride()[:3], own_k.stride(0), own_k.stride(1),
        own_k.stride(2), own_v.stride(0), own_v.stride(1), own_v.stride(2), out.stride(0), out.stride(1),
        REP=rep, D=D, BLOCK_CELLS=block_cells, BLOCK_REP=block_rep, BLOCK_D=block_d, BLOCK_N=16,
        BLOCK_OWN=own_keys_a_tile(block_cells * block_rep),
        BLOCK_FREE=FREE_ROWS_BLOCK, IEEE=ieee, num_warps=ATTENTION_WARPS)
    return out


@prompt_attention.register_fake
def _(q, pool_k, pool_v, pool_len, cells, own_k, own_v, pos, sample, used_columns, keys, window):
    return torch.empty_like(q)


def reference_prompt_attention(q, pool_k, pool_v, pool_len, cells, own_k, own_v, pos, sample, used_columns, keys,
                               window):
    """prompt_attention written with torch ops, row by row (slow, plain): the tests' second reference beside the
    hand-written step."""
    B, H, D = q.shape
    Hkv = pool_k.size(1)
    out = torch.zeros_like(q)
    slot_of = {int(r): s for s in range(cells.size(0)) for c in range(used_columns) if (r := int(cells[s, c])) >= 0}
    for b, slot in slot_of.items():
        L, p = int(pool_len[slot]), int(pos[b])
        k = torch.cat([pool_k[slot, :, :L], own_k[b, :, :keys]], dim=1).float()  # (Hkv, L + keys, D)
        v = torch.cat([pool_v[slot, :, :L], own_v[b, :, :keys]], dim=1).float()
        absolute = torch.cat([torch.arange(L), L + torch.arange(keys)])
        own = torch.cat([torch.zeros(L, dtype=torch.bool), torch.ones(keys, dtype=torch.bool)])
        query = L + p
        seen = (absolute <= query) & (query - absolute <= window) & (~own | (absolute - L <= p))
        k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
        scores = (q[b].float()[:, None, :] @ k.transpose(1, 2))[:, 0] / math.sqrt(D)  # (H, keys)
        probs = scores.masked_fill(~seen.to(scores.device), float("-inf")).softmax(-1)
        out[b] = (probs[:, None, :] @ v)[:, 0].to(q.dtype)
    return out
