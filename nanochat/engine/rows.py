"""
One sample in flight: its Completion, and the calculator tool's protocol (which special tokens start a call, what
the engine forces in reply). Token ids in, token ids out: nothing here knows the model or the cache.
"""

import math
from collections import deque
from dataclasses import dataclass, field

from nanochat.engine.calculator import DEFAULT_FORMAT, format_result, use_calculator


@dataclass
class Completion:
    """One sampled continuation of a prompt. tokens exclude the terminal token; masks: 1 = sampled by
    the model, 0 = forced by the tool (calculator output). Per token, the sampler's log-probabilities (nan for
    a forced token, see sampling.sample_with_logprobs): logprobs under the model at temperature 1 over the
    whole vocabulary (what the trainer computes), sampling_logprobs under the distribution sampled from."""
    tokens: list
    masks: list
    ended: bool = False        # True if the model emitted <|assistant_end|> or <|bos|>; False if cut at max_tokens
    tool_calls: int = 0        # <|python_end|> seen
    tool_successes: int = 0    # ... of which the calculator returned a value
    logprobs: list = field(default_factory=list)
    sampling_logprobs: list = field(default_factory=list)


class SpecialIds:
    """The ids of the special tokens the engine acts on."""

    def __init__(self, tokenizer):
        get = tokenizer.encode_special
        self.python_start, self.python_end = get("<|python_start|>"), get("<|python_end|>")
        self.output_start, self.output_end = get("<|output_start|>"), get("<|output_end|>")
        self.assistant_end, self.bos = get("<|assistant_end|>"), tokenizer.get_bos_token_id()
        self.terminal = {self.assistant_end, self.bos}  # a sampled one ends the row (not kept in its Completion)


class Row:
    """One sample of a prompt while it is decoded: the tool protocol lives here and nowhere else.

    Each step `feed` takes the token the model sampled and returns what the row emits. A sampled
    <|python_start|> expr <|python_end|> runs expr through the calculator; when it returns a value,
    <|output_start|> value <|output_end|> is queued and emitted over the next steps in place of the sampled
    tokens, with mask 0. <|assistant_end|> or <|bos|> ends the row (not kept in its Completion), and so does
    its max_tokens-th step.
    """

    def __init__(self, request, sample, max_tokens, special, tokenizer, calculator_format=DEFAULT_FORMAT):
        self.request = request         # index of the prompt this row belongs to
        self.sample = sample           # index among that prompt's samples
        self.max_tokens = max_tokens
        self.special, self.tokenizer = special, tokenizer
        self.calculator_format = calculator_format  # how a tool result is written (calculator.CALCULATOR_FORMATS)
        self.out = Completion([], [])
        self.forced = deque()          # tool output still to emit
        self.python_tokens = None      # the tool call being collected, when not None
        self.emitted = 0                # tokens emitted so far, a terminal one included

    @property
    def finished(self):
        return self.out.ended or self.emitted >= self.max_tokens

    @property
    def forced_next(self):
        """The token the next feed emits whatever was sampled (a queued tool output), or None."""
        return self.forced[0] if self.forced else None

    def feed(self, sampled_token, logprobs=(math.nan, math.nan)):
        """One step: (the token emitted, its mask). A queued forced token wins over the sampled one. logprobs:
        the sampled token's (under the model, under the sampled distribution), kept with a sampled token."""
        token, mask = (self.forced.popleft(), 0) if self.forced else (sampled_token, 1)
        self.emitted += 1
        if token in self.special.terminal:
            self.out.ended = True
        else:
            self.out.tokens.append(token)
            self.out.masks.append(mask)
            model_lp, sampling_lp = logprobs if mask else (math.nan, math.nan)
            self.out.logprobs.append(model_lp)
            self.out.sampling_logprobs.append(sampling_lp)
            self._track_tool_call(token)
        return token, mask

    def _track_tool_call(self, token):
        sp = self.special
        if token == sp.python_start:
            self.python_tokens = []
        elif token == sp.python_end and self.python_tokens is not None:
            self._run_calculator()
        elif self.python_tokens is not None:
            self.python_tokens.append(token)

    def _run_calculator(self):
        sp = self.special
        self.out.tool_calls += 1
        text = format_result(use_calculator(self.tokenizer.decode(self.python_tokens)), self.calculator_format)
        self.python_tokens = None
        if text is not None:
            self.out.tool_successes += 1
            self.forced.extend([sp.output_start, *self.tokenizer.encode(text), sp.output_end])
