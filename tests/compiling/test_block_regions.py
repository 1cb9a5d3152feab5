"""--compile=blocks (issue 48): each transformer block compiled around its attention, one compile of each region for
every layer. The regions are traced by Dynamo and run as traced (ATen's kernels, no Inductor: the test is of what
is compiled and how often, not of Inductor's roundings, which the whole-function compile tests cover), so the
compiled model must compute exactly what the eager one does: logits, gradients, sampled tokens and a chat_rl step."""

import re
from functools import partial

import pytest
import torch
from helpers import HAS_CUDA, TINY_RL_FLAGS, prompt_of, random_model, tiny_config
from test_compile import no_pretend_cuda  # noqa: F401 (autouse: Dynamo must see this machine's CUDA, or none)
from test_static_decode import ENDING_KWARGS, ENDING_PROMPTS, ending_model, logprobs, rollouts

from nanochat.compiling import functions as nc_functions
from nanochat.compiling.functions import CompiledFunction
from nanochat.compiling.plan import compile_block_regions, compile_plan
from nanochat.engine.cuda_graphs import DecodePlan, GraphedStep, bucketed_shape
from nanochat.engine.decode_batch import RolloutStats
from nanochat.engine.decode_weights import DecodeWeights
from nanochat.engine.engine import Engine, make_batch
from nanochat.engine.scheduler import BatchShape
from nanochat.engine.spec import rollout_spec
from nanochat.model.blocks import EAGER_REGIONS, BlockRegions
from scripts import chat_rl


def traced_regions():
    """Fresh compiled regions (Dynamo's graphs kept per compiled function: none from another test), run as traced,
    and the graphs each region compiled."""
    graphs = {fn.__name__: [] for fn in EAGER_REGIONS}

    def counting(name):
        def compiler(graph_module, example_inputs):
            graphs[name].append(graph_module)
            return graph_module.forward
        return compiler
    return BlockRegions(*(CompiledFunction(fn, True, announce=False, graph_compiler=counting(fn.__name__))
                          for fn in EAGER_REGIONS)), graphs


def logits_and_gradients(model, batches):
    """Per batch of token ids: the logits, and every parameter's gradient of a loss that reaches each of them."""
    out = []
    for idx in batches:
        model.zero_grad(set_to_none=True)
        logits = model(idx)
        (logits.float().sin().sum()).backward()
        out.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    return out


@pytest.mark.parametrize("generation", ["jan2026", "smear"])
def test_one_compile_of_each_region_serves_every_layer_and_computes_the_eager_forward_and_gradient(generation):
    """A 6-layer model compiles the graphs a 2-layer one does (the layer index and window stay outside the regions;
    a module argument is guarded by its attributes, not its identity), over batches of other rows and lengths (shapes
    dynamic), and its logits and gradients are the eager model's bit for bit. Value embeddings on some layers only
    (jan2026, smear) make two graphs of the region before attention, no more."""
    counts = {}
    for n_layer in (2, 6):
        model = random_model(tiny_config(n_layer=n_layer, window_pattern="SL"), generation=generation).train()
        batches = [torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(i))
                   for i, shape in enumerate([(3, 17), (5, 23), (2, 9)])]
        eager = logits_and_gradients(model, batches)
        model.block_regions, graphs = traced_regions()
        compiled = logits_and_gradients(model, batches)
        for (logits, grads), (logits_c, grads_c) in zip(eager, compiled):
            assert torch.equal(logits, logits_c)
            assert grads.keys() == grads_c.keys() and all(torch.equal(grads[n], grads_c[n]) for n in grads)
        counts[n_layer] = {name: len(g) for name, g in graphs.items()}
    assert counts[2] == counts[6], counts
    assert 1 <= counts[6]["block_before_attention"] <= 2 * 2 and 1 <= counts[6]["block_after_attention"] <= 2, counts


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_rollouts_with_compiled_block_regions_sample_the_eager_tokens(decode, tiny_tokenizer):
    """Rollouts (the engine's fused QKV decode weights, prefill and decode steps, rows that end at different steps)
    with the regions compiled sample the eager model's tokens and record its log-probabilities, exactly."""
    model = ending_model(tiny_tokenizer)
    prompts = [prompt_of(tiny_tokenizer, q) for q in ENDING_PROMPTS]
    eager = Engine(model, tiny_tokenizer, rollout_spec(model, decode=decode))
    expected = rollouts(eager, prompts, **ENDING_KWARGS), logprobs(eager, prompts, **ENDING_KWARGS)
    model.block_regions, graphs = traced_regions()
    compiled = Engine(model, tiny_tokenizer, rollout_spec(model, decode=decode))
    assert (rollouts(compiled, prompts, **ENDING_KWARGS), logprobs(compiled, prompts, **ENDING_KWARGS)) == expected
    assert all(len(g) >= 1 for g in graphs.values()), graphs  # it did run compiled


