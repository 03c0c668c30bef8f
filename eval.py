"""Rewards and reported results: answer extraction, equivalence, reward, pass@k and maj@k.

Paper: rStar2-Agent (arXiv 2508.20722), section 2.2 (the reward is a plain 0/1 outcome reward, "1 if the final
answer is correct, 0 otherwise", no format or tool-use shaping) and section 5 (results are average pass@1 over
16 samples per problem). Everything RL learns and everything we report rests on one question, "is this answer
right?", so this module answers it strictly where a reward could be gamed and generously where mathematics says
two answers are equal.

How data flows:

    response text --extract_answer--> the last \\boxed{...} inside <answer>...</answer> (or None: reward 0)
    (pred, gold) --normalize--> both stripped of decoration ($, \\left, units, degrees, %, "x =", \\!)
                 --fast path, in-process, microseconds--> plain numbers compared exactly as fractions,
                                                          text answers ("\\text{(C)}", "\\text{east}") as words
                 --otherwise: math-verify in a worker process--> parse to SymPy, decimals made exact, verify
                 --> True / False  (a timeout or a crash is False)
    reward = 1.0 if is_equiv(extract_answer(response), gold) else 0.0

Grader decisions (each one is pinned by a test in tests/test_eval.py):
  * A decimal equals only the number it denotes exactly: 0.5 == 1/2 and 27.0 == 27, but 0.333333 != 1/3 and
    3.14 (or 3.14159265) != pi. math-verify alone rounds to 6 places, which accepts 3.141593 for pi.
    Except a decimal printed to machine precision: one of 15 or more significant digits equals a number when it
    agrees with it to 15 significant digits (|d - g| < one unit in the 15th), so 0.0833333333333333 == 1/12,
    4.666666666666667 == 14/3 and 4.123105625617661 == sqrt(17). Why: a double holds 15.9 decimal digits, so
    15 agreeing digits are what Python's float repr, sympy's N() and numpy at full precision print for the exact
    value; only computing that value produces them, while the estimates the rule above refuses (6 to 8 digits,
    math-verify's rounding, numpy's default print) stay wrong. Digits past the 15th are a double's noise
    (0.1 + 0.2 prints 0.30000000000000004), so they are not read; a truncated 0.666666666666666 counts too.
    math-verify and Qwen's math_grader accept these (they compare with a tolerance: 6 places, relative 1e-4),
    so this is agreement, not leniency: a guess cannot hit 15 digits, and a hedge is still several answers.
    14 digits or fewer, or a different 15th digit (0.0833333333333353), stay wrong. An integer answer takes
    only its exact value (27.0 is 27): a float is not an integer however many digits agree, so
    2.2223224462942044e+62 is not F(300), a 63-digit integer, and 4.99999999999999999 is not 5.
  * Scientific notation is a number: 1.5\\times10^{3} == 1.5 \\cdot 10^3 == 1500 (one nonzero digit before the
    point, as scientific notation writes it; 15 \\times 10^{2} is a product, see "numeric gold" below).
  * "%" is a unit, dropped like "cm" or a degree sign: 50\\% == 50, and 50\\% != 0.5. A number is never rescaled
    by 100, so a gold 10 never accepts 0.1 or 1000 (the "include_percentage" leniency of Qwen-style graders).
  * Sets (and comma lists, MATH's "enter all solutions") match in any order; tuples, points, vectors and
    intervals must match element by element and bracket by bracket: (1,2) != (2,1), (3,4] != [3,4].
  * "x = 5" == 5 (also == "y = 5": the name before "=" is dropped when a plain number follows). Units (in
    \\text{} or \\textnormal{}, or words after a number: "7 days") and degree signs are ignored. math-verify's
    own unit stripping is switched off, because it reads "2t" or "5s" as 2 or 5.
  * Thousands separators (1,000 / 1{,}000 / 10,\\!080) and leading zeros (AIME's "033") are read as one integer.
    A comma is a thousands separator only between groups of exactly three digits with no space ("2,125");
    "1, 2", "1, 000" and "1,22" are lists (a comma is never a decimal point).
  * Algebraically equal expressions are equal (math-verify simplifies): (x+1)^2 == x^2+2x+1.
  * Word answers ("\\text{Evelyn}", "\\text{(C)}", a choice letter) are compared as words, case-insensitively;
    math-verify parses a bare word as a product of one-letter symbols (Evelyn -> E*e*l*n*v*y), which is not a
    word comparison one can reason about.
  * A number in another base keeps its base: 22_7 != 22_6 (math-verify drops subscripts); 4343 == 4343_6.
  * Predictions longer than MAX_ANSWER_CHARS are wrong: no answer needs them, and hedging lists or huge
    expressions are how a policy would stall or game a grader.

Bounded time, in any thread and under asyncio: math-verify's own timeouts use signal.alarm, which only works in
the main thread (off it, parse() raises ValueError instead of grading). So the slow path runs in a few
persistent worker processes: each grades one pair at a time under its own interval timer (a soft timeout that
answers False and keeps the warm worker), and the caller waits at most a hard deadline, after which the worker
is killed and restarted on next use (a computation stuck in C, such as 10^(10^10), never sees the soft timer).
The paper gets the same guarantee by sending verification to its code-environment service (section 3.1).
"""

