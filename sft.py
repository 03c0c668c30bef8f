"""sft.py - the non-reasoning SFT cold start of rStar2-Agent (arXiv 2508.20722, section 4.1).

Before RL the paper fine-tunes the base model on data that teaches *no* math reasoning: only how to call the
tool (165K function-call examples), how to follow instructions and the answer format (30K instruction-following
examples) and how to chat (27K). Reasoning is left for RL to discover. This module builds such data locally
(nothing is downloaded) and trains on it:

    chore generators (strings, lists, dates, units, small tables, counting ...)   -> drafts: question + programs
      -> every program runs in the real SandboxPool -> format_tool_response(result)  (real tool outputs, errors too)
      -> rendered with the RL protocol of scheduler.py into a Trajectory:
           prompt  = render_prompt(tok, question)                                     loss mask 0
           model   = "<reason> .. </reason>\\n<tool_call>\\n{json}\\n</tool_call>"     loss mask 1
           tool    = encode_tool_response(tok, tool text) (the text never parsed as ChatML)  loss mask 0
           ... (one or two calls) ...
           model   = "<reason> .. </reason>\\n<answer> .. \\boxed{X} </answer><|im_end|>"   loss mask 1
    + direct-answer / instruction-following examples (no tool: "<reason>..</reason> <answer>\\boxed{..}</answer>")
    + optionally a JSONL file of chat examples ({"messages": [...]}) for GPU runs on real function-calling sets
      -> length-bucketed batches -> cross-entropy on loss-mask-1 tokens only -> AdamW, warm-up + cosine
      -> early stop on a held-out SFT loss -> save_pretrained (atomically) for `--stage 1`

Why the data is varied (DESIGN.md, "Machines"): a probe SFT on one fixed template trained to a loss of 0.001 left
the model nearly deterministic, so GRPO groups were all-right or all-wrong and RL stalled. Here the reasoning
sentences, question phrasings, code styles (print(expr), variables, loops, functions, stdin) and the number of
calls (one, a check with a second method, an error then a fix) are all drawn at random, and training stops
early, so the model learns the format but keeps a spread of behaviours for RL to choose from.
Most programs end in `result = expr` + `print(result)`: a 135M model miscounts closing parentheses in deeply
nested one-liners, and its most common error after SFT was "unmatched ')'" (README, "valid tool call").

Speed: every generated example starts with the same ~450-token system prompt. `batch_loss` runs that shared
prefix once per micro-batch (batch size 1, with gradient) and lets each example attend to its cached keys/values;
the loss and the gradients are exactly those of the plain padded batch (tests/test_sft.py checks this), at a
fraction of the cost on a CPU. The matmuls run under bf16 autocast over fp32 master weights where the
hardware has bf16 units (a GPU; a CPU with AVX512-BF16 or AMX: a step 1.7x faster, README). Memory: a batch of
8 runs in micro-batches of at most `micro_batch_tokens` padded response tokens whose gradients add up to the
batch's (activations and the 49K-wide logits grow with the micro-batch: whole batches in fp32 peaked at
14.6 GB). Under torchrun the ranks share each batch (distributed.py).

    python sft.py --out runs/sft-probe          # the CPU preset on the bundled SmolLM2-135M-Instruct
"""
from __future__ import annotations

import argparse
import ast
import asyncio
import json
import math
import os
import random
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import date, timedelta
from pathlib import Path

from distributed import (DIST, all_ranks_sum, clip_gradients, from_rank0, full_state, my_micro_batches,
                         rank_shares, shard_policy)
from scheduler import (IM_END, IM_START, TOOL_NAME, Segment, Trajectory, encode, encode_tool_response,
                       render_prompt, tool_response_text)

# ----------------------------------------------------------------------------------------------------------
# Configuration: every hyperparameter, with the paper's value where the paper gives one


@dataclass
class SFTConfig:
    n_examples: int = 240            # generated examples (paper: 165K function-call + 30K instruction + 27K chat)
    direct_share: float = 0.05       # share answered without the tool (instruction following / answer format);
                                     # 0.1 gave more answers without a call on the math problems (README)
    verify_share: float = 0.15       # tool examples that run a second, different program to check the first
    fix_share: float = 0.1           # tool examples whose first program fails (real traceback), then is fixed
    name_share: float = 0.7          # programs whose last line prints a nested expression are rewritten to
                                     # `result = expr` + `print(result)` (a 135M model miscounts closing
                                     # parentheses: "unmatched ')'" was its most common error, README)
    data_jsonl: str | None = None    # extra chat examples {"messages": [...]} (real function-calling sets on GPU)
    epochs: int = 1                  # paper: 3 (over 222K examples); one pass over a small varied set here
    lr: float = 2e-4                 # paper: 5e-6 for a 14B model; a 135M model needs a larger step
                                     # (bench/measure_sft.py at T=1: 5e-5 gave 6% valid tool calls, 2e-4 26%)
    min_lr_ratio: float = 0.1        # cosine decay to lr * min_lr_ratio (paper: not stated)
    warmup_steps: int = 3            # linear warm-up, optimizer steps
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0           # global gradient-norm clip
    batch_size: int = 8              # examples per optimizer step (paper: not stated)
    micro_batch_tokens: int = 2304   # rows x longest response per forward/backward (padded); gradients
                                     # accumulate up to batch_size. Peak memory follows it (README: 8 whole
                                     # batches of 8 peaked at 14.6 GB)
    max_steps: int | None = None     # cap on optimizer steps (None: epochs decide)
    max_tokens: int = 1024           # longer examples are dropped (paper: not stated for SFT)
    heldout_examples: int = 16       # generated with another seed; early stopping watches their loss
    eval_every: int = 8              # optimizer steps between held-out evaluations
    patience: int = 2                # stop after this many evaluations without improvement ...
    min_delta: float = 0.01          # ... of at least this much (relative), so the data is never memorised
    share_prefix: bool = True        # run the common system prompt once per batch (exact, much faster)
    bf16: bool | None = None         # bf16 autocast over fp32 master weights; None: on a GPU and on CPUs with
                                     # bf16 matrix units (AVX512-BF16 / AMX: 1.7-1.9x faster steps, README)
    seed: int = 0


# ----------------------------------------------------------------------------------------------------------
# Chores: general programming tasks where a tool helps. Deliberately *not* the families of tasks.py (products,
# modular powers, primes, divisors, gcd, binomials, Fibonacci, digit sums, bases): SFT teaches the format, RL
# must discover how to use it on math. Each chore gives a question, the expected stdout, and several programs in
# different styles. "DATA" in a program stands for the literal data; a program that starts with
# `name = DATA` also gets a twin that reads the data from stdin (the tool's `input` argument).

WORDS = ("apple banana cherry dragon eagle forest garden harbor island jungle kettle lemon mountain needle orange "
         "pencil quartz river silver tiger umbrella violet window yellow zebra anchor bridge candle desert ember "
         "falcon glacier hammer igloo jacket kernel lantern marble nickel oyster pepper rocket saddle tunnel velvet "
         "walnut basket copper meadow planet rabbit spider tomato wizard").split()
NAMES = "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Oscar Peggy Rupert Sybil Trent Victor Wendy".split()


@dataclass
class Chore:
    what: str                 # a verb phrase for the reasoning sentence: "reverse the string"
    question: str
    answer: str               # what the programs print (stripped)
    programs: list[str]       # code variants; DATA is replaced by repr(data)
    data: object = None
    read: str | None = None   # how a stdin twin reads DATA, e.g. "input().split()"; None: no stdin twin
    stdin: str = ""           # the stdin text for the twin


def phrase(rng: random.Random, lo: int = 2, hi: int = 4) -> str:
    return " ".join(rng.sample(WORDS, rng.randint(lo, hi)))


def pick(rng: random.Random, *templates: str, **values) -> str:
    return rng.choice(templates).format(**values)


def reverse_string(rng):
    s = phrase(rng)
    return Chore("reverse the string", pick(rng, "Reverse the string '{s}'.", "What is \"{s}\" spelled backwards?",
                                             "Write the characters of '{s}' in reverse order.", s=s),
                 s[::-1], ["print(DATA[::-1])", "s = DATA\nprint(s[::-1])",
                           "s = DATA\nout = ''\nfor ch in s:\n    out = ch + out\nprint(out)",
                           "print(''.join(reversed(DATA)))"], s, "input()", s)


