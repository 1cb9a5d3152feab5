"""nanochat/kernels/: the decode step's Triton kernels, run on a CPU in Triton's interpreter, against the torch code
they replace (the hand-written shared-prompt step, the model's rotary/norm/residual ops, the sampler): each kernel on
hand-made states (free rows, gaps in a slot's columns, windows that cut the prompt, GQA and MHA, odd sizes), whole
rollouts of nanochat's fixture checkpoints token for token, and the d20 step's meta kernel count (test_sm90_compile.py
compiles them for a GPU)."""

import pytest
import torch
import torch.nn.functional as F
from helpers import FP32_GAP_BOUND, install_generation, prompt_of, random_model, tiny_config
from test_flex_prompt_attention import cache_in_use, rollouts

from nanochat.checkpoints.loading import build_model
from nanochat.diagnostics.op_count import count_decode_step_ops
from nanochat.engine.engine import Engine
from nanochat.engine.kv_cache import write_rows
from nanochat.engine.shared_prompt_cache import SharedPromptKVCache, SharedPromptStep
from nanochat.kernels.launch import kernels_unavailable
from nanochat.kernels.prompt_attention import cell_rows, prompt_attention, reference_prompt_attention
from nanochat.kernels.residual_norm import relu_square, residual_norm
from nanochat.kernels.rotary_store import norm_result_fp32, rotary_store
from nanochat.kernels.sampling import sample_rows
from nanochat.model.blocks import norm
from nanochat.model.gpt import GPT, GPTConfig
from nanochat.model.sampling import sample_with_logprobs

triton = pytest.importorskip("triton", reason="the kernels' tests need triton (tests/run.sh installs it)")
from nanochat.kernels.launch import interpreter_on  # noqa: E402

# on CPU tensors, in Triton's interpreter (tests/conftest.py turns it on where no GPU is); a GPU machine compiles
# instead, where these CPU-tensor tests cannot run (gpu_check.sh's bench compares the kernels' tokens there)
# and Triton 3.9's interpreter or later: 3.6's (the GPU image's) holds a loaded scalar as a 1-element array, which a loop
# bound cannot be (its compiler takes the same kernels: tests/support/sm90_compile.py passes under 3.6.0 and 3.9.0)
TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])
pytestmark = [pytest.mark.skipif(not interpreter_on(), reason="Triton's interpreter is off (a GPU machine)"),
              pytest.mark.skipif(TRITON_VERSION < (3, 9), reason=f"Triton {triton.__version__}'s interpreter: 3.9 or later")]

D20 = dict(sequence_len=2048, vocab_size=65536, n_layer=20, n_head=10, n_kv_head=10, n_embd=1280, window_pattern="SSSL")


def kernel_attention(cache, layer, q, keys, window):
    """prompt_attention over the first q.size(0) rows of `cache` at `layer` (its step's keys already written)."""
    rows = q.size(0)
    view = cache.prefix(rows)
    cells = cell_rows(view.prompt_slot, view.sample, cache.pool_k.size(1), cache.grid_columns)
    args = (q, cache.pool_k[layer], cache.pool_v[layer], cache.pool_len, cells, cache.k[layer], cache.v[layer],
            view.pos, view.sample, cache.rows_per_slot, keys, window)
    return prompt_attention(*args), reference_prompt_attention(*args)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2)])
@pytest.mark.parametrize("window", [0, 2, 6, 1000])
def test_prompt_attention_attends_as_the_hand_written_step(heads, kv_heads, window):
    """10 rows over 3 prompt slots (prompts of 5, 11 and 1 keys; gaps in slot 1's columns; row 9 free), 20 own keys:
    every row in use gets the hand-written step's attention within fp32 rounding, and the row-by-row reference's; the
    free row gets zeros. Window 0 and 2 hide every prompt key from most rows, 6 some, 1000 none; 6 heads over 2 kv
    heads is a group of 3, not a power of two."""
    cache = cache_in_use(heads, kv_heads, torch.float32)
    torch.manual_seed(1)
    q, k, v = torch.randn(10, 1, heads, 16), torch.randn(10, 1, kv_heads, 16), torch.randn(10, 1, kv_heads, 16)
    hand_written = SharedPromptStep(cache.prefix(10), 20).attend(1, q, k, v, window)[:, :, 0]  # writes k, v
    ours, reference = kernel_attention(cache, 1, q[:, 0], 20, window)
    torch.testing.assert_close(ours[:9], hand_written[:9], rtol=0, atol=2e-6)
    torch.testing.assert_close(ours[:9], reference[:9], rtol=0, atol=2e-6)
    assert torch.equal(ours[9], torch.zeros_like(ours[9]))


