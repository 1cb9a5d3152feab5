"""--compile=auto decided during a run (nanochat/compiling/rule.py): a part is compiled only where its measured
saving over the steps left pays for its expected compile; the figures a run measures go to a ledger beside Inductor's
cache, which the next run decides from; a part slower compiled goes back to eager; rank 0 decides for every rank;
chat_rl records the decisions in its checkpoints and --resume follows them. Timings are injected: what is checked is
the rule, not this machine's speed. The graphs a run's training forward compiles are counted with Dynamo's tracing
only (Inductor's code generation takes minutes here and is not what is asked)."""

import json

import pytest
import torch
from helpers import HAS_CUDA, TINY_RL_FLAGS, random_model, tiny_config

from nanochat.compiling import rule as compile_rule
from nanochat.compiling.functions import CompiledFunction
from nanochat.compiling.rule import (CHECK_STEPS, PRIOR_COLD_SECONDS_PER_LAYER, PRIOR_RATIO, PRIOR_WARM_FRACTION,
                                     PROBE_STEPS, AutoCompile, CompileLedger, PartRule)
from nanochat.model.gpt import GPT, GPTConfig
from nanochat.rl.advantages import make_question_batch
from nanochat.rl.policy_gradient import accumulate_policy_gradient, chunk_logprobs, one_graph_forward

@pytest.fixture(scope="module", autouse=True)
def no_pretend_cuda():
    """Dynamo saves and restores the CUDA random state around a compile wherever torch.cuda says it is there: the
    session's pretend CUDA (tests/conftest.py) must say what this machine has (as in tests/compiling/test_compile.py)."""
    with pytest.MonkeyPatch.context() as mp:
        if not HAS_CUDA:
            mp.setattr(torch.cuda, "is_available", lambda: False)
            mp.setattr(torch.cuda, "device_count", lambda: 0)
        yield


KEY = "train|jan2026|L4 C256 H2/2 V2048|bfloat16|torch x"


def rule_of(ledger, num_steps, layers=4, start_step=0, state=None, part="train", key=KEY):
    return AutoCompile({part: PartRule(part, key, layers)}, num_steps, ledger, start_step=start_step, state=state)


def feed(auto, steps, eager_s, compiled_s, compile_s=0.0, part="train"):
    """Steps `steps` of the run: eager_s a step until the part switches, then compiled_s (the switch step compiling
    compile_s). Returns every (step, switches) that switched something, and the steps the part ran compiled."""
    switched, compiled_steps, on = [], [], False
    for step in steps:
        seconds = compiled_s if on else eager_s
        spent = compile_s if on and step == auto.parts[part].switched_at else 0.0
        if on:
            compiled_steps.append(step)
        switches = auto.observe(step, {part: seconds}, {part: spent})
        for _, turned_on in switches:
            on = turned_on
        if switches:
            switched.append((step, switches))
    return switched, compiled_steps


def test_a_run_too_short_to_pay_for_a_cold_compile_never_compiles(tmp_path):
    """The speedrun's case: 0.5 s a step of training, 100 steps: (1 - PRIOR_RATIO) x 0.5 x 97 s to save against a cold
    compile of PRIOR_COLD_SECONDS_PER_LAYER x 4 layers: not compiled, and said why."""
    ledger = CompileLedger(str(tmp_path / "ledger.json"))
    auto = rule_of(ledger, 100)
    switched, compiled_steps = feed(auto, range(100), eager_s=0.5, compiled_s=0.4)
    assert switched == [] and compiled_steps == [] and auto.parts["train"].status == "never"
    saving = 0.5 * (1 - PRIOR_RATIO["train"]) * (100 - PROBE_STEPS - 1)
    cost = PRIOR_COLD_SECONDS_PER_LAYER["train"] * 4
    assert auto.said == [f"compile: auto: training forward 0.50 s a step eagerly, compiled expected x{PRIOR_RATIO['train']:.2f}: "
                         f"{saving:.0f} s saved over {100 - PROBE_STEPS - 1} steps against a {cost:.0f} s compile "
                         f"(cold, estimated): not compiled"]
    assert ledger.entries == {}  # nothing compiled, nothing measured to record


