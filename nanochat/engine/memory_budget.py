"""
How much memory the rollout batches' KV caches in memory at once may take together (`--memory-budget-gb`; a
step's and an eval's, see engine.Engine._new_batch), decided once at the start of a run.

    --memory-budget-gb=N     N GiB, on every device
    --memory-budget-gb=auto  (the default) on CUDA: FRACTION of what is left of the device's free memory, measured
                             with the model (and a --kl-coef reference) loaded, once the run's later allocations
                             are set aside:
                                 budget = FRACTION * (free - optimizer - decode weights - training peak)
                             elsewhere: FIXED_GB (CPU and MPS memory is shared with everything else on the machine,
                             and a CPU run is not limited by it)

What is set aside is what the run allocates after the budget is decided, at full size (an upper bound):
  optimizer       the gradients (one fp32 per parameter) and the optimizer state not yet allocated (AdamW: 2 fp32
                  per parameter, Muon: 1; both are allocated at the first step, or already are on --resume)
  decode weights  the bf16 copies of the matmul weights that bf16 rollouts use (engine.DecodeWeights; 2 bytes
                  per weight, outside the KV budget); for fp32 rollouts the q/k/v concatenations (4 bytes a weight)
  training peak   the activations of one training forward and backward, estimated (training_peak_bytes)
The KV caches of static decode batches are kept from one rollout to the next (the step's and the eval's, within
the budget together), so they are still there when the model trains: hence the training peak in the reserve.
FRACTION leaves room for the allocator's fragmentation and for what the estimates miss (CUDA-graph pools, one per
kept batch; temporaries of the optimizer step). An out-of-memory in training gives back the eval's batch first.

The arithmetic is `plan_budget`, a pure function of byte counts; `resolve_memory_budget` measures and estimates
them for a run and returns the GiB the Engine takes, with the line that states how it was chosen.
"""

from dataclasses import dataclass

import torch

from nanochat.engine.decode_weights import fusable_attention, qkv_weights
from nanochat.errors import SettingError, UserError

AUTO = "auto"
FIXED_GB = 4.0  # off CUDA, and the budget nanochat-rl had everywhere before "auto"
FRACTION = 0.9
GiB = 1 << 30

# Training activations per token, upper bounds. Per layer, the values autograd keeps for one token are about 24
# per channel (the residual and its two norms, q/k/v and their rotary and norm, the attention output, c_proj's
# input, then c_fc's output, its relu and square: 4 channels each), counted at 4 bytes (autocast keeps norms and
# the residual stream in fp32; bf16 matmul outputs take 2). Per sampled token the logits exist about 6 times at 4
# bytes (the lm_head output, fp32 copy, softcap, log-softmax, and their gradients).
ACTIVATION_BYTES_PER_CHANNEL = 24 * 4
LOGIT_BYTES_PER_ENTRY = 6 * 4


def parse_budget(text):
    """--memory-budget-gb's value: AUTO, or a number of GiB > 0 (else a SettingError, shown under the flag)."""
    if text == AUTO:
        return AUTO
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not value > 0:  # not a number, or <= 0, or nan
        raise SettingError("memory_budget_gb", f"must be auto or a number of GiB > 0, got {text!r}")
    return value


@dataclass(frozen=True)
class MemoryPlan:
    """An auto budget and what it was computed from, in bytes (see the module docstring)."""
    free: int            # the device's free memory, measured with the model loaded
    model: int           # the model's parameters (already out of `free`; stated, not subtracted)
    optimizer: int       # gradients and optimizer state still to be allocated
    decode_weights: int  # bf16 copies of the matmul weights for rollouts
    training_peak: int   # activations of one training forward and backward
    fraction: float = FRACTION

    @property
    def reserved(self):
        return self.optimizer + self.decode_weights + self.training_peak

    @property
    def budget_bytes(self):
        return int(self.fraction * (self.free - self.reserved))

    @property
    def budget_gb(self):
        return self.budget_bytes / GiB

    def describe(self):
        gb = lambda n: f"{n / GiB:.1f} GiB"
        return (f"KV cache budget (--memory-budget-gb=auto): {gb(self.budget_bytes)} = {self.fraction:g} x ({gb(self.free)} "
                f"free with the model's {gb(self.model)} loaded - {gb(self.reserved)} reserved: optimizer state and "
                f"gradients {gb(self.optimizer)}, bf16 decode weights {gb(self.decode_weights)}, training peak "
                f"{gb(self.training_peak)} (estimated))")


