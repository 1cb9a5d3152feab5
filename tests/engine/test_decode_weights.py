"""The engine's decode weights (engine.DecodeWeights): under bf16/fp16 autocast the rollouts' forwards use copies of
the matmul weights cast once per rollout instead of autocast's casts at every step (on a GPU a replayed CUDA graph
re-casts every weight at every step: three times the weight bytes the step needs).

Checked here: autocast casts exactly the weights that are copied, on every nanochat generation, and nothing once
the copies are in use; rollouts with the copies are bitwise those of plain autocast (tokens, masks, tool calls,
both log-probabilities, the generate() stream), greedy and sampled, eager and static; a rollout after an optimizer
step uses the new weights; fp32 rollouts make no copies; the training path keeps its fp32 parameters."""

import pytest
import torch
from helpers import install_generation, prompt_of, random_model, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from nanochat.checkpoints.loading import build_model
from nanochat.engine.decode_weights import DecodeWeights, matmul_modules
from nanochat.engine.engine import Engine
from nanochat.engine.kv_cache import KVCache, forward_cached
from nanochat.engine.spec import rollout_spec
from nanochat.model.generations import GENERATIONS


def bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


class Casts(TorchDispatchMode):
    """Records which of `tensors` (name -> tensor) an op converts to another dtype (autocast's casts)."""

    def __init__(self, tensors):
        super().__init__()
        self.names = {t.data_ptr(): name for name, t in tensors.items()}
        self.cast = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.names:
            self.cast.add(self.names[args[0].data_ptr()])
        return func(*args, **kwargs)


