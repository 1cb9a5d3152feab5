"""Every nanochat generation loads and computes as the nanochat that trained it.

The fixtures in tests/fixtures/generations/<name>/ were written by nanochat's own code at that generation's
commit (tokenizer, a tiny trained d4 checkpoint, fp32 reference logits, KV-cache decode logits, and greedy
generations through its engine); trim.py there says what was kept. `head` is nanochat of 2026-07, whose
forward pass is that of `smear`.
"""

import json

import pytest
import torch
from helpers import generation_reference, install_generation, random_model, tiny_config

from nanochat.checkpoints.loading import build_model
from nanochat.checkpoints.store import save_checkpoint
from nanochat.cli import run_main
from nanochat.engine.engine import Engine
from nanochat.engine.kv_cache import KVCache, forward_cached
from nanochat.engine.spec import rollout_spec
from nanochat.errors import UserError
from nanochat.model.generations import GENERATIONS, summarize_keys
from nanochat.model.gpt import GPT, UNLIMITED_WINDOW, GPTConfig, layer_windows

FIXTURE_NAMES = ["oct2025", "jan2026", "ve", "ve_late", "mar9", "smear", "head"]
DETECTED_AS = {"head": "smear"}  # the files of the two cannot be told apart, and their forwards are identical
TOL = 1e-5  # fp32; every generation matches to 0.0 on the full forward and to < 1e-6 on the KV-cache path here


@pytest.fixture
def gen_base(tmp_path, monkeypatch):
    base = tmp_path / "nanochat"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    return base


def load(gen_base, name, generation=None):
    return build_model(str(install_generation(gen_base, name)), 5, "cpu", "eval", generation)


# ----------------------------------------------------------------------------- detection

@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_generation_is_detected_and_printed(gen_base, name, capsys):
    model, _, _ = load(gen_base, name)
    expected = DETECTED_AS.get(name, name)
    assert model.generation.name == expected
    assert f"nanochat generation: {GENERATIONS[expected].label}" in capsys.readouterr().out


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_bf16_and_compiled_checkpoints_load_as_their_generation(gen_base, name):
    """A checkpoint saved from a torch.compile'd bf16 model: keys prefixed with _orig_mod., bf16 tensors."""
    ckpt = install_generation(gen_base, name)
    state = torch.load(ckpt / "model_000005.pt", weights_only=True)
    torch.save({"_orig_mod." + k: v.bfloat16() for k, v in state.items()}, ckpt / "model_000005.pt")
    model, _, _ = build_model(str(ckpt), 5, "cpu", "eval")
    assert model.generation.name == DETECTED_AS.get(name, name)
    loaded = model.state_dict()
    assert list(loaded) == list(state)
    assert all(loaded[k].dtype == torch.float32 and torch.equal(loaded[k], state[k].bfloat16().float()) for k in state)


@pytest.mark.parametrize("name", ["oct2025", "smear"])
def test_bf16_checkpoint_loads_fp32_on_a_device_other_than_the_cpu(gen_base, name):
    """Issue 35, item 4: the loader upcast bf16 only on CPU/MPS and load_state_dict(assign=True) kept the stored
    dtype, so a nanochat CUDA checkpoint (bf16 embeddings) run with --dtype=float32 on CUDA fed bf16 embeddings
    into fp32 matmuls, and its KV cache took the bf16 of the first parameter. The meta device is neither CPU nor
    MPS, so this runs the branch a CUDA load takes, on a machine without CUDA."""
    ckpt = install_generation(gen_base, name)
    state = torch.load(ckpt / "model_000005.pt", weights_only=True)
    torch.save({k: v.bfloat16() if v.is_floating_point() else v for k, v in state.items()}, ckpt / "model_000005.pt")
    model, _, _ = build_model(str(ckpt), 5, "meta", "train")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {k: p.dtype for k, p in model.named_parameters() if p.dtype != torch.float32} == {}
    assert KVCache.for_model(model, 2, 8).k.dtype == torch.float32