import atexit
import functools
import json
import logging
import math
import os
import re
import select
import subprocess
import sys
import threading
from fractions import Fraction

# Seconds a worker may spend on one pair before it answers False itself (soft), and the extra seconds the caller
# waits before it kills the worker (hard deadline = GRADE_TIMEOUT_S + GRADE_KILL_GRACE_S).
GRADE_TIMEOUT_S = 5.0
GRADE_KILL_GRACE_S = 2.0
WORKER_START_TIMEOUT_S = 120.0   # importing sympy + math-verify on a busy 2-core machine can take many seconds
GRADER_WORKERS = max(1, min(4, os.cpu_count() or 1))   # worker processes, started lazily, one per busy caller
WORKER_MEMORY_MB = 2048          # address-space cap: 10**(10**10) fails fast with MemoryError instead of swapping
MAX_ANSWER_CHARS = 1000          # a prediction longer than this is wrong (see the module docstring)


# ---- answer extraction

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
BOXED = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")   # \boxed{..}, \boxed 5, \fbox{..}; not \boxedfoo


def answer_region(text: str) -> str:
    """The text the answer must come from: inside the last <answer> ... </answer> when there is one (an unclosed
    final <answer> runs to the end), else the whole response."""
    start = text.rfind(ANSWER_OPEN)
    if start < 0:
        return text
    region = text[start + len(ANSWER_OPEN):]
    end = region.find(ANSWER_CLOSE)
    return region if end < 0 else region[:end]


