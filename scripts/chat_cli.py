"""
Talk to a chat model in the terminal, with its calculator tool.

  1. the conversation is kept as messages (user text; assistant text, python calls and their outputs) and
     rendered for each answer with the tokenizer's render_for_completion: the tokens chat_sft and chat_rl
     train on, not the raw tokens sampled in earlier turns;
  2. the engine samples the answer one token at a time and each token is printed as it comes;
  3. a calculator call the model writes (<|python_start|>expr<|python_end|>) is shown as `[python: expr]`
     and the result the engine forces in after it (mask 0, not sampled) as `[output: value]`; on a terminal
     the two are also coloured;
  4. the answer joins the conversation; `clear` starts a new one; `quit`, `exit` or Ctrl-D leave.
With -p/--prompt it answers one question, prints only the answer on stdout and exits (for scripts).
The turn-t answer of a session samples with seed --seed + t, so a session replays exactly.

Launch (one process: 1 GPU, MPS or CPU):
  python -m scripts.chat_cli                              # chat with the SFT model
  python -m scripts.chat_cli -i rl -t 0                   # the RL model, greedy
  python -m scripts.chat_cli -i rl -p "What is 17*23?"    # one answer, then exit
"""

import contextlib
import importlib.util
import os
import sys
from collections import namedtuple

from nanochat.checkpoints.loading import load_model
from nanochat.cli import (ArgumentParser, add_debug_flag, add_model_generation_flag, add_shared, add_shared_flag,
                          run_main)
from nanochat.common import compute_cleanup, compute_init
from nanochat.engine.calculator import recorded_calculator_format
from nanochat.engine.decode_steps import check_decode_kernels
from nanochat.engine.engine import Engine
from nanochat.engine.rows import SpecialIds
from nanochat.engine.spec import rollout_spec
from nanochat.errors import UserError
from nanochat.model.gpt import ROTARY_OVERSIZE
from nanochat.runtime.distributed import get_dist_info
from nanochat.runtime.dtypes import autocast_context, compute_dtype, requested_dtype

BANNER = ("NanoChat interactive mode\n" + "-" * 50 + "\n"
          "Type 'quit' or 'exit' (or Ctrl-D) to end the conversation\n"
          "Type 'clear' to start a new conversation\n"
          "Calculator calls show as [python: ...], their results as [output: ...]\n" + "-" * 50)

CYAN, GREEN, RESET = "\033[36m", "\033[32m", "\033[0m"


def build_parser():
    p = ArgumentParser(description="Chat with a model in the terminal")
    # model (nanochat's short flags; the step is args.step, as in nanochat)
    add_shared_flag(p, "source", "-i", help="checkpoint family: sft|mid|rl")
    add_shared_flag(p, "model_tag", "-g", help="model tag; default: the largest d<N>")
    add_shared_flag(p, "model_step", "-s", "--step", help="checkpoint step; default: the last one")
    add_model_generation_flag(p)
    # chat: chat_cli's own temperature and seed (T=0.6 as nanochat's chat_cli; the evals sample at the shared T=1)
    p.add_argument("-p", "--prompt", type=str, default="", help="answer this one question, print the answer and exit")
    add_shared_flag(p, "temperature", "-t", script="chat_cli")
    add_shared_flag(p, "top_k", "-k")
    add_shared_flag(p, "max_new_tokens", help="answer length cap in tokens")
    add_shared_flag(p, "seed", script="chat_cli", help="sampling seed; the session's t-th answer uses seed + t")
    # runtime
    add_shared(p, "device_type", "calculator_format", "decode_kernels")
    add_shared_flag(p, "dtype", "-d", help="float32|bfloat16; default: $NANOCHAT_DTYPE, else bfloat16")
    add_debug_flag(p)
    return p


def parse_args(argv):
    return build_parser().parse_args(argv)


