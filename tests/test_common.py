"""nanochat.common: choosing the compute dtype for a device, and the autocast context it gives."""

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
