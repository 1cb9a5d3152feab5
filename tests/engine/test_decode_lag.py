"""Issue 49, the host off the critical path: with `lag` each decode step is launched before the host reads the step
before it, and the host feeds the rows one step behind while the device runs. The same tokens and log-probabilities
as without, in every decode mode and cache, with rows that call the calculator at every moment (its forced output
decides the next input while a step on the last sampled token is already launched), rows that end at their first
token, rows cut by max_tokens in the middle of a call and waiting rows taking freed rows; at most one host read a
step."""

import pytest
import torch
from helpers import FP32_GAP_BOUND, HAS_CUDA, BigramModel, prompt_of
from test_decode_kernels import HostReads, recorded
from test_static_decode import ENDING_KWARGS, ENDING_PROMPTS, ending_model, logprobs, rollouts

from nanochat.engine.decode_batch import DecodeBatch
from nanochat.engine.engine import Engine
from nanochat.engine.spec import rollout_spec

BIGRAM_PROMPTS = ("a b", "Natalia sold clips", "c", "d e", "f")


def bigram_model(tokenizer):
    """helpers.BigramModel (a call of the calculator can start at any step, the first included, and its forced output
    decides what comes next), with a third of the rows ending at their first token."""
    torch.manual_seed(0)
    model = BigramModel(tokenizer)
    with torch.no_grad():
        start, end = (tokenizer.encode_special(s) for s in ("<|assistant_start|>", "<|assistant_end|>"))
        model.table[start, end] += 3.0
    return model


def both(model, tokenizer, prompts, decode, share_prompts, **kwargs):
    """(rollouts, log-probabilities, stats) of an engine without lag and of one with."""
    out = []
    for lag in (False, True):
        engine = Engine(model, tokenizer, rollout_spec(model, decode=decode, share_prompts=share_prompts, lag=lag))
        out.append((rollouts(engine, prompts, **kwargs), logprobs(engine, prompts, **kwargs), engine.last_stats))
    return out


@pytest.mark.parametrize("decode", ["eager", "static", "graph"])
@pytest.mark.parametrize("share_prompts", [True, False])
@pytest.mark.parametrize("max_tokens", [12, 40])  # 12: rows cut in the middle of a call or of its forced output
def test_lagging_rows_sample_the_same_tokens_through_calculator_calls(decode, share_prompts, max_tokens,
                                                                      tiny_tokenizer, cpu_graphs):
    model = bigram_model(tiny_tokenizer)
    prompts = [prompt_of(tiny_tokenizer, q) for q in BIGRAM_PROMPTS]
    kwargs = dict(num_samples=6, max_tokens=max_tokens, temperature=1.0, top_k=0, seeds=[1, 2, 3, 4, 5], max_rows=9)
    (want, want_lp, sync), (got, got_lp, lagged) = both(model, tiny_tokenizer, prompts, decode, share_prompts, **kwargs)
    assert got == want and got_lp == want_lp
    completions = [c for per in want for c in per]
    assert sum(c[3] for c in completions) >= (1 if max_tokens == 12 else 20)  # calculator calls
    assert sum(len(c[0]) == 0 and c[2] for c in completions) >= 3  # rows that end at their first token
    assert len({len(c[0]) for c in completions}) > 3
    # it did lag: a row is stepped once more after the step it ends at (the host learns of its end one step late)
    assert lagged.row_steps > sync.row_steps and lagged.decode_forwards >= sync.decode_forwards


@pytest.mark.parametrize("decode", ["eager", "static", "graph"])
def test_lagging_rows_of_a_transformer_sample_the_same_tokens(decode, tiny_tokenizer, cpu_graphs):
    """A model whose keys, values and smear state carry each step's input: a step launched on the wrong input would
    leave them wrong for the steps after. The log-probabilities agree within FP32_GAP_BOUND, not bitwise: a lagging
    step holds rows that ended one step longer, and a matmul over another number of rows may round otherwise."""
    model = ending_model(tiny_tokenizer)
    prompts = [prompt_of(tiny_tokenizer, q) for q in ENDING_PROMPTS]
    (want, want_lp, _), (got, got_lp, _) = both(model, tiny_tokenizer, prompts, decode, True, **ENDING_KWARGS)
    assert got == want
    flat = [[float("nan") if x is None else x for prompt in lp for sample in prompt for x in sample]
            for lp in (want_lp, got_lp)]
    torch.testing.assert_close(torch.tensor(flat[1]), torch.tensor(flat[0]), rtol=0, atol=FP32_GAP_BOUND,
                               equal_nan=True)
    assert len({len(c[0]) for per in want for c in per}) > 3