def braced_group(text: str, start: int) -> str | None:
    """The content of the {...} group that opens at text[start], honouring nesting and escaped braces (\\{ \\});
    None when it is never closed (a truncated response)."""
    depth, i = 0, start
    while i < len(text):
        ch = text[i]
        if ch == "\\":           # skip the escaped character: \{ and \} are literal braces, \\ a line break
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} / "\\boxed 5" in text; None if absent, empty or unclosed."""
    matches = list(BOXED.finditer(text))
    if not matches:
        return None
    i = matches[-1].end()
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        content = braced_group(text, i)
    else:                        # "\boxed 5": one token, up to a space, "$", a tag or the end
        content = re.match(r"[^\s$<]*", text[i:]).group(0).rstrip(".,;")
    if content is None or not content.strip():
        return None
    return content.strip()


def extract_answer(text: str) -> str | None:
    """The model's final answer: the last \\boxed{...} (nested braces, \\boxed 5, \\fbox), searched only inside
    <answer>...</answer> when the response has one. None means "no answer", which earns reward 0."""
    return last_boxed(answer_region(text))


def answer_format_ok(text: str) -> bool:
    """The paper's answer format: exactly one <answer>...</answer>, in that order, holding a complete \\boxed{}.
    (Extra or missing tags are what the RoC format penalty counts; this is the yes/no used for metrics.)"""
    if text.count(ANSWER_OPEN) != 1 or text.count(ANSWER_CLOSE) != 1:
        return False
    start, end = text.find(ANSWER_OPEN), text.find(ANSWER_CLOSE)
    return start < end and last_boxed(text[start + len(ANSWER_OPEN):end]) is not None


# ---- normalization: cheap string clean-up shared by the fast path and the worker

# Each (pattern, replacement) is applied in order. They remove presentation, never content.
DECORATIONS = [
    (re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![a-zA-Z])"), ""),  # \left( -> (
    (re.compile(r"\\(?:displaystyle|textstyle)(?![a-zA-Z])"), ""),
    (re.compile(r",\\!\s*"), ","),                                         # 11,\! 111 -> 11,111 (MATH's separator)
    (re.compile(r"(?<!\\)\\[!,;: ]|~"), ""),                               # LaTeX spacing: 10,\!080 -> 10,080
    (re.compile(r"\\[dtc]frac(?![a-zA-Z])"), r"\\frac"),                   # \dfrac, \tfrac, \cfrac -> \frac
    (re.compile(r"\{,\}"), ","),                                           # 1{,}000 -> 1,000
    (re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree(?![a-zA-Z])"), ""),  # 90^\circ, 90^{\circ}, 90° -> 90
    (re.compile(r"\\?%"), ""),                                             # % is a unit: 50\% -> 50
    (re.compile(r"^\\\$|\\\$$"), ""),                                      # \$32,\!348 -> 32,348
    # a trailing unit in text: 5.4 \text{ cents}, 864 \mbox{ inches}^2, \frac{270}7\text{ degrees}
    (re.compile(r"(?<=\S)\s*\\(?:text|textnormal|textrm|mbox|mathrm|textbf)\{\s*[a-zA-Z][a-zA-Z .]*\}"
                r"(?:\^\{?[23]\}?)?$"), ""),
]
UNIT_WORDS = re.compile(r"(?P<number>[^a-zA-Z\\]+?)\s+[a-zA-Z]{2,}(?:\s+[a-zA-Z]{2,})*(?:\^\{?[23]\}?)?")
ASSIGNMENT = re.compile(r"^[a-zA-Z](?:_\{?\w+\}?)?\s*=\s*(?P<rhs>[^=<>]+)$")   # x = 5, a_1 = 3
# 12, 0033, 1,000, -2.50, .5, and 6.72e-5 as a Python tool prints it
INTEGER_OR_DECIMAL = re.compile(r"[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE](?P<exp>[+-]?\d+))?")
FRACTION = re.compile(r"(?P<sign>[+-]?)\\frac(?:\{(?P<n1>[+-]?\d+)\}|(?P<n2>\d))(?:\{(?P<d1>\d+)\}|(?P<d2>\d))")
SLASH_FRACTION = re.compile(r"(?P<n>[+-]?\d+)/(?P<d>\d+)")
# 1.5\times10^{3}, -2.5 \cdot 10^{-2}: one nonzero digit before the point (spaces are removed before matching)
SCIENTIFIC = re.compile(r"(?P<mantissa>[+-]?[1-9](?:\.\d+)?)(?:\\times|\\cdot|×)10"
                        r"\^(?:\{(?P<e1>[+-]?\d+)\}|(?P<e2>\d))")
MACHINE_DIGITS = 15   # significant digits of a decimal printed to machine precision (see "Grader decisions")
TEXT_ANSWER = re.compile(r"\\(?:text|textnormal|textrm|textbf|mathrm|mbox)\{(?P<words>[^{}\d]*[a-zA-Z][^{}\d]*)\}")
CHOICE_LETTER = re.compile(r"\(?[A-E]\)?")


def normalize(answer: str) -> str:
    """Strip presentation that never changes a value: $...$, \\left/\\right, spacing, \\dfrac, degree signs,
    percent signs, currency, a final period, a trailing unit (in \\text{}, or words of two or more letters
    after a plain number), and "x =" in front of a plain number."""
    s = answer.strip()
    while len(s) >= 2 and s[0] == "$" and s[-1] == "$":
        s = s[1:-1].strip()
    for pattern, replacement in DECORATIONS:
        s = pattern.sub(replacement, s).strip()
    s = s.rstrip(".").strip()
    unit = UNIT_WORDS.fullmatch(s)
    if unit and plain_number(unit["number"]) is not None:
        s = unit["number"]                 # "7 days", "5 cm^2", "90 degrees" -> the number; "2 t" stays
    assignment = ASSIGNMENT.match(s)
    if assignment and plain_number(assignment["rhs"].strip()) is not None:
        s = assignment["rhs"].strip()      # only "x = <number>": equations and functions stay for math-verify
    return s


def plain_number(s: str) -> Fraction | None:
    """The exact value of an integer (leading zeros, 1,000 separators), decimal or integer fraction
    (\\frac{a}{b}, \\frac43, a/b); None for anything else."""
    number = INTEGER_OR_DECIMAL.fullmatch(re.sub(r"^([+-])\s+", r"\1", s.strip()))   # "1 2" and "1, 000"
    if number:                                                                         # are lists, not numbers
        if number["exp"] and abs(int(number["exp"])) > 100:   # 1e999999999 would hang Fraction(); the worker
            return None                                        # decides such answers under its timeout
        return Fraction(number[0].replace(",", ""))
    s = re.sub(r"\s+", "", s)                                  # \frac {1} {2}, 1 / 2
    scientific = SCIENTIFIC.fullmatch(s)
    if scientific:
        exponent = int(scientific["e1"] or scientific["e2"])
        return Fraction(scientific["mantissa"]) * Fraction(10) ** exponent if abs(exponent) <= 100 else None
    match = FRACTION.fullmatch(s) or SLASH_FRACTION.fullmatch(s)
    if match is None:
        return None
    parts = match.groupdict()
    numerator = int(parts.get("n") or parts.get("n1") or parts.get("n2"))
    denominator = int(parts.get("d") or parts.get("d1") or parts.get("d2"))
    if denominator == 0:
        return None
    return Fraction(-numerator if parts.get("sign") == "-" else numerator, denominator)


def machine_precision_decimal(s: str) -> bool:
    """Whether s is a decimal (a point or an exponent; not an integer) of MACHINE_DIGITS or more significant
    digits: 0.0833333333333333, 4.123105625617661, 1.66666666666667e-5."""
    number = INTEGER_OR_DECIMAL.fullmatch(s.strip())
    if not number or ("." not in s and not number["exp"]):
        return False
    mantissa = re.split(r"[eE]", number[0])[0]
    return len(re.sub(r"[^0-9]", "", mantissa).lstrip("0")) >= MACHINE_DIGITS


def agrees_to_machine_precision(decimal_text: str, value) -> bool:
    """|d - g| < 10^(floor(log10 |g|) - 14): the decimal d agrees with the exact number g (a Fraction, or a
    string of g to 50 digits from SymPy) to 15 significant digits, rounded or truncated. Exact zero needs d == 0."""
    import decimal

    with decimal.localcontext(decimal.Context(prec=60)):
        d = decimal.Decimal(decimal_text.strip().replace(",", ""))
        if isinstance(value, Fraction):
            g = decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator)
        else:
            g = decimal.Decimal(value)
        if g == 0:
            return d == 0
        return abs(d - g) < decimal.Decimal(10) ** (g.adjusted() - (MACHINE_DIGITS - 1))


def is_word_answer(s: str) -> bool:
    """Whether a (gold) answer is words, not mathematics: a whole \\text{...} without digits ("\\text{Evelyn}",
    "\\text{(C)}", "\\text{ellipse}") or a lone choice letter A-E ("C", "(C)")."""
    return bool(TEXT_ANSWER.fullmatch(s) or CHOICE_LETTER.fullmatch(s))


def canonical_words(s: str) -> str:
    """Words compared as words: \\text{} wrappers, spaces, parentheses and periods dropped, lower case.
    "\\text{(C)}", "(C)" and "c" all become "c"; "\\text{ East}" becomes "east"."""
    s = re.sub(r"\\(?:text|textnormal|textrm|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    return re.sub(r"[\s().]", "", s).lower()


def compact(s: str) -> str:
    """s without white space, except the space that ends a command word ("\\pi r" must not become "\\pir")."""
    return re.sub(r"(?<![a-zA-Z]) | (?![a-zA-Z])", "", re.sub(r"\s+", " ", s))


def base_subscript(s: str) -> str | None:
    """The base of a number written in another base, "4343_6" -> "6", "4210_{5}" -> "5"; else None."""
    match = re.fullmatch(r"[0-9A-Z]+_\{?(\d+)\}?", s.replace("\\text{", "").replace("}_", "_"))
    return match[1] if match else None


# ---- equivalence

def is_equiv(pred: str, gold: str) -> bool:
    """Whether the predicted answer equals the gold answer mathematically, decided in bounded time.

    Callable from any thread, a forked process or a coroutine. Plain numbers and words take microseconds; a pair
    sent to a worker takes milliseconds and never more than GRADE_TIMEOUT_S + GRADE_KILL_GRACE_S (plus a worker's
    start-up on first use, and the wait for a free worker when more than GRADER_WORKERS threads grade at once).
    Inside an event loop, `await asyncio.to_thread(is_equiv, pred, gold)` keeps the loop responsive.
    Not symmetric in general: gold is the reference (math-verify treats the two sides differently)."""
    if pred is None or gold is None or len(str(pred)) > MAX_ANSWER_CHARS:
        return False
    return _equiv_normalized(normalize(str(pred)), normalize(str(gold)))


@functools.lru_cache(maxsize=100_000)   # a GRPO group grades many identical answers against one gold
def _equiv_normalized(pred: str, gold: str) -> bool:
    if not pred or not gold:
        return False
    if compact(pred) == compact(gold):               # "x^2 + 1" and "x^2+1": same symbols, same answer
        return True
    pred_base, gold_base = base_subscript(pred), base_subscript(gold)
    if pred_base and gold_base and pred_base != gold_base:
        return False                                 # 22_7 is not 22_6 (math-verify drops the subscript)
    if is_word_answer(gold):                         # "\text{Evelyn}": compare words, not a product of symbols
        return canonical_words(pred) == canonical_words(gold)
    pred_value, gold_value = plain_number(pred), plain_number(gold)
    if pred_value is not None and gold_value is not None:  # the fast path: exact, no SymPy, no process
        if gold_value.denominator == 1 and not machine_precision_decimal(gold):
            # An integer answer takes only its exact value: 27.0 and 1.5\times10^{3} are integers written
            # otherwise, but a float printed to machine precision is not one. F(300) has 63 digits;
            # 2.2223224462942044e+62 agrees with it to 17 and is still the wrong number.
            return pred_value == gold_value
        return (pred_value == gold_value or (machine_precision_decimal(pred) and
                                             agrees_to_machine_precision(pred, gold_value))
                or (machine_precision_decimal(gold) and agrees_to_machine_precision(gold, pred_value)))
    if gold_value is not None and not machine_precision_decimal(gold):
        # A numeric gold needs a numeric answer. math-verify evaluates expressions, so "2306 \times 9484" would
        # "equal" 21870104: a policy could earn the reward by copying the question into \boxed{} (seen in a
        # CPU run on "What is 2306 * 9484?"). The paper keeps integer-answer problems; the answer is the value.
        # (A gold printed to machine precision, 4.123105625617661, is a computed key: its closed form, sqrt(17),
        # is the more exact answer, so that pair goes on to the worker.)
        return False
    return grade_in_worker(pred, gold)


# ---- the math-verify side, which runs inside a worker process

def math_verify_equiv(pred: str, gold: str) -> bool:
    """math-verify's verdict on two normalized answers, with decimals made exact first (see the docstring).
    Runs in a worker process: it imports SymPy lazily and has no timeout of its own."""
    from math_verify import verify

    gold_parsed, pred_parsed = parse_exact(gold), parse_exact(pred)
    if not gold_parsed or not pred_parsed:
        return False
    # strict=True: variables must match by name, a set is not a tuple. The timeout is ours (the worker's timer).
    if verify(list(gold_parsed), list(pred_parsed), strict=True, timeout_seconds=None):
        return True
    for decimal_text, other in ((pred, gold_parsed), (gold, pred_parsed)):  # a decimal to machine precision
        if machine_precision_decimal(decimal_text):
            value = real_number_digits(other[0])
            return value is not None and agrees_to_machine_precision(decimal_text, value)
    return False


def real_number_digits(expr) -> str | None:
    """A real constant expression (sqrt(17), pi/2, 1 + sqrt(5)) to 50 significant digits; None for anything
    else (variables, sets, tuples, complex numbers)."""
    import sympy

    if not isinstance(expr, sympy.Expr) or not expr.is_number or expr.free_symbols:
        return None
    value = sympy.N(expr, 50)
    return str(value) if isinstance(value, (sympy.Float, sympy.Integer)) else None   # not complex, not infinite


@functools.lru_cache(maxsize=10_000)   # golds repeat for every sample of a problem; SymPy objects are immutable
def parse_exact(answer: str) -> tuple:
    """math-verify's parse of one normalized answer (its SymPy object and its string), decimals made exact."""
    import dataclasses

    from math_verify import LatexExtractionConfig, parse

    # units=False: math-verify's unit stripping reads "2t", "5s", "2m" as the number 2 or 5 (t for tons, s for
    # seconds ...), so a gold "2t" would accept "2". Units are removed by normalize() instead, in the open.
    config = LatexExtractionConfig(boxed_match_priority=0)
    config = dataclasses.replace(config, normalization_config=dataclasses.replace(config.normalization_config,
                                                                                   units=False))
    return tuple(exact_decimals(x) for x in parse("\\boxed{" + answer + "}", [config], parsing_timeout=None))


