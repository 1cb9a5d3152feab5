"""
Reinforcement learning on GSM8K (or another task) with on-policy policy gradients, as in nanochat.

Each step, for each of the step's questions:
  1. sample --num-samples completions from the current model (KV-cached, calculator tool enabled);
  2. reward each completion (1.0 if the answer after #### is right, else 0.0);
  3. advantage = reward - mean reward of the question's samples (no std, no KL, no clipping);
  4. loss = -sum(logp * advantage) over sampled tokens only (prompt, tool outputs and padding masked),
     normalized per pass of --device-batch-size rows, by the passes and by the questions per rank;
then one Muon (matrices) + AdamW (embeddings, unembedding, scalars) step, LR decaying linearly to 0
(nanochat; --lr-schedule, --warmup-steps and --final-lr-frac for others).
Algorithm options (docs/flags.md "Algorithm options"; each defaults to nanochat's behaviour): --loss-norm,
--advantage-std, --mask-truncated, --ppo-epochs with --loss and --clip-low/--clip-high, --kl-coef,
--rollout-correction, --dynamic-sampling.

Launch:
  python -m scripts.chat_rl                                                   # 1 GPU, or CPU
  torchrun --standalone --nproc_per_node=8 -m scripts.chat_rl -- --run=my_run # 8 GPUs
  python -m scripts.chat_rl --device-type=cpu --dtype=float32 --task=arithmetic --num-steps=50
  python -m scripts.chat_rl --source=rl                  # a new run from the last RL checkpoint -> <tag>_cont
  torchrun --nproc_per_node=4 -m scripts.chat_rl -- --resume  # continue the latest run, on 4 ranks (any number
                                                             # dividing --examples-per-step; README "Resume ...")
"""

import os
import signal
import sys
import time

from nanochat.cli import given_flags, parse_rl_args, rl_parser, run_main
from nanochat.common import compute_cleanup, compute_init
from nanochat.files import check_writable_dir, check_writable_file, write_errors
from nanochat.report import get_report, log_chat_rl
from nanochat.rl.auto_switch import auto_compile_step
from nanochat.rl.config import RLConfig
from nanochat.rl.evaluation import evaluate_pass_at_k
from nanochat.rl.metrics import reduce_metrics
from nanochat.rl.progress import (ROLLOUTS_FILE, is_eval_step, is_save_step, no_signal_settings, report_step,
                                  sample_table)
from nanochat.rl.resume import finished_run, restore_settings, run_target
from nanochat.rl.run import check_run_device, meta_data, setup_run
from nanochat.runtime.distributed import get_dist_info, print0, wait_for_all_ranks
from nanochat.runtime.graceful_stop import GracefulStop
from nanochat.wandb_utils import init_wandb, log_samples_table


def evaluate(run, step):
    """pass@k on the test split (device_batch_size samples of each of --eval-examples questions), and on each of
    --eval-tasks' (a field each on the line, their keys prefixed with the task's name); logged."""
    run.model.eval()
    t0 = time.time()
    # sampled as nanochat's eval samples (nanochat/rl/evaluation.py), whatever the rollouts' flags, in their dtype
    passk, *extra = [evaluate_pass_at_k(run.engine, task, run.config.eval_examples, run.config.device_batch_size,
                                        device=run.reduce_device)[0]
                     for task in [run.val_task] + [t for _, t in run.extra_eval_tasks]]
    t_eval = time.time() - t0
    # what compiled since the last step line is the eval's own (its batch's shapes): said here, not in the next step's
    # line, and left out of the ETA, which counts what every later eval costs
    graphs, compile_s = run.compile_clock.lap()
    # the most of any rank (rank 0's eval time includes waiting for the others' compiles), as a step's
    compiled = reduce_metrics({"compiles": graphs, "compile_s": compile_s}, run.reduce_device)
    graphs, compile_s = int(compiled["compiles"]), float(compiled["compile_s"])
    names = [name for name, _ in run.extra_eval_tasks]
    print0(f"Step {step} | " + ", ".join(f"Pass@{k + 1}: {v:.4f}" for k, v in enumerate(passk.any))
           + "".join(f" | {name} pass@1 {p.any[0]:.4f}" for name, p in zip(names, extra)) + f" | eval {t_eval:.1f}s"
           + (f" | compiled {graphs} graphs in {compile_s:.1f}s" if graphs else ""))
    tasks = {k: v for name, p in zip(names, extra) for k, v in p.as_dict(prefix=f"eval/{name}/").items()}
    run.progress.record_eval(step, {**passk.as_dict(), **tasks}, max(t_eval - compile_s, 0.0))
    return {"step": step, **passk.as_dict(), **tasks, "time/eval": t_eval, "eval_compiles": graphs,
            "eval_compile_s": compile_s}


