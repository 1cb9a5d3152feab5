"""The tokenizer: nanochat's file format, special tokens, the split regex, the chat rendering and tok_train."""

import pickle

import pytest
import regex
import rustbpe
import tiktoken
import torch

from nanochat.errors import UserError
from nanochat.tokenizer import SPECIAL_TOKENS, SPLIT_PATTERN, Tokenizer, TokenizerError, get_tokenizer
from scripts import tok_train
from tasks.gsm8k import GSM8K, load_rows

UNICODE_TEXT = "Adam’s pay – $1,080 (≈ 1 080 €), 日本語 🙂\n\n\tdone  "


def special(tok, name):
    return tok.encode_special(name)


# ---------------------------------------------------------------- vocabulary and text

def test_special_tokens_are_the_last_nine_ids_in_order(tiny_tokenizer):
    V = tiny_tokenizer.get_vocab_size()
    assert SPECIAL_TOKENS == ["<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
                              "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"]
    assert [tiny_tokenizer.encode_special(s) for s in SPECIAL_TOKENS] == list(range(V - 9, V))
    assert tiny_tokenizer.get_bos_token_id() == V - 9
    assert tiny_tokenizer.get_special_tokens() == SPECIAL_TOKENS
    assert [tiny_tokenizer.id_to_token(i) for i in range(V - 9, V)] == SPECIAL_TOKENS
    with pytest.raises(ValueError, match="not a special token"):
        tiny_tokenizer.encode_special("<|endoftext|>")


def test_split_pattern_is_the_spec_regex_and_splits_digits_in_pairs():
    spec = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
    assert SPLIT_PATTERN == spec
    assert regex.findall(SPLIT_PATTERN, "I've 12345 apples!!\n\n  ok") == \
        ["I", "'ve", " ", "12", "34", "5", " apples", "!!\n\n", " ", " ok"]


def test_encode_decode_round_trip_unicode(tiny_tokenizer):
    ids = tiny_tokenizer.encode(UNICODE_TEXT)
    assert all(isinstance(i, int) for i in ids)
    assert tiny_tokenizer.decode(ids) == UNICODE_TEXT
    assert tiny_tokenizer(UNICODE_TEXT) == ids
    assert max(ids) < tiny_tokenizer.get_vocab_size() - 9  # plain text never yields special ids


def test_special_token_text_in_data_is_encoded_as_plain_text(tiny_tokenizer):
    ids = tiny_tokenizer.encode("<|assistant_end|>")
    assert special(tiny_tokenizer, "<|assistant_end|>") not in ids and len(ids) > 1
    assert tiny_tokenizer.decode(ids) == "<|assistant_end|>"


def test_encode_prepend_append_and_batch(tiny_tokenizer):
    tok = tiny_tokenizer
    bos, end = tok.get_bos_token_id(), special(tok, "<|assistant_end|>")
    a, b = tok.encode("12 apples"), tok.encode("héllo")
    assert tok.encode("12 apples", prepend="<|bos|>") == [bos] + a
    assert tok.encode("12 apples", prepend=bos, append="<|assistant_end|>") == [bos] + a + [end]
    assert tok.encode(["12 apples", "héllo"], prepend="<|bos|>", append=end, num_threads=2) == [[bos] + a + [end], [bos] + b + [end]]
    assert tok.encode(["12 apples", "héllo"]) == [a, b]
    assert tok.encode("") == []


def test_vocab_size_too_small_is_a_user_error():
    with pytest.raises(UserError, match="at least 265"):
        Tokenizer.train_from_iterator(iter(["abc"]), 264)


# ---------------------------------------------------------------- files

def test_save_load_round_trip_and_token_bytes(tiny_tokenizer, tmp_path):
    tiny_tokenizer.save(tmp_path)
    loaded = Tokenizer.from_directory(tmp_path)
    assert loaded.get_vocab_size() == tiny_tokenizer.get_vocab_size()
    assert loaded.encode(UNICODE_TEXT) == tiny_tokenizer.encode(UNICODE_TEXT)
    assert loaded.decode(loaded.encode(UNICODE_TEXT)) == UNICODE_TEXT
    assert [loaded.encode_special(s) for s in SPECIAL_TOKENS] == [tiny_tokenizer.encode_special(s) for s in SPECIAL_TOKENS]

    token_bytes = torch.load(tmp_path / "token_bytes.pt")
    V = tiny_tokenizer.get_vocab_size()
    assert token_bytes.dtype == torch.int32 and token_bytes.shape == (V,)
    assert token_bytes[V - 9:].tolist() == [0] * 9
    assert token_bytes[:256].tolist() == [1] * 256  # the byte tokens come first
    # the lengths belong to the right ids: summed over any encoding they give the text's UTF-8 length
    for text in (UNICODE_TEXT, "Natalia sold 48/2 = 24 clips in May.", "x"):
        assert token_bytes[tiny_tokenizer.encode(text)].sum().item() == len(text.encode("utf-8"))
    assert sorted(token_bytes[:V - 9].tolist()) == sorted(len(b) for b in tiny_tokenizer.enc.token_byte_values())


