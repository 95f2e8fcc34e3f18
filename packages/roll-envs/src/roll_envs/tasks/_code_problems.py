"""Templates of the built-in code problems: small stdin/stdout exercises with seeded variants and tests.

A template draws its parameters (`params`), states the problem (`statement`), draws test inputs (`make_input`)
and solves them (`solve`: input text -> expected output text). `solve` is self-contained (imports inside, no
globals), so `reference_program` can ship its source as a correct Python program: the tests run every
reference program in the sandbox, which checks the templates and the sandbox at once. Expected outputs are
computed here by calling `solve` directly: it is our code, never model text.
"""

from __future__ import annotations

import inspect
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Params = dict[str, Any]


@dataclass(frozen=True)
class Template:
    """One family of problems; a variant is the template with drawn `params`."""

    name: str
    params: Callable[[random.Random], Params]
    statement: Callable[[Params], str]
    make_input: Callable[[random.Random, Params], str]
    solve: Callable[[Params, str], str]


def reference_program(template: Template, params: Params) -> str:
    """A correct program for a variant: `solve`'s source, then a call on stdin."""
    source = inspect.getsource(template.solve)
    call = f"import sys\n\nsys.stdout.write({template.solve.__name__}(PARAMS, sys.stdin.read()))\n"
    return f"PARAMS = {params!r}\n\n\n{source}\n\n{call}"


def _ints(rng: random.Random, lo: int = -50, hi: int = 100, min_n: int = 1, max_n: int = 12) -> str:
    values = [rng.randint(lo, hi) for _ in range(rng.randint(min_n, max_n))]
    return f"{len(values)}\n{' '.join(map(str, values))}\n"


def _words(rng: random.Random, max_words: int = 8, alphabet: str = string.ascii_lowercase) -> str:
    return " ".join("".join(rng.choices(alphabet, k=rng.randint(1, 8))) for _ in range(rng.randint(1, max_words)))


# ---- solvers: input text -> output text; self-contained (their source becomes the reference program) ----------


def solve_sum_divisible(p: dict, text: str) -> str:
    nums = [int(x) for x in text.split()[1:]]
    return f"{sum(x for x in nums if x % p['k'] == 0)}\n"


def solve_reverse(p: dict, text: str) -> str:
    line = text.split("\n")[0]
    return (line[::-1] if p["mode"] == "characters" else " ".join(reversed(line.split()))) + "\n"


def solve_fizzbuzz(p: dict, text: str) -> str:
    out = []
    for i in range(1, int(text.split()[0]) + 1):
        word = (p["wa"] if i % p["a"] == 0 else "") + (p["wb"] if i % p["b"] == 0 else "")
        out.append(word or str(i))
    return "\n".join(out) + "\n"


def solve_count_char(p: dict, text: str) -> str:
    return f"{text.split(chr(10))[0].count(p['c'])}\n"


def solve_extreme(p: dict, text: str) -> str:
    nums = [int(x) for x in text.split()[1:]]
    value = {"max": max(nums), "min": min(nums), "range": max(nums) - min(nums)}[p["op"]]
    return f"{value}\n"


def solve_kth_largest(p: dict, text: str) -> str:
    nums = sorted((int(x) for x in text.split()[1:]), reverse=True)
    return f"{nums[p['k'] - 1]}\n"


def solve_digit_sum(p: dict, text: str) -> str:
    n = int(text.split()[0])
    n = sum(int(d) for d in str(n))
    while p["mode"] == "root" and n >= 10:
        n = sum(int(d) for d in str(n))
    return f"{n}\n"


def solve_primes(p: dict, text: str) -> str:
    def is_prime(n: int) -> bool:
        return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))

    nums = [int(x) for x in text.split()[1:]]
    return "".join((p["yes"] if is_prime(n) else p["no"]) + "\n" for n in nums)


def solve_gcd_lcm(p: dict, text: str) -> str:
    import math

    a, b = (int(x) for x in text.split()[:2])
    return f"{math.gcd(a, b) if p['op'] == 'gcd' else a * b // math.gcd(a, b)}\n"


def solve_sequence(p: dict, text: str) -> str:
    a, b = p["f0"], p["f1"]
    for _ in range(int(text.split()[0])):
        a, b = b, (a + b) % p["m"]
    return f"{a % p['m']}\n"


def solve_factorial_mod(p: dict, text: str) -> str:
    out = 1
    for i in range(2, int(text.split()[0]) + 1):
        out = out * i % p["m"]
    return f"{out % p['m']}\n"


