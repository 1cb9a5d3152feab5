"""The static decode step (what CUDA graphs capture): bucketed shapes that hold free rows give the same tokens
as the eager step, it reads nothing from the device and touches no host tensor (proved on the meta device),
GraphedStep's replays give the static step's tokens (on any machine with graph_capture's CPU stand-in for
CUDA graphs, and on a GPU with the real ones). nanochat's own greedy generations are checked in both decode
modes in test_generations.py."""

import contextlib
import dataclasses

import pytest
import torch
from graph_capture import capture_recorded_graph
from helpers import HAS_CUDA, BigramModel, ScriptedModel, install_generation, prompt_of, random_model, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from nanochat.checkpoints.loading import build_model
from nanochat.diagnostics.op_count import CountOps, OpCount, count_decode_step_ops
from nanochat.engine.cuda_graphs import (KEY_BUCKET, ROW_BUCKETS, DecodePlan, GraphedStep, bucket_shapes,
                                         bucketed_shape, capture_cuda_graph, decode_mode, decode_plan, exact_shape)
from nanochat.engine.decode_batch import DecodeBatch, RolloutStats
from nanochat.engine.engine import Engine
from nanochat.engine.kv_cache import KVCache
from nanochat.engine.scheduler import KEEP_BATCHES
from nanochat.engine.shared_prompt_cache import SharedPromptKVCache
from nanochat.engine.spec import rollout_spec
from nanochat.model.gpt import GPT

GENERATIONS = ["oct2025", "jan2026", "ve", "ve_late", "mar9", "smear"]


def rollouts(engine, prompts, **kwargs):
    out = engine.generate_many(prompts, **kwargs)
    return [[(c.tokens, c.masks, c.ended, c.tool_calls, c.tool_successes) for c in per] for per in out]


