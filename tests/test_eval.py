"""Tests for eval.py: extraction, equivalence (with the exploit cases), reward, pass@k, maj@k, and the grader's
bounded time in threads, coroutines, forks and against a hung worker.

Equivalence cases come from math-verify's own test suite (tests/test_all.py: number formats, fraction notations,
sets and intervals, units, percent), from the answers of the offline benchmark files (../shared/data: MATH-500,
AIME, AMC, HMMT, GSM8K), and from the exploits lenient graders accept.
"""

import asyncio
import json
import math
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import eval as grader  # noqa: E402
from eval import answer_format_ok, extract_answer, is_equiv, majority_vote, pass_at_k, reward  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def read_jsonl(name):
    if not (DATA / name).exists():
        pytest.skip(f"no offline data: {DATA / name}")
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


# ---- extraction

@pytest.mark.parametrize("text, expected", [
    (r"so the answer is \boxed{42}.", "42"),
    (r"first \boxed{1}, then \boxed{2}", "2"),                                     # the last one
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),                        # nested braces
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),                                            # escaped braces
    (r"\boxed{\left\{ x \right.}", r"\left\{ x \right."),                          # an escaped brace need not close
    (r"\boxed{1 \\}", r"1 \\"),                                                    # "\\" is a line break, not "\}"
    (r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
    (r"the answer is $\boxed 5$.", "5"),                                           # \boxed without braces
    (r"\fbox{7}", "7"),
    (r"\boxed {  12 }", "12"),
    (r"no box here: 42", None),
    (r"\boxed{}", None),                                                           # empty is no answer
    (r"\boxed{12", None),                                                          # truncated
    (r"\boxed{3} <answer>The answer is \boxed{4}</answer>", "4"),                  # inside <answer> only
    (r"<answer>\boxed{4}</answer> afterwards \boxed{5}", "4"),
    (r"\boxed{3} <answer>I think 4</answer>", None),                               # <answer> without a box
    (r"<answer>draft \boxed{1}</answer> <answer>final \boxed{2}</answer>", "2"),
    (r"<answer>\boxed{9}", "9"),                                                   # unclosed final <answer>
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text, ok", [
    (r"<reason>...</reason><answer>so \boxed{5}</answer>", True),
    (r"<answer>\boxed{5}</answer><|im_end|>", True),
    (r"\boxed{5}", False),                                                         # no tags
    (r"<answer>5</answer>", False),                                                # no box
    (r"<answer>\boxed{5}", False),                                                 # not closed
    (r"</answer>\boxed{5}<answer>", False),                                        # wrong order
    (r"<answer>\boxed{4}</answer><answer>\boxed{5}</answer>", False),              # two answers
    (r"<answer>\boxed{5</answer>", False),                                         # broken box
])
def test_answer_format_ok(text, ok):
    assert answer_format_ok(text) == ok


# ---- equivalence: equal

