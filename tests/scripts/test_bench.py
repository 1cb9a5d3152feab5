"""scripts/bench_rl: the report it writes, the step it times (chat_rl's; nanochat/diagnostics/bench_configs.py,
bench_measure.py, bench_results.py), the early-stop wrapper and the FLOP accounting;
nanochat/runtime/machine.py: the machine probes it reads (peak memory, matmul peak, bandwidth)."""

import json
import math

import pytest
import torch
from helpers import BF16_MIN_AGREEMENT, BF16_NEAR_TIE, FP32_GAP_BOUND, random_model, tiny_config

from nanochat.errors import UserError
from nanochat.runtime import machine
from greedy_agreement import greedy_agreement
from nanochat.diagnostics import bench_configs, bench_measure, bench_results
from nanochat.diagnostics.early_stop import EarlyStopModel
from nanochat.engine.engine import Engine
from nanochat.engine.kv_cache import KVCache, forward_cached
from nanochat.kernels.launch import interpreter_on
from nanochat.rl import run as rl_run
from scripts import bench_rl

TINY_FLAGS = ["--device-type=cpu", "--depth=1", "--vocab-size=400", "--examples-per-step=2", "--num-samples=4",
              "--device-batch-size=2", "--max-new-tokens=8", "--early-stop-mean=3", "--peak-matmul-size=256"]
METRICS = ["rollout_seconds", "train_seconds", "optimizer_seconds", "step_seconds", "rollout_tokens",
           "rollout_tokens_per_s", "rollout_flops", "rollout_flops_per_s", "rollout_mfu", "train_tokens",
           "train_tokens_per_s", "train_flops", "train_flops_per_s", "train_mfu", "rows", "prefill_tokens",
           "decode_forwards", "row_steps", "rows_x_longest", "resident_mb_at_start", "peak_memory_mb",
           "rollout_tokens_per_s_x", "train_tokens_per_s_x", "step_speedup_x", "kv_positions_read",
           "kv_bytes_per_decoded_token", "decode_ms_per_step", "decode_weight_bytes", "bytes_per_decode_step",
           "bandwidth_bound_ms", "decode_x_bound"]


def tiny_gpt(n_layer=1, window_pattern="L"):
    """One head of width 64 over the tiny tokenizer's 400 tokens: the sizes the FLOP counts below are worked out for."""
    return random_model(tiny_config(sequence_len=128, vocab_size=400, n_layer=n_layer, n_head=1, n_kv_head=1,
                                    window_pattern=window_pattern))


def test_static_decode_config_samples_the_same_tokens_and_forced_advantages_train_every_row(base_dir, tmp_path, capsys):
    """batched_fp32_static (the bucketed step CUDA graphs replay) is checked against batched_fp32's tokens and
    says so; --force-advantages makes a random model's whole batch trainable; --repeat times every step."""
    output = tmp_path / "bench.json"
    bench_rl.main(TINY_FLAGS + ["--configs=batched_fp32,batched_fp32_static", "--force-advantages", "--repeat=3",
                                f"--output={output}", "--no-signal-fractions="])
    results = json.loads(output.read_text())["results"]
    assert results["batched_fp32_static"]["tokens_identical_to"] == ["batched_fp32", True]
    assert results["batched_fp32_static+early"]["tokens_identical_to"] == ["batched_fp32+early", True]
    assert "tokens_identical_to" not in results["batched_fp32"]
    for r in results.values():
        assert r["rows_trained"] == r["rows"] == 8 and len(r["rollout_seconds_each"]) == 3
        # the times are the steady state's (the last step), not the first's, which pays captures and compiles
        assert (r["rollout_seconds"], r["train_seconds"], r["step_seconds"]) == (
            r["rollout_seconds_each"][-1], r["train_seconds_each"][-1], r["step_seconds_each"][-1])
        assert r["sampler_tokens"] > 0 and 0 <= r["sampler_gap_mean"] <= r["sampler_gap_max"] <= FP32_GAP_BOUND  # fp32: a few ulps
        assert r["bandwidth_bound_ms"] > 0 and r["decode_x_bound"] == r["decode_ms_per_step"] / r["bandwidth_bound_ms"]
    assert "= batched_fp32+early" in capsys.readouterr().out


