"""The run report: section files, report.md assembly order and header, and the Chat RL section
(config table, pass@k at first and last eval, plots that decode as images); each run's section and plots kept under
report/runs/, the latest at nanochat's names (issue 74)."""

import platform
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from nanochat.report import (PNG_SIGNATURE, DummyReport, Report, get_report, log_chat_rl, markdown_table, slugify,
                             trailing_mean)

# the run's device for the header: a CPU run asks CUDA nothing (under conftest's pretend CUDA it would fail)
CPU = torch.device("cpu")
CONFIG = {"run": "test_run", "task": "arithmetic", "num_samples": 4, "matrix_lr": 0.02, "eval_every": 2}


def fake_history(num_steps=5):
    return [{"step": s, "reward_mean": 0.1 * s, "reward_std": 0.05, "seq_len_mean": 120.0 - s,
             "completion_len_mean": 20.0 - s, "completion_len_min": 10.0, "completion_len_max": 30.0,
             "truncated_fraction": 0.0} for s in range(num_steps)]


EVALS = [
    (0, {"pass@1": 0.125, "pass@2": 0.25}),
    (2, {"pass@1": 0.2, "pass@2": 0.3}),
    (5, {"pass@1": 0.5, "pass@2": 0.75}),
]


def test_slugify_and_table_escaping():
    assert slugify("Chat RL") == "chat-rl"
    assert slugify("Chat evaluation (sft)") == "chat-evaluation-sft"
    table = markdown_table(["a", "b"], [["x|y", 0.5]])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| x\\|y | 0.5000 |"]


def test_chat_rl_section_and_plots(tmp_path):
    report = Report(tmp_path / "report")
    path = log_chat_rl(report, CONFIG, fake_history(), EVALS)
    assert path == str(tmp_path / "report" / "chat-rl.md")
    md = (tmp_path / "report" / "chat-rl.md").read_text()
    assert md.startswith("## Chat RL\n")

    lines = md.splitlines()
    for key, value in [("run", "test_run"), ("task", "arithmetic"), ("num_samples", "4"), ("matrix_lr", "0.0200")]:
        assert f"| {key} | {value} |" in lines
    # pass@k at the first (step 0) and last (step 5) eval, not the middle one
    assert "| metric | step 0 | step 5 |" in lines
    assert "| pass@1 | 0.1250 | 0.5000 |" in lines
    assert "| pass@2 | 0.2500 | 0.7500 |" in lines
    # final metrics are the last step's
    assert "| reward_mean | 0.4000 |" in lines and "| steps logged | 5 |" in lines

    for name, file in [("reward", "chat-rl-reward.png"), ("completion length", "chat-rl-completion-len.png"),
                       ("pass@1", "chat-rl-pass1.png")]:
        assert f"![{name}]({file})" in lines
        png = tmp_path / "report" / file
        assert png.read_bytes()[:8] == PNG_SIGNATURE
        with Image.open(png) as im:
            im.load()
            width, height = im.size
        assert width > 0 and height > 0
        pixels = np.asarray(Image.open(png).convert("L"))
        assert pixels.min() < pixels.max()  # something was drawn, not a blank canvas


def test_chat_rl_section_without_evals(tmp_path):
    """No eval (chat_rl --eval-every=-1): no pass@k table or pass@1 plot, and the section says so."""
    report = Report(tmp_path)
    log_chat_rl(report, CONFIG, fake_history(3), [])
    md = (tmp_path / "chat-rl.md").read_text()
    assert "No evaluation was run" in md and "pass1.png" not in md
    assert not (tmp_path / "chat-rl-pass1.png").exists()
    assert (tmp_path / "chat-rl-reward.png").exists()


def drawn_plots(monkeypatch):
    """{file name: the series drawn in it}, filled as the report draws its plots (each still written)."""
    import nanochat.report as report_module
    drawn = {}
    real_plot = report_module._plot

    def plot(path, ylabel, series, **kwargs):
        drawn[Path(path).name] = series
        return real_plot(path, ylabel, series, **kwargs)
    monkeypatch.setattr(report_module, "_plot", plot)
    return drawn


