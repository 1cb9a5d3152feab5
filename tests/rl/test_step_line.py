"""The step line a new user reads (issue 74): nanochat's fields as nanochat prints them, then every field named the
same way ("Name: value", in words), only the fields that measure something on this run (no CUDA graphs counted on a
CPU), and wandb's state said once at the start. wandb and the history keep their keys (tests/rl/test_metrics.py)."""

import re
from types import SimpleNamespace

from helpers import TINY_RL_FLAGS

from nanochat.rl.config import RLConfig
from nanochat.rl.progress import RunProgress, format_step_line
from nanochat.wandb_utils import wandb_state
from scripts import chat_rl

# a step of nanochat's defaults (README "What a run prints"); step_record's keys
RECORD = {"step": 0, "reward_mean": 0.1875, "seq_len_mean": 253.125, "completion_len_mean": 143.5,
          "completion_len_min": 37.0, "completion_len_max": 256.0, "truncated_fraction": 0.0625, "reward_std": 0.39,
          "zero_std_fraction": 0.4375, "tool_calls_per_sample": 1.9, "tool_success_fraction": 0.97,
          "num_tool_calls": 486.0, "rows_trained": 144.0, "num_samples": 256.0, "num_questions": 16.0,
          "entropy": 0.912, "grad_norm": 0.381, "lrm": 1.0, "sampler_tokens": 20000.0, "sampler_gap_mean": 2.1e-3,
          "sampler_gap_max": 9.7e-3, "sampler_k3": 4.0e-6, "corrected_fraction": 0.0, "time/rollout": 12.1,
          "time/train": 3.0, "rollout_tokens_per_s": 2890.0, "captures": 0.0, "compiles": 0.0, "compile_s": 0.0}
FIELD = re.compile(r"[A-Z][A-Za-z -]*: \S")  # "Name: value", the name in words


def line_of(record, **config):
    run = SimpleNamespace(num_steps=467, config=RLConfig(**config),
                          progress=RunProgress(step_seconds=[15.1], eval_seconds=[41.25]))
    return format_step_line(run, {**RECORD, **record}, elapsed=56)


def test_the_step_line_names_each_field_in_words():
    """Regression (issue 74): the line mixed nanochat's names with `lrm`, `gnorm`, `k3`, `captures 0` (always 0 on a
    CPU) that only the README explained. The exact line of a step of nanochat's defaults on a CPU:"""
    assert line_of({}) == (
        "Step 0/467 | Average reward: 0.1875 | Average sequence length: 253.12 | Average completion length: 143.50 "
        "(37-256, 6% cut off) | No-signal questions: 44% | Calculator: 1.90 calls a sample, 97% ok | Rows trained: "
        "144/256 | Entropy: 0.912 | Grad norm: 0.381 | LR multiplier: 1.000 | Sampler gap: mean 2.1e-03, max 9.7e-03, "
        "KL 4.0e-06 | Rollout: 12.1s, 2890 tok/s | Training: 3.0s | Elapsed: 56s | ETA: 1h57m + 5m30s of evals")


def test_a_field_shows_only_where_it_measures_something():
    """CUDA graphs captured: only on a step that captured some (graph decoding); the calculator's success rate: only
    where it was called; the options' fields (PPO, KL penalty, fp16, corrections, dynamic sampling) only with them;
    each still a "Name: value"."""
    assert "CUDA graphs" not in line_of({}) and "| Rollout: 12.1s, 2890 tok/s, 3 CUDA graphs captured |" in line_of(
        {"captures": 3.0})
    assert "| Calculator: 0.00 calls a sample |" in line_of({"tool_calls_per_sample": 0.0, "num_tool_calls": 0.0})
    options = line_of({"clip_fraction": 0.0125, "approx_kl": 1.5e-4, "kl_ref": 2e-3, "loss_scale": 32768.0,
                       "overflow": True, "questions_trained": 16.0, "num_questions": 48.0, "corrected_fraction": 0.003,
                       "compiles": 2.0, "compile_s": 41.0}, rollout_correction="token-tis")
    for field in ("PPO clipped: 1.2%, KL to the old policy 1.50e-04", "KL to the reference: 2.00e-03",
                  "Loss scale: 32768 (overflow: step skipped, scale halved)", "Questions: 48 drawn, 16 trained",
                  "Sampler gap: mean 2.1e-03, max 9.7e-03, KL 4.0e-06, 0.3% corrected",
                  "Compiled: 2 graphs in 41.0s"):
        assert f"| {field} |" in options, field
    for line in (line_of({}), options):
        assert all(FIELD.match(field) for field in line.split(" | ")[1:]), line


def test_wandb_state_is_one_line():
    assert wandb_state("dummy", "nanochat-rl") == "wandb: off (--run=dummy; --run=NAME logs a run)"
    assert wandb_state("my_run", "nanochat-rl") == "wandb: run my_run in project nanochat-rl"


def test_wandb_state_follows_wandb_mode(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_state("my_run", "nanochat-rl") == ("wandb: run my_run in project nanochat-rl (offline: `wandb sync` "
                                                    "uploads it)")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_state("my_run", "nanochat-rl") == "wandb: off (WANDB_MODE=disabled)"


def test_a_cpu_run_says_wandb_is_off_once_and_prints_no_graph_captures(sft, base_dir, capsys):
    """chat_rl on a CPU: `wandb: off (...)` once, before the first step line; every step line's fields named in
    words, none counting CUDA graphs (there are none to capture on a CPU)."""
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=2"])
    lines = capsys.readouterr().out.splitlines()
    steps = [i for i, line in enumerate(lines) if line.startswith("Step ")]
    wandb = [i for i, line in enumerate(lines) if line.startswith("wandb: ")]
    assert len(steps) == 2 and len(wandb) == 1 and wandb[0] < steps[0]
    assert lines[wandb[0]] == wandb_state("dummy", "nanochat-rl")
    for i in steps:
        assert all(FIELD.match(field) for field in lines[i].split(" | ")[1:]), lines[i]
        assert "captur" not in lines[i] and "CUDA" not in lines[i]
