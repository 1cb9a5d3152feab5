"""
Every "auto" of a chat_rl run, resolved once at its start and printed with why: the dtype training computes in
(--dtype), the dtype rollouts decode in (--rollout-dtype), the decode mode (--decode), what is compiled
(--compile), the rows per training forward (--train-rows), the KV caches' memory budget (--memory-budget-gb) and the
decode step (--decode-kernels, resolved by the engine's spec).

The resolved values are the run's RunPlan, frozen, which the run reads; the config stays as given. Checkpoints record
the config with the plan's values in place of the flags' (RunPlan.recorded): a resumed run computes as it started.
The plan holds the engine's RolloutSpec too, resolved by the engine's own function (nanochat/engine/spec.py) from
the config and the values above; --compile=auto's switches replace it (nanochat/rl/auto_switch.py's switched, which
RLRun.take applies).
Decisions that are measured (a dtype on a CPU) are measured on rank 0 and taken by every rank.
"""

import dataclasses
from dataclasses import dataclass

import torch

from nanochat.compiling.plan import compile_models, resolve_compile_flag
from nanochat.compiling.rule import AutoCompile, CompileLedger, PartRule, part_key
from nanochat.engine.decode_steps import decode_step_of, resolve_decode_kernels
from nanochat.engine.engine import Engine
from nanochat.engine.kv_cache import cache_geometry
from nanochat.engine.memory import rows_in_budget
from nanochat.engine.spec import (FIXED_GB, RolloutSpec, resolve_memory_budget, resolve_rollout_spec,
                                  rollout_decode_mode, rollout_spec, run_decode_mode)
from nanochat.model.head import HEAD_CHUNK_TOKENS
from nanochat.model.precision import MARGIN, PREFERENCE, fastest_rollout_dtype, fastest_training_dtype, rank0_choice
from nanochat.optim.training_memory import optimizer_bytes, teacher_forward_bytes, training_peak_bytes
from nanochat.runtime.distributed import print0
from nanochat.runtime.dtypes import compute_dtype, dtype_name

# trained rows per training forward under --train-rows=0 (auto), by device type: more rows than nanochat's
# --device-batch-size make larger, fuller matmuls and fewer forwards for the same rows. On CUDA 64: on an H200 (d20,
# 256 rows of 256 sampled tokens) 64 trained them in 1.36 s against 2.49 s with 16, whose pass was two-thirds waits on
# the host; elsewhere 16, 7-14% faster than 8 on a CPU (docs/performance.md)
AUTO_TRAIN_ROWS = {"cuda": 64, "cpu": 16}
OTHER_AUTO_TRAIN_ROWS = 16  # MPS and any other device: a CPU's choice until measured there


@dataclass(frozen=True)
class RunPlan:
    """What a run resolved at its start, each value once (printed with why), read by the run in place of its config's
    flag: the config itself stays as given. A checkpoint records the config with these values in their place
    (recorded), so that --resume continues the run it was; `spec`, how the engine runs rollouts, is built from them
    and not recorded (a resumed run resolves it again)."""
    dtype: str                # what training computes in (--dtype)
    rollout_dtype: str        # what rollouts and evals decode in (--rollout-dtype)
    decode: str               # the decode mode (--decode): the uncompiled one where nothing compiles the static step
    compile: str              # --compile, or off where the plan compiles nothing and measures nothing
    memory_budget_gb: float   # the KV caches' budget in GiB (--memory-budget-gb)
    output_tag: str           # the run's directory under chatrl_checkpoints (--output-tag)
    keep_last: int            # checkpoints kept after each save, 0 = all (--keep-last)
    decode_kernels: str = "torch"  # the decode step (--decode-kernels: the spec's, auto resolved)
    spec: RolloutSpec = None  # what the run's engine is built from (run_rollout_spec): decode as the engine runs it
    #                           now (--compile=auto may have switched its static step since the start), the budget above

    @classmethod
    def recorded_fields(cls):
        return [f.name for f in dataclasses.fields(cls) if f.name != "spec"]

    @classmethod
    def as_given(cls, config, spec=None):
        """The plan of a config whose values need no resolving (bench_rl's, built per configuration, with its
        engine's spec)."""
        given = {name: getattr(config, name) for name in cls.recorded_fields()}
        return cls(**given | {"keep_last": resolve_keep_last(config, meta={})}, spec=spec)

    def recorded(self, config):
        """The run's settings as a checkpoint, wandb and the report record them: config's, in its order, with this
        plan's values in place of the flags'."""
        return vars(config) | {name: getattr(self, name) for name in self.recorded_fields()}