def test_entropy_plot_skips_the_steps_without_one(tmp_path, monkeypatch):
    """Steps that trained no row have no entropy (older runs logged NaN there): the plot draws the others only,
    and a run with no entropy at all has no entropy plot."""
    drawn = drawn_plots(monkeypatch)
    history = fake_history(5)
    for step, entropy in ((0, 2.5), (2, float("nan")), (3, 2.25)):
        history[step]["entropy"] = entropy
    log_chat_rl(Report(tmp_path), CONFIG, history, [])
    (xs, ys, label), = drawn["chat-rl-entropy.png"]
    assert (xs, ys, label) == ([0, 3], [2.5, 2.25], "entropy")
    assert "![entropy](chat-rl-entropy.png)" in (tmp_path / "chat-rl.md").read_text().splitlines()
    drawn.clear()
    log_chat_rl(Report(tmp_path / "none"), CONFIG, fake_history(3), [])
    assert "chat-rl-entropy.png" not in drawn and "entropy" not in (tmp_path / "none" / "chat-rl.md").read_text()


def test_chat_rl_section_rejects_history_without_metrics(tmp_path):
    with pytest.raises(ValueError, match="reward_mean"):
        log_chat_rl(Report(tmp_path), CONFIG, [{"step": 0, "reward": 0.1}], [])


def test_write_report_order_and_header(tmp_path):
    report = Report(tmp_path)
    log_chat_rl(report, CONFIG, fake_history(), EVALS)
    report.log("Chat SFT", [{"val_loss": 1.25}, "sft notes"])
    report.log("Zeta extras", ["unlisted section"])
    path = report.write_report(CPU)
    assert path == str(tmp_path / "report.md")
    text = (tmp_path / "report.md").read_text()
    head = text.split("## ")[0]
    assert head.startswith("# nanochat report")
    for field in ("- Generated: ", "- Commit: ", "- Platform: "):
        assert field in head
    assert platform.python_version() in head
    # pipeline order (SFT before RL) whatever the logging order; unlisted sections last
    assert text.index("## Chat SFT") < text.index("## Chat RL") < text.index("## Zeta extras")
    assert "- val_loss: 1.2500" in text and "| pass@1 | 0.1250 | 0.5000 |" in text
    assert "![reward](chat-rl-reward.png)" in text  # relative link still valid: same directory

    # re-logging a section replaces it rather than appending
    report.log("Chat SFT", [{"val_loss": 0.5}])
    text = (tmp_path / report.write_report(CPU)).read_text()
    assert text.count("## Chat SFT") == 1 and "- val_loss: 0.5000" in text and "1.2500" not in text


def test_default_dir_and_non_master_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    monkeypatch.setenv("RANK", "0")
    assert get_report().report_dir == str(tmp_path / "base" / "report")
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2")):  # rank 1 of a torchrun launch
        monkeypatch.setenv(name, value)
    other = get_report()
    assert isinstance(other, DummyReport)
    assert log_chat_rl(other, CONFIG, fake_history(), EVALS) is None
    assert other.write_report(CPU) is None
    assert not (tmp_path / "base").exists()


