"""Tests for tasks.py: generated problems (exact answers, determinism, the held-out split), the file loader,
dataset names and 8-gram decontamination."""
import json
import math
import random
import re
import sys
from functools import reduce
from pathlib import Path

import numpy as np
import pytest
import sympy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tasks  # noqa: E402
from tasks import DataError, Problem  # noqa: E402


# ----------------------------------------------------------------------------------------------------------------
# Independent answers: brute force, sympy or a different algorithm from the one in tasks.py

def periodic_sum_below(n, keep, period):
    """Sum of 1 <= k < n with keep(k), where keep has the given period: each kept residue t in 1..period
    contributes the arithmetic progression t, t + period, ..., t + (c-1) * period below n."""
    total = 0
    for t in range(1, min(period, n - 1) + 1):
        if keep(t):
            c = (n - 1 - t) // period + 1
            total += c * t + period * c * (c - 1) // 2
    return total


def periodic_count_in(a, b, keep, period):
    """How many k in [a, b] satisfy keep(k), keep having the given period."""
    def upto(x):   # count of 1 <= k <= x
        full, rest = divmod(x, period)
        per_period = sum(1 for t in range(1, period + 1) if keep(t))
        return full * per_period + sum(1 for t in range(1, rest + 1) if keep(t))
    return upto(b) - upto(a - 1)


def numpy_primes_below(n):
    is_prime = np.ones(n, dtype=bool)
    is_prime[:2] = False
    for q in range(2, math.isqrt(n - 1) + 1):
        if is_prime[q]:
            is_prime[q * q::q] = False
    return np.flatnonzero(is_prime)


def fib_matrix_mod(n, m):
    """F(n) mod m from [[1,1],[1,0]]^n."""
    def mul(x, y):
        return [[(x[0][0] * y[0][0] + x[0][1] * y[1][0]) % m, (x[0][0] * y[0][1] + x[0][1] * y[1][1]) % m],
                [(x[1][0] * y[0][0] + x[1][1] * y[1][0]) % m, (x[1][0] * y[0][1] + x[1][1] * y[1][1]) % m]]
    result, base = [[1, 0], [0, 1]], [[1, 1], [1, 0]]
    while n:
        if n & 1:
            result = mul(result, base)
        base = mul(base, base)
        n >>= 1
    return result[0][1]


def digit_sum_by_division(x):
    total = 0
    while x:
        x, d = divmod(x, 10)
        total += d
    return total


