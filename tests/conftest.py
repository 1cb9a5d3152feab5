"""Shared fixtures: the committed GSM8K sample, a tiny trained tokenizer, a throwaway $NANOCHAT_BASE_DIR and a
random SFT checkpoint in it. Plain helpers (tiny models, base-dir writers) are in helpers.py.

The whole session runs with the Hugging Face hub offline and with empty HF / nanochat caches, so no test can
touch the network or the user's real data, whatever the machine has cached.

Pretend CUDA: the suite must hold on a machine with a GPU, and CI has none. So on a machine without CUDA the
whole session runs with torch.cuda.is_available() True and device_count() 1, in this process (the `pretend_cuda`
fixture) and in every Python process the tests start, scripts, torchrun ranks and multiprocessing children
included (tests/support/pretend_cuda/sitecustomize.py, on their PYTHONPATH). Code that picks CUDA by availability where
the test meant the CPU then fails here, where it first uses CUDA, with an error naming this guard, as it would
run on the GPU there; a test that means the CPU says so (device="cpu", --device-type=cpu). A test that needs a
real GPU is marked `cuda` and skips on helpers.HAS_CUDA (read before any patching), not on
torch.cuda.is_available(). Where a GPU is really there, the guard is off."""

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

# tests/ is in folders by package (none of them a package: no __init__.py); support/ holds the helpers and workers.
# Both go on sys.path for the session, every folder's too: some tests import another folder's test module
TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(TESTS / "support")] + sorted(str(d) for d in TESTS.iterdir() if any(d.glob("test_*.py")))

if shutil.which("nvidia-smi") is None:
    # Triton's interpreter for the kernels' tests on a CPU (tests/kernels/): Triton reads it once, when it is first
    # imported, so before anything imports it. Not on a GPU machine: there Triton compiles (Inductor's kernels too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from graph_capture import use_recorded_graphs
from helpers import FIXTURES, HAS_CUDA, PRETEND_CUDA_DIR, make_sft_checkpoint

TINY_VOCAB_SIZE = 400


def load_pretend_cuda():
    """tests/support/pretend_cuda/sitecustomize.py as a module of this process (its folder is not on sys.path here)."""
    spec = importlib.util.spec_from_file_location("pretend_cuda", PRETEND_CUDA_DIR / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PRETEND_CUDA = load_pretend_cuda()


def pytest_configure(config):
    # Under pytest-xdist (tests/run.sh runs one worker per core) each worker computes on one thread, and so does every
    # process a test starts: two workers of two OpenMP threads each on two cores wait on each other's spinning
    # threads (measured ~10x slower), one thread each keeps both cores busy without that
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    # before any test module imports datasets / huggingface_hub: they read these once, at import
    root = tempfile.mkdtemp(prefix="nanochat-tests-")
    config._nanochat_tmp_root = root
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HOME"] = os.path.join(root, "hf")
    for var in ("HF_DATASETS_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "NANOCHAT_GSM8K_DIR"):
        os.environ.pop(var, None)
    os.environ["NANOCHAT_BASE_DIR"] = os.path.join(root, "nanochat")  # tests that need one use `base_dir`
    if not HAS_CUDA:  # subprocesses that inherit this environment (helpers.PYTHONPATH has the folder too)
        os.environ[PRETEND_CUDA.ENV] = "1"
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PRETEND_CUDA_DIR), os.environ.get("PYTHONPATH")]))


# Fixtures that cost seconds to make (a model trained from scratch, runs of several processes): every test that
# uses one, directly or through another fixture, is `slow` (the quick tier, `-m "not slow"`, would make it)
SLOW_FIXTURES = {"one_step_sft", "uninterrupted", "disk_full_on_rank1", "two_ranks", "first_run"}


