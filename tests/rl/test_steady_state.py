"""Consecutive chat_rl steps hold the same memory. On a GPU, rollout time grew ~15% a step (issue 23), the mark of
something that accumulates across steps (caches, tensors, lists of a step's rollouts); here every step after
the first starts with the same live tensors and the same Python objects."""

import gc

import pytest
import torch
from helpers import TINY_RL_FLAGS

from nanochat.rl import run as rl_run
from scripts import chat_rl


def live_counts():
    """(live tensors, live Python objects tracked by the collector), after a full collection."""
    gc.collect()
    objects = gc.get_objects()
    return sum(issubclass(type(o), torch.Tensor) for o in objects), len(objects)  # type(): no __class__ lookups


@pytest.mark.slow
@pytest.mark.parametrize("decode", ["eager", "static"])
def test_every_step_starts_with_the_same_live_tensors_and_objects(decode, sft, base_dir, monkeypatch):
    """Counted when each step's rollouts start, over 8 steps: the first step creates the engine's kept batch and
    the optimizer's state; from the second on the tensors are the same in number, and from the third the
    objects are too, exactly: nothing of a step's rollouts, batches or caches is kept, and the step records
    kept in the run's history hold only numbers, which the collector does not track. A leak of one list a step
    fails."""
    counts = []
    sample_rollouts = rl_run.sample_rollouts

    def counted(run, step, position=None):
        counts.append(live_counts())
        return sample_rollouts(run, step, position)

    monkeypatch.setattr(rl_run, "sample_rollouts", counted)
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=8", f"--decode={decode}", "--save-every=100"])
    tensors, objects = zip(*counts)
    assert len(counts) == 8 and len(set(tensors[1:])) == 1
    # Python objects: equal from the third step on, but for a transient of one or two (an interpreter cache filled
    # on some step); a leak of one object a step grows by 5 over these 6 steps and fails both bounds
    steady = objects[2:]
    assert max(steady) - min(steady) <= 2 and steady[-1] - steady[0] <= 1, objects