def test_ve_era_with_the_new_meta_layout_can_be_chosen(gen_base):
    """ve_late's files are also those of ve and ve_mar2 checkpoints written after 2026-01-31: the default is
    ve_late, and the caller may choose; the forwards really differ (softcap 20 vs 15, rotary rounding)."""
    ref = generation_reference("ve_late")
    positions = ref["conv_positions"]
    logits = {}
    for choice in (None, "ve", "ve_mar2", "ve_late"):
        model, _, _ = load(gen_base, "ve_late", choice)
        assert model.generation.name == (choice or "ve_late")
        with torch.no_grad():
            logits[choice] = model(ref["conv"])[:, positions]
    torch.testing.assert_close(logits[None], ref["conv_logits_fp32"], atol=TOL, rtol=0)
    assert (logits["ve"] - logits["ve_late"]).abs().max() > 1e-2
    assert (logits["ve_mar2"] - logits["ve_late"]).abs().max() > 1e-5  # bf16 vs fp32 rotary tables


def test_choosing_a_generation_the_files_rule_out_is_refused(gen_base):
    with pytest.raises(UserError, match="generation smear .*not ve") as e:
        load(gen_base, "smear", "ve")
    assert "\n" not in str(e.value)


def test_unknown_keys_give_one_line_naming_every_group(gen_base):
    """A checkpoint of a newer nanochat: keys no generation has, summarised per group, and the supported list."""
    ckpt = install_generation(gen_base, "smear")
    state = torch.load(ckpt / "model_000005.pt", weights_only=True)
    state["transformer.h.1.attn.new_gate.weight"] = torch.zeros(2)
    state["transformer.h.3.attn.new_gate.weight"] = torch.zeros(2)
    state["fancy_scalar"] = torch.zeros(1)
    torch.save(state, ckpt / "model_000005.pt")
    with pytest.raises(UserError) as e:
        build_model(str(ckpt), 5, "cpu", "eval")
    message = str(e.value)
    assert "\n" not in message
    assert "unexpected keys: fancy_scalar, transformer.h.*.attn.new_gate.weight (2 tensors)" in message
    assert all(f"{name} (" in message for name in GENERATIONS)  # every supported generation, with its dates
    assert message.endswith(")")  # whole, not cut


def test_summarize_keys_groups_layers():
    keys = ["value_embeds.1.weight", "value_embeds.3.weight", "smear_lambda", "transformer.h.0.attn.x.weight"]
    assert summarize_keys(keys) == ["smear_lambda", "transformer.h.*.attn.x.weight (1 tensor)",
                                    "value_embeds.*.weight (2 tensors)"]


# ----------------------------------------------------------------------------- shapes and windows of other configs

@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_state_dict_shapes_and_windows_of_other_configs(name):
    """What nanochat builds at vocab 500 / depth 5 (padding, which layers get value embeddings) and at
    sequence_len 1000 and 2048 (the short-window rule), recorded from that version's own code."""
    generation = DETECTED_AS.get(name, name)
    for variant in generation_reference(name)["meta_device_variants"].values():
        config = GPTConfig(**{"window_pattern": "L", **variant["config"]})
        with torch.device("meta"):
            model = GPT(config, generation)
        if "shapes" in variant:
            assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == variant["shapes"]
        expected = variant["window_sizes"]
        if expected is None:  # no sliding windows in that generation: every earlier token, however far
            assert layer_windows(config, generation) == [UNLIMITED_WINDOW] * config.n_layer
        else:
            assert layer_windows(config, generation) == [left for left, _ in expected]


