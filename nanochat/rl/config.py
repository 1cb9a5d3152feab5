"""
chat_rl's run configuration: its settings as one table (SETTINGS: each flag's default, help and --help group, written
once), RLConfig, the frozen dataclass derived from it whose construction checks every value, and the output tag a new
run writes to. nanochat.cli builds chat_rl's parser from RLConfig's fields; RLConfig() is nanochat's run.

Every check is a one-line UserError naming the flag and a value that works (nanochat would, for example, train
on zero samples when --num-samples < --device-batch-size). Nothing changes a config once it is built: what a run
resolves at its start (the dtypes, the decode mode, compiling, the memory budget, the output tag, --keep-last) is
its RunPlan (nanochat/rl/plan.py), and every checkpoint records the config with the plan's values in their place as
its "user_config", so that --resume continues the run it was.
"""

import dataclasses
import os

from nanochat.checkpoints.layout import CHECKPOINT_DIRS
from nanochat.engine.calculator import DEFAULT_FORMAT
from nanochat.errors import UserError, require
from nanochat.optim.optimizers import LR_SCHEDULES, check_optimizer_flags
from nanochat.rl.objective import LOSSES, LOSS_CLIPS, LOSS_NORMS, REJECTED_TOKENS, ROLLOUT_CORRECTIONS
from nanochat.rl.plan import AUTO_TRAIN_ROWS, KEEP_ALL, OTHER_AUTO_TRAIN_ROWS
from nanochat.rl.rollout import Sampling
from nanochat.runtime.dtypes import DTYPES, requested_dtype
from nanochat.settings import SHARED, Setting, dataclass_of, decode_setting
from tasks.registry import resolve_task_class

# the groups of chat_rl's --help, in its order
MODEL, ROLLOUTS, OPTIMIZATION = "model and data", "rollouts", "optimization"
ALGORITHM = "algorithm options (each default is nanochat's; docs/flags.md)"
CHECKPOINTS, PERFORMANCE, LOGGING = "evaluation and checkpoints", "precision and performance", "logging and runtime"
GROUPS = (MODEL, ROLLOUTS, OPTIMIZATION, ALGORITHM, CHECKPOINTS, PERFORMANCE, LOGGING)


def flag(group, default, help, **argparse):
    return Setting(default, help, group=group, **argparse)


def shared(name, group, **changes):
    """The shared setting `name` in chat_rl's --help group, with `changes` where chat_rl's help says more."""
    return SHARED[name].varied(group=group, **changes)


def short(x):
    """A number as the help writes it: 0.2, 1, and 3e-4 where Python writes 0.0003."""
    if x == 0 or abs(x) >= 1e-3:
        return f"{x:g}"
    mantissa, exponent = f"{x:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def clip_defaults(side):
    """Each loss's default clip on `side` (0: low, 1: high; LOSS_CLIPS), as --clip-low's and --clip-high's help say."""
    return ", ".join(f"{loss} {short(clips[side])}" for loss, clips in LOSS_CLIPS.items())