def exact_decimals(expr):
    """Replace every decimal (SymPy Float) with the rational it denotes: Float('0.5') -> 1/2, Float('3.14') ->
    157/50. Without this math-verify compares floats rounded to 6 places (3.141593 would "equal" pi)."""
    import sympy

    if isinstance(expr, sympy.MatrixBase):
        return expr.applyfunc(exact_decimals)
    if isinstance(expr, sympy.Basic):
        floats = expr.atoms(sympy.Float)
        return expr.xreplace({f: sympy.Rational(str(f)) for f in floats}) if floats else expr
    return expr                                      # math-verify's raw string match, kept as it is


class GradeTimeout(BaseException):
    """Raised by the worker's interval timer. A BaseException, so SymPy's `except Exception` cannot swallow it."""


def serve_grader() -> None:
    """A worker's main loop: one JSON request [pred, gold, timeout_s] per stdin line, one JSON verdict (true or
    false) per stdout line. It first writes "ready" once its imports and warm-up are done, so the caller's
    per-pair deadlines never include start-up."""
    import resource
    import signal

    protocol_out = os.fdopen(os.dup(1), "w")         # replies go to the real stdout ...
    os.dup2(2, 1)                                    # ... and anything a library prints goes to stderr
    limit = WORKER_MEMORY_MB * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    logging.getLogger("math_verify").setLevel(logging.ERROR)   # no "timeout disabled" warning: ours is below

    def on_timer(signum, frame):
        raise GradeTimeout()

    signal.signal(signal.SIGALRM, on_timer)
    math_verify_equiv("(x+1)^2", "x^2+2x+1")         # warm up: the first parse builds math-verify's regexes,
    math_verify_equiv("(1,\\frac{1}{2}]", "\\{1,2\\}")    # the parser's tables and SymPy's caches
    protocol_out.write('"ready"\n')
    protocol_out.flush()
    for line in sys.stdin:
        pred, gold, timeout_s = json.loads(line)
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            verdict = bool(math_verify_equiv(pred, gold))
        except (Exception, GradeTimeout):        # a parse error, a MemoryError, a RecursionError, the timer
            verdict = False
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        protocol_out.write("true\n" if verdict else "false\n")
        protocol_out.flush()


