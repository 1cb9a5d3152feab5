"""
bench_rl's results, once every configuration is measured (bench_measure.py): whether a config sampled its twin's tokens
(mark_identical_tokens), each run against its variant's baseline (add_ratios), and the tables it prints (TABLES,
results_text; no_signal_text for no_signal_table's rows).
"""

from nanochat.diagnostics.bench_configs import CONFIGS
from nanochat.report import text_table


def mark_identical_tokens(results, configs):
    """Whether a config's tokens equal its twin's, if run: a *_nolag one's lagging, a *_flex one's hand-written
    attention's, a compiled one's uncompiled (a GPU's near-tie may fall otherwise), a graph one's static (same shapes,
    same kernels), else eager's; a static one's eager's."""
    names = {c.name for c in configs}
    for name, r in results.items():
        base, _, suffix = name.partition("+")
        twins = ([base.removesuffix("_nolag")] if CONFIGS[base].lag is not None else
                 [base.removesuffix("_flex").removesuffix("_triton")] if CONFIGS[base].decode_kernels != "torch" else
                 [base.removesuffix("_compiled").removesuffix("_blocks")] if CONFIGS[base].compiled or CONFIGS[base].blocks else
                 [base.replace("_graph", "_static"), base.replace("_graph", "")] if "_graph" in base else
                 [base.replace("_static", "")] if "_static" in base else None)
        if twins is not None:
            twin = next((t + ("+" + suffix if suffix else "") for t in twins if t in names), None)
            other = results.get(twin)
            r["tokens_identical_to"] = (twin, other["tokens_digest"] == r["tokens_digest"]) if other else None


def add_ratios(results):
    """Each run against its variant's baseline: throughput ratios, step speedup (None: the baseline did no such work)."""
    for name, r in results.items():
        if (base := results.get("baseline" + ("+early" if name.endswith("+early") else ""))) is not None:
            for key, a, b in (("rollout_tokens_per_s_x", r["rollout_tokens_per_s"], base["rollout_tokens_per_s"]),
                              ("train_tokens_per_s_x", r["train_tokens_per_s"], base["train_tokens_per_s"]),
                              ("step_speedup_x", base["step_seconds"], r["step_seconds"])):
                r[key] = a / b if b > 0 else None


TABLES = [
    [("roll tok/s", "rollout_tokens_per_s", ".1f"), ("x", "rollout_tokens_per_s_x", ".2f"),
     ("train tok/s", "train_tokens_per_s", ".1f"), ("x", "train_tokens_per_s_x", ".2f"), ("roll MFU", "rollout_mfu", ".2%"),
     ("train MFU", "train_mfu", ".2%"), ("step s", "step_seconds", ".2f"), ("speedup", "step_speedup_x", ".2f"),
     ("peak MB", "peak_memory_mb", ".0f")],
    [("tokens", "rollout_tokens", "d"), ("rows", "rows", "d"), ("row_steps", "row_steps", "d"),
     ("rows x longest", "rows_x_longest", "d"), ("rollout s", "rollout_seconds", ".2f"), ("train s", "train_seconds", ".2f"),
     ("optim s", "optimizer_seconds", ".2f"), ("trained", "rows_trained", "d"), ("skipped", "rows_skipped", "d"),
     ("KV B/token", "kv_bytes_per_decoded_token", ".0f")],
    [("decode ms/step", "decode_ms_per_step", ".2f"), ("MB/step", lambda r: r["bytes_per_decode_step"] / 2 ** 20, ".1f"),
     ("bound ms", "bandwidth_bound_ms", ".3f"), ("x bound", "decode_x_bound", ".1f"),
     ("rollout s first..last", lambda r: f"{r['rollout_seconds_each'][0]:.2f}..{r['rollout_seconds_each'][-1]:.2f}", ""),
     ("captures", lambda r: "/".join(map(str, r["captures_each"])), ""),
     ("ops/kernels (compiled)", lambda r: r["decode_step_ops"] and f"{r['decode_step_ops']}/{r['decode_step_kernels']}" + (
         "" if (k := r["decode_step_compiled_kernels"]) is None else f" ({k['generated']}+{k['library']})"), ""),  # launches
     # the sampler-trainer gap of the trained tokens (none trained: nothing measured)
     ("gap mean/max", lambda r: f"{r['sampler_gap_mean']:.1e}/{r['sampler_gap_max']:.1e}" if r["sampler_tokens"] else None, ""),
     ("tokens", lambda r: f"{'=' if t[1] else 'DIFFER from'} {t[0]}" if (t := r.get("tokens_identical_to")) else "", "")]]


def results_text(results):
    """TABLES of the results, one row a run (no row trained: no training speed shown)."""
    untrained = dict.fromkeys(("train_tokens_per_s", "train_tokens_per_s_x", "train_mfu"))  # no speed: no row trained
    shown = {name: r if r["rows_trained"] else {**r, **untrained} for name, r in results.items()}
    return "\n\n".join(text_table(shown.items(), columns) for columns in TABLES)


def no_signal_text(skipping):
    """no_signal_table's rows as a table, one row a fraction silenced."""
    return text_table([(f"{r['no_signal_fraction']:.2f}", r) for r in skipping], [
        ("rows trained", "skip_rows_trained", "d"), ("train s (skip)", "skip_seconds", ".2f"),
        ("x of first", lambda r: r["skip_seconds"] / skipping[0]["skip_seconds"], ".2f"),
        ("train s (all rows)", "all_rows_seconds", ".2f")], first="no-signal")
