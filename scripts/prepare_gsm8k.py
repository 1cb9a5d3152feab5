"""
Put GSM8K where tasks.gsm8k finds it without network: $NANOCHAT_BASE_DIR/data/gsm8k/{train,test}.jsonl.

1. With `--from DIR`: validate DIR/train.jsonl and DIR/test.jsonl (one {"question", "answer"} object per
   line) and copy them. Without it: download `openai/gsm8k` from the Hugging Face hub and write the two
   files in the hub's row order (the order matters: the task shuffles with seed 42 on top of it).
2. Print what was written and how to use it.

    python -m scripts.prepare_gsm8k                      # download (needs the hub)
    python -m scripts.prepare_gsm8k --from /path/to/gsm8k  # copy local files (offline machines)
"""

import json
import os
import shutil

from nanochat.cli import ArgumentParser, add_debug_flag, run_main
from nanochat.common import get_base_dir
from nanochat.errors import UserError
from nanochat.files import atomic_write
from tasks.gsm8k import HUB_NAME, SPLITS, hub_offline, hub_reachable, read_jsonl_rows, split_filename

# without the hub: the same fix, whether this script was run by hand or by speedrun.sh
OFFLINE_FIX = ("point NANOCHAT_GSM8K_DIR (or --from) at a directory holding GSM8K's train.jsonl and test.jsonl, "
               "copied from a machine with the hub (e.g. NANOCHAT_GSM8K_DIR=DIR bash speedrun.sh)")
HUB_SIZES = {("main", "train"): 7473, ("main", "test"): 1319, ("socratic", "train"): 7473, ("socratic", "test"): 1319}


def build_parser():
    p = ArgumentParser(description="Copy or download GSM8K into $NANOCHAT_BASE_DIR/data/gsm8k")
    p.add_argument("--from", dest="source", type=str, default=os.environ.get("NANOCHAT_GSM8K_DIR") or None,
                   help="directory holding train.jsonl and test.jsonl to copy (default: $NANOCHAT_GSM8K_DIR, as "
                        "speedrun.sh and the GSM8K task read it); neither = download from the hub")
    p.add_argument("--subset", type=str, default="main", choices=["main", "socratic"],
                   help="GSM8K subset; socratic goes to a socratic/ subdirectory")
    p.add_argument("--output-dir", type=str, default=None,
                   help="where to write (default: $NANOCHAT_BASE_DIR/data/gsm8k)")
    add_debug_flag(p)
    return p


def parse_args(argv):
    return build_parser().parse_args(argv)


def write_jsonl(path, rows):
    atomic_write(path, "".join(json.dumps({"question": row["question"], "answer": row["answer"]}, ensure_ascii=False) + "\n"
                               for row in rows))


def main(argv=None):
    args = parse_args(argv)
    output_dir = args.output_dir or os.path.join(get_base_dir(), "data", "gsm8k")
    if args.source is not None:
        sources = {split: split_filename(args.source, args.subset, split) for split in SPLITS}
        missing = [path for path in sources.values() if not os.path.isfile(path)]
        if missing:
            raise UserError(f"--from {args.source}: missing {', '.join(missing)}; the directory must hold train.jsonl and test.jsonl")
        counts = {split: len(read_jsonl_rows(path)) for split, path in sources.items()}  # validate before copying anything
    else:
        import datasets
        if not hub_offline() and not hub_reachable():
            raise UserError(f"cannot reach the Hugging Face hub to download {HUB_NAME}; {OFFLINE_FIX}")
        try:
            tables = {split: datasets.load_dataset(HUB_NAME, args.subset, split=split) for split in SPLITS}
        except (OSError, datasets.exceptions.DatasetsError) as e:
            raise UserError(f"cannot download {HUB_NAME} ({e}); {OFFLINE_FIX}") from e
        counts = {split: len(table) for split, table in tables.items()}

    for split in SPLITS:
        dest = split_filename(output_dir, args.subset, split)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if args.source is not None:
            if os.path.abspath(sources[split]) != os.path.abspath(dest):
                with open(sources[split], "rb") as src:
                    atomic_write(dest, lambda f: shutil.copyfileobj(src, f))
        else:
            write_jsonl(dest, tables[split])
        expected = HUB_SIZES[(args.subset, split)]
        note = "" if counts[split] == expected else f" (the hub has {expected}: shuffled order and example ids will differ from nanochat's)"
        print(f"{split}: {counts[split]} examples -> {dest}{note}")
    if os.path.abspath(output_dir) == os.path.abspath(os.path.join(get_base_dir(), "data", "gsm8k")):
        print(f"GSM8K {args.subset} ready in {output_dir}, where tasks.gsm8k looks when NANOCHAT_GSM8K_DIR is unset")
    else:
        print(f"GSM8K {args.subset} ready in {output_dir}; use it with NANOCHAT_GSM8K_DIR={output_dir}")


if __name__ == "__main__":
    run_main(main)
