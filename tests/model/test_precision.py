"""nanochat.model.precision: the timed choice between fp32 and bf16 (scripted clocks, so no test depends on this
machine's speed), the two workloads it times (a run's rollout, shortened; a training micro-batch), and every rank taking rank 0's choice. The CPU kinds'
detection and its $NANOCHAT_CPU_BF16 override are in test_common.py."""

import time

import pytest
import torch
from gloo_ranks import run_ranks
from helpers import prompt_of, random_model, tiny_config

from nanochat.model import precision


@pytest.fixture(scope="module")
def tiny_model():
    return random_model(tiny_config(sequence_len=64, vocab_size=300, window_pattern="SL"))


@pytest.fixture
def scripted_clock(monkeypatch):
    """time.perf_counter advancing by seconds[dtype] across each timed call, dtype being the autocast dtype in
    force (float32 outside autocast): the measured speed of each dtype is whatever the test sets."""
    seconds = {torch.bfloat16: 1.0, torch.float32: 1.0}
    state = {"t": 0.0, "calls": 0}

    def perf_counter():
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32
        state["calls"] += 1
        if state["calls"] % 2 == 0:  # the second reading of a pair: the step took seconds[dtype]
            state["t"] += seconds[dtype]
        return state["t"]

    monkeypatch.setattr(time, "perf_counter", perf_counter)
    return seconds


class RecordingEngine:
    """What fastest_rollout_dtype uses of an Engine, recording each rollout's autocast dtype and arguments."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def generate_many(self, prompts, **kwargs):
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32
        self.calls.append((dtype, prompts, kwargs))


@pytest.mark.parametrize("measure", ["rollouts", "training"])
def test_bf16_is_chosen_only_when_faster_by_the_margin(measure, tiny_model, scripted_clock):
    """fp32 first (preferred): bf16 replaces it only when its timed step is MARGIN (1.2x) faster."""
    choose = {"rollouts": lambda c: precision.fastest_rollout_dtype(RecordingEngine(tiny_model), [[1, 2]], 4, c),
              "training": lambda c: precision.fastest_training_dtype(tiny_model, rows=2, length=16, candidates=c)}[measure]
    order = list(precision.PREFERENCE)
    assert order == [torch.float32, torch.bfloat16]
    assert choose([torch.float32]) == torch.float32  # one candidate: not timed
    scripted_clock.update({torch.float32: 1.0, torch.bfloat16: 0.5})
    assert choose(order) == torch.bfloat16
    scripted_clock.update({torch.bfloat16: 1.0 / 1.1})  # faster, but within the margin
    assert choose(order) == torch.float32
    scripted_clock.update({torch.bfloat16: 3.0})
    assert choose(order) == torch.float32
    scripted_clock.update({torch.float32: 1.0 / 1.1, torch.bfloat16: 1.0})  # bf16 first: it keeps the near tie
    assert choose(list(reversed(order))) == torch.bfloat16


def test_fastest_dtype_times_each_candidate_under_its_autocast_after_a_warm_up():
    """make_step is built under the candidate's autocast, called once untimed, then `repeats` times timed."""
    calls = []

    def make_step(dtype):
        calls.append(("make", dtype, torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")))
        return lambda: calls.append(("step", dtype, torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")))

    precision.fastest_dtype(make_step, [torch.float32, torch.bfloat16], torch.device("cpu"), repeats=3)
    assert calls == ([("make", torch.float32, False)] + [("step", torch.float32, False)] * 4
                     + [("make", torch.bfloat16, torch.bfloat16)] + [("step", torch.bfloat16, torch.bfloat16)] * 4)


def test_rollout_measurement_runs_the_engines_rollout_in_each_dtype():
    """The rollout timing is the engine's own generate_many over the given prompts and samples, shortened to 16
    tokens: warmed up then timed twice under each candidate's autocast."""
    engine = RecordingEngine(None)
    engine.model = type("Model", (), {"get_device": lambda self: torch.device("cpu")})()
    prompts = [[1, 2, 3], [4, 5]]
    precision.fastest_rollout_dtype(engine, prompts, 8, [torch.float32, torch.bfloat16])
    assert [dtype for dtype, _, _ in engine.calls] == [torch.float32] * 3 + [torch.bfloat16] * 3
    assert all(p == prompts and kw["num_samples"] == 8 and kw["max_tokens"] == 16 for _, p, kw in engine.calls)


def test_rollout_measurement_with_a_real_engine_leaves_the_run_as_it_was(tiny_tokenizer):
    """On a real Engine the timed rollouts run in both dtypes and leave nothing behind that the run would see: the
    global random stream (the engine's rows draw from their own seeded streams) and the model's weights."""
    from nanochat.engine.engine import Engine
    model = random_model(tiny_config(sequence_len=64, vocab_size=tiny_tokenizer.get_vocab_size()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompt = prompt_of(tiny_tokenizer, "How many apples?")
    torch.manual_seed(7)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    chosen = precision.fastest_rollout_dtype(Engine(model, tiny_tokenizer), [prompt, prompt[:-1]], 3,
                                             [torch.float32, torch.bfloat16])
    assert chosen in (torch.float32, torch.bfloat16)
    assert torch.equal(torch.rand(3), expected_next)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_training_measurement_leaves_the_model_as_it_was(tiny_model):
    """The timing's backward passes leave no gradient, the mode is restored and the global random stream (which
    the run's sampling draws from) is untouched."""
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    tiny_model.eval()
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    precision.fastest_training_dtype(tiny_model, rows=2, length=200, candidates=[torch.float32, torch.bfloat16])
    assert torch.equal(torch.rand(3), expected_next)
    assert not tiny_model.training
    assert all(p.grad is None for p in tiny_model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in tiny_model.state_dict().items())


RANK0_CHOICE = """
import torch, torch.distributed as dist
from nanochat.model.precision import rank0_choice
dist.init_process_group("gloo")
rank = dist.get_rank()
def choose():
    assert rank == 0, "only rank 0 measures"
    return torch.bfloat16
print("choice", rank0_choice(choose, [torch.float32, torch.bfloat16]))
dist.destroy_process_group()
"""


def test_every_rank_takes_rank0_choice():
    outputs = run_ranks(lambda rank: ["-c", RANK0_CHOICE])
    assert [out.strip() for out, _ in outputs] == ["choice torch.bfloat16"] * 2
    assert precision.rank0_choice(lambda: torch.float32, [torch.float32, torch.bfloat16]) == torch.float32  # no group
