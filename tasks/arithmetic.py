"""
Arithmetic: short math word problems generated on the fly, in GSM8K's conversation format, so that RL can
be seen learning on a CPU in minutes (no download, any number of examples, graded difficulty).

A problem is a chain of quantities about one person's objects ("Mia has 4 bags with 12 apples in each.
She gives away 5 apples. ..."). The model has to pick the right numbers and operation for each step and
call the calculator; the calculator does the arithmetic. The reference answer looks like GSM8K's parsed form:

    [text "4 bags of 12 apples make ", python "4*12", python_output "48",
     text "48 apples.\\nMia gives away 5, so Mia has ", python "48-5", python_output "43",
     text "43 apples.\\n#### 43"]

Difficulty (calculator calls in the reference solution, and what else makes it harder):
  1  one operation on two numbers (+, -, *); nothing irrelevant.
  2  two steps, one distractor sentence with an irrelevant number; division appears.
  3  three steps, one or two distractors, numbers sometimes in words ("twelve"), sentences not in solution
     order (the question first, the starting amount stated last).
  4  four steps with units (dozens, weeks of days, dollars), two or three distractors, more words.
A tiny model learns a fixed template set within a couple of minutes on a 2-core CPU (measured), leaving RL
nothing to do. The intent for the default difficulty is a model that, after a few minutes of SFT, gets
partial credit (roughly 20-60% pass@1 sampled at temperature 1) so RL has room to improve; the default is
meant to be tuned against the SFT script's measurements.

Division: the engine forces str(eval(expr)) after a tool call, and Python's "48/4" gives 12.0 (as in
GSM8K's own solutions, which write "/"). So a division's python_output is "12.0", exactly what the model will see at RL
time, and the text after it and the final "#### 12" use the integer. Every division is exact, every
expression is written with integers, and every value stays in 2..9999.

Splits: example i of split s is drawn from random.Random(sha256 of (s, difficulty, seed, i)), never from
Python's per-process salted hash(). Train and test are disjoint by construction: a question belongs to test
iff the first byte of its text's sha256 is below TEST_BUCKET (~10% of questions); each split redraws until
the question falls in its own bucket.
"""

import hashlib
import random
import re

from nanochat.engine.calculator import format_result, use_calculator
from nanochat.errors import UserError
from tasks.common import FinalAnswerTask

SPLITS = ("train", "test")
DEFAULT_SIZES = {"train": 10_000, "test": 1_000}
DEFAULT_DIFFICULTY = 2
TEST_BUCKET = 26  # of 256: ~10% of all questions are test questions
MAX_VALUE = 9999  # every number in a problem and its solution stays below 10,000
MAX_DRAWS = 10_000  # redraws per example; a draw is rejected ~10x on average for test, far less for train

NAMES = [("Mia", "she"), ("Tom", "he"), ("Ava", "she"), ("Leo", "he"), ("Zoe", "she"), ("Sam", "he"),
         ("Ella", "she"), ("Max", "he"), ("Lily", "she"), ("Ben", "he"), ("Nora", "she"), ("Jack", "he"),
         ("Ruby", "she"), ("Owen", "he"), ("Ivy", "she"), ("Finn", "he")]
# (objects, containers they come in)
OBJECTS = [("apples", "bags"), ("marbles", "jars"), ("stickers", "packs"), ("cards", "boxes"),
           ("pencils", "cases"), ("cookies", "trays"), ("eggs", "cartons"), ("books", "shelves"),
           ("shells", "buckets"), ("beads", "jars"), ("stamps", "albums"), ("flowers", "vases"),
           ("crayons", "boxes"), ("coins", "purses")]
GAIN_VERBS = ["buys", "finds", "gets", "picks up", "wins", "collects"]
LOSE_VERBS = ["gives away", "loses", "sells", "uses"]
TIMES_WORDS = {2: "twice", 3: "three times", 4: "four times", 5: "five times"}

