"""
Process-level plumbing every script starts with, under nanochat's own names: the base directory,
picking the device and setting up the process group (compute_init / compute_cleanup own the device, the seeds, the
matmul precision and the process group; everything else asks `torch.distributed.is_initialized()`), and a no-op
wandb. What a rank asks of the group is nanochat.runtime.distributed; the errors a user can fix are nanochat.errors.
"""

import os

import torch
import torch.distributed as dist

from nanochat.errors import SettingError
from nanochat.runtime.distributed import get_dist_info, print0, release_process_group

# nanochat's own scripts import these from nanochat.common (print0 and get_dist_info live in runtime/distributed.py)
__all__ = ["autodetect_device_type", "compute_cleanup", "compute_init", "DummyWandb", "get_base_dir", "get_dist_info",
           "print0"]


def get_base_dir():
    """Where tokenizer, data, checkpoints and reports live: $NANOCHAT_BASE_DIR or ~/.cache/nanochat."""
    base = os.environ.get("NANOCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanochat")
    return base


def autodetect_device_type():
    """cuda > mps > cpu."""
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def compute_init(device_type="", seed=42):
    """Pick the device, seed the global RNGs, set matmul precision, and (under torchrun) create the
    process group: NCCL on CUDA, gloo on CPU. Returns (is_ddp, rank, local_rank, world_size, device)."""
    device_type = device_type or autodetect_device_type()
    if device_type not in ("cuda", "cpu", "mps"):
        raise SettingError("device_type", f"{device_type!r} is unknown; use cuda, cpu or mps (or leave it empty to autodetect)")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise SettingError("device_type", "is cuda but torch sees no CUDA device; use cpu or install a CUDA build of torch")
    if device_type == "mps" and not torch.backends.mps.is_available():
        raise SettingError("device_type", "is mps but MPS is not available on this machine; use cpu")

    torch.manual_seed(seed)
    if device_type == "cuda":
        torch.cuda.manual_seed(seed)
        torch.backends.cuda.matmul.allow_tf32 = True  # tf32 for the fp32 matmuls that remain
        torch.backends.cudnn.allow_tf32 = True

    is_ddp, rank, local_rank, world_size = get_dist_info()
    if is_ddp and device_type == "mps" and world_size > 1:
        raise SettingError("device_type", "is mps, which cannot run several ranks (no NCCL/gloo device backend); "
                                          "run one process, or use cpu")
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device(device_type)
    if is_ddp and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            dist.init_process_group(backend=backend, device_id=device)
        else:
            dist.init_process_group(backend=backend)
        dist.barrier()
    return is_ddp, rank, local_rank, world_size, device


def compute_cleanup():
    """Tear down the process group, if any."""
    if dist.is_initialized():
        release_process_group()


class DummyWandb:
    """Stand-in for a wandb run when logging is off (`--run=dummy`): every call is a no-op."""

    def log(self, *args, **kwargs):
        pass

    def finish(self):
        pass
