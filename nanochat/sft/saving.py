"""
Where an SFT run's model goes and what its checkpoint records: the folder (refused before training when it would hide
the run's model behind a later step), the meta, and the save at the end.
"""

import os

from nanochat.checkpoints.store import list_steps, save_checkpoint
from nanochat.common import get_base_dir
from nanochat.errors import UserError
from nanochat.files import check_writable_dir
from nanochat.runtime.distributed import print0


class LaterStepSavedError(UserError):
    """The run's checkpoint folder already holds a later step than the run may save, which loading the folder's last
    step would pick instead of the run's model (nanochat.cli's line adds the flags)."""

    def __init__(self, checkpoint_dir, later_step, save_step, may_stop_early):
        what = f"step {save_step}, where this run may stop" if may_stop_early else f"the {save_step} this run will save"
        super().__init__(f"{checkpoint_dir} already holds model_{later_step:06d}.pt, a later step than {what}")
        self.checkpoint_dir, self.later_step, self.save_step = checkpoint_dir, later_step, save_step


def output_dir(args, config, num_steps, held_out):
    """The checkpoint folder of this run, refused (before training) when it holds a later step than the run saves, or
    cannot be written."""
    checkpoint_dir = os.path.join(get_base_dir(), "chatsft_checkpoints", args.output_tag or f"d{config.n_layer}")
    # with a stop rule the run may save as early as the first check
    earliest_save = min(args.stop_check_every, num_steps) if held_out is not None else num_steps
    newer = [s for s in list_steps(checkpoint_dir) if s > earliest_save]
    if newer:  # found before training, not after: loading the "last step" of the tag would skip this run's model
        raise LaterStepSavedError(checkpoint_dir, newer[-1], earliest_save, may_stop_early=held_out is not None)
    check_writable_dir(checkpoint_dir, "the run's checkpoint", "make it writable, or set NANOCHAT_BASE_DIR (or "
                       "--output-tag) to write elsewhere")  # before training, not after it
    return checkpoint_dir


def sft_meta(model, args, step, val_loss, stop, compiled):
    """The checkpoint's meta: nanochat's fields, the graphs the run compiled and their calls' seconds (`compiled`;
    --compile), and the stop rule's record when one ran."""
    compiles, compile_seconds = compiled
    meta = {"step": step, "model_config": model.meta_model_config(), "generation": model.generation.name,
            "user_config": vars(args), "val_loss": val_loss, "compiles": compiles, "compile_s": compile_seconds}
    if stop is not None:
        meta["stop"] = stop
    return meta


def save_final_model(checkpoint_dir, model, step, meta, note):
    """The run's model (rank 0) as step `step` of checkpoint_dir; said, with `note`."""
    save_checkpoint(checkpoint_dir, step, model.state_dict(), None, meta)
    print0(f"Saved checkpoint to {checkpoint_dir} (model_{step:06d}.pt{note})")