def test_bucketed_shapes_cover_the_step_and_stay_few():
    for rows in range(1, 300):
        bucket, keys = bucketed_shape(rows, 37, max_rows=1000, max_keys=1000)
        assert rows <= bucket <= max(rows + 1, rows * 3 // 2) and bucket in ROW_BUCKETS  # a third free at most
        assert keys == 64
    assert bucketed_shape(200, 250, max_rows=210, max_keys=240) == (210, 240)  # never past the cache
    shapes = {bucketed_shape(r, k, 256, 256) for r in range(1, 257) for k in range(1, 257)}
    assert len(shapes) == len([b for b in ROW_BUCKETS if b <= 256]) * (256 // KEY_BUCKET)
    for max_rows, max_keys in ((256, 256), (150, 100), (7, 40)):  # every shape a step can take, largest first
        every = {bucketed_shape(r, k, max_rows, max_keys) for r in range(1, max_rows + 1) for k in range(1, max_keys + 1)}
        listed = bucket_shapes(max_rows, max_keys)
        assert len(listed) == len(set(listed)) and set(listed) == every and listed[0] == (max_rows, max_keys)


def test_decode_modes():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [decode_mode(m, cpu) for m in ("auto", "eager", "static")] == ["eager", "eager", "static"]
    assert [decode_mode(m, cuda) for m in ("auto", "eager", "static", "graph")] == ["graph", "eager", "static", "graph"]
    assert decode_plan("static") == DecodePlan(bucketed_shape, None, True) and decode_plan("graph").graphs is GraphedStep
    assert decode_plan("eager") == DecodePlan(exact_shape, None, False)
    with pytest.raises(ValueError, match="decode mode graph needs a CUDA device"):
        decode_mode("graph", cpu)
    with pytest.raises(ValueError, match="decode mode must be one of auto, eager, static, graph, got 'fast'"):
        decode_mode("fast", cpu)


@pytest.mark.parametrize("name", GENERATIONS)
@pytest.mark.parametrize("share_prompts", [True, False])
def test_static_sampling_equals_eager_for_every_generation(name, share_prompts, tmp_path, monkeypatch):
    """Sampled rollouts (T=1, top-k 50) of nanochat's fixture checkpoints, with rows admitted into freed slots
    (max_rows below the rows wanted): token for token the same in both decode modes."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    model, tokenizer, _ = build_model(str(install_generation(tmp_path, name)), 5, "cpu", "eval")
    prompts = [prompt_of(tokenizer, q) for q in ("What is 12 times 7?", "Tom has 3 apples", "Hi")]
    kwargs = dict(num_samples=5, max_tokens=24, temperature=1.0, top_k=50, seeds=[4, 5, 6], max_rows=7)
    eager = rollouts(Engine(model, tokenizer, rollout_spec(model, decode="eager", share_prompts=share_prompts)),
                     prompts, **kwargs)
    static = rollouts(Engine(model, tokenizer, rollout_spec(model, decode="static", share_prompts=share_prompts)),
                      prompts, **kwargs)
    assert static == eager


@pytest.mark.parametrize("share_prompts", [True, False])
def test_static_tool_calls_and_early_ends_equal_eager(tiny_tokenizer, share_prompts):
    """A scripted model that calls the calculator and stops at random steps: forced outputs, masks, tool counts
    and ends are the same in both modes, and rows end at many different steps (slots are freed and refilled)."""
    tok = tiny_tokenizer
    ps, pe, end = (tok.encode_special(s) for s in ("<|python_start|>", "<|python_end|>", "<|assistant_end|>"))
    prompts = [prompt_of(tok, "three more words")] * 4  # one length: the script is indexed by completion position
    script = [ps, *tok.encode("6*7"), pe] + tok.encode("a b c d e f g") + [ps, *tok.encode("1/0"), pe] + tok.encode("h i j") * 3
    model = ScriptedModel(script, len(prompts[0]), tok.get_vocab_size(), stop_token=end, stop_logit=-2.5)
    kwargs = dict(num_samples=6, max_tokens=40, temperature=1.0, seed=11, max_rows=9)
    eager = rollouts(Engine(model, tok, rollout_spec(model, decode="eager", share_prompts=share_prompts)), prompts,
                     **kwargs)
    static = rollouts(Engine(model, tok, rollout_spec(model, decode="static", share_prompts=share_prompts)), prompts,
                      **kwargs)
    assert static == eager
    assert len({len(c[0]) for per in eager for c in per}) > 3 and any(c[3] >= 1 and c[4] >= 1 for per in eager for c in per)


def logprobs(engine, prompts, **kwargs):
    """Each completion's two recorded log-probabilities, nan (forced tokens) written as None to compare."""
    out = engine.generate_many(prompts, **kwargs)
    return [[[None if x != x else x for x in c.logprobs + c.sampling_logprobs] for c in per] for per in out]


def ending_model(tokenizer, generation="smear"):
    """A tiny random model whose rows end at varied steps (<|assistant_end|> made likelier)."""
    config = tiny_config(sequence_len=128, vocab_size=tokenizer.get_vocab_size(), window_pattern="SL")
    model = random_model(config, generation=generation)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.encode_special("<|assistant_end|>")] *= 2.5
    return model


ENDING_PROMPTS = ("a b", "Natalia sold 48 clips", "c", "d e f", "g")
ENDING_KWARGS = dict(num_samples=6, max_tokens=40, temperature=1.0, top_k=50, seeds=[1, 2, 3, 4, 5], max_rows=14)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["jan2026", "ve", "smear"])  # every cache feature: windows, value embeddings, smear
@pytest.mark.parametrize("share_prompts", [True, False])
def test_replayed_graphs_equal_the_static_step(name, share_prompts, tmp_path, monkeypatch, cpu_graphs):
    """Replayed from graphs (CUDA graphs' semantics, on the CPU), sampled rollouts of nanochat's fixture
    checkpoints with rows admitted into freed slots give the static step's tokens and log-probabilities, bit for
    bit, over several row and key buckets (static equals eager on all six generations, tested above)."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    model, tokenizer, _ = build_model(str(install_generation(tmp_path, name)), 5, "cpu", "eval")
    prompts = [prompt_of(tokenizer, q) for q in ("What is 12 times 7?", "Tom has 3 apples", "Hi")]
    kwargs = dict(num_samples=5, max_tokens=40, temperature=1.0, top_k=50, seeds=[4, 5, 6], max_rows=7)
    static = Engine(model, tokenizer, rollout_spec(model, decode="static", share_prompts=share_prompts))
    graph = Engine(model, tokenizer, rollout_spec(model, decode="graph", share_prompts=share_prompts))
    assert rollouts(graph, prompts, **kwargs) == rollouts(static, prompts, **kwargs)
    # every shape of the batch captured when it was made, every step of the rollout replayed from its graph
    cache = graph.memory.kept_batch.cache
    shapes = bucket_shapes(cache.batch_size, cache.key_capacity)
    first = graph.last_stats
    assert cpu_graphs.captures == first.captures == len(shapes) >= 3 and cpu_graphs.replays == first.decode_forwards
    assert len({rows for rows, _ in shapes}) >= 3 and len({keys for _, keys in shapes}) >= 2
    assert logprobs(graph, prompts, **kwargs) == logprobs(static, prompts, **kwargs)
    # the kept batch serves the next rollout: nothing captured again
    assert graph.last_stats.captures == 0 and cpu_graphs.captures == len(shapes)
    assert cpu_graphs.replays == first.decode_forwards + graph.last_stats.decode_forwards


@pytest.mark.parametrize("share_prompts", [True, False])
def test_replayed_graphs_carry_tool_calls_early_ends_and_refilled_slots(tiny_tokenizer, share_prompts, cpu_graphs):
    """A model whose next logits are a table row of its input token (helpers.BigramModel): the calculator's
    forced output, written into the inputs between replays, decides what the replay samples next, so a graph
    that missed it (reading a stale or reallocated input) samples other tokens. Rows ending at many steps and
    waiting rows taking their slots give the static step's rollouts and log-probabilities."""
    torch.manual_seed(0)
    model = BigramModel(tiny_tokenizer)
    prompts = [prompt_of(tiny_tokenizer, q) for q in ("a b", "Natalia sold clips", "c", "d e")]
    kwargs = dict(num_samples=6, max_tokens=40, temperature=1.0, top_k=0, seeds=[1, 2, 3, 4], max_rows=9)
    static = Engine(model, tiny_tokenizer, rollout_spec(model, decode="static", share_prompts=share_prompts))
    graph = Engine(model, tiny_tokenizer, rollout_spec(model, decode="graph", share_prompts=share_prompts))
    want = rollouts(static, prompts, **kwargs)
    assert rollouts(graph, prompts, **kwargs) == want
    assert logprobs(graph, prompts, **kwargs) == logprobs(static, prompts, **kwargs)
    assert sum(c[3] for per in want for c in per) >= 3 and len({len(c[0]) for per in want for c in per}) > 3
    # every step of both rollouts replayed (the kept batch's graphs, all captured when it was made)
    assert cpu_graphs.captures > 0 and cpu_graphs.replays == 2 * graph.last_stats.decode_forwards