def test_a_long_run_compiles_after_its_probe_and_records_what_it_measured(tmp_path):
    """A run long enough to pay: eager for the warm-up step and PROBE_STEPS timed steps, compiled from the next; CHECK_STEPS
    compiled steps later (the step that compiled not counted) kept, and the ledger holds the compile's seconds (cold)
    and the measured ratio."""
    ledger = CompileLedger(str(tmp_path / "ledger.json"))
    auto = rule_of(ledger, 1000)
    switched, compiled_steps = feed(auto, range(20), eager_s=2.0, compiled_s=1.5, compile_s=90.0)
    first = 1 + PROBE_STEPS  # the step the part first runs compiled
    assert switched == [(first - 1, [("train", True)])]
    assert compiled_steps == list(range(first, 20))
    rule = auto.parts["train"]
    assert rule.status == "kept" and rule.switched_at == first and rule.back_at is None
    assert rule.eager == [2.0] * PROBE_STEPS and rule.compiled == [1.5] * CHECK_STEPS
    assert json.loads((tmp_path / "ledger.json").read_text()) == {KEY: {"cold_s": 90.0, "ratio": 0.75}}
    assert auto.said[-1] == "compile: auto: training forward 1.50 s a step compiled against 2.00 s eagerly (compiled in 90 s): kept"


def test_the_next_run_decides_from_the_ledger_warm_cache_and_measured_ratio(tmp_path):
    """A compile the ledger has seen is in Inductor's cache (the ledger lives beside it): expected at PRIOR_WARM_FRACTION
    of its cold seconds, then at its own warm seconds once measured; the saving at the ratio measured here. A run
    that a cold compile would not pay for compiles warm."""
    path = str(tmp_path / "ledger.json")
    CompileLedger(path).record(KEY, cold_s=200.0, ratio=0.5)
    ledger = CompileLedger(path)
    assert PartRule("train", KEY, 4).expected_compile_seconds(ledger) == (PRIOR_WARM_FRACTION * 200.0, "in Inductor's cache")
    assert PartRule("train", KEY, 4).expected_ratio(ledger) == 0.5
    # 0.5 s a step x 0.5 x 197 steps = 49 s: above the warm 50 s? no; 300 steps: 74 s, above it
    short, long_ = rule_of(ledger, 200), rule_of(ledger, 300)
    assert feed(short, range(10), 0.5, 0.25)[0] == []
    assert feed(long_, range(10), 0.5, 0.25, compile_s=12.0)[0][0] == (PROBE_STEPS, [("train", True)])
    assert json.loads(open(path).read())[KEY] == {"cold_s": 200.0, "warm_s": 12.0, "ratio": 0.5}
    assert PartRule("train", KEY, 4).expected_compile_seconds(CompileLedger(path)) == (12.0, "in Inductor's cache, measured")
    # another key (another model, dtype or torch) is cold: the ledger says nothing of its graphs
    other = KEY.replace("L4", "L8")
    assert PartRule("train", other, 8).expected_compile_seconds(ledger) == (8 * PRIOR_COLD_SECONDS_PER_LAYER["train"], "cold, estimated")


def test_a_part_slower_compiled_goes_back_to_eager_and_the_next_run_does_not_compile_it(tmp_path):
    path = str(tmp_path / "ledger.json")
    auto = rule_of(CompileLedger(path), 1000)
    switched, compiled_steps = feed(auto, range(12), eager_s=2.0, compiled_s=2.4, compile_s=30.0)
    back = 1 + PROBE_STEPS + CHECK_STEPS + 1  # the first step eager again
    assert switched == [(PROBE_STEPS, [("train", True)]), (back - 1, [("train", False)])]
    assert compiled_steps == list(range(1 + PROBE_STEPS, back))
    assert auto.parts["train"].status == "back" and auto.parts["train"].back_at == back
    assert auto.said[-1].endswith(f"eager again from step {back}")
    assert json.loads(open(path).read())[KEY]["ratio"] == 1.2
    again = rule_of(CompileLedger(path), 100000)  # no saving expected, however long the run
    assert feed(again, range(10), 2.0, 2.4)[0] == [] and again.parts["train"].status == "never"


