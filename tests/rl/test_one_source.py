"""The sources hold each setting in one place (issues 60 and 68), read from the code's own files:
- no flag of chat_rl is declared outside its setting (nanochat/rl/config.py's SETTINGS, nanochat/settings.py's SHARED),
  and no script declares a shared flag itself, whatever its help (a script's own help or default is Setting.varied);
- no script imports another script (shared logic belongs in the library);
- nothing writes a field of a config once it is built (what a run resolves is its RunPlan);
- nothing but nanochat/rl/run.py writes a field of the run, and nothing changes its progress but RunProgress's methods;
- nothing outside nanochat/engine/ writes a field of an engine, and a run's engine runs its plan's RolloutSpec, the one
  resolved for it, after --compile=auto switches too (issue 68);
- no error raised below the config names a flag: the library states the facts, nanochat.cli or the config the flag."""

import ast
import dataclasses

import pytest
import torch
from helpers import REPO, random_model, tiny_config

from nanochat import cli
from nanochat.compiling.plan import CompilePlan
from nanochat.engine.decode_batch import static_step
from nanochat.engine.engine import Engine
from nanochat.engine.spec import rollout_spec
from nanochat.rl import auto_switch
from nanochat.rl.auto_switch import CompileMarks, auto_compile_step, switched
from nanochat.rl.config import RLConfig
from nanochat.rl.plan import RunPlan, run_rollout_spec
from nanochat.rl.rollout import longest_prompt
from nanochat.rl.run import build_run
from nanochat.rl.training import TrainingState
from nanochat.settings import SCRIPT_DEFAULTS, SHARED
from tasks.arithmetic import Arithmetic

CONFIG_FIELDS = set(RLConfig.__dataclass_fields__)
# where flags may be named in messages: the command-line layer, the settings and the config that checks them
FLAG_SOURCES = {"nanochat/cli.py", "nanochat/settings.py", "nanochat/rl/config.py"}


def sources(*folders):
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            yield str(path.relative_to(REPO)), ast.parse(path.read_text(), str(path))


def calls_named(tree, name):
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and (getattr(node.func, "attr", None) == name or getattr(node.func, "id", None) == name)]


def literal_flags(call):
    return [arg.value for arg in call.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")]


def declarations(tree):
    """The calls that declare a flag: add_argument, and a name bound to it (bench_rl's `add = p.add_argument`)."""
    aliases = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
               and getattr(node.value, "attr", None) == "add_argument"
               for target in node.targets if isinstance(target, ast.Name)}
    return calls_named(tree, "add_argument") + [call for name in aliases for call in calls_named(tree, name)]


def declared_outside_their_settings(path, tree):
    """'path:line [flags]' of each declaration the settings forbid: in the library, any literal --flag (the library
    declares every flag from a Setting); in chat_rl, any (its parser is RLConfig's fields); in another script, a shared
    setting's flag, whatever its help or default (a script's own are Setting.varied: nanochat.cli.add_shared_flag)."""
    shared = {cli.flag_name(name) for name in SHARED}
    return [f"{path}:{call.lineno} {literal_flags(call)}" for call in declarations(tree)
            if (path.startswith("nanochat/") and literal_flags(call)) or path == "scripts/chat_rl.py"
            or shared & set(literal_flags(call))]


def test_no_flag_is_declared_outside_its_setting():
    """No flag is declared outside its Setting (declared_outside_their_settings); chat_rl's parser is RLConfig's
    fields."""
    assert [line for path, tree in sources("nanochat", "scripts") for line in declared_outside_their_settings(path, tree)
            ] == []
    parser = cli.rl_parser()
    assert {a.dest for a in parser._actions if a.dest != "help"} == CONFIG_FIELDS


def test_the_scan_finds_a_shared_flag_declared_by_hand():
    """The scan itself, on made-up scripts: a shared flag declared with its own help, short option and default (as
    chat_cli's -t --temperature was), or through a name bound to add_argument (as bench_rl's --seed was), is found; a
    script's own flag and a shared flag taken from its setting are not."""
    script = ast.parse('p.add_argument("-t", "--temperature", type=float, default=0.6, help="livelier")\n'
                       'add = p.add_argument\n'
                       'add("--seed", type=int, default=42, help="seed of the random-init model")\n'
                       'p.add_argument("--prompt", default="", help="one question")\n'
                       'add_shared_flag(p, "top_k", "-k")\n')
    assert declared_outside_their_settings("scripts/made_up.py", script) == [
        "scripts/made_up.py:1 ['--temperature']", "scripts/made_up.py:3 ['--seed']"]