@pytest.mark.skipif(not interpreter_on(), reason="Triton's interpreter is off (a GPU machine: gpu_check.sh runs it)")
def test_triton_config_samples_the_hand_written_steps_tokens_in_its_kernel_count(base_dir, tmp_path):
    """batched_fp32_static_triton (the step in nanochat/kernels/' Triton kernels, in Triton's interpreter here) is
    checked against batched_fp32_static's tokens: the same, with and without early ends; its meta op count is the
    kernels' step's (9 a block), not the hand-written one's; the GPU config's twin is the hand-written graph config."""
    output = tmp_path / "bench.json"
    bench_rl.main(TINY_FLAGS + ["--configs=batched_fp32_static,batched_fp32_static_triton", "--force-advantages",
                                f"--output={output}", "--no-signal-fractions="])
    results = json.loads(output.read_text())["results"]
    ours, hand_written = results["batched_fp32_static_triton"], results["batched_fp32_static"]
    assert ours["tokens_identical_to"] == ["batched_fp32_static", True]
    assert results["batched_fp32_static_triton+early"]["tokens_identical_to"] == ["batched_fp32_static+early", True]
    assert ours["decode_step_kernels_per_layer"] == [10] and hand_written["decode_step_kernels_per_layer"][0] > 10
    results = {name: {"tokens_digest": "d"} for name in ("batched_bf16_graph", "batched_bf16_graph_triton")}
    bench_results.mark_identical_tokens(results, [bench_configs.CONFIGS[n] for n in results])
    assert results["batched_bf16_graph_triton"]["tokens_identical_to"] == ("batched_bf16_graph", True)