@pytest.mark.parametrize("window", [5, 30, 1000])
def test_prompt_attention_over_several_tiles_of_prompt_and_own_keys(window):
    """Prompts of 37 and 16 keys (three tiles of 16, and exactly one) and rows with up to 21 own keys (three tiles of
    8): the online softmax carries its maximum and sum from tile to tile (rescaling what it accumulated), as the
    hand-written step's one softmax; 5 cuts the prompt mid-tile, 30 across tiles."""
    torch.manual_seed(6)
    cache = SharedPromptKVCache(6, 2, 40, 24, 2, 16, 1, rows_per_slot=3, static=True)
    cache.pool_k.normal_(), cache.pool_v.normal_(), cache.k.normal_(), cache.v.normal_()
    cache.pool_k[:, 0, :, 20:] += 3.0  # later prompt keys score higher: a later tile raises the running maximum
    cache.pool_len.copy_(torch.tensor([37, 16]))
    cache.prompt_slot[:5] = torch.tensor([0, 0, 0, 1, 1])
    cache.sample[:5] = torch.tensor([0, 1, 2, 0, 2])
    cache.pos[:5] = torch.tensor([0, 9, 20, 3, 17])
    cache.active[:5] = 1
    q, k, v = torch.randn(6, 1, 4, 16), torch.randn(6, 1, 2, 16), torch.randn(6, 1, 2, 16)
    hand_written = SharedPromptStep(cache.prefix(6), 21).attend(0, q, k, v, window)[:, :, 0]
    ours, _ = kernel_attention(cache, 0, q[:, 0], 21, window)
    torch.testing.assert_close(ours[:5], hand_written[:5], rtol=0, atol=2e-6)


def test_prompt_attention_in_bf16_within_bf16_rounding_of_fp32():
    """bf16 queries, keys and values give a bf16 result within bf16 rounding of the exact one. In the interpreter
    the op hands the kernel fp32 copies (its bf16 tl.dot is wrong, triton 3.9): this checks the op's dtypes and the
    output's rounding; the bf16 tl.dot itself runs on a GPU only (gpu_check.sh's bench compares the step's tokens)."""
    cache = cache_in_use(4, 2, torch.bfloat16)
    torch.manual_seed(2)
    q = torch.randn(10, 4, 16).bfloat16()
    ours, reference = kernel_attention(cache, 0, q, 20, 6)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours[:9].float(), reference[:9].float(), rtol=2 ** -7, atol=2 ** -7)


def test_prompt_attention_sees_only_its_rows_prompt_window_and_own_keys():
    """Keys a row must not see changed (pool keys past a prompt's length, own keys past a row's position, another
    row's keys): no output changes; a prompt key inside the window of slot 2's rows changed: exactly those rows."""
    cache = cache_in_use(4, 2, torch.float32)
    q = torch.randn(10, 4, 16)
    before, _ = kernel_attention(cache, 0, q, 24, 6)
    cache.pool_k[0, 0, :, 5:] += 5.0  # slot 0's prompt has 5 keys
    cache.pool_k[0, 2, :, 1:] += 5.0  # slot 2's has 1
    for row, pos in enumerate(cache.pos[:9].tolist()):
        cache.k[0, row, :, pos + 1:] += 5.0
    cache.k[0, 9] += 5.0  # the free row's
    unchanged, _ = kernel_attention(cache, 0, q, 24, 6)
    torch.testing.assert_close(unchanged, before, rtol=0, atol=0)
    cache.pool_k[0, 2, :, 0] += 1.0  # slot 2's one prompt key: rows 4-6, of which row 4 (position 2) sees it at window 6
    changed = (kernel_attention(cache, 0, q, 24, 6)[0] != before).flatten(1).any(1)
    assert changed.tolist() == [False] * 4 + [True] + [False] * 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("generation,layer", [("jan2026", 0), ("smear", 1), ("mar9", 1), ("ve", 1)])
