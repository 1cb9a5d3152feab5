"""
Benchmark of one chat_rl step, several ways, in one process, on the same model and questions (docs/performance.md):
chat_rl's step (nanochat.rl.run: RLRun.step's halves, sample_rollouts then train_on_rollouts, timed here) on an RLRun
of chat_rl's flags (all but the benchmark's own). --configs: baseline (nanochat's rollouts, a generate_batch call per
device_batch_size rows, and training: every row, with its prompt; fp32), batched_plain (chat_rl's rollouts, nanochat's
training), batched_fp32 / batched_bf16 (chat_rl's step), *_static / *_graph (the static decode step, eagerly / from CUDA graphs: tokens checked
against eager's / static's), *_compiled (torch.compile), *_blocks (--compile=blocks), *_nolag (the host not one step
behind the device), *_flex (the shared-prompt attention through FlexAttention), *_triton (the whole decode step in the
project's Triton kernels; --decode-kernels is per config); each as is and "+early" (rows end at random lengths).
  python -m scripts.bench_rl                                   # CPU or 1 GPU: random-init d4, vocab 8192
  python -m scripts.bench_rl --source=sft --task=arithmetic    # a trained checkpoint from $NANOCHAT_BASE_DIR
  python -m scripts.bench_rl --configs=batched_bf16 --profile=batched_bf16   # where a step's time goes
"""

import dataclasses
import json
import os

import torch

from nanochat.cli import ArgumentParser, add_shared_flag, flag_name, parse_rl_args, run_main
from nanochat.common import compute_cleanup, compute_init, get_base_dir
from nanochat.diagnostics import bench_measure, d20_train_step_kernels
from nanochat.diagnostics.bench_configs import CONFIGS, PER_CONFIG, PRESETS, default_configs
from nanochat.diagnostics.bench_results import add_ratios, mark_identical_tokens, no_signal_text, results_text
from nanochat.diagnostics.early_stop import EarlyStopModel
from nanochat.errors import require
from nanochat.files import atomic_write, check_writable_file, write_errors
from nanochat.model.flops import matmul_flops_per_token
from nanochat.model.gpt import build_fresh_model
from nanochat.rl.config import SETTINGS, RLConfig
from nanochat.rl.plan import resolve_memory, train_rows
from nanochat.rl.run import make_optimizers
from nanochat.runtime.distributed import get_dist_info, print0
from nanochat.runtime.dtypes import dtype_name
from nanochat.runtime.machine import PeakMemory, load_average, measure_machine, profile_phases
from nanochat.tokenizer import Tokenizer
from tasks.gsm8k import GSM8K
from tasks.registry import make_task


def build_parser():
    """The benchmark's own flags (every other flag is chat_rl's: parse_args)."""
    p = ArgumentParser(description="Benchmark one chat_rl step, several ways", epilog="Every other flag is chat_rl's (--task, "
                       "--examples-per-step, --num-samples, ...: its --help) but --dtype, --rollout-dtype, --decode, "
                       "--decode-kernels: per config (*_flex, *_triton: the decode steps flex and triton).")
    add = p.add_argument
    add("--configs", default="", help=f"comma-separated subset of {', '.join(CONFIGS)} (empty: all that run at speed here)")
    add("--output", default="bench_rl.json", help="where to write every number as JSON")
    add_shared_flag(p, "source", script="bench_rl", typed=False, help="empty: a random-init model of --depth; sft|rl: load that "
                                                               "checkpoint")
    add_shared_flag(p, "model_tag", typed=False, help="with --source: model tag to load (default: the largest d<N>)")
    add_shared_flag(p, "model_step", help="with --source: checkpoint step (default: the last one)")
    add_shared_flag(p, "seed", script="bench_rl", help="seed of the random-init model")
    add("--depth", type=int, default=4, help="layers of the random-init model (width 64 * depth, heads of 64)")
    add("--vocab-size", type=int, default=8192, help="its vocabulary ($NANOCHAT_BASE_DIR/tokenizer's, or a GSM8K BPE's)")
    add("--sequence-len", type=int, default=1024, help="its context length")
    add("--window-pattern", default="L", help="its sliding-window pattern")
    add("--preset", default="", choices=("",) + tuple(PRESETS), help="d20: nanochat's d20 shapes (depth 20, vocab 65536)")
    add("--force-advantages", action="store_true", help="advantages +1, -1, ...: a random model's whole batch trains")
    add("--repeat", type=int, default=1, help="measured steps per config (times: the last one's, the steady state)")
    add("--early-stop-mean", type=float, default=64.0, help="mean completion length of the +early runs (0: none)")
    add("--no-signal-fractions", default="0,0.25,0.5,0.75,1", help="batched_fp32's training, these fractions silenced")
    add("--peak-matmul-size", type=int, default=2048, help="n of the n x n matmul timed for the FLOP/s peak")
    add("--profile", default="", choices=("",) + tuple(CONFIGS), metavar="CONFIG", help="then profile a step of CONFIG (after one unprofiled)")
    add("--profile-rows", type=int, default=25, help="rows of each profile table")
    return p


