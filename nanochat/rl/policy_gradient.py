"""
The training pass of one step on one rank: the step's trained rows, in question order, through the model in forwards
of up to micro_batch_rows rows that may span questions (each forward's prompts run once, right-padded together; each
row attends to its own prompt's keys, then its own), the sampled tokens' log-probabilities from the model's chunked
head, the objective of nanochat/rl/objective.py summed and backpropagated forward by forward (gradients accumulate;
the optimizer steps elsewhere), and what the pass saw (TrainStats). nanochat/diagnostics/train_count.py counts the
kernels of such a pass on the meta device.

Each forward's objective (_backward_chunk) is nanochat's on-policy term by default, the sum over its sampled tokens of
logp * A / D; each option is a function of its own composed onto it: a rollout correction's weights multiply it, a PPO
epoch after the first replaces it by its clipped term, the KL penalty is subtracted.
"""

import dataclasses
from dataclasses import dataclass, field

import torch

from nanochat.compiling.functions import maybe_compiled
from nanochat.rl.objective import (MASK_CORRECTIONS, PolicyLoss, QuestionRows, epoch_objective, per_token_values,
                                   rollout_correction_weights, sampler_gap, sampler_gap_sums, step_counts,
                                   trainable_targets)
from nanochat.runtime.device import to_device


@dataclass
class TrainStats:
    """What accumulate_policy_gradient did on this rank (one epoch)."""
    objective: float        # the objective summed over the rank's tokens (nanochat's sum of pass objectives by default)
    entropy: float          # mean policy entropy over the trained rows' sampled tokens (nan if none)
    rows_trained: int       # rows that went through forward and backward
    rows_total: int
    tokens: int = 0                 # sampled tokens of the trained rows
    clip_fraction: float = None     # PPO epochs after the first: tokens whose clipped term won (no gradient)
    approx_kl: float = None         # ... and mean of (rho - 1) - log rho: the k3 estimate of KL(old || current)
    kl_ref: float = None            # with kl_coef > 0: mean k3 KL(policy || reference) over the tokens
    old_logprobs: list = None       # first epoch: per question (R, T) logp of the sampled tokens (detached)
    ref_logprobs: list = None       # first epoch, kl_coef > 0: the reference's, likewise
    correction_weights: list = None  # first epoch, with a rollout correction: per question (R, T) its weights
    sampler_tokens: int = 0          # first epoch: trained tokens with a sampler log-probability, over which:
    sampler_gap_mean: float = 0.0    #   mean |logp - sampler logp|
    sampler_gap_max: float = 0.0     #   max |logp - sampler logp|
    sampler_k3: float = 0.0          #   mean k3 estimate of KL(sampler || trainer)
    corrected_fraction: float = 0.0  #   tokens the rollout correction changed (token-tis: capped; sequence-mask: dropped)
    teacher_logprobs: list = None    # first epoch, with a teacher: per question (R, T) its log-probabilities
    reverse_kl: float = None         # first epoch, with a teacher: mean over the tokens of logp - teacher logp
    teacher_logprob: float = None    #   and mean teacher logp


def _trained_rows(targets, weights, any_weight=False):
    """Rows that can change the gradient: a non-zero weight (advantage), or any weight with any_weight (the KL
    penalty), and at least one sampled token."""
    return [r for r in range(targets.size(0)) if (any_weight or weights[r] != 0) and bool((targets[r] >= 0).any())]


def _prompt_offset(prompt_length, length, share_prompt):
    """The first position a forward keeps of one question's rows of `length` inputs (see _Chunk): with a shared prompt
    of prompt_length tokens, its last position (the one predicting the first completion token), else 0."""
    return prompt_length - 1 if share_prompt and 1 <= prompt_length <= length else 0


