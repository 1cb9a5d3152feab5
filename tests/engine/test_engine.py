"""The engine: nanochat's sampling semantics, the calculator state machine, and the batched rollout API."""

import pytest
import torch
from helpers import ScriptedModel, prompt_of, random_model, tiny_config

from nanochat.engine.calculator import CALCULATOR_FORMATS, format_result
from nanochat.engine.engine import Engine
from nanochat.engine.rows import Row, SpecialIds
from nanochat.engine.spec import rollout_spec


@pytest.fixture(scope="module")
def tiny_model(tiny_tokenizer):
    config = tiny_config(sequence_len=64, vocab_size=tiny_tokenizer.get_vocab_size(), window_pattern="SL")
    return random_model(config)  # perturbed weights: greedy decoding is not trivial


def test_same_seed_same_output_and_different_seed_differs(tiny_model, tiny_tokenizer):
    engine = Engine(tiny_model, tiny_tokenizer)
    prompt = prompt_of(tiny_tokenizer, "How many apples?")
    a, _ = engine.generate_batch(prompt, num_samples=4, max_tokens=12, temperature=1.0, seed=3)
    b, _ = engine.generate_batch(prompt, num_samples=4, max_tokens=12, temperature=1.0, seed=3)
    c, _ = engine.generate_batch(prompt, num_samples=4, max_tokens=12, temperature=1.0, seed=4)
    assert a == b and a != c


def test_greedy_ignores_seed_and_matches_naive_generate(tiny_model, tiny_tokenizer):
    engine = Engine(tiny_model, tiny_tokenizer)
    prompt = prompt_of(tiny_tokenizer, "Natalia sold clips")
    r1, _ = engine.generate_batch(prompt, num_samples=2, max_tokens=16, temperature=0.0, seed=1)
    r2, _ = engine.generate_batch(prompt, num_samples=2, max_tokens=16, temperature=0.0, seed=99)
    assert r1 == r2 and r1[0] == r1[1]
    naive = []
    stops = {tiny_tokenizer.encode_special("<|assistant_end|>"), tiny_tokenizer.get_bos_token_id()}
    for token in tiny_model.generate(prompt, max_tokens=16, temperature=0.0):
        if token in stops:
            break
        naive.append(token)
    # the naive reference has no calculator, so compare only while no tool call has completed
    python_end = tiny_tokenizer.encode_special("<|python_end|>")
    assert python_end not in naive
    assert r1[0] == prompt + naive


def test_rows_first_tokens_differ(tiny_model, tiny_tokenizer):
    """Regression: nanochat once sampled one first token and broadcast it to every row."""
    engine = Engine(tiny_model, tiny_tokenizer)
    prompt = prompt_of(tiny_tokenizer, "What is 3 plus 4?")
    results, _ = engine.generate_batch(prompt, num_samples=16, max_tokens=1, temperature=1.0, top_k=None, seed=0)
    first_tokens = {r[len(prompt)] for r in results if len(r) > len(prompt)}
    assert len(first_tokens) > 1


def test_shapes_masks_and_max_tokens(tiny_model, tiny_tokenizer):
    engine = Engine(tiny_model, tiny_tokenizer)
    prompt = prompt_of(tiny_tokenizer, "Weng earns 12 an hour")
    results, masks = engine.generate_batch(prompt, num_samples=5, max_tokens=7, temperature=1.0, seed=0)
    assert len(results) == len(masks) == 5
    for r, m in zip(results, masks):
        assert r[:len(prompt)] == prompt and m[:len(prompt)] == [0] * len(prompt)
        assert len(r) == len(m) and len(r) - len(prompt) <= 7


def test_streaming_generate_matches_generate_batch(tiny_model, tiny_tokenizer):
    engine = Engine(tiny_model, tiny_tokenizer)
    prompt = prompt_of(tiny_tokenizer, "Betty is saving money")
    results, _ = engine.generate_batch(prompt, num_samples=3, max_tokens=10, temperature=1.0, seed=5)
    columns = list(engine.generate(prompt, num_samples=3, max_tokens=10, temperature=1.0, seed=5))
    stops = {tiny_tokenizer.encode_special("<|assistant_end|>"), tiny_tokenizer.get_bos_token_id()}
    for row in range(3):
        streamed = []
        for column, _ in columns:
            if column[row] in stops:
                break
            streamed.append(column[row])
        assert prompt + streamed == results[row]


