"""
SFT's stop on held-out accuracy (--stop-at-pass1; the rule itself is nanochat/stop_rule.py): which questions are held
out of training, one check of their sampled pass@1, and the record of the checks in the checkpoint's meta.
"""

import time

from nanochat.errors import SettingError, UserError
from nanochat.runtime.distributed import print0
from nanochat.stop_rule import held_out_indices, measure_pass1


class NotGenerativeError(UserError):
    """The task whose questions would be held out is graded by choice, not by sampled answers (nanochat.cli's line
    names the flags)."""

    def __init__(self, task_name, eval_type):
        super().__init__(f"{task_name!r} is {eval_type}, not generative: it has no sampled answers to grade")
        self.task_name, self.eval_type = task_name, eval_type


def held_out_questions(task, task_name, stop_check_questions):
    """The indices of the held-out questions in `task`'s train split (its last stop_check_questions), which training
    leaves out. `task` is the first task of the mixture, named `task_name`."""
    if getattr(task, "eval_type", "generative") != "generative":
        raise NotGenerativeError(task_name, task.eval_type)
    if stop_check_questions >= len(task):
        raise SettingError("stop_check_questions", f"({stop_check_questions}) holds out every train question of "
                                                   f"{task_name!r} ({len(task)}); hold out fewer")
    return held_out_indices(len(task), stop_check_questions)


def check_stop(band, engine, task, held_out, args, step, num_steps, autocast, reduce_device):
    """One held-out pass@1 check at `step` (task[i] for i in held_out), logged. True = stop here; raises
    MissedBandError (see PassBand.observe)."""
    t0 = time.time()
    pass1 = measure_pass1(engine, task, held_out, args.stop_check_samples, args.stop_check_max_tokens,
                          autocast=autocast, reduce_device=reduce_device, seed=args.seed)
    print0(f"step {step}/{num_steps} | held-out pass@1 {pass1:.4f} (band {band.describe()}) | check {time.time() - t0:.1f}s")
    stop = band.observe(step, pass1, final=step == num_steps)
    if stop:
        print0(f"stop: step {step}/{num_steps} | held-out pass@1 {pass1:.4f} in the band {band.describe()} "
               f"({len(held_out)} train questions x {args.stop_check_samples} samples)")
    return stop


def stop_record(band, held_out, args, task_name):
    """The checkpoint meta's "stop": the band, the checks, and which held-out questions were asked."""
    return {**band.summary(), "task": task_name, "split": "train", "questions": len(held_out),
            "first_question": held_out.start, "samples": args.stop_check_samples}