def test_rotary_store_projects_as_the_model_and_writes_the_cache(dtype, generation, layer):
    """CausalSelfAttention.project of a generation's layer (rotary, q/k norm, its q/k scale; value embedding and gate
    where the layer has one: smear's 12-channel gate, ve's 32) on a block's normed input: the queries returned, the
    keys and values written into each row's completion at its position (as write_rows writes them), nothing else of
    the cache written. fp32 within its rounding; bf16 a few bf16 steps apart (Triton's interpreter rounds fp32 to bf16
    toward zero, torch to nearest, at each of rotary's, the norm's, the scale's and the gate's roundings)."""
    torch.manual_seed(3)
    config = GPTConfig(sequence_len=32, vocab_size=50, n_layer=4, n_head=4, n_kv_head=2, n_embd=64)
    model = GPT(config, generation)
    model.init_weights()
    attn = model.transformer.h[layer].attn
    assert (attn.ve_gate is not None) == (generation != "jan2026")
    for p in model.parameters():  # nothing left at its zero/one init: every term counts
        p.data.normal_(0, 0.5)
    model.to(dtype)
    B, heads, kv_heads, D = 5, 4, 2, 16
    h = norm(torch.randn(B, 64)).to(dtype)
    tokens = torch.randint(0, 50, (B,))
    positions, pos = torch.tensor([3, 17, 0, 30, 9]), torch.tensor([0, 5, 2, 7, 1])
    rope = model._rope(positions[:, None])
    ve = model.value_embeds[str(layer)](tokens[:, None]) if attn.ve_gate is not None else None
    with torch.no_grad():
        q_want, k_want, v_want = (t[:, 0] for t in attn.project(h[:, None], ve, rope))
        qkv = torch.cat([attn.c_q(h), attn.c_k(h), attn.c_v(h)], dim=-1).view(B, heads + 2 * kv_heads, D)
        # two rows more than the step's: the kernel writes only the step's rows
        expected_k, expected_v = (torch.randn(2, B + 2, kv_heads, 8, D).to(dtype) for _ in range(2))
        k_cache, v_cache = expected_k.clone(), expected_v.clone()
        write_rows(expected_k, 1, torch.arange(B), pos, k_want, heads_first=True)
        write_rows(expected_v, 1, torch.arange(B), pos, v_want, heads_first=True)
        value_embedding = (model.value_embeds[str(layer)].weight, tokens, attn.ve_gate.weight, h, attn.ve_gate_scale) \
            if ve is not None else (None, tokens, None, h, 0.0)
        q = rotary_store(qkv, model.cos, model.sin, positions, k_cache, v_cache, 1, pos, heads, attn.qk_scale,
                         *value_embedding, norm_result_fp32(dtype, h.device))
    tolerance = dict(rtol=0, atol=2e-6) if dtype == torch.float32 else dict(rtol=2 ** -5, atol=2 ** -5)
    torch.testing.assert_close(q.float(), q_want.float(), **tolerance)
    torch.testing.assert_close(k_cache.float(), expected_k.float(), **tolerance)
    torch.testing.assert_close(v_cache.float(), expected_v.float(), **tolerance)
    written = torch.zeros_like(k_cache, dtype=torch.bool)
    written[1, torch.arange(B), :, pos] = True
    assert torch.equal(k_cache[~written], expected_k[~written]) and torch.equal(v_cache[~written], expected_v[~written])


