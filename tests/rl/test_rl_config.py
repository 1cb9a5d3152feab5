"""RLConfig, chat_rl's one source of settings (nanochat/rl/config.py's SETTINGS): RLConfig() is nanochat's run, the
parser is built from it (the same defaults; --help in groups, defaults shown), it is frozen, and what a run resolves
lives in its RunPlan, which a checkpoint records in place of the flags' values. The source scans (no flag declared
twice, no script importing another, no field written later, no flag in a library error): test_one_source.py."""

import dataclasses

import pytest

from nanochat import cli
from nanochat.engine.calculator import DEFAULT_FORMAT
from nanochat.errors import UserError
from nanochat.rl.config import GROUPS, SETTINGS, RLConfig
from nanochat.rl.plan import KEEP_ALL, RunPlan, resolve_keep_last
from nanochat.settings import SHARED
from scripts import chat_rl

# nanochat's chat_rl defaults of January 2026, written from its parser (karpathy/nanochat 3c3a3d7, scripts/chat_rl.py),
# not read from ours
NANOCHAT_JAN_2026 = {
    "run": "dummy", "device_type": "", "dtype": "bfloat16", "source": "sft", "model_tag": None, "model_step": None,
    "num_epochs": 1, "device_batch_size": 8, "examples_per_step": 16, "num_samples": 16, "max_new_tokens": 256,
    "temperature": 1.0, "top_k": 50, "embedding_lr": 0.2, "unembedding_lr": 0.004, "matrix_lr": 0.02,
    "weight_decay": 0.0, "init_lr_frac": 0.05, "eval_every": 60, "eval_examples": 400, "save_every": 60,
}
# where ours differs on purpose (docs/flags.md): --dtype auto is nanochat's bf16 on a GPU with native bf16, fp16 on one
# without; on a CPU nanochat computed in fp32 (its autocast was CUDA's only), ours in bf16 where measured faster
DIFFERS = {"dtype": "auto"}
# the flags nanochat did not have: their defaults are its behaviour (no std, no PPO, no KL, no correction, every row
# trained, lr decaying linearly to 0 from the first step, every checkpoint kept, the task and step count of its run)
NANOCHATS_BEHAVIOUR = {
    "task": "gsm8k", "num_steps": -1, "loss_norm": "pass", "advantage_std": False, "mask_truncated": False,
    "ppo_epochs": 1, "loss": "pg", "kl_coef": 0.0, "rollout_correction": "none", "dynamic_sampling": False,
    "lr_schedule": "linear", "warmup_steps": 0, "final_lr_frac": 0.0, "recipe": "2026-01", "keep_last": None,
    "resume": "", "output_tag": None,
}


@pytest.fixture(autouse=True)
def no_dtype_from_the_environment(monkeypatch):
    monkeypatch.delenv("NANOCHAT_DTYPE", raising=False)


def test_rlconfig_with_no_arguments_is_nanochats_run():
    config = RLConfig()
    for name, value in NANOCHAT_JAN_2026.items():
        assert getattr(config, name) == DIFFERS.get(name, value), name
    for name, value in NANOCHATS_BEHAVIOUR.items():
        assert getattr(config, name) == value, name


def test_the_parser_is_built_from_rlconfig_with_its_defaults():
    """Every flag of chat_rl's parser is a field of RLConfig, in its order, with the field's default; parsing no flag
    gives RLConfig(), and a user_config records the fields in that order."""
    namespace = cli.parse_rl_args([])
    fields = dataclasses.fields(RLConfig)
    assert list(vars(namespace)) == [f.name for f in fields] == list(SETTINGS)
    assert vars(namespace) == {f.name: f.default for f in fields}
    assert RLConfig.from_flags(namespace) == RLConfig()
    assert RLConfig.from_flags(cli.parse_rl_args(["--top-k=5", "--resume", "--dynamic-sampling"])) == RLConfig(
        top_k=5, resume="latest", dynamic_sampling=True)


# chat_rl's own help of a shared setting: what its --source=rl, its --task and its auto decode do besides
OWN_HELP = {"source", "task", "decode", "calculator_format"}


def test_the_shared_settings_are_taken_under_their_own_names():
    """A setting chat_rl shares with other scripts is the shared one (nanochat/settings.py), under its name, but for
    the help of OWN_HELP's, and --calculator-format's default, nanochat's str in chat_rl and the checkpoint's own in
    chat_eval and chat_cli (the same choices)."""
    for name in SHARED.keys() & SETTINGS.keys():
        changes = {"group": SETTINGS[name].group} | ({"help": SETTINGS[name].help} if name in OWN_HELP else {})
        if name == "calculator_format":
            changes["default"] = DEFAULT_FORMAT
        assert SETTINGS[name] == SHARED[name].varied(**changes), name
    assert (SETTINGS["calculator_format"].default, SHARED["calculator_format"].default) == ("str", None)
    assert {s.group for s in SETTINGS.values()} == set(GROUPS)