def test_tool_call_forces_calculator_output(tiny_tokenizer):
    tok = tiny_tokenizer
    sp = {name: tok.encode_special(f"<|{name}|>") for name in
          ("python_start", "python_end", "output_start", "output_end", "assistant_end")}
    prompt = prompt_of(tok, "add")
    expr = tok.encode("12+30")
    filler = tok.encode("x")[0]
    after = tok.encode(" done")
    # positions where the engine forces <|output_start|> 42 <|output_end|> hold filler in the script
    forced = [sp["output_start"], *tok.encode("42"), sp["output_end"]]
    script = [sp["python_start"], *expr, sp["python_end"]] + [filler] * len(forced) + after + [sp["assistant_end"]]
    model = ScriptedModel(script, len(prompt), tok.get_vocab_size())
    engine = Engine(model, tok)
    results, masks = engine.generate_batch(prompt, num_samples=2, max_tokens=50, temperature=1.0, seed=0)
    expected = [sp["python_start"], *expr, sp["python_end"], *forced, *after]
    for r, m in zip(results, masks):
        assert r[len(prompt):] == expected  # terminal <|assistant_end|> excluded
        gen_mask = m[len(prompt):]
        assert gen_mask == [1] * (len(expr) + 2) + [0] * len(forced) + [1] * len(after)
    completion = engine.generate_many([prompt], num_samples=1, max_tokens=50, temperature=1.0)[0][0]
    assert completion.ended and completion.tool_calls == 1 and completion.tool_successes == 1


def test_failed_tool_call_forces_nothing(tiny_tokenizer):
    tok = tiny_tokenizer
    ps, pe, end = (tok.encode_special(s) for s in ("<|python_start|>", "<|python_end|>", "<|assistant_end|>"))
    prompt = prompt_of(tok, "bad")
    script = [ps, *tok.encode("1/0"), pe, *tok.encode("ok"), end]
    model = ScriptedModel(script, len(prompt), tok.get_vocab_size())
    c = Engine(model, tok).generate_many([prompt], num_samples=1, max_tokens=50)[0][0]
    assert c.tokens == script[:-1] and c.masks == [1] * (len(script) - 1)
    assert c.tool_calls == 1 and c.tool_successes == 0


@pytest.mark.parametrize("stop", ["<|assistant_end|>", "<|bos|>"])
def test_rows_stop_at_terminal_tokens(tiny_tokenizer, stop):
    tok = tiny_tokenizer
    stop_id = tok.encode_special(stop)
    prompt = prompt_of(tok, "stop")
    body = tok.encode("abc")
    model = ScriptedModel(body + [stop_id] + tok.encode("zzz"), len(prompt), tok.get_vocab_size())
    c = Engine(model, tok).generate_many([prompt], num_samples=3, max_tokens=30)[0]
    assert all(x.tokens == body and x.ended for x in c)


def test_finished_rows_cost_no_compute(tiny_tokenizer):
    """Rows that end early leave the batch: decoded row-steps equal each row's own steps, not rows x longest."""
    tok = tiny_tokenizer
    end = tok.encode_special("<|assistant_end|>")
    prompts = [prompt_of(tok, q) for q in ("one", "two words", "three more words")]
    script = tok.encode("a b c d e f g h i j k l m n o p q r s t u v w x y z") * 2
    model = ScriptedModel(script, 0, tok.get_vocab_size(), stop_token=end, stop_logit=-2.0)  # P(stop) ~ 12% per step
    engine = Engine(model, tok, rollout_spec(model, max_rows=8))
    results = engine.generate_many(prompts, num_samples=6, max_tokens=40, temperature=1.0, seed=1)
    rows = [c for per_prompt in results for c in per_prompt]
    emitted = [len(c.tokens) + int(c.ended) for c in rows]
    stats = engine.last_stats
    assert min(emitted) < max(emitted)  # lengths really differ
    assert stats.row_steps == sum(e - 1 for e in emitted)  # first token comes from the prefill
    assert stats.prefill_tokens == sum(len(p) for p in prompts)  # each prompt prefilled once
    assert stats.max_batch_rows <= 8


