"""
What training allocates beyond the model, at full size (an upper bound), counted before it allocates it: the bytes a
run reserves for training when it sizes the rollouts' KV caches (--memory-budget-gb=auto: nanochat/engine/spec.py's
resolve_memory_budget takes them, nanochat/rl/plan.py's resolve_memory counts them).

  optimizer       the gradients (one fp32 per parameter) and the optimizer state not yet allocated (AdamW: 2 fp32
                  per parameter, Muon: 1; both are allocated at the first step, or already are on --resume)
  training peak   the activations of one training forward and backward, estimated (training_peak_bytes), and with
                  a distillation teacher (chat_rl's --teacher) its no-grad forward's beside them (teacher_forward_bytes;
                  its weights are loaded before the free memory is measured, as the --kl-coef reference's)
"""

# Training activations per token, upper bounds. Per layer, the values autograd keeps for one token are about 24
# per channel (the residual and its two norms, q/k/v and their rotary and norm, the attention output, c_proj's
# input, then c_fc's output, its relu and square: 4 channels each), counted at 4 bytes (autocast keeps norms and
# the residual stream in fp32; bf16 matmul outputs take 2). Per sampled token the logits exist about 6 times at 4
# bytes (the lm_head output, fp32 copy, softcap, log-softmax, and their gradients).
ACTIVATION_BYTES_PER_CHANNEL = 24 * 4
LOGIT_BYTES_PER_ENTRY = 6 * 4


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


def training_peak_bytes(config, rows, completion_tokens, prompt_tokens, prompts=1, head_tokens=None):
    """Activations of one training pass of `rows` rows, each with `completion_tokens` sampled tokens, after `prompts`
    prompts of `prompt_tokens` tokens (chat_rl's pass: each prompt goes through the model once): every token through
    every layer, and logits for head_tokens of the sampled tokens at once (default all: the head computed whole; the
    chunked head holds one chunk's, nanochat/model/head.py; see the constants above)."""
    tokens = rows * completion_tokens + prompts * prompt_tokens
    layers = config.n_layer * ACTIVATION_BYTES_PER_CHANNEL * config.n_embd * tokens
    logits = LOGIT_BYTES_PER_ENTRY * config.vocab_size * (rows * completion_tokens if head_tokens is None else head_tokens)
    return layers + logits


def teacher_forward_bytes(config, rows, completion_tokens, prompt_tokens, prompts=1, head_tokens=None):
    """The activations of the teacher's no-grad forward of a training chunk (its model `config`), alive beside the
    student's training activations: about two layers' worth (a layer's input and output; nothing is kept for a
    backward) and one chunk of logits, fp32 (the constants above)."""
    tokens = rows * completion_tokens + prompts * prompt_tokens
    logits = config.vocab_size * (rows * completion_tokens if head_tokens is None else head_tokens)
    return 2 * ACTIVATION_BYTES_PER_CHANNEL * config.n_embd * tokens + LOGIT_BYTES_PER_ENTRY * logits
