"""
Supervised finetuning pieces that are independent of the script: the example order of a task mixture,
which examples each rank takes at a step, conversations -> padded (inputs, targets) tensors, and the
masked next-token loss with an explicit denominator.

The loss of one optimizer step is the mean cross-entropy over every trained-on token of the step, on all
ranks together:
    loss = sum over the step's rows and positions with target != -1 of CE  /  number of such positions
Each rank backpropagates  sum_rank CE / mean_over_ranks(count_rank); the distributed optimizers average
gradients over ranks, which turns that into the global token mean above, however unevenly the trained-on
tokens fall across micro-batches and ranks.
"""

import random

import torch

from nanochat.runtime.distributed import rank_share


def render_rows(tokenizer, conversations, max_seq_len):
    """Tokenize conversations for training: a list of (ids, mask) with at most max_seq_len + 1 tokens each,
    so that a row gives at most max_seq_len (input, target) pairs after the shift. mask 1 = train on it."""
    return [tokenizer.render_conversation(conv, max_tokens=max_seq_len + 1) for conv in conversations]


def collate_rows(rows, pad_token):
    """rows: list of (ids, mask) -> (inputs, targets), both (B, T) int64 with T = longest row - 1. RL's
    question batches are built with it too (nanochat.rl.advantages.make_question_batch).

    targets[b, t] = ids[b][t + 1] where mask[b][t + 1] == 1, else -1 (prompt, tool outputs, and padding
    past the row's end). Inputs past a row's end are pad_token; they only feed positions whose target is -1.
    """
    longest = max(len(ids) for ids, _ in rows)
    if longest < 2:
        raise ValueError("every row has fewer than 2 tokens: nothing to predict")
    ids = torch.full((len(rows), longest), pad_token, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for b, (row_ids, row_mask) in enumerate(rows):
        if len(row_ids) != len(row_mask):
            raise ValueError(f"row {b}: {len(row_ids)} ids but {len(row_mask)} mask entries")
        ids[b, :len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        mask[b, :len(row_mask)] = torch.tensor(row_mask, dtype=torch.long)
    inputs, targets = ids[:, :-1], ids[:, 1:].clone()
    targets[mask[:, 1:] == 0] = -1
    return inputs, targets


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


def make_micro_batches(tokenizer, conversations, max_seq_len, device_batch_size, pad_token):
    """Conversations -> list of (inputs, targets) micro-batches of up to device_batch_size rows each,
    each padded only to its own longest row."""
    rows = render_rows(tokenizer, conversations, max_seq_len)
    return [collate_rows(rows[i:i + device_batch_size], pad_token) for i in range(0, len(rows), device_batch_size)]


def count_targets(micro_batches):
    """Number of trained-on positions (target != -1) over the micro-batches."""
    return sum(int((targets >= 0).sum()) for _, targets in micro_batches)


def summed_cross_entropy(model, inputs, targets):
    """The cross-entropy summed over the trained-on positions (target != -1) of one micro-batch: inputs, targets
    (B, T). A pure function of tensors: nanochat/compiling/functions.py compiles it for the training pass (dynamic shapes: the
    rows' lengths vary from micro-batch to micro-batch)."""
    return model(inputs, targets, loss_reduction="sum")


def accumulate_gradient(model, micro_batches, denominator, device, autocast, forward=summed_cross_entropy):
    """Forward/backward every micro-batch, accumulating d(sum CE / denominator) into the model's grads.

    denominator: the step's trained-on positions averaged over ranks (see the module docstring); with
    one process, simply the step's count. forward: summed_cross_entropy, or its compiled version. Returns this
    rank's contribution to the loss (python float).
    """
    losses = []  # on the device: read once, after the last backward, not once per micro-batch
    for inputs, targets in micro_batches:
        inputs, targets = inputs.to(device), targets.to(device)
        with autocast:
            total = forward(model, inputs, targets)
        loss = total / denominator
        loss.backward()
        losses.append(loss.detach().float())
    return sum(torch.stack(losses).tolist()) if losses else 0.0


@torch.no_grad()
def loss_sums(model, micro_batches, device, autocast):
    """(sum of CE over trained-on positions, number of them) over the micro-batches, as python numbers. Eager: a
    compiled forward without gradients would be a graph of its own, compiled for an evaluation that runs rarely."""
    total, count = 0.0, 0
    for inputs, targets in micro_batches:
        inputs, targets = inputs.to(device), targets.to(device)
        with autocast:
            total += summed_cross_entropy(model, inputs, targets).item()
        count += int((targets >= 0).sum())
    return total, count
