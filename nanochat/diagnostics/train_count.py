"""
How many kernels one training step's pass (nanochat.rl.policy_gradient.accumulate_policy_gradient) launches, counted
on the meta device (op_count.count_meta_ops): the same on any machine, so a CPU counts what a GPU's step would launch
(bench_rl --preset=d20 writes it as train_step_kernels).
"""

import contextlib

import torch

from nanochat.diagnostics.op_count import count_meta_ops
from nanochat.model.gpt import GPT, GPTConfig
from nanochat.rl.advantages import make_question_batch
from nanochat.rl.policy_gradient import accumulate_policy_gradient

# nanochat's d20 (January 2026): the shapes count_train_step_ops counts at by default
D20_CONFIG = dict(sequence_len=2048, vocab_size=65536, n_layer=20, n_head=10, n_kv_head=10, n_embd=1280,
                  window_pattern="SSSL")


def synthetic_question_batches(questions, rows, prompt_len, completion_len, vocab_size, seed=0):
    """`questions` QuestionBatches (on the host) of `rows` samples each: prompts of prompt_len - 4 .. prompt_len + 3
    tokens (a step's questions differ), completions of completion_len sampled tokens, rewards 0, 1, 0, ... (every
    row has an advantage, every row is trained)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = lambda n: torch.randint(0, vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    return [make_question_batch(tokens(max(prompt_len + q % 8 - 4, 1)),
                                [(tokens(completion_len), [1] * completion_len) for _ in range(rows)],
                                [float(r % 2) for r in range(rows)], 0) for q in range(questions)]


def count_train_step_ops(model=None, questions=16, rows=16, prompt_len=100, completion_len=256, rows_per_forward=16):
    """The OpCount (op_count.py) of one training step's pass, accumulate_policy_gradient (eager,
    fp32, nanochat's objective, every row trained), of `model` moved to the meta device (default: a d20,
    D20_CONFIG) over synthetic_question_batches, rows_per_forward rows a forward. The pass runs on meta to its end,
    where TrainStats reads its sums back to the host: the count stops there."""
    if model is None:
        with torch.device("meta"):
            model = GPT(GPTConfig(**D20_CONFIG))
    model = model.to("meta").train()
    batches = synthetic_question_batches(questions, rows, prompt_len, completion_len, model.config.vocab_size)
    meta = torch.device("meta")
    no_autocast = contextlib.nullcontext()
    count, stopped_in = count_meta_ops(lambda: accumulate_policy_gradient(model, batches, rows, questions, meta,
                                                                          autocast=no_autocast,
                                                                          micro_batch_rows=rows_per_forward))
    if "stats" not in stopped_in:  # only _Tally.stats, at the pass's end, reads back: a read anywhere else cut it short
        raise RuntimeError(f"the counted training pass read back to the host before its end, in {' < '.join(stopped_in)}")
    model.zero_grad(set_to_none=True)
    return count


def d20_train_step_kernels(rows_per_forward=(16, 64)):
    """{rows per forward: kernels} of one d20 training step (count_train_step_ops at its defaults: 16 questions x 16
    rows, prompts ~100 tokens, completions 256; eager, on meta): bench_rl's `train_step_kernels`."""
    return {n: count_train_step_ops(rows_per_forward=n).kernels for n in rows_per_forward}
