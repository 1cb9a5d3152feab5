"""
The real-workload comparison with nanochat's own chat_rl, side by side on this machine (the README's tables).

    python tests/support/vs_nanochat.py --nanochat /path/to/nanochat --work /tmp/vs_nanochat [--steps 10]

--nanochat: a checkout of nanochat of 2026-01-31 (dc291c6), the version whose chat_rl this project follows; its
Python needs `tokenizers` (pip install tokenizers) besides what this project installs. What it does:
1. the speedrun's CPU bootstrap (tokenizer, d4 SFT on the arithmetic task, stopped at held-out pass@1 in 0.3-0.6)
   under --work/base, unless already there;
2. that checkpoint in nanochat's value-embedding (`ve`) layout, which dc291c6 loads: value embeddings and their
   gates added as zeros, so the model computes exactly what it did (--work/base_ve);
3. the arithmetic task written as GSM8K jsonl (question, answer with <<expr=result>> calls, #### N), read by both
   loaders: ours from $NANOCHAT_BASE_DIR/data/gsm8k, nanochat's through a stand-in for `datasets` (json only,
   shuffled as `datasets` shuffles);
4. chat_rl (defaults; one eval question at step 0 and no saving, before the timed steps), nanochat's chat_rl,
   chat_rl again, each stopped after --steps step lines past step 0; prints each run's seconds between
   consecutive step lines, their median, and the ratios.
Not part of the test suite (it takes ~10 minutes and a nanochat checkout).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(r"Step \d+/\d+ \| Average reward")  # both chat_rl's step lines start so
DATASETS_STANDIN = '''
"""Stand-in for Hugging Face datasets (written by tests/support/vs_nanochat.py): load_dataset("openai/gsm8k", ...) reads
$GSM8K_JSONL_DIR/<split>.jsonl; shuffle(seed) permutes as datasets does (numpy default_rng(seed).permutation)."""
import json, os
import numpy as np

class Dataset:
    def __init__(self, rows):
        self.rows = rows
    def __len__(self):
        return len(self.rows)
    def __getitem__(self, i):
        return self.rows[int(i)]
    def shuffle(self, seed=None):
        return Dataset([self.rows[i] for i in np.random.default_rng(seed).permutation(len(self.rows))])

def load_dataset(path, *args, split=None, **kwargs):
    if path != "openai/gsm8k":
        raise ValueError(f"stand-in datasets: only openai/gsm8k, not {path}")
    with open(os.path.join(os.environ["GSM8K_JSONL_DIR"], f"{split}.jsonl")) as f:
        return Dataset([json.loads(line) for line in f])
'''


def run(cmd, env, cwd=REPO):
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(cmd, env=env, cwd=cwd, check=True)


def write_gsm8k_jsonl(directory):
    """The arithmetic task's train and test splits as GSM8K jsonl."""
    sys.path.insert(0, str(REPO))
    from tasks.arithmetic import Arithmetic
    directory.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        task = Arithmetic(split=split)
        with open(directory / f"{split}.jsonl", "w") as f:
            for i in range(task.num_examples()):
                user, assistant = task.get_example(i)["messages"]
                question, answer = user["content"], ""
                for part in assistant["content"]:
                    if part["type"] == "text":
                        answer += part["text"]
                    elif part["type"] == "python":
                        expression = part["text"]
                    else:  # python_output: GSM8K writes the call and its result as <<expr=result>>
                        answer += f"<<{expression}={part['text']}>>"
                f.write(json.dumps({"question": question, "answer": answer}) + "\n")


def to_value_embedding_layout(src, dst):
    """The newest SFT checkpoint under src/chatsft_checkpoints/d4 in nanochat's ve layout under dst: zero value
    embeddings (on the layers nanochat gives them: alternate ones ending with the last) and zero gates add nothing
    to the values, so the forward is the checkpoint's own."""
    import torch
    source = src / "chatsft_checkpoints" / "d4"
    step = max(int(p.stem.split("_")[1]) for p in source.glob("model_*.pt"))
    state = torch.load(source / f"model_{step:06d}.pt", map_location="cpu")
    meta = json.loads((source / f"meta_{step:06d}.json").read_text())
    cfg = meta["model_config"]
    wte = state["transformer.wte.weight"]
    kv_dim = cfg["n_kv_head"] * cfg["n_embd"] // cfg["n_head"]
    for layer in range(cfg["n_layer"]):
        if layer % 2 == (cfg["n_layer"] - 1) % 2:
            state[f"value_embeds.{layer}.weight"] = torch.zeros(wte.size(0), kv_dim, dtype=wte.dtype)
            state[f"transformer.h.{layer}.attn.ve_gate.weight"] = torch.zeros(cfg["n_kv_head"], 32, dtype=wte.dtype)
    meta.pop("generation", None)  # nanochat's own meta has no such field
    target = dst / "chatsft_checkpoints" / "d4"
    target.mkdir(parents=True, exist_ok=True)
    torch.save(state, target / f"model_{step:06d}.pt")
    (target / f"meta_{step:06d}.json").write_text(json.dumps(meta, indent=2))
    for name in ("tokenizer", "data"):
        if not (dst / name).is_symlink():
            (dst / name).symlink_to(src / name)