def nanochat_style_encoding(texts, vocab_size):
    """An Encoding built the way nanochat builds one, without our Tokenizer class."""
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter(texts), vocab_size - len(SPECIAL_TOKENS), pattern=SPLIT_PATTERN)
    ranks = {bytes(k): v for k, v in trainer.get_mergeable_ranks()}
    return tiktoken.Encoding("rustbpe", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks,
                             special_tokens={s: len(ranks) + i for i, s in enumerate(SPECIAL_TOKENS)})


@pytest.mark.parametrize("protocol", [2, pickle.DEFAULT_PROTOCOL])
def test_loads_a_pickled_encoding_written_like_nanochat(tmp_path, protocol):
    texts = ["Weng earns 12/60 = $0.2 per minute.", "She earned 0.2 x 50 = $10."] * 5
    enc = nanochat_style_encoding(texts, 300)
    with open(tmp_path / "tokenizer.pkl", "wb") as f:
        pickle.dump(enc, f, protocol=protocol)
    tok = Tokenizer.from_directory(tmp_path)  # no token_bytes.pt needed to load
    for text in texts + [UNICODE_TEXT]:
        assert tok.encode(text) == enc.encode_ordinary(text)
    assert tok.get_vocab_size() == enc.n_vocab
    assert tok.encode_special("<|python_end|>") == enc.encode_single_token("<|python_end|>")


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_a_pickle_that_is_not_an_encoding_is_refused(tmp_path, capsys):
    with open(tmp_path / "tokenizer.pkl", "wb") as f:
        pickle.dump(_Evil(), f)
    with pytest.raises(TokenizerError, match="not a pickled tiktoken.Encoding") as e:
        Tokenizer.from_directory(tmp_path)
    assert e.value.path == str(tmp_path / "tokenizer.pkl")
    assert "must never run" not in capsys.readouterr().out


def test_get_tokenizer_reads_the_base_dir(base_dir, tiny_tokenizer):
    tok = get_tokenizer()
    assert tok.encode(UNICODE_TEXT) == tiny_tokenizer.encode(UNICODE_TEXT)


def test_get_tokenizer_missing_names_path_and_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    """The facts and the copy fix; the script that trains one is nanochat.cli's hint (tests/scripts/test_cli.py)."""
    with pytest.raises(TokenizerError) as e:
        get_tokenizer()
    message = str(e.value)
    assert e.value.path == str(tmp_path / "tokenizer" / "tokenizer.pkl") and e.value.path in message
    assert "nanochat tokenizer directory" in message and "scripts." not in message


# ---------------------------------------------------------------- conversations

def expected_render(tok, pieces):
    """ids and mask from (special token name | text, mask) pieces, built independently of the renderer."""
    ids, mask = [], []
    for piece, m in pieces:
        piece_ids = [tok.encode_special(piece)] if piece in SPECIAL_TOKENS else tok.encode(piece)
        ids += piece_ids
        mask += [m] * len(piece_ids)
    return ids, mask


@pytest.fixture
def natalia(gsm8k_dir):
    task = GSM8K(split="train", data_dir=gsm8k_dir)
    convs = [task[i] for i in range(len(task))]
    return next(c for c in convs if c["messages"][0]["content"].startswith("Natalia"))


def test_render_gsm8k_conversation_with_tool_calls(tiny_tokenizer, natalia):
    question = natalia["messages"][0]["content"]
    ids, mask = tiny_tokenizer.render_conversation(natalia)
    want_ids, want_mask = expected_render(tiny_tokenizer, [
        ("<|bos|>", 0), ("<|user_start|>", 0), (question, 0), ("<|user_end|>", 0),
        ("<|assistant_start|>", 0),
        ("Natalia sold 48/2 = ", 1), ("<|python_start|>", 1), ("48/2", 1), ("<|python_end|>", 1),
        ("<|output_start|>", 0), ("24", 0), ("<|output_end|>", 0),
        ("24 clips in May.\nNatalia sold 48+24 = ", 1), ("<|python_start|>", 1), ("48+24", 1), ("<|python_end|>", 1),
        ("<|output_start|>", 0), ("72", 0), ("<|output_end|>", 0),
        ("72 clips altogether in April and May.\n#### 72", 1), ("<|assistant_end|>", 1),
    ])
    assert ids == want_ids
    assert mask == want_mask


