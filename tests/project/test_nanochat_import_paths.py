"""nanochat's import paths (docs/layout.md, "nanochat's names"): a script written against karpathy/nanochat imports
these names from these modules and calls them with nanochat's signatures. Each test imports from nanochat's path,
calls with nanochat's arguments (keywords where nanochat's own code passes keywords) and checks what comes back."""

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import prompt_of, random_model, tiny_config

# ----------------------------------------------------------------------------- nanochat.engine


def test_sample_next_token_greedy_is_argmax_and_leaves_the_generator_alone():
    from nanochat.engine import sample_next_token
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    rng = torch.Generator().manual_seed(1)
    before = rng.get_state()
    tokens = sample_next_token(logits, rng, temperature=0.0)
    assert tokens.shape == (6, 1) and tokens.dtype == torch.long
    assert torch.equal(tokens, logits.argmax(dim=-1, keepdim=True))
    assert torch.equal(rng.get_state(), before)  # nanochat draws nothing for a greedy token


def test_sample_next_token_top_1_is_argmax():
    from nanochat.engine import sample_next_token
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    tokens = sample_next_token(logits, torch.Generator().manual_seed(2), 1.0, 1)
    assert torch.equal(tokens, logits.argmax(dim=-1, keepdim=True))


def test_sample_next_token_is_reproducible_from_the_generator_and_stays_in_the_top_k():
    from nanochat.engine import sample_next_token
    logits = torch.randn(200, 50, generator=torch.Generator().manual_seed(0))
    a = sample_next_token(logits, torch.Generator().manual_seed(3), temperature=1.5, top_k=5)
    b = sample_next_token(logits, torch.Generator().manual_seed(3), temperature=1.5, top_k=5)
    c = sample_next_token(logits, torch.Generator().manual_seed(4), temperature=1.5, top_k=5)
    assert a.shape == (200, 1) and torch.equal(a, b) and not torch.equal(a, c)
    top5 = logits.topk(5, dim=-1).indices  # (200, 5)
    assert (a == top5).any(dim=-1).all()
    assert (a != logits.argmax(dim=-1, keepdim=True)).any()  # it samples, not just takes the argmax


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.7, 3)])
def test_sample_next_token_draws_from_the_softmax_of_the_top_k(temperature, top_k):
    """nanochat's distribution: softmax(top-k logits / temperature), the other tokens never."""
    from nanochat.engine import sample_next_token
    row = torch.tensor([2.0, 1.5, 0.5, 0.0, -1.0])
    n = 20000
    tokens = sample_next_token(row.expand(n, -1), torch.Generator().manual_seed(5), temperature, top_k)
    frequencies = torch.bincount(tokens.squeeze(1), minlength=5).float() / n
    kept = row if top_k is None else torch.where(torch.arange(5) < top_k, row, torch.tensor(float("-inf")))
    expected = torch.softmax(kept / temperature, dim=-1)
    # 0.015: over 4 standard deviations of a frequency estimated from 20000 draws
    assert torch.allclose(frequencies, expected, atol=0.015), (frequencies, expected)


def test_use_calculator_evaluates_arithmetic_and_count_and_refuses_the_rest():
    from nanochat.engine import use_calculator
    assert use_calculator("2+3*4") == 14
    assert use_calculator("1,000 / 8") == 125.0  # nanochat strips the commas first
    assert use_calculator("'strawberry'.count('r')") == 3
    assert use_calculator("2**100") is None  # nanochat refuses the power operator
    assert use_calculator("__import__('os').getcwd()") is None


def test_kv_cache_from_nanochats_positional_arguments():
    from nanochat.engine import KVCache
    # nanochat: KVCache(batch_size, num_heads, seq_len, head_dim, num_layers, device, dtype)
    cache = KVCache(3, 2, 16, 8, 4, "cpu", torch.bfloat16)
    assert cache.k.shape == cache.v.shape == (4, 3, 16, 2, 8)  # (layers, B, T, heads, head_dim), as nanochat's
    assert cache.k.dtype == torch.bfloat16 and cache.k.device.type == "cpu"
    assert cache.batch_size == 3 and cache.max_seq_len == 16 and cache.get_pos() == 0


