"""--memory-budget-gb=auto (issue 35, item 2): on CUDA the KV budget is a fraction of the memory free after the
model, the optimizer and a training-peak reserve; elsewhere a fixed 4 GiB. The arithmetic against numbers worked
out by hand, with the device's free memory stubbed (no GPU needed), and the rows the Engine then chooses. The budget
is the engine's (nanochat/engine/spec.py); what training reserves, training's (nanochat/optim/training_memory.py)."""

from types import SimpleNamespace

import pytest
import torch

from nanochat.cli import error_line
from nanochat.engine import spec
from nanochat.engine.engine import Engine
from nanochat.engine.spec import GiB, parse_budget, plan_budget, resolve_memory_budget, rollout_spec
from nanochat.errors import SettingError, UserError
from nanochat.model.gpt import GPT, GPTConfig
from nanochat.optim import training_memory
from nanochat.optim.training_memory import optimizer_bytes, training_peak_bytes


def test_the_budget_and_the_rows_it_holds_are_as_computed_by_hand(tiny_tokenizer):
    """80 GiB free with the model loaded; 8 GiB of optimizer state and gradients, 1 GiB of bf16 decode weights and
    11 GiB of training peak to come: 0.9 x (80 - 20) = 54 GiB of KV cache. nanochat's d20 (20 layers, 10 kv heads
    of 128) caches 2 x 20 x 10 x 128 x 2 = 102,400 bytes per bf16 token, so 54 GiB hold 54 x 2**30 / 102,400 =
    566,231.04 tokens; with prompts of 300 tokens stored once per question of 16 samples and 256 new tokens, a row
    costs 256 + 2 x 300 / 16 = 293.5 tokens after one prompt: (566,231.04 - 300) // 293.5 = 1928 rows."""
    plan = plan_budget(free=80 * GiB, model=2 * GiB, optimizer=8 * GiB, decode_weights=1 * GiB, training_peak=11 * GiB)
    assert plan.budget_bytes == 54 * GiB and plan.budget_gb == 54.0
    assert "54.0 GiB = 0.9 x (80.0 GiB free with the model's 2.0 GiB loaded - 20.0 GiB reserved" in plan.describe()
    with torch.device("meta"):
        d20 = GPT(GPTConfig(sequence_len=2048, vocab_size=65536, n_layer=20, n_head=10, n_kv_head=10, n_embd=1280))
    engine = Engine(d20, tiny_tokenizer, rollout_spec(d20, memory_budget_gb=plan.budget_gb))
    assert engine.memory.rows_for_budget(prompt_len=300, max_tokens=256, dtype=torch.bfloat16, num_samples=16) == 1928


class Stub(torch.nn.Module):
    """A model of two parameters on the meta device: a 100 x 64 embedding (AdamW) and a 64 -> 256 matmul (Muon)."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(n_layer=2, n_embd=64, vocab_size=100)
        with torch.device("meta"):
            self.wte = torch.nn.Embedding(100, 64)
            self.fc = torch.nn.Linear(64, 256, bias=False)


def stub_optimizer(model, state=None):
    return SimpleNamespace(param_groups=[{"kind": "adamw", "params": [model.wte.weight]},
                                         {"kind": "muon", "params": [model.fc.weight]}], state=state or {})


@pytest.fixture
def free_memory(monkeypatch):
    """torch.cuda's free memory, stubbed: set free_memory[0] to the bytes mem_get_info reports."""
    free = [GiB]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 80 * GiB))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return free


