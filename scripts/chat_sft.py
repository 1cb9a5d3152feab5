"""
Supervised finetuning (SFT) on a mixture of chat tasks, the stage before RL: the model learns to answer
in the chat format, tool calls included, by imitating the tasks' reference conversations.

Algorithm:
  1. start from a checkpoint (--source base|mid|sft), or with --depth N from a freshly initialized model;
  2. the train splits of --tasks are concatenated and shuffled once with --seed; every step takes the next
     --examples-per-step conversations (ranks take every world_size-th), cycling for --num-epochs;
  3. each conversation is tokenized with its mask (1 = assistant tokens, tool calls included; 0 = <|bos|>,
     user turns and tool outputs), truncated to --max-seq-len + 1 tokens; targets are the next tokens
     where the mask is 1, -1 elsewhere and on padding;
  4. loss = mean cross-entropy over the step's targets on all ranks (explicit denominator, see
     nanochat/sft/training.py), accumulated over micro-batches of --device-batch-size rows;
  5. one Muon (matrices) + AdamW (embeddings, unembedding, scalars) step with every lr scaled by
     --init-lr-frac and decaying linearly to 0 over the run; steps with a non-finite loss or gradient
     are skipped;
  6. every --eval-every steps, the loss on the test splits' trained-on tokens;
  7. with --stop-at-pass1=LO:HI, every --stop-check-every steps the sampled pass@1 (T=1) on the last
     --stop-check-questions train questions of the first task (left out of training; see nanochat/stop_rule.py),
     and the run stops at the first check in [LO, HI] (the lr schedule stays the one over the step cap);
  8. at the end the model goes to $NANOCHAT_BASE_DIR/chatsft_checkpoints/<tag>/model_<step>.pt (+ meta), where
     chat_rl's `--source=sft` finds it.

Launch:
  python -m scripts.chat_sft                                                       # 1 GPU: finetune mid_checkpoints
  torchrun --standalone --nproc_per_node=8 -m scripts.chat_sft -- --run=my_run     # 8 GPUs
  python -m scripts.chat_sft --device-type=cpu --depth=4 --tasks=arithmetic --num-steps=150 \\
      --examples-per-step=32 --device-batch-size=32                               # CPU, a d4 model from scratch
  python -m scripts.chat_sft --device-type=cpu --depth=2 --tasks=arithmetic --arithmetic-difficulty=1 \\
      --num-steps=300 --stop-at-pass1=0.25:0.5 --stop-check-every=5 --examples-per-step=16 \\
      --device-batch-size=16                                # CPU, stopped at partial credit (the learning test's SFT)
"""

import json
import time

import torch

from nanochat.cli import (ArgumentParser, add_compile_flag, add_debug_flag, add_model_generation_flag,
                          add_optimizer_flags, add_runtime_flags, add_shared, add_shared_flag, run_main)
from nanochat.common import compute_cleanup, compute_init
from nanochat.compiling.functions import CompileClock
from nanochat.errors import UserError, require
from nanochat.model.gpt import HEAD_DIM
from nanochat.optim.optimizers import check_optimizer_flags, lr_multiplier
from nanochat.rl.evaluation import EVAL_TEMPERATURE, EVAL_TOP_K
from nanochat.runtime.distributed import collective_device, get_dist_info, print0, wait_for_all_ranks
from nanochat.runtime.dtypes import autocast_context, compute_dtype, dtype_name, requested_dtype
from nanochat.sft.data import conversations_at, make_micro_batches, rank_positions, val_micro_batches
from nanochat.sft.plan import compiled_parts, load_start_model, training_plan
from nanochat.sft.saving import output_dir, save_final_model, sft_meta
from nanochat.sft.stopping import check_stop, stop_record
from nanochat.sft.training import evaluate_val_loss, log_step, setup_optimizers, train_step
from nanochat.stop_rule import MissedBandError, PassBand, parse_band
from nanochat.wandb_utils import init_wandb
from tasks.registry import resolve_task_class

