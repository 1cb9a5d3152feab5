"""Every script's --help shows each flag's default (issue 74: chat_eval's and chat_cli's showed none, so what
`--num-examples` does without a value was found in the source). Read from the --help text itself, as a user reads it:
every flag that takes a value says its default, by `(default: ...)` (nanochat.cli.DefaultsShown) or in its own words
(`default: the largest d<N>`); a switch (no value) is off unless given."""

import importlib
import re

import pytest
from helpers import REPO

SCRIPTS = sorted(p.stem for p in (REPO / "scripts").glob("*.py") if p.stem != "__init__")


def help_entries(text):
    """--help's option entries: (what it is invoked as, e.g. '-t TEMPERATURE, --temperature TEMPERATURE', and its
    whole entry, wrapped lines joined)."""
    entries, current = [], None
    for line in text.splitlines():
        if line.startswith("  -"):
            current = [line.strip()]
            entries.append(current)
        elif line.startswith("   ") and current is not None:
            current.append(line.strip())
        else:
            current = None
    return [(re.split(r"\s{2,}", entry[0])[0], " ".join(entry)) for entry in entries]


def takes_a_value(invocation):
    """'--source SOURCE' and '-t T, --temperature T' do; '-h, --help' and '--debug' (switches) do not."""
    return any(" " in option for option in invocation.split(", "))


def script_help(script, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(f"scripts.{script}").main(["--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_shows_every_flags_default(script, monkeypatch, capsys):
    entries = help_entries(script_help(script, monkeypatch, capsys))
    valued = [(invocation, entry) for invocation, entry in entries if takes_a_value(invocation)]
    assert valued, f"{script}: no flag found in its --help"
    assert [invocation for invocation, entry in valued if "default" not in entry.lower()] == []


def test_the_help_reader_finds_a_missing_default():
    """The reader itself, on a made-up --help: a flag whose entry says no default is found, wrapped or not; a switch
    and a flag with its default are not."""
    text = ("usage: x\n\noptions:\n  -h, --help            show this help message and exit\n"
            "  --steps STEPS         how many (default: 3)\n  --source SOURCE       checkpoint family\n"
            "  --model-tag MODEL_TAG\n                        model tag; default: the largest d<N>\n"
            "  --resume [RESUME]     continue a run\n                        from its last step\n")
    entries = help_entries(text)
    missing = [invocation for invocation, entry in entries if takes_a_value(invocation) and "default" not in entry.lower()]
    assert missing == [
        "--source SOURCE", "--resume [RESUME]"]
