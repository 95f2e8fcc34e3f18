"""Countdown: reach a target with given numbers and + - * /, each number used exactly once.

Each split holds distinct problems (numbers and target) while the draw finds new ones; once a small space runs out
it repeats them rather than fail. The answer is checked by parsing the model's boxed equation with Python's `ast`
(numbers, + - * / and parentheses only, LaTeX's `\\left(`, brackets and `\\frac` read as such, a number or closing
parenthesis before an opening one read as a product, as in `2(3+5)`; anything else scores 0): no model text is ever
executed. The ground truth string is "target|n1,n2,...".
"""

from __future__ import annotations

import ast
import itertools
import random
import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

from roll_core.seeds import Purpose, derive_seed
from roll_envs.rewards.base import Reward, RewardResult
from roll_envs.rewards.judge import final_text
from roll_envs.rewards.math import extract_boxed
from roll_envs.tasks.base import Problem, Task, stable_fraction

_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


#: Longest equation parsed: a countdown answer is a few numbers and operators; model output of thousands of
#: characters (1*1*...*1, deep parentheses) would only cost parse time and recursion depth.
MAX_EQUATION_CHARS = 1000


# LaTeX a model writes around a correct equation: sized delimiters (`\left(` ... `\right)`, `\big(`), brackets and
# braces used as parentheses, fractions and thin spaces. Left in, `\left(3 + 5\right) \times 2` was "not an
# expression" and a right answer scored 0 (counted as an error). Brackets only ever group here (a Python list is
# refused anyway); `\left.` is LaTeX's invisible delimiter. Bars stay: |x| is no parenthesis, and is refused.
_SIZED = re.compile(r"\\(?:left|right|[bB]igg?[lr]?)\s*(\\[{}]|[()\[\].])")
_SPACES = re.compile(r"\\[,;:! ]|\\q?quad\b")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_GROUPING = str.maketrans("[]{}", "()()")


def _plain_latex(text: str) -> str:
    """`text` with the LaTeX above turned into Python arithmetic; `\\frac{a}{b}` becomes `((a)/(b))`."""
    text = _SPACES.sub(" ", text)
    text = _SIZED.sub(lambda m: "" if m.group(1) == "." else m.group(1), text)
    for _ in range(MAX_EQUATION_CHARS):  # innermost fractions first; each pass removes at least one
        text, n = _FRAC.subn(r"((\1)/(\2))", text)
        if not n:
            break
    return text.replace("\\{", "(").replace("\\}", ")").translate(_GROUPING)


# Implicit products: `2(3+5)`, `(1+2)(3+4)`, `2\\left(3+5\\right)` are products in written maths (sympy's
# parse_latex and math-verify read them so); they scored 0 as "not an expression". Only a number or `)` followed by
# `(` is one: digits are never split (`23` stays 23), `2 3` stays a syntax error, and `(3+5)2` (rarely written)
# stays refused. `a/b(c)` is refused as ambiguous: school arithmetic reads it
# `(a/b)*c`, sympy's LaTeX grammar (juxtaposition binds tighter than `/`) `a/(b*c)`; `\\frac` or explicit
# parentheses say which is meant.
_TOKEN = re.compile(r"\d+|\s+|.", re.DOTALL)


def _implicit_products(text: str) -> str:
    """`text` with `*` inserted where a number or `)` meets `(`; ValueError where that product follows a `/`."""
    out: list[str] = []
    signif: list[str] = []  # the tokens so far without whitespace, to look back past spaces
    opened: list[int] = []  # index in `signif` of each unclosed "("
    operand_at: int | None = None  # where the number or group that just ended starts, in `signif`
    for tok in _TOKEN.findall(text):
        if tok.isspace():
            out.append(tok)
            continue
        if tok == "(" and operand_at is not None:
            before = operand_at - 1
            while before >= 0 and signif[before] in "+-":  # unary signs: `6/-2(3)` is as ambiguous as `6/2(3)`
                before -= 1
            if before >= 0 and signif[before] == "/":
                raise ValueError(f"ambiguous implicit product after '/' (write \\frac or parentheses): {text[:80]!r}")
            out.append("*")
            signif.append("*")
        at = len(signif)
        out.append(tok)
        signif.append(tok)
        if tok.isdigit():
            operand_at = at
        elif tok == ")":
            operand_at = opened.pop() if opened else None  # an unmatched ")" is the parser's syntax error
        else:
            operand_at = None
            if tok == "(":
                opened.append(at)
    return "".join(out)


def evaluate_equation(text: str) -> tuple[Fraction, list[int]]:
    """Exact value of an arithmetic expression and the integers it uses; ValueError for anything else."""
    text = text.split("=")[0]
    if len(text) > MAX_EQUATION_CHARS:  # (before any rewriting: the cap bounds the regex work too)
        raise ValueError(f"equation of {len(text)} characters (more than {MAX_EQUATION_CHARS})")
    text = _plain_latex(text.replace("\\times", "*").replace("\\cdot", "*").replace("\\div", "/"))
    text = text.replace("×", "*").replace("÷", "/").replace("−", "-")  # the symbols themselves (unicode minus too)
    text = _implicit_products(text)
    if len(text) > MAX_EQUATION_CHARS:
        raise ValueError(f"equation of {len(text)} characters (more than {MAX_EQUATION_CHARS})")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError) as exc:  # deep nesting fails in the parser, not as syntax
        raise ValueError(f"not an expression: {text[:80]!r}") from exc
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            used.append(node.value)
            return Fraction(node.value)
        raise ValueError(f"unsupported syntax {type(node).__name__}")

    try:
        return walk(tree.body), used
    except (RecursionError, MemoryError) as exc:  # a tree deeper than Python's recursion limit
        raise ValueError(f"expression too deep to evaluate: {text[:80]!r}") from exc


