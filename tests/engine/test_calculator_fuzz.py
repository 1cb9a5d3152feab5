"""Fuzzing the calculator tool with hostile model output.

The calculator runs text a policy model wrote, thousands of times per RL step, and a policy under RL
pressure finds whatever the tool lets through. A seeded generator builds a corpus of hostile expressions
(sandbox escapes, resource bombs, parser-depth bombs, unicode look-alikes, string-method abuse ...); every
one must come back quickly as None or a value, with no side effect and bounded memory, and a value must
equal an independent reference: Python's own eval for short pure arithmetic (where eval is safe); for string
expressions nanochat's text gate (its dangerous words, restated here) and then Python's eval of a literal
followed by a chain of the tool's string methods (safe: none of them can allocate much with one-literal
arguments); and plain Python arithmetic on the generator's operands for huge numbers.
"""

import json
import math
import os
import random
import re
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from helpers import REPO

from nanochat.engine.calculator import format_result, use_calculator
from nanochat.engine.engine import Engine
from nanochat.engine.spec import rollout_spec

SEED = 1234
MIN_CORPUS = 1000
CALL_LIMIT_S = 3.0  # the time limit each call is given (use_calculator's timeout)
RSS_LIMIT_MB = 200

# the reference's own definition of "pure arithmetic" (deliberately not imported from the calculator)
PURE_ARITHMETIC = frozenset("0123456789*+-/.() ")
# nanochat's gate for string expressions (engine.use_calculator, January 2026), restated independently
STRING_ALPHABET = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789'\"()._ ")
NANOCHAT_DANGEROUS = ["__", "import", "exec", "eval", "compile", "open", "file", "input", "raw_input", "globals",
                      "locals", "vars", "dir", "getattr", "setattr", "delattr", "hasattr"]
# 'literal' (or several, concatenated) then .method() / .method('literal') of the tool's methods, chained
_LITERAL = r"""(?:'[^'\n]*'|"[^"\n]*")"""
CHAIN_RE = re.compile(rf"^ *(?:{_LITERAL} *)+(?:\. *(?:count|lower|upper|strip|replace) *\( *(?:{_LITERAL} *)?\) *)*$")

LOOKALIKES = {
    "0": ["\uff10", "\u0660", "\u06f0", "\u0966", "\u2070", "\U0001d7ce"],
    "1": ["\uff11", "\u0661", "\u00b9", "\u2460", "\U0001d7cf", "l", "I"],
    "2": ["\uff12", "\u0662", "\u00b2", "\u0968"],
    "3": ["\uff13", "\u0663", "\u00b3"],
    "5": ["\uff15", "\u0665"],
    "7": ["\uff17", "\u0667"],
    "9": ["\uff19", "\u0669"],
    "+": ["\uff0b", "\u2795", "\u207a", "\u02d6"],
    "-": ["\u2212", "\u2013", "\u2014", "\uff0d", "\u2010", "\u02d7"],
    "*": ["\u00d7", "\u2217", "\uff0a", "\u22c5", "\u2715"],
    "/": ["\u00f7", "\u2215", "\u2044", "\uff0f"],
    "(": ["\uff08", "\u207d", "\u2768"],
    ")": ["\uff09", "\u207e", "\u2769"],
    ".": ["\u3002", "\uff0e", "\u2024", "\u00b7"],
    " ": ["\u00a0", "\u2003", "\u3000", "\t", "\n", "\r", "\x0b", "\x0c"],
    "c": ["\u0441", "\u03f2", "\uff43", "\U0001d41c"],   # Cyrillic es, Greek lunate sigma, fullwidth, math bold
    "o": ["\u043e", "\u03bf", "\uff4f", "\u0585"],
    "u": ["\u057d", "\uff55", "\u03c5"],
    "n": ["\u0578", "\uff4e"],
    "t": ["\uff54", "\u0442"],
    "a": ["\u0430", "\uff41", "\u03b1"],
    "'": ["\u2019", "\u2018", "\u02bc", "\uff07", "`"],
    '"': ["\u201c", "\u201d", "\uff02"],
}
INVISIBLES = ["\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad", "\u202e", "\x00", "\u180e"]


# -----------------------------------------------------------------------------
# the corpus