# Under xdist (tests/run.sh, with --no-loadscope-reorder: workers take files in collection order) these files go first,
# longest first: each takes a minute or more of one core (pytest --durations on the 2-core development machine), and
# one started last is the suite's tail while the other worker idles (the longest-first rule of scheduling). A file
# missing here costs wall time only; the order of tests within a file never changes.
FILES_FIRST = ("optim/test_fp16.py", "scripts/test_speedrun.py", "checkpoints/test_resume_ranks.py",
               "checkpoints/test_resume.py", "compiling/test_block_regions.py", "checkpoints/test_faults.py",
               "rl/test_learning.py", "compiling/test_compile.py", "kernels/test_triton_kernels.py",
               "gpu/test_gpu_setup.py", "scripts/test_gsm8k_chat_rl.py", "rl/test_dynamic_sampling.py",
               "rl/test_steady_state.py")


# NANOCHAT_TEST_ORDER=reverse runs the files in reversed order (each file's tests in their own): with
# NANOCHAT_TEST_WORKERS=0, the check that no test leans on what an earlier one left (tests/run.sh's header)
ORDER_ENV = "NANOCHAT_TEST_ORDER"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    order = os.environ.get(ORDER_ENV, "files")
    if order not in ("files", "reverse"):
        raise pytest.UsageError(f"{ORDER_ENV} must be files or reverse, got {order!r}")
    files = list(dict.fromkeys(item.fspath for item in items))
    if order == "reverse":
        files = files[::-1]
    elif os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects alike, so the controller sees this order
        first = {TESTS / name: i for i, name in enumerate(FILES_FIRST)}
        files.sort(key=lambda path: first.get(Path(path), len(first)))  # stable: the others keep file order
    rank = {path: i for i, path in enumerate(files)}
    items.sort(key=lambda item: rank[item.fspath])  # stable: a file's tests keep their order


@pytest.fixture(scope="session", autouse=True)
def pretend_cuda():
    """torch.cuda answers like a one-GPU machine for the whole session (the module docstring): session- and
    module-scoped fixtures that run chat_sft or chat_rl in-process come before any per-test fixture, so the
    guard is session-wide. The `cuda` tests never run under it: they skip on helpers.HAS_CUDA, which is False
    wherever the guard is on."""
    with pytest.MonkeyPatch.context() as mp:
        if not HAS_CUDA:
            PRETEND_CUDA.pretend_cuda(torch.cuda, mp.setattr)
        yield


TEST_SEED = 1234  # every test's global random generators start here


@pytest.fixture(autouse=True)
def same_process_state_for_every_test():
    """Every test starts from the same process state and leaves none behind, so the suite passes in any order and
    in one process (issue 67: a rollout's lengths, drawn by a model initialized from the global generator, depended
    on the tests that ran before it in its process): Python's, numpy's and torch's global generators seeded alike;
    the environment, working directory, torch's threads, default dtype, grad mode and autocast cache as before it.
    Not Python's recursion limit: Inductor raises it once for the process and needs it raised; the one test that
    depends on the default pins it itself."""
    import random

    import numpy as np
    random.seed(TEST_SEED)
    np.random.seed(TEST_SEED)
    torch.manual_seed(TEST_SEED)
    env, cwd, threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
    dtype, grad, autocast_cache = torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_autocast_cache_enabled()
    yield
    if dict(os.environ) != env:
        os.environ.clear()
        os.environ.update(env)
    if os.getcwd() != cwd:
        os.chdir(cwd)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)
    torch.set_autocast_cache_enabled(autocast_cache)


def pytest_unconfigure(config):
    root = getattr(config, "_nanochat_tmp_root", None)
    if root:
        shutil.rmtree(root, ignore_errors=True)


def fixture_texts():
    """Every question and answer of the committed GSM8K sample."""
    from tasks.gsm8k import read_jsonl_rows
    rows = read_jsonl_rows(FIXTURES / "gsm8k" / "train.jsonl") + read_jsonl_rows(FIXTURES / "gsm8k" / "test.jsonl")
    return [row["question"] + "\n" + row["answer"] for row in rows]


