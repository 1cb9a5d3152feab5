"""
Loading a checkpoint's model: which checkpoint a source, tag and step name (find_checkpoint), and the GPT of its
files (build_model), with the keys and config fields of older nanochat versions patched and the model's
generation detected from the files (nanochat/model/generations.py).
"""

import dataclasses
import os
import warnings

import torch

from nanochat.checkpoints.errors import CorruptCheckpointError, NoCheckpointsError, UnknownStepError, UnknownTagError
from nanochat.checkpoints.layout import CHECKPOINT_DIRS, meta_path, model_path
from nanochat.checkpoints.store import find_largest_model, find_last_step, list_steps, list_tags, load_checkpoint
from nanochat.common import get_base_dir
from nanochat.errors import UserError
from nanochat.model.generations import detect_generation, summarize_keys, supported_generations
from nanochat.model.gpt import GPT, GPTConfig
from nanochat.runtime.distributed import print0
from nanochat.tokenizer import get_tokenizer


def _patch_state_dict(model_data):
    """Strip torch.compile's key prefix and load every bf16 tensor as fp32, on every device.

    nanochat's CUDA checkpoints store the embeddings in bf16 (its models keep them in the compute dtype). Here
    parameters are fp32 on every device, as a freshly built GPT's are: they are the weights the optimizers update,
    and a run's compute dtype comes from autocast (dtypes.autocast_context), not from the stored tensors. The rule
    does not look at the device: a bf16 embedding kept on CUDA (load_state_dict(assign=True) keeps the stored dtype)
    would meet fp32 matmuls in a --dtype=float32 run, and give the KV cache its dtype (engine.cache_geometry)."""
    prefix = "_orig_mod."  # left in the keys by saving a torch.compile'd module
    model_data = {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in model_data.items()}
    return {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in model_data.items()}


def _patch_model_config(model_config, config_cls, source_file):
    """Fill fields that older checkpoints lack; drop fields this code does not know (with a warning)."""
    model_config = dict(model_config)
    required = ("vocab_size", "n_layer", "n_head", "n_embd")
    missing = [k for k in required if k not in model_config]
    if missing:
        raise UserError(f"{source_file}: model_config lacks {', '.join(missing)}; this is not a nanochat checkpoint meta file")
    model_config.setdefault("window_pattern", "L")  # before sliding windows every layer attended fully
    model_config.setdefault("n_kv_head", model_config["n_head"])  # before GQA: one kv head per query head
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(model_config) - known)
    if unknown:
        # Likely a newer nanochat. Dropping is safe for parameters (the strict load below refuses
        # a state dict whose keys or shapes differ), not for behaviour-only switches, hence the warning.
        warnings.warn(f"{source_file}: ignoring model_config fields this version does not know: {', '.join(unknown)}",
                      stacklevel=3)
        for k in unknown:
            del model_config[k]
    return model_config


