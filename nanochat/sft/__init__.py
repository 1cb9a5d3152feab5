"""
Supervised finetuning (SFT) on a mixture of chat tasks, the stage before RL, as scripts/chat_sft.py runs it.

The run, in the order scripts/chat_sft.py uses it:
    plan.py       what the run is set up with: the model it starts from (a fresh --depth model or a checkpoint), its
                  plan (train tasks, held-out questions, the order of the train conversations, the number of steps),
                  and what it compiles (the training forward, the held-out checks' engine)
    saving.py     where its model goes (a folder refused before training when a later step would hide the run's
                  model), the checkpoint's meta, and the save at the end

The data path of one step, top-down:
    data.py       the tasks of a split -> the mixture's example order -> this rank's conversations at a step ->
                  padded (inputs, targets) micro-batches, targets -1 where nothing is trained on; the val batches
    training.py   the masked next-token loss with its explicit denominator (the step's token mean on all ranks),
                  one optimizer step, the val loss, the step's line
    stopping.py   the stop on held-out accuracy (--stop-at-pass1; the rule is nanochat/stop_rule.py): the held-out
                  questions, one check of their sampled pass@1, the checks' record in the meta

What used to be `nanochat.sft` (one module) is re-exported here.
"""

from nanochat.sft.data import (collate_rows, count_targets, make_micro_batches, mixture_order, rank_positions,
                               render_rows)
from nanochat.sft.training import accumulate_gradient, loss_sums, summed_cross_entropy

__all__ = ["collate_rows", "count_targets", "make_micro_batches", "mixture_order", "rank_positions", "render_rows",
           "accumulate_gradient", "loss_sums", "summed_cross_entropy"]