EQUAL = [
    # integers: leading zeros (AIME 2024 writes "033"), thousands separators (GSM8K "2,125", MATH "10,\!080")
    ("33", "033"), ("2125", "2,125"), ("10080", r"10,\!080"), ("11111111100", r"11,\! 111,\! 111,\! 100"),
    ("1000", "1{,}000"), ("14916", r"14{,}916"), ("27", "27.0"), ("-1", "-1.0"), ("+5", "5"),
    # decimals and fractions of the same value (math-verify tests: "0.4" vs ".4", "10/9" vs \frac{10}{9})
    (".4", "0.4"), ("1,000.0", "1000.0"), (r"\frac{10}{9}", "10/9"), (r"-\frac{10}{9}", "-10/9"),
    ("0.5", r"\frac{1}{2}"), (r"\frac13", "1/3"), (r"\frac3{3}", "1"), (r"\cfrac{1}{3}", "1/3"),
    (r"\dfrac{17}{50}", "0.34"), ("0.0000672", ".0000672"), ("6.72e-5", ".0000672"), (r"\frac{57}{160}", ".35625"),
    ("1.8", r"1\frac{4}{5}"), ("137.5", r"137 \frac{1}{2}"), (r"\frac{6}{4}", r"\frac32"),
    (r"\frac{-22}{4}", r"-\frac{11}{2}"), (r"\dfrac{-5}{2}", "-2.5"), (r"-\frac{-2}{3}", r"\frac23"),  # a signed numerator
    # "x = 5" and 5, units, degrees, currency
    ("x = 5", "5"), ("5", "x=5"), ("y = 5", "x=5"), (r"k = \frac{1}{3}", "1/3"),
    ("90", r"90^\circ"), (r"90^{\circ}", "90"),
    (r"\frac{1}{3} \text{meters}", "1/3"), ("864", r"864 \mbox{ inches}^2"), ("15", r"15\mbox{ cm}^2"),
    ("5.4", r"5.4 \text{ cents}"), (r"\frac{270}{7}", r"\frac{270}7\text{ degrees}"), ("32348", r"\$32,\!348"),
    ("18.9", r"\$18.90"), ("5 cm", "5"), ("7", "7 days"), ("90 degrees", "90"),
    # percent is a unit: 28\% and 28 (math-verify's percent tests)
    ("28", r"28\%"), (r"28\%", "28"), ("28 %", r"28\%"),
    # sets and comma lists in any order (MATH "enter all solutions")
    ("-2,1", "1,-2"), (r"\{2, 1\}", r"\{1,2\}"), ("7, 5, 3", "3, 5, 7"),
    (r"\{1\pm\sqrt{5},-2\}", r"\{-2, 1+\sqrt5, 1-\sqrt5\}"),
    (r"\frac{-1-\sqrt{17}}{2}, \frac{-1+\sqrt{17}}{2}", r"\frac{-1+\sqrt{17}}{2}, \frac{-1-\sqrt{17}}{2}"),
    (r"1+\sqrt{19}, 1-\sqrt{19}", r"1 \pm \sqrt{19}"),
    # tuples, intervals, matrices written differently
    (r"(3, \pi/2)", r"\left( 3, \frac{\pi}{2} \right)"), ("(0.5, 3)", r"(\frac12, 3)"), ("[0,1)", "[0,1)"),
    (r"(-\infty,0]", r"(-\infty, 0]"), (r"(9,36) \cup (0,9)", r"(0,9) \cup (9,36)"), ("[-2,7]", r"x \in [-2,7]"),
    (r"\begin{pmatrix} -\frac13 \\ \frac23 \end{pmatrix}", r"\begin{pmatrix} -1/3 \\ 2/3 \end{pmatrix}"),
    # algebraically equal expressions
    ("x^2+2x+1", "(x+1)^2"), ("2(k+1)", "2k+2"), ("-q+p", "p - q"), (r"\frac{\pi-2}{\pi}", r"1-\frac{2}{\pi}"),
    (r"\sqrt{8}", r"2\sqrt{2}"), (r"\frac{\sqrt{570}}{12}", r"\sqrt{\frac{95}{24}}"), (r"\sqrt[7]{12}", "12^{1/7}"),
    (r"\frac{\cos x}{\sin x}", r"\cot x"), ("2^{25} \\cdot 26!", "2^{25}\\cdot 26!"), ("5i-(-6)", "6 + 5i"),
    ("2x+3", "y = 2x + 3"), ("10x - 14y + 22z + 8 = 0", "5x - 7y + 11z + 4 = 0"), (r"x^2 + 1", "x^2+1"),
    # words and choices
    ("Evelyn", r"\text{Evelyn}"), (r"\text{ East}", r"\text{east}"), ("C", r"\text{(C)}"),
    (r"\textbf{(C)}", r"\text{(C)}"),
    # numbers in another base: the digits as asked
    ("4343", "4343_6"), (r"4210_{5}", "4210_5"),
    # scientific notation is a way of writing a number (math-verify and the MATH graders agree)
    (r"1.5\times10^{3}", "1500"), ("1500", r"1.5\times10^{3}"), (r"1.5 \cdot 10^3", "1500"),
    (r"-2.5 \times 10^{-2}", "-0.025"), (r"6.72\times10^{-5}", ".0000672"),
    # \textnormal{} is \text{} (a unit after a number; a word answer)
    ("125", r"125\textnormal{ miles}"), (r"125\textnormal{ miles}", "125"), ("Evelyn", r"\textnormal{Evelyn}"),
]

