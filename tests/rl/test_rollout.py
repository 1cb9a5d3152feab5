"""The library's rollout API: which questions a rank samples, and the record each question comes back as,
checked against the engine and the task called directly."""

import torch
from helpers import SFT_CONFIG, random_model, tiny_config
from rl_toy_task import ParityTask

from nanochat.engine.engine import Engine
from nanochat.rl.rollout import Sampling, question_seed, sample_questions, step_question_indices


def test_rank_strided_data_covers_each_question_once_per_epoch():
    seen = [step_question_indices(step, 2, rank, 2, 8) for step in range(2) for rank in range(2)]
    assert sorted(i for s in seen for i in s) == list(range(8))
    assert step_question_indices(0, 2, 1, 2, 8) == [1, 3]
    assert step_question_indices(2, 2, 1, 2, 8) == [1, 3]  # cycles


def test_question_seed_is_the_same_in_every_process():
    """hash() of an int tuple is not salted per process, so every rank derives the same seed."""
    assert question_seed(3, 7) == hash((3, 7)) & 0x7FFFFFFF
    assert question_seed(3, 7) != question_seed(7, 3)


def test_records_hold_what_the_engine_sampled_and_the_task_rewarded(tiny_tokenizer):
    model = random_model(tiny_config(**{**SFT_CONFIG, "vocab_size": tiny_tokenizer.get_vocab_size()}), seed=1)
    task, indices, seeds = ParityTask("train"), [3, 0, 5], [11, 12, 13]
    sampling = Sampling(num_samples=4, max_new_tokens=10, temperature=1.0, top_k=20)
    rollouts = sample_questions(Engine(model, tiny_tokenizer), task, indices, seeds, sampling)

    prompts = [tiny_tokenizer.render_for_completion(task[i]) for i in indices]
    direct = Engine(model, tiny_tokenizer).generate_many(prompts, num_samples=4, max_tokens=10, temperature=1.0,
                                                         top_k=20, seeds=seeds)
    assert [r.index for r in rollouts] == indices
    for rollout, prompt, completions in zip(rollouts, prompts, direct):
        assert [c.tokens for c in rollout.completions] == [c.tokens for c in completions]
        assert rollout.texts == [tiny_tokenizer.decode(c.tokens) for c in completions]
        assert rollout.rewards == [task.reward(task[rollout.index], t) for t in rollout.texts]
        rewards = torch.tensor(rollout.rewards)
        assert torch.equal(rollout.advantages, rewards - rewards.mean())
        assert rollout.prompt_length == len(prompt)
        assert rollout.completion_lengths == [len(c.tokens) for c in completions]
        assert rollout.batch.truncated.tolist() == [not c.ended for c in completions]
        # the training targets are exactly the sampled tokens: prompt, forced tokens and padding are -1
        for row, c in enumerate(completions):
            sampled = [t for t, m in zip(c.tokens, c.masks) if m == 1]
            targets = rollout.batch.targets[row]
            assert targets[targets >= 0].tolist() == sampled


def test_a_score_function_replaces_the_reward(tiny_tokenizer):
    """The eval grades with task.evaluate through the same call (its rewards are then 0/1)."""
    model = random_model(tiny_config(**{**SFT_CONFIG, "vocab_size": tiny_tokenizer.get_vocab_size()}), seed=2)
    task = ParityTask("test")
    rollouts = sample_questions(Engine(model, tiny_tokenizer), task, [0, 1], [0, 1], Sampling(num_samples=2, max_new_tokens=6),
                                score=lambda conv, text: 7.0)
    assert all(r.rewards == [7.0, 7.0] for r in rollouts)
    assert all(torch.equal(r.advantages, torch.zeros(2)) for r in rollouts)