def test_engine_generate_batch_with_nanochats_arguments(tiny_tokenizer):
    from nanochat.engine import Engine
    model = random_model(tiny_config(sequence_len=64, vocab_size=tiny_tokenizer.get_vocab_size()))
    prompt = prompt_of(tiny_tokenizer, "How many apples?")
    results, masks = Engine(model, tiny_tokenizer).generate_batch(prompt, num_samples=2, max_tokens=5,
                                                                   temperature=1.0, top_k=50, seed=7)
    assert len(results) == len(masks) == 2
    for tokens, mask in zip(results, masks):
        assert tokens[:len(prompt)] == prompt and len(prompt) < len(tokens) <= len(prompt) + 5
        assert len(mask) == len(tokens) and not any(mask[:len(prompt)])

# ----------------------------------------------------------------------------- nanochat.tokenizer


def test_get_token_bytes_reads_the_base_dirs_tokenizer(base_dir, tiny_tokenizer):
    from nanochat.tokenizer import get_token_bytes
    token_bytes = get_token_bytes(device="cpu")
    assert token_bytes.shape == (tiny_tokenizer.get_vocab_size(),) and token_bytes.dtype == torch.int32
    assert torch.equal(token_bytes, tiny_tokenizer.token_bytes())
    assert token_bytes[tiny_tokenizer.get_bos_token_id()] == 0  # special tokens are not text
    assert token_bytes[tiny_tokenizer.encode("a")[0]] == 1


def test_get_token_bytes_names_the_missing_file(tmp_path, monkeypatch):
    from nanochat.tokenizer import TokenizerError, get_token_bytes
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    with pytest.raises(TokenizerError, match=str(tmp_path / "tokenizer" / "token_bytes.pt")):
        get_token_bytes()


def test_get_tokenizer_is_a_rust_bpe_tokenizer_built_as_nanochat_builds_one(base_dir, tiny_tokenizer):
    from nanochat.tokenizer import RustBPETokenizer, get_tokenizer
    tokenizer = get_tokenizer()
    assert isinstance(tokenizer, RustBPETokenizer)
    again = RustBPETokenizer(tokenizer.enc, "<|bos|>")  # what nanochat's from_directory calls
    assert again.get_bos_token_id() == tiny_tokenizer.get_bos_token_id()
    assert again.encode("Natalia sold clips", prepend="<|bos|>") == tiny_tokenizer.encode("Natalia sold clips",
                                                                                        prepend="<|bos|>")
    with pytest.raises(ValueError, match="not a special token"):
        RustBPETokenizer(tokenizer.enc, "<|endoftext|>")

# ----------------------------------------------------------------------------- nanochat.muon, adamw, optim


def tiny_model_with_grads():
    """A tiny GPT whose parameters hold the gradient of a next-token loss."""
    model = random_model(tiny_config())
    idx = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    model(idx, targets=idx.roll(-1, dims=1)).backward()
    return model


def adamw_groups(model):
    """nanochat's AdamW groups (its gpt.py setup_optimizers): the head, the embedding, the two kinds of lambdas."""
    return [dict(params=[model.lm_head.weight], lr=0.004), dict(params=[model.transformer.wte.weight], lr=0.2),
            dict(params=[model.resid_lambdas], lr=0.005), dict(params=[model.x0_lambdas], lr=0.5, betas=(0.96, 0.95))]


def muon_adamw_groups(model):
    """nanochat's MuonAdamW groups since 2026-01-29: every group says its kind and carries all its settings."""
    groups = [dict(kind="adamw", eps=1e-10, weight_decay=0.0, **{"betas": (0.8, 0.95), **g})
              for g in adamw_groups(model)]
    matrices = list(model.transformer.h.parameters())
    for shape in sorted({p.shape for p in matrices}):
        groups.append(dict(kind="muon", params=[p for p in matrices if p.shape == shape], lr=0.02, momentum=0.95,
                           ns_steps=5, beta2=0.95, weight_decay=0.1))
    return groups


