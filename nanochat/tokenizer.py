"""
The BPE tokenizer and the chat format: text <-> token ids, and conversations -> (ids, mask).

Training uses rustbpe; encoding and decoding use tiktoken. On disk (`$NANOCHAT_BASE_DIR/tokenizer/`) the
tokenizer is nanochat's format exactly: `tokenizer.pkl` is a pickled `tiktoken.Encoding`, and
`token_bytes.pt` is an int32 tensor with the UTF-8 byte length of every token id (0 for special tokens),
so a tokenizer trained by nanochat can be copied in unchanged and ours can be used by nanochat.

Vocabulary layout: the 256 byte tokens and the merges (ids 0 .. n-1, in merge order), then the nine
special tokens of SPECIAL_TOKENS (ids n .. n+8, in that order).

nanochat's names are here too: RustBPETokenizer (this module's Tokenizer), get_tokenizer, get_token_bytes.
"""

import os
import pickle

import rustbpe
import tiktoken
import torch

from nanochat.common import get_base_dir
from nanochat.errors import UserError
from nanochat.files import atomic_write

SPECIAL_TOKENS = [
    "<|bos|>",  # starts every document / conversation
    "<|user_start|>", "<|user_end|>",
    "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>",  # the assistant calls the calculator tool
    "<|output_start|>", "<|output_end|>",  # the tool's answer, inserted by the engine (not predicted)
]

# GPT-4's split regex, except that numbers are split into runs of at most 2 digits (not 3): a small
# vocabulary then holds every 1-2 digit number instead of wasting ids on 3-digit ones.
SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|"""
                 r"""\s*[\r\n]|\s+(?!\S)|\s+""")

ENCODING_NAME = "rustbpe"  # the name nanochat gives its tiktoken.Encoding


class TokenizerError(UserError):
    """No usable nanochat tokenizer: `path` is the tokenizer file that is missing or unreadable (None for an
    Encoding built in memory)."""

    def __init__(self, message, path=None):
        super().__init__(message)
        self.path = path


class _PickledEncoding:
    """Receives the state of a pickled tiktoken.Encoding without running tiktoken's own unpickling."""

    def __setstate__(self, state):
        self.state = state


