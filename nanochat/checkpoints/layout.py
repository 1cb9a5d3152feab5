"""
Where a checkpoint's files are, in nanochat's on-disk layout:

    $NANOCHAT_BASE_DIR/{base,mid,chatsft,chatrl}_checkpoints/<tag>/
        model_<step:06d>.pt            torch.save'd model state_dict            (rank 0)
        meta_<step:06d>.json           json, indent 2, with "model_config"      (rank 0)
        optim_<step:06d>_rank<r>.pt    optimizer state of rank r (optional)     (every rank)
"""

import os
import re

CHECKPOINT_DIRS = {"base": "base_checkpoints", "mid": "mid_checkpoints", "sft": "chatsft_checkpoints", "rl": "chatrl_checkpoints"}

MODEL_FILE_RE = re.compile(r"^model_(\d+)\.pt$")
TAG_RE = re.compile(r"d(\d+)")  # used with .match: a prefix, as nanochat's re.match(r"d(\d+)", tag): d32_long is 32


def model_path(checkpoint_dir, step):
    return os.path.join(checkpoint_dir, f"model_{step:06d}.pt")


def meta_path(checkpoint_dir, step):
    return os.path.join(checkpoint_dir, f"meta_{step:06d}.json")


def optim_path(checkpoint_dir, step, rank):
    return os.path.join(checkpoint_dir, f"optim_{step:06d}_rank{rank}.pt")
