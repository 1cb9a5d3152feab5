"""
What a whole chat_rl epoch costs on this machine, from measured rates: a step (bench_rl's JSON), an eval (the
step's rollout rate over an eval's rows) and a save (timed here, on the model's own shapes), printed as one line:

    d20 epoch on this GPU ≈ N min (467 steps x S s + 9 evals x E s + 8 saves x W s + U s of writing not hidden)

The save is timed both ways side by side on the same state: written whole before training goes on (as chat_rl saved
until the background writer) and with nanochat.checkpoints.background: the host snapshot, the thread's writing, the
commit. A run alone waits for the snapshot and the commit (the writing, unless the next save or eval comes first);
with several ranks also for the writing left after the next step's rollouts (--overlap-seconds). The writer has the
machine to itself here: the figures are lower bounds of what a run waits.

    python -m scripts.bench_rl --preset=d20 --configs=batched_bf16_graph --output=bench.json   # the step
    python -m scripts.bench_epoch --bench=bench.json --output=epoch.json                     # saves, the epoch
"""

import json
import os
import tempfile
import time

import torch

from nanochat.checkpoints.background import BackgroundSaver
from nanochat.checkpoints.store import save_checkpoint
from nanochat.cli import ArgumentParser, add_debug_flag, add_shared, run_main
from nanochat.common import autodetect_device_type
from nanochat.errors import UserError
from nanochat.files import atomic_write
from nanochat.model.gpt import build_fresh_model
from nanochat.rl.config import SETTINGS
from nanochat.rl.progress import is_eval_step, is_save_step
from nanochat.runtime.device import synchronize
from nanochat.runtime.distributed import print0
from nanochat.settings import SHARED

GSM8K_TRAIN = 7473  # questions: nanochat's epoch is 7473 // 16 = 467 steps
RL = {name: setting.default for name, setting in SETTINGS.items()}  # chat_rl's defaults: the epoch this one estimates


def build_parser():
    p = ArgumentParser(description="Estimate a chat_rl epoch from a bench_rl step and timed saves")
    p.add_argument("--bench", type=str, default=None, help="bench_rl's JSON; its last config's step (or --config) "
                                                                "(default: none, the saves alone)")
    p.add_argument("--config", type=str, default=None, help="which of the bench's configs is the run's step "
                                                                 "(default: its last)")
    p.add_argument("--depth", type=int, default=None, help="model depth for the saves (default: the bench's model)")
    p.add_argument("--vocab-size", type=int, default=None, help="its vocabulary (default: the bench's)")
    add_shared(p, "device_type")
    epoch = GSM8K_TRAIN // RL["examples_per_step"]
    p.add_argument("--steps", type=int, default=epoch, help=f"steps of the epoch (nanochat: {epoch})")
    p.add_argument("--eval-every", type=int, default=RL["eval_every"], help="chat_rl's --eval-every")
    p.add_argument("--save-every", type=int, default=RL["save_every"], help="chat_rl's --save-every")
    p.add_argument("--eval-rows", type=int, default=RL["eval_examples"] * RL["device_batch_size"],
                   help="rows of an eval (--eval-examples x device batch)")
    p.add_argument("--overlap-seconds", type=float, default=None,
                   help="work between a save's start and its commit (default: the bench's rollout seconds)")
    p.add_argument("--output", type=str, default="bench_epoch.json", help="where to write the numbers as JSON")
    add_debug_flag(p)
    return p


def parse_args(argv):
    return build_parser().parse_args(argv)


def model_with_optimizer_state(depth, vocab_size, device):
    """A random d<depth> model and its 2026-01 optimizers after one step: the tensors a chat_rl save writes."""
    model = build_fresh_model(depth, 256, vocab_size, device)
    optimizers = model.setup_optimizers(**{name: SHARED[name].default for name in (
        "unembedding_lr", "embedding_lr", "matrix_lr", "weight_decay", "recipe")})  # chat_rl's: its state's tensors
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for opt in optimizers:
        opt.step()  # creates every state tensor (momentum, moments)
    return model, optimizers


def time_saves(model, optimizers, directory, overlap_seconds, device):
    """Seconds a save costs the training: written whole, and in the background (nanochat.checkpoints.background): its
    host snapshot, its writing by the thread, its commit. What the training waits for in the background: alone, the
    snapshot and the commit (it commits once written; Checkpointer.before_collective); with several ranks also the
    writing left after overlap_seconds of the next step's rollouts (committed at the end of their first draw,
    Checkpointer.written_behind)."""
    shard = lambda: {"optimizers": [o.state_dict() for o in optimizers], "rank": 0, "world_size": 1}  # noqa: E731
    meta = {"step": 1, "model_config": {"n_layer": model.config.n_layer}}
    synchronize(device)
    t0 = time.perf_counter()
    save_checkpoint(os.path.join(directory, "sync"), 1, model.state_dict(), shard(), meta)
    whole = time.perf_counter() - t0
    saver = BackgroundSaver()
    for step in (1, 2):  # the second reuses the first's host buffers, as every later save of a run does
        t0 = time.perf_counter()
        saver.start(os.path.join(directory, "background"), step, model.state_dict(), shard(), meta)
        started = time.perf_counter()
        while not saver.written:  # the writer has the machine to itself: a lower bound of its time in a run
            time.sleep(0.005)
        written = time.perf_counter()
        saver.finish()
        committed = time.perf_counter()
    snapshot, write, commit = started - t0, written - started, committed - written
    size = sum(os.path.getsize(os.path.join(directory, "sync", f)) for f in os.listdir(os.path.join(directory, "sync")))
    return {"bytes": size, "whole_seconds": whole, "snapshot_seconds": snapshot, "write_seconds": write,
            "commit_seconds": commit, "overlap_seconds": overlap_seconds,
            "alone_blocking_seconds": snapshot + commit,
            "ranks_blocking_seconds": snapshot + max(0.0, write - overlap_seconds) + commit}


