"""
The shared-prompt decode step's attention in two kernels a layer (SharedPromptKVCache's layout as it is).

A row's single query attends to its prompt's keys (a prompt slot of the pool, shared by the prompt's rows) and to its
own completion's, under the layer's window: key j at absolute position a is seen from the query at position p iff
a <= p and p - a <= window. Both key sets go through one softmax: the result is attention over their concatenation,
as the hand-written step computes it. The work is split as split-K ("flash-decoding") attention splits it:

    own_key_attention   one program per (row, kv head, split of `split_keys` own keys): each row's own completion
                        keys are its alone (no row shares them), so they are read by many small programs at once;
                        each keeps an online softmax over its keys and writes its part: (maximum, sum, weighted sum)
    prompt_attention    one program per (prompt slot, kv head, chunk of the slot's cells) holds the queries of up to
                        16 of the slot's rows and all the query heads of that kv head (GQA) as one block of M = 16
                        rows (d20's 16 samples a prompt: all of them), so the prompt's keys and values are read once
                        for all of them, in tiles (tl.dot); then it merges the rows' own-key parts into its online
                        softmax (each part rescaled to the running maximum) and writes the rows' output

Why split (nanochat/diagnostics/gpu_model.py, docs/performance.md "A model of the GPU decode step"): in one kernel each
program walked its rows' own keys 2 at a time, a dependent load and exp a pass (128 passes at 256 keys), at one
program an SM (253 registers x 256 threads) and 160 programs on 132 SMs (two waves): latency-bound at a fraction of
the card's bandwidth. Split, the own keys are read by thousands of small programs, at the bandwidth.

Which row sits where: `cells` (slots, columns) holds the row in each (prompt slot, sample) cell, -1 where none (made
once a step, `cell_rows`). A static cache's free rows share one spare column that no program reads: their output is
zero (the last programs of the prompt kernel's grid write it), and they are never read; their own-key parts are
empty (no key read).

Offsets that a product with a stride can take past 2^31 at sizes a user may set (a row's completion storage:
rows x Hkv x capacity x D; a prompt slot's; the parts: splits x rows x heads x D) are taken in int64.

The hand-written step (nanochat/engine/shared_prompt_cache.py) is the reference; the tests' second one is the same
function written with torch ops on this op's arguments (tests/support/oracles.py: reference_prompt_attention).
"""

import math

import torch

from nanochat.kernels.launch import block_size, kernel, recording, tl

FREE_ROWS_BLOCK = 16  # rows a program of the free-row part zeroes
# Whether Triton's interpreter computes a bf16 tl.dot as a GPU does: not triton 3.9's (it multiplies the bits as
# integers), so on a CPU the op hands the kernel fp32 copies; tests/support/launched_numerics.py fixes the
# interpreter's dot inside the tests and sets this, so that there the kernel's bf16 path runs as launched
INTERPRETER_BF16_DOT_FIXED = False
OWN_WARPS = 4  # a program of the own-key kernel: one row's (rep, keys, D) tile, small; many programs an SM
OWN_TILE_HEADS_KEYS = 32  # query heads x own keys a tile of the own-key kernel: its (heads, keys, D) fp32 tiles
# own keys a program of the own-key kernel takes (its split): 2 programs a (row, kv head) at 256 keys, 4 tiles of 32
# each. d20's 256 rows x 10 kv heads x 2 splits are 10 waves of 4 programs an SM: the keys' bytes bound the kernel,
# not its passes, and the parts it writes (fp32, D + 2 a head) and the merge reads stay ~1% of them (gpu_model's
# table; 64 keys a split made twice the parts and merge passes for no gain there)
OWN_SPLIT_KEYS = 128


def attention_warps(query_rows, grouped_fp32=False):
    """Warps a program of the prompt kernel with `query_rows` rows (cells x group): 4 for 16 rows (d20's), ~136
    registers a thread on sm_90, 3 programs an SM: d20's 176 programs in one wave (with 8, Triton 3.6.0's ~150 left
    one program an SM, two waves: nanochat/diagnostics/gpu_model.py); 8 for 32 rows (a GQA group of 32), and for a
    GQA group's fp32 tiles (grouped_fp32), which spill registers with 4 (the binaries of the engine's recorded
    calls, nanochat/diagnostics/kernel_binary.py: a group of 2 in fp32 spilled 52 bytes)."""
    return 8 if query_rows > 16 or grouped_fp32 else 4