def test_trailing_mean_against_a_direct_computation():
    values = [0.5, 0.25, 1.0, 0.0, 0.75, 0.5, 0.125]
    for window in (1, 3, 10):
        expected = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
                    for i in range(len(values))]
        assert trailing_mean(values, window) == pytest.approx(expected, abs=1e-12)
    assert trailing_mean([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]


# ----------------------------------------------------------------------------- no run's report replaced (issue 74)

def test_a_later_runs_section_and_plots_leave_an_earlier_runs_in_place(tmp_path):
    """Regression (issue 74): a 3-step smoke run replaced report/chat-rl.md and every chat-rl-*.png of a 100-step run.
    Each run's section and plots are its own (runs/<name>/), the report's own names hold the latest run's, and a plot
    the latest run has not (its pass@1: no eval) is not left there from the earlier run."""
    report = Report(tmp_path)
    first = log_chat_rl(report, CONFIG, fake_history(5), EVALS, run_name="d4-first")
    second = log_chat_rl(report, CONFIG, fake_history(2), [], run_name="d4-second")
    assert Path(first) == tmp_path / "runs" / "d4-first" / "chat-rl.md"
    assert Path(second) == tmp_path / "runs" / "d4-second" / "chat-rl.md"
    assert "| steps logged | 5 |" in Path(first).read_text() and "| steps logged | 2 |" in Path(second).read_text()
    plots = lambda directory: sorted(p.name for p in Path(directory).glob("chat-rl-*.png"))  # noqa: E731
    assert "chat-rl-pass1.png" in plots(tmp_path / "runs" / "d4-first")
    assert plots(tmp_path) == plots(tmp_path / "runs" / "d4-second") and "chat-rl-pass1.png" not in plots(tmp_path)
    for name in plots(tmp_path) + ["chat-rl.md"]:  # the latest: the second run's files, byte for byte
        assert (tmp_path / name).read_bytes() == (tmp_path / "runs" / "d4-second" / name).read_bytes(), name
    assert "| steps logged | 2 |" in Path(report.write_report(CPU)).read_text()


def test_a_smoke_run_after_a_run_keeps_that_runs_report(sft, base_dir, capsys):
    """Issue 74 end to end: chat_rl twice (a 2-step run, then a 1-step one to another tag); the first run's section
    and plots stay in report/runs/<tag>-<run id>/, report/chat-rl.md and report.md show the second's."""
    import json

    from helpers import TINY_RL_FLAGS

    from scripts import chat_rl
    for tag, steps in (("long", 2), ("smoke", 1)):
        chat_rl.main(TINY_RL_FLAGS + [f"--num-steps={steps}", f"--output-tag={tag}"])
    out = capsys.readouterr().out
    run_dirs = {}
    for tag, steps in (("long", 2), ("smoke", 1)):
        meta = json.loads((base_dir / "chatrl_checkpoints" / tag / f"meta_{steps - 1:06d}.json").read_text())
        run_dirs[tag] = base_dir / "report" / "runs" / f"{tag}-{meta['run_id']}"
        assert f"| steps logged | {steps} |" in (run_dirs[tag] / "chat-rl.md").read_text()
        assert (run_dirs[tag] / "chat-rl-reward.png").read_bytes().startswith(PNG_SIGNATURE)
        assert f"(this run's section and plots: {run_dirs[tag]})" in out
    latest = base_dir / "report" / "chat-rl.md"
    assert latest.read_text() == (run_dirs["smoke"] / "chat-rl.md").read_text()
    assert "| steps logged | 1 |" in (base_dir / "report" / "report.md").read_text()


def test_a_distillation_run_plots_the_reverse_kl_and_the_teachers_log_probability(tmp_path, monkeypatch):
    """Issue 75: the report shows the per-token reverse KL and the teacher's mean log-probability of the sampled
    tokens, on the steps that trained a token; a run without a teacher has neither plot."""
    drawn = drawn_plots(monkeypatch)
    history = fake_history(4)
    for step, (kl, logp, tokens) in enumerate(((0.5, -2.0, 10), (0.3, -1.5, 0), (0.25, -1.25, 7), (0.2, -1.0, 9))):
        history[step].update(reverse_kl=kl, teacher_logprob=logp, trained_tokens=tokens)
    log_chat_rl(Report(tmp_path), CONFIG, history, [])
    assert drawn["chat-rl-reverse-kl.png"] == [([0, 2, 3], [0.5, 0.25, 0.2], "reverse_kl")]
    assert drawn["chat-rl-teacher-logprob.png"] == [([0, 2, 3], [-2.0, -1.25, -1.0], "teacher_logprob")]
    drawn.clear()
    log_chat_rl(Report(tmp_path / "none"), CONFIG, fake_history(3), [])
    assert not {"chat-rl-reverse-kl.png", "chat-rl-teacher-logprob.png"} & set(drawn)