def test_rotary_store_rounds_the_norm_once_where_autocast_keeps_it_in_fp32():
    """CUDA's autocast runs F.rms_norm in fp32 from torch 2.12: there the scaled norm is rounded to bf16 once
    (norm_fp32=True), elsewhere after the norm and again after the scale; on this CPU F.rms_norm keeps bf16, with or
    without autocast, and fp32 is fp32. Each against the rounding it names, within two bf16 steps: which of the two
    roundings ran cannot be told apart here (they differ by one step at most, and the interpreter rounds toward
    zero), what can is the norm and the scale on both branches."""
    assert norm_result_fp32(torch.float32, torch.device("cpu"))
    assert not norm_result_fp32(torch.bfloat16, torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not norm_result_fp32(torch.bfloat16, torch.device("cpu"))
    torch.manual_seed(7)
    qkv = (torch.randn(3, 1 + 2, 16) * 3).bfloat16()  # one query head, one kv head
    cos, sin = torch.ones(4, 8), torch.zeros(4, 8)  # position 0: no rotation, the norm and scale alone
    k_cache = v_cache = torch.zeros(1, 3, 1, 2, 16, dtype=torch.bfloat16)
    zero = torch.zeros(3, dtype=torch.long)
    normed = F.rms_norm(qkv[:, 0].float(), (16,))
    for norm_fp32, want in ((True, (normed * 1.2).bfloat16()), (False, (normed.bfloat16() * 1.2).bfloat16())):
        q = rotary_store(qkv, cos, sin, zero, k_cache.clone(), v_cache.clone(), 0, zero, 1, 1.2, None, zero, None,
                         qkv[:, 0], 0.0, norm_fp32)
        torch.testing.assert_close(q[:, 0].float(), want.float(), rtol=2 ** -6, atol=0)


@pytest.mark.parametrize("part", ["lambdas", "add", "backout", "norm only"])
def test_residual_norm_composes_the_models_residual_ops(part):
    """x_new bitwise as the model's ops compute it (each product and sum rounded to fp32 in the same order), the
    norm within fp32 rounding of norm(x_new), the kept sum bitwise x + delta."""
    torch.manual_seed(4)
    x, delta, y = torch.randn(6, 40), torch.randn(6, 40).bfloat16(), torch.randn(6, 40)
    lam_a, lam_b = torch.randn(3), torch.randn(3)
    if part == "lambdas":
        args, want = (delta, lam_a, 2, y, lam_b, 1, 1.0), lam_a[2] * (x + delta) + lam_b[1] * y
    elif part == "add":
        args, want = (delta, None, 0, None, None, 0, 1.0), x + delta
    elif part == "backout":
        args, want = (delta, None, 0, y, lam_b, 0, -1.0), (x + delta) - lam_b[0] * y
    else:
        args, want = (None, None, 0, None, None, 0, 1.0), x
    x_new, normed, summed = residual_norm(x, *args, True, torch.bfloat16)
    assert torch.equal(x_new, want)
    # one bf16 rounding apart at most (the interpreter rounds toward zero, torch to nearest)
    torch.testing.assert_close(normed.float(), norm(want).bfloat16().float(), rtol=2 ** -7, atol=1e-6)
    assert torch.equal(summed, x + delta if part != "norm only" else x)


def test_relu_square_is_the_mlps_activation():
    """Bitwise in fp32; in bf16 one rounding apart at most (the interpreter rounds toward zero, torch to nearest)."""
    u = torch.randn(3, 1500)  # past one block of the kernel
    assert torch.equal(relu_square(u), F.relu(u).square())
    u = u.bfloat16()
    torch.testing.assert_close(relu_square(u).float(), F.relu(u).square().float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 50), (0.7, 20), (0.0, None), (1.3, None), (1.0, None)])