def solve_palindrome(p: dict, text: str) -> str:
    line = text.split("\n")[0].strip()
    if not p["case_sensitive"]:
        line = line.lower()
    return ("YES" if line == line[::-1] else "NO") + "\n"


def solve_caesar(p: dict, text: str) -> str:
    line = text.split("\n")[0]
    shift = "".join(chr((ord(c) - 97 + p["k"]) % 26 + 97) if "a" <= c <= "z" else c for c in line)
    return shift + "\n"


def solve_run_length(p: dict, text: str) -> str:
    s, out, i = text.split()[0], [], 0
    while i < len(s):
        j = i
        while j < len(s) and s[j] == s[i]:
            j += 1
        out.append(f"{s[i]}{j - i}" if p["style"] == "letter-count" else f"{j - i}{s[i]}")
        i = j
    return "".join(out) + "\n"


def solve_sort(p: dict, text: str) -> str:
    nums = sorted((int(x) for x in text.split()[1:]), reverse=p["order"] == "descending")
    return " ".join(map(str, nums)) + "\n"


def solve_count_letters(p: dict, text: str) -> str:
    return f"{sum(c in p['letters'] for c in text.split(chr(10))[0])}\n"


def solve_power_mod(p: dict, text: str) -> str:
    a, b = (int(x) for x in text.split()[:2])
    return f"{pow(a, b, p['m'])}\n"


def solve_long_words(p: dict, text: str) -> str:
    return f"{sum(len(w) >= p['length'] for w in text.split(chr(10))[0].split())}\n"


def solve_prefix(p: dict, text: str) -> str:
    nums, out, acc = [int(x) for x in text.split()[1:]], [], None
    for x in nums:
        acc = x if acc is None else (acc + x if p["op"] == "sum" else max(acc, x))
        out.append(acc)
    return " ".join(map(str, out)) + "\n"


def solve_base(p: dict, text: str) -> str:
    n, digits = int(text.split()[0]), ""
    while True:
        n, r = divmod(n, p["base"])
        digits = str(r) + digits
        if n == 0:
            return digits + "\n"


def solve_triangle(p: dict, text: str) -> str:
    n = int(text.split()[0])
    rows = range(1, n + 1) if p["shape"] == "growing" else range(n, 0, -1)
    return "".join(p["char"] * i + "\n" for i in rows)


def solve_distinct(p: dict, text: str) -> str:
    nums = [int(x) for x in text.split()[1:]]
    seen = list(dict.fromkeys(nums))
    return " ".join(map(str, seen if p["order"] == "first-appearance" else sorted(seen))) + "\n"


def solve_pair_sum(p: dict, text: str) -> str:
    nums = [int(x) for x in text.split()[1:]]
    count = sum(nums[i] + nums[j] == p["t"] for i in range(len(nums)) for j in range(i + 1, len(nums)))
    return f"{count}\n"


def solve_collatz(p: dict, text: str) -> str:
    n, steps, peak = int(text.split()[0]), 0, int(text.split()[0])
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps, peak = steps + 1, max(peak, n)
    return f"{steps if p['report'] == 'steps' else peak}\n"


_FIZZ = ["Fizz", "Buzz", "Bazz", "Pop", "Ping", "Pong", "Zip", "Zap"]
_ORD = {1: "1st", 2: "2nd", 3: "3rd"}
_NUMS = "The first line holds n, the second line n integers."
_LINE = "The input is one line of lowercase words separated by single spaces."

