"""
The calculator tool the model calls between <|python_start|> and <|python_end|>.

nanochat `eval`s the expression with empty builtins under a SIGALRM timeout. SIGALRM only works in the
main thread, and `eval` of model output is a sandbox that has to be right every time. Here the expression
is parsed with `ast` and a tiny interpreter evaluates only what the tool allows:
  - arithmetic: numbers, + - * / //, unary +/-, parentheses (characters `0-9*+-/.() `; `**` is refused),
  - `'text'.count('t')` on string literals.
Anything else (names, attributes other than `.count`, calls, subscripts, comprehensions...) is refused.
Values match what Python's eval would give for the same text (int/int division gives a float, etc.),
because the model was trained on nanochat's outputs. Without `**` and string repetition, a result's size is
bounded by the expression's length, so no input can exhaust memory; the interpreter also checks a deadline
between nodes, which works in any thread.
"""

import ast
import operator
import time

ARITHMETIC_CHARS = frozenset("0123456789*+-/.() ")
STRING_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789'\"()._ ")
MAX_EXPRESSION_CHARS = 1000  # far beyond any real tool call; keeps parse time and recursion bounded

_BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.FloorDiv: operator.floordiv}  # the tool's characters allow `//`, and nanochat's eval computes it
_UNARY_OPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class _Refused(Exception):
    """The expression uses something the calculator does not allow."""


def _evaluate(node, deadline):
    if time.monotonic() > deadline:
        raise _Refused("timeout")
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, deadline)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, str):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left, deadline), _evaluate(node.right, deadline)
        if isinstance(left, str) or isinstance(right, str):
            raise _Refused("arithmetic on strings")  # e.g. 'a' * 10**9 would allocate gigabytes
        return _BINARY_OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        operand = _evaluate(node.operand, deadline)
        if isinstance(operand, str):
            raise _Refused("arithmetic on a string")
        return _UNARY_OPS[type(node.op)](operand)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "count"
            and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str)
            and not node.keywords and len(node.args) == 1
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return node.func.value.value.count(node.args[0].value)
    raise _Refused(type(node).__name__)


def _allowed_text(expr):
    """The character-level gate nanochat applies before evaluating."""
    chars = set(expr)
    if chars <= ARITHMETIC_CHARS:
        return "**" not in expr
    if chars <= STRING_CHARS:
        return ".count(" in expr and "__" not in expr
    return False


def use_calculator(expr, timeout=3.0):
    """Evaluate a tool call. Returns an int, float or (for .count) int, or None if refused or failed."""
    if not isinstance(expr, str):
        return None
    expr = expr.replace(",", "")  # "1,234 + 5" is how people (and GSM8K) write numbers
    if not expr.strip() or len(expr) > MAX_EXPRESSION_CHARS or not _allowed_text(expr):
        return None
    try:
        tree = ast.parse(expr.strip(), mode="eval")
        return _evaluate(tree, time.monotonic() + timeout)
    except (_Refused, SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError, RecursionError, MemoryError):
        return None


def format_result(value):
    """The text the engine forces after <|output_start|>: str(value), or None if there is no value or it
    cannot be printed (Python refuses int->str beyond 4300 digits)."""
    if value is None:
        return None
    try:
        return str(value)
    except ValueError:
        return None
