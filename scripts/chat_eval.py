"""
Evaluate a chat checkpoint on a task's test split: greedy pass@1 and sampled pass@k.

  1. greedy: one completion per question at temperature 0; pass@1 = fraction correct;
  2. sampled: --num-samples completions per question at --temperature / --top-k; pass@k for every
     k <= num_samples, both nanochat's ("a correct answer among the first k samples") and the unbiased
     estimator 1 - C(n-c, k) / C(n, k).
Prints a table and writes the numbers as JSON: a new file each eval under report/chat_eval/, and a copy as
report/chat_eval_<source>.json, the latest (or --output). Without --task, the task the checkpoint's run trained on
(an RL checkpoint records it), else GSM8K. Uses the same evaluation code as chat_rl's periodic eval.

Launch:
  python -m scripts.chat_eval --source=rl
  torchrun --standalone --nproc_per_node=8 -m scripts.chat_eval -- --source=sft
"""

import os
import time

from nanochat.checkpoints.loading import find_checkpoint, load_model
from nanochat.cli import (ArgumentParser, add_compile_flag, add_debug_flag, add_decode_flag, add_decode_kernels_flag,
                          add_memory_budget_flag, add_model_generation_flag, add_shared, add_shared_flag, run_main)
from nanochat.common import compute_cleanup, compute_init, get_base_dir
from nanochat.compiling.functions import CompileClock
from nanochat.compiling.plan import compile_models, resolve_compile_flag
from nanochat.engine.calculator import recorded_calculator_format
from nanochat.engine.cuda_graphs import check_decode_flag
from nanochat.engine.decode_steps import check_decode_kernels
from nanochat.engine.engine import Engine
from nanochat.engine.spec import resolve_memory_budget, rollout_spec
from nanochat.errors import UserError
from nanochat.files import check_writable_dir, check_writable_file, write_errors
from nanochat.report import EVALS_DIR, eval_result_paths, save_json
from nanochat.rl.evaluation import evaluate_pass_at_k
from nanochat.rl.metrics import reduce_metrics
from nanochat.runtime.distributed import collective_device, get_dist_info, print0, wait_for_all_ranks
from nanochat.runtime.dtypes import autocast_context, compute_dtype, requested_dtype
from nanochat.settings import SHARED
from tasks.registry import make_task, recorded_task


def build_parser():
    p = ArgumentParser(description="pass@k of a chat checkpoint on a task's test split")
    # model
    add_shared(p, "source")
    add_shared_flag(p, "model_tag", help="model tag; default: the largest d<N>")
    add_shared_flag(p, "model_step", help="checkpoint step; default: the last one")
    add_model_generation_flag(p)
    # task
    add_shared_flag(p, "task", script="chat_eval",
                    help=f"{SHARED['task'].help}; several, comma-separated, are evaluated in turn (the JSON then holds "
                         f"{{\"tasks\": [one result each]}}); default: the checkpoint's own (an RL run's --task), "
                         f"else {SHARED['task'].default}")
    p.add_argument("--num-examples", type=int, default=-1, help="test questions to use (-1 = all)")
    # sampling: chat_rl's eval's by default (nanochat/rl/evaluation.py)
    p.add_argument("--num-samples", type=int, default=8, help="samples per question for pass@k")
    add_shared(p, "max_new_tokens")
    add_shared_flag(p, "temperature", help="sampling temperature for pass@k")
    add_shared_flag(p, "top_k", help="top-k for pass@k sampling (0 = disabled)")
    add_shared_flag(p, "max_rows", help="max rows per rollout batch (0 = from the memory budget)")
    add_memory_budget_flag(p)
    add_decode_flag(p)
    add_decode_kernels_flag(p)
    add_compile_flag(p)
    # runtime and output
    add_shared(p, "device_type", "calculator_format")
    add_shared_flag(p, "dtype", help="auto|float32|bfloat16; default: $NANOCHAT_DTYPE, else auto (bfloat16 where it is "
                                     "native)")
    p.add_argument("--output", type=str, default="", help="JSON output path (default: a new file each eval, "
                   "$NANOCHAT_BASE_DIR/report/chat_eval/<source>-<tag>-step<step>-<time>.json, copied to "
                   "report/chat_eval_<source>.json, the latest)")
    add_shared(p, "seed")
    add_debug_flag(p)
    return p


def parse_args(argv):
    return build_parser().parse_args(argv)


def validate_args(args):
    if args.source not in ("base", "mid", "sft", "rl"):
        raise UserError(f"--source must be base, mid, sft or rl, got {args.source!r}")
    args.dtype = requested_dtype(args.dtype)
    if args.num_samples < 1 or args.max_new_tokens < 1:
        raise UserError("--num-samples and --max-new-tokens must be >= 1")
    if args.num_examples == 0 or args.num_examples < -1:
        raise UserError(f"--num-examples must be >= 1, or -1 for all, got {args.num_examples}")
    if args.temperature < 0 or args.top_k < 0:
        raise UserError("--temperature and --top-k must be >= 0")


def format_table(greedy, sampled):
    """A plain-text table: one row per k."""
    lines = [f"{'k':>4} | {'pass@k (any of first k)':>24} | {'pass@k (unbiased)':>18}",
             f"{'-' * 4}-+-{'-' * 24}-+-{'-' * 18}"]
    for k, (a, u) in enumerate(zip(sampled.any, sampled.unbiased), start=1):
        lines.append(f"{k:>4} | {a:>24.4f} | {u:>18.4f}")
    lines.append(f"greedy pass@1: {greedy.any[0]:.4f} on {greedy.num_questions} questions")
    return "\n".join(lines)


def task_names(flag):
    """--task's tasks: one, or several comma-separated, each evaluated in turn."""
    return [name.strip() for name in flag.split(",") if name.strip()]