# A decimal of 15 or more significant digits that agrees with the exact value to 15 significant digits (within
# one unit in the 15th) is that value printed to machine precision (see eval.py, "Grader decisions").
MACHINE_PRECISION_EQUAL = [
    ("0.0833333333333333", r"\frac{1}{12}"), ("0.08333333333333333", r"\frac{1}{12}"),   # 15 digits; float repr
    ("4.666666666666667", r"\frac{14}{3}"), ("0.666666666666666", r"\frac23"),             # rounded; truncated
    ("0.30000000000000004", "3/10"), ("-0.0833333333333333", r"-\frac{1}{12}"),            # float noise; sign
    ("1.66666666666667e-5", r"\frac{1}{60000}"),
    ("4.123105625617661", r"\sqrt{17}"), ("4.12310562561766", r"\sqrt{17}"),              # float repr; sympy N()
    (r"\sqrt{17}", "4.123105625617661"), ("3.14159265358979", r"\pi"),
    ("0.0833333333333333", "0.08333333333333333"),
]
MACHINE_PRECISION_NOT_EQUAL = [
    ("0.08333333333333", r"\frac{1}{12}"), ("0.083333333", r"\frac{1}{12}"),               # 14 and 8 digits
    ("0.0833333333333353", r"\frac{1}{12}"), ("4.12310562561768", r"\sqrt{17}"),          # off in the 15th digit
    ("4.1231056256177", r"\sqrt{17}"), ("3.1415926535898", r"\pi"),                        # 14 digits
    ("5.00000000000001", "5"), ("0.0833333333333333", r"\frac{1}{13}"),
    ("0.0833333333333333", "x"), ("4.123105625617661", r"\sqrt{17} i"),
    ("123456789012345", "123456789012346"),                                                # integers are exact
]
# An integer answer needs an integer-valued prediction that equals it exactly: a float printed to machine
# precision is not an integer, however many digits agree (F(300) has 63 digits; a float keeps 17).
FLOAT_FOR_AN_INTEGER = [
    ("2.2223224462942044e+62", "222232244629420445529739893461909967206666939096499764990979600"),   # F(300)
    ("4.99999999999999999", "5"), ("5.00000000000000001", "5"), ("1.23456789012345e+20", "123456789012345000001"),
]
AN_INTEGER_WRITTEN_OTHERWISE = [   # integer-valued and exact: still the integer
    ("27.0", "27"), ("27", "27.0"), ("2.2223224462942044e+62", "222232244629420440000000000000000000000000000000000000000000000"),
    (r"1.5\times10^{3}", "1500"), ("1,000", "1000"),
]