def expected_answer(family, p):
    if family == "product":
        return reduce(lambda x, y: x * y, p["factors"])
    if family == "modular_power":
        return sympy.Integer(p["a"]).__pow__(p["e"], p["m"])
    if family == "divisors":
        ds = sympy.divisors(p["n"])
        return {"count": len(ds), "sum": sum(ds), "square": sum(1 for d in ds if math.isqrt(d) ** 2 == d)}[p["kind"]]
    if family == "range_sum":
        if p["kind"] == "powers":
            k = sympy.Symbol("k")
            return int(sympy.summation(k ** p["power"], (k, p["a"], p["b"])))
        ds, excluded = p["divisors"], p.get("excluded")
        def keep(k):
            return any(k % d == 0 for d in ds) and not (excluded and k % excluded == 0)
        return periodic_sum_below(p["n"], keep, math.lcm(*ds, excluded or 1))
    if family == "binomial":
        c = math.factorial(p["n"]) // (math.factorial(p["k"]) * math.factorial(p["n"] - p["k"]))
        return c % p["m"] if "m" in p else c
    if family == "digit_sum":
        x = p["base"] ** p["e"] if p["kind"] == "power" else math.factorial(p["n"])
        return digit_sum_by_division(x)
    if family == "gcd_lcm":
        if p["kind"] == "gcd":
            return int(reduce(sympy.igcd, p["numbers"]))
        if p["kind"] == "lcm":
            return int(reduce(sympy.ilcm, p["numbers"]))
        return int(reduce(sympy.ilcm, range(1, p["n"] + 1)))
    if family == "prime_count":
        if p["kind"] == "below":
            return int(sympy.primepi(p["n"] - 1))
        if p["kind"] == "between":
            return int(sympy.primepi(p["b"]) - sympy.primepi(p["a"] - 1))
        primes = numpy_primes_below(p["n"])
        return int(np.count_nonzero(primes % p["m"] == p["r"]))
    if family == "fibonacci":
        return fib_matrix_mod(p["n"], p.get("m", 10**1000))   # a modulus far above F(300): exact
    if family == "count_in_range":
        a, b = p["a"], p["b"]
        if p["kind"] == "digit_sum":
            return sum(1 for k in range(a, b + 1) if sum(int(c) for c in str(k)) == p["s"])
        if p["kind"] == "divisible_not":
            return periodic_count_in(a, b, lambda k: k % p["p"] == 0 and k % p["q"] != 0, math.lcm(p["p"], p["q"]))
        if p["kind"] == "divisible_none":
            ds = p["divisors"]
            return periodic_count_in(a, b, lambda k: all(k % d for d in ds), math.lcm(*ds))
        radical = math.prod(sympy.primefactors(p["m"]))
        if radical > 300_000:
            return None   # too slow to count this way; the formula is checked on the other samples
        return periodic_count_in(a, b, lambda k: math.gcd(k, radical) == 1, radical)
    if family == "base_conversion":
        return int(np.base_repr(p["value"], p["to"]))
    raise AssertionError(family)


def stated_numbers(family, params):
    """Numbers that the question must state for the problem to be well posed."""
    numbers = []
    for key, value in params.items():
        if key in ("kind", "power", "value", "from", "to"):
            continue
        numbers += value if isinstance(value, list) else [value]
    if family == "base_conversion" and params["from"] != 10:
        numbers.append(np.base_repr(params["value"], params["from"]))
    elif family == "base_conversion":
        numbers.append(params["value"])
    return [str(x) for x in numbers]


# ----------------------------------------------------------------------------------------------------------------
# Generated problems

@pytest.mark.parametrize("family", list(tasks.FAMILIES))
def test_family_answers_are_exact_and_questions_state_every_number(family):
    checked = 0
    for level in tasks.LEVELS:
        for seed in range(12):
            question, answer, params = tasks.FAMILIES[family](random.Random(f"{seed}"), level)
            assert isinstance(answer, int) and len(str(answer)) < 4300
            for number in stated_numbers(family, params):
                assert re.search(rf"(?<!\d){number}(?!\d)", question), (number, question)
            expected = expected_answer(family, params)
            if expected is not None:
                assert answer == expected, (question, params)
                checked += 1
    assert checked >= 30


def test_same_seed_same_problems_and_problem_at_is_the_stream():
    first = tasks.generate_problems(300, seed=7, levels=(1, 2, 3))
    assert first == tasks.generate_problems(300, seed=7, levels=(1, 2, 3))
    assert tasks.problem_at(123, seed=7, levels=(1, 2, 3)) == first[123]   # a resumed cursor gets the same problem
    other = tasks.generate_problems(300, seed=8, levels=(1, 2, 3))
    assert sum(a.question == b.question for a, b in zip(first, other)) < 5
    assert all(p.answer.lstrip("-").isdigit() and p.source == "generated" for p in first)
    assert {p.family for p in first} == set(tasks.FAMILIES)
    assert {p.level for p in first} == {1, 2, 3}


def test_train_and_heldout_never_share_a_problem():
    train = tasks.generate_problems(6000, seed=0, levels=(1, 2, 3))
    train += tasks.generate_problems(3000, seed=1, levels=(1,))
    heldout = tasks.generate_problems(600, seed=0, split="heldout", levels=(1, 2, 3))
    heldout += tasks.heldout_problems(176, levels=(1,))
    assert not {p.question for p in train} & {p.question for p in heldout}
    # About one problem in SPLIT_MODULUS is in each evaluation split, decided by (family, params), not the wording:
    rng = random.Random(0)
    draws = [("product", tasks.FAMILIES["product"](rng, 1)[2]) for _ in range(3000)]
    for split in ("validation", "test"):
        share = sum(tasks.split_of(f, p) == split for f, p in draws) / len(draws)
        assert abs(share - 1 / tasks.SPLIT_MODULUS) < 0.03


