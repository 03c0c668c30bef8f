"""Training and evaluation problems: rStar2-Agent's data, section 4 (training data) and 4.3 (curriculum).

The paper trains on ~42K math problems whose answers are integers (so that a rule-based verifier gives a clean
0/1 reward), decontaminated against the evaluation sets with 8-gram overlap, in stages of growing difficulty
(stage 3 keeps only problems the policy does not yet solve 8/8). Those 42K problems are not available offline,
and a 135M-parameter laptop model could not solve them anyway, so this module offers three sources:

1. A built-in, seeded generator of integer-answer problems that a small model cannot do in its head but can
   with one or a few lines of Python (large products, modular powers, divisor counts, prime counts, ...).
   Each family has levels 1 (a Python one-liner) .. 3 (needs a loop, a fast algorithm or care).

       problem_at(index, seed, split, levels, families)        # the index-th problem of a stream
         rng = Random("seed:split:index")                       #   -> one private RNG per index
         family, level = rng.choice(...)                        #   -> which kind of problem
         question, answer, params = FAMILIES[family](rng, level)
         keep it iff split_of(family, params) == split, else draw again from the same rng

   Because every index has its own RNG, the trainer's data cursor is just an integer and a resumed run sees
   exactly the problems it would have seen. The split (train, validation, test) is a hash of the family and its
   canonical parameters (C(n, k) = C(n, n - k)), not of the wording, so an evaluation problem never reaches
   training even in another phrasing or as its mirror.

2. A loader for the offline JSON/JSONL files (AIME, HMMT, MATH-500, AMC, GSM8K, the rLLM training sets) that
   keeps integer answers by default, as the paper does:   file -> rows -> (question, final answer) -> Problem.

3. decontaminate(): the paper's word 8-gram filter of training problems against the evaluation sets.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
from bisect import bisect_left
from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations
from pathlib import Path
from typing import Callable, Sequence


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    answer: str        # the gold final answer; an integer written in base 10 when it is one ("-12", "33")
    source: str = "generated"   # "generated", or the stem of the file it was loaded from ("aime24")
    level: int = 1     # generated: 1 (easy) .. 3 (hard); loaded: the file's "level" field, or 0 when it has none
    family: str = ""   # generated: the FAMILIES key; loaded: the file's subject/type field when present
    params: str = ""   # generated: the family's parameters as JSON (what the question states); loaded: ""


# ----------------------------------------------------------------------------------------------------------------
# Small number-theory helpers (the answers are always computed exactly with Python ints)

def digit_sum(n: int) -> int:
    return sum(map(int, str(abs(n))))


def to_base(n: int, base: int) -> str:
    """Digits of n >= 0 in base 2..10, most significant first ("0" for 0)."""
    digits = ""
    while True:
        n, d = divmod(n, base)
        digits = str(d) + digits
        if n == 0:
            return digits


def fibonacci_pair(n: int, mod: int | None = None) -> tuple[int, int]:
    """(F(n), F(n+1)) with F(0)=0, F(1)=1, by fast doubling, optionally mod `mod`:
    F(2k) = F(k) * (2F(k+1) - F(k)),  F(2k+1) = F(k)^2 + F(k+1)^2.  O(log n) steps, so n = 10^15 is instant."""
    if n == 0:
        return 0, 1
    a, b = fibonacci_pair(n // 2, mod)
    c = a * (2 * b - a)
    d = a * a + b * b
    if mod is not None:
        c, d = c % mod, d % mod
    return (d, c + d) if n % 2 else (c, d)


def prime_factors(n: int) -> dict[int, int]:
    """{prime: exponent} by trial division (used only for n up to about 10^9)."""
    factors: dict[int, int] = {}
    p = 2
    while p * p <= n:
        while n % p == 0:
            factors[p] = factors.get(p, 0) + 1
            n //= p
        p += 1
    if n > 1:
        factors[n] = factors.get(n, 0) + 1
    return factors


SIEVE_LIMIT = 10**6


@lru_cache(maxsize=1)
def primes_up_to_limit() -> list[int]:
    """All primes below SIEVE_LIMIT (sieve of Eratosthenes, computed once and cached)."""
    is_prime = bytearray([1]) * SIEVE_LIMIT
    is_prime[0] = is_prime[1] = 0
    for p in range(2, math.isqrt(SIEVE_LIMIT - 1) + 1):
        if is_prime[p]:
            is_prime[p * p::p] = bytes(len(range(p * p, SIEVE_LIMIT, p)))
    return [i for i, flag in enumerate(is_prime) if flag]


def primes_between(low: int, high: int) -> list[int]:
    """Primes p with low <= p < high (high <= SIEVE_LIMIT)."""
    primes = primes_up_to_limit()
    return primes[bisect_left(primes, low):bisect_left(primes, high)]


def sum_of_multiples_below(n: int, d: int) -> int:
    """d + 2d + ... + md with md < n:  d * m(m+1)/2,  m = (n-1) // d."""
    m = (n - 1) // d
    return d * m * (m + 1) // 2