def test_a_scripts_own_defaults_are_the_tables_not_literals():
    """A shared flag whose default a script changes on purpose takes it from settings.SCRIPT_DEFAULTS (by script and
    setting), never from a default= of its own in the add_shared_flag call; the table names real scripts and shared
    settings, and each script that has an entry declares the flags it names."""
    literal = [f"{path}:{call.lineno}" for path, tree in sources("scripts") for call in calls_named(tree, "add_shared_flag")
               if any(k.arg == "default" for k in call.keywords)]
    assert literal == []
    for script, defaults in SCRIPT_DEFAULTS.items():
        assert set(defaults) <= set(SHARED) and (REPO / "scripts" / f"{script}.py").is_file()
        tree = ast.parse((REPO / "scripts" / f"{script}.py").read_text())
        named = {call.args[1].value for call in calls_named(tree, "add_shared_flag")
                 if any(k.arg == "script" and getattr(k.value, "value", None) == script for k in call.keywords)}
        assert named == set(defaults), script


def test_no_script_imports_another_script():
    found = []
    for path, tree in sources("scripts"):
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path}:{node.lineno} {n}" for n in names if n == "scripts" or n.startswith("scripts.")]
    assert found == []


def is_config(node):
    """A name the library and chat_rl give a run's configuration: config, cfg, args, or something's .config."""
    return (isinstance(node, ast.Name) and node.id in ("config", "cfg", "args")) or (
        isinstance(node, ast.Attribute) and node.attr == "config")


def test_nothing_writes_a_config_field_after_construction():
    """No assignment to a config's field (RLConfig is frozen; a Namespace or another object standing for it is not),
    no setattr on one, and object.__setattr__ only on self, in construction (RLConfig.__post_init__)."""
    found = []
    for path, tree in sources("nanochat"):
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                       if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and t.attr in CONFIG_FIELDS and is_config(t.value):
                        found.append(f"{path}:{node.lineno} {ast.unparse(t)} =")
        for call in calls_named(tree, "setattr") + calls_named(tree, "__setattr__"):
            first = call.args[0] if call.args else None
            on_self = isinstance(first, ast.Name) and first.id == "self" and path == "nanochat/rl/config.py"
            if is_config(first) or (getattr(call.func, "attr", None) == "__setattr__" and not on_self):
                found.append(f"{path}:{call.lineno} {ast.unparse(call)}")
    assert found == []


def test_only_the_run_s_module_writes_the_run_and_only_its_methods_change_its_progress():
    """A run (`run`, an RLRun) is written only in nanochat/rl/run.py (its factory, its switches of engine and forward);
    its progress (history, data position, counters, timings) is changed by RunProgress's methods alone: no assignment
    to `run.progress.<field>` and no in-place call (append, clear, ...) on one elsewhere."""
    def is_run(node):
        return isinstance(node, ast.Name) and node.id == "run"

    def is_progress(node):
        return isinstance(node, ast.Attribute) and node.attr == "progress" and is_run(node.value)
    found = []
    for path, tree in list(sources("nanochat")) + list(sources("scripts")):
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                       if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                base = target.value if isinstance(target, ast.Subscript) else target
                if isinstance(base, ast.Attribute) and (is_progress(base.value) or (
                        is_run(base.value) and path != "nanochat/rl/run.py")):
                    found.append(f"{path}:{node.lineno} {ast.unparse(target)} =")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Attribute) and is_progress(node.func.value.value)):
                found.append(f"{path}:{node.lineno} {ast.unparse(node)}")
    assert found == []


def is_engine(node):
    """A name the library and the scripts give an Engine: engine, or something's .engine (run.engine)."""
    return (isinstance(node, ast.Name) and node.id == "engine") or (
        isinstance(node, ast.Attribute) and node.attr == "engine")


def engine_writes(path, tree):
    """Each assignment to an engine's field (or into one: engine.memory.kept[0] = ...) and each setattr on an engine."""
    found = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                   if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        found += [f"{path}:{node.lineno} {ast.unparse(t)} =" for target in targets for t in ast.walk(target)
                  if isinstance(t, ast.Attribute) and is_engine(t.value)]
    found += [f"{path}:{call.lineno} {ast.unparse(call)}" for call in calls_named(tree, "setattr")
              if call.args and is_engine(call.args[0])]
    return found


