"""Checkpoint save/load: round trips through the real GPT, upstream-compatibility patches, step and tag
resolution, and atomic writes (a failed save leaves nothing behind and never damages another step)."""

import errno
import json
import os
from dataclasses import asdict

import pytest
import torch
from helpers import random_model, tiny_config  # every parameter random: a loader that dropped one would show

from nanochat.checkpoints.errors import (CorruptCheckpointError, MissingMetaError, NoCheckpointsError, NoStepsError,
                                         UnknownStepError, UnknownTagError)
from nanochat.checkpoints.loading import build_model, load_model
from nanochat.checkpoints.optimizer_shards import ShardError, check_shard
from nanochat.checkpoints.pruning import prune_checkpoints, remove_extra_shards
from nanochat.checkpoints.store import find_largest_model, find_last_step, list_steps, load_checkpoint, save_checkpoint
from nanochat.errors import UserError
from nanochat.model.gpt import GPT

# `base_dir` (a fresh $NANOCHAT_BASE_DIR holding the tokenizer) and `tiny_tokenizer` come from conftest.py


@pytest.fixture
def vocab(tiny_tokenizer):
    return tiny_tokenizer.get_vocab_size()


def fixed_input(vocab_size):
    return (torch.arange(12).view(2, 6) * 37 + 5) % vocab_size  # (2, 6)


def meta_for(config, step=5):
    return {"step": step, "model_config": asdict(config)}


def files_of(directory):
    return sorted(os.listdir(directory))


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("phase", ["eval", "train"])
def test_round_trip_gives_identical_weights_and_logits(base_dir, phase, vocab):
    config = tiny_config(vocab_size=vocab)
    model = random_model(config)
    ckpt = base_dir / "chatsft_checkpoints" / "d2"
    save_checkpoint(str(ckpt), 5, model.state_dict(), None, meta_for(config))
    assert files_of(ckpt) == ["meta_000005.json", "model_000005.pt"]
    assert json.loads((ckpt / "meta_000005.json").read_text()) == meta_for(config)

    loaded, tokenizer, meta = load_model("sft", "cpu", phase)
    assert meta["step"] == 5 and meta["model_config"] == asdict(config)
    assert tokenizer.get_vocab_size() == vocab
    assert loaded.training == (phase == "train")
    reference = model.state_dict()
    got = loaded.state_dict()
    assert got.keys() == reference.keys()
    for k in reference:
        assert got[k].dtype == reference[k].dtype and torch.equal(got[k], reference[k]), k
    # loaded weights must be trainable leaves (RL trains the loaded model)
    assert all(p.requires_grad and p.is_leaf for p in loaded.parameters())
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(fixed_input(vocab)), model(fixed_input(vocab)))


def test_build_model_rejects_unknown_phase(tmp_path):
    with pytest.raises(ValueError, match="phase"):
        build_model(str(tmp_path), 0, "cpu", "inference")


def test_legacy_checkpoint_loads_as_its_generation(base_dir, vocab):
    """Upstream checkpoints of before 2026-01-11: keys prefixed by torch.compile, no resid/x0 lambdas, no
    window_pattern. They load as generation dec2025 (padded rows) with exactly their own keys (no lambdas
    added), and compute what a lambdas-1/0, window-"L" model computes within sequence_len."""
    config = tiny_config(vocab_size=vocab)
    model = random_model(config)
    legacy = {"_orig_mod." + k: v for k, v in model.state_dict().items() if k not in ("resid_lambdas", "x0_lambdas")}
    legacy_config = asdict(config)
    del legacy_config["window_pattern"]
    ckpt = base_dir / "mid_checkpoints" / "d2"
    save_checkpoint(str(ckpt), 100, legacy, None, {"step": 100, "model_config": legacy_config})

    loaded, _, meta = load_model("mid", "cpu", "eval")
    assert loaded.generation.name == ("dec2025" if vocab % 64 else "oct2025")
    assert loaded.meta_model_config() == legacy_config  # what that nanochat's GPTConfig accepts
    expected = {k[len("_orig_mod."):]: v for k, v in legacy.items()}
    got = loaded.state_dict()
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k].to(got[k].dtype)), k
    reference = GPT(tiny_config(vocab_size=vocab, window_pattern="L"))
    reference.init_weights()
    reference.load_state_dict({**expected, "resid_lambdas": torch.ones(config.n_layer),
                               "x0_lambdas": torch.zeros(config.n_layer)})
    reference.eval()
    with torch.no_grad():
        assert torch.equal(loaded(fixed_input(vocab)), reference(fixed_input(vocab)))


