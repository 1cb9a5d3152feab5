"""
Where a run starts: a new run from a --source checkpoint (its output directory refused if another run holds it,
unless --overwrite, and checked writable, before anything loads: run_target), or --resume of a saved RL step, with
the run's own settings and optimizer state put back so that the continuation is the run it was (a flag they
replace said by name, a longer run refused, a finished run said finished), on any number of ranks that divides its
--examples-per-step; the model it starts from (load_start) and, for --kl-coef, the frozen reference (load_reference).
A --teacher's model is nanochat/rl/teacher.py's.
"""

import contextlib
import dataclasses
import os
import re
import shlex
from dataclasses import dataclass, field

from nanochat.checkpoints.errors import CheckpointError
from nanochat.checkpoints.layout import CHECKPOINT_DIRS, meta_path
from nanochat.checkpoints.loading import find_checkpoint, load_model
from nanochat.checkpoints.optimizer_shards import optimizer_states_for_resume
from nanochat.checkpoints.store import list_steps, list_tags, load_meta, make_checkpoint_dir
from nanochat.common import get_base_dir
from nanochat.errors import UserError
from nanochat.files import check_writable_dir
from nanochat.rl.config import RLConfig, resolve_output_tag
from nanochat.rl.progress import is_eval_step
from nanochat.rl.teacher import find_teacher
from nanochat.runtime.distributed import print0
from tasks.registry import make_task

# flags that do not define the run: --resume keeps them as given (the rest it restores from the checkpoint)
RUNTIME_FLAGS = ("run", "device_type", "resume", "overwrite", "debug", "max_rows", "memory_budget_gb", "max_bad_steps",
                 "output_tag", "decode", "compile", "keep_last", "no_signal_steps",  # a resumed run writes to its own directory
                 "decode_kernels",  # the decode step: the same tokens from each (up to near-ties), the machine decides
                 "train_rows",  # the same gradient for any value: the machine's memory decides
                 "save_rollouts")  # what is written beside the run, not what it computes
# what the command that trains a run further (a new run from its last checkpoint) sets itself: the checkpoint it starts
# from, its length, its directory (<tag>_cont); or cannot take along: --resume, --overwrite
FURTHER_RUN_SETS = ("source", "model_tag", "model_step", "model_generation", "output_tag", "num_steps", "num_epochs",
                    "resume", "overwrite")
RUN_FILE_PREFIXES = ("model_", "meta_", "optim_", "rollouts_")  # an RL run's files in its directory


class ResumeError(UserError):
    """What --resume names cannot be continued. The message states the facts (the runs, the saved steps); nanochat.cli
    adds the flag (with the value given, `spec`, where its form is the problem) and the fix: `fix` is "new run" (start
    one without resuming), "overwrite" (start a new run over it), "saved step" (name one of `steps`, run `tag`'s saved
    steps) or "another step" (resume one of `steps` but `step`, or start over); None: the facts say it."""

    def __init__(self, facts, fix=None, spec=None, tag=None, step=None, steps=()):
        super().__init__(facts)
        self.fix, self.spec, self.tag, self.step, self.steps = fix, spec, tag, step, list(steps)


class LongerRunError(UserError):
    """A resumed run asked (by `setting` = `value`) for more steps than it planned: its learning rate decays over the
    steps it planned (`schedule`), so it is not lengthened; `further` is the command of a new run from its last step.
    The message states the facts; nanochat.cli writes the line with the flags."""

    def __init__(self, setting, value, tag, planned, schedule, further):
        super().__init__(f"run {tag} was planned with {planned} steps, over which its learning rate decays ({schedule} "
                         f"schedule), and a resumed run continues it to that end, not further")
        self.setting, self.value, self.tag, self.planned, self.schedule, self.further = (
            setting, value, tag, planned, schedule, further)


class NoStartCheckpointError(UserError):
    """A KL penalty for a resumed run whose meta, written before the penalty existed, names no starting checkpoint."""

    def __init__(self):
        super().__init__("a KL penalty needs the checkpoint the run started from, and this run's meta does not record it")


class TeacherInRunDirError(UserError):
    """The teacher's checkpoints are in the directory the new run would write its own into: its checkpoints would
    take the teacher's step numbers (and an overwrite delete the teacher), so a resumed run could not reload it."""

    def __init__(self, checkpoint_dir):
        super().__init__(f"the teacher's checkpoints are in {checkpoint_dir}, the directory this run would write its "
                         f"own into")


class RunExistsError(UserError):
    """A new run's directory holds another run, whose files it names (nanochat.cli adds the flags that continue,
    avoid or delete it)."""

    def __init__(self, checkpoint_dir, files):
        super().__init__(f"{checkpoint_dir} already holds an RL run, {describe_run_files(files)}")
        self.checkpoint_dir, self.files = checkpoint_dir, files