def test_sample_rows_draws_the_samplers_tokens(temperature, top_k):
    """sample_with_logprobs' tokens from the same streams (every row), its two log-probabilities within fp32
    rounding of the logsumexps, the streams of the rows in use advanced by one and the free row's not."""
    torch.manual_seed(5)
    B, V = 6, 2500  # V past two blocks of the kernel
    logits = torch.randn(B, V) * 3
    seeds, draws = torch.randint(0, 2 ** 32, (B,)), torch.randint(0, 100, (B,))
    active = torch.tensor([1, 1, 1, 0, 1, 1])
    tokens, model_lp, sampling_lp = sample_with_logprobs(logits, seeds, draws, temperature, top_k)
    sampled, after = torch.zeros(B + 2, 3), torch.cat([draws, torch.tensor([7, 7])])  # buffers past the step's rows
    top = torch.topk(logits, top_k) if top_k else (None, None)
    sample_rows(logits, *top, seeds, after, torch.cat([active, torch.ones(2, dtype=torch.long)]), sampled, temperature)
    assert torch.equal(sampled[:B, 0].long(), tokens)
    torch.testing.assert_close(sampled[:B, 1], model_lp, rtol=0, atol=2e-6)
    torch.testing.assert_close(sampled[:B, 2], sampling_lp, rtol=0, atol=2e-6)
    assert torch.equal(after, torch.cat([draws + active, torch.tensor([7, 7])]))
    assert torch.equal(sampled[B:], torch.zeros(2, 3))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["jan2026", "smear", "oct2025"])  # windows; smear, backout, value embeddings; neither
def test_kernel_rollouts_sample_the_hand_written_tokens(name, tmp_path, monkeypatch):
    """fp32 rollouts (T=1, top-k 50; 2 prompts x 3 samples in 4 rows: rows admitted into freed ones) of nanochat's
    fixture checkpoints: the Triton step samples the hand-written step's tokens, log-probabilities within
    FP32_GAP_BOUND."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    model, tokenizer, _ = build_model(str(install_generation(tmp_path, name)), 5, "cpu", "eval")
    prompts = [prompt_of(tokenizer, q) for q in ("What is 12 times 7?", "Hi")]
    kwargs = dict(num_samples=3, max_tokens=10, temperature=1.0, top_k=50, seeds=[4, 5], max_rows=4)
    explicit, explicit_lp = rollouts(Engine(model, tokenizer, decode="static"), prompts, **kwargs)
    ours, ours_lp = rollouts(Engine(model, tokenizer, decode="static", decode_kernels="triton"), prompts, **kwargs)
    assert ours == explicit
    assert explicit_lp.numel() >= 40 and (ours_lp - explicit_lp).abs().max() <= FP32_GAP_BOUND


@pytest.mark.parametrize("generation,outside", [("jan2026", 18), ("smear", 26), ("oct2025", 18)])
def test_the_d20_kernel_step_runs_at_most_300_kernels(generation, outside):
    """Issue 66's target on the meta device (a custom op one kernel): one d20 decode step, 256 rows x 256 keys, at most
    300 kernels (1,152 hand-written for jan2026, 1,258 for smear): every block 9 (value embeddings inside
    rotary_store), outside the blocks 18 (smear's gate: 26)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**D20), generation)
    count = count_decode_step_ops(model, 256, 256, decode_kernels="triton")
    assert count.kernels_per_block == [9] * 20 and count.ops_outside_blocks >= 0
    assert count.kernels == 9 * 20 + outside <= 300, count.kernels


def test_the_triton_step_is_refused_in_one_line_where_it_cannot_run(tiny_tokenizer, monkeypatch):
    model = random_model(tiny_config(vocab_size=tiny_tokenizer.get_vocab_size()))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"^decode_kernels is triton: the Triton kernels run on a CUDA GPU; on a CPU "
                                         r"only in Triton's interpreter"):
        Engine(model, tiny_tokenizer, decode_kernels="triton")
    assert kernels_unavailable(torch.device("cuda")) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="decode_kernels is triton, a step of the shared-prompt cache"):
        Engine(model, tiny_tokenizer, decode_kernels="triton", share_prompts=False)
    with pytest.raises(ValueError, match="decode_kernels is triton, whose step is never compiled"):
        Engine(model, tiny_tokenizer, decode_kernels="triton", compile="on")