def _chunk_hidden(model, rows, prompts, prompt_lengths, row_prompt):
    """Hidden states (B, L, C) of a forward's kept positions (see _Chunk): rows (B, L) whole when prompts is None;
    else the prompts (Q, P) go through the model once (hidden_states_shared_prefix) and rows (B, S) hold each row's
    tokens after its prompt, L = 1 + S: the prompt's last position, then the row's own."""
    if prompts is None:
        return model.hidden_states(rows)
    B = rows.size(0)
    if rows.size(1) == 0:  # nothing after the prompts: only their last positions carry a target
        prompt_hidden, rows_hidden = model.hidden_states(prompts), None
    elif row_prompt is None:
        prompt_hidden, rows_hidden = model.hidden_states_shared_prefix(prompts, rows)
    else:
        prompt_hidden, rows_hidden = model.hidden_states_shared_prefix(prompts, rows, prompt_lengths, row_prompt)
    if row_prompt is None:
        last = prompt_hidden[:, -1:].expand(B, -1, -1)  # (B, 1, C)
    else:
        last = prompt_hidden[row_prompt, prompt_lengths[row_prompt] - 1][:, None]  # (B, 1, C): each row's prompt's
    return last if rows_hidden is None else torch.cat([last, rows_hidden], dim=1)


def chunk_logprobs(model, rows, prompts, prompt_lengths, row_prompt, row_index, position, targets):
    """The training pass's forward of one chunk: the log-probabilities logp (N,) of its sampled targets and the
    mean entropy there (token_logprobs_and_entropy of the model's logits, by its chunked head: sampled_logprobs).
    rows, prompts, prompt_lengths, row_prompt: the forward's inputs (_Chunk.inputs, see _chunk_hidden); row_index,
    position (N,): each target's row and position among the kept positions (B, L), row-major; targets (N,) the
    sampled tokens. Logits only where there is a target
    (sampled tokens): no vocabulary-wide work for prompt, forced tool-output and padding positions. A pure
    function of tensors with no host read: nanochat/compiling/functions.py compiles it (dynamic shapes) for the policy,
    PPO and reference forwards alike."""
    hidden = _chunk_hidden(model, rows, prompts, prompt_lengths, row_prompt)
    return model.sampled_logprobs(hidden[row_index, position], targets)  # the (N, V) logits a chunk at a time


def one_graph_forward(forward):
    """`forward` (chunk_logprobs compiled) given a chunk of one question's rows in the several-prompts form too (its
    prompt as the only one, its length, every row's index 0), and every input as a tensor of its own, dense: Dynamo
    guards on row_prompt being None, on strides (a (1, P) slice of a question's inputs is "contiguous" to torch,
    strides and all) and on the sizes of a view's base (nonzero's row and position are views of one (N, 2) tensor,
    whose 2 it tied to two prompts' 2) and on a size of 1 (one prompt), so each would be another graph to compile
    (~45 s each for the speedrun's d4 on a 2-core CPU). Both forms compute the same hidden states."""
    def call(model, rows, prompts, prompt_lengths, row_prompt, *rest, **kwargs):
        if prompts is not None and row_prompt is None and rows.size(1) > 0:
            prompt_lengths = torch.full((1,), prompts.size(1), dtype=torch.long, device=prompts.device)
            row_prompt = torch.zeros(rows.size(0), dtype=torch.long, device=rows.device)
        inputs = [None if t is None else t.new_empty(t.shape).copy_(t) for t in (rows, prompts, prompt_lengths,
                                                                              row_prompt, *rest)]
        if inputs[3] is not None:  # the prompts' count, 1 or more: Dynamo would specialize 1 (a graph of its own)
            torch._dynamo.decorators.mark_unbacked(inputs[1], 0)
            torch._dynamo.decorators.mark_unbacked(inputs[2], 0)
        return forward(model, *inputs, **kwargs)
    return call


def compiled_chunk_forward(on, required=False):
    """The training pass's chunk forward: chunk_logprobs, compiled (one_graph_forward) where `on`; required: a compile
    failure is an error (--compile=on), not a warning and the eager path."""
    return one_graph_forward(maybe_compiled(chunk_logprobs, True, dynamic=True, required=required)) if on else chunk_logprobs