def test_a_resumed_run_takes_its_decisions_so_far(tmp_path):
    """compile_auto as a checkpoint records it: a part switched at or before the resumed step is compiled from the
    resume on (nothing more to time), one given back stays eager, one decided against stays so; a switch after the
    resumed step (a checkpoint of step 4 written before the switch at 5 took effect) is measured anew."""
    state = {"train": {"status": "kept", "switched_at": 3, "back_at": None},
             "decode": {"status": "back", "switched_at": 3, "back_at": 6}}
    auto = AutoCompile({"train": PartRule("train", KEY, 4), "decode": PartRule("decode", KEY.replace("train", "decode"), 4)}, 100,
                       CompileLedger(str(tmp_path / "ledger.json")), start_step=7, state=state)
    assert auto.compiled_now("train") and not auto.compiled_now("decode")
    assert auto.state() == {"train": {"status": "kept", "switched_at": 3, "back_at": None},
                            "decode": {"status": "back", "switched_at": 3, "back_at": 6}}
    early = AutoCompile({"train": PartRule("train", KEY, 4)}, 100, None, start_step=5,
                        state={"train": {"status": "compiled", "switched_at": 6, "back_at": None}})
    assert not early.compiled_now("train") and early.parts["train"].status == "eager"
    never = AutoCompile({"train": PartRule("train", KEY, 4)}, 100, None, start_step=5,
                        state={"train": {"status": "never", "switched_at": None, "back_at": None}})
    assert never.parts["train"].status == "never" and never.observe(6, {"train": 9.0}, {}) == []


def test_an_unreadable_ledger_is_an_empty_one(tmp_path):
    (tmp_path / "ledger.json").write_text("{not json")
    assert CompileLedger(str(tmp_path / "ledger.json")).entries == {}
    (tmp_path / "list.json").write_text("[1, 2]")
    assert CompileLedger(str(tmp_path / "list.json")).entries == {}


RANK0_DECIDES = """
import sys, torch, torch.distributed as dist
from nanochat.compiling.rule import AutoCompile, CompileLedger, PartRule, PROBE_STEPS
dist.init_process_group("gloo")
rank = dist.get_rank()
auto = AutoCompile({"train": PartRule("train", "k", 4)}, 1000, CompileLedger(sys.argv[1] + f"/ledger{rank}.json"),
                   records=rank == 0)
eager = 5.0 if rank == 0 else 0.01  # rank 1 alone would never compile
for step in range(1 + PROBE_STEPS):
    switches = auto.observe(step, {"train": eager}, {}, torch.device("cpu"), 2)
print(switches, auto.parts["train"].status, auto.parts["train"].switched_at)
dist.destroy_process_group()
"""


def test_every_rank_takes_rank_0s_decision(tmp_path):
    from gloo_ranks import run_ranks
    outputs = run_ranks(lambda rank: ["-c", RANK0_DECIDES, str(tmp_path)])
    expected = f"[('train', True)] compiled {1 + PROBE_STEPS}"
    assert [out.strip() for out, _ in outputs] == [expected] * 2


def graph_as_traced(graph_module, example_inputs):
    return graph_module.forward


