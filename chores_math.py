"""chores_math.py - the everyday Python that math needs, as SFT chores (arXiv 2508.20722, section 4.1).

The paper's cold start teaches the tool-call format, not math reasoning. An SFT model that has only seen
`print(a * b)` is right on none of tasks.py's families but products, and RL learns nothing from a family it never
gets right (RESULTS.md). The chores here teach the tools those families need - loops over ranges, math.comb /
math.perm, sympy's functions, int(text, base), numbers read out of a sentence - in everyday settings, never the
families' own questions. Same shape as chores.py:

    MATH_CHORES[i](rng) -> chores.Chore (question, expected stdout, programs in several styles)
    CHORES: the SFT's default mix = chores.EVERYDAY_CHORES + about a quarter of these (range loops the most)
      -> sft_data.py drafts examples, runs every program in the sandbox -> sft.py trains on them
    EXTRA_CHORES: chores measured outside the default mix, added by name (chore_mix; SFTConfig.extra_chores)
"""
from __future__ import annotations

import calendar
import math

from chores import EVERYDAY_CHORES, Chore, pick
from tasks import to_base


def range_count(rng):
    """A loop over a range of numbers with a condition: house numbers, seats, years."""
    a = rng.randint(1, 400)
    b = a + rng.randint(30, 900)
    d = rng.randint(1, 9)
    kind = rng.choice(["digit", "ending", "leap"])
    if kind == "digit":
        answer = sum(str(d) in str(k) for k in range(a, b + 1))
        q = pick(rng, "The houses on a street are numbered {a} to {b}. How many house numbers contain the digit {d}?",
                 "Seats are numbered from {a} through {b}. On how many seat numbers does the digit {d} appear?",
                 a=a, b=b, d=d)
        return Chore(f"count the numbers with the digit {d}", q, str(answer),
                     [f"count = 0\nfor k in range({a}, {b} + 1):\n    if '{d}' in str(k):\n        count += 1\nprint(count)",
                      f"print(sum(1 for k in range({a}, {b + 1}) if '{d}' in str(k)))",
                      f"numbers = range({a}, {b + 1})\nresult = len([k for k in numbers if '{d}' in str(k)])\nprint(result)"])
    if kind == "ending":
        answer = sum(k % 10 == d for k in range(a, b + 1))
        q = pick(rng, "Tickets are numbered {a} to {b}. How many ticket numbers end in {d}?",
                 "Lockers {a} through {b} are painted red when their number ends with the digit {d}. How many "
                 "lockers are red?", a=a, b=b, d=d)
        return Chore(f"count the numbers ending in {d}", q, str(answer),
                     [f"count = 0\nfor k in range({a}, {b} + 1):\n    if k % 10 == {d}:\n        count += 1\nprint(count)",
                      f"print(sum(1 for k in range({a}, {b + 1}) if k % 10 == {d}))"])
    y1 = rng.randint(1582, 2000)
    y2 = y1 + rng.randint(20, 400)
    answer = sum(calendar.isleap(y) for y in range(y1, y2 + 1))
    q = pick(rng, "How many leap years are there from {a} to {b}, both included?",
             "Count the leap years between the years {a} and {b} inclusive.", a=y1, b=y2)
    return Chore("count the leap years", q, str(answer),
                 [f"import calendar\nprint(sum(calendar.isleap(y) for y in range({y1}, {y2} + 1)))",
                  f"count = 0\nfor year in range({y1}, {y2 + 1}):\n    if year % 4 == 0 and (year % 100 != 0 or year % 400 == 0):\n"
                  f"        count += 1\nprint(count)",
                  f"import calendar\nresult = calendar.leapdays({y1}, {y2 + 1})\nprint(result)"])