def resolve_resume(spec):
    """--resume value -> (tag, step) of the RL checkpoint to continue from."""
    rl_root = os.path.join(get_base_dir(), CHECKPOINT_DIRS["rl"])
    tag, _, step = spec.partition(":") if spec != "latest" else ("", "", "")
    if not tag:
        tags = list_tags(rl_root) if os.path.isdir(rl_root) else []
        if not tags:
            raise ResumeError(f"no RL run in {rl_root}", fix="new run")
        tag = max(tags, key=lambda t: os.path.getmtime(os.path.join(rl_root, t)))
    directory = os.path.join(rl_root, tag)
    if not os.path.isdir(directory):
        raise ResumeError(f"no RL run {tag!r} in {rl_root}; available: {', '.join(list_tags(rl_root)) or 'none'}")
    if step and not step.isdigit():
        raise ResumeError("the step after ':' must be a number", spec=spec)
    steps = list_steps(directory)  # checked here: the loader's own error would point at --model-step
    if not steps:
        raise ResumeError(f"the RL run {tag!r} in {rl_root} has no saved step", fix="overwrite")
    if step and int(step) not in steps:
        raise ResumeError(f"run {tag!r} has no step {int(step)}; saved steps: {', '.join(map(str, steps))}",
                          fix="saved step", spec=spec, tag=tag, steps=steps)
    return tag, int(step) if step else steps[-1]


@dataclass
class Resume:
    """The saved step --resume continues."""
    tag: str
    step: int
    checkpoint_dir: str
    meta: dict    # the step's meta json as saved
    num_steps: int = 0  # the run's planned number of steps (check_run_length)
    given: dict = field(default_factory=dict)  # the flags given with --resume: name -> value as the command line set it

    @contextlib.contextmanager
    def errors(self):
        """A checkpoint that cannot be read: a ResumeError, whose fix is --resume's (the loader's would name
        --model-step, which --resume does not read)."""
        try:
            yield
        except CheckpointError as e:
            raise ResumeError(str(e), fix="another step", tag=self.tag, step=self.step,
                              steps=list_steps(self.checkpoint_dir)) from e


def restore_settings(config, world_size, given=frozenset()):
    """--resume, from the step's meta alone, before any process group or model: the run's saved settings put back
    into the config (only RUNTIME_FLAGS stay as given), so the continuation is the run it was, and checked against
    this run's number of ranks, which may differ from the run's (the optimizer state is then re-split, see
    restore_optimizers). `given`: the flags on the command line (nanochat.cli.given_flags), each that a saved
    setting replaced said by name; a longer run than the saved one is refused (check_run_length). Returns (the
    restored RLConfig, the Resume)."""
    tag, step = resolve_resume(config.resume)
    checkpoint_dir = os.path.join(get_base_dir(), CHECKPOINT_DIRS["rl"], tag)
    resume = Resume(tag=tag, step=step, checkpoint_dir=checkpoint_dir, meta={},
                    given={k: getattr(config, k) for k in given})
    with resume.errors():
        resume.meta = load_meta(checkpoint_dir, step)
    saved = {k: v for k, v in resume.meta.get("user_config", {}).items() if k not in RUNTIME_FLAGS}
    restored = config.restored(saved)
    resume.num_steps = check_run_length(restored, resume.given, tag, resume.meta.get("teacher"))
    changed = sorted(k for k, v in saved.items() if getattr(config, k, v) != v)
    defaults = [f"{k}={saved[k]}" for k in changed if k not in given]
    print0(f"--resume: run {tag} continues with its saved settings"
           + (f" (where they differ from the defaults: {', '.join(defaults)})" if defaults else ""))
    for k in (k for k in changed if k in given):
        print0(f"{given_flag(k, getattr(config, k))} ignored: the run's saved {k}={saved[k]} is kept (--resume "
               f"continues a run with its own settings)")
    restored.check_ranks(world_size, resumed=tag)
    return restored, resume


def given_flag(name, value):
    """A flag as the command line gave it: --num-steps=5; --advantage-std (a switch)."""
    flag = "--" + name.replace("_", "-")
    return flag if value is True else f"{flag}={value}"


def planned_steps(config):
    """The number of steps of a run with these settings (RLConfig.run_length; the train split is read only where
    the run's length comes from --num-epochs)."""
    return config.run_length(0 if config.num_steps > 0 else len(make_task(config.task, "train")))


