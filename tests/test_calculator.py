"""The calculator tool: nanochat's values for what it allows, None for everything else, in bounded time."""

import threading
import time

import pytest

from nanochat.calculator import MAX_STRING_CHARS, evaluate, format_result, use_calculator


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
    ("'Strawberry'.lower().count('r')", 3),     # string methods chain on a literal, as in nanochat's eval
    ("'Strawberry'.upper().count('R')", 3),
    ("'  pear '.strip().count(' ')", 0),
    ("'xxaxx'.strip('x').count('x')", 0),
    ("'a.count(b)'.upper()", "A.COUNT(B)"),     # a str result: the gate only asks for the text `.count(`
    ("()", ()),                                 # pure-arithmetic characters; eval gives the empty tuple
    ("(())", ()),
    ("() * 99999999999", ()),
])
def test_values_match_python(expr, expected):
    value = use_calculator(expr)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("expr", [
    "2**10", "2 ** 10", "__import__('os')", "().__class__", "abs(-1)", "'a'*10", "'abc'.upper()",
    "'abc'.count('a').__class__", "open('x')", "1/0", "", "   ", "1 +", "x.count('a')", "'a'.count(x)",
    "'__class__'.count('_')", "lambda: 1", "[1,2][0]", "007", "-()", "()/2", "()()",
    "'abc'.title().count('A')",                 # methods other than count/lower/upper/strip/replace
    "'abc'.count('a').count('a')",              # .count on an int
    "'aaa'.replace('a', 'b').count('b')",       # commas are stripped first: replace gets one argument
])
def test_refused(expr):
    assert use_calculator(expr) is None


@pytest.mark.parametrize("expr", [
    "'directory'.count('r')", "'Profile'.count('f')", "'reopened'.count('e')", "'VARSITY'.count('V')",
    "'medieval'.count('e')", "'dirt'.lower().count('d')",
])
def test_dangerous_words_refuse_the_whole_expression(expr):
    """nanochat refuses a string expression containing one of its dangerous words anywhere, in any case,
    even inside a quoted word ('directory' contains 'dir'); the calculator must not answer where it did not."""
    assert use_calculator(expr) is None
    assert evaluate(expr) is not None  # the interpreter alone would answer: the gate refuses it


@pytest.mark.parametrize("value, text", [(3, "3"), (24.0, "24.0"), ("A.COUNT(B)", "A.COUNT(B)"), ((), "()")])
def test_formatted_as_nanochat_prints_it(value, text):
    """nanochat forces str(result): strings without quotes, the empty tuple as ()."""
    assert format_result(value) == text


def test_memory_cap_refuses_growing_strings():
    """replace can multiply a string's length; a chain that would pass the cap returns nothing, quickly,
    and never builds the string. Width methods (zfill, ljust, ...) are not in the tool's language at all."""
    grow = ".replace('a', 'aaaaaaaaaa')"
    assert evaluate("'a'" + grow * 5) == "a" * 10 ** 5 and 10 ** 5 <= MAX_STRING_CHARS
    t0 = time.monotonic()
    assert evaluate("'a'" + grow * 6) is None
    assert evaluate("'a'" + grow * 30 + ".count('a')") is None
    empty_needle = "'ab'.replace('', '" + "x" * 300 + "')"  # inserts at the 3 gaps: 902 characters
    assert len(evaluate(empty_needle)) == 902
    assert evaluate(empty_needle + ".replace('x', '" + "y" * 200 + "')") is None  # 180,002 characters
    assert time.monotonic() - t0 < 1.0
    assert evaluate("'aXa'.replace('a', 'bb', 1)") == "bbXa"
    assert use_calculator("'a'.zfill(99999999999).count('a')") is None
    assert use_calculator("'a'.ljust(99999999999).count('a')") is None


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
