"""
Benchmark of one chat_rl step, several ways, in one process, on the same model and questions (docs/performance.md):
chat_rl's step (nanochat.rl.run: RLRun.step, its rollouts then train_on_rollouts) on an RLRun of chat_rl's flags (all but the
benchmark's own). --configs: baseline (nanochat's rollouts, a generate_batch call per device_batch_size rows, and
training: every row, with its prompt; fp32), batched_plain (chat_rl's rollouts, nanochat's training), batched_fp32 /
batched_bf16 (chat_rl's step), *_static / *_graph (the static decode step, eagerly / from CUDA graphs: tokens checked
against eager's / static's), *_compiled (torch.compile), *_blocks (--compile=blocks), *_nolag (the host not one step
behind the device), *_flex (the shared-prompt attention through FlexAttention); each as is and "+early" (rows end at
random lengths).
  python -m scripts.bench_rl                                   # CPU or 1 GPU: random-init d4, vocab 8192
  python -m scripts.bench_rl --source=sft --task=arithmetic    # a trained checkpoint from $NANOCHAT_BASE_DIR
  python -m scripts.bench_rl --configs=batched_bf16 --profile=batched_bf16   # where a step's time goes
"""

import copy
import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

from nanochat.cli import ArgumentParser, add_shared_flag, flag_name, parse_rl_args, run_main
from nanochat.common import compute_cleanup, compute_init, get_base_dir
from nanochat.compiling.plan import compile_block_regions, compile_plan
from nanochat.diagnostics import (compiled_step_graphs, compiled_step_kernels, count_decode_step_ops,
                                  d20_train_step_kernels)
from nanochat.diagnostics.early_stop import EarlyStopModel
from nanochat.engine.decode_weights import matmul_modules
from nanochat.engine.engine import Engine
from nanochat.engine.flex_prompt_attention import flex_compile_state
from nanochat.engine.kv_cache import cache_geometry
from nanochat.errors import require
from nanochat.files import atomic_write
from nanochat.model.flops import matmul_flops_per_token, rollout_flops, train_flops
from nanochat.model.gpt import GPT, build_fresh_model
from nanochat.report import text_table
from nanochat.rl.advantages import make_question_batch
from nanochat.rl.config import RLConfig
from nanochat.rl.plan import RunPlan, resolve_memory, train_rows
from nanochat.rl.policy_gradient import accumulate_policy_gradient
from nanochat.rl.rollout import QuestionRollout, StepRollouts, longest_prompt, step_question_indices
from nanochat.rl.run import build_run, make_optimizers, sample_rollouts
from nanochat.runtime.cpu_features import cpu_has_native_bf16
from nanochat.runtime.distributed import get_dist_info, print0
from nanochat.runtime.dtypes import autocast_context, dtype_name
from nanochat.runtime.machine import PeakMemory, device_time, load_average, measure_machine, profile_phases
from nanochat.tokenizer import Tokenizer
from tasks.gsm8k import GSM8K
from tasks.registry import make_task


@dataclass(frozen=True)
class BenchConfig:
    name: str
    batched: bool        # chat_rl's rollouts (sample_rollouts), else nanochat's: a generate_batch call per pass
    dtype: torch.dtype   # of rollouts and training (bf16: autocast; weights stay fp32)
    lean: bool           # chat_rl's work (RLRun.lean, the engine's share_prompts), else nanochat's
    decode: str = "eager"  # the engine's decode mode (nanochat.engine.cuda_graphs.decode_mode): the same tokens in each
    compiled: bool = False  # torch.compile the training forward and (static, graph) the decode step
    blocks: bool = False    # torch.compile each block around its attention instead (--compile=blocks)
    lag: Optional[bool] = None  # the engine's host one step behind the device (None: the engine's default, on CUDA)
    prompt_attention: str = "explicit"  # the shared-prompt decode step's attention (the engine's; "flex": FlexAttention)


