"""What several test files share: where the repo is, tiny GPT models, and base dirs holding a checkpoint.

Import it as `from helpers import ...`: tests/conftest.py puts tests/support/ (here) on sys.path, the workers run
from it, and subprocesses get the repo and it through PYTHONPATH below (with the pretend-CUDA guard's folder, see
conftest).
"""

import os
import shutil
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import torch

from nanochat.checkpoints.store import save_checkpoint
from nanochat.model.gpt import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
SUPPORT = REPO / "tests" / "support"  # these helpers and the workers, on every test process's sys.path
# whether torch really sees a GPU, read here, before conftest's pretend-CUDA guard patches torch.cuda (or, in a
# process started under the guard, from the real answer it keeps): the `cuda` tests skip on it, and the guard stays
# off where it is True
HAS_CUDA = getattr(torch.cuda, "real_is_available", torch.cuda.is_available)()
# its sitecustomize.py carries the guard into subprocesses (conftest's docstring)
PRETEND_CUDA_DIR = REPO / "tests" / "support" / "pretend_cuda"
# for a subprocess: nanochat, scripts and tasks from the repo, user-style tasks (rl_toy_task) from tests/, then what
# the test session was given (a GPU machine's packages installed with --target, say: dropped, the subprocesses of
# the first GPU run could not import rustbpe)
PYTHONPATH = os.pathsep.join([str(p) for p in [REPO, SUPPORT] + ([] if HAS_CUDA else [PRETEND_CUDA_DIR])]
                             + [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

# The fp32 sampler-trainer gap: decoding (KV cache, one token at a time) and training (whole sequences) compute the
# same fp32 log-softmax along different paths, so a sampled token's two log-probabilities differ by a few roundings
# of the log-probability itself. Measured max: 1 ulp (9.5e-7) on the six generation fixtures, eager and static
# decoding, under ATen's AVX512, AVX2 and default kernels, 1 or 2 threads (1.25 ulp once, under AVX2); 2.1e-6 (1.1
# ulp) in chat_rl's tiny run; 4.8e-7 in bench_rl's. A log-probability in (-32, 0) has an ulp of at most 2**-19 =
# 1.9e-6; the bound is 4 of those, so the CPU's kernel choice has room and a 1e-5 decode error fails.
FP32_GAP_BOUND = 4 * 2.0 ** -19  # 7.6e-6

# Near-ties: where two decodes of the same fp32 model choose different greedy tokens (nanochat/engine/agreement.py measures
# the fp32 logit margin of the two choices at a row's first difference), the margin must be within what their
# roundings can move a logit.
# bf16 keeps 8 significant bits: a logit between 8 and 16 (the softcap is 15) is rounded to a multiple of 1/16,
# so two fp32 logits closer than two such steps can swap order under bf16.
BF16_NEAR_TIE = 0.125
BF16_MIN_AGREEMENT = 0.9  # measured 0.996 (0.95 with an earlier fixture); a guard against bf16 going wrong wholesale, not the main check
# Two fp32 paths (the compiled decode step and the eager one) compute the same logits, rounded in other orders and
# fusions: per logit they agree within the scale FP32_GAP_BOUND measures for two paths' log-probabilities (a logit
# minus a log-sum-exp, an average of logits). Where path 1 chooses a (z1_a >= z1_b) and path 2 chooses b
# (z2_b >= z2_a), each path's margin z_a - z_b is within 2 * FP32_GAP_BOUND of 0, and the margin read from a third
# path (agreement.py's full forward) within 4 * FP32_GAP_BOUND: 3.1e-5, 4000 times tighter than bf16's bound.
FP32_NEAR_TIE = 4 * FP32_GAP_BOUND

# ----------------------------------------------------------------------------- tiny models

# 16 positions: the short window (8) and the long one (16) both bind in sequences of a few dozen tokens.
# 300 tokens pad to 320 rows, so the padding shows in state-dict shapes.
TINY_CONFIG = dict(sequence_len=16, vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, window_pattern="L")


def tiny_config(**overrides):
    """A GPTConfig of TINY_CONFIG with `overrides` (GPTConfig's own field names)."""
    return GPTConfig(**{**TINY_CONFIG, **overrides})


def random_model(config, seed=0, noise=0.3, generation=None, fresh=False):
    """GPT(config) in eval mode with every parameter random, from torch.manual_seed(seed).

    init_weights zeroes both c_proj (attention and MLP would contribute nothing) and sets the lambdas to 1/0,
    so every parameter is then moved by noise * N(0, 1). fresh=True draws every parameter afresh instead:
    noise * N(0, 1), plus 0.5 on the vectors (the lambdas). noise=0 keeps init_weights' model.
    generation: nanochat's generation to build (None: GPT's default)."""
    torch.manual_seed(seed)
    model = GPT(config) if generation is None else GPT(config, generation)
    model.init_weights()
    if noise:
        with torch.no_grad():
            for p in model.parameters():
                if fresh:
                    p.copy_(torch.randn_like(p) * noise + (0.5 if p.ndim == 1 else 0.0))
                else:
                    p.add_(torch.randn_like(p) * noise)
    return model.eval()


# ----------------------------------------------------------------------------- base dirs

SFT_CONFIG = dict(sequence_len=128, n_layer=2, n_head=2, n_kv_head=1, n_embd=64, window_pattern="SL")
# a chat_rl run on make_sft_checkpoint's model that takes seconds on a CPU; tests add --num-steps and more
TINY_RL_FLAGS = ["--task=rl_toy_task:ParityTask", "--device-type=cpu", "--dtype=float32", "--examples-per-step=4",
                 "--num-samples=4", "--device-batch-size=2", "--max-new-tokens=12", "--eval-every=-1",
                 "--temperature=1.0"]


def make_sft_checkpoint(base_dir, vocab_size, seed=0, noise=0.2, tag="d2", step=0, **overrides):
    """A random tiny model (SFT_CONFIG with `overrides`, see random_model for seed and noise) saved as step `step`
    where chat_rl looks for an SFT checkpoint: base_dir/chatsft_checkpoints/<tag> (d2). Returns the model."""
    config = tiny_config(**{**SFT_CONFIG, "vocab_size": vocab_size, **overrides})
    model = random_model(config, seed, noise)
    save_checkpoint(str(Path(base_dir) / "chatsft_checkpoints" / tag), step, model.state_dict(), None,
                    {"model_config": asdict(config), "step": step})
    return model


GENERATION_FIXTURES = FIXTURES / "generations"


def generation_reference(name):
    """What nanochat's own code computed on the fixture checkpoint of generation `name` (see test_generations)."""
    return torch.load(GENERATION_FIXTURES / name / "reference.pt", weights_only=True)


def install_generation(base, name, tag="d4"):
    """Fill $NANOCHAT_BASE_DIR `base` with the generation fixtures' tokenizer and the checkpoint of generation
    `name` as chatsft_checkpoints/<tag> (step 5). Returns that checkpoint directory."""
    (base / "tokenizer").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(GENERATION_FIXTURES / "tokenizer" / "tokenizer.pkl", base / "tokenizer" / "tokenizer.pkl")
    target = base / "chatsft_checkpoints" / tag
    target.mkdir(parents=True, exist_ok=True)
    for f in ("model_000005.pt", "meta_000005.json"):
        shutil.copyfile(GENERATION_FIXTURES / name / f, target / f)
    return target


# ----------------------------------------------------------------------------- test doubles

class ScriptedModel(torch.nn.Module):
    """Emits script[k] as the k-th completion token (by cache position), with a small chance of stopping
    when stop_prob > 0: a stand-in that makes the tool state machine and early stops testable exactly."""

    def __init__(self, script, prompt_len, vocab_size, stop_token=None, stop_logit=None):
        super().__init__()
        self.script, self.prompt_len, self.stop_token, self.stop_logit = script, prompt_len, stop_token, stop_logit
        self.config = SimpleNamespace(sequence_len=128, vocab_size=vocab_size, n_layer=1, n_head=1, n_kv_head=1, n_embd=4)
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.forwards = 0

    def get_device(self):
        return self.dummy.device

    def forward(self, idx, cache_step=None):
        return self.logits(self.hidden_states(idx, cache_step))

    def hidden_states(self, idx, cache_step=None):
        """The "hidden state" is already the logits row (the engine's prefill takes hidden states, then logits)."""
        self.forwards += 1
        B, T = idx.shape
        positions = cache_step.positions  # (B, T)
        k = (positions + 1 - self.prompt_len).clamp(min=0, max=len(self.script) - 1)
        logits = torch.full((B, T, self.config.vocab_size), -1e9)
        logits.scatter_(-1, torch.tensor(self.script)[k][..., None], 0.0)
        if self.stop_logit is not None:  # a constant chance to stop at every step
            logits[..., self.stop_token] = self.stop_logit
        return logits

    def logits(self, hidden):
        return hidden


class TableModel(torch.nn.Module):
    """A model whose logits are a learnable table lookup: the gradient of the objective is easy to
    compute independently."""

    def __init__(self, vocab=100):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab))

    def hidden_states(self, idx, cache_step=None):
        return self.table[idx]  # (B, T, V): the "hidden state" is already the logits row

    def hidden_states_shared_prefix(self, prefix, rows, prefix_lengths=None, row_prefix=None):
        return self.table[prefix], self.table[rows]  # a lookup does not depend on what came before

    def logits(self, hidden):
        return hidden

    def sampled_logprobs(self, hidden, targets):
        from nanochat.rl.objective import token_logprobs_and_entropy
        return token_logprobs_and_entropy(self.logits(hidden), targets)


