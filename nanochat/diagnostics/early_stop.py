"""
A benchmark's rows that end at random lengths, alike in every configuration it compares (bench_rl's "+early" runs): a
model wrapper whose decode steps force <|assistant_end|> by a hash of the input token and its position.
"""

import torch
import torch.nn as nn

from nanochat.engine.engine import Engine
from nanochat.engine.variants.triton_step import kernel_step_logits, sample_step_logits
from nanochat.model.sampling import mix32

FORCED_END_LOGIT = 1e4   # beats any softcapped logit (|x| <= 15) plus Gumbel noise (< 20)


class EarlyStopModel(nn.Module):
    """A GPT whose decode steps force <|assistant_end|> after input token x at position p when hash(x, p) < 2**32 /
    mean_length: rows end at geometric random lengths, alike in every config; prefills and training are left alone."""

    def __init__(self, model, end_token, mean_length):
        super().__init__()
        self.model, self.config, self.end_token = model, model.config, end_token
        self.threshold = round(2 ** 32 / mean_length)

    # the model's, left alone: its device, a prefill's forward (hidden states, logits at the last token, smear state)
    # and its blocks (what the Triton decode step checks of a model: check_kernel_model)
    get_device, hidden_states, logits, smear_state, transformer = (
        property(lambda self, name=name: getattr(self.model, name))
        for name in ("get_device", "hidden_states", "logits", "smear_state", "transformer"))

    def ends(self, tokens, positions):
        """tokens, positions: (B,) int64 -> (B,) bool: does the row end after this input."""
        return mix32(mix32(tokens) ^ mix32(positions + 0x5BD1E995)) < self.threshold

    def forward(self, idx, cache_step=None, **kwargs):
        logits = self.model(idx, cache_step=cache_step, **kwargs)  # a decode step's: (B, 1, V) float32
        if cache_step is not None and idx.size(1) == 1:
            self.adjust_decode_logits(idx[:, 0], cache_step.positions[:, 0], logits[:, 0])
        return logits

    def adjust_decode_logits(self, tokens, positions, logits):
        """logits (B, V) of a decode step's inputs `tokens` at `positions` (B,): the ends forced, in place."""
        logits[:, self.end_token] = torch.where(self.ends(tokens, positions), FORCED_END_LOGIT, logits[:, self.end_token])


class EarlyStopEngine(Engine):
    """An Engine decoding an EarlyStopModel: with the Triton kernels' decode step, kernel_step_ending_early."""

    def decode_step_for(self, spec):
        step = super().decode_step_for(spec)
        return kernel_step_ending_early if spec.decode_kernels == "triton" else step


def kernel_step_ending_early(batch, rows, keys):
    """The Triton kernels' decode step (kernel_static_step) of a batch whose model is an EarlyStopModel: the kernels
    run its GPT's weights, not its forward, so the ends are forced here, between the step's logits and its sampling."""
    wrapper = batch.model
    inputs, step, logits = kernel_step_logits(wrapper.model, batch, rows, keys)
    wrapper.adjust_decode_logits(inputs, step.positions[:, 0], logits)
    sample_step_logits(batch, step, logits)