def count_multiples_in(low: int, high: int, d: int) -> int:
    """How many k in [low, high] are divisible by d."""
    return high // d - (low - 1) // d


def lcm_all(numbers: Sequence[int]) -> int:
    result = 1
    for x in numbers:
        result = result * x // math.gcd(result, x)
    return result


def random_digits(rng: random.Random, digits: int) -> int:
    """A uniformly random integer with exactly `digits` decimal digits."""
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


SMALL_PRIMES = [p for p in range(2, 200) if all(p % q for q in range(2, p))]


# ----------------------------------------------------------------------------------------------------------------
# Problem families. Each is `family(rng, level) -> (question, answer, params)`:
#   params holds every number the question states (so params decide the problem and the answer; the template,
#   also drawn from rng, only decides the wording). Level 1 is one Python expression; level 3 needs a loop,
#   a fast algorithm (fast doubling, modular exponentiation) or inclusion-exclusion.

def product(rng: random.Random, level: int):
    sizes = {1: [4, 4], 2: [6, 7], 3: [7, 8, 5]}[level]
    factors = [random_digits(rng, d) for d in sizes]
    shown = " * ".join(map(str, factors))
    if len(factors) == 2:
        a, b = factors
        question = rng.choice([
            f"What is {a} * {b}?",
            f"Compute the product of {a} and {b}.",
            f"Multiply {a} by {b}. What number do you get?",
            f"A warehouse holds {a} crates and every crate contains {b} bolts. How many bolts are in the warehouse?",
        ])
    else:
        question = rng.choice([
            f"What is {shown}?",
            f"Compute the product {shown}.",
            f"Find the value of {shown.replace(' * ', ' times ')}.",
        ])
    return question, math.prod(factors), {"factors": factors}


def modular_power(rng: random.Random, level: int):
    if level == 1:
        a, e, m = rng.randint(2, 99), rng.randint(20, 99), rng.randint(100, 999)
    elif level == 2:
        a, e, m = rng.randint(100, 9999), rng.randint(1000, 10**6), rng.randint(10**4, 10**6)
    else:
        a, e, m = rng.randint(10**5, 10**9), rng.randint(10**9, 10**12), rng.randint(10**8, 2 * 10**9)
    question = rng.choice([
        f"What is the remainder when {a}^{e} is divided by {m}?",
        f"Compute {a}^{e} mod {m}.",
        f"Find {a} raised to the power {e}, modulo {m}.",
        f"Let N = {a}^{e}. What is N mod {m}?",
    ])
    return question, pow(a, e, m), {"a": a, "e": e, "m": m}