def auto_train_rows(device_type):
    return AUTO_TRAIN_ROWS.get(device_type, OTHER_AUTO_TRAIN_ROWS)


def train_rows(args, device_type):
    """Trained rows per training forward on a device of device_type: --train-rows, else (0, auto) the device's
    AUTO_TRAIN_ROWS (--device-batch-size if larger). A forward may hold rows of several questions
    (nanochat.rl.policy_gradient.accumulate_policy_gradient cuts the step's trained rows, in question order, into
    forwards of this many), so it is not capped at --num-samples. args: a checked config (--train-rows >= 0)."""
    return args.train_rows or max(args.device_batch_size, auto_train_rows(device_type))


def phase_dtype(phase, device, requested, measure):
    """The dtype name one phase (phase: "training" or "rollouts") runs in, for `requested` (auto, float32, bfloat16
    or float16: --dtype or --rollout-dtype). float32 or float16 when asked; float32 where bf16 is not native (a
    note says so); float16 for auto on a CUDA GPU without native bf16 (a V100, a T4; a note says so); bf16 when
    asked, or for auto on CUDA; for auto on a CPU or MPS with native bf16, the faster of the two by
    measure(candidates): fp32 unless bf16 wins by the margin (measured on rank 0; every rank takes its choice)."""
    what, flag = {"training": ("training computes", "--dtype"), "rollouts": ("rollouts decode", "--rollout-dtype")}[phase]
    dtype = compute_dtype(device, requested, what, float16=True)  # see compute_dtype
    if dtype in (torch.float32, torch.float16) or requested == "bfloat16" or device.type == "cuda":
        return dtype_name(dtype)
    name = dtype_name(rank0_choice(lambda: measure(list(PREFERENCE)), list(PREFERENCE)))
    print0(f"{what} in {name}: bfloat16 measured {'at least' if name == 'bfloat16' else 'less than'} {MARGIN}x as fast "
           f"as float32 on this {device.type} ({flag} to choose)")
    return name


def resolve_training_dtype(config, model, tokenizer, train_task, device, rows):
    """The dtype training runs in for --dtype, timed on one micro-batch of the run's own shape (`rows` rows of the
    first question's prompt plus --max-new-tokens)."""
    length = len(tokenizer.render_for_completion(train_task[0])) + config.max_new_tokens
    return phase_dtype("training", device, config.dtype, lambda candidates: fastest_training_dtype(
        model, rows, length, candidates))