NOT_EQUAL = [
    # exploits: percentage leniency (a gold 10 must not accept 1000 or 0.1) and pi leniency
    ("1000", "10"), ("0.1", "10"), ("10", "1000"), ("3.14", r"\pi"), ("3.14159265", r"\pi"), ("3.141593", r"\pi"),
    ("0.5", r"50\%"), (r"50\%", "0.5"), ("0.78", r"78\%"), (r"6.283", r"2\pi"), ("0.36338", r"1-\frac{2}{\pi}"),
    ("(3, 1.5708)", r"\left( 3, \frac{\pi}{2} \right)"), (r"4.472", r"2\sqrt{5}"),
    # a decimal is exactly the number it denotes: 0.333333 is not 1/3
    ("0.333333", r"\frac13"), ("0.33", r"\frac{1}{3}"), ("4.6666667", r"\frac{14}{3}"), ("5.000001", "5"),
    # hedging: several answers, "plus or minus", an interval around the answer, infinity
    ("5, 10", "5"), (r"5 \text{ or } 10", "5"), (r"\pm 5", "5"), ("[0,100]", "5"), (r"\infty", "5"), ("x", "5"),
    # order matters in tuples; brackets matter in intervals (math-verify tests: (0,9) vs [0,9))
    ("(2,1)", "(1,2)"), ("(31,6,-1)", "(6,31,-1)"), ("[3,4]", "(3,4]"), ("[0,9)", "(0,9)"),
    ("(-\\infty,0)", "(-\\infty, 0]"),
    ("[0,1)", "[0,9)"), ("3,5", "3, 5, 7"),
    # a comma is a list separator or a thousands separator, never a decimal point; "1, 000" is a list
    ("1.22", "1,22"), ("1000", "1, 000"), ("100", "1,00"),
    # plain wrong answers of every shape
    ("42", "43"), ("6+5i", "6 - 5i"), ("2j+2", "2k+2"), (r"\frac{\pi}{2}", r"90^\circ"), ("22_7", "22_6"),
    ("D", r"\text{(C)}"), (r"\text{west}", r"\text{east}"), ("Nevlye", r"\text{Evelyn}"), ("x=5", "x=6"),
    ("2", "2t"), ("5", "5s"),                                    # math-verify's unit stripping would read 2t as 2
    ("", "5"), ("5", ""), (r"\text{}", "5"),
    # the question copied into the box: a numeric gold needs the value, not an expression that evaluates to it
    (r"2306 \times 9484", "21870104"), ("2306*9484", "21870104"), ("7^{3} \bmod 10", "3"), (r"\binom{5}{2}", "10"),
    (r"15 \times 10^{2}", "1500"), (r"2306 \times 10^{4}", "23060000"),   # scientific notation has one digit first
]


@pytest.mark.parametrize("pred, gold", EQUAL)
def test_equal(pred, gold):
    assert is_equiv(pred, gold)


@pytest.mark.parametrize("pred, gold", NOT_EQUAL)
def test_not_equal(pred, gold):
    assert not is_equiv(pred, gold)


@pytest.mark.parametrize("pred, gold", MACHINE_PRECISION_EQUAL)
def test_a_decimal_to_machine_precision_is_the_value(pred, gold):
    assert is_equiv(pred, gold)


@pytest.mark.parametrize("pred, gold", MACHINE_PRECISION_NOT_EQUAL)
def test_a_shorter_or_different_decimal_is_not_the_value(pred, gold):
    assert not is_equiv(pred, gold)


@pytest.mark.parametrize("pred, gold", FLOAT_FOR_AN_INTEGER)
def test_a_float_is_not_an_integer_answer(pred, gold):
    assert not is_equiv(pred, gold)


@pytest.mark.parametrize("pred, gold", AN_INTEGER_WRITTEN_OTHERWISE)
def test_an_exact_integer_value_is_the_integer_however_written(pred, gold):
    assert is_equiv(pred, gold)


def test_machine_precision_rule_against_a_plain_oracle():
    """The rule, computed independently with 50-digit decimal arithmetic: a decimal d with n >= 15 significant
    digits equals a fraction g iff |d - g| < 10**(floor(log10 |g|) - 14)."""
    import decimal
    import random
    from fractions import Fraction

    rng = random.Random(7)
    decimal.getcontext().prec = 50
    for _ in range(300):
        g = Fraction(rng.randint(-10**6, 10**6) or 1, rng.randint(1, 10**4))
        exact = decimal.Decimal(g.numerator) / decimal.Decimal(g.denominator)
        digits = rng.choice([13, 14, 15, 16, 17])
        d = f"{exact:.{digits}g}" if rng.random() < 0.5 else f"{float(g)!r}"
        d = f"{float(d) + rng.choice([0, 1, -1, 3]) * 10 ** (exact.adjusted() - 14):.17g}" if rng.random() < 0.3 else d
        if "e" in d or "." not in d:
            continue
        significant = len(d.lstrip("-").replace(".", "").lstrip("0"))
        unit = decimal.Decimal(10) ** (exact.adjusted() - 14)
        expected = significant >= 15 and abs(decimal.Decimal(d) - exact) < unit and g.denominator != 1
        expected = expected or Fraction(d) == g     # an integer g takes only its exact value
        assert is_equiv(d, f"{g.numerator}/{g.denominator}") == expected, (d, g)