# Which moves each difficulty draws from; a move's cost is its number of calculator calls. units: every
# problem converts dozens or weeks, or ends in dollars. word_p: chance a number is written in words.
# reorder_p: chance the starting amount is stated after later events (and half that: the question first).
LEVELS = {
    1: dict(calls=1, units=False, distractors=(0, 0), word_p=0.0, reorder_p=0.0,
            starts=("plain", "groups"), middles=("gain", "lose", "more", "fewer"), finals=("total",)),
    2: dict(calls=2, units=False, distractors=(1, 1), word_p=0.0, reorder_p=0.0,
            starts=("plain", "groups"), middles=("gain", "lose", "more", "fewer", "times"),
            finals=("share", "pack", "total")),
    3: dict(calls=3, units=False, distractors=(1, 2), word_p=0.3, reorder_p=0.5,
            starts=("plain", "groups"), middles=("gain", "lose", "more", "fewer", "times", "buy_groups"),
            finals=("share", "pack", "total")),
    4: dict(calls=4, units=True, distractors=(2, 3), word_p=0.4, reorder_p=0.6,
            starts=("plain", "groups", "dozen", "weeks"),
            middles=("gain", "lose", "more", "fewer", "times", "buy_groups"),
            finals=("share", "pack", "total", "price")),
}
START_CALLS = {"plain": 0, "groups": 1, "dozen": 1, "weeks": 2}
MIDDLE_CALLS = {"gain": 1, "lose": 1, "more": 1, "fewer": 1, "times": 1, "buy_groups": 2}
FINAL_CALLS = {None: 0, "share": 1, "pack": 1, "total": 1, "price": 1}
RELATIONS = ("more", "fewer", "times")
UNIT_STARTS = ("dozen", "weeks")

_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
         "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def number_to_words(n):
    """English words for 0 <= n <= 99: 7 -> "seven", 42 -> "forty-two"."""
    if not 0 <= n <= 99:
        raise ValueError(f"number_to_words handles 0..99, got {n}")
    if n < 20:
        return _ONES[n]
    tens, ones = divmod(n, 10)
    return _TENS[tens] + ("" if ones == 0 else "-" + _ONES[ones])