def test_heldout_set_is_fixed_distinct_and_honours_levels():
    heldout = tasks.heldout_problems()
    assert len(heldout) == 64 and heldout == tasks.heldout_problems(64, seed=1234)
    assert len({p.question for p in heldout}) == 64
    assert {p.level for p in heldout} <= {1, 2}
    assert len({p.family for p in heldout}) >= 8
    assert tasks.heldout_problems(64, seed=99) != heldout


def test_heldout_set_is_stratified_over_families_and_levels():
    """Every family gets its share of the held-out set (n problems round-robin over families, then levels), so a
    per-family pass@1 never rests on a family that the draw happened to leave out."""
    from collections import Counter
    problems = tasks.heldout_problems(22, levels=(1,))
    assert Counter(p.family for p in problems) == {family: 2 for family in tasks.FAMILIES}
    problems = tasks.heldout_problems(50, levels=(1, 2))
    by_family = Counter(p.family for p in problems)
    assert set(by_family) == set(tasks.FAMILIES) and max(by_family.values()) - min(by_family.values()) <= 1
    by_cell = Counter((p.family, p.level) for p in problems)
    assert max(by_cell.values()) - min(by_cell.values()) <= 1
    two = tasks.heldout_problems(12, levels=(1,), families=["gcd_lcm", "product"])
    assert Counter(p.family for p in two) == {"gcd_lcm": 6, "product": 6}
    for bad in ({"levels": ()}, {"levels": (9,)}, {"families": []}, {"families": ["nope"]}):
        with pytest.raises(ValueError, match="levels|families"):
            tasks.heldout_problems(4, **bad)


def test_families_filter_and_wording_varies():
    problems = tasks.generate_problems(200, seed=3, families=["fibonacci", "product"], levels=(1,))
    assert {p.family for p in problems} == {"fibonacci", "product"}
    for family in tasks.FAMILIES:
        shapes = {re.sub(r"\d+", "#", p.question)
                  for p in tasks.generate_problems(60, seed=5, families=[family], levels=(1,))}
        assert len(shapes) >= 2, family    # several templates per family


def test_cells_draw_only_those_family_level_pairs_and_keep_the_split():
    """A difficulty scan's choice [(family, level)] makes a stream of just those pairs, each of them drawn, and the
    train stream still never yields a held-out problem."""
    cells = [("binomial", 1), ("product", 2), ("fibonacci", 3)]
    problems = [tasks.problem_at(i, seed=7, cells=cells) for i in range(150)]
    assert {(p.family, p.level) for p in problems} == set(cells)
    heldout = {p.question for p in tasks.heldout_problems(40, seed=7, levels=(1, 2, 3))}
    assert not heldout & {p.question for p in problems}


def test_problem_at_rejects_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        tasks.problem_at(0, 0, split="holdout")
    with pytest.raises(ValueError, match="levels"):
        tasks.problem_at(0, 0, levels=(4,))
    with pytest.raises(ValueError, match="known: product"):
        tasks.problem_at(0, 0, families=["calculus"])
    with pytest.raises(ValueError, match="cells"):
        tasks.problem_at(0, 0, cells=[("product", 4)])
    with pytest.raises(ValueError, match="cells"):
        tasks.problem_at(0, 0, cells=[])


# ----------------------------------------------------------------------------------------------------------------
# Loading files