def count_vowels(rng):
    s = phrase(rng, 2, 5)
    n = sum(ch in "aeiou" for ch in s)
    return Chore("count the vowels", pick(rng, "How many vowels (a, e, i, o, u) are in '{s}'?",
                                          "Count the vowels in the text \"{s}\".", s=s), str(n),
                 ["print(sum(ch in 'aeiou' for ch in DATA))",
                  "text = DATA\ncount = 0\nfor ch in text:\n    if ch in 'aeiou':\n        count += 1\nprint(count)",
                  "text = DATA\nprint(len([c for c in text if c in 'aeiou']))"], s, "input()", s)


def count_letter(rng):
    s = phrase(rng, 3, 5)
    letter = rng.choice(sorted(set(s.replace(" ", ""))))
    return Chore(f"count the letter {letter}", pick(rng, "How many times does the letter '{c}' appear in '{s}'?",
                                                    "Count the occurrences of '{c}' in \"{s}\".", c=letter, s=s),
                 str(s.count(letter)), [f"print(DATA.count({letter!r}))",
                                        f"s = DATA\nprint(s.count({letter!r}))",
                                        f"s = DATA\nn = 0\nfor ch in s:\n    if ch == {letter!r}:\n        n += 1\nprint(n)"],
                 s, "input()", s)


def sort_words(rng):
    words = rng.sample(WORDS, rng.randint(4, 7))
    desc = rng.random() < 0.3
    order = "reverse alphabetical" if desc else "alphabetical"
    answer = ", ".join(sorted(words, reverse=desc))
    key = ", reverse=True" if desc else ""
    return Chore(f"sort the words in {order} order",
                 pick(rng, "Sort these words in {o} order: {w}. Give them separated by commas.",
                      "Put the words {w} in {o} order (comma-separated).", o=order, w=", ".join(words)), answer,
                 [f"print(', '.join(sorted(DATA{key})))", f"words = DATA\nwords.sort({key[2:]})\nprint(', '.join(words))",
                  f"words = DATA\nresult = sorted(words{key})\nprint(', '.join(result))"],
                 words, "input().split()", " ".join(words))


def sort_numbers(rng):
    nums = [rng.randint(-50, 200) for _ in range(rng.randint(5, 9))]
    desc = rng.random() < 0.4
    answer = ", ".join(map(str, sorted(nums, reverse=desc)))
    key = ", reverse=True" if desc else ""
    how = "from largest to smallest" if desc else "from smallest to largest"
    return Chore(f"sort the numbers {how}", pick(rng, "Sort {n} {h}. List them separated by commas.",
                                                 "Order the numbers {n} {h} (comma-separated list).",
                                                 n=", ".join(map(str, nums)), h=how), answer,
                 [f"print(', '.join(str(x) for x in sorted(DATA{key})))",
                  f"nums = DATA\nnums.sort({key[2:]})\nprint(', '.join(map(str, nums)))"],
                 nums, "[int(x) for x in input().split()]", " ".join(map(str, nums)))


def longest_word(rng):
    words = rng.sample(WORDS, rng.randint(4, 7))
    best = max(words, key=len)
    return Chore("find the longest word", pick(rng, "Which is the longest word in: {w}? If there is a tie, give the "
                                               "first one.", "Find the longest of these words (first one on a tie): "
                                               "{w}.", w=", ".join(words)), best,
                 ["print(max(DATA, key=len))",
                  "words = DATA\nbest = words[0]\nfor w in words:\n    if len(w) > len(best):\n        best = w\nprint(best)"],
                 words, "input().split()", " ".join(words))


def word_count(rng):
    s = phrase(rng, 4, 9)
    return Chore("count the words", pick(rng, "How many words are in the sentence \"{s}\"?",
                                         "Count the words in '{s}'.", s=s), str(len(s.split())),
                 ["print(len(DATA.split()))", "sentence = DATA\nwords = sentence.split()\nprint(len(words))"],
                 s, "input()", s)


def dedupe(rng):
    base = rng.sample(WORDS, rng.randint(3, 5))
    items = base + [rng.choice(base) for _ in range(rng.randint(2, 4))]
    rng.shuffle(items)
    answer = ", ".join(dict.fromkeys(items))
    return Chore("remove the duplicates in order", pick(rng, "Remove duplicates from [{l}], keeping the first "
                                                        "occurrence of each. Give the result comma-separated.",
                                                        "Deduplicate the list {l} while keeping the original order.",
                                                        l=", ".join(items)), answer,
                 ["print(', '.join(dict.fromkeys(DATA)))",
                  "items = DATA\nseen = []\nfor x in items:\n    if x not in seen:\n        seen.append(x)\nprint(', '.join(seen))"],
                 items, "input().split()", " ".join(items))


def palindrome(rng):
    w = rng.choice(["level", "radar", "rotor", "civic", "kayak", "refer", "madam", "stats"] + WORDS)
    return Chore("check whether the word is a palindrome",
                 pick(rng, "Is '{w}' a palindrome? Answer True or False.",
                      "Does '{w}' read the same backwards? Reply with True or False.", w=w), str(w == w[::-1]),
                 ["print(DATA == DATA[::-1])", "w = DATA\nprint(w == w[::-1])",
                  "def is_palindrome(s):\n    return s == s[::-1]\n\nprint(is_palindrome(DATA))"], w, "input()", w)


def random_date(rng) -> date:
    return date(2000, 1, 1) + timedelta(days=rng.randint(0, 365 * 30))


def days_between(rng):
    a, b = sorted([random_date(rng), random_date(rng)])
    return Chore("count the days between the dates", pick(rng, "How many days are there from {a} to {b}?",
                                                          "Compute the number of days between {a} and {b}.",
                                                          a=a.isoformat(), b=b.isoformat()), str((b - a).days),
                 [f"from datetime import date\nprint((date({b.year}, {b.month}, {b.day}) - date({a.year}, {a.month}, {a.day})).days)",
                  f"import datetime\nstart = datetime.date.fromisoformat('{a}')\nend = datetime.date.fromisoformat('{b}')\nprint((end - start).days)",
                  f"from datetime import datetime\nd1 = datetime.strptime('{a}', '%Y-%m-%d')\nd2 = datetime.strptime('{b}', '%Y-%m-%d')\ndelta = d2 - d1\nprint(delta.days)"])


def weekday(rng):
    d = random_date(rng)
    return Chore("find the day of the week", pick(rng, "What day of the week was {d}?",
                                                  "On which weekday does {d} fall? Give the English name.",
                                                  d=d.strftime("%B %d, %Y")), d.strftime("%A"),
                 [f"import datetime\nprint(datetime.date({d.year}, {d.month}, {d.day}).strftime('%A'))",
                  f"import calendar\nprint(calendar.day_name[calendar.weekday({d.year}, {d.month}, {d.day})])"])


def add_days(rng):
    d, k = random_date(rng), rng.randint(10, 1000)
    return Chore("add the days to the date", pick(rng, "What date is {k} days after {d}? Answer in YYYY-MM-DD form.",
                                                  "Add {k} days to {d} and give the date as YYYY-MM-DD.",
                                                  k=k, d=d.isoformat()), (d + timedelta(days=k)).isoformat(),
                 [f"from datetime import date, timedelta\nprint(date.fromisoformat('{d}') + timedelta(days={k}))",
                  f"import datetime\nstart = datetime.date({d.year}, {d.month}, {d.day})\nresult = start + datetime.timedelta(days={k})\nprint(result.isoformat())"])


UNITS = [  # (from, to, factor, question noun)
    ("kilometers", "miles", 0.621371), ("miles", "kilometers", 1.609344), ("kilograms", "pounds", 2.20462),
    ("pounds", "kilograms", 0.453592), ("inches", "centimeters", 2.54), ("feet", "meters", 0.3048),
    ("liters", "gallons", 0.264172), ("ounces", "grams", 28.3495)]


def convert_units(rng):
    a, b, f = rng.choice(UNITS)
    x = rng.choice([rng.randint(2, 500), round(rng.uniform(1, 100), 1)])
    return Chore(f"convert {a} to {b}", pick(rng, "Convert {x} {a} to {b}, rounded to 2 decimal places.",
                                             "How many {b} is {x} {a}? Round to two decimals.", x=x, a=a, b=b),
                 str(round(x * f, 2)), [f"print(round({x} * {f}, 2))", f"value = {x}\nfactor = {f}\nprint(round(value * factor, 2))",
                                        f"def convert(v):\n    return v * {f}\n\nprint(round(convert({x}), 2))"])


