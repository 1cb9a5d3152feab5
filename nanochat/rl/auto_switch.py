"""
--compile=auto during a chat_rl run (its rule: nanochat/compiling/rule.py's AutoCompile). Each step's seconds of
each part, the training forward and the decode step, are measured with the part's compiling left out (CompileMarks:
each part's compile seconds where the step's rollouts began and where the last step ended); the rule's switches
make the run's next plan and training state (switched: new values, nothing changed in place), which the run takes
in one place (RLRun.take), from the next step on.
"""

import dataclasses
from dataclasses import dataclass

from nanochat.compiling.functions import compile_seconds
from nanochat.engine.decode_batch import static_step
from nanochat.engine.engine import STATIC_STEP_DYNAMIC
from nanochat.rl.policy_gradient import chunk_logprobs
from nanochat.rl.training import training_forward
from nanochat.runtime.distributed import print0


def part_compile_seconds():
    """{part: the seconds its compiled function (the training forward's, the static decode step's) has compiled so
    far in this process}."""
    return {"train": compile_seconds(chunk_logprobs, True), "decode": compile_seconds(static_step, STATIC_STEP_DYNAMIC)}


@dataclass(frozen=True)
class CompileMarks:
    """Each part's compile seconds (part_compile_seconds) at two points: `at_rollouts`, where the step's rollouts
    began; `at_step_end`, where the last step ended (or the run started)."""
    at_rollouts: dict
    at_step_end: dict

    @classmethod
    def at_start(cls):
        now = part_compile_seconds()
        return cls(at_rollouts=now, at_step_end=now)

    def rollouts_begin(self):
        """These marks with the step's rollouts beginning now."""
        return dataclasses.replace(self, at_rollouts=part_compile_seconds())

    def step_end(self, t_rollout, t_train):
        """At the step's end, its halves' seconds t_rollout, t_train: (each part's seconds in the step, what it
        compiled in the step left out; each part's compile seconds since the last step's end, an eval's graphs of
        the part included: the compile's cost; the marks with this step ended)."""
        now = part_compile_seconds()
        spent = {part: now[part] - self.at_rollouts[part] for part in now}  # in the step: not the part's step time
        seconds = {"train": max(t_train - spent["train"], 0.0), "decode": max(t_rollout - spent["decode"], 0.0)}
        compiled = {part: now[part] - self.at_step_end[part] for part in now}
        return seconds, compiled, dataclasses.replace(self, at_step_end=now)


def switched(plan, training, switches, decode_flag, device):
    """The run's (plan, training state) once --compile=auto's switches [(part, compiled)] are made, new values: a
    decode switch replaces the plan's RolloutSpec (its static step compiled or not, RolloutSpec.with_step_compiled,
    for the run's --decode `decode_flag` on `device`); a train switch the training state's chunk forward (compiled or
    not, loss-scaled as before)."""
    for part, on in switches:
        if part == "train":
            training = dataclasses.replace(training, forward=training_forward(on, training.loss_scale))
        else:
            plan = dataclasses.replace(plan, spec=plan.spec.with_step_compiled(on, decode_flag, device))
    return plan, training


def auto_compile_step(run, step, t_rollout, t_train):
    """At a step's end, --compile=auto measuring (run.auto_compile): the step's seconds of each part, compiling left
    out, to the rule; its decisions (rank 0's) said, and made from the next step on (switched, RLRun.take)."""
    if run.auto_compile is None:
        return
    seconds, compiled, run.compile_marks = run.compile_marks.step_end(t_rollout, t_train)
    switches = run.auto_compile.observe(step, seconds, compiled, run.reduce_device, run.world_size)
    for line in run.auto_compile.take_said():
        print0(line)
    if switches:
        run.take(*switched(run.plan, run.training, switches, run.config.decode, run.device))
