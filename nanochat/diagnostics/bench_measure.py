"""
Measuring one of bench_rl's configurations (bench_configs.py): chat_rl's RLRun built in its dtype and decode mode
(bench_run), one step of it timed on the device (bench_step: the rollouts, chat_rl's or nanochat's, step_rollouts; the
engine's work they did, engine_work; then train_on_rollouts, its optimizer steps timed apart), and measure: a warm-up
then --repeat steps, with the figures derived from them (throughput, MFU, the decode step's roofline and op counts).
And no_signal_table: the training of a step's rollouts timed again with fractions of its questions silenced.
"""

import copy
import dataclasses
import hashlib

import torch

from nanochat.compiling.plan import compile_block_regions
from nanochat.diagnostics.early_stop import EarlyStopEngine, EarlyStopModel
from nanochat.diagnostics.op_count import compiled_step_graphs, compiled_step_kernels, count_decode_step_ops
from nanochat.engine.decode_weights import matmul_modules
from nanochat.engine.engine import Engine
from nanochat.engine.variants.flex_prompt_attention import flex_compile_state
from nanochat.engine.kv_cache import cache_geometry
from nanochat.engine.spec import rollout_spec
from nanochat.model.flops import rollout_flops, train_flops
from nanochat.model.gpt import GPT
from nanochat.rl.advantages import make_question_batch
from nanochat.rl.plan import RunPlan, train_rows
from nanochat.rl.policy_gradient import accumulate_policy_gradient
from nanochat.rl.rollout import QuestionRollout, longest_prompt, step_question_indices
from nanochat.rl.run import build_run, count_bad_step, make_optimizers, sample_rollouts, train_on_rollouts
from nanochat.runtime.dtypes import autocast_context, dtype_name
from nanochat.runtime.machine import device_time

BENCH_STEP = 0           # the chat_rl step whose questions and seeds the benchmark uses
ENGINE_WORK = ("prefill_tokens", "decode_forwards", "row_steps", "kv_positions_read")  # Engine.last_stats, summed


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
            seqs, masks = engine.generate_batch(prompt, num_samples=cfg.device_batch_size, max_tokens=cfg.max_new_tokens,
                                                temperature=cfg.temperature, top_k=cfg.top_k or None,
                                                seed=hash((BENCH_STEP, i, j)) & 0x7FFFFFFF)  # in the run's rollout dtype
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
    """chat_rl's RLRun (build_run) of rl in the config's dtype, decode mode and decode step, fresh optimizers
    (optimize=False: none)."""
    rl = dataclasses.replace(rl, dtype=dtype_name(config.dtype), rollout_dtype=dtype_name(config.dtype),
                             decode=config.decode, decode_kernels=config.decode_kernels)
    engine_type = EarlyStopEngine if isinstance(rollout_model, EarlyStopModel) else Engine
    spec = rollout_spec(rollout_model, max_rows=(rl.max_rows or None) if config.batched else None,
                        memory_budget_gb=rl.memory_budget_gb, share_prompts=config.shares_work, decode=config.decode,
                        compile="on" if config.compiled else "off", lag=config.lag,
                        decode_kernels=config.decode_kernels, dtype=rl.rollout_dtype)
    engine = engine_type(rollout_model, tokenizer, spec)
    if engine.spec.decode != "eager":  # as chat_rl's: one static batch, sized for the task's longest prompt
        engine.reserve_prompt_length(longest_prompt(tokenizer, task))
    return build_run(rl, RunPlan.as_given(rl, engine.spec), model, tokenizer, engine,
                     optimizers=make_optimizers(rl, model) if optimize else [],
                     tasks=(task, None), device=device, steps=(BENCH_STEP, BENCH_STEP + 1), compiled=config.compiled,
                     rows=train_rows(rl, device.type) if config.batched else rl.device_batch_size, required=True,
                     reference=copy.deepcopy(model).requires_grad_(False) if rl.kl_coef else None)


