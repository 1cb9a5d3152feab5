"""nanochat/kernels/: the decode step's Triton kernels against the torch code they replace (the hand-written
shared-prompt step, the model's rotary/norm/residual ops, the sampler): each kernel on hand-made states (free rows,
gaps in a slot's columns, windows that cut the prompt, GQA and MHA, odd sizes, the layouts of d20: padded head lanes,
several chunks a slot, groups of 16 and 32, free rows over several programs, head dim 128), in Triton's interpreter
under the bounds harness here and compiled on a GPU there (kernel_targets.py), within bounds derived from their
roundings; whole rollouts of nanochat's fixture checkpoints token for token, and the d20 step's meta kernel count
(test_sm90_compile.py compiles them for a GPU)."""

import pytest
import torch
import torch.nn.functional as F
from helpers import FP32_GAP_BOUND, install_generation, prompt_of, random_model, tiny_config
from oracles import reference_prompt_attention
from test_flex_prompt_attention import cache_in_use, rollouts

from nanochat.checkpoints.loading import build_model
from nanochat.diagnostics.op_count import count_decode_step_ops
from nanochat.engine.engine import Engine
from nanochat.engine.kv_cache import write_rows
from nanochat.engine.shared_prompt_cache import SharedPromptKVCache, SharedPromptStep
from nanochat.engine.spec import rollout_spec
from nanochat.kernels.launch import kernels_unavailable
from nanochat.kernels.prompt_attention import OWN_SPLIT_KEYS, cell_rows, prompt_attention
from nanochat.kernels.residual_norm import relu_square, residual_norm
from nanochat.kernels.rotary_store import norm_result_fp32, rotary_store
from nanochat.kernels.sampling import sample_rows
from nanochat.model.blocks import norm
from nanochat.model.gpt import GPT, GPTConfig
from nanochat.model.sampling import sample_with_logprobs

triton = pytest.importorskip("triton", reason="the kernels' tests need triton (tests/run.sh installs it)")
from bounds_harness import checked_memory  # noqa: E402
from kernel_targets import INTERPRETER_SKIP, assert_within_ulps, target  # noqa: E402,F401 (target: a fixture)

# Each op's test runs on both targets (kernel_targets.py): in Triton's interpreter on CPU tensors, under the bounds
# harness, where no GPU is; compiled on CUDA tensors where one is (marked cuda). The rollouts and the refusal need
# the interpreter.

D20 = dict(sequence_len=2048, vocab_size=65536, n_layer=20, n_head=10, n_kv_head=10, n_embd=1280, window_pattern="SSSL")


def kernel_attention(cache, layer, q, keys, window, split_keys=OWN_SPLIT_KEYS):
    """prompt_attention over the first q.size(0) rows of `cache` at `layer` (its step's keys already written), the
    own keys in splits of `split_keys`."""
    rows = q.size(0)
    view = cache.prefix(rows)
    cells = cell_rows(view.prompt_slot, view.sample, cache.pool_k.size(1), cache.grid_columns)
    args = (q, cache.pool_k[layer], cache.pool_v[layer], cache.pool_len, cells, cache.k[layer], cache.v[layer],
            view.pos, view.sample, cache.rows_per_slot, keys, window)
    return prompt_attention(*args, split_keys=split_keys), reference_prompt_attention(*args)


def attention_bound(values, dtype):
    """The magnitude an attention output's error is measured against: the largest value it averages (a convex
    combination of them, each weight carrying its exp's and the scores' roundings)."""
    return values.detach().float().abs().amax()


# fp32 roundings between the kernel's attention and a torch one: the scores' dot products and scale, the exp, the
# running rescales and the sum over keys, each a few roundings of the largest value averaged
FP32_ATTENTION_ROUNDINGS = 8
# bf16 as launched: the probabilities rounded to bf16 before each tl.dot (half a step of each term, at most half a
# step of the largest value in all) and the output rounded once: within two steps of the largest value
BF16_ATTENTION_ROUNDINGS = 2


