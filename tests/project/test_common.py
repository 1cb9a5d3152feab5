"""What every script starts with: the compute dtype (--dtype, NANOCHAT_DTYPE) for a device and the autocast context it
gives (nanochat.runtime.dtypes, nanochat.runtime.cpu_features), where the rank comes from and the reductions (nanochat.runtime.distributed),
the device setup (nanochat.common), and the run's time estimate. (run_main's one-line errors: test_cli.py.)"""

import pytest
import torch
import torch.distributed as dist

from nanochat import errors
from nanochat.rl import progress
from nanochat.runtime import cpu_features, distributed, dtypes


@pytest.mark.parametrize("device, native, requested, expected", [
    ("cpu", True, "bfloat16", torch.bfloat16),
    ("cpu", True, "auto", torch.bfloat16),       # before any measurement (chat_rl times it; see test_precision)
    ("cpu", False, "auto", torch.float32),
    ("cpu", False, "bfloat16", torch.float32),   # emulated bf16 would be ~100x slower than fp32
    ("cpu", True, "float32", torch.float32),
    ("cuda", False, "bfloat16", torch.bfloat16),  # the CPU's abilities say nothing about a GPU
    ("cuda", True, "float32", torch.float32),
])
def test_compute_dtype(device, native, requested, expected, monkeypatch, capsys):
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: native)
    assert dtypes.compute_dtype(torch.device(device), requested) == expected
    fell_back = requested != "float32" and expected == torch.float32
    assert ("computing in float32 instead of bfloat16" in capsys.readouterr().out) == fell_back


def test_native_bf16_probe_agrees_with_torch(monkeypatch):
    monkeypatch.delenv("NANOCHAT_CPU_BF16", raising=False)
    amx, avx512_bf16 = torch.cpu._is_amx_tile_supported(), torch.cpu._is_avx512_bf16_supported()
    assert cpu_features.cpu_bf16_kind() == ("amx" if amx else "avx512-bf16" if avx512_bf16 else "none")
    assert cpu_features.cpu_has_native_bf16() == (amx or avx512_bf16)


@pytest.mark.parametrize("kind", ["none", "avx512-bf16", "amx"])
def test_cpu_bf16_override_replaces_the_probe(kind, monkeypatch, capsys):
    """$NANOCHAT_CPU_BF16 makes this machine decide as that CPU kind would, whatever it is."""
    monkeypatch.setenv("NANOCHAT_CPU_BF16", kind)
    assert cpu_features.cpu_bf16_kind() == kind
    assert cpu_features.cpu_has_native_bf16() == (kind != "none")
    expected = torch.float32 if kind == "none" else torch.bfloat16
    assert dtypes.compute_dtype(torch.device("cpu"), "auto") == expected


def test_cpu_bf16_override_refuses_an_unknown_kind(monkeypatch):
    monkeypatch.setenv("NANOCHAT_CPU_BF16", "avx2")
    with pytest.raises(errors.UserError, match="^NANOCHAT_CPU_BF16 must be one of none, avx512-bf16, amx "
                                                r"\(or unset to probe the CPU\), got 'avx2'$"):
        cpu_features.cpu_bf16_kind()


def test_autocast_context_runs_matmuls_in_the_chosen_dtype():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with dtypes.autocast_context(torch.device("cpu"), torch.bfloat16):
        assert (a @ b).dtype == torch.bfloat16
    with dtypes.autocast_context(torch.device("cpu"), torch.float32):
        assert (a @ b).dtype == torch.float32
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("flag, env, expected", [
    (None, None, "auto"),               # bf16 where it is fast (nanochat's chat_rl default is bfloat16 on CUDA)
    ("auto", "float32", "auto"),
    (None, "float32", "float32"),       # current nanochat sets precision with NANOCHAT_DTYPE
    (None, "bfloat16", "bfloat16"),
    ("bfloat16", "float32", "bfloat16"),  # an explicit --dtype wins over the environment
    ("float32", "bfloat16", "float32"),
])
def test_requested_dtype(flag, env, expected, monkeypatch):
    if env is None:
        monkeypatch.delenv("NANOCHAT_DTYPE", raising=False)
    else:
        monkeypatch.setenv("NANOCHAT_DTYPE", env)
    assert dtypes.requested_dtype(flag) == expected


