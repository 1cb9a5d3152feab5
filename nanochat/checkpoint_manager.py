"""nanochat's import path for checkpoints (`from nanochat.checkpoint_manager import load_model`); the code is in
nanochat/checkpoints/."""

from nanochat.checkpoints.errors import (CheckpointError, CorruptCheckpointError, MissingMetaError, NoCheckpointsError,
                                         NoStepsError, RankLostError, UnknownStepError, UnknownTagError)
from nanochat.checkpoints.layout import CHECKPOINT_DIRS, meta_path, model_path, optim_path
from nanochat.checkpoints.loading import build_model, find_checkpoint, load_model
from nanochat.checkpoints.store import (find_largest_model, find_last_step, list_steps, list_tags, load_checkpoint,
                                        load_meta, load_optimizer_state, save_checkpoint, update_meta)

__all__ = ["CHECKPOINT_DIRS", "CheckpointError", "CorruptCheckpointError", "MissingMetaError", "NoCheckpointsError",
           "NoStepsError", "RankLostError", "UnknownStepError", "UnknownTagError", "build_model", "find_checkpoint",
           "find_largest_model", "find_last_step", "list_steps", "list_tags", "load_checkpoint", "load_meta",
           "load_model", "load_optimizer_state", "meta_path", "model_path", "optim_path", "save_checkpoint",
           "update_meta"]
