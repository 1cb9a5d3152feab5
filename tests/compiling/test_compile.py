"""torch.compile of the static decode step and of the training forward (issue 36), on the CPU with Inductor.

Compiled decoding samples the eager engine's tokens on every generation fixture; greedy, on a trained model and 256
questions, it parts from the eager static step only at near-ties of the fp32 logits, in fp32 (here it is
identical) and in bf16; a rollout compiles each bucketed shape once and the next rollout none; the function
compiled is the one proven free of host reads on the meta device, and the graph Dynamo captures from it runs there
too. The compiled training forward gives the eager objective and gradient within fp32 rounding on every generation
fixture, prompts shared and zero-advantage rows skipped (bound derived as tests/rl/test_rl_sharing.py derives its
own). Where compiling fails, one warning and the eager result; with --compile=on, a one-line error. chat_rl
--compile=on reproduces the golden trace. chat_sft compiled trains as the eager run does, and chat_eval compiled
samples the eager run's tokens; which parts each script compiles (compile_plan) on a CPU and on CUDA.

Compiling is slow on a CPU (a cold Inductor cache: ~10 s a decode graph, ~50 s a training graph, forward and
backward): Inductor compiles where its code is what is checked (smear's decode step and training pass, the trained
model's fp32 and bf16 decode steps, chat_sft's forward); elsewhere (the other generations, the scripts' wiring) the
function is traced whole by Dynamo and run as traced (INDUCTOR_GENERATIONS says why). The compiled functions are
the process's (nanochat.compiling.functions.compiled), so the tests share their graphs (head computes smear's forward and
compiles nothing anew), each test keeps to one or a few shapes, and the fp32 greedy rollouts serve three tests."""

import io
import json
import re
import warnings
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from helpers import (BF16_MIN_AGREEMENT, BF16_NEAR_TIE, FP32_GAP_BOUND, FP32_NEAR_TIE, HAS_CUDA, generation_reference,
                     install_generation, prompt_of, random_model, tiny_config)
from test_generations import FIXTURE_NAMES
from test_rl_sharing import gradients, question, term_sizes
from test_static_decode import ENDING_KWARGS, ENDING_PROMPTS, DeviceOnly, ending_model, logprobs, rollouts

from nanochat.checkpoints.loading import build_model, load_model
from nanochat.cli import error_line
from greedy_agreement import greedy_agreement
from nanochat.compiling import functions as nc_functions, plan as nc_plan
from nanochat.compiling.functions import (RECOMPILE_LIMIT, CompileFailed, CompiledFunction, compile_totals, compiled,
                                          generated_kernels)
from nanochat.compiling.plan import (CPU_DECODE_MIN_STEPS, CPU_MIN_STEPS, SFT_CPU_MIN_STEPS, compile_plan,
                                     resolve_compile)
from nanochat.diagnostics.op_count import count_decode_step_ops
from nanochat.engine.cuda_graphs import DecodePlan, GraphedStep, bucket_shapes, bucketed_shape, decode_plan
from nanochat.engine.decode_batch import DecodeBatch, RolloutStats, static_step
from nanochat.engine.decode_weights import DecodeWeights
from nanochat.engine.engine import STATIC_STEP_DYNAMIC, Engine, make_batch
from nanochat.engine.scheduler import BatchShape
from nanochat.engine.shared_prompt_cache import SharedPromptKVCache
from nanochat.engine.spec import rollout_spec, run_decode_mode
from nanochat.model.gpt import GPT
from nanochat.rl import plan as rl_plan, policy_gradient, progress as rl_progress
from nanochat.rl.objective import pass_denominators
from nanochat.rl.policy_gradient import chunk_logprobs


@pytest.fixture(scope="module", autouse=True)
def no_pretend_cuda():
    """Dynamo saves and restores the CUDA random state around a compile wherever torch.cuda says it is there:
    the session's pretend CUDA (tests/conftest.py) must say what this machine has, from the module fixtures on."""
    with pytest.MonkeyPatch.context() as mp:
        if not HAS_CUDA:
            mp.setattr(torch.cuda, "is_available", lambda: False)
            mp.setattr(torch.cuda, "device_count", lambda: 0)
        yield


def completions(engine, prompts, **kwargs):
    """Per prompt, per sample: (tokens, masks, ended), and separately the two recorded log-probabilities."""
    out = engine.generate_many(prompts, **kwargs)
    tokens = [[(c.tokens, c.masks, c.ended) for c in per] for per in out]
    logprobs = [x for per in out for c in per for x in c.logprobs + c.sampling_logprobs if x == x]
    return tokens, torch.tensor(logprobs)


# Inductor's code generation costs ~40 s a direction of a training graph and ~10 s a decode graph on a 2-core CPU;
# Dynamo's and AOTAutograd's tracing ~15 s more (most of test_compile's time, issue 45). Inductor compiles the
# generation whose forward has every feature of the others (smear: lambdas, sliding windows, value embeddings, smear,
# backout, the q/k scale; head computes the same forward and compiles nothing anew); chat_sft's compiled test (its
# forward) and the trained model's tests (its decode step) run Inductor on jan2026's layout. Every other generation
# is traced whole by Dynamo (fullgraph, shapes dynamic as in a run: the graph breaks and guards a generation's
# Python could cause) and its graph run as traced, by ATen's kernels (Dynamo's own "eager" backend): whether each
# generation's forward compiles to one graph that computes what eager computes is asked of each; how Inductor lowers
# and fuses the operations they share, of smear.
INDUCTOR_GENERATIONS = ("smear", "head")


def graph_as_traced(graph_module, example_inputs):
    """A graph compiler that keeps Dynamo's graph as it is (what the "eager" backend does)."""
    return graph_module.forward


def compiled_for(name, fn, dynamic, monkeypatch):
    """The process's CompiledFunction of `fn` for an Inductor generation; for the others one traced by Dynamo only,
    put in the process's place (`compiled` returns it, the engine included) for this test."""
    if name in INDUCTOR_GENERATIONS:
        return compiled(fn, dynamic)
    traced = CompiledFunction(fn, dynamic, graph_compiler=graph_as_traced)
    monkeypatch.setitem(nc_functions._COMPILED, (fn, dynamic), traced)
    return traced


