"""
wandb for the training scripts: one function that opens a run on rank 0 (or hands back the no-op
`DummyWandb`), and one that logs sampled completions as a table.

Online or offline is wandb's own choice, read from the environment: WANDB_MODE=offline writes the run
under $WANDB_DIR/wandb/offline-run-* without touching the network (upload it later with `wandb sync`);
WANDB_MODE=disabled turns every call into a no-op. WANDB_SILENT=true quiets its console output.
"""

import os

from nanochat.common import DummyWandb
from nanochat.errors import UserError
from nanochat.runtime.distributed import get_rank

SAMPLE_COLUMNS = ["step", "question", "completion", "reward"]


class WandbStartError(UserError):
    """wandb refused to start the run `run_name` (e.g. online mode without an API key)."""

    def __init__(self, run_name, reason):
        super().__init__(f"wandb could not start run {run_name!r}: {reason}; run `wandb login`, "
                         f"or set WANDB_MODE=offline to log locally")
        self.run_name, self.reason = run_name, reason


def wandb_state(run_name, project):
    """One line saying whether this run logs to wandb, and where: said once, at the start, by rank 0."""
    mode = os.environ.get("WANDB_MODE", "")
    if run_name == "dummy":
        return "wandb: off (--run=dummy; --run=NAME logs a run)"
    if mode == "disabled":
        return "wandb: off (WANDB_MODE=disabled)"
    return f"wandb: run {run_name} in project {project}" + (" (offline: `wandb sync` uploads it)" if mode == "offline"
                                                            else "")


def init_wandb(run_name, project, config, rank=None):
    """A wandb run named `run_name` in `project` with `config` (the parsed CLI args, as a dict) recorded
    whole; `DummyWandb()` when run_name == "dummy" or on a rank other than 0 (one run per job). Rank 0 says which
    (wandb_state). rank: None = distributed.get_rank()."""
    rank = get_rank() if rank is None else rank
    if rank != 0:
        return DummyWandb()
    if run_name == "dummy":
        print(wandb_state(run_name, project), flush=True)
        return DummyWandb()
    import wandb  # imported here: a dummy run (and every test that uses one) never pays for it
    try:
        run = wandb.init(project=project, name=run_name, config=dict(config))
    except wandb.errors.UsageError as e:  # e.g. online mode without an API key
        raise WandbStartError(run_name, e) from e
    print(wandb_state(run_name, project), flush=True)  # once it has started: a refusal is the error's line alone
    return run


def log_samples_table(wandb_run, rows, step=None, key="samples"):
    """Log (question, completion, reward) triples as a wandb.Table under `key`; no-op for DummyWandb.

    rows: iterable of (question: str, completion: str, reward: float). `step`, if given, fills the
    table's step column and is logged as the "step" key alongside, like the scripts' other metrics.
    """
    if isinstance(wandb_run, DummyWandb):
        return
    import wandb
    data = [[step, str(q), str(c), float(r)] for q, c, r in rows]
    entry = {key: wandb.Table(columns=SAMPLE_COLUMNS, data=data)}
    if step is not None:
        entry["step"] = step
    wandb_run.log(entry)
