"""
Benchmark of one chat_rl step, several ways, in one process, on the same model and the same questions.

One step of chat_rl at its default shape: --num-questions GSM8K train questions x --num-samples samples x up to
--max-new-tokens tokens, then the policy-gradient forward/backward in passes of --device-batch-size rows (forwards
of --train-rows rows: auto, 16 or --device-batch-size if larger; the baseline's of --device-batch-size, as nanochat's), then the Muon + AdamW
step. Configurations (--configs):
  baseline      nanochat-style: one question per engine call, `Engine.generate_batch(prompt,
                num_samples=device_batch_size)` repeated num_samples / device_batch_size times; fp32
  batched_fp32  chat_rl's rollouts (nanochat.rl.rollout): every question in one `Engine.generate_many` call; fp32
  batched_bf16  the same with rollouts and training under bf16 autocast (by default only where bf16 is native:
                a GPU, or a CPU with AVX512-BF16/AMX; elsewhere chat_rl computes in fp32, see compute_dtype)
  *_static      the same, decoding with the static step (bucketed shapes, run eagerly): tokens checked equal
                to the eager config's
  *_graph       the static step replayed from CUDA graphs (CUDA only): tokens checked equal to the static
                config's (same shapes, same kernels; on a GPU other shapes may round otherwise)
  *_compiled    the same with torch.compile (nanochat/model/compile.py): the training forward, and the static decode step
                where the config has one; compile seconds and graphs compiled are columns of their own, and with
                --repeat >= 2 the last step is the steady state (the first pays the compiles)
Each runs twice: as is ("full": a random-init model almost never ends a row, so rows run to the cap) and with
"+early": a wrapper ends every row at a geometric random length (mean --early-stop-mean), to show that finished
rows stop costing compute (the engine's row_steps against rows x longest row).

Per configuration: rollout tokens/s (completion tokens / rollout wall time, rewards and batch building
included), training tokens/s (every input position of the padded passes / forward+backward time), step time
(rollout + training + grad norm + optimizer step), FLOP/s and MFU against this machine's matmul peak for the
dtype (a 2048x2048 matmul timed at start), and peak memory (see PeakMemory). Every configuration starts from
the same weights and fresh optimizers, after an untimed warm-up on one question.

Launch (one process; the benchmark has no multi-GPU mode):
  python -m scripts.bench_rl                                   # CPU or 1 GPU: random-init d4, vocab 8192
  python -m scripts.bench_rl --depth=6 --output=bench_d6.json
  python -m scripts.bench_rl --source=sft                      # a trained checkpoint from $NANOCHAT_BASE_DIR
  python -m scripts.bench_rl --configs=batched_bf16 --profile=batched_bf16   # where rollout time goes
"""

import argparse
import cProfile
import ctypes
import dataclasses
import gc
import hashlib
import io
import json
import math
import os
import platform
import pstats
import re
import resource
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from nanochat.cli import (ArgumentParser, add_compile_flag, add_debug_flag, add_memory_budget_flag,
                          add_model_generation_flag, add_train_rows_flag, check_train_rows, run_main, train_rows)
from nanochat.common import (UserError, autocast_context, compute_cleanup, compute_init, cpu_bf16_kind,
                             cpu_has_native_bf16, cpu_name, dtype_name, get_base_dir, get_dist_info, grad_norm, print0,
                             require, synchronize)
from nanochat.engine.agreement import greedy_agreement
from nanochat.engine.decode_batch import static_step
from nanochat.engine.decode_weights import matmul_modules
from nanochat.engine.engine import STATIC_STEP_DYNAMIC, Engine
from nanochat.engine.kv_cache import cache_geometry
from nanochat.engine.memory_budget import resolve_memory_budget
from nanochat.engine.op_count import count_decode_step_ops
from nanochat.model.compile import CompileClock, compile_plan, generated_kernels, maybe_compiled
from nanochat.model.flops import matmul_flops_per_token, rollout_flops, train_flops
from nanochat.model.gpt import GPT, build_fresh_model
from nanochat.model.sampling import mix32
from nanochat.optim.optimizers import scale_initial_lr
from nanochat.rl.advantages import make_question_batch
from nanochat.rl.policy_gradient import accumulate_policy_gradient, chunk_logprobs
from nanochat.rl.rollout import Sampling, question_seed, sample_questions
from nanochat.tokenizer import Tokenizer
from tasks.gsm8k import GSM8K
from tasks.registry import make_task


@dataclass(frozen=True)
class BenchConfig:
    name: str
    batched: bool        # all questions in one generate_many call, else one generate_batch call per pass
    dtype: torch.dtype   # compute dtype (bf16 = autocast; weights stay fp32)
    lean: bool           # skip work that cannot change the gradient: prompts' KV stored once in decoding, each
                         # prompt computed once in training, zero-advantage rows not trained (chat_rl's way)
    decode: str = "eager"  # the engine's decode mode (nanochat.engine.engine.decode_mode); tokens are the same in each
    compiled: bool = False  # torch.compile the training forward and (static, graph) the decode step


CONFIGS = {c.name: c for c in (BenchConfig("baseline", False, torch.float32, False),
                                BenchConfig("batched_plain", True, torch.float32, False),
                                BenchConfig("batched_fp32", True, torch.float32, True),
                                BenchConfig("batched_fp32_static", True, torch.float32, True, "static"),
                                BenchConfig("batched_bf16", True, torch.bfloat16, True),
                                BenchConfig("batched_bf16_static", True, torch.bfloat16, True, "static"),
                                BenchConfig("batched_bf16_graph", True, torch.bfloat16, True, "graph"),
                                BenchConfig("batched_fp32_compiled", True, torch.float32, True, "eager", True),
                                BenchConfig("batched_fp32_static_compiled", True, torch.float32, True, "static", True),
                                BenchConfig("batched_bf16_compiled", True, torch.bfloat16, True, "eager", True),
                                BenchConfig("batched_bf16_static_compiled", True, torch.bfloat16, True, "static", True),
                                BenchConfig("batched_bf16_graph_compiled", True, torch.bfloat16, True, "graph", True))}
