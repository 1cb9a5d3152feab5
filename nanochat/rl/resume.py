"""
Where a run starts: a new run from a --source checkpoint (its output directory refused if another run holds it,
unless --overwrite), or --resume of a saved RL step, with the run's own settings and optimizer state put back so
that the continuation is the run it was, on any number of ranks that divides its --examples-per-step; the model it
starts from (load_start) and, for --kl-coef, the frozen reference (load_reference); for --teacher, on-policy
distillation's frozen teacher (load_teacher: any checkpoint the project loads, of any depth or generation, whose
tokenizer is the student's; a resumed run's own), whose no-grad forwards run in the rollout dtype on the training
forward's very inputs (each question's prompt once, micro-batched as training, under its out-of-memory back-off).
"""

import contextlib
import os
import time
from dataclasses import dataclass

import torch

from nanochat.checkpoints.errors import CheckpointError
from nanochat.checkpoints.layout import CHECKPOINT_DIRS
from nanochat.checkpoints.loading import find_checkpoint, load_model
from nanochat.checkpoints.optimizer_shards import optimizer_states_for_resume
from nanochat.checkpoints.store import list_steps, list_tags, load_meta, make_checkpoint_dir
from nanochat.common import get_base_dir
from nanochat.errors import UserError
from nanochat.rl.config import parse_teacher, resolve_output_tag
from nanochat.rl.objective import distill_sums
from nanochat.runtime.distributed import print0
from nanochat.runtime.dtypes import autocast_context

# flags that do not define the run: --resume keeps them as given (the rest it restores from the checkpoint)
RUNTIME_FLAGS = ("run", "device_type", "resume", "overwrite", "debug", "max_rows", "memory_budget_gb", "max_bad_steps",
                 "output_tag", "decode", "compile", "keep_last", "no_signal_steps",  # a resumed run writes to its own directory
                 "decode_kernels",  # the decode step: the same tokens from each (up to near-ties), the machine decides
                 "train_rows",  # the same gradient for any value: the machine's memory decides
                 "save_rollouts")  # what is written beside the run, not what it computes


class ResumeError(UserError):
    """What --resume names cannot be continued. The message states the facts (the runs, the saved steps); nanochat.cli
    adds the flag (with the value given, `spec`, where its form is the problem) and the fix: `fix` is "new run" (start
    one without resuming), "overwrite" (start a new run over it), "saved step" (name one of `steps`, run `tag`'s saved
    steps) or "another step" (resume one of `steps` but `step`, or start over); None: the facts say it."""

    def __init__(self, facts, fix=None, spec=None, tag=None, step=None, steps=()):
        super().__init__(facts)
        self.fix, self.spec, self.tag, self.step, self.steps = fix, spec, tag, step, list(steps)


class NoStartCheckpointError(UserError):
    """A KL penalty for a resumed run whose meta, written before the penalty existed, names no starting checkpoint."""

    def __init__(self):
        super().__init__("a KL penalty needs the checkpoint the run started from, and this run's meta does not record it")


class RunExistsError(UserError):
    """A new run's directory holds another run (nanochat.cli adds the flags that continue, replace or avoid it)."""

    def __init__(self, checkpoint_dir, files):
        super().__init__(f"{checkpoint_dir} already holds an RL run ({len(files)} files)")
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

    @contextlib.contextmanager
    def errors(self):
        """A checkpoint that cannot be read: a ResumeError, whose fix is --resume's (the loader's would name
        --model-step, which --resume does not read)."""
        try:
            yield
        except CheckpointError as e:
            raise ResumeError(str(e), fix="another step", tag=self.tag, step=self.step,
                              steps=list_steps(self.checkpoint_dir)) from e


def restore_settings(config, world_size):
    """--resume, from the step's meta alone, before any process group or model: the run's saved settings put back
    into the config (only RUNTIME_FLAGS stay as given), so the continuation is the run it was, and checked against
    this run's number of ranks, which may differ from the run's (the optimizer state is then re-split, see
    restore_optimizers). Returns (the restored RLConfig, the Resume)."""
    tag, step = resolve_resume(config.resume)
    checkpoint_dir = os.path.join(get_base_dir(), CHECKPOINT_DIRS["rl"], tag)
    resume = Resume(tag=tag, step=step, checkpoint_dir=checkpoint_dir, meta={})
    with resume.errors():
        resume.meta = load_meta(checkpoint_dir, step)
    saved = {k: v for k, v in resume.meta.get("user_config", {}).items() if k not in RUNTIME_FLAGS}
    changed = sorted(k for k, v in saved.items() if getattr(config, k, v) != v)
    if changed:
        print0(f"--resume: using the run's saved settings for {', '.join(changed)}")
    config = config.restored(saved)
    config.check_ranks(world_size, resumed=tag)
    return config, resume