@pytest.mark.parametrize("name", list(GENERATIONS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_casts_exactly_the_copied_weights(name, dtype):
    """The claim the copies rest on, for every generation's forward: plain autocast casts every matmul weight (the
    nn.Linear ones: lm_head and the gates too) and no other parameter; with the copies in use it casts nothing,
    and the logits are bitwise the same (autocast made the same copy)."""
    model = random_model(tiny_config(sequence_len=64, window_pattern="SL"), generation=name)
    idx = torch.randint(0, 300, (3, 20), generator=torch.Generator().manual_seed(0))
    weights = DecodeWeights(model)
    weights.refresh(dtype)
    tensors = {**dict(model.named_parameters()), **{f"copy {i}": c for i, c in enumerate(weights.copies)}}
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        with Casts(tensors) as plain:
            expected = model(idx)
        with Casts(tensors) as copied, weights.in_use():
            logits = model(idx)
    linear = {n + ".weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert plain.cast == linear and len(weights.copies) == len(matmul_modules(model)) == len(linear)
    assert copied.cast == set()
    assert torch.equal(logits, expected)


def plain_autocast(monkeypatch):
    """Rollouts from here on make no copies: autocast casts the fp32 weights at every step, as before."""
    refresh = DecodeWeights.refresh
    monkeypatch.setattr(DecodeWeights, "refresh", lambda self, dtype: refresh(self, None))


def outcome(completions):
    """Everything a rollout returns, log-probabilities as their bit patterns (nan, for forced tokens, included)."""
    bits = lambda values: torch.tensor(values, dtype=torch.float64).view(torch.int64).tolist()
    return [[(c.tokens, c.masks, c.ended, c.tool_calls, c.tool_successes, bits(c.logprobs), bits(c.sampling_logprobs))
             for c in per] for per in completions]


def bf16_rollouts(model, tokenizer, prompts, decode, share_prompts):
    """Greedy and sampled (T=1, top-k 50) rollouts with rows admitted into freed slots, and the generate() stream,
    under bf16 autocast on one engine. Returns (their outcomes, the decode weights the engine held, the parameters
    autocast cast in the greedy rollout)."""
    engine = Engine(model, tokenizer, rollout_spec(model, decode=decode, share_prompts=share_prompts))
    kwargs = dict(num_samples=3, max_tokens=32, seeds=[4, 5, 6], max_rows=5, top_k=50)
    with bf16():
        with Casts(dict(model.named_parameters())) as casts:  # slow (Python per op): one rollout
            out = [outcome(engine.generate_many(prompts, temperature=0.0, **kwargs))]
        out.append(outcome(engine.generate_many(prompts, temperature=1.0, **kwargs)))
        out.append(list(engine.generate(prompts[0], num_samples=3, max_tokens=16, temperature=1.0, seed=7)))
    return out, len(engine.memory.weights.copies), casts.cast


@pytest.mark.parametrize("name,decode,share_prompts", [("oct2025", "eager", True), ("oct2025", "static", False),
                                                       ("ve_late", "static", True), ("smear", "eager", False),
                                                       ("smear", "static", True)])
@pytest.mark.slow
def test_bf16_rollouts_are_bitwise_those_of_plain_autocast(name, decode, share_prompts, tmp_path, monkeypatch):
    """nanochat's fixture checkpoints: the copies change nothing a rollout returns, in either decode step (both KV
    caches), and with them no parameter is cast (prefills and decode steps alike use them); oct2025's rows call the
    calculator (forced tokens included)."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    model, tokenizer, _ = build_model(str(install_generation(tmp_path, name)), 5, "cpu", "eval")
    prompts = [prompt_of(tokenizer, q) for q in ("What is 12 times 7?", "Tom has 3 apples and buys 5 more.", "Hi")]
    copied, copies, cast = bf16_rollouts(model, tokenizer, prompts, decode, share_prompts)
    plain_autocast(monkeypatch)
    plain, no_copies, plain_cast = bf16_rollouts(model, tokenizer, prompts, decode, share_prompts)
    assert copied == plain
    assert (copies, no_copies) == (len(matmul_modules(model)), 0) and cast == set() and len(plain_cast) == copies
    if name == "oct2025":
        assert any(c[3] >= 1 for per in copied[0] for c in per)  # greedy rows call the calculator


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_a_rollout_after_an_optimizer_step_uses_the_new_weights(decode, tiny_tokenizer):
    """Regression guard for the refresh: the engine keeps its copies (and a static batch) between rollouts, and
    the trainer changes the fp32 weights in place; the next rollout must be that of the new weights (a fresh
    engine's), not of the copies made before the step. Training itself runs on the fp32 parameters, with autograd."""
    config = tiny_config(sequence_len=64, vocab_size=tiny_tokenizer.get_vocab_size(), window_pattern="SL")
    model = random_model(config, generation="smear")
    prompts = [prompt_of(tiny_tokenizer, q) for q in ("a b", "Natalia sold 48 clips")]
    kwargs = dict(num_samples=3, max_tokens=12, temperature=1.0, top_k=50, seeds=[1, 2])
    engine = Engine(model, tiny_tokenizer, rollout_spec(model, decode=decode))
    parameters = list(model.parameters())
    with bf16():
        before = outcome(engine.generate_many(prompts, **kwargs))
    copies, kept = [c.data_ptr() for c in engine.memory.weights.copies], engine.memory.kept_batch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = torch.tensor([prompts[1]])
    loss = model(ids[:, :-1], targets=ids[:, 1:])
    loss.backward()
    assert all(a is b for a, b in zip(model.parameters(), parameters, strict=True))
    assert all(p.dtype == torch.float32 and p.grad is not None for p in parameters)
    optimizer.step()

    with bf16():
        after = outcome(engine.generate_many(prompts, **kwargs))
        fresh = Engine(model, tiny_tokenizer, rollout_spec(model, decode=decode))
        fresh = outcome(fresh.generate_many(prompts, **kwargs))
    # refreshed in place, and a static batch reused: graphs captured over the copies would stay valid
    assert [c.data_ptr() for c in engine.memory.weights.copies] == copies and engine.memory.kept_batch is kept
    assert (kept is not None) == (decode == "static")
    assert after == fresh and after != before


def test_fp32_rollouts_make_no_copies_and_a_failed_forward_restores_the_parameters(tiny_tokenizer):
    """Without autocast the engine holds no copy (and drops bf16 ones); release() drops them too. An error inside
    a forward with the copies in use (a KV-cache overflow) leaves the model with its own fp32 parameters."""
    config = tiny_config(sequence_len=64, vocab_size=tiny_tokenizer.get_vocab_size())
    model = random_model(config)
    parameters = list(model.parameters())
    engine = Engine(model, tiny_tokenizer)
    prompt = prompt_of(tiny_tokenizer, "a b")
    engine.generate_many([prompt], num_samples=2, max_tokens=4)
    assert engine.memory.weights.copies == []
    with bf16():
        engine.generate_many([prompt], num_samples=2, max_tokens=4)
    assert len(engine.memory.weights.copies) == len(matmul_modules(model)) > 0
    engine.generate_many([prompt], num_samples=2, max_tokens=4)
    assert engine.memory.weights.copies == []
    with bf16():
        engine.generate_many([prompt], num_samples=2, max_tokens=4)
    engine.memory.release()
    assert engine.memory.weights.copies == []

    weights = DecodeWeights(model)
    weights.refresh(torch.bfloat16)
    with pytest.raises(ValueError, match="KV cache overflow"), weights.in_use(), bf16(), torch.no_grad():
        forward_cached(model, torch.zeros(1, 2, dtype=torch.long), KVCache.for_model(model, 1, 1))
    assert all(a is b for a, b in zip(model.parameters(), parameters, strict=True))