def test_system_message_is_merged_into_the_first_user_message(tiny_tokenizer):
    with_system = {"messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 3+4?"},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "And 2*5?"},
        {"role": "assistant", "content": "10"},
    ]}
    ids, mask = tiny_tokenizer.render_conversation(with_system)
    want = expected_render(tiny_tokenizer, [
        ("<|bos|>", 0), ("<|user_start|>", 0), ("Answer briefly.\n\nWhat is 3+4?", 0), ("<|user_end|>", 0),
        ("<|assistant_start|>", 0), ("7", 1), ("<|assistant_end|>", 1),
        ("<|user_start|>", 0), ("And 2*5?", 0), ("<|user_end|>", 0),
        ("<|assistant_start|>", 0), ("10", 1), ("<|assistant_end|>", 1),
    ])
    assert (ids, mask) == want
    assert tiny_tokenizer.visualize_tokenization(ids[:2], mask[:2]) == "[<|bos|>][<|user_start|>]"
    assert tiny_tokenizer.visualize_tokenization(ids[-1:], mask[-1:]) == "*[<|assistant_end|>]"
    assert with_system["messages"][1]["content"] == "What is 3+4?"  # the caller's conversation is untouched


def test_truncation_to_max_tokens(tiny_tokenizer, natalia):
    full_ids, full_mask = tiny_tokenizer.render_conversation(natalia)
    for n in (1, 7, len(full_ids) - 1):
        ids, mask = tiny_tokenizer.render_conversation(natalia, max_tokens=n)
        assert ids == full_ids[:n] and mask == full_mask[:n]
    assert tiny_tokenizer.render_conversation(natalia, max_tokens=10_000) == (full_ids, full_mask)


@pytest.mark.parametrize("roles", [["user", "user"], ["assistant", "user"], ["system", "assistant"],
                                   ["user", "assistant", "assistant"]])
def test_roles_must_alternate(tiny_tokenizer, roles):
    conv = {"messages": [{"role": r, "content": "hi"} for r in roles]}
    with pytest.raises(UserError, match="alternate|followed by a user"):
        tiny_tokenizer.render_conversation(conv)


def test_unknown_part_type_is_an_error(tiny_tokenizer):
    conv = {"messages": [{"role": "user", "content": "q"},
                         {"role": "assistant", "content": [{"type": "image", "text": "x"}]}]}
    with pytest.raises(UserError, match="unknown type 'image'"):
        tiny_tokenizer.render_conversation(conv)


def test_render_for_completion_drops_the_answer_and_opens_the_assistant_turn(tiny_tokenizer, natalia):
    prompt = tiny_tokenizer.render_for_completion(natalia)
    question = natalia["messages"][0]["content"]
    want_ids, _ = expected_render(tiny_tokenizer, [
        ("<|bos|>", 0), ("<|user_start|>", 0), (question, 0), ("<|user_end|>", 0), ("<|assistant_start|>", 0)])
    assert prompt == want_ids
    assert prompt[-1] == tiny_tokenizer.encode_special("<|assistant_start|>")
    assert len(natalia["messages"]) == 2  # not mutated
    with pytest.raises(UserError, match="ends with an assistant message"):
        tiny_tokenizer.render_for_completion({"messages": [{"role": "user", "content": "q"}]})


# ---------------------------------------------------------------- scripts/tok_train.py

def test_tok_train_on_gsm8k_writes_a_loadable_tokenizer(base_dir):
    out = base_dir / "tok_gsm8k"
    stats = tok_train.main(["--vocab-size", "300", "--output-dir", str(out)])
    tok = Tokenizer.from_directory(out)
    assert tok.get_vocab_size() == stats["vocab_size"] == 300
    assert tok.decode(tok.encode(UNICODE_TEXT)) == UNICODE_TEXT
    assert torch.load(out / "token_bytes.pt").shape == (300,)
    held_out = "\n".join(row["question"] + "\n" + row["answer"] for row in load_rows("main", "test"))
    assert stats["bytes_per_token"] == len(held_out.encode("utf-8")) / len(tok.encode(held_out))
    assert stats["bytes_per_token"] > 1.2  # even 35 merges learned on 12 train rows compress the test rows


def test_tok_train_on_input_files_and_overwrite_guard(base_dir, tmp_path, gsm8k_dir):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(line for line in (gsm8k_dir / "train.jsonl").read_text(encoding="utf-8").splitlines()),
                      encoding="utf-8")
    # default output dir: $NANOCHAT_BASE_DIR/tokenizer, which already holds the tiny tokenizer
    with pytest.raises(UserError, match="--force"):
        tok_train.main(["--input", str(corpus), "--vocab-size", "320"])
    stats = tok_train.main(["--input", str(corpus), "--vocab-size", "320", "--max-chars", "4000", "--force"])
    assert stats["train_chars"] <= 4000
    assert get_tokenizer().get_vocab_size() == 320
    with pytest.raises(UserError, match="does not exist"):
        tok_train.main(["--input", str(tmp_path / "missing.txt"), "--output-dir", str(tmp_path / "t")])
