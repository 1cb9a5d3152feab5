"""
Compare RL runs: reward, pass@1, completion length and entropy of several chat_rl runs on shared axes.

Each RUN_DIR is a chat_rl output directory ($NANOCHAT_BASE_DIR/chatrl_checkpoints/<tag>); its last
checkpoint's meta holds the run's per-step history, its evals and its flags.
  1. read the last meta_<step>.json of every run;
  2. plot, one line per run: training reward (trailing mean), pass@1 at each eval (the mean over the eval's
     samples per question, when recorded: less noisy than the first sample's), mean completion length and
     policy entropy against step, in one PNG of four panels;
  3. print a table: the flags in which the runs differ, pass@1 at the first and last eval (first sample, and
     mean over samples), reward at the start and end.

Launch:
  python -m scripts.compare_runs ~/.cache/nanochat/chatrl_checkpoints/{base,token_ppo} --output=compare.png
"""

import json
import math
import os
import statistics

from nanochat.checkpoints.errors import NoStepsError
from nanochat.checkpoints.layout import meta_path
from nanochat.checkpoints.store import find_last_step
from nanochat.cli import ArgumentParser, add_debug_flag, run_main
from nanochat.errors import UserError
from nanochat.files import atomic_write
from nanochat.report import markdown_table, trailing_mean

PANELS = [  # (title, y label)
    ("reward", "mean reward (trailing mean)"),
    ("pass@1", "held-out pass@1"),
    ("completion length", "generated tokens"),
    ("entropy", "policy entropy"),
]
IGNORED_FLAGS = {"run", "resume", "overwrite", "debug", "output_tag", "device_type", "max_rows", "memory_budget_gb"}


def build_parser():
    p = ArgumentParser(description="plot and tabulate several chat_rl runs on shared axes")
    p.add_argument("runs", nargs="+", help="chat_rl run directories (chatrl_checkpoints/<tag>)")
    p.add_argument("--output", type=str, default="compare_runs.png", help="the PNG to write")
    p.add_argument("--smooth", type=int, default=10, help="trailing-mean window (steps) for reward, length and entropy")
    add_debug_flag(p)
    return p


def parse_args(argv):
    return build_parser().parse_args(argv)


def load_run(run_dir):
    """(name, meta) of a run directory's last checkpoint."""
    if not os.path.isdir(run_dir):
        raise UserError(f"{run_dir} is not a directory; pass chat_rl run directories (chatrl_checkpoints/<tag>)")
    try:
        path = meta_path(run_dir, find_last_step(run_dir))
    except NoStepsError as e:
        raise UserError(f"{e}; pass chat_rl run directories (chatrl_checkpoints/<tag>)") from e
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from e
    if "history" not in meta:
        raise UserError(f"{path} has no \"history\": not a chat_rl checkpoint")
    return os.path.basename(os.path.normpath(run_dir)), meta


def differing_flags(metas):
    """The flags (user_config keys) whose values are not the same in every run, in first-seen order."""
    configs = [m.get("user_config", {}) for m in metas]
    keys = list(dict.fromkeys(k for c in configs for k in c if k not in IGNORED_FLAGS))
    return [k for k in keys if len({json.dumps(c.get(k)) for c in configs}) > 1]


def pass1_key(metas):
    """The pass@1 to plot: the mean over each question's samples (pass@1_unbiased) when every eval has it,
    else nanochat's first-sample pass@1."""
    evals = [d for m in metas for _, d in m.get("eval_history", [])]
    return "pass@1_unbiased" if evals and all("pass@1_unbiased" in d for d in evals) else "pass@1"


def run_series(meta, smooth, pass_key="pass@1"):
    """{panel title: (steps, values)} of one run."""
    history = meta["history"]
    steps = [h["step"] for h in history]
    smoothed = lambda key: trailing_mean([h.get(key, float("nan")) for h in history], smooth)
    evals = meta.get("eval_history", [])
    entropy = [h for h in history if math.isfinite(h.get("entropy", math.nan))]  # steps that trained a row (older runs: NaN)
    return {
        "reward": (steps, smoothed("reward_mean")),
        "pass@1": ([s for s, _ in evals], [d[pass_key] for _, d in evals]),
        "completion length": (steps, smoothed("completion_len_mean")),
        "entropy": ([h["step"] for h in entropy], trailing_mean([h["entropy"] for h in entropy], smooth)),
    }


def plot_runs(path, runs, smooth):
    """runs: [(label, meta)]. Writes one PNG with a panel per PANELS entry; returns the path."""
    # Figure + its own Agg canvas: no pyplot, so no global backend switch and no GUI in a headless job
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2).flatten()
    pass_key = pass1_key([m for _, m in runs])
    for label, meta in runs:
        series = run_series(meta, smooth, pass_key)
        for ax, (title, _) in zip(axes, PANELS):
            xs, ys = series[title]
            ax.plot(xs, ys, label=label, marker="o" if title == "pass@1" else None)
    for ax, (title, ylabel) in zip(axes, PANELS):
        ax.set_title(title + (" (mean over each question's samples)" if title == "pass@1" and pass_key != "pass@1" else ""),
                     fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    # one legend for the four panels, under them, so long labels never cover a curve
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.035 * len(runs) + 0.01, 1, 1))
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    atomic_write(path, lambda f: fig.savefig(f, format="png"))
    return path


def summary_rows(runs, flags, window=10):
    """One table row per run: its differing flags, pass@1 at the first and last eval (first sample; mean over
    the samples when recorded), reward over the first and last `window` steps, and the mean completion
    length and entropy over the last `window` steps."""
    rows = []
    for name, meta in runs:
        config, history, evals = meta.get("user_config", {}), meta["history"], meta.get("eval_history", [])
        # over the steps that have the key (a step that trained no row has no entropy)
        mean = lambda key, part: statistics.fmean([h[key] for h in part if key in h] or [float("nan")])
        first, last = history[:window], history[-window:]
        rows.append([name, " ".join(f"{k}={config.get(k)}" for k in flags) or "-", len(history),
                     evals[0][1]["pass@1"] if evals else float("nan"),
                     f"{evals[-1][1]['pass@1']:.4f} (step {evals[-1][0]})" if evals else "-",
                     evals[0][1].get("pass@1_unbiased", float("nan")) if evals else float("nan"),
                     evals[-1][1].get("pass@1_unbiased", float("nan")) if evals else float("nan"),
                     mean("reward_mean", first), mean("reward_mean", last),
                     mean("completion_len_mean", last), mean("entropy", last)])
    return rows


def main(argv):
    args = parse_args(argv)
    if args.smooth < 1:
        raise UserError(f"--smooth must be >= 1, got {args.smooth}")
    runs = [load_run(d) for d in args.runs]
    flags = differing_flags([m for _, m in runs])
    # each run's label: its name and the flags in which it differs from the first run
    first_config = runs[0][1].get("user_config", {})
    labels = []
    for name, m in runs:
        config = m.get("user_config", {})
        own = [f"{k}={config.get(k)}" for k in flags if config.get(k) != first_config.get(k)]
        labels.append(name + (": " + " ".join(own) if own else ""))
    path = plot_runs(args.output, list(zip(labels, [m for _, m in runs])), args.smooth)
    print(markdown_table(["run", "flags", "steps", "pass@1 first", "pass@1 last", "sampled pass@1 first",
                          "sampled pass@1 last", "reward first 10", "reward last 10", "length last 10",
                          "entropy last 10"], summary_rows(runs, flags)))
    print(f"plot: {path}")


if __name__ == "__main__":
    run_main(main)