def validate_args(args):
    if args.source not in ("sft", "mid", "rl"):
        raise UserError(f"--source must be sft, mid or rl, got {args.source!r}")
    args.dtype = requested_dtype(args.dtype)
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0 = whole vocabulary), got {args.top_k}")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if get_dist_info()[3] > 1:
        raise UserError("chat_cli runs in one process; launch it with `python -m scripts.chat_cli`, not torchrun")


# a bracketed span of the transcript: its opening token and the mask that token carries, its closing token
Span = namedtuple("Span", "opener mask closer label color")


class AnswerPrinter:
    """Writes an answer to `out` as the engine yields it, one (token, mask) at a time.

    Text between tool markers is decoded as a whole segment and only its new characters are written, so a
    character split over several tokens is printed once it is complete. A sampled python block shows as
    `[python: expr]`; the calculator result the engine forced in (mask 0) as `[output: value]`. Any other
    special token the model samples is shown by its name."""

    def __init__(self, tokenizer, out, color=False):
        self.tokenizer, self.out, self.color = tokenizer, out, color
        self.sp = SpecialIds(tokenizer)
        self.segment, self.written = [], 0   # token ids of the current text segment; its characters written
        # the bracketed spans: a sampled calculator call, and the result the engine forced in
        self.spans = (Span(self.sp.python_start, 1, self.sp.python_end, "python", CYAN),
                      Span(self.sp.output_start, 0, self.sp.output_end, "output", GREEN))
        self.open_span = None                # the span being written, or None in plain text

    def _write(self, text, color=None):
        if not text:
            return
        if self.color and color:
            text = color + text + RESET
        self.out.write(text)
        self.out.flush()

    def _style(self):
        return self.open_span.color if self.open_span else None

    def _flush_segment(self, final):
        text = self.tokenizer.decode(self.segment)
        if final or not text.endswith("\ufffd"):  # an incomplete UTF-8 character waits for its next byte
            self._write(text[self.written:], self._style())
            self.written = len(text)
        if final:
            self.segment, self.written = [], 0

    def feed(self, token, mask):
        sp = self.sp
        if token in sp.terminal:
            self._flush_segment(final=True)
        elif self.open_span and token == self.open_span.closer:
            self._flush_segment(final=True)
            self._write("]", self.open_span.color)
            self.open_span = None
        elif any(token == span.opener and mask == span.mask for span in self.spans):
            self._flush_segment(final=True)
            self.open_span = next(span for span in self.spans if token == span.opener and mask == span.mask)
            self._write(f"[{self.open_span.label}: ", self.open_span.color)
        else:
            self.segment.append(token)
            self._flush_segment(final=False)

    def finish(self):
        self._flush_segment(final=True)
        self._write("\n")


def answer_parts(tokenizer, tokens):
    """The assistant message for a sampled answer (tokens without the terminal token): a list of
    {"type": "text" | "python" | "python_output", "text": ...} parts, as render_conversation takes them.
    A python block the answer left open (cut by the length cap) is kept as a python part."""
    sp = SpecialIds(tokenizer)
    opener = {sp.python_start: "python", sp.output_start: "python_output"}
    closer = {sp.python_end: "python", sp.output_end: "python_output"}
    parts, kind, run = [], "text", []

    def close():
        if run or kind != "text":
            parts.append({"type": kind, "text": tokenizer.decode(run)})
        run.clear()

    for token in tokens:
        if token in opener:
            close()
            kind = opener[token]
        elif closer.get(token) == kind:
            close()
            kind = "text"
        else:
            run.append(token)
    close()
    return parts


def context_limit(model):
    """The longest sequence the model can take: its rotary tables cover ROTARY_OVERSIZE x sequence_len."""
    return ROTARY_OVERSIZE * model.config.sequence_len


def render_prompt(tokenizer, messages):
    """The tokens to sample the reply to `messages` (ending with a user message) from, rendered as in training."""
    return tokenizer.render_for_completion({"messages": messages + [{"role": "assistant", "content": ""}]})


