"""Math reward through `math-verify`: the answer in the last `\\boxed{}` is compared symbolically to the truth.

Scoring (per response):
- `correct` = 1 when the last non-empty `\\boxed{...}` verifies against the ground truth (strict accuracy).
- `score` = `correct_weight` if correct; else, for a response without a boxed answer, `last_number_weight` if
  its last number equals the ground truth (a softer signal for small models that state the right number without
  boxing it; a wrong boxed answer earns none: `\\boxed{\\frac{1}{2}}` ends with the number 2); plus
  `format_weight` if a non-empty `\\boxed{...}` is present (small models copy the prompt's empty `\\boxed{}`;
  that earns nothing).
- Parsing or verification that crashes or times out, or a boxed answer longer than `MAX_BOXED_CHARS` (not a
  plain number), scores 0 for correctness and is counted (`reward/timeouts`, `reward/errors`). math-verify's
  timeout uses SIGALRM, which works only in a process's main thread: there it is used as is (each of parse and
  verify within `timeout_s`). Called from any other thread (a threaded actor, an
  agentic environment thread), verification runs in a forked child process (roll_core.isolation.ForkedWorker),
  where SIGALRM works again, and a deadline of three times `timeout_s` kills the child if even that fails (a hang
  in C code); a killed child is forked again for the next answer.

`extract_answer` (roll-eval's majority vote) gives the boxed answer in one spelling per value where that is
certain, so that samples agreeing on a value vote together: a plain number in canonical decimal form (`1,000`,
`1 000`, `1000.0` -> `1000`; `0.50` -> `0.5`), `\\dfrac`/`\\tfrac` as `\\frac`; anything else as boxed.

Covers: numbers, fractions, LaTeX expressions math-verify understands. Does not cover: free-form proofs.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence

from roll_core.isolation import CallTimeout, ChildError, ForkedWorker
from roll_envs.boxed import extract_boxed
from roll_envs.numeric import numbers_equal, parse_number
from roll_envs.rewards.base import Reward, RewardResult

#: A decimal number; a minus sign right after a digit, letter or closing bracket is a hyphen or an operator ("pages
#: 10-12", "x-3"), not the number's sign.
_NUMBER = re.compile(r"(?:(?<![\w)\]])-)?\d+(?:,\d{3})*(?:\.\d+)?")
#: A number that is part of a fraction, a power or an index (`3/2`, `2^{10}`, `\frac{1}{2}`, `x_2`) is not a
#: number the response states: `last_number` skips it.
_PART = re.compile(r"[/^_{]$")
_PART_AFTER = re.compile(r"^(?:/|\}\{|\^)")
#: A space (or LaTeX thin space) between thousands groups, as in `1 000` or `1\,000`; `1 2` is not twelve.
_GROUP_SPACE = re.compile(r"(?<=\d)(?:\s|\\,|\\ |~)(?=\d{3}(?!\d))")
#: Longest boxed answer verified symbolically. Longer ones (model output of thousands of nested braces or
#: parentheses) score 0 and count in `errors` at once: math-verify would spend its whole timeout on them, and its
#: SIGALRM timeout cannot interrupt C code (a regex over the text), so the time is not even bounded.
MAX_BOXED_CHARS = 1000


def last_number(text: str) -> str | None:
    """The last integer or decimal in `text` (thousands separators removed) that stands alone: not a part of a
    fraction, power or index (`_PART`); None when there is none."""
    for m in reversed(list(_NUMBER.finditer(text))):
        before, after = text[max(0, m.start() - 1) : m.start()], text[m.end() : m.end() + 2]
        if not (_PART.search(before) or _PART_AFTER.match(after)):
            return m.group().replace(",", "")
    return None


#: Fraction commands that mean `\frac` (a vote key spells them one way).
_FRAC = re.compile(r"\\[dt]frac(?![a-zA-Z])")


def canonical_answer(boxed: str) -> str:
    """One spelling of a boxed answer per value where that is certain (module docstring): plain numbers in
    canonical decimal form, `\\dfrac`/`\\tfrac` as `\\frac`, anything else stripped but unchanged."""
    text = boxed.strip()
    plain = _GROUP_SPACE.sub("", text)
    if _NUMBER.fullmatch(plain):
        value = parse_number(plain)
        if value.denominator == 1:
            return str(value.numerator)
        whole, _, digits = plain.replace(",", "").lstrip("-").partition(".")  # a decimal, not an integer
        return f"{'-' if value < 0 else ''}{int(whole or '0')}.{digits.rstrip('0')}"
    return _FRAC.sub(r"\\frac", text)


def _same_number(a: str, b: str) -> bool:
    """Plain numbers compared exactly (roll_envs.numeric: "1,000" = "1000", large integers never rounded)."""
    try:
        return numbers_equal(a, b)
    except ValueError:
        return a.strip() == b.strip()


def _verify_latex(boxed: str, answer: str, timeout_s: int) -> bool:
    """math-verify's symbolic check of `boxed` against `answer`; its timeouts need the main thread (SIGALRM)."""
    from math_verify import parse, verify

    gold = parse(f"${answer}$", parsing_timeout=timeout_s, raise_on_error=True)
    pred = parse(f"${boxed}$", parsing_timeout=timeout_s, raise_on_error=True)
    return bool(verify(gold, pred, timeout_seconds=timeout_s, raise_on_error=True))


