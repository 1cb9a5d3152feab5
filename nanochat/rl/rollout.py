"""
Rollouts: a task's questions in, one record per question out (what was sampled, what it earned, and the
tensors the policy gradient trains on). chat_rl's training step, the pass@k eval and the benchmark all sample
through `sample_questions`, so they cannot drift apart.

Which questions a rank samples and with which seeds is decided here too: the questions of step s and their seeds
(question i at step s is seeded with question_seed(s, i)) are the same whatever the rank layout, and every sample of
a question has its own stream inside the engine, so a question's completions do not depend on how many ranks or
rows share the work.
"""

import sys
from dataclasses import dataclass

from nanochat.rl.advantages import QuestionBatch, make_question_batch
from nanochat.runtime.distributed import get_rank
from nanochat.settings import SHARED


@dataclass(frozen=True)
class Sampling:
    """How completions are sampled. The defaults are nanochat's, for its chat_rl rollouts and its eval alike: the shared
    --max-new-tokens, --temperature and --top-k (nanochat/settings.py's table), and the one source of chat_rl's
    --num-samples; the pass@k eval samples so too (nanochat/rl/evaluation.py)."""
    num_samples: int = 16                                  # completions per question
    max_new_tokens: int = SHARED["max_new_tokens"].default  # completion length cap in tokens
    temperature: float = SHARED["temperature"].default      # 0 = greedy
    top_k: int = SHARED["top_k"].default                    # 0 = the whole vocabulary


@dataclass
class QuestionRollout:
    """One question's samples. R = num_samples."""
    index: int            # the question's index in its task split
    completions: list     # (R,) engine Completion: tokens, masks (1 sampled / 0 tool output), ended, tool stats
    texts: list           # (R,) the decoded completions
    rewards: list         # (R,) float: the task's reward (or grade) of each completion
    batch: QuestionBatch  # the training tensors: inputs, targets, advantages, truncated (see nanochat.rl.objective)

    @property
    def prompt_length(self):
        return self.batch.prompt_length

    @property
    def advantages(self):
        return self.batch.advantages

    @property
    def completion_lengths(self):
        return self.batch.completion_lengths


def question_seed(step, example_index, draw=0):
    """The sampling seed of one question at one RL step (and, with --dynamic-sampling, the step's draw: a question
    drawn twice in one step, past the end of a small split, samples anew): the same on every rank layout."""
    key = (step, example_index) if draw == 0 else (step, example_index, draw)
    return hash(key) & 0x7FFFFFFF  # the hash of an int tuple is not salted per process


def question_indices_at(position, examples_per_rank, rank, world_size, num_examples):
    """The train questions this rank samples from data position `position`. The run walks the split in order, epoch
    after epoch (position p is question p mod num_examples), examples_per_rank * W positions a draw (a step's, or with
    --dynamic-sampling one of its draws), and rank r takes every W-th of the draw's positions from the r-th. That is
    nanochat's split (rank r walks r, r+W, r+2W, ... cycling) in the first epoch, and in every epoch when W divides
    the split; unlike it, which questions a step takes does not depend on W, so a run resumed on another number of
    ranks goes on with the next questions of the epoch, and each epoch takes every question once also when W does
    not divide the split."""
    return [(position + rank + world_size * i) % num_examples for i in range(examples_per_rank)]


def step_question_indices(step, examples_per_rank, rank, world_size, num_examples):
    """The train questions this rank samples at `step` of a run without --dynamic-sampling (its data position is
    step * examples_per_rank * W; see question_indices_at)."""
    return question_indices_at(step * examples_per_rank * world_size, examples_per_rank, rank, world_size, num_examples)


def has_signal(rollout):
    """Whether a question's samples were rewarded differently: only then are its advantages not all zero."""
    return len(set(rollout.rewards)) > 1


def step_questions(drawn, examples_per_rank):
    """--dynamic-sampling: the step's questions among those drawn, in draw order: the first examples_per_rank whose
    samples differ in reward, and if there are fewer, the first ones without (their advantages are zero: they add
    nothing to the gradient, as in a step without dynamic sampling), so a rank trains examples_per_rank questions."""
    ranked = sorted(range(len(drawn)), key=lambda i: not has_signal(drawn[i]))  # stable: draw order within each kind
    kept = set(ranked[:examples_per_rank])
    return [r for i, r in enumerate(drawn) if i in kept]


@dataclass
class StepRollouts:
    """What a step sampled on this rank."""
    trained: list        # the step's questions (QuestionRollouts), which the policy gradient trains on
    drawn: list          # every question sampled, in draw order (the same as `trained` without --dynamic-sampling)
    next_position: int   # the data position of the next step's first question


PROMPTS_SCANNED = 50_000  # a task's first prompts that longest_prompt renders (GSM8K: 7,473 train in ~0.2 s)


def longest_prompt(tokenizer, *tasks):
    """The longest rendered prompt (in tokens) among the first PROMPTS_SCANNED questions of each task: what a
    run's static decode batch is sized for, so that it is not rebuilt (and its graphs not recaptured) when a
    longer prompt comes. A longer one past the scanned questions still fits: the batch is rebuilt for it."""
    return max(len(tokenizer.render_for_completion(task[i])) for task in tasks
               for i in range(min(len(task), PROMPTS_SCANNED)))


class _NoProgress:
    def update(self, n=1):
        pass

    def close(self):
        pass


def progress_bar(total, desc):
    """A tqdm bar on rank 0 when stderr is a terminal; a no-op otherwise (CI and log files get the plain
    per-step lines instead of carriage-return noise)."""
    if get_rank() != 0 or not sys.stderr.isatty():
        return _NoProgress()
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


def sample_questions(engine, task, indices, seeds, sampling, score=None, scale_by_std=False, label="rollouts",
                     within_memory=False):
    """Sample sampling.num_samples completions of each task question in `indices` (all in one batched engine
    call, question i seeded with seeds[i]) and score them with score(conversation, text) (default
    task.reward). scale_by_std: GRPO's advantages (see nanochat.rl.advantages.advantages_from_rewards).
    within_memory: the engine's call backs off where it runs out of memory (Engine.generate_many's; chat_rl's steps;
    the progress bar then counts the rows of the attempt that runs). Returns [QuestionRollout], in the order of
    `indices`."""
    tokenizer = engine.tokenizer
    score = score or task.reward
    conversations = [task[i] for i in indices]
    prompts = [tokenizer.render_for_completion(conv) for conv in conversations]
    bar = progress_bar(len(prompts) * sampling.num_samples, label)
    results = engine.generate_many(prompts, num_samples=sampling.num_samples, max_tokens=sampling.max_new_tokens,
                                   temperature=sampling.temperature, top_k=sampling.top_k or None, seeds=seeds,
                                   progress=bar.update, within_memory=within_memory)
    bar.close()
    pad = tokenizer.encode_special("<|assistant_end|>")  # any id: padded positions carry no target
    rollouts = []
    for index, conv, prompt, completions in zip(indices, conversations, prompts, results):
        texts = [tokenizer.decode(c.tokens) for c in completions]
        rewards = [float(score(conv, text)) for text in texts]
        batch = make_question_batch(prompt, [(c.tokens, c.masks) for c in completions], rewards, pad,
                                    truncated=[not c.ended for c in completions], scale_by_std=scale_by_std,
                                    sampler_logprobs=[c.logprobs for c in completions])
        rollouts.append(QuestionRollout(index=index, completions=completions, texts=texts, rewards=rewards, batch=batch))
    return rollouts
