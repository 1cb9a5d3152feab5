"""The sources hold each setting in one place (issue 60), read from the code's own files:
- no flag of chat_rl is declared outside its setting (nanochat/rl/config.py's SETTINGS, nanochat/settings.py's SHARED);
- no script imports another script (shared logic belongs in the library);
- nothing writes a field of a config once it is built (what a run resolves is its RunPlan);
- nothing but nanochat/rl/run.py writes a field of the run, and nothing changes its progress but RunProgress's methods;
- no error raised below the config names a flag: the library states the facts, nanochat.cli or the config the flag."""

import ast

from helpers import REPO

from nanochat import cli
from nanochat.rl.config import RLConfig
from nanochat.settings import SHARED

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


def copies_a_shared_setting(call):
    """A literal declaration of a shared setting's flag with that setting's help: a copy. A script's own flag of the
    name says what differs in its own help (chat_eval's --dtype: no float16; rl_variants' --device-type: cpu)."""
    help_ = next((k.value.value for k in call.keywords if k.arg == "help" and isinstance(k.value, ast.Constant)), None)
    return any(flag == cli.flag_name(name) and help_ == setting.help
               for flag in literal_flags(call) for name, setting in SHARED.items())


def test_no_flag_is_declared_outside_its_setting():
    """The library declares every flag from a Setting (no add_argument of a literal --flag); chat_rl declares none of
    its own; no other script copies a shared setting (nanochat/settings.py); chat_rl's parser is RLConfig's fields."""
    found = []
    for path, tree in sources("nanochat", "scripts"):
        for call in calls_named(tree, "add_argument"):
            if (path.startswith("nanochat/") and literal_flags(call)) or path == "scripts/chat_rl.py" or (
                    copies_a_shared_setting(call)):
                found.append(f"{path}:{call.lineno} {literal_flags(call)}")
    assert found == []
    parser = cli.rl_parser()
    assert {a.dest for a in parser._actions if a.dest != "help"} == CONFIG_FIELDS


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