def test_a_lagging_rollout_reads_the_device_at_most_once_a_step(tiny_tokenizer, monkeypatch):
    """HostReads (tests/engine/test_decode_kernels.py) with lag: a decode step reads once (the step before's samples) or not
    at all (the first step after rows were admitted: nothing before it to read); nothing else in the rollout reads
    but admissions and prefills."""
    model = bigram_model(tiny_tokenizer)
    prompts = [prompt_of(tiny_tokenizer, q) for q in BIGRAM_PROMPTS]
    engine = Engine(model, tiny_tokenizer, rollout_spec(model, decode="static", lag=True))
    host = HostReads(monkeypatch)
    phases = {"decode_step": [], "admit": [], "prefill": []}
    for name, calls in phases.items():
        monkeypatch.setattr(DecodeBatch, name, recorded(getattr(DecodeBatch, name), host, calls))
    before = host.reads
    engine.generate_many(prompts, num_samples=6, max_tokens=40, temperature=1.0, top_k=0, seeds=[1, 2, 3, 4, 5],
                         max_rows=9)
    steps = phases["decode_step"]
    assert set(steps) == {0, 1} and steps.count(1) > 10
    assert host.reads - before == sum(steps) + sum(phases["admit"]) + sum(phases["prefill"])


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("decode", ["static", "graph"])
def test_on_a_gpu_lagging_rows_sample_the_same_tokens(decode, tiny_tokenizer):
    """On CUDA (pinned buffers, copies that do not block the host, an event for the samples): the tokens and
    log-probabilities of the same rollouts without lag."""
    model = bigram_model(tiny_tokenizer).cuda()
    prompts = [prompt_of(tiny_tokenizer, q) for q in BIGRAM_PROMPTS]
    kwargs = dict(num_samples=6, max_tokens=40, temperature=1.0, top_k=0, seeds=[1, 2, 3, 4, 5], max_rows=9)
    (want, want_lp, _), (got, got_lp, _) = both(model, tiny_tokenizer, prompts, decode, True, **kwargs)
    assert got == want and got_lp == want_lp
    assert Engine(model, tiny_tokenizer).spec.lag  # the default on CUDA


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("share_prompts", [True, False])
def test_where_a_lagging_step_would_not_fit_the_rows_are_fed_first(decode, share_prompts, tiny_tokenizer):
    """Rotary tables that end one position after the last a row without lag reaches: the step a lagging batch would
    launch on rows that have just ended (before the host knows it) would be past them. The rows are fed first instead,
    and the rollout gives the tokens without lag, where a launched step would have raised."""
    model = bigram_model(tiny_tokenizer)
    prompts = [prompt_of(tiny_tokenizer, q) for q in BIGRAM_PROMPTS[:3]]
    kwargs = dict(num_samples=3, max_tokens=20, temperature=1.0, top_k=0, seeds=[1, 2, 3], max_rows=4)
    model.rotary_len = max(len(p) for p in prompts) + kwargs["max_tokens"] - 1
    (want, want_lp, _), (got, got_lp, _) = both(model, tiny_tokenizer, prompts, decode, share_prompts, **kwargs)
    assert got == want and got_lp == want_lp
    assert any(len(c[0]) == kwargs["max_tokens"] for per in want for c in per)  # rows that reach the last position


def test_nanochats_generate_never_lags(tiny_tokenizer):
    """generate's columns are steps: a row admitted while others run (more samples than rows) would, lagging, skip
    a column after its first token. It decodes in step with the device, whatever the engine's lag: the columns of an
    engine without lag."""
    model = bigram_model(tiny_tokenizer)
    prompt = prompt_of(tiny_tokenizer, "Natalia sold clips")
    columns = [list(Engine(model, tiny_tokenizer, rollout_spec(model, decode="static", max_rows=3, lag=lag)).generate(
        prompt, num_samples=8, max_tokens=20, temperature=1.0, top_k=0, seed=5)) for lag in (False, True)]
    assert columns[1] == columns[0] and len(columns[0]) > 2


def test_an_engine_lags_by_default_on_cuda_and_not_on_a_cpu(tiny_tokenizer):
    """lag=None resolves by the model's device: on CUDA the host runs a step behind (issue 49's overlap), on a CPU it
    does not (a CPU is its own device: nothing to overlap). A default turned to False everywhere passed every CPU
    test; here a model that says it is on CUDA (its get_device; nothing is allocated there, the engine is only
    built) gets the lag, and an explicit lag wins either way."""
    cpu_model, cuda_model = bigram_model(tiny_tokenizer), bigram_model(tiny_tokenizer)
    cuda_model.get_device = lambda: torch.device("cuda")
    assert Engine(cuda_model, tiny_tokenizer, rollout_spec(cuda_model, decode="eager")).spec.lag is True
    assert Engine(cuda_model, tiny_tokenizer, rollout_spec(cuda_model, decode="eager", lag=False)).spec.lag is False
    assert Engine(cpu_model, tiny_tokenizer).spec.lag is False
    assert Engine(cpu_model, tiny_tokenizer, rollout_spec(cpu_model, lag=True)).spec.lag is True