# chat_rl's settings in the order a checkpoint records them (its user_config); each default is nanochat's where
# nanochat has the flag (but --dtype: auto, which is nanochat's bf16 on a GPU)
SETTINGS = dict(
    run=shared("run", LOGGING),
    device_type=shared("device_type", LOGGING),
    dtype=shared("dtype", PERFORMANCE),  # None (not given) -> $NANOCHAT_DTYPE or auto
    rollout_dtype=flag(PERFORMANCE, "auto", "dtype of rollouts and evals: auto (float32 with --dtype=float32, float16 "
                       "where training is float16; else bfloat16 on a GPU, and on a CPU/MPS bfloat16 only where the "
                       "run's rollout, timed shortened at the start, is 1.2x faster, or as --dtype where the decode step "
                       "is compiled; kept on --resume), float32, bfloat16 or float16"),
    source=shared("source", MODEL, help="checkpoint family to start from: base|mid|sft|rl (rl: a new run from an RL "
                                        "checkpoint)"),
    model_tag=shared("model_tag", MODEL),
    model_step=shared("model_step", MODEL),
    model_generation=shared("model_generation", MODEL),
    output_tag=flag(CHECKPOINTS, None, "write the run to chatrl_checkpoints/<tag>; default: the model tag (d<depth> "
                    "without --model-tag), or <model tag>_cont with --source=rl"),
    task=shared("task", MODEL, help=f"task to train and evaluate on: {SHARED['task'].help}"),
    num_epochs=flag(MODEL, 1, "epochs over the task's train split"),
    num_steps=flag(MODEL, -1, "override the number of steps (-1 = from epochs)"),
    device_batch_size=flag(ROLLOUTS, 8, "rows per pass: nanochat's micro-batch, whose valid tokens each row's loss "
                           "denominator counts (forwards take --train-rows rows); also eval samples per question"),
    train_rows=flag(PERFORMANCE, 0, f"trained rows per training forward, taken from one question or several in turn "
                    f"(0 = auto: {AUTO_TRAIN_ROWS['cuda']} on CUDA, {OTHER_AUTO_TRAIN_ROWS} elsewhere, or "
                    "--device-batch-size if larger). The gradient is the same for any value: each row keeps the "
                    "denominator of its --device-batch-size pass. More rows make larger matmuls and fewer forwards (on "
                    "a GPU, fewer and fuller kernels) and need more memory; halved on out-of-memory"),
    examples_per_step=flag(ROLLOUTS, 16, "questions per optimizer step, summed over ranks"),
    num_samples=flag(ROLLOUTS, Sampling.num_samples, "completions sampled per question"),
    max_new_tokens=shared("max_new_tokens", ROLLOUTS),
    temperature=shared("temperature", ROLLOUTS),
    top_k=shared("top_k", ROLLOUTS),
    max_rows=shared("max_rows", PERFORMANCE),
    memory_budget_gb=shared("memory_budget_gb", PERFORMANCE),  # "auto" or GiB
    decode=decode_setting(auto_note="; on a CPU, in bf16, static where --compile compiles it: on always, auto once "
                          "measured to pay").shown_in(PERFORMANCE),
    compile=shared("compile", PERFORMANCE),
    embedding_lr=shared("embedding_lr", OPTIMIZATION),
    unembedding_lr=shared("unembedding_lr", OPTIMIZATION),
    matrix_lr=shared("matrix_lr", OPTIMIZATION),
    weight_decay=shared("weight_decay", OPTIMIZATION),
    recipe=shared("recipe", OPTIMIZATION),
    init_lr_frac=flag(OPTIMIZATION, 0.05, "every lr is multiplied by this at the start"),
    lr_schedule=flag(OPTIMIZATION, "linear", "lr multiplier over the run, after any warm-up: linear (nanochat: from 1 "
                     "down to --final-lr-frac at the last step), constant (1), or cosine (half a cosine from 1 down to "
                     "--final-lr-frac)"),
    warmup_steps=flag(OPTIMIZATION, 0, "steps whose lr multiplier rises linearly, (step + 1) / warmup-steps, before "
                      "the schedule"),
    final_lr_frac=flag(OPTIMIZATION, 0.0, "the lr multiplier the linear and cosine schedules reach at the end (0 = "
                       "nanochat's decay to 0)"),
    loss_norm=flag(ALGORITHM, "pass", "denominator of each token's term: pass (nanochat: valid tokens per pass of "
                   "--device-batch-size rows), token (DAPO: all the step's tokens), sequence (mean per sequence, then "
                   "over sequences), constant (Dr. GRPO: num_samples * max_new_tokens per question)"),
    advantage_std=flag(ALGORITHM, False, "divide each question's advantages by its reward std + 1e-4 (GRPO)"),
    mask_truncated=flag(ALGORITHM, False, "rows cut at --max-new-tokens carry no gradient and count in no denominator "
                        "(overlong filtering)"),
    ppo_epochs=flag(ALGORITHM, 1, "optimizer steps per batch of rollouts; epochs after the first use the clipped ratio "
                    "(PPO)"),
    loss=flag(ALGORITHM, "pg", "the term of PPO epochs after the first: pg (PPO's clipped ratio), gspo (sequence-level "
              "ratio) or cispo (clipped, detached ratio weighing logp); the first epoch is on-policy: the policy "
              "gradient"),
    clip_low=flag(ALGORITHM, None, f"ratio clipped below at 1 - clip-low (default by --loss: {clip_defaults(0)} = no "
                  f"floor)", type=float),  # None (not given) -> the loss's default (LOSS_CLIPS)
    clip_high=flag(ALGORITHM, None, f"ratio clipped above at 1 + clip-high (default by --loss: {clip_defaults(1)}; "
                   f"DAPO: 0.28)", type=float),
    kl_coef=flag(ALGORITHM, 0.0, "weight of the k3 KL penalty to the starting model (0 = none; > 0 loads a second "
                 "copy)"),
    rollout_correction=flag(ALGORITHM, "none", "correct for the gap between the sampler's and the trainer's "
                            "log-probabilities: none (nanochat), token-tis (each token's term times min(ratio, cap)), "
                            "sequence-mask (drop rows whose sequence ratio leaves [1/cap, cap]), geo-mask (drop rows "
                            "whose geometric-mean token ratio leaves [1/cap, cap]; SkyRL) or token-mask (drop tokens "
                            "whose ratio leaves [1/cap, cap]; verl); ratio = exp(logp_trainer - logp_sampler), whole "
                            "vocabulary"),
    rollout_correction_cap=flag(ALGORITHM, 2.0, "the cap of --rollout-correction (> 1)"),
    dynamic_sampling=flag(ALGORITHM, False, "draw more questions until the step has --examples-per-step whose samples "
                          "differ in reward (DAPO), or --dynamic-sampling-rounds more draws; the step trains those "
                          "(nanochat: off)"),
    dynamic_sampling_rounds=flag(ALGORITHM, 3, "with --dynamic-sampling: draws of --examples-per-step questions a step "
                                 "may add"),
    eval_every=flag(CHECKPOINTS, 60, "pass@k eval period in steps (-1 = never)"),
    eval_examples=flag(CHECKPOINTS, 400, "test questions used by the eval"),
    save_every=flag(CHECKPOINTS, 60, "checkpoint period in steps (-1 = only the last step)"),
    keep_last=flag(CHECKPOINTS, None, f"after each save, remove this run's older checkpoints beyond the last N "
                   f"({KEEP_ALL} = keep all, as nanochat; the default, except that --resume keeps the run's own value "
                   f"unless given)", type=int),  # None (not given) -> resolve_keep_last (nanochat/rl/plan.py)
    save_rollouts=flag(CHECKPOINTS, False, "append every sample (question, text, reward, advantage, length, tool calls) "
                       "as a JSON line to chatrl_checkpoints/<tag>/rollouts_rank<r>.jsonl, one file per rank, each "
                       "step's lines whole"),
    resume=flag(CHECKPOINTS, "", "continue an RL run: --resume (the latest), --resume=TAG (its last step) or "
                "--resume=TAG:STEP", nargs="?", const="latest"),
    overwrite=flag(CHECKPOINTS, False, "replace an existing chatrl_checkpoints/<tag> run (without it, the run is "
                   "refused)"),
    max_bad_steps=flag(LOGGING, 5, "abort after this many consecutive steps with a non-finite loss or gradient"),
    no_signal_steps=flag(LOGGING, 10, "warn when this many consecutive steps trained no row (every advantage 0: nothing "
                         "to learn from); 0 = never"),
    debug=shared("debug", LOGGING),
    # issue 61's, recorded after the older ones (a checkpoint's user_config keeps its order)
    calculator_format=shared("calculator_format", ROLLOUTS, default=DEFAULT_FORMAT, help="how the calculator's result "
                             "is written into the rollout: str (nanochat: str(), so 10/2 gives 5.0) or int (an integral "
                             "float below 2**53 without its .0, as GSM8K's answers write numbers; nanochat PR #786); "
                             "kept on --resume"),  # nanochat's, where chat_eval and chat_cli follow the checkpoint
    rejected_tokens=flag(ALGORITHM, "counted", "with a masking --rollout-correction (sequence-mask, geo-mask, "
                         "token-mask): counted (today's: a dropped token still counts in the denominators) or uncounted "
                         "(slime's, verl's: dropped tokens leave them; a no-grad forward of the step's rows first)",
                         choices=REJECTED_TOKENS),
    eval_tasks=flag(CHECKPOINTS, "", "more tasks the periodic eval measures beside --task's, comma-separated (gsm8k, "
                    "arithmetic, package.module:ClassName): pass@k on each test split, a field each on the eval line, "
                    "eval/<task>/pass@k in wandb, a row each in the report (default: --task's alone)"),
    decode_kernels=shared("decode_kernels", PERFORMANCE),  # issue 73's
    # issue 75's: on-policy distillation (docs/flags.md; nanochat/rl/objective.py, nanochat/rl/teacher.py)
    teacher=flag(ALGORITHM, "", "on-policy distillation's teacher, SOURCE[:MODEL_TAG[:STEP]] (source base|mid|sft|rl; "
                 "any depth or nanochat generation whose tokenizer is the student's); it scores every sampled token "
                 "(empty: none; needs --distill-coef > 0)"),
    distill_coef=flag(ALGORITHM, 0.0, "weight C of the teacher's term in each sampled token's advantage: "
                      "--reward-coef x the row's reward advantage + C x (log p_teacher - log p_student) at the token, "
                      "the student's from the training forward, detached (0 = none: nanochat's run)"),
    reward_coef=flag(ALGORITHM, 1.0, "weight of the reward advantage in each token's advantage (0 with "
                     "--distill-coef > 0: distillation alone)"),
)