def bench_step(run, config, force_advantages):
    """One chat_rl step of the run, as RLRun.step runs it, timed on the device: the step's rollouts (chat_rl's, or
    nanochat's: step_rollouts) in the profiler's "rollout" range, then train_on_rollouts (chat_rl's training, or
    nanochat's: config.shares_work) in its "training" range, its optimizer steps timed apart, by hooks. Every repeat
    samples the questions of chat_rl's step BENCH_STEP; force_advantages: +1, -1, ... before training."""
    optimizer_seconds = []
    hooks = [hook for opt in run.optimizers for hook in (
        opt.register_step_pre_hook(lambda *_: optimizer_seconds.append(-device_time(run.device))),
        opt.register_step_post_hook(lambda *_: optimizer_seconds.append(device_time(run.device))))]
    t0 = device_time(run.device)
    with torch.profiler.record_function("rollout"):
        rollouts, calls = step_rollouts(run, config)
        t_rollout = device_time(run.device) - t0
    digest = hashlib.sha1(repr([r.batch.inputs.tolist() for r in rollouts]).encode()).hexdigest()[:16]
    if force_advantages:
        rollouts = [dataclasses.replace(r, batch=dataclasses.replace(r.batch, advantages=(
            1 - 2 * (torch.arange(len(r.batch.advantages)) % 2)).to(r.batch.advantages))) for r in rollouts]
    t0 = device_time(run.device)
    with torch.profiler.record_function("training"):
        result = train_on_rollouts(run, rollouts, BENCH_STEP, share_prompt=config.shares_work,
                                   skip_zero_advantage=config.shares_work)
        count_bad_step(run, BENCH_STEP, result)
        t_train = device_time(run.device) - t0
    for hook in hooks:
        hook.remove()
    (compiles, compile_seconds), optimizer_s, trained = run.compile_clock.lap(), sum(optimizer_seconds), result.first
    return {**engine_work(run.model, calls, run.config.max_new_tokens), "tokens_digest": digest, "compiles": compiles,
            "compile_seconds": compile_seconds, "rollout_seconds": t_rollout,
            "train_seconds": t_train - optimizer_s, "optimizer_seconds": optimizer_s,
            "step_seconds": t_rollout + t_train, "captures": run.engine.last_stats.captures,
            "rows": trained.rows_total, "rows_trained": trained.rows_trained,
            "rows_skipped": trained.rows_total - trained.rows_trained, "batches": [r.batch for r in rollouts],
            **{key: getattr(trained, key) for key in ("sampler_tokens", "sampler_gap_mean", "sampler_gap_max", "sampler_k3")}}


def measure(model, rollout_model, initial_state, tokenizer, task, config, rl, args, device, memory, peaks, bandwidth):
    """One config from the initial weights: a warm-up (a question, a few tokens, no optimizer step), then --repeat steps
    of one run. Figures: the last step's, the steady state; *_each: every step's; tokens compared: the first step's."""
    model.load_state_dict(initial_state)
    compile_block_regions(model, config.blocks, required=True)  # the rollout model is it, or wraps it
    graphs_before = len(compiled_step_graphs())  # earlier configs' decode graphs
    warm = dataclasses.replace(rl, examples_per_step=1, num_samples=rl.device_batch_size,
                               max_new_tokens=min(4, rl.max_new_tokens))
    steps = [bench_step(bench_run(model, rollout_model, tokenizer, task, config, rl=warm, device=device,
                                  optimize=False), config,
                        args.force_advantages)]
    resident_mb = memory.reset()
    run = bench_run(model, rollout_model, tokenizer, task, config, rl=rl, device=device)
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
    flex = config.decode_kernels == "flex"  # FlexAttention does not run on the meta device: no count of its step
    with torch.device("meta"):  # a static decode step at the run's largest shape: the same count on any machine
        ops = None if flex else count_decode_step_ops(GPT(model.config, model.generation), max(r["max_batch_rows"], 1),
                                                      rl.max_new_tokens, share_prompts=config.shares_work,
                                                      num_samples=rl.num_samples, decode_kernels=config.decode_kernels)
    compiled = compiled_step_kernels(graphs_before) if config.compiled and config.decode != "eager" else None
    r.update({key: ops and getattr(ops, field) for key, field in (("decode_step_ops", "ops"), ("decode_step_kernels", "kernels"),
              ("decode_step_ops_per_layer", "ops_per_block"), ("decode_step_kernels_per_layer", "kernels_per_block"))},
             decode_step_compiled_kernels=compiled and compiled.asdict(),
             flex_compile=flex_compile_state() if flex else None)  # compiled alone on CUDA: whether it did, and its cost
    return r



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
                                                 autocast=autocast_context(device, torch.float32),
                                                 skip_zero_advantage=skip)
            out[-1].update({f"{key}_seconds": device_time(device) - t0, f"{key}_rows_trained": trained.rows_trained})
            model.zero_grad(set_to_none=True)
    model.eval()
    return out
