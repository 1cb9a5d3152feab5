"""
--compile=auto's rule where it is measured (chat_rl on a CPU): a part of the run, the training forward or the decode
step, is compiled only where what it saves over the steps left is measured to exceed what its compile costs.

- The run starts eagerly. After the warm-up step, PROBE_STEPS steps time each part eagerly (a step's training
  phase; its rollouts, for the decode step).
- Then, for each part: the compile's expected seconds (CompileLedger: what the same graphs took on this machine
  before, when Inductor's cache still holds them; else a cold estimate) against the steps left times the part's
  expected saving a step (its eager seconds times 1 - the compiled/eager ratio measured here before, else a prior).
  A part whose saving pays for its compile is compiled from the next step on.
- CHECK_STEPS compiled steps later the part's compiled seconds are compared with its eager ones and written to the
  ledger (with the compile's seconds), so that the next run on this machine decides from its own figures; a part
  that runs slower compiled goes back to eager (its compile is spent, the steps left are not).

Rank 0 decides and every rank takes its decision (broadcast); the run records each switch's step in its checkpoints,
and --resume follows them (see AutoCompile.state).
"""

import json
import os
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

PARTS = ("train", "decode")
PART_NAMES = {"train": "training forward", "decode": "decode step"}
PROBE_STEPS = 2   # eager steps timed (after the run's first, a warm-up) before deciding
CHECK_STEPS = 2   # compiled steps timed (after the one that compiled) before the part is kept or given back
# compiled seconds / eager seconds of a part, before this machine measured its own (docs/performance.md, the compile
# benchmark: the speedrun's d4 and RL workload, bf16, a 2-core AVX512-BF16 EPYC, medians of 97 steps): the training
# phase 0.467 s a step compiled against 0.61-0.63 eagerly; the rollouts with the compiled static decode step 0.38 s
# against 0.58-0.64 with the eager exact-shape step (an Intel Xeon in fp32 measured 0.74 for training)
PRIOR_RATIO = {"train": 0.76, "decode": 0.62}
# a cold compile's seconds per transformer layer, before this machine measured its own: the same d4's training forward
# (forward and backward, one graph) 48 s; its static decode step's graphs 32 s a batch, and an eval's batch as many
PRIOR_COLD_SECONDS_PER_LAYER = {"train": 12.0, "decode": 16.0}
# a compile whose graphs are in Inductor's cache (Dynamo traces again; AOTAutograd's and Inductor's work is loaded):
# the same d4's training forward 2.7 s warm against 48 s cold, its decode step's graphs 8 s against 32 (22-25%)
PRIOR_WARM_FRACTION = 0.25
LEDGER_FILE = "nanochat_compile_ledger.json"
STATUSES = ("eager", "compiled", "kept", "back", "never")


