"""nanochat's import path for the model (`from nanochat.gpt import GPT, GPTConfig`); the code is nanochat/model/gpt.py."""

from nanochat.model.gpt import GPT, GPTConfig, build_fresh_model

__all__ = ["GPT", "GPTConfig", "build_fresh_model"]