class MathReward(Reward):
    """Boxed-answer correctness with optional last-number credit and a format bonus."""

    def __init__(
        self,
        correct_weight: float = 1.0,
        last_number_weight: float = 0.0,
        format_weight: float = 0.0,
        timeout_s: int = 5,
    ) -> None:
        if timeout_s < 1:
            raise ValueError(f"timeout_s must be >= 1 second (SIGALRM granularity), got {timeout_s}")
        from roll_envs.config import MATH_VERIFY

        # Every score imports math-verify; without it each would count as a reward error and score 0, silently.
        MATH_VERIFY.require()
        self.correct_weight = correct_weight
        self.last_number_weight = last_number_weight
        self.format_weight = format_weight
        self.timeout_s = timeout_s
        # Off the main thread: verification in a forked child (see the module docstring), started on first use.
        self._child = ForkedWorker(_verify_latex, name="math-verify")

    def _verify(self, boxed: str, answer: str, counters: dict[str, int]) -> bool:
        from math_verify.errors import TimeoutException

        plain = _GROUP_SPACE.sub("", boxed.strip())
        if _NUMBER.fullmatch(plain) and _NUMBER.fullmatch(answer.strip()):
            return _same_number(plain, answer)  # fast path: plain numbers
        if len(boxed) > MAX_BOXED_CHARS:
            counters["errors"] += 1
            return False
        try:
            if threading.current_thread() is threading.main_thread():
                return _verify_latex(boxed, answer, self.timeout_s)
            # Two parses and a verify, each under SIGALRM in the child; the deadline catches what SIGALRM cannot.
            return bool(self._child.call(boxed, answer, self.timeout_s, timeout=3 * self.timeout_s + 1))
        except (TimeoutException, CallTimeout):
            counters["timeouts"] += 1
        except ChildError as exc:
            counters["timeouts" if exc.kind == TimeoutException.__name__ else "errors"] += 1
        except Exception:  # a malformed model answer must not stop training; it is counted
            counters["errors"] += 1
        return False

    def extract_answer(self, response: str) -> str | None:
        """The answer this reward grades: the last non-empty \\boxed{} in one spelling per value
        (`canonical_answer`; None without one); roll-eval's majority vote counts these."""
        boxed = extract_boxed(response) or None
        return None if boxed is None else canonical_answer(boxed)

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        counters = {"timeouts": 0, "errors": 0, "no_boxed": 0}
        scores, correct, formatted = [], [], []
        for response, answer in zip(responses, answers):
            boxed = extract_boxed(response) or None  # an empty \boxed{} (copied from the prompt) is no answer
            ok = boxed is not None and self._verify(boxed, str(answer), counters)
            if boxed is None:
                counters["no_boxed"] += 1
            score = self.correct_weight if ok else 0.0
            if boxed is None and self.last_number_weight:
                num = last_number(response)
                if num is not None and _same_number(num, str(answer)):
                    score = self.last_number_weight
            if boxed is not None:
                score += self.format_weight
            scores.append(score)
            correct.append(float(ok))
            formatted.append(float(boxed is not None))
        return RewardResult(scores=scores, correct=correct, formatted=formatted, counters=counters)