def answer(engine, prompt, args, seed, out, color=False, interruptible=False):
    """Sample the assistant's reply to the prompt tokens, streaming it to `out`; returns its parts. With
    `interruptible`, Ctrl-C ends the reply early and what was said so far is kept."""
    tokenizer = engine.tokenizer
    printer, tokens = AnswerPrinter(tokenizer, out, color), []
    max_tokens = min(args.max_new_tokens, context_limit(engine.model) - len(prompt))
    try:
        for column, masks in engine.generate(prompt, num_samples=1, max_tokens=max_tokens, temperature=args.temperature,
                                             top_k=args.top_k or None, seed=seed):
            printer.feed(column[0], masks[0])
            if column[0] not in printer.sp.terminal:
                tokens.append(column[0])
    except KeyboardInterrupt:
        if not interruptible:
            raise
        out.write(" [interrupted]")
    printer.finish()
    return answer_parts(tokenizer, tokens)


def too_long(engine, prompt):
    """A message when the prompt leaves the model no room to answer, else None."""
    limit = context_limit(engine.model)
    if len(prompt) < limit:
        return None
    return f"the conversation is {len(prompt)} tokens and the model takes at most {limit}"


def read_line(prompt):
    """The user's next line, or None at end of input (Ctrl-D, a closed pipe) or on Ctrl-C at the prompt."""
    try:
        return input(prompt)
    except (EOFError, KeyboardInterrupt):
        return None


def main(argv):
    args = parse_args(argv)
    validate_args(args)
    _, _, _, _, device = compute_init(args.device_type)
    try:
        check_decode_kernels(args.decode_kernels, device)  # before the model loads
        with contextlib.redirect_stdout(sys.stderr):  # loading notes go to stderr; stdout is the conversation
            autocast = autocast_context(device, compute_dtype(device, args.dtype))
            model, tokenizer, meta = load_model(args.source, device, phase="eval", model_tag=args.model_tag,
                                                step=args.step, generation=args.model_generation)
        calculator = args.calculator_format or recorded_calculator_format(meta)
        engine = Engine(model, tokenizer,
                        rollout_spec(model, calculator_format=calculator, decode_kernels=args.decode_kernels))
        color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        with autocast:
            if args.prompt:
                prompt = render_prompt(tokenizer, [{"role": "user", "content": args.prompt}])
                if too_long(engine, prompt):
                    raise UserError(f"--prompt is too long: {too_long(engine, prompt)}")
                answer(engine, prompt, args, args.seed, sys.stdout, color=color)
            else:
                chat(engine, args, color)
        return 0
    finally:
        compute_cleanup()


def chat(engine, args, color):
    if sys.stdin.isatty() and importlib.util.find_spec("readline"):
        import readline  # noqa: F401  (importing it gives input() line editing and history)
    print(BANNER, flush=True)
    messages, turn = [], 0
    while True:
        line = read_line("\nUser: ")
        if line is None:
            print("\nGoodbye!")
            return
        if not sys.stdin.isatty():  # piped input is not echoed by a terminal: echo it so the transcript reads
            print(line)
        line = line.strip()
        if line.lower() in ("quit", "exit"):
            print("Goodbye!")
            return
        if line.lower() == "clear":
            messages = []
            print("Conversation cleared.")
            continue
        if not line:
            continue
        asked = messages + [{"role": "user", "content": line}]
        prompt = render_prompt(engine.tokenizer, asked)
        if too_long(engine, prompt):
            print(f"({too_long(engine, prompt)}; type 'clear' to start over)")
            continue
        sys.stdout.write("\nAssistant: ")
        parts = answer(engine, prompt, args, args.seed + turn, sys.stdout, color=color, interruptible=True)
        messages = asked + [{"role": "assistant", "content": parts}]
        turn += 1


if __name__ == "__main__":
    run_main(main)