def test_nothing_outside_the_engine_writes_an_engines_field():
    """The engine owns how its rollouts run and the memory it holds (issue 68): outside nanochat/engine/ nothing
    assigns an engine's field (run.py set `engine.max_rows` for its out-of-memory retries, bench_eval
    `engine.prefill_tokens`); a run asks through its methods (reconfigure, memory.yield_memory,
    generate_many(within_memory=True)). Its memory's fields are its fields."""
    assert engine_writes("snippet", ast.parse("run.engine.max_rows = 4\nengine.prefill_tokens += 1\n"
                                              "setattr(engine, 'decode', 'static')\nengine.memory.max_rows = 2")) == [
        "snippet:1 run.engine.max_rows =", "snippet:2 engine.prefill_tokens =",
        "snippet:4 engine.memory =", "snippet:3 setattr(engine, 'decode', 'static')"]
    assert engine_writes("snippet", ast.parse("run.engine = Engine(model, tokenizer, spec=spec)")) == []
    found = [write for path, tree in list(sources("nanochat")) + list(sources("scripts"))
             if not path.startswith("nanochat/engine/") for write in engine_writes(path, tree)]
    assert found == []


class Switches:
    """--compile=auto's AutoCompile as auto_compile_step sees it, deciding `switches` one step after another."""

    def __init__(self, *switches):
        self.switches = list(switches)

    def observe(self, step, seconds, compiled, device, world_size):
        return [self.switches.pop(0)]

    def take_said(self):
        return []


def test_the_engine_runs_the_plans_spec_after_an_auto_switch(tiny_tokenizer):
    """A run's RolloutSpec is resolved once, into its plan (run_rollout_spec, through the engine's
    resolve_rollout_spec), and its engine is built from it. Where --compile=auto switches the decode step, a new spec
    replaces the plan's and the same engine runs it (Engine.reconfigure): the plan's spec and the engine's are one
    (the engine was rebuilt from flags, its decode apart from the frozen plan's), its batch still sized for the tasks'
    prompts, and what a checkpoint records is as it was (user_config; compile_auto is the AutoCompile's)."""
    cpu, config = torch.device("cpu"), RLConfig(device_type="cpu", compile="auto")
    model = random_model(tiny_config(vocab_size=tiny_tokenizer.get_vocab_size()))
    measured = CompilePlan(False, False, "auto on a CPU", measured=True)
    plan = RunPlan(dtype="float32", rollout_dtype="float32", decode="eager", compile="auto", memory_budget_gb=4.0,
                   output_tag="d2", keep_last=0, spec=run_rollout_spec(config, cpu, measured, None, 4.0, "float32"))
    task = Arithmetic(size=4)
    engine = Engine(model, tiny_tokenizer, spec=plan.spec)
    run = build_run(config, plan, model, tiny_tokenizer, engine, [], (task, task), cpu, steps=(0, 10), rows=4,
                    compiled=False, auto_compile=Switches(("decode", True), ("decode", False)))
    recorded = run.user_config

    def end_of_step(step):  # the compile seconds a step's rollouts start from (RLRun.step), then its end
        run.compile_marks = run.compile_marks.rollouts_begin()
        auto_compile_step(run, step, 1.0, 1.0)
    assert (engine.spec.decode, engine.spec.compiled, engine.step) == ("eager", False, static_step)
    end_of_step(0)
    assert run.engine is engine and engine.spec is run.plan.spec
    assert run.plan.spec == plan.spec.with_step_compiled(True, "auto", cpu) != plan.spec
    assert (engine.spec.decode, engine.spec.compiled, engine.step is static_step) == ("static", True, False)
    assert engine.prompt_floor == longest_prompt(tiny_tokenizer, task) and run.user_config == recorded
    end_of_step(1)
    assert engine.spec is run.plan.spec and run.plan.spec == plan.spec and engine.step is static_step
    assert run.user_config == recorded


def test_an_auto_switch_is_a_new_plan_and_training_state_the_old_ones_as_they_were(monkeypatch):
    """--compile=auto's switches are one transition (auto_switch.switched): given the run's plan and training state,
    a decode switch returns the plan with the spec RolloutSpec.with_step_compiled makes for the run's --decode (the
    training state the same value), a train switch the training state with the forward training_forward makes for
    the switch, loss-scaled with the run's scale (the plan the same value), both switches both; nothing changed in
    place."""
    cpu, config = torch.device("cpu"), RLConfig(device_type="cpu", compile="auto")
    measured = CompilePlan(False, False, "auto on a CPU", measured=True)
    plan = RunPlan(dtype="float32", rollout_dtype="float32", decode="eager", compile="auto", memory_budget_gb=4.0,
                   output_tag="d2", keep_last=0, spec=run_rollout_spec(config, cpu, measured, None, 4.0, "float32"))
    training = TrainingState(policy_loss=None, forward="eager forward", rows=8, loss_scale="the scale")
    monkeypatch.setattr(auto_switch, "training_forward", lambda on, scale: ("forward", on, scale))
    decode_on = dataclasses.replace(plan, spec=plan.spec.with_step_compiled(True, "auto", cpu))
    assert decode_on.spec.decode == "static" and decode_on != plan
    assert switched(plan, training, [("decode", True)], "auto", cpu) == (decode_on, training)
    train_on = dataclasses.replace(training, forward=("forward", True, "the scale"))
    assert switched(plan, training, [("train", True)], "auto", cpu) == (plan, train_on)
    assert switched(plan, training, [("train", True), ("decode", True)], "auto", cpu) == (decode_on, train_on)
    assert switched(decode_on, train_on, [("decode", False), ("train", False)], "auto", cpu) == (
        plan, dataclasses.replace(training, forward=("forward", False, "the scale")))
    assert training.forward == "eager forward" and plan.spec.decode == "eager"