def test_flex_config_samples_the_hand_written_steps_tokens(base_dir, tmp_path, monkeypatch):
    """batched_fp32_static_flex (the shared-prompt attention through FlexAttention, eagerly on a CPU) is checked
    against batched_fp32_static's tokens: the same, with and without early ends; the GPU's flex configs against the
    hand-written attention's, compiled or not."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # Dynamo runs eager FlexAttention: this machine's
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)      # CUDA, not the session's pretend one
    output = tmp_path / "bench.json"
    bench_rl.main(TINY_FLAGS + ["--configs=batched_fp32_static,batched_fp32_static_flex", "--force-advantages",
                                f"--output={output}", "--no-signal-fractions="])
    results = json.loads(output.read_text())["results"]
    assert results["batched_fp32_static_flex"]["tokens_identical_to"] == ["batched_fp32_static", True]
    assert results["batched_fp32_static_flex+early"]["tokens_identical_to"] == ["batched_fp32_static+early", True]
    assert results["batched_fp32_static_flex"]["rollout_tokens"] == results["batched_fp32_static"]["rollout_tokens"] > 0
    names = ("batched_bf16_graph", "batched_bf16_graph_flex", "batched_bf16_graph_compiled", "batched_bf16_graph_compiled_flex")
    results = {name: {"tokens_digest": "d"} for name in names}
    bench_results.mark_identical_tokens(results, [bench_configs.CONFIGS[n] for n in results])
    assert results["batched_bf16_graph_flex"]["tokens_identical_to"] == ("batched_bf16_graph", True)
    assert results["batched_bf16_graph_compiled_flex"]["tokens_identical_to"] == ("batched_bf16_graph_compiled", True)


def test_d20_preset_sets_nanochats_d20_shapes():
    args = bench_rl.parse_args(["--preset=d20"])
    bench_rl.validate_args(args)
    assert (args.depth, args.vocab_size, args.sequence_len, args.window_pattern) == (20, 65536, 2048, "SSSL")


def test_report_has_every_config_and_metric(base_dir, tmp_path, capsys):
    output = tmp_path / "bench.json"
    bench_rl.main(TINY_FLAGS + ["--configs=baseline,batched_fp32,batched_bf16", f"--output={output}"])
    report = json.loads(output.read_text())
    names = ["baseline", "batched_fp32", "batched_bf16", "baseline+early", "batched_fp32+early", "batched_bf16+early"]
    assert list(report["results"]) == names
    for name in names:
        r = report["results"][name]
        for key in METRICS:
            assert key in r, (name, key)
            assert math.isfinite(r[key]) and r[key] > 0, (name, key, r[key])
        assert r["rows"] == 2 * 4
        assert r["rows_trained"] + r["rows_skipped"] == r["rows"]  # a random model earns no reward: all skipped
        assert r["rows_trained"] == (0 if name.startswith("batched") else r["rows"])
        assert r["rollout_tokens"] <= r["rows"] * 8
        assert r["row_steps"] <= r["rows_x_longest"] <= r["rows"] * (8 - 1)  # the first token comes from the prefill
        # every position of the padded passes is trained on: prompt + longest completion - 1, per question
        assert r["train_tokens"] >= r["rollout_tokens"]
        # a decode step reads each matmul weight once in its dtype (bf16: the engine's copies), 4 * 64 * 64 (attention)
        # + 2 * 64 * 256 (MLP) + 448 * 64 (lm_head, 400 rows padded) = 77,824 (the embeddings are looked up), and its
        # keys and values: 2 * 64 per position (one head of 64, one layer)
        size = 2 if "bf16" in name else 4
        assert r["decode_weight_bytes"] == 77_824 * size
        kv_per_step = 2 * 64 * size * r["kv_positions_read"] / r["decode_forwards"]
        assert r["bytes_per_decode_step"] == r["decode_weight_bytes"] + kv_per_step
    for name in ("baseline", "baseline+early"):
        assert report["results"][name]["step_speedup_x"] == 1.0
    for name in names[3:]:
        assert report["results"][name]["row_steps"] < 2 * 4 * 8
    # the batched configs prefill each prompt once; the baseline once per engine call (2 passes of 2 rows)
    base, batched = report["results"]["baseline"], report["results"]["batched_fp32"]
    assert base["prefill_tokens"] == 2 * batched["prefill_tokens"]
    assert set(report["peak_flops"]) == {"float32", "bfloat16"} and all(v > 0 for v in report["peak_flops"].values())
    assert report["machine"]["torch"] == torch.__version__ and report["machine"]["threads"] >= 1
    assert report["model"]["n_layer"] == 1 and report["model"]["n_embd"] == 64 and report["model"]["vocab_size"] == 400
    out = capsys.readouterr().out
    assert all(name in out for name in names)


def test_lean_configs_skip_rows_and_read_fewer_kv_bytes(base_dir, tmp_path):
    """The arithmetic workload on a tiny random model: the plain batched config trains every row and keeps a
    prompt copy per row; batched_fp32 trains only rows with an advantage and reads each prompt's keys once
    per step. The no-signal table trains nothing when every question is silent."""
    output = tmp_path / "bench.json"
    bench_rl.main(TINY_FLAGS + ["--configs=batched_plain,batched_fp32", "--task=arithmetic", "--num-samples=8",
                                "--early-stop-mean=0", "--no-signal-fractions=0,1", f"--output={output}"])
    report = json.loads(output.read_text())
    plain, lean = report["results"]["batched_plain"], report["results"]["batched_fp32"]
    assert plain["rows_trained"] == plain["rows"] == 16 and plain["rows_skipped"] == 0
    assert lean["rows_trained"] + lean["rows_skipped"] == 16
    assert lean["kv_bytes_per_decoded_token"] < plain["kv_bytes_per_decoded_token"]
    table = report["no_signal_training"]
    assert [r["no_signal_fraction"] for r in table] == [0.0, 1.0]
    assert table[0]["skip_rows_trained"] == lean["rows_trained"] and table[1]["skip_rows_trained"] == 0
    assert table[0]["all_rows_rows_trained"] == table[1]["all_rows_rows_trained"] == 16


def test_config_subset_without_baseline_has_no_ratios(base_dir, tmp_path, monkeypatch):
    """The step timed is chat_rl's train_on_rollouts on a run of chat_rl's flags (here its objective, --loss-norm):
    once in the warm-up, without optimizers, then once measured, with them."""
    runs = []

    def train_on_rollouts(run, rollouts, step, **work):
        runs.append((run.training.policy_loss.loss_norm, len(run.optimizers), step))
        return rl_run.train_on_rollouts(run, rollouts, step, **work)
    monkeypatch.setattr(bench_measure, "train_on_rollouts", train_on_rollouts)
    output = tmp_path / "bench.json"
    bench_rl.main(TINY_FLAGS + ["--configs=batched_fp32", "--early-stop-mean=0", "--loss-norm=token", f"--output={output}"])
    report = json.loads(output.read_text())
    assert list(report["results"]) == ["batched_fp32"] and report["complete"] is True
    assert "step_speedup_x" not in report["results"]["batched_fp32"]
    assert runs == [("token", 0, bench_measure.BENCH_STEP), ("token", 2, bench_measure.BENCH_STEP)]  # AdamW and Muon
    assert report["settings"]["rl"]["loss_norm"] == "token" and report["settings"]["rl"]["examples_per_step"] == 2


def test_the_json_is_written_after_every_config(base_dir, tmp_path, monkeypatch):
    """A bench stopped by a time limit keeps what finished: after each config the JSON holds the configs measured so
    far, marked incomplete; here the second config fails, and the first's numbers are on disk."""
    real_measure, seen = bench_measure.measure, []

    def measure(*args, **kwargs):
        if seen:
            raise KeyboardInterrupt  # the time limit
        seen.append(1)
        return real_measure(*args, **kwargs)
    monkeypatch.setattr(bench_measure, "measure", measure)
    output = tmp_path / "bench.json"
    with pytest.raises(KeyboardInterrupt):
        bench_rl.main(TINY_FLAGS + ["--configs=batched_fp32,batched_fp32_static", "--early-stop-mean=0",
                                    f"--output={output}"])
    report = json.loads(output.read_text())
    assert list(report["results"]) == ["batched_fp32"] and report["complete"] is False
    assert report["results"]["batched_fp32"]["step_seconds"] > 0 and "batches" not in report["results"]["batched_fp32"]