def accumulate_policy_gradient(model, batches, device_batch_size, examples_per_rank, device, autocast,
                               micro_batch_rows=None, share_prompt=True, skip_zero_advantage=True,
                               loss=None, counts=None, reference=None, first_epoch=None, forward=chunk_logprobs,
                               teacher=None):
    """Forward/backward the step's rows, accumulating the policy gradient into the model.

    batches: this rank's QuestionBatch list. By default the objective is nanochat's: each question's rows
    form passes of device_batch_size rows, each pass normalized by its own valid-target count (see
    pass_denominators). loss (PolicyLoss, default nanochat's) picks another normalization, masks truncated rows,
    and sets the PPO clip range and the KL coefficient; counts: the step's StepCounts, which the token,
    sequence and constant normalizations need (computed here when None; under a process group that is a
    collective, so compute it once per step with step_counts and pass it). reference: the frozen model of
    the KL penalty (needed when loss.kl_coef > 0).
    first_epoch: None in a step's first epoch: the policy is the one that sampled (ratio 1), the term is
    A * logp / D (on_policy_objective), and the returned stats keep the sampled tokens' log-probabilities (and the
    reference's). In a later PPO epoch, the first epoch's TrainStats: its log-probabilities are the old policy's and
    the term is loss.loss's clipped one / D (ppo_objective).
    Only work that can change the gradient is done:
      - rows whose advantage is 0 (every row of a question whose samples were all rewarded alike) are not
        run at all (skip_zero_advantage; with kl_coef > 0 they are, as the penalty gives them a gradient);
        their valid tokens still count in the denominators. Rows without a sampled token are never run;
      - each question's prompt is computed once per forward instead of once per row (share_prompt).
    The trained rows of all questions, in question order, are cut into forwards of micro_batch_rows rows (default
    device_batch_size), so a forward may hold rows of several questions (see _Chunk); any value (a smaller one
    after an out-of-memory) gives the same gradient. The model provides hidden_states, hidden_states_shared_prefix
    (of several prompts) and sampled_logprobs, as GPT does. Every parameter ends with a gradient (zeros if no
    row was trained here), so that distributed optimizers see the same tensors on every rank.
    forward: the chunk forward of the policy, the reference and the teacher (chunk_logprobs, or its compiled version).
    teacher: with loss.distill_coef > 0, the Teacher (nanochat/rl/teacher.py) whose log-probabilities make each
    token's advantage; then every row with a sampled token runs (its distillation term is known only from the
    forward), as with the KL penalty.
    Returns TrainStats."""
    loss = loss or PolicyLoss()
    first = first_epoch is None
    use_kl, distill = loss.kl_coef > 0, loss.distill_coef > 0
    if use_kl and first and reference is None:
        raise ValueError("kl_coef > 0 needs the reference model (reference=...)")
    if distill and first and teacher is None:
        raise ValueError("distill_coef > 0 needs the teacher (teacher=...)")
    if loss.loss_norm != "pass" and counts is None:
        counts = step_counts(batches, loss.mask_truncated, device)
    tally = _Tally.of_epoch(first_epoch, use_kl, loss.rollout_correction != "none", distill)
    trained = []  # (question, row) of every row to run, in question order
    for q, batch in enumerate(batches):
        question = QuestionRows.of(q, batch, loss, device_batch_size, examples_per_rank, counts=counts)
        R = question.targets.size(0)
        rows = (_trained_rows(question.targets, question.weights, any_weight=use_kl or distill) if skip_zero_advantage
                else list(range(R)))
        tally.add_question(question.targets, len(rows), first, device)
        trained += [(question, r) for r in rows]
    micro = micro_batch_rows or device_batch_size
    for lo in range(0, len(trained), micro):
        chunk = _Chunk.of(trained[lo:lo + micro], share_prompt)
        _backward_chunk(model, chunk, loss, first, (reference, teacher), device=device, autocast=autocast, tally=tally,
                        forward=forward)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return tally.stats(first, use_kl)