NOT_BENCHED = ("teacher", "distill_coef", "reward_coef")  # on-policy distillation's settings (issue 75)


def parse_args(argv):
    """The benchmark's flags, and chat_rl's (every other flag, nanochat.cli.rl_parser's) as args.rl: an RLConfig."""
    args, rest = build_parser().parse_known_args(argv)
    flags = parse_rl_args(rest)
    given = [flag_name(name) for name, default in PER_CONFIG.items() if getattr(flags, name) != default]
    require(not given, f"{', '.join(given)}: bench_rl sets them per configuration (choose those with --configs)")
    # a benchmark's run loads no teacher (it measures chat_rl's own step): distillation's flags would fail mid-run
    taught = [flag_name(name) for name in NOT_BENCHED if getattr(flags, name) != SETTINGS[name].default]
    require(not taught, f"{', '.join(taught)}: bench_rl measures chat_rl's step without a distillation teacher")
    args.rl = RLConfig.from_flags(flags)
    return args


def validate_args(args):
    """Check the benchmark's own flags and apply --preset. Returns --configs' configs (None: default_configs')."""
    for name, value in PRESETS.get(args.preset, {}).items():
        setattr(args, name, value)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    require(all(n in CONFIGS for n in names) and (names or not args.configs.strip()),
            f"--configs={args.configs!r}: give a comma-separated subset of {', '.join(CONFIGS)}")
    require(len(set(names)) == len(names), f"--configs={args.configs!r} names a config twice")
    require(args.source in ("", "sft", "rl"), f"--source must be empty (random init), sft or rl, got {args.source!r}")
    require(args.source or (args.model_tag, args.model_step) == (None, None), "--model-tag/--model-step need --source=sft|rl")
    for name in ("depth", "vocab_size", "sequence_len", "repeat", "peak_matmul_size", "profile_rows"):
        require(getattr(args, name) >= 1, f"{flag_name(name)} must be >= 1, got {getattr(args, name)}")
    require(args.early_stop_mean == 0 or args.early_stop_mean >= 1, f"--early-stop-mean must be >= 1 (tokens) or 0 (no "
            f"+early runs), got {args.early_stop_mean}")
    return [CONFIGS[n] for n in names] or None


def bench_model(args, device):
    """(model in eval mode, tokenizer, description): the --source checkpoint, or a random-init model whose tokenizer is
    $NANOCHAT_BASE_DIR/tokenizer if it has --vocab-size tokens, else a BPE trained on the GSM8K train text."""
    if args.source:
        from nanochat.checkpoints.loading import load_model
        model, tokenizer, meta = load_model(args.source, device, phase="eval", model_tag=args.model_tag,
                                            step=args.model_step, generation=args.rl.model_generation)
        return model, tokenizer, {"source": args.source, "model_tag": args.model_tag, "step": meta.get("step")}
    directory = os.path.join(get_base_dir(), "tokenizer")
    tokenizer = Tokenizer.from_directory(directory) if os.path.isfile(os.path.join(directory, "tokenizer.pkl")) else None
    if tokenizer is None or tokenizer.get_vocab_size() != args.vocab_size:
        directory = "GSM8K train text"
        tokenizer = Tokenizer.train_from_iterator((r["question"] + "\n" + r["answer"] for r in GSM8K(split="train").rows),
                                                  args.vocab_size)
        require(tokenizer.get_vocab_size() == args.vocab_size, f"the GSM8K train text only supports a "
                f"{tokenizer.get_vocab_size()}-token BPE; pass --vocab-size={tokenizer.get_vocab_size()} or less")
    torch.manual_seed(args.seed)
    model = build_fresh_model(args.depth, args.sequence_len, args.vocab_size, device, args.window_pattern)
    return model.eval(), tokenizer, {"source": "random init", "tokenizer": directory}


def main(argv):
    args = parse_args(argv)
    configs = validate_args(args)
    require(get_dist_info()[3] == 1, "bench_rl measures one process; run it with python -m scripts.bench_rl, not torchrun")
    check_writable_file(args.output, "the benchmark's numbers", "pass --output=<a writable path>")  # before measuring
    _, _, _, _, device = compute_init(args.rl.device_type)
    try:
        graphs = ", ".join(c.name for c in configs or () if c.decode == "graph")
        require(device.type == "cuda" or not graphs, f"--configs names {graphs}, which replays CUDA graphs, and this run "
                f"is on {device.type} (torch sees no CUDA device, or --device-type chose another); measure the same step "
                "eagerly with a *_static config")
        return run(args, configs or default_configs(device, args.rl.compile), device)
    finally:
        compute_cleanup()