def stepped(model, make_optimizer):
    """A copy of `model` (gradients included) after one step of make_optimizer(copy); checks the step moved every
    parameter the optimizer holds."""
    original, model = model, copy.deepcopy(model)
    for p, q in zip(original.parameters(), model.parameters()):
        q.grad = p.grad.clone()  # deepcopy leaves a parameter's .grad behind
    optimizer = make_optimizer(model)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in held]
    optimizer.step()
    moved = [not torch.equal(b, p) for b, p in zip(before, held)]
    assert held and all(moved), f"{type(optimizer).__name__} left {moved.count(False)} of {len(held)} unchanged"
    return model


class StepBoth:
    """Two optimizers stepped as one (nanochat's base_train steps its Muon and AdamW in turn)."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers
        self.param_groups = [g for o in optimizers for g in o.param_groups]

    def step(self):
        for optimizer in self.optimizers:
            optimizer.step()


@pytest.fixture
def one_rank_group(tmp_path):
    """A 1-process gloo group, as nanochat's distributed optimizers need one (its constructors ask the group)."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_optimizer_names_are_the_classes_checked_against_nanochats_numbers():
    """The names are this library's optimizers themselves, whose steps tests/optim/test_optim.py holds to nanochat's
    recorded trajectories; the tests below check that nanochat's way of building and stepping them works."""
    import nanochat.adamw
    import nanochat.muon
    import nanochat.optim
    from nanochat.optim import adamw, muon, muon_adamw
    assert (nanochat.muon.Muon, nanochat.muon.DistMuon) == (muon.Muon, muon.DistMuon)
    assert nanochat.adamw.DistAdamW is adamw.DistAdamW
    assert nanochat.optim.MuonAdamW is nanochat.optim.DistMuonAdamW is muon_adamw.MuonAdamW


def test_muon_steps_nanochats_matrices():
    from nanochat.muon import Muon
    stepped(tiny_model_with_grads(),
            lambda m: Muon(list(m.transformer.h.parameters()), lr=0.02, momentum=0.95, weight_decay=0.1))


def test_dist_muon_and_dist_adamw_in_a_process_group_match_the_single_process_optimizers(one_rank_group):
    from nanochat.adamw import DistAdamW
    from nanochat.muon import DistMuon, Muon
    model = tiny_model_with_grads()
    muon_kwargs = dict(lr=0.02, momentum=0.95, weight_decay=0.1)  # nanochat's gpt.py passes these
    adamw_kwargs = dict(betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)

    def dist_optimizers(m):
        return DistMuon(list(m.transformer.h.parameters()), **muon_kwargs), DistAdamW(adamw_groups(m), **adamw_kwargs)

    distributed = stepped(model, lambda m: StepBoth(*dist_optimizers(m)))
    # nanochat's single-GPU pair: Muon and torch's AdamW
    single = stepped(model, lambda m: StepBoth(Muon(list(m.transformer.h.parameters()), **muon_kwargs),
                                               torch.optim.AdamW(adamw_groups(m), **adamw_kwargs)))
    for (name, a), b in zip(distributed.named_parameters(), single.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_muon_adamw_steps_nanochats_param_groups():
    from nanochat.optim import MuonAdamW
    model = tiny_model_with_grads()

    def make(m):
        optimizer = MuonAdamW(muon_adamw_groups(m))
        for group in optimizer.param_groups:
            group["initial_lr"] = group["lr"]  # nanochat's setup_optimizer records it after construction
        return optimizer

    stepped(model, make)


def test_dist_muon_adamw_in_a_process_group_matches_muon_adamw(one_rank_group):
    from nanochat.optim import DistMuonAdamW, MuonAdamW
    model = tiny_model_with_grads()
    distributed = stepped(model, lambda m: DistMuonAdamW(muon_adamw_groups(m)))
    single = stepped(model, lambda m: MuonAdamW(muon_adamw_groups(m)))
    for (name, a), b in zip(distributed.named_parameters(), single.parameters()):
        torch.testing.assert_close(a, b, msg=name)