@pytest.mark.slow
def test_the_stand_in_catches_what_a_capture_breaks(tiny_tokenizer, cpu_graphs, monkeypatch):
    """graph_capture's replays have a real capture's teeth: a batch that writes the inputs the host knows into a
    new tensor instead of its buffer (the graph keeps reading the buffer it captured: the calculator's forced
    tokens, helpers.BigramModel's, are lost), or a cache that grows after a capture (the graph writes the old
    storage), is right when run eagerly and samples other tokens when replayed."""
    from nanochat.engine import decode_batch
    bigram = BigramModel(tiny_tokenizer)
    calls = [prompt_of(tiny_tokenizer, q) for q in ("a b", "Natalia sold clips", "c", "d e")]
    kwargs = dict(num_samples=6, max_tokens=40, temperature=1.0, top_k=0, seeds=[1, 2, 3, 4], max_rows=9)
    right = rollouts(Engine(bigram, tiny_tokenizer, rollout_spec(bigram, decode="static")), calls, **kwargs)
    feed = DecodeBatch._feed

    def feed_into_a_new_tensor(self, sampled, rows):
        self.host_inputs = self.host_inputs.clone()
        return feed(self, sampled, rows)

    with monkeypatch.context() as patch:
        patch.setattr(DecodeBatch, "_feed", feed_into_a_new_tensor)
        assert rollouts(Engine(bigram, tiny_tokenizer, rollout_spec(bigram, decode="static")), calls, **kwargs) == right
        assert rollouts(Engine(bigram, tiny_tokenizer, rollout_spec(bigram, decode="graph")), calls, **kwargs) != right

    model = ending_model(tiny_tokenizer)
    prompts = [prompt_of(tiny_tokenizer, q) for q in ENDING_PROMPTS]
    right = rollouts(Engine(model, tiny_tokenizer, rollout_spec(model, decode="static")), prompts, **ENDING_KWARGS)

    init = SharedPromptKVCache.__init__

    def growing_storage(self, *args, **kwargs):  # completion keys allocated 8 at first, grown on demand
        init(self, *args, **kwargs)
        self.k, self.v = self.k[:, :, :, :8].clone(), self.v[:, :, :, :8].clone()

    monkeypatch.setattr(SharedPromptKVCache, "__init__", growing_storage)
    assert rollouts(Engine(model, tiny_tokenizer, rollout_spec(model, decode="static")), prompts,
                    **ENDING_KWARGS) == right
    # shapes captured largest first (the engine's order): the storage grows at the first warm-up, before any
    # capture, so the graphs hold; smallest first, it grows after some captures, whose replays write the old one
    assert rollouts(Engine(model, tiny_tokenizer, rollout_spec(model, decode="graph")), prompts,
                    **ENDING_KWARGS) == right
    monkeypatch.setattr(decode_batch, "bucket_shapes", lambda rows, keys: bucket_shapes(rows, keys)[::-1])
    assert rollouts(Engine(model, tiny_tokenizer, rollout_spec(model, decode="graph")), prompts,
                    **ENDING_KWARGS) != right