def _number(rng, max_digits=6, allow_float=True):
    digits = str(rng.randint(0, 10 ** rng.randint(1, max_digits)))
    if allow_float and rng.random() < 0.3:
        return rng.choice([f"{digits}.{rng.randint(0, 999)}", f".{rng.randint(0, 99)}", f"{digits}."])
    if rng.random() < 0.1:
        return f"{int(digits):,}"  # "1,234": commas are stripped, as people write numbers
    return digits


def _arith_tree(rng, depth):
    """A random expression over the pure-arithmetic alphabet; `//` sometimes (floor division, as nanochat's eval)."""
    if depth == 0 or rng.random() < 0.3:
        return _number(rng)
    kind = rng.random()
    if kind < 0.15:
        return rng.choice(["-", "+", "- ", "--", "-+"]) + _arith_tree(rng, depth - 1)
    if kind < 0.35:
        return "(" + _arith_tree(rng, depth - 1) + ")"
    op = rng.choice(["+", "-", "*", "/", " + ", " * ", " / ", " - ", "//"] if rng.random() < 0.1
                    else ["+", "-", "*", "/", " + ", " * ", " / ", " - "])
    return _arith_tree(rng, depth - 1) + op + _arith_tree(rng, depth - 1)


def _count_literal(rng, alphabet="abcrsty 01_"):
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
    return text.replace("__", "_a")


def _quoted(rng, text):
    q = rng.choice("'\"")
    return f"{q}{text}{q}"


def _lookalike(rng, expr):
    """One character swapped for a look-alike, or an invisible character inserted."""
    candidates = [i for i, ch in enumerate(expr) if ch in LOOKALIKES]
    if candidates and rng.random() < 0.7:
        i = rng.choice(candidates)
        return expr[:i] + rng.choice(LOOKALIKES[expr[i]]) + expr[i + 1:]
    i = rng.randint(0, len(expr))
    return expr[:i] + rng.choice(INVISIBLES) + expr[i:]