# ---- the worker pool, on the caller's side

class GraderProcess:
    """One persistent worker process and the pipes to it; restarted after a crash or a hard timeout."""

    def __init__(self):
        self.proc = None

    def start(self) -> None:
        here = os.path.dirname(os.path.abspath(__file__))
        # The child imports this module (nothing heavy at top level) and serves requests.
        bootstrap = f"import sys; sys.path.insert(0, {here!r}); import eval; eval.serve_grader()"
        self.proc = subprocess.Popen([sys.executable, "-c", bootstrap], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=0)
        if self.read_line(WORKER_START_TIMEOUT_S) != '"ready"':
            self.kill()
            raise RuntimeError("the math-verify grader worker did not start (is math-verify installed?)")

    def read_line(self, timeout_s: float) -> str | None:
        """One reply line, or None when the worker died or missed the deadline."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = self.proc.stdout.readline()         # the worker writes whole lines, so this does not block
        return line.decode().strip() if line else None

    def grade(self, pred: str, gold: str) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        try:
            self.proc.stdin.write((json.dumps([pred, gold, GRADE_TIMEOUT_S]) + "\n").encode())
        except BrokenPipeError:
            self.kill()
            return False
        reply = self.read_line(GRADE_TIMEOUT_S + GRADE_KILL_GRACE_S)
        if reply is None:                            # stuck in C code, out of memory, or dead: kill, restart later
            self.kill()
            return False
        return reply == "true"

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


_pool_cond = threading.Condition()
_pool_idle: list[GraderProcess] = []
_pool_size = 0                     # workers that exist, idle or busy


def forget_workers_after_fork() -> None:
    """A forked child must not talk to its parent's workers (their pipes are shared): it starts its own."""
    global _pool_cond, _pool_idle, _pool_size
    _pool_cond, _pool_idle, _pool_size = threading.Condition(), [], 0


