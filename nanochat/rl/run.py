"""
One RL run's state and its step, as chat_rl's loop calls it: setup_run builds the run (model, optimizers, engine,
tasks) from the config, through build_run, which bench_rl's runs go through too; RLRun.step() is one step, its two
halves sample_rollouts and train_on_rollouts (which bench_rl times itself); the run's Checkpointer writes a step for
--resume. Out of memory, a step retries with fewer rows at a time, which gives the same tokens and the same
gradient.
"""

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import torch

from nanochat.checkpoints.checkpointer import Checkpointer
from nanochat.checkpoints.store import new_run_id
from nanochat.compiling.functions import CompileClock
from nanochat.compiling.plan import compile_models
from nanochat.compiling.rule import AutoCompile
from nanochat.engine.cuda_graphs import check_decode_flag
from nanochat.engine.decode_steps import check_decode_kernels
from nanochat.engine.engine import Engine
from nanochat.errors import UserError
from nanochat.model.precision import ortho_dtype
from nanochat.optim.loss_scale import loss_scale_for
from nanochat.optim.optimizers import guarded_step, lr_multiplier, scale_initial_lr
from nanochat.rl.auto_switch import CompileMarks
from nanochat.rl.config import RLConfig
from nanochat.rl.objective import PolicyLoss, step_counts
from nanochat.rl.plan import (RunPlan, auto_compile_of, describe_plan, resolve_compute_plan, resolve_keep_last,
                              resolve_memory, run_rollout_spec, train_rows)
from nanochat.rl.policy_gradient import TrainStats, accumulate_policy_gradient, without_rejected_tokens
from nanochat.rl.progress import RolloutLog, RunProgress, drop_rollouts_after
from nanochat.rl.resume import load_reference, load_start, prepare_output_dir, restore_optimizers
from nanochat.rl.rollout import (Sampling, StepRollouts, has_signal, longest_prompt, question_indices_at, question_seed,
                                 sample_questions, step_questions)
from nanochat.rl.teacher import load_teacher
from nanochat.rl.training import TrainingState, training_forward
from nanochat.runtime.device import with_fewer_rows_on_oom
from nanochat.runtime.distributed import any_rank, collective_device, print0
from nanochat.runtime.dtypes import autocast_context
from tasks.registry import make_task


@dataclass(frozen=True)
class RunLineage:
    """Where a run comes from, as every checkpoint's meta records it (meta_data) and --resume reads it back."""
    run_id: str = None                     # the run's id, in its shards too (checked on --resume)
    start_checkpoint: dict = None          # {source, model_tag, step} the run started from
    segments: list = field(default_factory=list)  # [{start_step, world_size}] of the run's start and each --resume