def without_rejected_tokens(model, batches, loss, micro_rows, device, autocast, share_prompt=True,
                            forward=chunk_logprobs):
    """The peers' rule for a masking rollout correction (loss.rejected_in_denominator False): the step's batches with
    the tokens the mask drops taken out of their targets (-1), so that they count in no denominator (a row dropped
    whole in no sequence count either; `constant` divides by a fixed budget and stays); the trainer's log-probabilities
    come from a no-grad forward of every counted row first (those of advantage 0 too: their tokens count). Call it
    before step_counts, once a step. Returns (batches, tokens dropped); the batches as they are otherwise."""
    if loss.rejected_in_denominator or loss.rollout_correction not in MASK_CORRECTIONS:
        return batches, 0
    targets = [trainable_targets(batch, loss.mask_truncated) for batch in batches]
    questions = [QuestionRows(q, batch, t, None, None, advantages=batch.advantages) for q,
                 (batch, t) in enumerate(zip(batches, targets))]
    kept = [torch.ones(t.shape, device=device) for t in targets]
    rows = [(question, r) for question in questions for r in range(question.targets.size(0))
            if bool((question.targets[r] >= 0).any())]
    for lo in range(0, len(rows), micro_rows):
        tokens = _Tokens(_Chunk.of(rows[lo:lo + micro_rows], share_prompt), device)
        sampler = tokens.sampler_logprobs()
        if sampler is not None:
            with torch.no_grad(), autocast:
                logp = forward(model, *tokens.forward_inputs)[0]
            weights, _ = rollout_correction_weights(loss, *sampler_gap(logp, sampler), tokens.row_index,
                                                    tokens.num_rows, torch.float32)
            tokens.store(kept, weights)
    dropped = [(k.cpu() == 0) & (t >= 0) for k, t in zip(kept, targets)]  # the step's one read back
    return ([dataclasses.replace(b, targets=b.targets.masked_fill(d, -1)) for b, d in zip(batches, dropped)],
            sum(int(d.sum()) for d in dropped))


@dataclass
class _Chunk:
    """One forward's rows, laid out on the host: up to micro_batch_rows rows of one or several questions, in
    question order. With share_prompt (and every prompt at least a token, its rows longer than it) the chunk's
    prompts go through the model once, right-padded to the longest of them, and each row holds its tokens after
    its prompt, right-padded; the kept positions (B, L) are each row's prompt's last position then its own (from
    offset P - 1 in its question's (R, T)). Otherwise each row is whole (offset 0), right-padded. Padding carries
    no target and is never seen by a real token (attention is causal)."""
    parts: list              # [(QuestionRows, rows (n,) long: its rows here)], in order
    inputs: tuple            # (rows, prompts, prompt_lengths, row_prompt): chunk_logprobs' inputs (None: unused)
    targets: torch.Tensor    # (B, L) the sampled tokens at the kept positions, -1 elsewhere
    offsets: torch.Tensor    # (B,) where each row's kept positions start in its question's (R, T)
    row_in_question: torch.Tensor  # (B,) each row's index among its question's R

    @classmethod
    def of(cls, trained, share_prompt):
        """The chunk of `trained`: [(QuestionRows, row)], grouped by question in order."""
        parts = []
        for question, r in trained:
            if parts and parts[-1][0] is question:
                parts[-1][1].append(r)
            else:
                parts.append((question, [r]))
        parts = [(question, torch.tensor(rows)) for question, rows in parts]
        lengths = [(q.batch.prompt_length, q.targets.size(1)) for q, _ in parts]
        shared = share_prompt and all(1 <= P <= T for P, T in lengths)
        row_in_question = torch.cat([rows for _, rows in parts])
        if len(parts) == 1:  # one question: its rows share one length and one prompt, no padding
            (question, rows), (P, T) = parts[0], lengths[0]
            inputs, offset = question.batch.inputs[rows], _prompt_offset(P, T, shared)
            model_inputs = (inputs[:, P:], inputs[:1, :P], None, None) if offset else (inputs, None, None, None)
            return cls(parts, model_inputs, question.targets[rows][:, offset:], torch.full((len(rows),), offset),
                       row_in_question)
        counts = torch.tensor([len(rows) for _, rows in parts])
        if shared:
            prompts = _right_padded([q.batch.inputs[:1, :P] for (q, _), (P, _) in zip(parts, lengths)], 0)
            prompt_lengths = torch.tensor([P for P, _ in lengths])
            row_prompt = torch.repeat_interleave(torch.arange(len(parts)), counts)
            rows = _right_padded([q.batch.inputs[rows, P:] for (q, rows), (P, _) in zip(parts, lengths)], 0)
            model_inputs, offsets = (rows, prompts, prompt_lengths, row_prompt), prompt_lengths[row_prompt] - 1
        else:
            model_inputs = (_right_padded([q.batch.inputs[rows] for q, rows in parts], 0), None, None, None)
            offsets = torch.zeros(int(counts.sum()), dtype=torch.long)
        targets = [q.targets[rows][:, int(offset):] for (q, rows), offset in zip(parts, offsets[counts.cumsum(0) - 1])]
        return cls(parts, model_inputs, _right_padded(targets, -1), offsets, row_in_question)