def test_enough_cases():
    assert len(EQUAL) + len(NOT_EQUAL) >= 60


def test_none_and_overlong_predictions_are_wrong():
    assert not is_equiv(None, "5")
    assert not is_equiv("5", None)
    assert not is_equiv(" + ".join(["x"] * 600), " + ".join(["x"] * 600))   # over MAX_ANSWER_CHARS


# ---- equivalence on the offline benchmark answers

def test_benchmark_integer_answers_in_other_formats():
    aime = read_jsonl("aime24.jsonl") + read_jsonl("aime25_matharena.jsonl")
    for row in aime:
        n = int(row["answer"])
        assert is_equiv(str(n), row["answer"]) and is_equiv(f"x = {n}", row["answer"])
        assert not is_equiv(str(n + 1), row["answer"]) and not is_equiv(str(n * 100), row["answer"])
    for row in read_jsonl("amc23.jsonl"):                                # answers stored as 27.0
        assert is_equiv(str(int(row["answer"])), str(row["answer"]))
    for row in read_jsonl("gsm8k_test_openai.jsonl")[:300]:             # "#### 2,125"
        gold = row["answer"].split("####")[-1].strip()
        assert is_equiv(gold.replace(",", ""), gold)


def test_every_math500_answer_equals_itself_with_decoration():
    for row in read_jsonl("math500.jsonl"):
        assert is_equiv(f"${row['answer']}$", row["answer"])
        assert is_equiv(extract_answer(f"<answer>The answer is \\boxed{{{row['answer']}}}.</answer>"), row["answer"])


def test_hmmt_answers_reformatted_and_perturbed():
    for row in read_jsonl("hmmt_feb_2025.jsonl"):
        gold = row["answer"]
        assert is_equiv(gold.replace("\\frac", "\\dfrac").replace(" ", ""), gold), gold
        digit = next(i for i, ch in enumerate(gold) if ch.isdigit())
        wrong = gold[:digit] + str((int(gold[digit]) + 1) % 10) + gold[digit + 1:]
        assert not is_equiv(wrong, gold), (wrong, gold)


# ---- reward

def test_reward():
    gold = r"\frac{14}{3}"
    assert reward(r"<reason>f(-2)+f(-1)+f(0)</reason><answer>\boxed{\dfrac{14}{3}}</answer>", gold) == 1.0
    assert reward(r"<answer>\boxed{4.666666666666667}</answer>", gold) == 1.0      # a float from the tool
    assert reward(r"<answer>\boxed{4.6667}</answer>", gold) == 0.0                  # ... rounded by hand
    assert reward(r"\boxed{\frac{14}{3}} <answer>14/3</answer>", gold) == 0.0        # box outside <answer>
    assert reward("the answer is 14/3", gold) == 0.0                                 # no answer at all
    assert reward(r"<answer>\boxed{033}</answer>", "33") == 1.0
    assert reward(r"<answer>\boxed{27}</answer>", 27.0) == 1.0                       # AMC golds are floats


# ---- plain numbers: exact values, so that a decimal equals only the number it denotes