def solve(nums: list[int], target: int) -> str | None:
    """An equation over `nums` (each once, + - * /, left-nested, as problems are drawn) equal to `target`, or None.
    Brute force: fine for the few numbers of a countdown problem."""
    for order in itertools.permutations(nums):
        for ops in itertools.product("+-*/", repeat=len(nums) - 1):
            expr, value = str(order[0]), Fraction(order[0])
            for op, x in zip(ops, order[1:]):
                if op == "/" and x == 0:
                    break
                value = {"+": value + x, "-": value - x, "*": value * x, "/": value / x}[op]
                expr = f"({expr} {op} {x})"
            else:
                if value == target:
                    return expr
    return None


class CountdownReward(Reward):
    """1 for a boxed equation that uses exactly the given numbers and equals the target; `format_weight` for a box.
    Read after a thinking model's last `</think>` (roll_envs.rewards.judge.final_text): a response cut off inside its
    reasoning has no answer."""

    def __init__(self, format_weight: float = 0.0) -> None:
        self.format_weight = format_weight

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        counters = {"errors": 0, "no_boxed": 0, "wrong_numbers": 0}
        scores, correct, formatted = [], [], []
        for response, answer in zip(responses, answers, strict=True):
            # Only the answer after a thinking model's reasoning counts; one cut off inside it has none.
            answer_text = final_text(response) or ""
            boxed = extract_boxed(answer_text) or None  # an empty \boxed{} (copied from the prompt) is no answer
            ok = False
            if boxed is None:
                counters["no_boxed"] += 1
            else:
                try:  # a malformed ground truth (user data) is a counted error, never a crash
                    target_s, nums_s = answer.split("|")
                    value, used = evaluate_equation(boxed)
                    if Counter(used) != Counter(int(n) for n in nums_s.split(",")):
                        counters["wrong_numbers"] += 1
                    else:
                        ok = value == Fraction(int(target_s))
                except ValueError:
                    counters["errors"] += 1
            scores.append(float(ok) + (self.format_weight if boxed is not None else 0.0))
            correct.append(float(ok))
            formatted.append(float(boxed is not None))
        return RewardResult(scores=scores, correct=correct, formatted=formatted, counters=counters)


class CountdownTask(Task):
    """Countdown problems with `num_numbers` numbers in [1, max_number] and a positive integer target."""

    def __init__(
        self,
        reward: Reward,
        name: str = "countdown",
        num_numbers: int = 3,
        max_number: int = 10,
        train_size: int = 2000,
        eval_size: int = 100,
        eval_fraction: float = 0.2,
        seed: int = 0,
        system_prompt: str | None = None,
    ) -> None:
        super().__init__(reward)
        if num_numbers < 2:
            raise ValueError(f"num_numbers must be >= 2, got {num_numbers}")
        self.name, self.num_numbers, self.max_number = name, num_numbers, max_number
        self.system_prompt = system_prompt
        self._train = self._draw(random.Random(seed), train_size, False, eval_fraction)
        self._eval = self._draw(random.Random(derive_seed(seed, Purpose.HELD_OUT)), eval_size, True, eval_fraction)

    @classmethod
    def conformance_task(cls, seed: int, workdir: Path) -> CountdownTask:
        """A small instance for roll_core.testing.tasks' suite."""
        return cls(CountdownReward(format_weight=0.1), train_size=200, eval_size=40, seed=seed)

    def conformance_response(self, problem: Problem) -> str:
        """A correct boxed equation for `problem` (found by `solve`), for roll_core.testing.tasks' suite."""
        target, nums = problem.answer.split("|")
        expr = solve([int(n) for n in nums.split(",")], int(target))
        if expr is None:
            raise ValueError(f"countdown problem {problem.id} has no solution")
        return f"\\boxed{{{expr}}}"

    def _draw(self, rng: random.Random, n: int, held_out: bool, fraction: float) -> list[Problem]:
        out: list[Problem] = []
        seen: set[str] = set()
        attempts = misses = 0
        while len(out) < n:
            attempts += 1
            if attempts > 200 * max(n, 1):  # a split these settings leave (nearly) empty: say so, never spin
                raise ValueError(
                    f"countdown: cannot draw {n} {'held-out' if held_out else 'training'} problems with "
                    f"num_numbers={self.num_numbers}, max_number={self.max_number}, eval_fraction={fraction}: "
                    "widen max_number, or move eval_fraction away from 0 and 1 (or set that split's size to 0)"
                )
            nums = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            order = nums[:]
            rng.shuffle(order)
            expr = str(order[0])
            for x in order[1:]:
                expr = f"({expr} {rng.choice('+-*')} {x})"
            value, _ = evaluate_equation(expr)
            if value <= 0 or value.denominator != 1:
                continue
            key = f"{sorted(nums)}->{value}"
            if (stable_fraction(key) < fraction) != held_out:
                continue
            # Repeats were kept as drawn: the default 2000 training problems held 1209 distinct ones and the 100
            # held-out 89 (some weighed twice in held-out accuracy). A long run of repeats: the space is spent.
            if key in seen and misses < max(100, 10 * len(seen)):
                misses += 1
                continue
            if key not in seen:
                misses = 0
            seen.add(key)
            listed = ", ".join(map(str, nums))
            prompt = (
                f"Using the numbers [{listed}], write an equation that equals {value}. Use each number exactly "
                "once with + - * / and parentheses. Put the final equation in \\boxed{}."
            )
            out.append(
                Problem(
                    id=f"{self.name}:{key}",
                    prompt=prompt,
                    answer=f"{value}|{','.join(map(str, nums))}",
                    domain="countdown",
                )
            )
        return out