@dataclass
class RLRun:
    """One run. Fixed for it, set once by build_run: `config` as given (the flags, after --resume put back the run's
    own), the model, optimizers, tasks, engine, ranks and lineage. What changes from step to step: `plan` (resolved at
    the run's start: dtypes, decode mode, compiling, memory budget, output tag, --keep-last, which every checkpoint
    records with the config, RunPlan.recorded; and the engine's RolloutSpec) and `training` (TrainingState), each a
    frozen value replaced whole: --compile=auto's switches through take(), the one place, an out-of-memory's fewer
    rows in train_on_rollouts; `progress` (history, data position, counters, timings) through its methods, the saves
    through `checkpointer`, --compile=auto's `compile_marks` at each step's rollouts and end, and what the engine holds
    through the engine's own methods. step() runs one step."""
    config: RLConfig
    plan: RunPlan
    model: torch.nn.Module
    tokenizer: object                      # the engine's, to size its batches for the tasks' prompts
    optimizers: list
    training: TrainingState                # the training half's objective, forward, rows, reference, loss scale
    train_task: object
    val_task: object
    num_steps: int
    start_step: int
    device: torch.device
    teacher: object = None                 # --teacher's Teacher (nanochat/rl/teacher.py), or None
    rank: int = 0
    world_size: int = 1
    extra_eval_tasks: tuple = ()           # --eval-tasks: ((name, test task), ...) evaluated beside val_task
    auto_compile: AutoCompile = None       # --compile=auto decided during the run (nanochat/compiling/rule.py), or None
    lineage: RunLineage = field(default_factory=RunLineage)
    rollout_log: RolloutLog = None         # --save-rollouts: this rank's samples as JSON lines
    checkpointer: Checkpointer = None      # its saves (chat_rl's runs), or None
    compile_clock: CompileClock = field(default_factory=CompileClock)  # what each step compiled
    progress: RunProgress = field(default_factory=RunProgress)
    engine: Engine = None                  # built from plan.spec, reconfigured with each new one (take)
    compile_marks: CompileMarks = field(default_factory=CompileMarks.at_start)  # nanochat/rl/auto_switch.py

    @property
    def user_config(self):
        """The run's settings as its checkpoints, wandb and the report record them (RunPlan.recorded)."""
        return self.plan.recorded(self.config)

    @property
    def master(self):
        return self.rank == 0

    @property
    def examples_per_rank(self):
        return self.config.examples_per_step // self.world_size

    @property
    def reduce_device(self):
        return collective_device(self.device)

    def autocast(self):
        """Training's autocast (its forwards in the plan's dtype); the engine decodes in its own (RolloutSpec.dtype)."""
        return autocast_context(self.device, getattr(torch, self.plan.dtype))

    def step(self, step):
        """One step: this rank's questions sampled and rewarded from the run's data position (sample_rollouts: the
        last checkpoint committed at its first draw's end, before the step's first collective), then the policy
        gradient and optimizer step(s) (train_on_rollouts; a non-finite one counted). Each half timed inside the
        profiler's "rollout" and "training" ranges. Returns a StepOutcome."""
        clock = time.time
        t0 = clock()
        with torch.profiler.record_function("rollout"):
            self.compile_marks = self.compile_marks.rollouts_begin()  # --compile=auto: auto_compile_step's
            sampled = sample_rollouts(self, step, self.progress.data_position)
            t_rollout = clock() - t0
        self.progress.advance(sampled.next_position)
        trained = sampled.trained
        t0 = clock()
        with torch.profiler.record_function("training"):
            result = train_on_rollouts(self, trained, step)
            count_bad_step(self, step, result)
            t_train = clock() - t0
        return StepOutcome(sampled.drawn, trained, result, t_rollout, t_train,
                           t_teacher=self.teacher.take_seconds() if self.teacher else None)

    def take(self, plan, training):
        """The run's plan and training state from the next step on (--compile=auto's switches, auto_switch.switched):
        the one place a run's plan changes. A new RolloutSpec reconfigures the engine, which runs it from the next
        rollout on (what it kept for the other step goes), its batch sized again for the tasks' prompts."""
        respec = plan.spec is not self.plan.spec
        self.plan, self.training = plan, training
        if respec:
            self.engine.reconfigure(plan.spec)
            size_for_prompts(self.engine, self.tokenizer, self.train_task, self.val_task, self.extra_eval_tasks)

    def snapshot(self, step):
        """What a checkpoint of `step` holds: the model (rank 0), this rank's optimizer shard, the meta."""
        shard = {"optimizers": [opt.state_dict() for opt in self.optimizers], "world_size": self.world_size,
                 "rank": self.rank, "step": step, "run_id": self.lineage.run_id}
        return self.model.state_dict() if self.master else None, shard, meta_data(self, step)


@dataclass
class StepOutcome:
    """What one step did on this rank: every question it sampled (drawn), those it trained on, the training's
    TrainResult and the two halves' seconds."""
    drawn: list
    trained: list
    result: object
    t_rollout: float
    t_train: float
    t_teacher: float = None  # the teacher's forwards, within t_train (--teacher), or None


class NonFiniteStepsError(UserError):
    """Too many consecutive steps had a non-finite loss or gradient (nanochat.cli adds what to change)."""

    def __init__(self, steps, last_saved):
        super().__init__(f"{steps} consecutive steps had a non-finite loss or gradient; stopping (last good checkpoint: "
                         f"{last_saved})")