REFUSED_IN_A_CAPTURE = {
    "item": lambda x, mask: x[0].item(),
    "int": lambda x, mask: int(x[0]),
    "bool": lambda x, mask: bool(x[0] > 0),
    "tolist": lambda x, mask: x.tolist(),
    "numpy": lambda x, mask: x.numpy(),
    "nonzero": lambda x, mask: mask.nonzero(),
    "where(mask)": lambda x, mask: torch.where(mask),
    "boolean-mask index": lambda x, mask: x[mask],
    "boolean-mask write": lambda x, mask: x.__setitem__(mask, 0.0),
    "masked_select": lambda x, mask: x.masked_select(mask),
    "unique": lambda x, mask: torch.unique(x),
    "torch.tensor(host list)": lambda x, mask: x + torch.tensor([1.0, 2.0, 3.0, 4.0]),
    "python-list index": lambda x, mask: x[[0, 2]],
}


@pytest.mark.parametrize("op", REFUSED_IN_A_CAPTURE.values(), ids=REFUSED_IN_A_CAPTURE.keys())
def test_the_stand_in_refuses_what_a_capture_refuses(op):
    """A host read (with or without an aten op: .item() dispatches one, .tolist() and .numpy() do not), an output
    shape only the data knows (boolean masks included), and a tensor built from host data: each raises at the
    capture, as a CUDA graph capture does, and leaves Tensor's methods as they were. The same step without the
    refused op captures and replays (the control)."""
    x, mask = torch.arange(4.0), torch.tensor([True, False, True, False])
    out = torch.zeros(4)
    with pytest.raises(RuntimeError, match="CUDA graph capture cannot hold it"):
        capture_recorded_graph(lambda: (out.copy_(x * 2), op(x, mask)), None)
    assert torch.arange(3).tolist() == [0, 1, 2] and torch.equal(x, torch.arange(4.0))  # nothing left behind
    replay, _ = capture_recorded_graph(lambda: out.copy_(x * 2), None)
    assert torch.equal(out, torch.zeros(4))  # a capture has no effect
    x.add_(1)
    replay()
    assert torch.equal(out, torch.arange(1.0, 5.0) * 2)  # the replay reads x's current contents


