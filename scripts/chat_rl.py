"""
Reinforcement learning on GSM8K (or another task) with on-policy policy gradients, as in nanochat.

Each step, for each of the step's questions:
  1. sample --num-samples completions from the current model (KV-cached, calculator tool enabled);
  2. reward each completion (1.0 if the answer after #### is right, else 0.0);
  3. advantage = reward - mean reward of the question's samples (no std, no KL, no clipping);
  4. loss = -sum(logp * advantage) over sampled tokens only (prompt, tool outputs and padding masked),
     normalized per pass of --device-batch-size rows, by the passes and by the questions per rank;
then one Muon (matrices) + AdamW (embeddings, unembedding, scalars) step, LR decaying linearly to 0
(nanochat; --lr-schedule, --warmup-steps and --final-lr-frac for others).
Algorithm options (README "Algorithm options"; each defaults to nanochat's behaviour): --loss-norm,
--advantage-std, --mask-truncated, --ppo-epochs with --clip-low/--clip-high, --kl-coef.

Launch:
  python -m scripts.chat_rl                                                   # 1 GPU, or CPU
  torchrun --standalone --nproc_per_node=8 -m scripts.chat_rl -- --run=my_run # 8 GPUs
  python -m scripts.chat_rl --device-type=cpu --dtype=float32 --task=arithmetic --num-steps=50
  python -m scripts.chat_rl --source=rl                  # a new run from the last RL checkpoint -> <tag>_cont
  torchrun --nproc_per_node=4 -m scripts.chat_rl -- --resume  # continue the latest run, on 4 ranks (any number
                                                             # dividing --examples-per-step; README "Resume ...")
"""

import argparse
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import torch

from nanochat.checkpoints.errors import CheckpointError
from nanochat.checkpoints.layout import CHECKPOINT_DIRS
from nanochat.checkpoints.loading import find_checkpoint, load_model
from nanochat.checkpoints.store import (list_steps, list_tags, load_meta, make_checkpoint_dir, new_run_id,
                                        save_checkpoint, update_meta)
from nanochat.checkpoints.pruning import prune_checkpoints, remove_extra_shards
from nanochat.cli import (ArgumentParser, add_compile_flag, add_debug_flag, add_decode_flag, add_memory_budget_flag,
                          add_model_generation_flag, add_optimizer_flags, add_runtime_flags, add_train_rows_flag,
                          check_decode_flag, check_optimizer_flags, check_train_rows, resolve_compile_flag, run_main,
                          train_rows)
from nanochat.model.compile import CPU_DECODE_MIN_STEPS, CompileClock, maybe_compiled, run_decode_mode
from nanochat.common import (GracefulStop, UserError, autocast_context, collective_device, compute_cleanup,
                             compute_dtype, compute_init, dtype_name, format_duration, get_base_dir, get_dist_info, print0,
                             remaining_seconds, require, requested_dtype, wait_for_all_ranks)
from nanochat.engine.cuda_graphs import DECODE_DESCRIPTIONS
from nanochat.engine.engine import Engine
from nanochat.engine.memory_budget import FIXED_GB, resolve_memory_budget
from nanochat.rl.evaluation import evaluate_pass_at_k
from nanochat.rl.metrics import drop_unmeasured, objective_metrics, reduce_metrics, rollout_metrics
from nanochat.optim.optimizers import LR_SCHEDULES, guarded_step, lr_multiplier, scale_initial_lr
from nanochat.checkpoints.optimizer_shards import optimizer_states_for_resume
from nanochat.model.precision import MARGIN, PREFERENCE, fastest_rollout_dtype, fastest_training_dtype, rank0_choice
from nanochat.report import get_report, log_chat_rl
from nanochat.rl.objective import LOSS_NORMS, ROLLOUT_CORRECTIONS, PolicyLoss, step_counts
from nanochat.rl.policy_gradient import TrainStats, accumulate_policy_gradient, chunk_logprobs
from nanochat.rl.rollout import Sampling, longest_prompt, question_seed, sample_questions, step_question_indices
from nanochat.wandb_utils import init_wandb, log_samples_table
from tasks.registry import make_task, resolve_task_class


def add_algorithm_flags(p):
    """The RL algorithm's options; each default is nanochat's (see README, Algorithm options)."""
    p.add_argument("--loss-norm", type=str, default="pass",
                   help="denominator of each token's term: pass (nanochat: valid tokens per pass of --device-batch-size "
                        "rows), token (DAPO: all the step's tokens), sequence (mean per sequence, then over sequences), "
                        "constant (Dr. GRPO: num_samples * max_new_tokens per question)")
    p.add_argument("--advantage-std", action="store_true",
                   help="divide each question's advantages by its reward std + 1e-4 (GRPO)")
    p.add_argument("--mask-truncated", action="store_true",
                   help="rows cut at --max-new-tokens carry no gradient and count in no denominator (overlong filtering)")
    p.add_argument("--ppo-epochs", type=int, default=1,
                   help="optimizer steps per batch of rollouts; epochs after the first use the clipped ratio (PPO)")
    p.add_argument("--clip-low", type=float, default=0.2, help="PPO ratio clipped below at 1 - clip-low")
    p.add_argument("--clip-high", type=float, default=0.2, help="PPO ratio clipped above at 1 + clip-high (DAPO: 0.28)")
    p.add_argument("--kl-coef", type=float, default=0.0,
                   help="weight of the k3 KL penalty to the starting model (0 = none; > 0 loads a second copy)")
    p.add_argument("--rollout-correction", type=str, default="none",
                   help="correct for the gap between the sampler's and the trainer's log-probabilities: none (nanochat), "
                        "token-tis (each token's term times min(ratio, cap)) or sequence-mask (drop rows whose "
                        "sequence ratio leaves [1/cap, cap]); ratio = exp(logp_trainer - logp_sampler), whole vocabulary")
    p.add_argument("--rollout-correction-cap", type=float, default=2.0,
                   help="the cap of --rollout-correction (> 1)")