@pytest.mark.parametrize("kind", ["none", "avx512-bf16", "amx"])
def test_default_configs_measure_bf16_only_where_it_is_native(kind, monkeypatch, capsys):
    monkeypatch.setenv("NANOCHAT_CPU_BF16", kind)
    native_bf16 = kind != "none"
    assert bench_rl.validate_args(bench_rl.parse_args([])) is None  # no --configs: the device decides
    names = [c.name for c in bench_configs.default_configs(torch.device("cpu"))]
    expected = ["baseline", "batched_plain", "batched_fp32", "batched_fp32_static"] + (
        ["batched_bf16", "batched_bf16_static"] if native_bf16 else []) + [
        "batched_fp32_compiled", "batched_fp32_static_compiled"] + (
        ["batched_bf16_compiled", "batched_bf16_static_compiled"] if native_bf16 else [])
    # CUDA graphs (batched_bf16_graph) only on CUDA; compiled configs where chat_rl's --compile=auto compiles (on a
    # CPU the training forward, and the static decode step of a long run: the benchmark's stands for one)
    assert names == expected
    assert ("skipping batched_bf16" in capsys.readouterr().out) == (not native_bf16)


@pytest.mark.parametrize("flags, message", [
    (["--configs=baseline,fast"], "--configs"),
    (["--num-samples=6", "--device-batch-size=4"], "multiple of --device-batch-size"),
    (["--early-stop-mean=0.5"], "--early-stop-mean"),
    (["--model-tag=d4"], "--source"),
    (["--dtype=float32"], "per configuration"),  # chat_rl's flag, but each config sets it
    (["--no-such-flag"], "unrecognized"),
])
def test_bad_flags_are_user_errors(flags, message):
    with pytest.raises(UserError, match=message):
        bench_rl.main(["--device-type=cpu"] + flags)


