"""The calculator tool: nanochat's values for what it allows, None for everything else, in bounded time."""

import sys
import threading
import tracemalloc
from types import SimpleNamespace

import pytest

import nanochat.engine.calculator
from nanochat.engine.calculator import MAX_EXPRESSION_CHARS, MAX_STRING_CHARS, evaluate, format_result, use_calculator


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
    """replace can multiply a string's length; a chain that would pass the cap returns nothing and never
    builds the string: the traced peak stays under 3 * MAX_STRING_CHARS bytes (a replace's receiver and
    result, each at most the cap in one-byte characters, and the parse of an expression shorter than the cap),
    where one replace past the cap here would build 10 * MAX_STRING_CHARS. Width methods (zfill, ljust, ...)
    are not in the tool's language at all."""
    grow = ".replace('a', 'aaaaaaaaaa')"
    assert evaluate("'a'" + grow * 5) == "a" * 10 ** 5 and 10 ** 5 <= MAX_STRING_CHARS
    assert MAX_EXPRESSION_CHARS <= MAX_STRING_CHARS
    empty_needle = "'ab'.replace('', '" + "x" * 300 + "')"  # inserts at the 3 gaps: 902 characters
    tracemalloc.start()
    try:
        assert evaluate("'a'" + grow * 6, timeout=float("inf")) is None  # the cap refuses, not the time limit
        assert evaluate("'a'" + grow * 30 + ".count('a')", timeout=float("inf")) is None
        assert len(evaluate(empty_needle)) == 902
        assert evaluate(empty_needle + ".replace('x', '" + "y" * 200 + "')", timeout=float("inf")) is None  # 180,002
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * MAX_STRING_CHARS, peak
    assert evaluate("'aXa'.replace('a', 'bb', 1)") == "bbXa"
    assert use_calculator("'a'.zfill(99999999999).count('a')") is None
    assert use_calculator("'a'.ljust(99999999999).count('a')") is None


def test_not_a_string():
    assert use_calculator(None) is None and use_calculator(12) is None


def test_huge_values_are_bounded_by_the_expression_length():
    """Without ** a product has at most as many digits as its factors together, so the expression's length
    bounds every number (and so the time to compute it); printing past Python's 4300-digit limit gives None
    instead of an exception in the engine."""
    expr = "*".join(["9" * 90] * 10)  # ~900 digits
    value = use_calculator(expr, timeout=float("inf"))
    assert value == int("9" * 90) ** 10 and len(str(value)) <= len(expr) <= MAX_EXPRESSION_CHARS
    assert format_result(value) == str(value)
    assert use_calculator("9" * 90 + "**10") is None
    assert format_result(10 ** 5000) is None
    assert format_result(None) is None  # a refused call forces no output (not the text 'None')


def in_worker_thread(fn, join_timeout):
    """fn() run in a thread of its own (nanochat's SIGALRM timeout raises outside the main thread), joined
    for at most join_timeout seconds: a guard against a hang, not a measure of speed."""
    results = []
    thread = threading.Thread(target=lambda: results.append(fn()))
    thread.start()
    thread.join(timeout=join_timeout)
    assert not thread.is_alive(), "the calculator hung in a worker thread"
    return results[0]


def test_the_time_limit_refuses_from_a_worker_thread(monkeypatch):
    """The interpreter reads the clock before each node and refuses once the deadline has passed, in any
    thread. A clock that advances one second per read makes the deadline fire at a known node, whatever the
    machine's speed: `1+2+3+4` visits 8 nodes (Expression, 3 BinOps, 4 Constants) after the read that sets
    the deadline, so it needs a limit of 8 seconds and is refused with 7."""
    ticks = iter(range(10 ** 6))
    monkeypatch.setattr(nanochat.engine.calculator, "time", SimpleNamespace(monotonic=lambda: float(next(ticks))))
    assert in_worker_thread(lambda: use_calculator("1+2+3+4", timeout=8), join_timeout=60) == 10
    assert in_worker_thread(lambda: use_calculator("1+2+3+4", timeout=7), join_timeout=60) is None
    assert in_worker_thread(lambda: use_calculator("'ab'.upper().count('A')", timeout=0), join_timeout=60) is None


def test_deep_nesting_is_refused_or_evaluated_from_a_worker_thread():
    """Parser-depth bombs come back as None or a value, never a hang or a RecursionError, in a worker thread.
    Each call's deadline is far beyond its milliseconds of work, so the machine's speed or load cannot decide an
    outcome (the deadline itself is pinned with a scripted clock above); the join waits for all of them: only a
    hang reaches it. Python's recursion limit is its default (1000) here: torch's Inductor raises it for the
    process once it has compiled, and then 999 nested minuses evaluate (seen when a compile test ran first in
    the same process)."""
    limit = 30.0
    exprs = ["(" * 400 + "1" + ")" * 400, "(" * 90 + "1" + ")" * 90, "-" * 999 + "1", "-" * 99 + "1"]
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        results = in_worker_thread(lambda: [use_calculator(e, timeout=limit) for e in exprs],
                                   join_timeout=len(exprs) * limit + 60)
    finally:
        sys.setrecursionlimit(before)
    assert results[0] is None          # past Python's parser limit of 200 nested parentheses: a SyntaxError
    assert results[1] == 1             # legal nesting still evaluates
    # 999 unary minus: evaluating it nests 1000 calls, past Python's recursion limit (1000) from any caller's
    # depth, and the calculator documents a RecursionError as a refusal; 99 of them evaluate, to -1 (an odd count)
    assert results[2] is None and results[3] == -1


def test_the_int_format_writes_integral_floats_below_two_to_the_53_as_ints():
    """--calculator-format=int on both sides of its bound (issue 67: `<=` for `<` passed): 2**53 - 1 and its negative
    as ints, 2**53 (past which a float no longer holds every integer) and 1e20 as Python prints floats; 2.5 as it is;
    the str format leaves every float as Python prints it."""
    big = 2.0 ** 53
    assert format_result(big - 1, "int") == "9007199254740991" and format_result(1 - big, "int") == "-9007199254740991"
    assert format_result(big, "int") == "9007199254740992.0" and format_result(-big, "int") == "-9007199254740992.0"
    assert format_result(1e20, "int") == "1e+20" and format_result(2.5, "int") == "2.5" and format_result(10.0, "int") == "10"
    assert format_result(10.0) == "10.0" and format_result(big - 1) == "9007199254740991.0"