def inductor_cache_dir():
    """Where Inductor keeps its compiled code (TORCHINDUCTOR_CACHE_DIR, default /tmp/torchinductor_$USER)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return cache_dir()


class CompileLedger:
    """What compiling each part cost and saved on this machine, kept in a JSON file beside Inductor's cache (so that a
    cache cleared clears it too, and a ledger entry means the graphs are still there to load). An entry per key
    (part_key): cold_s (the first compile's seconds), warm_s (a later one's, from the cache), ratio (compiled / eager
    seconds a step). A file that cannot be read is an empty ledger; one that cannot be written loses the figures
    only."""

    def __init__(self, path=None):
        self.path = path or os.path.join(inductor_cache_dir(), LEDGER_FILE)
        try:
            with open(self.path) as f:
                self.entries = json.load(f)
            if not isinstance(self.entries, dict):
                self.entries = {}
        except (OSError, ValueError):
            self.entries = {}

    def get(self, key):
        return self.entries.get(key)

    def record(self, key, **figures):
        self.entries.setdefault(key, {}).update(figures)
        try:
            tmp = f"{self.path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(self.entries, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:
            pass


def part_key(part, model, dtype):
    """What a part's compiled graphs and their speed depend on: the part, the model's shape and generation, the dtype,
    the device's type, torch's version (Inductor's cache is keyed on the graph and torch; the machine is the cache's
    own)."""
    c = model.config
    return (f"{part}|{model.generation.name}|L{c.n_layer} C{c.n_embd} H{c.n_head}/{c.n_kv_head} V{c.vocab_size}"
            f"|{dtype}|{model.get_device().type}|torch {torch.__version__}")


@dataclass
class PartRule:
    """One part's measurements and where it stands: eager (timed), compiled (switched, being timed or kept), back
    (given back to eager after it ran slower compiled), or never (the decision was not to compile)."""
    part: str                 # one of PARTS
    key: str                  # part_key's
    layers: int
    status: str = "eager"
    switched_at: int = None   # the first step run compiled
    back_at: int = None       # the first step run eagerly again
    eager: list = field(default_factory=list)
    compiled: list = field(default_factory=list)
    compile_s: float = 0.0
    recorded: str = None      # the ledger's field of this run's compile: cold_s, or warm_s (the cache had its graphs)

    def expected_compile_seconds(self, ledger):
        """(seconds, how they are known): the graphs' own warm figure where the ledger has them, else cold."""
        entry = ledger.get(self.key) or {}
        if "warm_s" in entry:
            return entry["warm_s"], "in Inductor's cache, measured"
        if "cold_s" in entry:
            return PRIOR_WARM_FRACTION * entry["cold_s"], "in Inductor's cache"
        return PRIOR_COLD_SECONDS_PER_LAYER[self.part] * self.layers, "cold, estimated"

    def ledger_field(self, ledger):
        """Where this run's compile seconds go: warm_s if the ledger has its cold compile (the graphs are cached)."""
        return "warm_s" if "cold_s" in (ledger.get(self.key) or {}) else "cold_s"

    def expected_ratio(self, ledger):
        entry = ledger.get(self.key) or {}
        return entry.get("ratio", PRIOR_RATIO[self.part])