def run_length(config, train_task):
    """The run's number of steps: --num-steps, or the epochs over the train split (RLConfig.run_length)."""
    num_steps = config.run_length(len(train_task))
    print0(f"Calculated number of steps: {num_steps}")
    return num_steps


def make_optimizers(config, model, dtype=None):
    """The run's optimizers at step 0, each group at --init-lr-frac of its lr (its `initial_lr`). Muon
    orthogonalizes in the run's compute dtype `dtype` (RunPlan.dtype; default: the config's, where --dtype names
    one): bf16 where it is native (nanochat's numerics), fp32 otherwise (and for fp16: precision.ortho_dtype)."""
    return scale_initial_lr(model.setup_optimizers(
        unembedding_lr=config.unembedding_lr, embedding_lr=config.embedding_lr, matrix_lr=config.matrix_lr,
        weight_decay=config.weight_decay, recipe=config.recipe, ortho_dtype=ortho_dtype(dtype or config.dtype)),
        config.init_lr_frac)


def policy_loss_of(config):
    """The objective the run's algorithm flags choose (each default is nanochat's)."""
    return PolicyLoss(loss=config.loss, loss_norm=config.loss_norm, max_new_tokens=config.max_new_tokens,
                      mask_truncated=config.mask_truncated, clip_low=config.clip_low, clip_high=config.clip_high,
                      kl_coef=config.kl_coef, rollout_correction=config.rollout_correction,
                      correction_cap=config.rollout_correction_cap,
                      rejected_in_denominator=config.rejected_tokens == "counted", reward_coef=config.reward_coef,
                      distill_coef=config.distill_coef)


def check_run_device(config, device):
    """The settings `device` rules out, each a one-line error, before the checkpoints are even listed (run_target) and
    long before the model loads: graph decode off CUDA, a decode step that cannot run there."""
    check_decode_flag(config.decode, device)
    check_decode_kernels(config.decode_kernels, device, compiled=config.compile == "on")