def test_a_static_batch_is_reused_by_the_next_rollout_of_its_shape(tiny_tokenizer):
    """The static batch (its cache, and on CUDA its graphs) outlives a rollout that ran to its end and serves the
    next one of the same shape, prompts of other lengths within the pool's rounding included; the tokens are
    those of fresh eager engines. A longer prompt, or an interrupted rollout, gets a new batch."""
    config = tiny_config(sequence_len=256, vocab_size=tiny_tokenizer.get_vocab_size(), window_pattern="SL")
    model = random_model(config, generation="smear")
    engine = Engine(model, tiny_tokenizer, rollout_spec(model, decode="static"))
    kwargs = dict(num_samples=4, max_tokens=20, temperature=1.0, top_k=50, max_rows=6)
    first = [prompt_of(tiny_tokenizer, q) for q in ("a b", "Natalia sold 48 clips")]
    second = [prompt_of(tiny_tokenizer, q) for q in ("c", "d e f g")]
    assert max(map(len, first + second)) <= 64
    outs = [rollouts(engine, first, seeds=[1, 2], **kwargs)]
    batch = engine.memory.kept_batch
    assert batch is not None
    outs.append(rollouts(engine, second, seeds=[3, 4], **kwargs))
    assert engine.memory.kept_batch is batch  # reused, and kept again
    assert outs == [rollouts(Engine(model, tiny_tokenizer, rollout_spec(model, decode="eager")), p, seeds=s, **kwargs)
                    for p, s in ((first, [1, 2]), (second, [3, 4]))]
    long_prompt = [prompt_of(tiny_tokenizer, "word " * 40)]
    rollouts(engine, long_prompt, seeds=[5], **kwargs)
    # the pool rounded up to 128
    assert engine.memory.kept_batch is not batch and engine.memory.kept[-1].shape.prompt_cap == 128
    assert len(engine.memory.kept) == 1  # the batch for shorter prompts can serve no rollout again: gone
    long_batch = engine.memory.kept_batch
    stream = engine.generate(first[0], num_samples=2, max_tokens=10, seed=1)
    next(stream)  # a rollout left unfinished: its batch is not kept
    stream.close()
    assert [k.batch for k in engine.memory.kept] == [long_batch]


def test_two_shapes_alternating_keep_a_batch_each(tiny_tokenizer):
    """chat_rl alternates its steps' rollout shape with its evals' (other samples per question, more questions):
    each keeps its own static batch (on CUDA, its graphs), so neither is made again when the other has run; tokens
    are fresh eager engines'. A third shape makes a batch in place of the oldest (KEEP_BATCHES); where the budget
    the kept batches leave holds under half the rows the whole budget would, they go first; a kept batch made for
    the rows the budget left serves again."""
    config = tiny_config(sequence_len=256, vocab_size=tiny_tokenizer.get_vocab_size(), window_pattern="SL")
    model = random_model(config, generation="smear")
    prompts = [prompt_of(tiny_tokenizer, q) for q in ("a b", "Natalia sold 48 clips", "c", "d e f g")]
    step = dict(num_samples=4, max_tokens=20, temperature=1.0, top_k=50)
    evals = dict(num_samples=2, max_tokens=24, temperature=1.0, top_k=50)
    eager = Engine(model, tiny_tokenizer, rollout_spec(model, decode="eager"))
    engine = Engine(model, tiny_tokenizer, rollout_spec(model, decode="static"))
    assert KEEP_BATCHES == 2
    outs, batches = [], []
    for kwargs, questions in ((step, prompts[:2]), (evals, prompts), (step, prompts[:2]), (evals, prompts)):
        outs.append(rollouts(engine, questions, seeds=list(range(len(questions))), **kwargs))
        assert outs[-1] == rollouts(eager, questions, seeds=list(range(len(questions))), **kwargs)
        batches.append(engine.memory.kept_batch)
    assert batches[0] is batches[2] and batches[1] is batches[3] and batches[0] is not batches[1]
    assert [k.batch for k in engine.memory.kept] == [batches[0], batches[1]]
    rollouts(engine, prompts[:1], seeds=[0], num_samples=3, max_tokens=8)  # a third shape: the oldest goes
    assert [k.batch for k in engine.memory.kept][0] is batches[1] and len(engine.memory.kept) == 2

    # a budget that holds the step's batch and little more: the eval's batch takes its place, with every row the
    # budget holds (6, not its 8 samples), and serves the next eval; the step's batch comes back in its place
    tight = Engine(model, tiny_tokenizer, rollout_spec(model, decode="static"))
    rollouts(tight, prompts[:2], seeds=[0, 1], **step)
    step_batch = tight.memory.kept[-1]
    tight.reconfigure(dataclasses.replace(tight.spec, memory_budget_gb=step_batch.nbytes * 1.2 / 2 ** 30))
    rows_alone = tight.memory.rows_for_budget(64, evals["max_tokens"], torch.float32, evals["num_samples"])
    assert rows_alone < 8  # the budget binds the eval's rows
    assert tight.memory.rows_for_budget(64, evals["max_tokens"], torch.float32, evals["num_samples"],
                                 tight.spec.memory_budget_gb * 2 ** 30 - step_batch.nbytes) * 2 < rows_alone
    rollouts(tight, prompts, seeds=[0, 1, 2, 3], **evals)
    eval_batch = tight.memory.kept_batch
    assert [k.batch for k in tight.memory.kept] == [eval_batch] and eval_batch.cache.batch_size == rows_alone
    assert tight.memory.kept[-1].budget_bound
    again = rollouts(tight, prompts, seeds=[0, 1, 2, 3], **evals)
    assert tight.memory.kept_batch is eval_batch and again == rollouts(eager, prompts, seeds=[0, 1, 2, 3], **evals)
    rollouts(tight, prompts[:2], seeds=[0, 1], **step)
    step_rows = min(8, tight.memory.rows_for_budget(64, step["max_tokens"], torch.float32, step["num_samples"]))
    assert [(k.shape.num_samples, k.batch.cache.batch_size) for k in tight.memory.kept] == [(4, step_rows)]  # made way
    # the kept batch fills the budget: not one row beside it
    tight.reconfigure(dataclasses.replace(tight.spec, memory_budget_gb=tight.memory.kept[0].nbytes / 2 ** 30))
    rollouts(tight, prompts[:1], seeds=[0], num_samples=1, max_tokens=8)
    assert [k.shape.num_samples for k in tight.memory.kept] == [1]

    # chat_rl's case: an eval of more samples than the budget holds, beside the step's batch, with 10 rows (of the
    # at most 20 the whole budget would give) in the budget the step's batch leaves: both kept, both serve again
    both = Engine(model, tiny_tokenizer, rollout_spec(model, decode="static"))
    rollouts(both, prompts[:2], seeds=[0, 1], **step)
    step_batch = both.memory.kept[-1]
    room = lambda budget: both.memory.rows_for_budget(64, evals["max_tokens"], torch.float32, evals["num_samples"],
                                                      budget)
    eval_bytes = next(b for b in range(0, 10 ** 9, 1024) if room(b) >= 10)
    both.reconfigure(dataclasses.replace(both.spec, memory_budget_gb=(step_batch.nbytes + eval_bytes) / 2 ** 30))
    questions = prompts * 4  # 32 samples: more than the budget holds
    assert 10 < room(both.spec.memory_budget_gb * 2 ** 30) <= 20
    eval_batches = []
    for _ in range(2):
        assert rollouts(both, questions, seeds=list(range(16)), **evals) == rollouts(eager, questions, seeds=list(range(16)), **evals)
        rollouts(both, prompts[:2], seeds=[0, 1], **step)
        assert [(k.shape.num_samples, k.shape.rows) for k in both.memory.kept] == [(2, 10), (4, 8)]
        assert both.memory.kept[0].budget_bound and both.memory.kept[1].batch is step_batch.batch
        eval_batches.append(both.memory.kept[0].batch)
    assert eval_batches[0] is eval_batches[1]


