"""
What one of chat_rl's pass@k evals costs, with its prompts prefilled several at a time (the engine's default,
nanochat.engine.scheduler.PREFILL_TOKENS positions a forward) and one at a time (as before), side by side on the
same model and questions, alternately, so that both see the same machine, with one engine (one static batch, its
graphs captured once). Both sample from the same seeds, so they sample the same tokens where the prefill's shapes
round alike (fp32 on a CPU; in bf16 on a GPU a token may differ): the timings differ by the prefill, whose own
seconds (DecodeBatch.prefill, synchronized) are measured in one more eval each way and reported apart.

    python -m scripts.bench_eval --source=sft --task=arithmetic --eval-examples=100 --num-samples=8 --max-new-tokens=128
    python -m scripts.bench_eval --source=sft --task=gsm8k --eval-examples=400 --num-samples=8   # chat_rl's eval
"""

import dataclasses
import json
import time

from nanochat.checkpoints.loading import load_model
from nanochat.cli import (ArgumentParser, add_compile_flag, add_debug_flag, add_decode_flag, add_memory_budget_flag,
                          add_shared, add_shared_flag, run_main)
from nanochat.common import compute_init
from nanochat.compiling.plan import compile_models, resolve_compile_flag
from nanochat.engine.cuda_graphs import check_decode_flag
from nanochat.engine.decode_batch import DecodeBatch
from nanochat.engine.engine import Engine
from nanochat.engine.scheduler import PREFILL_TOKENS
from nanochat.engine.spec import resolve_memory_budget, rollout_spec
from nanochat.errors import UserError
from nanochat.rl.config import SETTINGS
from nanochat.rl.evaluation import EVAL_MAX_NEW_TOKENS, evaluate_pass_at_k
from nanochat.runtime.device import synchronize
from nanochat.runtime.distributed import print0
from nanochat.runtime.dtypes import autocast_context, compute_dtype, requested_dtype
from tasks.registry import make_task

WAYS = {"batched": PREFILL_TOKENS, "one_by_one": 1}  # positions a prefill forward takes at most


def timed_prefills(device, seconds):
    """DecodeBatch.prefill, its seconds appended to `seconds` (the device synchronized before and after)."""
    prefill = DecodeBatch.prefill

    def timed(batch, *args, **kwargs):
        synchronize(device)
        t0 = time.perf_counter()
        out = prefill(batch, *args, **kwargs)
        synchronize(device)
        seconds.append(time.perf_counter() - t0)
        return out
    return timed


def build_parser():
    p = ArgumentParser(description="Seconds of a pass@k eval, prompts prefilled together and one at a time")
    add_shared(p, "source", "task")
    # the eval chat_rl runs by default (its --eval-examples questions, --device-batch-size samples each)
    p.add_argument("--eval-examples", type=int, default=SETTINGS["eval_examples"].default,
                   help="test questions (chat_rl's --eval-examples)")
    p.add_argument("--num-samples", type=int, default=SETTINGS["device_batch_size"].default,
                   help="samples per question (chat_rl: --device-batch-size)")
    add_shared_flag(p, "max_new_tokens", help=f"completion length cap (chat_rl's eval: {EVAL_MAX_NEW_TOKENS})")
    p.add_argument("--repeats", type=int, default=2, help="evals timed each way, alternately")
    add_shared(p, "device_type")
    add_shared_flag(p, "dtype", help="auto|float32|bfloat16 (default: $NANOCHAT_DTYPE, else auto)")
    add_memory_budget_flag(p)
    add_decode_flag(p)
    add_compile_flag(p)
    p.add_argument("--output", type=str, default="bench_eval.json", help="where to write the numbers as JSON")
    add_debug_flag(p)
    return p


def parse_args(argv):
    return build_parser().parse_args(argv)


def main(argv):
    args = parse_args(argv)
    if args.repeats < 1 or args.eval_examples < 1:
        raise UserError("--repeats and --eval-examples must be >= 1")
    _, _, _, _, device = compute_init(args.device_type)
    decode = check_decode_flag(args.decode, device)
    compiling, args.compile = resolve_compile_flag(args.compile, device, decode, trains=False)
    autocast = autocast_context(device, compute_dtype(device, requested_dtype(args.dtype)))
    model, tokenizer, _ = load_model(args.source, device, phase="eval")
    compile_models(compiling, model)
    budget, _ = resolve_memory_budget(args.memory_budget_gb, model, device)
    task = make_task(args.task, "test")
    # one engine for both ways: the limit changes no batch or graph, so they share the budget's one static batch
    engine = Engine(model, tokenizer, rollout_spec(model, memory_budget_gb=budget, decode=decode, compile=args.compile))

    def evaluate(way):
        engine.reconfigure(dataclasses.replace(engine.spec, prefill_tokens=WAYS[way]))  # the same batches serve
        with autocast:
            return evaluate_pass_at_k(engine, task, args.eval_examples, args.num_samples,
                                      max_new_tokens=args.max_new_tokens, device=device)[0]

    seconds, prefill_seconds, stats, pass1 = {way: [] for way in WAYS}, {}, {}, {}
    for repeat in range(args.repeats + 1):  # the first round warms up (the batch made, graphs captured): not counted
        for way in WAYS:
            synchronize(device)
            t0 = time.perf_counter()
            passk = evaluate(way)
            synchronize(device)
            if repeat > 0:
                seconds[way].append(time.perf_counter() - t0)
            stats[way], pass1[way] = engine.last_stats, passk.any[0]
    plain_prefill = DecodeBatch.prefill
    for way in WAYS:  # the prefills' own seconds, in an eval of their own: synchronizing each would slow the timed ones
        prefills = []
        DecodeBatch.prefill = timed_prefills(device, prefills)
        try:
            evaluate(way)
        finally:
            DecodeBatch.prefill = plain_prefill
        prefill_seconds[way] = sum(prefills)
    result = {way: {"seconds": min(seconds[way]), "all_seconds": seconds[way], "prefill_seconds": prefill_seconds[way],
                    "pass@1": pass1[way], "prefill_forwards_last_rollout": stats[way].prefill_forwards} for way in WAYS}
    result.update(task=args.task, eval_examples=args.eval_examples, num_samples=args.num_samples, device=str(device),
                  speedup=result["one_by_one"]["seconds"] / result["batched"]["seconds"])
    for way in WAYS:
        print0(f"eval {way:>10}: {result[way]['seconds']:.2f} s (best of {args.repeats}; "
               f"prefills {result[way]['prefill_seconds']:.3f} s), "
               f"{result[way]['prefill_forwards_last_rollout']} prefill forwards in the last rollout, "
               f"pass@1 {result[way]['pass@1']:.4f}")
    print0(f"one at a time / batched: {result['speedup']:.2f}x the eval, "
           f"{result['one_by_one']['prefill_seconds'] / max(result['batched']['prefill_seconds'], 1e-9):.2f}x its prefills")
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    run_main(main)