def task_flag(flag, meta):
    """--task's value: the flag as given, else the task the checkpoint records (an RL run's), else the shared
    setting's (gsm8k); and, where the user named none, the line that says which was taken."""
    if flag is not None:
        return flag, None
    recorded = recorded_task(meta)
    where = "the checkpoint's" if recorded else "the checkpoint records none"
    task = recorded or SHARED["task"].default
    return task, f"task: {task} ({where}; --task to choose)"


def evaluate_task(name, engine, args, autocast, device, meta, decode):
    """Greedy pass@1 and sampled pass@k on the test split of the task `name`, printed; the result's dict."""
    task = make_task(name, "test")
    num_examples = len(task) if args.num_examples == -1 else min(args.num_examples, len(task))
    common = dict(device=collective_device(device), seed=args.seed, max_new_tokens=args.max_new_tokens)
    clock, t0 = CompileClock(), time.time()
    with autocast:
        greedy, _ = evaluate_pass_at_k(engine, task, num_examples, 1, temperature=0.0, top_k=None, **common)
        sampled, outcomes = evaluate_pass_at_k(engine, task, num_examples, args.num_samples,
                                               temperature=args.temperature, top_k=args.top_k or None, **common)
    elapsed = time.time() - t0
    compiles, compile_seconds = clock.total()  # part of `elapsed`; the most of any rank below
    compiled = reduce_metrics({"compiles": compiles, "compile_s": compile_seconds}, collective_device(device))
    print0(f"{name} test, {num_examples} questions, {args.num_samples} samples at T={args.temperature}, "
           f"top-k {args.top_k} ({elapsed:.1f}s)")
    print0(format_table(greedy, sampled))
    result = {
        "task": name, "source": args.source, "model_tag": args.model_tag, "model_step": meta.get("step"),
        "num_questions": sampled.num_questions, "num_samples": args.num_samples,
        "temperature": args.temperature, "top_k": args.top_k, "decode": decode, "compile": args.compile,
        "decode_kernels": engine.spec.decode_kernels,
        "seconds": elapsed, "compiles": int(compiled["compiles"]), "compile_s": compiled["compile_s"],
        "greedy_pass@1": greedy.any[0],
        "pass@k": {str(k): v for k, v in enumerate(sampled.any, start=1)},
        "pass@k_unbiased": {str(k): v for k, v in enumerate(sampled.unbiased, start=1)},
        "examples": [{"index": o.index, "completion": o.texts[0], "correct": int(o.rewards[0])} for o in outcomes[:5]],
    }
    return result


def write_result(result, args, tag, step):
    """The result as JSON: to --output where given; else to a file of its own under report/chat_eval/ (an earlier
    eval's is never replaced) and a copy to report/chat_eval_<source>.json, the latest."""
    if args.output:
        save_json(result, args.output)
        print0(f"wrote {args.output}")
        return
    path, latest = eval_result_paths(os.path.join(get_base_dir(), "report"), args.source, tag, step)
    save_json(result, path, latest)
    print0(f"wrote {path} (the latest also as {latest})")


def check_writable_result(args):
    """Say in one line, before the model loads, where the result cannot be written: --output, or the report folder's
    chat_eval/ (this eval's own file) and chat_eval_<source>.json (the latest)."""
    fix = "pass --output=<a writable path>"
    if args.output:
        return check_writable_file(args.output, "the results", fix)
    report_dir = os.path.join(get_base_dir(), "report")
    check_writable_dir(os.path.join(report_dir, EVALS_DIR), "the results", fix)
    check_writable_file(os.path.join(report_dir, f"chat_eval_{args.source}.json"), "the results", fix)


def main(argv):
    args = parse_args(argv)
    validate_args(args)
    if get_dist_info()[1] == 0:  # before the model loads and the questions run
        check_writable_result(args)
    _, rank, _, _, device = compute_init(args.device_type)
    try:
        decode = check_decode_flag(args.decode, device)
        check_decode_kernels(args.decode_kernels, device, compiled=args.compile == "on")  # before the model loads
        compiling, args.compile = resolve_compile_flag(args.compile, device, decode, trains=False)
        dtype = compute_dtype(device, args.dtype)
        autocast = autocast_context(device, dtype)
        _, tag, step = find_checkpoint(args.source, args.model_tag, args.model_step)
        model, tokenizer, meta = load_model(args.source, device, phase="eval", model_tag=tag, step=step,
                                            generation=args.model_generation)
        tasks, task_line = task_flag(args.task, meta)
        if task_line:
            print0(task_line)
        compile_models(compiling, model)
        args.memory_budget_gb, budget_line = resolve_memory_budget(args.memory_budget_gb, model, device,
                                                                   rollout_dtype=dtype)
        print0(budget_line or f"KV cache budget: {args.memory_budget_gb:g} GiB (--memory-budget-gb)")
        calculator = args.calculator_format or recorded_calculator_format(meta)
        engine = Engine(model, tokenizer, rollout_spec(model, max_rows=args.max_rows or None,
                                                       memory_budget_gb=args.memory_budget_gb, decode=args.decode,
                                                       compile=args.compile, calculator_format=calculator,
                                                       decode_kernels=args.decode_kernels))
        results = [evaluate_task(name, engine, args, autocast, device, meta=meta,
                                 decode=decode) for name in task_names(tasks)]
        result = results[0] if len(results) == 1 else {"tasks": results}  # one task: the file as it always was
        if rank == 0:
            with write_errors(lambda: "the results are the table above", fix=lambda e: "pass --output=<a writable path>"):
                write_result(result, args, tag, step)
        wait_for_all_ranks()
        return result
    finally:
        compute_cleanup()


if __name__ == "__main__":
    run_main(main)