def own_keys_a_tile(group):
    """Own keys a tile of the own-key kernel for a GQA group of `group` query heads (its block: a power of two): 32
    for d20's MHA, fewer as the group grows, so that the tile's registers do not spill on a GPU."""
    return max(1, OWN_TILE_HEADS_KEYS // group)


def cells_a_program(group_block):
    """Cells (rows of a slot) a program of the prompt kernel holds, for a GQA group block of `group_block` heads:
    16 query rows a program (tl.dot's least; more spill registers on a GPU), at least one cell."""
    return max(1, 16 // group_block)


def own_splits(keys, split_keys):
    """Programs a (row, kv head) of the own-key kernel: `keys` own keys in splits of `split_keys`."""
    return max(1, -(-keys // split_keys))


@kernel
def _prompt_attention_kernel(q_ptr, out_ptr, pool_k_ptr, pool_v_ptr, pool_len_ptr, cells_ptr, part_top_ptr,
                             part_total_ptr, part_acc_ptr, pos_ptr, sample_ptr, rows, used_columns, columns, splits,
                             window, scale, slots, Hkv, chunks, q_sb, q_sh, pk_ss, pk_sh, pk_sn, pv_ss, pv_sh, pv_sn,
                             out_sb, out_sh,
                             REP: tl.constexpr, D: tl.constexpr, BLOCK_CELLS: tl.constexpr, BLOCK_REP: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_FREE: tl.constexpr,
                             IEEE: tl.constexpr):
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    if pid >= slots * Hkv * chunks:  # the free-row part: zero the output of rows in the spare column
        r = (pid - slots * Hkv * chunks) * BLOCK_FREE + tl.arange(0, BLOCK_FREE)
        in_rows = r < rows
        free = (tl.load(sample_ptr + r, mask=in_rows, other=0) >= used_columns) & in_rows
        for h in range(0, Hkv * REP):
            tl.store(out_ptr + r.to(tl.int64)[:, None] * out_sb + h * out_sh + d[None, :],
                     tl.zeros((BLOCK_FREE, BLOCK_D), dtype=out_ptr.dtype.element_ty),
                     mask=free[:, None] & d_ok[None, :])
    else:  # a (prompt slot, kv head, chunk of BLOCK_CELLS cells): M = cells x rep query rows
        slot = pid // (Hkv * chunks)
        kvh = (pid // chunks) % Hkv
        m = tl.arange(0, BLOCK_CELLS * BLOCK_REP)
        cell = (pid % chunks) * BLOCK_CELLS + m // BLOCK_REP
        rep = m % BLOCK_REP
        row = tl.load(cells_ptr + slot * columns + cell, mask=cell < used_columns, other=-1)
        live = (row >= 0) & (rep < REP)
        row = tl.where(live, row, 0).to(tl.int64)
        head = kvh * REP + rep
        q = tl.load(q_ptr + row[:, None] * q_sb + head[:, None] * q_sh + d[None, :], mask=live[:, None] & d_ok[None, :],
                    other=0.0)
        prompt_len = tl.load(pool_len_ptr + slot)
        own_pos = tl.load(pos_ptr + row, mask=live, other=0)  # (M,) the newest completion key's index
        any_live = tl.max(live.to(tl.int32), axis=0) > 0
        top = tl.full((BLOCK_CELLS * BLOCK_REP,), float("-inf"), dtype=tl.float32)
        total = tl.zeros((BLOCK_CELLS * BLOCK_REP,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_CELLS * BLOCK_REP, BLOCK_D), dtype=tl.float32)
        slot64 = slot.to(tl.int64)
        k_slot, v_slot = pool_k_ptr + slot64 * pk_ss + kvh * pk_sh, pool_v_ptr + slot64 * pv_ss + kvh * pv_sh
        top, total, acc = _attend_prompt(q, live, prompt_len + own_pos, tl.where(any_live, prompt_len, 0), prompt_len,
                                         window, scale, top, total, acc, k_slot, v_slot, pk_sn, pv_sn, d, d_ok, BLOCK_N,
                                         IEEE)
        top, total, acc = _merge_own_parts(live, (row * Hkv * REP + head), rows * Hkv * REP,
                                           tl.where(any_live, splits, 0), top, total, acc, part_top_ptr,
                                           part_total_ptr, part_acc_ptr, d, d_ok, D)
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + row[:, None] * out_sb + head[:, None] * out_sh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None] & d_ok[None, :])


@kernel
def _own_keys_kernel(q_ptr, own_k_ptr, own_v_ptr, pos_ptr, sample_ptr, part_top_ptr, part_total_ptr, part_acc_ptr,
                     rows, used_columns, keys, split_keys, window, scale, Hkv, splits, q_sb, q_sh, ok_sb, ok_sh, ok_sn,
                     ov_sb, ov_sh, ov_sn,
                     REP: tl.constexpr, D: tl.constexpr, BLOCK_REP: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_OWN: tl.constexpr):
    pid = tl.program_id(0)  # a (row, kv head, split): keys [split * split_keys, +split_keys) of the row's own ones
    split = pid % splits
    kvh = (pid // splits) % Hkv
    row = (pid // (splits * Hkv)).to(tl.int64)
    rep = tl.arange(0, BLOCK_REP)
    rep_ok = rep < REP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    head = kvh * REP + rep  # (BLOCK_REP,)
    live = tl.load(sample_ptr + row) < used_columns  # a free row (the spare column) reads no key
    own_pos = tl.load(pos_ptr + row)  # the newest completion key's index
    q = tl.load(q_ptr + row * q_sb + head[:, None] * q_sh + d[None, :], mask=rep_ok[:, None] & d_ok[None, :],
                other=0.0)
    first = split * split_keys
    end = tl.where(live, tl.minimum(first + split_keys, keys), first)
    top = tl.full((BLOCK_REP,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_REP,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_REP, BLOCK_D), dtype=tl.float32)
    top, total, acc = _attend_own(q, rep_ok, own_pos, first, end, window, scale, top, total, acc,
                                  own_k_ptr + row * ok_sb + kvh.to(tl.int64) * ok_sh,
                                  own_v_ptr + row * ov_sb + kvh.to(tl.int64) * ov_sh, ok_sn, ov_sn, d, d_ok, BLOCK_OWN)
    part = (split.to(tl.int64) * rows + row) * Hkv * REP + head  # (BLOCK_REP,) [split, row, head]
    tl.store(part_top_ptr + part, top, mask=rep_ok)
    tl.store(part_total_ptr + part, total, mask=rep_ok)
    tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=rep_ok[:, None] & d_ok[None, :])


@kernel
def _softmax_step(scores, top):
    """A tile of fp32 scores (M, N) into the online softmax whose running maximum is top (M,): (probabilities, the
    factor that rescales what was accumulated, the new maximum). A row that has seen nothing yet keeps -inf."""
    new_top = tl.maximum(top, tl.max(scores, axis=1))
    base = tl.where(new_top == float("-inf"), 0.0, new_top)  # exp(-inf - 0) = 0, not exp(nan)
    return tl.exp(scores - base[:, None]), tl.exp(top - base), new_top


@kernel
def _merge_own_parts(live, index, stride, splits, top, total, acc, part_top_ptr, part_total_ptr, part_acc_ptr, d, d_ok,
                     D: tl.constexpr):
    """The own-key kernel's parts of each query row (index (M,) int64: its [row, head] among `stride` = rows x heads)
    merged into the online softmax (top, total, acc): each part's sum and weighted sum rescaled to the new maximum, as
    a tile of scores is; a part that saw no key (-inf) adds nothing."""
    for split in range(0, splits):
        part = split * stride + index
        part_top = tl.load(part_top_ptr + part, mask=live, other=float("-inf"))
        part_total = tl.load(part_total_ptr + part, mask=live, other=0.0)
        part_acc = tl.load(part_acc_ptr + part[:, None] * D + d[None, :], mask=live[:, None] & d_ok[None, :],
                           other=0.0)
        new_top = tl.maximum(top, part_top)
        base = tl.where(new_top == float("-inf"), 0.0, new_top)
        rescale, part_scale = tl.exp(top - base), tl.exp(part_top - base)
        acc = acc * rescale[:, None] + part_acc * part_scale[:, None]
        total = total * rescale + part_total * part_scale
        top = new_top
    return top, total, acc


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
def _attend_own(q, rep_ok, own_pos, first, end, window, scale, top, total, acc, k_ptr, v_ptr, k_sn, v_sn, d, d_ok,
                BLOCK_OWN: tl.constexpr):
    """One row's own completion keys first..end-1 (k_ptr, v_ptr: its kv head's) for its query heads q (BLOCK_REP, D),
    BLOCK_OWN keys a tile; the probabilities rounded to the values' dtype before the weighted sum, as tl.dot takes
    them."""
    qf = q.to(tl.float32)
    for start in range(first, end, BLOCK_OWN):
        j = start + tl.arange(0, BLOCK_OWN)
        seen = (j < end) & (j <= own_pos) & (own_pos - j <= window)  # (BLOCK_OWN,)
        where = seen[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + j[:, None] * k_sn + d[None, :], mask=where, other=0.0)  # (BLOCK_OWN, BLOCK_D)
        scores = tl.sum(qf[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale  # (BLOCK_REP, BLOCK_OWN)
        p, rescale, top = _softmax_step(tl.where(rep_ok[:, None] & seen[None, :], scores, float("-inf")), top)
        v = tl.load(v_ptr + j[:, None] * v_sn + d[None, :], mask=where, other=0.0)
        update = tl.sum(p.to(v.dtype).to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * rescale[:, None] + update
        total = total * rescale + tl.sum(p, axis=1)
    return top, total, acc


def cell_rows(prompt_slot, sample, slots, columns):
    """(slots, columns) int32: the row in each (prompt slot, sample) cell, -1 where none. Free rows all land in the
    spare column (sample == columns - 1 of a static cache); which of them wins it does not matter (never read)."""
    cells = torch.full((slots, columns), -1, dtype=torch.int32, device=prompt_slot.device)
    cells[prompt_slot, sample] = torch.arange(prompt_slot.size(0), dtype=torch.int32, device=prompt_slot.device)
    return cells


def own_key_attention(q, own_k, own_v, pos, sample, used_columns, keys, window, split_keys):
    """Each row's attention parts over its own completion keys 0..keys-1 (this step's included), `split_keys` keys a
    part (the module docstring): (top, total, acc), each (splits, B, H[, D]) fp32: the part's maximum score, its sum
    of exp(score - maximum), and the values weighted by those. A free row's parts are empty (-inf, 0, 0)."""
    return _own_key_parts(q, own_k, own_v, pos, sample, used_columns, keys, min(window, 2 ** 31 - 1), split_keys)


@torch.library.custom_op("nanochat::own_key_attention", mutates_args=())
def _own_key_parts(q: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor, pos: torch.Tensor, sample: torch.Tensor,
                   used_columns: int, keys: int, window: int,
                   split_keys: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, D = q.shape
    Hkv = own_k.size(1)
    rep = H // Hkv
    splits = own_splits(keys, split_keys)
    top, total = (q.new_empty(splits, B, H, dtype=torch.float32) for _ in range(2))
    acc = q.new_empty(splits, B, H, D, dtype=torch.float32)
    q, own_k, own_v = _interpreter_inputs(q, own_k, own_v)
    block_rep = block_size(rep, floor=1)
    _own_keys_kernel.on(q.device)[(B * Hkv * splits,)](
        q, own_k, own_v, pos, sample, top, total, acc, B, used_columns, keys, split_keys, window, 1.0 / math.sqrt(D),
        Hkv, splits, q.stride(0), q.stride(1), *own_k.stride()[:3], *own_v.stride()[:3],
        REP=rep, D=D, BLOCK_REP=block_rep, BLOCK_D=block_size(D), BLOCK_OWN=own_keys_a_tile(block_rep),
        num_warps=OWN_WARPS)
    return top, total, acc


@_own_key_parts.register_fake
def _(q, own_k, own_v, pos, sample, used_columns, keys, window, split_keys):
    B, H, D = q.shape
    splits = own_splits(keys, split_keys)
    return (q.new_empty(splits, B, H, dtype=torch.float32), q.new_empty(splits, B, H, dtype=torch.float32),
            q.new_empty(splits, B, H, D, dtype=torch.float32))


def _interpreter_inputs(*tensors):
    """The tensors as the kernels take them: on a CPU (Triton's interpreter, triton 3.9, multiplies the raw bits of
    bf16 tiles in tl.dot) fp32 copies, the same values (bf16 is exact in fp32), the probabilities then unrounded
    (within bf16's); on a GPU, in a recorded launch (launch.recording) or where the tests fixed the interpreter's dot
    (INTERPRETER_BF16_DOT_FIXED), as they are."""
    interpreted = tensors[0].device.type != "cuda" and not recording()  # a recorded launch binds as on a GPU
    if interpreted and tensors[0].dtype != torch.float32 and not INTERPRETER_BF16_DOT_FIXED:
        return tuple(t.float() for t in tensors)
    return tensors


def prompt_attention(q, pool_k, pool_v, pool_len, cells, own_k, own_v, pos, sample, used_columns, keys, window,
                     split_keys=OWN_SPLIT_KEYS):
    """q: (B, H, D) the step's rows' queries; pool_k, pool_v: (slots, Hkv, Lp, D) one layer's prompt pool; pool_len:
    (slots,); cells: (slots, columns) from cell_rows; own_k, own_v: (B', Hkv, capacity, D) one layer's completion
    keys, rows 0..B-1 the step's; pos: (B,) each row's newest completion key (this step's, already written); sample:
    (B,) each row's column (>= used_columns: a free row, output zero); keys: completion keys a row may see (this
    step's included); window: the layer's; split_keys: own keys a program of the own-key kernel takes. Returns
    (B, H, D) in q's dtype. Two kernels (the module docstring)."""
    if not q.dtype == pool_k.dtype == pool_v.dtype == own_k.dtype == own_v.dtype:
        raise ValueError(f"prompt_attention takes its queries, keys and values in one dtype, got {q.dtype} queries, "
                         f"{pool_k.dtype} prompt keys and {own_k.dtype} own keys")
    parts = own_key_attention(q, own_k, own_v, pos, sample, used_columns, keys, window, split_keys)
    return _prompt_and_merge(q, pool_k, pool_v, pool_len, cells, *parts, pos, sample, used_columns,
                             min(window, 2 ** 31 - 1))


@torch.library.custom_op("nanochat::prompt_attention", mutates_args=())
def _prompt_and_merge(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, pool_len: torch.Tensor,
                      cells: torch.Tensor, part_top: torch.Tensor, part_total: torch.Tensor, part_acc: torch.Tensor,
                      pos: torch.Tensor, sample: torch.Tensor, used_columns: int, window: int) -> torch.Tensor:
    B, H, D = q.shape
    slots, Hkv = pool_k.shape[:2]
    out = torch.empty_like(q)
    rep = H // Hkv
    q, pool_k, pool_v = _interpreter_inputs(q, pool_k, pool_v)
    ieee = q.dtype == torch.float32  # fp32 stays fp32: tl.dot would round its operands to tf32 on a GPU
    block_d, block_rep = block_size(D), block_size(rep, floor=1)
    block_cells = cells_a_program(block_rep)  # a slot's cells in chunks of that many
    chunks = -(-used_columns // block_cells)
    grid = (slots * Hkv * chunks + -(-B // FREE_ROWS_BLOCK),)
    _prompt_attention_kernel.on(q.device)[grid](
        q, out, pool_k, pool_v, pool_len, cells, part_top, part_total, part_acc, pos, sample, B, used_columns,
        cells.size(1), part_top.size(0), window, 1.0 / math.sqrt(D), slots, Hkv, chunks,
        q.stride(0), q.stride(1), *pool_k.stride()[:3], *pool_v.stride()[:3], out.stride(0), out.stride(1),
        REP=rep, D=D, BLOCK_CELLS=block_cells, BLOCK_REP=block_rep, BLOCK_D=block_d, BLOCK_N=16,
        BLOCK_FREE=FREE_ROWS_BLOCK, IEEE=ieee, num_warps=attention_warps(block_cells * block_rep, ieee and rep > 1))
    return out


@_prompt_and_merge.register_fake
def _(q, pool_k, pool_v, pool_len, cells, part_top, part_total, part_acc, pos, sample, used_columns, window):
    return torch.empty_like(q)
