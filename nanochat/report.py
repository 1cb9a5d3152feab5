"""
The run report: a markdown file per pipeline stage, assembled into one `report.md`.

Each stage calls `report.log(section, data)` once when it finishes; that writes `<report_dir>/<slug>.md`
(nanochat's name: re-running a stage replaces its section there). `write_report(device)` joins the section files, in
pipeline order, under a header with the date, the git commit and the platform (its GPUs when the run used CUDA). The
RL stage's section ("Chat RL": config, final metrics, pass@k table and plots) is built by `log_chat_rl`.

What one run or one eval wrote is never replaced by another's (issue 74): an RL run's section and plots are written
under its own name, `<report_dir>/runs/<output tag>-<run id>/` (a resumed run's, the same run, updates it), then
copied to nanochat's names in `<report_dir>`, which so always hold the latest; chat_eval's results go to a new file
each, `<report_dir>/chat_eval/<source>-<tag>-step<step>-<time>.json`, copied to `chat_eval_<source>.json`, the latest.

Only rank 0 writes: `get_report()` returns a `DummyReport` elsewhere, as `DummyWandb` does for wandb.
"""

import datetime
import glob
import json
import math
import os
import platform
import re
import subprocess

import torch

from nanochat.common import get_base_dir
from nanochat.files import atomic_write
from nanochat.runtime.distributed import get_rank

# sections in pipeline order; a section not listed here goes after these, alphabetically
SECTION_ORDER = [
    "Tokenizer training", "Tokenizer evaluation",
    "Base model training", "Base model evaluation",
    "Midtraining", "Chat evaluation mid",
    "Chat SFT", "Chat evaluation sft",
    "Chat RL", "Chat evaluation rl",
]
REPORT_FILE = "report.md"
RUNS_DIR = "runs"             # each RL run's own section and plots, by run
EVALS_DIR = "chat_eval"       # each chat_eval's result, by checkpoint and time
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def slugify(section):
    """'Chat RL' -> 'chat-rl': the section's file name stem."""
    return re.sub(r"[^a-z0-9]+", "-", section.lower()).strip("-")


def format_value(v):
    """Floats with 4 decimals (scientific when tiny or huge), everything else as str."""
    if isinstance(v, float):
        if v != 0 and math.isfinite(v) and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.3e}"
        return f"{v:.4f}"
    return str(v)