def test_bf16_tensors_are_cast_to_fp32_on_cpu(base_dir, vocab):
    config = tiny_config(vocab_size=vocab)
    model = random_model(config)
    bf16 = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    save_checkpoint(str(base_dir / "base_checkpoints" / "d2"), 3, bf16, None, meta_for(config, 3))
    loaded, _, _ = load_model("base", torch.device("cpu"), "eval")
    for k, v in loaded.state_dict().items():
        assert v.dtype == torch.float32, k
        assert torch.equal(v, bf16[k].float()), k


def test_unknown_model_config_field_is_dropped_with_a_warning(base_dir, vocab):
    config = tiny_config(vocab_size=vocab)
    model = random_model(config)
    meta = {"step": 1, "model_config": {**asdict(config), "some_future_flag": True}}
    save_checkpoint(str(base_dir / "chatrl_checkpoints" / "d2"), 1, model.state_dict(), None, meta)
    with pytest.warns(UserWarning, match="some_future_flag"):
        loaded, _, meta = load_model("rl", "cpu", "eval")
    assert "some_future_flag" not in meta["model_config"]
    with torch.no_grad():
        assert torch.equal(loaded(fixed_input(vocab)), model(fixed_input(vocab)))


# ----------------------------------------------------------------------------- step and tag resolution

def test_find_last_step_matches_exact_names_and_compares_as_ints(tmp_path):
    for name in ["model_000999.pt", "model_001000.pt", "model_9.pt", "model_000200_backup.pt",
                 "model_005000.pt.tmp", ".model_006000.pt.tmp-123", "optim_007000_rank0.pt", "meta_008000.json",
                 "xmodel_009000.pt"]:
        (tmp_path / name).write_bytes(b"")
    assert list_steps(str(tmp_path)) == [9, 999, 1000]
    assert find_last_step(str(tmp_path)) == 1000  # a string max would pick model_9.pt


def test_find_last_step_without_model_files(tmp_path):
    (tmp_path / "model_000200_backup.pt").write_bytes(b"")
    with pytest.raises(NoStepsError, match="no model_<step>.pt files in " + str(tmp_path)):
        find_last_step(str(tmp_path))


def test_find_largest_model(tmp_path):
    for tag in ["d4", "d12", "latest"]:
        (tmp_path / tag).mkdir()
    (tmp_path / "d20").write_bytes(b"")  # a file, not a model directory
    assert find_largest_model(str(tmp_path)) == "d12"  # a string max would pick d4

    other = tmp_path / "other"
    other.mkdir()
    for tag, mtime in [("old", 1_000_000), ("new", 3_000_000), ("mid", 2_000_000)]:
        (other / tag).mkdir()
        os.utime(other / tag, (mtime, mtime))
    assert find_largest_model(str(other)) == "new"

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no model directories in " + str(empty)):
        find_largest_model(str(empty))


def test_find_largest_model_takes_d_n_as_a_prefix(tmp_path):
    """nanochat matches "d" and digits at the start of a tag, so d32_long is a depth-32 model: it beats d12
    (the project used to accept only an exact d<N> and picked d12)."""
    for tag in ["d12", "d32_long", "dev", "latest"]:
        (tmp_path / tag).mkdir()
    assert find_largest_model(str(tmp_path)) == "d32_long"
    # a tie in depth: the most recently modified directory (nanochat leaves it to the listing order)
    (tmp_path / "d32").mkdir()
    os.utime(tmp_path / "d32", (1_000_000, 1_000_000))
    os.utime(tmp_path / "d32_long", (2_000_000, 2_000_000))
    assert find_largest_model(str(tmp_path)) == "d32_long"
    os.utime(tmp_path / "d32", (3_000_000, 3_000_000))
    assert find_largest_model(str(tmp_path)) == "d32"


# ----------------------------------------------------------------------------- user errors

