"""nanochat/engine/variants/flex_prompt_attention.py: the shared-prompt decode step's attention through FlexAttention
(the decode step "flex", bench_rl's *_flex configs) against the hand-written step it stands beside: the same
attention on hand-made cache states (windows that hide every prompt key, free rows, grouped-query heads), the same
tokens in rollouts, and a step Dynamo traces whole with dynamic shapes (what a GPU's Inductor then lowers)."""

import warnings

import pytest
import torch
from helpers import FP32_GAP_BOUND, HAS_CUDA, install_generation, prompt_of, random_model, tiny_config
from test_compile import no_pretend_cuda  # noqa: F401 (autouse: eagerly, FlexAttention runs through Dynamo too)

from nanochat.checkpoints.loading import build_model
from nanochat.compiling import functions as nc_functions
from nanochat.compiling.functions import CompiledFunction
from nanochat.engine.decode_batch import static_step
from nanochat.engine.engine import STATIC_STEP_DYNAMIC, Engine
from nanochat.engine.variants.flex_prompt_attention import FLEX_DYNAMIC, flex_compile_state, flex_prompt_attention
from nanochat.engine.shared_prompt_cache import FlexPromptStep, SharedPromptKVCache, SharedPromptStep
from nanochat.engine.spec import rollout_spec

# eagerly FlexAttention is PyTorch's unfused reference, and says so once per process
pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")


def graph_as_traced(graph_module, example_inputs):
    """A graph compiler that keeps Dynamo's graph as it is: Dynamo's trace is what is checked, not Inductor's code
    (a CPU's Inductor does not lower FlexAttention with its log-sum-exp)."""
    return graph_module.forward


def cache_in_use(heads, kv_heads, dtype, device="cpu", seed=0, layers=2):
    """A static SharedPromptKVCache of 10 rows over 3 prompt slots (prompts of 5, 11 and 1 tokens in a pool of 12)
    with random keys: rows 0-3 continue slot 0 (samples 0-3), 4-6 slot 2, 7-8 slot 1 (samples 3 and 1: gaps in its
    column), each at its own completion position; row 9 is free (the spare column)."""
    torch.manual_seed(seed)
    D = 16
    cache = SharedPromptKVCache(10, 3, 12, 24, kv_heads, D, layers, device=device, dtype=dtype, rows_per_slot=4,
                                static=True)
    cache.pool_k.normal_(), cache.pool_v.normal_(), cache.k.normal_(), cache.v.normal_()
    cache.pool_len.copy_(torch.tensor([5, 11, 1]))
    cache.prompt_slot[:9] = torch.tensor([0, 0, 0, 0, 2, 2, 2, 1, 1])
    cache.sample[:9] = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 1])
    cache.pos[:9] = torch.tensor([0, 3, 7, 15, 1, 9, 19, 2, 12])
    cache.active[:9] = 1
    return cache


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("window", [0, 2, 6, 1000])
def test_the_flex_step_attends_as_the_hand_written_step(heads, kv_heads, window):
    """Every row of a step of 10 rows and 20 keys: the same attention (within fp32 rounding: eagerly FlexAttention
    computes its softmax in fp32 whatever the inputs) over its prompt's visible keys and its own. Window 0 and 2 hide every prompt key from most rows (the prompt part's
    log-sum-exp is -inf there), 6 some of them, 1000 none."""
    results = []
    for step_type in (SharedPromptStep, FlexPromptStep):
        cache = cache_in_use(heads, kv_heads, torch.float64)
        torch.manual_seed(1)
        q = torch.randn(10, 1, heads, 16, dtype=torch.float64)
        k, v = torch.randn(10, 1, kv_heads, 16, dtype=torch.float64), torch.randn(10, 1, kv_heads, 16, dtype=torch.float64)
        step = SharedPromptStep(cache.prefix(10), 20) if step_type is SharedPromptStep else FlexPromptStep(
            cache.prefix(10), 20, whole=cache)
        results.append(step.attend(1, q, k, v, window))
    explicit, flex = results
    assert flex.shape == explicit.shape == (10, heads, 1, 16)
    torch.testing.assert_close(flex[:9], explicit[:9], rtol=1e-6, atol=1e-6)  # row 9 is free: never read


