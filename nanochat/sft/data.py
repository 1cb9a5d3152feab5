"""
SFT's data, from the task mixture to padded tensors: the tasks of --tasks for a split, the example order of their
mixture, which examples each rank takes at a step, and conversations -> (inputs, targets) micro-batches whose targets
are -1 wherever nothing is trained on (prompt, tool outputs, padding).
"""

import random

from nanochat.runtime.distributed import rank_share
from nanochat.tokenizer import collate_rows
from tasks.registry import make_task


def load_tasks(names, split, arithmetic_difficulty):
    """One task object per name, for `split`."""
    tasks = []
    for name in names:
        if name == "arithmetic" and arithmetic_difficulty is not None:
            from tasks.arithmetic import Arithmetic  # the registry builds Cls(split=...) only
            tasks.append(Arithmetic(split=split, difficulty=arithmetic_difficulty))
        else:
            tasks.append(make_task(name, split))
    return tasks


def mixture_order(task_sizes, seed):
    """Every example of every task once, shuffled with a fixed seed: a list of (task_index, example_index).
    Concatenating then shuffling mixes tasks in proportion to their sizes."""
    order = [(t, i) for t, size in enumerate(task_sizes) for i in range(size)]
    random.Random(seed).shuffle(order)
    return order


def rank_positions(step, examples_per_step, rank, world_size):
    """Positions (into the repeated mixture order) of the examples this rank trains on at `step`.
    The step owns positions step*E .. step*E + E-1; rank r takes every world_size-th one from r, so the
    ranks together see exactly the examples a single process would."""
    start = step * examples_per_step
    return list(rank_share(start, start + examples_per_step, rank, world_size))


def conversations_at(tasks, order, positions):
    """The conversations at these positions of the mixture order, which repeats once per epoch."""
    return [tasks[t][i] for t, i in (order[pos % len(order)] for pos in positions)]


def render_rows(tokenizer, conversations, max_seq_len):
    """Tokenize conversations for training: a list of (ids, mask) with at most max_seq_len + 1 tokens each,
    so that a row gives at most max_seq_len (input, target) pairs after the shift. mask 1 = train on it."""
    return [tokenizer.render_conversation(conv, max_tokens=max_seq_len + 1) for conv in conversations]


def make_micro_batches(tokenizer, conversations, max_seq_len, device_batch_size, pad_token):
    """Conversations -> list of (inputs, targets) micro-batches of up to device_batch_size rows each,
    each padded only to its own longest row."""
    rows = render_rows(tokenizer, conversations, max_seq_len)
    return [collate_rows(rows[i:i + device_batch_size], pad_token) for i in range(0, len(rows), device_batch_size)]


def count_targets(micro_batches):
    """Number of trained-on positions (target != -1) over the micro-batches."""
    return sum(int((targets >= 0).sum()) for _, targets in micro_batches)


def val_micro_batches(args, task_names, tokenizer, pad_token, rank, world_size):
    """This rank's share of the first --eval-examples test conversations, rendered once (the val set does not
    change during the run)."""
    val_tasks = load_tasks(task_names, "test", args.arithmetic_difficulty)
    val_order = mixture_order([len(t) for t in val_tasks], args.seed)
    num_val = min(args.eval_examples, len(val_order))
    val_convs = conversations_at(val_tasks, val_order, rank_share(0, num_val, rank, world_size))
    return make_micro_batches(tokenizer, val_convs, args.max_seq_len, args.device_batch_size, pad_token)