def test_early_stop_ends_rows_exactly_where_the_hash_fires(tiny_tokenizer):
    """A row must end at its first step whose (input token, position) hash fires and never before,
    whichever rows share its batch."""
    model = tiny_gpt()
    end = tiny_tokenizer.encode_special("<|assistant_end|>")
    wrapped = EarlyStopModel(model, end, mean_length=4)
    prompts = [tiny_tokenizer.encode("two plus", prepend="<|bos|>"), tiny_tokenizer.encode("seven", prepend="<|bos|>")]
    results = Engine(wrapped, tiny_tokenizer).generate_many(prompts, num_samples=6, max_tokens=20, temperature=1.0, seed=3)
    lengths = []
    for prompt, completions in zip(prompts, results):
        for c in completions:
            # decode step s >= 1 feeds token s - 1 at position len(prompt) + s - 1 (the prefill is never
            # stopped); a row cut at the cap never fed its last token
            inputs = c.tokens if c.ended else c.tokens[:-1]
            positions = torch.arange(len(prompt), len(prompt) + len(inputs))
            fires = wrapped.ends(torch.tensor(inputs), positions).tolist()
            if c.ended:
                assert fires[-1] and not any(fires[:-1])
            else:
                assert len(c.tokens) == 20 and not any(fires)
            lengths.append(len(c.tokens))
    assert min(lengths) < 20 and len(set(lengths)) > 2  # rows really end, at different lengths


def test_early_stop_wrapper_leaves_logits_alone_unless_it_fires(tiny_tokenizer):
    model = tiny_gpt()
    end = tiny_tokenizer.encode_special("<|assistant_end|>")
    idx = torch.randint(0, 300, (3, 10))
    never = EarlyStopModel(model, end, mean_length=2 ** 40)  # threshold 0: never fires
    always = EarlyStopModel(model, end, mean_length=1)
    assert torch.equal(always(idx), model(idx))  # training forwards are the model's

    def prefill_then_decode(m):
        """Logits of a 10-token prefill, then of one decode step, through a fresh cache."""
        cache = KVCache(3, 1, 16, 64, 1)
        return forward_cached(m, idx, cache), forward_cached(m, idx[:, :1], cache)

    prefill, decode = prefill_then_decode(model)
    never_prefill, never_decode = prefill_then_decode(never)
    assert torch.equal(never_prefill, prefill) and torch.equal(never_decode, decode)
    always_prefill, always_decode = prefill_then_decode(always)
    assert torch.equal(always_prefill, prefill)  # samples share the prefill: it is never stopped
    assert torch.all(always_decode[:, 0].argmax(-1) == end)
    others = torch.arange(decode.size(-1)) != end
    assert torch.equal(always_decode[..., others], decode[..., others])
    # mean length 1: every row ends at its first decode step, after the token sampled from the prefill
    prompt = tiny_tokenizer.encode("hi", prepend="<|bos|>")
    completions = Engine(always, tiny_tokenizer).generate_many([prompt], num_samples=3, max_tokens=5)[0]
    assert [(len(c.tokens), c.ended) for c in completions] == [(1, True)] * 3


def test_row_steps_count_the_terminal_token_only_before_the_cap():
    assert bench_measure.row_steps_of([1, 2], 8) == 3      # ended: two tokens then <|assistant_end|>
    assert bench_measure.row_steps_of([1] * 7, 8) == 8     # ended at the last step
    assert bench_measure.row_steps_of([1] * 8, 8) == 8     # cut at the cap


def test_peak_memory_is_reset_between_measurements():
    memory = machine.PeakMemory(torch.device("cpu"))
    assert memory.method.startswith("peak RSS")  # Linux: resettable
    start = memory.reset()
    block = torch.ones(64 * 2 ** 20, dtype=torch.uint8)  # 64 MB, every page touched
    high = memory.peak_mb()
    assert high >= start + 60
    del block
    memory.reset()
    assert memory.peak_mb() < high - 40


def test_machine_probes_measure_this_machine():
    cpu = torch.device("cpu")
    assert machine.memory_bandwidth(cpu, megabytes=8, reps=2) > 1e8  # bytes/s: any machine copies 100 MB/s
    assert machine.matmul_peak_flops(cpu, torch.float32, 64, reps=2, warmup=1) > 1e6
    info = machine.machine_info(cpu)
    assert info["torch"] == torch.__version__ and info["device"] == "cpu" and info["gpu"] is None
    load = machine.load_average()
    assert load is None or (len(load) == 3 and all(x >= 0 for x in load))
    t0 = machine.device_time(cpu)
    assert machine.device_time(cpu) >= t0