class DeviceOnly(TorchDispatchMode):
    """Fails any op that reads a tensor to the host (.item(), .tolist(), nonzero, a tensor-valued `if` raise on
    meta tensors anyway) or mixes in a CPU tensor (a host-to-device copy inside the step): the ops a CUDA graph
    capture cannot hold. Counts the ops it saw."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        for a in list(args) + list((kwargs or {}).values()):
            for t in (a if isinstance(a, (list, tuple)) else [a]):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    raise AssertionError(f"{func} touches a {t.device} tensor inside the decode step")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("generation", ["jan2026", "smear", "ve"])
@pytest.mark.parametrize("share_prompts", [True, False])
def test_static_step_runs_on_the_meta_device(generation, share_prompts, tiny_tokenizer):
    """Every tensor on `meta`, so any host read raises: the step (forward, sampling, stream advance) over a
    bucket of 6 slots with 4 in use and 32 keys is pure device work of fixed shape."""
    config = tiny_config(sequence_len=64, vocab_size=tiny_tokenizer.get_vocab_size(), window_pattern="SL")
    model = random_model(config, generation=generation).to("meta")
    if share_prompts:
        cache = SharedPromptKVCache.for_model(model, 6, 2, 16, 40, rows_per_slot=4, static=True)
    else:
        cache = KVCache.for_model(model, 6, 56)
    batch = DecodeBatch(model, cache, 1.0, 50, RolloutStats())
    with DeviceOnly() as mode, torch.no_grad():
        batch.run_step(6, 32)
    assert mode.ops > 50 and batch.sampled.device.type == "meta"


def test_an_out_of_memory_inside_a_capture_is_raised_as_one(monkeypatch):
    """capture_cuda_graph's error path, with torch.cuda's graph API stubbed on the CPU: when the capture ends in
    its own error after an out-of-memory inside it (the stream's capture is broken), the out-of-memory is what
    comes out, so the rollout backs off to fewer rows; any other error comes out as it is; either way the stream
    that was current before the capture is current again."""
    class FailingCapture:
        def __init__(self, graph, pool=None, capture_error_mode="global"):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            if exc[0] is not None:
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    streams = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph", FailingCapture)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "the rollout's stream")
    monkeypatch.setattr(torch.cuda, "set_stream", streams.append)
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def bad_kernel():
        raise ValueError("not an allocation")

    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        capture_cuda_graph(out_of_memory, None)
    with pytest.raises(RuntimeError, match="previous error during capture") as error:
        capture_cuda_graph(bad_kernel, None)
    assert isinstance(error.value.__context__, ValueError)
    assert streams == ["the rollout's stream"] * 2  # put back after each failed capture


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_equals_the_static_step(dtype, tiny_tokenizer):
    """On a GPU: rollouts replayed from CUDA graphs (several row and key buckets: 30 rows that end at different
    steps, admitted into freed slots) give exactly the static step's tokens and log-probabilities (the same
    shapes run eagerly: the same kernels). Eager decoding runs other shapes, whose kernels may round otherwise
    on a GPU, so it is compared by the sampler gap (tests/rl/test_sampler_gap.py), not token for token."""
    model = ending_model(tiny_tokenizer).cuda()
    prompts = [prompt_of(tiny_tokenizer, q) for q in ENDING_PROMPTS]
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        static = Engine(model, tiny_tokenizer, rollout_spec(model, decode="static"))
        graph = Engine(model, tiny_tokenizer, rollout_spec(model, decode="graph"))
        assert rollouts(graph, prompts, **ENDING_KWARGS) == rollouts(static, prompts, **ENDING_KWARGS)
        assert logprobs(graph, prompts, **ENDING_KWARGS) == logprobs(static, prompts, **ENDING_KWARGS)
        assert len(graph.memory.kept_batch.graphs.replays) >= 3
        ends = {len(c[0]) for per in rollouts(graph, prompts, **ENDING_KWARGS) for c in per}
    assert len(ends) > 2


@pytest.mark.parametrize("generation", ["oct2025", "jan2026"])  # no value embeddings: every layer alike
@pytest.mark.parametrize("share_prompts", [True, False])
def test_a_decode_step_builds_each_windows_masks_once_not_per_layer(generation, share_prompts):
    """Issue 35: a replayed step still runs every kernel, and the visibility masks depend only on the window, so they
    are built once per step and window, not in every layer. Counted on the meta device: the ops outside the
    blocks do not grow with depth; every block after the first of its window runs the same ops, fewer than the
    first of each window (which builds its masks); depth 8 costs depth 4 plus 4 such blocks."""
    counts = {}
    for depth in (4, 8):
        with torch.device("meta"):
            model = GPT(tiny_config(n_layer=depth, sequence_len=64, window_pattern="SL"), generation=generation)
        counts[depth] = count_decode_step_ops(model, 6, 32, share_prompts=share_prompts, prompt_len=16, num_samples=4)
    c4, c8 = counts[4], counts[8]
    # outside the blocks only the trunk's per-layer residual mix grows with depth (none without lambdas)
    lambdas, x = torch.ones(8, device="meta"), torch.zeros(6, 1, 64, device="meta")
    mix = OpCount()
    with CountOps(mix):
        _ = lambdas[3] * x + lambdas[3] * x
    per_layer_mix = mix.ops if model.generation.lambdas else 0
    assert c8.ops_outside_blocks - c4.ops_outside_blocks == 4 * per_layer_mix
    firsts = {model.window_sizes.index(w) for w in set(model.window_sizes)}  # the first block of each window
    later = [ops for i, ops in enumerate(c8.ops_per_block) if i not in firsts]
    assert len(set(later)) == 1 and later[0] < min(c8.ops_per_block[i] for i in firsts), c8.ops_per_block
    assert c8.ops - c4.ops == 4 * (later[0] + per_layer_mix)
    assert 0 < c8.kernels < c8.ops