def stable_seed(*parts):
    """A 64-bit seed from the parts' text, the same in every process (unlike hash() of a str)."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "big")


def split_of_question(question):
    """'test' for ~10% of question texts, 'train' for the rest: what keeps the splits disjoint."""
    return "test" if hashlib.sha256(question.encode()).digest()[0] < TEST_BUCKET else "train"


class _Rejected(Exception):
    """The numbers drawn so far cannot complete the chain (e.g. no exact division); draw again."""


class _Problem:
    """Builds one problem: question sentences (each with the person it is about, for pronouns) and the
    reference solution's calculator steps, in solution order. render_question turns the sentences into the
    question's text, render_solution the steps into the reference answer."""

    def __init__(self, rng, level):
        self.rng, self.level = rng, level
        (self.main, self.other, self.extra) = rng.sample(NAMES, 3)  # the subject, a relative, a bystander
        self.objects, self.containers = rng.choice(OBJECTS)
        self.focus = self.main  # whose count the chain is tracking
        self.value = None
        self.sentences = []  # dicts: subject (name, pronoun) or None, text with {S} for the subject, tag
        self.steps = []  # (lead text, expression, calculator output text, tail text)

    # -- helpers ---------------------------------------------------------------------------------------

    def num(self, n):
        """A number as the question states it: digits, or words with probability word_p."""
        return number_to_words(n) if n <= 99 and self.rng.random() < self.level["word_p"] else str(n)

    def say(self, subject, text, tag="fact", late_text=None):
        """late_text: how to state a starting amount after the events that follow it."""
        self.sentences.append({"subject": subject, "text": text, "tag": tag, "late_text": late_text})

    def call(self, lead, expr, tail):
        """Record a calculator step. Its output is the text the engine will force at RL time (Python's
        str of the value: "12.0" for 48/4); the chain continues with the value as an integer."""
        result = use_calculator(expr)
        if result is None or result != int(result) or not 2 <= result <= MAX_VALUE:
            raise _Rejected(expr)
        value = int(result)
        self.steps.append((lead, expr, format_result(result), tail.format(v=value)))
        self.value = value
        return value

    def draw(self, lo, hi):
        if hi < lo:
            raise _Rejected(f"empty range {lo}..{hi}")
        return self.rng.randint(lo, hi)

    # -- moves (sentences + solution steps), in solution order --------------------------------------------

    def start(self, kind):
        o, c, name = self.objects, self.containers, self.main[0]
        if kind == "plain":
            a = self.draw(10, 99)
            self.value = a
            words = f"{self.num(a)} {o}"
            text = self.rng.choice(["{S} has %s.", "{S} starts with %s.", "{S} owns %s."]) % words
            late_text = self.rng.choice(["{S} had %s at first.", "at the start, {S} had %s."]) % words
            self.say(self.main, text, tag="start", late_text=late_text)
        elif kind == "groups":
            n, m = self.draw(2, 12), self.draw(2, 25)
            self.say(self.main, self.rng.choice([
                f"{{S}} has {self.num(n)} {c} with {self.num(m)} {o} in each.",
                f"{{S}} has {self.num(n)} {c}, and each one holds {self.num(m)} {o}.",
                f"there are {self.num(m)} {o} in each of {name}'s {self.num(n)} {c}."]), tag="start")
            self.call(f"{n} {c} of {m} {o} make ", f"{n}*{m}", "{v} " + o + ".\n")
        elif kind == "dozen":
            n = self.draw(2, 12)
            self.say(self.main, f"{{S}} {self.rng.choice(GAIN_VERBS)} {self.num(n)} dozen {o}.", tag="start")
            self.call(f"{n} dozen is ", f"{n}*12", "{v} " + o + ".\n")
        elif kind == "weeks":
            a, w = self.draw(2, 15), self.draw(2, 8)
            self.say(self.main, f"{{S}} collects {self.num(a)} {o} every day for {self.num(w)} weeks.", tag="start")
            days = self.call(f"{w} weeks is ", f"{w}*7", "{v} days.\n")
            self.call(f"In {days} days {name} collects ", f"{a}*{days}", "{v} " + o + ".\n")
        else:
            raise ValueError(kind)

    def middle(self, kind):
        o, c, v = self.objects, self.containers, self.value
        who = self.focus[0]
        if kind == "gain":
            b = self.draw(2, min(99, MAX_VALUE - v))
            verb = self.rng.choice(GAIN_VERBS)
            self.say(self.focus, f"{{S}} {verb} {self.num(b)} more {o}.", tag="event")
            self.call(f"{who} {verb} {b} more, so {who} has ", f"{v}+{b}", "{v} " + o + ".\n")
        elif kind == "lose":
            b = self.draw(2, min(99, v - 2))
            verb = self.rng.choice(LOSE_VERBS)
            if self.rng.random() < 0.3:
                self.say(self.focus, f"{{S}} gives {self.num(b)} {o} to {self.extra[0]}.", tag="event")
                verb = "gives away"
            else:
                self.say(self.focus, f"{{S}} {verb} {self.num(b)} {o}.", tag="event")
            self.call(f"{who} {verb} {b}, so {who} has ", f"{v}-{b}", "{v} " + o + ".\n")
        elif kind == "buy_groups":
            n, m = self.draw(2, 9), self.draw(2, 20)
            self.say(self.focus, f"{{S}} {self.rng.choice(['buys', 'gets'])} {self.num(n)} {c} with "
                                 f"{self.num(m)} {o} in each.", tag="event")
            g = self.call(f"{n} {c} of {m} {o} make ", f"{n}*{m}", "{v} " + o + ".\n")
            self.call(f"With {g} more, {who} has ", f"{v}+{g}", "{v} " + o + ".\n")
        elif kind in RELATIONS:
            new, base = self.other, self.focus[0]
            self.focus = new
            if kind == "more":
                b = self.draw(2, min(99, MAX_VALUE - v))
                self.say(new, f"{{S}} has {self.num(b)} more {o} than {base}.", tag="relation")
                self.call(f"{new[0]} has {b} more than {base}: ", f"{v}+{b}", "{v} " + o + ".\n")
            elif kind == "fewer":
                b = self.draw(2, min(99, v - 2))
                self.say(new, f"{{S}} has {self.num(b)} fewer {o} than {base}.", tag="relation")
                self.call(f"{new[0]} has {b} fewer than {base}: ", f"{v}-{b}", "{v} " + o + ".\n")
            else:
                k = self.draw(2, 5)
                self.say(new, f"{{S}} has {TIMES_WORDS[k]} as many {o} as {base}.", tag="relation")
                self.call(f"{new[0]} has {k} times as many as {base}: ", f"{v}*{k}", "{v} " + o + ".\n")
        else:
            raise ValueError(kind)

    def final(self, kind):
        """The last step and the question; returns the question sentence."""
        o, c, v, who = self.objects, self.containers, self.value, self.focus[0]
        if kind is None:
            last_lost = bool(self.steps) and "-" in self.steps[-1][1]
            endings = ["have left", "have now"] if last_lost else ["have now", "have in all", "end up with"]
            ending = self.rng.choice(endings)
            return f"How many {o} does {who} {ending}?"
        if kind == "total":
            d = self.draw(2, min(99, MAX_VALUE - v))
            self.say(self.other, f"{{S}} has {self.num(d)} {o}.", tag="fact")
            self.call(f"Together {who} and {self.other[0]} have ", f"{v}+{d}", "{v} " + o + ".\n")
            return f"How many {o} do {who} and {self.other[0]} have together?"
        if kind in ("share", "pack"):
            lo, hi = (2, 12) if kind == "share" else (2, 25)
            divisors = [k for k in range(lo, hi + 1) if v % k == 0 and v // k >= 2]
            if not divisors:
                raise _Rejected(f"{v} has no divisor in {lo}..{hi}")
            k = self.rng.choice(divisors)
            if kind == "share":
                self.say(self.focus, f"{{S}} shares them equally among {self.num(k)} friends.")
                self.call("Each friend gets ", f"{v}/{k}", "{v} " + o + ".\n")
                return f"How many {o} does each friend get?"
            self.say(self.focus, f"{{S}} packs them into {c} of {self.num(k)} each.")
            self.call(f"{who} fills ", f"{v}/{k}", "{v} " + c + ".\n")
            return f"How many {c} does {who} fill?"
        if kind == "price":
            p = self.draw(2, min(20, MAX_VALUE // v))
            self.say(self.focus, f"{{S}} sells all of them for {self.num(p)} dollars each.")
            self.call(f"{who} gets ", f"{v}*{p}", "{v} dollars.\n")
            return f"How many dollars does {who} get?"
        raise ValueError(kind)


def _distractors(problem, count):
    """`count` different sentences with irrelevant numbers (different, so that none contradicts another)."""
    o, x = problem.objects, problem.extra
    kinds = [(x, "{S} is %s years old."),
             (problem.main, "{S} also has %s " + problem.rng.choice([ob for ob, _ in OBJECTS if ob != o]) + "."),
             (x, "{S} has %s " + problem.rng.choice([ob for ob, _ in OBJECTS if ob != o]) + "."),
             (x, "{S} has %s " + o + "."),
             (None, "the shop is %s minutes away."),
             (problem.main, "{S} is in a class of %s kids.")]
    return [{"subject": subject, "text": text % problem.num(problem.draw(2, 99)), "tag": "distractor"}
            for subject, text in problem.rng.sample(kinds, count)]


def render_solution(problem):
    """The reference answer in GSM8K's parsed form: text, python, python_output per step, then "#### N"."""
    parts, text = [], ""
    for lead, expr, output, tail in problem.steps:
        parts.append({"type": "text", "text": text + lead})
        parts.append({"type": "python", "text": expr})
        parts.append({"type": "python_output", "text": output})
        text = tail
    parts.append({"type": "text", "text": f"{text}#### {problem.value}"})
    return parts


def render_question(problem, question):
    """The question text of a _Problem whose moves are made, ending (or, sometimes, starting) with `question`: a
    late-stated start moves after the events it precedes, distractors go anywhere, and a sentence about the person
    the previous one named sometimes says "she"/"he"."""
    level, rng = problem.level, problem.rng
    sentences = list(problem.sentences)
    events = 1
    while events < len(sentences) and sentences[events]["tag"] == "event":
        events += 1
    if sentences[0]["late_text"] and events > 1 and rng.random() < level["reorder_p"]:
        sentences = sentences[1:events] + [dict(sentences[0], text=sentences[0]["late_text"])] + sentences[events:]
    lo, hi = level["distractors"]
    for extra in _distractors(problem, rng.randint(lo, hi)):
        # "Mia also has ..." only after Mia has appeared
        first = 0
        if "also" in extra["text"]:
            first = next(i + 1 for i, s in enumerate(sentences) if s["subject"] == problem.main)
        sentences.insert(rng.randint(first, len(sentences)), extra)
    rendered, previous = [], None
    names = {name for name, _ in NAMES}
    for s in sentences:
        subject = s["subject"]
        if subject is None:
            name = ""
        elif subject == previous and rng.random() < 0.6:
            name = subject[1]
        else:
            name = subject[0]
        text = s["text"].replace("{S}", name)
        rendered.append(text[0].upper() + text[1:])
        # a pronoun next could mean either person when a sentence names two
        previous = subject if len(set(re.findall(r"[A-Z][a-z]+", text)) & names) <= 1 else None
    if rng.random() < level["reorder_p"] / 2:
        return " ".join([question] + rendered)
    return " ".join(rendered + [question])


def _plan(rng, level):
    """(start, middles, final) whose calculator calls add up to the level's count."""
    calls = level["calls"]
    starts = [s for s in level["starts"] if START_CALLS[s] <= calls]
    if level["units"] and rng.random() < 0.5:
        starts = [s for s in starts if s in UNIT_STARTS]  # half open with a unit conversion...
    start = rng.choice(starts)
    remaining = calls - START_CALLS[start]
    final = None
    if level["units"] and start not in UNIT_STARTS:
        final = "price"  # ...the others end in dollars
    elif remaining > 0 and rng.random() < 0.5:
        final = rng.choice(level["finals"])
    remaining -= FINAL_CALLS[final]
    middles = []
    while remaining > 0:
        options = [m for m in level["middles"] if MIDDLE_CALLS[m] <= remaining
                   and not (m in RELATIONS and (final == "total" or any(x in RELATIONS for x in middles)))]
        middles.append(rng.choice(options))
        remaining -= MIDDLE_CALLS[middles[-1]]
    return start, middles, final


def generate(rng, difficulty):
    """One problem drawn from rng: (question, assistant parts). Redraws internally until the numbers work."""
    level = LEVELS[difficulty]
    for _ in range(MAX_DRAWS):
        problem = _Problem(rng, level)
        start, middles, final = _plan(rng, level)
        try:
            problem.start(start)
            for kind in middles:
                problem.middle(kind)
            question = problem.final(final)
        except _Rejected:
            continue
        return render_question(problem, question), render_solution(problem)
    raise RuntimeError(f"could not draw an arithmetic problem at difficulty {difficulty} in {MAX_DRAWS} tries")


class Arithmetic(FinalAnswerTask):
    """Procedural word problems with calculator calls; reward 1 for the right "#### N", as GSM8K."""

    def __init__(self, split="train", difficulty=DEFAULT_DIFFICULTY, size=None, seed=None, **slice_kwargs):
        super().__init__(**slice_kwargs)
        if split not in SPLITS:
            raise UserError(f"unknown arithmetic split {split!r}; use one of {', '.join(SPLITS)}")
        if difficulty not in LEVELS:
            raise UserError(f"arithmetic difficulty must be one of {', '.join(map(str, LEVELS))}, got {difficulty!r}")
        if size is not None and (not isinstance(size, int) or size < 1):
            raise UserError(f"arithmetic size must be a positive integer (or None for {DEFAULT_SIZES[split]}), "
                            f"got {size!r}")
        self.split, self.difficulty, self.seed = split, difficulty, seed
        self.size = DEFAULT_SIZES[split] if size is None else size

    def num_examples(self):
        return self.size

    def get_example(self, index):
        rng = random.Random(stable_seed("arithmetic", self.split, self.difficulty, self.seed, index))
        for _ in range(MAX_DRAWS):
            question, parts = generate(rng, self.difficulty)
            if split_of_question(question) == self.split:
                return {"messages": [{"role": "user", "content": question},
                                     {"role": "assistant", "content": parts}]}
        raise RuntimeError(f"no {self.split} question in {MAX_DRAWS} draws for example {index}")


def describe(n=3, difficulties=tuple(LEVELS), split="train"):
    """Print n examples of each difficulty: the question and the reference solution with its tool calls."""
    for difficulty in difficulties:
        task = Arithmetic(split=split, difficulty=difficulty)
        print(f"=== difficulty {difficulty} ===")
        for i in range(n):
            messages = task[i]["messages"]
            shown = "".join(p["text"] if p["type"] == "text" else
                            f"<<{p['text']}" if p["type"] == "python" else f"={p['text']}>>"
                            for p in messages[1]["content"])
            print(f"Q: {messages[0]['content']}\nA: {shown}\n")


if __name__ == "__main__":
    describe()