def test_batched_greedy_equals_one_prompt_calls(tiny_model, tiny_tokenizer):
    engine = Engine(tiny_model, tiny_tokenizer)
    questions = ["How many?", "Janet's ducks lay 16 eggs per day", "A robe takes 2 bolts", "x", "Tom has 3 cats"]
    prompts = [prompt_of(tiny_tokenizer, q) for q in questions]
    batched = engine.generate_many(prompts, num_samples=2, max_tokens=20, temperature=0.0, max_rows=7)
    for prompt, completions in zip(prompts, batched):
        single, single_masks = engine.generate_batch(prompt, num_samples=2, max_tokens=20, temperature=0.0)
        assert [prompt + c.tokens for c in completions] == single
        assert [[0] * len(prompt) + c.masks for c in completions] == single_masks


def test_sampled_outputs_do_not_depend_on_batch_grouping(tiny_model, tiny_tokenizer):
    engine = Engine(tiny_model, tiny_tokenizer)
    prompts = [prompt_of(tiny_tokenizer, q) for q in ["a b", "Natalia sold 48 clips", "c", "Weng earns"]]
    runs = []
    for max_rows in (1, 3, 5, 64):
        out = engine.generate_many(prompts, num_samples=4, max_tokens=15, temperature=1.0, top_k=20,
                                   seeds=[11, 12, 13, 14], max_rows=max_rows)
        runs.append([[(c.tokens, c.masks) for c in per] for per in out])
    assert all(r == runs[0] for r in runs[1:])
    # and a prompt's samples are the same when it is rolled out alone
    alone = engine.generate_many(prompts[1:2], num_samples=4, max_tokens=15, temperature=1.0, top_k=20, seeds=[12])
    assert [(c.tokens, c.masks) for c in alone[0]] == runs[0][1]


def test_progress_reports_every_finished_row(tiny_model, tiny_tokenizer):
    engine = Engine(tiny_model, tiny_tokenizer)
    prompts = [prompt_of(tiny_tokenizer, q) for q in ("a", "bb", "ccc")]
    counts = []
    engine.generate_many(prompts, num_samples=3, max_tokens=6, temperature=1.0, max_rows=4, progress=counts.append)
    assert sum(counts) == 9 and all(c > 0 for c in counts)


@pytest.mark.parametrize("generation", ["jan2026", "smear"])
def test_shared_prompt_cache_gives_the_tokens_of_per_row_copies(tiny_tokenizer, generation, monkeypatch):
    """A prompt's keys stored once for all its rows (the default) against a copy per row (nanochat's way):
    the same greedy tokens, and the same sampled tokens from the same per-row seeds, with rows recycled
    mid-run (max_rows below the row count), prompts longer than the short window, and the completion
    storage growing (from 4 positions) while rows decode."""
    from nanochat.engine.shared_prompt_cache import SharedPromptKVCache
    monkeypatch.setattr(SharedPromptKVCache, "INITIAL_SUFFIX_CAPACITY", 4)
    config = tiny_config(sequence_len=64, vocab_size=tiny_tokenizer.get_vocab_size(), window_pattern="SL")
    model = random_model(config, generation=generation)
    questions = ["a b", "Natalia sold 48 clips to her friends in April and then half as many in May", "c", "Weng"]
    prompts = [prompt_of(tiny_tokenizer, q) for q in questions]
    assert max(len(p) for p in prompts) > 32  # past the short window
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, top_k=20)):
        outs = []
        for share in (True, False):
            engine = Engine(model, tiny_tokenizer, rollout_spec(model, share_prompts=share))
            out = engine.generate_many(prompts, num_samples=3, max_tokens=24, seeds=[5, 6, 7, 8], max_rows=5, **sampling)
            outs.append([[(c.tokens, c.masks) for c in per] for per in out])
        assert outs[0] == outs[1]