def _right_padded(tensors, value):
    """(n_i, L_i) tensors -> (sum n_i, max L_i), each right-padded with `value`."""
    width = max(t.size(1) for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.size(1)), value=value) for t in tensors])


@dataclass
class _Tally:
    """Running sums of one epoch of accumulate_policy_gradient, turned into TrainStats at the end."""
    old_logprobs: list
    ref_logprobs: list
    correction_weights: list = None
    chunk_sums: list = field(default_factory=list)    # per chunk, on the device: (objective, mean entropy)
    chunk_tokens: list = field(default_factory=list)  # per chunk: its sampled tokens
    objective: float = 0.0
    entropy_sum: float = 0.0
    tokens: int = 0
    rows_trained: int = 0
    rows_total: int = 0
    clipped: int = 0
    approx_kl_sum: float = 0.0
    kl_ref_sum: float = 0.0
    sampler: list = None  # device sums over the chunks: tokens, |d| sum, |d| max, k3 sum, corrected tokens
    teacher_logprobs: list = None  # with a teacher: per question (R, T), kept by the first epoch
    distill: object = None         # first epoch, with a teacher: device sums (logp - teacher logp, teacher logp)

    @classmethod
    def of_epoch(cls, first_epoch, use_kl, correct, distill=False):
        """A first epoch's tally (first_epoch None) keeps its tokens' values for the later epochs, which read them."""
        if first_epoch is not None:
            return cls(first_epoch.old_logprobs, first_epoch.ref_logprobs, first_epoch.correction_weights,
                       teacher_logprobs=first_epoch.teacher_logprobs)
        return cls(old_logprobs=[], ref_logprobs=[] if use_kl else None, correction_weights=[] if correct else None,
                   teacher_logprobs=[] if distill else None)

    def add_question(self, targets, rows_trained, first, device):
        """Count a question's rows (targets (R, T)); in the first epoch, room for what is kept of its tokens, at
        their (row, position) in its (R, T)."""
        self.rows_total += targets.size(0)
        self.rows_trained += rows_trained
        if first:
            self.old_logprobs.append(torch.zeros(targets.shape, device=device))
            if self.ref_logprobs is not None:
                self.ref_logprobs.append(torch.zeros(targets.shape, device=device))
            if self.correction_weights is not None:
                self.correction_weights.append(torch.ones(targets.shape, device=device))
            if self.teacher_logprobs is not None:
                self.teacher_logprobs.append(torch.zeros(targets.shape, device=device))

    def add_chunk(self, terms, entropy, tokens):
        """A forward's EpochTerms and mean entropy (kept on the device) over its `tokens` sampled tokens."""
        self.chunk_sums.append(torch.stack([terms.objective.detach().float(), entropy.float()]))
        self.chunk_tokens.append(tokens)
        self.tokens += tokens
        if terms.clipped is not None:
            self.clipped = self.clipped + terms.clipped
            self.approx_kl_sum = self.approx_kl_sum + terms.approx_kl
        if terms.kl_ref is not None:
            self.kl_ref_sum = self.kl_ref_sum + terms.kl_ref

    def add_gap(self, gap, known, corrected):
        """gap: (N,) trainer minus sampler log-probabilities of a chunk's tokens (0 where `known` is False: the
        sampler's is missing); corrected: how many the rollout correction changed. Kept on the device."""
        self.sampler = sampler_gap_sums(gap, known, corrected, self.sampler)

    def stats(self, first, use_kl):
        """TrainStats of the epoch: the device sums are read here, once."""
        host = lambda x: float(x) if isinstance(x, torch.Tensor) else x
        self.clipped, self.approx_kl_sum, self.kl_ref_sum = map(host, (self.clipped, self.approx_kl_sum, self.kl_ref_sum))
        # summed on the host in float64, chunk by chunk, as the objective used to be: the same number to the bit
        for (objective, entropy), tokens in zip(torch.stack(self.chunk_sums).tolist() if self.chunk_sums else [],
                                                self.chunk_tokens):
            self.objective += objective
            self.entropy_sum += entropy * tokens
        per_token = lambda total: total / self.tokens if self.tokens else 0.0
        tokens, gap_sum, gap_max, k3_sum, corrected = self.sampler.tolist() if self.sampler is not None else [0.0] * 5
        per_sampled = lambda total: total / tokens if tokens else 0.0
        reverse_kl, teacher_logprob = (map(per_token, self.distill.tolist()) if self.distill is not None
                                       else (0.0, 0.0) if first and self.teacher_logprobs is not None else (None, None))
        return TrainStats(objective=self.objective, entropy=self.entropy_sum / self.tokens if self.tokens else float("nan"),
                          rows_trained=self.rows_trained, rows_total=self.rows_total, tokens=self.tokens,
                          clip_fraction=None if first else per_token(self.clipped),
                          approx_kl=None if first else per_token(self.approx_kl_sum),
                          kl_ref=per_token(self.kl_ref_sum) if use_kl else None,
                          old_logprobs=self.old_logprobs, ref_logprobs=self.ref_logprobs,
                          correction_weights=self.correction_weights, sampler_tokens=int(tokens),
                          sampler_gap_mean=per_sampled(gap_sum), sampler_gap_max=gap_max, sampler_k3=per_sampled(k3_sum),
                          corrected_fraction=per_sampled(corrected), teacher_logprobs=self.teacher_logprobs,
                          reverse_kl=reverse_kl, teacher_logprob=teacher_logprob)


