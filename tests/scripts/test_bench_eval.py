"""scripts/bench_eval.py: an eval timed with its prompts prefilled together and one at a time, on the same questions."""

import json

from scripts import bench_eval


def test_both_ways_sample_alike_and_differ_in_prefill_forwards(sft, tmp_path, capsys):
    out_file = tmp_path / "eval.json"
    bench_eval.main(["--source=sft", "--task=arithmetic", "--eval-examples=3", "--num-samples=2", "--max-new-tokens=4",
                     "--repeats=1", "--device-type=cpu", "--dtype=float32", f"--output={out_file}"])
    result = json.loads(out_file.read_text())
    batched, one_by_one = result["batched"], result["one_by_one"]
    assert (batched["prefill_forwards_last_rollout"], one_by_one["prefill_forwards_last_rollout"]) == (1, 3)
    assert batched["pass@1"] == one_by_one["pass@1"]
    assert all(result[way]["prefill_seconds"] < result[way]["seconds"] for way in ("batched", "one_by_one"))
    assert result["speedup"] == one_by_one["seconds"] / batched["seconds"]
    assert "one at a time / batched" in capsys.readouterr().out