def test_shared_prompts_fit_more_rows(tiny_model, tiny_tokenizer):
    """In the same memory budget a prompt stored once leaves room for more rows."""
    shared = Engine(tiny_model, tiny_tokenizer, rollout_spec(tiny_model, memory_budget_gb=0.01))
    copies = Engine(tiny_model, tiny_tokenizer, rollout_spec(tiny_model, memory_budget_gb=0.01, share_prompts=False))
    rows = [e.memory.rows_for_budget(prompt_len=200, max_tokens=100, dtype=torch.float32,
                                     num_samples=16) for e in (shared, copies)]
    assert rows[0] > 2 * rows[1]


def test_row_runs_the_tool_state_machine(tiny_tokenizer):
    """Row alone, fed tokens by hand: a completed <|python_start|> expr <|python_end|> queues <|output_start|>
    value <|output_end|>, emitted with mask 0 in place of whatever is sampled (even a terminal token); a
    <|python_end|> outside a call is plain text; a failed call forces nothing; <|assistant_end|> ends the row
    and is not kept; max_tokens ends it without `ended`."""
    tok = tiny_tokenizer
    sp = SpecialIds(tok)
    row = Row(request=3, sample=1, max_tokens=100, special=sp, tokenizer=tok)
    x = tok.encode("x")[0]
    call = [sp.python_end, sp.python_start, *tok.encode("6*7"), sp.python_end]
    assert [row.feed(t) for t in call] == [(t, 1) for t in call]
    forced = [sp.output_start, *tok.encode("42"), sp.output_end]
    sampled = [sp.assistant_end] + [x] * (len(forced) - 1)
    assert [row.feed(t) for t in sampled] == [(t, 0) for t in forced] and not row.finished
    failed = [x, sp.python_start, *tok.encode("1/0"), sp.python_end, x]
    assert [row.feed(t) for t in failed] == [(t, 1) for t in failed]
    assert row.feed(sp.assistant_end) == (sp.assistant_end, 1) and row.finished
    c = row.out
    assert c.tokens == call + forced + failed and c.masks == [1] * len(call) + [0] * len(forced) + [1] * len(failed)
    assert c.ended and c.tool_calls == 2 and c.tool_successes == 1
    short = Row(request=0, sample=0, max_tokens=2, special=sp, tokenizer=tok)
    short.feed(x)
    assert not short.finished
    short.feed(x)
    assert short.finished and not short.out.ended and short.out.tokens == [x, x]


def test_a_row_leaves_its_tool_call_at_python_end(tiny_tokenizer):
    """After a call's <|python_end|> the row is out of the call: what follows, the forced output and the text after
    it, is no expression, and a later <|python_end|> without its own <|python_start|> is plain text. A row that
    stayed in its call ran the calculator again on everything since the first call's start, a call the model never
    made (counted, and its output forced into the completion where it succeeded)."""
    tok = tiny_tokenizer
    sp = SpecialIds(tok)
    row = Row(request=0, sample=0, max_tokens=100, special=sp, tokenizer=tok)
    x = tok.encode("x")[0]
    for t in [sp.python_start, *tok.encode("2+3"), sp.python_end]:
        row.feed(t)
    forced = [sp.output_start, *tok.encode("5"), sp.output_end]
    assert [row.feed(x) for _ in forced] == [(t, 0) for t in forced]
    after = [*tok.encode("2+3"), sp.python_end, x, x]
    assert [row.feed(t) for t in after] == [(t, 1) for t in after]  # plain text: nothing forced
    assert (row.out.tool_calls, row.out.tool_successes) == (1, 1)


def test_the_kv_cache_takes_the_models_compute_dtype_not_its_stored_embeddings():
    """Issue 35: a nanochat CUDA checkpoint stores its embeddings in bf16; a cache for an fp32 model (fp32 matmul
    weights) is fp32 whatever the first parameter's dtype, and the smear state keeps the embeddings' dtype."""
    from nanochat.engine.kv_cache import KVCache, cache_geometry
    model = random_model(tiny_config(n_layer=2), generation="smear")
    model.transformer.wte.to(torch.bfloat16)
    geometry = cache_geometry(model)
    assert geometry.dtype == torch.float32 and geometry.smear_dtype == torch.bfloat16
    cache = KVCache.for_model(model, 2, 8)
    assert cache.dtype == torch.float32 and cache.prev_embedding.dtype == torch.bfloat16
    assert geometry.bytes_per_token(torch.bfloat16) == 2 * 2 * geometry.n_kv_head * geometry.head_dim * 2


