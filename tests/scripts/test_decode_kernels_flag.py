"""--decode-kernels on every script that decodes (issue 73): each --help names it, a bad value is argparse's one line,
and the value given reaches the engine each script builds (chat_eval's and chat_cli's from their own main, chat_rl's
through its plan and the checkpoint's record; bench_rl's configurations choose their own and refuse the flag). The
one-line refusals of a step that cannot run, before the model loads, are tests/scripts/test_bad_input.py's (chat_rl)
and the subprocess test below (chat_eval, chat_cli)."""

import os
import subprocess
import sys

import pytest
import torch
from helpers import PYTHONPATH, REPO, random_model, tiny_config

from nanochat.cli import parse_rl_args, rl_parser, run_main
from nanochat.compiling.plan import CompilePlan
from nanochat.diagnostics.bench_configs import CONFIGS
from nanochat.diagnostics.bench_measure import bench_run
from nanochat.engine.engine import Engine
from nanochat.errors import UserError
from nanochat.rl.config import RLConfig
from nanochat.rl.plan import RunPlan, run_rollout_spec
from nanochat.rl.resume import RUNTIME_FLAGS
from scripts import bench_rl, chat_cli, chat_eval
from tasks.arithmetic import Arithmetic

CPU = torch.device("cpu")
# each script's own flags around --decode-kernels: a CPU, fp32, one short answer
SCRIPT_FLAGS = {"chat_eval": ["--device-type=cpu", "--dtype=float32", "--task=arithmetic", "--num-examples=1",
                              "--num-samples=1", "--max-new-tokens=2"],
                "chat_cli": ["--device-type=cpu", "--dtype=float32", "--max-new-tokens=2", "-p", "hi"]}
SCRIPTS = {"chat_eval": chat_eval, "chat_cli": chat_cli}


def test_every_decoding_script_names_the_flag_in_its_help():
    for parser in (chat_eval.build_parser(), chat_cli.build_parser(), rl_parser()):
        text = " ".join(parser.format_help().split())
        assert "--decode-kernels {auto,torch,flex,triton}" in text and "auto (torch on every device for now" in text
    assert "--decode-kernels: per config" in " ".join(bench_rl.build_parser().format_help().split())


@pytest.mark.parametrize("script", ["chat_eval", "chat_cli", "chat_rl"])
def test_a_bad_value_is_argparses_one_line(script, capsys):
    main = SCRIPTS[script].main if script in SCRIPTS else (lambda argv: RLConfig.from_flags(parse_rl_args(argv)))
    with pytest.raises(SystemExit) as e:
        run_main(main, ["--decode-kernels=fast"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: argument --decode-kernels: invalid choice: 'fast' (choose from")


class Built(Exception):
    """Raised by the recording Engine once built: the test needs its spec, not a rollout."""


@pytest.mark.parametrize("given, runs", [("flex", "flex"), ("auto", "torch"), (None, "torch")])
@pytest.mark.parametrize("script", ["chat_eval", "chat_cli"])
def test_the_flag_reaches_the_engine_the_script_builds(script, given, runs, sft, monkeypatch):
    """The script's own main, up to its Engine (the checkpoint loaded): the engine's spec runs the step asked for,
    auto (and no flag) the torch step."""
    def recording_engine(*args, **kwargs):
        raise Built(Engine(*args, **kwargs).spec)
    monkeypatch.setattr(SCRIPTS[script], "Engine", recording_engine)
    with pytest.raises(Built) as e:
        SCRIPTS[script].main(SCRIPT_FLAGS[script] + ([f"--decode-kernels={given}"] if given else []))
    assert e.value.args[0].decode_kernels == runs


@pytest.mark.parametrize("given, runs", [("flex", "flex"), ("auto", "torch")])
def test_chat_rl_runs_and_records_the_step_it_is_given(given, runs):
    """chat_rl's config -> the plan's spec (run_rollout_spec, what setup_run builds its engine from) -> the record a
    checkpoint keeps (auto resolved, as --decode and --compile are); --resume keeps the flag as given."""
    config = RLConfig.from_flags(parse_rl_args(["--device-type=cpu", f"--decode-kernels={given}"]))
    spec = run_rollout_spec(config, CPU, CompilePlan(False, False, "off"), None, 4.0, "float32")
    plan = RunPlan(dtype="float32", rollout_dtype="float32", decode="eager", compile="off", memory_budget_gb=4.0,
                   output_tag="d2", keep_last=0, decode_kernels=spec.decode_kernels, spec=spec)
    assert spec.decode_kernels == runs and plan.recorded(config)["decode_kernels"] == runs
    assert "decode_kernels" in RUNTIME_FLAGS  # not put back from the checkpoint: as given


def test_bench_rl_configs_choose_their_own_step_and_refuse_the_flag(tiny_tokenizer):
    model = random_model(tiny_config(vocab_size=tiny_tokenizer.get_vocab_size()))
    rl = RLConfig(device_type="cpu", task="arithmetic", examples_per_step=2, num_samples=2, device_batch_size=2,
                  memory_budget_gb=4.0)
    for name, runs in (("batched_fp32_static_flex", "flex"), ("batched_fp32_static", "torch")):
        run = bench_run(model, model, tiny_tokenizer, Arithmetic(size=4), CONFIGS[name], rl, CPU, optimize=False)
        assert run.engine.spec.decode_kernels == run.plan.decode_kernels == runs
    with pytest.raises(UserError, match="^--decode-kernels: bench_rl sets them per configuration"):
        bench_rl.parse_args(["--decode-kernels=triton"])


@pytest.mark.slow
@pytest.mark.parametrize("script", ["chat_eval", "chat_cli"])
def test_triton_on_a_cpu_without_the_interpreter_is_one_line_before_the_model_loads(script, tmp_path):
    """The real process, TRITON_INTERPRET=0 and an empty base dir: exit 2 and the flag's one line (a load first
    would have said that no checkpoint is there)."""
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(tmp_path), "TRITON_INTERPRET": "0", "PYTHONPATH": PYTHONPATH,
           "OMP_NUM_THREADS": "1"}
    env.pop("NANOCHAT_DEBUG", None)
    argv = [sys.executable, "-m", f"scripts.{script}", *SCRIPT_FLAGS[script], "--decode-kernels=triton"]
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(  # without triton installed: "need the package"
        "error: --decode-kernels is triton: the Triton kernels "), result.stderr
    assert "; use --decode-kernels=auto or torch (the hand-written step)" in result.stderr