def parse_args(argv):
    p = ArgumentParser(description="RL on GSM8K (or --task) with on-policy policy gradients")
    # logging and runtime
    add_runtime_flags(p)
    p.add_argument("--rollout-dtype", type=str, default="auto",
                   help="dtype of rollouts and evals: auto (float32 with --dtype=float32; else bfloat16 on a GPU, and "
                        "on a CPU/MPS bfloat16 only where the run's rollout, timed shortened at the start, is 1.2x "
                        "faster, or as --dtype where the decode step is compiled; kept on --resume), float32 or bfloat16")
    # model to start from, and where the run is written
    p.add_argument("--source", type=str, default="sft",
                   help="checkpoint family to start from: base|mid|sft|rl (rl: a new run from an RL checkpoint)")
    p.add_argument("--model-tag", type=str, default=None, help="model tag (subdirectory) to load; default: the largest d<N>")
    p.add_argument("--model-step", type=int, default=None, help="checkpoint step to load; default: the last one")
    add_model_generation_flag(p)
    p.add_argument("--output-tag", type=str, default=None,
                   help="write the run to chatrl_checkpoints/<tag>; default: the model tag (d<depth> without "
                        "--model-tag), or <model tag>_cont with --source=rl")
    # data
    p.add_argument("--task", type=str, default="gsm8k",
                   help="task to train and evaluate on: gsm8k, arithmetic, or package.module:ClassName")
    p.add_argument("--num-epochs", type=int, default=1, help="epochs over the task's train split")
    p.add_argument("--num-steps", type=int, default=-1, help="override the number of steps (-1 = from epochs)")
    # batch sizes and sampling
    p.add_argument("--device-batch-size", type=int, default=8,
                   help="rows per pass: nanochat's micro-batch, whose valid tokens each row's loss denominator counts "
                        "(forwards take --train-rows rows); also eval samples per question")
    add_train_rows_flag(p)
    p.add_argument("--examples-per-step", type=int, default=16, help="questions per optimizer step, summed over ranks")
    p.add_argument("--num-samples", type=int, default=16, help="completions sampled per question")
    p.add_argument("--max-new-tokens", type=int, default=256, help="completion length cap in tokens")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=50, help="top-k sampling (0 = whole vocabulary)")
    p.add_argument("--max-rows", type=int, default=0,
                   help="max rows decoded together in one rollout batch (0 = as many as --memory-budget-gb allows)")
    add_memory_budget_flag(p)
    add_decode_flag(p, auto_note=f"; on a CPU, training in bf16, static where --compile compiles it: auto from "
                                 f"{CPU_DECODE_MIN_STEPS} steps, on always")
    add_compile_flag(p)
    # optimization
    add_optimizer_flags(p)
    p.add_argument("--init-lr-frac", type=float, default=0.05, help="every lr is multiplied by this at the start")
    p.add_argument("--lr-schedule", type=str, default="linear",
                   help="lr multiplier over the run, after any warm-up: linear (nanochat: from 1 down to --final-lr-frac "
                        "at the last step), constant (1), or cosine (half a cosine from 1 down to --final-lr-frac)")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="steps whose lr multiplier rises linearly, (step + 1) / warmup-steps, before the schedule")
    p.add_argument("--final-lr-frac", type=float, default=0.0,
                   help="the lr multiplier the linear and cosine schedules reach at the end (0 = nanochat's decay to 0)")
    add_algorithm_flags(p)
    # eval and checkpoints
    p.add_argument("--eval-every", type=int, default=60, help="pass@k eval period in steps (-1 = never)")
    p.add_argument("--eval-examples", type=int, default=400, help="test questions used by the eval")
    p.add_argument("--save-every", type=int, default=60, help="checkpoint period in steps (-1 = only the last step)")
    p.add_argument("--keep-last", type=int, default=None,
                   help="after each save, remove this run's older checkpoints beyond the last N (0 = keep all, as "
                        "nanochat; the default, except that --resume keeps the run's own value unless given)")
    # robustness
    p.add_argument("--resume", type=str, nargs="?", const="latest", default="",
                   help="continue an RL run: --resume (the latest), --resume=TAG (its last step) or --resume=TAG:STEP")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing chatrl_checkpoints/<tag> run (without it, the run is refused)")
    p.add_argument("--max-bad-steps", type=int, default=5,
                   help="abort after this many consecutive steps with a non-finite loss or gradient")
    p.add_argument("--no-signal-steps", type=int, default=10,
                   help="warn when this many consecutive steps trained no row (every advantage 0: nothing to learn "
                        "from); 0 = never")
    add_debug_flag(p)
    return p.parse_args(argv)