@pytest.mark.slow
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_compiled_decode_samples_the_eager_tokens_on_generation_fixtures(name, tmp_path, monkeypatch):
    """fp32 rollouts (T=1, top-k 50, the second prompt's rows admitted into the slots the first's freed) of each of
    nanochat's fixture checkpoints: the static step compiled (by Inductor on INDUCTOR_GENERATIONS, traced whole
    elsewhere) samples exactly the eager engine's tokens; the recorded log-probabilities agree within FP32_GAP_BOUND
    (Inductor sums the log-sum-exp over the vocabulary in its own order: measured <= 1e-6). Two rows at a time, and with these seeds no row ends before its 16 tokens
    (measured on every fixture): one bucketed shape, one graph per generation; rows that end early and the smaller
    buckets they leave are tested on the trained model below."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    model, tokenizer, _ = build_model(str(install_generation(tmp_path, name)), 5, "cpu", "eval")
    prompts = [prompt_of(tokenizer, q) for q in ("What is 12 times 7?", "Hi")]
    kwargs = dict(num_samples=2, max_tokens=16, temperature=1.0, top_k=50, seeds=[1, 2], max_rows=2)
    eager, eager_lp = completions(Engine(model, tokenizer, rollout_spec(model, decode="eager")), prompts, **kwargs)
    step = compiled_for(name, static_step, STATIC_STEP_DYNAMIC, monkeypatch)
    engine = Engine(model, tokenizer, rollout_spec(model, decode="static", compile="on"))
    fast, fast_lp = completions(engine, prompts, **kwargs)
    assert engine.step.func is step and step.compiles >= 1 and step.failed is None  # it did run compiled
    assert fast == eager
    assert eager_lp.numel() >= 64 and (fast_lp - eager_lp).abs().max() <= FP32_GAP_BOUND


# ----------------------------------------------------------------------------- greedy: near-ties

# greedy, at most 3 rows (buckets of 3 and 2 rows: 2 at least) of at most 32 tokens (one key bucket): 2 graphs a dtype
GREEDY = dict(num_samples=1, max_tokens=32, temperature=0.0, max_rows=3)


@pytest.fixture(scope="module")
def arithmetic(one_step_sft):
    """conftest's trained 2-layer model (a random one has near-uniform logits, where any rounding flips the argmax),
    its tokenizer, and the prompts of 256 held-out one-step arithmetic questions."""
    from rl_toy_task import OneStepArithmetic
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(one_step_sft))
        model, tokenizer, _ = load_model("sft", torch.device("cpu"), phase="eval")
    task = OneStepArithmetic(split="test")
    return SimpleNamespace(model=model, tokenizer=tokenizer,
                           prompts=[tokenizer.render_for_completion(task[i]) for i in range(256)])


def agreement_of(arithmetic, prompts, reference, other):
    """nanochat/engine/agreement.py's greedy_agreement of two engines' greedy rollouts (generate_many's lists)."""
    ends = [arithmetic.tokenizer.encode_special(t) for t in ("<|assistant_end|>", "<|bos|>")]
    return greedy_agreement(arithmetic.model, prompts, [c.tokens for c, in reference], [c.tokens for c, in other], ends)


@pytest.fixture(scope="module")
def greedy_fp32(arithmetic):
    """The 256 questions' greedy fp32 rollouts by the eager static step and by the compiled one, with the compiled
    engine (its batch kept for the next rollout), the (rows, keys) of each of its steps and the graphs it compiled."""
    model, tokenizer, prompts = arithmetic.model, arithmetic.tokenizer, arithmetic.prompts
    eager = Engine(model, tokenizer, rollout_spec(model, decode="static")).generate_many(prompts, **GREEDY)
    engine = Engine(model, tokenizer, rollout_spec(model, decode="static", compile="on"))
    step, shapes = engine.step, []
    engine.step = lambda batch, rows, keys: (shapes.append((rows, keys)), step(batch, rows, keys))
    before, graphs_before = compile_totals()[0], len(generated_kernels(static_step, STATIC_STEP_DYNAMIC))
    fast = engine.generate_many(prompts, **GREEDY)
    return SimpleNamespace(eager=eager, fast=fast, engine=engine, shapes=shapes, compiles=compile_totals()[0] - before,
                           kernels=generated_kernels(static_step, STATIC_STEP_DYNAMIC)[graphs_before:])


@pytest.mark.slow
def test_compiled_greedy_decode_parts_from_eager_only_at_fp32_near_ties(arithmetic, greedy_fp32):
    """Greedy fp32 rollouts (static step, at most 3 rows of 32 tokens) of the 256 questions, compiled against
    eager: at each row's first difference the fp32 logits of the two choices are within FP32_NEAR_TIE (3.1e-5,
    helpers.py derives it), and before it the two log-probabilities of each token within FP32_GAP_BOUND (the
    bound's premise). Measured on a Xeon with AMX: all 256 rows identical (6,534 tokens), log-probabilities within
    2.4e-6 (80% equal), and no fp32 decision of the eager rollout with a top-2 margin under 1e-3 (the least is
    1.4e-3; 138 of 6,764 decisions, 2%, are under bf16's bound): a difference here is a fault, not rounding."""
    agreement = agreement_of(arithmetic, arithmetic.prompts, greedy_fp32.eager, greedy_fp32.fast)
    assert agreement["rows"] == 256 and agreement["tokens"] > 256 * 20
    assert all(abs(m) <= FP32_NEAR_TIE for m in agreement["fp32_margins_at_differences"]), agreement
    gaps = [abs(x - y) for (a,), (b,) in zip(greedy_fp32.eager, greedy_fp32.fast)
            for t, u, x, y in zip(a.tokens, b.tokens, a.logprobs, b.logprobs) if t == u and x == x]
    assert len(gaps) > 256 * 15 and max(gaps) <= FP32_GAP_BOUND


@pytest.mark.slow
def test_compiled_bf16_greedy_decode_parts_from_eager_bf16_only_at_near_ties(arithmetic):
    """The engine's bf16 rollouts (autocast, bf16 matmul weights and KV cache), greedy, static step compiled against
    eager, on the 256 questions: at each row's first difference the fp32 logits of the two choices are within
    BF16_NEAR_TIE, as test_bench.py's bf16-against-fp32 test requires (each bf16 path is within bf16 rounding of
    fp32, so two of them swap only what fp32 nearly tied). Inductor rounds to bf16 at other points than eager
    autocast does: the log-probabilities of the tokens both chose differ by up to 0.057. Measured on a Xeon with
    AMX: 252 of 256 rows identical, 99.6% of 6,526 tokens before a row's first difference, the 4 differences at
    fp32 margins 0.0035 to 0.055."""
    model, tokenizer, prompts = arithmetic.model, arithmetic.tokenizer, arithmetic.prompts
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = Engine(model, tokenizer, rollout_spec(model, decode="static")).generate_many(prompts, **GREEDY)
        fast = Engine(model, tokenizer, rollout_spec(model, decode="static", compile="on"))
        fast = fast.generate_many(prompts, **GREEDY)
    agreement = agreement_of(arithmetic, prompts, eager, fast)
    assert agreement["rows"] == 256 and agreement["tokens"] > 256 * 20
    margins = agreement["fp32_margins_at_differences"]
    assert len(margins) == agreement["rows"] - agreement["identical_rows"]
    assert all(abs(m) <= BF16_NEAR_TIE for m in margins), agreement
    assert agreement["agreement"] >= BF16_MIN_AGREEMENT, agreement


def test_a_rollout_compiles_a_few_graphs_and_the_next_rollout_none(arithmetic, greedy_fp32):
    """The greedy fp32 rollout's rows end at varied steps and run two row buckets (2 rows at least: Dynamo specializes
    a size of 1, which cost a graph of its own), and the step is compiled with dynamic shapes: at most 2 graphs serve
    them all (measured 2 here: the first step's, of all the batch's rows, comes back from Inductor with a guard that
    the row count is the batch's, and the next shape compiles the same graph again, from Inductor's cache in 0.1 s),
    not one per shape, nor one
    per step (as a guard that changed from one step to the next would make it: a Python value, a new tensor).
    After the weights change in place (as an optimizer step changes them), the next rollout on the kept batch
    compiles no graph at all, and decodes what a fresh eager engine decodes on the updated weights (identical but
    at fp32 near-ties), which is not what it decoded before."""
    model, tokenizer, prompts = arithmetic.model, arithmetic.tokenizer, arithmetic.prompts[:32]
    shapes, engine = set(greedy_fp32.shapes), greedy_fp32.engine
    assert {rows for rows, _ in shapes} == {2, 3} and 1 <= greedy_fp32.compiles <= 2, (shapes, greedy_fp32.compiles)
    kept, weights = engine.memory.kept_batch, {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.1)
        before = compile_totals()[0]
        again = engine.generate_many(prompts, **GREEDY)
        assert compile_totals()[0] == before and engine.memory.kept_batch is kept is not None
        eager = Engine(model, tokenizer, rollout_spec(model, decode="static")).generate_many(prompts, **GREEDY)
        agreement = agreement_of(arithmetic, prompts, eager, again)
        assert all(abs(m) <= FP32_NEAR_TIE for m in agreement["fp32_margins_at_differences"]), agreement
        assert [c.tokens for c, in again] != [c.tokens for c, in greedy_fp32.fast[:32]]
    finally:
        model.load_state_dict(weights)


def freshly_traced_static_step():
    """static_step compiled by Dynamo with dynamic shapes and run as traced, in a code object of its own (a Dynamo
    cache that no other test has filled), and the list of the graphs it makes."""
    graphs = []

    def count_graphs(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    def fresh_step(batch, rows, keys):
        return static_step(batch, rows, keys)
    return torch.compile(fresh_step, fullgraph=True, dynamic=True, backend=count_graphs), graphs


@pytest.mark.slow
@pytest.mark.parametrize("share_prompts", [True, False])
def test_every_bucketed_shape_of_a_static_batch_compiles_one_graph(share_prompts):
    """A static batch's shapes, each run once through a freshly compiled step (as the engine's CUDA graphs warm every
    shape up when the batch is made): Dynamo makes one graph. It made one more for the steps whose keys spanned the
    cache's whole storage, until the static caches got a spare position (6 graphs for the 128 shapes of a 256-row x
    256-token batch before, 3 after), and one more for a step of one row (Dynamo specializes a size of 1), until the
    smallest row bucket became 2 (3 graphs before, 1 after; each graph is an Inductor compile, ~10 s on a CPU for
    this 1-layer model, ~50 s for d20 on an H200). Traced with Dynamo's eager backend: the graphs are
    Dynamo's, the guards that split them its shape tracing's. As many kv heads as heads (d20's): the copy cache's
    step did not trace at all with them (SDPA's enable_gqa came out symbolic)."""
    model = random_model(tiny_config(sequence_len=256, vocab_size=320, n_head=4, n_kv_head=4, n_layer=1))
    step, graphs = freshly_traced_static_step()
    shape = BatchShape(64, 9 if share_prompts else None, 64, 64, 8, torch.float32, 1.0, 50)
    batch = make_batch(model, shape, decode_plan("static"), RolloutStats(), DecodeWeights(model), step)
    shapes = bucket_shapes(batch.cache.batch_size, batch.cache.key_capacity)
    assert len(shapes) >= 20 and {rows for rows, _ in shapes} >= {2, 64} and 1 not in {rows for rows, _ in shapes}
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        for rows, keys in shapes:
            batch.run_step(rows, keys)
    assert len(graphs) == 1, len(graphs)


def test_warm_ups_and_captures_of_a_graph_batch_share_the_compiled_steps_graphs():
    """A graph batch warms each shape up and then captures it (with autocast's cast cache off, as a capture must),
    all when it is made: the compiled step makes the graph a static batch makes (one), not one per cache state.
    On an H200 (torch 2.11) each of the d20 step's graphs compiled twice, once per state of the cast cache, on
    which Dynamo guards: the step now runs with the cache off in warm-ups, captures and plain steps alike."""
    captures = []

    def capture(step, pool):  # what capture_cuda_graph does around the step (compiling under the stand-in's
        with torch.autocast("cpu", enabled=False, cache_enabled=False):  # recording dispatch mode cannot run)
            step()
        captures.append(step)
        return step, pool
    plan = DecodePlan(bucketed_shape, partial(GraphedStep, capture=capture, warm_up=lambda step: step()), True)
    model = random_model(tiny_config(sequence_len=256, vocab_size=320, n_head=4, n_kv_head=4, n_layer=1))
    step, graphs = freshly_traced_static_step()
    shape = BatchShape(32, 9, 64, 64, 8, torch.float32, 1.0, 50)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        make_batch(model, shape, plan, RolloutStats(), DecodeWeights(model), step)
    assert len(captures) >= 12 and len(graphs) == 1, (len(captures), len(graphs))


def test_inductor_fuses_the_eager_steps_kernels(arithmetic, greedy_fp32):
    """What bench_rl reports as a compiled config's decode kernels: each graph Inductor compiled of the static step
    launches generated kernels and library calls, fewer in all than the eager step launches at the largest shape the
    rollout ran (counted on the meta device, temperature 0 as here): fusing the elementwise work is what compiling
    the step is for. The library calls are exactly those the step's code makes: per block the q/k/v matmul (one,
    DecodeWeights' concatenation), the projection, the MLP's two, the shared-prompt attention's two value matmuls
    (bmm) and the two cache writes (nanochat's store_rows); then the head's matmul (greedy: no top-k)."""
    with torch.device("meta"):
        twin = GPT(arithmetic.model.config, arithmetic.model.generation)
    rows = max(r for r, _ in greedy_fp32.shapes)
    eager = count_decode_step_ops(twin, rows, GREEDY["max_tokens"], num_samples=1, temperature=0.0).kernels
    assert len(greedy_fp32.kernels) == greedy_fp32.compiles
    library = 8 * arithmetic.model.config.n_layer + 1
    assert all(k.generated > 0 and k.library == library and k.launches < eager for k in greedy_fp32.kernels), (
        greedy_fp32.kernels, eager)


class GraphRecorder:
    """A torch.compile backend that keeps the FX graph Dynamo captured and the inputs it was called with (the
    tensors Dynamo read: the batch's buffers, cache and weights), and runs it as it is."""

    def __init__(self):
        self.graphs, self.inputs = [], None

    def __call__(self, graph_module, example_inputs):
        self.graphs.append(graph_module)

        def run(*args):
            self.inputs = args
            return graph_module(*args)
        return run


@pytest.mark.parametrize("share_prompts", [True, False])
def test_the_step_compiled_is_the_one_proven_on_the_meta_device(share_prompts, tiny_tokenizer):
    """The engine compiles static_step, the function tests/engine/test_static_decode.py runs on the meta device; and the
    whole graph Dynamo captures from it (fullgraph: one graph, no break) runs on `meta` under DeviceOnly, so the
    compiled step reads nothing from the host either (fullgraph alone would not show it: Dynamo can capture
    .item() into a graph)."""
    ending = ending_model(tiny_tokenizer)
    spec = rollout_spec(ending, decode="static", compile="on")
    assert Engine(ending, tiny_tokenizer, spec).step.func.fn is static_step
    config = tiny_config(sequence_len=64, vocab_size=tiny_tokenizer.get_vocab_size(), window_pattern="SL")
    model = random_model(config, generation="smear").to("meta")
    if share_prompts:
        cache = SharedPromptKVCache.for_model(model, 6, 2, 16, 40, rows_per_slot=4, static=True)
    else:
        from nanochat.engine.kv_cache import KVCache
        cache = KVCache.for_model(model, 6, 56)
    batch = DecodeBatch(model, cache, 1.0, 50, RolloutStats())
    recorder = GraphRecorder()
    # static shapes: the graph then runs on meta as traced (the dynamic trace takes symbolic sizes as inputs)
    step = torch.compile(static_step, fullgraph=True, dynamic=False, backend=recorder)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):  # the other tests' graphs count
        step(batch, 6, 32)
    (graph,), inputs = recorder.graphs, recorder.inputs
    with DeviceOnly() as mode, torch.no_grad():
        graph(*inputs)
    assert mode.ops > 50 and all(t.device.type == "meta" for t in inputs if isinstance(t, torch.Tensor))


def small_batches(name):
    """One question with mixed advantages (rows 0 and 1 trained, rows 2 and 3 at advantage 0: skipped), forced tokens
    and rows of four lengths, in one pass of two rows; and one whose samples were all rewarded alike (nothing
    trained): one graph per generation (a pass of one row would specialize the rows' dimension to 1)."""
    prompts = generation_reference(name)["greedy_prompts"]
    return [question(prompts[0][:24], [1, 0, 0.5, 0.5], [7, 12, 3, 5], seed=1),
            question(prompts[1][:16], [0, 0, 0, 0], [3, 4, 6, 2], seed=2)]


@pytest.mark.slow
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_compiled_training_gives_the_eager_gradient_within_fp32_rounding(name, tmp_path, monkeypatch):
    """The policy-gradient pass with the compiled chunk forward (Inductor on INDUCTOR_GENERATIONS, traced whole by
    Dynamo elsewhere), prompts shared, on each fixture checkpoint (smear
    crosses the prompt's end; value embeddings; windows; lambdas; the q/k scale) with small_batches: objective and
    gradient within the Higham bound of tests/rl/test_rl_sharing.py. Both paths sum the same terms x_t = w_t * logp_t
    (and their gradients) in different orders and fusions, each within (n + 2) u sum |x_t| of the exact sum (n
    terms, a few u of rounding per term), the two within twice that; norm-wise for the gradient."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    model, _, _ = build_model(str(install_generation(tmp_path, name)), 5, "cpu", "train")
    batches = small_batches(name)
    logps, grad_norms = term_sizes(model.double(), batches)
    model.float()
    u, n, B = torch.finfo(torch.float32).eps / 2, sum(int((b.targets >= 0).sum()) for b in batches), 2
    weights = [(b.advantages.double() / pass_denominators(b.targets, B, len(batches))).abs()[:, None] for b in batches]
    objective_bound = 2 * (n + 2) * u * sum((w * logp.abs()).sum() for w, logp in zip(weights, logps)).item()
    gradient_bound = 2 * (n + 2) * u * sum((w * g).sum() for w, g in zip(weights, grad_norms)).item()
    forward = compiled_for(name, chunk_logprobs, True, monkeypatch)
    eager, eager_stats = gradients(model, batches, B)
    fast, fast_stats = gradients(model, batches, B, forward=lambda *args: forward(*args, required=True))
    assert forward.compiles >= 1 and forward.failed is None
    assert fast_stats.rows_trained == eager_stats.rows_trained == 2 and fast_stats.rows_total == 8
    assert abs(fast_stats.objective - eager_stats.objective) <= objective_bound
    error = torch.cat([(fast[k] - eager[k]).flatten() for k in eager]).norm().item()
    assert error <= gradient_bound, (error, gradient_bound)
    assert sum(g.abs().sum() for g in fast.values()) > 0


def test_a_failed_compile_warns_once_and_runs_eagerly(monkeypatch):
    """Compilation made to fail (the backend raises, as Inductor does without a C++ compiler): one warning, the
    eager result, and the eager path from then on without another attempt; required (--compile=on): a one-line
    error that says which flag to change."""
    def no_compiler(self, graph_module, example_inputs):
        raise RuntimeError("Compiler: cc is not found")

    monkeypatch.setattr(nc_functions._CountingInductor, "__call__", no_compiler)
    twice = lambda x: x * 2 + 1
    function = CompiledFunction(twice, dynamic=False)
    x = torch.arange(3.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(function(x), x * 2 + 1) and torch.equal(function(x), x * 2 + 1)
    assert len(caught) == 1 and "runs eagerly" in str(caught[0].message) and "cc is not found" in str(caught[0].message)
    with pytest.raises(CompileFailed, match="cannot compile <lambda>: .*cc is not found") as error:
        function(x, required=True)
    assert "\n" not in error_line(error.value) and "--compile=off" in error_line(error.value)
    with pytest.raises(CompileFailed, match="cc is not found"):
        CompiledFunction(twice, dynamic=False)(x, required=True)

    monkeypatch.setattr(nc_functions, "_COMPILED", {})  # the probe is made afresh, and fails
    for mode in ("on", "blocks"):  # asked for by name: an error, not an eager run
        with pytest.raises(CompileFailed, match="does not work on cpu here"):
            resolve_compile(mode, torch.device("cpu"), "static")
    with pytest.warns(UserWarning, match="running eagerly"):  # auto on a long CPU run would compile training
        assert resolve_compile("auto", torch.device("cpu"), "eager", num_steps=500)[:2] == (False, False)


def test_an_out_of_memory_while_compiling_is_raised_as_itself_and_compiling_goes_on():
    """Running out of memory while compiling (Inductor benchmarks and allocates) is not a failure to compile: the
    out-of-memory itself comes out (torch.compile wraps it; the rollout or training backs off with fewer rows), the
    function is not marked failed, and the next call compiles."""
    calls = []

    def short_of_memory_once(graph_module, example_inputs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return graph_module.forward
    function = CompiledFunction(lambda x: x * 2 + 1, dynamic=False, announce=False, graph_compiler=short_of_memory_once)
    x = torch.arange(3.0)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        function(x, required=True)
    assert function.failed is None
    assert torch.equal(function(x, required=True), x * 2 + 1) and function.compiles >= 1


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_step_replayed_from_cuda_graphs_equals_it_run_without(dtype, tiny_tokenizer):
    """On a GPU (`gpu_check.sh compiled` runs it): the static step compiled by Inductor and captured in the engine's
    CUDA graphs gives exactly the same compiled step's tokens and log-probabilities run without graphs (the same
    generated kernels), over rows that end at different steps and buckets that change, as the uncompiled graphs do
    (tests/engine/test_static_decode.py); and it did run compiled."""
    model = ending_model(tiny_tokenizer).cuda()
    prompts = [prompt_of(tiny_tokenizer, q) for q in ENDING_PROMPTS]
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        static = Engine(model, tiny_tokenizer, rollout_spec(model, decode="static", compile="on"))
        graph = Engine(model, tiny_tokenizer, rollout_spec(model, decode="graph", compile="on"))
        assert graph.step.func is static.step.func  # one compiled function: the same graphs
        assert rollouts(graph, prompts, **ENDING_KWARGS) == rollouts(static, prompts, **ENDING_KWARGS)
        assert logprobs(graph, prompts, **ENDING_KWARGS) == logprobs(static, prompts, **ENDING_KWARGS)
        assert len(graph.memory.kept_batch.graphs.replays) >= 3
    step = graph.step.func
    assert step.failed is None and step.compiles >= 1


def test_each_graph_compiled_is_announced_as_it_starts_and_as_it_ends(capsys):
    """A compile may take minutes (the d20 decode step on an H100 did not finish in two): each graph says when it goes
    to Inductor and when it is back, with its seconds and kernels; a call that compiles nothing says nothing."""
    def double_plus_one(x):
        return x * 2 + 1
    function = CompiledFunction(double_plus_one, dynamic=False)
    capsys.readouterr()
    assert torch.equal(function(torch.ones(3)), torch.full((3,), 3.0))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "compile: double_plus_one: graph 1 going to Inductor"
    assert re.fullmatch(r"compile: double_plus_one: graph 1 compiled in \d+\.\d s \(1 generated kernels and 0 library "
                        r"calls a call\)", lines[1])
    assert len(lines) == 2 and function.compiles == 1
    function(torch.ones(3))
    assert capsys.readouterr().out == ""
    # another shape fails graph 1's guard on the size: the second graph's line names the guard that failed (a
    # recompile in the middle of a run costs up to a minute on a CPU, and should say what caused it)
    assert torch.equal(function(torch.ones(5)), torch.full((5,), 3.0))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("compile: double_plus_one: graph 2 going to Inductor (no earlier graph fits: ")
    assert "3" in lines[0].partition("fits: ")[2] and "5" in lines[0].partition("fits: ")[2] and len(lines) == 2, lines


def test_a_compile_failure_names_what_dynamo_could_not_trace_and_where():
    """The one line of a failed compile (the warning, or --compile=on's error) says what Dynamo could not trace and
    the line of our code it was at: "Unsupported method call" alone was the first CUDA run's whole report."""
    def writes_a_string_buffer(x):
        buffer = io.StringIO()  # not traceable: a graph break, which fullgraph refuses
        buffer.write("x")
        return x + 1
    function = CompiledFunction(writes_a_string_buffer, dynamic=False)
    with pytest.raises(CompileFailed) as error:
        function(torch.ones(2), required=True)
    line = str(error.value)
    assert "\n" not in line and line.startswith("torch.compile cannot compile writes_a_string_buffer: Unsupported: ")
    assert re.search(r"at test_compile\.py:\d+ in writes_a_string_buffer\)$", line), line
    assert "Explanation" not in line and "Dynamo" in line  # the explanation's text, not its label


def test_compile_plans():
    """auto: nothing on CUDA (not yet measured to pay there); on a CPU the training forward for a run long enough to
    pay for it, and the static decode step for a training run longer still (never the eager step: its exact shapes
    change every step). A part the script does not run is None (chat_eval trains nothing, chat_sft samples only for
    its stop checks), and its start line names only the parts it runs."""
    cpu, cuda, mps = torch.device("cpu"), torch.device("cuda"), torch.device("mps")
    assert compile_plan("auto", cpu, "static", num_steps=467)[:2] == (True, True)
    assert compile_plan("auto", cpu, "static", num_steps=CPU_DECODE_MIN_STEPS)[:2] == (True, True)
    assert compile_plan("auto", cpu, "static", num_steps=CPU_DECODE_MIN_STEPS - 1)[:2] == (False, True)
    assert compile_plan("auto", cpu, "static")[:2] == (True, True)  # a run of unknown length: a long one
    assert compile_plan("auto", cpu, "eager", num_steps=467)[:2] == (False, True)
    assert compile_plan("auto", cpu, "static", num_steps=467).describe() == (
        f"compile: decode step on, training forward on (auto on a CPU with 467 steps: the training forward (measured to "
        f"pay from {CPU_MIN_STEPS} steps) and the static decode step (from {CPU_DECODE_MIN_STEPS}); --compile to choose)")
    assert compile_plan("auto", cpu, "static", num_steps=CPU_DECODE_MIN_STEPS - 1).describe().endswith(
        f"; not the decode step (it pays from {CPU_DECODE_MIN_STEPS} steps); --compile to choose)")
    assert compile_plan("auto", cpu, "eager", num_steps=CPU_MIN_STEPS - 1)[:2] == (False, False)
    assert compile_plan("auto", cuda, "graph")[:2] == (False, False) and compile_plan("auto", cuda, "eager")[:2] == (False, False)
    assert compile_plan("on", cuda, "graph")[:2] == (True, True) and compile_plan("on", cuda, "eager")[:2] == (False, True)
    assert compile_plan("auto", cuda, "graph").describe() == (
        "compile: decode step off, training forward off (auto on CUDA: not yet measured to pay there "
        "(tests/gpu_check.sh compiled measures it); --compile=on to compile; --compile to choose)")
    assert compile_plan("on", cpu, "static")[:2] == (True, True) and compile_plan("on", cpu, "eager")[:2] == (False, True)
    assert compile_plan("off", cuda, "graph")[:2] == (False, False) and compile_plan("auto", mps, "eager")[:2] == (False, False)
    with pytest.raises(ValueError, match="compile mode must be one of auto, on, off"):
        compile_plan("yes", cpu, "eager")
    # chat_sft: a training forward, paying later on a CPU; a decode step only with --stop-at-pass1 (auto decode: graph
    # on CUDA, eager on a CPU)
    sft = dict(cpu_min_steps=SFT_CPU_MIN_STEPS)
    assert compile_plan("auto", cuda, None, num_steps=5, **sft)[:2] == (None, False)
    assert compile_plan("on", cuda, "graph", num_steps=5, **sft)[:2] == (True, True)
    assert compile_plan("auto", cpu, None, num_steps=SFT_CPU_MIN_STEPS, **sft)[:2] == (None, True)
    assert compile_plan("auto", cpu, "eager", num_steps=SFT_CPU_MIN_STEPS, **sft)[:2] == (False, True)
    assert compile_plan("auto", cpu, "eager", num_steps=SFT_CPU_MIN_STEPS - 1, **sft)[:2] == (False, False)
    assert compile_plan("on", cpu, None, num_steps=1, **sft)[:2] == (None, True)
    assert compile_plan("auto", cpu, None, num_steps=300, **sft).describe() == (
        f"compile: training forward off (auto on a CPU: 300 steps are too few to pay for compiling "
        f"(from {SFT_CPU_MIN_STEPS} on); --compile to choose)")
    # chat_eval: a decode step only, compiled where it is static and asked for (on)
    assert compile_plan("auto", cuda, "graph", trains=False)[:2] == (False, None)
    assert compile_plan("on", cuda, "graph", trains=False)[:2] == (True, None)
    assert compile_plan("auto", cuda, "eager", trains=False)[:2] == (False, None)
    assert compile_plan("auto", cpu, "static", trains=False)[:2] == (False, None)
    assert compile_plan("on", cpu, "static", trains=False)[:2] == (True, None)
    assert compile_plan("on", cpu, "eager", trains=False)[:2] == (False, None)
    assert compile_plan("auto", mps, "static", trains=False)[:2] == (False, None)
    assert compile_plan("auto", cpu, "eager", trains=False).describe().startswith(
        "compile: decode step off (auto on a CPU: not the decode step (it applies to --decode=static only")
    assert compile_plan("on", cuda, "graph", trains=False).describe() == "compile: decode step on (--compile=on; --compile to choose)"


def test_chat_rls_auto_decode_is_the_static_step_on_a_cpu_where_that_step_is_compiled():
    """--decode=auto is graph on CUDA and, on a CPU, the eager exact-shape step, except where the run compiles the
    static step (--compile=auto from CPU_DECODE_MIN_STEPS steps, --compile=on always): compiled, the static step is
    the faster there. A mode the user gave is kept."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")

    def mode(flag, compile_mode, device, steps):
        return run_decode_mode(flag, compile_mode, device, steps)
    assert mode("auto", "auto", cpu, 467) == "static"
    assert mode("auto", "auto", cpu, CPU_DECODE_MIN_STEPS - 1) == "eager"
    assert mode("auto", "auto", cpu, CPU_MIN_STEPS - 1) == "eager"
    assert mode("auto", "on", cpu, 5) == "static" and mode("auto", "off", cpu, 467) == "eager"
    assert mode("eager", "auto", cpu, 467) == "eager" and mode("static", "off", cpu, 5) == "static"
    assert mode("auto", "auto", cuda, 467) == "graph" and mode("auto", "on", cuda, 467) == "graph"
    assert mode("auto", "auto", torch.device("mps"), 467) == "eager"
    # in fp32 the compiled step's gain does not pay for its compile: the eager step, unless asked for
    assert run_decode_mode("auto", "auto", cpu, 467, dtype="float32") == "eager"
    assert run_decode_mode("static", "auto", cpu, 467, dtype="float32") == "static"


@pytest.mark.slow
def test_the_golden_trace_compiled(sft, base_dir, monkeypatch, capsys):
    """chat_rl --compile=on reproduces tests/rl/test_golden_trace.py's trace (4 steps, fp32, teacher-forced rollouts)
    within the trace's own tolerance, 1e-4 relative: the compiled forward sums the same terms in another order, the
    same kind of difference as another CPU's kernels. The compile's cost is in the step line and the history of step
    0 only (the forward is dynamic in the rows' lengths: no step after the first compiles), and out of the ETA: the
    step seconds it extrapolates are each step's rollout and training seconds less that step's compiling."""
    from helpers import TINY_RL_FLAGS
    from test_golden_trace import STEPS, TRACED, check_against_golden, teacher_forced

    from nanochat.checkpoints.store import load_checkpoint
    from scripts import chat_rl

    # chat_rl's wiring is what this asks (the compile line, the compiles in the history, the ETA): the forward is
    # traced whole by Dynamo and run as traced (see INDUCTOR_GENERATIONS). Inductor's code for this generation's
    # forward is chat_sft's compiled test's, and for chunk_logprobs' head (log-probabilities, entropy) smear's.
    compiled_for("traced only", chunk_logprobs, True, monkeypatch)
    monkeypatch.setattr(Engine, "generate_many", teacher_forced)
    eta_inputs = []  # the step seconds each step line's ETA extrapolated from
    real_remaining = rl_progress.remaining_seconds
    monkeypatch.setattr(rl_progress, "remaining_seconds",
                        lambda step_seconds, *rest: eta_inputs.append(list(step_seconds)) or real_remaining(step_seconds, *rest))
    chat_rl.main(TINY_RL_FLAGS + [f"--num-steps={STEPS}", "--save-every=-1", "--overwrite", "--compile=on"])
    out = capsys.readouterr().out
    assert "compile: decode step off, training forward on (--compile=on" in out  # fp32: the eager decode step
    _, _, meta = load_checkpoint(str(base_dir / "chatrl_checkpoints" / "d2"), STEPS - 1, "cpu")
    history = meta["history"]
    check_against_golden([{key: record[key] for key in TRACED} for record in history])
    compiles = [record["compiles"] for record in history]
    assert compiles[0] >= 1 and compiles[1:] == [0] * (STEPS - 1) and history[0]["compile_s"] > 0, compiles
    assert f"Compiled: {compiles[0]:.0f} graphs in " in out
    steady = [max(r["time/rollout"] + r["time/train"] - r["compile_s"], 0.0) for r in history]
    assert eta_inputs[-1] == pytest.approx(steady, abs=1e-9) and eta_inputs[0] == pytest.approx(steady[:1], abs=1e-9)
    assert steady[0] < history[0]["time/rollout"] + history[0]["time/train"] - 0.5 * history[0]["compile_s"]


@pytest.mark.slow
def test_the_cache_write_compiled_with_dynamic_shapes_is_eagers():
    """kv_cache.write_rows writes into a layer of the whole storage (heads first or not), compiled with dynamic
    shapes as the static decode step is (through the store_rows operator; eagerly a plain index_put): the cache and
    what is read back after the write equal eager's at several
    (rows, keys) shapes from one graph. (Inductor in torch 2.13 got this wrong when the operator mutated a view of
    the storage instead: every shape here differed.)"""
    from nanochat.engine.kv_cache import write_rows

    def write_then_read(cache, rows, positions, values, keys, heads_first):
        write_rows(cache, 1, rows, positions, values, heads_first)
        layer = cache[1].transpose(1, 2) if heads_first else cache[1]
        return layer[:, :keys].sum(dim=(1, 2, 3))

    for heads_first in (False, True):
        fast = torch.compile(write_then_read, fullgraph=True, dynamic=True)
        for rows, keys in [(4, 32), (3, 64), (2, 32)]:
            shape = (2, 4, 2, 128, 8) if heads_first else (2, 4, 128, 2, 8)
            eager_cache, fast_cache = torch.zeros(shape), torch.zeros(shape)
            index, positions = torch.arange(rows)[:, None], torch.full((rows, 1), keys - 1)
            values = torch.randn(rows, 1, 2, 8)
            expected = write_then_read(eager_cache, index, positions, values, keys, heads_first)
            got = fast(fast_cache, index, positions, values, keys, heads_first)
            # the write exactly; the read-back sums 16 values in another order (fp32 rounding of that order)
            assert torch.equal(fast_cache, eager_cache) and expected.abs().sum() > 0
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), (got, expected)

# ----------------------------------------------------------------------------- chat_sft and chat_eval

SFT_FLAGS = ["--source=sft", "--model-tag=d2", "--tasks=arithmetic", "--arithmetic-difficulty=1", "--num-steps=3",
             "--examples-per-step=8", "--device-batch-size=4", "--eval-every=-1", "--dtype=float32", "--device-type=cpu",
             "--seed=9"]


def sft_losses(monkeypatch, flags):
    """chat_sft's per-step losses (as train_step returned them, unrounded) and trained-on token counts."""
    from nanochat.sft import count_targets
    from scripts import chat_sft
    losses, tokens = [], []

    def recording(model, optimizers, micro_batches, *args, **kwargs):
        loss, gnorm, updated = train_step(model, optimizers, micro_batches, *args, **kwargs)
        losses.append(loss)
        tokens.append(count_targets(micro_batches))
        return loss, gnorm, updated
    train_step = chat_sft.train_step
    with monkeypatch.context() as patch:
        patch.setattr(chat_sft, "train_step", recording)
        chat_sft.main(SFT_FLAGS + flags)
    return losses, tokens


@pytest.mark.slow
def test_chat_sft_compiled_gives_the_eager_losses_and_weights(sft, base_dir, monkeypatch, capsys):
    """chat_sft --compile=on (the training forward and loss compiled, dynamic in the rows' lengths) finetunes the
    random tiny checkpoint as the eager run does. Step 1 runs on the same weights: the two losses sum the same n
    positive cross-entropy terms in another order and fusion, each within (n + 2) u of the exact sum relative to
    it (Higham), so within 2 (n + 2) u of each other. Later steps start from weights that already differ by that
    rounding through the optimizers: there, and for the final weights, the tolerances tests/scripts/test_chat_sft.py's two
    gloo ranks and tests/rl/test_golden_trace.py hold on every CPU kind for the same kind of difference (summation
    order): 1e-4 relative for a loss, 1e-5 relative (+ 1e-6) for a weight. The losses move by far more from step to
    step. The compile is in step 1's line and in the meta; no later step compiles (a new length is no new graph)."""
    eager, tokens = sft_losses(monkeypatch, ["--compile=off", "--output-tag=eager"])
    assert "compile: training forward off (--compile=off; --compile to choose)" in capsys.readouterr().out
    fast, _ = sft_losses(monkeypatch, ["--compile=on", "--output-tag=fast"])
    out = capsys.readouterr().out
    assert "compile: training forward on (--compile=on; --compile to choose)" in out
    u = torch.finfo(torch.float32).eps / 2
    assert abs(fast[0] - eager[0]) <= 2 * (tokens[0] + 2) * u * eager[0], (fast, eager)
    assert fast[1:] == pytest.approx(eager[1:], rel=1e-4)
    assert min(abs(a - b) for a, b in zip(eager, eager[1:])) > 1e-3 * eager[0]  # every step moved the loss
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert "| compiled " in step_lines[0] and not any("compiled" in line for line in step_lines[1:]), step_lines
    checkpoints = base_dir / "chatsft_checkpoints"
    meta = json.loads((checkpoints / "fast" / "meta_000003.json").read_text())
    assert meta["compiles"] >= 1 and meta["compile_s"] > 0 and meta["user_config"]["compile"] == "on"
    assert json.loads((checkpoints / "eager" / "meta_000003.json").read_text())["compiles"] == 0
    eager_weights, fast_weights = (torch.load(checkpoints / tag / "model_000003.pt") for tag in ("eager", "fast"))
    for key in eager_weights:
        torch.testing.assert_close(fast_weights[key], eager_weights[key], atol=1e-6, rtol=1e-5, msg=key)


def eval_completions(monkeypatch, flags, out):
    """chat_eval's report, and every completion it sampled (greedy, then sampled: tokens, masks, ended)."""
    from nanochat.cli import run_main
    from scripts import chat_eval
    sampled = []

    def recording(*args, **kwargs):
        passk, outcomes = evaluate(*args, **kwargs)
        sampled.append([(c.tokens, c.masks, c.ended) for o in outcomes for c in o.completions])
        return passk, outcomes
    evaluate = chat_eval.evaluate_pass_at_k
    with monkeypatch.context() as patch:
        patch.setattr(chat_eval, "evaluate_pass_at_k", recording)
        run_main(chat_eval.main, ["--task=rl_toy_task:ParityTask", "--num-examples=2", "--num-samples=2",
                                  "--max-new-tokens=8", "--decode=static", "--device-type=cpu", "--dtype=float32",
                                  f"--output={out}"] + flags)
    return json.loads(out.read_text()), sampled


@pytest.mark.slow
def test_chat_eval_compiled_samples_the_eager_tokens(sft, base_dir, monkeypatch, capsys):
    """chat_eval --compile=on --decode=static: the compiled static step samples exactly the tokens of the eager
    static step, greedy and at T=1 (fp32, fixed seeds: a difference would need a near-tie within Inductor's
    rounding of a tiny model's logits), so the report is the same; the compiles are in the report. The script's wiring
    is what this asks: the step is traced whole by Dynamo and run as traced (see INDUCTOR_GENERATIONS); Inductor's
    code for this generation's decode step is the trained model's tests' above."""
    compiled_for("traced only", static_step, STATIC_STEP_DYNAMIC, monkeypatch)
    eager, eager_tokens = eval_completions(monkeypatch, ["--compile=off"], base_dir / "eager.json")
    assert "compile: decode step off (--compile=off; --compile to choose)" in capsys.readouterr().out
    fast, fast_tokens = eval_completions(monkeypatch, ["--compile=on"], base_dir / "fast.json")
    assert "compile: decode step on (--compile=on; --compile to choose)" in capsys.readouterr().out
    assert fast_tokens == eager_tokens and sum(len(tokens) for tokens, _, _ in eager_tokens[1]) > 8
    assert (eager["compiles"], eager["compile"], fast["compile"]) == (0, "off", "on")
    assert fast["compiles"] >= 1 and fast["compile_s"] > 0
    skip = {"seconds", "compiles", "compile_s", "compile"}
    assert {k: v for k, v in fast.items() if k not in skip} == {k: v for k, v in eager.items() if k not in skip}


@pytest.mark.parametrize("script", ["chat_sft", "chat_eval"])
def test_compile_on_where_compiling_fails_is_one_line_and_exit_2(script, sft, base_dir, monkeypatch, capsys):
    """--compile=on where torch.compile does not work here (compiling stubbed to fail, as Inductor fails without a
    C++ compiler): one line naming the flag to change, exit 2, no checkpoint or report written."""
    from nanochat.cli import run_main
    from scripts import chat_eval, chat_sft

    def no_compiler(self, graph_module, example_inputs):
        raise RuntimeError("Compiler: cc is not found")
    monkeypatch.setattr(nc_functions._CountingInductor, "__call__", no_compiler)
    monkeypatch.setattr(nc_functions, "_COMPILED", {})  # the probe is made afresh, and fails
    main, flags = {"chat_sft": (chat_sft.main, SFT_FLAGS + ["--output-tag=never"]),
                   "chat_eval": (chat_eval.main, ["--task=rl_toy_task:ParityTask", "--decode=static",
                                                  "--device-type=cpu", f"--output={base_dir / 'never.json'}"])}[script]
    with pytest.raises(SystemExit) as exit:
        run_main(main, flags + ["--compile=on"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: torch.compile does not work on cpu here") and "cc is not found" in err
    assert "--compile=off" in err
    assert not (base_dir / "chatsft_checkpoints" / "never").exists() and not (base_dir / "never.json").exists()


@pytest.mark.slow
def test_compiled_bf16_training_attention_traces_whole_and_matches_eager():
    """The compiled training forward (chunk_logprobs, compiled with dynamic shapes) traces a CPU's explicit bf16
    attention (nanochat/model/attention.py) in one graph, autocast turned off inside fp32_scores included, and its output
    and gradients are eager's, at sequence lengths on both sides of EXPLICIT_MAX_KEYS from one compile (eagerly the
    longer one takes the fused kernel; compiled, a limit would be a guard and a new graph mid-run). aot_eager traces
    forward and backward as Inductor would, without generating kernels (seconds, not minutes)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from nanochat.model.attention import EXPLICIT_MAX_KEYS, attend, explicit_attention

    def forward(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return attend(q, k, v, None).float().square().sum()

    def explicit_forward(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return explicit_attention(q, k, v, None).float().square().sum()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(forward, fullgraph=True, dynamic=True, backend=counter)
    for T in (9, 13, EXPLICIT_MAX_KEYS + 3):
        gen = torch.Generator().manual_seed(T)
        eager_inputs = [torch.randn(2, T, heads, 16, generator=gen).bfloat16().requires_grad_() for heads in (4, 2, 2)]
        compiled_inputs = [x.detach().clone().requires_grad_() for x in eager_inputs]
        want, got = explicit_forward(*eager_inputs), compiled(*compiled_inputs)
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        for a, b in zip(compiled_inputs, eager_inputs):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-2, atol=1e-3)
    assert counter.frame_count == 1


@pytest.mark.parametrize("dtype, rollout_dtype", [("bfloat16", "auto"), ("float32", "auto"), ("bfloat16", "float32")])
def test_chat_rl_decodes_with_the_static_step_where_it_compiles_it(dtype, rollout_dtype, sft, base_dir, monkeypatch,
                                                                   capsys):
    """chat_rl --decode=auto on a CPU with --compile=on (or auto, for a long run) training in bf16 decodes with the
    static step, compiled, its rollouts in training's dtype without timing them (timing would compile the step
    twice; a --rollout-dtype given is kept); in fp32 with the eager step, uncompiled. The compiling itself is stubbed (what is checked is the choice
    and what the engine runs; the compiled step's tokens are checked above). bf16 as an AVX512-BF16 CPU would run
    it, whatever this one is."""
    from helpers import TINY_RL_FLAGS

    from nanochat.engine import engine as nc_engine
    from scripts import chat_rl
    asked = []

    def recording(fn, on, dynamic, required=False):
        asked.append((fn.__name__, on))
        return fn
    monkeypatch.setattr(nc_engine, "maybe_compiled", recording)
    monkeypatch.setattr(policy_gradient, "maybe_compiled", recording)
    monkeypatch.setenv("NANOCHAT_CPU_BF16", "avx512-bf16")
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=1", "--save-every=-1", "--overwrite", "--compile=on", f"--dtype={dtype}",
                                  f"--rollout-dtype={rollout_dtype}"])
    out = capsys.readouterr().out
    config = json.loads((base_dir / "chatrl_checkpoints" / "d2" / "meta_000000.json").read_text())["user_config"]
    assert config["rollout_dtype"] == (dtype if rollout_dtype == "auto" else rollout_dtype)
    assert ("as training, with the compiled decode step" in out) == (dtype == "bfloat16" and rollout_dtype == "auto")
    if dtype == "bfloat16":
        assert "compile: decode step on, training forward on (--compile=on; --compile to choose)" in out
        assert config["decode"] == "static"
        assert "rollouts: static decode step (bucketed static shapes, compiled; --decode to choose)" in out
        assert ("static_step", True) in asked and ("chunk_logprobs", True) in asked
    else:
        assert "compile: decode step off, training forward on (--compile=on; the eager decode step is not compiled" in out
        assert "rollouts: eager decode step" in out and "with the compiled decode step" not in out
        assert ("static_step", False) in asked and ("chunk_logprobs", True) in asked


@pytest.mark.parametrize("compiler", ["works", "fails"])
def test_a_long_cpu_runs_auto_decode_is_static_only_where_compiling_works(compiler, monkeypatch):
    """--decode=auto for a CPU run of 467 steps. --compile=auto: nothing compiled at the start and the compiler not
    probed, whether it works or not (stubbed to fail, as Inductor does without a C++ compiler): the run measures each
    part first (tests/compiling/test_compile_rule.py), and a part that then fails to compile warns once and runs eagerly
    (test_a_failed_compile_warns_once_and_runs_eagerly). --compile=on: the static step, compiled, where compiling
    works; else the one-line error."""
    if compiler == "fails":
        def no_compiler(self, graph_module, example_inputs):
            raise RuntimeError("Compiler: cc is not found")
        monkeypatch.setattr(nc_functions._CountingInductor, "__call__", no_compiler)
        monkeypatch.setattr(nc_functions, "_COMPILED", {})  # the probe is made afresh, and fails
    probes = []
    real_check = nc_plan.check_compiler
    monkeypatch.setattr(nc_plan, "check_compiler", lambda device: probes.append(device) or real_check(device))
    args = SimpleNamespace(decode="auto", compile="auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decode, mode, plan = rl_plan.resolve_decode_and_compile(args, torch.device("cpu"), 467, "bfloat16")
    assert plan[:2] == (False, False) and plan.measured and (decode, mode) == ("eager", "auto")
    assert not caught and probes == []
    args = SimpleNamespace(decode="auto", compile="on")
    if compiler == "works":
        decode, mode, plan = rl_plan.resolve_decode_and_compile(args, torch.device("cpu"), 467, "bfloat16")
        assert plan[:2] == (True, True) and (decode, mode) == ("static", "on") and len(probes) == 1
    else:
        with pytest.raises(nc_functions.CompileFailed, match="torch.compile does not work on cpu here"):
            rl_plan.resolve_decode_and_compile(args, torch.device("cpu"), 467, "bfloat16")


AGREE_ON_COMPILING = """
import sys, warnings, torch, torch.distributed as dist
from nanochat.compiling import functions as nc_functions, plan as nc_plan
dist.init_process_group("gloo")
rank = dist.get_rank()
nc_plan.check_compiler = lambda device: None if rank == 0 else "Compiler: cc is not found"  # rank 1 cannot compile
warnings.simplefilter("ignore")
try:
    plan = nc_plan.resolve_compile(sys.argv[1], torch.device("cpu"), "static", 467)
    print("plan", plan.decode, plan.train)
except nc_functions.CompileFailed as error:
    print("failed", "another rank" in str(error) or "cc is not found" in str(error))
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["auto", "on"])
def test_ranks_take_one_compile_plan_where_one_rank_cannot_compile(mode):
    """Each rank probes its own toolchain; where one fails, every rank compiles nothing (auto) or stops with the
    one-line error (on): none goes on alone down another path (in chat_rl, other collectives: a hang)."""
    from gloo_ranks import run_ranks
    outputs = run_ranks(lambda rank: ["-c", AGREE_ON_COMPILING, mode])
    expected = "plan False False" if mode == "auto" else "failed True"
    assert [out.strip() for out, _ in outputs] == [expected] * 2
