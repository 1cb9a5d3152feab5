"""
On-policy distillation's frozen teacher (--teacher): any checkpoint the project loads, of any depth or generation,
whose tokenizer is the student's (load_teacher; a resumed run's own teacher, as its meta records it), and its
no-grad forwards, run in the rollout dtype on the training forward's very inputs (each question's prompt once,
micro-batched as training, under its out-of-memory back-off), whose log-probabilities give each sampled token its
distillation term (nanochat/rl/objective.py).
"""

import time
from dataclasses import dataclass

import torch

from nanochat.checkpoints.loading import find_checkpoint, load_found
from nanochat.checkpoints.store import load_meta
from nanochat.errors import UserError
from nanochat.rl.config import parse_teacher
from nanochat.rl.objective import distill_sums
from nanochat.runtime.distributed import print0
from nanochat.runtime.dtypes import autocast_context

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


def find_teacher(config, resumed=None):
    """(checkpoint_dir, {source, model_tag, step}) of --teacher: a resumed run's own (`resumed`, its meta's
    "teacher": the checkpoint it was taught by, whatever is latest now), else --teacher resolved (a missing tag: the
    largest model; a missing step: the last). One find_checkpoint: the teacher's directory is listed once."""
    source, tag, step = ((resumed["source"], resumed["model_tag"], resumed["step"]) if resumed
                         else parse_teacher(config.teacher))
    checkpoint_dir, tag, step = find_checkpoint(source, tag, step)
    return checkpoint_dir, {"source": source, "model_tag": tag, "step": step}


def load_teacher(config, student, student_tokenizer, device, rollout_dtype, start=None, resumed=None):
    """The run's Teacher (--teacher; `resumed`: see find_teacher), on `device`, forwards in `rollout_dtype`
    (a torch dtype name); start: the student's checkpoint {source, model_tag, step} (its name in an error). A
    teacher trained with another tokenizer than the student's is refused in one line naming both, before its
    weights load: a model's vocabulary size is its tokenizer's (the base directory's tokenizer
    serves every checkpoint of a run), and the loaded tokenizers are compared too."""
    checkpoint_dir, checkpoint = find_teacher(config, resumed)
    vocab = load_meta(checkpoint_dir, checkpoint["step"]).get("model_config", {}).get("vocab_size")
    name = f"{checkpoint['source']}:{checkpoint['model_tag']}:{checkpoint['step']}"
    student_name = (":".join(str(start[k]) for k in ("source", "model_tag", "step")) if start else config.source) + \
        f" (vocab {student.config.vocab_size})"
    if vocab != student.config.vocab_size:
        raise UserError(f"the teacher {name} was trained with another tokenizer (vocab {vocab}) than the student "
                        f"{student_name}; a teacher must share the student's tokenizer")
    model, tokenizer, _ = load_found(checkpoint_dir, checkpoint["step"], device, "eval")
    if not same_tokenizer(tokenizer, student_tokenizer):
        raise UserError(f"the teacher {name}'s tokenizer encodes otherwise than the student {student_name}'s; a "
                        f"teacher must share the student's tokenizer")
    model.requires_grad_(False)
    print0(f"distillation: teacher {name} (d{model.config.n_layer}, "
           f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters) on every rank")
    return Teacher(model, autocast_context(torch.device(device), getattr(torch, rollout_dtype)), checkpoint)
