"""Parsing a generative judge's reply into a reward (roll_envs.rewards.judge documents the rules); also
`final_text`, which every built-in reward uses to read a thinking model's answer without its reasoning.

Score rules (`ScoreParser`, after dropping the reasoning): the score is that of the reply's last line when that line
is only a score (`Score: 8`, `**Final score**: 8/10`, `Rating: [[7]]`: the form the templates ask the judge to end
with; a judge that revises itself, `Score: 3 ...` then a last line `Score: 8`, scores 8). Else every score the reply
names must be the same one: scores that differ (`Score: 8 (a score: 3 would be for a wrong unit)`, once read as the
last, 3) are an invalid verdict, never a guess.

Verdict rules (`VerdictParser`, after dropping the reasoning and the echoes of the template's own questions, below):
a reply whose verdict is ambiguous is an invalid verdict (None: counted in `judge_invalid`), never a guess that may
be the wrong grade.
1. Marked labels (`[[yes]]`, `Verdict: yes`, `Judgement: yes`; not one followed by `?`): the label they all name;
   marked labels that disagree (`Verdict: yes ... the verdict: no`) are invalid (the last one was taken).
2. Else `Answer: yes` labels, those on a line of their own (`Answer: no`, `**Final answer**: no`) before those
   inside a sentence (`the response's answer: yes`, a quote): the label they all name, else invalid.
3. Else a label the reply opens with that states it (followed by the end, a line break, `.`, `!`, `,`, `;`, a
   bracket or a dash: `Yes.`, `**Incorrect**`): its label, unless another label stated after it, not negated,
   takes it back (`Yes, wait, no.`; `Incorrect. It is not correct.` stays incorrect). A label followed by `?` or
   `:` or a word states nothing: `Correct? No.` (a question; it was scored correct), `Correct: no` (a field name),
   `No doubt, it is correct` and `no errors` (a word; scored as no).
4. Else the only label the reply names, when one of its mentions states it, none is negated (`not correct`: labels
   cannot say "not") and no `?` comes before it (`Incorrect? Yes.` answers the judge's own question, which may be
   the opposite of the template's).
An echoed question: a question of the reply (from its sentence's start to its `?`) that is, up to case, spaces and
markup, a question the template itself asks (JudgeSpec passes them: `questions`), e.g. `Is the response correct?
Yes.` under a template asking "Is the response correct? ...". Its answer answers the template, so the echo is
dropped before the rules run (it was an invalid verdict: a `?` before the label); a question of the judge's own
(`Is it wrong? No.`) still is no verdict, and an echo answered twice differently (`... correct? Yes. ... correct?
No.`) is a label taken back: invalid.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Iterable, Mapping

from roll_core.errors import ConfigError

_THINK_END = "</think>"

# A decimal comma (`8,5`, as judges writing German or French do) has one or two digits after it and no further
# digit, comma or point: `8,9,10` is a list (read as 8). A number that runs on is no score: `1,000` (a thousands
# separator), `3,14159`, `1.2.3`, `1e1`, `0x5`, `6½`, `1_0` and a range `7-8` used to be read as their first digits
# (1, 3, 1, 1, 0, 6, 1, 7: a silent wrong reward); they are invalid verdicts now.
_RUNS_ON = r"(?!\d|\.\d|,\d{3}|[eE][-+]?\d|[xX][0-9a-fA-F]|_\d|[\u00bc-\u00be\u2150-\u215e]| ?[-\u2013] ?\d)"
_NUM = rf"([-+]?\d+(?:\.\d+|,\d{{1,2}}(?![.,]?\d))?){_RUNS_ON}"
#: `Score: 7`, `score = 7.5`, `Score: 8,5`, `Rating: **8**/10`, `**Score**: 8`, `__Score__: 8`, ``Score: `8` ``,
#: `Score: [[7]]`, `[[7]]` (the number is the first group that matched).
DEFAULT_SCORE_PATTERN = (
    rf"(?i)(?<![a-z])(?:score|rating)(?![a-z])[*_`]*\s*(?:is|[:=])?[\s*_`]*(?:\[\[\s*)?{_NUM}|\[\[\s*{_NUM}\s*\]\]"
)
# What follows a score that names its scale: `8/10`, `**8**/10`, `[[8]]/10`, `8 out of 10`.
_SCALE = re.compile(r"(?i)[\s*_`\]]*(?:/|out\s+of)\s*[*_`]*(\d+(?:\.\d+)?)")
# A negation right before a verdict label (`not correct`, `isn't **yes**`, `never acceptable`).
_NEGATED = re.compile(r"(?i)(?:\b(?:not|never)|n['\u2019]t)[\s*_`\"']+$")


def final_text(reply: str) -> str | None:
    """The reply without its reasoning: the text after the last `</think>`; None when a `<think>` block was
    opened and never closed (a reply cut off while reasoning has no verdict)."""
    if _THINK_END in reply:
        return reply.rsplit(_THINK_END, 1)[1]
    if "<think>" in reply:
        return None
    return reply


class ScoreParser:
    """`score` mode: the judge's number `pattern` captures, in [lo, hi], mapped to [0, 1] (module docstring: "Score
    rules")."""

    def __init__(self, lo: float, hi: float, pattern: str | None = None) -> None:
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ConfigError(f"env.reward.score_range=[{lo}, {hi}] must be two finite numbers, low < high")
        source = pattern or DEFAULT_SCORE_PATTERN
        try:
            self.pattern = re.compile(source)
        except re.error as exc:
            raise ConfigError(f"env.reward.score_pattern={source!r} is not a regular expression: {exc}") from None
        if self.pattern.groups < 1:
            raise ConfigError(f"env.reward.score_pattern={source!r} needs a capture group around the number")
        self.lo, self.hi = lo, hi
        # Your own pattern says itself what follows the number; the default one reads the scale a judge names.
        self.check_scale = pattern is None

    def __call__(self, reply: str) -> float | None:
        """The reward in [0, 1], or None for an invalid verdict (no match, not a number, out of range, a scale
        other than score_range's high, scores that disagree without a final score line)."""
        text = final_text(reply)
        if text is None:
            return None
        matches = list(self.pattern.finditer(text))
        if not matches:
            return None
        if _closes_reply(text, matches[-1]):  # the final line the templates ask for ("end with ... Score: N")
            return self._value(text, matches[-1])
        values = {self._value(text, m) for m in matches}
        return values.pop() if len(values) == 1 else None

    def _value(self, text: str, m: re.Match[str]) -> float | None:
        """The reward of one score match, None when it is no valid score."""
        raw = next((g for g in m.groups() if g is not None), None)
        if raw is not None and raw.count(",") == 1 and "." not in raw:  # a decimal comma: 8,5 is 8.5
            raw = raw.replace(",", ".")
        try:
            x = float(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None
        if not (math.isfinite(x) and self.lo <= x <= self.hi):
            return None
        scale = _SCALE.match(text, m.end()) if self.check_scale else None
        if scale is not None and float(scale.group(1)) != self.hi:
            return None  # `Score: 4/5` on a 0-10 scale is not 4 of 10 (it was read as 0.4)
        return (x - self.lo) / (self.hi - self.lo)


#: What may end a final score line after the score (and its scale): markup, `]]`, a full stop.
_LINE_END = re.compile(r"[\s*_`\].!]*\Z")
#: Words a final score line may open with (`**Final score**: 8`, `Overall rating: [[7]]`).
_SCORE_LINE_HEADS = ("", "final", "overall", "final overall", "total")


def _closes_reply(text: str, m: re.Match[str]) -> bool:
    """Whether the score match `m` is the reply's last line, alone (markup, a scale and a full stop aside)."""
    head = text[text.rfind("\n", 0, m.start()) + 1 : m.start()].strip(_MARKUP).lower()
    scale = _SCALE.match(text, m.end())
    return head in _SCORE_LINE_HEADS and _LINE_END.match(text, scale.end() if scale else m.end()) is not None


#: What follows a label that states it (`yes.`, `**No**`, `correct,`, `no (`, `yes - because`, the end): a label
#: followed by a word (`no doubt`, `no errors`, `correct in form`), a question mark or a colon states nothing.
_STATES = re.compile(r"[*_`\"'\]]*[ \t]*(?:$|\n|[.!,;()]|[\u2013\u2014]|-(?:\s|$))")
#: What follows a label in a question (`Correct?`, `Verdict: yes?`): no verdict.
_ASKED = re.compile(r"[*_`\"'\]]*\s*\?")
#: Markup a reply's first label may follow (`**Yes**`, `> No`, `# Correct`).
_MARKUP = " \t\n*_\"'`#>-"


class VerdictParser:
    """`verdict` mode: the judge's label (roll_envs.rewards.judge's docstring) mapped to its reward. An ambiguous
    reply is an invalid verdict, never a guess (module docstring: "Verdict rules")."""

    def __init__(self, labels: Mapping[str, float], questions: Iterable[str] = ()) -> None:
        """`labels`: verdict label -> reward; `questions`: the template's own questions, whose echoes in a reply are
        dropped (module docstring: "An echoed question")."""
        if not labels:
            raise ConfigError("env.reward.labels must map at least one verdict label to a reward")
        self.values: dict[str, float] = {}
        for label, value in labels.items():
            key = str(label).strip().lower()
            if not key:
                raise ConfigError("env.reward.labels: a verdict label is empty")
            if key in self.values:
                raise ConfigError(f"env.reward.labels: {label!r} appears twice (labels are case-insensitive)")
            if not math.isfinite(float(value)):
                raise ConfigError(f"env.reward.labels: the reward of {label!r} must be finite, got {value}")
            self.values[key] = float(value)
        # Longest first, so that "not correct" wins over "correct" at the same position.
        alts = "|".join(re.escape(k) for k in sorted(self.values, key=len, reverse=True))
        after = rf"[*_`]*\s*[:=][\s*_\"'`]*({alts})(?!\w)"  # `: yes`, `**: **yes**`, ``: `yes` ``
        self.marked = re.compile(rf"(?i)\[\[\s*({alts})\s*\]\]|\b(?:verdict|judgement|judgment){after}")
        self.answered = re.compile(rf"(?i)\banswer{after}")
        self.word = re.compile(rf"(?i)(?<!\w)({alts})(?!\w)")
        self.questions = frozenset(q for q in map(_normalised, questions) if q)

    def __call__(self, reply: str) -> float | None:
        """The label's reward, or None for an invalid verdict (module docstring: "Verdict rules")."""
        text = final_text(reply)
        if text is None:
            return None
        if self.questions:
            text = self._without_echoes(text)
        marked = [m for m in self.marked.finditer(text) if not _ASKED.match(text, m.end())]
        if marked:
            return self._agreed(marked)
        answered = [m for m in self.answered.finditer(text) if not _ASKED.match(text, m.end())]
        own_line = [m for m in answered if _own_line(text, m.start())]
        if answered:  # `Answer: no` on a line of its own wins over a quoted `the response's answer: yes`
            return self._agreed(own_line or answered)
        found = list(self.word.finditer(text))
        stated = [m for m in found if _STATES.match(text, m.end())]
        if not stated:
            return None  # only labels in questions (`Correct? No.`), as field names or as words (`no doubt`)
        first = found[0]
        if stated[0] is first and not text[: first.start()].strip(_MARKUP):  # "Yes. Because ..."
            label = first.group(1).lower()
            # ... unless taken back: another label stated after it, not negated ("Yes, wait, no.")
            if any(m.group(1).lower() != label and not self._negated(text, m) for m in stated[1:]):
                return None
            return self.values[label]
        # "Verdict: not correct" or "The response is not correct." named only the label `correct` and scored as
        # correct; the labels cannot say "not <label>" (unless one is that phrase, which matches whole first).
        if any(self._negated(text, m) for m in found):
            return None
        if "?" in text[: stated[0].start()]:  # "Incorrect? Yes.": an answer to the judge's own question
            return None
        return self._agreed(found)  # the only label named ("so, no."); "correct or incorrect." names two

    def _without_echoes(self, text: str) -> str:
        """`text` with its echoes of the template's questions blanked out (same length: positions keep)."""
        for m in reversed(list(_QUESTION.finditer(text))):
            if _normalised(m.group()) in self.questions:
                text = text[: m.start()] + " " * (m.end() - m.start()) + text[m.end() :]
        return text

    def _agreed(self, matches: list[re.Match[str]]) -> float | None:
        """The reward of the one label `matches` name; None when they name several."""
        named = {next(g for g in m.groups() if g is not None).lower() for m in matches}
        return self.values[named.pop()] if len(named) == 1 else None

    @staticmethod
    def _negated(text: str, m: re.Match[str]) -> bool:
        """Whether a negation (`not`, `never`, `n't`) stands right before the label `m`."""
        return _NEGATED.search(text, max(0, m.start() - 16), m.start()) is not None


#: A question: from its sentence's start (after `.`, `!`, `?`, `:`, a line break or a bracket) to its `?`.
_QUESTION = re.compile(r"(?<![^.!?:\n\[\]()])[^.!?:\n\[\]()]+\?")  # starts only there: linear time


def questions_of(text: str, template: bool = True) -> list[str]:
    """The questions `text` asks: a template's own text (`template`: not the values of its fields, `{prompt}` may
    ask one) or a system prompt (sent as it is)."""
    literal = "\n".join(part for part, *_ in string.Formatter().parse(text)) if template else text
    return [m.group() for m in _QUESTION.finditer(literal)]


def _normalised(question: str) -> str:
    """A question up to case, spaces and markup: `**Is the response  correct?**` is `is the response correct?`."""
    return " ".join(re.sub(r"[*_`\"'#>]", " ", question).lower().split()).rstrip(" ?") + "?" if question else ""


def _own_line(text: str, at: int) -> bool:
    """Whether what precedes position `at` on its line is only markup or `final` (`**Final answer**: no`)."""
    before = text[text.rfind("\n", 0, at) + 1 : at].strip(_MARKUP).lower()
    return before in ("", "final")