@pytest.fixture(scope="session")
def gsm8k_dir():
    """tests/fixtures/gsm8k: 12 train and 8 test rows copied from GSM8K, in their original relative order."""
    return FIXTURES / "gsm8k"


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A 400-token BPE (391 bytes+merges, 9 specials) trained on the fixture text in a few milliseconds."""
    from nanochat.tokenizer import Tokenizer
    tokenizer = Tokenizer.train_from_iterator(iter(fixture_texts()), TINY_VOCAB_SIZE)
    assert tokenizer.get_vocab_size() == TINY_VOCAB_SIZE  # the fixture text has enough pairs to merge
    return tokenizer


@pytest.fixture
def base_dir(tmp_path, monkeypatch, tiny_tokenizer, gsm8k_dir):
    """A fresh $NANOCHAT_BASE_DIR holding the tiny tokenizer, with $NANOCHAT_GSM8K_DIR at the fixture."""
    base = tmp_path / "nanochat"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    monkeypatch.setenv("NANOCHAT_GSM8K_DIR", str(gsm8k_dir))
    tiny_tokenizer.save(base / "tokenizer")
    return base


@pytest.fixture
def sft(base_dir, tiny_tokenizer):
    """`base_dir` with a random tiny model as its SFT checkpoint (helpers.make_sft_checkpoint), which chat_rl and
    chat_cli load by default. Returns the model."""
    return make_sft_checkpoint(base_dir, tiny_tokenizer.get_vocab_size())


# SFT stops on held-out sampled pass@1, not at a step count: on the steep part of the curve another CPU's kernels
# move the accuracy at a fixed step by more than the learning test's precondition allows (issue 28)
ONE_STEP_SFT_BAND = "0.25:0.5"
ONE_STEP_SFT_MAX_STEPS = 300


@pytest.fixture(scope="session")
def one_step_sft(tmp_path_factory):
    """A $NANOCHAT_BASE_DIR with a 512-token tokenizer trained on one-step arithmetic text and a 2-layer model
    SFT'd from scratch on that task in fp32, stopped on purpose at partial credit, so RL has room to improve it:
    chat_sft's --stop-at-pass1 stops it at the first check (every 5 steps) whose sampled pass@1 (T=1, 4 samples)
    on 64 held-out train questions is in ONE_STEP_SFT_BAND, with the lr decaying over ONE_STEP_SFT_MAX_STEPS.
    Measured on the 2-core development machine (AMD EPYC, AVX2): held-out pass@1 0.03 at step 65, 0.09 at 70,
    0.21 at 75, stopped at step 80 with 0.344 (0.358 on the learning test's 256 test questions x 8 samples), in
    ~18 s of which ~10 s are the 16 checks. The fixed 140 steps this replaces gave 0.38 on the test questions
    here but 0.77 on an Intel AVX512 CPU, where the learning test's precondition failed."""
    import contextlib
    import io

    from nanochat.cli import run_main
    from nanochat.tokenizer import Tokenizer
    from scripts import chat_sft
    from tasks.arithmetic import Arithmetic

    base = tmp_path_factory.mktemp("one_step_sft") / "nanochat"
    train = Arithmetic(split="train", difficulty=1, size=2000)
    texts = []
    for i in range(len(train)):
        user, assistant = train[i]["messages"]
        texts.append(user["content"] + "\n" + "".join(part["text"] for part in assistant["content"]))
    Tokenizer.train_from_iterator(iter(texts), 512).save(base / "tokenizer")
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()):
        mp.setenv("NANOCHAT_BASE_DIR", str(base))
        torch.set_num_threads(1)  # a 2-layer model gains nothing from threads; spinning OpenMP threads cost a lot
        run_main(chat_sft.main, ["--depth=2", "--tasks=arithmetic", "--arithmetic-difficulty=1",
                                 f"--num-steps={ONE_STEP_SFT_MAX_STEPS}", f"--stop-at-pass1={ONE_STEP_SFT_BAND}",
                                 "--stop-check-every=5", "--stop-check-max-tokens=64", "--eval-every=-1", "--device-type=cpu",
                                 "--dtype=float32", "--examples-per-step=16", "--device-batch-size=16"])
        torch.set_num_threads(threads)
    return base


@pytest.fixture
def cpu_graphs(monkeypatch):
    """Engines made with decode="graph" run on the CPU with CUDA graphs' semantics (graph_capture's recorded
    graphs). Returns the capture and replay counts."""
    return use_recorded_graphs(monkeypatch)