class NoMemoryForRolloutsError(UserError):
    """Nothing of the device's free memory is left for a KV cache once the rest of the run is counted. The
    message states the arithmetic; what to change on the command line is the script's (nanochat/cli.py's HINTS)."""


def plan_budget(free, model, optimizer, decode_weights, training_peak, fraction=FRACTION):
    """The MemoryPlan of these byte counts; a NoMemoryForRolloutsError when nothing is left for a KV cache."""
    plan = MemoryPlan(int(free), int(model), int(optimizer), int(decode_weights), int(training_peak), fraction)
    if plan.budget_bytes <= 0:
        raise NoMemoryForRolloutsError(f"no device memory left for rollouts: {plan.describe().split(': ', 1)[1]}")
    return plan


def optimizer_bytes(model, optimizers):
    """Gradients of every parameter not holding one yet, and the state of every optimized parameter that has
    none yet: 2 values per parameter for an 'adamw' group (exp_avg, exp_avg_sq), 1 for a 'muon' group (its
    momentum; the second-moment row is negligible), 2 for a group of unknown kind. In the parameters' dtype."""
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p.grad is None)
    for opt in optimizers:
        for group in opt.param_groups:
            states = 1 if group.get("kind") == "muon" else 2
            total += sum(states * p.numel() * p.element_size() for p in group["params"] if not opt.state.get(p))
    return total


def decode_weight_bytes(model, rollout_dtype):
    """What the engine's DecodeWeights hold: the bf16/fp16 copies of the matmul weights (every nn.Linear) that
    low-precision rollouts use (the q/k/v concatenations among them); in fp32, the q/k/v concatenations alone."""
    if rollout_dtype not in (torch.bfloat16, torch.float16):
        return sum(w.numel() * w.element_size() for m in fusable_attention(model) for w in qkv_weights(m))
    size = torch.tensor([], dtype=rollout_dtype).element_size()
    return sum(m.weight.numel() * size for m in model.modules() if isinstance(m, torch.nn.Linear))


def training_peak_bytes(config, rows, completion_tokens, prompt_tokens, prompts=1, head_tokens=None):
    """Activations of one training pass of `rows` rows, each with `completion_tokens` sampled tokens, after `prompts`
    prompts of `prompt_tokens` tokens (chat_rl's pass: each prompt goes through the model once): every token through
    every layer, and logits for head_tokens of the sampled tokens at once (default all: the head computed whole; the
    chunked head holds one chunk's, nanochat/model/head.py; see the constants above)."""
    tokens = rows * completion_tokens + prompts * prompt_tokens
    layers = config.n_layer * ACTIVATION_BYTES_PER_CHANNEL * config.n_embd * tokens
    logits = LOGIT_BYTES_PER_ENTRY * config.vocab_size * (rows * completion_tokens if head_tokens is None else head_tokens)
    return layers + logits


def resolve_memory_budget(value, model, device, optimizers=(), rows=0, completion_tokens=0, prompt_tokens=0,
                          rollout_dtype=torch.bfloat16, prompts=1, head_tokens=None):
    """The GiB of KV cache the Engine takes for `value` (parse_budget's), and the line that says how an auto budget
    was chosen (None for a number given). On CUDA `auto` measures the free memory now, so call it once the model,
    any reference model and the optimizers exist, before the Engine (the optimizers may be () for a run that does
    not train, with rows=0; prompts and head_tokens as training_peak_bytes'); elsewhere it is FIXED_GB."""
    if value != AUTO:
        return float(value), None
    if device.type != "cuda":
        return FIXED_GB, f"KV cache budget (--memory-budget-gb=auto): {FIXED_GB:g} GiB, the fixed default on {device.type}"
    torch.cuda.empty_cache()  # blocks cached while loading (the bf16 -> fp32 copies) are free for the cache
    free, _ = torch.cuda.mem_get_info(device)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = training_peak_bytes(model.config, rows, completion_tokens, prompt_tokens, prompts, head_tokens) if rows else 0
    plan = plan_budget(free, model_bytes, optimizer_bytes(model, optimizers) if optimizers else 0,
                       decode_weight_bytes(model, rollout_dtype), peak)
    return plan.budget_gb, plan.describe()