DEFAULT_SEQUENCE_LEN = 512
# Finetuning a pretrained model wants small steps (nanochat's SFT uses 0.02 of the pretraining lrs);
# a model trained from scratch here needs the full lrs.
INIT_LR_FRAC_FINETUNE = 0.02
INIT_LR_FRAC_SCRATCH = 1.0
# the --stop-check-* flags: their defaults, which apply with --stop-at-pass1 only
STOP_CHECK_DEFAULTS = {"stop_check_every": 10, "stop_check_questions": 64, "stop_check_samples": 4,
                       "stop_check_max_tokens": 256}


def build_parser():
    p = ArgumentParser(description="Supervised finetuning on a mixture of chat tasks")
    # logging and runtime
    add_runtime_flags(p)
    add_compile_flag(p)
    add_shared_flag(p, "seed", script="chat_sft", help="seed for the model init and the example order")
    # model to start from (nanochat's SFT finetunes the midtrained model)
    add_shared_flag(p, "source", script="chat_sft", help="checkpoint family to finetune: base|mid|sft (unused with --depth)")
    add_shared(p, "model_tag", "model_step")
    add_model_generation_flag(p)
    p.add_argument("--depth", type=int, default=0,
                   help=f"> 0: train a fresh model with this many layers, width {HEAD_DIM}*depth, heads of {HEAD_DIM} "
                        f"(0 = load --source)")
    p.add_argument("--sequence-len", type=int, default=None,
                   help=f"context length of a fresh --depth model (default {DEFAULT_SEQUENCE_LEN})")
    # data
    p.add_argument("--tasks", type=str, default="gsm8k",
                   help="comma-separated tasks to mix: gsm8k, arithmetic, or package.module:ClassName")
    p.add_argument("--arithmetic-difficulty", type=int, default=None,
                   help="difficulty (1-4) of the arithmetic task (default: the task's own default)")
    p.add_argument("--num-epochs", type=int, default=1, help="epochs over the mixture's train examples")
    p.add_argument("--num-steps", type=int, default=-1, help="override the number of steps (-1 = from epochs)")
    p.add_argument("--max-seq-len", type=int, default=0,
                   help="train on at most this many tokens per conversation (0 = the model's sequence_len)")
    # batch sizes
    p.add_argument("--device-batch-size", type=int, default=4, help="conversations (rows) per forward pass")
    p.add_argument("--examples-per-step", type=int, default=32,
                   help="conversations per optimizer step, summed over ranks (gradient accumulation)")
    # optimization
    add_optimizer_flags(p)
    p.add_argument("--init-lr-frac", type=float, default=None,
                   help=f"every lr is multiplied by this at the start (default {INIT_LR_FRAC_FINETUNE} when finetuning "
                        f"a checkpoint, {INIT_LR_FRAC_SCRATCH} with --depth); lrs then decay linearly to 0")
    # eval and output
    p.add_argument("--eval-every", type=int, default=100,
                   help="val loss period in steps, also before the first and after the last step (-1 = never)")
    p.add_argument("--eval-examples", type=int, default=400, help="test conversations used for the val loss")
    p.add_argument("--output-tag", type=str, default=None, help="checkpoint subdirectory to write (default d<n_layer>)")
    # stop on held-out accuracy (nanochat/stop_rule.py)
    p.add_argument("--stop-at-pass1", type=str, default="",
                   help="LO:HI, e.g. 0.25:0.5: stop at the first check whose held-out sampled pass@1 is in [LO, HI]; "
                        "the run fails if it reaches the step cap below LO or jumps past HI (empty = train to the cap)")
    p.add_argument("--stop-check-every", type=int, default=None,
                   help=f"steps between held-out pass@1 checks, also at the step cap "
                        f"(default {STOP_CHECK_DEFAULTS['stop_check_every']})")
    p.add_argument("--stop-check-questions", type=int, default=None,
                   help=f"held-out questions: the last ones of the first task's train split, left out of training "
                        f"(default {STOP_CHECK_DEFAULTS['stop_check_questions']})")
    p.add_argument("--stop-check-samples", type=int, default=None,
                   help=f"samples per held-out question, at T={EVAL_TEMPERATURE:g} and top-k {EVAL_TOP_K} "
                        f"(default {STOP_CHECK_DEFAULTS['stop_check_samples']})")
    p.add_argument("--stop-check-max-tokens", type=int, default=None,
                   help=f"cap on a held-out sample's length in tokens (default {STOP_CHECK_DEFAULTS['stop_check_max_tokens']})")
    add_debug_flag(p)
    return p


