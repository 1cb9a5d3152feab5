"""--resume on the same or another number of ranks (issue 38): the optimizer shards gathered and re-split exactly,
the epoch continued with its next questions, an uneven split refused before anything is written; the lr schedules
against their formulas across a resume; the warnings of runs that cannot learn."""

import copy
import hashlib
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_ranks
from helpers import PYTHONPATH, TINY_RL_FLAGS, assert_same_weights, random_model, tiny_config, weights

from nanochat.checkpoints.optimizer_shards import gather_optimizer_states, split_optimizer_states
from nanochat.cli import run_main
from nanochat.rl import progress as rl_progress
from nanochat.rl import run as rl_run
from nanochat.rl.config import RLConfig
from scripts import chat_rl

# 16 questions, 4 a step: --num-steps=4 is one epoch. Every reward is written down (see RecordedParityTask).
FLAGS = [f for f in TINY_RL_FLAGS if not f.startswith("--task")] + ["--task=rl_toy_task:RecordedParityTask",
                                                                     "--num-steps=4", "--save-every=1"]


def rl_dir(base_dir):
    return base_dir / "chatrl_checkpoints" / "d2"


def meta(base_dir, step):
    return json.loads((rl_dir(base_dir) / f"meta_{step:06d}.json").read_text())


def drop_steps(directory, *steps):
    for step in steps:
        for f in directory.glob(f"*_{step:06d}*"):
            f.unlink()


def questions(log, rank):
    """The questions rank `rank` trained on, in order (one line per sample in the log: consecutive repeats merged);
    the log is emptied for the next run."""
    path = Path(f"{log}.rank{rank}")
    lines = path.read_text().split() if path.exists() else []
    path.unlink(missing_ok=True)
    return [int(q) for q, _ in itertools.groupby(lines)]


def digests(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in Path(root).rglob("*")
            if p.is_file()}