def test_auto_on_cuda_reserves_the_optimizer_decode_weights_and_training_peak(free_memory):
    model = Stub()
    embedding, matrix = 100 * 64 * 4, 64 * 256 * 4  # fp32 bytes of each parameter
    grads = embedding + matrix
    optimizer = grads + 2 * embedding + 1 * matrix  # AdamW: exp_avg, exp_avg_sq; Muon: momentum
    decode_weights = 64 * 256 * 2  # the matmul's bf16 copy; the embedding is looked up, not copied
    rows, completion, prompt = 8, 16, 32
    tokens = rows * completion + prompt  # one shared prompt through the model once
    peak = 2 * (24 * 4) * 64 * tokens + (6 * 4) * 100 * rows * completion  # layers x channels; logits of sampled tokens
    assert optimizer_bytes(model, [stub_optimizer(model)]) == optimizer
    assert training_peak_bytes(model.config, rows, completion, prompt) == peak
    gb, line = resolve_memory_budget("auto", model, torch.device("cuda"), torch.bfloat16, optimizer=optimizer,
                                     training_peak=peak)
    assert gb == int(0.9 * (GiB - optimizer - decode_weights - peak)) / GiB
    assert line.startswith("KV cache budget (--memory-budget-gb=auto): ")
    # fp32 rollouts copy no weights; optimizer state already there (a resume) is in the free memory already
    resumed = stub_optimizer(model, state={model.wte.weight: {"exp_avg": 0}, model.fc.weight: {"momentum_buffer": 0}})
    assert optimizer_bytes(model, [resumed]) == grads
    gb, _ = resolve_memory_budget("auto", model, torch.device("cuda"), torch.float32, optimizer=grads,
                                  training_peak=peak)
    assert gb == int(0.9 * (GiB - grads - peak)) / GiB


def test_auto_off_cuda_is_the_fixed_default_and_a_number_is_taken_as_given(free_memory):
    model = Stub()
    assert resolve_memory_budget("auto", model, torch.device("cpu")) == (
        4.0, "KV cache budget (--memory-budget-gb=auto): 4 GiB, the fixed default on cpu")
    assert resolve_memory_budget(16.0, model, torch.device("cuda"), optimizer=GiB, training_peak=GiB) == (16.0, None)


def test_no_memory_left_is_one_line_naming_the_flag(free_memory):
    free_memory[0] = 64 * 1024  # less than the optimizer will need
    model = Stub()
    with pytest.raises(UserError, match=r"^no device memory left for rollouts: ") as refused:
        resolve_memory_budget("auto", model, torch.device("cuda"),
                              optimizer=optimizer_bytes(model, [stub_optimizer(model)]))
    assert "--" not in str(refused.value)  # the library states the facts; the script names the flags
    line = error_line(refused.value)
    assert "\n" not in line and line.startswith(str(refused.value) + "; pass --memory-budget-gb=N to choose")


@pytest.mark.parametrize("text", ["0", "-1", "nan", "lots"])
def test_a_bad_budget_is_refused(text):
    """A SettingError of memory_budget_gb (the facts); the command line shows it under the flag's name."""
    with pytest.raises(SettingError, match="^memory_budget_gb must be auto or a number of GiB > 0") as refused:
        parse_budget(text)
    assert error_line(refused.value) == f"--memory-budget-gb must be auto or a number of GiB > 0, got {text!r}"
    assert parse_budget("auto") == spec.AUTO and parse_budget("2.5") == 2.5


def test_the_training_reserve_counts_each_prompt_and_one_chunk_of_logits():
    """A forward of 64 rows spans questions: its prompts each count once; the chunked head holds one chunk of
    logits (nanochat/model/head.py), the whole head every sampled token's: by hand, at nanochat's d20 shapes."""
    config = SimpleNamespace(n_layer=20, n_embd=1280, vocab_size=65536)
    per_token = 20 * training_memory.ACTIVATION_BYTES_PER_CHANNEL * 1280
    logit = training_memory.LOGIT_BYTES_PER_ENTRY * 65536
    whole = training_peak_bytes(config, 64, 256, 100, prompts=5)
    assert whole == per_token * (64 * 256 + 5 * 100) + logit * 64 * 256
    chunked = training_peak_bytes(config, 64, 256, 100, prompts=5, head_tokens=2048)
    assert chunked == per_token * (64 * 256 + 5 * 100) + logit * 2048
    assert training_peak_bytes(config, 16, 256, 100) == per_token * (16 * 256 + 100) + logit * 16 * 256