def resolve_rollout_dtype(config, dtype, decode, model, tokenizer, train_task, device, world_size, compiled_decode=False):
    """The dtype rollouts run in for --rollout-dtype, once training's (`dtype`, for the --dtype asked for) and the
    decode mode (`decode`) are resolved. auto is float32 with a float32 --dtype, float16 where training computes in
    float16 (the sampler rounds as the trainer does: fp16's small sampler-trainer gap); with a compiled decode step
    (compiled_decode), training's dtype: timing it would compile it twice, and compiled, its matmuls are most of its
    time, as in training; else timed on its own on the run's rollout shortened (its first questions x --num-samples,
    16 tokens, an uncompiled engine in the run's decode mode; see fastest_rollout_dtype): the eager step's many small
    operations gain less from bf16, and decoding and training gain from bf16 on different CPUs."""
    if compiled_decode and config.rollout_dtype == "auto":
        print0(f"rollouts decode in {dtype}: as training, with the compiled decode step (--rollout-dtype to choose)")
        return dtype
    rollout_request = config.rollout_dtype
    if config.rollout_dtype == "auto" and (config.dtype == "float32" or dtype == "float16"):
        rollout_request = "float32" if config.dtype == "float32" else "float16"

    def measure_rollouts(candidates):
        questions = max(1, min(len(train_task), config.examples_per_step // world_size))  # a rank's step
        prompts = [tokenizer.render_for_completion(train_task[i]) for i in range(questions)]
        budget = config.memory_budget_gb if isinstance(config.memory_budget_gb, (int, float)) else FIXED_GB  # off CUDA
        engine = Engine(model, tokenizer, rollout_spec(model, max_rows=config.max_rows or None, memory_budget_gb=budget,
                                                       decode=decode, compile="off"))
        return fastest_rollout_dtype(engine, prompts, config.num_samples, candidates)
    return phase_dtype("rollouts", device, rollout_request, measure_rollouts)


def resolve_decode_and_compile(config, device, num_steps, dtype):
    """(the decode mode, the --compile that runs, the CompilePlan) of a run of num_steps steps in all training in
    `dtype` (printed with why): compiling.plan.compile_plan's plan for the mode the engine's run_decode_mode asks about
    (--compile=auto on a CPU: measured during the run, nanochat/compiling/rule.py; the run starts uncompiled), and the
    mode the engine then runs (rollout_decode_mode: where the plan compiles nothing, the one --decode gives
    uncompiled). Decided on the run's whole length, not the steps left, so that a resumed run decodes as it started
    (--decode and --compile are not restored by --resume; the compiled step may sample another token at a near-tie).
    Every rank takes the same plan (compiling.plan.resolve_compile). A decode step that fails to compile later, at its
    first call, warns once and runs uncompiled (the same tokens)."""
    decode = run_decode_mode(config.decode, config.compile, device, num_steps, dtype, measured=True)
    compiling, compile_mode = resolve_compile_flag(config.compile, device, decode, num_steps, measured=True)
    return rollout_decode_mode(config.decode, device, bool(compiling.decode)), compile_mode, compiling


def measured_parts(compiling, decode_flag, rollout_dtype, step_compiles=True):
    """The parts --compile=auto decides during the run (compiling.measured): the training forward; the decode step
    where the compiled static step can take the rollouts' place (--decode=auto, decoding in bf16: in fp32 its gain
    was measured too small to pay; or --decode=static) and the run's decode step compiles at all (step_compiles:
    the Triton step never does)."""
    if not compiling.measured:
        return ()
    decodes = step_compiles and (decode_flag == "static" or (decode_flag == "auto" and rollout_dtype == "bfloat16"))
    return ("train", "decode") if decodes else ("train",)


def resolve_compute_plan(config, model, tokenizer, train_task, device, world_size, num_steps, rows):
    """The dtypes, the decode mode and what is compiled, in the order each depends on the last: training's dtype
    (the compiled decode step follows it), then the decode mode and compiling, then the rollouts' dtype. Returns
    (RunPlan's fields dtype, rollout_dtype, decode and compile; the CompilePlan; the parts auto decides during the
    run: measured_parts)."""
    dtype = resolve_training_dtype(config, model, tokenizer, train_task, device, rows=rows)
    decode, compile_mode, compiling = resolve_decode_and_compile(config, device, num_steps, dtype)
    rollout_dtype = resolve_rollout_dtype(config, dtype, decode, model, tokenizer, train_task=train_task, device=device,
                                          world_size=world_size, compiled_decode=bool(compiling.decode))
    compile_models(compiling, model)  # after the rollout dtype's timing, which would compile them for each dtype
    resolved = dict(dtype=dtype, rollout_dtype=rollout_dtype, decode=decode, compile=compile_mode)
    compiles = decode_step_of(resolve_decode_kernels(config.decode_kernels, device)).compiles
    return resolved, compiling, measured_parts(compiling, config.decode, rollout_dtype, compiles)


def resolve_memory(config, model, device, optimizers, rows, rollout_dtype, compiled_training=False, rollout_rows=0,
                   prompt_tokens=0, teacher=None):
    """--memory-budget-gb in GiB, for rollouts in `rollout_dtype`: the KV caches' budget once the model and optimizer
    state are in memory and a training forward of `rows` rows is reserved: rows of up to ceil(rows / --num-samples)
    + 1 questions (a forward spans questions), their prompts at most the model's sequence length, and the head's
    logits one chunk at a time (whole when training is compiled: nanochat/model/head.py). Where `rows` are auto's
    CUDA rows and the auto budget they leave cannot hold a step's rollout_rows rows at once (prompts of
    prompt_tokens), the rows fall back to the other devices' auto: a rollout cut in two passes costs more than the
    larger forwards save (an H200's d20 figures, docs/performance.md). Returns (the rows per training forward, the
    budget in GiB)."""
    def budget(rows):  # what training reserves counted here (nanochat/optim/training_memory.py), the rest the engine's
        head_tokens = None if compiled_training else min(rows * config.max_new_tokens, HEAD_CHUNK_TOKENS)
        shape = (rows, config.max_new_tokens, model.config.sequence_len, -(-rows // config.num_samples) + 1, head_tokens)
        peak = training_peak_bytes(model.config, *shape) if rows else 0
        if teacher is not None and rows:  # its no-grad forward, beside the student's activations (its weights are
            peak += teacher_forward_bytes(teacher.config, *shape)  # loaded: measured with the free memory)
        return resolve_memory_budget(config.memory_budget_gb, model, device, getattr(torch, rollout_dtype),
                                     optimizer=optimizer_bytes(model, optimizers) if optimizers else 0,
                                     training_peak=peak)
    gb, line = budget(rows)
    smaller = train_rows(config, "other")  # the auto of a device without an entry of its own
    if line and not config.train_rows and smaller < rows and rollout_rows:
        per_token = cache_geometry(model).bytes_per_token(getattr(torch, rollout_dtype))
        if rows_in_budget(per_token, gb * 2 ** 30, prompt_tokens, config.max_new_tokens, config.num_samples,
                          share_prompts=True, at_least=0) < rollout_rows:
            print0(f"training: {smaller} trained rows per forward, not {rows}: a forward of {rows} would leave too "
                   f"little memory for a step's {rollout_rows} rollout rows at once")
            rows, (gb, line) = smaller, budget(smaller)
    print0(line or f"KV cache budget: {gb:g} GiB (--memory-budget-gb)")
    return rows, gb


KEEP_ALL = 0  # --keep-last's "keep every checkpoint" (nanochat's): a new run's, where the flag is not given


def resolve_keep_last(config, meta):
    """--keep-last, where it is not given: a resumed run's own (`meta`: its step's), a new run's KEEP_ALL."""
    if config.keep_last is not None:
        return config.keep_last
    return (meta.get("user_config", {}).get("keep_last") if config.resume else None) or KEEP_ALL


def describe_plan(plan, config, rows):
    """The plan's lines about rollouts (its RolloutSpec's) and training passes, once the engine is built."""
    print0(plan.spec.describe())
    print0(f"training: {rows} trained rows per forward, of one question or several "
           f"({'--train-rows' if config.train_rows else 'auto'}; the same gradient for any count)")


def run_rollout_spec(config, device, compiling, auto_compile, memory_budget_gb, rollout_dtype):
    """The RolloutSpec of the run's engine at its start (the engine's resolve_rollout_spec, from the config and the
    plan's values): its static step compiled where the CompilePlan `compiling` compiles it (--compile=on: graph stays
    graph on CUDA), or where --compile=auto switched it before the resumed step (a CPU run: the static step then, as
    the switch makes it, RolloutSpec.with_step_compiled); in the plan's memory budget and rollout dtype (the engine
    decodes in it, its steps' and evals' alike, whatever autocast the run trains under)."""
    compiled = bool(compiling.decode) or bool(auto_compile is not None and auto_compile.compiled_now("decode"))
    return resolve_rollout_spec(device, config.decode, compiled, max_rows=config.max_rows or None,
                                memory_budget_gb=memory_budget_gb, calculator_format=config.calculator_format,
                                dtype=rollout_dtype, decode_kernels=config.decode_kernels)


def auto_compile_of(resolved, model, parts, compiling, num_steps, start_step, meta, rank):
    """The AutoCompile of a run whose --compile=auto measures `parts` (plan.measured_parts; resumed: meta's decisions),
    or that compiles from its start (--compile=on: the CompilePlan `compiling`), recording its compiles' cost; or None.
    resolved: resolve_compute_plan's dtypes (dtype, rollout_dtype)."""
    compiled = () if parts else tuple(p for p, on in (("train", compiling.train), ("decode", compiling.decode)) if on)
    if not parts and not compiled:
        return None
    dtypes = {"train": resolved["dtype"], "decode": resolved["rollout_dtype"]}
    rules = {part: PartRule(part, part_key(part, model, dtypes[part]), model.config.n_layer) for part in parts + compiled}
    return AutoCompile(rules, num_steps, CompileLedger(), start_step=start_step,
                       state=(meta or {}).get("compile_auto"), records=rank == 0, compiled=compiled)
