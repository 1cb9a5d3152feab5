"""chat_cli: a piped conversation samples what the engine samples, calculator calls are shown with their
results, -p answers once, and bad input is one line. Expected transcripts are written out (the banner, the
turn layout, `[python: ...]`) or decoded from the engine's tokens with the tokenizer, never built with
chat_cli's own printer or message helpers."""

import io
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
from helpers import REPO, ScriptedModel, make_sft_checkpoint

from nanochat.checkpoints.loading import load_model
from nanochat.checkpoints.store import save_checkpoint
from nanochat.cli import run_main
from nanochat.engine.engine import Engine
from scripts import chat_cli

FLAGS = ["--device-type=cpu", "--dtype=float32", "--max-new-tokens=24"]


def run_cli(base_dir, args, stdin=""):
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base_dir), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "scripts.chat_cli", *args], input=stdin, cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


BANNER = """NanoChat interactive mode
--------------------------------------------------
Type 'quit' or 'exit' (or Ctrl-D) to end the conversation
Type 'clear' to start a new conversation
Calculator calls show as [python: ...], their results as [output: ...]
--------------------------------------------------"""


def plain_text(tokenizer, completion):
    """The text of an engine Completion that holds no special token (no calculator call to bracket), as the
    tokenizer decodes it: what chat_cli must print for it."""
    specials = {tokenizer.encode_special(name) for name in tokenizer.get_special_tokens()}
    assert not specials & set(completion.tokens), "the model's answer holds a special token: pick another seed"
    return tokenizer.decode(completion.tokens)


@pytest.fixture
def plain_sft(base_dir, tiny_tokenizer):
    """`base_dir` with the `sft` fixture's random model, its special tokens' lm_head rows zeroed: their logit is 0
    while about half of the 391 other tokens' random logits are positive, so greedy decoding and top-k 50 never
    pick one. Its answers are plain text, which chat_cli must print exactly as the tokenizer decodes it."""
    model = make_sft_checkpoint(base_dir, tiny_tokenizer.get_vocab_size())
    specials = [tiny_tokenizer.encode_special(name) for name in tiny_tokenizer.get_special_tokens()]
    with torch.no_grad():
        model.lm_head.weight[specials] = 0.0
    save_checkpoint(str(base_dir / "chatsft_checkpoints" / "d2"), 0, model.state_dict(), None,
                    {"model_config": asdict(model.config), "step": 0})
    return model


def user(text):
    return {"role": "user", "content": text}


def reply(tokenizer, conversation, **sampling):
    """The engine's completion of `conversation` (a list of messages ending with a user message)."""
    model, _, _ = load_model("sft", "cpu", "eval")
    prompt = tokenizer.render_for_completion({"messages": conversation + [{"role": "assistant", "content": ""}]})
    return Engine(model, tokenizer).generate_many([prompt], max_tokens=24, **sampling)[0][0]


@pytest.mark.slow
def test_piped_greedy_chat_is_the_engines_greedy_output(plain_sft, base_dir, tiny_tokenizer):
    """Two turns, `clear`, the first question again, then end of input: every answer is the engine's
    greedy completion of the conversation so far, rendered with render_for_completion."""
    result = run_cli(base_dir, FLAGS + ["-t", "0", "--seed=7"], stdin="hello there\nwhat is 2+2\nclear\nhello there\n")
    assert result.returncode == 0, result.stderr
    tok = tiny_tokenizer
    first = reply(tok, [user("hello there")], temperature=0.0)
    history = [user("hello there"), {"role": "assistant", "content": plain_text(tok, first)}]
    second = reply(tok, history + [user("what is 2+2")], temperature=0.0)
    expected = (BANNER + "\n"
                + "\nUser: hello there\n" + "\nAssistant: " + plain_text(tok, first) + "\n"
                + "\nUser: what is 2+2\n" + "\nAssistant: " + plain_text(tok, second) + "\n"
                + "\nUser: clear\nConversation cleared.\n"
                + "\nUser: hello there\n" + "\nAssistant: " + plain_text(tok, first) + "\n"
                + "\nUser: \nGoodbye!\n")
    assert result.stdout == expected
    assert first.tokens != second.tokens  # the second answer really saw a different conversation