def test_the_flex_step_sees_only_its_rows_prompt_and_own_keys():
    """The property behind the equality above, on the flex step alone: changing a key no row's query may see (past
    a prompt's end, another slot's prompt, another row's completion, past the row's position) changes nothing."""
    cache = cache_in_use(4, 2, torch.float64)
    torch.manual_seed(1)
    q, k, v = torch.randn(10, 1, 4, 16, dtype=torch.float64), *torch.randn(2, 10, 1, 2, 16, dtype=torch.float64)
    before = FlexPromptStep(cache.prefix(10), 20, whole=cache).attend(0, q, k, v, 1000)
    cache.pool_k[0, 0, :, 5:] += 100.0   # slot 0's prompt is 5 tokens
    cache.pool_v[0, 2, :, 1:] -= 50.0    # slot 2's is 1
    cache.k[0, 0, :, 1:] += 100.0        # row 0 is at position 0: its completion has one key, this step's
    cache.v[0, 3, :, 16:] += 100.0       # row 3 at 15
    after = FlexPromptStep(cache.prefix(10), 20, whole=cache).attend(0, q, k, v, 1000)
    torch.testing.assert_close(after[:9], before[:9], rtol=0, atol=1e-12)
    cache.pool_k[0, 1, :, 3] += 1.0      # a visible key of slot 1: rows 7 and 8 change, the others do not
    changed = FlexPromptStep(cache.prefix(10), 20, whole=cache).attend(0, q, k, v, 1000)
    differs = (changed[:9] - before[:9]).abs().amax(dim=(1, 2, 3)) > 1e-9
    assert differs.tolist() == [False] * 7 + [True, True]


def rollouts(engine, prompts, **kwargs):
    out = engine.generate_many(prompts, **kwargs)
    tokens = [[(c.tokens, c.masks, c.ended, c.tool_calls) for c in per] for per in out]
    return tokens, torch.tensor([x for per in out for c in per for x in c.logprobs if x == x])