def restore_optimizers(resume, optimizers, meta, rank, world_size, device):
    """Load the optimizer state of the resumed step into `optimizers`: every rank's shard checked (present, readable,
    of this step, rank and run) before any is used, and when the step was saved by another number of ranks, all of
    them gathered and re-split for this one. A fault is one line on every rank and nothing is written. Returns the
    number of ranks that saved the step."""
    with resume.errors():
        states, saved = optimizer_states_for_resume(resume.checkpoint_dir, resume.step, device, meta, optimizers,
                                                    rank, world_size)
    for opt, state in zip(optimizers, states):
        opt.load_state_dict(state)  # also restores each group's initial_lr and lr
    if saved != world_size:
        print0(f"--resume: the optimizer state of {saved} rank{'s' * (saved != 1)} re-split for {world_size}")
    return saved


def start_new_run(config, device):
    """The --source checkpoint a new run starts from. Returns (model, tokenizer, meta, the run's output tag)."""
    _, source_tag, source_step = find_checkpoint(config.source, config.model_tag, config.model_step)
    # from an RL run the tag is known (and the source run refused) before loading; else it may need the depth
    output_tag = resolve_output_tag(config, source_tag, depth=None) if config.source == "rl" else None
    model, tokenizer, meta = load_model(config.source, device, phase="eval", model_tag=source_tag, step=source_step,
                                        generation=config.model_generation)
    output_tag = output_tag or resolve_output_tag(config, source_tag, model.config.n_layer)
    meta["start_checkpoint"] = {"source": config.source, "model_tag": source_tag, "step": source_step}
    print0(f"Starting a new RL run from {config.source} {source_tag} step {source_step}; writing to {output_tag}")
    return model, tokenizer, meta, output_tag


def prepare_output_dir(checkpoint_dir, overwrite, master):
    """Refuse to silently mix a new run into an old run's directory; --overwrite clears the old run first
    (so the loader's 'last step' cannot pick one of its checkpoints)."""
    old = [f for f in (os.listdir(checkpoint_dir) if os.path.isdir(checkpoint_dir) else [])
           if f.startswith(("model_", "meta_", "optim_", "rollouts_"))]
    make_checkpoint_dir(checkpoint_dir)  # fail now, not after an hour of training, if it cannot be written
    if not old:
        return
    if not overwrite:
        raise RunExistsError(checkpoint_dir, old)
    if master:
        for f in old:
            os.remove(os.path.join(checkpoint_dir, f))


def load_start(config, resume, device):
    """The model the run starts from: a new run's (start_new_run), or `resume`'s step (restore_settings' Resume).
    Returns (model, tokenizer, meta, output tag, start step)."""
    if not resume:
        return (*start_new_run(config, device), 0)
    with resume.errors():
        model, tokenizer, meta = load_model("rl", device, phase="eval", model_tag=resume.tag, step=resume.step)
    print0(f"Resuming RL run {resume.tag} after step {resume.step}")
    return model, tokenizer, meta, resume.tag, resume.step + 1


def load_reference(start, device, generation):
    """The frozen model of --kl-coef's penalty: the checkpoint the run started from (start: its source, tag and
    step, as recorded in the run's meta), so a resumed run is penalized towards the same model."""
    if start is None:
        raise NoStartCheckpointError()
    reference, _, _ = load_model(start["source"], device, phase="eval", model_tag=start["model_tag"], step=start["step"],
                                 generation=generation)
    reference.requires_grad_(False)
    return reference


# a text whose encoding tells two tokenizers apart where their vocabularies' sizes and special tokens agree
TOKENIZER_PROBE = "The teacher's tokens: 12 + 7 = 19, <<12+7=19>> #### 19. Ünïcödé and     spaces\n\t!"


