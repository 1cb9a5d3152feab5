"""
nanochat's model generations: what each version's forward pass computes, and how to tell a checkpoint's
generation from its files.

nanochat changed its GPT several times between October 2025 and July 2026 without recording a version in
its checkpoints. A checkpoint only computes what it was trained to compute under the code that wrote it, so
the model here is built from a `Generation`: a set of switches, one per thing that changed. `nanochat.model.gpt`
reads the switches; nothing else about the model differs between generations.

    name      nanochat commits (dates)                 what changed (from the previous row)
    oct2025   ..f1bf69d^  (2025-10 .. 2025-12-08)      baseline: no lambdas, no windows, vocab not padded
    dec2025   f1bf69d..   (2025-12-09 .. 2026-01-10)   wte/lm_head rows padded to a multiple of 64
    jan2026   aa530cd..   (2026-01-11 .. 2026-01-17)   resid/x0 lambdas; sliding windows, S = L/2
    ve        a91743c..   (2026-01-18 .. 2026-03-01)   value embeddings on alternate layers, gate 2*sigmoid over 32 channels
    ve_mar2   aba30cb..   (2026-03-02 .. 2026-03-03)   logit softcap 20
    ve_late   1076f97..   (2026-03-04 .. 2026-03-08)   rotary tables in the compute dtype (fp32 on CPU) instead of bf16
    mar9      6ed7d1d..   (2026-03-09 .. 2026-03-13)   gate 3*sigmoid over 12 channels; q, k *1.15; rotary base 1e5;
                                                       S = L/3 rounded up to 128; softcap 15 again
    smear     a825e63..   (2026-03-14 .. 2026-07)      smear (previous token's embedding), backout; q, k *1.2;
                                                       S = L/4 rounded up to 128. Also nanochat's 2026-07 head:
                                                       its forward pass is bit-identical.

Telling them apart (`detect_generation`): the state-dict keys separate oct2025/dec2025 (no lambdas; dec2025
has padded rows), jan2026 (lambdas), the value-embedding era (`value_embeds.*`, ve_gate over 32 channels),
mar9 (ve_gate over 12) and smear (`smear_gate`). Inside the value-embedding era the files cannot separate
ve, ve_mar2 and ve_late when the meta has nanochat's new layout (`user_config`, written from 2026-01-31):
such a checkpoint is taken as ve_late, the last forward of that era, unless the caller names another. The
old meta layout (`val_loss`, no `user_config`) was written only before 2026-01-31, so it means ve.
Checkpoints written by this project carry a top-level "generation" key and are never guessed.
"""

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Generation:
    name: str
    label: str                    # printed at load
    dates: str
    pad_vocab: bool               # wte/lm_head rows padded up to a multiple of 64
    lambdas: bool                 # per-layer resid_lambdas / x0_lambdas parameters
    short_window_divisor: int     # S = L // 2 (2), or ceil(L / d) rounded up to 128 (3, 4); 0 = no windows at all
    value_embeds: bool            # value embeddings and their per-layer gates
    ve_gate_channels: int = 0     # the gate reads this many leading channels of the block's normed input
    ve_gate_scale: float = 0.0    # gate = scale * sigmoid(.)
    qk_scale: float = 1.0         # q and k are multiplied by this after the QK norm
    rotary_base: int = 10000
    bf16_rotary_tables: bool = True  # cos/sin rounded to bf16 even when computing in fp32
    softcap: float = 15.0
    smear: bool = False           # mix the previous token's normed embedding into each position
    backout: bool = False         # subtract backout_lambda * (residual after block n_layer // 2) at the end
    window_pattern_in_config: bool = True  # model_config has a window_pattern field


SMEAR_GATE_CHANNELS = 24  # the smear gate reads this many leading channels of the normed embedding

GENERATIONS = {g.name: g for g in [
    Generation("oct2025", "2025-10 (original)", "2025-10 .. 2025-12-08", pad_vocab=False, lambdas=False,
               short_window_divisor=0, value_embeds=False, window_pattern_in_config=False),
    Generation("dec2025", "2025-12 (padded vocab)", "2025-12-09 .. 2026-01-10", pad_vocab=True, lambdas=False,
               short_window_divisor=0, value_embeds=False, window_pattern_in_config=False),
    Generation("jan2026", "2026-01 (lambdas, sliding windows)", "2026-01-11 .. 2026-01-17", pad_vocab=True,
               lambdas=True, short_window_divisor=2, value_embeds=False),
    Generation("ve", "2026-01 (value embeddings)", "2026-01-18 .. 2026-03-01", pad_vocab=True, lambdas=True,
               short_window_divisor=2, value_embeds=True, ve_gate_channels=32, ve_gate_scale=2.0),
    Generation("ve_mar2", "2026-03-02 (value embeddings, softcap 20)", "2026-03-02 .. 2026-03-03", pad_vocab=True,
               lambdas=True, short_window_divisor=2, value_embeds=True, ve_gate_channels=32, ve_gate_scale=2.0,
               softcap=20.0),
    Generation("ve_late", "2026-03-04 (value embeddings, softcap 20, compute-dtype rotary)", "2026-03-04 .. 2026-03-08",
               pad_vocab=True, lambdas=True, short_window_divisor=2, value_embeds=True, ve_gate_channels=32,
               ve_gate_scale=2.0, softcap=20.0, bf16_rotary_tables=False),
    Generation("mar9", "2026-03-09 (value embeddings, q/k scale 1.15, rotary base 1e5)", "2026-03-09 .. 2026-03-13",
               pad_vocab=True, lambdas=True, short_window_divisor=3, value_embeds=True, ve_gate_channels=12,
               ve_gate_scale=3.0, qk_scale=1.15, rotary_base=100000, bf16_rotary_tables=False),
    Generation("smear", "2026-03 (smear, backout, value embeddings)", "2026-03-14 .. 2026-07", pad_vocab=True,
               lambdas=True, short_window_divisor=4, value_embeds=True, ve_gate_channels=12, ve_gate_scale=3.0,
               qk_scale=1.2, rotary_base=100000, bf16_rotary_tables=False, smear=True, backout=True),
]}
ALIASES = {"head": "smear"}  # nanochat of 2026-07 computes the same forward as a825e63
DEFAULT_GENERATION = "jan2026"  # what this project's own from-scratch models are (the seed's nanochat)
# the value-embedding era's generations that a new-layout meta cannot tell apart
VE_ERA_WITH_NEW_META = ("ve", "ve_mar2", "ve_late")
MODEL_CONFIG_FIELDS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "window_pattern")