def write_lines(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_load_jsonl_field_names_and_integer_normalization(tmp_path):
    path = write_lines(tmp_path / "train.jsonl", [
        {"problem": "p1", "answer": "0012"},
        {"question": "p2", "answer": "She has 3 + 4 = 7.\n#### 1,234"},          # GSM8K
        "",                                                                        # empty lines are skipped
        {"prompt": "p3", "final_answer": "\\$1,\\!657"},
        {"problem": "p4", "solution": "so x = \\boxed{-12}."},
        {"problem": "p5", "answer": 27.0},                                         # AMC23 style
        {"problem": "p6", "answer": "\\frac{1}{2}"},
        {"problem": "p7", "answer": "1,2"},                                        # a list, not 12
        {"problem": "p8", "answer": None},                                         # skipped
        {"problem": "p9", "answer": "-0", "level": 3, "subject": "Algebra", "id": "x-9"},
    ])
    problems = tasks.load_problems(path)
    assert [(p.question, p.answer) for p in problems] == [
        ("p1", "12"), ("p2", "1234"), ("p3", "1657"), ("p4", "-12"), ("p5", "27"), ("p9", "0")]
    assert problems[0] == Problem("train-1", "p1", "12", "train", 0, "")
    assert problems[-1].id == "x-9" and problems[-1].level == 3 and problems[-1].family == "Algebra"
    everything = tasks.load_problems(path, integer_only=False)
    assert [p.answer for p in everything] == ["12", "1234", "1657", "-12", "27", "\\frac{1}{2}", "1,2", "0"]
    assert len(tasks.load_problems(path, limit=2)) == 2


def test_load_json_array(tmp_path):
    path = tmp_path / "set.json"
    path.write_text(json.dumps([{"problem": "a", "answer": "5"}, {"problem": "b", "answer": "x+1"}]))
    assert [p.answer for p in tasks.load_problems(path)] == ["5"]
    path.write_text(json.dumps([{"problem": "a", "answer": "5"}, {"problem": "b"}]))
    with pytest.raises(DataError, match=r"set.json item 2: missing field 'answer' \(expected one of answer, "):
        tasks.load_problems(path)


def test_load_errors_name_the_file_and_line(tmp_path):
    path = write_lines(tmp_path / "train.jsonl", [{"problem": "a", "answer": "1"}, "", "{not json"])
    with pytest.raises(DataError, match=r"train.jsonl line 3: invalid JSON"):
        tasks.load_problems(path)
    path = write_lines(tmp_path / "train.jsonl", [{"problem": "a", "answer": "1"}] * 16 + [{"problem": "b"}])
    with pytest.raises(DataError, match=r"train.jsonl line 17: missing field 'answer' \(expected one of answer, "
                                        r"final_answer.*solution"):
        tasks.load_problems(path)
    path = write_lines(tmp_path / "train.jsonl", [{"text": "a", "answer": "1"}])
    with pytest.raises(DataError, match=r"line 1: missing field 'question' \(expected one of problem, question"):
        tasks.load_problems(path)
    with pytest.raises(DataError, match="known names: aime24, aime25"):
        tasks.resolve_dataset("aime2099")
    assert isinstance(DataError("x"), ValueError)


def test_resolve_dataset_uses_env_dir(tmp_path, monkeypatch):
    write_lines(tmp_path / "aime24.jsonl", [{"problem": "q", "answer": "033"}])
    monkeypatch.setenv("RSTAR2_DATA_DIR", str(tmp_path))
    assert tasks.resolve_dataset("aime24") == tmp_path / "aime24.jsonl"
    assert tasks.load_problems("aime24")[0].answer == "33"
    with pytest.raises(DataError, match="does not exist"):
        tasks.resolve_dataset("math500")


needs_data = pytest.mark.skipif(not (tasks.data_dir() / "aime24.jsonl").is_file(), reason="no offline data")


@needs_data
def test_real_benchmark_files():
    counts = {name: (len(tasks.load_problems(name)), len(tasks.load_problems(name, integer_only=False)))
              for name in ("aime24", "aime25", "hmmt25", "math500", "amc23", "gsm8k", "aime_train")}
    assert counts == {"aime24": (30, 30), "aime25": (30, 30), "hmmt25": (14, 30), "math500": (315, 500),
                      "amc23": (40, 40), "gsm8k": (1319, 1319), "aime_train": (975, 975)}
    aime24 = tasks.load_problems("aime24")
    assert "25" in [p.answer for p in aime24] and not any(p.answer.startswith("0") for p in aime24)  # "025"
    assert tasks.load_problems("gsm8k", limit=1)[0].answer == "18"
    assert tasks.load_problems("amc23", limit=1)[0].answer == "27"


# ----------------------------------------------------------------------------------------------------------------
# Decontamination

def test_decontaminate_constructed_overlap():
    eval_set = [Problem("e1", "Find the number of ordered pairs (x, y) of positive integers with x + y = 100.", "99"),
                Problem("e2", "Compute 2 + 2.", "4")]
    train = [
        Problem("t1", "FIND the number of ordered pairs (x,y) of POSITIVE integers such that xy = 36.", "9"),
        Problem("t2", "What is the number of ordered triples of positive integers with a + b + c = 10?", "36"),
        Problem("t3", "compute 2+2", "4"),            # a short problem is compared whole
        Problem("t4", "Compute 2 + 3.", "5"),
    ]
    kept, removed = tasks.decontaminate(train, [eval_set])
    assert [p.id for p in kept] == ["t2", "t4"] and removed == 2
    assert tasks.decontaminate(train, [eval_set], n=13) == ([train[0], train[1], train[3]], 1)
    assert tasks.decontaminate(train, []) == (train, 0)


@needs_data
def test_decontaminate_real_files():
    train = tasks.load_problems("math_train")
    math500 = tasks.load_problems("math500", integer_only=False)
    kept, removed = tasks.decontaminate(train, [math500])
    assert 0 < removed < 0.2 * len(train) and len(kept) + removed == len(train)
    eval_grams = set().union(*(tasks.word_ngrams(p.question) for p in math500))
    assert all(eval_grams.isdisjoint(tasks.word_ngrams(p.question)) for p in kept[:500])
    assert tasks.decontaminate(math500[:50], [math500]) == ([], 50)    # an eval set is fully contaminated by itself


# ----------------------------------------------------------------------------------------------------------------
# The splits (train, scans, SFT drafts, validation, test) are disjoint by what decides a problem's answer

def answer_determining(family: str, params: dict) -> tuple:
    """This test's own reading of what decides each family's answer, whatever the wording: C(n, k) = C(n, n - k),
    a product, gcd or lcm does not depend on the order of its numbers; every other family's parameters as stated."""
    if family == "binomial":
        return family, params["n"], min(params["k"], params["n"] - params["k"]), params.get("m")
    if family == "product":
        return family, tuple(sorted(params["factors"]))
    if family == "gcd_lcm" and "numbers" in params:
        return family, params["kind"], tuple(sorted(params["numbers"]))
    return family, json.dumps(params, sort_keys=True)


def keys_of(problems) -> set:
    return {answer_determining(p.family, json.loads(p.params)) for p in problems}


def test_canonical_parameters_decide_the_answer_and_merge_mirrors():
    """Brute force over many draws: problems with the same canonical key have the same answer, and the mirror
    C(n, n - k) or a reordered product or gcd has the same key as the original."""
    answers: dict[str, str] = {}
    for p in tasks.generate_problems(3000, seed=11, levels=(1, 2, 3)):
        key = tasks.canonical_key(p.family, json.loads(p.params))
        assert answers.setdefault(key, p.answer) == p.answer, key
    assert tasks.canonical_key("binomial", {"n": 30, "k": 4}) == tasks.canonical_key("binomial", {"n": 30, "k": 26})
    assert tasks.canonical_key("binomial", {"n": 30, "k": 4}) != tasks.canonical_key("binomial", {"n": 30, "k": 5})
    assert tasks.canonical_key("product", {"factors": [12, 7]}) == tasks.canonical_key("product", {"factors": [7, 12]})
    assert (tasks.canonical_key("gcd_lcm", {"kind": "gcd", "numbers": [6, 4]})
            == tasks.canonical_key("gcd_lcm", {"kind": "gcd", "numbers": [4, 6]}))
    assert tasks.split_of("binomial", {"n": 30, "k": 4}) == tasks.split_of("binomial", {"n": 30, "k": 26})


SFT_MIXES = [{}, {"extra_chores": "dotted_sum"}, {"math_share": 0.5}]   # the default mix, the option, the others


def sft_drafts(n: int, seed: int = 0) -> list:
    from sft_config import SFTConfig
    from sft_data import draft_example

    return [draft_example(seed, i, SFTConfig(**mix)) for mix in SFT_MIXES for i in range(n)]


def sft_draft_keys(n: int, seed: int = 0) -> set:
    return {answer_determining(*d.same_as) for d in sft_drafts(n, seed) if d.same_as}


def test_no_two_splits_share_canonical_parameters():
    """Training streams (two seeds, the CPU preset's levels), the difficulty scans' draws, the SFT drafts that state
    a generator problem, the validation set and the test set: pairwise disjoint by answer-determining parameters
    (mirrored binomials included)."""
    train = keys_of(tasks.generate_problems(4000, seed=0, levels=(1, 2)))
    train |= keys_of(tasks.generate_problems(3000, seed=1, levels=(1,)))
    scans = keys_of([tasks.problem_at(i, seed=4099 + s, split="train", cells=[(f, 1)])
                     for s in range(3) for f in tasks.FAMILIES for i in range(40)])
    sft = sft_draft_keys(1500)
    validation = keys_of(tasks.heldout_problems(176, levels=(1,))) | keys_of(tasks.heldout_problems(200, levels=(1, 2)))
    test = keys_of(tasks.heldout_test_problems(176, levels=(1,))) | keys_of(tasks.heldout_test_problems(200, levels=(1, 2)))
    assert len(sft) > 50 and {k[0] for k in sft} >= {"binomial", "range_sum", "base_conversion"}
    sides = {"train": train, "scans": scans, "sft": sft, "validation": validation, "test": test}
    for a, b in [("train", "validation"), ("train", "test"), ("scans", "validation"), ("scans", "test"),
                 ("sft", "validation"), ("sft", "test"), ("validation", "test")]:
        assert not sides[a] & sides[b], (a, b, sorted(sides[a] & sides[b])[:3])


def test_sft_drafts_declare_the_generator_problem_they_state():
    """A chore that states a generator family's problem declares it, and the declaration is right: the declared
    parameters give the chore's answer by the family's own formula."""
    seen = set()
    for d in sft_drafts(800):
        if not d.same_as:
            continue
        family, params = d.same_as
        seen.add(family)
        if family == "binomial":
            assert math.comb(params["n"], params["k"]) == int(d.answer)
        elif family == "range_sum":
            assert sum(k ** params["power"] for k in range(params["a"], params["b"] + 1)) == int(d.answer)
        elif family == "base_conversion":
            assert params["to"] == 10 and params["value"] == int(d.answer)
    assert seen == {"binomial", "range_sum", "base_conversion"}


def test_test_split_is_deterministic_distinct_and_stratified():
    from collections import Counter
    test = tasks.heldout_test_problems(176, levels=(1,))
    assert test == tasks.heldout_test_problems(176, levels=(1,))
    assert Counter(p.family for p in test) == {family: 16 for family in tasks.FAMILIES}
    assert len(keys_of(test)) == 176                                       # no problem twice, in any wording
    assert not {p.question for p in test} & {p.question for p in tasks.heldout_problems(176, levels=(1,))}


def test_validation_set_never_repeats_a_problem_in_other_words():
    validation = tasks.heldout_problems(176, levels=(1,))
    assert len(keys_of(validation)) == 176