def test_the_calculator_format_writes_integral_floats_as_nanochat_or_as_ints(tiny_tokenizer):
    """--calculator-format: "str" (nanochat's) writes 10/2 as 5.0, "int" as 5 (GSM8K's SFT data writes 5; nanochat
    PR #786); only an exact integral float loses its .0: 1e20 (beyond 2**53) stays 1e+20, 2.5 and ints as str."""
    assert [format_result(v, "int") for v in (10.0, -4.0, 2.5, 7, 2.0 ** 53 - 1, 2.0 ** 53, 1e20, float("inf"))] == [
        "10", "-4", "2.5", "7", "9007199254740991", "9007199254740992.0", "1e+20", "inf"]
    assert [format_result(v) for v in (10.0, 2.5, 7, 1e20)] == ["10.0", "2.5", "7", "1e+20"]  # str(), as nanochat
    tok = tiny_tokenizer
    sp = SpecialIds(tok)
    forced = {}
    for style in CALCULATOR_FORMATS:
        row = Row(request=0, sample=0, max_tokens=100, special=sp, tokenizer=tok, calculator_format=style)
        for t in [sp.python_start, *tok.encode("10/2"), sp.python_end]:
            row.feed(t)
        forced[style] = tok.decode([row.feed(sp.assistant_end)[0] for _ in range(len(row.forced))])
    assert forced == {"str": "<|output_start|>5.0<|output_end|>", "int": "<|output_start|>5<|output_end|>"}
    with pytest.raises(ValueError, match="calculator_format must be one of str, int, got 'float'"):
        rollout_spec(random_model(tiny_config()), calculator_format="float")


def _sampled(engine, prompts):
    out = engine.generate_many(prompts, num_samples=3, max_tokens=10, temperature=1.0, top_k=20, seeds=[5, 6])
    return [[(c.tokens, c.masks, c.logprobs) for c in per] for per in out]


def test_an_engine_of_a_dtype_decodes_in_it_whatever_its_callers_autocast(tiny_model, tiny_tokenizer):
    """An engine whose spec names a dtype (a chat_rl run's: --rollout-dtype) decodes in it on its own: bitwise the
    rollouts of an engine without one under its caller's autocast to that dtype, and in float32 whatever autocast
    its caller runs under; without one it takes its caller's (nanochat's Engine)."""
    prompts = [prompt_of(tiny_tokenizer, q) for q in ["Natalia sold 48 clips", "Weng earns"]]
    fp32 = _sampled(Engine(tiny_model, tiny_tokenizer), prompts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = _sampled(Engine(tiny_model, tiny_tokenizer), prompts)
        assert _sampled(Engine(tiny_model, tiny_tokenizer, rollout_spec(tiny_model, dtype="float32")), prompts) == fp32
    assert bf16 != fp32  # the two precisions are told apart
    assert _sampled(Engine(tiny_model, tiny_tokenizer, rollout_spec(tiny_model, dtype="bfloat16")), prompts) == bf16


def test_the_engines_dtype_does_not_reach_its_caller_between_steps(tiny_model, tiny_tokenizer):
    """The engine enters its dtype's autocast for each decode step and leaves it before yielding (generate streams
    its steps to the caller): the caller's code between steps runs under its own autocast, not the engine's."""
    engine = Engine(tiny_model, tiny_tokenizer, rollout_spec(tiny_model, dtype="bfloat16"))
    seen = [torch.is_autocast_enabled("cpu") for _ in engine.generate(prompt_of(tiny_tokenizer, "a b"), num_samples=2,
                                                                      max_tokens=6, seed=1)]
    assert seen and not any(seen)


def test_a_rollout_spec_refuses_a_dtype_it_cannot_decode_in():
    from nanochat.engine.spec import RolloutSpec
    with pytest.raises(ValueError, match="rollout dtype must be one of"):
        RolloutSpec(dtype="bf16")
