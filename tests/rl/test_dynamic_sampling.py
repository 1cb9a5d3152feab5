"""--dynamic-sampling (DAPO): a step draws more questions until it has --examples-per-step whose samples differ in
reward (or --dynamic-sampling-rounds more draws), trains on those, and a resumed run draws what the uninterrupted
one drew: the data position is saved with each checkpoint."""

import json
import re

import torch
from gloo_ranks import run_ranks
from helpers import PYTHONPATH, TINY_RL_FLAGS, weights

from nanochat.rl.rollout import (QuestionRollout, question_indices_at, question_seed, step_question_indices,
                                 step_questions)
from scripts import chat_rl

FLAGS = [f if not f.startswith("--task=") else "--task=rl_toy_task:HalfSilentParity" for f in TINY_RL_FLAGS]


def rollout(index, rewards):
    return QuestionRollout(index=index, completions=[], texts=[], rewards=rewards, batch=None)


def test_a_step_keeps_the_first_questions_with_signal_in_draw_order():
    drawn = [rollout(0, [0, 0]), rollout(1, [1, 0]), rollout(2, [1, 1]), rollout(3, [0, 1]), rollout(4, [1, 0])]
    assert [r.index for r in step_questions(drawn, 2)] == [1, 3]
    assert [r.index for r in step_questions(drawn, 4)] == [0, 1, 3, 4]  # one short: the first without signal fills
    assert [r.index for r in step_questions(drawn[:1], 1)] == [0]


def test_draws_walk_on_through_the_split_and_sample_anew():
    assert step_question_indices(3, 2, 1, 2, 10) == question_indices_at(12, 2, 1, 2, 10) == [3, 5]
    assert question_indices_at(16, 2, 0, 2, 10) == [6, 8]
    assert question_seed(5, 7) == question_seed(5, 7, 0) != question_seed(5, 7, 1)  # draw 0: the seeds of before


def test_seeds_differ_across_draws():
    """Every draw of a question in a step has its own seed (draw 0 keeps a run's seeds without dynamic sampling)."""
    for step, index in ((0, 0), (3, 1), (5, 7)):
        seeds = [question_seed(step, index, draw) for draw in range(4)]
        assert seeds[0] == question_seed(step, index) and len(set(seeds)) == 4, seeds


def test_a_question_drawn_again_in_a_step_samples_anew(sft, base_dir):
    """A split of 4 questions without signal, 4 questions a draw, 2 more draws: step 0 samples each question 3
    times. Each time is a new draw (seeded with question_seed(step, i, draw)), so its samples differ from the other
    draws'; with the draw left out of the seed a question drawn again repeated its samples to the token, and no test
    drew a question twice in a step. The samples are read from --save-rollouts, in draw order."""
    flags = [f if not f.startswith("--task=") else "--task=rl_toy_task:FourSilentQuestions" for f in TINY_RL_FLAGS]
    chat_rl.main(flags + ["--num-steps=1", "--dynamic-sampling", "--dynamic-sampling-rounds=2", "--save-rollouts"])
    path = base_dir / "chatrl_checkpoints" / "d2" / "rollouts_rank0.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    # 3 draws of questions 0-3 in order, 4 samples each
    assert [(line["question"], line["sample"]) for line in lines] == [(q, j) for _ in range(3) for q in range(4)
                                                                      for j in range(4)]
    for question in range(4):
        draws = [tuple(line["text"] for line in lines[16 * d + 4 * question:16 * d + 4 * question + 4])
                 for d in range(3)]
        assert len(set(draws)) == 3, f"question {question}'s samples repeat across the step's draws: {draws}"


def trained_rows(out):
    return [int(m) for m in re.findall(r"Rows trained: (\d+)/\d+", out)]


def test_it_trains_more_rows_and_resumes_exactly(sft, base_dir, capsys):
    flags = FLAGS + ["--num-steps=3", "--save-every=1"]
    chat_rl.main(flags + ["--output-tag=plain"])
    plain = capsys.readouterr().out
    chat_rl.main(flags + ["--output-tag=dynamic", "--dynamic-sampling", "--dynamic-sampling-rounds=2"])
    dynamic = capsys.readouterr().out
    assert "| Questions: " not in plain and len(re.findall(r"\| Questions: (8|12) drawn, 4 trained \|", dynamic)) >= 2
    assert sum(trained_rows(dynamic)) > sum(trained_rows(plain))  # the same seed: more questions with signal
    rl_dir = base_dir / "chatrl_checkpoints" / "dynamic"
    positions = [json.loads((rl_dir / f"meta_00000{s}.json").read_text())["data_position"] for s in (1, 2)]
    assert 8 < positions[0] < positions[1] and all(p % 4 == 0 for p in positions)  # after steps 1 and 2
    uninterrupted = weights(rl_dir / "model_000002.pt")
    (rl_dir / "model_000002.pt").unlink()
    chat_rl.main(["--resume=dynamic:1", "--device-type=cpu"])
    resumed = capsys.readouterr().out
    step_line = lambda out: next(line for line in out.splitlines()  # noqa: E731
                                 if line.startswith("Step 2/3")).split("| Rollout:")[0]
    assert step_line(resumed) == step_line(dynamic)
    assert json.loads((rl_dir / "meta_000002.json").read_text())["data_position"] == positions[1]
    for k, v in weights(rl_dir / "model_000002.pt").items():
        assert torch.equal(v, uninterrupted[k]), k