class _EncodingUnpickler(pickle.Unpickler):
    """Reads a pickled tiktoken.Encoding as plain data.

    Rebuilding the Encoding from its four documented fields ourselves keeps old files loadable if tiktoken
    changes its module layout or pickle state, and refuses any other object, so a tokenizer.pkl from
    elsewhere cannot run code on load."""

    # what pickle protocols 0-5 need to rebuild an object whose state is a dict of str/bytes/int
    _ALLOWED = {("copyreg", "_reconstructor"), ("copy_reg", "_reconstructor"), ("builtins", "object"),
                ("__builtin__", "object"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if module.split(".")[0] == "tiktoken" and name == "Encoding":
            return _PickledEncoding
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a tokenizer pickle")


def _load_encoding(path):
    try:
        with open(path, "rb") as f:
            obj = _EncodingUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
        raise TokenizerError(f"{path} is not a pickled tiktoken.Encoding ({e})", path) from e
    state = getattr(obj, "state", None)
    if isinstance(state, str):  # tiktoken pickles its registered encodings (gpt2, cl100k_base, ...) by name
        return tiktoken.get_encoding(state)
    if not isinstance(state, dict) or not {"pat_str", "mergeable_ranks", "special_tokens"} <= state.keys():
        raise TokenizerError(f"{path} does not hold a tiktoken.Encoding", path)
    return tiktoken.Encoding(state.get("name", ENCODING_NAME), pat_str=state["pat_str"],
                             mergeable_ranks=state["mergeable_ranks"], special_tokens=state["special_tokens"])


class ChatFormat:
    """nanochat's chat format over a tokenizer's encode and special tokens: a conversation rendered for training
    (ids and the mask of what the assistant produces) or as a prompt to sample its answer from."""

    def render_conversation(self, conversation, max_tokens=2048):
        """Tokenize a conversation for training: (ids, mask), two lists of equal length <= max_tokens.

        mask is 1 on the tokens the assistant produces (its text, tool calls and <|assistant_end|>), 0 on
        everything else: <|bos|>, user turns, <|assistant_start|> and tool outputs (the engine inserts those)."""
        messages = _merge_system_message(conversation["messages"])
        ids, mask = [], []

        def add(token_ids, m):
            token_ids = [token_ids] if isinstance(token_ids, int) else token_ids
            ids.extend(token_ids)
            mask.extend([m] * len(token_ids))

        sp = self._special_ids
        add(self.bos_token_id, 0)
        for i, message in enumerate(messages):
            content = message["content"]
            if message["role"] == "user":
                if not isinstance(content, str):
                    raise UserError(f"message {i} (user) content must be a string, got {type(content).__name__}")
                add(sp["<|user_start|>"], 0)
                add(self.encode(content), 0)
                add(sp["<|user_end|>"], 0)
                continue
            add(sp["<|assistant_start|>"], 0)
            if isinstance(content, str):
                add(self.encode(content), 1)
            elif isinstance(content, list):
                for part in content:
                    kind, value = part["type"], self.encode(part["text"])
                    if kind == "text":
                        add(value, 1)
                    elif kind == "python":
                        add(sp["<|python_start|>"], 1)
                        add(value, 1)
                        add(sp["<|python_end|>"], 1)
                    elif kind == "python_output":
                        add(sp["<|output_start|>"], 0)
                        add(value, 0)
                        add(sp["<|output_end|>"], 0)
                    else:
                        raise UserError(f"message {i} has a part of unknown type {kind!r}; use text, python or python_output")
            else:
                raise UserError(f"message {i} (assistant) content must be a string or a list of parts, got {type(content).__name__}")
            add(sp["<|assistant_end|>"], 1)
        return ids[:max_tokens], mask[:max_tokens]

    def render_for_completion(self, conversation):
        """The prompt for sampling an answer: the conversation without its last (assistant) message,
        rendered, then <|assistant_start|>."""
        messages = conversation["messages"]
        if not messages or messages[-1]["role"] != "assistant":
            raise UserError("render_for_completion needs a conversation that ends with an assistant message "
                            "(the reference answer, which is dropped)")
        ids, _ = self.render_conversation(dict(conversation, messages=messages[:-1]))
        return ids + [self._special_ids["<|assistant_start|>"]]

    def visualize_tokenization(self, ids, mask):
        """A debugging view: each token as [text], with trained-on tokens (mask 1) marked by a leading '*'."""
        return "".join(f"{'*' if m else ''}[{self.id_to_token(t)}]" for t, m in zip(ids, mask))


def collate_rows(rows, pad_token):
    """rows: list of (ids, mask), as ChatFormat.render_conversation renders them -> (inputs, targets), both (B, T)
    int64 with T = longest row - 1: what SFT trains on (nanochat/sft/data.py), and RL's question batches
    (nanochat.rl.advantages.make_question_batch).

    targets[b, t] = ids[b][t + 1] where mask[b][t + 1] == 1, else -1 (prompt, tool outputs, and padding
    past the row's end). Inputs past a row's end are pad_token; they only feed positions whose target is -1.
    """
    longest = max(len(ids) for ids, _ in rows)
    if longest < 2:
        raise ValueError("every row has fewer than 2 tokens: nothing to predict")
    ids = torch.full((len(rows), longest), pad_token, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for b, (row_ids, row_mask) in enumerate(rows):
        if len(row_ids) != len(row_mask):
            raise ValueError(f"row {b}: {len(row_ids)} ids but {len(row_mask)} mask entries")
        ids[b, :len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        mask[b, :len(row_mask)] = torch.tensor(row_mask, dtype=torch.long)
    inputs, targets = ids[:, :-1], ids[:, 1:].clone()
    targets[mask[:, 1:] == 0] = -1
    return inputs, targets


class Tokenizer(ChatFormat):
    """A tiktoken Encoding plus nanochat's special tokens and chat rendering (nanochat's RustBPETokenizer).

    bos_token: the special token that starts a sequence, as nanochat's constructor takes it (always "<|bos|>" in a
    nanochat tokenizer)."""

    def __init__(self, enc, bos_token="<|bos|>"):
        missing = [s for s in SPECIAL_TOKENS if s not in enc.special_tokens_set]
        if missing:
            raise TokenizerError(f"tokenizer {enc.name!r} lacks the special tokens {', '.join(missing)}, "
                                 "so it is not a nanochat tokenizer")
        self.enc = enc
        self._special_ids = {s: enc.encode_single_token(s) for s in SPECIAL_TOKENS}  # the encode_special cache
        self.bos_token_id = self.encode_special(bos_token)

    # ---------------------------------------------------------------- construction and files

    @classmethod
    def train_from_iterator(cls, text_iterator, vocab_size):
        """Train BPE on an iterator of strings; vocab_size counts the nine special tokens.

        If the text runs out of pairs to merge the vocabulary comes out smaller; get_vocab_size() tells."""
        num_regular = vocab_size - len(SPECIAL_TOKENS)
        if num_regular < 256:
            raise UserError(f"vocab_size {vocab_size} is too small: it must hold 256 byte tokens and "
                            f"{len(SPECIAL_TOKENS)} special tokens, so use at least {256 + len(SPECIAL_TOKENS)}")
        trainer = rustbpe.Tokenizer()
        trainer.train_from_iterator(text_iterator, num_regular, pattern=SPLIT_PATTERN)
        mergeable_ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
        offset = len(mergeable_ranks)
        special_tokens = {s: offset + i for i, s in enumerate(SPECIAL_TOKENS)}
        enc = tiktoken.Encoding(ENCODING_NAME, pat_str=SPLIT_PATTERN, mergeable_ranks=mergeable_ranks,
                                special_tokens=special_tokens)
        return cls(enc)

    @classmethod
    def from_directory(cls, tokenizer_dir):
        """Load `tokenizer_dir/tokenizer.pkl` (as written by nanochat or by save())."""
        path = os.path.join(tokenizer_dir, "tokenizer.pkl")
        if not os.path.isfile(path):
            raise TokenizerError(f"no tokenizer at {path}; copy your nanochat tokenizer directory "
                                 f"(tokenizer.pkl, token_bytes.pt) to {tokenizer_dir}", path)
        return cls(_load_encoding(path))

    def save(self, tokenizer_dir):
        """Write tokenizer.pkl (pickled tiktoken.Encoding) and token_bytes.pt, as nanochat does."""
        os.makedirs(tokenizer_dir, exist_ok=True)
        atomic_write(os.path.join(tokenizer_dir, "tokenizer.pkl"), lambda f: pickle.dump(self.enc, f))
        token_bytes = self.token_bytes()
        atomic_write(os.path.join(tokenizer_dir, "token_bytes.pt"), lambda f: torch.save(token_bytes, f))

    def token_bytes(self):
        """(vocab_size,) int32: the byte length of each token, 0 for special tokens (they are not text)."""
        special = set(self._special_ids.values())
        lengths = [0 if i in special else len(self.enc.decode_single_token_bytes(i)) for i in range(self.get_vocab_size())]
        return torch.tensor(lengths, dtype=torch.int32)

    # ---------------------------------------------------------------- vocabulary

    def get_vocab_size(self):
        return self.enc.n_vocab

    def get_special_tokens(self):
        """The special token strings, in id order."""
        return list(SPECIAL_TOKENS)

    def id_to_token(self, token_id):
        """The text of one token (a partial UTF-8 character decodes to U+FFFD)."""
        return self.enc.decode([token_id])

    def encode_special(self, text):
        """The id of a special token such as "<|assistant_end|>"."""
        try:
            return self._special_ids[text]
        except KeyError:
            raise ValueError(f"{text!r} is not a special token; they are {', '.join(SPECIAL_TOKENS)}") from None

    def get_bos_token_id(self):
        return self.bos_token_id

    # ---------------------------------------------------------------- text

    def _as_id(self, token):
        return self.encode_special(token) if isinstance(token, str) else int(token)

    def encode(self, text, prepend=None, append=None, num_threads=8):
        """str -> list[int], or list[str] -> list[list[int]] (encoded in parallel).

        Special-token strings inside the text are encoded as plain text, never as special tokens, so data
        cannot inject them. prepend/append: a special token (string) or an id, added to each sequence."""
        head = [] if prepend is None else [self._as_id(prepend)]
        tail = [] if append is None else [self._as_id(append)]
        if isinstance(text, str):
            return head + self.enc.encode_ordinary(text) + tail
        if isinstance(text, (list, tuple)):
            return [head + ids + tail for ids in self.enc.encode_ordinary_batch(list(text), num_threads=num_threads)]
        raise TypeError(f"encode expects a str or a list of str, got {type(text).__name__}")

    __call__ = encode

    def decode(self, ids):
        return self.enc.decode(ids)


def _merge_system_message(messages):
    """Validate roles and fold a leading system message into the first user message ("system\\n\\nuser"),
    as nanochat does: the chat format has no system turn."""
    if not messages:
        raise UserError("a conversation needs at least one message")
    if messages[0]["role"] == "system":
        if len(messages) < 2 or messages[1]["role"] != "user":
            raise UserError("a system message must be followed by a user message")
        if not isinstance(messages[0]["content"], str) or not isinstance(messages[1]["content"], str):
            raise UserError("a system message and the user message after it must both be strings")
        first = dict(messages[1], content=messages[0]["content"] + "\n\n" + messages[1]["content"])
        messages = [first] + list(messages[2:])
    for i, message in enumerate(messages):
        expected = "user" if i % 2 == 0 else "assistant"
        if message["role"] != expected:
            roles = [m["role"] for m in messages]
            raise UserError(f"message {i} has role {message['role']!r} but {expected!r} was expected: roles must "
                            f"alternate user/assistant starting with user (after an optional system message); got {roles}")
    return messages


def get_tokenizer():
    """The tokenizer in $NANOCHAT_BASE_DIR/tokenizer (see `python -m scripts.tok_train`)."""
    return Tokenizer.from_directory(os.path.join(get_base_dir(), "tokenizer"))


RustBPETokenizer = Tokenizer  # nanochat's name for the same class (trained with rustbpe, encoding with tiktoken)


def get_token_bytes(device="cpu"):
    """(vocab_size,) int32 on `device`: the byte length of every token id, read from
    $NANOCHAT_BASE_DIR/tokenizer/token_bytes.pt (Tokenizer.save writes it, and so does nanochat's tok_train)."""
    path = os.path.join(get_base_dir(), "tokenizer", "token_bytes.pt")
    if not os.path.isfile(path):
        raise TokenizerError(f"no token_bytes.pt at {path}; train a tokenizer (python -m scripts.tok_train) or copy "
                             "your nanochat tokenizer directory there", path)
    return torch.load(path, map_location=device)