def test_requested_dtype_names_where_a_bad_value_came_from(monkeypatch):
    monkeypatch.setenv("NANOCHAT_DTYPE", "float16")
    with pytest.raises(errors.UserError, match="NANOCHAT_DTYPE must be auto, float32 or bfloat16, got 'float16'"):
        dtypes.requested_dtype(None)
    # the argument's value: the library names the setting; nanochat.cli shows it as --dtype (test_cli.py)
    with pytest.raises(errors.SettingError, match="^dtype must be auto, float32 or bfloat16, got 'fp8'$") as e:
        dtypes.requested_dtype("fp8")
    assert (e.value.setting, e.value.problem) == ("dtype", "must be auto, float32 or bfloat16, got 'fp8'")


def test_rank_comes_from_the_process_group_else_torchrun_env(tmp_path, monkeypatch):
    """One source of the rank for print0, reports, wandb, checkpoints and the optimizers: torchrun's RANK and
    WORLD_SIZE until the process group is up, the group's own rank and size from then on."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.rank_and_world() == (0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    # Regression: a launcher that sets RANK and WORLD_SIZE but not LOCAL_RANK runs one process (compute_init's
    # rule); reading rank 3 here made that process skip saving the model and evaluate 1/4 of the questions.
    assert distributed.rank_and_world() == (0, 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.rank_and_world() == (3, 4) and distributed.get_rank() == 3
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert distributed.rank_and_world() == (0, 1)
    finally:
        dist.destroy_process_group()


def test_remaining_seconds_excludes_eval_time():
    """Regression: the ETA was elapsed / steps done * steps left, with the step-0 eval inside `elapsed`, so a
    4-minute eval before a 3-second step made step 0 print 'eta 23h' for a 40-minute run."""
    steps, evals = [3.0], [240.0]
    train, evals_left = progress.remaining_seconds(steps, 466, evals, 8)
    assert train == pytest.approx(3.0 * 466) and evals_left == pytest.approx(240.0 * 8)
    assert progress.format_duration(train) == "23m18s"
    # the mean step time, not the last one
    assert progress.remaining_seconds([2.0, 4.0, 6.0], 10) == (pytest.approx(40.0), 0.0)
    # before any eval was timed there is nothing to add; with nothing timed at all, nothing to estimate
    assert progress.remaining_seconds([5.0], 2, [], 3) == (pytest.approx(10.0), 0.0)
    assert progress.remaining_seconds([], 2) == (0.0, 0.0)


def test_reductions_take_precision_and_place_from_the_device_type():
    """Regression: the float64 rule compared `device == "cpu"`, which is False for torch.device("cpu"), so
    chat_eval (passing its torch.device) summed pass@k counts in float32 on a CPU."""
    assert distributed.reduction_dtype("cpu") == distributed.reduction_dtype(torch.device("cpu")) == torch.float64
    assert distributed.reduction_dtype(torch.device("cuda", 0)) == torch.float32
    assert distributed.collective_device("cpu") == torch.device("cpu")
    assert distributed.collective_device(torch.device("mps")) == torch.device("cpu")  # gloo reduces CPU tensors
    assert distributed.collective_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert distributed.all_reduce_mean(0.1, torch.device("cpu")) == 0.1  # float64: the python float comes back exact


# ----------------------------------------------------------------------------- devices where CUDA is absent
# The suite pretends CUDA (conftest), so these branches would never run on CI: each test here takes the pretence
# away (and sets MPS) for itself, as a machine without a GPU answers.

@pytest.fixture
def machine(monkeypatch):
    """machine(mps=...): torch answers as a machine without CUDA, with or without MPS, for this test."""
    def set_up(mps):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    return set_up


@pytest.mark.parametrize("mps, want", [(False, "cpu"), (True, "mps")])
def test_autodetection_without_cuda_picks_mps_then_the_cpu(machine, mps, want):
    from nanochat.common import autodetect_device_type
    machine(mps)
    assert autodetect_device_type() == want


def test_compute_init_without_cuda_autodetects_the_cpu_and_refuses_cuda_and_mps_by_name(machine):
    from nanochat.common import compute_init
    from nanochat.errors import SettingError
    machine(False)
    assert compute_init("")[4] == torch.device("cpu")
    with pytest.raises(SettingError, match="is cuda but torch sees no CUDA device; use cpu"):
        compute_init("cuda")
    with pytest.raises(SettingError, match="is mps but MPS is not available on this machine; use cpu"):
        compute_init("mps")