os.register_at_fork(after_in_child=forget_workers_after_fork)


def grade_in_worker(pred: str, gold: str) -> bool:
    """math_verify_equiv(pred, gold) in an idle worker process (one is started if fewer than GRADER_WORKERS
    exist, else the caller waits for one). Thread-safe; False on timeout or crash."""
    global _pool_size
    with _pool_cond:
        while not _pool_idle and _pool_size >= GRADER_WORKERS:
            _pool_cond.wait()
        if _pool_idle:
            worker = _pool_idle.pop()
        else:
            worker = GraderProcess()                 # started by its first grade(), outside the lock
            _pool_size += 1
    try:
        return worker.grade(pred, gold)              # a worker that failed to start stays in the pool, unstarted
    finally:
        with _pool_cond:
            _pool_idle.append(worker)
            _pool_cond.notify()


def shutdown_graders() -> None:
    """Stop the idle worker processes (also run at exit). The next slow-path grade starts them again."""
    with _pool_cond:
        for worker in _pool_idle:
            worker.kill()


atexit.register(shutdown_graders)


# ---- reward and reported metrics

def reward(response: str, gold: str) -> float:
    """The paper's outcome reward (section 2.2): 1.0 if the final boxed answer is correct, else 0.0."""
    pred = extract_answer(response)
    return 1.0 if pred is not None and is_equiv(pred, str(gold)) else 0.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, "Evaluating Large Language
    Models Trained on Code"): pass@k = 1 - C(n-c, k) / C(n, k), computed as the stable product
    1 - prod_{i=n-c+1..n} (1 - k/i). pass@1 is c/n, the paper's "average pass@1" over 16 samples."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:                                    # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority_vote(preds: list[str | None]) -> str | None:
    """maj@k: the answer most samples agree on. Answers are clustered by is_equiv against each cluster's first
    member; the largest cluster wins, ties go to the cluster seen first; None (no answer) never votes."""
    clusters: list[list[str]] = []                   # each cluster: [first member, later members ...]
    for pred in preds:
        if pred is None:
            continue
        for cluster in clusters:
            if pred == cluster[0] or is_equiv(pred, cluster[0]):
                cluster.append(pred)
                break
        else:
            clusters.append([pred])
    if not clusters:
        return None
    best = max(len(cluster) for cluster in clusters)
    return next(cluster[0] for cluster in clusters if len(cluster) == best)   # first seen among the largest


# ---- evaluation
# The paper's protocol (section 5): temperature 0.6, 16 samples per problem, up to 30 turns, average pass@1;
# with maj@k, pass@k, response length, tool calls per problem, tool error rate, and the shares of trajectories
# with a valid tool call and with a well-formed answer. Rollouts use the same scheduler and sandbox as training.
# Heavy imports (torch, transformers, the scheduler) stay inside these functions: grader workers import this file.


def has_valid_tool_call(traj) -> bool:
    """At least one call that parsed, named the right function and ran without error (status ok)."""
    return traj.tool_statuses.get("ok", 0) > 0


def first_program(model_text: str) -> str | None:
    """The code and stdin of a trajectory's first tool call (None: no parsable call). Samples of a problem that
    write the same first program explore nothing; how many distinct ones they write is a diversity measure."""
    from scheduler import parse_tool_call

    head, closed, _ = model_text.partition("</tool_call>")
    call = parse_tool_call(head + closed) if closed else None
    return f"{call.code}\n---\n{call.stdin}" if call is not None and call.code is not None else None


def distinct_programs_per_problem(groups) -> float | None:
    """Mean number of different first programs among a problem's samples (1: every sample wrote the same)."""
    return sum(len({first_program(t.model_text) for t in g} - {None}) for g in groups) / len(groups) if groups else None