def test_one_and_several_prompt_chunks_share_one_compiled_graph():
    """The training forward compiled (Dynamo's graph, run as traced): chunks of one question's rows (a slice of its
    inputs, row_prompt None) and of several (padded prompts, row_prompt a tensor) go through one graph, and give
    eager's gradient. Without one_graph_forward they were two graphs (~45 s each for the speedrun's d4 on a CPU)."""
    model = random_model(tiny_config(n_layer=2, vocab_size=128, n_embd=32, n_head=2, n_kv_head=2), seed=3).double()
    gen = torch.Generator().manual_seed(0)
    batches = []
    for prompt_length, rewards in [(20, [1, 0, 0, 1]), (33, [0, 1, 1, 1]), (27, [1, 0, 1, 0])]:
        prompt = torch.randint(1, 128, (prompt_length,), generator=gen).tolist()
        completions = [(torch.randint(1, 128, (n,), generator=gen).tolist(), [1] * n) for n in (9, 14, 5, 11)]
        batches.append(make_question_batch(prompt, completions, rewards, 0))

    def gradient(forward, rows):
        model.zero_grad(set_to_none=True)
        accumulate_policy_gradient(model, batches, 2, 3, "cpu", torch.autocast("cpu", enabled=False),
                                   micro_batch_rows=rows, forward=forward)
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    traced = CompiledFunction(chunk_logprobs, True, announce=False, graph_compiler=graph_as_traced)
    calls = []

    def counting(model, rows, prompts, prompt_lengths, row_prompt, *rest):
        calls.append(row_prompt is None)
        return traced(model, rows, prompts, prompt_lengths, row_prompt, *rest, required=True)
    forward = one_graph_forward(counting)
    for rows in (4, 8, 6):  # 4: a question a forward; 8: two; 6: one and a half, then the rest
        assert torch.allclose(gradient(forward, rows), gradient(chunk_logprobs, rows), rtol=1e-9, atol=1e-12)
    assert calls.count(False) == len(calls) and traced.compiles == 1


class CountedTraced(CompiledFunction):
    """A CompiledFunction run as Dynamo traced it, counting its calls."""

    def __init__(self):
        super().__init__(chunk_logprobs, True, graph_compiler=graph_as_traced)
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return super().__call__(*args, **kwargs)


def test_chat_rl_auto_compiles_where_it_pays_records_it_and_resume_follows(sft, base_dir, monkeypatch, capsys):
    """A chat_rl run with --compile=auto whose training forward is expected to compile for nothing (prior cost 0):
    eager for the first 1 + PROBE_STEPS steps, compiled from then on (the compiled steps' check put off past the run's
    end); the checkpoints record the step; --resume from a later step runs it compiled from its first step, where a
    decision made anew would not compile (cost made huge). The ledger is in Inductor's cache folder."""
    from nanochat.compiling import functions as nc_functions
    from scripts import chat_rl
    traced = CountedTraced()
    monkeypatch.setitem(nc_functions._COMPILED, (chunk_logprobs, True), traced)
    monkeypatch.setitem(compile_rule.PRIOR_COLD_SECONDS_PER_LAYER, "train", 0.0)
    monkeypatch.setitem(compile_rule.PRIOR_RATIO, "train", 0.5)
    monkeypatch.setattr(compile_rule, "CHECK_STEPS", 1000)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(base_dir / "inductor"))
    steps, saved = 8, 2 + PROBE_STEPS  # the part switches at step 1 + PROBE_STEPS; a checkpoint of the step after
    chat_rl.main(TINY_RL_FLAGS + [f"--num-steps={steps}", f"--save-every={saved}", "--overwrite", "--compile=auto"])
    out = capsys.readouterr().out
    assert "compile: nothing yet; each part timed eagerly over the first steps" in out
    assert f"compiling it from step {1 + PROBE_STEPS}" in out
    run_dir = base_dir / "chatrl_checkpoints" / "d2"
    meta = json.loads((run_dir / f"meta_{saved:06d}.json").read_text())
    assert [r["step"] for r in meta["history"] if r["compiles"] > 0] == [1 + PROBE_STEPS]
    assert meta["compile_auto"]["train"] == {"status": "compiled", "switched_at": 1 + PROBE_STEPS, "back_at": None}
    assert traced.calls > 0
    traced.calls = 0
    monkeypatch.setitem(compile_rule.PRIOR_COLD_SECONDS_PER_LAYER, "train", 1e9)
    chat_rl.main(TINY_RL_FLAGS + [f"--resume=d2:{saved}", "--compile=auto"])
    out = capsys.readouterr().out
    resumed = json.loads((run_dir / f"meta_{steps - 1:06d}.json").read_text())
    assert resumed["compile_auto"]["train"] == {"status": "kept", "switched_at": 1 + PROBE_STEPS, "back_at": None}
    assert traced.calls > 0 and "compile: auto:" not in out  # compiled from the resume on, nothing decided anew