def setup_run(config, resume, target, rank, world_size, device):
    """Load the model (a new run, or `resume`: restore_settings' Resume; from and to run_target's Target), resolve the
    plan (nanochat/rl/plan.py), and build the optimizers, the engine and the tasks: an RLRun at its first step
    (build_run)."""
    model, tokenizer, meta, start_step = load_start(config, resume, target, device)
    output_tag, checkpoint_dir = target.output_tag, target.checkpoint_dir
    start = meta.get("start_checkpoint")
    train_task, val_task = make_task(config.task, "train"), make_task(config.task, "test")
    extra_eval_tasks = tuple((name, make_task(name, "test")) for name in config.extra_eval_tasks)
    rows = train_rows(config, device.type)  # per training forward
    num_steps = run_length(config, train_task)
    resolved, compiling, measured = resolve_compute_plan(config, model, tokenizer, train_task, device,
                                                         world_size=world_size, num_steps=num_steps, rows=rows)
    auto_compile = auto_compile_of(resolved, model, measured, compiling, num_steps, start_step=start_step,
                                   meta=resume and meta, rank=rank)
    optimizers = make_optimizers(config, model, resolved["dtype"])
    segments = [{"start_step": 0, "world_size": world_size}]  # the world size of each part of the run
    if resume:
        saved = restore_optimizers(resume, optimizers, meta, rank, world_size, device=device)
        segments = (meta.get("segments") or [{"start_step": 0, "world_size": saved}]) + [
            {"start_step": start_step, "world_size": world_size}]
    reference = load_reference(start, device, config.model_generation) if config.kl_coef > 0 else None
    if reference is not None:
        compile_models(compiling, reference)
    teacher = load_teacher(config, model, tokenizer, device, resolved["rollout_dtype"], start=start,
                           resumed=meta.get("teacher") if config.resume else None) if config.teacher else None
    if teacher is not None:
        compile_models(compiling, teacher.model)
    rows, budget = resolve_memory(config, model, device, optimizers, rows, rollout_dtype=resolved["rollout_dtype"],
                                  compiled_training=compiling.train or "train" in measured,
                                  teacher=teacher and teacher.model,
                                  rollout_rows=config.examples_per_step // world_size * config.num_samples,
                                  prompt_tokens=longest_prompt(tokenizer, train_task) if device.type == "cuda" else 0)
    spec = run_rollout_spec(config, device, compiling, auto_compile, budget, rollout_dtype=resolved["rollout_dtype"])
    plan = RunPlan(**resolved, memory_budget_gb=budget, output_tag=output_tag,
                   keep_last=resolve_keep_last(config, meta), decode_kernels=spec.decode_kernels, spec=spec)
    engine = Engine(model, tokenizer, spec=plan.spec)
    size_for_prompts(engine, tokenizer, train_task, val_task, extra_eval_tasks)
    describe_plan(plan, config, rows)
    if plan.spec.decode != "eager":
        print0(f"rollouts: static batch sized for prompts of up to {engine.prompt_floor} tokens (the task's longest)")
    if not config.resume:  # last: --overwrite clears the old run only once everything else has loaded
        prepare_output_dir(target, rank == 0)
    elif rank == 0:  # the run's samples, if it kept them, continue from the resumed step
        drop_rollouts_after(checkpoint_dir, resume.step)
    resumed = meta if config.resume else None
    # a new run (from any source): a new id
    lineage = RunLineage(run_id=(resumed or {}).get("run_id") or new_run_id(), start_checkpoint=start,
                         segments=segments)
    compiled = compiling.train or bool(auto_compile and auto_compile.compiled_now("train"))
    return build_run(config, plan, model, tokenizer, engine, optimizers=optimizers, tasks=(train_task, val_task),
                     device=device, steps=(start_step, num_steps), rows=rows, ranks=(rank, world_size),
                     reference=reference, compiled=compiled, loss_scale=loss_scale_for(plan, resumed),
                     auto_compile=auto_compile, lineage=lineage, checkpoint_dir=checkpoint_dir, resumed=resumed,
                     extra_eval_tasks=extra_eval_tasks, teacher=teacher)


def build_run(config, plan, model, tokenizer, engine, optimizers, tasks, device, steps, rows, compiled, ranks=(0, 1),
              reference=None, loss_scale=None, checkpoint_dir=None, resumed=None, required=None, **fixed):
    """The one place an RLRun is made (chat_rl's setup_run, bench_rl's bench_run): its objective from the config,
    its training forward (compiled where `compiled`, a failure an error where `required`, by default under
    --compile=on; loss-scaled under fp16), its progress (a resumed run's from
    the meta `resumed`) and, given a checkpoint_dir, its checkpointer and --save-rollouts log. steps: (start step,
    number of steps); rows: rows per training forward; ranks: (rank, world size); fixed: more of RLRun's fields."""
    (start_step, num_steps), (rank, world_size) = steps, ranks
    if engine.spec.dtype != plan.rollout_dtype:  # its steps' rollouts and evals sample in it, under no one's autocast
        raise ValueError(f"a run's engine decodes in its plan's rollout dtype {plan.rollout_dtype}, not "
                         f"{engine.spec.dtype}: build it with rollout_spec(model, dtype={plan.rollout_dtype!r})")
    progress = RunProgress() if resumed is None else RunProgress.restored(resumed, start_step, config.examples_per_step)
    required = plan.compile == "on" if required is None else required
    training = TrainingState(policy_loss=policy_loss_of(config), rows=rows, reference=reference, loss_scale=loss_scale,
                             forward=training_forward(compiled, loss_scale, required))
    run = RLRun(config=config, plan=plan, model=model, tokenizer=tokenizer, optimizers=optimizers, training=training,
                train_task=tasks[0], val_task=tasks[1], num_steps=num_steps, start_step=start_step, device=device,
                rank=rank, world_size=world_size, engine=engine, progress=progress, **fixed)
    if checkpoint_dir is not None:
        run.checkpointer = Checkpointer(checkpoint_dir, rank, world_size, plan.keep_last, run.snapshot,
                                        last_saved=None if resumed is None else start_step - 1)
        if config.save_rollouts:
            run.rollout_log = RolloutLog(checkpoint_dir, rank, resumed=resumed is not None)
    return run


