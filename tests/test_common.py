"""nanochat.common: choosing the compute dtype (--dtype, NANOCHAT_DTYPE) for a device and the autocast context
it gives, one-line errors, and the run's time estimate."""

import pytest
import torch

from nanochat import common


@pytest.mark.parametrize("device, native, requested, expected", [
    ("cpu", True, "bfloat16", torch.bfloat16),
    ("cpu", False, "bfloat16", torch.float32),   # emulated bf16 would be ~100x slower than fp32
    ("cpu", True, "float32", torch.float32),
    ("cuda", False, "bfloat16", torch.bfloat16),  # the CPU's abilities say nothing about a GPU
    ("cuda", True, "float32", torch.float32),
])
def test_compute_dtype(device, native, requested, expected, monkeypatch, capsys):
    monkeypatch.setattr(common, "cpu_has_native_bf16", lambda: native)
    assert common.compute_dtype(torch.device(device), requested) == expected
    fell_back = requested == "bfloat16" and expected == torch.float32
    assert ("computing in float32 instead of bfloat16" in capsys.readouterr().out) == fell_back


def test_native_bf16_probe_agrees_with_torch():
    expected = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert common.cpu_has_native_bf16() == expected


def test_autocast_context_runs_matmuls_in_the_chosen_dtype():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with common.autocast_context(torch.device("cpu"), torch.bfloat16):
        assert (a @ b).dtype == torch.bfloat16
    with common.autocast_context(torch.device("cpu"), torch.float32):
        assert (a @ b).dtype == torch.float32
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("flag, env, expected", [
    (None, None, "bfloat16"),           # nanochat's chat_rl default
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
    assert common.requested_dtype(flag) == expected


def test_requested_dtype_names_where_a_bad_value_came_from(monkeypatch):
    monkeypatch.setenv("NANOCHAT_DTYPE", "float16")
    with pytest.raises(common.UserError, match="NANOCHAT_DTYPE must be float32 or bfloat16, got 'float16'"):
        common.requested_dtype(None)
    with pytest.raises(common.UserError, match="--dtype must be float32 or bfloat16, got 'fp8'"):
        common.requested_dtype("fp8")


def test_long_error_comes_through_whole(capsys):
    """A one-line error is never cut (it used to end mid-word at 300 characters, losing the fix it named)."""
    message = " ".join(f"word{i:03d}" for i in range(71)) + " -- pass --the-fix"  # 514 characters
    assert len(message) > 500

    def main(argv):
        raise common.UserError(message)

    with pytest.raises(SystemExit) as e:
        common.run_main(main, [])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_remaining_seconds_excludes_eval_time():
    """Regression: the ETA was elapsed / steps done * steps left, with the step-0 eval inside `elapsed`, so a
    4-minute eval before a 3-second step made step 0 print 'eta 23h' for a 40-minute run."""
    steps, evals = [3.0], [240.0]
    train, evals_left = common.remaining_seconds(steps, 466, evals, 8)
    assert train == pytest.approx(3.0 * 466) and evals_left == pytest.approx(240.0 * 8)
    assert common.format_duration(train) == "23m18s"
    # the mean step time, not the last one
    assert common.remaining_seconds([2.0, 4.0, 6.0], 10) == (pytest.approx(40.0), 0.0)
    # before any eval was timed there is nothing to add; with nothing timed at all, nothing to estimate
    assert common.remaining_seconds([5.0], 2, [], 3) == (pytest.approx(10.0), 0.0)
    assert common.remaining_seconds([], 2) == (0.0, 0.0)
