"""
GSM8K: grade-school math word problems (https://huggingface.co/datasets/openai/gsm8k, MIT license).

Each example becomes a two-message conversation. The reference answer's calculator annotations
`<<48/2=24>>` become tool-use parts, so SFT/RL teach the model to call the calculator:

    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    -> [text "Natalia sold 48/2 = ", python "48/2", python_output "24", text "24 clips in May.\n#### 72"]

Data comes from a local directory of `train.jsonl` / `test.jsonl` (fields `question`, `answer`, in the
hub's row order) when there is one, else from the Hugging Face hub. Either way the rows are shuffled as
`datasets.Dataset.shuffle(seed=42)` shuffles them (numpy's `default_rng(42).permutation`), so example i is the
same question whatever the source; a local copy needs no `datasets` import (a GPU box without it works).
Local directory, first that applies: the `data_dir` argument, $NANOCHAT_GSM8K_DIR, or
$NANOCHAT_BASE_DIR/data/gsm8k if it holds the split (`python -m scripts.prepare_gsm8k` fills it).
The socratic subset lives in a `socratic/` subdirectory of a local directory.
"""

import json
import os
import re
import urllib.error
import urllib.request

import numpy as np

from nanochat.common import get_base_dir
from nanochat.errors import UserError
from tasks.common import (  # noqa: F401  (nanochat's tasks/gsm8k.py defines it: user code imports it from here)
    FinalAnswerTask, extract_answer)

SUBSETS = ("main", "socratic")
SPLITS = ("train", "test")
HUB_NAME = "openai/gsm8k"
SHUFFLE_SEED = 42

TOOL_CALL_RE = re.compile(r"<<([^>]+)>>")  # a calculator annotation: <<expr=result>>


class GSM8KUnavailableError(UserError):
    """GSM8K `subset`/`split` is not where it was asked to be read from, or there is no local copy and the
    hub cannot provide it."""

    def __init__(self, subset, split, problem):
        super().__init__(f"GSM8K {subset}/{split}: {problem}; "
                         f"set NANOCHAT_GSM8K_DIR to a directory with train.jsonl/test.jsonl")
        self.subset, self.split = subset, split


def answer_to_parts(answer):
    """Split a GSM8K reference answer into assistant parts (text / python / python_output).

    Every annotation is preceded by a text part and the answer ends with one (any of them may be empty),
    as re.split would give; the result is split on the last "=" (no "=" -> empty output)."""
    parts, pos = [], 0
    for match in TOOL_CALL_RE.finditer(answer):
        inner = match.group(1)
        expr, _, result = inner.rpartition("=") if "=" in inner else (inner, "", "")
        parts.append({"type": "text", "text": answer[pos:match.start()]})
        parts.append({"type": "python", "text": expr})
        parts.append({"type": "python_output", "text": result})
        pos = match.end()
    parts.append({"type": "text", "text": answer[pos:]})
    return parts


def split_filename(data_dir, subset, split):
    """Where a local directory keeps one subset's split."""
    return os.path.join(data_dir, f"{split}.jsonl") if subset == "main" else os.path.join(data_dir, subset, f"{split}.jsonl")


def read_jsonl_rows(path):
    """Rows {"question", "answer"} of a GSM8K jsonl file, validated; UserError naming the bad line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{line_no} is not valid JSON ({e}); GSM8K files hold one JSON object per line") from e
            if not (isinstance(row, dict) and isinstance(row.get("question"), str) and isinstance(row.get("answer"), str)):
                raise UserError(f"{path}:{line_no} lacks string fields 'question' and 'answer'")
            rows.append({"question": row["question"], "answer": row["answer"]})
    if not rows:
        raise UserError(f"{path} has no rows; expected GSM8K examples, one JSON object per line")
    return rows


def find_local_dir(subset, split, data_dir=None):
    """The local directory to read, or None to use the hub. An explicitly given directory must hold the split."""
    explicit = data_dir or os.environ.get("NANOCHAT_GSM8K_DIR")
    if explicit:
        path = split_filename(explicit, subset, split)
        if not os.path.isfile(path):
            where = "data_dir" if data_dir else "NANOCHAT_GSM8K_DIR"
            hint = f" (the {subset} subset goes in a '{subset}/' subdirectory)" if subset != "main" else ""
            raise GSM8KUnavailableError(subset, split, f"{path} does not exist ({where}={explicit}){hint}")
        return explicit
    default = os.path.join(get_base_dir(), "data", "gsm8k")
    return default if os.path.isfile(split_filename(default, subset, split)) else None


def hub_offline():
    """HF_HUB_OFFLINE is set: the datasets library reads only its cache."""
    import datasets
    return bool(datasets.config.HF_HUB_OFFLINE)


def hub_reachable(timeout=3.0):
    """A quick probe, because the datasets library retries an unreachable hub for ~25 s before failing."""
    from huggingface_hub import constants
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return True  # the server answered
    except (urllib.error.URLError, OSError):
        return False
    return True


def shuffled(rows, seed=SHUFFLE_SEED):
    """rows in the order datasets.Dataset.shuffle(seed=seed) gives: the permutation numpy's default_rng(seed)
    draws for their number (tests/tasks/test_gsm8k.py checks the two agree where datasets is installed)."""
    return [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))]


def load_rows(subset="main", split="train", data_dir=None):
    """The split's rows [{"question", "answer"}] in the shuffled (seed 42) order nanochat uses."""
    if subset not in SUBSETS:
        raise UserError(f"unknown GSM8K subset {subset!r}; use one of {', '.join(SUBSETS)}")
    if split not in SPLITS:
        raise UserError(f"unknown GSM8K split {split!r}; use one of {', '.join(SPLITS)}")
    local_dir = find_local_dir(subset, split, data_dir)
    if local_dir is not None:
        return shuffled(read_jsonl_rows(split_filename(local_dir, subset, split)))
    import datasets  # slow to import; only the hub needs it
    if not hub_offline() and not hub_reachable():
        raise GSM8KUnavailableError(subset, split, "no local copy, and the Hugging Face hub is unreachable "
                                                   "(HF_HUB_OFFLINE=1 uses a copy in the Hugging Face cache)")
    try:
        ds = datasets.load_dataset(HUB_NAME, subset, split=split)
    except (OSError, datasets.exceptions.DatasetsError) as e:  # ConnectionError, not in the offline cache, ...
        raise GSM8KUnavailableError(subset, split, f"no local copy, and the hub failed ({e})") from e
    return shuffled(ds.select_columns(["question", "answer"]).to_list())  # the local copy's permutation


class GSM8K(FinalAnswerTask):
    """GSM8K as conversations with calculator tool calls; reward 1 for the right final number."""

    def __init__(self, subset="main", split="train", data_dir=None, **slice_kwargs):
        super().__init__(**slice_kwargs)
        self.subset, self.split = subset, split
        self.rows = load_rows(subset, split, data_dir)

    def num_examples(self):
        return len(self.rows)

    def get_example(self, index):
        row = self.rows[index]
        return {"messages": [
            {"role": "user", "content": row["question"]},
            {"role": "assistant", "content": answer_to_parts(row["answer"])},
        ]}