def assert_wrote_every_row_once(target, out):
    """In the interpreter: the launch stored each element of its output exactly once (a row in use by its attention
    program, a free row by the free-row part), none twice (two programs racing on one row on a GPU)."""
    if target.memory is not None:
        counts = target.memory.launch("_prompt_attention_kernel").write_counts("out_ptr")
        assert counts.size == out.numel() and (counts == 1).all(), (
            f"{int((counts == 0).sum())} output elements unwritten, {int((counts > 1).sum())} written more than once")


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2)])
@pytest.mark.parametrize("window", [0, 2, 6, 1000])
def test_prompt_attention_attends_as_the_hand_written_step(target, heads, kv_heads, window):
    """10 rows over 3 prompt slots (prompts of 5, 11 and 1 keys; gaps in slot 1's columns; row 9 free), 20 own keys:
    every row in use gets the hand-written step's attention within fp32 rounding, and the row-by-row reference's; the
    free row gets zeros. Window 0 and 2 hide every prompt key from most rows, 6 some, 1000 none; 6 heads over 2 kv
    heads is a group of 3, not a power of two."""
    cache = cache_in_use(heads, kv_heads, torch.float32, device=target.device)
    torch.manual_seed(1)
    q, k, v = (torch.randn(10, 1, n, 16, device=target.device) for n in (heads, kv_heads, kv_heads))
    hand_written = SharedPromptStep(cache.prefix(10), 20).attend(1, q, k, v, window)[:, :, 0]  # writes k, v
    ours, reference = kernel_attention(cache, 1, q[:, 0], 20, window)
    scale = attention_bound(torch.cat([cache.pool_v.flatten(), cache.v.flatten()]), torch.float32)
    assert_within_ulps(ours[:9], hand_written[:9], torch.float32, FP32_ATTENTION_ROUNDINGS, scale=scale)
    assert_within_ulps(ours[:9], reference[:9], torch.float32, FP32_ATTENTION_ROUNDINGS, scale=scale)
    assert torch.equal(ours[9], torch.zeros_like(ours[9]))
    assert_wrote_every_row_once(target, ours)


@pytest.mark.parametrize("split_keys", [OWN_SPLIT_KEYS, 5, 1])
@pytest.mark.parametrize("window", [5, 30, 1000])
def test_prompt_attention_over_several_tiles_of_prompt_and_own_keys(target, window, split_keys):
    """Prompts of 37 and 16 keys (three tiles of 16, and exactly one) and rows with up to 21 own keys (two tiles of
    16 in one split, or splits of 5 keys (the last of 1, some past a row's position: empty) or of 1): the online
    softmax carries its maximum and sum from tile to tile and the merge from part to part (rescaling what it
    accumulated), as the hand-written step's one softmax; 5 cuts the prompt mid-tile, 30 across tiles."""
    torch.manual_seed(6)
    device = target.device
    cache = SharedPromptKVCache(6, 2, 40, 24, 2, 16, 1, rows_per_slot=3, static=True, device=device)
    cache.pool_k.normal_(), cache.pool_v.normal_(), cache.k.normal_(), cache.v.normal_()
    cache.pool_k[:, 0, :, 20:] += 3.0  # later prompt keys score higher: a later tile raises the running maximum
    cache.pool_len.copy_(torch.tensor([37, 16]))
    cache.prompt_slot[:5] = torch.tensor([0, 0, 0, 1, 1])
    cache.sample[:5] = torch.tensor([0, 1, 2, 0, 2])
    cache.pos[:5] = torch.tensor([0, 9, 20, 3, 17])
    cache.active[:5] = 1
    q, k, v = (torch.randn(6, 1, n, 16, device=device) for n in (4, 2, 2))
    hand_written = SharedPromptStep(cache.prefix(6), 21).attend(0, q, k, v, window)[:, :, 0]
    ours, _ = kernel_attention(cache, 0, q[:, 0], 21, window, split_keys)
    scale = attention_bound(torch.cat([cache.pool_v.flatten(), cache.v.flatten()]), torch.float32)
    assert_within_ulps(ours[:5], hand_written[:5], torch.float32, FP32_ATTENTION_ROUNDINGS, scale=scale)