def range_total(rng):
    """A total over numbered items, each contributing a formula of its number: a loop or sum() over a range."""
    n = rng.randint(8, 120)
    c, e = rng.randint(2, 9), rng.randint(1, 12)
    kind = rng.choice(["rows", "pages"])
    if kind == "rows":
        answer = sum(c * k + e for k in range(1, n + 1))
        q = pick(rng, "A stadium has {n} rows. Row k has {c}*k + {e} seats. How many seats are there in all?",
                 "A pyramid of cans has {n} layers; layer k (counting from the top) holds {c}k + {e} cans. How "
                 "many cans are there?", n=n, c=c, e=e)
        return Chore("add up the rows", q, str(answer),
                     [f"total = 0\nfor k in range(1, {n} + 1):\n    total += {c} * k + {e}\nprint(total)",
                      f"print(sum({c} * k + {e} for k in range(1, {n + 1})))",
                      f"rows = [{c} * k + {e} for k in range(1, {n + 1})]\nresult = sum(rows)\nprint(result)"])
    a = rng.randint(1, 300)
    b = a + rng.randint(10, 400)
    answer = sum(range(a, b + 1))
    q = pick(rng, "A book's pages from {a} to {b} are torn out. What is the sum of the torn page numbers?",
             "Add up all the whole numbers from {a} to {b}, both included.", a=a, b=b)
    return Chore("add up the numbers in the range", q, str(answer),
                 [f"print(sum(range({a}, {b} + 1)))",
                  f"total = 0\nfor page in range({a}, {b + 1}):\n    total += page\nprint(total)"])


def choose_ways(rng):
    """Everyday counting with math.comb and math.perm: menus, teams, podiums, handshakes."""
    n = rng.randint(5, 30)
    k = rng.randint(2, min(6, n - 1))
    thing = rng.choice(["toppings", "songs", "books", "flavors", "colleagues"])
    kind = rng.choice(["comb", "perm", "pairs"])
    if kind == "comb":
        q = pick(rng, "A shop offers {n} {t}. In how many ways can you pick {k} different ones (order does not "
                 "matter)?", "How many different sets of {k} can be made from {n} {t}?", n=n, k=k, t=thing)
        return Chore("count the choices with math.comb", q, str(math.comb(n, k)),
                     [f"import math\nprint(math.comb({n}, {k}))", f"from math import comb\nresult = comb({n}, {k})\nprint(result)",
                      f"import itertools\nprint(len(list(itertools.combinations(range({n}), {k}))))"],
                     same_as=("binomial", {"n": n, "k": k}))
    if kind == "perm":
        q = pick(rng, "{n} runners race. In how many ways can the first {k} places be filled?",
                 "From {n} {t}, how many ordered lists of {k} different ones are there?", n=n, k=k, t=thing)
        return Chore("count the ordered choices with math.perm", q, str(math.perm(n, k)),
                     [f"import math\nprint(math.perm({n}, {k}))",
                      f"result = 1\nfor i in range({k}):\n    result *= {n} - i\nprint(result)"])
    q = pick(rng, "At a meeting of {n} people everyone shakes hands with everyone else once. How many handshakes?",
             "{n} teams play each other once. How many games are played?", n=n)
    return Chore("count the pairs", q, str(math.comb(n, 2)),
                 [f"import math\nprint(math.comb({n}, 2))", f"n = {n}\nprint(n * (n - 1) // 2)",
                  f"count = 0\nfor i in range({n}):\n    for j in range(i + 1, {n}):\n        count += 1\nprint(count)"],
                 same_as=("binomial", {"n": n, "k": 2}))