def temperature(rng):
    c = rng.randint(-40, 120)
    if rng.random() < 0.5:
        return Chore("convert Celsius to Fahrenheit", pick(rng, "Convert {c} degrees Celsius to Fahrenheit "
                                                           "(rounded to 1 decimal).", "What is {c} C in F? Round "
                                                           "to one decimal place.", c=c), str(round(c * 9 / 5 + 32, 1)),
                     [f"print(round({c} * 9 / 5 + 32, 1))", f"celsius = {c}\nfahrenheit = celsius * 9 / 5 + 32\nprint(round(fahrenheit, 1))"])
    return Chore("convert Fahrenheit to Celsius", pick(rng, "Convert {c} degrees Fahrenheit to Celsius, rounded to 1 "
                                                       "decimal.", "What is {c} F in Celsius (one decimal)?", c=c),
                 str(round((c - 32) * 5 / 9, 1)),
                 [f"print(round(({c} - 32) * 5 / 9, 1))", f"f = {c}\nc = (f - 32) * 5 / 9\nprint(round(c, 1))"])


def seconds_to_clock(rng):
    s = rng.randint(100, 86000)
    h, m, sec = s // 3600, s % 3600 // 60, s % 60
    return Chore("turn the seconds into hours, minutes and seconds",
                 pick(rng, "Write {s} seconds as H:MM:SS.", "Convert {s} seconds to the format H:MM:SS.", s=s),
                 f"{h}:{m:02d}:{sec:02d}",
                 [f"s = {s}\nprint(f'{{s // 3600}}:{{s % 3600 // 60:02d}}:{{s % 60:02d}}')",
                  f"h, rest = divmod({s}, 3600)\nm, sec = divmod(rest, 60)\nprint(f'{{h}}:{{m:02d}}:{{sec:02d}}')",
                  f"import datetime\nprint(datetime.timedelta(seconds={s}))"])


def table_rows(rng, k: int) -> list[tuple[str, int]]:
    return [(name, rng.randint(10, 99)) for name in rng.sample(NAMES, k)]


def table_top(rng):
    rows = table_rows(rng, rng.randint(4, 6))
    text = "name,score\n" + "\n".join(f"{n},{s}" for n, s in rows)
    best = max(rows, key=lambda r: r[1])
    return Chore("parse the table and find the top scorer",
                 pick(rng, "Here is a CSV table:\n{t}\nWho has the highest score? (first one on a tie)",
                      "Given the table below, which name has the largest score?\n{t}", t=text), best[0],
                 ["import csv, io\nrows = list(csv.DictReader(io.StringIO(DATA)))\nbest = max(rows, key=lambda r: int(r['score']))\nprint(best['name'])",
                  "table = DATA\nlines = table.strip().split('\\n')[1:]\nbest_name, best_score = None, -1\nfor line in lines:\n    name, score = line.split(',')\n    if int(score) > best_score:\n        best_name, best_score = name, int(score)\nprint(best_name)"],
                 text, "sys.stdin.read()", text)


def table_total(rng):
    rows = table_rows(rng, rng.randint(3, 6))
    text = "name,score\n" + "\n".join(f"{n},{s}" for n, s in rows)
    avg = rng.random() < 0.4
    answer = str(round(sum(s for _, s in rows) / len(rows), 2)) if avg else str(sum(s for _, s in rows))
    what = "average" if avg else "total"
    last = "print(round(sum(scores) / len(scores), 2))" if avg else "print(sum(scores))"
    return Chore("add up the score column" if not avg else "average the score column",
                 pick(rng, "What is the {w} of the score column in this CSV?\n{t}" + (" Round to 2 decimals." if avg else ""),
                      "Compute the {w} score from the table" + (" (2 decimals)" if avg else "") + ":\n{t}", w=what, t=text),
                 answer, ["table = DATA\nscores = [int(line.split(',')[1]) for line in table.splitlines()[1:]]\n" + last,
                          "import csv, io\nscores = [int(r['score']) for r in csv.DictReader(io.StringIO(DATA))]\n" + last],
                 text, "sys.stdin.read()", text)


def most_common_letter(rng):
    s = phrase(rng, 3, 6)
    from collections import Counter
    counts = Counter(s.replace(" ", ""))
    best = max(sorted(counts), key=lambda ch: counts[ch])
    return Chore("find the most frequent letter",
                 pick(rng, "Which letter occurs most often in '{s}'? On a tie give the alphabetically first.",
                      "Find the most common letter in \"{s}\" (ties: the earliest in the alphabet).", s=s), best,
                 ["from collections import Counter\ncounts = Counter(DATA.replace(' ', ''))\nprint(max(sorted(counts), key=lambda ch: counts[ch]))",
                  "s = DATA\ncounts = {}\nfor ch in s:\n    if ch != ' ':\n        counts[ch] = counts.get(ch, 0) + 1\nbest = min(counts, key=lambda ch: (-counts[ch], ch))\nprint(best)"],
                 s, "input()", s)


def acronym(rng):
    s = phrase(rng, 3, 5)
    return Chore("build the acronym", pick(rng, "Make an uppercase acronym from the first letters of '{s}'.",
                                           "What acronym do the initials of \"{s}\" form (in capitals)?", s=s),
                 "".join(w[0] for w in s.split()).upper(),
                 ["print(''.join(w[0] for w in DATA.split()).upper())",
                  "words = DATA.split()\nletters = [w[0].upper() for w in words]\nprint(''.join(letters))"], s, "input()", s)


def case_change(rng):
    s = phrase(rng, 2, 4)
    style, fn = rng.choice([("uppercase", "upper"), ("title case", "title"), ("snake_case", None), ("camelCase", None)])
    if style == "snake_case":
        answer, programs = s.replace(" ", "_"), ["print(DATA.replace(' ', '_'))", "print('_'.join(DATA.split()))"]
    elif style == "camelCase":
        w = s.split()
        answer = w[0] + "".join(x.capitalize() for x in w[1:])
        programs = ["words = DATA.split()\nprint(words[0] + ''.join(w.capitalize() for w in words[1:]))"]
    else:
        answer, programs = getattr(s, fn)(), [f"print(DATA.{fn}())", f"text = DATA\nprint(text.{fn}())"]
    return Chore(f"convert the text to {style}", pick(rng, "Convert '{s}' to {st}.", "Write \"{s}\" in {st}.",
                                                      s=s, st=style), answer, programs, s, "input()", s)


def caesar(rng):
    w, k = rng.choice(WORDS), rng.randint(1, 25)
    answer = "".join(chr((ord(c) - 97 + k) % 26 + 97) for c in w)
    return Chore(f"shift each letter by {k}", pick(rng, "Apply a Caesar shift of {k} to the lowercase word '{w}'.",
                                                   "Encrypt '{w}' with a Caesar cipher, shift {k}.", k=k, w=w), answer,
                 [f"print(''.join(chr((ord(c) - 97 + {k}) % 26 + 97) for c in DATA))",
                  f"word = DATA\nout = ''\nfor c in word:\n    out += chr((ord(c) - ord('a') + {k}) % 26 + ord('a'))\nprint(out)"],
                 w, "input()", w)


def list_stat(rng):
    nums = [rng.randint(1, 300) for _ in range(rng.randint(5, 10))]
    kind = rng.choice(["max", "min", "median", "sum", "evens"])
    s = sorted(nums)
    if kind == "median":
        answer = str(s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2)
        q, programs = "What is the median of {n}?", ["import statistics\nprint(statistics.median(DATA))"]
    elif kind == "evens":
        answer = str(sum(x % 2 == 0 for x in nums))
        q = "How many even numbers are in the list {n}?"
        programs = ["print(sum(1 for x in DATA if x % 2 == 0))",
                    "nums = DATA\nevens = [x for x in nums if x % 2 == 0]\nprint(len(evens))"]
    else:
        answer = str({"max": max, "min": min, "sum": sum}[kind](nums))
        q = {"max": "What is the largest number in {n}?", "min": "Find the smallest value in {n}.",
             "sum": "Add up the numbers {n}."}[kind]
        programs = [f"print({kind}(DATA))", f"nums = DATA\nresult = {kind}(nums)\nprint(result)"]
    return Chore({"max": "find the maximum", "min": "find the minimum", "median": "find the median",
                  "sum": "add up the list", "evens": "count the even numbers"}[kind], q.format(n=nums), answer,
                 programs, nums, "[int(x) for x in input().split()]", " ".join(map(str, nums)))