@dataclass_of(SETTINGS)
class RLConfig:
    """chat_rl's settings (SETTINGS), checked on construction; frozen. RLConfig() is nanochat's run on GSM8K;
    RLConfig(task="arithmetic", device_type="cpu") another."""

    @property
    def extra_eval_tasks(self):
        """--eval-tasks' names, in order: the tasks evaluated beside --task's."""
        return [name.strip() for name in self.eval_tasks.split(",") if name.strip()]

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
        # the two values construction settles: --dtype not given, and the clip band of the loss where not given
        object.__setattr__(self, "dtype", requested_dtype(self.dtype, float16=True))  # float16: optim/loss_scale.py
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
        self._check_choices()
        self._check_batch()
        self._check_optimization()
        self._check_run()
        self._check_algorithm()
        require(not (self.resume and self.overwrite), "--resume continues a run and --overwrite replaces it; pass only one")

    def _check_batch(self):
        for name in ("device_batch_size", "examples_per_step", "num_samples", "max_new_tokens", "num_epochs",
                     "eval_examples"):
            require(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        require(self.train_rows >= 0, f"--train-rows must be >= 0 (0 = auto), got {self.train_rows}")
        require(self.num_samples % self.device_batch_size == 0,
                f"--num-samples ({self.num_samples}) must be a multiple of --device-batch-size ({self.device_batch_size}); "
                f"e.g. --device-batch-size={largest_divisor_at_most(self.num_samples, self.device_batch_size)}")
        require(self.temperature >= 0, f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        require(self.top_k >= 0, f"--top-k must be >= 0 (0 = disabled), got {self.top_k}")
        require(self.max_rows >= 0, f"--max-rows must be >= 0 (0 = from the memory budget), got {self.max_rows}")

    def _check_choices(self):
        # a setting whose table entry lists its choices (argparse's on the command line) is checked here by them too,
        # for a config made in code or restored from a run's meta: one declaration, one check, for every such flag
        for field in dataclasses.fields(self):
            setting, value = field.metadata["setting"], getattr(self, field.name)
            if setting.choices is not None and value != setting.default and value not in setting.choices:
                listed = (" or " if len(setting.choices) == 2 else ", ").join(map(str, setting.choices))
                raise UserError(f"--{field.name.replace('_', '-')} must be {listed}, got {value!r}")

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
        require(not (self.loss == "gspo" and self.rollout_correction == "token-mask"),
                "--loss=gspo weighs whole sequences and --rollout-correction=token-mask single tokens; use "
                "--rollout-correction=sequence-mask or geo-mask (or none) with gspo")
        for name in self.extra_eval_tasks:  # an unknown task is reported now, not at the first eval
            resolve_task_class(name)
        require(len(set(self.extra_eval_tasks)) == len(self.extra_eval_tasks) and self.task not in self.extra_eval_tasks,
                f"--eval-tasks={self.eval_tasks!r} names a task twice (--task's, {self.task}, is always evaluated)")
        default_low, default_high = LOSS_CLIPS[self.loss]
        object.__setattr__(self, "clip_low", default_low if self.clip_low is None else self.clip_low)
        object.__setattr__(self, "clip_high", default_high if self.clip_high is None else self.clip_high)
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
        check_distillation(self)

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

    def check_ranks(self, world_size, resumed=None):
        """A step's questions must split evenly over the ranks: a new run's, or those of `resumed`, the tag of the run
        --resume continues, whose --examples-per-step its saved settings put back (nanochat/rl/resume.py)."""
        per_step = self.examples_per_step
        if per_step % world_size == 0:
            return
        if resumed is None:
            raise UserError(f"--examples-per-step ({per_step}) must be divisible by the number of ranks ({world_size}); "
                            f"use a multiple of {world_size}")
        raise UserError(f"--resume: run {resumed} takes {per_step} questions a step (its --examples-per-step), which "
                        f"{world_size} ranks cannot share evenly; resume it on a number of ranks that divides {per_step} "
                        f"(e.g. torchrun --nproc_per_node={largest_divisor_at_most(per_step, world_size)})")

    def run_length(self, questions):
        """The run's number of steps on a train split of `questions` questions: --num-steps, or --num-epochs over it."""
        num_steps = self.num_steps if self.num_steps > 0 else (questions // self.examples_per_step) * self.num_epochs
        require(num_steps >= 1, f"the {self.task} train split has {questions} questions, fewer than --examples-per-step "
                                f"({self.examples_per_step}); lower --examples-per-step or pass --num-steps")
        require(self.warmup_steps < num_steps, f"--warmup-steps ({self.warmup_steps}) must be fewer than the run's "
                                               f"{num_steps} steps")
        return num_steps


def check_distillation(config):
    """--teacher, --distill-coef and --reward-coef, together and with --loss (RLConfig's checks)."""
    require(config.distill_coef >= 0, f"--distill-coef must be >= 0 (0 = no distillation), got {config.distill_coef}")
    require(config.reward_coef >= 0, f"--reward-coef must be >= 0 (0 = no reward term), got {config.reward_coef}")
    require(bool(config.teacher) == (config.distill_coef > 0),
            f"--teacher={config.teacher} is scored with --distill-coef > 0 (e.g. --distill-coef=1); it has none"
            if config.teacher else f"--distill-coef={config.distill_coef} weighs a teacher's term; name it with "
                                   f"--teacher=SOURCE[:MODEL_TAG[:STEP]] (e.g. --teacher=rl)")
    require(config.reward_coef > 0 or config.distill_coef > 0,
            "--reward-coef=0 without --distill-coef leaves every advantage 0: nothing to learn; pass "
            "--teacher and --distill-coef, or a --reward-coef > 0")
    if config.teacher:
        parse_teacher(config.teacher)
        require(config.loss != "gspo", "--loss=gspo's one ratio a sequence weighs a row's tokens alike, so a "
                                       "teacher's per-token advantages would be averaged away; use --loss=pg or "
                                       "cispo with --teacher")


def parse_teacher(spec):
    """--teacher's SOURCE[:MODEL_TAG[:STEP]] -> (source, model tag or None, step or None), checked."""
    source, tag, step = (spec.split(":") + [None, None])[:3] if spec.count(":") <= 2 else (None, None, None)
    require(source in CHECKPOINT_DIRS and tag != "" and (step is None or step.isdigit()),
            f"--teacher must be SOURCE[:MODEL_TAG[:STEP]] with SOURCE {', '.join(CHECKPOINT_DIRS)} and STEP a number "
            f"(e.g. --teacher=rl:d32 or --teacher=sft:d20:700), got {spec!r}")
    return source, tag, None if step is None else int(step)


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