def test_compile_marks_leave_a_steps_compiling_out_of_its_parts_seconds(monkeypatch):
    """CompileMarks: a step's seconds of each part are its half's seconds less what the part compiled since the
    rollouts began (never below 0); what each part compiled is counted from the last step's end (an eval's graphs
    between steps included); the step's end is the next step's mark."""
    totals = iter([{"train": 1.0, "decode": 2.0}, {"train": 3.0, "decode": 2.0}, {"train": 6.0, "decode": 2.5}])
    monkeypatch.setattr(auto_switch, "part_compile_seconds", lambda: next(totals))
    marks = CompileMarks.at_start()
    assert marks == CompileMarks(at_rollouts={"train": 1.0, "decode": 2.0}, at_step_end={"train": 1.0, "decode": 2.0})
    marks = marks.rollouts_begin()  # an eval compiled 2 s of the training forward before this step's rollouts
    seconds, compiled, ended = marks.step_end(t_rollout=5.0, t_train=2.0)
    assert seconds == {"train": 0.0, "decode": 4.5}  # train: 2 s less the 3 s compiled in the step, at least 0
    assert compiled == {"train": 5.0, "decode": 0.5}
    assert ended == CompileMarks(at_rollouts={"train": 3.0, "decode": 2.0}, at_step_end={"train": 6.0, "decode": 2.5})
    totals = iter([{"train": 7.0, "decode": 2.5}])
    seconds, _, _ = ended.step_end(t_rollout=5.0, t_train=6.0)
    assert seconds == {"train": 2.0, "decode": 4.5}


def raised_texts(tree):
    """(line, text) of each string in what the module raises: raise statements, require(...), a call of a class named
    ...Error, and what an ...Error class passes to its base's __init__."""
    nodes = [n.exc for n in ast.walk(tree) if isinstance(n, ast.Raise) and n.exc is not None]
    nodes += [c for c in ast.walk(tree) if isinstance(c, ast.Call)
              and (getattr(c.func, "id", "") == "require" or getattr(c.func, "id", "").endswith("Error"))]
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name.endswith("Error")):
        nodes += [c for c in calls_named(cls, "__init__") if isinstance(c.func.value, ast.Call)]  # super().__init__
    return {(s.lineno, s.value) for n in nodes for s in ast.walk(n)
            if isinstance(s, ast.Constant) and isinstance(s.value, str)}


def test_no_error_raised_below_the_config_names_a_flag():
    """The engine, the model, the checkpoints, the optimizers and the run (plan, run, resume, ...) raise errors of
    facts; nanochat.cli's HINTS and LINES, or the config's own checks, add the flag (17 strings named one before)."""
    found = [f"{path}:{line} {text!r}" for path, tree in sources("nanochat", "tasks") if path not in FLAG_SOURCES
             for line, text in raised_texts(tree) if "--" in text]
    assert found == []


def test_a_runs_engine_must_decode_in_the_plans_rollout_dtype(tiny_tokenizer):
    """The plan's rollout dtype is the one the run's engine decodes in (its spec's: the rollouts and evals take no
    autocast from the run); an engine built otherwise is refused where the run is made, naming the fix."""
    cpu, config = torch.device("cpu"), RLConfig(device_type="cpu")
    model = random_model(tiny_config(vocab_size=tiny_tokenizer.get_vocab_size()))
    plan = RunPlan(dtype="bfloat16", rollout_dtype="bfloat16", decode="eager", compile="off", memory_budget_gb=4.0,
                   output_tag="d2", keep_last=0)
    task = Arithmetic(size=4)
    with pytest.raises(ValueError, match=r"build it with rollout_spec\(model, dtype='bfloat16'\)"):
        build_run(config, plan, model, tiny_tokenizer, Engine(model, tiny_tokenizer), [], (task, task), cpu,
                  steps=(0, 10), rows=4, compiled=False)
    bf16 = Engine(model, tiny_tokenizer, rollout_spec(model, dtype="bfloat16"))
    run = build_run(config, plan, model, tiny_tokenizer, bf16, [],
                    (task, task), cpu, steps=(0, 10), rows=4, compiled=False)
    assert run.engine.spec.dtype == run.plan.rollout_dtype