# nanochat's d20 of January 2026 (561M parameters), random weights: the shapes the GPU figures are quoted for
PRESETS = {"d20": dict(depth=20, vocab_size=65536, sequence_len=2048, window_pattern="SSSL")}
BENCH_STEP = 0           # the chat_rl step whose questions and seeds the benchmark uses
FORCED_END_LOGIT = 1e4   # beats any softcapped logit (|x| <= 15) plus Gumbel noise (< 20)


def parse_args(argv):
    p = ArgumentParser(description="Benchmark one chat_rl step: baseline vs batched fp32 vs batched bf16")
    # runtime
    p.add_argument("--device-type", type=str, default="", help="cuda|cpu|mps (empty = autodetect)")
    p.add_argument("--configs", type=str, default="",
                   help=f"comma-separated subset of {', '.join(CONFIGS)} (empty = all that run at speed on this device)")
    p.add_argument("--output", type=str, default="bench_rl.json", help="where to write every number as JSON")
    add_compile_flag(p)
    p.add_argument("--seed", type=int, default=42, help="seed of the random-init model")
    # model
    p.add_argument("--source", type=str, default="", help="empty = a random-init model of --depth; sft|rl = load that checkpoint")
    p.add_argument("--model-tag", type=str, default=None, help="with --source: model tag to load (default: the largest d<N>)")
    p.add_argument("--model-step", type=int, default=None, help="with --source: checkpoint step (default: the last one)")
    add_model_generation_flag(p)
    p.add_argument("--depth", type=int, default=4, help="layers of the random-init model (width 64 * depth, heads of 64)")
    p.add_argument("--vocab-size", type=int, default=8192,
                   help="vocabulary of the random-init model; its tokenizer is $NANOCHAT_BASE_DIR/tokenizer if that "
                        "has this size, else one trained on GSM8K train text (cached under $NANOCHAT_BASE_DIR/bench_rl)")
    p.add_argument("--sequence-len", type=int, default=1024, help="context length of the random-init model")
    p.add_argument("--window-pattern", type=str, default="L", help="sliding-window pattern of the random-init model")
    p.add_argument("--preset", type=str, default="", choices=("",) + tuple(PRESETS),
                   help="d20: the random-init model in nanochat's d20 shapes (depth 20, vocab 65536 (give "
                        "$NANOCHAT_BASE_DIR/tokenizer that size), sequence_len 2048, SSSL windows)")
    # the work (chat_rl's defaults)
    p.add_argument("--task", type=str, default="gsm8k",
                   help="questions and reward: gsm8k (with a random-init model: nothing is rewarded, rows run to the "
                        "cap), arithmetic (with the speedrun's trained model: mixed rewards, rows that end, tool calls), "
                        "or package.module:ClassName")
    p.add_argument("--no-signal-fractions", type=str, default="0,0.25,0.5,0.75,1",
                   help="training time of the batched_fp32 rollouts with these fractions of questions made no-signal "
                        "(all advantages 0), with and without skipping (empty = skip this table)")
    p.add_argument("--num-questions", type=int, default=16, help="questions in the step (chat_rl --examples-per-step)")
    p.add_argument("--num-samples", type=int, default=16, help="completions sampled per question")
    p.add_argument("--max-new-tokens", type=int, default=256, help="completion length cap in tokens")
    p.add_argument("--device-batch-size", type=int, default=8, help="rows per training pass (and per baseline engine call)")
    add_train_rows_flag(p)
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-k", type=int, default=50, help="top-k sampling (0 = whole vocabulary)")
    p.add_argument("--max-rows", type=int, default=0, help="batched configs: max rows decoded together (0 = memory budget)")
    add_memory_budget_flag(p)
    p.add_argument("--init-lr-frac", type=float, default=0.05, help="chat_rl's initial lr fraction (the optimizer step runs with it)")
    p.add_argument("--force-advantages", action="store_true",
                   help="give every row advantage +1 or -1 (alternating) after the rollouts, so that a random model's "
                        "full batch is trained (it earns no reward, so nothing would be)")
    p.add_argument("--repeat", type=int, default=1,
                   help="measured steps per config, one after another (times: the last one's, the steady state; "
                        "every step's in the JSON)")
    # measurement
    p.add_argument("--early-stop-mean", type=float, default=64.0,
                   help="mean completion length of the +early runs (0 = skip them)")
    p.add_argument("--peak-matmul-size", type=int, default=2048, help="n of the n x n matmul timed for the FLOP/s peak")
    p.add_argument("--profile", type=str, default="",
                   help="after the measurements, profile the rollout of this config (torch.profiler and cProfile)")
    p.add_argument("--profile-rows", type=int, default=25, help="rows of each profile table")
    add_debug_flag(p)
    return p.parse_args(argv)