TEMPLATES: tuple[Template, ...] = (
    Template(
        "sum_divisible",
        lambda r: {"k": r.randint(2, 9)},
        lambda p: f"{_NUMS} Print the sum of the integers that are divisible by {p['k']} (0 if none).",
        lambda r, p: _ints(r),
        solve_sum_divisible,
    ),
    Template(
        "reverse",
        lambda r: {"mode": r.choice(["characters", "words"])},
        lambda p: f"{_LINE} Print the line with its {p['mode']} in reverse order.",
        lambda r, p: _words(r) + "\n",
        solve_reverse,
    ),
    Template(
        "fizzbuzz",
        lambda r: dict(zip(("a", "b"), r.sample(range(2, 8), 2)), **dict(zip(("wa", "wb"), r.sample(_FIZZ, 2)))),
        lambda p: (
            f"Read n. For i from 1 to n print one line: {p['wa']}{p['wb']} if i is divisible by both {p['a']} and "
            f"{p['b']}, {p['wa']} if only by {p['a']}, {p['wb']} if only by {p['b']}, otherwise i."
        ),
        lambda r, p: f"{r.randint(1, 40)}\n",
        solve_fizzbuzz,
    ),
    Template(
        "count_char",
        lambda r: {"c": r.choice("aeiorstn")},
        lambda p: f"{_LINE} Print how many times the letter '{p['c']}' occurs in it.",
        lambda r, p: _words(r, alphabet="aeiorstnlm") + "\n",
        solve_count_char,
    ),
    Template(
        "extreme",
        lambda r: {"op": r.choice(["max", "min", "range"])},
        lambda p: (
            _NUMS
            + {"max": " Print the largest.", "min": " Print the smallest.", "range": " Print largest - smallest."}[
                p["op"]
            ]
        ),
        lambda r, p: _ints(r),
        solve_extreme,
    ),
    Template(
        "kth_largest",
        lambda r: {"k": r.randint(1, 3)},
        lambda p: f"{_NUMS} n >= {p['k']}. Print the {_ORD[p['k']]} largest integer (equal values count separately).",
        lambda r, p: _ints(r, min_n=p["k"]),
        solve_kth_largest,
    ),
    Template(
        "digit_sum",
        lambda r: {"mode": r.choice(["once", "root"])},
        lambda p: (
            "Read a non-negative integer n. "
            + (
                "Print the sum of its decimal digits."
                if p["mode"] == "once"
                else "Replace n by the sum of its decimal digits until it has one digit; print it."
            )
        ),
        lambda r, p: f"{r.randint(0, 10 ** r.randint(1, 12))}\n",
        solve_digit_sum,
    ),
    Template(
        "primes",
        lambda r: dict(zip(("yes", "no"), r.choice([("YES", "NO"), ("prime", "composite"), ("P", "N")]))),
        lambda p: f"{_NUMS} For each integer print {p['yes']} if it is a prime number, else {p['no']}, one per line.",
        lambda r, p: _ints(r, lo=0, hi=200),
        solve_primes,
    ),
    Template(
        "gcd_lcm",
        lambda r: {"op": r.choice(["gcd", "lcm"])},
        lambda p: (
            "Read two positive integers a and b on one line. Print their "
            + ("greatest common divisor." if p["op"] == "gcd" else "least common multiple.")
        ),
        lambda r, p: f"{r.randint(1, 500)} {r.randint(1, 500)}\n",
        solve_gcd_lcm,
    ),
    Template(
        "sequence",
        lambda r: {"f0": r.choice([0, 2, 3]), "f1": r.choice([1, 4]), "m": r.choice([1000, 1_000_000_007])},
        lambda p: (
            f"A sequence has s(0) = {p['f0']}, s(1) = {p['f1']} and s(i) = s(i-1) + s(i-2). Read n (0 <= n <= 90) "
            f"and print s(n) modulo {p['m']}."
        ),
        lambda r, p: f"{r.randint(0, 90)}\n",
        solve_sequence,
    ),
    Template(
        "factorial_mod",
        lambda r: {"m": r.choice([97, 1_000_003, 1_000_000_007])},
        lambda p: f"Read n (0 <= n <= 2000). Print n! modulo {p['m']}.",
        lambda r, p: f"{r.randint(0, 2000)}\n",
        solve_factorial_mod,
    ),
    Template(
        "palindrome",
        lambda r: {"case_sensitive": r.random() < 0.5},
        lambda p: (
            "Read one word of letters. Print YES if it reads the same backwards"
            + (" (upper and lower case differ)" if p["case_sensitive"] else " ignoring upper/lower case")
            + ", else NO."
        ),
        lambda r, p: _palindrome_word(r) + "\n",
        solve_palindrome,
    ),
    Template(
        "caesar",
        lambda r: {"k": r.randint(1, 25)},
        lambda p: f"{_LINE} Shift every letter {p['k']} places forward in the alphabet (z wraps to a); print it.",
        lambda r, p: _words(r) + "\n",
        solve_caesar,
    ),
    Template(
        "run_length",
        lambda r: {"style": r.choice(["letter-count", "count-letter"])},
        lambda p: (
            "Read a word of lowercase letters. Print its run-length encoding: each run of equal letters as "
            + (
                "the letter then the run length (aaab -> a3b1)."
                if p["style"] == "letter-count"
                else "the run length then the letter (aaab -> 3a1b)."
            )
        ),
        lambda r, p: "".join(r.choice("abc") * r.randint(1, 4) for _ in range(r.randint(1, 6))) + "\n",
        solve_run_length,
    ),
    Template(
        "sort",
        lambda r: {"order": r.choice(["ascending", "descending"])},
        lambda p: f"{_NUMS} Print them in {p['order']} order, separated by single spaces.",
        lambda r, p: _ints(r),
        solve_sort,
    ),
    Template(
        "count_letters",
        lambda r: {"letters": "".join(sorted(r.sample("abcdefghijklmnop", r.randint(2, 4))))},
        lambda p: f"{_LINE} Print how many of its characters are one of the letters {', '.join(p['letters'])}.",
        lambda r, p: _words(r, alphabet="abcdefghijklmnop") + "\n",
        solve_count_letters,
    ),
    Template(
        "power_mod",
        lambda r: {"m": r.choice([7, 1000, 1_000_000_007])},
        lambda p: f"Read two non-negative integers a and b on one line. Print a to the power b modulo {p['m']}.",
        lambda r, p: f"{r.randint(0, 10**6)} {r.randint(0, 10**9)}\n",
        solve_power_mod,
    ),
    Template(
        "long_words",
        lambda r: {"length": r.randint(3, 6)},
        lambda p: f"{_LINE} Print how many words have at least {p['length']} letters.",
        lambda r, p: _words(r) + "\n",
        solve_long_words,
    ),
    Template(
        "prefix",
        lambda r: {"op": r.choice(["sum", "max"])},
        lambda p: (
            f"{_NUMS} Print the running "
            + ("sums" if p["op"] == "sum" else "maxima")
            + " (the i-th value covers the first i integers), separated by single spaces."
        ),
        lambda r, p: _ints(r),
        solve_prefix,
    ),
    Template(
        "base",
        lambda r: {"base": r.randint(2, 9)},
        lambda p: f"Read a non-negative integer n. Print n written in base {p['base']} (no leading zeros).",
        lambda r, p: f"{r.randint(0, 10**6)}\n",
        solve_base,
    ),
    Template(
        "triangle",
        lambda r: {"char": r.choice("*#+@"), "shape": r.choice(["growing", "shrinking"])},
        lambda p: (
            f"Read n (1 <= n <= 20). Print n lines of the character {p['char']}: "
            + (
                "1 on the first line, 2 on the second, ..., n on the last."
                if p["shape"] == "growing"
                else "n on the first line, n-1 on the second, ..., 1 on the last."
            )
        ),
        lambda r, p: f"{r.randint(1, 20)}\n",
        solve_triangle,
    ),
    Template(
        "distinct",
        lambda r: {"order": r.choice(["first-appearance", "sorted"])},
        lambda p: (
            f"{_NUMS} Print each distinct value once, in "
            + ("order of first appearance" if p["order"] == "first-appearance" else "ascending order")
            + ", separated by single spaces."
        ),
        lambda r, p: _ints(r, lo=0, hi=9),
        solve_distinct,
    ),
    Template(
        "pair_sum",
        lambda r: {"t": r.randint(5, 20)},
        lambda p: f"{_NUMS} Print how many pairs of positions i < j have a[i] + a[j] = {p['t']}.",
        lambda r, p: _ints(r, lo=0, hi=15),
        solve_pair_sum,
    ),
    Template(
        "collatz",
        lambda r: {"report": r.choice(["steps", "peak"])},
        lambda p: (
            "Read a positive integer n. Repeat: if n is even halve it, else replace it by 3n + 1, until n "
            "is 1. Print "
            + ("the number of steps." if p["report"] == "steps" else "the largest value n took (the start included).")
        ),
        lambda r, p: f"{r.randint(1, 10_000)}\n",
        solve_collatz,
    ),
)


def _palindrome_word(rng: random.Random) -> str:
    half = "".join(rng.choices("abAB", k=rng.randint(1, 4)))
    word = half + rng.choice(["", "a", "B"]) + half[::-1]
    if rng.random() < 0.5:  # a near miss or a case flip
        i = rng.randrange(len(word))
        word = word[:i] + word[i].swapcase() + word[i + 1 :]
    return word


def param_key(params: Params) -> str:
    """A stable, readable key of a variant's parameters (part of the problem id)."""
    return ",".join(f"{k}={params[k]}" for k in sorted(params))