@pytest.mark.parametrize("text, value", [
    ("42", Fraction(42)), ("033", Fraction(33)), ("+5", Fraction(5)), ("- 7", Fraction(-7)),
    ("2,125", Fraction(2125)), ("11,111,100", Fraction(11111100)), ("1,000.25", Fraction(4001, 4)),
    ("-2.50", Fraction(-5, 2)), (".5", Fraction(1, 2)), ("27.0", Fraction(27)), ("5.", Fraction(5)),
    ("0.333333", Fraction(333333, 1000000)), ("4.666666666666667", Fraction(4666666666666667, 10 ** 15)),
    ("6.72e-5", Fraction(672, 10 ** 7)), ("1E3", Fraction(1000)),
    (r"\frac{14}{3}", Fraction(14, 3)), (r"\frac43", Fraction(4, 3)), (r"\frac{10}9", Fraction(10, 9)),
    (r"-\frac{1}{2}", Fraction(-1, 2)), (r"\frac {6} {4}", Fraction(3, 2)), ("10/9", Fraction(10, 9)),
    ("-10 / 4", Fraction(-5, 2)),
])
def test_plain_number_exact_values(text, value):
    got = grader.plain_number(text)
    assert isinstance(got, Fraction) and got == value


@pytest.mark.parametrize("text", [
    "1, 000", "1 2", "1,22", "1,0000", "3.14.15", "x", "", "1/0", r"\frac{1}{0}", r"\pi", r"\sqrt{2}", "2^{10}",
    "1e999999999", "(1,2)", "5 cm", "1/2/3",
])
def test_plain_number_is_none_for_anything_else(text):
    assert grader.plain_number(text) is None


def test_plain_numbers_compare_exactly():
    # the fast path of is_equiv: both sides plain numbers, compared as exact fractions (no worker process)
    # (a decimal of 15+ significant digits is the double the value rounds to: the same answer, see eval.py)
    for pred, gold in [("0.5", r"\frac{1}{2}"), ("27", "27.0"), ("2125", "2,125"), ("33", "033"),
                       (".35625", r"\frac{57}{160}"), ("4.666666666666667", r"\frac{14}{3}")]:
        assert is_equiv(pred, gold), (pred, gold)
    for pred, gold in [("0.333333", r"\frac13"), ("4.6666667", r"\frac{14}{3}"), ("5.000001", "5"),
                       ("1000", "10"), ("0.1", "10"), ("-1", "1")]:
        assert not is_equiv(pred, gold), (pred, gold)


# ---- pass@k and maj@k

def test_pass_at_k_matches_the_combinatorial_definition():
    for n in range(1, 17):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(16, 4, 1) == pytest.approx(0.25)                               # pass@1 = c / n
    assert pass_at_k(16, 0, 8) == 0.0 and pass_at_k(16, 16, 1) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 2, 5)


def test_majority_vote():
    assert majority_vote(["1/2", "3", "0.5", None, None, None, "3", r"\frac12"]) == "1/2"   # 3 equal forms win
    assert majority_vote(["3", "4", "4", "3"]) == "3"                                      # tie: first seen
    assert majority_vote(["(1,2)", "(2,1)", "(2,1)"]) == "(2,1)"
    assert majority_vote([None, None]) is None and majority_vote([]) is None


# ---- bounded time: threads, asyncio, forks, a hung or crashed worker

MIXED = [("x^2+2x+1", "(x+1)^2", True), ("3.14", r"\pi", False), ("033", "33", True), ("(2,1)", "(1,2)", False),
         (r"\{2,1\}", r"\{1,2\}", True), ("1000", "10", False), (r"2\sqrt2", r"\sqrt8", True), ("7", "8", False)]


def test_math_verify_alone_cannot_grade_off_the_main_thread():
    """Why the worker processes exist: math-verify's signal-based timeout raises in any other thread."""
    from math_verify import parse

    errors = []
    thread = threading.Thread(target=lambda: errors.append(catch(lambda: parse("$x^2$"))))
    thread.start()
    thread.join()
    assert isinstance(errors[0], ValueError)


def catch(fn):
    try:
        fn()
    except Exception as e:   # noqa: BLE001 - the test inspects it
        return e


def test_grading_from_many_threads():
    grader._equiv_normalized.cache_clear()
    cases = MIXED * 4
    with ThreadPoolExecutor(8) as pool:
        verdicts = list(pool.map(lambda case: is_equiv(case[0], case[1]), cases))
    assert verdicts == [expected for _, _, expected in cases]