class BigramModel(TableModel):
    """Logits = a table row of the current token, in decoding and in training alike, so the output depends on the
    input ids (forced calculator tokens included). The two paths compute the same log-softmax, up to its last
    rounding (the sampler subtracts a logsumexp, the trainer takes log_softmax), so the sampler-trainer gap is a
    few ulps when each log-probability is matched with its own token, and O(1) when not. The table makes rows
    call the calculator on "2*3" and end at varied steps."""

    def __init__(self, tokenizer):
        vocab = tokenizer.get_vocab_size()
        super().__init__(vocab)
        special = {n: tokenizer.encode_special(n) for n in ("<|python_start|>", "<|python_end|>", "<|assistant_end|>")}
        chain = [special["<|python_start|>"], *tokenizer.encode("2*3"), special["<|python_end|>"]]
        with torch.no_grad():
            self.table.mul_(0.5)
            self.table[:, special["<|python_start|>"]] += 2.5
            self.table[:, special["<|assistant_end|>"]] += 1.5
            for a, b in zip(chain, chain[1:]):
                self.table[a, b] += 12.0
        self.config = SimpleNamespace(sequence_len=256, vocab_size=vocab, n_layer=1, n_head=1, n_kv_head=1, n_embd=4)

    def get_device(self):
        return self.table.device

    def forward(self, idx, cache_step=None):
        return self.table[idx]


# ----------------------------------------------------------------------------- checkpoints

def weights(path):
    """A saved model_<step>.pt's state dict."""
    return torch.load(path, weights_only=True)


def assert_same_weights(a, b):
    """Two state dicts with the same keys and bitwise-equal tensors."""
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def prompt_of(tokenizer, question):
    """The tokens a model completes for a one-turn chat asking `question`."""
    return tokenizer.render_for_completion({"messages": [{"role": "user", "content": question},
                                                         {"role": "assistant", "content": ""}]})