def summarize(problems, groups, ks=None) -> dict:
    """Per-problem grades -> the benchmark's numbers. groups[i] holds the graded samples of problems[i].
    pass@k and maj@k for k in ks (default: the powers of two up to n, and n itself)."""
    n = len(groups[0]) if groups else 0
    if ks is None:
        ks = sorted({k for k in (2, 4, 8, 16, 32, 64) if k <= n} | ({n} if n > 1 else set()))
    trajs = [t for g in groups for t in g]
    calls = sum(t.tool_calls for t in trajs)
    correct = [t for t in trajs if t.reward > 0]
    correct_calls = sum(t.tool_calls for t in correct)
    by_problem = [sum(t.reward for t in g) / len(g) if g else 0.0 for g in groups]
    out = {
        "problems": len(problems), "samples_per_problem": n,
        "pass@1": sum(t.reward for t in trajs) / len(trajs) if trajs else 0.0,  # average pass@1 (paper)
        "pass@1_se": mean_and_se(x for x, g in zip(by_problem, groups) if g)[1],
        "pass@1_by_problem": by_problem,
        "response_len": sum(t.num_response_tokens for t in trajs) / max(len(trajs), 1),
        "tool_calls_per_problem": calls / max(len(problems), 1),
        "tool_calls_per_traj": calls / max(len(trajs), 1),
        "tool_error_rate": sum(t.tool_errors for t in trajs) / calls if calls else None,
        # the paper's Figure 9 quantity: how often the tool failed inside trajectories that got the answer right
        "tool_error_rate_correct": sum(t.tool_errors for t in correct) / correct_calls if correct_calls else None,
        "valid_tool_call_share": sum(has_valid_tool_call(t) for t in trajs) / max(len(trajs), 1),
        "answer_format_share": sum(answer_format_ok(t.model_text) for t in trajs) / max(len(trajs), 1),
        "finish_reasons": {r: sum(t.finish_reason == r for t in trajs) for r in sorted({t.finish_reason for t in trajs})},
        # problems whose samples disagree in outcome: the groups GRPO can learn from (all-equal groups have zero
        # advantage). Meaningful at the training temperature (1.0) with several samples per problem.
        "mixed_outcome_share": (sum(0 < sum(t.reward > 0 for t in g) < len(g) for g in groups) / len(groups)
                                if groups and n > 1 else None),
        "distinct_programs_per_problem": distinct_programs_per_problem(groups),
        "pass@1_by_family": pass_at_1_by_family(problems, groups),
    }
    for k in ks:
        if 1 < k <= n:
            solved = [sum(t.reward > 0 for t in g) for g in groups]
            out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in solved) / len(groups)
            votes = [majority_vote([extract_answer(t.model_text) for t in g[:k]]) for g in groups]
            out[f"maj@{k}"] = sum(v is not None and is_equiv(v, p.answer) for v, p in zip(votes, problems)) / len(groups)
    return out


def mean_and_se(values) -> tuple[float, float | None]:
    """The mean of per-problem scores and its standard error, SE = s / sqrt(n) with s the sample standard
    deviation (n - 1). Problems are the unit: the samples of one problem are not independent of each other, so
    the noise of a pass@1 is counted over problems (None with fewer than two). Applied to the per-problem changes
    d_i = after_i - before_i of one set, it is the paired standard error of a change."""
    values = list(values)
    n = len(values)
    if n == 0:
        return 0.0, None
    mean = sum(values) / n
    if n < 2:
        return mean, None
    return mean, (sum((v - mean) ** 2 for v in values) / (n - 1) / n) ** 0.5


def pass_at_1_by_family(problems, groups) -> dict | None:
    """{family: average pass@1 over its problems' samples}, for problems that name a family (the generator's,
    or a file's subject field); None when none does."""
    by = {}
    for p, g in zip(problems, groups):
        if getattr(p, "family", "") and g:
            by.setdefault(p.family, []).extend(t.reward for t in g)
    return {f: sum(r) / len(r) for f, r in sorted(by.items())} or None


def evaluate(engines, pool, tokenizer, problems, n_samples: int, rollout_cfg, loop, seed: int = 0,
             progress: bool = True):
    """Roll out n_samples per problem with the training scheduler, grade each, and summarize.
    Returns (summary dict, groups of graded trajectories)."""
    import scheduler

    groups = scheduler.run_rollouts(engines, pool, tokenizer, [(p.id, p.question) for p in problems], n_samples,
                                    rollout_cfg, seed=seed, progress=progress, loop=loop)
    for p, group in zip(problems, groups):
        for t in group:
            t.reward = reward(t.model_text, p.answer)
    return summarize(problems, groups), groups


def markdown_table(name: str, s: dict) -> str:
    keys = ["pass@1", "pass@1_se"] + [k for k in s if k.startswith(("pass@", "maj@")) and k not in (
        "pass@1", "pass@1_se", "pass@1_by_family", "pass@1_by_problem")] + [
        "response_len", "tool_calls_per_problem", "tool_error_rate", "valid_tool_call_share", "answer_format_share",
        "mixed_outcome_share", "distinct_programs_per_problem"]
    fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    return ("| data | problems x samples | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 2) + "\n"
            f"| {name} | {s['problems']} x {s['samples_per_problem']} | " + " | ".join(fmt(s.get(k)) for k in keys)
            + " |\n" + family_table(s.get("pass@1_by_family")))


def family_table(by_family: dict | None) -> str:
    """pass@1 per family as a second markdown table ("" when the problems name no family)."""
    if not by_family:
        return ""
    return ("\n| family | " + " | ".join(by_family) + " |\n|" + "---|" * (len(by_family) + 1) + "\n| pass@1 | "
            + " | ".join(f"{v:.3f}" for v in by_family.values()) + " |\n")


def show_trajectory(tokenizer, traj, gold: str, colour: bool) -> str:
    """One trajectory, readable: model text plain, inserted tool responses dimmed (cyan), verdict in colour."""
    c = (lambda code, x: f"\033[{code}m{x}\033[0m") if colour else (lambda code, x: x)  # noqa: E731
    parts = [c("1", f"== {traj.problem_id}  gold={gold}  predicted={extract_answer(traj.model_text)}  ")
             + (c("32", "CORRECT") if traj.reward > 0 else c("31", "WRONG"))
             + f"  turns={traj.turns} tool_calls={traj.tool_calls} errors={traj.tool_errors} finish={traj.finish_reason}"]
    for seg in traj.segments:
        text = tokenizer.decode(seg.ids)
        parts.append(text if seg.loss_mask else c("36", text))
    return "".join(parts) + "\n"