def check_run_length(restored, given, tag, taught_by=None):
    """The resumed run's number of steps. --resume does not lengthen a run: its learning rate's schedule (linear:
    down to 0 at the last step) is laid over the steps it planned, and a longer run would have taken its earlier
    steps at other rates; a --num-steps (or --num-epochs) that asks for more steps is refused, naming the new run
    from its last step that trains further (--source=rl). Fewer steps: the flag is ignored, as any other. `given`:
    the flags given (name -> value, Resume.given)."""
    planned = planned_steps(restored)
    length_flags = {k: v for k, v in given.items() if k in ("num_steps", "num_epochs")}
    if length_flags:
        asked = planned_steps(dataclasses.replace(restored, **length_flags))
        if asked > planned:
            setting = "num_steps" if "num_steps" in length_flags else "num_epochs"
            raise LongerRunError(setting, length_flags[setting], tag, planned, restored.lr_schedule,
                                 further=train_further_command(restored, tag, given, asked, taught_by))
    return planned


def train_further_command(config, tag, given, num_steps="N", taught_by=None):
    """The command of a new run from the last checkpoint of run `tag` (of settings `config`), written to <tag>_cont,
    that copied trains on as the run did, where the user ran it: the run's settings where they differ from the
    defaults, each flag given with --resume (`given`: name -> value) in place of the run's, less those the command
    sets itself (FURTHER_RUN_SETS); --teacher as the checkpoint that taught the run (`taught_by`, its meta's
    {source, model_tag, step}), not its tag's newest step."""
    if taught_by and "teacher" not in given:
        config = dataclasses.replace(config, teacher=":".join(str(taught_by[k]) for k in ("source", "model_tag",
                                                                                          "step")))
    defaults = RLConfig()
    names = [f.name for f in dataclasses.fields(config) if f.name not in FURTHER_RUN_SETS]
    flags = [given_flag(k, given.get(k, getattr(config, k))) for k in names
             if k in given or getattr(config, k) != getattr(defaults, k)]
    command = shlex.join(["python", "-m", "scripts.chat_rl", "--source=rl", f"--model-tag={tag}", *flags,
                          f"--num-steps={num_steps}"])
    return f"{command} (a new run, written to {tag}_cont)"


def finished_run(config, resume):
    """What to say, instead of training, of a resumed run that is finished: its last step saved and its final eval
    (where the run has one) recorded; None for a run with something left to do (a run killed during its final eval
    runs that eval again)."""
    num_steps = resume.num_steps
    final = [passk for step, passk in resume.meta.get("eval_history", []) if step == num_steps]
    if resume.step < num_steps - 1 or (is_eval_step(num_steps, num_steps, config.eval_every) and not final):
        return None
    task = f" --task={config.task}" if config.task != RLConfig().task else ""
    evaluated = f" and its final eval recorded (pass@1 {final[-1]['pass@1']:.4f})" if final else ""
    trained = f"all {num_steps} of its steps are trained" if num_steps > 1 else "its one step is trained"
    further = train_further_command(config, resume.tag, resume.given, taught_by=resume.meta.get("teacher"))
    return [f"Run {resume.tag} is finished: {trained}, the last (step {resume.step}) saved{evaluated}. Nothing to do.",
            f"  evaluate it:      python -m scripts.chat_eval --source=rl --model-tag={resume.tag}{task}",
            f"  train it further: {further}"]


def restore_optimizers(resume, optimizers, meta, rank, world_size, device):
    """Load the optimizer state of the resumed step into `optimizers`: every rank's shard checked (present, readable,
    of this step, rank and run) before any is used, and when the step was saved by another number of ranks, all of
    them gathered and re-split for this one. A fault is one line on every rank and nothing is written. Returns the
    number of ranks that saved the step."""
    with resume.errors():
        states, saved = optimizer_states_for_resume(resume.checkpoint_dir, resume.step, device, meta, optimizers,
                                                    rank=rank, world_size=world_size)
    for opt, state in zip(optimizers, states):
        opt.load_state_dict(state)  # also restores each group's initial_lr and lr
    if saved != world_size:
        print0(f"--resume: the optimizer state of {saved} rank{'s' * (saved != 1)} re-split for {world_size}")
    return saved


@dataclass
class Target:
    """Where a run starts and what it writes, settled before anything loads: the checkpoint it starts from (a new
    run's --source; a resumed run's step), its output tag and directory, checked writable, and the files of the old
    run there that --overwrite deletes once the new run has loaded (prepare_output_dir)."""
    source: str
    source_tag: str
    source_step: int
    output_tag: str
    checkpoint_dir: str
    old_files: list