def parse_args(argv):
    return build_parser().parse_args(argv)


def parse_task_names(spec):
    names = [name.strip() for name in spec.split(",")]
    if not spec.strip() or any(not name for name in names):
        raise UserError(f"--tasks={spec!r} has an empty entry; give a comma-separated list such as gsm8k,arithmetic")
    return names


def validate_args(args, world_size):
    """Refuse flag values that would fail late or silently train on the wrong thing; fill in the
    defaults that depend on other flags, so the logged config is the effective one."""
    args.dtype = requested_dtype(args.dtype)
    require(args.depth >= 0, f"--depth must be >= 1 for a fresh model, or 0 to load --source, got {args.depth}")
    if args.depth > 0:
        require(args.model_tag is None and args.model_step is None,
                "--model-tag/--model-step choose a checkpoint to load; they do not apply with --depth (a fresh model)")
        args.sequence_len = DEFAULT_SEQUENCE_LEN if args.sequence_len is None else args.sequence_len
        require(args.sequence_len >= 2, f"--sequence-len must be >= 2, got {args.sequence_len}")
    else:
        require(args.source in ("base", "mid", "sft"), f"--source must be base, mid or sft, got {args.source!r}")
        require(args.sequence_len is None, "--sequence-len sets the context of a fresh --depth model; a loaded "
                                           "checkpoint keeps its own (use --max-seq-len to train on shorter rows)")
    names = parse_task_names(args.tasks)
    for name in names:
        resolve_task_class(name)  # an unknown task fails now, not after the model is loaded
    if args.arithmetic_difficulty is not None:
        require("arithmetic" in names, f"--arithmetic-difficulty applies to the arithmetic task, which is not in --tasks={args.tasks!r}")
    for name in ("device_batch_size", "examples_per_step", "num_epochs", "eval_examples"):
        require(getattr(args, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    per_step = args.device_batch_size * world_size
    require(args.examples_per_step % per_step == 0,
            f"--examples-per-step ({args.examples_per_step}) must be a multiple of --device-batch-size ({args.device_batch_size})"
            f" x ranks ({world_size}) = {per_step}; e.g. --examples-per-step={max(1, args.examples_per_step // per_step) * per_step}")
    require(args.num_steps == -1 or args.num_steps >= 1, f"--num-steps must be >= 1, or -1 to derive it from epochs, got {args.num_steps}")
    require(args.max_seq_len >= 0, f"--max-seq-len must be >= 1, or 0 for the model's sequence_len, got {args.max_seq_len}")
    check_optimizer_flags(args)
    if args.init_lr_frac is None:
        args.init_lr_frac = INIT_LR_FRAC_SCRATCH if args.depth > 0 else INIT_LR_FRAC_FINETUNE
    require(0 < args.init_lr_frac <= 1, f"--init-lr-frac must be in (0, 1], got {args.init_lr_frac}")
    require(args.eval_every == -1 or args.eval_every >= 1, f"--eval-every must be >= 1, or -1 to disable, got {args.eval_every}")
    validate_stop_flags(args)
    return names


def validate_stop_flags(args):
    """--stop-at-pass1 and the --stop-check-* flags that only mean something with it (defaults filled in)."""
    if not args.stop_at_pass1:
        for name in STOP_CHECK_DEFAULTS:
            require(getattr(args, name) is None, f"--{name.replace('_', '-')} applies with --stop-at-pass1, which is not given")
        return
    parse_band(args.stop_at_pass1)
    for name, default in STOP_CHECK_DEFAULTS.items():
        value = default if getattr(args, name) is None else getattr(args, name)
        require(value >= 1, f"--{name.replace('_', '-')} must be >= 1, got {value}")
        setattr(args, name, value)


def main(argv):
    args = parse_args(argv)
    _, _, _, world_size = get_dist_info()
    task_names = validate_args(args, world_size)
    _, rank, _, world_size, device = compute_init(args.device_type, seed=args.seed)
    try:
        run(args, task_names, rank, world_size, device)
    finally:
        compute_cleanup()


def run(args, task_names, rank, world_size, device):
    args.dtype = dtype_name(compute_dtype(device, args.dtype))  # the config records what runs
    autocast = autocast_context(device, getattr(torch, args.dtype))
    reduce_device = collective_device(device)

    model, tokenizer, args.max_seq_len = load_start_model(args, device)
    print0(f"config: {json.dumps(vars(args))}")
    print0(f"model: {model.meta_model_config()} ({model.generation.name}) | {model.num_params():,} parameters")

    wandb_run = init_wandb(args.run, "nanochat-sft", vars(args))
    train_tasks, held_out, train_order, num_steps = training_plan(args, task_names)
    checkpoint_dir = output_dir(args, model.config, num_steps, held_out)

    pad_token = tokenizer.encode_special("<|assistant_end|>")  # any id works: padded positions have target -1
    val_batches = val_micro_batches(args, task_names, tokenizer, pad_token, rank,
                                    world_size=world_size) if args.eval_every > 0 else []

    optimizers = setup_optimizers(model, args)
    band = PassBand(*parse_band(args.stop_at_pass1)) if held_out is not None else None
    forward, check_engine, args.compile = compiled_parts(args.compile, model, tokenizer, band, device,
                                                         num_steps=num_steps)
    compile_clock, val_loss, missed = CompileClock(), None, None
    for step in range(num_steps + 1):  # `step` updates done so far
        last_step = step == num_steps
        if band is not None and step > 0 and (step % args.stop_check_every == 0 or last_step):
            try:
                last_step = check_stop(band, check_engine, train_tasks[0], held_out, args, step=step,
                                       num_steps=num_steps, autocast=autocast, reduce_device=reduce_device)
            except MissedBandError as e:
                missed, last_step = e, True
            wandb_run.log({"step": step, "held_out_pass1": band.last[1]})
        if args.eval_every > 0 and (step % args.eval_every == 0 or last_step):
            val_loss = evaluate_val_loss(model, val_batches, device, reduce_device, autocast)
            print0(f"step {step}/{num_steps} | val loss {val_loss:.4f}")
            wandb_run.log({"step": step, "val_loss": val_loss})
        if last_step:
            break

        t0 = time.time()
        convs = conversations_at(train_tasks, train_order, rank_positions(step, args.examples_per_step, rank, world_size))
        micro_batches = make_micro_batches(tokenizer, convs, args.max_seq_len, args.device_batch_size, pad_token)
        lrm = lr_multiplier(step, num_steps)
        loss, gnorm, updated = train_step(model, optimizers, micro_batches, lrm, device, reduce_device=reduce_device,
                                          autocast=autocast, forward=forward)
        if device.type == "cuda":
            torch.cuda.synchronize()
        log_step(step + 1, num_steps, loss, gnorm, lrm, dt=(time.time() - t0) * 1000, updated=updated,
                 compile_clock=compile_clock, wandb_run=wandb_run)

    # A run that missed the band still saves its model (nothing is lost: it is a finished, valid checkpoint, and its
    # meta's stop.in_band says it missed), then fails with the error, so that a pipeline does not go on with it.
    if rank == 0:
        stop = None if band is None else stop_record(band, held_out, args, task_names[0])
        save_final_model(checkpoint_dir, model, step, sft_meta(model, args, step, val_loss, stop,
                                                               compiled=compile_clock.total()),
                         "" if missed is None else f", outside the band {band.describe()}")
    wandb_run.finish()
    wait_for_all_ranks()
    if missed is not None:
        raise missed


if __name__ == "__main__":
    run_main(main)
