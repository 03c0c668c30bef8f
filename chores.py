"""chores.py - the tasks behind the non-reasoning SFT data (arXiv 2508.20722, section 4.1).

The paper's cold start teaches no math reasoning: only how to call the tool (165K function-call examples) and how
to follow instructions and the answer format (30K). This module holds what such examples are about:

    chore generators (strings, lists, dates, units, small tables, counting ...): EVERYDAY_CHORES[i](rng) -> Chore
        (the everyday Python of math - ranges, math.comb, sympy, bases - in chores_math.py, with the default mix
        chores_math.CHORES)
        question, expected stdout, several programs in different styles
      chore_programs(chore) -> (code, stdin) variants: DATA as a literal, or read from standard input
    direct_example(rng) -> (question, reason, answer): instruction following, no tool and no computation
      -> sft_data.py drafts examples from them, runs every program in the sandbox and renders Trajectories
         -> sft.py trains on them

Chores are deliberately *not* the questions of tasks.py's families (products, modular powers, primes, divisors,
gcd, binomials, Fibonacci, digit sums, bases): SFT teaches the format and the everyday Python those need (loops
over ranges, math.comb, sympy, int(text, base), numbers read from a sentence), RL must discover how to use it on
math.
Questions, phrasings and code styles (print(expr), variables, loops, functions, stdin) are drawn at random, so
that no single template is memorised (why: sft_data.py).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import date, timedelta



# ----------------------------------------------------------------------------------------------------------
# Chores: general programming tasks where a tool helps. Deliberately *not* the questions of tasks.py's families
# (products, modular powers, primes, divisors, gcd, binomials, Fibonacci, digit sums, bases): SFT teaches the
# format, RL must discover how to use it on math. Each chore gives a question, the expected stdout, and several
# programs in different styles. "DATA" in a program stands for the literal data; a program that starts with
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
    same_as: tuple[str, dict] | None = None   # (tasks family, its parameters) when the chore states a generator
                                              # problem: the SFT keeps such a chore only when it is in train


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


# Every everyday chore above, in the order the SFT's draws index them (chores_math.CHORES appends the
# everyday-math chores to this list; with SFTConfig.math_share set, tool examples draw from this list and
# chores_math.MATH_CHORES in that share).
EVERYDAY_CHORES = [packing, shopping, growth, square_side, count_matching, savings, reverse_string, count_vowels,
                   count_letter, sort_words, sort_numbers, longest_word, word_count, dedupe, palindrome,
                   days_between, weekday, add_days, convert_units, temperature, seconds_to_clock, table_top,
                   table_total, most_common_letter, acronym, case_change, caesar, list_stat, extract_digits,
                   replace_word, evaluate_expression, percent,
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
