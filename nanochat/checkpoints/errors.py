"""
The errors of saving and loading checkpoints: each a UserError that names what is missing or broken and keeps
the facts as attributes (the path, the available tags or steps, the checkpoint family), so that nanochat.cli can
add which flag to change or which script makes a checkpoint.
"""

import os
import re

from nanochat.checkpoints.layout import CHECKPOINT_DIRS, meta_path, model_path
from nanochat.errors import UserError


def _listing(items):
    return ", ".join(map(str, items)) or "none"


class CheckpointError(UserError):
    """A checkpoint that cannot be found or read; `path` is the directory or file concerned."""

    def __init__(self, message, path):
        super().__init__(message)
        self.path = path


class NoCheckpointsError(CheckpointError):
    """A checkpoint family (`source`: base|mid|sft|rl) with no directory under the base dir yet."""

    def __init__(self, source, checkpoints_dir):
        dirname = CHECKPOINT_DIRS[source]
        super().__init__(f"no {source} checkpoints: {checkpoints_dir} does not exist; copy your nanochat {dirname}/<tag> "
                         f"directory there (or set NANOCHAT_BASE_DIR to the directory that holds {dirname})",
                         checkpoints_dir)
        self.source = source


class UnknownTagError(CheckpointError):
    """A model tag that is not a directory of the family; `available` lists the tags that are."""

    def __init__(self, checkpoints_dir, tag, available):
        super().__init__(f"no model tag {tag!r} in {checkpoints_dir}; available tags: {_listing(available)}",
                         checkpoints_dir)
        self.tag, self.available = tag, available


class NoStepsError(CheckpointError):
    """A model directory without any model_<step>.pt file."""

    def __init__(self, checkpoint_dir):
        super().__init__(f"no model_<step>.pt files in {checkpoint_dir}", checkpoint_dir)


class UnknownStepError(CheckpointError):
    """A step with no model file in the directory; `available` lists the steps that have one."""

    def __init__(self, checkpoint_dir, step, available):
        super().__init__(f"no step {step} in {checkpoint_dir} (no {os.path.basename(model_path(checkpoint_dir, step))}); "
                         f"available steps: {_listing(available)}", checkpoint_dir)
        self.step, self.available = step, available


class MissingMetaError(CheckpointError):
    """A step whose model file is there but whose meta json is not; `path` is the missing meta file."""

    def __init__(self, checkpoint_dir, step):
        path = meta_path(checkpoint_dir, step)
        super().__init__(f"checkpoint step {step} in {checkpoint_dir} has a model file but no {os.path.basename(path)}",
                         path)
        self.step = step


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file that exists but cannot be read as what it should be; `reason` says what was found."""

    def __init__(self, path, reason):
        super().__init__(f"checkpoint file {path} is {reason}", path)
        self.reason = reason


class RankLostError(UserError):
    """Another rank of the process group stopped answering (killed, its node lost) while this one was saving step
    `step`: the save was abandoned. Every step whose model file exists is complete on every rank (see the module
    docstring), so the latest of them is where to resume."""

    def __init__(self, checkpoint_dir, step, error):
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        reason = re.sub(r"^\[\S+\] ", "", first_line).split(". ")[0]  # gloo: "[file.cc:537] Read error ...: reset by peer"
        super().__init__(f"lost another rank while saving step {step} to {checkpoint_dir} ({reason}); the latest step "
                         f"with a model file there is complete on every rank")
        self.checkpoint_dir, self.step = checkpoint_dir, step


class CheckpointWriteError(UserError):
    """A checkpoint file that could not be written (a full disk, permissions changed): nothing of it is left behind.
    `kept` says what the run still has (the Checkpointer adds its last committed step); `fix` what to do."""

    def __init__(self, checkpoint_dir, name, reason, fix, kept=None):
        kept_part = f"; {kept}" if kept else ""
        super().__init__(f"could not write checkpoint {name} to {checkpoint_dir}: {reason}{kept_part}; {fix}")
        self.checkpoint_dir, self.name, self.reason, self.fix, self.kept = checkpoint_dir, name, reason, fix, kept

    def with_kept(self, kept):
        return CheckpointWriteError(self.checkpoint_dir, self.name, self.reason, self.fix, kept)