def write_numbers(path, numbers):
    """The JSON of what was measured, replacing the last; a failed write one line (the numbers so far are printed)."""
    with write_errors(lambda: "what was measured is printed above", fix=lambda e: "pass --output=<a writable path>"):
        atomic_write(path, json.dumps(numbers, indent=2))


def run(args, configs, device):
    dtypes = sorted({dtype_name(c.dtype) for c in configs}, reverse=True)  # float32 first
    info, peaks, bandwidth = measure_machine(device, dtypes, args.peak_matmul_size)
    rl = dataclasses.replace(args.rl, dtype="float32", rollout_dtype="bfloat16")  # until a configuration sets them
    task = make_task(rl.task, "train")
    require(rl.examples_per_step <= len(task), f"--examples-per-step={rl.examples_per_step}: {len(task)} questions here")
    model, tokenizer, model_info = bench_model(args, device)
    model_info.update({k: getattr(model.config, k) for k in ("n_layer", "n_embd", "n_head", "vocab_size", "sequence_len")},
                      num_params=model.num_params(), matmul_flops_per_token=matmul_flops_per_token(model))
    print0(f"model: {model_info}")
    initial_state, memory = {k: v.detach().clone() for k, v in model.state_dict().items()}, PeakMemory(device)
    _, budget = resolve_memory(rl, model, device, make_optimizers(rl, model), train_rows(rl, device.type),
                               rollout_dtype=rl.rollout_dtype)
    rl = dataclasses.replace(rl, memory_budget_gb=budget)  # once for every config, as chat_rl
    results, skipping, train_kernels = {}, None, None  # the same anywhere, so not in a GPU's (scarce) time
    report = lambda: {"machine": {**info, "load_average_after": load_average()}, "model": model_info,  # noqa: E731
                      "settings": {**vars(args), "rl": {**vars(rl), **PER_CONFIG}}, "peak_flops": peaks,
                      "memory_bandwidth": bandwidth, "memory_method": memory.method, "train_step_kernels": train_kernels,
                      "results": {n: {k: v for k, v in r.items() if k != "batches"} for n, r in results.items()},
                      "no_signal_training": skipping, "complete": len(results) == len(configs) * len(variants)}
    end = tokenizer.encode_special("<|assistant_end|>")
    variants = [("", model)] + ([("+early", EarlyStopModel(model, end, args.early_stop_mean))] if args.early_stop_mean else [])
    for suffix, rollout_model in variants:
        for config in configs:
            print0(f"running {config.name + suffix} ...", end=" ")
            r = results[config.name + suffix] = bench_measure.measure(
                model, rollout_model, initial_state, tokenizer, task, config=config, rl=rl, args=args, device=device,
                memory=memory, peaks=peaks, bandwidth=bandwidth)
            compiled = f", compiled {r['compiles_each']} graphs (warm-up, steps)" if any(r["compiles_each"]) else ""
            print0(f"step {r['step_seconds']:.1f}s (rollout {r['rollout_seconds']:.1f}s, train {r['train_seconds']:.1f}s, "
                   f"optimizer {r['optimizer_seconds']:.1f}s{compiled})")
            write_numbers(args.output, report())  # a time limit keeps what finished
    mark_identical_tokens(results, configs)
    batches = {name: r.pop("batches") for name, r in results.items()}
    add_ratios(results)
    train_kernels = d20_train_step_kernels() if args.preset == "d20" and device.type != "cuda" else None  # on meta:
    model.load_state_dict(initial_state)
    if (fractions := [float(f) for f in args.no_signal_fractions.split(",") if f.strip()]) and "batched_fp32" in batches:
        skipping = bench_measure.no_signal_table(model, batches["batched_fp32"], fractions, rl, device)
    print0("\n" + results_text(results))
    if skipping:
        print0("\n" + no_signal_text(skipping))
    write_numbers(args.output, report())
    print0(f"\nwrote {args.output} (memory: {memory.method})")
    if args.profile:  # where a step's time goes: the GPU's kernels against its waits on the host, and by torch op
        model.load_state_dict(initial_state)
        config = CONFIGS[args.profile]
        profile_run = bench_measure.bench_run(model, model, tokenizer, task, config, rl=rl, device=device)
        split, text = profile_phases(lambda: bench_measure.bench_step(profile_run, config, args.force_advantages), device,
                                     ("rollout", "training"), args.profile_rows)
        print0(f"\nprofiled step of {config.name}: {text}")
        write_numbers(args.output, {**report(), "profile_split": {config.name: split}})
    return report()


if __name__ == "__main__":
    run_main(main)