@pytest.mark.slow
def test_prompt_flag_answers_once_and_exits_0(plain_sft, base_dir, tiny_tokenizer):
    """-p prints only the answer: the engine's sample for the same seed at the default T=0.6, top-k 50."""
    result = run_cli(base_dir, FLAGS + ["-p", "hello there", "--seed=3"], stdin="never read\n")
    assert result.returncode == 0, result.stderr
    expected = reply(tiny_tokenizer, [user("hello there")], temperature=0.6, top_k=50, seed=3)
    assert result.stdout == plain_text(tiny_tokenizer, expected) + "\n"
    assert "Loading model" in result.stderr  # loading notes stay off stdout


def test_missing_checkpoint_is_one_line_and_exit_2(base_dir):
    result = run_cli(base_dir, FLAGS + ["-p", "hi"])
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no sft checkpoints"), result.stderr
    assert lines[0].endswith("or create one with `python -m scripts.chat_sft`")  # nanochat.cli's hint


@pytest.mark.parametrize("flags, message", [
    (["--source=base"], "--source must be sft, mid or rl"),
    (["-t", "-1"], "--temperature must be >= 0"),
    (["-k", "-5"], "--top-k must be >= 0"),
    (["--max-new-tokens=0"], "--max-new-tokens must be >= 1"),
    (["--dtype=float16"], "--dtype must be auto, float32 or bfloat16"),
    (["--temp=0"], "unrecognized arguments: --temp=0"),
])
def test_bad_flags_are_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_main(chat_cli.main, flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def scripted_calculator(tokenizer, question):
    """A model that answers `question` with text, a calculator call 6*7, and text after the result."""
    sp = {name: tokenizer.encode_special(f"<|{name}|>") for name in
          ("python_start", "python_end", "output_start", "output_end", "assistant_end")}
    prompt = tokenizer.render_for_completion({"messages": [user(question), {"role": "assistant", "content": ""}]})
    forced = [sp["output_start"], *tokenizer.encode("42"), sp["output_end"]]
    filler = tokenizer.encode("x")  # the engine overrides these positions with the forced result
    script = (tokenizer.encode("Let me compute ") + [sp["python_start"], *tokenizer.encode("6*7"), sp["python_end"]]
              + filler * len(forced) + tokenizer.encode(" so 42.") + [sp["assistant_end"]])
    return ScriptedModel(script, len(prompt), tokenizer.get_vocab_size())


class ConversationModel(ScriptedModel):
    """A ScriptedModel that answers by the conversation: at each prompt's prefill it records the prompt and picks
    scripts[number of user turns in it], played from the prompt's end."""

    def __init__(self, tokenizer, scripts):
        super().__init__(scripts[1], 0, tokenizer.get_vocab_size())
        self.scripts, self.user_start, self.prompts = scripts, tokenizer.encode_special("<|user_start|>"), []

    def hidden_states(self, idx, cache_step=None):
        if idx.size(1) > 1 and int(cache_step.positions[0, 0]) == 0:  # a new prompt, whole (one at a time here)
            self.prompts.append(idx[0].tolist())
            turns = int((idx[0] == self.user_start).sum())
            assert turns in self.scripts, f"a prompt with {turns} user turns, no answer scripted for it"
            self.script, self.prompt_len = self.scripts[turns], idx.size(1)
        return super().hidden_states(idx, cache_step)


def test_piped_chat_transcript_and_the_prompts_the_model_sees(tiny_tokenizer, monkeypatch, capsys):
    """A whole session written out: each answer printed after its turn, the calculator call bracketed with the
    engine's result, `clear` forgetting the conversation; and each prompt the model is given holds the earlier
    turns as training renders them (the answer's calculator call and its output included)."""
    tok = tiny_tokenizer
    sp = lambda name: tok.encode_special(f"<|{name}|>")
    forced = [sp("output_start"), *tok.encode("4"), sp("output_end")]  # the engine writes these, not the model
    scripts = {
        1: tok.encode("Hello!") + [sp("assistant_end")],
        2: (tok.encode("Let me compute ") + [sp("python_start"), *tok.encode("2+2"), sp("python_end")]
            + tok.encode("x") * len(forced) + tok.encode(" so 4.") + [sp("assistant_end")]),
        3: tok.encode("You are welcome.") + [sp("assistant_end")],
    }
    model = ConversationModel(tok, scripts)
    monkeypatch.setattr(chat_cli, "load_model", lambda *args, **kwargs: (model, tok, {}))
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\nwhat is 2+2\nthanks\nclear\nhello there\n"))
    assert chat_cli.main(FLAGS + ["--max-new-tokens=64"]) == 0
    assert capsys.readouterr().out == (BANNER + "\n"
                                       "\nUser: hello there\n"
                                       "\nAssistant: Hello!\n"
                                       "\nUser: what is 2+2\n"
                                       "\nAssistant: Let me compute [python: 2+2][output: 4] so 4.\n"
                                       "\nUser: thanks\n"
                                       "\nAssistant: You are welcome.\n"
                                       "\nUser: clear\n"
                                       "Conversation cleared.\n"
                                       "\nUser: hello there\n"
                                       "\nAssistant: Hello!\n"
                                       "\nUser: \n"
                                       "Goodbye!\n")
    first = "<|bos|><|user_start|>hello there<|user_end|><|assistant_start|>"
    assert [tok.decode(p) for p in model.prompts] == [
        first,
        first + "Hello!<|assistant_end|><|user_start|>what is 2+2<|user_end|><|assistant_start|>",
        first + "Hello!<|assistant_end|><|user_start|>what is 2+2<|user_end|><|assistant_start|>"
        "Let me compute <|python_start|>2+2<|python_end|><|output_start|>4<|output_end|> so 4.<|assistant_end|>"
        "<|user_start|>thanks<|user_end|><|assistant_start|>",
        first,
    ]


@pytest.mark.parametrize("mode", ["chat", "prompt"])
def test_calculator_call_and_its_result_are_shown(tiny_tokenizer, monkeypatch, capsys, mode):
    question = "what is 6*7?"
    model = scripted_calculator(tiny_tokenizer, question)
    monkeypatch.setattr(chat_cli, "load_model", lambda *args, **kwargs: (model, tiny_tokenizer, {}))
    shown_answer = "Let me compute [python: 6*7][output: 42] so 42.\n"
    if mode == "prompt":
        assert chat_cli.main(FLAGS + ["--max-new-tokens=64", "-p", question]) == 0
        assert capsys.readouterr().out == shown_answer
    else:
        monkeypatch.setattr(sys, "stdin", io.StringIO(f"{question}\nquit\n"))
        assert chat_cli.main(FLAGS + ["--max-new-tokens=64"]) == 0
        out = capsys.readouterr().out
        assert out.endswith(f"\nUser: {question}\n\nAssistant: {shown_answer}\nUser: quit\nGoodbye!\n"), out


def test_answer_parts_render_back_to_the_sampled_tokens(tiny_tokenizer):
    """The next turn's prompt holds the answer as training renders it: text, the python call, its output."""
    tok = tiny_tokenizer
    sp = lambda name: tok.encode_special(f"<|{name}|>")
    tokens = (tok.encode("Let me compute ") + [sp("python_start"), *tok.encode("6*7"), sp("python_end"),
              sp("output_start"), *tok.encode("42"), sp("output_end")] + tok.encode(" so 42."))
    parts = chat_cli.answer_parts(tok, tokens)
    assert parts == [{"type": "text", "text": "Let me compute "}, {"type": "python", "text": "6*7"},
                     {"type": "python_output", "text": "42"}, {"type": "text", "text": " so 42."}]
    ids, mask = tok.render_conversation({"messages": [user("q"), {"role": "assistant", "content": parts}]})
    start = ids.index(sp("assistant_start")) + 1
    assert ids[start:] == tokens + [sp("assistant_end")]
    # an answer cut inside its python block keeps the call open (rendering closes it)
    cut = tokens.index(sp("python_start")) + 2
    assert chat_cli.answer_parts(tok, tokens[:cut])[-1] == {"type": "python", "text": tok.decode(tokens[cut - 1:cut])}


def test_printer_writes_whole_characters_and_plain_text_unchanged(tiny_tokenizer):
    """Streaming token by token must print exactly the decoded text, even where one character's UTF-8
    bytes are split over several tokens."""
    tok = tiny_tokenizer
    text = "Ünïcödé ✓ 12 × 3 = 36"
    tokens = tok.encode(text)
    out = io.StringIO()
    printer = chat_cli.AnswerPrinter(tok, out)
    pieces = []
    for t in tokens:
        before = out.tell()
        printer.feed(t, 1)
        pieces.append(out.getvalue()[before:])
        assert "\ufffd" not in pieces[-1]
    printer.finish()
    assert out.getvalue() == text + "\n"
    assert any(piece == "" for piece in pieces)  # some tokens were partial characters, held back
