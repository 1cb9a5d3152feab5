"""
Reinforcement learning on GSM8K (or another task) with on-policy policy gradients, as in nanochat.

Each step, for each of the step's questions:
  1. sample --num-samples completions from the current model (KV-cached, calculator tool enabled);
  2. reward each completion (1.0 if the answer after #### is right, else 0.0);
  3. advantage = reward - mean reward of the question's samples (no std, no KL, no clipping);
  4. loss = -sum(logp * advantage) over sampled tokens only (prompt, tool outputs and padding masked),
     normalized per pass of --device-batch-size rows, by the passes and by the questions per rank;
then one Muon (matrices) + AdamW (embeddings, unembedding, scalars) step, LR decaying linearly to 0.
Algorithm options (README "Algorithm options"; each defaults to nanochat's behaviour): --loss-norm,
--advantage-std, --mask-truncated, --ppo-epochs with --clip-low/--clip-high, --kl-coef.

Launch:
  python -m scripts.chat_rl                                                   # 1 GPU, or CPU
  torchrun --standalone --nproc_per_node=8 -m scripts.chat_rl -- --run=my_run # 8 GPUs
  python -m scripts.chat_rl --device-type=cpu --dtype=float32 --task=arithmetic --num-steps=50
  python -m scripts.chat_rl --source=rl                  # a new run from the last RL checkpoint -> <tag>_cont
"""

import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from nanochat.checkpoint_manager import (CHECKPOINT_DIRS, find_checkpoint, find_last_step, list_tags, load_checkpoint,
                                         load_model, make_checkpoint_dir, save_checkpoint, update_meta)
from nanochat.common import (ArgumentParser, GracefulStop, UserError, add_model_generation_flag, add_optimizer_flags, autocast_context,
                             compute_cleanup, compute_dtype, compute_init, format_duration, get_base_dir, get_dist_info,
                             grad_norm, print0, progress_bar, remaining_seconds, requested_dtype, run_main)
from nanochat.engine import Engine, fastest_decode_dtype
from nanochat.evaluation import evaluate_pass_at_k
from nanochat.gpt import scale_initial_lr
from nanochat.metrics import reduce_metrics, rollout_metrics
from nanochat.report import get_report, log_chat_rl
from nanochat.wandb_utils import init_wandb, log_samples_table
from nanochat.rl import LOSS_NORMS, PolicyLoss, accumulate_policy_gradient, lr_multiplier, make_question_batch, step_counts
from tasks.registry import make_task, resolve_task_class


def parse_args(argv):
    p = ArgumentParser(description="RL on GSM8K (or --task) with on-policy policy gradients")
    # logging
    p.add_argument("--run", type=str, default="dummy", help="wandb run name ('dummy' disables wandb)")
    # runtime
    p.add_argument("--device-type", type=str, default="", help="cuda|cpu|mps (empty = autodetect)")
    p.add_argument("--dtype", type=str, default=None,
                   help="float32|bfloat16 compute dtype (autocast); default: $NANOCHAT_DTYPE, else bfloat16")
    p.add_argument("--rollout-dtype", type=str, default="auto",
                   help="dtype of rollouts and evals: auto (with a bf16 --dtype on a CPU, whichever of bf16 and fp32 "
                        "decodes faster here, measured at the start and kept on --resume), float32 or bfloat16")
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
    p.add_argument("--device-batch-size", type=int, default=8, help="rows per training forward pass (and eval samples per question)")
    p.add_argument("--examples-per-step", type=int, default=16, help="questions per optimizer step, summed over ranks")
    p.add_argument("--num-samples", type=int, default=16, help="completions sampled per question")
    p.add_argument("--max-new-tokens", type=int, default=256, help="completion length cap in tokens")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=50, help="top-k sampling (0 = whole vocabulary)")
    p.add_argument("--max-rows", type=int, default=0,
                   help="max rows decoded together in one rollout batch (0 = as many as --memory-budget-gb allows)")
    p.add_argument("--memory-budget-gb", type=float, default=4.0, help="KV-cache memory the rollout batch may use")
    # optimization
    add_optimizer_flags(p)
    p.add_argument("--init-lr-frac", type=float, default=0.05, help="every lr is multiplied by this at the start")
    # algorithm options (each default is nanochat's)
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
    # eval and checkpoints
    p.add_argument("--eval-every", type=int, default=60, help="pass@k eval period in steps (-1 = never)")
    p.add_argument("--eval-examples", type=int, default=400, help="test questions used by the eval")
    p.add_argument("--save-every", type=int, default=60, help="checkpoint period in steps (-1 = only the last step)")
    # robustness
    p.add_argument("--resume", type=str, nargs="?", const="latest", default="",
                   help="continue an RL run: --resume (the latest), --resume=TAG (its last step) or --resume=TAG:STEP")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing chatrl_checkpoints/<tag> run (without it, the run is refused)")
    p.add_argument("--max-bad-steps", type=int, default=5,
                   help="abort after this many consecutive steps with a non-finite loss or gradient")
    p.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    return p.parse_args(argv)