def validate_args(args):
    for name, value in PRESETS.get(args.preset, {}).items():
        setattr(args, name, value)
    require(args.repeat >= 1, f"--repeat must be >= 1, got {args.repeat}")
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    require(not args.configs.strip() or (names and all(n in CONFIGS for n in names)),
            f"--configs={args.configs!r}: give a comma-separated subset of {', '.join(CONFIGS)}")
    require(len(set(names)) == len(names), f"--configs={args.configs!r} names a config twice")
    require(args.source in ("", "sft", "rl"), f"--source must be empty (random init), sft or rl, got {args.source!r}")
    require(args.source or (args.model_tag is None and args.model_step is None),
            "--model-tag/--model-step choose a checkpoint; pass --source=sft|rl with them")
    for name in ("depth", "vocab_size", "sequence_len", "num_questions", "num_samples", "max_new_tokens",
                 "device_batch_size", "peak_matmul_size", "profile_rows"):
        require(getattr(args, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    require(args.num_samples % args.device_batch_size == 0,
            f"--num-samples ({args.num_samples}) must be a multiple of --device-batch-size ({args.device_batch_size})")
    check_train_rows(args)
    require(args.temperature >= 0, f"--temperature must be >= 0, got {args.temperature}")
    require(args.top_k >= 0, f"--top-k must be >= 0, got {args.top_k}")
    require(args.max_rows >= 0, f"--max-rows must be >= 0, got {args.max_rows}")
    require(0 < args.init_lr_frac <= 1, f"--init-lr-frac must be in (0, 1], got {args.init_lr_frac}")
    require(args.early_stop_mean == 0 or args.early_stop_mean >= 1,
            f"--early-stop-mean must be >= 1 (a mean length in tokens) or 0 to skip the +early runs, got {args.early_stop_mean}")
    require(not args.profile or args.profile in CONFIGS, f"--profile must be one of {', '.join(CONFIGS)}, got {args.profile!r}")
    return [CONFIGS[n] for n in names] or None  # None: default_configs chooses for the device


def default_configs(device, compile_mode="auto"):
    """Every config that runs here at speed: CUDA graphs only on CUDA; no bf16 on a CPU without native bf16
    (there a bf16 matmul is ~100x slower than fp32, so measuring it would take hours, and chat_rl computes in
    fp32 on such a CPU anyway); compiled configs as --compile says: off none, on all, auto those whose
    compilation chat_rl's --compile=auto would choose here."""
    def compiles(c):  # everything the config compiles is what the plan compiles
        plan = compile_plan(compile_mode, device, c.decode)
        return plan.train and (plan.decode or c.decode == "eager")
    configs = [c for c in CONFIGS.values() if (c.decode != "graph" or device.type == "cuda")
               and (not c.compiled or compiles(c))]
    if device.type == "cpu" and not cpu_has_native_bf16():
        print0("note: no native bf16 on this CPU (no AVX512-BF16 or AMX): skipping batched_bf16 "
               "(chat_rl runs in fp32 here; --configs=batched_bf16 measures it anyway)")
        return [c for c in configs if c.dtype != torch.bfloat16]
    return configs


# -----------------------------------------------------------------------------
# Machine: matmul peak, memory, description


def memory_bandwidth(device, megabytes=512, reps=5):
    """Best bytes/s of copying a `megabytes` tensor on the device (read + write counted)."""
    src = torch.empty(megabytes * 2 ** 20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def matmul_peak_flops(device, dtype, size, reps=10, warmup=2):
    """Best FLOP/s of an n x n @ n x n matmul (2 n^3 FLOPs) over `reps` timed runs after `warmup` runs."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    for _ in range(warmup):
        a @ b
    synchronize(device)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * size ** 3 / best


def _proc_status_kb(field):
    match = re.search(rf"^{field}:\s+(\d+) kB", open("/proc/self/status").read(), re.MULTILINE)
    return int(match.group(1)) if match else None


class PeakMemory:
    """Peak memory over a stretch of work, resettable between configurations.

    CUDA: the caching allocator's peak (torch.cuda.max_memory_allocated). Elsewhere the peak resident set:
    on Linux VmHWM from /proc/self/status, whose peak is reset to the current RSS by writing "5" to
    /proc/self/clear_refs; glibc's malloc_trim first returns the previous configuration's freed heap to the
    OS, so the peak is this configuration's working set plus what stays resident (weights, data, imports).
    Without clear_refs (macOS, locked-down kernels) it is ru_maxrss: the peak since the process started.
    torch's CPU allocations bypass Python's allocator, so tracemalloc cannot see them."""

    def __init__(self, device):
        self.device = device
        self._trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if platform.system() == "Linux" else None
        if device.type == "cuda":
            self.method = "torch.cuda.max_memory_allocated, reset per config"
        elif self._can_reset_rss():
            self.method = ("peak RSS (VmHWM), reset per config via /proc/self/clear_refs"
                           + (" after malloc_trim" if self._trim else ""))
        else:
            self.method = "ru_maxrss: peak RSS since process start (this OS cannot reset it)"

    def _can_reset_rss(self):
        if not os.path.exists("/proc/self/status") or _proc_status_kb("VmHWM") is None:
            return False
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return False
        return True

    def reset(self):
        """Start a new peak; returns the memory in use now, in MB."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device) / 2 ** 20
        if self.method.startswith("peak RSS"):
            if self._trim:
                self._trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _proc_status_kb("VmRSS") / 1024
        return self.peak_mb()

    def peak_mb(self):
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2 ** 20
        if self.method.startswith("peak RSS"):
            return _proc_status_kb("VmHWM") / 1024
        scale = 1 if platform.system() == "Darwin" else 1024  # ru_maxrss is bytes on macOS, KB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2 ** 20


def machine_info(device):
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "cpu": cpu_name(),
            "cpu_bf16": cpu_bf16_kind(),
            "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "platform": platform.platform(), "python": platform.python_version()}


def load_average():
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


# -----------------------------------------------------------------------------
# Model, tokenizer, questions


def bench_tokenizer(vocab_size, task):
    """$NANOCHAT_BASE_DIR/tokenizer if it has vocab_size tokens, else a BPE trained on the GSM8K train text
    (cached per vocab size and text, since the same one is wanted run after run)."""
    base = get_base_dir()
    standard = os.path.join(base, "tokenizer")
    if os.path.isfile(os.path.join(standard, "tokenizer.pkl")):
        tokenizer = Tokenizer.from_directory(standard)
        if tokenizer.get_vocab_size() == vocab_size:
            return tokenizer, standard
        print0(f"{standard} has {tokenizer.get_vocab_size()} tokens, not --vocab-size={vocab_size}; using a GSM8K-trained one")
    texts = [row["question"] + "\n" + row["answer"] for row in task.rows]
    digest = hashlib.sha1("\0".join(texts).encode("utf-8")).hexdigest()[:12]
    cached = os.path.join(base, "bench_rl", f"tokenizer_v{vocab_size}_{digest}")
    if os.path.isfile(os.path.join(cached, "tokenizer.pkl")):
        return Tokenizer.from_directory(cached), cached
    tokenizer = Tokenizer.train_from_iterator(iter(texts), vocab_size)
    if tokenizer.get_vocab_size() != vocab_size:
        raise UserError(f"the GSM8K train text only supports a {tokenizer.get_vocab_size()}-token BPE; "
                        f"pass --vocab-size={tokenizer.get_vocab_size()} or less")
    tokenizer.save(cached)
    return tokenizer, cached


def build_bench_model(args, device):
    """(model in eval mode, tokenizer, description dict). A random-init model gets a tokenizer trained on
    GSM8K train text (see bench_tokenizer)."""
    if args.source:
        from nanochat.checkpoints.loading import load_model
        model, tokenizer, meta = load_model(args.source, device, phase="eval", model_tag=args.model_tag, step=args.model_step,
                                            generation=args.model_generation)
        return model, tokenizer, {"source": args.source, "model_tag": args.model_tag, "step": meta.get("step")}
    tokenizer, tokenizer_dir = bench_tokenizer(args.vocab_size, GSM8K(split="train"))
    torch.manual_seed(args.seed)
    model = build_fresh_model(args.depth, args.sequence_len, args.vocab_size, device, args.window_pattern)
    return model.eval(), tokenizer, {"source": "random init", "tokenizer": tokenizer_dir}


class EarlyStopModel(nn.Module):
    """A GPT whose decode forwards end rows at random lengths, without touching the engine.

    The engine moves rows between batch slots, so a row cannot be told by its slot. Instead, after a row's
    input token x at position p, <|assistant_end|> is forced when hash(x, p) < 2**32 / mean_length: each
    decode step ends a row with probability 1 / mean_length, so completions have geometric lengths (at least
    one token), the same way in every configuration. Prefills are left alone: all samples of a prompt share
    the prefill's logits, so a stop there would end them all together. Uncached forwards (training) are the
    inner model's, untouched."""

    def __init__(self, model, end_token, mean_length):
        super().__init__()
        self.model = model
        self.config = model.config
        self.end_token = end_token
        self.threshold = round(2 ** 32 / mean_length)

    def get_device(self):
        return self.model.get_device()

    def ends(self, tokens, positions):
        """tokens, positions: (B,) int64 -> (B,) bool: does the row end after this input."""
        return mix32(mix32(tokens) ^ mix32(positions + 0x5BD1E995)) < self.threshold

    def forward(self, idx, cache_step=None, **kwargs):
        if cache_step is None or idx.size(1) != 1:  # training, or a prefill
            return self.model(idx, cache_step=cache_step, **kwargs)
        logits = self.model(idx, cache_step=cache_step, **kwargs)  # (B, 1, V) float32
        positions = cache_step.positions[:, 0]  # (B,)
        end = logits[:, 0, self.end_token]
        logits[:, 0, self.end_token] = torch.where(self.ends(idx[:, 0], positions), FORCED_END_LOGIT, end)
        return logits


# -----------------------------------------------------------------------------
# One RL step, measured


def row_steps_of(tokens, max_tokens):
    """Engine steps a completion took: its tokens, plus the terminal token if it ended before the cap
    (a row is cut only when it reaches max_tokens; ending at the last step leaves max_tokens - 1 tokens)."""
    return len(tokens) + (len(tokens) < max_tokens)


def baseline_rollouts(engine, task, indices, args):
    """nanochat's rollout loop: per question, num_samples / device_batch_size generate_batch calls of
    device_batch_size rows. Returns (batches, [(prompt_len, num_prefills, row steps)], engine work)."""
    tokenizer = engine.tokenizer
    pad = tokenizer.encode_special("<|assistant_end|>")
    batches, rows = [], []
    work = {"prefill_tokens": 0, "decode_forwards": 0, "row_steps": 0, "rows_x_longest": 0, "kv_positions_read": 0,
            "max_batch_rows": 0}
    passes = args.num_samples // args.device_batch_size
    for i in indices:
        conversation = task[i]
        prompt = tokenizer.render_for_completion(conversation)
        completions = []
        for j in range(passes):
            seqs, masks = engine.generate_batch(prompt, num_samples=args.device_batch_size, max_tokens=args.max_new_tokens,
                                                temperature=args.temperature, top_k=args.top_k or None,
                                                seed=hash((BENCH_STEP, i, j)) & 0x7FFFFFFF)
            call = [(s[len(prompt):], m[len(prompt):]) for s, m in zip(seqs, masks)]
            completions += call
            stats = engine.last_stats
            work["prefill_tokens"] += stats.prefill_tokens
            work["decode_forwards"] += stats.decode_forwards
            work["row_steps"] += stats.row_steps
            work["kv_positions_read"] += stats.kv_positions_read
            work["max_batch_rows"] = max(work["max_batch_rows"], stats.max_batch_rows)
            # without compaction every row of the call would be decoded until the call's longest row ends
            work["rows_x_longest"] += len(call) * max(row_steps_of(t, args.max_new_tokens) - 1 for t, _ in call)
        rewards = [task.reward(conversation, tokenizer.decode(t)) for t, _ in completions]
        batches.append(make_question_batch(prompt, completions, rewards, pad))
        rows.append((len(prompt), passes, [row_steps_of(t, args.max_new_tokens) for t, _ in completions]))
    return batches, rows, work


def batched_rollouts(engine, task, indices, args):
    """chat_rl's rollouts (nanochat.rl.rollout: one generate_many call for all questions), with the same outputs as
    baseline_rollouts."""
    sampling = Sampling(num_samples=args.num_samples, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k)
    rollouts = sample_questions(engine, task, indices, [question_seed(BENCH_STEP, i) for i in indices], sampling)
    batches, results = [r.batch for r in rollouts], [r.completions for r in rollouts]
    tokenizer, stats = engine.tokenizer, engine.last_stats
    rows = [(len(tokenizer.render_for_completion(task[i])), 1, [row_steps_of(c.tokens, args.max_new_tokens) for c in cs])
            for i, cs in zip(indices, results)]
    longest = max(s for _, _, steps in rows for s in steps) - 1
    work = {"prefill_tokens": stats.prefill_tokens, "decode_forwards": stats.decode_forwards, "row_steps": stats.row_steps,
            "rows_x_longest": sum(len(steps) for _, _, steps in rows) * longest, "kv_positions_read": stats.kv_positions_read,
            "max_batch_rows": stats.max_batch_rows}
    return batches, rows, work


def bench_engine(rollout_model, tokenizer, config, args):
    """The engine of a configuration, as chat_rl makes it (one per run: a kept static batch and its graphs serve
    the next rollouts)."""
    return Engine(rollout_model, tokenizer, max_rows=(args.max_rows or None) if config.batched else None,
                  memory_budget_gb=args.memory_budget_gb, share_prompts=config.lean, decode=config.decode,
                  compile="on" if config.compiled else "off")


def rl_step(model, engine, optimizers, task, indices, config, args, device):
    """One chat_rl step (rollouts, forward/backward, grad norm, optimizer step), timed by phase."""
    autocast = autocast_context(device, config.dtype)
    compile_clock = CompileClock()
    synchronize(device)
    t0 = time.perf_counter()
    model.eval()
    with autocast:
        rollouts = batched_rollouts if config.batched else baseline_rollouts
        batches, rows, work = rollouts(engine, task, indices, args)
    synchronize(device)
    t1 = time.perf_counter()
    work["tokens_digest"] = hashlib.sha1(repr([b.inputs.tolist() for b in batches]).encode()).hexdigest()[:16]
    if args.force_advantages:
        batches = [dataclasses.replace(b, advantages=torch.tensor([1.0 - 2 * (r % 2) for r in range(len(b.advantages))],
                                                                  device=b.advantages.device, dtype=b.advantages.dtype))
                   for b in batches]
    model.train()
    trained = accumulate_policy_gradient(model, batches, args.device_batch_size, len(indices), device, autocast,
                                         micro_batch_rows=train_rows(args) if config.batched else args.device_batch_size,
                                         share_prompt=config.lean,
                                         skip_zero_advantage=config.lean,
                                         forward=maybe_compiled(chunk_logprobs, config.compiled, dynamic=True, required=True))
    synchronize(device)
    t2 = time.perf_counter()
    grad_norm(model)
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    synchronize(device)
    t3 = time.perf_counter()
    compiles, compile_seconds = compile_clock.lap()
    return {"compiles": compiles, "compile_seconds": compile_seconds,
            "rollout_seconds": t1 - t0, "train_seconds": t2 - t1, "optimizer_seconds": t3 - t2, "step_seconds": t3 - t0,
            "captures": engine.last_stats.captures,
            "rows_trained": trained.rows_trained, "rows_skipped": trained.rows_total - trained.rows_trained,
            "sampler_tokens": trained.sampler_tokens, "sampler_gap_mean": trained.sampler_gap_mean,
            "sampler_gap_max": trained.sampler_gap_max, "sampler_k3": trained.sampler_k3,
            "batches": batches, "rows": rows, "work": work}


def decode_op_counts(model, config, work, args):
    """aten ops and kernels of one static decode step at this run's largest shape (the rows it decoded at once,
    max_new_tokens keys), counted on the meta device (the same on any machine; nanochat.engine.op_count)."""
    with torch.device("meta"):
        twin = GPT(model.config, model.generation)
    count = count_decode_step_ops(twin, max(work["max_batch_rows"], 1), args.max_new_tokens, share_prompts=config.lean,
                                  num_samples=args.num_samples)
    return {"decode_step_ops": count.ops, "decode_step_kernels": count.kernels,
            "decode_step_ops_per_layer": count.ops_per_block, "decode_step_kernels_per_layer": count.kernels_per_block}


def largest_new_graph(graphs_before):
    """The kernels of the largest graph of the static decode step compiled since the process had `graphs_before`
    of them (this config's: another dtype or decode mode compiles its own), else of any (this config reused
    graphs an earlier one compiled)."""
    kernels = generated_kernels(static_step, STATIC_STEP_DYNAMIC)
    return max(kernels[graphs_before:] or kernels, default=0)


def fresh_optimizers(model, init_lr_frac):
    """chat_rl's optimizers at step 0 (the lr multiplier is 1 there)."""
    return scale_initial_lr(model.setup_optimizers(ortho_dtype=torch.float32), init_lr_frac)


def measure(model, initial_state, tokenizer, task, indices, config, early_stop_mean, args, device, memory, peaks, bandwidth):
    """Run one configuration from the initial weights: an untimed warm-up, then the measured step (--repeat of
    them, one after another). The figures are the last step's, the steady state chat_rl runs in: the first also
    pays what a run pays once (graph captures, compiles, a GPU's first use of each kernel and shape; on an H200
    the first step's rollout took 10.0 s with 128 captures, the next ones 2.1 s). Every step's times are in the
    *_each lists. The tokens compared between configs are the first step's: every config starts it from the same
    weights (the later ones sample from weights it trained)."""
    model.load_state_dict(initial_state)
    rollout_model = model
    if early_stop_mean:
        rollout_model = EarlyStopModel(model, tokenizer.encode_special("<|assistant_end|>"), early_stop_mean)
    optimizers = fresh_optimizers(model, args.init_lr_frac)
    decode_graphs_before = len(generated_kernels(static_step, STATIC_STEP_DYNAMIC))  # earlier configs' graphs
    # warm-up: kernels and allocator pools for this dtype, one question, a few tokens, no optimizer step
    warm = argparse.Namespace(**{**vars(args), "num_samples": args.device_batch_size, "max_new_tokens": min(4, args.max_new_tokens)})
    warm_up = rl_step(model, bench_engine(rollout_model, tokenizer, config, warm), [], task, indices[:1], config, warm,
                      device)
    model.load_state_dict(initial_state)

    resident_mb = memory.reset()
    engine = bench_engine(rollout_model, tokenizer, config, args)  # one for every repeat, as chat_rl keeps one
    runs = [rl_step(model, engine, optimizers, task, indices, config, args, device) for _ in range(args.repeat)]
    del engine
    peak_mb = memory.peak_mb()
    del optimizers

    first_tokens = runs[0]["work"]["tokens_digest"]
    m = runs[-1]
    batches, rows, work = m["batches"], m.pop("rows"), m.pop("work")
    work["tokens_digest"] = first_tokens
    kv_bytes = cache_geometry(model).bytes_per_token(config.dtype) * work["kv_positions_read"]
    peak = peaks[dtype_name(config.dtype)]
    # the decode step's roofline: every matmul weight read once in the compute dtype (bf16: the engine's
    # DecodeWeights), plus the keys/values read; embeddings are looked up, a few rows per step
    decode_ms = 1000 * m["rollout_seconds"] / max(work["decode_forwards"], 1)
    element_size = torch.tensor([], dtype=config.dtype).element_size()
    weight_bytes = element_size * sum(linear.weight.numel() for linear in matmul_modules(model))
    step_bytes = weight_bytes + kv_bytes / max(work["decode_forwards"], 1)
    bound_ms = 1000 * step_bytes / bandwidth
    r_tokens = sum(n for b in batches for n in b.completion_lengths)
    r_flops = sum(rollout_flops(model, plen, prefills, steps) for plen, prefills, steps in rows)
    t_tokens, t_flops = sum(b.inputs.numel() for b in batches), train_flops(model, batches)
    return {**m,
            "rollout_tokens": r_tokens, "rollout_tokens_per_s": r_tokens / m["rollout_seconds"],
            "rollout_flops": r_flops, "rollout_flops_per_s": r_flops / m["rollout_seconds"],
            "rollout_mfu": r_flops / m["rollout_seconds"] / peak,
            "train_tokens": t_tokens, "train_tokens_per_s": t_tokens / m["train_seconds"],
            "train_flops": t_flops, "train_flops_per_s": t_flops / m["train_seconds"],
            "train_mfu": t_flops / m["train_seconds"] / peak,
            "rows": sum(len(steps) for _, _, steps in rows), **work,
            "kv_bytes_per_decoded_token": kv_bytes / max(work["row_steps"], 1),
            "decode_ms_per_step": decode_ms, "decode_weight_bytes": weight_bytes, "bytes_per_decode_step": step_bytes,
            "bandwidth_bound_ms": bound_ms,
            "decode_x_bound": decode_ms / bound_ms,
            "rollout_seconds_each": [r["rollout_seconds"] for r in runs],
            "captures_each": [r["captures"] for r in runs],
            # the warm-up's compiles first (its one question compiles the training forward, dynamic in every length)
            "compiles_each": [warm_up["compiles"]] + [r["compiles"] for r in runs],
            "compile_seconds_each": [warm_up["compile_seconds"]] + [r["compile_seconds"] for r in runs],
            "step_seconds_each": [r["step_seconds"] for r in runs], "train_seconds_each": [r["train_seconds"] for r in runs],
            **decode_op_counts(model, config, work, args),
            # the compiled static step: the fused kernels of its largest graph (a step launches each once, plus the
            # matmul and attention library calls), against decode_step_kernels of the eager step
            "decode_step_inductor_kernels": (largest_new_graph(decode_graphs_before)
                                             if config.compiled and config.decode != "eager" else None),
            "resident_mb_at_start": resident_mb, "peak_memory_mb": peak_mb}


def mark_identical_tokens(results, configs):
    """A config decoding in another mode than eager, or compiled, records whether its rollouts' tokens equal those
    of its twin of the same dtype and work: a compiled one's is the same config uncompiled (on a CPU in fp32 the
    same tokens are expected; elsewhere a near-tie may go the other way); a graph config's is the static one (the
    shapes it replays, run eagerly: on a GPU only the same shapes are sure to run the same kernels), a static one's
    is eager (there the shapes differ, so equality holds where kernels round alike for any batch: checked on
    CPU)."""
    by_name = {c.name: c for c in configs}
    for name, r in results.items():
        base_name, _, suffix = name.partition("+")
        config = by_name[base_name]
        if config.decode == "eager" and not config.compiled:
            continue
        same_work = [c for c in configs if (c.batched, c.dtype, c.lean) == (config.batched, config.dtype, config.lean)
                     and not c.compiled]
        modes = (config.decode,) if config.compiled else ("static", "eager") if config.decode == "graph" else ("eager",)
        twins = [c.name for mode in modes for c in same_work if c.decode == mode]
        twin_name = twins[0] + ("+" + suffix if suffix else "") if twins else None
        other = results.get(twin_name) if twin_name else None
        r["tokens_identical_to"] = (twin_name, other["tokens_digest"] == r["tokens_digest"]) if other else None


def add_ratios(results):
    """Each run against the baseline of its variant: throughput ratios and step-time speedup (> 1 = faster)."""
    for name, r in results.items():
        base = results.get("baseline" + ("+early" if name.endswith("+early") else ""))
        if base is not None:
            # None when the baseline did no such work (every row ended at once): there is nothing to compare
            r["rollout_tokens_per_s_x"] = _ratio(r["rollout_tokens_per_s"], base["rollout_tokens_per_s"])
            r["train_tokens_per_s_x"] = _ratio(r["train_tokens_per_s"], base["train_tokens_per_s"])
            r["step_speedup_x"] = _ratio(base["step_seconds"], r["step_seconds"])


def _ratio(a, b):
    return a / b if b > 0 else None


def format_table(results):
    def ratio(r, key):
        return f"{r[key]:6.2f}" if r.get(key) is not None else "     -"
    lines = [f"{'config':<26} {'roll tok/s':>10} {'x':>6} {'train tok/s':>11} {'x':>6} {'roll MFU':>8} {'train MFU':>9} "
             f"{'step s':>8} {'speedup':>7} {'peak MB':>8}"]
    for name, r in results.items():
        # training throughput counts every row's tokens (the work a plain step does); with no row trained
        # (every question without signal) there is no training speed to show
        if r["rows_trained"]:
            train = (f"{r['train_tokens_per_s']:11.1f} {ratio(r, 'train_tokens_per_s_x')} {100 * r['rollout_mfu']:7.2f}% "
                     f"{100 * r['train_mfu']:8.2f}%")
        else:
            train = f"{'-':>11} {'-':>6} {100 * r['rollout_mfu']:7.2f}% {'-':>9}"
        lines.append(f"{name:<26} {r['rollout_tokens_per_s']:10.1f} {ratio(r, 'rollout_tokens_per_s_x')} "
                     f"{train} {r['step_seconds']:8.2f} {ratio(r, 'step_speedup_x'):>7} {r['peak_memory_mb']:8.0f}")
    lines.append("")
    lines.append(f"{'config':<26} {'tokens':>7} {'rows':>5} {'row_steps':>9} {'rows x longest':>14} "
                 f"{'rollout s':>9} {'train s':>8} {'optim s':>8} {'trained':>7} {'skipped':>7} {'KV B/token':>10}")
    for name, r in results.items():
        lines.append(f"{name:<26} {r['rollout_tokens']:7d} {r['rows']:5d} {r['row_steps']:9d} {r['rows_x_longest']:14d} "
                     f"{r['rollout_seconds']:9.2f} {r['train_seconds']:8.2f} {r['optimizer_seconds']:8.2f} "
                     f"{r['rows_trained']:7d} {r['rows_skipped']:7d} {r['kv_bytes_per_decoded_token']:10.0f}")
    lines.append("")
    lines.append(f"{'config':<26} {'decode ms/step':>14} {'MB/step':>8} {'bound ms':>8} {'x bound':>7} "
                 f"{'rollout s first..last':>21} {'captures':>9} {'ops/kernels':>11} {'gap mean/max':>17} {'tokens':>24}")
    for name, r in results.items():
        each = r["rollout_seconds_each"]
        same = r.get("tokens_identical_to")
        tokens = "" if same is None else f"{'=' if same[1] else 'DIFFER from'} {same[0]}"
        # the sampler-trainer gap of the trained tokens (none trained: nothing measured)
        gap = f"{r['sampler_gap_mean']:.1e}/{r['sampler_gap_max']:.1e}" if r["sampler_tokens"] else "-"
        lines.append(f"{name:<26} {r['decode_ms_per_step']:14.2f} {r['bytes_per_decode_step'] / 2 ** 20:8.1f} "
                     f"{r['bandwidth_bound_ms']:8.3f} {r['decode_x_bound']:7.1f} {f'{each[0]:.2f}..{each[-1]:.2f}':>21} "
                     f"{'/'.join(map(str, r['captures_each'])):>9} "
                     f"{str(r['decode_step_ops']) + '/' + str(r['decode_step_kernels']):>11} {gap:>17} {tokens:>24}")
    if any(r["compiles_each"] != [0] * len(r["compiles_each"]) for r in results.values()):
        lines.append("")
        lines.append(f"{'config':<26} {'compiles warm-up/steps':>22} {'compile s':>22} {'step s first..last':>19} "
                     f"{'rollout s first..last':>21} {'train s first..last':>20} {'decode kernels':>14}")
        span = lambda values: f"{values[0]:.2f}..{values[-1]:.2f}"
        for name, r in results.items():
            # the compiled decode step's Inductor kernels (besides library matmuls); eager: the meta count's kernels
            kernels = r.get("decode_step_inductor_kernels")
            kernels = f"{kernels} fused" if kernels is not None else f"{r['decode_step_kernels']} eager"
            lines.append(f"{name:<26} {'/'.join(map(str, r['compiles_each'])):>22} "
                         f"{'/'.join(f'{s:.1f}' for s in r['compile_seconds_each']):>22} "
                         f"{span(r['step_seconds_each']):>19} {span(r['rollout_seconds_each']):>21} "
                         f"{span(r['train_seconds_each']):>20} {kernels:>14}")
    return "\n".join(lines)


def no_signal_table(model, batches, fractions, args, device):
    """Training time of the same rollouts when a fraction f of the questions has no signal (their advantages
    set to 0, as when every sample of a question got the same reward): with skipping (chat_rl) the time should
    fall like the fraction of rows left to train; without (nanochat) it stays. fp32, prompts shared in both."""
    autocast = autocast_context(device, torch.float32)
    model.train()
    out = []
    for f in fractions:
        silent = round(f * len(batches))
        trial = [dataclasses.replace(b, advantages=torch.zeros_like(b.advantages)) if i < silent else b
                 for i, b in enumerate(batches)]
        row = {"no_signal_fraction": silent / len(batches)}
        for key, skip in (("skip", True), ("all_rows", False)):
            synchronize(device)
            t0 = time.perf_counter()
            trained = accumulate_policy_gradient(model, trial, args.device_batch_size, len(trial), device, autocast,
                                                 skip_zero_advantage=skip)
            synchronize(device)
            row[f"{key}_seconds"] = time.perf_counter() - t0
            row[f"{key}_rows_trained"] = trained.rows_trained
            model.zero_grad(set_to_none=True)
        out.append(row)
    model.eval()
    return out


def format_no_signal_table(rows):
    top = rows[0]
    lines = [f"{'no-signal':>9} {'rows trained':>12} {'train s (skip)':>14} {'x of first':>10} {'train s (all rows)':>18}"]
    for r in rows:
        lines.append(f"{r['no_signal_fraction']:9.2f} {r['skip_rows_trained']:12d} {r['skip_seconds']:14.2f} "
                     f"{r['skip_seconds'] / top['skip_seconds']:10.2f} {r['all_rows_seconds']:18.2f}")
    return "\n".join(lines)


def bf16_agreement(model, tokenizer, prompts, max_tokens, device):
    """How far bf16 rollouts follow fp32 ones under greedy decoding, on the same prompts (nanochat/engine/agreement.py's
    greedy_agreement: bf16 rounding should only flip near-ties). Both decodes run through the engine (the bf16 one
    under autocast, with a bf16 KV cache)."""
    engine = Engine(model, tokenizer)
    fp32 = engine.generate_many(prompts, num_samples=1, max_tokens=max_tokens, temperature=0.0)
    with torch.amp.autocast(device_type=device.type, dtype=torch.bfloat16):
        bf16 = engine.generate_many(prompts, num_samples=1, max_tokens=max_tokens, temperature=0.0)
    ends = [tokenizer.encode_special(t) for t in ("<|assistant_end|>", "<|bos|>")]
    return greedy_agreement(model, prompts, [a.tokens for a, in fp32], [b.tokens for b, in bf16], ends)


def profile_rollout(model, tokenizer, task, indices, config, args, device):
    """Print where one rollout of `config` spends its time: torch ops (torch.profiler), then Python functions
    (cProfile). Two separate runs, so neither profiler's overhead shows in the other's table."""
    engine = bench_engine(model, tokenizer, config, args)
    rollouts = batched_rollouts if config.batched else baseline_rollouts

    def run():
        with autocast_context(device, config.dtype):
            rollouts(engine, task, indices, args)

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        run()
    print0(f"\ntorch.profiler, rollout of {config.name} (self time per op):")
    print0(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.profile_rows)
    print0(f"cProfile, rollout of {config.name} (sorted by own time):")
    print0(out.getvalue())


def main(argv):
    args = parse_args(argv)
    configs = validate_args(args)
    if get_dist_info()[3] > 1:
        raise UserError("bench_rl measures one process; run it with python -m scripts.bench_rl, not torchrun")
    _, _, _, _, device = compute_init(args.device_type)
    try:
        graphs = [c.name for c in configs or () if c.decode == "graph"]
        require(device.type == "cuda" or not graphs,
                f"--configs names {', '.join(graphs)}, which replays CUDA graphs, and this run is on {device.type} (torch sees no "
                f"CUDA device, or --device-type chose another); measure the same step eagerly with a *_static config")
        return run(args, configs or default_configs(device, args.compile), device)
    finally:
        compute_cleanup()


def run(args, configs, device):
    load_before = load_average()
    info = machine_info(device)
    print0(f"torch {info['torch']}, {info['threads']} threads, {info['cpu']}, load average {load_before}")
    dtypes = sorted({dtype_name(c.dtype) for c in configs}, reverse=True)  # float32 first
    peaks = {name: matmul_peak_flops(device, getattr(torch, name), args.peak_matmul_size) for name in dtypes}
    print0(f"matmul peak ({args.peak_matmul_size}^2): " + ", ".join(f"{n} {p / 1e12:.3f} TFLOP/s" for n, p in peaks.items()))
    bandwidth = memory_bandwidth(device)
    print0(f"memory bandwidth (device copy): {bandwidth / 1e9:.1f} GB/s")

    task = make_task(args.task, "train")
    if args.num_questions > len(task):
        raise UserError(f"--num-questions={args.num_questions} but the {args.task} train split has {len(task)} questions")
    indices = list(range(args.num_questions))  # chat_rl's step 0 on one rank
    model, tokenizer, model_info = build_bench_model(args, device)
    cfg = model.config
    model_info.update(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, vocab_size=cfg.vocab_size,
                      sequence_len=cfg.sequence_len, num_params=model.num_params(),
                      matmul_flops_per_token=matmul_flops_per_token(model))
    print0(f"model: {model_info}")
    initial_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    memory = PeakMemory(device)
    # once, for every config (bf16's decode weights reserved: the larger case), as chat_rl sizes its run
    args.memory_budget_gb, budget_line = resolve_memory_budget(
        args.memory_budget_gb, model, device, fresh_optimizers(model, args.init_lr_frac), rows=train_rows(args),
        completion_tokens=args.max_new_tokens, prompt_tokens=cfg.sequence_len)
    print0(budget_line or f"KV cache budget: {args.memory_budget_gb:g} GiB (--memory-budget-gb)")

    variants = [("", 0)] + ([("+early", args.early_stop_mean)] if args.early_stop_mean else [])
    results = {}
    for suffix, mean_length in variants:
        for config in configs:
            name = config.name + suffix
            print0(f"running {name} ...", end=" ")
            results[name] = measure(model, initial_state, tokenizer, task, indices, config, mean_length, args, device,
                                    memory, peaks, bandwidth)
            r = results[name]
            print0(f"step {r['step_seconds']:.1f}s (rollout {r['rollout_seconds']:.1f}s, train {r['train_seconds']:.1f}s, "
                   f"optimizer {r['optimizer_seconds']:.1f}s)")
    mark_identical_tokens(results, configs)
    lean_batches = results.get("batched_fp32", {}).get("batches")
    for r in results.values():
        r.pop("batches")
    add_ratios(results)
    model.load_state_dict(initial_state)
    skipping = None
    if args.no_signal_fractions.strip() and lean_batches:
        fractions = [float(f) for f in args.no_signal_fractions.split(",")]
        skipping = no_signal_table(model, lean_batches, fractions, args, device)
    agreement = None
    if any(c.dtype == torch.bfloat16 for c in configs):
        prompts = [tokenizer.render_for_completion(task[i]) for i in indices]
        agreement = bf16_agreement(model, tokenizer, prompts, args.max_new_tokens, device)
    print0()
    print0(format_table(results))
    if agreement:
        print0(f"\ngreedy bf16 vs fp32 on the {agreement['rows']} questions: {agreement['identical_rows']} identical rows, "
               f"{100 * agreement['agreement']:.1f}% of fp32 tokens before the first difference"
               + (f", largest fp32 logit margin at a difference {max(map(abs, agreement['fp32_margins_at_differences'])):.3f}"
                  if agreement['fp32_margins_at_differences'] else ""))

    if skipping:
        print0("\n" + format_no_signal_table(skipping))
    report = {"machine": {**info, "load_average_before": load_before, "load_average_after": load_average()},
              "settings": vars(args), "model": model_info, "peak_flops": peaks, "memory_bandwidth": bandwidth,
              "memory_method": memory.method,
              "results": results, "greedy_bf16_vs_fp32": agreement, "no_signal_training": skipping}
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print0(f"\nwrote {args.output} (memory: {memory.method})")

    if args.profile:
        model.load_state_dict(initial_state)
        profile_rollout(model, tokenizer, task, indices, CONFIGS[args.profile], args, device)
    return report


if __name__ == "__main__":
    run_main(main)