def test_help_shows_the_flags_in_groups_with_their_defaults(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "250")  # one line a flag
    with pytest.raises(SystemExit) as e:
        chat_rl.main(["--help"])
    assert e.value.code == 0
    headings, flags, flag = [], {}, None
    for line in capsys.readouterr().out.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            headings.append(line[:-1])
        elif line.startswith("  --"):
            flag = line.split()[0]
            flags[flag] = (headings[-1], line)
        elif line.startswith("    ") and flag:  # a help on the lines below its flag
            flags[flag] = (flags[flag][0], flags[flag][1] + " " + line.strip())
    assert headings == ["options", *GROUPS]
    assert {flag for flag in flags} == {cli.flag_name(name) for name in SETTINGS}
    for name, setting in SETTINGS.items():
        assert flags[cli.flag_name(name)][0] == setting.group, name
    assert flags["--examples-per-step"][1].endswith("questions per optimizer step, summed over ranks (default: 16)")
    assert flags["--top-k"][1].endswith("(0 = whole vocabulary) (default: 50)")
    assert flags["--model-tag"][1].endswith("default: the largest d<N>")  # no default to show: its help says it
    assert flags["--advantage-std"][1].endswith("(GRPO)")  # a switch: off


def test_the_config_is_frozen_and_a_changed_copy_is_checked_again():
    config = RLConfig(temperature=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.temperature = 2.0
    assert dataclasses.replace(config, temperature=0.7).temperature == 0.7 and config.temperature == 0.5
    with pytest.raises(UserError, match="--temperature must be >= 0"):
        dataclasses.replace(config, temperature=-1.0)


def test_keep_last_is_the_flags_else_a_resumed_runs_own_else_keep_all():
    """--keep-last where it is not given (plan.resolve_keep_last): --resume keeps the run's own value (its meta's
    user_config), and a new run keeps every checkpoint (nanochat's) even when it starts from an RL checkpoint whose
    run pruned: the source's value is its own run's, not the new one's (issue 67: a new run inheriting it passed)."""
    pruned = {"user_config": {"keep_last": 2}}
    assert resolve_keep_last(RLConfig(device_type="cpu", resume="latest"), pruned) == 2
    assert resolve_keep_last(RLConfig(device_type="cpu"), pruned) == KEEP_ALL == 0
    assert resolve_keep_last(RLConfig(device_type="cpu", resume="latest"), {}) == KEEP_ALL
    assert resolve_keep_last(RLConfig(device_type="cpu", resume="latest", keep_last=5), pruned) == 5
    assert resolve_keep_last(RLConfig(device_type="cpu", keep_last=3), pruned) == 3


def test_a_checkpoint_records_the_config_with_the_plans_values_in_place():
    """RunPlan.recorded: the config's settings in their order (what user_config always was), each resolved value in
    place of its flag's; the plan is frozen too."""
    config = RLConfig(device_type="cpu", keep_last=None)
    plan = RunPlan(dtype="float32", rollout_dtype="bfloat16", decode="eager", compile="off", memory_budget_gb=4.0,
                   output_tag="d2", keep_last=0)
    recorded = plan.recorded(config)
    assert list(recorded) == list(SETTINGS)
    assert {k: v for k, v in recorded.items() if k not in dataclasses.asdict(plan)} == {
        k: v for k, v in vars(config).items() if k not in dataclasses.asdict(plan)}
    assert (recorded["dtype"], recorded["memory_budget_gb"], recorded["output_tag"], recorded["keep_last"]) == (
        "float32", 4.0, "d2", 0)
    assert (config.dtype, config.memory_budget_gb, config.output_tag, config.keep_last) == ("auto", "auto", None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.decode = "static"


CHOICE_SETTINGS = [name for name, setting in SETTINGS.items() if setting.choices is not None]
# what RLConfig says of a value outside them, written out (a setting given choices is added here)
REFUSED = {"model_generation": "--model-generation must be ve, ve_mar2, ve_late",
           "decode": "--decode must be auto, eager, static, graph",
           "compile": "--compile must be auto, on, off, blocks", "recipe": "--recipe must be 2026-01 or 2026-07",
           "calculator_format": "--calculator-format must be str or int",
           "rejected_tokens": "--rejected-tokens must be counted or uncounted",
           "decode_kernels": "--decode-kernels must be auto, torch, flex, triton"}


@pytest.mark.parametrize("name", CHOICE_SETTINGS)
def test_a_setting_with_choices_is_checked_by_them_in_code_as_on_the_command_line(name):
    """The table's choices are the one declaration: argparse refuses another value on the command line, and RLConfig
    the same value made in code or restored from a run's meta, in one line naming the flag; each choice is taken."""
    flag, choices = "--" + name.replace("_", "-"), SETTINGS[name].choices
    with pytest.raises(UserError, match=f"^argument {flag}: invalid choice: 'bogus'"):
        cli.rl_parser().parse_args([f"{flag}=bogus"])
    with pytest.raises(UserError) as refused:
        RLConfig(**{name: "bogus"})
    assert str(refused.value) == REFUSED[name] + ", got 'bogus'"
    assert [getattr(RLConfig(**{name: choice}), name) for choice in choices] == list(choices)
