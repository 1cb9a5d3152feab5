"""
The calculator tool the model calls between <|python_start|> and <|python_end|>.

nanochat strips commas and then `eval`s the expression with empty builtins under a SIGALRM timeout, if it
passes a text gate:
  - pure arithmetic (characters `0-9*+-/.() `) without `**`, or
  - string work: letters, digits, quotes, `()._` and spaces, containing `.count(`, and none of nanochat's
    dangerous words (DANGEROUS_WORDS, matched as substrings of the lower-cased text, so even
    `'directory'.count('r')` is refused: it contains "dir").
This module applies the same gate, but SIGALRM only works in the main thread and `eval` of model output is a
sandbox that has to be right every time. So the expression is parsed with `ast` and a tiny interpreter
evaluates only:
  - numbers, + - * / //, unary +/-, parentheses, and the empty tuple `()` (eval gives `()` for it),
  - string literals and the methods count, lower, upper, strip and replace called on them, chained
    (`'Strawberry'.lower().count('r')` is 3).
Anything else (names, other attributes and methods, subscripts, comprehensions...) is refused, where nanochat
would have evaluated some of it (`'abc'.title().count('A')`). Values are what Python's eval gives for the same
text (int/int division gives a float, etc.), because the model was trained on nanochat's outputs.
Limits: without `**` and string repetition, a number's size is bounded by the expression's length; a string
that would grow past MAX_STRING_CHARS (replace can multiply a length) is refused before it is built; and the
interpreter checks a deadline between nodes, which works in any thread.
"""

import ast
import operator
import time

ARITHMETIC_CHARS = frozenset("0123456789*+-/.() ")
STRING_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789'\"()._ ")
# nanochat's list (engine.use_calculator): a string expression containing any of these, in any case, is refused
DANGEROUS_WORDS = ("__", "import", "exec", "eval", "compile", "open", "file", "input", "raw_input", "globals",
                   "locals", "vars", "dir", "getattr", "setattr", "delattr", "hasattr")
MAX_EXPRESSION_CHARS = 1000  # far beyond any real tool call; keeps parse time and recursion bounded
MAX_STRING_CHARS = 100_000   # memory cap on any string the interpreter builds

_BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.FloorDiv: operator.floordiv}  # the tool's characters allow `//`, and nanochat's eval computes it
_UNARY_OPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class _Refused(Exception):
    """The expression uses something the calculator does not allow."""


def _replace(text, old, new, count=-1):
    """str.replace, refused before it builds a string over the memory cap."""
    if not (isinstance(text, str) and isinstance(old, str) and isinstance(new, str) and type(count) is int):
        raise TypeError("replace takes strings and an int count")
    found = len(text) + 1 if old == "" else text.count(old)
    replaced = found if count < 0 else min(count, found)
    if len(text) + replaced * (len(new) - len(old)) > MAX_STRING_CHARS:
        raise _Refused("replace result over the memory cap")
    return text.replace(old, new, count)


# method name -> function of (receiver, *args); arguments are checked by str's own methods (TypeError)
_STRING_METHODS = {"count": str.count, "lower": str.lower, "upper": str.upper, "strip": str.strip,
                   "replace": _replace}


def _evaluate(node, deadline):
    if time.monotonic() > deadline:
        raise _Refused("timeout")
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, deadline)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, str):
        if isinstance(node.value, str) and len(node.value) > MAX_STRING_CHARS:
            raise _Refused("string literal over the memory cap")
        return node.value
    if isinstance(node, ast.Tuple) and not node.elts:
        return ()
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left, deadline), _evaluate(node.right, deadline)
        if isinstance(left, str) or isinstance(right, str):
            raise _Refused("arithmetic on strings")  # e.g. 'a' * 10**9 would allocate gigabytes
        return _BINARY_OPS[type(node.op)](left, right)  # the only tuple is (), and () * n is () for any n
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        operand = _evaluate(node.operand, deadline)
        if isinstance(operand, str):
            raise _Refused("arithmetic on a string")
        return _UNARY_OPS[type(node.op)](operand)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _STRING_METHODS
            and not node.keywords and not any(isinstance(arg, ast.Starred) for arg in node.args)):
        receiver = _evaluate(node.func.value, deadline)
        if not isinstance(receiver, str):
            raise _Refused(f".{node.func.attr} on a {type(receiver).__name__}")
        args = [_evaluate(arg, deadline) for arg in node.args]
        return _STRING_METHODS[node.func.attr](receiver, *args)
    raise _Refused(type(node).__name__)


def _allowed_text(expr):
    """nanochat's gate, applied before evaluating (expr has its commas stripped)."""
    chars = set(expr)
    if chars <= ARITHMETIC_CHARS:
        return "**" not in expr
    if chars <= STRING_CHARS:
        lowered = expr.lower()
        return ".count(" in expr and not any(word in lowered for word in DANGEROUS_WORDS)
    return False


def evaluate(expr, timeout=3.0):
    """The interpreter alone, without nanochat's text gate: the value of expr, or None if it is refused, fails,
    or would exceed the time or memory limit."""
    if not isinstance(expr, str) or not expr.strip() or len(expr) > MAX_EXPRESSION_CHARS:
        return None
    try:
        tree = ast.parse(expr.strip(), mode="eval")
        return _evaluate(tree, time.monotonic() + timeout)
    except (_Refused, SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError, RecursionError, MemoryError):
        return None


def use_calculator(expr, timeout=3.0):
    """Evaluate a tool call as nanochat does. Returns an int or float (arithmetic, .count), a str (a chain
    ending in lower/upper/strip/replace), the empty tuple (`()`), or None if refused or failed."""
    if not isinstance(expr, str):
        return None
    expr = expr.replace(",", "")  # "1,234 + 5" is how people (and GSM8K) write numbers
    if not _allowed_text(expr):
        return None
    return evaluate(expr, timeout)


# How a tool result is written (--calculator-format): "str", nanochat's str(value), so an integral float is `10.0`;
# "int", an integral float written without its `.0` where it is exact (|x| < 2**53), as GSM8K's SFT data writes
# results (nanochat PR #786, open). The forced tokens differ, so a checkpoint records the choice.
DEFAULT_FORMAT = "str"  # nanochat's: the engine's, chat_rl's --calculator-format, a checkpoint's that records none
CALCULATOR_FORMATS = (DEFAULT_FORMAT, "int")
EXACT_INTEGER_FLOAT = 2.0 ** 53  # beyond it a float's integer part is no longer every integer


def format_result(value, style=DEFAULT_FORMAT):
    """The text the engine forces after <|output_start|>: str(value) as nanochat prints it (`'abc'.upper()`
    gives ABC without quotes, `()` gives ()), or with style "int" an integral float below 2**53 as an int (10.0 ->
    10; 1e+20 stays 1e+20), or None if there is no value or it cannot be printed (Python refuses int->str beyond
    4300 digits)."""
    if value is None:
        return None
    if style == "int" and isinstance(value, float) and value.is_integer() and abs(value) < EXACT_INTEGER_FLOAT:
        value = int(value)
    try:
        return str(value)
    except ValueError:
        return None


def recorded_calculator_format(meta):
    """How the run that wrote a checkpoint had the calculator write its results (an RL run's --calculator-format,
    in the user_config of its checkpoint's meta), so that evaluating or chatting with it forces the same text; nanochat's (DEFAULT_FORMAT)
    for any other checkpoint."""
    return (meta.get("user_config") or {}).get("calculator_format") or DEFAULT_FORMAT