def assert_same_state(a, b, exact_dtype=True):
    """Two gathered optimizer states: the same keys, steps and hyperparameters, and bitwise-equal tensors."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        # the hyperparameters both optimizers have (torch's AdamW adds its own switches: fused, foreach, ...)
        assert [{k: v for k, v in g.items() if k in h} for g, h in zip(x["param_groups"], y["param_groups"])] == [
            {k: v for k, v in h.items() if k in g} for g, h in zip(x["param_groups"], y["param_groups"])]
        assert x["state"].keys() == y["state"].keys()
        for index in x["state"]:
            assert x["state"][index].keys() == y["state"][index].keys(), index
            for key, u in x["state"][index].items():
                v = y["state"][index][key]
                if not torch.is_tensor(u):
                    assert u == v and type(u) is type(v), (index, key)
                    continue
                assert not exact_dtype or u.dtype == v.dtype, (index, key)
                assert torch.equal(u.double(), v.double()), (index, key)


def drop_timing(records):
    return [{k: v for k, v in r.items() if "time" not in k and "per_s" not in k} for r in records]


@pytest.fixture
def question_log(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", PYTHONPATH)  # the ranks import rl_toy_task from tests/
    monkeypatch.setenv("QUESTION_LOG", str(tmp_path / "questions"))
    return tmp_path / "questions"


@pytest.mark.slow
def test_two_rank_run_resumes_on_two_ranks_bitwise_and_on_one_rank(sft, base_dir, question_log, monkeypatch, capsys):
    """A 2-rank run's step 1 resumed on 2 ranks ends with bitwise the uninterrupted run's weights and history. On 1
    rank, the optimizer it loads is the 2 shards gathered, bit for bit; it trains on the epoch's next questions in
    one process's order, none seen before; it ends with the uninterrupted 2-rank run's weights up to the order of
    the gradient sums (question seeds and per-sample streams do not depend on the ranks; a lost momentum moves
    weights by ~lr = 1e-2); and the meta continues the run (id, history) and records both segments."""
    run_ranks(lambda rank: ["-m", "scripts.chat_rl", *FLAGS, "--save-rollouts"], timeout=300)
    directory = rl_dir(base_dir)
    assert questions(question_log, 0) == [0, 2, 4, 6, 8, 10, 12, 14]  # nanochat's split: rank r takes r, r+2, ...
    assert questions(question_log, 1) == [1, 3, 5, 7, 9, 11, 13, 15]
    # --save-rollouts: each rank's own samples in its own file, its questions in its order
    saved_rollouts = [(directory / f"rollouts_rank{r}.jsonl").read_bytes() for r in (0, 1)]
    for r in (0, 1):
        lines = [json.loads(line) for line in saved_rollouts[r].decode().splitlines()]
        assert [line["question"] for line in lines if line["sample"] == 0] == list(range(r, 16, 2))
    uninterrupted, saved_meta = weights(directory / "model_000003.pt"), meta(base_dir, 3)
    step1 = meta(base_dir, 1)
    saved_shards = [torch.load(directory / f"optim_000001_rank{r}.pt", weights_only=True)["optimizers"] for r in (0, 1)]

    drop_steps(directory, 2, 3)
    run_ranks(lambda rank: ["-m", "scripts.chat_rl", "--resume=d2:1", "--device-type=cpu", "--save-rollouts"], timeout=300)
    assert_same_weights(weights(directory / "model_000003.pt"), uninterrupted)
    assert [(directory / f"rollouts_rank{r}.jsonl").read_bytes() for r in (0, 1)] == saved_rollouts
    assert drop_timing(meta(base_dir, 3)["history"]) == drop_timing(saved_meta["history"])
    assert [questions(question_log, r) for r in (0, 1)] == [[8, 10, 12, 14], [9, 11, 13, 15]]

    drop_steps(directory, 2, 3)
    real_restore, loaded = rl_run.restore_optimizers, []

    def restore(resume, optimizers, *args, **kwargs):
        saved = real_restore(resume, optimizers, *args, **kwargs)
        state = copy.deepcopy([opt.state_dict() for opt in optimizers])
        loaded.append((gather_optimizer_states([state], optimizers), gather_optimizer_states(saved_shards, optimizers)))
        return saved
    monkeypatch.setattr(rl_run, "restore_optimizers", restore)
    capsys.readouterr()
    chat_rl.main(["--resume=d2:1", "--device-type=cpu"])
    assert "--resume: the optimizer state of 2 ranks re-split for 1" in capsys.readouterr().out
    # torch's load_state_dict casts a state tensor to its parameter's dtype (a bf16 NorMuon buffer to fp32: exact)
    assert_same_state(*loaded[0], exact_dtype=False)
    assert questions(question_log, 0) == [8, 9, 10, 11, 12, 13, 14, 15]  # with steps 0-1's 0-7: each question once
    resumed = weights(directory / "model_000003.pt")
    for k in uninterrupted:
        assert torch.allclose(resumed[k], uninterrupted[k], atol=1e-5, rtol=0), k
    after = meta(base_dir, 3)
    assert after["run_id"] == step1["run_id"] and after["world_size"] == 1
    assert after["segments"] == [{"start_step": 0, "world_size": 2}, {"start_step": 2, "world_size": 1}]
    assert [r["step"] for r in after["history"]] == [0, 1, 2, 3] and after["history"][:2] == step1["history"]
    assert sorted(p.name for p in directory.glob("optim_000003_*")) == ["optim_000003_rank0.pt"]
    for r in (0, 1):  # resumed without --save-rollouts: both files end at the resumed step
        kept = [line for line in saved_rollouts[r].decode().splitlines() if json.loads(line)["step"] <= 1]
        assert (directory / f"rollouts_rank{r}.jsonl").read_text().splitlines() == kept


@pytest.mark.slow
def test_one_rank_run_resumes_on_two_ranks_mid_schedule_and_three_ranks_are_refused(sft, base_dir, question_log,
                                                                                   monkeypatch, capsys):
    """A 1-process cosine run with warm-up, resumed from step 1 on 2 ranks: the epoch goes on with questions 8-15
    (rank r every other one), the weights end as the uninterrupted run's (up to the order of the gradient sums), and
    the schedule is the run's (a different --lr-schedule on the command line is overridden), each step's lrm its
    formula. On 3 ranks the resume is refused in one line before anything is written: 4 questions a step do not
    split over 3 ranks."""
    schedule = ["--lr-schedule=cosine", "--warmup-steps=2", "--final-lr-frac=0.1"]
    chat_rl.main(FLAGS + schedule)
    assert "warning" not in capsys.readouterr().out  # a run that learns: no no-signal warning
    assert questions(question_log, 0) == list(range(16))
    directory = rl_dir(base_dir)
    uninterrupted = weights(directory / "model_000003.pt")
    drop_steps(directory, 2, 3)

    before = digests(base_dir)
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "3")):
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        run_main(chat_rl.main, ["--resume=d2:1", "--device-type=cpu"])  # refused before any process group is made
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert ("--resume: run d2 takes 4 questions a step (its --examples-per-step), which 3 ranks cannot share evenly; "
            "resume it on a number of ranks that divides 4 (e.g. torchrun --nproc_per_node=2)") in err
    assert digests(base_dir) == before
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name)

    (out, _), _ = run_ranks(lambda rank: ["-m", "scripts.chat_rl", "--resume=d2:1", "--device-type=cpu",
                                          "--lr-schedule=linear"], timeout=300)
    assert ("--lr-schedule=linear ignored: the run's saved lr_schedule=cosine is kept (--resume continues a run with "
            "its own settings)") in out.splitlines()
    assert "--resume: the optimizer state of 1 rank re-split for 2" in out
    assert [questions(question_log, r) for r in (0, 1)] == [[8, 10, 12, 14], [9, 11, 13, 15]]
    resumed = weights(directory / "model_000003.pt")
    for k in uninterrupted:
        assert torch.allclose(resumed[k], uninterrupted[k], atol=1e-5, rtol=0), k
    after = meta(base_dir, 3)
    assert after["segments"] == [{"start_step": 0, "world_size": 1}, {"start_step": 2, "world_size": 2}]
    # warm-up (step + 1) / 2, then t = (step - 2) / 2 and lrm = 0.1 + 0.9 * (1 + cos(pi t)) / 2
    expected = [0.5, 1.0, 1.0, 0.1 + 0.9 * (1 + math.cos(math.pi * 0.5)) / 2]
    assert [r["lrm"] for r in after["history"]] == pytest.approx(expected, abs=1e-15)
    assert [line.split("| LR multiplier: ")[1][:5] for line in out.splitlines()
            if line.startswith("Step ")] == ["1.000", "0.550"]


@pytest.mark.parametrize("recipe", ["2026-01", "2026-07"])
def test_re_split_states_gather_back_to_the_saved_one_bit_for_bit(recipe):
    """A one-process optimizer state (after two steps) cut for 2 and 3 ranks and gathered again is the same state,
    bit for bit; each Muon matrix's state goes to exactly one rank and each sharded AdamW moment is cut in rows."""
    model = random_model(tiny_config(n_layer=3, n_embd=64, vocab_size=512))
    optimizers = model.setup_optimizers(recipe=recipe, ortho_dtype=torch.float32)
    torch.manual_seed(1)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        for opt in optimizers:
            opt.step()
    whole = gather_optimizer_states([[opt.state_dict() for opt in optimizers]], optimizers)
    assert any(len(w["state"]) for w in whole)
    for world_size in (2, 3):
        parts = [split_optimizer_states(whole, optimizers, r, world_size) for r in range(world_size)]
        assert_same_state(gather_optimizer_states(parts, optimizers), whole)
        owners, cut = [], []
        for k, w in enumerate(whole):
            for index, state in w["state"].items():
                holders = [part[k]["state"][index] for part in parts if index in part[k]["state"]]
                owners.append(len(holders))
                if "exp_avg" in state and len(holders) == world_size:
                    cut.append(holders[0]["exp_avg"].shape[0] * world_size == state["exp_avg"].shape[0])
        assert set(owners) == {1, world_size}  # Muon matrices: one owner each; AdamW: on every rank
        assert any(cut) == (world_size == 2)  # the embeddings' 512 rows split in 2, not in 3


