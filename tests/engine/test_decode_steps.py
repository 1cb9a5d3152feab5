"""nanochat/engine/decode_steps.py, the one table of the decode steps (issue 73): `auto` resolves to the torch step on
every device; what the engine runs, the per-step object its batches' caches make and what the meta counter counts are
the table's entry for the name, nothing decided elsewhere; the Triton step in the eager mode's exact shapes samples
the torch step's tokens; each refusal is one line."""

import pytest
import torch
from helpers import FP32_GAP_BOUND, prompt_of, random_model, tiny_config
from test_flex_prompt_attention import rollouts

from nanochat.cli import error_line
from nanochat.compiling.plan import CompilePlan
from nanochat.diagnostics.op_count import static_batch
from nanochat.engine.decode_steps import (DECODE_KERNELS, DECODE_STEPS, DecodeKernelsError, check_decode_kernels,
                                          resolve_decode_kernels)
from nanochat.engine.engine import Engine
from nanochat.engine.spec import resolve_rollout_spec, rollout_spec
from nanochat.kernels.launch import interpreter_on, triton
from nanochat.rl.plan import measured_parts

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
needs_interpreter = pytest.mark.skipif(not interpreter_on(), reason="Triton's interpreter is off (a GPU machine)")


def test_auto_is_the_torch_step_on_every_device():
    """Until a GPU's figures decide (docs/flags.md), auto is torch on CUDA too; a spec holds the resolved name."""
    assert DECODE_KERNELS == ("auto", "torch", "flex", "triton")
    assert [resolve_decode_kernels("auto", d) for d in (CPU, CUDA, torch.device("mps"))] == ["torch"] * 3
    assert resolve_rollout_spec(CUDA).decode_kernels == resolve_rollout_spec(CPU, decode_kernels="auto").decode_kernels
    assert resolve_rollout_spec(CPU).decode_kernels == "torch"
    assert resolve_rollout_spec(CPU, decode_kernels="flex").decode_kernels == "flex"


@pytest.mark.parametrize("name", [pytest.param("triton", marks=needs_interpreter), "flex", "torch"])
def test_the_engine_its_caches_and_the_meta_counter_build_the_tables_step(name, tiny_tokenizer):
    """Engine(decode_kernels=name) runs the table's static step (uncompiled here), a batch it makes hands each step
    the table's per-step object, and op_count's batch runs the same pair: one entry decides for all three."""
    model = random_model(tiny_config(vocab_size=tiny_tokenizer.get_vocab_size()))
    entry = DECODE_STEPS[name]
    engine = Engine(model, tiny_tokenizer, rollout_spec(model, decode="static", decode_kernels=name))
    assert engine.spec.decode_kernels == name and engine.step is entry.static_step
    batch, _ = engine._new_batch(1, 5, 2, 4, 1.0, None, 4)
    rows = batch.cache.batch_size
    assert type(batch.cache.decode_step(rows, 3)) is entry.cache_step and batch.step is entry.static_step
    counted = static_batch(model, 4, 3, True, 8, 2, 1.0, None, name)
    assert type(counted.cache.decode_step(4, 3)) is entry.cache_step and counted.step is entry.static_step


@needs_interpreter
def test_the_triton_step_in_exact_shapes_samples_the_torch_steps_tokens(tiny_tokenizer):
    """--decode=auto on a CPU decodes in the eager mode (exact shapes: no free rows, a cache that grows): the Triton
    step there, in fp32 in Triton's interpreter, samples the torch step's tokens (rows admitted into freed slots)."""
    config = tiny_config(sequence_len=64, vocab_size=tiny_tokenizer.get_vocab_size(), window_pattern="SL")
    model = random_model(config, generation="smear")
    prompts = [prompt_of(tiny_tokenizer, q) for q in ("a b", "Natalia sold 48 clips")]
    kwargs = dict(num_samples=3, max_tokens=12, temperature=1.0, top_k=50, seeds=[1, 2], max_rows=4)
    torch_tokens, torch_lp = rollouts(Engine(model, tiny_tokenizer, rollout_spec(model, decode="eager")), prompts,
                                      **kwargs)
    ours, ours_lp = rollouts(Engine(model, tiny_tokenizer, rollout_spec(model, decode="eager",
                                                                        decode_kernels="triton")), prompts, **kwargs)
    assert ours == torch_tokens
    assert torch_lp.numel() >= 12 and (ours_lp - torch_lp).abs().max() <= FP32_GAP_BOUND


@pytest.mark.skipif(triton is None, reason="without the triton package the refusal names it (launch.py)")
def test_the_triton_step_is_refused_before_anything_is_built(monkeypatch):
    """What a script checks once it has its device: the Triton step on a CPU without Triton's interpreter, compiled,
    or without shared prompts; each a DecodeKernelsError (a ValueError too) whose line names the flag and the fix."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(DecodeKernelsError) as e:
        check_decode_kernels("triton", CPU)
    assert isinstance(e.value, ValueError)
    assert error_line(e.value).startswith("--decode-kernels is triton: the Triton kernels run on a CUDA GPU; on a CPU "
                                          "only in Triton's interpreter (TRITON_INTERPRET=1")
    assert error_line(e.value).endswith("; use --decode-kernels=auto or torch (the hand-written step)")
    assert check_decode_kernels("auto", CPU) == "torch" and check_decode_kernels("triton", CUDA) == "triton"
    with pytest.raises(DecodeKernelsError) as e:
        check_decode_kernels("triton", CUDA, compiled=True)
    assert error_line(e.value) == (
        "--decode-kernels is triton, whose step is never compiled (its kernels are the fusion), and the static step is "
        "asked compiled (compile on); use --decode-kernels=auto or torch (the hand-written step), or --compile=off or "
        "auto (which compile nothing of it)")
    with pytest.raises(DecodeKernelsError, match="decode_kernels is triton, a step of the shared-prompt cache"):
        check_decode_kernels("triton", CUDA, share_prompts=False)
    assert check_decode_kernels("flex", CUDA, compiled=True) == "flex"


@needs_interpreter  # the device is checked first: a CPU model's Triton step runs in the interpreter alone
def test_a_model_the_kernels_cannot_compute_is_refused_in_one_line(tiny_tokenizer):
    model = random_model(tiny_config(vocab_size=tiny_tokenizer.get_vocab_size()))
    model.transformer.wte.to(torch.bfloat16)
    with pytest.raises(DecodeKernelsError, match=r"^decode_kernels is triton: the Triton kernels need the token "
                                                 r"embedding in float32, and this model's is torch.bfloat16$"):
        Engine(model, tiny_tokenizer, rollout_spec(model, decode_kernels="triton"))


def test_compile_auto_never_measures_a_step_that_does_not_compile():
    """chat_rl's --compile=auto on a CPU times the decode step for a compiled switch; the Triton step never compiles,
    so only training is measured (a switch would make a compiled spec, which the engine refuses)."""
    measured = CompilePlan(False, False, "auto on a CPU", measured=True)
    assert measured_parts(measured, "auto", "bfloat16") == ("train", "decode")
    assert measured_parts(measured, "auto", "bfloat16", step_compiles=DECODE_STEPS["triton"].compiles) == ("train",)