def test_missing_checkpoints_dir_names_the_path(base_dir):
    """The facts only (the family and its directory); the script that makes one is nanochat.cli's hint."""
    with pytest.raises(NoCheckpointsError) as e:
        load_model("sft", "cpu", "eval")
    msg = str(e.value)
    assert e.value.source == "sft" and e.value.path == str(base_dir / "chatsft_checkpoints")
    assert str(base_dir / "chatsft_checkpoints") in msg and "\n" not in msg
    assert "--" not in msg and "scripts." not in msg


def test_unknown_source_tag_and_step(base_dir, vocab):
    with pytest.raises(UserError, match="valid sources: base, mid, sft, rl"):
        load_model("pretrain", "cpu", "eval")
    config = tiny_config(vocab_size=vocab)
    ckpt = base_dir / "chatsft_checkpoints" / "d2"
    save_checkpoint(str(ckpt), 7, random_model(config).state_dict(), None, meta_for(config, 7))
    save_checkpoint(str(ckpt), 12, random_model(config).state_dict(), None, meta_for(config, 12))
    with pytest.raises(UnknownTagError, match="available tags: d2") as e:
        load_model("sft", "cpu", "eval", model_tag="d4")
    assert (e.value.tag, e.value.available) == ("d4", ["d2"])
    with pytest.raises(UnknownStepError, match="available steps: 7, 12") as e:
        load_model("sft", "cpu", "eval", step=8)
    assert (e.value.step, e.value.available, e.value.path) == (8, [7, 12], str(ckpt))
    with pytest.raises(UnknownStepError, match="available steps: 7, 12"):
        load_checkpoint(str(ckpt), 9, "cpu")
    assert load_model("sft", "cpu", "eval", step=7)[2]["step"] == 7
    assert load_model("sft", "cpu", "eval")[2]["step"] == 12
    os.remove(ckpt / "meta_000007.json")
    with pytest.raises(MissingMetaError, match="meta_000007.json") as e:
        load_checkpoint(str(ckpt), 7, "cpu")
    assert e.value.path == str(ckpt / "meta_000007.json")