def test_a_graph_batch_compiles_the_regions_in_its_warm_ups_and_never_in_a_capture():
    """A graph batch warms each shape up, then captures it (with autocast's cast cache off, as capture_cuda_graph
    does): every region graph is compiled in a warm-up (on a GPU, compiling inside a capture would record Inductor's
    own work, or fail it), and the captures, all of them, find their graphs made. A few graphs serve all shapes."""
    model = random_model(tiny_config(sequence_len=256, vocab_size=320, n_head=4, n_kv_head=4, n_layer=2,
                                     window_pattern="SL"), generation="smear")
    model.block_regions, graphs = traced_regions()
    total = lambda: sum(map(len, graphs.values()))  # noqa: E731
    compiled_in_captures = []

    def capture(step, pool):
        before = total()
        with torch.autocast("cpu", enabled=False, cache_enabled=False):
            step()
        compiled_in_captures.append(total() - before)
        return step, pool
    plan = DecodePlan(bucketed_shape, partial(GraphedStep, capture=capture, warm_up=lambda step: step()), True)
    with torch.no_grad():
        make_batch(model, BatchShape(32, 9, 64, 64, 8, torch.float32, 1.0, 50), plan, RolloutStats(),
                   DecodeWeights(model), None)
    assert len(compiled_in_captures) >= 12 and set(compiled_in_captures) == {0}, compiled_in_captures
    assert 1 <= total() <= 6, {name: len(g) for name, g in graphs.items()}


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_on_a_gpu_the_compiled_regions_replayed_from_cuda_graphs_equal_them_run_without(tiny_tokenizer):
    """On a GPU (`gpu_check.sh checks` runs it): the regions compiled by Inductor, in bf16, inside the engine's CUDA
    graphs give exactly the tokens and log-probabilities of the same compiled regions run without graphs (the same
    generated kernels), over rows that end at different steps and buckets that change; and they did run compiled."""
    model = ending_model(tiny_tokenizer).cuda()
    prompts = [prompt_of(tiny_tokenizer, q) for q in ENDING_PROMPTS]
    compile_block_regions(model, required=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        static = Engine(model, tiny_tokenizer, rollout_spec(model, decode="static"))
        graph = Engine(model, tiny_tokenizer, rollout_spec(model, decode="graph"))
        assert rollouts(graph, prompts, **ENDING_KWARGS) == rollouts(static, prompts, **ENDING_KWARGS)
        assert logprobs(graph, prompts, **ENDING_KWARGS) == logprobs(static, prompts, **ENDING_KWARGS)
        assert len(graph.memory.kept_batch.graphs.replays) >= 3
    assert all(region.func.failed is None and region.func.compiles >= 1 for region in model.block_regions)


def test_compile_blocks_is_a_plan_of_its_own():
    """--compile=blocks compiles the regions alone, on any device: not the whole decode step or training forward."""
    for device in ("cpu", "cuda"):
        plan = compile_plan("blocks", torch.device(device), "graph" if device == "cuda" else "static", 500)
        assert plan.blocks and plan.compiles and not plan.decode and not plan.train
        assert plan.describe().startswith("compile: each transformer block around its attention")
        assert not plan.nothing("unavailable").blocks
    assert compile_plan("on", torch.device("cpu"), "static").blocks is False


def test_chat_rl_with_compile_blocks_trains_as_the_eager_run(sft, base_dir, monkeypatch, capsys):
    """chat_rl --compile=blocks says so at its start, runs its model's block regions compiled (rollouts and training
    alike) and samples, trains and logs what the uncompiled run does. The process's compiled regions are replaced
    by traced ones for the test (Inductor's minute of code generation is not what it checks)."""
    flags = TINY_RL_FLAGS + ["--num-steps=4", "--save-every=-1"]
    chat_rl.main(flags + ["--compile=off"])
    eager = capsys.readouterr().out
    regions, graphs = traced_regions()
    for fn, traced in zip(EAGER_REGIONS, regions):
        monkeypatch.setitem(nc_functions._COMPILED, (fn, True), traced)
    chat_rl.main(flags + ["--compile=blocks", "--overwrite"])
    out = capsys.readouterr().out
    assert "compile: each transformer block around its attention" in out
    assert all(len(g) >= 1 for g in graphs.values()), graphs
    step_lines = lambda text: [re.sub(r" \| (Rollout|Elapsed): .*", "", line)  # noqa: E731 (timings differ)
                               for line in text.splitlines() if line.startswith("Step ")]
    assert step_lines(out) == step_lines(eager) and len(step_lines(out)) == 4
    compiled_steps = [line.split()[1] for line in out.splitlines() if line.startswith("Step ") and "Compiled: " in line]
    assert compiled_steps == ["0/4"], compiled_steps  # no recompiles after step 0 (shapes dynamic)


def test_compile_block_regions_off_restores_the_eager_regions():
    model = random_model(tiny_config())
    compile_block_regions(model)
    assert model.block_regions != EAGER_REGIONS
    compile_block_regions(model, on=False)
    assert model.block_regions == EAGER_REGIONS