def epoch_estimate(step_seconds, eval_seconds, save_seconds, steps, eval_every, save_every, write_seconds=0.0):
    """(minutes, evals, saves, the seconds of writing not hidden) of an epoch of `steps` steps at these rates, with
    chat_rl's eval and save schedule. save_seconds: what a save blocks (snapshot and commit); write_seconds: its writing in the background, which the
    steps up to the next point that waits for it (the next save or eval, the end) hide, and the rest blocks."""
    eval_steps = [s for s in range(steps + 1) if is_eval_step(s, steps, eval_every)]
    save_steps = [s for s in range(steps) if is_save_step(s, steps, save_every)]
    # a save at the end of step s is waited for before step w's eval (or the end, w = steps): steps s+1..w-1 hide its
    # writing; or by the next save, at the end of step w: steps s+1..w
    def hidden_steps(s):
        return min([e - 1 for e in eval_steps if e > s] + [w for w in save_steps if w > s] + [steps - 1]) - s
    unhidden = sum(max(0.0, write_seconds - hidden_steps(s) * step_seconds) for s in save_steps)
    minutes = (steps * step_seconds + len(eval_steps) * eval_seconds + len(save_steps) * save_seconds + unhidden) / 60
    return minutes, len(eval_steps), len(save_steps), unhidden


def main(argv):
    args = parse_args(argv)
    bench = {}
    if args.bench:
        try:
            with open(args.bench) as f:
                bench = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"--bench={args.bench}: cannot read it ({e}); write one with python -m scripts.bench_rl") from e
    results = bench.get("results") or {}
    name = args.config or (list(results)[-1] if results else None)
    if args.bench and name not in results:
        raise UserError(f"--config={name}: not in {args.bench}; it has {', '.join(results) or 'no result'}")
    step = results.get(name, {})
    depth = args.depth or bench.get("model", {}).get("n_layer") or 4
    vocab = args.vocab_size or bench.get("model", {}).get("vocab_size") or 8192
    device = torch.device(args.device_type or autodetect_device_type())
    model, optimizers = model_with_optimizer_state(depth, vocab, device)
    overlap = args.overlap_seconds if args.overlap_seconds is not None else step.get("rollout_seconds", 1.0)
    # on the disk of --output, where a user points a run's results
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(args.output))) as directory:
        saves = time_saves(model, optimizers, directory, overlap, device)
    print0(f"save of d{depth} ({saves['bytes'] / 2 ** 30:.2f} GiB): {saves['whole_seconds']:.2f} s written whole; in "
           f"the background {saves['snapshot_seconds']:.2f} s snapshot + {saves['commit_seconds']:.2f} s commit, "
           f"its {saves['write_seconds']:.2f} s of writing hidden by the steps before the next save or eval (one "
           f"process); with several ranks {saves['ranks_blocking_seconds']:.2f} s (committed before the next step's "
           f"training, after {overlap:.2f} s of rollouts)")
    report = {"config": name, "depth": depth, "vocab_size": vocab, "device": device.type, "save": saves}
    if step:
        # an eval samples eval_rows rows at the step's rollout rate (an upper bound: a random model's rows run to the cap)
        eval_seconds = step["rollout_seconds"] * args.eval_rows / max(step["rows"], 1)
        minutes, evals, n_saves, unhidden = epoch_estimate(step["step_seconds"], eval_seconds, saves["alone_blocking_seconds"],
                                                 args.steps, args.eval_every, save_every=args.save_every,
                                                 write_seconds=saves["write_seconds"])
        where = f"this {'GPU' if device.type == 'cuda' else device.type.upper()}"
        print0(f"d{depth} epoch on {where} ≈ {minutes:.0f} min ({args.steps} steps x {step['step_seconds']:.2f} s + "
               f"{evals} evals x {eval_seconds:.1f} s + {n_saves} saves x {saves['alone_blocking_seconds']:.2f} s + "
               f"{unhidden:.1f} s of writing not hidden)")
        report["epoch"] = {"minutes": minutes, "steps": args.steps, "step_seconds": step["step_seconds"],
                           "evals": evals, "eval_seconds": eval_seconds, "saves": n_saves, "unhidden_write_seconds": unhidden}
    atomic_write(args.output, json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    run_main(main)