def build_model(checkpoint_dir, step, device, phase, generation=None):
    """Load step `step` of `checkpoint_dir` into a GPT on `device`. Returns (model, tokenizer, meta_data).
    phase: "train" or "eval" (sets the module mode). generation: None to detect it from the files (see
    nanochat.model.generations), or a name to choose among the generations the files cannot tell apart."""
    if phase not in ("train", "eval"):
        raise ValueError(f"phase must be 'train' or 'eval', got {phase!r}")
    device = torch.device(device)
    model_data, _, meta_data = load_checkpoint(checkpoint_dir, step, device)
    mpath, jpath = model_path(checkpoint_dir, step), meta_path(checkpoint_dir, step)
    if not isinstance(model_data, dict):
        raise CorruptCheckpointError(mpath, f"a {type(model_data).__name__}, not a state_dict")
    if not isinstance(meta_data, dict) or not isinstance(meta_data.get("model_config"), dict):
        raise UserError(f"{jpath} has no \"model_config\" object; it is not a nanochat checkpoint meta file")
    model_data = _patch_state_dict(model_data)
    try:
        gen, how = detect_generation(model_data, meta_data, requested=generation)
    except ValueError as e:  # UnknownCheckpoint, or a requested generation the files contradict
        raise UserError(f"{mpath}: {e}") from e
    model_config = _patch_model_config(meta_data["model_config"], GPTConfig, jpath)
    meta_data = {**meta_data, "model_config": model_config}

    config = GPTConfig(**model_config)
    with torch.device("meta"):
        model = GPT(config, gen)  # no memory, no init cost: every weight is replaced by the loaded one
    model.to_empty(device=device)
    model.init_weights()  # computes the non-persistent buffers (rotary cos/sin) that the state dict lacks
    expected = model.state_dict()
    if gen.lambdas:  # a window_pattern without lambdas: nanochat's loader fills them with these values
        for key, value in (("resid_lambdas", 1.0), ("x0_lambdas", 0.0)):
            if key not in model_data:
                model_data[key] = torch.full_like(expected[key], value)
    missing, unexpected = sorted(set(expected) - set(model_data)), sorted(set(model_data) - set(expected))
    if missing or unexpected:
        found = "; ".join(part for part in (
            f"unexpected keys: {', '.join(summarize_keys(unexpected))}" if unexpected else "",
            f"missing keys: {', '.join(summarize_keys(missing))}" if missing else "") if part)
        raise UserError(f"{mpath} does not match nanochat generation {gen.name} ({how}): {found}; it was written by "
                        f"a nanochat version this project does not know; supported: {supported_generations()}")
    try:
        model.load_state_dict(model_data, strict=True, assign=True)
    except RuntimeError as e:  # shape mismatches
        raise UserError(f"{mpath} does not match the GPT built from its meta (generation {gen.name}): "
                        f"{' '.join(str(e).split())}") from e
    if phase == "train":
        model.train()
    else:
        model.eval()
    print0(f"nanochat generation: {gen.label} [{gen.name}: {how}]")

    tokenizer = get_tokenizer()
    if tokenizer.get_vocab_size() != config.vocab_size:
        raise UserError(f"tokenizer vocab size {tokenizer.get_vocab_size()} != model vocab size {config.vocab_size} "
                        f"({jpath}); the tokenizer in $NANOCHAT_BASE_DIR/tokenizer must be the one the model was trained with")
    return model, tokenizer, meta_data


def find_checkpoint(source, model_tag=None, step=None):
    """Which checkpoint load_model would read: source in base|mid|sft|rl; model_tag None = find_largest_model;
    step None = the last one. Returns (checkpoint_dir, model_tag, step); a UserError says what is missing."""
    if source not in CHECKPOINT_DIRS:
        raise UserError(f"unknown checkpoint source {source!r}; valid sources: {', '.join(CHECKPOINT_DIRS)}")
    dirname = CHECKPOINT_DIRS[source]
    checkpoints_dir = os.path.join(get_base_dir(), dirname)
    if not os.path.isdir(checkpoints_dir):
        raise NoCheckpointsError(source, checkpoints_dir)
    if model_tag is None:
        model_tag = find_largest_model(checkpoints_dir)
    elif not os.path.isdir(os.path.join(checkpoints_dir, model_tag)):
        raise UnknownTagError(checkpoints_dir, model_tag, list_tags(checkpoints_dir))
    checkpoint_dir = os.path.join(checkpoints_dir, model_tag)
    if step is None:
        step = find_last_step(checkpoint_dir)
    elif step not in list_steps(checkpoint_dir):
        raise UnknownStepError(checkpoint_dir, step, list_steps(checkpoint_dir))
    return checkpoint_dir, model_tag, step


def load_model(source, device, phase, model_tag=None, step=None, generation=None):
    """Load a checkpoint family's model (arguments as find_checkpoint; generation as in build_model).
    Returns (model, tokenizer, meta_data)."""
    checkpoint_dir, _, step = find_checkpoint(source, model_tag, step)
    return load_found(checkpoint_dir, step, device, phase, generation)


def load_found(checkpoint_dir, step, device, phase, generation=None):
    """Load the checkpoint find_checkpoint found (build_model), saying which. Returns (model, tokenizer, meta)."""
    print0(f"Loading model from {checkpoint_dir} with step {step}")
    return build_model(checkpoint_dir, step, device, phase, generation)