def test_truncated_model_file(base_dir, vocab):
    config = tiny_config(vocab_size=vocab)
    ckpt = base_dir / "chatsft_checkpoints" / "d2"
    save_checkpoint(str(ckpt), 5, random_model(config).state_dict(), None, meta_for(config))
    path = ckpt / "model_000005.pt"
    data = path.read_bytes()
    for cut in (0, 10, len(data) // 2, len(data) - 10):
        path.write_bytes(data[:cut])
        with pytest.raises(CorruptCheckpointError, match="corrupted") as e:
            load_model("sft", "cpu", "eval")
        assert e.value.path == str(path) and str(path) in str(e.value) and "--" not in str(e.value)


def test_shape_mismatch_error_is_not_cut(base_dir, vocab, capsys):
    """Weights of a 32-wide model under a 64-wide meta: torch lists every mismatched tensor, far past 300
    characters; the one-line error carries all of it (it used to be cut at 300 characters, mid-word)."""
    narrow, wide = tiny_config(vocab_size=vocab, n_embd=32), tiny_config(vocab_size=vocab)
    save_checkpoint(str(base_dir / "chatsft_checkpoints" / "d2"), 5, random_model(narrow).state_dict(), None,
                    meta_for(wide))
    with pytest.raises(UserError, match="does not match the GPT built from its meta") as e:
        load_model("sft", "cpu", "eval")
    msg = str(e.value)
    assert len(msg) > 500 and "\n" not in msg
    mismatched = [k for k, v in random_model(wide).state_dict().items()
                  if v.shape != random_model(narrow).state_dict()[k].shape]
    assert len(mismatched) > 5 and all(f"size mismatch for {k}:" in msg for k in mismatched)


def test_vocab_mismatch(base_dir, vocab):
    config = tiny_config(vocab_size=vocab + 3)
    save_checkpoint(str(base_dir / "chatsft_checkpoints" / "d2"), 5, random_model(config).state_dict(), None,
                    meta_for(config))
    with pytest.raises(UserError, match=f"tokenizer vocab size {vocab} != model vocab size {vocab + 3}") as e:
        load_model("sft", "cpu", "eval")
    assert "must be the one the model was trained with" in str(e.value)


def test_unwritable_checkpoint_dir(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_bytes(b"")
    target = blocker / "d2"
    with pytest.raises(UserError, match="could not create checkpoint directory " + str(target)):
        save_checkpoint(str(target), 1, {"w": torch.zeros(2)}, None, {"model_config": {}})


# ----------------------------------------------------------------------------- atomic writes

def disk_full_save(fail_on_call):
    """A torch.save that writes some bytes and then fails like a full disk, on its `fail_on_call`-th call."""
    real_save, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) < fail_on_call:
            return real_save(obj, f, *args, **kwargs)
        f.write(b"PK\x03\x04" + b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return save


@pytest.mark.parametrize("fail_on_call", [1, 2])  # 1: the optimizer shard fails; 2: the model fails after it
@pytest.mark.parametrize("failed_step", [20, 10])  # a new step, or overwriting the existing one
def test_disk_full_leaves_nothing_behind(base_dir, monkeypatch, fail_on_call, failed_step, vocab):
    config = tiny_config(vocab_size=vocab)
    model = random_model(config)
    ckpt = base_dir / "chatsft_checkpoints" / "d2"
    save_checkpoint(str(ckpt), 10, model.state_dict(), None, meta_for(config, 10))
    before = {name: (ckpt / name).read_bytes() for name in files_of(ckpt)}

    other = random_model(config, seed=1)
    with monkeypatch.context() as m, pytest.raises(UserError) as e:
        m.setattr(torch, "save", disk_full_save(fail_on_call))
        save_checkpoint(str(ckpt), failed_step, other.state_dict(), {"state": {}, "param_groups": []},
                        meta_for(config, failed_step))
    msg = str(e.value)
    assert "could not write checkpoint" in msg and str(ckpt) in msg and "No space left on device" in msg
    assert "free space or pass a different base dir" in msg and "\n" not in msg
    # no temp file, no file of the failed step, and the earlier step byte-for-byte as it was
    assert {name: (ckpt / name).read_bytes() for name in files_of(ckpt)} == before
    loaded, _, meta = load_model("sft", "cpu", "eval")
    assert meta["step"] == 10
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_non_json_meta_writes_nothing(tmp_path):
    with pytest.raises(TypeError):
        save_checkpoint(str(tmp_path), 1, {"w": torch.zeros(2)}, None, {"model_config": {}, "bad": object()})
    assert files_of(tmp_path) == []


def test_optimizer_shards_per_rank(tmp_path, vocab):
    config = tiny_config(vocab_size=vocab)
    model = random_model(config)
    shards = []
    for rank in range(2):
        # a real optimizer state (step counters, moments) that differs per rank
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * (rank + 1))
        model(fixed_input(vocab)).square().mean().backward()
        opt.step()
        model.zero_grad(set_to_none=True)
        shards.append(opt.state_dict())
    save_checkpoint(str(tmp_path), 42, model.state_dict(), shards[0], meta_for(config, 42), rank=0)
    save_checkpoint(str(tmp_path), 42, None, shards[1], meta_for(config, 42), rank=1)
    assert files_of(tmp_path) == ["meta_000042.json", "model_000042.pt", "optim_000042_rank0.pt", "optim_000042_rank1.pt"]
    for rank in range(2):
        model_data, optim_data, meta = load_checkpoint(str(tmp_path), 42, "cpu", load_optimizer=True, rank=rank)
        assert meta["step"] == 42
        assert optim_data["param_groups"] == shards[rank]["param_groups"]
        for i, state in shards[rank]["state"].items():
            for name, value in state.items():
                assert torch.equal(optim_data["state"][i][name], value), (rank, i, name)
    assert load_checkpoint(str(tmp_path), 42, "cpu")[1] is None
    with pytest.raises(UserError, match="optim_000042_rank2.pt"):
        load_checkpoint(str(tmp_path), 42, "cpu", load_optimizer=True, rank=2)


def test_rank1_alone_writes_only_its_shard(tmp_path):
    save_checkpoint(str(tmp_path), 3, None, {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}, {}, rank=1)
    assert files_of(tmp_path) == ["optim_000003_rank1.pt"]


# ----------------------------------------------------------------------------- --keep-last and --resume's checks

def test_prune_keeps_the_last_steps_and_removes_only_this_ranks_files(tmp_path):
    """After step 9 is saved with keep_last=2: steps 9 and 7 stay; 3 and 5 go, with the shard and meta of step 4
    whose model was never renamed (a killed save) and the temp files killed saves left for removed steps; step 12
    (after the one just saved: a resumed run's abandoned future) stays. Rank 1 removes only its own shards; rank 0
    the models, metas and its shards."""
    names = [f"{kind}_{s:06d}{ext}" for s in (3, 5, 7, 9, 12) for kind, ext in (("model", ".pt"), ("meta", ".json"))]
    names += [f"optim_{s:06d}_rank{r}.pt" for s in (3, 4, 5, 7, 9, 12) for r in (0, 1)] + ["meta_000004.json"]
    names += [".model_000005.pt.tmp-123", ".optim_000004_rank1.pt.tmp-456", ".model_000009.pt.tmp-789", "notes.txt"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert prune_checkpoints(str(tmp_path), 9, 2, rank=1, world_size=2) == [3, 4, 5]
    assert prune_checkpoints(str(tmp_path), 9, 2, rank=0, world_size=2) == [3, 4, 5]
    assert files_of(tmp_path) == sorted(
        [".model_000009.pt.tmp-789", "notes.txt"]
        + [f"{kind}_{s:06d}{ext}" for s in (7, 9, 12) for kind, ext in (("model", ".pt"), ("meta", ".json"))]
        + [f"optim_{s:06d}_rank{r}.pt" for s in (7, 9, 12) for r in (0, 1)])
    assert prune_checkpoints(str(tmp_path), 9, 1, rank=0, world_size=2) == [7] and not (tmp_path / "model_000007.pt").exists()
    assert (tmp_path / "optim_000007_rank1.pt").exists()  # rank 1's to remove
    # a run of 1 rank (a 2-rank run resumed on one): rank 1 is gone, so its shards are rank 0's to remove
    assert prune_checkpoints(str(tmp_path), 12, 1, rank=0, world_size=1) == [7, 9]
    assert files_of(tmp_path) == sorted(["notes.txt", "model_000012.pt", "meta_000012.json", "optim_000012_rank0.pt",
                                         "optim_000012_rank1.pt"])


def test_a_step_saved_again_by_fewer_ranks_loses_the_extra_shards(tmp_path):
    """A 2-rank run resumed on 1 rank from an earlier step saves step 5 again: rank 1's old shard of step 5 goes
    (the meta says 1 rank); other steps' shards stay, for prune_checkpoints."""
    for name in ("optim_000005_rank0.pt", "optim_000005_rank1.pt", "optim_000005_rank2.pt", "optim_000006_rank1.pt"):
        (tmp_path / name).write_bytes(b"x")
    assert remove_extra_shards(str(tmp_path), 5, 1) == [1, 2]
    assert files_of(tmp_path) == ["optim_000005_rank0.pt", "optim_000006_rank1.pt"]


@pytest.mark.parametrize("change, message", [
    ({"run_id": "other"}, "is from another run (run id other; the meta of step 4 records run abc)"),
    ({"step": 3}, "holds step 3, not step 4"),
    ({"rank": 1}, "was written by rank 1 of 2 ranks, not by rank 0 of 2"),
    ({"world_size": 1}, "was written by rank 0 of 1 ranks, not by rank 0 of 2"),
    ({"optimizers": None}, 'is not an optimizer shard (no "optimizers" list in it)'),
])
def test_a_shard_that_is_not_the_steps_is_named(tmp_path, change, message):
    shard = {"optimizers": [], "run_id": "abc", "step": 4, "rank": 0, "world_size": 2}
    check_shard(shard, "optim_000004_rank0.pt", 4, 0, 2, "abc")
    with pytest.raises(ShardError) as e:
        check_shard({**shard, **change}, "optim_000004_rank0.pt", 4, 0, 2, "abc")
    assert str(e.value) == f"optimizer shard optim_000004_rank0.pt {message}"
    check_shard({"optimizers": [], "world_size": 2}, "old.pt", 4, 0, 2, None)  # a shard from before run ids