def test_the_decode_weights_reserve_is_what_decode_weights_holds():
    """bf16 rollouts: a bf16 copy of every matmul weight (the q/k/v concatenations among them); fp32 rollouts: the
    fp32 q/k/v concatenations alone (nanochat/engine/decode_weights.py), measured on what DecodeWeights allocates."""
    from nanochat.engine.decode_weights import DecodeWeights
    model = GPT(GPTConfig(sequence_len=32, vocab_size=96, n_layer=2, n_head=2, n_kv_head=1, n_embd=32))
    for dtype in (torch.float32, torch.bfloat16):
        weights = DecodeWeights(model)
        weights.refresh(dtype if dtype != torch.float32 else None)
        storages = [t.untyped_storage() for t in list(weights.copies) + list(weights.fused or [])]
        held = {s.data_ptr(): s.nbytes() for s in storages}  # a q/k/v copy is a view of its concatenation
        assert spec.decode_weight_bytes(model, dtype) == sum(held.values()) > 0


def test_cudas_auto_train_rows_give_way_when_their_reserve_would_cut_the_rollout(free_memory, capsys):
    """nanochat's d20 (102,400 bytes a bf16 cached token; a row 256 + 2 x 300 / 16 = 293.5 tokens): with 70 GiB free,
    64 trained rows a forward reserve a 63.9 GiB training peak, leaving 0.9 x (70 - 0.9 - 63.9) = 4.7 GiB, ~171 rows:
    the step's 256 rollout rows would need two passes, so auto takes 16 rows (a 21.8 GiB reserve, 42.6 GiB of KV).
    With 135 GiB free (an H200) 64 stay; rows given by --train-rows are never changed; off CUDA nothing is reserved."""
    from nanochat.rl.plan import resolve_memory
    with torch.device("meta"):
        d20 = GPT(GPTConfig(sequence_len=2048, vocab_size=65536, n_layer=20, n_head=10, n_kv_head=10, n_embd=1280))

    def rows_and_budget(free_gib, train_rows=0, device="cuda", rows=64):
        free_memory[0] = free_gib * GiB
        config = SimpleNamespace(memory_budget_gb="auto", max_new_tokens=256, num_samples=16, train_rows=train_rows,
                                 device_batch_size=8)
        rows, budget = resolve_memory(config, d20, torch.device(device), [], rows, "bfloat16", rollout_rows=256,
                                      prompt_tokens=300)
        return rows, round(budget, 1)

    assert rows_and_budget(70) == (16, 42.6)
    assert "training: 16 trained rows per forward, not 64: a forward of 64 would leave too little memory for a " \
           "step's 256 rollout rows at once" in capsys.readouterr().out
    assert rows_and_budget(135) == (64, 63.2)
    assert rows_and_budget(70, train_rows=64) == (64, 4.7)
    assert rows_and_budget(70, device="cpu", rows=16) == (16, 4.0)


def test_a_distillation_teachers_forward_is_reserved_beside_trainings(free_memory):
    """--teacher: the teacher's no-grad forward of a training chunk runs while the student's activations are held, so
    the auto budget reserves it too: two layers' activations of the chunk's tokens at the teacher's width and one
    chunk of its logits (a d26 teacher of a d20: 16 rows of 256 tokens and 2 prompts of up to 2048; the teacher's
    weights are in memory already, measured with the free memory)."""
    from nanochat.model.head import HEAD_CHUNK_TOKENS
    from nanochat.rl.plan import resolve_memory
    with torch.device("meta"):
        d20 = GPT(GPTConfig(sequence_len=2048, vocab_size=65536, n_layer=20, n_head=10, n_kv_head=10, n_embd=1280))
        d26 = GPT(GPTConfig(sequence_len=2048, vocab_size=65536, n_layer=26, n_head=13, n_kv_head=13, n_embd=1664))
    free_memory[0] = 135 * GiB
    config = SimpleNamespace(memory_budget_gb="auto", max_new_tokens=256, num_samples=16, train_rows=16,
                             device_batch_size=8)
    budgets = [resolve_memory(config, d20, torch.device("cuda"), [], 16, "bfloat16", teacher=teacher)[1]
               for teacher in (None, d26)]
    tokens = 16 * 256 + 2 * 2048
    teacher_bytes = 2 * (24 * 4) * 1664 * tokens + (6 * 4) * 65536 * min(16 * 256, HEAD_CHUNK_TOKENS)
    assert training_memory.teacher_forward_bytes(d26.config, 16, 256, 2048, 2, min(16 * 256, HEAD_CHUNK_TOKENS)) \
        == teacher_bytes
    assert (budgets[0] - budgets[1]) * GiB == pytest.approx(0.9 * teacher_bytes, abs=2)