def text_table(rows, columns, first="config"):
    """Plain text: a row per (name, result), columns of (header, key or function of the result, format spec); None: -."""
    cells = [[first] + [header for header, _, _ in columns]] + [[name] + [
        "-" if (value := key(r) if callable(key) else r.get(key)) is None else format(value, spec) for _, key, spec in columns]
        for name, r in rows]
    widths = [max(map(len, column)) for column in zip(*cells)]
    return "\n".join(" ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells)


def markdown_table(header, rows):
    """A markdown table; '|' inside cells is escaped so a value cannot split a row."""
    def line(cells):
        return "| " + " | ".join(format_value(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"
    return "\n".join([line(header), "|" + "---|" * len(header)] + [line(r) for r in rows])


def git_commit():
    """Short commit of the code's checkout, '+dirty' if it has uncommitted changes; 'unknown' without git."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"  # not a checkout (e.g. an installed copy)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):  # no git binary, or it hung
        return "unknown"
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def platform_summary(device):
    """One line: OS, python, torch, CPUs, and the GPUs if the run's `device` is one. A run on the CPU does not
    ask CUDA, though the machine may have it: naming a GPU initializes CUDA, which the run does not use and
    which can fail (a busy or mismatched driver) after the run has done its work."""
    parts = [platform.platform(), f"python {platform.python_version()}", f"torch {torch.__version__}",
             f"{os.cpu_count()} CPUs"]
    if device.type == "cuda":
        parts.append(f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(device)}")
    return ", ".join(parts)


class Report:
    """Markdown sections under `report_dir` (default: $NANOCHAT_BASE_DIR/report)."""

    def __init__(self, report_dir=None):
        self.report_dir = report_dir or os.path.join(get_base_dir(), "report")

    def section_path(self, section):
        return os.path.join(self.report_dir, slugify(section) + ".md")

    def log(self, section, data):
        """Write (replace) a section. data: a list whose items are markdown strings (written as they are)
        or dicts (written as `- key: value` lines). Returns the section file's path."""
        os.makedirs(self.report_dir, exist_ok=True)
        parts = [f"## {section}", f"timestamp: {datetime.datetime.now():%Y-%m-%d %H:%M:%S}"]
        for item in data:
            if isinstance(item, dict):
                parts.append("\n".join(f"- {k}: {format_value(v)}" for k, v in item.items()))
            elif isinstance(item, str):
                parts.append(item.rstrip())
            else:
                raise TypeError(f"Report.log items must be str or dict, got {type(item).__name__}")
        path = self.section_path(section)
        atomic_write(path, "\n\n".join(parts) + "\n")
        return path

    def run_report(self, run_name):
        """The Report of one run's own files: `<report_dir>/runs/<run_name>/`."""
        return Report(os.path.join(self.report_dir, RUNS_DIR, run_name))

    def publish(self, run_report, section):
        """Copy a run's section and its plots (run_report's `<slug>.md` and `<slug>-*.png`) to nanochat's names here,
        as the latest; a plot of the section that the run does not have (an earlier run's) goes, so that no file here
        mixes two runs (the earlier run keeps its own copy under runs/). Returns the section's path here."""
        os.makedirs(self.report_dir, exist_ok=True)
        stem = slugify(section)
        own_plots = glob.glob(os.path.join(glob.escape(run_report.report_dir), stem + "-*.png"))
        plots = {os.path.basename(p) for p in own_plots}
        for stale in glob.glob(os.path.join(glob.escape(self.report_dir), stem + "-*.png")):
            if os.path.basename(stale) not in plots:
                os.remove(stale)
        for name in sorted(plots) + [stem + ".md"]:  # the section last: it names the plots
            copy_atomically(os.path.join(run_report.report_dir, name), os.path.join(self.report_dir, name))
        return self.section_path(section)

    def write_report(self, device):
        """Assemble report.md from the section files present, in SECTION_ORDER then alphabetically, under
        a header naming the platform the run used `device` on. Returns its path."""
        os.makedirs(self.report_dir, exist_ok=True)
        known = {slugify(s): i for i, s in enumerate(SECTION_ORDER)}
        stems = [f[:-3] for f in os.listdir(self.report_dir) if f.endswith(".md") and f != REPORT_FILE]
        stems.sort(key=lambda s: (known.get(s, len(known)), s))
        header = "\n".join([
            "# nanochat report",
            "",
            f"- Generated: {datetime.datetime.now():%Y-%m-%d %H:%M:%S}",
            f"- Commit: {git_commit()}",
            f"- Platform: {platform_summary(device)}",
        ])
        sections = []
        for stem in stems:
            with open(os.path.join(self.report_dir, stem + ".md"), encoding="utf-8") as f:
                sections.append(f.read().rstrip())
        path = os.path.join(self.report_dir, REPORT_FILE)
        atomic_write(path, "\n\n".join([header] + sections) + "\n")
        return path


class DummyReport:
    """Stand-in on ranks other than 0: nothing is written."""

    def log(self, section, data):
        return None

    def write_report(self, device):
        return None

    def run_report(self, run_name):
        return self

    def publish(self, run_report, section):
        return None


def copy_atomically(source, destination):
    """Copy a file over `destination` as one rename: a reader sees the old file or the new one."""
    with open(source, "rb") as f:
        atomic_write(destination, f.read())


def get_report(report_dir=None):
    """`Report` on rank 0, `DummyReport` elsewhere (every rank runs the same code; one writes)."""
    return Report(report_dir) if get_rank() == 0 else DummyReport()


# -----------------------------------------------------------------------------
# chat_eval's results: one file each, and the latest under the stable name

def eval_result_paths(report_dir, source, model_tag, step, when=None):
    """(this eval's own file, the latest's) for a chat_eval of `source`'s checkpoint `model_tag` at `step`:
    `<report_dir>/chat_eval/<source>-<tag>-step<step>-<YYYYmmdd-HHMMSS>.json` (a -2, -3, ... added where an eval of
    the same second has the name) and `<report_dir>/chat_eval_<source>.json`. when: a datetime (default: now)."""
    stamp = f"{when or datetime.datetime.now():%Y%m%d-%H%M%S}"
    stem = os.path.join(report_dir, EVALS_DIR, f"{source}-{model_tag}-step{step}-{stamp}")
    path, n = stem + ".json", 1
    while os.path.exists(path):
        n += 1
        path = f"{stem}-{n}.json"
    return path, os.path.join(report_dir, f"chat_eval_{source}.json")


def save_json(result, path, latest=None):
    """Write `result` as indented JSON to `path` and, given `latest`, a copy there (each file in one rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    text = json.dumps(result, indent=2)
    atomic_write(path, text)
    if latest is not None:
        os.makedirs(os.path.dirname(os.path.abspath(latest)), exist_ok=True)
        atomic_write(latest, text)


# -----------------------------------------------------------------------------
# The "Chat RL" section

CHAT_RL_SECTION = "Chat RL"


def log_chat_rl(report, config, history, eval_history, section=CHAT_RL_SECTION, run_name=None):
    """Write the RL section: the run config, the final step's metrics, pass@k at the first and last eval,
    and plots of reward, completion length, entropy, the sampler-trainer gap and pass@1 against step (PNGs next
    to the markdown; entropy and the gap on the steps that measured them). With `run_name`, under the run's own
    directory (Report.run_report), then copied to the report's own names as the latest (Report.publish); the run's
    own section's path is returned then.

    config: dict (e.g. vars(args)), shown whole, in its order.
    history: list of per-step dicts, each with "step", "reward_mean" and "completion_len_mean" (the keys of
        nanochat.rl.metrics.rollout_metrics; "completion_len_min"/"completion_len_max" draw a band when present).
    eval_history: list of (step, {"pass@1": ..., "pass@2": ..., ...}) (e.g. PassAtK.as_dict()).
    Returns the section's path, or None from a DummyReport.
    """
    if isinstance(report, DummyReport):
        return None
    if run_name is not None:
        own = report.run_report(run_name)
        path = log_chat_rl(own, config, history, eval_history, section)
        report.publish(own, section)
        return path
    check_rl_history(history, eval_history)
    os.makedirs(report.report_dir, exist_ok=True)  # the plots are saved before the section is
    data = ["### Config", markdown_table(["option", "value"], list(config.items())),
            "### Final metrics", final_metrics_table(history, eval_history),
            "### pass@k", pass_at_k_table(eval_history),
            "### Plots"]
    plots = rl_plots(os.path.join(report.report_dir, slugify(section)), history, eval_history)
    data += [f"![{name}]({os.path.basename(path)})" for name, path in plots] or ["Nothing to plot."]
    return report.log(section, data)


def check_rl_history(history, eval_history):
    """A one-line error for a history that lacks what the RL section shows (see log_chat_rl)."""
    for i, h in enumerate(history):
        missing = [k for k in ("step", "reward_mean", "completion_len_mean") if k not in h]
        if missing:
            raise ValueError(f"history[{i}] lacks {missing}; log the rollout_metrics keys and 'step' every step")
    for step, passk in eval_history:
        if "pass@1" not in passk:
            raise ValueError(f"the eval at step {step} has no 'pass@1' (keys: {sorted(passk)})")


def final_metrics_table(history, eval_history):
    """The last step's metrics, and the last eval's pass@k."""
    if not history:
        return "No training step was logged."
    last = history[-1]
    rows = [("steps logged", len(history))] + [(k, v) for k, v in last.items()]
    if eval_history:
        rows += [(f"{k} (step {eval_history[-1][0]})", v) for k, v in eval_history[-1][1].items()]
    return markdown_table(["metric", f"value (step {last['step']})"], rows)


def pass_at_k_table(eval_history):
    """pass@k at the first and the last eval."""
    if not eval_history:
        return "No evaluation was run."
    evals = [eval_history[0]] if len(eval_history) == 1 else [eval_history[0], eval_history[-1]]
    keys = list(dict.fromkeys(k for _, d in evals for k in d))  # union, first-seen order
    rows = [[k] + [d.get(k, "") for _, d in evals] for k in keys]
    return markdown_table(["metric"] + [f"step {s}" for s, _ in evals], rows)


def rl_plots(stem, history, eval_history):
    """[(name, path of the PNG)] of the RL section's plots; stem: their path without its '-<plot>.png'."""
    steps = [h["step"] for h in history]
    plots = []
    if history:
        rewards = [h["reward_mean"] for h in history]
        # one step's reward is noisy (16 questions): the trailing mean shows the trend
        plots.append(("reward", _plot(f"{stem}-reward.png", "mean reward",
                                      [(steps, rewards, "reward_mean"),
                                       (steps, trailing_mean(rewards, REWARD_TREND_WINDOW),
                                        f"mean of the last {REWARD_TREND_WINDOW} steps")])))
        band = None
        if all("completion_len_min" in h and "completion_len_max" in h for h in history):
            band = ([h["completion_len_min"] for h in history], [h["completion_len_max"] for h in history])
        plots.append(("completion length", _plot(f"{stem}-completion-len.png", "generated tokens",
                                                 [(steps, [h["completion_len_mean"] for h in history],
                                                   "completion_len_mean")], band=band)))
        # the entropy, on the steps that trained a row (the others have none; older runs logged NaN there)
        entropy = [h for h in history if isinstance(h.get("entropy"), (int, float)) and math.isfinite(h["entropy"])]
        if entropy:
            plots.append(("entropy", _plot(f"{stem}-entropy.png", "policy entropy",
                                           [([h["step"] for h in entropy], [h["entropy"] for h in entropy], "entropy")],
                                           marker=".")))
        # the sampler-trainer gap, on the steps that trained a token (the others measured nothing)
        gap = [h for h in history if h.get("sampler_tokens")]
        if gap:
            gap_steps = [h["step"] for h in gap]
            plots.append(("sampler-trainer gap", _plot(f"{stem}-sampler-gap.png", "|logp trainer - logp sampler|",
                                                       [(gap_steps, [h["sampler_gap_mean"] for h in gap], "sampler_gap_mean"),
                                                        (gap_steps, [h["sampler_gap_max"] for h in gap], "sampler_gap_max")],
                                                       marker=".")))
        # --teacher's per-token reverse KL and its log-probability of the sampled tokens, on the steps that trained one
        distilled = [h for h in history if "reverse_kl" in h and h.get("trained_tokens")]
        if distilled:
            plots.append(("reverse KL to the teacher", _plot(
                f"{stem}-reverse-kl.png", "mean logp student - logp teacher",
                [([h["step"] for h in distilled], [h["reverse_kl"] for h in distilled], "reverse_kl")], marker=".")))
            plots.append(("teacher's log-probability", _plot(
                f"{stem}-teacher-logprob.png", "mean logp teacher of the sampled tokens",
                [([h["step"] for h in distilled], [h["teacher_logprob"] for h in distilled], "teacher_logprob")],
                marker=".")))
    if eval_history:
        plots.append(("pass@1", _plot(f"{stem}-pass1.png", "pass@1",
                                      [([s for s, _ in eval_history], [d["pass@1"] for _, d in eval_history],
                                        "pass@1")], marker="o")))
    return plots


REWARD_TREND_WINDOW = 10


def trailing_mean(values, window):
    """At each position, the mean of the last `window` values up to and including it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _plot(path, ylabel, series, band=None, marker=None):
    """Save a line plot of series [(xs, ys, label)] against step as a PNG; returns the path.
    band: optional (lows, highs) shaded under the first series (e.g. min/max sequence length)."""
    # Figure + its own Agg canvas: no pyplot, so no global backend switch and no GUI in a headless job
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for xs, ys, label in series:
        ax.plot(xs, ys, label=label, marker=marker)
    if band is not None:
        ax.fill_between(series[0][0], band[0], band[1], alpha=0.2, label="min-max")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png"))
    return path
