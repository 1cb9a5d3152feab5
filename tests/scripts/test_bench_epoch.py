"""scripts/bench_epoch.py: an epoch's count of evals and saves is chat_rl's schedule, the estimate adds them up at
the bench's rates, and the saves it times write what chat_rl's saves write."""

import json

import pytest

from nanochat.checkpoints.store import load_checkpoint
from nanochat.errors import UserError
from scripts import bench_epoch


def test_an_epoch_has_chat_rls_evals_and_saves():
    # nanochat's GSM8K epoch: evals at 0, 60, ..., 420 and after the last step; saves at 60, ..., 420 and step 466
    minutes, evals, saves, _ = bench_epoch.epoch_estimate(2.0, 30.0, 0.5, 467, 60, 60)
    assert (evals, saves) == (9, 8)
    assert minutes == pytest.approx((467 * 2.0 + 9 * 30.0 + 8 * 0.5) / 60)
    assert bench_epoch.epoch_estimate(1.0, 1.0, 1.0, 10, -1, -1)[1:3] == (0, 1)  # no eval; the last step is saved


def test_a_saves_writing_blocks_only_what_the_steps_before_the_next_wait_do_not_hide():
    """Saves at the ends of steps 60, 120, ..., 420 and 466 (the last); evals at the starts of 0, 60, ..., 420 and
    467. A save's writing is hidden by the steps before the next eval (59 after each of 60..360) or up to the next
    save (46 from 420 to 466), and blocks the rest: the last save is waited for at once (by the final eval)."""
    base = bench_epoch.epoch_estimate(2.0, 30.0, 0.5, 467, 60, 60)[0]
    # 100 s of writing at 2 s a step: hidden after 60..360 (118 s), 8 s over after 420 (92 s), all of it after 466
    minutes, _, _, unhidden = bench_epoch.epoch_estimate(2.0, 30.0, 0.5, 467, 60, 60, write_seconds=100.0)
    assert unhidden == pytest.approx(8 + 100) and minutes == pytest.approx(base + unhidden / 60)
    assert bench_epoch.epoch_estimate(2.0, 30.0, 0.5, 467, 60, 60, write_seconds=200.0)[3] == pytest.approx(
        6 * 82 + 108 + 200)


def test_the_estimate_reads_the_bench_and_times_both_saves(tmp_path, capsys):
    bench = {"model": {"n_layer": 1, "vocab_size": 96},
             "results": {"batched_fp32": {"step_seconds": 1.5, "rollout_seconds": 0.5, "rows": 256}}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    out_file = tmp_path / "epoch.json"
    report = bench_epoch.main([f"--bench={tmp_path / 'bench.json'}", "--device-type=cpu", "--overlap-seconds=0",
                               f"--output={out_file}"])
    assert json.loads(out_file.read_text()) == report
    epoch, save = report["epoch"], report["save"]
    assert epoch["eval_seconds"] == pytest.approx(0.5 * 3200 / 256) and (epoch["evals"], epoch["saves"]) == (9, 8)
    # a tiny model's writing ends long before the next save (45 steps of 1.5 s at least): each save blocks its snapshot
    # and commit, and the last one, waited for by the final eval at once, its writing too
    assert epoch["unhidden_write_seconds"] == pytest.approx(save["write_seconds"])
    assert epoch["minutes"] == pytest.approx((467 * 1.5 + 9 * epoch["eval_seconds"] + 8 * save["alone_blocking_seconds"]
                                              + save["write_seconds"]) / 60)
    assert save["bytes"] > 0 and save["alone_blocking_seconds"] == pytest.approx(save["snapshot_seconds"]
                                                                                 + save["commit_seconds"])
    assert save["ranks_blocking_seconds"] == pytest.approx(save["alone_blocking_seconds"] + save["write_seconds"])  # no overlap
    out = capsys.readouterr().out
    assert f"d1 epoch on this CPU ≈ {epoch['minutes']:.0f} min (467 steps x 1.50 s + 9 evals x" in out
    assert "s of writing not hidden)" in out


def test_a_missing_config_or_unreadable_bench_is_one_line(tmp_path):
    (tmp_path / "bench.json").write_text(json.dumps({"results": {"baseline": {}}}))
    with pytest.raises(UserError, match=r"--config=other: not in .*bench.json; it has baseline"):
        bench_epoch.main([f"--bench={tmp_path / 'bench.json'}", "--config=other"])
    with pytest.raises(UserError, match="cannot read it"):
        bench_epoch.main([f"--bench={tmp_path / 'missing.json'}"])


def test_the_timed_saves_are_loadable_checkpoints(tmp_path):
    model, optimizers = bench_epoch.model_with_optimizer_state(1, 96, bench_epoch.torch.device("cpu"))
    saves = bench_epoch.time_saves(model, optimizers, str(tmp_path), 0.0, bench_epoch.torch.device("cpu"))
    assert saves["whole_seconds"] > 0
    for kind in ("sync", "background"):
        weights, shard, _ = load_checkpoint(str(tmp_path / kind), 1, "cpu", load_optimizer=True, rank=0)
        assert weights.keys() == model.state_dict().keys() and len(shard["optimizers"]) == len(optimizers)