def main(argv=None) -> int:
    import argparse
    import asyncio
    from pathlib import Path

    ap = argparse.ArgumentParser(description="Evaluate a model with the paper's protocol: average pass@1 over "
                                 "k samples, up to 30 tool-using turns, temperature 0.6.")
    ap.add_argument("--model", default="smollm2-135m", help="model directory, or smollm2-135m (bundled)")
    ap.add_argument("--data", default="heldout", help="a JSONL/JSON file, a benchmark name (aime24, aime25, "
                    "hmmt25, math500, amc23, gsm8k), heldout or validation (the generator's validation set, what a "
                    "run prints) or test (its test split: report only, never tune on it)")
    ap.add_argument("--samples", type=int, default=16, help="samples per problem (paper: 16)")
    ap.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (paper: 0.6)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-turns", type=int, default=30, help="assistant turns (paper: 30 at evaluation)")
    ap.add_argument("--max-tokens", type=int, default=12288, help="response budget, tool tokens included")
    ap.add_argument("--limit", type=int, help="evaluate only the first N problems")
    ap.add_argument("--levels", default="1,2", help="generator levels for --data heldout / test")
    ap.add_argument("--families", help="generator families for --data heldout / test, comma-separated (default: "
                    "all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16, help="CPU engine: sequences decoded together")
    ap.add_argument("--engine", default="auto", help="auto (vLLM on GPUs when installed, else ours) | vllm | "
                    "transformers")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="the engine's weights: auto = bf16 on GPUs and on CPUs with bf16 units, else float32")
    ap.add_argument("--tool-state", default="stateless", choices=("stateless", "replay", "persistent"),
                    help="the Python tool's state across a trajectory's calls: stateless (the paper's), replay "
                    "(earlier calls rerun) or persistent (one isolated Python session per trajectory); "
                    "docs/sandbox.md")
    ap.add_argument("--show", type=int, default=0, help="print N trajectories readably")
    ap.add_argument("--out", help="directory for result.json and result.md (default: print only)")
    args = ap.parse_args(argv)
    try:
        import model as models
        import tasks

        if args.samples < 1 or (args.limit is not None and args.limit < 1):
            raise ValueError("--samples and --limit must be at least 1")
        if args.data in ("heldout", "validation", "test"):
            levels = tuple(int(x) for x in args.levels.split(","))
            families = [f.strip() for f in args.families.split(",") if f.strip()] if args.families else None
            pick = tasks.heldout_test_problems if args.data == "test" else tasks.heldout_problems
            problems = pick(args.limit or 64, levels=levels, families=families)
        else:
            problems = tasks.load_problems(tasks.resolve_dataset(args.data), limit=args.limit)
        if not problems:
            raise ValueError(f"{args.data} holds no problems with integer answers")
        path = models.resolve_model(args.model)
        import torch

        import scheduler

        device = "cuda" if torch.cuda.is_available() else "cpu"
        use_vllm = scheduler.wants_vllm(args.engine, device)
    except (ValueError, models.ModelUnavailable) as e:  # tasks.DataError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2

    import sandbox

    tokenizer = models.load_tokenizer(path)
    loop = asyncio.new_event_loop()
    bf16 = None if args.dtype == "auto" else args.dtype == "bfloat16"   # (GPUs: bf16 whatever the option)
    if use_vllm:  # nothing else on the GPUs: one engine on each, as much of it as vLLM wants
        engines = scheduler.VLLMEngine.launch(str(path), loop, seed=args.seed, max_model_len=args.max_tokens + 2048,
                                              dtype=str(models.engine_dtype(bf16, device)).removeprefix("torch."))
    else:
        engines = [scheduler.TransformersEngine(models.load_model(path, dtype=models.engine_dtype(bf16, device),
                                                                  device=device),   # bf16 where that is fast
                                                tokenizer, max_batch=args.batch, device=device,
                                                tool_state=args.tool_state)]
    cfg = scheduler.RolloutConfig(max_turns=args.max_turns, max_response_tokens=args.max_tokens,
                                  temperature=args.temperature, top_p=args.top_p, tool_state=args.tool_state)
    pool = sandbox.SandboxPool(max_sessions=sandbox.sessions_that_fit() if args.tool_state == "persistent" else 0)
    try:  # (the pool starts inside: if it cannot, the engines still stop)
        loop.run_until_complete(pool.start())
        summary, groups = evaluate(engines, pool, tokenizer, problems, args.samples, cfg, loop, seed=args.seed)
    finally:
        scheduler.stop_rollouts(engines, loop)
        loop.run_until_complete(pool.close())
        loop.close()
    summary.update(model=str(path), data=args.data, temperature=args.temperature, max_turns=args.max_turns,
                   max_tokens=args.max_tokens, tool_state=args.tool_state)
    table = markdown_table(args.data, summary)
    colour = sys.stdout.isatty()
    shown = [(t, p) for p, g in zip(problems, groups) for t in g][: args.show]
    for t, p in shown:
        print(show_trajectory(tokenizer, t, p.answer, colour))
    print(table)
    print(json.dumps(summary))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(summary, indent=2))
        (out / "result.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