CONFIGS = {c.name: c for c in [BenchConfig("baseline", False, torch.float32, False),
                                BenchConfig("batched_plain", True, torch.float32, False)]
           + [BenchConfig(f"batched_{short}" + ("" if mode == "eager" else "_" + mode) + "_compiled" * compiled, True,
                          dtype, True, mode, compiled)
              for compiled in (False, True) for short, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
              for mode in ("eager", "static", "graph")[:3 if short == "bf16" else 2]]
           + [BenchConfig("batched_fp32_blocks", True, torch.float32, True, "eager", blocks=True),
              BenchConfig("batched_bf16_graph_blocks", True, torch.bfloat16, True, "graph", blocks=True),
              BenchConfig("batched_bf16_graph_nolag", True, torch.bfloat16, True, "graph", lag=False),
              BenchConfig("batched_fp32_static_flex", True, torch.float32, True, "static", prompt_attention="flex"),
              BenchConfig("batched_bf16_graph_flex", True, torch.bfloat16, True, "graph", prompt_attention="flex"),
              BenchConfig("batched_bf16_graph_compiled_flex", True, torch.bfloat16, True, "graph", True,
                          prompt_attention="flex"),
              BenchConfig("batched_fp32_static_triton", True, torch.float32, True, "static", prompt_attention="triton"),
              BenchConfig("batched_bf16_graph_triton", True, torch.bfloat16, True, "graph", prompt_attention="triton")]}
PRESETS = {"d20": dict(depth=20, vocab_size=65536, sequence_len=2048, window_pattern="SSSL")}  # nanochat's d20, Jan 2026
BENCH_STEP = 0           # the chat_rl step whose questions and seeds the benchmark uses
PER_CONFIG = {"dtype": None, "rollout_dtype": "auto", "decode": "auto"}  # chat_rl's flags that each config sets
ENGINE_WORK = ("prefill_tokens", "decode_forwards", "row_steps", "kv_positions_read")  # Engine.last_stats, summed


def build_parser():
    """The benchmark's own flags (every other flag is chat_rl's: parse_args)."""
    p = ArgumentParser(description="Benchmark one chat_rl step, several ways", epilog="Every other flag is chat_rl's (--task, "
                       "--examples-per-step, --num-samples, ...: its --help) but --dtype, --rollout-dtype, --decode: per config.")
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


def parse_args(argv):
    """The benchmark's flags, and chat_rl's (every other flag, nanochat.cli.rl_parser's) as args.rl: an RLConfig."""
    args, rest = build_parser().parse_known_args(argv)
    flags = parse_rl_args(rest)
    given = [flag_name(name) for name, default in PER_CONFIG.items() if getattr(flags, name) != default]
    require(not given, f"{', '.join(given)}: bench_rl sets them per configuration (choose those with --configs)")
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


def default_configs(device, compile_mode="auto"):
    """The configs that run here at speed: graphs on CUDA, bf16 where native, compiled ones as chat_rl's --compile."""
    plans = {c: compile_plan(compile_mode, device, c.decode) for c in CONFIGS.values()}
    configs = [c for c, plan in plans.items() if (c.decode != "graph" or device.type == "cuda")
               and (not c.compiled or (plan.train and (plan.decode or c.decode == "eager"))) and not c.blocks
               and c.lag is None and c.prompt_attention == "explicit"]
    if device.type == "cpu" and not cpu_has_native_bf16():
        print0("note: no native bf16 on this CPU (no AVX512-BF16 or AMX): skipping batched_bf16 "
               "(chat_rl runs in fp32 here; --configs=batched_bf16 measures it anyway)")
        return [c for c in configs if c.dtype != torch.bfloat16]
    return configs


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


def row_steps_of(tokens, max_tokens):
    """Engine steps a completion took: its tokens, plus the terminal token if it ended before the cap
    (a row is cut only when it reaches max_tokens; ending at the last step leaves max_tokens - 1 tokens)."""
    return len(tokens) + (len(tokens) < max_tokens)