def main(argv):
    config = RLConfig.from_flags(parse_rl_args(argv))
    _, rank, _, world_size = get_dist_info()
    resume = None
    if config.resume:  # the run's own settings, checked against this run's ranks
        config, resume = restore_settings(config, world_size, given_flags(rl_parser(), argv))
        if finished := finished_run(config, resume):  # nothing to train, nor to evaluate again
            for line in finished:
                print0(line)
            return
    else:
        config.check_ranks(world_size)
    _, rank, _, world_size, device = compute_init(config.device_type)
    stop = GracefulStop().install()
    try:
        check_run_device(config, device)  # what the device rules out first: then the run's directory,
        target = run_target(config, resume)  # refused, or checked writable, before anything loads
        if rank == 0:
            check_outputs(config, target)
        train(setup_run(config, resume, target, rank, world_size, device=device), stop)
    finally:
        stop.uninstall()
        compute_cleanup()


def check_outputs(config, target):
    """What rank 0 writes besides the checkpoints (run_target checked their directory), checked before the first step:
    the report's directory, and the rollouts file a resumed run appends to."""
    check_writable_dir(get_report().report_dir, "the run's report", "make it writable, or set NANOCHAT_BASE_DIR")
    if config.save_rollouts and config.resume:
        check_writable_file(os.path.join(target.checkpoint_dir, ROLLOUTS_FILE.format(rank=0)), "the run's rollouts",
                            "make it writable, or run without --save-rollouts")


def train(run, stop):
    """nanochat's loop: eval, rollouts, policy gradient and optimizer step (RLRun.step), log, checkpoint; then the
    final eval and the report. A checkpoint is written by a thread while the next step's rollouts run, and committed
    before that step's first collective (nanochat/checkpoints/checkpointer.py); alone, once written."""
    cfg, num_steps, saves = run.config, run.num_steps, run.checkpointer
    wandb_run = init_wandb(cfg.run, "nanochat-rl", run.user_config)
    for line in no_signal_settings(cfg):
        print0(line)
    run_start = time.time()
    with write_errors(saves.kept), saves.on_error():  # a failed write: one line, the file and the step kept
        for step in range(run.start_step, num_steps):
            # ---- eval: pass@k on the test split
            if is_eval_step(step, num_steps, cfg.eval_every):
                saves.before_eval()  # the last checkpoint in place first: the eval's collectives
                wandb_run.log(evaluate(run, step))

            # ---- rollouts, policy gradient and optimizer step (the last checkpoint is written meanwhile)
            outcome = run.step(step)

            # ---- log
            record = report_step(run, step, outcome, run_start)
            auto_compile_step(run, step, outcome.t_rollout, outcome.t_train)  # --compile=auto: compile a part where it pays
            wandb_run.log(record)
            if cfg.eval_every > 0 and step % cfg.eval_every == 0:  # a few completions to read, from rank 0's first question
                log_samples_table(wandb_run, sample_table(run, outcome.trained[0]), step=step)

            # ---- checkpoint (model on rank 0; optimizer shards on every rank, for resume)
            stopping = stop.requested(run.reduce_device)
            if is_save_step(step, num_steps, cfg.save_every) or stopping:
                saves.save(step)
            if stopping:
                stop_now(run, stop, wandb_run, step)

        # ---- the final eval, after the last update: of the last saved model, whose meta records it
        if run.start_step <= num_steps and is_eval_step(num_steps, num_steps, cfg.eval_every):
            saves.before_eval()
            wandb_run.log(evaluate(run, num_steps))
            saves.refresh_meta(num_steps - 1, meta_data(run, num_steps - 1))
        saves.finish()  # the last step's checkpoint, when no final eval committed it

    with write_errors(lambda: f"training is done, its checkpoints in {saves.checkpoint_dir} (the last: step "
                              f"{saves.last_saved})"):
        report = get_report()
        # the run's own section and plots (never replaced by another run's), copied to nanochat's names as the latest
        own = log_chat_rl(report, run.user_config, run.progress.history, run.progress.eval_history,
                          run_name=f"{run.plan.output_tag}-{run.lineage.run_id}")
        path = report.write_report(run.device)
    if path:
        print0(f"Report: {path} (this run's section and plots: {os.path.dirname(own)})")
    wandb_run.finish()
    wait_for_all_ranks()


def stop_now(run, stop, wandb_run, step):
    """A stop on request (a signal, on any rank) after `step`, whose checkpoint is committed: how to resume."""
    run.checkpointer.finish()
    wandb_run.finish()
    print0(f"Stopped after step {step} on request. Resume with: python -m scripts.chat_rl "
           f"--resume={run.plan.output_tag}:{step}")
    sys.exit(128 + (stop.signum or signal.SIGTERM))


if __name__ == "__main__":
    run_main(main)