def size_for_prompts(engine, tokenizer, train_task, val_task, extra_eval_tasks):
    """A static batch of the run's engine sized for every prompt of the tasks it samples, --eval-tasks' ((name, task),
    ...) too (one batch for the run, its graphs captured once, not rebuilt for an eval's longer prompts); nothing to
    size in the eager mode."""
    if engine.spec.decode != "eager":
        tasks = (train_task, val_task, *(task for _, task in extra_eval_tasks))
        engine.reserve_prompt_length(longest_prompt(tokenizer, *tasks))


def give_back_rollout_memory(engine):
    """After an out-of-memory in training: what the engine gives back for it (RolloutMemory.yield_memory: first the
    batches it keeps from other rollouts, then all it keeps), as the line to print, or None if it held nothing."""
    given = engine.memory.yield_memory()
    return f"out of memory during training: gave back {given}; retrying" if given else None


def sample_rollouts(run, step, position=None):
    """This rank's questions of `step`, sampled and rewarded (with fewer rows at a time after an out-of-memory), from
    data position `position` (default: step * --examples-per-step, a run's own without --dynamic-sampling). With
    --dynamic-sampling, draws of --examples-per-step more questions follow while some rank has fewer than its share
    of questions whose samples differ in reward, up to --dynamic-sampling-rounds more draws (every rank draws as
    many: the count is agreed). The first draw runs no collective: the run's last checkpoint is written meanwhile and
    committed at its end (Checkpointer.written_behind), before the draws' agreement or the training's collectives.
    Returns StepRollouts."""
    cfg = run.config
    position = step * cfg.examples_per_step if position is None else position
    saves = run.checkpointer.written_behind() if run.checkpointer else contextlib.nullcontext()  # bench_rl's: none
    with saves:
        drawn = sample_draw(run, step, position, 0)
    for draw in range(1, 1 + cfg.dynamic_sampling_rounds if cfg.dynamic_sampling else 1):
        if not any_rank(sum(map(has_signal, drawn)) < run.examples_per_rank, run.reduce_device):
            break
        drawn += sample_draw(run, step, position + draw * cfg.examples_per_step, draw)
    draws = len(drawn) // run.examples_per_rank
    trained = step_questions(drawn, run.examples_per_rank) if cfg.dynamic_sampling else drawn
    return StepRollouts(trained, drawn, position + draws * cfg.examples_per_step)


def sample_draw(run, step, position, draw):
    """This rank's questions at data position `position`, sampled and rewarded (the `draw`-th of the step), in the
    plan's rollout dtype (the engine's spec). Out of memory, the engine gives back what it keeps from other rollouts,
    then halves its rows (within_memory)."""
    cfg = run.config
    indices = question_indices_at(position, run.examples_per_rank, run.rank, run.world_size, len(run.train_task))
    sampling = Sampling(num_samples=cfg.num_samples, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                        top_k=cfg.top_k)
    run.model.eval()
    return sample_questions(run.engine, run.train_task, indices, [question_seed(step, i, draw) for i in indices],
                            sampling, scale_by_std=cfg.advantage_std, label=f"step {step} rollouts", within_memory=True)


@dataclass
class TrainResult:
    """What one step's training did on this rank."""
    first: TrainStats       # the on-policy epoch: entropy, trained rows, the sampled tokens' log-probabilities
    last: TrainStats        # the last epoch run: PPO's clipped fraction and KL from the old policy
    grad_norm: float        # the on-policy gradient's norm, as nanochat logs it
    last_grad_norm: float   # the last epoch's
    lrm: float
    stepped: bool           # every epoch's optimizer step was taken (finite loss and gradient on all ranks)