def test_grading_from_asyncio():
    async def main():
        grader._equiv_normalized.cache_clear()
        direct = [is_equiv(p, g) for p, g, _ in MIXED]                       # blocking call inside a coroutine
        grader._equiv_normalized.cache_clear()
        offloaded = await asyncio.gather(*(asyncio.to_thread(is_equiv, p, g) for p, g, _ in MIXED))
        return direct, offloaded

    direct, offloaded = asyncio.run(main())
    assert direct == list(offloaded) == [expected for _, _, expected in MIXED]


def grade_in_fork(queue):
    grader._equiv_normalized.cache_clear()
    queue.put([is_equiv(p, g) for p, g, _ in MIXED])


def test_grading_in_a_forked_child_uses_its_own_workers():
    is_equiv("x+x", "2x")                                                      # the parent has a worker now
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=grade_in_fork, args=(queue,))
    child.start()
    verdicts = queue.get(timeout=120)
    child.join()
    assert verdicts == [expected for _, _, expected in MIXED]
    grader._equiv_normalized.cache_clear()
    assert is_equiv("x+x+x", "3x")                                             # the parent's worker still answers


def test_pathological_answer_times_out_and_the_worker_survives(monkeypatch):
    monkeypatch.setattr(grader, "GRADE_TIMEOUT_S", 1.0)
    assert not is_equiv("10^{10^{10}}", "1")
    assert not is_equiv("1", "10^{10^{10}}")
    assert is_equiv("(y+1)^2", "y^2+2y+1")


def test_hung_worker_is_killed_and_replaced(monkeypatch):
    monkeypatch.setattr(grader, "GRADE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(grader, "GRADE_KILL_GRACE_S", 0.5)
    grader.shutdown_graders()
    monkeypatch.setattr(grader, "GRADER_WORKERS", 1)
    grader.forget_workers_after_fork()                                         # a fresh pool with one worker
    assert is_equiv("x+x", "2x")
    worker = grader._pool_idle[0]
    os.kill(worker.proc.pid, signal.SIGSTOP)                                   # hangs where no timer can reach
    assert not is_equiv("y+y", "2y")                                           # the hard deadline: False ...
    assert worker.proc is None                                                 # ... and the worker was killed
    monkeypatch.setattr(grader, "GRADE_TIMEOUT_S", 5.0)                        # room for a cold worker's first parse
    assert is_equiv("z+z", "2z")                                               # a new one starts on demand
    crashed = grader._pool_idle[0].proc
    crashed.kill()
    crashed.wait()
    assert is_equiv("w+w", "2w")                                               # a dead worker is restarted too
    grader.shutdown_graders()
    grader.forget_workers_after_fork()


def test_pass_at_1_has_the_standard_error_of_its_problems():
    """summarize's pass@1_se is the sample standard deviation of the per-problem pass@1 over sqrt(problems)
    (statistics.stdev as the oracle), not of the samples: two samples of one problem are not independent."""
    import statistics

    import scheduler
    import tasks

    rewards = [[1, 1], [1, 0], [0, 0], [0, 0], [1, 1]]
    problems = [tasks.Problem(f"p{i}", "q", "1") for i in range(len(rewards))]
    groups = [[scheduler.Trajectory(p.id, [1], [scheduler.Segment([2], 1)], reward=float(r)) for r in rs]
              for p, rs in zip(problems, rewards)]
    s = grader.summarize(problems, groups, ks=())
    per_problem = [sum(rs) / 2 for rs in rewards]
    assert s["pass@1_by_problem"] == per_problem and s["pass@1"] == 0.5
    assert s["pass@1_se"] == pytest.approx(statistics.stdev(per_problem) / math.sqrt(5))
    assert grader.mean_and_se([0.3]) == (0.3, None) and grader.mean_and_se([]) == (0.0, None)
