"""The GPT model: state-dict layout, numerics against an independent reference forward, the KV-cache
path against full forwards (prefill, decode, per-row positions, sliding windows, GQA), optimizer groups,
and the naive sampler."""

import math

import pytest
import torch
import torch.distributed as dist
from helpers import TINY_CONFIG, random_model, tiny_config

from nanochat.engine.kv_cache import KVCache, forward_cached
from nanochat.errors import UserError
from nanochat.model.gpt import GPT
from nanochat.model.sampling import row_seed, sample_next_token
from nanochat.optim.adamw import DistAdamW
from nanochat.optim.muon import DistMuon, Muon

VOCAB = TINY_CONFIG["vocab_size"]  # 300, padded to 320


def new_cache(config, batch_size, max_len, dtype=torch.float32):
    return KVCache(batch_size, config.n_kv_head, max_len, config.n_embd // config.n_head, config.n_layer, dtype=dtype)


def hidden_cached(model, idx, cache):
    """The model's hidden states for idx after what each row of `cache` holds; then the cache holds idx too."""
    step = cache.step(idx.size(1), model.rotary_len)
    hidden = model.hidden_states(idx, step)
    step.advance()
    return hidden


def random_tokens(shape, seed=1):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


# Comparisons of two computations that are equal in exact arithmetic but sum in different orders (another
# attention kernel, a cache, another CPU's vector width) run in float64: their difference is then rounding
# of ~1e-16 relative, grown by a few layers of sums of <= 256 terms to < 1e-13 on the O(1) hidden states,
# while a wrong key, position, window or mask moves them by > 1e-2. In fp32 the same rounding is ~1e-6,
# close to any tolerance that is still tight, and its size depends on the CPU's kernels.
FP64_TOL = dict(atol=1e-10, rtol=0)
U32 = torch.finfo(torch.float32).eps / 2  # fp32 unit roundoff
SOFTCAP = 15
# GPT.logits returns float32 whatever the model's dtype: an fp64 model's logits z are cast to fp32 and
# softcapped there, 15 tanh(z / 15). The cast and the division each round a value whose error reaches the
# output scaled by sech^2(z / 15) (at most 0.45 * 15 u together), tanh errs by <= 2 ulps (4 u relative) and
# the product by u, of values <= 15: within 6 u * 15 = 5.4e-6 of the exact softcapped logits.
LOGITS_CAST_TOL = dict(atol=6 * U32 * SOFTCAP, rtol=0)


# ----------------------------------------------------------------------------- an independent reference

def reference_forward(model, idx):
    """The spec's forward written out with plain tensor ops, reading only the model's weights, in their dtype."""
    cfg = model.config
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    B, T = idx.shape
    H, Hkv, C = cfg.n_head, cfg.n_kv_head, cfg.n_embd
    D = C // H
    dtype = sd["lm_head.weight"].dtype
    eps = torch.finfo(dtype).eps  # rms_norm's default

    def rms(x):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    # rotary angles theta[p, i] = p * 10000^(-2i/D), tables rounded to bf16 as nanochat trained with them
    half = D // 2
    theta = torch.arange(T, dtype=torch.float32)[:, None] * (10000.0 ** (-(2.0 * torch.arange(half)) / D))[None, :]
    cos, sin = theta.cos().bfloat16().to(dtype), theta.sin().bfloat16().to(dtype)

    def rotate(x):  # (B, T, heads, D): channel i pairs with i + D/2
        a, b = x[..., :half], x[..., half:]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.cat([a * c + b * s, b * c - a * s], dim=-1)

    windows = []
    for i in range(cfg.n_layer):
        kind = cfg.window_pattern[i % len(cfg.window_pattern)] if i < cfg.n_layer - 1 else "L"
        windows.append(cfg.sequence_len if kind == "L" else cfg.sequence_len // 2)

    x = rms(sd["transformer.wte.weight"][idx])
    x0 = x
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        x = sd["resid_lambdas"][i] * x + sd["x0_lambdas"][i] * x0
        h = rms(x)
        q = rms(rotate((h @ sd[p + "attn.c_q.weight"].T).view(B, T, H, D)))
        k = rms(rotate((h @ sd[p + "attn.c_k.weight"].T).view(B, T, Hkv, D)))
        v = (h @ sd[p + "attn.c_v.weight"].T).view(B, T, Hkv, D)
        y = torch.zeros(B, T, H, D, dtype=dtype)
        for head in range(H):
            g = head // (H // Hkv)  # consecutive query heads share a key/value head
            scores = torch.einsum("btd,bsd->bts", q[:, :, head], k[:, :, g]) / math.sqrt(D)
            for t in range(T):
                for s in range(T):
                    if not (s <= t and t - s <= windows[i]):
                        scores[:, t, s] = float("-inf")
            y[:, :, head] = torch.einsum("bts,bsd->btd", scores.softmax(-1), v[:, :, g])
        x = x + y.reshape(B, T, C) @ sd[p + "attn.c_proj.weight"].T
        hidden = torch.clamp(rms(x) @ sd[p + "mlp.c_fc.weight"].T, min=0) ** 2
        x = x + hidden @ sd[p + "mlp.c_proj.weight"].T
    logits = (rms(x) @ sd["lm_head.weight"].T)[..., :cfg.vocab_size]
    return SOFTCAP * torch.tanh(logits / SOFTCAP)


@pytest.mark.parametrize("pattern,n_layer,n_kv_head,T", [("L", 1, 4, 10), ("SL", 2, 2, 13), ("SSL", 3, 1, 20),
                                                         ("S", 2, 2, 13)])
def test_forward_matches_reference_math(pattern, n_layer, n_kv_head, T):
    """T=13 and 20 exceed the short window (8) and T=20 also the long one (16): both windows bind.
    Pattern "S" over 2 layers checks that the last layer is long whatever the pattern says. In float64
    (see FP64_TOL): the model's float32 logits are within their cast and softcap's rounding of the reference's
    (in fp32 both sides carried ~7e-6 of rounding, against a tolerance of 1e-5)."""
    config = tiny_config(n_layer=n_layer, window_pattern=pattern, n_kv_head=n_kv_head, sequence_len=16)
    model = random_model(config).double()
    idx = random_tokens((2, T))
    with torch.no_grad():
        logits, want = model(idx), reference_forward(model, idx)
    assert logits.dtype == torch.float32 and want.dtype == torch.float64
    torch.testing.assert_close(logits.double(), want, **LOGITS_CAST_TOL)


def test_window_pattern_changes_logits():
    """Guards the reference check above against a window mask that never binds."""
    model = random_model(tiny_config(window_pattern="SL"))
    same_weights = GPT(tiny_config(window_pattern="L"))
    same_weights.load_state_dict(model.state_dict())
    idx = random_tokens((1, 14))
    with torch.no_grad():
        a, b = model(idx), same_weights(idx)
    assert torch.equal(a[:, :9], b[:, :9])  # up to position 8 the short window (8) sees everything
    assert (a[:, 9:] - b[:, 9:]).abs().max() > 1e-3


# ----------------------------------------------------------------------------- state dict, shapes, loss

def test_state_dict_keys_shapes_and_padding():
    config = tiny_config(n_layer=3, n_head=4, n_kv_head=2, n_embd=64)
    model = GPT(config)
    hd = 64 // 4
    expected = {"transformer.wte.weight": (320, 64), "lm_head.weight": (320, 64),
                "resid_lambdas": (3,), "x0_lambdas": (3,)}
    for i in range(3):
        expected.update({
            f"transformer.h.{i}.attn.c_q.weight": (4 * hd, 64),
            f"transformer.h.{i}.attn.c_k.weight": (2 * hd, 64),
            f"transformer.h.{i}.attn.c_v.weight": (2 * hd, 64),
            f"transformer.h.{i}.attn.c_proj.weight": (64, 64),
            f"transformer.h.{i}.mlp.c_fc.weight": (256, 64),
            f"transformer.h.{i}.mlp.c_proj.weight": (64, 256),
        })
    state = model.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    buffers = dict(model.named_buffers())
    assert set(buffers) == {"cos", "sin"} and buffers["cos"].shape == (10 * 16, hd // 2)
    # a state dict with exactly the spec's keys loads strictly
    GPT(config).load_state_dict({k: torch.zeros(s) for k, s in expected.items()}, strict=True)


@pytest.mark.parametrize("vocab,padded", [(300, 320), (320, 320), (321, 384), (50304, 50304), (65537, 65600)])
def test_vocab_padding(vocab, padded):
    with torch.device("meta"):
        model = GPT(tiny_config(vocab_size=vocab))
    assert model.transformer.wte.weight.shape[0] == model.lm_head.weight.shape[0] == padded


def test_meta_build_then_load_reproduces_logits():
    """The checkpoint loader's path: build on meta, to_empty, init_weights (recomputes cos/sin), load."""
    source = random_model(tiny_config(window_pattern="SL"))
    with torch.device("meta"):
        model = GPT(source.config)
    model.to_empty(device="cpu")
    model.init_weights()
    model.load_state_dict(source.state_dict(), strict=True, assign=True)
    idx = random_tokens((2, 12))
    with torch.no_grad():
        assert torch.equal(model.eval()(idx), source(idx))


def test_forward_shapes_softcap_and_loss_reductions():
    model = random_model(tiny_config())
    idx = random_tokens((3, 7))
    targets = random_tokens((3, 7), seed=2)
    targets[0, :3] = -1
    targets[2, 6] = -1
    logits = model(idx)
    assert logits.shape == (3, 7, VOCAB) and logits.dtype == torch.float32
    assert logits.abs().max() < SOFTCAP
    per_token = model(idx, targets, loss_reduction="none")
    assert per_token.shape == (21,)
    valid = targets.view(-1) != -1
    assert torch.all(per_token[~valid] == 0)
    # the exact losses of these fp32 logits (float64), from which fp32 cross-entropy, lse(z) - z_t, differs by
    # rounding only: each exponential's argument z - max z (|.| < 2 SOFTCAP) rounds by u of its size, a
    # relative error of the exponential; the sum of V of them adds (V - 1) u relative (Higham, Accuracy and
    # Stability of Numerical Algorithms, (4.4)), which the log turns into as much absolute error; the
    # exponentials, the log, adding the max and subtracting z_t round values below 2 SOFTCAP + log V. So
    # per token at most (V + 5 (SOFTCAP + log V)) u = 2.4e-5. The mean and the sum of the n valid tokens add
    # (n - 1) u of the sum of the terms, and the mean's division u of its value.
    exact = -torch.log_softmax(logits.detach().double(), -1).view(-1, VOCAB)[valid, targets.view(-1)[valid]]
    n = int(valid.sum())
    per_token_bound = U32 * (VOCAB + 5 * (SOFTCAP + math.log(VOCAB)))
    assert (per_token[valid].detach().double() - exact).abs().max() <= per_token_bound
    mean, total = model(idx, targets).item(), model(idx, targets, loss_reduction="sum").item()
    assert abs(mean - exact.mean().item()) <= per_token_bound + n * U32 * exact.mean().item()
    assert abs(total - exact.sum().item()) <= n * per_token_bound + n * U32 * exact.sum().item()


def test_init_weights():
    config = tiny_config(n_embd=128, n_head=4, vocab_size=5000)
    model = GPT(config)
    torch.manual_seed(0)
    model.init_weights()
    s = math.sqrt(3) / math.sqrt(128)
    assert abs(model.transformer.wte.weight.std().item() - 1.0) < 0.02
    assert abs(model.lm_head.weight.std().item() - 0.001) < 2e-5
    for block in model.transformer.h:
        for w in (block.attn.c_q.weight, block.attn.c_k.weight, block.attn.c_v.weight, block.mlp.c_fc.weight):
            assert w.abs().max() <= s and w.abs().max() > 0.95 * s  # U(-s, s)
        assert not block.attn.c_proj.weight.any() and not block.mlp.c_proj.weight.any()
    assert torch.equal(model.resid_lambdas, torch.ones(2)) and torch.equal(model.x0_lambdas, torch.zeros(2))


@pytest.mark.parametrize("kw", [dict(n_embd=60, n_head=4), dict(n_head=4, n_kv_head=3), dict(window_pattern="SX"),
                                dict(window_pattern=""), dict(n_embd=36, n_head=4)])
def test_invalid_config_is_a_user_error(kw):
    with pytest.raises(UserError):
        tiny_config(**kw)


def test_estimate_flops():
    config = tiny_config(sequence_len=16, n_layer=2, n_head=4, n_embd=64, window_pattern="SL")
    model = GPT(config)
    matrices = 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 2 * 256 * 64) + 320 * 64  # blocks + lm_head
    attention = 12 * 4 * 16 * (8 + 16)  # layer 0 short window (8 keys), layer 1 long (16)
    assert model.estimate_flops() == 6 * matrices + attention


# ----------------------------------------------------------------------------- KV cache

KV_CASES = [
    dict(n_head=4, n_kv_head=2, window_pattern="L"),
    dict(n_head=4, n_kv_head=2, window_pattern="SL"),
    dict(n_head=4, n_kv_head=1, window_pattern="SSL", n_layer=3),
]
# Cached and full forwards reduce in different orders (different attention kernels): they are compared in
# float64, model and cache, on the hidden states (FP64_TOL); the logits add the same fp32 cast to both.


def cached_and_full_forward(cfg, rows, cache_len, chunks):
    """A random float64 model of `cfg` (sequence_len 16) on random tokens of `rows` rows, fed through a float64
    KV cache of `cache_len` positions in the chunks [a, b) of `chunks`: (the chunks' hidden states
    concatenated, the full forward's, the cache positions after each chunk)."""
    config = tiny_config(sequence_len=16, **cfg)
    model = random_model(config).double()
    idx = random_tokens((rows, chunks[-1][1]))
    with torch.no_grad():
        full = model.hidden_states(idx)
        cache = new_cache(config, rows, cache_len, dtype=torch.float64)
        pieces, positions = [], []
        for a, b in chunks:
            pieces.append(hidden_cached(model, idx[:, a:b], cache))
            positions.append(cache.pos.tolist())
    return torch.cat(pieces, dim=1), full, positions


@pytest.mark.parametrize("cfg", KV_CASES)
def test_prefill_then_decode_matches_full_forward(cfg):
    """24 tokens with sequence_len 16: the short window (8) and the long one (16) both slide."""
    cached, full, positions = cached_and_full_forward(cfg, 1, 24, [(0, 10)] + [(t, t + 1) for t in range(10, 24)])
    assert positions[0] == [10] and positions[-1] == [24]
    torch.testing.assert_close(cached, full, **FP64_TOL)


@pytest.mark.parametrize("cfg", KV_CASES)
def test_chunks_with_several_rows_match_full_forward(cfg):
    """T > 1 with B > 1 in lockstep: prefill 5, then chunks of 4, 1 and 7 tokens."""
    cached, full, _ = cached_and_full_forward(cfg, 3, 20, [(0, 5), (5, 9), (9, 10), (10, 17)])
    torch.testing.assert_close(cached, full, **FP64_TOL)


@pytest.mark.parametrize("window_pattern", ["L", "SL"])
def test_rows_at_different_positions(window_pattern):
    """Two prompts of different lengths, each prefilled into its own row, then decoded together
    (T=1 steps and a T=3 chunk): every row's hidden states equal a forward of that row alone (float64)."""
    config = tiny_config(sequence_len=16, window_pattern=window_pattern)
    model = random_model(config).double()
    seqs = [random_tokens((1, 22), seed=3), random_tokens((1, 22), seed=4)]
    prompt_lens = [5, 11]
    with torch.no_grad():
        alone = [model.hidden_states(s) for s in seqs]
        cache = new_cache(config, 2, 24, dtype=torch.float64)
        for b, (s, n) in enumerate(zip(seqs, prompt_lens)):
            out = hidden_cached(model, s[:, :n], cache.rows(b, b + 1))
            torch.testing.assert_close(out, alone[b][:, :n], **FP64_TOL)
        assert cache.pos.tolist() == prompt_lens
        offsets = [0, 1, 2, 5, 6, 8]  # tokens fed so far past each prompt
        for a, b in zip(offsets, offsets[1:]):
            chunk = torch.cat([s[:, n + a:n + b] for s, n in zip(seqs, prompt_lens)])  # (2, b - a)
            out = hidden_cached(model, chunk, cache)
            for r, n in enumerate(prompt_lens):
                torch.testing.assert_close(out[r], alone[r][0, n + a:n + b], **FP64_TOL)
    assert cache.pos.tolist() == [5 + 8, 11 + 8]


def test_bf16_cache_stores_bf16_and_stays_close():
    config = tiny_config(window_pattern="SL")
    model = random_model(config)
    idx = random_tokens((2, 12))
    with torch.no_grad():
        full = model(idx)
        cache = new_cache(config, 2, 12, dtype=torch.bfloat16)
        out = torch.cat([forward_cached(model, idx[:, :6], cache)] + [forward_cached(model, idx[:, t:t + 1], cache) for t in range(6, 12)], 1)
    assert cache.k.dtype == torch.bfloat16 and out.dtype == torch.float32
    assert cache.k[:, :, :12].abs().sum() > 0
    torch.testing.assert_close(out, full, atol=0.1, rtol=0)


def test_cache_overflow_and_row_mismatch_raise():
    config = tiny_config()
    model = random_model(config)
    with torch.no_grad():
        cache = new_cache(config, 1, 4)
        with pytest.raises(ValueError, match="overflow"):
            forward_cached(model, random_tokens((1, 5)), cache)
        with pytest.raises(ValueError, match="rows"):
            forward_cached(model, random_tokens((2, 2)), cache)


# ----------------------------------------------------------------------------- naive sampler

def test_generate_greedy_equals_repeated_argmax():
    model = random_model(tiny_config(window_pattern="SL"))
    prompt = random_tokens((12,)).tolist()
    generated = list(model.generate(prompt, max_tokens=10, temperature=0.0))  # 22 tokens > sequence_len
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert generated == ids[len(prompt):]
    assert list(model.generate(prompt, max_tokens=10, temperature=1.0, top_k=1)) == generated


def test_generate_samples_with_the_engine_stream():
    """Same seed, same tokens; the draws are row 0's stream of the engine's sampler."""
    model = random_model(tiny_config())
    prompt = [1, 2, 3]
    a = list(model.generate(prompt, max_tokens=8, temperature=1.5, top_k=50, seed=7))
    assert a == list(model.generate(prompt, max_tokens=8, temperature=1.5, top_k=50, seed=7))
    assert a != list(model.generate(prompt, max_tokens=8, temperature=1.5, top_k=50, seed=8))
    ids, seeds = list(prompt), torch.tensor([row_seed(7, 0)])
    with torch.no_grad():
        for step in range(8):
            logits = model(torch.tensor([ids]))[:, -1]
            ids.append(int(sample_next_token(logits, seeds, torch.tensor([step]), 1.5, 50)))
    assert a == ids[3:]


# ----------------------------------------------------------------------------- optimizers

def check_optimizer_groups(model, optimizers, adamw_type, muon_type):
    adamw, muon = optimizers
    assert type(adamw) is adamw_type and type(muon) is muon_type
    s = (64 / 768) ** -0.5
    expected = [(model.lm_head.weight, 0.004 * s), (model.transformer.wte.weight, 0.2 * s),
                (model.resid_lambdas, 0.5 * 0.01), (model.x0_lambdas, 0.5)]
    assert len(adamw.param_groups) == 4
    for group, (param, lr) in zip(adamw.param_groups, expected):
        assert len(group["params"]) == 1 and group["params"][0] is param
        assert group["lr"] == pytest.approx(lr) and group["initial_lr"] == group["lr"]
        assert group["betas"] == (0.8, 0.95) and group["eps"] == 1e-10 and group["weight_decay"] == 0.0
    for group in muon.param_groups:
        assert group["lr"] == 0.02 and group["initial_lr"] == 0.02 and group["momentum"] == 0.95
    muon_ids = [id(p) for g in muon.param_groups for p in g["params"]]
    assert sorted(muon_ids) == sorted(id(p) for p in model.transformer.h.parameters())
    all_ids = muon_ids + [id(p) for g in adamw.param_groups for p in g["params"]]
    assert sorted(all_ids) == sorted(id(p) for p in model.parameters())  # each parameter exactly once


def test_setup_optimizers_groups_and_a_step_moves_every_parameter():
    torch.manual_seed(0)
    model = GPT(tiny_config())
    model.init_weights()
    optimizers = model.setup_optimizers()
    check_optimizer_groups(model, optimizers, torch.optim.AdamW, Muon)
    # c_proj start at zero, so the step after a zero update of the first: two steps reach every weight
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    idx, targets = random_tokens((2, 8)), random_tokens((2, 8), seed=5)
    for _ in range(2):
        model(idx, targets).backward()
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert unchanged == []


def test_setup_optimizers_with_a_process_group_uses_distributed_optimizers(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = GPT(tiny_config())
        check_optimizer_groups(model, model.setup_optimizers(), DistAdamW, DistMuon)
    finally:
        dist.destroy_process_group()