def test_two_ranks_agree_on_the_draws(sft, base_dir, monkeypatch):
    """With 2 ranks rank 1 takes the odd questions, which never have a signal: it asks for every draw, and rank 0,
    which has enough after the first, draws as often (the count is agreed), so both walk the same positions and
    neither waits for a collective the other never calls."""
    monkeypatch.setenv("PYTHONPATH", PYTHONPATH)  # the ranks import rl_toy_task from tests/
    run_ranks(lambda rank: ["-m", "scripts.chat_rl", *FLAGS, "--num-steps=2", "--dynamic-sampling",
                            "--dynamic-sampling-rounds=2", "--save-rollouts", "--output-tag=two"], timeout=300)
    lines = [[json.loads(line) for line in (base_dir / "chatrl_checkpoints" / "two" / f"rollouts_rank{r}.jsonl")
              .read_text().splitlines()] for r in (0, 1)]
    for step in (0, 1):
        asked = [sorted({line["question"] for line in rank if line["step"] == step}) for rank in lines]
        assert len(asked[0]) == len(asked[1]) == 3 * 2  # 3 draws of 2 questions a rank, on both ranks
        assert all(q % 2 == 0 for q in asked[0]) and all(q % 2 == 1 for q in asked[1])


def draws_of(monkeypatch, signal_per_draw, rounds, examples=4, position=8):
    """sample_rollouts' draws with sample_draw replaced: draw d returns `examples` questions at its position, of which
    the first signal_per_draw[d] have samples that differ in reward. Returns (the draws made, as (position, draw)), the
    StepRollouts)."""
    from types import SimpleNamespace

    from nanochat.rl import run as rl_run
    made = []

    def sample_draw(run, step, at, draw):
        made.append((at, draw))
        with_signal = signal_per_draw[min(draw, len(signal_per_draw) - 1)]
        return [rollout(at + i, [1, 0] if i < with_signal else [0, 0]) for i in range(examples)]
    monkeypatch.setattr(rl_run, "sample_draw", sample_draw)
    config = SimpleNamespace(examples_per_step=examples, dynamic_sampling=True, dynamic_sampling_rounds=rounds)
    run = SimpleNamespace(config=config, checkpointer=None, examples_per_rank=examples, reduce_device="cpu")
    return made, rl_run.sample_rollouts(run, 3, position)


def test_the_last_checkpoint_is_committed_after_the_first_draw_before_any_collective(monkeypatch, tmp_path):
    """A step's rollouts commit the checkpoint its loop saved last (Checkpointer.written_behind) at the end of their
    first draw, which ran no collective, and before the first one: with --dynamic-sampling the draws' agreement
    (any_rank), without it the training that follows the rollouts. With several ranks the commit is a collective
    of its own, so every rank must make it at that same point."""
    from types import SimpleNamespace

    from nanochat.checkpoints.checkpointer import Checkpointer
    from nanochat.rl import run as rl_run
    events = []

    def sample_draw(run, step, at, draw):
        events.append(f"draw {draw}")
        return [rollout(at + i, [0, 0]) for i in range(2)]

    def any_rank(flag, device):
        events.append("agreement")
        return flag
    monkeypatch.setattr(rl_run, "sample_draw", sample_draw)
    monkeypatch.setattr(rl_run, "any_rank", any_rank)
    saves = Checkpointer(str(tmp_path), rank=0, world_size=2, keep_last=0, snapshot=None)
    monkeypatch.setattr(saves.saver, "finish", lambda: events.append("commit"))
    for dynamic, expected in ((True, ["draw 0", "commit", "agreement", "draw 1", "agreement", "draw 2"]),
                              (False, ["draw 0", "commit"])):
        config = SimpleNamespace(examples_per_step=2, dynamic_sampling=dynamic, dynamic_sampling_rounds=2)
        run = SimpleNamespace(config=config, checkpointer=saves, examples_per_rank=2, reduce_device="cpu")
        events.clear()
        rl_run.sample_rollouts(run, 3, 6)
        assert events == expected


def test_a_step_draws_again_exactly_while_its_share_lacks_signal(monkeypatch):
    """Both sides of each bound (issue 67: a loop bound in the draws passed this file): a first draw with exactly the
    share of questions with signal draws no more, one short draws a second; a draw count stops at exactly
    --dynamic-sampling-rounds more draws (1 and 3) when no draw ever has the share, and the next step starts after the
    last draw."""
    made, out = draws_of(monkeypatch, [4], rounds=3)
    assert made == [(8, 0)] and out.next_position == 12 and [r.index for r in out.trained] == [8, 9, 10, 11]
    made, out = draws_of(monkeypatch, [3, 1], rounds=3)
    assert made == [(8, 0), (12, 1)] and out.next_position == 16
    assert [r.index for r in out.trained] == [8, 9, 10, 12]  # the first 4 with signal, in draw order
    for rounds in (1, 3):
        made, out = draws_of(monkeypatch, [0], rounds=rounds)
        assert made == [(8 + 4 * d, d) for d in range(rounds + 1)] and out.next_position == 8 + 4 * (rounds + 1)
        assert len(out.drawn) == 4 * (rounds + 1) and [r.index for r in out.trained] == [8, 9, 10, 11]