@pytest.mark.slow
def test_bf16_greedy_rollouts_follow_fp32_on_a_trained_model(one_step_sft, monkeypatch):
    """bf16 sampling (autocast + bf16 KV cache) against fp32, greedy, on a trained 2-layer model and 256 held-out
    one-step arithmetic questions. The property: bf16 only changes a greedy decision where fp32 itself had a
    near-tie, i.e. at each row's first difference the fp32 logits of the two choices are within BF16_NEAR_TIE.
    A trained model is needed: a random one has near-uniform logits, where any rounding flips the argmax.
    Measured on an AVX2 EPYC with the fixture stopped by its accuracy band (step 80): 252 of 256 rows identical,
    agreement 0.996, the 4 differences at fp32 margins 0.0003-0.072. (With the earlier 140-step fixture: 59 of 64
    identical, 5 differences at margins 0.0005-0.018, when only 6.7% of all fp32 greedy decisions had a top-2
    margin under 0.125.) 256 questions, so that some rows differ and the property has something to check."""
    from rl_toy_task import OneStepArithmetic

    from nanochat.checkpoints.loading import load_model
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(one_step_sft))
    model, tokenizer, _ = load_model("sft", torch.device("cpu"), phase="eval")
    task = OneStepArithmetic(split="test")
    prompts = [tokenizer.render_for_completion(task[i]) for i in range(256)]
    engine = Engine(model, tokenizer)  # both greedy decodes through the engine, the bf16 one with a bf16 KV cache
    fp32 = engine.generate_many(prompts, num_samples=1, max_tokens=64, temperature=0.0)
    with torch.amp.autocast(device_type="cpu", dtype=torch.bfloat16):
        bf16 = engine.generate_many(prompts, num_samples=1, max_tokens=64, temperature=0.0)
    ends = [tokenizer.encode_special(t) for t in ("<|assistant_end|>", "<|bos|>")]
    agreement = greedy_agreement(model, prompts, [a.tokens for a, in fp32], [b.tokens for b, in bf16], ends)
    assert agreement["rows"] == 256 and agreement["tokens"] > 256 * 10
    margins = agreement["fp32_margins_at_differences"]
    assert len(margins) == agreement["rows"] - agreement["identical_rows"]
    assert all(abs(m) <= BF16_NEAR_TIE for m in margins), agreement
    assert agreement["agreement"] >= BF16_MIN_AGREEMENT, agreement


def test_graph_configs_are_checked_against_the_static_step_and_static_ones_against_eager():
    """On a GPU only the same shapes are sure to round alike: a graph config's tokens are compared with the
    static config's (the shapes it replays), a static config's with eager's; without a static config, a graph
    one falls back to eager."""
    names = ["batched_bf16", "batched_bf16_static", "batched_bf16_graph"]
    digests = {"batched_bf16": "eager", "batched_bf16_static": "static", "batched_bf16_graph": "static",
               "batched_bf16+early": "e", "batched_bf16_static+early": "e", "batched_bf16_graph+early": "e"}
    results = {name: {"tokens_digest": digest} for name, digest in digests.items()}
    bench_results.mark_identical_tokens(results, [bench_configs.CONFIGS[n] for n in names])
    assert results["batched_bf16_graph"]["tokens_identical_to"] == ("batched_bf16_static", True)
    assert results["batched_bf16_static"]["tokens_identical_to"] == ("batched_bf16", False)
    assert results["batched_bf16_graph+early"]["tokens_identical_to"] == ("batched_bf16_static+early", True)
    assert "tokens_identical_to" not in results["batched_bf16"]
    del results["batched_bf16_static"], results["batched_bf16_static+early"]
    bench_results.mark_identical_tokens(results, [bench_configs.CONFIGS[n] for n in ("batched_bf16", "batched_bf16_graph")])
    assert results["batched_bf16_graph"]["tokens_identical_to"] == ("batched_bf16", False)


@pytest.mark.parametrize("flags", [["--teacher=sft", "--distill-coef=1"], ["--distill-coef=0.5"], ["--reward-coef=0"]])
def test_bench_rl_refuses_distillations_flags_before_it_measures(flags):
    """A benchmark's run loads no teacher: --teacher / --distill-coef / --reward-coef would fail at the first training
    pass, after the machine was measured (a traceback): refused in one line while the flags are read."""
    with pytest.raises(UserError, match=": bench_rl measures chat_rl's step without a distillation teacher$"):
        bench_rl.parse_args(flags)