def test_no_signal_settings_are_named_and_a_normal_run_has_none():
    """Each setting that makes every advantage 0 has its own line; nanochat's defaults have none."""
    assert rl_progress.no_signal_settings(RLConfig()) == []
    lines = rl_progress.no_signal_settings(RLConfig(temperature=0, top_k=1, num_samples=1, device_batch_size=1))
    assert [line.split(":")[1].strip() for line in lines] == ["--temperature=0 samples greedily", "--top-k=1 always "
                                                              "takes the most likely token", "--num-samples=1"]


@pytest.mark.parametrize("flags, start", [
    (["--temperature=0"], "warning: --temperature=0 samples greedily: every sample of a question is the same"),
    (["--top-k=1"], "warning: --top-k=1 always takes the most likely token: every sample of a question is the same"),
    (["--num-samples=1", "--device-batch-size=1"], "warning: --num-samples=1: a question's one sample is its own mean"),
])
def test_a_run_that_cannot_learn_says_so_and_exits_normally(sft, base_dir, flags, start, capsys):
    """Regression (issue 38): such a run trained nothing, to the end, without a word. Now: the setting's warning
    at the start, and one warning after --no-signal-steps steps that trained no row; the run still ends normally."""
    chat_rl.main(TINY_RL_FLAGS + flags + ["--num-steps=2", "--save-every=-1", "--no-signal-steps=2"])
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2 and warnings[0].startswith(start), warnings
    assert warnings[1].startswith("warning: no row was trained in 2 consecutive steps (steps 0-1): ")
    assert "Rows trained: 0/" in out and (rl_dir(base_dir) / "model_000001.pt").exists()