def validate_args(args, world_size):
    """Refuse flag values that would silently do the wrong thing (nanochat would train on zero samples
    when --num-samples < --device-batch-size, for example)."""
    args.dtype = requested_dtype(args.dtype)
    require(args.rollout_dtype in ("auto", "float32", "bfloat16"),
            f"--rollout-dtype must be auto, float32 or bfloat16, got {args.rollout_dtype!r}")
    require(args.source in CHECKPOINT_DIRS, f"--source must be {', '.join(CHECKPOINT_DIRS)}, got {args.source!r}")
    resolve_task_class(args.task)  # an unknown --task is reported now, not after the checkpoint has loaded
    if args.output_tag is not None:
        require(args.output_tag not in ("", ".", "..") and "/" not in args.output_tag and os.sep not in args.output_tag,
                f"--output-tag must be a directory name (no '/'), got {args.output_tag!r}")
        require(not args.resume, "--resume continues a run in its own directory and --output-tag names a new run's; "
                                 "pass only one")
    if args.source == "rl" and args.model_tag is not None:
        resolve_output_tag(args, args.model_tag, depth=None)  # refuses the run it reads
    for name in ("device_batch_size", "examples_per_step", "num_samples", "max_new_tokens", "num_epochs", "eval_examples"):
        require(getattr(args, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_train_rows(args)
    require(args.num_samples % args.device_batch_size == 0,
            f"--num-samples ({args.num_samples}) must be a multiple of --device-batch-size ({args.device_batch_size}); "
            f"e.g. --device-batch-size={_largest_divisor_at_most(args.num_samples, args.device_batch_size)}")
    if not args.resume:  # a resumed run's own value is checked once restored (restore_settings)
        require(args.examples_per_step % world_size == 0,
                f"--examples-per-step ({args.examples_per_step}) must be divisible by the number of ranks ({world_size}); "
                f"use a multiple of {world_size}")
    require(args.temperature >= 0, f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    require(args.top_k >= 0, f"--top-k must be >= 0 (0 = disabled), got {args.top_k}")
    require(args.max_rows >= 0, f"--max-rows must be >= 0 (0 = from the memory budget), got {args.max_rows}")
    check_optimizer_flags(args)
    require(0 < args.init_lr_frac <= 1, f"--init-lr-frac must be in (0, 1], got {args.init_lr_frac}")
    require(args.lr_schedule in LR_SCHEDULES, f"--lr-schedule must be {', '.join(LR_SCHEDULES)}, got {args.lr_schedule!r}")
    require(args.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    require(0 <= args.final_lr_frac <= 1, f"--final-lr-frac must be in [0, 1], got {args.final_lr_frac}")
    require(args.lr_schedule != "constant" or args.final_lr_frac == 0,
            f"--final-lr-frac={args.final_lr_frac} is the end of a linear or cosine schedule; --lr-schedule=constant "
            f"keeps the multiplier at 1 (drop --final-lr-frac, or choose linear or cosine)")
    require(args.eval_every == -1 or args.eval_every >= 1, f"--eval-every must be >= 1, or -1 to disable, got {args.eval_every}")
    require(args.save_every == -1 or args.save_every >= 1, f"--save-every must be >= 1, or -1 for the last step only, got {args.save_every}")
    require(args.keep_last is None or args.keep_last >= 0,
            f"--keep-last must be >= 0 (0 = keep every checkpoint), got {args.keep_last}")
    require(args.num_steps == -1 or args.num_steps >= 1, f"--num-steps must be >= 1, or -1 to derive it from epochs, got {args.num_steps}")
    require(args.max_bad_steps >= 1, f"--max-bad-steps must be >= 1, got {args.max_bad_steps}")
    require(args.no_signal_steps >= 0, f"--no-signal-steps must be >= 0 (0 = never warn), got {args.no_signal_steps}")
    require(args.loss_norm in LOSS_NORMS, f"--loss-norm must be {', '.join(LOSS_NORMS)}, got {args.loss_norm!r}")
    require(args.ppo_epochs >= 1, f"--ppo-epochs must be >= 1 (1 = nanochat's on-policy step), got {args.ppo_epochs}")
    require(0 <= args.clip_low < 1, f"--clip-low must be in [0, 1) (the ratio is clipped at 1 - clip-low), got {args.clip_low}")
    require(args.clip_high >= 0, f"--clip-high must be >= 0, got {args.clip_high}")
    require(args.kl_coef >= 0, f"--kl-coef must be >= 0 (0 = no KL penalty), got {args.kl_coef}")
    require(args.rollout_correction in ROLLOUT_CORRECTIONS,
            f"--rollout-correction must be {', '.join(ROLLOUT_CORRECTIONS)}, got {args.rollout_correction!r}")
    require(args.rollout_correction_cap > 1, f"--rollout-correction-cap must be > 1, got {args.rollout_correction_cap}")
    require(not (args.resume and args.overwrite), "--resume continues a run and --overwrite replaces it; pass only one")


def _largest_divisor_at_most(n, limit):
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def load_reference(start, device, generation):
    """The frozen model of --kl-coef's penalty: the checkpoint the run started from (start: its source, tag and
    step, as recorded in the run's meta), so a resumed run is penalized towards the same model."""
    if start is None:
        raise UserError("--kl-coef > 0 needs the checkpoint the run started from, and this run's meta does not record "
                        "it (written before --kl-coef existed); resume it with its own flags or start a new run")
    reference, _, _ = load_model(start["source"], device, phase="eval", model_tag=start["model_tag"], step=start["step"],
                                 generation=generation)
    reference.requires_grad_(False)
    return reference


def phase_dtype(phase, device, requested, measure):
    """The dtype name one phase (phase: "training" or "rollouts") runs in, for `requested` (auto, float32 or
    bfloat16: --dtype or --rollout-dtype). float32 when asked, or where bf16 is not native (a note says so);
    bf16 when asked, or for auto on CUDA; for auto on a CPU or MPS with native bf16, the faster of the two by
    measure(candidates): fp32 unless bf16 wins by the margin (measured on rank 0; every rank takes its choice)."""
    what, flag = {"training": ("training computes", "--dtype"), "rollouts": ("rollouts decode", "--rollout-dtype")}[phase]
    dtype = compute_dtype(device, requested, what)  # float32 when asked or where bf16 is not native, else bf16
    if dtype == torch.float32 or requested == "bfloat16" or device.type == "cuda":
        return dtype_name(dtype)
    name = dtype_name(rank0_choice(lambda: measure(list(PREFERENCE)), list(PREFERENCE)))
    print0(f"{what} in {name}: bfloat16 measured {'at least' if name == 'bfloat16' else 'less than'} {MARGIN}x as fast "
           f"as float32 on this {device.type} ({flag} to choose)")
    return name


def resolve_training_dtype(args, model, tokenizer, train_task, device, rows):
    """Set args.dtype to what training runs in (the run's config and checkpoints record it, so a resumed run
    computes as it did), timed on one micro-batch of the run's own shape (`rows` rows of the first question's prompt
    plus --max-new-tokens). Returns the dtype that was asked for (resolve_rollout_dtype's `requested`)."""
    requested = args.dtype
    length = len(tokenizer.render_for_completion(train_task[0])) + args.max_new_tokens
    args.dtype = phase_dtype("training", device, requested, lambda candidates: fastest_training_dtype(
        model, rows, length, candidates))
    return requested


def resolve_rollout_dtype(args, model, tokenizer, train_task, device, world_size, requested, compiled_decode=False):
    """Set args.rollout_dtype to what rollouts run in (recorded, as args.dtype is), after resolve_training_dtype
    (requested: the --dtype asked for). --rollout-dtype=auto is float32 with a float32 --dtype; with a compiled decode step (compiled_decode), training's
    dtype: timing it would compile it twice, and compiled its matmuls are most of its time, as in training (measured
    on an AVX512-BF16 CPU, 256 rows: 12.9 ms a step in bf16, 26.2 in fp32); else timed on its own on the run's
    rollout shortened (its first questions x --num-samples, 16 tokens, an uncompiled engine in the run's decode
    mode; see fastest_rollout_dtype): the eager step's many small operations gain less from bf16, and decoding and
    training gain from bf16 on different CPUs."""
    if compiled_decode and args.rollout_dtype == "auto":
        args.rollout_dtype = args.dtype
        print0(f"rollouts decode in {args.dtype}: as training, with the compiled decode step (--rollout-dtype to choose)")
        return
    rollout_request = "float32" if args.rollout_dtype == "auto" and requested == "float32" else args.rollout_dtype

    def measure_rollouts(candidates):
        questions = max(1, min(len(train_task), args.examples_per_step // world_size))  # a rank's step
        prompts = [tokenizer.render_for_completion(train_task[i]) for i in range(questions)]
        budget = args.memory_budget_gb if isinstance(args.memory_budget_gb, (int, float)) else FIXED_GB  # off CUDA
        engine = Engine(model, tokenizer, max_rows=args.max_rows or None, memory_budget_gb=budget, decode=args.decode,
                        compile="off")
        return fastest_rollout_dtype(engine, prompts, args.num_samples, candidates)
    args.rollout_dtype = phase_dtype("rollouts", device, rollout_request, measure_rollouts)


# flags that define the run; --resume restores them from the checkpoint so the continuation is exact
RUNTIME_FLAGS = ("run", "device_type", "resume", "overwrite", "debug", "max_rows", "memory_budget_gb", "max_bad_steps",
                 "output_tag", "decode", "compile", "keep_last", "no_signal_steps",  # a resumed run writes to its own directory
                 "train_rows")  # the same gradient for any value: the machine's memory decides


def resolve_resume(spec):
    """--resume value -> (tag, step) of the RL checkpoint to continue from."""
    rl_root = os.path.join(get_base_dir(), CHECKPOINT_DIRS["rl"])
    tag, _, step = spec.partition(":") if spec != "latest" else ("", "", "")
    if not tag:
        tags = list_tags(rl_root) if os.path.isdir(rl_root) else []
        if not tags:
            raise UserError(f"--resume: no RL run in {rl_root}; start one without --resume")
        tag = max(tags, key=lambda t: os.path.getmtime(os.path.join(rl_root, t)))
    directory = os.path.join(rl_root, tag)
    if not os.path.isdir(directory):
        raise UserError(f"--resume: no RL run {tag!r} in {rl_root}; available: {', '.join(list_tags(rl_root)) or 'none'}")
    if step and not step.isdigit():
        raise UserError(f"--resume={spec}: the step after ':' must be a number")
    steps = list_steps(directory)  # checked here: the loader's own error would point at --model-step
    if not steps:
        raise UserError(f"--resume: the RL run {tag!r} in {rl_root} has no saved step; start a new run with --overwrite")
    if step and int(step) not in steps:
        raise UserError(f"--resume={spec}: run {tag!r} has no step {int(step)}; saved steps: "
                        f"{', '.join(map(str, steps))} (e.g. --resume={tag}:{steps[-1]})")
    return tag, int(step) if step else steps[-1]


def resolve_output_tag(args, source_tag, depth):
    """The chatrl_checkpoints/<tag> a new run writes: --output-tag; else, from an RL checkpoint, <source_tag>_cont
    (never the run it reads); else nanochat's rule: --model-tag, or d<depth> of the loaded model."""
    if args.output_tag is not None:
        tag = args.output_tag
    elif args.source == "rl":
        tag = f"{source_tag}_cont"
    else:
        tag = args.model_tag or f"d{depth}"
    if args.source == "rl" and tag == source_tag:
        raise UserError(f"--output-tag={tag} is the RL run --source=rl reads; a new run needs another --output-tag "
                        f"(to continue that run, use --resume={tag})")
    return tag


def is_eval_step(step, num_steps, eval_every):
    """pass@k is evaluated every eval_every steps from step 0, and after the last update (step num_steps)."""
    return eval_every > 0 and (step % eval_every == 0 or step == num_steps)


def prepare_output_dir(checkpoint_dir, overwrite, master):
    """Refuse to silently mix a new run into an old run's directory; --overwrite clears the old run first
    (so the loader's 'last step' cannot pick one of its checkpoints)."""
    old = [f for f in (os.listdir(checkpoint_dir) if os.path.isdir(checkpoint_dir) else [])
           if f.startswith(("model_", "meta_", "optim_"))]
    make_checkpoint_dir(checkpoint_dir)  # fail now, not after an hour of training, if it cannot be written
    if not old:
        return
    if not overwrite:
        raise UserError(f"{checkpoint_dir} already holds an RL run ({len(old)} files); continue it with --resume, "
                        f"replace it with --overwrite, or choose another --model-tag")
    if master:
        for f in old:
            os.remove(os.path.join(checkpoint_dir, f))


@dataclass
class Resume:
    """The saved step --resume continues."""
    tag: str
    step: int
    checkpoint_dir: str
    meta: dict    # the step's meta json as saved

    @contextlib.contextmanager
    def errors(self):
        """A checkpoint that cannot be read: one line naming --resume's fix (the loader's would name --model-step,
        which --resume does not read)."""
        try:
            yield
        except CheckpointError as e:
            raise UserError(f"--resume: {e}; {resume_hint(self.tag, self.step, list_steps(self.checkpoint_dir))}") from e


def restore_settings(args, world_size):
    """--resume, from the step's meta alone, before any process group or model: the run's saved settings put back
    into args (only RUNTIME_FLAGS stay as given), so the continuation is the run it was, and checked against this
    run's number of ranks, which may differ from the run's (the optimizer state is then re-split, see setup_run).
    Returns the Resume."""
    tag, step = resolve_resume(args.resume)
    checkpoint_dir = os.path.join(get_base_dir(), CHECKPOINT_DIRS["rl"], tag)
    resume = Resume(tag=tag, step=step, checkpoint_dir=checkpoint_dir, meta={})
    with resume.errors():
        resume.meta = load_meta(checkpoint_dir, step)
    saved = {k: v for k, v in resume.meta.get("user_config", {}).items() if k not in RUNTIME_FLAGS}
    changed = sorted(k for k, v in saved.items() if getattr(args, k, v) != v)
    vars(args).update(saved)
    if changed:
        print0(f"--resume: using the run's saved settings for {', '.join(changed)}")
    per_step = args.examples_per_step
    require(per_step % world_size == 0,
            f"--resume: run {tag} takes {per_step} questions a step (its --examples-per-step), which {world_size} ranks "
            f"cannot share evenly; resume it on a number of ranks that divides {per_step} (e.g. torchrun "
            f"--nproc_per_node={_largest_divisor_at_most(per_step, world_size)})")
    validate_args(args, world_size)
    args.output_tag = tag
    return resume


def resume_hint(tag, step, steps):
    """What to do about a checkpoint of run `tag` that cannot be resumed at `step` (steps: the saved ones)."""
    others = [s for s in steps if s != step]
    if not others:
        return "no other step of this run is saved: start a new run with --overwrite"
    return (f"resume another saved step (--resume={tag}:{others[-1]}; saved: {', '.join(map(str, others))}) "
            f"or start a new run with --overwrite")


def restore_optimizers(resume, optimizers, meta, rank, world_size, device):
    """Load the optimizer state of the resumed step into `optimizers`: every rank's shard checked (present, readable,
    of this step, rank and run) before any is used, and when the step was saved by another number of ranks, all of
    them gathered and re-split for this one. A fault is one line on every rank and nothing is written. Returns the
    number of ranks that saved the step."""
    with resume.errors():
        states, saved = optimizer_states_for_resume(resume.checkpoint_dir, resume.step, device, meta, optimizers,
                                                    rank, world_size)
    for opt, state in zip(optimizers, states):
        opt.load_state_dict(state)  # also restores each group's initial_lr and lr
    if saved != world_size:
        print0(f"--resume: the optimizer state of {saved} rank{'s' * (saved != 1)} re-split for {world_size}")
    return saved


def start_new_run(args, device):
    """The --source checkpoint a new run starts from. Sets args.output_tag. Returns (model, tokenizer, meta)."""
    _, source_tag, source_step = find_checkpoint(args.source, args.model_tag, args.model_step)
    # from an RL run the tag is known (and the source run refused) before loading; else it may need the depth
    output_tag = resolve_output_tag(args, source_tag, depth=None) if args.source == "rl" else None
    model, tokenizer, meta = load_model(args.source, device, phase="eval", model_tag=source_tag, step=source_step,
                                        generation=args.model_generation)
    args.output_tag = output_tag or resolve_output_tag(args, source_tag, model.config.n_layer)
    meta["start_checkpoint"] = {"source": args.source, "model_tag": source_tag, "step": source_step}
    print0(f"Starting a new RL run from {args.source} {source_tag} step {source_step}; writing to {args.output_tag}")
    return model, tokenizer, meta


@dataclass
class RLRun:
    """What a run carries from step to step. `config` is the effective configuration: the flags after
    --resume restored the run's own and the output tag and dtypes were resolved; every checkpoint records it."""
    config: argparse.Namespace
    model: torch.nn.Module
    engine: Engine
    optimizers: list
    policy_loss: PolicyLoss
    reference: torch.nn.Module             # --kl-coef's frozen starting model, or None
    train_task: object
    val_task: object
    num_steps: int
    start_step: int
    start_checkpoint: dict                 # {source, model_tag, step} the run started from
    checkpoint_dir: str
    rank: int
    world_size: int
    device: torch.device
    run_id: str                            # recorded in every checkpoint's meta and shards (checked on --resume)
    segments: list                         # [{start_step, world_size}] of the run's start and each --resume
    history: list                          # per-step metrics, for the report
    eval_history: list                     # (step, pass@k dict)
    last_saved: int = None
    micro_rows: int = 0                    # rows per training forward; halved on out-of-memory
    consecutive_bad: int = 0
    steps_without_signal: list = field(default_factory=list)  # records of the current streak of steps that trained no row
    forward: object = chunk_logprobs       # the training pass's chunk forward: compiled or not (--compile)
    compile_clock: CompileClock = field(default_factory=CompileClock)  # what each step compiled
    step_seconds: list = field(default_factory=list)   # this process's timings, for the ETA, compiling left out
    eval_seconds: list = field(default_factory=list)

    @property
    def master(self):
        return self.rank == 0

    @property
    def examples_per_rank(self):
        return self.config.examples_per_step // self.world_size

    @property
    def reduce_device(self):
        return collective_device(self.device)

    def autocast(self, rollouts=False):
        return autocast_context(self.device, getattr(torch, self.config.rollout_dtype if rollouts else self.config.dtype))


def resolve_decode_and_compile(args, device, num_steps):
    """The decode mode and the CompilePlan of a run of num_steps steps in all (printed with why), args.decode and
    args.compile set to them: compile.run_decode_mode's mode (--decode=auto on a CPU is the static step where it is
    compiled and the run trains in bf16), compile.compile_plan's plan for it. Decided on the run's whole length, not
    the steps left, so that a resumed run decodes as it started (--decode and --compile are not restored by
    --resume; the compiled step may sample another token at a near-tie). Every rank takes the same plan
    (compile.resolve_compile); where it compiles nothing, the mode is the one --decode gives uncompiled. A decode
    step that fails to compile later, at its first call, warns once and runs uncompiled (the same tokens)."""
    uncompiled = check_decode_flag(args.decode, device)
    decode = run_decode_mode(args.decode, uncompiled, args.compile, device, num_steps, args.dtype)
    compiling = resolve_compile_flag(args, device, decode, num_steps)
    args.decode = decode if compiling.decode else uncompiled
    return compiling


def setup_run(args, resume, rank, world_size, device):
    """Load the model (a new run, or `resume`: restore_settings' Resume), resolve the effective configuration, and
    build the optimizers, the engine and the tasks: an RLRun at its first step."""
    start_step = 0
    if resume:
        with resume.errors():
            model, tokenizer, meta = load_model("rl", device, phase="eval", model_tag=resume.tag, step=resume.step)
        start_step = resume.step + 1
        print0(f"Resuming RL run {resume.tag} after step {resume.step}")
    else:
        model, tokenizer, meta = start_new_run(args, device)
    if args.keep_last is None:  # not given: a resumed run keeps its own disk policy, a new run every checkpoint
        args.keep_last = (meta.get("user_config", {}).get("keep_last") if args.resume else None) or 0
    start = meta.get("start_checkpoint")
    train_task, val_task = make_task(args.task, "train"), make_task(args.task, "test")
    rows = train_rows(args)  # per training forward
    num_steps = args.num_steps if args.num_steps > 0 else (len(train_task) // args.examples_per_step) * args.num_epochs
    if num_steps < 1:
        raise UserError(f"the {args.task} train split has {len(train_task)} questions, fewer than --examples-per-step "
                        f"({args.examples_per_step}); lower --examples-per-step or pass --num-steps")
    require(args.warmup_steps < num_steps, f"--warmup-steps ({args.warmup_steps}) must be fewer than the run's "
                                           f"{num_steps} steps")
    print0(f"Calculated number of steps: {num_steps}")
    requested_dtype = resolve_training_dtype(args, model, tokenizer, train_task, device, rows)
    compiling = resolve_decode_and_compile(args, device, num_steps)
    resolve_rollout_dtype(args, model, tokenizer, train_task, device, world_size, requested_dtype,
                          compiled_decode=bool(compiling.decode))
    checkpoint_dir = os.path.join(get_base_dir(), CHECKPOINT_DIRS["rl"], args.output_tag)
    # Muon orthogonalizes in the run's compute dtype: bf16 where it is native (nanochat's numerics), fp32 otherwise
    optimizers = scale_initial_lr(model.setup_optimizers(unembedding_lr=args.unembedding_lr, embedding_lr=args.embedding_lr,
                                                         matrix_lr=args.matrix_lr, weight_decay=args.weight_decay,
                                                         recipe=args.recipe, ortho_dtype=getattr(torch, args.dtype)),
                                  args.init_lr_frac)
    segments = [{"start_step": 0, "world_size": world_size}]  # the world size of each part of the run
    if resume:
        saved = restore_optimizers(resume, optimizers, meta, rank, world_size, device)
        segments = meta.get("segments") or [{"start_step": 0, "world_size": saved}]
        segments = segments + [{"start_step": start_step, "world_size": world_size}]
    reference = load_reference(start, device, args.model_generation) if args.kl_coef > 0 else None
    args.memory_budget_gb, budget_line = resolve_memory_budget(
        args.memory_budget_gb, model, device, optimizers, rows=rows,
        completion_tokens=args.max_new_tokens, prompt_tokens=model.config.sequence_len,
        rollout_dtype=getattr(torch, args.rollout_dtype))
    print0(budget_line or f"KV cache budget: {args.memory_budget_gb:g} GiB (--memory-budget-gb)")
    engine = Engine(model, tokenizer, max_rows=args.max_rows or None, memory_budget_gb=args.memory_budget_gb,
                    decode=args.decode, compile=args.compile if compiling.decode else "off")
    how = DECODE_DESCRIPTIONS[engine.decode]
    how = "bucketed static shapes, compiled" if compiling.decode and engine.decode == "static" else how
    print0(f"rollouts: {engine.decode} decode step ({how}; --decode to choose)")
    print0(f"training: {rows} rows of a question per forward "
           f"({'--train-rows' if args.train_rows else 'auto'}; the same gradient for any count)")
    if engine.decode != "eager":  # one static batch for the run, its graphs captured once: sized for every prompt
        engine.reserve_prompt_length(longest_prompt(tokenizer, train_task, val_task))
        print0(f"rollouts: static batch sized for prompts of up to {engine.prompt_floor} tokens (the task's longest)")
    if not args.resume:  # last: --overwrite clears the old run only once everything else has loaded
        prepare_output_dir(checkpoint_dir, args.overwrite, rank == 0)
    return RLRun(
        config=args, model=model, optimizers=optimizers,
        engine=engine,
        policy_loss=PolicyLoss(loss_norm=args.loss_norm, max_new_tokens=args.max_new_tokens, mask_truncated=args.mask_truncated,
                               clip_low=args.clip_low, clip_high=args.clip_high, kl_coef=args.kl_coef,
                               rollout_correction=args.rollout_correction, correction_cap=args.rollout_correction_cap),
        reference=reference,
        train_task=train_task, val_task=val_task, num_steps=num_steps, start_step=start_step, start_checkpoint=start,
        checkpoint_dir=checkpoint_dir, rank=rank, world_size=world_size, device=device,
        run_id=(meta.get("run_id") if args.resume else None) or new_run_id(),  # a new run (from any source): a new id
        segments=segments,
        history=list(meta.get("history", [])) if args.resume else [],
        eval_history=[tuple(e) for e in meta.get("eval_history", [])] if args.resume else [],
        last_saved=start_step - 1 if args.resume else None, micro_rows=rows,
        forward=maybe_compiled(chunk_logprobs, compiling.train, dynamic=True, required=args.compile == "on"))


def with_fewer_rows_on_oom(attempt, rows, message, rows_in_use=None, free_memory=None):
    """attempt(rows), retried on out-of-memory with half the rows the failed attempt used (rows_in_use(), by
    default rows) until one row fails too; message is formatted with the new rows and printed. First, if given,
    free_memory() may give back memory held for later and return what to print: then the same rows are tried
    again. The result does not depend on the rows (per-row sampling streams; gradients summed in chunks).
    Returns (result, rows)."""
    while True:
        try:
            return attempt(rows), rows
        except torch.OutOfMemoryError:
            freed = free_memory() if free_memory else None
            if freed:
                print0(freed)
                continue
            used = (rows_in_use() if rows_in_use else rows) or 1
            if used <= 1:
                raise
            rows = used // 2
            print0(message.format(rows=rows))


def give_back_rollout_memory(engine):
    """After an out-of-memory in training: first the batches the engine keeps from other rollouts (an eval's) go,
    the step's own staying; at the next, the engine's batch and weight copies kept for the next rollout go, and
    later rollouts keep none (rebuilding them each rollout costs less than running short of memory each step).
    What to print, or None if it held nothing."""
    dropped = engine.drop_kept_batches(keep_latest=True)
    if dropped:
        return (f"out of memory during training: gave back the {dropped} decode batch(es) the rollout engine keeps "
                "from other rollouts (an eval's); retrying")
    if engine.release(keep_from_now_on=False):
        return ("out of memory during training: gave back the KV cache, decode graphs and weights the rollout engine "
                "keeps between rollouts (it keeps none from now on); retrying")
    return None


def evaluate(run, step):
    """pass@k on the test split (device_batch_size samples of each of --eval-examples questions); logged."""
    run.model.eval()
    t0 = time.time()
    with run.autocast(rollouts=True):
        passk, _ = evaluate_pass_at_k(run.engine, run.val_task, run.config.eval_examples, run.config.device_batch_size,
                                      max_new_tokens=256, temperature=1.0, top_k=50, device=run.reduce_device, seed=0)
    t_eval = time.time() - t0
    # what compiled since the last step line is the eval's own (its batch's shapes): said here, not in the next step's
    # line, and left out of the ETA, which counts what every later eval costs
    graphs, compile_s = run.compile_clock.lap()
    # the most of any rank (rank 0's eval time includes waiting for the others' compiles), as a step's
    compiled = reduce_metrics({"compiles": graphs, "compile_s": compile_s}, run.reduce_device)
    graphs, compile_s = int(compiled["compiles"]), float(compiled["compile_s"])
    run.eval_seconds.append(max(t_eval - compile_s, 0.0))
    print0(f"Step {step} | " + ", ".join(f"Pass@{k + 1}: {v:.4f}" for k, v in enumerate(passk.any)) + f" | eval {t_eval:.1f}s"
           + (f" | compiled {graphs} graphs in {compile_s:.1f}s" if graphs else ""))
    run.eval_history.append((step, passk.as_dict()))
    return {"step": step, **passk.as_dict(), "time/eval": t_eval, "eval_compiles": graphs, "eval_compile_s": compile_s}


def sample_rollouts(run, step):
    """This rank's questions of `step`, sampled and rewarded (with fewer rows at a time after an out-of-memory)."""
    cfg = run.config
    indices = step_question_indices(step, run.examples_per_rank, run.rank, run.world_size, len(run.train_task))
    sampling = Sampling(num_samples=cfg.num_samples, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                        top_k=cfg.top_k)

    def attempt(max_rows):
        run.engine.max_rows = max_rows
        with run.autocast(rollouts=True):
            return sample_questions(run.engine, run.train_task, indices, [question_seed(step, i) for i in indices],
                                    sampling, scale_by_std=cfg.advantage_std, label=f"step {step} rollouts")
    def give_back_kept_batches():  # an eval's batch kept beside the steps' (Engine._new_batch), or theirs beside it
        dropped = run.engine.drop_kept_batches()
        return (f"out of memory during rollouts: gave back the {dropped} decode batch(es) kept from other rollouts; "
                "retrying") if dropped else None
    run.model.eval()
    rollouts, _ = with_fewer_rows_on_oom(attempt, run.engine.max_rows, "out of memory during rollouts: retrying with "
                                         "--max-rows={rows}", rows_in_use=lambda: max(run.engine.last_stats.rows_allocated,
                                                                                 run.engine.last_stats.max_batch_rows),
                                         free_memory=give_back_kept_batches)
    return rollouts


@dataclass
class TrainResult:
    """What one step's training did on this rank."""
    first: TrainStats       # the on-policy epoch: entropy, trained rows, the sampled tokens' log-probabilities
    last: TrainStats        # the last epoch run: PPO's clipped fraction and KL from the old policy
    grad_norm: float        # the on-policy gradient's norm, as nanochat logs it
    last_grad_norm: float   # the last epoch's
    lrm: float
    stepped: bool           # every epoch's optimizer step was taken (finite loss and gradient on all ranks)


def train_on_rollouts(run, rollouts, step):
    """--ppo-epochs optimizer steps on these rollouts (nanochat: 1). The first epoch is on-policy and records
    the sampled tokens' log-probabilities; later epochs clip the ratio to them. A non-finite epoch ends the step."""
    cfg = run.config
    batches = [r.batch for r in rollouts]
    lrm = lr_multiplier(step, run.num_steps, cfg.lr_schedule, cfg.warmup_steps, cfg.final_lr_frac)
    counts = step_counts(batches, cfg.mask_truncated, run.reduce_device) if cfg.loss_norm != "pass" else None
    run.model.train()
    first = None
    for _ in range(cfg.ppo_epochs):
        def attempt(rows):
            run.model.zero_grad(set_to_none=True)  # what a failed attempt accumulated
            return accumulate_policy_gradient(run.model, batches, cfg.device_batch_size, run.examples_per_rank, run.device,
                                              run.autocast(), micro_batch_rows=rows, loss=run.policy_loss, counts=counts,
                                              reference=run.reference, first_epoch=first, forward=run.forward)
        last, run.micro_rows = with_fewer_rows_on_oom(attempt, run.micro_rows, "out of memory during training: "
                                                      "retrying with {rows} rows per forward pass",
                                                      free_memory=lambda: give_back_rollout_memory(run.engine))
        last_gnorm, stepped = guarded_step(run.model, run.optimizers, lrm, last.objective, run.reduce_device)
        if first is None:
            first, gnorm = last, last_gnorm
        if not stepped:
            break
    return TrainResult(first=first, last=last, grad_norm=gnorm, last_grad_norm=last_gnorm, lrm=lrm, stepped=stepped)


def count_bad_step(run, step, result):
    """Track consecutive steps whose update was skipped (non-finite); too many in a row end the run."""
    if result.stepped:
        run.consecutive_bad = 0
        return
    run.consecutive_bad += 1
    print0(f"warning: step {step} has a non-finite loss or gradient (objective {result.last.objective}, grad norm "
           f"{result.last_grad_norm}); skipping the optimizer step ({run.consecutive_bad}/{run.config.max_bad_steps})")
    if run.consecutive_bad >= run.config.max_bad_steps:
        where = f"step {run.last_saved} in {run.checkpoint_dir}" if run.last_saved is not None else "none saved yet"
        raise UserError(f"{run.consecutive_bad} consecutive steps had a non-finite loss or gradient; stopping "
                        f"(last good checkpoint: {where}); lower the learning rates or use --dtype=float32")


def no_signal_settings(cfg):
    """A warning line for each setting under which every advantage is 0, so that no step trains anything."""
    same = "every sample of a question is the same completion, so every advantage is 0 and the run trains nothing"
    lines = []
    if cfg.temperature == 0:
        lines.append(f"warning: --temperature=0 samples greedily: {same}; sample with --temperature=1.0 (nanochat's)")
    if cfg.top_k == 1:
        lines.append(f"warning: --top-k=1 always takes the most likely token: {same}; use --top-k=50 (nanochat's) or 0")
    if cfg.num_samples == 1:
        lines.append("warning: --num-samples=1: a question's one sample is its own mean reward, so every advantage is 0 "
                     "and the run trains nothing; sample several completions per question (nanochat: --num-samples=16)")
    return lines


def count_no_signal_step(run, record):
    """Track consecutive steps that trained no row (every advantage 0 on every rank); every --no-signal-steps of
    them in a row, one warning naming the likely cause. The run goes on: a later step may find a signal."""
    if record["rows_trained"] > 0 or run.config.no_signal_steps == 0:
        run.steps_without_signal.clear()
        return
    streak = run.steps_without_signal
    streak.append(record)
    if len(streak) % run.config.no_signal_steps:
        return
    rewards = [r["reward_mean"] for r in streak[-run.config.no_signal_steps:]]
    if max(rewards) == 0:
        cause = ("no sample earned any reward: the task is too hard for this model (start from a stronger checkpoint, "
                 "or an easier --task)")
    else:
        cause = (f"every question's samples earned the same reward (mean {sum(rewards) / len(rewards):.3f}): the samples "
                 f"are too alike (raise --temperature or --top-k, or --num-samples) or the task's reward does not vary")
    print0(f"warning: no row was trained in {len(streak)} consecutive step{'s' * (len(streak) > 1)} (steps "
           f"{streak[0]['step']}-{streak[-1]['step']}): {cause}")


def step_record(run, step, rollouts, result, t_rollout, t_train):
    """The step's metrics over all ranks, as logged to wandb and kept in the run's history."""
    compiled = run.compile_clock.lap()  # graphs compiled and their calls' seconds, since the last record
    metrics = drop_unmeasured(reduce_metrics(
        {**rollout_metrics([r.rewards for r in rollouts], [r.completions for r in rollouts], run.config.max_new_tokens,
                           prompt_lengths=[r.prompt_length for r in rollouts], rows_trained=result.first.rows_trained),
         **objective_metrics(result.first, result.last), "captures": float(run.engine.last_stats.captures),
         "compiles": float(compiled[0]), "compile_s": compiled[1]},
        run.reduce_device))
    num_tokens = metrics["completion_len_mean"] * metrics["num_samples"]  # generated this step, all ranks
    return {"step": step, **metrics, "reward": metrics["reward_mean"], "sequence_length": metrics["seq_len_mean"],
            "completion_length": metrics["completion_len_mean"], "lrm": result.lrm, "grad_norm": result.grad_norm,
            "time/rollout": t_rollout, "time/train": t_train, "rollout_tokens_per_s": num_tokens / max(t_rollout, 1e-9)}


def format_step_line(run, m, elapsed):
    """The step's log line (m: its step_record): nanochat's first fields, then what a reader needs to trust it."""
    step, num_steps = m["step"], run.num_steps
    eta_train, eta_eval = remaining_seconds(
        run.step_seconds, num_steps - step - 1, run.eval_seconds,
        sum(is_eval_step(s, num_steps, run.config.eval_every) for s in range(step + 1, num_steps + 1)))
    return (f"Step {step}/{num_steps} | Average reward: {m['reward_mean']:.4f} | "
            f"Average sequence length: {m['seq_len_mean']:.2f} | Average completion length: {m['completion_len_mean']:.2f} | "
            f"reward std {m['reward_std']:.3f} | no-signal {m['zero_std_fraction']:.2f} | "
            f"len {m['completion_len_min']:.0f}-{m['completion_len_max']:.0f} cut {m['truncated_fraction']:.2f} | "
            f"tool {m['tool_calls_per_sample']:.2f}/ok {m['tool_success_fraction']:.2f} | "
            f"trained {m['rows_trained']:.0f}/{m['num_samples']:.0f} rows | "
            + (f"entropy {m['entropy']:.3f} | " if "entropy" in m else "")  # none where no row was trained
            + f"gnorm {m['grad_norm']:.3f} | lrm {m['lrm']:.3f} | "
            + (f"clip {m['clip_fraction']:.3f} kl_old {m['approx_kl']:.2e} | " if "clip_fraction" in m else "")
            + (f"kl_ref {m['kl_ref']:.2e} | " if "kl_ref" in m else "")
            + (f"sampler gap {m['sampler_gap_mean']:.1e}/{m['sampler_gap_max']:.1e} k3 {m['sampler_k3']:.1e}"
               + (f" corrected {m['corrected_fraction']:.3f}" if run.config.rollout_correction != "none" else "") + " | "
               if m.get("sampler_tokens") else "")
            + f"rollout {m['time/rollout']:.1f}s captures {m['captures']:.0f} train {m['time/train']:.1f}s {m['rollout_tokens_per_s']:.0f} tok/s | "
            + (f"compiled {m['compiles']:.0f} graphs in {m['compile_s']:.1f}s | " if m.get("compiles") else "")
            + f"elapsed {format_duration(elapsed)} eta {format_duration(eta_train)}"
            + (f" + eval {format_duration(eta_eval)}" if eta_eval else ""))


def sample_table(run, rollout):
    """(question, completion, reward) rows of one question's samples, for wandb."""
    question = run.train_task[rollout.index]["messages"][0]["content"]
    return [(question, text, reward) for text, reward in zip(rollout.texts, rollout.rewards)]


def meta_data(run, step):
    return {"step": step, "model_config": run.model.meta_model_config(), "generation": run.model.generation.name,
            "user_config": vars(run.config), "start_checkpoint": run.start_checkpoint, "history": run.history,
            "eval_history": run.eval_history, "run_id": run.run_id, "world_size": run.world_size,
            "segments": run.segments}


def save(run, step):
    """The model (rank 0) and every rank's optimizer shard, for --resume; the step appears (model_N.pt) only once
    every rank's shard is in place. Then --keep-last removes this run's older steps."""
    shard = {"optimizers": [opt.state_dict() for opt in run.optimizers], "world_size": run.world_size,
             "rank": run.rank, "step": step, "run_id": run.run_id}
    save_checkpoint(run.checkpoint_dir, step, run.model.state_dict() if run.master else None, shard,
                    meta_data(run, step), all_ranks=True)
    if run.master:  # a run resumed on fewer ranks saving a step that more ranks saved before
        remove_extra_shards(run.checkpoint_dir, step, run.world_size)
    run.last_saved = step
    print0(f"Saved checkpoint to {run.checkpoint_dir} (step {step})")
    if run.config.keep_last > 0:  # only this run's directory: the start checkpoint is another's (resolve_output_tag)
        removed = prune_checkpoints(run.checkpoint_dir, step, run.config.keep_last)
        if removed:
            print0(f"--keep-last={run.config.keep_last}: removed step{'s' * (len(removed) > 1)} "
                   f"{', '.join(map(str, removed))}")


def main(argv):
    args = parse_args(argv)
    world_size = get_dist_info()[3]
    validate_args(args, world_size)
    resume = restore_settings(args, world_size) if args.resume else None
    _, rank, _, world_size, device = compute_init(args.device_type)
    check_decode_flag(args.decode, device)  # before the model loads: graph off CUDA is a one-line error
    stop = GracefulStop().install()
    try:
        train(setup_run(args, resume, rank, world_size, device), stop)
    finally:
        stop.uninstall()
        compute_cleanup()


def train(run, stop):
    """nanochat's loop: eval, rollouts, policy gradient and optimizer step, log, checkpoint; then the report."""
    cfg, num_steps = run.config, run.num_steps
    wandb_run = init_wandb(cfg.run, "nanochat-rl", vars(cfg))
    for line in no_signal_settings(cfg):
        print0(line)
    run_start = time.time()
    for step in range(run.start_step, num_steps + 1):
        last_step = step == num_steps
        # ---- eval: pass@k on the test split (also after the last update)
        if is_eval_step(step, num_steps, cfg.eval_every):
            wandb_run.log(evaluate(run, step))
            if last_step and run.last_saved == step - 1 and run.master:  # the final eval is of the last saved model
                update_meta(run.checkpoint_dir, step - 1, meta_data(run, step - 1))
        if last_step:
            break

        # ---- rollouts: sample and reward this rank's questions
        t0 = time.time()
        rollouts = sample_rollouts(run, step)
        t_rollout = time.time() - t0

        # ---- policy gradient and optimizer step
        t0 = time.time()
        result = train_on_rollouts(run, rollouts, step)
        count_bad_step(run, step, result)
        t_train = time.time() - t0

        # ---- log
        record = step_record(run, step, rollouts, result, t_rollout, t_train)
        run.step_seconds.append(max(t_rollout + t_train - record["compile_s"], 0.0))  # the ETA: compiling is one-off
        print0(format_step_line(run, record, time.time() - run_start))
        count_no_signal_step(run, record)
        run.history.append(record)
        wandb_run.log(record)
        if cfg.eval_every > 0 and step % cfg.eval_every == 0:  # a few completions to read, from rank 0's first question
            log_samples_table(wandb_run, sample_table(run, rollouts[0]), step=step)

        # ---- checkpoint (model on rank 0; optimizer shards on every rank, for resume)
        stopping = stop.requested(run.reduce_device)
        if (cfg.save_every > 0 and step > 0 and step % cfg.save_every == 0) or step == num_steps - 1 or stopping:
            save(run, step)
        if stopping:
            wandb_run.finish()
            print0(f"Stopped after step {step} on request. Resume with: python -m scripts.chat_rl --resume={cfg.output_tag}:{step}")
            sys.exit(128 + (stop.signum or signal.SIGTERM))

    report = get_report()
    log_chat_rl(report, vars(cfg), run.history, run.eval_history)
    path = report.write_report(run.device)
    if path:
        print0(f"Report: {path}")
    wandb_run.finish()
    wait_for_all_ranks()


if __name__ == "__main__":
    run_main(main)