def train_on_rollouts(run, rollouts, step, share_prompt=True, skip_zero_advantage=True):
    """--ppo-epochs optimizer steps on these rollouts (nanochat: 1). The first epoch is on-policy and records
    the sampled tokens' log-probabilities; later epochs clip the ratio to them. A non-finite epoch ends the step.
    share_prompt, skip_zero_advantage: accumulate_policy_gradient's (the same gradient either way; False: nanochat's
    work, each row's prompt in its own forward and every row trained)."""
    cfg = run.config
    training = run.training  # --rejected-tokens:
    batches, _ = without_rejected_tokens(run.model, [r.batch for r in rollouts], training.policy_loss, training.rows,
                                         run.device, autocast=run.autocast(), share_prompt=share_prompt,
                                         forward=training.forward)
    lrm = lr_multiplier(step, run.num_steps, cfg.lr_schedule, cfg.warmup_steps, cfg.final_lr_frac)
    counts = step_counts(batches, cfg.mask_truncated, run.reduce_device) if cfg.loss_norm != "pass" else None
    run.model.train()
    first = None
    for _ in range(cfg.ppo_epochs):
        def attempt(rows):
            run.model.zero_grad(set_to_none=True)  # what a failed attempt accumulated
            return accumulate_policy_gradient(run.model, batches, cfg.device_batch_size, run.examples_per_rank, run.device,
                                              autocast=run.autocast(), micro_batch_rows=rows, loss=training.policy_loss,
                                              counts=counts, reference=training.reference, first_epoch=first,
                                              forward=training.forward, share_prompt=share_prompt,
                                              skip_zero_advantage=skip_zero_advantage,
                                              teacher=run.teacher)
        last, rows = with_fewer_rows_on_oom(attempt, run.training.rows, "out of memory during training: "
                                            "retrying with {rows} rows per forward pass",
                                            free_memory=lambda: give_back_rollout_memory(run.engine))
        run.training = dataclasses.replace(run.training, rows=rows)  # fewer from here on, after an out-of-memory
        last_gnorm, stepped = guarded_step(run.model, run.optimizers, lrm, last.objective, run.reduce_device,
                                           loss_scale=training.loss_scale)
        if first is None:
            first, gnorm = last, last_gnorm
        if not stepped:
            break
    return TrainResult(first=first, last=last, grad_norm=gnorm, last_grad_norm=last_gnorm, lrm=lrm, stepped=stepped)


def count_bad_step(run, step, result):
    """Track consecutive steps whose update was skipped (non-finite); too many in a row end the run."""
    if result.stepped:
        run.progress.count_bad(True)
        return
    loss_scale = run.training.loss_scale
    overflow = loss_scale.overflow_note(step) if loss_scale else None
    if overflow:  # fp16: a smaller scale may fit; not a bad step
        print0(overflow)
        return
    bad = run.progress.count_bad(False)
    print0(f"warning: step {step} has a non-finite loss or gradient (objective {result.last.objective}, grad norm "
           f"{result.last_grad_norm}); skipping the optimizer step ({bad}/{run.config.max_bad_steps})")
    if bad >= run.config.max_bad_steps:
        saves = run.checkpointer  # alone, the last save may still be in flight (before_collective): the one to name
        last = saves.settled_last() if saves else None
        where = f"step {last} in {saves.checkpoint_dir}" if last is not None else "none saved yet"
        raise NonFiniteStepsError(bad, where)


def meta_data(run, step):
    return {"step": step, "model_config": run.model.meta_model_config(), "generation": run.model.generation.name,
            "user_config": run.user_config, "start_checkpoint": run.lineage.start_checkpoint,
            "history": run.progress.history, "eval_history": run.progress.eval_history, "run_id": run.lineage.run_id,
            "world_size": run.world_size, "segments": run.lineage.segments,
            "loss_scale": run.training.loss_scale.state_dict() if run.training.loss_scale else None,
            "data_position": run.progress.data_position,
            "teacher": run.teacher.checkpoint if run.teacher else None,
            "compile_auto": run.auto_compile.state() if run.auto_compile and run.plan.compile == "auto" else None}
