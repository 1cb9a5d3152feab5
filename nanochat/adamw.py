"""nanochat's import path for its distributed AdamW until 2026-01-29 (`from nanochat.adamw import DistAdamW`); the
code is nanochat/optim/adamw.py."""

from nanochat.optim.adamw import DistAdamW

__all__ = ["DistAdamW"]