class AutoCompile:
    """The rule of the module docstring for a run's candidate parts ({part: PartRule}) over num_steps steps.
    observe() takes each step's seconds and returns the switches to make before the next step: [(part, compiled)].
    Its lines (why each decision) are in `said` until the caller prints them. records: whether this process writes
    the ledger (rank 0)."""

    def __init__(self, parts, num_steps, ledger, start_step=0, state=None, records=True, compiled=()):
        """compiled: parts compiled from the start whatever they measure (--compile=on): only their compile's seconds
        are recorded, for a later auto run to find."""
        self.parts, self.num_steps, self.ledger, self.start_step = parts, num_steps, ledger, start_step
        self.records, self.said = records, []
        state = {**(state or {}), **{part: {"switched_at": start_step} for part in compiled}}
        for part, saved in state.items():  # --resume: the run's decisions so far
            rule = self.parts.get(part)
            if rule is None:
                continue
            rule.switched_at, rule.back_at = saved.get("switched_at"), saved.get("back_at")
            if rule.back_at is not None and rule.back_at <= start_step:
                rule.status = "back"
            elif rule.switched_at is not None and rule.switched_at <= start_step:
                rule.status = "kept"  # compiled before the resume: compiled from its start on, nothing left to time
            elif saved.get("status") == "never":
                rule.status = "never"
            if rule.status == "kept" and ledger is not None:  # compiling from the start
                rule.recorded = rule.ledger_field(ledger)

    def take_said(self):
        """The lines said since the last call (why each decision), once."""
        said, self.said = self.said, []
        return said

    def compiled_now(self, part):
        """Whether `part` runs compiled at the run's (re)start."""
        rule = self.parts.get(part)
        return rule is not None and rule.status == "kept"

    def state(self):
        """What a checkpoint records: each part's status and switch steps."""
        return {part: {"status": r.status, "switched_at": r.switched_at, "back_at": r.back_at}
                for part, r in self.parts.items()}

    def observe(self, step, seconds, compile_seconds, device=None, world_size=1):
        """step's seconds of each part (compiling left out), and the seconds each part compiled in it -> the switches
        [(part, compiled)] to make from step + 1 on. Under a process group (world_size > 1) rank 0's decisions."""
        decided = []
        for part, rule in self.parts.items():
            if rule.status == "kept" and compile_seconds.get(part, 0.0) > 0 and rule.recorded:
                rule.compile_s += compile_seconds[part]  # graphs compiled after the check (an eval's batch): the
                self._record(rule, {rule.recorded: round(rule.compile_s, 2)})  # compile's cost all the same
            if step == self.start_step or rule.status in ("never", "back", "kept"):
                continue  # the first step warms up (allocations, the engine's first batch); decided parts are done
            if rule.status == "eager":
                rule.eager.append(seconds[part])
                if len(rule.eager) >= PROBE_STEPS:
                    self._decide(part, rule, step)
                    decided.append(part)
            else:  # compiled: timed from the step after the one that compiled
                rule.compile_s += compile_seconds.get(part, 0.0)
                if step > rule.switched_at:
                    rule.compiled.append(seconds[part])
                if len(rule.compiled) >= CHECK_STEPS:
                    self._check(part, rule, step)
                    decided.append(part)
        if decided and world_size > 1:
            rank0_statuses(self.parts, decided, device)
        switches = []
        for part in decided:
            rule = self.parts[part]
            rule.switched_at = step + 1 if rule.status == "compiled" else rule.switched_at
            rule.back_at = step + 1 if rule.status == "back" else None
            if rule.status in ("compiled", "back"):
                switches.append((part, rule.status == "compiled"))
        return switches

    def _record(self, rule, figures):
        if self.records:
            self.ledger.record(rule.key, **figures)

    def _decide(self, part, rule, step):
        eager = statistics.median(rule.eager)
        cost, known = rule.expected_compile_seconds(self.ledger)
        ratio = rule.expected_ratio(self.ledger)
        steps_left = self.num_steps - step - 1
        saving = eager * (1 - ratio) * steps_left
        pays = saving > cost
        rule.status = "compiled" if pays else "never"
        self.said.append(f"compile: auto: {PART_NAMES[part]} {eager:.2f} s a step eagerly, compiled expected "
                         f"x{ratio:.2f}: {saving:.0f} s saved over {steps_left} steps against a {cost:.0f} s "
                         f"compile ({known}): " + (f"compiling it from step {step + 1}" if pays else "not compiled"))

    def _check(self, part, rule, step):
        eager, compiled = statistics.median(rule.eager), statistics.median(rule.compiled)
        rule.recorded = rule.ledger_field(self.ledger)
        self._record(rule, {"ratio": round(compiled / eager, 4) if eager > 0 else 1.0,
                            rule.recorded: round(rule.compile_s, 2)})
        rule.status = "kept" if compiled < eager else "back"
        self.said.append(f"compile: auto: {PART_NAMES[part]} {compiled:.2f} s a step compiled against {eager:.2f} s "
                         f"eagerly (compiled in {rule.compile_s:.0f} s): "
                         + ("kept" if compiled < eager else f"eager again from step {step + 1}"))


def rank0_statuses(rules, decided, device):
    """Every rank takes rank 0's decisions (each rank's own timings differ). Decisions come at the same steps on every
    rank (PROBE_STEPS after the start, CHECK_STEPS after a switch), so this collective is called by all together."""
    codes = torch.tensor([STATUSES.index(rules[part].status) for part in decided], dtype=torch.long, device=device)
    dist.broadcast(codes, src=0)
    for part, code in zip(decided, codes.tolist()):
        rules[part].status = STATUSES[code]
