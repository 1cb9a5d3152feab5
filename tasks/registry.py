"""
Task lookup by name for the `--task` flag: a built-in name, or a user's own class as `package.module:ClassName`.

A user task class is constructed as `Cls(split="train")` / `Cls(split="test")` and provides `__len__`,
`__getitem__(i) -> conversation`, `reward(conversation, response_text) -> float` and
`evaluate(conversation, response_text) -> int`.
"""

import importlib

from nanochat.errors import UserError

BUILTIN_TASKS = {
    "gsm8k": ("tasks.gsm8k", "GSM8K"),
    "arithmetic": ("tasks.arithmetic", "Arithmetic"),
}
REQUIRED_METHODS = ("__len__", "__getitem__", "reward", "evaluate")


class TaskNotFoundError(UserError):
    """No task class by the name `name` (a built-in name or package.module:ClassName)."""

    def __init__(self, name, problem):
        super().__init__(problem)
        self.name = name


def resolve_task_class(name):
    """The class named by --task."""
    if name in BUILTIN_TASKS:
        module_name, class_name = BUILTIN_TASKS[name]
    elif ":" in name:
        module_name, class_name = name.split(":", 1)
    else:
        raise TaskNotFoundError(name, f"unknown task {name!r}; use one of {', '.join(BUILTIN_TASKS)} "
                                      f"or your own as package.module:ClassName")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TaskNotFoundError(name, f"cannot import task module {module_name!r} ({e}); "
                                      f"the module must be importable (on PYTHONPATH)") from e
    cls = getattr(module, class_name, None)
    if cls is None:
        raise TaskNotFoundError(name, f"module {module_name!r} has no class {class_name!r} (the name after ':')")
    missing = [m for m in REQUIRED_METHODS if not hasattr(cls, m)]
    if missing:
        raise UserError(f"task class {name!r} lacks {', '.join(missing)}; a task needs __len__, __getitem__, reward and evaluate")
    return cls


def make_task(name, split):
    """Instantiate the task `name` for `split` ('train' or 'test')."""
    task = resolve_task_class(name)(split=split)
    if len(task) == 0:
        raise UserError(f"task {name!r} split {split!r} has no examples")
    return task


def recorded_task(meta):
    """The task the run that wrote a checkpoint trained on (an RL run's --task, in the user_config of its meta), or
    None where the meta records none (an SFT checkpoint, whose mixture is --tasks, or nanochat's own)."""
    return (meta.get("user_config") or {}).get("task") or None