class _Tokens:
    """A forward's N sampled tokens (row-major over its (B, L)) on the device: its arguments, and each token's place in
    its question's rows, worked out on the host (the batches live there): a chunk reads nothing back from the device."""

    def __init__(self, chunk, device):
        valid = chunk.targets >= 0  # (B, L)
        row_host, position_host = valid.nonzero(as_tuple=True)  # (N,): each token's row and position
        self.chunk, self.device, self.row_host = chunk, device, row_host
        self.count, self.num_rows = row_host.numel(), valid.size(0)
        # every host tensor goes over with to_device: queued, so the host can run ahead of the GPU into the next chunk
        self.row_index = to_device(row_host, device)
        inputs = [None if x is None else to_device(x, device) for x in chunk.inputs]
        self.forward_inputs = (*inputs, self.row_index, to_device(position_host, device),
                               to_device(chunk.targets[valid], device))  # chunk_logprobs' arguments after the model
        # each question's tokens are a contiguous span of the N (rows in question order, tokens row-major), and their
        # places in its (R, T): one copy to the device for the chunk, sliced per question
        ends = valid.sum(1).cumsum(0)[torch.tensor([len(rows) for _, rows in chunk.parts]).cumsum(0) - 1].tolist()
        self.places = (chunk.row_in_question[row_host], position_host + chunk.offsets[row_host])  # on the host
        places = [to_device(x, device) for x in self.places]
        self.spans = [(question.index, slice(lo, hi), (places[0][lo:hi], places[1][lo:hi]))
                      for (question, _), lo, hi in zip(chunk.parts, [0] + ends[:-1], ends)]

    def per_row(self, name, dtype):
        """(N,) each token's row's entry of QuestionRows.`name` (weights, denominators, advantages), in dtype."""
        per_row = torch.cat([getattr(question, name)[rows] for question, rows in self.chunk.parts])  # (B,)
        return to_device(per_row[self.row_host], self.device).to(dtype)

    def sampler_logprobs(self):
        """(N,) the sampler's log-probability of each token (nan where unknown), or None: none known."""
        stored = [question.batch.sampler_logprobs for question, _ in self.chunk.parts]  # per question (R, T), or None
        if all(values is None for values in stored):
            return None
        rows, positions = self.places
        return to_device(torch.cat([torch.full((span.stop - span.start,), float("nan")) if values is None
                                    else values[rows[span], positions[span]]
                                    for values, (_, span, _) in zip(stored, self.spans)]), self.device)

    def gather(self, stored):
        """(N,) the tokens' entries of per-question (R, T) tensors (the epoch's kept values)."""
        values = [stored[q][where] for q, _, where in self.spans]
        return values[0] if len(values) == 1 else torch.cat(values)

    def store(self, stored, values):
        """Write values (N,) at the tokens' places in per-question (R, T) tensors."""
        for q, span, where in self.spans:
            stored[q][where] = values[span]


