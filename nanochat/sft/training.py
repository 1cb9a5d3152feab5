"""
SFT's optimization: the masked next-token loss with an explicit denominator, one optimizer step, the val loss, and the
step's line.

The loss of one optimizer step is the mean cross-entropy over every trained-on token of the step, on all
ranks together:
    loss = sum over the step's rows and positions with target != -1 of CE  /  number of such positions
Each rank backpropagates  sum_rank CE / mean_over_ranks(count_rank); the distributed optimizers average
gradients over ranks, which turns that into the global token mean above, however unevenly the trained-on
tokens fall across micro-batches and ranks.
"""

import torch

from nanochat.optim.optimizers import guarded_step, scale_initial_lr
from nanochat.runtime.distributed import all_reduce_mean, print0
from nanochat.sft.data import count_targets


def summed_cross_entropy(model, inputs, targets):
    """The cross-entropy summed over the trained-on positions (target != -1) of one micro-batch: inputs, targets
    (B, T). A pure function of tensors: nanochat/compiling/functions.py compiles it for the training pass (dynamic
    shapes: the rows' lengths vary from micro-batch to micro-batch)."""
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


def setup_optimizers(model, args):
    """Muon (matrices) and AdamW (embeddings, unembedding, scalars) at the flags' lrs, each scaled by --init-lr-frac."""
    # Muon orthogonalizes in the run's compute dtype: bf16 where it is native (nanochat's numerics), fp32 otherwise
    optimizers = model.setup_optimizers(unembedding_lr=args.unembedding_lr, embedding_lr=args.embedding_lr,
                                        matrix_lr=args.matrix_lr, weight_decay=args.weight_decay,
                                        recipe=args.recipe, ortho_dtype=getattr(torch, args.dtype))
    return scale_initial_lr(optimizers, args.init_lr_frac)


def train_step(model, optimizers, micro_batches, lrm, device, reduce_device, autocast, forward=summed_cross_entropy):
    """One optimizer step on this rank's micro-batches, each through `forward` (summed_cross_entropy, or its compiled
    version). Returns (loss, grad norm, updated): the loss is the step's token-mean over all ranks; on a non-finite
    loss or gradient (on any rank) nothing is updated."""
    model.train()
    denominator = all_reduce_mean(count_targets(micro_batches), reduce_device)
    if denominator == 0:  # every conversation of the step truncated before its answer
        return float("nan"), 0.0, False
    local_loss = accumulate_gradient(model, micro_batches, denominator, device, autocast, forward=forward)
    gnorm, updated = guarded_step(model, optimizers, lrm, local_loss, reduce_device)
    loss = all_reduce_mean(local_loss, reduce_device) if updated else local_loss  # the step's token mean on all ranks
    return loss, gnorm, updated


def evaluate_val_loss(model, val_batches, device, reduce_device, autocast):
    """Mean CE over the trained-on tokens of every rank's val micro-batches."""
    model.eval()
    total, count = loss_sums(model, val_batches, device, autocast)
    # the ratio of the rank means is the ratio of the sums
    total, count = all_reduce_mean(total, reduce_device), all_reduce_mean(count, reduce_device)
    return total / count if count > 0 else float("nan")


def log_step(step, num_steps, loss, gnorm, lrm, dt, updated, compile_clock, wandb_run):
    """The line and wandb record of the update that makes `step` (dt in ms), or the line of one skipped."""
    if not updated:
        print0(f"step {step}/{num_steps} | non-finite loss or gradient (loss {loss:.4f}, grad norm {gnorm:.4f}), "
               f"or no trained-on tokens; update skipped")
        return
    compiles, compile_seconds = compile_clock.lap()  # since the last step line: a check's decode graphs included
    print0(f"step {step}/{num_steps} | loss {loss:.4f} | lrm {lrm:.3f} | dt {dt:.0f}ms | grad norm {gnorm:.3f}"
           + (f" | compiled {compiles} graphs in {compile_seconds:.1f}s" if compiles else ""))
    wandb_run.log({"step": step, "loss": loss, "lrm": lrm, "grad_norm": gnorm, "dt_ms": dt, "compiles": compiles,
                   "compile_s": compile_seconds})