@pytest.mark.parametrize("name", ["oct2025", "jan2026"])
def test_attention_beyond_sequence_len_follows_the_generation(gen_base, name):
    """Past sequence_len (256) oct2025 attends to every earlier token, while jan2026's long window (the
    last layer) slides: each differs from the other rule exactly at positions past 256. The cached path
    agrees with the full forward either way."""
    model, _, _ = load(gen_base, name)
    idx = torch.randint(0, 512, (1, 300), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache.for_model(model, 1, 300)
        cached = torch.cat([forward_cached(model, idx[:, :200], cache)] + [forward_cached(model, idx[:, t:t + 1], cache)
                                                                    for t in range(200, 300)], dim=1)
        other_rule = UNLIMITED_WINDOW if name == "jan2026" else model.config.sequence_len
        saved = list(model.window_sizes)
        model.window_sizes[-1] = other_rule
        try:
            other = model(idx)
        finally:
            model.window_sizes[:] = saved
    torch.testing.assert_close(cached, full, atol=TOL, rtol=TOL)
    assert torch.equal(full[:, :257], other[:, :257])
    assert (full[:, 257:] - other[:, 257:]).abs().amax(-1).min() > 0


# ----------------------------------------------------------------------------- numerics against nanochat

@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_logits_match_nanochat(gen_base, name):
    model, _, _ = load(gen_base, name)
    ref = generation_reference(name)
    with torch.no_grad():
        logits = model(ref["conv"])[:, ref["conv_positions"]]
    torch.testing.assert_close(logits, ref["conv_logits_fp32"], atol=TOL, rtol=0)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_kv_cache_decode_matches_nanochat(gen_base, name):
    """nanochat's engine path: a batch-1 prefill, the cache copied to 2 rows (smear's previous embedding
    with it), then 30 single-token steps, row 0 continuing the conversation and row 1 fed other tokens."""
    model, _, _ = load(gen_base, name)
    ref = generation_reference(name)
    conv, n = ref["conv"], ref["kv_prefill_len"]
    steps = ref["kv_row1_tokens"].numel()
    with torch.no_grad():
        prompt_cache = KVCache.for_model(model, 1, n)
        prefill_last = forward_cached(model, conv[:, :n], prompt_cache)[:, -1]
        cache = KVCache.for_model(model, 2, n + steps)
        cache.admit_rows(0, 2, prompt_cache, pool_slot=None, first_sample=0)
        decoded = []
        for j in range(steps):
            tokens = torch.stack([conv[0, n + j], ref["kv_row1_tokens"][j]])[:, None]  # (2, 1)
            decoded.append(forward_cached(model, tokens, cache)[:, -1])
    torch.testing.assert_close(prefill_last, ref["kv_prefill_last_logits_fp32"], atol=TOL, rtol=0)
    torch.testing.assert_close(torch.stack(decoded, dim=1), ref["kv_decode_logits_fp32"], atol=TOL, rtol=0)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("decode", ["eager", "static"])
def test_greedy_generations_match_nanochat(gen_base, name, decode):
    """Through generate_batch (nanochat's API) and the batched generate_many, with few rows so that rows
    are admitted from prefilled prompts while others decode. Prompt 2 plus 48 tokens passes sequence_len.
    Both decode steps: eager (exact shapes) and static (bucketed shapes with free rows, what CUDA graphs run)."""
    model, tokenizer, _ = load(gen_base, name)
    ref = generation_reference(name)
    engine = Engine(model, tokenizer, rollout_spec(model, decode=decode))
    kwargs = dict(num_samples=ref["greedy_num_samples"], max_tokens=ref["greedy_max_tokens"], temperature=0.0)
    for conversation, prompt in zip(ref["greedy_prompt_conversations"], ref["greedy_prompts"]):
        assert tokenizer.render_for_completion(conversation) == prompt
    for prompt, (tokens, masks) in zip(ref["greedy_prompts"], ref["greedy"]):
        assert engine.generate_batch(prompt, **kwargs) == (tokens, masks)
    batched = engine.generate_many(ref["greedy_prompts"], max_rows=3, **kwargs)
    for prompt, completions, (tokens, masks) in zip(ref["greedy_prompts"], batched, ref["greedy"]):
        assert [prompt + c.tokens for c in completions] == tokens
        assert [[0] * len(prompt) + c.masks for c in completions] == masks


def test_oct2025_greedy_output_calls_the_calculator():
    """Guards the check above: forced tool output (mask 0) is part of what is compared."""
    tokens, masks = generation_reference("oct2025")["greedy"][0]
    assert any(0 in m[len(generation_reference("oct2025")["greedy_prompts"][0]):] for m in masks)


def test_smear_state_survives_row_compaction(tiny_tokenizer):
    """Rows that end early leave the batch and the last row moves into the hole: its smear state must move
    with it. Sampled outputs then do not depend on how rows were grouped (each row has its own stream)."""
    model = random_model(tiny_config(sequence_len=64, vocab_size=tiny_tokenizer.get_vocab_size(), n_head=2, n_kv_head=1,
                                     window_pattern="SL"), generation="smear")
    end = tiny_tokenizer.encode_special("<|assistant_end|>")
    with torch.no_grad():
        model.smear_lambda.fill_(1.0)  # make smearing matter
        model.lm_head.weight[end] *= 2.5  # stop at varied steps (measured: 0 to 20 tokens)
    engine = Engine(model, tiny_tokenizer)
    prompts = [tiny_tokenizer.render_for_completion({"messages": [{"role": "user", "content": q},
                                                                  {"role": "assistant", "content": ""}]})
               for q in ("a b", "Natalia sold 48 clips", "c")]
    runs = []
    for max_rows in (2, 5, 64):
        out = engine.generate_many(prompts, num_samples=4, max_tokens=20, temperature=1.0, seeds=[1, 2, 3],
                                   max_rows=max_rows)
        runs.append([[(c.tokens, c.masks) for c in per] for per in out])
    lengths = {len(tokens) for per in runs[0] for tokens, _ in per}
    assert len(lengths) > 2  # rows really end at different steps
    assert runs[1] == runs[0] and runs[2] == runs[0]


# ----------------------------------------------------------------------------- RL on every generation

@pytest.mark.parametrize("name", ["oct2025", "ve_late", "smear"])
def test_two_rl_steps_write_a_checkpoint_of_the_same_generation(gen_base, name):
    """The RL checkpoint holds exactly the input's state-dict keys and model_config (that nanochat builds
    GPTConfig(**model_config)), records its generation, and loads back as it."""
    from scripts import chat_rl
    source = install_generation(gen_base, name)
    flags = ["--task=rl_toy_task:ParityTask", "--device-type=cpu", "--dtype=float32", "--num-steps=2", "--save-every=1",
             "--examples-per-step=2", "--num-samples=4", "--device-batch-size=4", "--max-new-tokens=8",
             "--temperature=1.0", "--eval-every=-1", "--run=dummy"]
    if name == "ve_late":
        flags.append("--model-generation=ve")
    run_main(chat_rl.main, flags)
    rl_dir = gen_base / "chatrl_checkpoints" / "d4"
    meta = json.loads((rl_dir / "meta_000001.json").read_text())
    source_meta = json.loads((source / "meta_000005.json").read_text())
    assert meta["model_config"] == source_meta["model_config"]
    assert meta["generation"] == ("ve" if name == "ve_late" else name)
    state = torch.load(rl_dir / "model_000001.pt", weights_only=True)
    source_state = torch.load(source / "model_000005.pt", weights_only=True)
    assert list(state) == list(source_state) and all(state[k].shape == source_state[k].shape for k in state)
    assert any(not torch.equal(state[k], source_state[k]) for k in state)
    model, _, _ = build_model(str(rl_dir), 1, "cpu", "eval")
    assert model.generation.name == meta["generation"]


def test_save_checkpoint_of_a_generation_round_trips(gen_base):
    """A checkpoint this project writes carries its generation at the top level of the meta, so a ve-era
    model saved as ve_mar2 loads back as ve_mar2 without guessing."""
    model, _, meta = load(gen_base, "ve_late", "ve_mar2")
    target = gen_base / "chatrl_checkpoints" / "mine"
    save_checkpoint(str(target), 1, model.state_dict(), None,
                    {"step": 1, "model_config": model.meta_model_config(), "generation": model.generation.name,
                     "user_config": {}})
    loaded, _, _ = build_model(str(target), 1, "cpu", "eval")
    assert loaded.generation.name == "ve_mar2"


def test_eval_and_sft_run_on_a_smear_checkpoint(gen_base, gsm8k_dir, monkeypatch, capsys):
    """chat_eval evaluates, and chat_sft finetunes, a checkpoint of the newest generation; SFT's checkpoint
    keeps the generation, its keys and model_config."""
    from scripts import chat_eval, chat_sft
    monkeypatch.setenv("NANOCHAT_GSM8K_DIR", str(gsm8k_dir))
    source = install_generation(gen_base, "smear")
    run_main(chat_eval.main, ["--task=rl_toy_task:ParityTask", "--num-examples=2", "--num-samples=2",
                              "--max-new-tokens=6", "--device-type=cpu", "--dtype=float32"])
    assert "nanochat generation: 2026-03 (smear" in capsys.readouterr().out
    run_main(chat_sft.main, ["--source=sft", "--tasks=gsm8k", "--num-steps=1", "--eval-every=-1", "--device-type=cpu",
                             "--dtype=float32", "--examples-per-step=2", "--device-batch-size=2", "--output-tag=sft2"])
    sft_dir = gen_base / "chatsft_checkpoints" / "sft2"
    meta_file = next(sft_dir.glob("meta_*.json"))
    meta = json.loads(meta_file.read_text())
    assert meta["generation"] == "smear"
    assert meta["model_config"] == json.loads((source / "meta_000005.json").read_text())["model_config"]
    state = torch.load(sft_dir / meta_file.name.replace("meta_", "model_").replace(".json", ".pt"), weights_only=True)
    assert list(state) == list(torch.load(source / "model_000005.pt", weights_only=True))
