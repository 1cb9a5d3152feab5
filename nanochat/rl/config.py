"""
chat_rl's run configuration: its flags as one dataclass whose construction checks them (RLConfig), and the
output tag a new run writes to.

Every check is a one-line UserError naming the flag and a value that works (nanochat would, for example, train
on zero samples when --num-samples < --device-batch-size). What a run resolves later (the dtypes, the decode
mode, compiling, the memory budget: nanochat/rl/plan.py; the output tag, --keep-last) is written back into the
config, which every checkpoint then records as its "user_config", so that --resume continues the run it was.
"""

import dataclasses
import os
from dataclasses import dataclass

from nanochat.checkpoints.layout import CHECKPOINT_DIRS
from nanochat.common import DTYPES, UserError, requested_dtype, require
from nanochat.optim.optimizers import LR_SCHEDULES, check_optimizer_flags
from nanochat.rl.objective import LOSS_CLIPS, LOSS_NORMS, LOSSES, ROLLOUT_CORRECTIONS
from nanochat.rl.plan import check_train_rows
from tasks.registry import resolve_task_class


@dataclass
class RLConfig:
    """chat_rl's flags, in the order `--help` lists them (scripts/chat_rl.py holds each one's help)."""
    # logging and runtime
    run: str
    device_type: str
    dtype: str                  # None (not given) -> $NANOCHAT_DTYPE or auto; then what training computes in
    rollout_dtype: str
    # model to start from, and where the run is written
    source: str
    model_tag: str
    model_step: int
    model_generation: str
    output_tag: str
    # data
    task: str
    num_epochs: int
    num_steps: int
    # batch sizes and sampling
    device_batch_size: int
    train_rows: int
    examples_per_step: int
    num_samples: int
    max_new_tokens: int
    temperature: float
    top_k: int
    max_rows: int
    memory_budget_gb: object    # "auto", a fraction string or GiB; resolved to GiB
    decode: str
    compile: str
    # optimization
    embedding_lr: float
    unembedding_lr: float
    matrix_lr: float
    weight_decay: float
    recipe: str
    init_lr_frac: float
    lr_schedule: str
    warmup_steps: int
    final_lr_frac: float
    # the algorithm's options (each default is nanochat's)
    loss_norm: str
    advantage_std: bool
    mask_truncated: bool
    ppo_epochs: int
    loss: str
    clip_low: float                 # None (not given) -> the loss's default (LOSS_CLIPS)
    clip_high: float
    kl_coef: float
    rollout_correction: str
    rollout_correction_cap: float
    dynamic_sampling: bool
    dynamic_sampling_rounds: int
    # eval and checkpoints
    eval_every: int
    eval_examples: int
    save_every: int
    keep_last: int
    save_rollouts: bool
    # robustness
    resume: str
    overwrite: bool
    max_bad_steps: int
    no_signal_steps: int
    debug: bool

    @classmethod
    def from_flags(cls, namespace):
        """The config of parsed flags (argparse's Namespace), checked."""
        return cls(**vars(namespace))

    def restored(self, saved):
        """This config with a resumed run's saved settings (its meta's user_config, less what --resume leaves to
        the flags given) put back, checked again; settings this version does not know are left out."""
        known = {f.name for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{k: v for k, v in saved.items() if k in known})

    def __post_init__(self):
        self.dtype = requested_dtype(self.dtype, float16=True)  # float16: with dynamic loss scaling (optim/loss_scale.py)
        require(self.rollout_dtype in DTYPES,
                f"--rollout-dtype must be auto, float32, bfloat16 or float16, got {self.rollout_dtype!r}")
        require(self.source in CHECKPOINT_DIRS, f"--source must be {', '.join(CHECKPOINT_DIRS)}, got {self.source!r}")
        resolve_task_class(self.task)  # an unknown --task is reported now, not after the checkpoint has loaded
        if self.output_tag is not None:
            require(self.output_tag not in ("", ".", "..") and "/" not in self.output_tag and os.sep not in self.output_tag,
                    f"--output-tag must be a directory name (no '/'), got {self.output_tag!r}")
            require(not self.resume, "--resume continues a run in its own directory and --output-tag names a new run's; "
                                     "pass only one")
        if self.source == "rl" and self.model_tag is not None:
            resolve_output_tag(self, self.model_tag, depth=None)  # refuses the run it reads
        self._check_batch()
        self._check_optimization()
        self._check_run()
        self._check_algorithm()
        require(not (self.resume and self.overwrite), "--resume continues a run and --overwrite replaces it; pass only one")

    def _check_batch(self):
        for name in ("device_batch_size", "examples_per_step", "num_samples", "max_new_tokens", "num_epochs",
                     "eval_examples"):
            require(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        check_train_rows(self)
        require(self.num_samples % self.device_batch_size == 0,
                f"--num-samples ({self.num_samples}) must be a multiple of --device-batch-size ({self.device_batch_size}); "
                f"e.g. --device-batch-size={largest_divisor_at_most(self.num_samples, self.device_batch_size)}")
        require(self.temperature >= 0, f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        require(self.top_k >= 0, f"--top-k must be >= 0 (0 = disabled), got {self.top_k}")
        require(self.max_rows >= 0, f"--max-rows must be >= 0 (0 = from the memory budget), got {self.max_rows}")

    def _check_optimization(self):
        check_optimizer_flags(self)
        require(0 < self.init_lr_frac <= 1, f"--init-lr-frac must be in (0, 1], got {self.init_lr_frac}")
        require(self.lr_schedule in LR_SCHEDULES,
                f"--lr-schedule must be {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        require(self.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        require(0 <= self.final_lr_frac <= 1, f"--final-lr-frac must be in [0, 1], got {self.final_lr_frac}")
        require(self.lr_schedule != "constant" or self.final_lr_frac == 0,
                f"--final-lr-frac={self.final_lr_frac} is the end of a linear or cosine schedule; --lr-schedule=constant "
                f"keeps the multiplier at 1 (drop --final-lr-frac, or choose linear or cosine)")

    def _check_algorithm(self):
        require(self.loss_norm in LOSS_NORMS, f"--loss-norm must be {', '.join(LOSS_NORMS)}, got {self.loss_norm!r}")
        require(self.ppo_epochs >= 1, f"--ppo-epochs must be >= 1 (1 = nanochat's on-policy step), got {self.ppo_epochs}")
        require(self.loss in LOSSES, f"--loss must be {', '.join(LOSSES)}, got {self.loss!r}")
        require(self.loss == "pg" or self.ppo_epochs > 1,
                f"--loss={self.loss} changes only the PPO epochs after the first (the first is on-policy: every ratio is 1, "
                f"its gradient the policy gradient); pass --ppo-epochs=2 or more, or drop --loss")
        require(not (self.loss == "gspo" and self.rollout_correction == "token-tis"),
                "--loss=gspo weighs whole sequences and --rollout-correction=token-tis single tokens; use "
                "--rollout-correction=sequence-mask (or none) with gspo")
        default_low, default_high = LOSS_CLIPS[self.loss]
        self.clip_low = default_low if self.clip_low is None else self.clip_low
        self.clip_high = default_high if self.clip_high is None else self.clip_high
        require(0 <= self.clip_low <= 1,
                f"--clip-low must be in [0, 1] (the ratio is clipped at 1 - clip-low; 1: no floor), got {self.clip_low}")
        require(self.clip_high >= 0, f"--clip-high must be >= 0, got {self.clip_high}")
        require(self.kl_coef >= 0, f"--kl-coef must be >= 0 (0 = no KL penalty), got {self.kl_coef}")
        require(self.rollout_correction in ROLLOUT_CORRECTIONS,
                f"--rollout-correction must be {', '.join(ROLLOUT_CORRECTIONS)}, got {self.rollout_correction!r}")
        require(self.rollout_correction_cap > 1,
                f"--rollout-correction-cap must be > 1, got {self.rollout_correction_cap}")
        require(self.dynamic_sampling_rounds >= 1,
                f"--dynamic-sampling-rounds must be >= 1 (draws a step may add), got {self.dynamic_sampling_rounds}")

    def _check_run(self):
        require(self.eval_every == -1 or self.eval_every >= 1,
                f"--eval-every must be >= 1, or -1 to disable, got {self.eval_every}")
        require(self.save_every == -1 or self.save_every >= 1,
                f"--save-every must be >= 1, or -1 for the last step only, got {self.save_every}")
        require(self.keep_last is None or self.keep_last >= 0,
                f"--keep-last must be >= 0 (0 = keep every checkpoint), got {self.keep_last}")
        require(self.num_steps == -1 or self.num_steps >= 1,
                f"--num-steps must be >= 1, or -1 to derive it from epochs, got {self.num_steps}")
        require(self.max_bad_steps >= 1, f"--max-bad-steps must be >= 1, got {self.max_bad_steps}")
        require(self.no_signal_steps >= 0,
                f"--no-signal-steps must be >= 0 (0 = never warn), got {self.no_signal_steps}")

    def check_ranks(self, world_size):
        """A new run's questions of a step must split evenly over the ranks (a resumed run's are checked against its
        own --examples-per-step, see nanochat/rl/resume.py)."""
        require(self.examples_per_step % world_size == 0,
                f"--examples-per-step ({self.examples_per_step}) must be divisible by the number of ranks ({world_size}); "
                f"use a multiple of {world_size}")


def largest_divisor_at_most(n, limit):
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def resolve_output_tag(config, source_tag, depth):
    """The chatrl_checkpoints/<tag> a new run writes: --output-tag; else, from an RL checkpoint, <source_tag>_cont
    (never the run it reads); else nanochat's rule: --model-tag, or d<depth> of the loaded model."""
    if config.output_tag is not None:
        tag = config.output_tag
    elif config.source == "rl":
        tag = f"{source_tag}_cont"
    else:
        tag = config.model_tag or f"d{depth}"
    if config.source == "rl" and tag == source_tag:
        raise UserError(f"--output-tag={tag} is the RL run --source=rl reads; a new run needs another --output-tag "
                        f"(to continue that run, use --resume={tag})")
    return tag