def test_the_measured_plan_is_chat_rls_auto_on_a_cpu_only():
    """compile_plan(measured=True), chat_rl's: auto on a CPU compiles nothing at the start and measures; on CUDA,
    MPS, with on/off/blocks, or for a script that trains nothing, the plan is what it was without."""
    from nanochat.compiling.plan import compile_plan
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    plan = compile_plan("auto", cpu, "eager", 467, measured=True)
    assert plan.measured and (plan.decode, plan.train, plan.compiles) == (False, False, False)
    assert plan.describe() == ("compile: nothing yet; each part timed eagerly over the first steps, then compiled where "
                               "its saving pays for its compile (auto on a CPU; --compile to choose)")
    for args in [("auto", cuda, "graph", 467), ("on", cpu, "static", 467), ("off", cpu, "eager", 467),
                 ("blocks", cpu, "eager", 467), ("auto", torch.device("mps"), "eager", 467)]:
        assert compile_plan(*args, measured=True) == compile_plan(*args)
    no_training = ("auto", cpu, "static", 467)
    assert compile_plan(*no_training, trains=False, measured=True) == compile_plan(*no_training, trains=False)


def test_a_run_compiling_from_its_start_records_its_compile_for_a_later_auto_run(tmp_path):
    """--compile=on: the parts compiled from the start are not timed or given back, but what their compiles cost (the
    step's and an eval's graphs after it) goes to the ledger, cold the first time and warm once the ledger has them,
    so that a later auto run knows the graphs are in Inductor's cache."""
    path = str(tmp_path / "ledger.json")
    first = AutoCompile({"train": PartRule("train", KEY, 4)}, 100, CompileLedger(path), compiled=("train",))
    assert first.compiled_now("train")
    assert first.observe(0, {"train": 9.0}, {"train": 40.0}) == []
    assert first.observe(1, {"train": 1.0}, {"train": 0.0}) == []
    assert first.observe(50, {"train": 1.0}, {"train": 8.0}) == []  # an eval's graphs compiled since step 49
    assert json.loads(open(path).read()) == {KEY: {"cold_s": 48.0}} and first.take_said() == []
    second = AutoCompile({"train": PartRule("train", KEY, 4)}, 100, CompileLedger(path), compiled=("train",))
    second.observe(0, {"train": 3.0}, {"train": 2.5})
    assert json.loads(open(path).read()) == {KEY: {"cold_s": 48.0, "warm_s": 2.5}}
    assert PartRule("train", KEY, 4).expected_compile_seconds(CompileLedger(path)) == (2.5, "in Inductor's cache, measured")


def test_the_engine_decodes_in_the_resolved_mode_unless_auto_switched_before_the_resume(tmp_path):
    """--compile=on keeps --decode's mode (graph on CUDA: the engine's CUDA graphs capture the compiled step); auto,
    resumed after it switched the decode step, starts on the compiled static step, the spec the switch made
    (RolloutSpec.with_step_compiled); otherwise the resolved mode, uncompiled (the run's RolloutSpec:
    run_rollout_spec)."""
    from types import SimpleNamespace

    from nanochat.compiling.plan import CompilePlan
    from nanochat.rl.plan import run_rollout_spec
    ledger = CompileLedger(str(tmp_path / "ledger.json"))
    config = lambda decode: SimpleNamespace(decode=decode, max_rows=0, calculator_format="str",  # noqa: E731
                                             decode_kernels="torch")

    def spec(decode, device, compiling, auto_compile):
        return run_rollout_spec(config(decode), torch.device(device), compiling, auto_compile, 4.0, "float32")
    on = CompilePlan(True, True, "--compile=on")
    recording_on = AutoCompile({"decode": PartRule("decode", KEY, 4)}, 100, ledger, compiled=("decode",))
    assert (spec("auto", "cuda", on, recording_on).decode, spec("auto", "cuda", on, recording_on).compiled) == (
        "graph", True)
    static = spec("static", "cpu", on, recording_on)
    assert (static.decode, static.compiled) == ("static", True)
    measured = CompilePlan(False, False, "auto on a CPU", measured=True)
    switched = AutoCompile({"decode": PartRule("decode", KEY, 4)}, 100, ledger, start_step=7,
                           state={"decode": {"status": "kept", "switched_at": 3, "back_at": None}})
    fresh = AutoCompile({"decode": PartRule("decode", KEY, 4)}, 100, ledger)
    resumed, started = spec("auto", "cpu", measured, switched), spec("auto", "cpu", measured, fresh)
    assert (resumed.decode, resumed.compiled, started.decode, started.compiled) == ("static", True, "eager", False)
    assert resumed == started.with_step_compiled(True, "auto", torch.device("cpu"))
    assert started == resumed.with_step_compiled(False, "auto", torch.device("cpu"))
    off = spec("auto", "cpu", CompilePlan(False, False, "--compile=off"), None)
    assert (off.decode, off.compiled, off.memory_budget_gb, off.max_rows) == ("eager", False, 4.0, None)