def count_matching(rng):
    """A loop with a condition over a list of records: how many pass, or the total of those that pass."""
    scores = [rng.randint(0, 100) for _ in range(rng.randint(6, 12))]
    cut = rng.choice([40, 50, 60, 70, 75, 80, 90])
    if rng.random() < 0.5:
        return Chore("count the scores that pass", pick(rng, "The test scores are {s}. How many students scored at "
                                                        "least {c}?", "Count the scores of at least {c} in {s}.",
                                                        s=scores, c=cut),
                     str(sum(x >= cut for x in scores)),
                     [f"scores = DATA\ncount = 0\nfor x in scores:\n    if x >= {cut}:\n        count += 1\nprint(count)",
                      f"scores = DATA\npassed = [x for x in scores if x >= {cut}]\nprint(len(passed))",
                      f"print(sum(1 for x in DATA if x >= {cut}))"],
                     scores, "[int(x) for x in input().split()]", " ".join(map(str, scores)))
    return Chore("add up the scores below the cut", pick(rng, "The scores are {s}. What is the sum of the scores "
                                                         "below {c}?", "Add up the values under {c} in {s}.",
                                                         s=scores, c=cut),
                 str(sum(x for x in scores if x < cut)),
                 [f"scores = DATA\ntotal = 0\nfor x in scores:\n    if x < {cut}:\n        total += x\nprint(total)",
                  f"scores = DATA\nlow = [x for x in scores if x < {cut}]\nprint(sum(low))"],
                 scores, "[int(x) for x in input().split()]", " ".join(map(str, scores)))


def savings(rng):
    """A quantity that changes by a fixed step every week: a loop that accumulates."""
    first, step, weeks = rng.randint(1, 40), rng.randint(1, 15), rng.randint(6, 52)
    total = sum(first + step * w for w in range(weeks))
    return Chore("add up the weekly savings", pick(rng, "I save {a} dollars in the first week and {d} dollars more "
                                                   "each week than the week before. How much have I saved after "
                                                   "{n} weeks?", "A jar gets {a} coins in week 1, and every week "
                                                   "{d} more coins than the previous week. How many coins are in "
                                                   "the jar after {n} weeks?", a=first, d=step, n=weeks),
                 str(total),
                 [f"total = 0\namount = {first}\nfor week in range({weeks}):\n    total += amount\n    amount += {step}\nprint(total)",
                  f"weeks = {weeks}\ntotal = 0\nfor w in range(weeks):\n    total += {first} + {step} * w\nprint(total)",
                  f"deposits = [{first} + {step} * w for w in range({weeks})]\nprint(sum(deposits))"])


def extract_digits(rng):
    s = "".join(rng.choice("abcxyz-#") if rng.random() < 0.6 else str(rng.randint(0, 9)) for _ in range(rng.randint(8, 14)))
    if not any(ch.isdigit() for ch in s):
        s += str(rng.randint(0, 9))
    return Chore("keep only the digits", pick(rng, "Keep only the digits of '{s}', in order.",
                                              "Extract the digits from the string \"{s}\".", s=s),
                 "".join(ch for ch in s if ch.isdigit()),
                 ["print(''.join(ch for ch in DATA if ch.isdigit()))",
                  "import re\nprint(''.join(re.findall(r'\\d', DATA)))",
                  "s = DATA\ndigits = ''\nfor ch in s:\n    if ch.isdigit():\n        digits += ch\nprint(digits)"], s, "input()", s)


def replace_word(rng):
    words = rng.sample(WORDS, rng.randint(3, 6))
    old, new = rng.choice(words), rng.choice([w for w in WORDS if w not in words])
    s = " ".join(words)
    return Chore("replace the word", pick(rng, "In '{s}', replace '{o}' with '{n}'.",
                                          "Substitute \"{n}\" for \"{o}\" in the text \"{s}\".", s=s, o=old, n=new),
                 s.replace(old, new), [f"print(DATA.replace({old!r}, {new!r}))",
                                       f"text = DATA\ntext = text.replace({old!r}, {new!r})\nprint(text)"],
                 s, "input()", s)


def evaluate_expression(rng):
    """Written notation -> Python syntax (× for *, ^ for **, ÷ for /): formatting, not reasoning."""
    a, b, c = rng.randint(2, 99), rng.randint(2, 60), round(rng.uniform(1, 20), 1)
    e = rng.randint(2, 4)
    shown, code = rng.choice([(f"{a} × {b} − {c}", f"{a} * {b} - {c}"), (f"{a}^{e} + {b}", f"{a}**{e} + {b}"),
                              (f"({a} + {b}) ÷ {c}", f"({a} + {b}) / {c}"), (f"{c} × ({a} − {b})", f"{c} * ({a} - {b})")])
    value = eval(code)  # noqa: S307 - our own arithmetic, no input involved
    rounded = isinstance(value, float)
    answer = str(round(value, 2)) if rounded else str(value)
    expr = f"round({code}, 2)" if rounded else code
    return Chore("evaluate the expression", pick(rng, "Evaluate {x}" + (", rounded to 2 decimals." if rounded else "."),
                                                 "What is the value of {x}" + (" (2 decimals)?" if rounded else "?"), x=shown),
                 answer, [f"print({expr})", f"result = {code}\nprint({'round(result, 2)' if rounded else 'result'})"])


def percent(rng):
    p, x = rng.choice([5, 10, 12.5, 15, 20, 25, 30, 40, 75]), rng.randint(20, 2000)
    if rng.random() < 0.5:
        return Chore("take the percentage", pick(rng, "What is {p}% of {x}?", "Compute {p} percent of {x}.", p=p, x=x),
                     str(round(p / 100 * x, 2)), [f"print(round({p} / 100 * {x}, 2))",
                                                  f"share = {p} / 100\ntotal = {x}\nprint(round(share * total, 2))"])
    y = rng.randint(20, 2000)
    return Chore("compute the percentage change", pick(rng, "A price goes from {x} to {y}. What is the percentage "
                                                       "change, rounded to 1 decimal?", "By what percent does {x} "
                                                       "change to become {y}? Round to one decimal.", x=x, y=y),
                 str(round((y - x) / x * 100, 1)), [f"print(round(({y} - {x}) / {x} * 100, 1))",
                                                    f"old, new = {x}, {y}\nchange = (new - old) / old * 100\nprint(round(change, 1))"])


def packing(rng):
    """Everyday integer arithmetic: full boxes (//) and what is left over (%)."""
    n, k = rng.randint(100, 9999), rng.randint(3, 48)
    thing, box = rng.choice([("eggs", "cartons"), ("books", "shelves"), ("apples", "crates"), ("cards", "decks"),
                             ("bottles", "cases"), ("chairs", "rows")])
    if rng.random() < 0.5:
        return Chore("count the full groups", pick(rng, "{n} {thing} are packed {k} per {one}. How many {box} are "
                                                   "completely filled?", "How many full {box} of {k} can be made "
                                                   "from {n} {thing}?", n=n, k=k, thing=thing, box=box,
                                                   one=box[:-1]),
                     str(n // k), [f"print({n} // {k})", f"total = {n}\nper_box = {k}\nprint(total // per_box)",
                                   f"full, left = divmod({n}, {k})\nprint(full)"])
    return Chore("find what is left over", pick(rng, "{n} {thing} are packed {k} per {one}. How many {thing} are "
                                                "left over?", "What remains when {n} {thing} are split into groups "
                                                "of {k}?", n=n, k=k, thing=thing, one=box[:-1]),
                 str(n % k), [f"print({n} % {k})", f"total = {n}\nper_box = {k}\nprint(total % per_box)",
                              f"full, left = divmod({n}, {k})\nprint(left)"])


