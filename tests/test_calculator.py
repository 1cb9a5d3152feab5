"""The calculator tool: nanochat's values for what it allows, None for everything else, in bounded time."""

import threading
import time

import pytest

from nanochat.calculator import format_result, use_calculator


@pytest.mark.parametrize("expr, expected", [
    ("48/2", 24.0),                 # true division gives a float, as Python's eval does
    ("48+24", 72),
    ("1,234 + 5", 1239),            # commas are stripped
    ("-(3+4)*2", -14),
    ("0.2*50", 0.2 * 50),
    ("  7 - 10 ", -3),
    ("7//2", 3),                    # floor division: nanochat's character set allows it and eval computes it
    ("-7.5//2", -4.0),
    ("'strawberry'.count('r')", 3),
    ('"banana".count("an")', 2),
])
def test_values_match_python(expr, expected):
    value = use_calculator(expr)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("expr", [
    "2**10", "2 ** 10", "__import__('os')", "().__class__", "abs(-1)", "'a'*10", "'abc'.upper()",
    "'abc'.count('a').__class__", "open('x')", "1/0", "", "   ", "1 +", "x.count('a')", "'a'.count(x)",
    "'__class__'.count('_')", "lambda: 1", "[1,2][0]", "007",
])
def test_refused(expr):
    assert use_calculator(expr) is None


def test_not_a_string():
    assert use_calculator(None) is None and use_calculator(12) is None


def test_huge_values_return_none_or_value_quickly():
    """A product of long numbers is bounded by the expression length; printing past Python's 4300-digit
    limit gives None instead of an exception in the engine."""
    expr = "*".join(["9" * 90] * 10)  # ~900 digits
    t0 = time.monotonic()
    value = use_calculator(expr)
    assert value == int("9" * 90) ** 10
    assert format_result(value) == str(value)
    assert time.monotonic() - t0 < 1.0
    assert format_result(10 ** 5000) is None
    assert format_result(None) is None  # a refused call forces no output (not the text 'None')


def test_deep_nesting_is_refused_quickly_from_a_worker_thread():
    """nanochat's SIGALRM timeout raises outside the main thread; this calculator needs no signal."""
    results = []
    exprs = ["(" * 400 + "1" + ")" * 400, "(" * 90 + "1" + ")" * 90, "-" * 999 + "1"]
    thread = threading.Thread(target=lambda: results.extend(use_calculator(e, timeout=0.5) for e in exprs))
    t0 = time.monotonic()
    thread.start()
    thread.join(timeout=5)
    assert not thread.is_alive() and time.monotonic() - t0 < 3
    assert results[0] is None          # over the length cap
    assert results[1] == 1             # legal nesting still evaluates
    assert results[2] in (1, -1, None)  # 999 unary minus: a value or a refusal, never a hang
