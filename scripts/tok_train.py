"""
Train the BPE tokenizer and save it where every other script looks: $NANOCHAT_BASE_DIR/tokenizer.

1. Text: the --input files, or by default GSM8K train questions and answers (tasks.gsm8k).
2. rustbpe learns vocab_size - 9 tokens (256 bytes + merges) with nanochat's split regex; the nine
   special tokens are appended after them.
3. Save tokenizer.pkl + token_bytes.pt (nanochat's format), then report the compression (UTF-8 bytes per
   token) on held-out text: the GSM8K test split, or the last 5% of the --input text.

Tokenizer training runs on the CPU only (no GPU, no torchrun), in seconds for the default:

    python -m scripts.tok_train                                  # 2048 tokens from GSM8K
    python -m scripts.tok_train --input corpus.txt --vocab-size 8192

Models are tied to the tokenizer they were trained with. To fine-tune a nanochat checkpoint, copy that
run's tokenizer directory instead of training a new one (nanochat uses 65,536 tokens).
"""

import os
import time

from nanochat.cli import ArgumentParser, add_debug_flag, error_line, run_main
from nanochat.common import get_base_dir
from nanochat.errors import UserError
from nanochat.runtime.distributed import print0
from nanochat.tokenizer import Tokenizer

HELD_OUT_FRACTION = 0.05  # of the --input text, kept out of training to measure compression
CHUNK_CHARS = 1 << 16  # the --input text reaches rustbpe in pieces of about this size, cut at newlines


def build_parser():
    p = ArgumentParser(description="Train the BPE tokenizer (rustbpe) and save it for nanochat")
    # what to learn
    p.add_argument("--vocab-size", type=int, default=2048,
                   help="tokens including the 9 special ones; 2048 keeps embedding and softmax cheap for small "
                        "CPU models and already covers GSM8K's vocabulary (nanochat itself uses 65536)")
    p.add_argument("--input", type=str, nargs="+", default=None,
                   help="UTF-8 text files to train on; default: GSM8K train questions and answers")
    p.add_argument("--max-chars", type=int, default=10_000_000, help="train on at most this many characters")
    # where to put it
    p.add_argument("--output-dir", type=str, default=None, help="default: $NANOCHAT_BASE_DIR/tokenizer")
    p.add_argument("--force", action="store_true",
                   help="overwrite an existing tokenizer (checkpoints trained with the old one become unusable)")
    return add_debug_flag(p)


def parse_args(argv):
    args = build_parser().parse_args(argv)
    if args.max_chars < 1:
        raise UserError(f"--max-chars must be positive, got {args.max_chars}")
    return args


def _line_chunks(text, size):
    """Pieces of about `size` characters, each ending at a newline where there is one."""
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        newline = text.rfind("\n", start, end)
        if end < len(text) and newline > start:
            end = newline + 1
        yield text[start:end]
        start = end


def read_inputs(paths, max_chars):
    """(training chunks, held-out text) from text files; reads no more than training needs."""
    budget = int(max_chars / (1 - HELD_OUT_FRACTION)) + 1
    pieces = []
    for path in paths:
        if not os.path.isfile(path):
            raise UserError(f"--input {path} does not exist")
        with open(path, encoding="utf-8", errors="replace") as f:
            pieces.append(f.read(budget))
        budget -= len(pieces[-1])
        if budget <= 0:
            break
    text = "".join(pieces)
    if not text:
        raise UserError(f"the --input files are empty: {' '.join(paths)}")
    cut = int(len(text) * (1 - HELD_OUT_FRACTION))
    newline = text.rfind("\n", 0, cut)
    cut = newline + 1 if newline > 0 else cut
    return list(_line_chunks(text[:cut][:max_chars], CHUNK_CHARS)), text[cut:]


def read_gsm8k(max_chars):
    """(training documents, held-out text): GSM8K train questions + answers, and the test split."""
    from tasks.gsm8k import load_rows
    try:
        train, test = load_rows("main", "train"), load_rows("main", "test")
    except UserError as e:  # the hint run_main would have added, then this script's own alternative
        raise UserError(f"{error_line(e)}; or train on your own text with --input FILE") from e
    docs, total = [], 0
    for row in train:
        doc = row["question"] + "\n" + row["answer"]
        if total + len(doc) > max_chars:
            break
        docs.append(doc)
        total += len(doc)
    return docs, "\n".join(row["question"] + "\n" + row["answer"] for row in test)


def main(argv=None):
    args = parse_args(argv)
    output_dir = args.output_dir or os.path.join(get_base_dir(), "tokenizer")
    if os.path.exists(os.path.join(output_dir, "tokenizer.pkl")) and not args.force:
        raise UserError(f"{output_dir} already holds a tokenizer; models trained with it need it, so pass --force "
                        "to overwrite it or choose another --output-dir")

    if args.input:
        docs, held_out = read_inputs(args.input, args.max_chars)
        source = " ".join(args.input)
    else:
        docs, held_out = read_gsm8k(args.max_chars)
        source = "GSM8K train"
    train_chars = sum(len(d) for d in docs)
    print0(f"training a {args.vocab_size}-token BPE on {train_chars:,} characters of {source}")

    t0 = time.time()
    tokenizer = Tokenizer.train_from_iterator(iter(docs), args.vocab_size)
    print0(f"trained in {time.time() - t0:.1f}s")
    vocab_size = tokenizer.get_vocab_size()
    if vocab_size < args.vocab_size:
        print0(f"note: the text ran out of pairs to merge; the vocabulary has {vocab_size} tokens, not {args.vocab_size}")
    tokenizer.save(output_dir)
    print0(f"saved tokenizer.pkl and token_bytes.pt to {output_dir}")

    stats = {"vocab_size": vocab_size, "train_chars": train_chars}
    if held_out:
        num_bytes, num_tokens = len(held_out.encode("utf-8")), len(tokenizer.encode(held_out))
        stats["bytes_per_token"] = num_bytes / num_tokens
        print0(f"held-out compression: {num_bytes:,} bytes -> {num_tokens:,} tokens = {stats['bytes_per_token']:.2f} bytes/token")
    return stats


if __name__ == "__main__":
    run_main(main)