def shopping(rng):
    """A word problem turned into one expression: price times quantity plus a fee, or a change."""
    q, price, fee = rng.randint(3, 97), rng.randint(4, 250), rng.randint(5, 60)
    item = rng.choice(["notebooks", "tickets", "lamps", "shirts", "tiles", "cables", "plants"])
    if rng.random() < 0.5:
        return Chore("add up the cost", pick(rng, "{q} {item} cost {price} dollars each and shipping is {fee} "
                                             "dollars. What is the total in dollars?", "What do {q} {item} at "
                                             "{price} dollars apiece cost, plus a {fee} dollar fee?", q=q, item=item,
                                             price=price, fee=fee),
                     str(q * price + fee), [f"print({q} * {price} + {fee})",
                                            f"quantity = {q}\nprice = {price}\nfee = {fee}\nprint(quantity * price + fee)"])
    paid = (q * price // 100 + 1) * 100
    return Chore("compute the change", pick(rng, "I buy {q} {item} at {price} dollars each and pay with {paid} "
                                            "dollars. How much change do I get?", "Paying {paid} dollars for {q} "
                                            "{item} costing {price} each, what is the change?", q=q, item=item,
                                            price=price, paid=paid),
                 str(paid - q * price), [f"print({paid} - {q} * {price})",
                                         f"cost = {q} * {price}\nprint({paid} - cost)"])


def growth(rng):
    """Repeated doubling or tripling: a power written as a program."""
    start, years, factor = rng.randint(2, 90), rng.randint(5, 30), rng.choice([2, 3])
    word = {2: "doubles", 3: "triples"}[factor]
    return Chore("repeat the growth", pick(rng, "A colony of {start} cells {word} every hour. How many cells are "
                                           "there after {years} hours?", "Starting from {start}, a number {word} "
                                           "{years} times. What is the result?", start=start, word=word, years=years),
                 str(start * factor ** years),
                 [f"print({start} * {factor} ** {years})",
                  f"cells = {start}\nfor hour in range({years}):\n    cells *= {factor}\nprint(cells)",
                  f"print({start} * pow({factor}, {years}))"])


def square_side(rng):
    """An exact integer square root, math.isqrt."""
    side = rng.randint(12, 3000)
    return Chore("take the square root", pick(rng, "A square floor has an area of {a} square meters. How long is "
                                              "one side in meters?", "What is the side length of a square of area "
                                              "{a}?", a=side * side),
                 str(side), [f"import math\nprint(math.isqrt({side * side}))", f"print(int({side * side} ** 0.5))",
                             f"import math\narea = {side * side}\nprint(math.isqrt(area))"])


def named_value(rng):
    """A question that names its quantity ("Let T = ..."): the program must define that name before using it.
    (The SFT model's most common invalid call was on "Let N = a^e. What is N mod m?": `print(N % m)` with N never
    defined. With this chore, such NameErrors fell from 38 to 9 of 512 held-out trajectories: README.) Sums and
    products only, no powers or remainders: it teaches how a named quantity becomes code, not the math of the RL
    families."""
    name = rng.choice(["N", "n", "T", "S", "x", "k", "M", "total"])
    a, b, c = rng.randint(12, 999), rng.randint(3, 99), rng.randint(1, 500)
    expr, value = rng.choice([(f"{a} * {b} + {c}", a * b + c), (f"{a} + {b} * {c}", a + b * c),
                              (f"{a} * {b} - {c}", a * b - c), (f"{a} * {b}", a * b)])
    k = rng.randint(3, 40)
    ask, code, answer = rng.choice([
        (f"What is {name} divided by {k}, rounded down?", f"{name} // {k}", value // k),
        (f"What is {name} minus {c + k}?", f"{name} - {c + k}", value - c - k),
        (f"What is twice {name}?", f"2 * {name}", 2 * value),
        (f"How many digits does {name} have?", f"len(str({name}))", len(str(value))),
        (f"What is {name} + {k}?", f"{name} + {k}", value + k)])
    return Chore("evaluate the named quantity", pick(rng, "Let {v} = {e}. {q}", "Define {v} = {e}. {q}",
                                                     "Let {v} be {e}. {q}", v=name, e=expr, q=ask),
                 str(answer), [f"{name} = {expr}\nprint({code})", f"{name} = {expr}\nresult = {code}\nprint(result)"])


CHORES = [packing, shopping, growth, square_side, count_matching, savings, reverse_string, count_vowels,
          count_letter, sort_words, sort_numbers, longest_word, word_count, dedupe, palindrome,
          days_between, weekday, add_days, convert_units, temperature, seconds_to_clock, table_top, table_total,
          most_common_letter, acronym, case_change, caesar, list_stat, extract_digits, replace_word,
          evaluate_expression, percent,
          named_value, named_value]  # twice as likely: the failure it addresses was the most common one


def chore_programs(chore: Chore) -> list[tuple[str, str]]:
    """(code, stdin) variants: each program with DATA as a literal, plus stdin twins where the program allows."""
    out = []
    for program in chore.programs:
        out.append((program.replace("DATA", repr(chore.data)), ""))
        first, _, rest = program.partition("\n")
        if chore.read and first.endswith(" = DATA") and "DATA" not in rest:
            name = first[: -len(" = DATA")]
            head = "import sys\n" if chore.read.startswith("sys.") else ""
            out.append((f"{head}{name} = {chore.read}\n{rest}", chore.stdin))
    return out


# ----------------------------------------------------------------------------------------------------------
# Direct answers: instruction following and the answer format, no tool and no computation

FACTS = [  # (question, answer, why)
    ("What is the capital of France?", "Paris", "Paris is the capital of France"),
    ("What is the capital of Japan?", "Tokyo", "Tokyo is the capital of Japan"),
    ("What is the capital of Italy?", "Rome", "Rome is the capital of Italy"),
    ("What color do you get by mixing blue and yellow?", "green", "blue and yellow make green"),
    ("What is the chemical symbol for gold?", "Au", "gold is Au, from the Latin aurum"),
    ("What is the chemical symbol for water?", "H2O", "water is H2O"),
    ("Which planet is known as the Red Planet?", "Mars", "Mars is called the Red Planet"),
    ("What is the largest ocean on Earth?", "Pacific", "the Pacific is the largest ocean"),
    ("How many days are in a week?", "7", "a week has seven days"),
    ("Which language is this project's tool written for: Python or Java?", "Python", "the tool runs Python code"),
    ("What do bees make?", "honey", "bees make honey"),
    ("What is the opposite of 'hot'?", "cold", "the opposite of hot is cold"),
    ("What is the opposite of 'early'?", "late", "the opposite of early is late"),
    ("What is the plural of 'mouse'?", "mice", "the plural of mouse is mice"),
    ("What is the plural of 'child'?", "children", "the plural of child is children"),
    ("What is the past tense of 'go'?", "went", "the past tense of go is went"),
    ("Which animal says 'moo'?", "cow", "a cow says moo"),
    ("Which month comes after March?", "April", "April follows March"),
    ("What is the first letter of the English alphabet?", "A", "the alphabet starts with A"),
    ("Which is a fruit: carrot or mango?", "mango", "a mango is a fruit"),
]
INSTRUCTIONS = [  # (instruction, function applied to the answer)
    ("", lambda a: a), (" Answer in lowercase.", str.lower), (" Answer in uppercase.", str.upper),
    (" Reply with a single word.", lambda a: a), (" Keep the answer short.", lambda a: a)]


def direct_example(rng) -> tuple[str, str, str]:
    """(question, reason, answer) for a question that needs no code."""
    kind = rng.random()
    if kind < 0.5:
        q, a, why = rng.choice(FACTS)
        instruction, fn = rng.choice(INSTRUCTIONS)
        return q + instruction, why[0].upper() + why[1:] + ", so no code is needed.", fn(a)
    w = rng.choice(WORDS)
    if kind < 0.7:
        return (pick(rng, "Repeat the word '{w}' exactly.", "Echo back the word \"{w}\".", w=w),
                "The task is to repeat the word unchanged.", w)
    if kind < 0.85:
        return (pick(rng, "What is the first letter of '{w}'?", "Give the initial letter of \"{w}\".", w=w),
                f"The word {w} starts with {w[0]}.", w[0])
    u = rng.choice([x for x in WORDS if x != w])
    first = min(w, u)
    return (pick(rng, "Which comes first in alphabetical order: '{a}' or '{b}'?", "Alphabetically, which is earlier, "
                 "\"{a}\" or \"{b}\"?", a=w, b=u), f"Comparing letter by letter, {first} comes first.", first)


# ----------------------------------------------------------------------------------------------------------
# Reasoning and answer sentences, drawn at random so that no single template is memorised

CALL_REASONS = [
    "I will use Python to {what}.", "Let me {what} with a short program.", "A small script can {what} reliably.",
    "To avoid mistakes, I'll {what} in code.", "The easiest way to {what} is to run some Python.",
    "I need to {what}. Let me write code for it.", "Let me compute this: I'll {what} with Python.",
    "Doing this by hand is error-prone, so I'll {what} with the tool.", "I can {what} using Python.",
    "First, {what} with a quick program.", "I'll call the Python tool to {what}.", "Let's {what} programmatically.",
]
STDIN_REASONS = ["I'll pass the data on standard input and {what}.", "The program reads the data from stdin; "
                 "then it will {what}.", "Let me feed the input through stdin and {what}."]
VERIFY_REASONS = ["Let me double-check with a different method.", "I'll verify that with a second program.",
                  "To be sure, I'll compute it another way.", "Let me confirm this result independently."]
FIX_REASONS = ["The code failed with a NameError: I misspelled a variable. Let me fix it and run again.",
               "There is a typo in a variable name. I'll correct it and rerun.",
               "The error shows an undefined name; fixing the typo."]
FINAL_REASONS = ["The tool printed {x}.", "The output is {x}.", "The program ran successfully and printed {x}.",
                 "From the tool output, the result is {x}.", "The code gives {x}, so that is the answer.",
                 "Both runs agree on {x}.", "The result is {x}."]
ANSWERS = ["\\boxed{{{x}}}", "The answer is \\boxed{{{x}}}.", "\\boxed{{{x}}}", "Result: \\boxed{{{x}}}",
           "So the answer is \\boxed{{{x}}}."]


def call_turn(reason: str, code: str, stdin: str) -> str:
    """One model turn that calls the tool, exactly as the RL rollout expects (generation stops at </tool_call>)."""
    call = json.dumps({"name": TOOL_NAME, "arguments": {"code": code, "input": stdin}})
    return f"<reason> {reason} </reason>\n<tool_call>\n{call}\n</tool_call>"


def answer_turn(rng, reason: str, answer: str) -> str:
    """The final model turn: reasoning, then the answer in <answer> with \\boxed{}, then the end-of-turn token."""
    sep = rng.choice(["\n", "\n", " "])
    return f"<reason> {reason} </reason>{sep}<answer> {rng.choice(ANSWERS).format(x=answer)} </answer>{IM_END}"


def typo(code: str) -> str | None:
    """A buggy twin for the "error, then fix" examples: the last use of the first assigned name is misspelled."""
    first = code.split("\n")[0]
    name = first.split(" = ")[0].strip() if " = " in first else ""
    uses = list(re.finditer(rf"\b{name}\b", code)) if name.isidentifier() else []
    if len(uses) < 2:
        return None
    last = uses[-1]
    return code[:last.start()] + name + name[-1] + code[last.end():]


def name_the_result(code: str) -> str:
    """`print(f(g(x)))` on the last line -> `result = f(g(x))` then `print(result)`: one level of parentheses
    less to close in the line that a small model most often gets wrong. Other programs are returned unchanged."""
    lines = code.split("\n")
    try:
        call = ast.parse(lines[-1]).body[0].value
    except (SyntaxError, IndexError, AttributeError):
        return code
    if not (isinstance(call, ast.Call) and getattr(call.func, "id", "") == "print" and len(call.args) == 1
            and not call.keywords and not isinstance(call.args[0], (ast.Name, ast.Constant))):
        return code
    name = next(n for n in ("result", "answer", "value", "out", "res") if not re.search(rf"\b{n}\b", code))
    expr = ast.get_source_segment(lines[-1], call.args[0])
    return "\n".join(lines[:-1] + [f"{name} = {expr}", f"print({name})"])


# ----------------------------------------------------------------------------------------------------------
# Building examples: draft -> run every program in the sandbox -> render as a Trajectory


@dataclass
class Draft:
    id: str
    question: str
    answer: str                                  # the expected final answer (what the last program prints)
    calls: list[tuple[str, str, str]] = field(default_factory=list)   # (reason, code, stdin) per tool call
    expect: list[str] = field(default_factory=list)                   # expected status per call
    final: str = ""                              # the final model turn, <|im_end|> included


def draft_example(seed: int, index: int, cfg: SFTConfig) -> Draft:
    """The index-th example of a seeded stream (its own RNG, so example i never depends on how many were drawn)."""
    rng = random.Random(f"sft:{seed}:{index}")
    if rng.random() < cfg.direct_share:
        q, reason, a = direct_example(rng)
        return Draft(f"sft-{index}-direct", q, a, final=answer_turn(rng, reason, a))
    chore = rng.choice(CHORES)(rng)
    programs = [(name_the_result(code) if rng.random() < cfg.name_share else code, stdin)
                for code, stdin in chore_programs(chore)]
    code, stdin = rng.choice(programs)
    reasons = STDIN_REASONS if stdin else CALL_REASONS
    d = Draft(f"sft-{index}-{chore.what.split()[0]}", chore.question, chore.answer)
    first_reason = rng.choice(reasons).format(what=chore.what)
    roll = rng.random()
    others = [p for p in programs if p[0] != code]
    buggy = typo(code)
    if roll < cfg.fix_share and buggy:
        d.calls = [(first_reason, buggy, stdin), (rng.choice(FIX_REASONS), code, stdin)]
        d.expect = ["error", "ok"]
    elif roll < cfg.fix_share + cfg.verify_share and others:
        d.calls = [(first_reason, code, stdin), (rng.choice(VERIFY_REASONS), *rng.choice(others))]
        d.expect = ["ok", "ok"]
    else:
        d.calls, d.expect = [(first_reason, code, stdin)], ["ok"]
    finals = FINAL_REASONS if len(d.calls) > 1 else [r for r in FINAL_REASONS if "Both" not in r]
    d.final = answer_turn(rng, rng.choice(finals).format(x=chore.answer), chore.answer)
    return d


def render_example(tokenizer, draft: Draft, results: list) -> Trajectory | None:
    """Draft + real sandbox results -> Trajectory (prompt, model and tool segments), or None when the sandbox did
    not do what the draft expects (then the example would teach something false, so it is dropped)."""
    from sandbox import format_tool_response

    for result, want in zip(results, draft.expect):
        if result.status != want or (want == "error" and "NameError" not in result.stderr):
            return None
    if results and results[-1].stdout.strip() != draft.answer:
        return None
    t = Trajectory(problem_id=draft.id, prompt_ids=render_prompt(tokenizer, draft.question), finish_reason="answer",
                   reward=1.0)
    texts = []
    for (reason, code, stdin), result in zip(draft.calls, results):
        model_text, tool_out = call_turn(reason, code, stdin), format_tool_response(result)
        tool_text = tool_response_text(tool_out)
        t.segments += [Segment(encode(tokenizer, model_text), 1), Segment(encode_tool_response(tokenizer, tool_out), 0)]
        texts += [model_text, tool_text]
        t.tool_calls += 1
        t.tool_errors += result.status != "ok"
        t.tool_statuses[result.status] = t.tool_statuses.get(result.status, 0) + 1
    t.segments.append(Segment(encode(tokenizer, draft.final), 1))
    t.response_text = "".join(texts) + draft.final
    t.model_text = "".join(texts[::2]) + draft.final
    t.turns, t.answer_tags = len(draft.calls) + 1, 1
    return t


async def run_drafts(drafts: list[Draft], pool) -> list[list]:
    """Run every tool call of every draft in the sandbox pool, concurrently."""
    async def one(d: Draft):
        return [await pool.run(code, stdin) for _, code, stdin in d.calls]
    return await asyncio.gather(*(one(d) for d in drafts))


def build_sft_examples(tokenizer, n: int, seed: int, pool=None, cfg: SFTConfig | None = None,
                       loop: asyncio.AbstractEventLoop | None = None) -> list[Trajectory]:
    """n generated SFT examples whose tool responses are real sandbox outputs.

    pool: a SandboxPool (bound to no event loop); None starts a private one. loop: an event loop to run on
    (None: asyncio.run; must not be called from inside a running loop - use `asyncio.to_thread` there)."""
    cfg = cfg or SFTConfig()

    async def go(pool):
        examples: list[Trajectory] = []
        index = 0
        for _ in range(5):  # refill rounds: an example is dropped when the sandbox disagrees with its draft
            want = n - len(examples)
            if want <= 0:
                break
            drafts = [draft_example(seed, index + i, cfg) for i in range(want + want // 10 + 1)]
            index += len(drafts)
            for draft, results in zip(drafts, await run_drafts(drafts, pool)):
                t = render_example(tokenizer, draft, results)
                if t is not None and len(examples) < n:
                    examples.append(t)
        return examples

    async def with_pool():
        if pool is not None:
            return await go(pool)
        from sandbox import SandboxPool
        async with SandboxPool() as private:
            return await go(private)

    return loop.run_until_complete(with_pool()) if loop is not None else asyncio.run(with_pool())


# ----------------------------------------------------------------------------------------------------------
# Chat examples from a JSONL file: {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...}]}

ROLES = ("system", "user", "assistant", "tool")


def chat_pieces(messages: list[dict]) -> list[tuple[str, int]]:
    """ChatML text pieces with loss masks: assistant content (+ <|im_end|>) is 1, everything else 0. Consecutive
    tool messages become one user turn of <tool_response> blocks, as Qwen's template renders them. Without a
    system message the paper's system prompt (with the tool schema) is used. OpenAI-style `tool_calls` on an
    assistant message are written as <tool_call> blocks."""
    from scheduler import system_message

    pieces: list[tuple[str, int]] = []
    if messages[0]["role"] != "system":
        pieces.append((f"{IM_START}system\n{system_message()}{IM_END}\n", 0))
    i = 0
    while i < len(messages):
        m = messages[i]
        if m["role"] == "tool":
            j = i
            while j < len(messages) and messages[j]["role"] == "tool":
                j += 1
            body = "\n".join(f"<tool_response>\n{t['content']}\n</tool_response>" for t in messages[i:j])
            pieces.append((f"{IM_START}user\n{body}{IM_END}\n", 0))
            i = j
            continue
        if m["role"] == "assistant":
            text = m.get("content") or ""
            for call in m.get("tool_calls") or []:
                fn = call.get("function", call)
                args = fn.get("arguments", {})
                args = json.loads(args) if isinstance(args, str) else args
                text += f"\n<tool_call>\n{json.dumps({'name': fn['name'], 'arguments': args})}\n</tool_call>"
            pieces += [(f"{IM_START}assistant\n", 0), (text.strip("\n") + IM_END, 1), ("\n", 0)]
        else:
            pieces.append((f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n", 0))
        i += 1
    while pieces and pieces[-1][1] == 0:  # nothing after the last assistant turn is trained on
        pieces.pop()
    return pieces


def check_chat_row(row) -> str | None:
    """Why a parsed JSONL row is not a chat example, or None when it is."""
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
        return 'expected an object {"messages": [...]} with a non-empty list'
    for k, m in enumerate(row["messages"]):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            return f"message {k}: role must be one of {', '.join(ROLES)}"
        if not isinstance(m.get("content"), str) and not (m["role"] == "assistant" and m.get("tool_calls")):
            return f"message {k} ({m['role']}): content must be a string"
    if not any(m["role"] == "assistant" for m in row["messages"]):
        return "no assistant message (nothing to train on)"
    return None


def load_chat_jsonl(path: str | Path, tokenizer) -> list[Trajectory]:
    """Chat examples -> Trajectories (prompt = everything before the first assistant content). A malformed line
    raises ValueError naming the file and its 1-based line number."""
    examples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            problem = check_chat_row(row)
            if problem is None:
                try:
                    pieces = chat_pieces(row["messages"])
                except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
                    problem = f"malformed tool call ({type(e).__name__}: {e})"
            if problem is not None:
                raise ValueError(f"{path}:{lineno}: {problem}")
            first = next(k for k, (_, mask) in enumerate(pieces) if mask)
            t = Trajectory(problem_id=f"{Path(path).stem}-{lineno}",
                           prompt_ids=encode(tokenizer, "".join(text for text, _ in pieces[:first])),
                           finish_reason="answer", reward=1.0)
            t.segments = [Segment(encode(tokenizer, text), mask) for text, mask in pieces[first:]]
            t.response_text = "".join(text for text, _ in pieces[first:])
            t.model_text = "".join(text for text, mask in pieces[first:] if mask)
            examples.append(t)
    return examples


# ----------------------------------------------------------------------------------------------------------
# Batches and the loss: cross-entropy on model tokens only


def collate(examples: list[Trajectory], pad_id: int) -> dict:
    """Right-padded input_ids, attention_mask, and labels that are -100 wherever loss_mask is 0 (system, user,
    tool tokens) and on padding, so only the model's own tokens are trained on."""
    import torch

    length = max(len(t.input_ids) for t in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), length), dtype=torch.long)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)
    for row, t in enumerate(examples):
        x, m = torch.tensor(t.input_ids), torch.tensor(t.loss_mask)
        ids[row, :len(x)], attn[row, :len(x)] = x, 1
        labels[row, :len(x)] = torch.where(m == 1, x, torch.full_like(x, -100))
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def shared_prefix_len(batch: dict) -> int:
    """How many leading tokens can be run once for the whole batch: the common prefix of all rows, kept short of
    the first labeled token (the logit that predicts it must come from the per-example part)."""
    ids, labels = batch["input_ids"], batch["labels"]
    same = (ids == ids[:1]).all(dim=0) & (batch["attention_mask"] == 1).all(dim=0)
    common = int(same.long().cumprod(0).sum())
    labeled = (labels != -100).any(dim=0).nonzero()
    first_label = int(labeled[0]) if len(labeled) else ids.shape[1]
    return max(0, min(common, first_label) - 1)


def batch_loss(model, batch: dict, share_prefix: bool = True):
    """Summed token cross-entropy over labeled tokens, and their count: logits at t predict the token at t+1.

    With share_prefix, the common prompt runs once (batch size 1, with gradient) into a KV cache shared by the
    batch (model.next_token_logits); the rest of each row attends to it. Same loss and gradients as the plain
    batch, far less work."""
    import torch.nn.functional as F

    import model as models

    device = next(model.parameters()).device
    ids, attn, labels = (batch[k].to(device) for k in ("input_ids", "attention_mask", "labels"))
    start = 1 + (shared_prefix_len(batch) if share_prefix else 0)   # logits predict ids[:, start:]
    targets = labels[:, start:]
    labeled = targets != -100   # assistant tokens: the only logits computed (~2/3 of the tokens after the prompt)
    logits = models.next_token_logits(model, ids, attn, start, share_prefix=share_prefix and start >= 16,
                                      keep=labeled)
    loss_sum = F.cross_entropy(logits.float(), targets[labeled], reduction="sum")
    return loss_sum, int(labeled.sum())


def my_micro_batches_of(examples: list[Trajectory], max_tokens: int) -> list:
    """The examples in micro-batches of at most max_tokens padded response tokens (rows x the longest response
    among them: what activations and logits grow with; the shared prompt runs once per micro-batch). Under
    torchrun: this rank's token-balanced share, padded with None up to the busiest rank's count (an empty pass,
    distributed.py)."""
    lengths = [len(t.input_ids) - len(t.prompt_ids) for t in examples]
    shares = rank_shares(list(range(len(examples))), lengths)
    return [None if mb is None else [examples[i] for i in mb]
            for mb in my_micro_batches(shares, lengths, max_tokens)]


def autocast(model, cfg: SFTConfig):
    """bf16 autocast over the fp32 master weights (matmuls in bf16, the loss and the optimizer in fp32), where
    cfg.bf16 says so (None: where bf16 matrix units exist, models.bf16_is_fast)."""
    import torch

    import model as models

    device = next(model.parameters()).device.type
    on = models.bf16_is_fast(device) if cfg.bf16 is None else cfg.bf16
    return torch.autocast(device, dtype=torch.bfloat16, enabled=on)


def accumulate_gradients(model, examples: list[Trajectory], cfg: SFTConfig, pad_id: int) -> float:
    """Gradients of the token-level mean loss over the whole batch, in micro-batches of cfg.micro_batch_tokens:
    L = sum_mb sum_tokens CE / N, N = the batch's model tokens, so splitting changes memory, not the gradient.
    Under torchrun the ranks split the batch and FSDP averages their gradients: each rank's loss is scaled by
    the number of ranks."""
    total = sum(sum(t.loss_mask) for t in examples)  # N: every labeled token (a prompt always precedes them)
    share = cfg.share_prefix and DIST.world == 1     # FSDP: the same number of forward passes on every rank
    loss = 0.0
    for micro in my_micro_batches_of(examples, cfg.micro_batch_tokens):
        with autocast(model, cfg):
            loss_sum, _ = batch_loss(model, collate(micro or examples[:1], pad_id), share)
        if micro is None:
            loss_sum = loss_sum * 0.0  # an empty pass: keeps this rank in step with the others
        (loss_sum * DIST.world / max(1, total)).backward()
        loss += loss_sum.item() / max(1, total)
    return all_ranks_sum([loss])[0]


def length_batches(examples: list, batch_size: int, rng: random.Random) -> list[list]:
    """Batches of similar length (less padding): shuffle, sort within windows of 8 batches, shuffle the batches."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    batches = []
    window = batch_size * 8
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: len(examples[i].input_ids))
        batches += [[examples[i] for i in chunk[k:k + batch_size]] for k in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def lr_at(step: int, total: int, cfg: SFTConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr * cfg.min_lr_ratio."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def heldout_loss(model, examples: list[Trajectory], cfg: SFTConfig, pad_id: int) -> float:
    """Mean token loss on held-out SFT examples (no gradient)."""
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), autocast(model, cfg):
        for batch in my_micro_batches_of(examples, cfg.micro_batch_tokens):
            s, c = batch_loss(model, collate(batch or examples[:1], pad_id), cfg.share_prefix and DIST.world == 1)
            if batch is not None:
                total, count = total + float(s), count + c
    model.train()
    total, count = all_ranks_sum([total, count])
    return total / max(1, count)


# ----------------------------------------------------------------------------------------------------------
# Training


def save_checkpoint(model, tokenizer, out_dir: Path, metrics: dict | None = None, weights=None) -> None:
    """save_pretrained + tokenizer into a temporary directory next to out_dir, then rename: a killed run never
    leaves a half-written checkpoint under the final name. weights: the full state dict of a sharded model."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    model.save_pretrained(tmp, state_dict=weights)
    tokenizer.save_pretrained(tmp)
    if metrics is not None:
        (tmp / "sft_metrics.json").write_text(json.dumps(metrics, indent=1))
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}-old-{os.getpid()}")
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)


def run_sft(model, tokenizer, cfg: SFTConfig, out_dir: Path | None, pool=None, log=print) -> dict:
    """Non-reasoning SFT in place on `model`; saves model + tokenizer to out_dir (None: no save). Returns metrics
    (JSON-serializable): loss curve, held-out losses, example and token counts, steps, time."""
    import torch
    from tqdm import tqdm

    import model as models

    t0 = time.time()
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    lead = DIST.rank == 0  # under torchrun (distributed.py): rank 0 builds the data, logs and saves
    if not lead:
        log = lambda *_: None  # noqa: E731
    if DIST.world > 1:
        model = shard_policy(model, bf16=next(model.parameters()).is_cuda)

    # ---- data: generated chores (real sandbox outputs) + direct answers, optional JSONL chats, held-out set
    def build(n, seed):
        return build_sft_examples(tokenizer, n, seed, pool, cfg) if n > 0 and lead else []
    train = build(cfg.n_examples, cfg.seed)
    if cfg.data_jsonl and lead:
        train += load_chat_jsonl(cfg.data_jsonl, tokenizer)
    heldout = build(cfg.heldout_examples, cfg.seed + 1_000_003)
    train, heldout = from_rank0((train, heldout))  # every rank trains on the same examples (tool timings vary)
    too_long = sum(len(t.input_ids) > cfg.max_tokens for t in train)
    train = [t for t in train if len(t.input_ids) <= cfg.max_tokens]
    heldout = [t for t in heldout if len(t.input_ids) <= cfg.max_tokens]
    if not train:
        raise ValueError("no SFT examples to train on (n_examples=0 and no data_jsonl, or all over max_tokens)")
    model_tokens = sum(t.num_model_tokens for t in train)
    log(f"[sft] {len(train)} examples ({too_long} over {cfg.max_tokens} tokens dropped), "
        f"{sum(len(t.input_ids) for t in train)} tokens of which {model_tokens} trained on; "
        f"{len(heldout)} held-out; data built in {time.time() - t0:.0f}s")

    # ---- optimization: AdamW, warm-up + cosine, clip 1.0, early stop on the held-out loss
    batches = [b for _ in range(cfg.epochs) for b in length_batches(train, cfg.batch_size, rng)]
    if cfg.max_steps is not None:
        batches = batches[:cfg.max_steps]
    opt = models.adamw(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    model.train()
    losses, evals = [], []
    best, bad_evals, stopped_early = float("inf"), 0, False
    if heldout:
        evals.append((0, heldout_loss(model, heldout, cfg, pad_id)))
        best = evals[-1][1]
    bar = tqdm(batches, desc="sft", unit="step", dynamic_ncols=True, disable=not lead)
    for step, examples in enumerate(bar):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, len(batches), cfg)
        opt.zero_grad(set_to_none=True)
        loss = accumulate_gradients(model, examples, cfg, pad_id)
        grad_norm = clip_gradients(model, cfg.grad_clip)
        opt.step()
        models.release_freed_memory()  # the step's logits and activations, before they fragment the heap
        losses.append(loss)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", gnorm=f"{grad_norm:.2f}", lr=f"{group['lr']:.1e}")
        if heldout and ((step + 1) % cfg.eval_every == 0 or step + 1 == len(batches)):
            evals.append((step + 1, heldout_loss(model, heldout, cfg, pad_id)))
            log(f"[sft] step {step + 1}/{len(batches)} train loss {losses[-1]:.3f} held-out loss {evals[-1][1]:.3f}")
            if evals[-1][1] < best * (1 - cfg.min_delta):
                best, bad_evals = evals[-1][1], 0
            else:
                bad_evals += 1
                if bad_evals >= cfg.patience and step + 1 < len(batches):
                    stopped_early = True
                    log(f"[sft] early stop: held-out loss has not improved for {cfg.patience} evaluations")
                    break
    bar.close()
    model.eval()

    metrics = {"examples": len(train), "heldout_examples": len(heldout), "dropped_too_long": too_long,
               "tokens": sum(len(t.input_ids) for t in train), "model_tokens": model_tokens,
               "steps": len(losses), "planned_steps": len(batches), "stopped_early": stopped_early,
               "losses": losses, "heldout_losses": evals, "final_loss": losses[-1] if losses else None,
               "final_heldout_loss": evals[-1][1] if evals else None, "time_s": round(time.time() - t0, 1),
               "config": asdict(cfg)}
    if out_dir is not None:
        weights, _ = full_state(model)  # FSDP: the full weights, gathered on rank 0
        if lead:
            save_checkpoint(model, tokenizer, Path(out_dir), metrics, weights)
        metrics["out_dir"] = str(out_dir)
        log(f"[sft] saved to {out_dir} after {metrics['time_s']:.0f}s")
    return metrics


# ----------------------------------------------------------------------------------------------------------
# Command line: python sft.py --out DIR [--model PATH] [--n-examples N] [--show K]


def main() -> None:
    import model as models

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL, help="bundled smollm2-135m or a HF model directory")
    ap.add_argument("--out", default="runs/sft/model", help="where the SFT checkpoint is saved")
    ap.add_argument("--show", type=int, default=0, help="only print K generated examples and exit")
    for f in SFTConfig.__dataclass_fields__.values():
        if f.type in ("int", "float", "str | None", "int | None"):
            kind = {"int": int, "float": float, "int | None": int}.get(f.type, str)
            ap.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, help=f"default {f.default}")
    args = ap.parse_args()
    cfg = SFTConfig(**{k: v for k, v in vars(args).items() if k in SFTConfig.__dataclass_fields__})
    path = models.resolve_model(args.model)
    tokenizer = models.load_tokenizer(path)
    if args.show:
        for t in build_sft_examples(tokenizer, args.show, cfg.seed, cfg=cfg):
            print(f"===== {t.problem_id} ({len(t.input_ids)} tokens)\n{t.response_text}\n")
        return
    print(json.dumps({k: v for k, v in run_sft(models.load_model(path), tokenizer, cfg, Path(args.out)).items()
                      if k not in ("losses", "config")}))


if __name__ == "__main__":
    main()