def test_the_ledger_key_changes_with_everything_a_compile_depends_on(monkeypatch):
    """compile_rule.part_key, written out for one model (issue 67: a key without torch's version passed this file, and
    after a torch upgrade a run would read the old version's compile seconds as a warm cache while Inductor compiles
    everything again cold): then each field changed alone gives a key of its own, none equal to another."""
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    config = dict(sequence_len=64, vocab_size=96, n_layer=2, n_head=2, n_kv_head=1, n_embd=64)
    model = GPT(GPTConfig(**config), "jan2026")
    key = compile_rule.part_key("train", model, torch.bfloat16)
    assert key == "train|jan2026|L2 C64 H2/1 V96|torch.bfloat16|cpu|torch 2.13.0+cpu"
    variants = {"part": compile_rule.part_key("decode", model, torch.bfloat16),
                "generation": compile_rule.part_key("train", GPT(GPTConfig(**config), "smear"), torch.bfloat16),
                "dtype": compile_rule.part_key("train", model, torch.float32)}
    for field, value in (("n_layer", 3), ("n_embd", 128), ("n_head", 4), ("n_kv_head", 2), ("vocab_size", 128)):
        variants[field] = compile_rule.part_key("train", GPT(GPTConfig(**{**config, field: value}), "jan2026"),
                                                torch.bfloat16)
    with torch.device("meta"):
        variants["device"] = compile_rule.part_key("train", GPT(GPTConfig(**config), "jan2026"), torch.bfloat16)
    monkeypatch.setattr(torch, "__version__", "2.14.0+cpu")
    variants["torch"] = compile_rule.part_key("train", model, torch.bfloat16)
    assert len(set(variants.values()) | {key}) == len(variants) + 1, variants


def test_after_a_torch_upgrade_the_ledger_expects_a_cold_compile(tmp_path, monkeypatch):
    """A ledger written under torch 2.13 holds a warm compile of 10 s; under torch 2.14 the same part of the same model
    is expected cold (Inductor's cache is keyed on torch's version), and the run that a warm compile would pay for
    does not compile."""
    model = random_model(tiny_config())
    path = str(tmp_path / "ledger.json")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    old = compile_rule.part_key("train", model, torch.float32)
    CompileLedger(path).record(old, cold_s=40.0, warm_s=10.0, ratio=0.5)
    assert PartRule("train", old, 4).expected_compile_seconds(CompileLedger(path)) == (10.0, "in Inductor's cache, measured")
    monkeypatch.setattr(torch, "__version__", "2.14.0+cpu")
    new = compile_rule.part_key("train", model, torch.float32)
    layers = model.config.n_layer
    assert PartRule("train", new, layers).expected_compile_seconds(CompileLedger(path)) == (
        layers * PRIOR_COLD_SECONDS_PER_LAYER["train"], "cold, estimated")
    # 0.5 s a step for 100 steps: at the ledger's ratio 0.5 a 10 s warm compile pays (24 s saved); a cold one does not
    warm, upgraded = rule_of(CompileLedger(path), 100, key=old), rule_of(CompileLedger(path), 100, key=new, layers=layers)
    assert feed(warm, range(10), 0.5, 0.25)[0][0] == (PROBE_STEPS, [("train", True)])
    assert feed(upgraded, range(10), 0.5, 0.25)[0] == []