def divisors(rng: random.Random, level: int):
    if level == 1:
        # A random 4-5 digit number; trial division is instant at this size.
        n = rng.randint(1000, 99999)
        factors = prime_factors(n)
        kind = "count"
    else:
        # Build n from its factorization so that it has many divisors and the answer needs no factoring here:
        # 3-5 distinct primes (below 60 at level 2, below 200 at level 3) with exponents 1..4 (level 2) or 1..6.
        k = rng.randint(3, 5)
        pool = [p for p in SMALL_PRIMES if p < (60 if level == 2 else 200)]
        factors = {p: rng.randint(1, 4 if level == 2 else 6) for p in sorted(rng.sample(pool, k))}
        n = math.prod(p**e for p, e in factors.items())
        kind = "count" if level == 2 else rng.choice(["count", "sum", "square"])
    if kind == "count":
        # d(n) = prod (e_i + 1)
        answer = math.prod(e + 1 for e in factors.values())
        question = rng.choice([
            f"How many positive divisors does {n} have?",
            f"Find the number of positive integer divisors of {n}.",
            f"How many positive integers divide {n} exactly?",
        ])
    elif kind == "sum":
        # sigma(n) = prod (p^(e+1) - 1) / (p - 1)
        answer = math.prod((p ** (e + 1) - 1) // (p - 1) for p, e in factors.items())
        question = rng.choice([
            f"What is the sum of all positive divisors of {n}?",
            f"Compute the sum of the positive integers that divide {n}.",
        ])
    else:
        # A divisor p1^f1... is a square iff every f_i is even: prod (floor(e_i / 2) + 1) choices.
        answer = math.prod(e // 2 + 1 for e in factors.values())
        question = rng.choice([
            f"How many positive divisors of {n} are perfect squares?",
            f"Count the divisors of {n} that are squares of integers (1 counts).",
        ])
    return question, answer, {"n": n, "kind": kind}


def range_sum(rng: random.Random, level: int):
    kind = rng.choice(["powers", "multiples"])
    if kind == "powers":
        power, high = {1: (2, 300), 2: (3, 5000), 3: (rng.randint(4, 6), 20000)}[level]
        a = rng.randint(1, high // 2)
        b = rng.randint(a + 10, high)
        answer = sum(k**power for k in range(a, b + 1))
        what = {2: "squares", 3: "cubes"}.get(power, f"{power}th powers")
        question = rng.choice([
            f"What is the sum of the {what} of all integers from {a} to {b} inclusive?",
            f"Compute the sum of k^{power} for k = {a}, {a + 1}, ..., {b}.",
            f"Find {a}^{power} + {a + 1}^{power} + ... + {b}^{power}.",
        ])
        return question, answer, {"kind": kind, "power": power, "a": a, "b": b}
    n = rng.randint(*{1: (100, 2000), 2: (10**4, 10**6), 3: (10**6, 10**9)}[level])
    p, q = sorted(rng.sample(range(2, 10 if level < 3 else 20), 2))
    # Inclusion-exclusion: S(p or q) = S(p) + S(q) - S(lcm(p, q)), S(d) = sum of multiples of d below n.
    either = sum_of_multiples_below(n, p) + sum_of_multiples_below(n, q) - sum_of_multiples_below(n, math.lcm(p, q))
    if level < 3:
        question = rng.choice([
            f"What is the sum of all positive integers below {n} that are multiples of {p} or {q}?",
            f"Find the sum of the natural numbers less than {n} that are divisible by {p} or by {q}.",
            f"Add up every positive integer smaller than {n} that is a multiple of {p} or of {q}. What is the total?",
        ])
        return question, either, {"kind": kind, "n": n, "divisors": [p, q]}
    # Level 3 also removes the multiples of r: S(p or q) - S((p or q) and r), the second term by the same rule.
    r = rng.choice([x for x in range(2, 20) if x not in (p, q)])
    both_and_r = (sum_of_multiples_below(n, math.lcm(p, r)) + sum_of_multiples_below(n, math.lcm(q, r))
                  - sum_of_multiples_below(n, math.lcm(p, q, r)))
    question = rng.choice([
        f"What is the sum of all positive integers below {n} that are divisible by {p} or {q} but not by {r}?",
        f"Find the sum of the natural numbers less than {n} that are multiples of {p} or of {q}, "
        f"excluding every multiple of {r}.",
    ])
    return question, either - both_and_r, {"kind": kind, "n": n, "divisors": [p, q], "excluded": r}


def binomial(rng: random.Random, level: int):
    if level == 1:
        n = rng.randint(20, 40)
    elif level == 2:
        n = rng.randint(50, 120)
    else:
        n = rng.randint(500, 5000)
    k = rng.randint(3, n - 3)
    if level < 3:
        question = rng.choice([
            f"What is the binomial coefficient C({n}, {k})?",
            f"How many ways are there to choose {k} items from {n} distinct items?",
            f"Compute {n} choose {k}.",
            f"A club has {n} members. In how many ways can it pick a committee of {k} members?",
        ])
        return question, math.comb(n, k), {"n": n, "k": k}
    m = rng.choice([10**9 + 7, 998244353, rng.randint(10**6, 10**9)])
    question = rng.choice([
        f"What is C({n}, {k}) mod {m}?",
        f"Find the remainder when the binomial coefficient {n} choose {k} is divided by {m}.",
    ])
    return question, math.comb(n, k) % m, {"n": n, "k": k, "m": m}


def big_digit_sum(rng: random.Random, level: int):
    kind = "power" if level == 1 else rng.choice(["power", "factorial"])
    if kind == "power":
        base = rng.randint(2, 9) if level == 1 else rng.randint(10, 99)
        low, high = {1: (30, 200), 2: (100, 500), 3: (500, 3000)}[level]
        # At most 4000 digits: Python refuses str() of ints over 4300 digits (sys.set_int_max_str_digits), and
        # the one-liner the model writes, sum(map(int, str(x))), should work.
        e = rng.randint(low, min(high, int(4000 / math.log10(base))))
        value, shown = base**e, f"{base}^{e}"
    else:
        n = rng.randint(*{2: (30, 150), 3: (150, 1000)}[level])
        value, shown = math.factorial(n), f"{n}!"
    question = rng.choice([
        f"What is the sum of the digits of {shown}?",
        f"Compute the digit sum of {shown} (written in base 10).",
        f"Write out {shown} in decimal and add up its digits. What do you get?",
    ])
    params = {"kind": kind, "base": base, "e": e} if kind == "power" else {"kind": kind, "n": n}
    return question, digit_sum(value), params


def gcd_lcm(rng: random.Random, level: int):
    # gcd questions share a planted common factor g, otherwise the gcd would almost always be 1 or tiny.
    if level == 1:
        g = rng.randint(2, 999)
        numbers = [g * rng.randint(50, 999) for _ in range(2)]
        kind = "gcd"
    elif level == 2:
        kind = rng.choice(["gcd", "lcm"])
        if kind == "gcd":
            g = rng.randint(1000, 99999)
            numbers = [g * rng.randint(1000, 99999) for _ in range(3)]
        else:
            numbers = [rng.randint(10**4, 10**7) for _ in range(2)]
    else:
        kind = rng.choice(["gcd", "lcm_range"])
        if kind == "gcd":
            g = random_digits(rng, rng.randint(6, 9))
            numbers = [g * random_digits(rng, 10) for _ in range(2)]
        else:
            n = rng.randint(20, 60)
            question = rng.choice([
                f"What is the smallest positive integer that is divisible by every integer from 1 to {n}?",
                f"Compute the least common multiple of 1, 2, 3, ..., {n}.",
            ])
            return question, lcm_all(range(1, n + 1)), {"kind": kind, "n": n}
    shown = ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
    if kind == "gcd":
        question = rng.choice([
            f"What is the greatest common divisor of {shown}?",
            f"Find gcd({', '.join(map(str, numbers))}).",
            f"What is the largest positive integer that divides each of {shown}?",
        ])
        return question, math.gcd(*numbers), {"kind": kind, "numbers": numbers}
    question = rng.choice([
        f"What is the least common multiple of {shown}?",
        f"Find lcm({', '.join(map(str, numbers))}).",
        f"What is the smallest positive integer that is a multiple of {numbers[0]} and also of {numbers[1]}?",
    ])
    return question, lcm_all(numbers), {"kind": kind, "numbers": numbers}


def prime_count(rng: random.Random, level: int):
    if level == 1:
        n = rng.randint(100, 3000)
        question = rng.choice([
            f"How many prime numbers are less than {n}?",
            f"Count the primes p with p < {n}.",
            f"How many primes are there below {n}?",
        ])
        return question, len(primes_between(2, n)), {"kind": "below", "n": n}
    if level == 2:
        a = rng.randint(1000, 50000)
        b = a + rng.randint(1000, 50000)
        question = rng.choice([
            f"How many prime numbers are there between {a} and {b} inclusive?",
            f"Count the primes p with {a} <= p <= {b}.",
        ])
        return question, len(primes_between(a, b + 1)), {"kind": "between", "a": a, "b": b}
    n = rng.randint(10**5, SIEVE_LIMIT)
    m = rng.choice([4, 6, 10, 12])
    r = rng.choice([x for x in range(1, m) if math.gcd(x, m) == 1])
    question = rng.choice([
        f"How many primes p less than {n} satisfy p mod {m} = {r}?",
        f"Count the prime numbers below {n} that leave remainder {r} when divided by {m}.",
    ])
    answer = sum(1 for p in primes_between(2, n) if p % m == r)
    return question, answer, {"kind": "residue", "n": n, "m": m, "r": r}


def fibonacci(rng: random.Random, level: int):
    definition = rng.choice([
        "The Fibonacci numbers are F(1) = 1, F(2) = 1 and F(n) = F(n-1) + F(n-2).",
        "Let F(1) = F(2) = 1 and F(n+2) = F(n+1) + F(n) for n >= 1.",
    ])
    if level == 1:
        n = rng.randint(40, 300)      # F(300) has 63 digits: exact, via a short loop
        question = definition + rng.choice([f" What is F({n})?", f" Compute F({n})."])
        return question, fibonacci_pair(n)[0], {"n": n}
    n, m = ((rng.randint(1000, 10**5), rng.randint(100, 10**4)) if level == 2
            else (rng.randint(10**12, 10**15), rng.randint(10**6, 10**9)))
    question = definition + rng.choice([
        f" What is F({n}) mod {m}?",
        f" Find the remainder when F({n}) is divided by {m}.",
    ])
    return question, fibonacci_pair(n, m)[0], {"n": n, "m": m}


def count_in_range(rng: random.Random, level: int):
    kind = rng.choice(["divisible_not", "digit_sum"] if level < 3 else ["divisible_none", "coprime"])
    if kind == "digit_sum":   # counted by brute force below, so the range stays short (at most 5000 numbers)
        a = rng.randint(1, {1: 1000, 2: 10**5}[level])
        b = a + rng.randint(*{1: (200, 1000), 2: (2000, 5000)}[level])
    else:                     # counted by formula, so the range can be huge
        span = {1: 2000, 2: 10**5, 3: 10**9}[level]
        a = rng.randint(1, span)
        b = a + rng.randint(span // 2, span)
    if kind == "divisible_not":
        p, q = rng.sample(range(2, 30), 2)
        # |multiples of p| - |multiples of p and q| = count(p) - count(lcm(p, q))
        answer = count_multiples_in(a, b, p) - count_multiples_in(a, b, math.lcm(p, q))
        question = rng.choice([
            f"How many integers from {a} to {b} inclusive are divisible by {p} but not by {q}?",
            f"Count the integers k with {a} <= k <= {b} such that {p} divides k and {q} does not divide k.",
        ])
        return question, answer, {"kind": kind, "a": a, "b": b, "p": p, "q": q}
    if kind == "digit_sum":
        s = rng.randint(5, 25)
        answer = sum(1 for k in range(a, b + 1) if digit_sum(k) == s)
        question = rng.choice([
            f"How many integers between {a} and {b} inclusive have digit sum equal to {s}?",
            f"Count the integers k with {a} <= k <= {b} whose decimal digits add up to {s}.",
        ])
        return question, answer, {"kind": kind, "a": a, "b": b, "s": s}
    if kind == "divisible_none":
        ds = sorted(rng.sample(range(2, 40), 3))
        # Inclusion-exclusion: count(none) = sum over subsets T of (-1)^|T| * count(lcm(T)), T = {} gives b-a+1.
        answer = sum((-1) ** size * count_multiples_in(a, b, lcm_all(subset))
                     for size in range(4) for subset in combinations(ds, size))
        question = rng.choice([
            f"How many integers from {a} to {b} inclusive are divisible by none of {ds[0]}, {ds[1]} and {ds[2]}?",
            f"Count the integers k with {a} <= k <= {b} that are not multiples of {ds[0]}, {ds[1]} or {ds[2]}.",
        ])
        return question, answer, {"kind": kind, "a": a, "b": b, "divisors": ds}
    m = rng.randint(1000, 10**6)
    primes = list(prime_factors(m))
    # Integers in [a, b] coprime to m: inclusion-exclusion over the distinct prime factors of m.
    answer = sum((-1) ** size * count_multiples_in(a, b, math.prod(subset))
                 for size in range(len(primes) + 1) for subset in combinations(primes, size))
    question = rng.choice([
        f"How many integers k with {a} <= k <= {b} satisfy gcd(k, {m}) = 1?",
        f"Count the integers from {a} to {b} inclusive that are relatively prime to {m}.",
    ])
    return question, answer, {"kind": kind, "a": a, "b": b, "m": m}


def base_conversion(rng: random.Random, level: int):
    # Answers stay integers: a base-10 value, or the digits of a base-2..9 numeral read as one number.
    if level == 1:
        base, value = rng.randint(2, 9), rng.randint(50, 5000)
        numeral = to_base(value, base)
        question = rng.choice([
            f"Convert the base-{base} number {numeral} to base 10.",
            f"The number {numeral} is written in base {base}. What is its value in decimal?",
            f"What is {numeral}_{base} in base 10?",
        ])
        return question, value, {"from": base, "to": 10, "value": value}
    if level == 2:
        source, target, value = 10, rng.randint(2, 9), rng.randint(1000, 10**6)
    else:
        source, target = rng.sample(range(2, 10), 2)
        value = rng.randint(10**6, 10**9)
    numeral = to_base(value, source)
    written = f"the base-{source} number {numeral}" if source != 10 else str(value)
    question = rng.choice([
        f"Write {written} in base {target}. Give the base-{target} digits as your answer.",
        f"Convert {written} to base {target}. Answer with the digits of the result, without a subscript.",
        f"What are the digits of {written} when it is written in base {target}?",
    ])
    return question, int(to_base(value, target)), {"from": source, "to": target, "value": value}


# family name -> generator(rng, level) -> (question, answer, params); a plain dict, in a fixed order.
FAMILIES: dict[str, Callable[[random.Random, int], tuple[str, int, dict]]] = {
    "product": product,
    "modular_power": modular_power,
    "divisors": divisors,
    "range_sum": range_sum,
    "binomial": binomial,
    "digit_sum": big_digit_sum,
    "gcd_lcm": gcd_lcm,
    "prime_count": prime_count,
    "fibonacci": fibonacci,
    "count_in_range": count_in_range,
    "base_conversion": base_conversion,
}
LEVELS = (1, 2, 3)
SPLITS = ("train", "validation", "test")


# ----------------------------------------------------------------------------------------------------------------
# The splits and the deterministic stream
#
# A problem's split is decided by its canonical parameters, the numbers that decide its answer written in one
# form (C(n, k) = C(n, n - k); a product, gcd or lcm does not depend on the order of its numbers), never by its
# wording: a problem held out for evaluation never reaches training in another phrasing or as its mirror.
#
#   bucket = sha256(family + canonical params) mod 10:  0 -> validation, 1 -> test, 2..9 -> train
#
# validation: the held-out set the CPU preset's settings were chosen on (printed at every run);
# test:       a set of its own seed and stream, looked at only to report (docs/design.md, "The test split").
# Training streams, the difficulty scans and the SFT's chores that state a generator problem all stay in train.

SPLIT_MODULUS = 10
SPLIT_OF_BUCKET = {0: "validation", 1: "test"}      # any other bucket: train
VALIDATION_SEED, TEST_SEED = 1234, 4321            # the two evaluation sets' streams


def canonical_params(family: str, params: dict) -> dict:
    """The parameters that decide the answer, in one form: a mirrored binomial and a reordered product or gcd
    are the same problem. Every other family's parameters are already canonical."""
    if family == "binomial":                     # C(n, k) = C(n, n - k)
        return {**params, "k": min(params["k"], params["n"] - params["k"])}
    if family == "product":                      # a * b = b * a
        return {**params, "factors": sorted(params["factors"])}
    if family == "gcd_lcm" and "numbers" in params:   # gcd and lcm of a set
        return {**params, "numbers": sorted(params["numbers"])}
    return params


def canonical_key(family: str, params: dict) -> str:
    """A canonical text for the mathematical problem (not its wording): the family and its canonical parameters."""
    return family + ":" + json.dumps(canonical_params(family, params), sort_keys=True)


def stable_hash(text: str) -> int:
    # sha256, not hash(): Python's str hash changes between processes (PYTHONHASHSEED).
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def split_of(family: str, params: dict) -> str:
    """"train", "validation" or "test": the split every wording of this problem belongs to."""
    return SPLIT_OF_BUCKET.get(stable_hash(canonical_key(family, params)) % SPLIT_MODULUS, "train")


def checked_split(split: str) -> str:
    """The split's name ("heldout", the validation set's older name, is accepted); a ValueError for others."""
    split = "validation" if split == "heldout" else split
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return split


def checked_families(levels: Sequence[int], families: Sequence[str] | None) -> list[str]:
    """The family names to draw from (all when None); a ValueError for empty or unknown levels or families."""
    if not levels or any(level not in LEVELS for level in levels):
        raise ValueError(f"levels must be a non-empty subset of {LEVELS}, got {tuple(levels)}")
    names = list(FAMILIES) if families is None else list(families)
    unknown = [f for f in names if f not in FAMILIES]
    if not names or unknown:
        raise ValueError(f"unknown families {unknown or names}; known: {', '.join(FAMILIES)}")
    return names


def problem_at(index: int, seed: int, split: str = "train", levels: Sequence[int] = (1, 2),
               families: Sequence[str] | None = None, cells: Sequence[tuple[str, int]] | None = None) -> Problem:
    """The index-th problem of the (seed, split, levels, families) stream; the same arguments, the same problem.
    `cells` [(family, level), ...] replaces families x levels by just those pairs (a stage's difficulty scan
    chooses them: curriculum.choose_cells)."""
    split = checked_split(split)
    names = checked_families(levels, families)
    if cells is not None:
        bad = [c for c in cells if c[0] not in FAMILIES or c[1] not in LEVELS]
        if not cells or bad:
            raise ValueError(f"cells must be (family, level) pairs of {', '.join(FAMILIES)} x {LEVELS}, got {bad}")
    # One RNG per index, seeded from a string (Random hashes str seeds with sha512: stable across processes).
    # The validation stream keeps its older name, "heldout", so its problems are those it always had.
    stream = "heldout" if split == "validation" else split
    rng = random.Random(f"rstar2-tasks:{seed}:{stream}:{index}")
    for _ in range(1000):   # a train draw is kept 8 times in 10, a validation or test draw 1 time in 10
        if cells is not None:
            family, level = rng.choice(list(cells))
        else:
            family = rng.choice(names)
            level = rng.choice(list(levels))
        question, answer, params = FAMILIES[family](rng, level)
        if split_of(family, params) == split:
            problem_id = f"{family}-L{level}-{stable_hash(question):016x}"
            return Problem(problem_id, question, str(answer), "generated", level, family,
                           json.dumps(params, sort_keys=True))
    raise RuntimeError(f"no {split} problem found for index {index}")   # unreachable at SPLIT_MODULUS = 10


def generate_problems(n: int, seed: int, split: str = "train", levels: Sequence[int] = (1, 2),
                      families: Sequence[str] | None = None) -> list[Problem]:
    """Problems 0..n-1 of the stream, i.e. [problem_at(i, ...) for i in range(n)]."""
    return [problem_at(i, seed, split, levels, families) for i in range(n)]


def evaluation_set(split: str, n: int, seed: int, levels: Sequence[int] = (1, 2),
                   families: Sequence[str] | None = None) -> list[Problem]:
    """A fixed evaluation set of n problems of one split, no two alike by canonical parameters (so never the
    same problem in other words), stratified: problem k comes from family k mod F and, once every family has had
    one, the next level in turn, so each (family, level) cell holds floor(n / cells) or one more and a
    per-family pass@1 always has its samples."""
    names = checked_families(levels, families)
    cells = [(family, level) for level in levels for family in names]     # round-robin: families first
    problems: list[Problem] = []
    seen: set[str] = set()
    next_index = {cell: 0 for cell in cells}
    for k in range(n):
        cell = cells[k % len(cells)]
        for _ in range(10_000):
            problem = problem_at(next_index[cell], seed, split, levels, names, cells=[cell])
            next_index[cell] += 1
            key = canonical_key(problem.family, json.loads(problem.params))
            if key not in seen:
                break
        else:
            raise ValueError(f"cell {cell} has too few distinct {split} problems for a set of {n}")
        seen.add(key)
        problems.append(problem)
    return problems


def heldout_problems(n: int = 64, seed: int = VALIDATION_SEED, levels: Sequence[int] = (1, 2),
                     families: Sequence[str] | None = None) -> list[Problem]:
    """The validation set: the held-out problems every run prints before and after RL (evaluation_set)."""
    return evaluation_set("validation", n, seed, levels, families)


def heldout_test_problems(n: int = 64, seed: int = TEST_SEED, levels: Sequence[int] = (1, 2),
                  families: Sequence[str] | None = None) -> list[Problem]:
    """The test set: disjoint from training, the scans, the SFT's chores and the validation set by canonical
    parameters, from a seed and stream of its own; looked at only to report, never to choose a setting."""
    return evaluation_set("test", n, seed, levels, families)


# ----------------------------------------------------------------------------------------------------------------
# Loading problem files

class DataError(ValueError):
    """A problem file that cannot be read: the message names the file and the line (or array item)."""


QUESTION_FIELDS = ("problem", "question", "prompt", "input")
# "answer" first: AIME/MATH rows carry both a short answer and a long solution. GSM8K's "answer" is a whole
# solution ending in "#### N", and a bare "solution" holds a \boxed{} answer: final_answer_text() handles both.
ANSWER_FIELDS = ("answer", "final_answer", "expected_answer", "gt_answer", "ground_truth", "target", "solution")

DATASETS = {                     # short names for offline data files in data_dir() (none is shipped here)
    "aime24": "aime24.jsonl",
    "aime25": "aime25_matharena.jsonl",
    "hmmt25": "hmmt_feb_2025.jsonl",
    "math500": "math500.jsonl",
    "amc23": "amc23.jsonl",
    "gsm8k": "gsm8k_test_openai.jsonl",
    "gsm8k_train": "gsm8k_train_openai.jsonl",
    "aime_train": "train_aime_1983_2023_rllm.json",
    "math_train": "train_math_rllm.json",
}


def data_dir() -> Path:
    """Where the short names' files are looked up: $RSTAR2_DATA_DIR, else data/ in this checkout (git-ignored:
    put downloaded copies of the benchmark files there; the repository ships none)."""
    return Path(os.environ.get("RSTAR2_DATA_DIR") or Path(__file__).resolve().parent / "data")


def resolve_dataset(name_or_path: str | Path) -> Path:
    """An existing file path as is; a short name ("aime24", "math500", ...) as its file in data_dir()."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    name = str(name_or_path).lower()
    if name in DATASETS:
        found = data_dir() / DATASETS[name]
        if found.is_file():
            return found
        raise DataError(f"dataset {name!r} should be at {found}, which does not exist "
                        f"(set RSTAR2_DATA_DIR to the folder that holds the offline data files)")
    raise DataError(f"{name_or_path!r} is neither a file nor a known dataset name; "
                    f"known names: {', '.join(DATASETS)} (in {data_dir()})")


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} (or \\fbox{...}), nested braces included."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    open_brace = text.find("{", start)
    if open_brace < 0:
        return None
    depth = 0
    for i in range(open_brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_brace + 1:i]
    return None


def final_answer_text(raw) -> str:
    """The final answer out of an answer field: after the last "####" (GSM8K), else the last \\boxed{}."""
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)                      # AMC23 stores 27.0
    text = str(raw).strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    boxed = last_boxed(text)
    return boxed.strip() if boxed is not None else text


# After removing "$" signs and LaTeX spacing: an optional sign, digits with optional thousands commas
# ("1,000,000" but not the list "1,2"), and an optional all-zero fraction ("27.0").
INTEGER_RE = re.compile(r"([+-]?)(\d{1,3}(?:,\d{3})+|\d+)(?:\.0*)?")


def normalize_integer(text: str) -> str | None:
    """ "033" -> "33", "-12" -> "-12", "\\$1,\\!657" -> "1657", "27.0" -> "27"; None when not an integer."""
    for junk in ("\\$", "$", "\\!", "\\,", "\\ "):
        text = text.replace(junk, "")
    text = text.replace("{,}", ",").strip()
    match = INTEGER_RE.fullmatch(text)
    if not match:
        return None
    return str(int(match.group(1) + match.group(2).replace(",", "")))   # int() drops zero padding; -0 -> 0


def read_rows(path: Path) -> list[tuple[str, object]]:
    """[(where, row)] with where = "line N" (JSONL) or "item N" (a JSON array), 1-based."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" or text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            if not e.msg.startswith("Extra data"):       # "Extra data": one object per line, read as JSONL
                raise DataError(f"{path.name} line {e.lineno}: invalid JSON ({e.msg})") from None
        else:
            if not isinstance(data, list):
                raise DataError(f"{path.name}: expected a JSON array of problems, got {type(data).__name__}")
            return [(f"item {i}", row) for i, row in enumerate(data, 1)]
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue                                       # empty lines are skipped
        try:
            rows.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise DataError(f"{path.name} line {number}: invalid JSON ({e.msg})") from None
    return rows


def first_field(row: dict, fields: Sequence[str], where: str, kind: str):
    for field in fields:
        if field in row:
            return row[field]
    raise DataError(f"{where}: missing field {kind!r} (expected one of {', '.join(fields)})")


def load_problems(path: str | Path, integer_only: bool = True, limit: int | None = None) -> list[Problem]:
    """Problems from a JSONL file or a JSON array (or a short dataset name, see DATASETS).

    integer_only=True keeps only integer answers, as the paper does for RL data, normalized to plain base-10
    ("033" -> "33"); with False every row is kept (integer answers still normalized). A row whose answer is
    null or empty is skipped; a row without any question or answer field is an error (DataError)."""
    path = resolve_dataset(path)
    problems: list[Problem] = []
    for where, row in read_rows(path):
        where = f"{path.name} {where}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        question = first_field(row, QUESTION_FIELDS, where, "question")
        raw_answer = first_field(row, ANSWER_FIELDS, where, "answer")
        if not isinstance(question, str) or not question.strip():
            raise DataError(f"{where}: the question is empty or not a string")
        if raw_answer is None or str(raw_answer).strip() == "":
            continue
        answer = final_answer_text(raw_answer)
        integer = normalize_integer(answer)
        if integer is None and integer_only:
            continue
        # The row's own id when it is a string ("aime_2025_I-1"), else the file stem and the id or line number.
        row_id = row.get("id", row.get("unique_id"))
        if not isinstance(row_id, str):
            row_id = f"{path.stem}-{row_id if row_id is not None else where.rsplit(' ', 1)[1]}"
        level = row.get("level")
        problems.append(Problem(
            id=row_id,
            question=question.strip(),
            answer=integer if integer is not None else answer,
            source=path.stem,
            level=level if isinstance(level, int) and not isinstance(level, bool) else 0,
            family=str(row.get("subject") or row.get("type") or ""),
        ))
        if limit is not None and len(problems) >= limit:
            break
    return problems


# ----------------------------------------------------------------------------------------------------------------
# Decontamination (the paper removes training problems that share an 8-gram with an evaluation problem)

def word_ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    """Word n-grams after lowercasing and turning every non-alphanumeric character into a space.
    A text shorter than n words gives its whole word tuple, so short problems are compared whole."""
    words = re.sub(r"[^0-9a-z]+", " ", text.lower()).split()
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def decontaminate(train: list[Problem], eval_sets: list[list[Problem]], n: int = 8) -> tuple[list[Problem], int]:
    """(train problems sharing no word n-gram with any evaluation problem, how many were removed)."""
    eval_grams: set[tuple[str, ...]] = set()
    for eval_set in eval_sets:
        for problem in eval_set:
            eval_grams |= word_ngrams(problem.question, n)
    kept = [p for p in train if eval_grams.isdisjoint(word_ngrams(p.question, n))]
    return kept, len(train) - len(kept)