def validate_args(args, world_size):
    """Refuse flag values that would silently do the wrong thing (nanochat would train on zero samples
    when --num-samples < --device-batch-size, for example)."""
    def need(ok, message):
        if not ok:
            raise UserError(message)
    args.dtype = requested_dtype(args.dtype)
    need(args.rollout_dtype in ("auto", "float32", "bfloat16"),
         f"--rollout-dtype must be auto, float32 or bfloat16, got {args.rollout_dtype!r}")
    need(args.source in CHECKPOINT_DIRS, f"--source must be {', '.join(CHECKPOINT_DIRS)}, got {args.source!r}")
    resolve_task_class(args.task)  # an unknown --task is reported now, not after the checkpoint has loaded
    if args.output_tag is not None:
        need(args.output_tag not in ("", ".", "..") and "/" not in args.output_tag and os.sep not in args.output_tag,
             f"--output-tag must be a directory name (no '/'), got {args.output_tag!r}")
        need(not args.resume, "--resume continues a run in its own directory and --output-tag names a new run's; "
                              "pass only one")
    if args.source == "rl" and args.model_tag is not None:
        resolve_output_tag(args, args.model_tag, depth=None)  # refuses the run it reads
    for name in ("device_batch_size", "examples_per_step", "num_samples", "max_new_tokens", "num_epochs", "eval_examples"):
        need(getattr(args, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    need(args.num_samples % args.device_batch_size == 0,
         f"--num-samples ({args.num_samples}) must be a multiple of --device-batch-size ({args.device_batch_size}); "
         f"e.g. --device-batch-size={_largest_divisor_at_most(args.num_samples, args.device_batch_size)}")
    need(args.examples_per_step % world_size == 0,
         f"--examples-per-step ({args.examples_per_step}) must be divisible by the number of ranks ({world_size}); "
         f"use a multiple of {world_size}")
    need(args.temperature >= 0, f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    need(args.top_k >= 0, f"--top-k must be >= 0 (0 = disabled), got {args.top_k}")
    need(args.max_rows >= 0, f"--max-rows must be >= 0 (0 = from the memory budget), got {args.max_rows}")
    need(args.memory_budget_gb > 0, f"--memory-budget-gb must be > 0, got {args.memory_budget_gb}")
    for name in ("embedding_lr", "unembedding_lr", "matrix_lr", "weight_decay"):
        need(getattr(args, name) >= 0, f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    need(0 < args.init_lr_frac <= 1, f"--init-lr-frac must be in (0, 1], got {args.init_lr_frac}")
    need(args.eval_every == -1 or args.eval_every >= 1, f"--eval-every must be >= 1, or -1 to disable, got {args.eval_every}")
    need(args.save_every == -1 or args.save_every >= 1, f"--save-every must be >= 1, or -1 for the last step only, got {args.save_every}")
    need(args.num_steps == -1 or args.num_steps >= 1, f"--num-steps must be >= 1, or -1 to derive it from epochs, got {args.num_steps}")
    need(args.max_bad_steps >= 1, f"--max-bad-steps must be >= 1, got {args.max_bad_steps}")
    need(args.loss_norm in LOSS_NORMS, f"--loss-norm must be {', '.join(LOSS_NORMS)}, got {args.loss_norm!r}")
    need(args.ppo_epochs >= 1, f"--ppo-epochs must be >= 1 (1 = nanochat's on-policy step), got {args.ppo_epochs}")
    need(0 <= args.clip_low < 1, f"--clip-low must be in [0, 1) (the ratio is clipped at 1 - clip-low), got {args.clip_low}")
    need(args.clip_high >= 0, f"--clip-high must be >= 0, got {args.clip_high}")
    need(args.kl_coef >= 0, f"--kl-coef must be >= 0 (0 = no KL penalty), got {args.kl_coef}")
    need(not (args.resume and args.overwrite), "--resume continues a run and --overwrite replaces it; pass only one")


def _largest_divisor_at_most(n, limit):
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def question_seed(step, example_index):
    """The sampling seed of one question at one step: the same on every rank layout."""
    return hash((step, example_index)) & 0x7FFFFFFF  # hash of an int tuple is not salted per process


def rank_example_indices(step, examples_per_rank, rank, world_size, num_examples):
    """Rank r walks train indices r, r+W, r+2W, ... cycling forever; step s takes the next examples_per_rank."""
    strided = range(rank, num_examples, world_size)
    start = step * examples_per_rank
    return [strided[(start + i) % len(strided)] for i in range(examples_per_rank)]


def rollout_step(engine, task, indices, step, args):
    """Sample and reward every question of this rank's step. Returns (batches, stats)."""
    tokenizer = engine.tokenizer
    conversations = [task[i] for i in indices]
    prompts = [tokenizer.render_for_completion(conv) for conv in conversations]
    bar = progress_bar(len(prompts) * args.num_samples, f"step {step} rollouts")
    results = engine.generate_many(prompts, num_samples=args.num_samples, max_tokens=args.max_new_tokens,
                                   temperature=args.temperature, top_k=args.top_k or None,
                                   seeds=[question_seed(step, i) for i in indices], progress=bar.update)
    bar.close()
    pad = tokenizer.encode_special("<|assistant_end|>")
    batches = []
    for conv, prompt, completions in zip(conversations, prompts, results):
        rewards = [float(task.reward(conv, tokenizer.decode(c.tokens))) for c in completions]
        batches.append(make_question_batch(prompt, [(c.tokens, c.masks) for c in completions], rewards, pad,
                                           truncated=[not c.ended for c in completions],
                                           scale_by_std=args.advantage_std))
    return batches, results


def policy_gradient(model, batches, args, examples_per_rank, device, autocast, micro_rows, **objective):
    """accumulate_policy_gradient, retried with half the rows per forward on out-of-memory (the objective is
    unchanged). objective: its loss, counts, reference and first_epoch arguments.
    Returns (TrainStats, the rows per forward that fit)."""
    while True:
        try:
            return accumulate_policy_gradient(model, batches, args.device_batch_size, examples_per_rank, device, autocast,
                                              micro_batch_rows=micro_rows, **objective), micro_rows
        except torch.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            if micro_rows <= 1:
                raise
            micro_rows //= 2
            print0(f"out of memory during training: retrying with {micro_rows} rows per forward pass")


def objective_metrics(first, last):
    """The objective's diagnostics, as metrics for reduce_metrics: the first epoch's trained tokens and its mean
    KL to the reference (with --kl-coef), the last PPO epoch's clipped fraction and KL from the old policy
    (measured in its forward, after the earlier epochs' updates)."""
    out = {"trained_tokens": float(first.tokens)}
    if last.clip_fraction is not None:
        out.update(clip_fraction=last.clip_fraction, approx_kl=last.approx_kl)
    if first.kl_ref is not None:
        out["kl_ref"] = first.kl_ref
    return out


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


def rollout_dtype(model, device, args):
    """The rollout dtype's name: --rollout-dtype when it names one; with auto, the compute dtype, except
    that a bf16 run on a CPU or MPS decodes in whichever of bf16 and fp32 is faster there (measured now, on
    rank 0's device: every rank uses its choice)."""
    if args.rollout_dtype != "auto":
        return args.rollout_dtype
    if args.dtype == "float32" or device.type == "cuda":
        return args.dtype
    candidates = [torch.bfloat16, torch.float32]
    choice = torch.tensor([candidates.index(fastest_decode_dtype(model, candidates))])
    if dist.is_initialized():  # every rank decodes as rank 0 measured (and as the checkpoint records); a CPU
        dist.broadcast(choice, src=0)  # tensor: this path runs on CPU/MPS only, whose process group is gloo
    name = str(candidates[int(choice)]).removeprefix("torch.")
    print0(f"rollouts decode in {name}: measured faster than {'float32' if name == 'bfloat16' else 'bfloat16'} "
           f"on this {device.type} (--rollout-dtype to choose)")
    return name


# flags that define the run; --resume restores them from the checkpoint so the continuation is exact
RUNTIME_FLAGS = ("run", "device_type", "resume", "overwrite", "debug", "max_rows", "memory_budget_gb", "max_bad_steps",
                 "output_tag")  # a resumed run writes to its own directory


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
    return tag, int(step) if step else find_last_step(directory)


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


def main(argv):
    args = parse_args(argv)
    _, rank, _, world_size = get_dist_info()
    validate_args(args, world_size)
    _, rank, _, world_size, device = compute_init(args.device_type)
    stop = GracefulStop().install()
    try:
        run(args, rank, world_size, device, stop)
    finally:
        stop.uninstall()
        compute_cleanup()


def run(args, rank, world_size, device, stop):
    master = rank == 0
    start_step, optimizer_state = 0, None
    if args.resume:
        tag, resume_step = resolve_resume(args.resume)
        model, tokenizer, meta = load_model("rl", device, phase="eval", model_tag=tag, step=resume_step)
        saved = meta.get("user_config", {})
        changed = {k: v for k, v in saved.items() if k not in RUNTIME_FLAGS and getattr(args, k, v) != v}
        for k, v in saved.items():
            if k not in RUNTIME_FLAGS:
                setattr(args, k, v)
        if changed:
            print0(f"--resume: using the run's saved settings for {', '.join(sorted(changed))}")
        _, optimizer_state, _ = load_checkpoint(os.path.join(get_base_dir(), CHECKPOINT_DIRS["rl"], tag), resume_step,
                                                device, load_optimizer=True, rank=rank)
        if optimizer_state.get("world_size") != world_size:
            raise UserError(f"--resume: the checkpoint was written by {optimizer_state.get('world_size')} ranks; "
                            f"resume with the same number of ranks (got {world_size})")
        validate_args(args, world_size)
        start_step, model_tag = resume_step + 1, tag
        start = meta.get("start_checkpoint")
        print0(f"Resuming RL run {tag} after step {resume_step}")
    else:
        _, source_tag, source_step = find_checkpoint(args.source, args.model_tag, args.model_step)
        if args.source == "rl":
            resolve_output_tag(args, source_tag, depth=None)  # refuse writing into the source run before loading it
        model, tokenizer, meta = load_model(args.source, device, phase="eval", model_tag=source_tag, step=source_step,
                                            generation=args.model_generation)
        model_tag = resolve_output_tag(args, source_tag, model.config.n_layer)
        start = {"source": args.source, "model_tag": source_tag, "step": source_step}
        print0(f"Starting a new RL run from {args.source} {source_tag} step {source_step}; writing to {model_tag}")
    args.output_tag = model_tag  # the config records where the run is written
    reference = load_reference(start, device, args.model_generation) if args.kl_coef > 0 else None
    policy_loss = PolicyLoss(loss_norm=args.loss_norm, max_new_tokens=args.max_new_tokens,
                             mask_truncated=args.mask_truncated, clip_low=args.clip_low, clip_high=args.clip_high,
                             kl_coef=args.kl_coef)
    checkpoint_dir = os.path.join(get_base_dir(), CHECKPOINT_DIRS["rl"], model_tag)

    args.dtype = str(compute_dtype(device, args.dtype)).removeprefix("torch.")  # the config records what runs
    autocast = autocast_context(device, getattr(torch, args.dtype))
    args.rollout_dtype = rollout_dtype(model, device, args)  # recorded, so a resumed run decodes as it did
    rollout_autocast = autocast_context(device, getattr(torch, args.rollout_dtype))
    reduce_device = device if device.type == "cuda" else "cpu"

    wandb_run = init_wandb(args.run, "nanochat-rl", vars(args), rank)

    engine = Engine(model, tokenizer, max_rows=args.max_rows or None, memory_budget_gb=args.memory_budget_gb)
    train_task, val_task = make_task(args.task, "train"), make_task(args.task, "test")

    examples_per_rank = args.examples_per_step // world_size
    num_steps = args.num_steps if args.num_steps > 0 else (len(train_task) // args.examples_per_step) * args.num_epochs
    if num_steps < 1:
        raise UserError(f"the {args.task} train split has {len(train_task)} questions, fewer than --examples-per-step "
                        f"({args.examples_per_step}); lower --examples-per-step or pass --num-steps")
    print0(f"Calculated number of steps: {num_steps}")
    if not args.resume:
        prepare_output_dir(checkpoint_dir, args.overwrite, master)

    # Muon orthogonalizes in the run's compute dtype: bf16 where it is native (nanochat's numerics), fp32 otherwise
    optimizers = scale_initial_lr(model.setup_optimizers(unembedding_lr=args.unembedding_lr, embedding_lr=args.embedding_lr,
                                                         matrix_lr=args.matrix_lr, weight_decay=args.weight_decay,
                                                         recipe=args.recipe, ortho_dtype=getattr(torch, args.dtype)),
                                  args.init_lr_frac)
    if optimizer_state is not None:
        for opt, state in zip(optimizers, optimizer_state["optimizers"]):
            opt.load_state_dict(state)  # also restores each group's initial_lr and lr

    history = list(meta.get("history", [])) if args.resume else []          # per-step metrics, for the report
    eval_history = [tuple(e) for e in meta.get("eval_history", [])] if args.resume else []

    def meta_data(step):
        return {"step": step, "model_config": model.meta_model_config(), "generation": model.generation.name,
                "user_config": vars(args), "start_checkpoint": start, "history": history, "eval_history": eval_history}

    def save(step):
        save_checkpoint(checkpoint_dir, step, model.state_dict() if master else None,
                        {"optimizers": [opt.state_dict() for opt in optimizers], "world_size": world_size},
                        meta_data(step), rank=rank)
        print0(f"Saved checkpoint to {checkpoint_dir} (step {step})")

    eval_samples = args.device_batch_size
    micro_rows = args.device_batch_size  # rows per training forward; halved on out-of-memory
    consecutive_bad = 0
    last_saved = start_step - 1 if args.resume else None
    run_start = time.time()
    step_seconds, eval_seconds = [], []  # this process's timings, for the ETA
    for step in range(start_step, num_steps + 1):
        last_step = step == num_steps
        # ---- eval: pass@k on the test split (also after the last update)
        if is_eval_step(step, num_steps, args.eval_every):
            model.eval()
            t0 = time.time()
            with rollout_autocast:
                passk, _ = evaluate_pass_at_k(engine, val_task, args.eval_examples, eval_samples, max_new_tokens=256,
                                              temperature=1.0, top_k=50, rank=rank, world_size=world_size,
                                              device=reduce_device, seed=0)
            t_eval = time.time() - t0
            eval_seconds.append(t_eval)
            print0(f"Step {step} | " + ", ".join(f"Pass@{k + 1}: {v:.4f}" for k, v in enumerate(passk.any))
                   + f" | eval {t_eval:.1f}s")
            wandb_run.log({"step": step, **passk.as_dict(), "time/eval": t_eval})
            eval_history.append((step, passk.as_dict()))
            if last_step and last_saved == step - 1 and master:  # the final eval is of the last saved model
                update_meta(checkpoint_dir, step - 1, meta_data(step - 1))
        if last_step:
            break

        # ---- rollouts (retried with half the rows on out-of-memory: per-row seeds make them identical)
        t0 = time.time()
        indices = rank_example_indices(step, examples_per_rank, rank, world_size, len(train_task))
        model.eval()
        while True:
            try:
                with rollout_autocast:
                    batches, results = rollout_step(engine, train_task, indices, step, args)
                break
            except torch.OutOfMemoryError:
                rows = engine.last_stats.max_batch_rows or 1
                if rows <= 1:
                    raise
                engine.max_rows = max(1, rows // 2)
                print0(f"out of memory during rollouts: retrying with --max-rows={engine.max_rows}")
        t_rollout = time.time() - t0

        # ---- policy gradient: --ppo-epochs optimizer steps on these rollouts (nanochat: 1). The first epoch is
        # on-policy and records the sampled tokens' log-probabilities; later epochs clip the ratio to them.
        t0 = time.time()
        model.train()
        lrm = lr_multiplier(step, num_steps)
        counts = step_counts(batches, args.mask_truncated, reduce_device) if args.loss_norm != "pass" else None
        first = None
        for epoch in range(args.ppo_epochs):
            trained, micro_rows = policy_gradient(model, batches, args, examples_per_rank, device, autocast, micro_rows,
                                                  loss=policy_loss, counts=counts, reference=reference, first_epoch=first)
            first = first or trained
            epoch_gnorm = grad_norm(model)
            if epoch == 0:
                gnorm = epoch_gnorm  # the on-policy gradient's norm, as nanochat logs it
            finite = torch.tensor([float(math.isfinite(trained.objective) and math.isfinite(epoch_gnorm))], device=reduce_device)
            if dist.is_initialized():
                dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # every rank must make the same choice
            if finite.item() != 1.0:
                break
            for opt in optimizers:
                for group in opt.param_groups:
                    group["lr"] = group["initial_lr"] * lrm
            for opt in optimizers:
                opt.step()
            model.zero_grad(set_to_none=True)
        entropy = first.entropy
        if finite.item() == 1.0:
            consecutive_bad = 0
        else:
            consecutive_bad += 1
            print0(f"warning: step {step} has a non-finite loss or gradient (objective {trained.objective}, grad norm "
                   f"{epoch_gnorm}); skipping the optimizer step ({consecutive_bad}/{args.max_bad_steps})")
            if consecutive_bad >= args.max_bad_steps:
                where = f"step {last_saved} in {checkpoint_dir}" if last_saved is not None else "none saved yet"
                raise UserError(f"{consecutive_bad} consecutive steps had a non-finite loss or gradient; stopping "
                                f"(last good checkpoint: {where}); lower the learning rates or use --dtype=float32")
        model.zero_grad(set_to_none=True)
        t_train = time.time() - t0

        metrics = reduce_metrics({**rollout_metrics([b.rewards.tolist() for b in batches], results, args.max_new_tokens,
                                                    prompt_lengths=[b.prompt_length for b in batches],
                                                    rows_trained=first.rows_trained),
                                  **objective_metrics(first, trained)}, reduce_device)
        num_tokens = metrics["completion_len_mean"] * metrics["num_samples"]  # generated this step, all ranks
        step_seconds.append(t_rollout + t_train)
        eta_train, eta_eval = remaining_seconds(
            step_seconds, num_steps - step - 1, eval_seconds,
            sum(is_eval_step(s, num_steps, args.eval_every) for s in range(step + 1, num_steps + 1)))
        print0(f"Step {step}/{num_steps} | Average reward: {metrics['reward_mean']:.4f} | "
               f"Average sequence length: {metrics['seq_len_mean']:.2f} | "
               f"Average completion length: {metrics['completion_len_mean']:.2f} | "
               f"reward std {metrics['reward_std']:.3f} | no-signal {metrics['zero_std_fraction']:.2f} | "
               f"len {metrics['completion_len_min']:.0f}-{metrics['completion_len_max']:.0f} "
               f"cut {metrics['truncated_fraction']:.2f} | "
               f"tool {metrics['tool_calls_per_sample']:.2f}/ok {metrics['tool_success_fraction']:.2f} | "
               f"trained {metrics['rows_trained']:.0f}/{metrics['num_samples']:.0f} rows | "
               f"entropy {entropy:.3f} | gnorm {gnorm:.3f} | lrm {lrm:.3f} | "
               + (f"clip {metrics['clip_fraction']:.3f} kl_old {metrics['approx_kl']:.2e} | " if "clip_fraction" in metrics else "")
               + (f"kl_ref {metrics['kl_ref']:.2e} | " if "kl_ref" in metrics else "") +
               f"rollout {t_rollout:.1f}s train {t_train:.1f}s {num_tokens / t_rollout:.0f} tok/s | "
               f"elapsed {format_duration(time.time() - run_start)} eta {format_duration(eta_train)}"
               + (f" + eval {format_duration(eta_eval)}" if eta_eval else ""))
        record = {"step": step, **metrics, "reward": metrics["reward_mean"], "sequence_length": metrics["seq_len_mean"],
                  "completion_length": metrics["completion_len_mean"],
                  "lrm": lrm, "entropy": entropy, "grad_norm": gnorm, "time/rollout": t_rollout,
                  "time/train": t_train, "rollout_tokens_per_s": num_tokens / max(t_rollout, 1e-9)}
        history.append(record)
        wandb_run.log(record)
        if args.eval_every > 0 and step % args.eval_every == 0:  # a few completions to read, from rank 0's first question
            question = train_task[indices[0]]["messages"][0]["content"]
            log_samples_table(wandb_run, [(question, tokenizer.decode(c.tokens), r)
                                          for c, r in zip(results[0], batches[0].rewards.tolist())], step=step)

        # ---- checkpoint (model on rank 0; optimizer shards on every rank, for resume)
        stopping = stop.requested(reduce_device)
        if (args.save_every > 0 and step > 0 and step % args.save_every == 0) or step == num_steps - 1 or stopping:
            save(step)
            last_saved = step
        if stopping:
            wandb_run.finish()
            print0(f"Stopped after step {step} on request. Resume with: python -m scripts.chat_rl --resume={model_tag}:{step}")
            sys.exit(128 + (stop.signum or signal.SIGTERM))

    report = get_report()
    log_chat_rl(report, vars(args), history, eval_history)
    path = report.write_report()
    if path:
        print0(f"Report: {path}")
    wandb_run.finish()
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    run_main(main)
