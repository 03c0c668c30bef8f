"""Benchmark the answer grader (eval.is_equiv) against plain math-verify, on realistic (pred, gold) pairs.

The goal: grading 10,000 pairs takes under a minute on 2 cores. Pairs are built from the answers of the offline
benchmark files (in tasks.data_dir(): $RSTAR2_DATA_DIR or the checkout's data/, read in place): for each sampled
gold answer a prediction that is the same string ("correct"), an equal answer written differently ("reformatted": 033, 1,000, x = 5, 5^\\circ,
a/b, 0.5 for 1/2, the tool's 0.3333333333333333 for 1/3, 1.5\\times10^{3}, 125\\textnormal{ miles}, $...$,
\\dfrac, ...) or a wrong one ("wrong": off by one, scaled by 100 or 1/100, a decimal approximation of pi or 1/3
to 6 places, a changed digit). Each pair carries the verdict we intend, so the run also reports
how often each grader agrees with it.

    python bench/bench_grader.py                       # 10,000 pairs, 2 grading threads, baseline on 2,000
    python bench/bench_grader.py --pairs 2000 --baseline-pairs 500

The baseline is math_verify.verify(parse(gold), parse(pred)) with its defaults, in the main thread (its
signal-based timeouts only work there). The last line printed is one JSON object.
"""

import argparse
import json
import os
import random
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import eval as grader  # noqa: E402
import tasks  # noqa: E402

DATA = str(tasks.data_dir())

# ---- arguments

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--data", default=DATA, help="folder with the offline benchmark files")
parser.add_argument("--pairs", type=int, default=10_000, help="pairs to grade with eval.is_equiv")
parser.add_argument("--baseline-pairs", type=int, default=2_000, help="of those, pairs to grade with math-verify")
parser.add_argument("--threads", type=int, default=2, help="threads calling is_equiv (one grader worker each)")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()


# ---- gold answers from the offline benchmark files

def load_golds(folder: str) -> list[str]:
    golds = []
    for name in ["math500.jsonl", "aime24.jsonl", "aime25_matharena.jsonl", "amc23.jsonl", "hmmt_feb_2025.jsonl"]:
        with open(os.path.join(folder, name)) as f:
            golds += [str(json.loads(line)["answer"]) for line in f if line.strip()]
    with open(os.path.join(folder, "gsm8k_test_openai.jsonl")) as f:
        golds += [json.loads(line)["answer"].split("####")[-1].strip() for line in f if line.strip()]
    with open(os.path.join(folder, "train_math_rllm.json")) as f:
        golds += [str(row["answer"]).strip() for row in json.load(f)]
    return [gold for gold in golds if gold]         # a few MATH rows have an empty answer


# ---- predictions: correct, reformatted, wrong

FRAC = re.compile(r"^(-?)\\d?frac\{(\d+)\}\{(\d+)\}$")


def reformatted(gold: str, rng: random.Random) -> str:
    """An answer equal to gold, written the way models and other answer keys write it."""
    value = grader.plain_number(grader.normalize(gold))
    if value is not None and value.denominator == 1:
        n = int(value)
        return rng.choice([f"0{n}" if n >= 0 else f"{n}.00", f"{n:,}", f"x = {n}", f"{n}.0", f"{n}^\\circ",
                           f"{n} \\text{{ units}}", f"\\frac{{{2 * n}}}{{2}}", f"${n}$", f"{n}\\%",
                           f"{n}\\textnormal{{ miles}}", scientific(n)])
    if value is not None:
        terminating = all(p in (2, 5) for p in small_factors(value.denominator))
        forms = [f"{value.numerator}/{value.denominator}", f"\\dfrac{{{value.numerator}}}{{{value.denominator}}}",
                 f"\\frac{{{2 * value.numerator}}}{{{2 * value.denominator}}}"]
        forms.append(decimal_string(value) if terminating else repr(float(value)))   # the tool's float print
        return rng.choice(forms)
    return rng.choice([f"${gold}$", f" {gold} ", gold.replace("\\frac", "\\dfrac"), f"\\left({gold}\\right)"
                       if not gold.startswith(("(", "[", "\\{", "\\begin")) and "," not in gold else gold + " ."])


