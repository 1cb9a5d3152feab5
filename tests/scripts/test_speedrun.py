"""speedrun.sh at tiny size: every stage (GSM8K from a local copy, tokenizer and SFT bootstrap, eval, RL, eval,
report) runs and leaves its files; a second run reuses the bootstrapped checkpoint instead of training again."""

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO

# a band every model is in: the bootstrap SFT stops at its first check (step 2 of at most 3)
TINY = {"SPEEDRUN_SKIP_INSTALL": "1", "SPEEDRUN_DEVICE": "cpu", "SPEEDRUN_VOCAB_SIZE": "300", "SPEEDRUN_DEPTH": "1",
        "SPEEDRUN_SFT_STEPS": "3", "SPEEDRUN_SFT_BAND": "0:1", "SPEEDRUN_SFT_CHECK_EVERY": "2", "SPEEDRUN_RL_STEPS": "2", "SPEEDRUN_EVAL_EXAMPLES": "3", "SPEEDRUN_EVAL_EVERY": "-1",
        "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def run_speedrun(base, gsm8k_dir):
    # the interpreter running the tests, first on PATH, stands in for the venv speedrun would create
    env = {**os.environ, **TINY, "NANOCHAT_BASE_DIR": str(base), "NANOCHAT_GSM8K_DIR": str(gsm8k_dir),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    proc = subprocess.run(["bash", str(REPO / "speedrun.sh")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, gsm8k_dir):
    base = tmp_path_factory.mktemp("speedrun") / "nanochat"
    return base, run_speedrun(base, gsm8k_dir)


@pytest.mark.slow
def test_stages_run_in_order_and_leave_their_files(first_run, gsm8k_dir):
    base, out = first_run
    stages = re.findall(r"^=== \[\d\d:\d\d\] (\d)/5", out, re.MULTILINE)
    assert stages == ["1", "2", "3", "4", "5"]
    # GSM8K copied from the local directory, byte for byte
    for split in ("train", "test"):
        assert (base / "data" / "gsm8k" / f"{split}.jsonl").read_bytes() == (gsm8k_dir / f"{split}.jsonl").read_bytes()
    # bootstrap: a tokenizer of the asked size and a d1 SFT checkpoint where the held-out accuracy band stopped it
    assert "bootstrapping a d1 model on the arithmetic task" in out
    assert (base / "tokenizer" / "tokenizer.pkl").is_file() and (base / "tokenizer" / "token_bytes.pt").is_file()
    from nanochat.tokenizer import Tokenizer
    assert Tokenizer.from_directory(str(base / "tokenizer")).get_vocab_size() == 300
    assert re.search(r"^stop: step 2/3 \| held-out pass@1 \d\.\d{4} in the band \[0(\.0)?, 1(\.0)?\]", out, re.MULTILINE)
    assert sorted(p.name for p in (base / "chatsft_checkpoints" / "d1").glob("model_*.pt")) == ["model_000002.pt"]
    # RL wrote its final checkpoint; both evals wrote their JSON on the arithmetic test split
    assert sorted(p.name for p in (base / "chatrl_checkpoints" / "d1").glob("model_*.pt")) == ["model_000001.pt"]
    for source in ("sft", "rl"):
        result = json.loads((base / "report" / f"chat_eval_{source}.json").read_text())
        assert result["source"] == source and result["task"] == "arithmetic" and result["num_questions"] == 3
        pass1 = result["pass@k_unbiased"]["1"]
        assert f"{source:>3}: greedy pass@1 {result['greedy_pass@1']:.4f}, sampled pass@1 {pass1:.4f}" in out
    report = base / "report" / "report.md"
    assert "## Chat RL" in report.read_text()
    from PIL import Image
    for plot in ("chat-rl-reward.png", "chat-rl-completion-len.png"):  # no pass@k plot: this tiny run never evaluates
        assert f"]({plot})" in report.read_text()
        with Image.open(base / "report" / plot) as image:
            image.load()
            assert image.size[0] > 0 and image.size[1] > 0
    assert f"report: {report} (total " in out


@pytest.mark.slow
def test_second_run_reuses_the_bootstrapped_checkpoint(first_run, gsm8k_dir):
    base, _ = first_run
    sft = base / "chatsft_checkpoints" / "d1" / "model_000002.pt"
    before = sft.stat().st_mtime_ns
    out = run_speedrun(base, gsm8k_dir)
    assert "using the SFT checkpoint an earlier speedrun bootstrapped" in out
    assert "bootstrapping" not in out
    assert sft.stat().st_mtime_ns == before
    assert (base / "report" / "chat_eval_rl.json").is_file()