def test_prompt_attention_in_bf16_as_launched(target):
    """bf16 queries, keys and values through the kernel's bf16 path as it is launched (bf16 tiles into tl.dot, the
    probabilities rounded to bf16 before the values' dot: in the interpreter with launched_numerics' tl.dot, not
    the fp32 copies the op makes for an interpreter without it): a bf16 result within two bf16 steps of the largest
    value of the exact attention over the same bf16 inputs."""
    cache = cache_in_use(4, 2, torch.bfloat16, device=target.device)
    torch.manual_seed(2)
    q = torch.randn(10, 4, 16, device=target.device).bfloat16()
    ours, reference = kernel_attention(cache, 0, q, 20, 6)
    assert ours.dtype == torch.bfloat16
    scale = attention_bound(torch.cat([cache.pool_v.flatten(), cache.v.flatten()]), torch.bfloat16)
    assert_within_ulps(ours[:9], reference[:9], torch.bfloat16, BF16_ATTENTION_ROUNDINGS, scale=scale)
    assert_wrote_every_row_once(target, ours)


def test_prompt_attention_sees_only_its_rows_prompt_window_and_own_keys(target):
    """Keys a row must not see changed (pool keys past a prompt's length, own keys past a row's position, another
    row's keys): no output changes; a prompt key inside the window of slot 2's rows changed: exactly those rows."""
    cache = cache_in_use(4, 2, torch.float32, device=target.device)
    q = torch.randn(10, 4, 16, device=target.device)
    before, _ = kernel_attention(cache, 0, q, 24, 6)
    cache.pool_k[0, 0, :, 5:] += 5.0  # slot 0's prompt has 5 keys
    cache.pool_k[0, 2, :, 1:] += 5.0  # slot 2's has 1
    for row, pos in enumerate(cache.pos[:9].tolist()):
        cache.k[0, row, :, pos + 1:] += 5.0
    cache.k[0, 9] += 5.0  # the free row's
    unchanged, _ = kernel_attention(cache, 0, q, 24, 6)
    torch.testing.assert_close(unchanged, before, rtol=0, atol=0)
    cache.pool_k[0, 2, :, 0] += 1.0  # slot 2's one prompt key: rows 4-6, of which row 4 (position 2) sees it (window 6)
    changed = (kernel_attention(cache, 0, q, 24, 6)[0] != before).flatten(1).any(1)
    assert changed.tolist() == [False] * 4 + [True] + [False] * 5


# What d20's step has that the states above lack: (heads, kv heads, head dim, rows, prompt slots, samples a slot,
# rows in use, static). A program holds 16 query rows: 16 // group cells of a slot (a "chunk"), one cell where the
# group is 16 or more; the free rows (a static cache's spare column) are zeroed 16 a program.
ATTENTION_LAYOUTS = {
    "MHA, 2 chunks a slot": (2, 2, 16, 24, 2, 20, 22, True),  # 16 cells a program, 20 samples a slot
    "GQA 4, 3 chunks a slot": (8, 2, 16, 12, 1, 11, 10, True),  # 4 cells a program, the last chunk partial
    "GQA group of 16": (16, 1, 16, 5, 2, 3, 4, True),  # one cell a program, its 16 heads the 16 rows
    "GQA group of 32": (32, 1, 16, 3, 1, 3, 2, True),  # one cell, 32 rows in one program
    "free rows over 3 programs": (2, 1, 16, 40, 2, 4, 6, True),  # 34 free rows, 16 a program
    "head dim 24": (4, 2, 24, 6, 2, 3, 5, True),  # a tile wider than the head
    "head dim 128": (4, 2, 128, 6, 2, 3, 5, True),
    "d20 heads, head dim 128": (10, 10, 128, 16, 1, 16, 16, True),
    "no spare column": (4, 2, 16, 6, 2, 3, 6, False),  # a dynamic cache: every column of `cells` a sample's
}