def _backward_chunk(model, chunk, loss, first, frozen, device, autocast, tally, forward):
    """Forward and backward the rows of `chunk` (a _Chunk), adding their objective (objective.epoch_objective, where
    every option of the loss applies) to the model's gradient and its sums to the tally. frozen: (the KL penalty's
    reference, the distillation's Teacher), each None where unused."""
    reference, teacher = frozen
    tokens = _Tokens(chunk, device)
    with autocast:  # the log-probabilities are computed in fp32 inside, whatever autocast says
        logp, entropy = forward(model, *tokens.forward_inputs)  # (N,) the sampled tokens' log-probabilities
    correction, old_logp, ref_logp = _epoch_inputs(logp, tokens, loss, first, tally, reference=reference,
                                                   autocast=autocast, forward=forward)
    row_values = lambda name: tokens.per_row(name, logp.dtype)
    if loss.per_token:  # not nanochat's path (its row weights, divided on the host): per-token advantages
        distilled = teacher.chunk_logprobs(logp, tokens, first, tally, forward) if teacher else (None, None)
        row_values = per_token_values(loss, row_values, *distilled)
    terms = epoch_objective(loss, first, logp, row_values, tokens.row_index, num_rows=tokens.num_rows,
                            correction=correction, old_logp=old_logp, ref_logp=ref_logp)
    (-terms.objective).backward()
    tally.add_chunk(terms, entropy, tokens.count)


def _epoch_inputs(logp, tokens, loss, first, tally, reference, autocast, forward):
    """What this epoch's objective reads beside the policy's log-probabilities logp (N,), each (N,) or None: the
    rollout correction's weights (None: no correction, or no sampler log-probability known), the old policy's
    log-probabilities (later epochs) and the reference's (kl_coef > 0). The first epoch measures and keeps them
    (the tally's stores, for the later epochs: the policy that sampled is the first epoch's) and tallies the gap to
    the sampler, with or without a correction; a later epoch reads them back."""
    kl = loss.kl_coef > 0
    if not first:
        weights = None if tally.correction_weights is None else tokens.gather(tally.correction_weights)
        return weights, tokens.gather(tally.old_logprobs), tokens.gather(tally.ref_logprobs) if kl else None
    weights, sampler = None, tokens.sampler_logprobs()
    if sampler is not None:
        gap, known = sampler_gap(logp.detach(), sampler)
        weights, changed = rollout_correction_weights(loss, gap, known, tokens.row_index, tokens.num_rows,
                                                      dtype=logp.dtype)
        tally.add_gap(gap, known, changed)
        if weights is not None:
            tokens.store(tally.correction_weights, weights)
    tokens.store(tally.old_logprobs, logp.detach())
    if kl:
        with torch.no_grad(), autocast:
            tokens.store(tally.ref_logprobs, forward(reference, *tokens.forward_inputs)[0])
    return weights, None, tokens.gather(tally.ref_logprobs) if kl else None