@pytest.mark.parametrize("name", ["jan2026", "smear"])  # windows; value embeddings and smear
def test_flex_rollouts_sample_the_hand_written_tokens(name, tmp_path, monkeypatch):
    """fp32 rollouts (T=1, top-k 50; 3 prompts x 5 samples in 7 rows: rows admitted into freed slots) of nanochat's
    fixture checkpoints: the flex step samples the hand-written step's tokens, its log-probabilities within
    FP32_GAP_BOUND (the two parts' softmaxes merged by their log-sum-exps round otherwise than one softmax)."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    model, tokenizer, _ = build_model(str(install_generation(tmp_path, name)), 5, "cpu", "eval")
    prompts = [prompt_of(tokenizer, q) for q in ("What is 12 times 7?", "Tom has 3 apples", "Hi")]
    kwargs = dict(num_samples=5, max_tokens=24, temperature=1.0, top_k=50, seeds=[4, 5, 6], max_rows=7)
    explicit, explicit_lp = rollouts(Engine(model, tokenizer, rollout_spec(model, decode="static")), prompts, **kwargs)
    flex, flex_lp = rollouts(Engine(model, tokenizer, rollout_spec(model, decode="static", decode_kernels="flex")),
                             prompts, **kwargs)
    assert flex == explicit
    assert explicit_lp.numel() >= 100 and (flex_lp - explicit_lp).abs().max() <= FP32_GAP_BOUND


def test_dynamo_traces_flex_attention_for_every_bucket_and_layer_in_two_graphs_decoding_ready():
    """flex_prompt_attention as a GPU compiles it (fullgraph, FLEX_DYNAMIC's automatic dynamic shapes), traced by
    Dynamo over steps of other row and key counts (a static batch's buckets) and layers: each result the eager
    function's; two graphs, the first all static, the second dynamic in what changed; and in both, each FlexAttention
    call's query has a static batch and static heads, which Inductor's decoding kernel needs (else its main kernel
    runs a block of 64-128 query rows for the own part's one)."""
    graphs = []

    def keep_graph(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward
    traced = CompiledFunction(flex_prompt_attention, FLEX_DYNAMIC, announce=False, graph_compiler=keep_graph)
    for layer, (rows, keys) in enumerate(((10, 20), (6, 16), (8, 24), (4, 16), (9, 20))):
        cache = cache_in_use(4, 2, torch.float32, layers=5)
        step = FlexPromptStep(cache.prefix(rows), keys, whole=cache)
        lowest, lowest_own = step.lowest(6)
        q = torch.randn(rows, 4, 16)
        args = (q, cache.pool_k[layer], cache.pool_v[layer], cache.pool_len, cache.prompt_slot[:rows],
                cache.sample[:rows], lowest, cache.k[layer, :, :, :keys], cache.v[layer, :, :, :keys], cache.pos,
                lowest_own)  # every row sees its own newest key
        torch.testing.assert_close(traced(*args), flex_prompt_attention(*args), rtol=1e-6, atol=1e-6)
    assert traced.failed is None and traced.compiles == len(graphs) == 2
    for graph in graphs:
        queries = [node.args[0].meta["example_value"] for node in graph.graph.nodes
                   if node.op == "call_function" and "flex_attention" in str(node.target)]
        assert len(queries) == 2 and all(isinstance(q.size(0), int) and isinstance(q.size(1), int) for q in queries)


def test_the_compiled_static_step_takes_flex_attention_in_whole(tiny_tokenizer, monkeypatch):
    """--compile=on's static step with the flex cache, traced whole by Dynamo (fullgraph, dynamic shapes: the
    flex calls inside the step's graph, not a compiled function of their own): the eager flex step's tokens."""
    config = tiny_config(sequence_len=128, vocab_size=tiny_tokenizer.get_vocab_size(), window_pattern="SL")
    model = random_model(config, generation="smear")
    traced = CompiledFunction(static_step, STATIC_STEP_DYNAMIC, announce=False, graph_compiler=graph_as_traced)
    monkeypatch.setitem(nc_functions._COMPILED, (static_step, STATIC_STEP_DYNAMIC), traced)
    prompts = [prompt_of(tiny_tokenizer, q) for q in ("a b", "Natalia sold 48 clips")]
    kwargs = dict(num_samples=3, max_tokens=20, temperature=1.0, top_k=50, seeds=[1, 2], max_rows=4)
    eager, _ = rollouts(Engine(model, tiny_tokenizer, rollout_spec(model, decode="static", decode_kernels="flex")),
                        prompts, **kwargs)
    engine = Engine(model, tiny_tokenizer, rollout_spec(model, decode="static", compile="on", decode_kernels="flex"))
    compiled, _ = rollouts(engine, prompts, **kwargs)
    assert engine.step.func is traced and traced.compiles >= 1 and traced.failed is None
    assert compiled == eager


def test_an_unknown_decode_step_is_refused(tiny_tokenizer):
    model = random_model(tiny_config(vocab_size=tiny_tokenizer.get_vocab_size()))
    with pytest.raises(ValueError, match="decode_kernels must be one of auto, torch, flex, triton, got 'fast'"):
        Engine(model, tiny_tokenizer, rollout_spec(model, decode_kernels="fast"))
    with pytest.raises(ValueError, match="decode_kernels is flex, a step of the shared-prompt cache: it needs "
                                         "share_prompts=True"):
        Engine(model, tiny_tokenizer, rollout_spec(model, decode_kernels="flex", share_prompts=False))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_compiled_flex_attention_on_cuda_equals_the_hand_written_step(dtype, tolerance):
    """On a GPU the flex step runs FlexAttention compiled by Inductor (Triton): the hand-written step's attention,
    within the dtype's rounding, over every window case of the CPU test."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for window in (0, 6, 1000):
            results = []
            for flex in (False, True):
                cache = cache_in_use(4, 2, dtype, device="cuda")
                torch.manual_seed(1)
                q, k, v = (torch.randn(10, 1, h, 16, device="cuda", dtype=dtype) for h in (4, 2, 2))
                step = FlexPromptStep(cache.prefix(10), 20, whole=cache) if flex else SharedPromptStep(cache.prefix(10), 20)
                results.append(step.attend(1, q, k, v, window)[:9].float())
            torch.testing.assert_close(results[1], results[0], rtol=tolerance, atol=tolerance)
    state = flex_compile_state()  # Inductor's kernels computed it, not the eager reference after a failed compile
    assert state is not None and state["failed"] is None and state["compiles"] >= 1, state


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_flex_rollouts_replayed_from_cuda_graphs_equal_the_static_flex_step(tiny_tokenizer):
    """The flex step captured in the engine's CUDA graphs (FlexAttention's Triton kernels among the captured ones;
    no CPU stand-in can capture a higher-order operator) gives the static flex step's tokens, in bf16."""
    config = tiny_config(sequence_len=128, vocab_size=tiny_tokenizer.get_vocab_size(), window_pattern="SL")
    model = random_model(config, generation="smear").cuda()
    prompts = [prompt_of(tiny_tokenizer, q) for q in ("a b", "Natalia sold 48 clips", "c")]
    kwargs = dict(num_samples=4, max_tokens=30, temperature=1.0, top_k=50, seeds=[1, 2, 3], max_rows=8)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        static, _ = rollouts(Engine(model, tiny_tokenizer, rollout_spec(model, decode="static", decode_kernels="flex")),
                             prompts, **kwargs)
        graph = Engine(model, tiny_tokenizer, rollout_spec(model, decode="graph", decode_kernels="flex"))
        replayed, _ = rollouts(graph, prompts, **kwargs)
    assert replayed == static and len(graph.memory.kept_batch.graphs.replays) >= 2
    state = flex_compile_state()
    assert state is not None and state["failed"] is None and state["compiles"] >= 1, state