def layout_state(device, heads, kv_heads, D, rows, slots, samples, in_use, static, keys=12, seed=0):
    """A SharedPromptKVCache of `rows` rows of which `in_use`, at random rows, sit in random (slot, sample) cells at
    random positions below `keys`; prompts of 1-12 keys; random keys and values. Returns the cache, the step's
    queries, keys and values (rows, 1, heads or kv heads, D), and which rows are in use."""
    g = torch.Generator().manual_seed(seed)
    cache = SharedPromptKVCache(rows, slots, 12, keys, kv_heads, D, 1, rows_per_slot=samples, static=static,
                                device=device)
    for t in (cache.pool_k, cache.pool_v, cache.k, cache.v):
        t.copy_(torch.randn(t.shape, generator=g))
    cache.pool_len.copy_(torch.randint(1, 13, (slots,), generator=g))
    used = torch.randperm(rows, generator=g)[:in_use].sort().values
    cells = torch.randperm(slots * samples, generator=g)[:in_use]
    cache.prompt_slot[used] = (cells // samples).to(device)
    cache.sample[used] = (cells % samples).to(device)
    cache.pos[used] = torch.randint(0, keys, (in_use,), generator=g).to(device)
    cache.active[used] = 1
    live = torch.zeros(rows, dtype=torch.bool, device=device)
    live[used] = True
    q, k, v = (torch.randn(rows, 1, n, D, generator=g).to(device) for n in (heads, kv_heads, kv_heads))
    return cache, q, k, v, live


@pytest.mark.parametrize("layout", ATTENTION_LAYOUTS)
def test_prompt_attention_at_the_layouts_of_d20(target, layout):
    """Each layout of ATTENTION_LAYOUTS (window 7: it cuts some prompts): the rows in use get the hand-written step's
    attention and the row-by-row reference's within fp32 rounding, the free rows zeros, every output element written
    once, and (the harness) no load or store outside its tensor."""
    heads, kv_heads, D, rows, slots, samples, in_use, static = ATTENTION_LAYOUTS[layout]
    cache, q, k, v, live = layout_state(target.device, heads, kv_heads, D, rows, slots, samples, in_use, static)
    hand_written = SharedPromptStep(cache.prefix(rows), 12).attend(0, q, k, v, 7)[:, :, 0]  # writes k, v
    ours, reference = kernel_attention(cache, 0, q[:, 0], 12, 7)
    scale = attention_bound(torch.cat([cache.pool_v.flatten(), cache.v.flatten()]), torch.float32)
    assert_within_ulps(ours[live], hand_written[live], torch.float32, FP32_ATTENTION_ROUNDINGS, scale=scale)
    assert_within_ulps(ours[live], reference[live], torch.float32, FP32_ATTENTION_ROUNDINGS, scale=scale)
    assert torch.equal(ours[~live], torch.zeros_like(ours[~live]))
    assert_wrote_every_row_once(target, ours)


# (heads, kv heads, head dim): the lanes of rotary_store's tile are heads + 2 kv heads, padded to a power of two
ROTARY_LAYOUTS = {"gqa": (4, 2, 16), "padded lanes": (3, 3, 16), "d20 lanes": (10, 10, 16), "head dim 24": (2, 1, 24),
                  "head dim 128": (2, 1, 128)}
ROTARY_CASES = ([(g, layer, "gqa") for g, layer in [("jan2026", 0), ("smear", 1), ("mar9", 1), ("ve", 1)]]
                + [("ve", 1, layout) for layout in ROTARY_LAYOUTS if layout != "gqa"] + [("smear", 1, "padded lanes")])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("generation,layer,layout", ROTARY_CASES)
def test_rotary_store_projects_as_the_model_and_writes_the_cache(target, dtype, generation, layer, layout):
    """CausalSelfAttention.project of a generation's layer (rotary, q/k norm, its q/k scale; value embedding and gate
    where the layer has one: smear's 12-channel gate, ve's 32) on a block's normed input: the queries returned, the
    keys and values written into each row's completion at its position (as write_rows writes them), nothing else of
    the cache written. Layouts: 3 + 2 x 3 = 9 lanes padded to 16 and d20's 30 padded to 32 (the padded lanes are
    value lanes past the last kv head: issue 73 found them reading the gate's rows 10-11 of 10), head dims 24 (a
    tile wider than the head) and 128; one row at the rotary table's last position. fp32 within a few fp32 roundings
    of each value; bf16 within two bf16 roundings (the norm's sum order can move its rounding by one step, and the
    scale's product rounds again), the values past their gate's rounding too."""
    torch.manual_seed(3)
    heads, kv_heads, D = ROTARY_LAYOUTS[layout]
    config = GPTConfig(sequence_len=32, vocab_size=50, n_layer=4, n_head=heads, n_kv_head=kv_heads, n_embd=heads * D)
    model = GPT(config, generation)
    model.init_weights()
    attn = model.transformer.h[layer].attn
    assert (attn.ve_gate is not None) == (generation != "jan2026")
    for p in model.parameters():  # nothing left at its zero/one init: every term counts
        p.data.normal_(0, 0.5)
    model.to(target.device, dtype)
    B, C = 5, heads * D
    h = norm(torch.randn(B, C, device=target.device)).to(dtype)
    last = model.value_embeds[str(layer)].weight.size(0) - 1 if attn.ve_gate is not None else 49
    tokens = torch.tensor([last, 0, 17, 3, last], device=target.device)  # the value embedding's last row read too
    positions = torch.tensor([3, 17, 0, model.cos.size(0) - 1, 9], device=target.device)
    pos = torch.tensor([0, 5, 2, 7, 1], device=target.device)
    rope = model._rope(positions[:, None])
    ve = model.value_embeds[str(layer)](tokens[:, None]) if attn.ve_gate is not None else None
    with torch.no_grad():
        q_want, k_want, v_want = (t[:, 0] for t in attn.project(h[:, None], ve, rope))
        qkv = torch.cat([attn.c_q(h), attn.c_k(h), attn.c_v(h)], dim=-1).view(B, heads + 2 * kv_heads, D)
        # two rows more than the step's: the kernel writes only the step's rows
        expected_k, expected_v = (torch.randn(2, B + 2, kv_heads, 8, D, device=target.device).to(dtype) for _ in "kv")
        k_cache, v_cache = expected_k.clone(), expected_v.clone()
        write_rows(expected_k, 1, torch.arange(B, device=target.device), pos, k_want, heads_first=True)
        write_rows(expected_v, 1, torch.arange(B, device=target.device), pos, v_want, heads_first=True)
        gate_channels = attn.ve_gate.weight.size(1) if ve is not None else 0
        # the gate reads h's first channels only: given exactly those, a read past them leaves h
        value_embedding = (model.value_embeds[str(layer)].weight, tokens, attn.ve_gate.weight,
                           h[:, :gate_channels].contiguous(), attn.ve_gate_scale) if ve is not None \
            else (None, tokens, None, h, 0.0)
        q = rotary_store(qkv, model.cos, model.sin, positions, k_cache, v_cache, 1, pos, heads, attn.qk_scale,
                         *value_embedding, norm_result_fp32(dtype, h.device))
    roundings = 2 if dtype == torch.bfloat16 else 8
    assert_within_ulps(q, q_want, dtype, roundings, scale=attn.qk_scale if dtype == torch.float32 else None)
    assert_within_ulps(k_cache, expected_k, dtype, roundings, scale=1.0 if dtype == torch.float32 else None)
    # v = x + gate * embedding: the term's roundings (its gate's logit, sigmoid, scale) within the same count of its own
    term = (v_want - qkv[:, heads + kv_heads:]).abs().amax()
    assert_within_ulps(v_cache, expected_v, dtype, roundings, scale=term)
    written = torch.zeros_like(k_cache, dtype=torch.bool)
    written[1, torch.arange(B, device=target.device), :, pos] = True
    assert torch.equal(k_cache[~written], expected_k[~written]) and torch.equal(v_cache[~written], expected_v[~written])


def test_rotary_store_rounds_the_norm_once_where_autocast_keeps_it_in_fp32(target):
    """CUDA's autocast runs F.rms_norm in fp32 from torch 2.12: there the scaled norm is rounded to bf16 once
    (norm_fp32=True), elsewhere after the norm and again after the scale; on this CPU F.rms_norm keeps bf16, with or
    without autocast, and fp32 is fp32. Each against the rounding it names, within one bf16 step (the norm's sum
    order can move a rounding by one step): the norm and the scale on both branches."""
    assert norm_result_fp32(torch.float32, torch.device("cpu"))
    assert not norm_result_fp32(torch.bfloat16, torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not norm_result_fp32(torch.bfloat16, torch.device("cpu"))
    torch.manual_seed(7)
    device = target.device
    qkv = (torch.randn(3, 1 + 2, 16) * 3).bfloat16().to(device)  # one query head, one kv head
    cos, sin = torch.ones(4, 8, device=device), torch.zeros(4, 8, device=device)  # no rotation: the norm, the scale
    k_cache = v_cache = torch.zeros(1, 3, 1, 2, 16, dtype=torch.bfloat16, device=device)
    zero = torch.zeros(3, dtype=torch.long, device=device)
    normed = F.rms_norm(qkv[:, 0].float(), (16,))
    for norm_fp32, want in ((True, (normed * 1.2).bfloat16()), (False, (normed.bfloat16() * 1.2).bfloat16())):
        q = rotary_store(qkv, cos, sin, zero, k_cache.clone(), v_cache.clone(), 0, zero, 1, 1.2, None, zero, None,
                         qkv[:, 0], 0.0, norm_fp32)
        assert_within_ulps(q[:, 0], want, torch.bfloat16, 1)


# a compiled kernel may contract a product and the sum it feeds into one FMA (one rounding fewer than torch's two
# ops), the interpreter does not: the residual stream bitwise there, within a rounding per contracted pair on a GPU
def residual_roundings(target):
    return 0 if target.interpreted else 2


@pytest.mark.parametrize("part", ["lambdas", "add", "backout", "norm only"])
@pytest.mark.parametrize("rows", [6, 9])
def test_residual_norm_composes_the_models_residual_ops(target, part, rows):
    """x_new as the model's ops compute it (each product and sum rounded to fp32 in the same order: bitwise in the
    interpreter), the norm within one bf16 rounding of norm(x_new) (its sum's order), the kept sum bitwise x + delta;
    40 channels in a tile of 64, 6 and 9 rows in programs of 4 (the last partial), every output element written
    once."""
    torch.manual_seed(4)
    device = target.device
    x, delta, y = (torch.randn(rows, 40, device=device) for _ in "xdy")
    delta = delta.bfloat16()
    lam_a, lam_b = torch.randn(3, device=device), torch.randn(3, device=device)
    none = dict(delta=None, a=None, a_index=0, y=None, b=None, b_index=0, sign=1.0)  # the op's other arguments
    if part == "lambdas":
        args, want = {**none, "delta": delta, "a": lam_a, "a_index": 2, "y": y, "b": lam_b, "b_index": 1}, \
            lam_a[2] * (x + delta) + lam_b[1] * y
    elif part == "add":
        args, want = {**none, "delta": delta}, x + delta
    elif part == "backout":
        args, want = {**none, "delta": delta, "y": y, "b": lam_b, "sign": -1.0}, (x + delta) - lam_b[0] * y
    else:
        args, want = none, x
    x_new, normed, summed = residual_norm(x, **args, keep_sum=True, norm_dtype=torch.bfloat16)
    assert_within_ulps(x_new, want, torch.float32, residual_roundings(target), scale=(x + delta).abs().amax())
    assert_within_ulps(normed, norm(want).bfloat16(), torch.bfloat16, 1)
    assert torch.equal(summed, x + delta if part != "norm only" else x)
    if target.memory is not None:
        launch = target.memory.launch("_residual_norm_kernel")
        for name in ("x_out_ptr", "normed_ptr", "summed_ptr"):
            assert (launch.write_counts(name) == 1).all(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu_square_is_the_mlps_activation(target, dtype):
    """Bitwise in fp32 and in bf16 (one product, rounded once to nearest as torch's bf16 square rounds it), over
    4,500 elements: past four blocks of the kernel, the last partial."""
    u = torch.randn(3, 1500, device=target.device).to(dtype)
    assert torch.equal(relu_square(u), F.relu(u).square())
    if target.memory is not None:  # a negative last element squares to 0: an unwritten one could read as right
        assert (target.memory.launch("_relu_square_kernel").write_counts("out_ptr") == 1).all()


# the sampler's log-probabilities: a logit minus a log-sum-exp over the vocabulary, whose sum's order and exp/log
# (approximate on a GPU) differ from torch's: a few fp32 roundings of the largest logit's magnitude
SAMPLER_ROUNDINGS = 8


@pytest.mark.parametrize("temperature,top_k", [(1.0, 50), (0.7, 20), (0.0, None), (1.3, None), (1.0, None)])
def test_sample_rows_draws_the_samplers_tokens(target, temperature, top_k):
    """sample_with_logprobs' tokens from the same streams (every row), its two log-probabilities within fp32
    rounding of the logsumexps, the streams of the rows in use advanced by one and the free row's not."""
    torch.manual_seed(5)
    device = target.device
    B, V = 6, 2500  # V past two blocks of the kernel
    logits = (torch.randn(B, V) * 3).to(device)
    seeds, draws = torch.randint(0, 2 ** 32, (B,), device=device), torch.randint(0, 100, (B,), device=device)
    active = torch.tensor([1, 1, 1, 0, 1, 1], device=device)
    tokens, model_lp, sampling_lp = sample_with_logprobs(logits, seeds, draws, temperature, top_k)
    # buffers past the step's rows
    sampled, after = torch.zeros(B + 2, 3, device=device), torch.cat([draws, torch.tensor([7, 7], device=device)])
    top = torch.topk(logits, top_k) if top_k else (None, None)
    ones = torch.ones(2, dtype=torch.long, device=device)
    sample_rows(logits, *top, seeds, after, torch.cat([active, ones]), sampled, temperature)
    assert torch.equal(sampled[:B, 0].long(), tokens)
    scale = logits.abs().amax() / (temperature or 1.0)
    assert_within_ulps(sampled[:B, 1], model_lp, torch.float32, SAMPLER_ROUNDINGS, scale=scale)
    assert_within_ulps(sampled[:B, 2], sampling_lp, torch.float32, SAMPLER_ROUNDINGS, scale=scale)
    assert torch.equal(after, torch.cat([draws + active, 7 * ones]))
    assert torch.equal(sampled[B:], torch.zeros(2, 3, device=device))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sample_rows_breaks_ties_as_torch_argmax(target, temperature):
    """Equal largest logits: greedy takes the first (torch.argmax's), within a block of the kernel (indices 5 and 7)
    and across blocks (100 and 1,100, blocks of 1,024); at temperature 1 the draw over the tied logits is the
    sampler's."""
    device = target.device
    logits = torch.zeros(2, 2500, device=device)
    logits[0, [5, 7]] = 4.0
    logits[1, [100, 1100]] = 4.0
    seeds, draws = torch.tensor([1, 2], device=device), torch.zeros(2, dtype=torch.long, device=device)
    tokens, model_lp, _ = sample_with_logprobs(logits, seeds, draws, temperature, None)
    sampled = torch.zeros(2, 3, device=device)
    sample_rows(logits, None, None, seeds, draws.clone(), torch.ones(2, dtype=torch.long, device=device), sampled,
                temperature)
    assert torch.equal(sampled[:, 0].long(), tokens)
    if temperature == 0.0:
        assert tokens.tolist() == [5, 100]


@INTERPRETER_SKIP
@pytest.mark.slow
@pytest.mark.parametrize("name", ["jan2026", "smear", "oct2025"])  # windows; smear, backout, value embeddings; neither
def test_kernel_rollouts_sample_the_hand_written_tokens(name, tmp_path, monkeypatch):
    """fp32 rollouts (T=1, top-k 50; 2 prompts x 3 samples in 4 rows: rows admitted into freed ones) of nanochat's
    fixture checkpoints: the Triton step samples the hand-written step's tokens, log-probabilities within
    FP32_GAP_BOUND, every access of its kernels inside its tensor (the bounds harness)."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    model, tokenizer, _ = build_model(str(install_generation(tmp_path, name)), 5, "cpu", "eval")
    prompts = [prompt_of(tokenizer, q) for q in ("What is 12 times 7?", "Hi")]
    kwargs = dict(num_samples=3, max_tokens=10, temperature=1.0, top_k=50, seeds=[4, 5], max_rows=4)
    explicit, explicit_lp = rollouts(Engine(model, tokenizer, rollout_spec(model, decode="static")), prompts, **kwargs)
    with checked_memory():  # every load and store of the whole step's kernels inside its tensor
        ours, ours_lp = rollouts(Engine(model, tokenizer, rollout_spec(model, decode="static",
                                                                       decode_kernels="triton")), prompts, **kwargs)
    assert ours == explicit
    assert explicit_lp.numel() >= 40 and (ours_lp - explicit_lp).abs().max() <= FP32_GAP_BOUND


@pytest.mark.parametrize("generation,outside", [("jan2026", 18), ("smear", 26), ("oct2025", 18)])
def test_the_d20_kernel_step_runs_at_most_300_kernels(generation, outside):
    """Issue 66's target on the meta device (a custom op one kernel): one d20 decode step, 256 rows x 256 keys, at most
    300 kernels (1,152 hand-written for jan2026, 1,258 for smear): every block 10 (value embeddings inside
    rotary_store; the attention's own keys and its prompt and merge two), outside the blocks 18 (smear's gate: 26)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**D20), generation)
    count = count_decode_step_ops(model, 256, 256, decode_kernels="triton")
    assert count.kernels_per_block == [10] * 20 and count.ops_outside_blocks >= 0
    assert count.kernels == 10 * 20 + outside <= 300, count.kernels


@INTERPRETER_SKIP
def test_the_triton_step_is_refused_in_one_line_where_it_cannot_run(tiny_tokenizer, monkeypatch):
    model = random_model(tiny_config(vocab_size=tiny_tokenizer.get_vocab_size()))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"^decode_kernels is triton: the Triton kernels run on a CUDA GPU; on a CPU "
                                         r"only in Triton's interpreter"):
        Engine(model, tiny_tokenizer, rollout_spec(model, decode_kernels="triton"))
    assert kernels_unavailable(torch.device("cuda")) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="decode_kernels is triton, a step of the shared-prompt cache"):
        Engine(model, tiny_tokenizer, rollout_spec(model, decode_kernels="triton", share_prompts=False))
    with pytest.raises(ValueError, match="decode_kernels is triton, whose step is never compiled"):
        Engine(model, tiny_tokenizer, rollout_spec(model, decode_kernels="triton", compile="on"))