def hostile_corpus(rng, sentinel):
    """(corpus, known): a deterministic list of hostile expressions, and {expr: expected value} for those the
    generic references below do not cover (huge numbers, which eval is not trusted with, computed with Python's
    own arithmetic, None where Python raises; other legal spellings of string literals).
    `sentinel` is a path that expressions try to create."""
    S = sentinel
    corpus, known = [], {}

    # ---- hand-written escapes and bombs
    corpus += [
        "__import__('os').system('touch %s')" % S, "__import__('os')", "__import__", "import os",
        "().__class__", "().__class__.__bases__[0]", "().__class__.__bases__[0].__subclasses__()",
        "().__class__.__base__.__subclasses__()[0]", "''.__class__.__mro__[1].__subclasses__()",
        "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'Popen'][0]('touch %s', shell=True)" % S,
        "globals()", "locals()", "vars()", "dir()", "globals()['__builtins__']", "__builtins__",
        "__builtins__.__dict__['open']('%s', 'w')" % S, "open('%s', 'w')" % S, "open('%s','w').write('x')" % S,
        "open('/etc/passwd').read()", "exec('open(\"%s\", \"w\")')" % S, "eval('1+1')", "eval(\"__import__('os')\")",
        "compile('1', 'x', 'eval')", "getattr(1, '__class__')", "setattr(object, 'x', 1)", "breakpoint()",
        "input()", "exit()", "quit()", "help()", "print(1)", "lambda: 1", "(lambda: 1)()",
        "(lambda f: f(f))(lambda f: f(f))", "[x for x in range(10**10)]", "{x: x for x in range(9)}",
        "(x for x in ())", "[i*i for i in range(99999999)]", "f'{1+1}'", "f\"{__import__('os').system('touch %s')}\"" % S,
        "f'{open(\"%s\",\"w\")}'" % S, "(x := 5)", "(y:=__import__('os'))", "1; import os", "1;2", "1\n2",
        "1 # comment", "#", "# just a comment", "1 + 1 # ; __import__('os')", "1\\\n+1", "'a'*10**10",
        "'a'*99999999999", "'a' * 10 ** 10", "'ab'*(10**9)", "['a']*10**10", "b'a'*10**10", "'a'*2**40",
        "'x'*9999999999 .count('x')", "('a'*99999999999).count('a')", "2**99999", "2 ** 9", "2* *9", "2 * * 9",
        "(2)**(9)", "2**-1", "pow(2,3)", "pow(2, 99999)", "9**9**9**9", "10**10**10", "-2**0.5", "2.0**1e6",
        "2 **  3", "(1)(2)", "1(2)", "()", "(1,2)", "[]", "{}", "...", "None", "True", "False", "1 if 1 else 0",
        "not 1", "1 and 2", "1 or 2", "1 < 2", "1 == 1", "~1", "1 % 2", "1 @ 2", "1 & 3", "1 | 2", "1 ^ 3",
        "1 << 100000", "1 >> 1", "7//2", "7 // 2", "-7//2", "1e308*10", "1e999", "1j", "0x10", "0b101",
        "0o17", "1_000", "007", "00", "0.0", "-0.0", "+.5", "5.", ".", "..", "1..2", "1.2.3", "(", ")", "((",
        "))", "()()", "+", "-", "*", "/", "", " ", "\t", "\n", "\x00", "1\x00", ",", ",,,", "1,234", "1,2,3",
        "'\\x5f\\x5f'", "'\\x5f\\x5fimport\\x5f\\x5f'", "'\\u005f\\u005f'", "'\\N{LOW LINE}'", "r'\\x5f'",
        "'''a'''.count('a')", "'a' 'b'.count('a')", "'\\x61'.count('a')", "'a'.count('\\x61')",
        "'a'.count('a').__class__", "'a'.count('a').__class__.__bases__[0].__subclasses__()",
        "'abc'.count(*'a')", "'abc'.count(sub='a')", "'abc'.count('a', 1)", "'abc'.count('a',0,2)",
        "'abc'.count()", "'abc'.count", "'a'.count('a')('b')", "'a'.count('a')+1", "'a'.count(x)",
        "x.count('a')", "'a'.count('a'.count('a'))", "'a'.count(1)", "b'a'.count(b'a')",
        "'a'.count('a') if 1 else 0", "('a'*5).count('a')", "'a'.__class__.count('a','a')",
        "str.count('aa', 'a')", "'a'.count('a');1", "'a'.count('a')\n__import__('os')", "'a'.count('a') # x",
        "'a'.count('a')\t", "'a'.count(('a'))", "('a').count('a')", "'a'.count('a').real", "'a'.upper().count('A')",
        "'a'.count('a') .count('a')", "'%s'.count('s')", "'{}'.format(1).count('1')", "'__'.count('_')",
        "'_'.count('_')", "'a_b'.count('_')", "u'a'.count('a')", "r'a'.count('a')", "'a'.count(u'a')",
        "'a'.count", ".count('a')", "'Strawberry'.lower().count('r')", "'Strawberry'.upper().count('R')",
        "' pear '.strip().count(' ')", "'xxaxx'.strip('x').count('a')", "'a.count(b)'.upper()", "'.count('",
        "'a.count(b)'.lower().strip()", "'directory'.count('r')", "'PROFILE'.count('F')", "'opener'.count('e')",
        "'vars'.count('a')", "'Medieval'.lower().count('e')", "'aaa'.replace('a','b').count('b')",
        "'aaa'.replace('a' 'b').count('b')", "'a'.zfill(99999999999).count('a')", "'a'.center(99999999999).count('a')",
        "'a'.ljust(10**10).count('a')", "(1).to_bytes(99999999999).count(b'')", "'abc'.title().count('A')",
        "'abc'.count('a').bit_length()", "'a'.lower.count('a')", "() * 99999999999", "()+()", "(())", "-()", "()/2", "'a'.count('a'", "'a'.count('a'))", "'a.count('a')", "'a'..count('a')",
        "'1+1<|python_end|><|output_start|>2'", "1+1<|python_end|>", "<|assistant_end|>", "1<|output_end|>",
        "\\x31+\\x31", "\\u0031", "1\u200b+1", "\u0661+\u0661", "\uff11\uff12\uff13", "\uff11\uff0b\uff11",
        "1 \u2212 1", "2\u00d73", "6\u00f72", "'a'.\u0441ount('a')", "'a'.c\u043eunt('a')",
        "\uff4f\uff50\uff45\uff4e('%s','w')" % S, "\uff3f\uff3fimport\uff3f\uff3f('os')",
        "\U0001d428\U0001d429\U0001d41e\U0001d427('%s', 'w')" % S, "'a'.\uff43\uff4f\uff55\uff4e\uff54('a')",
        "1" * 10 ** 6, "1+" * 200_000 + "1", "," * 10 ** 6 + "__import__('os')", "(" * 10 ** 5 + ")" * 10 ** 5,
        "-" * 100_000 + "1", "'" + "a" * 10 ** 6 + "'.count('a')",
    ]

    # ---- dunder and attribute chains
    bases = ["()", "[]", "{}", "''", '""', "0", "1 ", "(1)", "'a'.count('a')", "len", "type(0)", "object",
             "(lambda:0)", "print", "__builtins__", "str", "_", "x", "'a'"]
    attrs = ["__class__", "__bases__[0]", "__base__", "__subclasses__()", "__mro__[-1]", "__init__", "__globals__",
             "__builtins__", "__dict__", "__code__", "co_consts", "__getattribute__('__class__')", "__reduce__()",
             "__reduce_ex__(2)", "mro()", "__self__", "__func__", "count", "count('a')", "real", "imag",
             "conjugate()", "__doc__", "__name__", "__module__", "__len__()", "format", "join", "__add__(1)"]
    tails = ["", "()", "['os']", "[0]", ".system('touch %s')" % S, "('os')", ".__call__()", "(1)"]
    for _ in range(220):
        corpus.append(rng.choice(bases) + "".join("." + rng.choice(attrs) for _ in range(rng.randint(1, 4)))
                      + rng.choice(tails))

    # ---- calls of builtins
    funcs = ["pow", "abs", "eval", "exec", "compile", "open", "getattr", "setattr", "__import__", "globals",
             "locals", "vars", "dir", "input", "print", "breakpoint", "exit", "help", "memoryview", "bytearray",
             "range", "sum", "max", "min", "round", "divmod", "int", "float", "str", "chr", "ord", "hex", "id",
             "hash", "iter", "next", "sorted", "map", "filter", "zip", "type", "isinstance", "super", "len"]
    args = ["2,3", "'1+1'", "'%s','w'" % S, "10**10", "'a'*10**9", "", "0", "*'a'", "x=1", "'os'", "[]",
            "2, 99999", "'__import__(\"os\")'", "1"]
    for _ in range(160):
        corpus.append(f"{rng.choice(funcs)}({rng.choice(args)})" + rng.choice(["", "", "+1", ".count('a')", "*2"]))

    # ---- syntax around an arithmetic payload: lambdas, comprehensions, f-strings, walrus, statements
    wrappers = ["lambda: {}", "(lambda: {})()", "[{} for _ in '12']", "{{{}}}", "f'{{{}}}'", "(z := {})",
                "{}; import os", "{};{}", "{}\n{}", "{} # {}", "{}  #", "if 1: {}", "{} if 1 else {}",
                "[{}][0]", "({},)[0]", "({})[0]", "{}.real", "{}.__class__", "int({})", "float({})",
                "-{}", "({})", "{}.0", "'{}'", "\"{}\".count('1')", "{} {}", "{}\\\n"]
    for _ in range(140):
        w = rng.choice(wrappers)
        corpus.append(w.format(*[_arith_tree(rng, 2) for _ in range(w.count("{}"))]))

    # ---- string repetition to gigabytes
    for _ in range(60):
        lit = rng.choice(["'a'", "'ab'", '"x"', "'\\x00'", "b'a'", "['a']", "'a'.count('a')*'b'"])
        n = rng.choice(["10**10", "99999999999", "2**40", str(rng.randint(10 ** 9, 10 ** 12)), "9" * rng.randint(8, 30)])
        corpus.append(rng.choice([f"{lit}*{n}", f"{n}*{lit}", f"({lit}*{n}).count('a')", f"{lit} * {n}",
                                  f"len({lit}*{n})"]))

    # ---- ** in every spelling
    for _ in range(80):
        a, b = rng.choice(["2", "9", "10", "2.0", "(2)", "-2", "1.5"]), rng.choice(["9", "99999", "10**10", "-1", "0.5", "(9)"])
        corpus.append(rng.choice([f"{a}**{b}", f"{a} ** {b}", f"{a}* *{b}", f"{a} **{b}", f"{a}**  {b}",
                                  f"pow({a},{b})", f"pow({a}, {b}, 7)", f"1+{a}**{b}", f"({a}**{b})/1",
                                  f"{a}*{a}**{b}"]))

    # ---- nesting: parentheses, unary chains, long operator chains
    for depth in [10, 49, 50, 99, 100, 199, 200, 201, 300, 499, 500, 1000, 2000, 5000]:
        inner = rng.choice(["1", "1+1", "2*3", "-1"])
        corpus += ["(" * depth + inner + ")" * depth, "-" * depth + "1", "+-" * (depth // 2) + "1",
                   "(-" * depth + "1" + ")" * depth, "+".join(["1"] * depth),
                   "".join("1+(" for _ in range(depth)) + "1" + ")" * depth,
                   "(" * depth + inner]  # unbalanced
    # ---- huge integers and huge floats, with values computed by Python directly
    for _ in range(70):
        a = rng.randint(10 ** rng.randint(100, 450), 10 ** 451)
        b = rng.randint(10 ** rng.randint(1, 450), 10 ** 451)
        sa, sb = str(a), str(b)
        for expr, value in [(f"{sa}*{sb}", lambda: a * b), (f"{sa} + {sb}", lambda: a + b),
                            (f"{sa}-{sb}", lambda: a - b), (f"{sa}/{sb}", lambda: a / b),
                            (f"{sa}.0*{sb}.0", lambda: float(sa + ".0") * float(sb + ".0")),  # literals past 1e308 are inf
                            (f"{sa}/3", lambda: a / 3)]:
            if len(expr) <= 1000 and rng.random() < 0.35:
                try:
                    known[expr] = value()
                except OverflowError:
                    known[expr] = None
                corpus.append(expr)
    big = "9" * 200 + ".0"
    for expr, value in [(f"{big}*{big}", math.inf), (f"-{big}*{big}", -math.inf),
                        (f"({big}*{big})-({big}*{big})", math.nan), (f"1/({big}*{big})", 0.0),
                        ("9" * 400 + "/3", None), ("9" * 400 + ".0", math.inf), ("1.0*" + "9" * 400, None),
                        ("*".join(["9" * 95] * 10), int("9" * 95) ** 10)]:
        corpus.append(expr)
        known[expr] = value
    # legal spellings of a string literal that the plain-literal pattern of `reference` does not cover
    known.update({"'''a'''.count('a')": 1, "'a' 'b'.count('a')": 1, "u'a'.count('a')": 1, "r'a'.count('a')": 1,
                  "'a'.count(u'a')": 1, "'a'.count(('a'))": 1, "('a').count('a')": 1,
                  "'" + "a" * 10 ** 6 + "'.count('a')": None})  # over the calculator's 1000-character cap

    # ---- division by zero
    for _ in range(40):
        num = _arith_tree(rng, 1)
        corpus.append(rng.choice([f"{num}/0", f"{num}/0.0", f"{num}/(1-1)", f"{num} / (2*0)", f"{num}/-0",
                                  f"{num}/(0.5-0.5)", f"{num}/.0", f"{num}//0", "0/0"]))

    # ---- plain .count calls (checked against str.count) and their look-alike mutations
    counts = []
    for _ in range(160):
        text, sub = _count_literal(rng), _count_literal(rng, "abrs ")[:3]
        if rng.random() < 0.3 and text:
            sub = text[rng.randint(0, len(text) - 1):][:2]
        sp = lambda: rng.choice(["", "", " "])
        counts.append(f"{sp()}{_quoted(rng, text)}{sp()}.count({sp()}{_quoted(rng, sub)}{sp()}){sp()}")
    corpus += counts

    # ---- chains of the tool's string methods, some with nanochat's dangerous words inside the literal
    methods = [".lower()", ".upper()", ".strip()", ".strip('x')", ".strip( 'a' )", ".count('a')", ".count('R')",
               ".replace('a','b')", ".replace('a' 'b')", ".count()", ".upper ()"]
    for _ in range(160):
        text = "".join(rng.choice("abcRSTy xX01_.") for _ in range(rng.randint(0, 12))).replace("__", "_a")
        if rng.random() < 0.2:
            text += rng.choice(["dir", "File", "OPEN", "evaluate", "Vars", "input", ".count(x)"])
        chain = "".join(rng.choice(methods) for _ in range(rng.randint(0, 3)))
        corpus.append(_quoted(rng, text) + chain + (f".count({_quoted(rng, rng.choice('abxR '))})"
                                                    if rng.random() < 0.8 else ""))

    # ---- valid short arithmetic (checked against eval) and its look-alike mutations
    trees = [_arith_tree(rng, rng.randint(1, 5)) for _ in range(260)]
    corpus += trees
    corpus += [_lookalike(rng, rng.choice(trees + counts)) for _ in range(240)]

    # ---- character soup over the arithmetic alphabet (syntax edge cases)
    for _ in range(150):
        corpus.append("".join(rng.choice("0123456789*+-/.() ,") for _ in range(rng.randint(1, 25))))

    # unique, in generation order
    return list(dict.fromkeys(corpus)), known


# -----------------------------------------------------------------------------
# references

def paren_depth(expr):
    depth = deepest = 0
    for ch in expr:
        depth += (ch == "(") - (ch == ")")
        deepest = max(deepest, depth)
    return deepest


def reference(expr, known):
    """(checked, value): checked is False when there is no trusted reference for expr; value is what a
    faithful calculator returns (None = it must refuse)."""
    text = expr.replace(",", "")
    if expr in known:
        return True, known[expr]
    if set(text) <= STRING_ALPHABET and not set(text) <= PURE_ARITHMETIC:
        if ".count(" not in text or any(word in text.lower() for word in NANOCHAT_DANGEROUS):
            return True, None  # refused by nanochat's gate
        if not CHAIN_RE.match(text):
            return True, None  # nanochat would eval more (other methods, attributes); the tool stops here
        try:
            return True, eval(text, {"__builtins__": {}}, {})
        except Exception:
            return True, None
    if set(text) <= PURE_ARITHMETIC and text.strip():
        if "**" in text:
            return True, None  # refused by design (as nanochat does): a power can exhaust memory
        if len(text) < 200 and paren_depth(text) < 50:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "'int' object is not callable; perhaps you missed a comma?"
                    value = eval(text, {"__builtins__": {}}, {})
            except Exception:
                return True, None
            return True, value if type(value) in (int, float, tuple) else None
        return False, None
    return True, None  # everything else is outside the tool's language


def same_value(type_name, value, expected):
    """value as the fuzz child recorded it (a tuple as its repr) equals the reference's expected value."""
    if type_name != type(expected).__name__:
        return False
    if isinstance(expected, tuple):
        return value == repr(expected)
    if isinstance(expected, float) and math.isnan(expected):
        return math.isnan(value)
    return value == expected


# -----------------------------------------------------------------------------
# the run: in a child process, so a regression that hangs inside one C-level operation (a bignum power
# cannot be interrupted) fails the test instead of hanging it, and peak RSS measures the calculator alone

CHILD_TIMEOUT_S = 60

# argv: corpus.json progress_file out.json limit_seconds (each call's timeout). An audit hook (inert unless
# `active`) sees every exec/eval of code, import, open, os.system and subprocess at the C level, whoever calls
# them. The positive control at the end shows the hook is live.
_FUZZ_CHILD = r"""
import json, resource, sys, time, warnings
corpus_path, progress_path, out_path, limit = sys.argv[1:5]
events, active = [], [False]
sys.addaudithook(lambda event, args: events.append([event, repr(args)[:200]]) if active[0] else None)
from nanochat.engine.calculator import use_calculator
with open(corpus_path, encoding="utf-8") as f:
    corpus = json.load(f)
progress = open(progress_path, "w")
results = []
rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for i, expr in enumerate(corpus):
        progress.write(f"{i}\n")
        progress.flush()
        t0 = time.thread_time()  # the call's own CPU time: a loaded machine's waits do not count
        active[0] = True
        value = use_calculator(expr, timeout=float(limit))
        active[0] = False
        seconds = time.thread_time() - t0
        plain = type(value) in (int, float, str) or value is None
        results.append([type(value).__name__, value if plain else repr(value)[:200], seconds])
rss_growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
calculator_events = list(events)
events.clear()
active[0] = True
eval("1")
open(out_path + ".probe", "w").close()
active[0] = False
control_events = sorted({e[0] for e in events})
with open(out_path, "w", encoding="utf-8") as f:
    json.dump({"results": results, "rss_growth_mb": rss_growth_mb, "events": calculator_events,
               "control_events": control_events, "warnings": [str(w.message) for w in caught]}, f)
"""


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory):
    work = tmp_path_factory.mktemp("fuzz")
    sentinel = str(work / "pwned")
    corpus, known = hostile_corpus(random.Random(SEED), sentinel)
    corpus_path, progress_path, out_path = work / "corpus.json", work / "progress", work / "out.json"
    corpus_path.write_text(json.dumps(corpus), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        child = subprocess.run([sys.executable, "-c", _FUZZ_CHILD, str(corpus_path), str(progress_path), str(out_path),
                                str(CALL_LIMIT_S)],
                               cwd=work, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        index = int(progress_path.read_text().split()[-1])
        pytest.fail(f"the calculator hung on corpus[{index}] = {corpus[index][:200]!r}")
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(out_path.read_text(encoding="utf-8"))
    types = [r[0] for r in out["results"]]
    values = [r[1] for r in out["results"]]
    return SimpleNamespace(corpus=corpus, known=known, types=types, values=values,
                           durations=[r[2] for r in out["results"]], rss_growth_mb=out["rss_growth_mb"],
                           events=out["events"], control_events=out["control_events"], warnings=out["warnings"],
                           sentinel=sentinel)


def test_corpus_is_large_deterministic_and_covers_the_attack_families(tmp_path):
    a, known_a = hostile_corpus(random.Random(SEED), "/s")
    b, known_b = hostile_corpus(random.Random(SEED), "/s")
    assert a == b and known_a.keys() == known_b.keys()
    assert len(a) >= MIN_CORPUS
    for needle in ["__import__", "__subclasses__", "globals()", "'a'*10**10", "'a'*99999999999", "2**99999",
                   "2 ** 9", "pow(2,3)", "(" * 1000, "\uff11", "\u0661", "\u2212", ".\u0441ount", "\u200b",
                   "'abc'.count(*'a')", "sub='a'", "'\\x5f\\x5f'", "#", "\n", ";", ":=", "lambda", " for ", "f'",
                   ".lower().count(", "'directory'", ".zfill(99999999999)", "'a.count(b)'.upper()"]:
        assert any(needle in e for e in a), needle


def test_every_call_returns_within_its_time_limit(fuzz):
    """A call answers before its deadline or is refused by it: the interpreter reads the clock before each
    node, so a call whose deadline passed returns None, at most one node's work (one bounded operation) late;
    twice the limit leaves that overrun a whole limit. The durations are each call's own CPU time (thread_time),
    never more than its wall time, so a loaded machine that pauses the child cannot fail this (it can only make
    the deadline refuse more calls); a hang fails the fixture at CHILD_TIMEOUT_S. test_calculator pins the deadline
    itself with a scripted clock."""
    for expr, type_name, seconds in zip(fuzz.corpus, fuzz.types, fuzz.durations):
        assert seconds <= CALL_LIMIT_S or type_name == "NoneType", (expr[:200], seconds, type_name)
        assert seconds < 2 * CALL_LIMIT_S, (expr[:200], seconds)


def test_results_are_none_numbers_strings_or_the_empty_tuple(fuzz):
    for expr, type_name, value in zip(fuzz.corpus, fuzz.types, fuzz.values):
        assert type_name in ("NoneType", "int", "float", "str", "tuple"), (expr[:200], type_name, value)
        assert type_name != "tuple" or value == "()", (expr[:200], value)


def test_results_match_the_reference(fuzz):
    """Pure arithmetic equals Python's eval (same type: 48/2 is 24.0; `()` is ()), string-method chains equal
    eval behind nanochat's gate, huge numbers equal Python's arithmetic, and everything outside the tool's
    language is refused."""
    checked = accepted = 0
    for expr, type_name, value in zip(fuzz.corpus, fuzz.types, fuzz.values):
        has_reference, expected = reference(expr, fuzz.known)
        if not has_reference:
            continue
        checked += 1
        accepted += value is not None
        if expected is None:
            assert value is None, (expr[:200], value)
        else:
            assert same_value(type_name, value, expected), (expr[:200], value, expected)
    # the comparison is not vacuous: most of the corpus has a reference, and hundreds of values were checked
    assert checked >= 0.9 * len(fuzz.corpus) and accepted >= 300


def test_formatted_results_are_printable(fuzz):
    """What the engine forces after <|output_start|> is str(value), or nothing."""
    for value in fuzz.values:
        assert format_result(value) == (None if value is None else str(value))


def test_memory_stays_bounded(fuzz):
    assert fuzz.rss_growth_mb < RSS_LIMIT_MB


def test_nothing_is_executed(fuzz):
    """No audit event other than ast.parse's own 'compile' while the calculator ran, and the sentinel file
    that many expressions try to create does not exist. A positive control shows the hook sees exec and open."""
    assert not os.path.exists(fuzz.sentinel)
    assert [e for e in fuzz.events if e[0] != "compile"] == []
    assert any(e[0] == "compile" for e in fuzz.events)  # the hook saw the calculator's ast.parse calls
    assert {"exec", "open"} <= set(fuzz.control_events)
    assert fuzz.warnings == []


# -----------------------------------------------------------------------------
# the engine keeps running when the model writes hostile tool calls

class PerPromptScriptedModel(torch.nn.Module):
    """Each prompt's rows emit that prompt's script (token k of the completion = script[k]; the last token
    repeats). Prompt i has length i + 1. The prefill writes t + 1 into the key slot of each position t (a batched
    prefill pads prompts to the longest, so a row cannot know its own length then), and each decode step writes 0
    into its position's: since the engine copies a prompt's positions into each of its rows, a row's prompt length is
    the largest value among its positions so far, so many prompts can share one batch."""

    def __init__(self, scripts, vocab_size):
        super().__init__()
        width = max(len(s) for s in scripts)
        self.scripts = torch.tensor([s + [s[-1]] * (width - len(s)) for s in scripts])  # (P, width)
        self.config = SimpleNamespace(sequence_len=4096, vocab_size=vocab_size, n_layer=1, n_head=1, n_kv_head=1, n_embd=2)
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # device and dtype for the engine

    def get_device(self):
        return self.anchor.device

    def forward(self, idx, cache_step=None):
        return self.logits(self.hidden_states(idx, cache_step))

    def hidden_states(self, idx, cache_step=None):
        """(B, T, 2): per position, (prompt length, completion index of the next token)."""
        B, T = idx.shape
        positions = cache_step.positions  # (B, T)
        k_store = cache_step.cache.k  # a KVCache's (share_prompts=False): the double's own per-row memory
        rows = torch.arange(B)[:, None]
        if T > 1:  # a prefill: every row starts at 0
            k_store[0, rows, positions, 0, 0] = (positions + 1).float()
            return torch.stack([positions + 1, torch.zeros_like(positions)], dim=-1)
        k_store[0, rows, positions, 0, 0] = 0.0
        seen = torch.arange(k_store.size(2))[None, :] <= positions  # (B, keys)
        prompt_len = torch.where(seen, k_store[0, :, :, 0, 0], 0.0).amax(dim=1).long().clamp(min=1)  # (B,)
        return torch.stack([prompt_len[:, None], positions + 1 - prompt_len[:, None]], dim=-1)

    def logits(self, hidden):
        prompt_len, k = hidden[..., 0], hidden[..., 1].clamp(0, self.scripts.size(1) - 1)
        next_token = self.scripts[(prompt_len - 1).clamp(0, self.scripts.size(0) - 1), k]  # (...)
        logits = torch.full((*hidden.shape[:-1], self.config.vocab_size), -1e9)
        logits.scatter_(-1, next_token[..., None], 0.0)
        return logits


def test_engine_survives_hostile_tool_calls(fuzz, tiny_tokenizer):
    tok = tiny_tokenizer
    sp = {name: tok.encode_special(f"<|{name}|>") for name in
          ("python_start", "python_end", "output_start", "output_end", "assistant_end")}
    rng = random.Random(SEED + 1)
    short = [(e, v) for e, v in zip(fuzz.corpus, fuzz.values) if len(e) <= 200]
    accepted = [e for e, v in short if v is not None]
    refused = [e for e, v in short if v is None]
    sample = rng.sample(refused, 24) + rng.sample(accepted, 6)
    rng.shuffle(sample)
    scripts = [[sp["python_start"], *tok.encode(e), sp["python_end"], sp["assistant_end"]] for e in sample]
    model = PerPromptScriptedModel(scripts, tok.get_vocab_size())
    # fewer rows than prompts: rows are recycled mid-run; the double keeps its state in a per-row KV cache
    engine = Engine(model, tok, rollout_spec(model, max_rows=16, share_prompts=False))
    prompts = [[tok.get_bos_token_id()] * (i + 1) for i in range(len(sample))]
    max_tokens = max(len(s) for s in scripts) + 64
    results = engine.generate_many(prompts, num_samples=2, max_tokens=max_tokens, temperature=0.0)
    for expr, per_prompt in zip(sample, results):
        expr_tokens = tok.encode(expr)
        assert tok.decode(expr_tokens) == expr
        text = format_result(use_calculator(expr))
        forced = [] if text is None else [sp["output_start"], *tok.encode(text), sp["output_end"]]
        for c in per_prompt:
            assert c.ended and c.tool_calls == 1 and c.tool_successes == int(text is not None), expr
            assert c.tokens == [sp["python_start"], *expr_tokens, sp["python_end"], *forced], expr
            assert c.masks == [1] * (len(expr_tokens) + 2) + [0] * len(forced)
    assert sum(c.tool_successes for per_prompt in results for c in per_prompt) == 12