def wrong(gold: str, rng: random.Random) -> str:
    """An answer not equal to gold, including the exploits lenient graders accept."""
    value = grader.plain_number(grader.normalize(gold))
    if value is not None and value.denominator == 1:
        n = int(value)
        exploits = [str(n * 100), decimal_string(Fraction(n, 100))] if n else []   # accepted by lenient graders
        return rng.choice([str(n + 1), str(n - 1), str(-n - 1)] + exploits)
    if value is not None:
        return rng.choice([f"\\frac{{{value.numerator + 1}}}{{{value.denominator}}}", f"{float(value):.6f}"
                           if not all(p in (2, 5) for p in small_factors(value.denominator)) else str(value + 1)])
    if "\\pi" in gold:
        return rng.choice(["3.14", "3.14159265", gold.replace("\\pi", "3.14")])
    digits = [i for i, ch in enumerate(gold) if ch.isdigit()]
    if digits:
        i = rng.choice(digits)
        return gold[:i] + str((int(gold[i]) + 1) % 10) + gold[i + 1:]
    return gold + "+1"


def scientific(n: int) -> str:
    """n in scientific notation, 1500 -> 1.5\\times10^{3} (one nonzero digit before the point)."""
    if n == 0:
        return "0"
    digits = str(abs(n)).rstrip("0") or "0"
    mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    return f"{'-' if n < 0 else ''}{mantissa}\\times10^{{{len(str(abs(n))) - 1}}}"


def small_factors(n: int) -> set[int]:
    factors, p = set(), 2
    while p * p <= n:
        while n % p == 0:
            factors.add(p)
            n //= p
        p += 1
    return factors | ({n} if n > 1 else set())


def decimal_string(value: Fraction) -> str:
    text = f"{float(value):.12f}".rstrip("0").rstrip(".")
    return text if Fraction(text) == value else str(float(value))


def make_pairs(golds: list[str], count: int, rng: random.Random) -> list[tuple[str, str, bool, str]]:
    pairs = []
    for _ in range(count):
        gold = rng.choice(golds)
        kind = rng.choices(["correct", "reformatted", "wrong"], weights=[3, 3, 4])[0]
        pred = gold if kind == "correct" else reformatted(gold, rng) if kind == "reformatted" else wrong(gold, rng)
        pairs.append((pred, gold, kind != "wrong", kind))
    return pairs


# ---- timing

def time_ours(pairs):
    grader._equiv_normalized.cache_clear()
    start = time.perf_counter()
    with ThreadPoolExecutor(args.threads) as pool:
        verdicts = list(pool.map(lambda pair: grader.is_equiv(pair[0], pair[1]), pairs, chunksize=16))
    return verdicts, time.perf_counter() - start


def time_math_verify(pairs):
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    start = time.perf_counter()
    verdicts = [verify(parse("\\boxed{" + gold + "}"), parse("\\boxed{" + pred + "}")) for pred, gold, *_ in pairs]
    return verdicts, time.perf_counter() - start


if __name__ == "__main__":
    rng = random.Random(args.seed)
    golds = load_golds(args.data)
    pairs = make_pairs(golds, args.pairs, rng)
    grader.is_equiv("x^2", "x^2+0")                  # start one worker outside the timing, as a trainer would
    ours, seconds = time_ours(pairs)
    baseline_pairs = pairs[: args.baseline_pairs]
    theirs, baseline_seconds = time_math_verify(baseline_pairs)

    fast = sum(grader.plain_number(grader.normalize(p)) is not None and
               grader.plain_number(grader.normalize(g)) is not None for p, g, *_ in pairs)
    agree_ours = sum(v == pair[2] for v, pair in zip(ours, pairs)) / len(pairs)
    agree_theirs = sum(v == pair[2] for v, pair in zip(theirs, baseline_pairs)) / len(baseline_pairs)
    disagreements = [(p, g, want, v) for (p, g, want, _), v in zip(pairs, ours) if v != want]
    for p, g, want, v in disagreements[:15]:
        print(f"ours disagrees with intended: pred={p!r} gold={g!r} intended={want} ours={v}")
    mv_only = [(p, g, want) for (p, g, want, _), a, b in zip(baseline_pairs, ours, theirs) if a != b]
    for p, g, want in mv_only[:15]:
        print(f"ours != math-verify: pred={p!r} gold={g!r} intended={want}")
    grader.shutdown_graders()
    print(json.dumps({
        "pairs": len(pairs), "unique_pairs": len({(p, g) for p, g, *_ in pairs}), "threads": args.threads,
        "seconds": round(seconds, 2), "pairs_per_s": round(len(pairs) / seconds, 1),
        "fast_path_share": round(fast / len(pairs), 3),
        "math_verify_pairs": len(baseline_pairs), "math_verify_seconds": round(baseline_seconds, 2),
        "math_verify_pairs_per_s": round(len(baseline_pairs) / baseline_seconds, 1),
        "agree_with_intended": round(agree_ours, 4), "math_verify_agree_with_intended": round(agree_theirs, 4),
        "ours_vs_math_verify_differ": len(mv_only),
    }))