def step_gaps(label, cmd, env, cwd, steps, log, timeout=1800):
    """Run cmd until it has printed steps + 1 step lines; the seconds between consecutive ones. A run that ends
    or is still going after `timeout` seconds before that is an error naming its log."""
    stamps, start = [], time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env={**env, "PYTHONUNBUFFERED": "1"}, cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        watchdog = threading.Timer(timeout, proc.kill)
        watchdog.start()
        for line in proc.stdout:
            out.write(f"{time.time() - start:8.2f} {line}")
            if STEP_LINE.search(line):
                stamps.append(time.time())
                if len(stamps) > steps:
                    break
        watchdog.cancel()
        proc.kill()
        proc.wait()
    if len(stamps) <= steps:
        raise SystemExit(f"{label}: {len(stamps)} of {steps + 1} step lines before it ended (exit code "
                         f"{proc.returncode}); see {log}")
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    print(f"{label}: s/step {' '.join(f'{g:.2f}' for g in gaps)} | median {statistics.median(gaps):.2f} ({log})",
          flush=True)
    return statistics.median(gaps)


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--nanochat", type=Path, required=True, help="a nanochat checkout (dc291c6)")
    p.add_argument("--work", type=Path, required=True, help="where the models, data and logs go")
    p.add_argument("--steps", type=int, default=10, help="step-to-step gaps timed per run")
    args = p.parse_args()
    work, python = args.work.resolve(), sys.executable
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))}
    base, base_ve, jsonl, standin = work / "base", work / "base_ve", work / "gsm8k_jsonl", work / "standin"
    if not (jsonl / "test.jsonl").exists():
        write_gsm8k_jsonl(jsonl)
    ours = {**env, "NANOCHAT_BASE_DIR": str(base)}
    if not list((base / "chatsft_checkpoints").glob("d4/model_*.pt")):
        run([python, "-m", "scripts.prepare_gsm8k", "--from", jsonl], ours)
        run([python, "-m", "scripts.tok_train", "--vocab-size=2048"], ours)
        run([python, "-m", "scripts.chat_sft", "--depth=4", "--tasks=arithmetic", "--num-steps=300", "--eval-every=-1",
             "--device-type=cpu", "--stop-at-pass1=0.3:0.6", "--stop-check-every=5", "--stop-check-questions=32",
             "--stop-check-samples=4", "--stop-check-max-tokens=64"], ours)
    to_value_embedding_layout(base, base_ve)
    (standin / "datasets").mkdir(parents=True, exist_ok=True)
    (standin / "datasets" / "__init__.py").write_text(textwrap.dedent(DATASETS_STANDIN).lstrip())
    common = ["--device-type=cpu", "--eval-examples=1", "--save-every=100000"]
    ours_cmd = [python, "-m", "scripts.chat_rl", *common, "--model-generation=ve"]
    ours_env = {**env, "NANOCHAT_BASE_DIR": str(base_ve)}
    theirs_env = {**env, "NANOCHAT_BASE_DIR": str(base_ve), "GSM8K_JSONL_DIR": str(jsonl),
                  "PYTHONPATH": os.pathsep.join([str(args.nanochat.resolve()), str(standin)] +
                                                ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))}
    first = step_gaps("chat_rl (this project)", ours_cmd, ours_env, REPO, args.steps, work / "ours_1.log")
    nanochat = step_gaps("nanochat chat_rl", [python, "-m", "scripts.chat_rl", *common], theirs_env,
                         args.nanochat.resolve(), args.steps, work / "nanochat.log")
    second = step_gaps("chat_rl (this project) again", ours_cmd, ours_env, REPO, args.steps, work / "ours_2.log")
    print(f"x nanochat: {nanochat / first:.2f}, {nanochat / second:.2f}")


if __name__ == "__main__":
    main()