def sympy_chore(rng):
    """Sympy's functions on programmer's and shopper's questions: isprime, nextprime, divisors, solve, Rational."""
    import sympy

    kind = rng.choice(["isprime", "nextprime", "rows", "solve", "fraction"])
    if kind == "isprime":
        # a prime or an odd number; the prime from rng (sympy.randprime draws from sympy's global RNG, which would
        # make the data depend on what ran before, not on the seed)
        n = rng.choice([sympy.nextprime(rng.randint(100, 20000)), rng.randint(50, 10000) * 2 + 1])
        q = pick(rng, "Is {n} a prime number? Answer yes or no.", "Is the locker number {n} prime? Reply yes or no.",
                 n=n)
        return Chore("test whether it is prime", q, "yes" if sympy.isprime(n) else "no",
                     [f"import sympy\nprint('yes' if sympy.isprime({n}) else 'no')",
                      f"from sympy import isprime\nresult = isprime({n})\nprint('yes' if result else 'no')"])
    if kind == "nextprime":
        n = rng.randint(100, 50000)
        q = pick(rng, "A hash table needs a prime size larger than {n}. What is the smallest such size?",
                 "What is the first prime number after {n}?", n=n)
        return Chore("find the next prime", q, str(sympy.nextprime(n)),
                     [f"import sympy\nprint(sympy.nextprime({n}))",
                      f"from sympy import isprime\nk = {n} + 1\nwhile not isprime(k):\n    k += 1\nprint(k)"])
    if kind == "rows":
        n = rng.choice([12, 24, 30, 36, 48, 60, 72, 84, 90, 96, 100, 120, 144, 180])
        q = pick(rng, "{n} chairs are set out in equal rows, with at least 2 chairs in a row and at least 2 rows. "
                 "How many different row lengths are possible?", n=n)
        return Chore("count the row lengths with sympy.divisors", q, str(len(sympy.divisors(n)) - 2),
                     [f"import sympy\nsizes = [d for d in sympy.divisors({n}) if 2 <= d <= {n} // 2]\nprint(len(sizes))",
                      f"count = 0\nfor d in range(2, {n} // 2 + 1):\n    if {n} % d == 0:\n        count += 1\nprint(count)"])
    if kind == "solve":
        price, k, fee = rng.randint(3, 90), rng.randint(2, 12), rng.randint(1, 30)
        total = price * k + fee
        q = pick(rng, "{k} tickets plus a {f} dollar booking fee cost {t} dollars. What does one ticket cost?",
                 "Solve for x: {k}x + {f} = {t}.", k=k, f=fee, t=total)
        return Chore("solve the equation with sympy", q, str(price),
                     [f"from sympy import symbols, solve\nx = symbols('x')\nprint(solve({k} * x + {fee} - {total}, x)[0])",
                      f"import sympy\nx = sympy.Symbol('x')\nresult = sympy.solve(sympy.Eq({k} * x + {fee}, {total}), x)\nprint(result[0])",
                      f"print(({total} - {fee}) // {k})"])
    a, b = rng.randint(1, 9), rng.randint(2, 12)
    c, d = rng.randint(1, 9), rng.randint(2, 12)
    q = pick(rng, "A recipe needs {a}/{b} cup of sugar and {c}/{d} cup of flour. How many cups is that in all, as a "
             "fraction in lowest terms?", "Add the fractions {a}/{b} and {c}/{d}. Give the answer in lowest terms.",
             a=a, b=b, c=c, d=d)
    return Chore("add the fractions exactly", q, str(sympy.Rational(a, b) + sympy.Rational(c, d)),
                 [f"from sympy import Rational\nprint(Rational({a}, {b}) + Rational({c}, {d}))",
                  f"from fractions import Fraction\nresult = Fraction({a}, {b}) + Fraction({c}, {d})\nprint(result)"])


def hex_color(rng):
    """int(text, base): a hex colour's channel, a binary flag register, an octal file mode."""
    kind = rng.choice(["hex", "binary", "octal"])
    if kind == "hex":
        rgb = [rng.randint(0, 255) for _ in range(3)]
        code = "#" + "".join(f"{v:02X}" for v in rgb)
        i = rng.randrange(3)
        channel = ("red", "green", "blue")[i]
        q = pick(rng, "What is the {c} value (0-255) of the colour {h}?", "The colour {h} is written as #RRGGBB. "
                 "What is its {c} component in decimal?", c=channel, h=code)
        return Chore("read the hex colour", q, str(rgb[i]),
                     [f"code = {code!r}\nprint(int(code[{1 + 2 * i}:{3 + 2 * i}], 16))", f"print(int('{code[1 + 2 * i:3 + 2 * i]}', 16))"])
    if kind == "binary":
        bits = "".join(rng.choice("01") for _ in range(rng.randint(6, 16))).lstrip("0") or "1"
        q = pick(rng, "A register holds the bits {b}. What number is that in decimal?",
                 "Read the binary string {b} as a whole number.", b=bits)
        return Chore("read the binary number", q, str(int(bits, 2)),
                     [f"print(int('{bits}', 2))", f"value = 0\nfor bit in '{bits}':\n    value = 2 * value + int(bit)\nprint(value)"],
                     same_as=("base_conversion", {"from": 2, "to": 10, "value": int(bits, 2)}))
    mode = "".join(str(rng.randint(0, 7)) for _ in range(3))
    q = pick(rng, "The file mode is {m} in octal. What is it in decimal?", "Convert the octal permission {m} to a "
             "decimal number.", m=mode)
    return Chore("read the octal number", q, str(int(mode, 8)), [f"print(int('{mode}', 8))", f"print(0o{mode})"],
                 same_as=("base_conversion", {"from": 8, "to": 10, "value": int(mode, 8)}))