class UnknownCheckpoint(ValueError):
    """The checkpoint's keys fit no known generation. The message is one line, meant for the user."""


def get_generation(name):
    """A Generation by name (or alias); ValueError naming the known ones otherwise."""
    if isinstance(name, Generation):
        return name
    key = ALIASES.get(name, name)
    if key not in GENERATIONS:
        raise ValueError(f"unknown nanochat generation {name!r}; known: {', '.join(list(GENERATIONS) + list(ALIASES))}")
    return GENERATIONS[key]


def has_value_embedding(generation, layer_idx, n_layer):
    """Alternate layers, always including the last one."""
    return generation.value_embeds and layer_idx % 2 == (n_layer - 1) % 2


def model_config_fields(generation):
    """The GPTConfig fields that generation's nanochat has (it refuses a model_config with any other)."""
    return MODEL_CONFIG_FIELDS if generation.window_pattern_in_config else MODEL_CONFIG_FIELDS[:-1]


def summarize_keys(keys):
    """['transformer.h.1.attn.x', 'transformer.h.3.attn.x', 'foo'] -> ['foo', 'transformer.h.*.attn.x (2 tensors)']:
    state-dict keys grouped by their name with layer numbers replaced by '*'."""
    groups = {}
    for key in keys:
        pattern = re.sub(r"(?<=\.)\d+(?=\.|$)", "*", key)
        groups[pattern] = groups.get(pattern, 0) + 1
    return [p if n == 1 and "*" not in p else f"{p} ({n} tensor{'s' if n > 1 else ''})" for p, n in sorted(groups.items())]


def _is_new_meta_layout(meta):
    """nanochat's chat_sft meta from 2026-01-31 on has user_config and val_bpb; before, val_loss and no user_config."""
    return "user_config" in meta or "val_bpb" in meta


def detect_generation(state_dict, meta, requested=None):
    """(Generation, how it was decided) for a checkpoint's state dict (key -> tensor, any prefix already
    stripped) and its meta json. `requested` (a name) picks among generations the files cannot separate,
    and must be consistent with the files otherwise. Raises UnknownCheckpoint for keys no generation has."""
    keys = set(state_dict)
    model_config = meta.get("model_config", {})
    if requested is not None:
        requested = get_generation(requested)

    recorded = meta.get("generation")
    if recorded is not None:
        found, how = get_generation(recorded), "recorded in the meta"
    elif "smear_gate.weight" in keys:
        found, how = GENERATIONS["smear"], "smear_gate and backout_lambda present"
    elif any(k.startswith("value_embeds.") for k in keys):
        gates = [v for k, v in state_dict.items() if k.endswith("attn.ve_gate.weight")]
        width = gates[0].shape[-1] if gates else None
        if width == 12:
            found, how = GENERATIONS["mar9"], "value embeddings with a 12-channel gate"
        elif width == 32 and not _is_new_meta_layout(meta):
            found, how = GENERATIONS["ve"], "value embeddings, meta layout of before 2026-01-31"
        elif width == 32:
            found, how = GENERATIONS["ve_late"], ("value embeddings, meta layout of 2026-01-31 .. 2026-03-08; "
                                                  "assumed the last forward of that era (the files cannot tell it "
                                                  "from ve and ve_mar2; the model_generation setting chooses)")
            if requested is not None and requested.name in VE_ERA_WITH_NEW_META:
                return requested, "value embeddings, meta layout of 2026-01-31 .. 2026-03-08; chosen by the caller"
        else:
            raise UnknownCheckpoint(f"value-embedding gate of width {width}: no known nanochat generation has it; "
                                    f"supported: {supported_generations()}")
    elif "resid_lambdas" in keys:
        found, how = GENERATIONS["jan2026"], "resid_lambdas and x0_lambdas present"
    else:
        wte = state_dict.get("transformer.wte.weight")
        vocab = model_config.get("vocab_size")
        padded = wte is not None and vocab is not None and wte.shape[0] != vocab
        found = GENERATIONS["dec2025" if padded else "oct2025"]
        how = "no per-layer lambdas" + (", padded vocabulary" if padded else "")
        if "window_pattern" in model_config:
            # windows and lambdas arrived together (2026-01-11); a window_pattern without lambdas is a
            # checkpoint whose lambdas were dropped, which nanochat's own loader fills with 1 and 0
            found, how = GENERATIONS["jan2026"], "window_pattern without lambdas (filled with 1 and 0, as nanochat's loader does)"
    if requested is not None and requested.name != found.name:
        raise ValueError(f"the checkpoint is generation {found.name} ({how}), not {requested.name}; "
                         f"only {', '.join(VE_ERA_WITH_NEW_META)} can be chosen, for value-embedding checkpoints "
                         f"whose files cannot tell them apart")
    return found, how


def supported_generations():
    return ", ".join(f"{g.name} ({g.dates})" for g in GENERATIONS.values())