@dataclass
class Teacher:
    """The frozen teacher of a run: its model (fp32 weights, no grad), the autocast of its forwards (the rollout
    dtype's) and the checkpoint it is ({source, model_tag, step}, as the run's meta records it)."""
    model: torch.nn.Module
    autocast: object
    checkpoint: dict
    seconds: float = 0.0  # its forwards' seconds in the current step (take_seconds)

    def logprobs(self, forward, inputs):
        """(N,) the teacher's log-probabilities of a chunk's sampled tokens: `forward` (the training pass's chunk
        forward) of the teacher on the training forward's `inputs`, no grad, in the rollout dtype, timed."""
        start = _now(self.model)
        with torch.no_grad(), self.autocast:
            logp = forward(self.model, *inputs)[0]
        self.seconds += _now(self.model) - start
        return logp

    def chunk_logprobs(self, logp, tokens, first, tally, forward):
        """(teacher logp, student logp), each (N,) detached, of a training chunk's tokens (policy_gradient's _Tokens;
        tally: its epoch's _Tally; forward: its chunk forward), for their distillation term; (None, None) where the
        epoch keeps no teacher values (distill_coef 0). The first epoch runs the teacher on the training forward's
        inputs, keeps its values (the later epochs read them back, with the first epoch's logp: the advantage is the
        step's) and sums the reverse KL; the student's is this forward's (nanochat/rl/objective.py says why)."""
        if tally.teacher_logprobs is None:
            return None, None
        if not first:
            return tokens.gather(tally.teacher_logprobs), tokens.gather(tally.old_logprobs)
        teacher_logp = self.logprobs(forward, tokens.forward_inputs).float()  # (N,)
        tokens.store(tally.teacher_logprobs, teacher_logp)
        sums = distill_sums(logp, teacher_logp)
        tally.distill = sums if tally.distill is None else tally.distill + sums
        return teacher_logp, logp.detach()

    def take_seconds(self):
        """The teacher's seconds since the last call (a step's), and restart the count."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _now(model):
    """Seconds, the device's queued work done first on CUDA (a step's teacher seconds are its own, not the
    queue's). One sync a chunk: distillation's cost, not the default run's."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def same_tokenizer(a, b):
    """Whether two tokenizers encode alike: vocabulary size, special tokens and a probe text's tokens."""
    return (a.get_vocab_size() == b.get_vocab_size() and a.get_special_tokens() == b.get_special_tokens()
            and a.encode(TOKENIZER_PROBE) == b.encode(TOKENIZER_PROBE))


def teacher_checkpoint(config, resumed=None):
    """{source, model_tag, step} of --teacher: a resumed run's own (`resumed`, its meta's "teacher": the checkpoint
    it was taught by, whatever is latest now), else --teacher resolved (a missing tag: the largest model; a missing
    step: the last)."""
    if resumed:
        return dict(resumed)
    source, tag, step = parse_teacher(config.teacher)
    _, tag, step = find_checkpoint(source, tag, step)
    return {"source": source, "model_tag": tag, "step": step}


def load_teacher(config, student, student_tokenizer, device, rollout_dtype, start=None, resumed=None):
    """The run's Teacher (--teacher; `resumed`: see teacher_checkpoint), on `device`, forwards in `rollout_dtype`
    (a torch dtype name); start: the student's checkpoint {source, model_tag, step} (its name in an error). A
    teacher trained with another tokenizer than the student's is refused in one line naming both, before its
    weights load: a model's vocabulary size is its tokenizer's (the base directory's tokenizer
    serves every checkpoint of a run), and the loaded tokenizers are compared too."""
    checkpoint = teacher_checkpoint(config, resumed)
    checkpoint_dir, _, _ = find_checkpoint(checkpoint["source"], checkpoint["model_tag"], checkpoint["step"])
    vocab = load_meta(checkpoint_dir, checkpoint["step"]).get("model_config", {}).get("vocab_size")
    name = f"{checkpoint['source']}:{checkpoint['model_tag']}:{checkpoint['step']}"
    student_name = (":".join(str(start[k]) for k in ("source", "model_tag", "step")) if start else config.source) + \
        f" (vocab {student.config.vocab_size})"
    if vocab != student.config.vocab_size:
        raise UserError(f"the teacher {name} was trained with another tokenizer (vocab {vocab}) than the student "
                        f"{student_name}; a teacher must share the student's tokenizer")
    model, tokenizer, _ = load_model(checkpoint["source"], device, phase="eval", model_tag=checkpoint["model_tag"],
                                     step=checkpoint["step"], generation=None)
    if not same_tokenizer(tokenizer, student_tokenizer):
        raise UserError(f"the teacher {name}'s tokenizer encodes otherwise than the student {student_name}'s; a "
                        f"teacher must share the student's tokenizer")
    model.requires_grad_(False)
    print0(f"distillation: teacher {name} (d{model.config.n_layer}, "
           f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters) on every rank")
    return Teacher(model, autocast_context(torch.device(device), getattr(torch, rollout_dtype)), checkpoint)
