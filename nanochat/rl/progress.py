"""
What a run says as it goes: each step's record (its metrics over all ranks, logged to wandb and kept for the
report) and log line, with the ETA, the warnings of a run that has nothing to learn from, and (--save-rollouts)
every sample it drew, as JSON lines beside its checkpoints.
"""

import glob
import json
import os
import time
from dataclasses import dataclass, field

from nanochat.files import atomic_write
from nanochat.optim.loss_scale import scale_text
from nanochat.rl.metrics import drop_unmeasured, objective_metrics, reduce_metrics, rollout_metrics
from nanochat.rl.rollout import Sampling
from nanochat.runtime.distributed import print0


def is_eval_step(step, num_steps, eval_every):
    """pass@k is evaluated every eval_every steps from step 0, and after the last update (step num_steps)."""
    return eval_every > 0 and (step % eval_every == 0 or step == num_steps)


def is_save_step(step, num_steps, save_every):
    """A checkpoint is saved every save_every steps after step 0, and after the last step (num_steps - 1)."""
    return (save_every > 0 and step > 0 and step % save_every == 0) or step == num_steps - 1


def format_duration(seconds):
    """12.3 -> '12s', 754 -> '12m34s', 7500 -> '2h05m'."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def remaining_seconds(step_seconds, steps_left, eval_seconds=(), evals_left=0):
    """Time left in a run, as (training, eval) seconds: steps_left steps at the mean of step_seconds (each
    step's rollout + training + optimizer time, evals excluded), and evals_left evals at the mean of
    eval_seconds (0 until an eval has been timed). An eval takes far longer than a step, so counting it as
    step time would inflate the estimate many times over at the start of a run."""
    train = steps_left * sum(step_seconds) / len(step_seconds) if step_seconds else 0.0
    evals = evals_left * sum(eval_seconds) / len(eval_seconds) if eval_seconds else 0.0
    return train, evals


def step_record(run, step, rollouts, result, t_rollout, t_train, trained=None, t_teacher=None):
    """The step's metrics over all ranks, as logged to wandb and kept in the run's history. rollouts: every question
    the step sampled; trained: those it trained on, when --dynamic-sampling drew more (its count is logged);
    t_teacher: with --teacher, its forwards' seconds (within t_train)."""
    compiled = run.compile_clock.lap()  # graphs compiled and their calls' seconds, since the last record
    metrics = drop_unmeasured(reduce_metrics(
        {**rollout_metrics([r.rewards for r in rollouts], [r.completions for r in rollouts], run.config.max_new_tokens,
                           prompt_lengths=[r.prompt_length for r in rollouts], rows_trained=result.first.rows_trained),
         **objective_metrics(result.first, result.last), "captures": float(run.engine.last_stats.captures),
         "compiles": float(compiled[0]), "compile_s": compiled[1],
         **({"questions_trained": float(len(trained))} if run.config.dynamic_sampling else {})},
        run.reduce_device))
    num_tokens = metrics["completion_len_mean"] * metrics["num_samples"]  # generated this step, all ranks
    return {"step": step, **metrics, "reward": metrics["reward_mean"], "sequence_length": metrics["seq_len_mean"],
            "completion_length": metrics["completion_len_mean"], "lrm": result.lrm, "grad_norm": result.grad_norm,
            "time/rollout": t_rollout, "time/train": t_train, "rollout_tokens_per_s": num_tokens / max(t_rollout, 1e-9),
            **({"time/teacher": t_teacher} if t_teacher is not None else {}),
            **(run.training.loss_scale.record() if run.training.loss_scale else {})}  # fp16: the same on every rank


def report_step(run, step, outcome, run_start):
    """A step's record (step_record of its StepOutcome) kept in the run's progress with the step's seconds, its line
    printed (elapsed since time.time() was run_start), a no-signal streak warned of, its samples saved
    (--save-rollouts). Returns the record, for wandb."""
    record = step_record(run, step, outcome.drawn, outcome.result, outcome.t_rollout, t_train=outcome.t_train,
                         trained=outcome.trained, t_teacher=outcome.t_teacher)
    # the ETA's seconds: compiling is one-off
    run.progress.record_step(record, max(outcome.t_rollout + outcome.t_train - record["compile_s"], 0.0))
    print0(format_step_line(run, record, time.time() - run_start))
    run.progress.count_no_signal(record, run.config.no_signal_steps)
    if run.rollout_log:
        run.rollout_log.append(step, outcome.drawn)
    return record


def format_step_line(run, m, elapsed):
    """The step's log line (m: its step_record): nanochat's first fields as nanochat prints them, then what a reader
    needs to trust it, each field named as nanochat names its own ("Name: value", words a reader without the README
    can follow; fractions of questions, samples or tokens in %), a field only where it measures something on this
    run (the CUDA graphs captured where a step captured some, PPO's and the KL penalty's with those options, ...).
    wandb and the history keep their keys (step_record's), reward_std too, which the line leaves out: with 0/1 rewards
    it is sqrt(p (1 - p)) of the average reward p."""
    step, num_steps = m["step"], run.num_steps
    eta_train, eta_eval = remaining_seconds(
        run.progress.step_seconds, num_steps - step - 1, run.progress.eval_seconds,
        sum(is_eval_step(s, num_steps, run.config.eval_every) for s in range(step + 1, num_steps + 1)))
    fields = [f"Step {step}/{num_steps}", f"Average reward: {m['reward_mean']:.4f}",
              f"Average sequence length: {m['seq_len_mean']:.2f}",
              f"Average completion length: {m['completion_len_mean']:.2f} ({m['completion_len_min']:.0f}-"
              f"{m['completion_len_max']:.0f}, {m['truncated_fraction']:.0%} cut off)",
              f"No-signal questions: {m['zero_std_fraction']:.0%}",
              f"Calculator: {m['tool_calls_per_sample']:.2f} calls a sample"
              + (f", {m['tool_success_fraction']:.0%} ok" if m["num_tool_calls"] else "")]  # ok of no call: nothing
    if "questions_trained" in m:  # --dynamic-sampling
        fields.append(f"Questions: {m['num_questions']:.0f} drawn, {m['questions_trained']:.0f} trained")
    fields.append(f"Rows trained: {m['rows_trained']:.0f}/{m['num_samples']:.0f}")
    if "entropy" in m:  # none where no row was trained
        fields.append(f"Entropy: {m['entropy']:.3f}")
    fields += [f"Grad norm: {m['grad_norm']:.3f}", f"LR multiplier: {m['lrm']:.3f}"]
    if "loss_scale" in m:  # --dtype=float16
        fields.append(f"Loss scale: {scale_text(m['loss_scale'])}"
                      + (" (overflow: step skipped, scale halved)" if m["overflow"] else ""))
    if "clip_fraction" in m:  # --ppo-epochs >= 2
        fields.append(f"PPO clipped: {m['clip_fraction']:.1%}, KL to the old policy {m['approx_kl']:.2e}")
    if "kl_ref" in m:  # --kl-coef
        fields.append(f"KL to the reference: {m['kl_ref']:.2e}")
    if "reverse_kl" in m:  # --teacher
        fields.append(f"Teacher: reverse KL {m['reverse_kl']:.3e}, log-prob {m['teacher_logprob']:.3f}, "
                      f"{m['time/teacher']:.2f}s")
    if m.get("sampler_tokens"):  # on the steps that trained a token
        corrected = run.config.rollout_correction != "none"
        fields.append(f"Sampler gap: mean {m['sampler_gap_mean']:.1e}, max {m['sampler_gap_max']:.1e}, "
                      f"KL {m['sampler_k3']:.1e}" + (f", {m['corrected_fraction']:.1%} corrected" if corrected else ""))
    fields += [f"Rollout: {m['time/rollout']:.1f}s, {m['rollout_tokens_per_s']:.0f} tok/s"
               + (f", {m['captures']:.0f} CUDA graphs captured" if m.get("captures") else ""),
               f"Training: {m['time/train']:.1f}s"]
    if m.get("compiles"):
        fields.append(f"Compiled: {m['compiles']:.0f} graphs in {m['compile_s']:.1f}s")
    fields += [f"Elapsed: {format_duration(elapsed)}",
               f"ETA: {format_duration(eta_train)}" + (f" + {format_duration(eta_eval)} of evals" if eta_eval else "")]
    return " | ".join(fields)


def sample_table(run, rollout):
    """(question, completion, reward) rows of one question's samples, for wandb."""
    question = run.train_task[rollout.index]["messages"][0]["content"]
    return [(question, text, reward) for text, reward in zip(rollout.texts, rollout.rewards)]


def no_signal_settings(cfg):
    """A warning line for each setting under which every advantage is 0, so that no step trains anything."""
    same = "every sample of a question is the same completion, so every advantage is 0 and the run trains nothing"
    lines = []
    if cfg.temperature == 0:
        lines.append(f"warning: --temperature=0 samples greedily: {same}; sample with --temperature="
                     f"{Sampling.temperature} (nanochat's)")
    if cfg.top_k == 1:
        lines.append(f"warning: --top-k=1 always takes the most likely token: {same}; use --top-k={Sampling.top_k} "
                     f"(nanochat's) or 0")
    if cfg.num_samples == 1:
        lines.append(f"warning: --num-samples=1: a question's one sample is its own mean reward, so every advantage is "
                     f"0 and the run trains nothing; sample several completions per question (nanochat: --num-samples="
                     f"{Sampling.num_samples})")
    return lines


@dataclass
class RunProgress:
    """What changes from step to step, changed only through its methods; every checkpoint's meta records the run's
    history, eval history and data position, from which --resume restores them (RunProgress.restored)."""
    data_position: int = 0   # the next step's first question's position in the walk over the split
    history: list = field(default_factory=list)          # per-step metrics, for the report
    eval_history: list = field(default_factory=list)     # (step, pass@k dict)
    consecutive_bad: int = 0                              # steps in a row whose update was skipped (non-finite)
    steps_without_signal: list = field(default_factory=list)  # records of the current streak of steps that trained no row
    step_seconds: list = field(default_factory=list)     # this process's timings, for the ETA, compiling left out
    eval_seconds: list = field(default_factory=list)

    @classmethod
    def restored(cls, meta, start_step, examples_per_step):
        """A resumed run's progress, from its checkpoint's meta: without --dynamic-sampling the data position is always
        start_step * --examples-per-step; with it, what the resumed step left."""
        return cls(data_position=meta.get("data_position", start_step * examples_per_step),
                   history=list(meta.get("history", [])), eval_history=[tuple(e) for e in meta.get("eval_history", [])])

    def advance(self, position):
        """The data position of the next step's first question."""
        self.data_position = position

    def record_step(self, record, seconds):
        """A step's record (step_record) and its seconds, compiling left out (the ETA's: compiling is one-off)."""
        self.history.append(record)
        self.step_seconds.append(seconds)

    def record_eval(self, step, passk, seconds):
        """An eval's pass@k (a dict) and its seconds, compiling left out."""
        self.eval_history.append((step, passk))
        self.eval_seconds.append(seconds)

    def count_bad(self, stepped):
        """The steps in a row whose update was skipped, this one counted (0 once a step is taken)."""
        self.consecutive_bad = 0 if stepped else self.consecutive_bad + 1
        return self.consecutive_bad

    def count_no_signal(self, record, every):
        """Track consecutive steps that trained no row (every advantage 0 on every rank); every `every`
        (--no-signal-steps) of them in a row, one warning naming the likely cause. The run goes on: a later step may
        find a signal."""
        if record["rows_trained"] > 0 or every == 0:
            self.steps_without_signal.clear()
            return
        streak = self.steps_without_signal
        streak.append(record)
        if len(streak) % every:
            return
        rewards = [r["reward_mean"] for r in streak[-every:]]
        if max(rewards) == 0:
            cause = ("no sample earned any reward: the task is too hard for this model (start from a stronger "
                     "checkpoint, or an easier --task)")
        else:
            cause = (f"every question's samples earned the same reward (mean {sum(rewards) / len(rewards):.3f}): the "
                     f"samples are too alike (raise --temperature or --top-k, or --num-samples) or the task's reward "
                     f"does not vary")
        print0(f"warning: no row was trained in {len(streak)} consecutive step{'s' * (len(streak) > 1)} (steps "
               f"{streak[0]['step']}-{streak[-1]['step']}): {cause}")


ROLLOUTS_FILE = "rollouts_rank{rank}.jsonl"


def rollout_lines(step, rollouts):
    """This rank's samples of `step` (its QuestionRollouts), a JSON object per line."""
    return "".join(json.dumps({"step": step, "question": r.index, "sample": j, "text": text, "reward": reward,
                               "advantage": advantage, "length": len(c.tokens), "ended": c.ended,
                               "tool_calls": c.tool_calls, "tool_successes": c.tool_successes}) + "\n"
                   for r in rollouts
                   for j, (c, text, reward, advantage) in enumerate(zip(r.completions, r.texts, r.rewards,
                                                                         r.advantages.tolist())))


def drop_rollouts_after(checkpoint_dir, step):
    """On --resume of `step` (rank 0, before any step runs): the rollout files of the run keep only the lines of
    steps up to it, which the continuation then extends; a line a crash cut short goes too."""
    for path in glob.glob(os.path.join(glob.escape(checkpoint_dir), ROLLOUTS_FILE.format(rank="*"))):
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
        kept = []
        for line in lines:
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line + b"\n")
            except (ValueError, KeyError):
                pass  # the cut end of a line a crash interrupted (or the empty string after the last newline)
        atomic_write(path, b"".join(kept))


class RolloutLog:
    """--save-rollouts: this rank's samples appended to <checkpoint dir>/rollouts_rank<r>.jsonl (one file per rank:
    no gather, and each rank's questions are its own). A step's lines go in one write, flushed and fsynced, so a
    reader sees whole steps but for the one being written; a new run starts the file afresh."""

    def __init__(self, checkpoint_dir, rank, resumed):
        self.path = os.path.join(checkpoint_dir, ROLLOUTS_FILE.format(rank=rank))
        if not resumed:
            atomic_write(self.path, b"")

    def append(self, step, rollouts):
        with open(self.path, "ab") as f:
            f.write(rollout_lines(step, rollouts).encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