def run_target(config, resume):
    """The run's Target, from the checkpoints' listing and metas (no model loaded): the refusals of a directory that
    holds another run (RunExistsError) or cannot be written come before the seconds of loading and timing."""
    if resume:
        source, source_tag, source_step, output_tag = "rl", resume.tag, resume.step, resume.tag
    else:
        source = config.source
        source_dir, source_tag, source_step = find_checkpoint(source, config.model_tag, config.model_step)
        output_tag = resolve_output_tag(config, source_tag, depth=recorded_depth(source_dir, source_step))
    checkpoint_dir = os.path.join(get_base_dir(), CHECKPOINT_DIRS["rl"], output_tag)
    old = [] if resume else run_files(checkpoint_dir)
    if not resume and config.teacher:
        teacher_dir, _ = find_teacher(config)
        if os.path.realpath(teacher_dir) == os.path.realpath(checkpoint_dir):
            raise TeacherInRunDirError(checkpoint_dir)
    if old and not config.overwrite:
        raise RunExistsError(checkpoint_dir, old)
    check_writable_dir(checkpoint_dir, "the run's checkpoints", "make it writable, or set NANOCHAT_BASE_DIR (or "
                       "--output-tag) to write elsewhere")
    return Target(source, source_tag, source_step, output_tag, checkpoint_dir, old_files=old)


def recorded_depth(checkpoint_dir, step):
    """The model's depth (n_layer) as the step's meta records it: d<depth> names a new run's directory."""
    n_layer = load_meta(checkpoint_dir, step).get("model_config", {}).get("n_layer")
    if not isinstance(n_layer, int):
        raise UserError(f"{meta_path(checkpoint_dir, step)}: model_config lacks n_layer; this is not a nanochat "
                        f"checkpoint meta file")
    return n_layer


def run_files(checkpoint_dir):
    """The files of an RL run in `checkpoint_dir` (checkpoints and --save-rollouts' files), in step order."""
    names = [f for f in (os.listdir(checkpoint_dir) if os.path.isdir(checkpoint_dir) else [])
             if f.startswith(RUN_FILE_PREFIXES)]
    return sorted(names, key=lambda f: (file_step(f) is None, file_step(f) or 0, f))


def file_step(name):
    """The step in a checkpoint file's name (model_000003.pt -> 3), or None (rollouts_rank0.jsonl)."""
    m = re.match(r"(?:model|meta|optim)_(\d+)", name)
    return int(m.group(1)) if m else None


def describe_run_files(files):
    """A run's files as a refusal and --overwrite say them: 'steps 1-3: 9 files (meta_000001.json, ...)'."""
    steps = sorted({s for s in map(file_step, files) if s is not None})
    shown = files if len(files) <= 6 else files[:3] + ["..."] + files[-2:]
    saved = f"step{'s' * (len(steps) > 1)} {step_ranges(steps)}" if steps else "no saved step"
    return f"{saved}: {len(files)} file{'s' * (len(files) > 1)} ({', '.join(shown)})"


def step_ranges(steps):
    """[1, 2, 3, 5, 60] -> '1-3, 5, 60'."""
    runs = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def prepare_output_dir(target, master):
    """A new run's directory, once the run has loaded: made (run_target's check made none), and --overwrite's old run
    in it deleted (rank 0; a failure before keeps it), said in one line, so that the loader's 'last step' cannot pick
    one of its checkpoints."""
    make_checkpoint_dir(target.checkpoint_dir)
    old = run_files(target.checkpoint_dir)
    if not old:
        return
    if master:
        for f in old:
            os.remove(os.path.join(target.checkpoint_dir, f))
    print0(f"--overwrite: deleted the RL run that was in {target.checkpoint_dir}, {describe_run_files(old)}")


def load_start(config, resume, target, device):
    """The model the run starts from: a new run's (the Target's source checkpoint), or `resume`'s step
    (restore_settings' Resume). Returns (model, tokenizer, meta, start step)."""
    if resume:
        with resume.errors():
            model, tokenizer, meta = load_model("rl", device, phase="eval", model_tag=resume.tag, step=resume.step)
        print0(f"Resuming RL run {resume.tag} after step {resume.step}")
        return model, tokenizer, meta, resume.step + 1
    model, tokenizer, meta = load_model(target.source, device, phase="eval", model_tag=target.source_tag,
                                        step=target.source_step, generation=config.model_generation)
    meta["start_checkpoint"] = {"source": target.source, "model_tag": target.source_tag, "step": target.source_step}
    print0(f"Starting a new RL run from {target.source} {target.source_tag} step {target.source_step}; writing to "
           f"{target.output_tag}")
    return model, tokenizer, meta, 0


def load_reference(start, device, generation):
    """The frozen model of --kl-coef's penalty: the checkpoint the run started from (start: its source, tag and
    step, as recorded in the run's meta), so a resumed run is penalized towards the same model."""
    if start is None:
        raise NoStartCheckpointError()
    reference, _, _ = load_model(start["source"], device, phase="eval", model_tag=start["model_tag"], step=start["step"],
                                 generation=generation)
    reference.requires_grad_(False)
    return reference
