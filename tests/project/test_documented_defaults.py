"""The defaults the README and docs/flags.md write by hand are the code's (issue 68): each row of a `| flag | default |
meaning |` table, and each `--flag` (N) of a script's section written as prose, against the parser of the script it
documents (the last `scripts/<name>.py` the page names before it). chat_rl's parser is built from its settings
(nanochat/rl/config.py's SETTINGS, nanochat/settings.py's SHARED), every other script's by its build_parser(). A
default changed in the code without its docs, or in the docs without the code, fails here."""

import importlib
import re

import pytest
from helpers import REPO

from nanochat import cli
from nanochat.rl.config import RLConfig
from nanochat.rl.plan import resolve_keep_last
from scripts.chat_sft import STOP_CHECK_DEFAULTS

PAGES = ["README.md", "docs/flags.md"]
SCRIPT = re.compile(r"`scripts/(\w+)\.py`")
TABLE_ROW = re.compile(r"(?m)^\| `(--[\w-]+)` \| ([^|\n]*) \|")
# prose: `--max-new-tokens` (256 per answer), `-t/--temperature` (0.6; ...), `--stop-check-every` steps (10), and
# `-i/--source` `sft|mid|rl` (default `sft`)
PROSE_NUMBER = re.compile(r"`(?:-\w/)?(--[\w-]+)`[^`(.]*?\((-?\d[\d.]*)[;) ]")  # in the flag's own sentence
PROSE_DEFAULT = re.compile(r"`(?:-\w/)?(--[\w-]+)`(?: `[^`]*`)? \(default `([^`]+)`\)")
# where a parser's default means "not given" (None) and the run settles it, what the docs write is the settled value
RESOLVED = {"chat_rl": {"--keep-last": resolve_keep_last(RLConfig(), meta={})},
            "chat_sft": {cli.flag_name(name): value for name, value in STOP_CHECK_DEFAULTS.items()}}
WORDS = object()  # a default written in words (`$NANOCHAT_DTYPE`, else `auto`; largest `d<N>`; by `--loss`)


def parser_of(script):
    return cli.rl_parser() if script == "chat_rl" else importlib.import_module(f"scripts.{script}").build_parser()


def code_defaults(script):
    """Each option string of the script's parser -> its default, as a user who does not give the flag gets it."""
    resolved = RESOLVED.get(script, {})
    return {option: resolved.get(action.option_strings[-1], action.default)
            for action in parser_of(script)._actions for option in action.option_strings}


def documented(cell):
    """A documented default as a value: off -> False, a number, a `literal`; WORDS for a description."""
    cell = cell.strip()
    if cell == "off":
        return False
    if re.fullmatch(r"-?\d+(\.\d+)?(e-?\d+)?", cell):
        return float(cell)
    literal = re.fullmatch(r"`([^`]*)`", cell)
    return literal.group(1) if literal else WORDS


def agrees(written, default):
    """Whether the docs' `written` (documented()) says the code's `default`: words only for a default that is "not
    given" (None or empty: the docs say what happens then), off for a switch or an empty default, a number for the
    same number, a literal for the same string."""
    if written is WORDS:
        return default in (None, "")
    if written is False:
        return default is False or default == ""
    if isinstance(written, float):
        return isinstance(default, (int, float)) and not isinstance(default, bool) and float(default) == written
    return default == written


def script_at(text, position):
    named = SCRIPT.findall(text[:position])
    return named[-1] if named else None


def tables(page):
    """(script, flag, cell, line) of each row of the page's `| flag | default | meaning |` tables."""
    text = (REPO / page).read_text()
    rows = []
    for table in re.finditer(r"(?m)^\| flag \| default \| meaning \|\n\|[-|]+\|\n((?:\|.*\n?)*)", text):
        script = script_at(text, table.start())
        for row in TABLE_ROW.finditer(table.group(1)):
            line = text.count("\n", 0, table.start(1) + row.start()) + 1
            rows.append((script, row.group(1), row.group(2), f"{page}:{line}"))
    return rows


def prose(page):
    """(script, flag, written value, line) of each default written in the prose of a script's section with no table
    (docs/flags.md's chat_eval, chat_cli, tok_train and chat_sft)."""
    text = (REPO / page).read_text()
    found = []
    for section in re.finditer(r"(?m)^## [^\n]*`scripts/[^\n]*\n(?s:.*?)(?=^## |\Z)", text):  # headed by a script
        if "| flag | default |" in section.group(0):
            continue
        for pattern, value in ((PROSE_NUMBER, float), (PROSE_DEFAULT, str)):
            for m in pattern.finditer(section.group(0)):
                at = section.start() + m.start()
                found.append((script_at(text, at + 1), m.group(1), value(m.group(2)),
                              f"{page}:{text.count(chr(10), 0, at) + 1}"))
    return found


@pytest.mark.parametrize("page", PAGES)
def test_each_documented_default_is_the_codes(page):
    defaults = {}
    wrong = []
    for script, flag, cell, where in tables(page):
        defaults.setdefault(script, code_defaults(script))
        if flag not in defaults[script] or not agrees(documented(cell), defaults[script][flag]):
            wrong.append(f"{where} {script} {flag}: documented {cell.strip()!r}, code {defaults[script].get(flag)!r}")
    for script, flag, written, where in prose(page):
        defaults.setdefault(script, code_defaults(script))
        if flag not in defaults[script] or not agrees(written, defaults[script][flag]):
            wrong.append(f"{where} {script} {flag}: documented {written!r}, code {defaults[script].get(flag)!r}")
    assert wrong == []


def test_the_pages_are_read():
    """What the test above reads: flags.md's table of chat_rl holds every flag of chat_rl, the README's the flags a
    user usually changes, and the prose defaults of chat_eval, chat_cli, tok_train and chat_sft are found."""
    flags_md = {(script, flag) for script, flag, _, _ in tables("docs/flags.md")}
    assert flags_md == {("chat_rl", option) for action in cli.rl_parser()._actions for option in action.option_strings
                        if option != "-h" and option != "--help"}
    readme = {flag for script, flag, _, _ in tables("README.md") if script == "chat_rl"}
    assert {"--source", "--num-samples", "--max-new-tokens", "--temperature", "--keep-last", "--debug"} <= readme
    found = {(script, flag) for script, flag, _, _ in prose("docs/flags.md")}
    assert {("chat_eval", "--num-examples"), ("chat_cli", "--temperature"), ("chat_cli", "--source"),
            ("chat_cli", "--seed"), ("tok_train", "--vocab-size"), ("chat_sft", "--device-batch-size"),
            ("chat_sft", "--stop-check-every")} <= found


def test_a_default_that_differs_is_found():
    """The comparison itself: a number, a literal, a switch and words against defaults that agree and that do not."""
    assert agrees(documented("1.0"), 1.0) and agrees(documented("0"), 0.0) and not agrees(documented("0.6"), 1.0)
    assert agrees(documented("`sft`"), "sft") and not agrees(documented("`mid`"), "sft")
    assert agrees(documented("off"), False) and not agrees(documented("off"), 0)
    assert agrees(documented("largest `d<N>`"), None) and not agrees(documented("largest `d<N>`"), "d20")
    assert not agrees(documented("1"), True)  # a switch is documented as off, never as a number