def step_rollouts(run, config):
    """The step's rollouts: chat_rl's (sample_rollouts), or nanochat's, each question in num_samples / device_batch_size
    generate_batch calls. Returns (QuestionRollouts, [(Engine.last_stats, [(prompt length, [tokens]) per prompt])])."""
    if config.batched:
        rollouts = sample_rollouts(run, BENCH_STEP).trained
        return rollouts, [(run.engine.last_stats, [(r.prompt_length, [c.tokens for c in r.completions]) for r in rollouts])]
    cfg, engine, task, tokenizer = run.config, run.engine, run.train_task, run.engine.tokenizer
    rollouts, calls = [], []
    run.model.eval()
    for i in step_question_indices(BENCH_STEP, run.examples_per_rank, run.rank, run.world_size, len(task)):
        prompt, completions = tokenizer.render_for_completion(task[i]), []
        for j in range(cfg.num_samples // cfg.device_batch_size):
            with run.autocast(rollouts=True):
                seqs, masks = engine.generate_batch(prompt, num_samples=cfg.device_batch_size, max_tokens=cfg.max_new_tokens,
                                                    temperature=cfg.temperature, top_k=cfg.top_k or None,
                                                    seed=hash((BENCH_STEP, i, j)) & 0x7FFFFFFF)
            completions += [(s[len(prompt):], m[len(prompt):]) for s, m in zip(seqs, masks)]
            calls.append((engine.last_stats, [(len(prompt), [s[len(prompt):] for s in seqs])]))
        texts = [tokenizer.decode(t) for t, _ in completions]
        rewards = [task.reward(task[i], text) for text in texts]
        batch = make_question_batch(prompt, completions, rewards, tokenizer.encode_special("<|assistant_end|>"))
        rollouts.append(QuestionRollout(i, completions, texts, rewards, batch))
    return rollouts, calls


def engine_work(model, calls, max_tokens):
    """step_rollouts' engine calls' work: their counts, rows x longest row (uncompacted decoding) and matmul FLOPs."""
    work = {key: sum(getattr(stats, key) for stats, _ in calls) for key in ENGINE_WORK}
    work.update(max_batch_rows=max(stats.max_batch_rows for stats, _ in calls), rows_x_longest=0, rollout_flops=0)
    for _, prompts in calls:
        steps = [[row_steps_of(tokens, max_tokens) for tokens in rows] for _, rows in prompts]
        work["rows_x_longest"] += sum(map(len, steps)) * (max(map(max, steps)) - 1)
        work["rollout_flops"] += sum(rollout_flops(model, length, 1, s) for (length, _), s in zip(prompts, steps))
    return work


def bench_run(model, rollout_model, tokenizer, task, config, rl, device, optimize=True):
    """chat_rl's RLRun (build_run) of rl in the config's dtype and decode mode, fresh optimizers (optimize=False: none)."""
    rl = dataclasses.replace(rl, dtype=dtype_name(config.dtype), rollout_dtype=dtype_name(config.dtype), decode=config.decode)
    engine = Engine(rollout_model, tokenizer, max_rows=(rl.max_rows or None) if config.batched else None,
                    memory_budget_gb=rl.memory_budget_gb, share_prompts=config.lean, decode=config.decode,
                    compile="on" if config.compiled else "off", lag=config.lag, prompt_attention=config.prompt_attention)
    if engine.spec.decode != "eager":  # as chat_rl's: one static batch, sized for the task's longest prompt
        engine.reserve_prompt_length(longest_prompt(tokenizer, task))
    return build_run(rl, RunPlan.as_given(rl, engine.spec), model, tokenizer, engine, make_optimizers(rl, model) if optimize else [],
                     (task, None), device, steps=(BENCH_STEP, BENCH_STEP + 1), lean=config.lean, compiled=config.compiled,
                     rows=train_rows(rl, device.type) if config.batched else rl.device_batch_size, required=True,
                     reference=copy.deepcopy(model).requires_grad_(False) if rl.kl_coef else None)


def bench_step(run, config, force_advantages):
    """One chat_rl step (RLRun.step), timed on the device: the rollouts (chat_rl's, or nanochat's: step_rollouts),
    then train_on_rollouts (its optimizer steps timed apart, by hooks)."""
    optimizer_seconds, calls, digest = [], [], []
    hooks = [hook for opt in run.optimizers for hook in (
        opt.register_step_pre_hook(lambda *_: optimizer_seconds.append(-device_time(run.device))),
        opt.register_step_post_hook(lambda *_: optimizer_seconds.append(device_time(run.device))))]

    def sample(run, step, position):  # every repeat the step's questions, as chat_rl's step BENCH_STEP
        rollouts, step_calls = step_rollouts(run, config)
        calls.extend(step_calls)
        return StepRollouts(rollouts, rollouts, position)

    def before_training(rollouts):
        digest.append(hashlib.sha1(repr([r.batch.inputs.tolist() for r in rollouts]).encode()).hexdigest()[:16])
        return [dataclasses.replace(r, batch=dataclasses.replace(r.batch, advantages=(
            1 - 2 * (torch.arange(len(r.batch.advantages)) % 2)).to(r.batch.advantages))) for r in rollouts] \
            if force_advantages else rollouts
    outcome = run.step(BENCH_STEP, clock=lambda: device_time(run.device), sample=sample, before_training=before_training)
    for hook in hooks:
        hook.remove()
    (compiles, compile_seconds), optimizer_s, trained = run.compile_clock.lap(), sum(optimizer_seconds), outcome.result.first
    return {**engine_work(run.model, calls, run.config.max_new_tokens), "tokens_digest": digest[0], "compiles": compiles,
            "compile_seconds": compile_seconds, "rollout_seconds": outcome.t_rollout,
            "train_seconds": outcome.t_train - optimizer_s, "optimizer_seconds": optimizer_s,
            "step_seconds": outcome.t_rollout + outcome.t_train, "captures": run.engine.last_stats.captures,
            "rows": trained.rows_total, "rows_trained": trained.rows_trained,
            "rows_skipped": trained.rows_total - trained.rows_trained, "batches": [r.batch for r in outcome.trained],
            **{key: getattr(trained, key) for key in ("sampler_tokens", "sampler_gap_mean", "sampler_gap_max", "sampler_k3")}}


def measure(model, rollout_model, initial_state, tokenizer, task, config, rl, args, device, memory, peaks, bandwidth):
    """One config from the initial weights: a warm-up (a question, a few tokens, no optimizer step), then --repeat steps
    of one run. Figures: the last step's, the steady state; *_each: every step's; tokens compared: the first step's."""
    model.load_state_dict(initial_state)
    compile_block_regions(model, config.blocks, required=True)  # the rollout model is it, or wraps it
    graphs_before = len(compiled_step_graphs())  # earlier configs' decode graphs
    warm = dataclasses.replace(rl, examples_per_step=1, num_samples=rl.device_batch_size,
                               max_new_tokens=min(4, rl.max_new_tokens))
    steps = [bench_step(bench_run(model, rollout_model, tokenizer, task, config, warm, device, optimize=False), config,
                        args.force_advantages)]
    resident_mb = memory.reset()
    run = bench_run(model, rollout_model, tokenizer, task, config, rl, device)
    steps += [bench_step(run, config, args.force_advantages) for _ in range(args.repeat)]
    r = {**steps[-1], "resident_mb_at_start": resident_mb, "peak_memory_mb": memory.peak_mb(),
         "tokens_digest": steps[1]["tokens_digest"], "train_flops": train_flops(model, steps[-1]["batches"]),
         "rollout_tokens": sum(sum(b.completion_lengths) for b in steps[-1]["batches"]),
         "train_tokens": sum(b.inputs.numel() for b in steps[-1]["batches"])}
    r.update({f"{key}_each": [s[key] for s in (steps if key.startswith("compile") else steps[1:])]  # compiles: warm-up's too
              for key in ("compiles", "compile_seconds", "rollout_seconds", "captures", "step_seconds", "train_seconds")})
    for phase in ("rollout", "train"):  # MFU: against the matmul peak of the dtype
        flops, seconds = r[f"{phase}_flops"], r[f"{phase}_seconds"]
        r.update({f"{phase}_tokens_per_s": r[f"{phase}_tokens"] / seconds, f"{phase}_flops_per_s": flops / seconds,
                  f"{phase}_mfu": flops / seconds / peaks[dtype_name(config.dtype)]})
    # the decode step's roofline: every matmul weight read once in the compute dtype, plus the keys/values it reads
    forwards = max(r["decode_forwards"], 1)
    kv_bytes = cache_geometry(model).bytes_per_token(config.dtype) * r["kv_positions_read"]
    weight_bytes = config.dtype.itemsize * sum(linear.weight.numel() for linear in matmul_modules(model))
    r.update(kv_bytes_per_decoded_token=kv_bytes / max(r["row_steps"], 1), decode_weight_bytes=weight_bytes,
             decode_ms_per_step=1000 * r["rollout_seconds"] / forwards,
             bytes_per_decode_step=weight_bytes + kv_bytes / forwards)
    r.update(bandwidth_bound_ms=(bound := 1000 * r["bytes_per_decode_step"] / bandwidth),
             decode_x_bound=r["decode_ms_per_step"] / bound)
    flex = config.prompt_attention == "flex"  # FlexAttention does not run on the meta device: no count of its step
    with torch.device("meta"):  # a static decode step at the run's largest shape: the same count on any machine
        ops = None if flex else count_decode_step_ops(GPT(model.config, model.generation), max(r["max_batch_rows"], 1),
                                                      rl.max_new_tokens, share_prompts=config.lean, num_samples=rl.num_samples,
                                                      kernels=config.prompt_attention)
    compiled = compiled_step_kernels(graphs_before) if config.compiled and config.decode != "eager" else None
    r.update({key: ops and getattr(ops, field) for key, field in (("decode_step_ops", "ops"), ("decode_step_kernels", "kernels"),
              ("decode_step_ops_per_layer", "ops_per_block"), ("decode_step_kernels_per_layer", "kernels_per_block"))},
             decode_step_compiled_kernels=compiled and compiled.asdict(),
             flex_compile=flex_compile_state() if flex else None)  # compiled alone on CUDA: whether it did, and its cost
    return r


def mark_identical_tokens(results, configs):
    """Whether a config's tokens equal its twin's, if run: a *_nolag one's lagging, a *_flex one's hand-written
    attention's, a compiled one's uncompiled (a GPU's near-tie may fall otherwise), a graph one's static (same shapes,
    same kernels), else eager's; a static one's eager's."""
    names = {c.name for c in configs}
    for name, r in results.items():
        base, _, suffix = name.partition("+")
        twins = ([base.removesuffix("_nolag")] if CONFIGS[base].lag is not None else
                 [base.removesuffix("_flex").removesuffix("_triton")] if CONFIGS[base].prompt_attention != "explicit" else
                 [base.removesuffix("_compiled").removesuffix("_blocks")] if CONFIGS[base].compiled or CONFIGS[base].blocks else
                 [base.replace("_graph", "_static"), base.replace("_graph", "")] if "_graph" in base else
                 [base.replace("_static", "")] if "_static" in base else None)
        if twins is not None:
            twin = next((t + ("+" + suffix if suffix else "") for t in twins if t in names), None)
            other = results.get(twin)
            r["tokens_identical_to"] = (twin, other["tokens_digest"] == r["tokens_digest"]) if other else None


def add_ratios(results):
    """Each run against its variant's baseline: throughput ratios, step speedup (None: the baseline did no such work)."""
    for name, r in results.items():
        if (base := results.get("baseline" + ("+early" if name.endswith("+early") else ""))) is not None:
            for key, a, b in (("rollout_tokens_per_s_x", r["rollout_tokens_per_s"], base["rollout_tokens_per_s"]),
                              ("train_tokens_per_s_x", r["train_tokens_per_s"], base["train_tokens_per_s"]),
                              ("step_speedup_x", base["step_seconds"], r["step_seconds"])):
                r[key] = a / b if b > 0 else None


TABLES = [
    [("roll tok/s", "rollout_tokens_per_s", ".1f"), ("x", "rollout_tokens_per_s_x", ".2f"),
     ("train tok/s", "train_tokens_per_s", ".1f"), ("x", "train_tokens_per_s_x", ".2f"), ("roll MFU", "rollout_mfu", ".2%"),
     ("train MFU", "train_mfu", ".2%"), ("step s", "step_seconds", ".2f"), ("speedup", "step_speedup_x", ".2f"),
     ("peak MB", "peak_memory_mb", ".0f")],
    [("tokens", "rollout_tokens", "d"), ("rows", "rows", "d"), ("row_steps", "row_steps", "d"),
     ("rows x longest", "rows_x_longest", "d"), ("rollout s", "rollout_seconds", ".2f"), ("train s", "train_seconds", ".2f"),
     ("optim s", "optimizer_seconds", ".2f"), ("trained", "rows_trained", "d"), ("skipped", "rows_skipped", "d"),
     ("KV B/token", "kv_bytes_per_decoded_token", ".0f")],
    [("decode ms/step", "decode_ms_per_step", ".2f"), ("MB/step", lambda r: r["bytes_per_decode_step"] / 2 ** 20, ".1f"),
     ("bound ms", "bandwidth_bound_ms", ".3f"), ("x bound", "decode_x_bound", ".1f"),
     ("rollout s first..last", lambda r: f"{r['rollout_seconds_each'][0]:.2f}..{r['rollout_seconds_each'][-1]:.2f}", ""),
     ("captures", lambda r: "/".join(map(str, r["captures_each"])), ""),
     ("ops/kernels (compiled)", lambda r: r["decode_step_ops"] and f"{r['decode_step_ops']}/{r['decode_step_kernels']}" + (
         "" if (k := r["decode_step_compiled_kernels"]) is None else f" ({k['generated']}+{k['library']})"), ""),  # launches
     # the sampler-trainer gap of the trained tokens (none trained: nothing measured)
     ("gap mean/max", lambda r: f"{r['sampler_gap_mean']:.1e}/{r['sampler_gap_max']:.1e}" if r["sampler_tokens"] else None, ""),
     ("tokens", lambda r: f"{'=' if t[1] else 'DIFFER from'} {t[0]}" if (t := r.get("tokens_identical_to")) else "", "")]]


def no_signal_table(model, batches, fractions, rl, device):
    """Training time of the rollouts, fractions of the questions silenced, skipping their rows (chat_rl) and not (fp32)."""
    model.train()
    out = []
    for f in fractions:
        silent = round(f * len(batches))
        trial = [dataclasses.replace(b, advantages=torch.zeros_like(b.advantages)) if i < silent else b
                 for i, b in enumerate(batches)]
        out.append({"no_signal_fraction": silent / len(batches)})
        for key, skip in (("skip", True), ("all_rows", False)):
            t0 = device_time(device)
            trained = accumulate_policy_gradient(model, trial, rl.device_batch_size, len(trial), device,
                                                 autocast_context(device, torch.float32), skip_zero_advantage=skip)
            out[-1].update({f"{key}_seconds": device_time(device) - t0, f"{key}_rows_trained": trained.rows_trained})
            model.zero_grad(set_to_none=True)
    model.eval()
    return out


def main(argv):
    args = parse_args(argv)
    configs = validate_args(args)
    require(get_dist_info()[3] == 1, "bench_rl measures one process; run it with python -m scripts.bench_rl, not torchrun")
    _, _, _, _, device = compute_init(args.rl.device_type)
    try:
        graphs = ", ".join(c.name for c in configs or () if c.decode == "graph")
        require(device.type == "cuda" or not graphs, f"--configs names {graphs}, which replays CUDA graphs, and this run "
                f"is on {device.type} (torch sees no CUDA device, or --device-type chose another); measure the same step "
                "eagerly with a *_static config")
        return run(args, configs or default_configs(device, args.rl.compile), device)
    finally:
        compute_cleanup()


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
    _, budget = resolve_memory(rl, model, device, make_optimizers(rl, model), train_rows(rl, device.type), rl.rollout_dtype)
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
            r = results[config.name + suffix] = measure(model, rollout_model, initial_state, tokenizer, task, config, rl,
                                                        args, device, memory, peaks, bandwidth)
            compiled = f", compiled {r['compiles_each']} graphs (warm-up, steps)" if any(r["compiles_each"]) else ""
            print0(f"step {r['step_seconds']:.1f}s (rollout {r['rollout_seconds']:.1f}s, train {r['train_seconds']:.1f}s, "
                   f"optimizer {r['optimizer_seconds']:.1f}s{compiled})")
            atomic_write(args.output, json.dumps(report(), indent=2))  # a time limit keeps what finished
    mark_identical_tokens(results, configs)
    batches = {name: r.pop("batches") for name, r in results.items()}
    add_ratios(results)
    train_kernels = d20_train_step_kernels() if args.preset == "d20" and device.type != "cuda" else None  # on meta:
    model.load_state_dict(initial_state)
    if (fractions := [float(f) for f in args.no_signal_fractions.split(",") if f.strip()]) and "batched_fp32" in batches:
        skipping = no_signal_table(model, batches["batched_fp32"], fractions, rl, device)
    untrained = dict.fromkeys(("train_tokens_per_s", "train_tokens_per_s_x", "train_mfu"))  # no speed: no row trained
    shown = {name: r if r["rows_trained"] else {**r, **untrained} for name, r in results.items()}
    print0("\n" + "\n\n".join(text_table(shown.items(), columns) for columns in TABLES))
    if skipping:
        print0("\n" + text_table([(f"{r['no_signal_fraction']:.2f}", r) for r in skipping], [
            ("rows trained", "skip_rows_trained", "d"), ("train s (skip)", "skip_seconds", ".2f"),
            ("x of first", lambda r: r["skip_seconds"] / skipping[0]["skip_seconds"], ".2f"),
            ("train s (all rows)", "all_rows_seconds", ".2f")], first="no-signal"))
    atomic_write(args.output, json.dumps(report(), indent=2))
    print0(f"\nwrote {args.output} (memory: {memory.method})")
    if args.profile:  # where a step's time goes: the GPU's kernels against its waits on the host, and by torch op
        model.load_state_dict(initial_state)
        config = CONFIGS[args.profile]
        profile_run = bench_run(model, model, tokenizer, task, config, rl, device)
        split, text = profile_phases(lambda: bench_step(profile_run, config, args.force_advantages), device,
                                     ("rollout", "training"), args.profile_rows)
        print0(f"\nprofiled step of {config.name}: {text}")
        atomic_write(args.output, json.dumps({**report(), "profile_split": {config.name: split}}, indent=2))
    return report()


if __name__ == "__main__":
    run_main(main)