def number_in_sentence(rng):
    """Numbers as people write them (thousands separators, "million", "k"), read into code exactly."""
    a, b = rng.randint(1000, 9_999_999), rng.randint(1000, 9_999_999)
    unit = rng.choice(["parcels", "visitors", "dollars", "downloads", "kilometers"])
    shown_a, shown_b = f"{a:,}", f"{b:,}"
    kind = rng.choice(["total", "difference", "million"])
    if kind == "total":
        text = f"The report says {shown_a} {unit} in March and {shown_b} {unit} in April."
        q = pick(rng, "{t} How many {u} is that in total?", "{t} Add the two numbers.", t=text, u=unit)
        return Chore("read the numbers and add them", q, str(a + b),
                     [f"march = {a}\napril = {b}\nprint(march + april)",
                      "import re\ntext = DATA\nnumbers = [int(x.replace(',', '')) for x in re.findall(r'\\d[\\d,]*', text)]\nprint(sum(numbers))",
                      f"print(int('{shown_a}'.replace(',', '')) + int('{shown_b}'.replace(',', '')))"],
                     text, "input()", text)
    if kind == "difference":
        hi, lo = max(a, b), min(a, b)
        text = f"Last year the site had {f'{lo:,}'} {unit}; this year it had {f'{hi:,}'}."
        q = pick(rng, "{t} By how many did it grow?", "{t} What is the increase?", t=text)
        return Chore("read the numbers and subtract", q, str(hi - lo),
                     [f"before = {lo}\nafter = {hi}\nprint(after - before)",
                      "import re\ntext = DATA\nlow, high = [int(x.replace(',', '')) for x in re.findall(r'\\d[\\d,]*', text)]\nprint(high - low)"],
                     text, "input()", text)
    m, k = round(rng.uniform(1.1, 9.9), 1), rng.randint(2, 500)
    q = pick(rng, "A city of {m} million people is split into {k} equal districts. How many people live in each, "
             "rounded down?", "{m} million {u} are shared equally among {k} groups. How many does each get, rounded "
             "down?", m=m, k=k, u=unit)
    total = round(m * 1_000_000)
    return Chore("write out the millions", q, str(total // k),
                 [f"total = {total}  # {m} million\nprint(total // {k})", f"print(round({m} * 1_000_000) // {k})"])


def digit_check(rng):
    """A check value of an ID: the sum of its digits, by str() or by % 10 and // 10."""
    n = rng.randint(10**5, 10**12)
    thing = rng.choice(["card number", "order number", "serial number", "account number", "barcode"])
    q = pick(rng, "The check value of a {t} is the sum of its digits. What is it for {n}?",
             "Add up the digits of the {t} {n}.", "What do the digits of the {t} {n} add up to?", t=thing, n=n)
    return Chore("add up the digits", q, str(sum(map(int, str(n)))),
                 [f"print(sum(int(ch) for ch in str({n})))", f"print(sum(map(int, str({n}))))",
                  f"n = {n}\ntotal = 0\nwhile n > 0:\n    total += n % 10\n    n //= 10\nprint(total)"])


def layer_blocks(rng):
    """A total over numbered layers whose size is a power of the layer number: sum(k**2 for k in range(a, b + 1))."""
    a = rng.randint(1, 40)
    b = a + rng.randint(5, 60)
    power = rng.choice([2, 2, 3])
    if power == 2:
        q = pick(rng, "A stack of oranges has square layers: layer k is a k-by-k square. How many oranges are in "
                 "layers {a} through {b}?", "Square tiles of side k are made for every k from {a} to {b}; tile k "
                 "uses k*k small squares. How many small squares in all?", a=a, b=b)
    else:
        q = pick(rng, "Cubes of side k are built from unit blocks, one cube for each k from {a} to {b}. How many "
                 "unit blocks are used?", "Box k holds k*k*k marbles, for boxes {a} to {b}. How many marbles are "
                 "there?", a=a, b=b)
    return Chore("add up the layers", q, str(sum(k**power for k in range(a, b + 1))),
                 [f"print(sum(k**{power} for k in range({a}, {b} + 1)))",
                  f"total = 0\nfor k in range({a}, {b + 1}):\n    total += k**{power}\nprint(total)",
                  f"sizes = [k**{power} for k in range({a}, {b + 1})]\nresult = sum(sizes)\nprint(result)"],
                 same_as=("range_sum", {"kind": "powers", "power": power, "a": a, "b": b}))


def base_display(rng):
    """int(text, base) for a base from 3 to 9: a counter or a register whose digits run from 0 to base - 1."""
    base = rng.randint(3, 9)
    value = rng.randint(30, 5000)
    digits = to_base(value, base)
    q = pick(rng, "A toy counter only has the digits 0 to {m}, so its display {d} is a base-{b} number. What count "
             "does it show in decimal?", "An old machine stores numbers in base {b}. Its register reads {d}. What "
             "is that number in decimal?", m=base - 1, d=digits, b=base)
    return Chore(f"read the base-{base} number", q, str(value),
                 [f"print(int('{digits}', {base}))",
                  f"value = 0\nfor digit in '{digits}':\n    value = {base} * value + int(digit)\nprint(value)"],
                 same_as=("base_conversion", {"from": base, "to": 10, "value": value}))


def dotted_sum(rng):
    """A sum written with dots, "a^2 + (a+1)^2 + ... + b^2": the dots stand for every term between, a loop over
    range(a, b + 1). A model that copies such a sum into Python adds an int to Python's Ellipsis (a TypeError)."""
    a = rng.randint(1, 60)
    b = a + rng.randint(8, 120)
    power = rng.choice([1, 2, 2, 3])
    term = (lambda k: str(k)) if power == 1 else (lambda k: f"{k}^{power}")
    dots = f"{term(a)} + {term(a + 1)} + ... + {term(b)}"
    setting = rng.choice(["A pyramid of oranges holds {s} oranges, layer by layer.",
                          "Over the days a savings jar gets {s} coins.", "A tower is built of {s} blocks.",
                          "The rows of a mosaic use {s} tiles."])
    q = setting.format(s=dots) + rng.choice([" How many is that in all?", " What is the total?",
                                             " How many are there altogether?"])
    k = "k" if power == 1 else f"k**{power}"
    return Chore(f"add up {term('k')} for every k from {a} to {b}", q, str(sum(n**power for n in range(a, b + 1))),
                 [f"print(sum({k} for k in range({a}, {b} + 1)))",
                  f"total = 0\nfor k in range({a}, {b + 1}):\n    total += {k}\nprint(total)",
                  f"terms = [{k} for k in range({a}, {b + 1})]\nresult = sum(terms)\nprint(result)"],
                 same_as=("range_sum", {"kind": "powers", "power": power, "a": a, "b": b}))


# The default mix: every everyday chore, then the everyday Python of math, about a quarter of the chores (loops over
# ranges the most: most families need one). The order is the draw's: CHORES[i] of a seed is the same chore always.
CHORES = EVERYDAY_CHORES + [range_count, range_count, range_total, range_total, choose_ways, choose_ways, sympy_chore,
                            sympy_chore, hex_color, number_in_sentence, number_in_sentence]
# The everyday-math chores once each, with three that CHORES lacks (digit sums, sums of powers, any base): drawn
# with probability SFTConfig.math_share when it is set, the rest of the tool examples from EVERYDAY_CHORES.
MATH_CHORES = [range_count, range_total, choose_ways, sympy_chore, hex_color, number_in_sentence, digit_check,
               layer_blocks, base_display]
# Chores outside both lists, added to the default mix by name (SFTConfig.extra_chores; measured in docs/design.md,
# "Sums written with dots, as an SFT chore").
EXTRA_CHORES = {"dotted_sum": dotted_sum}


def chore_mix(extra: str = "") -> list:
    """CHORES, then each chore named in `extra` (comma-separated EXTRA_CHORES names) twice, the weight of the range
    loops. Appended at the end, so a draw that picks an index below len(CHORES) picks the same chore as without."""
    names = [n.strip() for n in extra.split(",") if n.strip()]
    unknown = [n for n in names if n not in EXTRA_CHORES]
    if unknown:
        raise ValueError(f"extra_chores: unknown chore {', '.join(unknown)}; known: {', '.join(EXTRA_CHORES)}")
    return CHORES + [EXTRA_CHORES[n] for n in names for _ in range(2)]
