"""Math reward through `math-verify`: the answer in the last `\\boxed{}` is compared symbolically to the truth.

Scoring (per response):
- `correct` = 1 when the last non-empty `\\boxed{...}` verifies against the ground truth (strict accuracy); a
  brace-less `\\boxed 5` is a box too, and escaped braces do not count toward balance (roll_envs.boxed).
- `score` = `correct_weight` if correct; else, for a response without a boxed answer, `last_number_weight` if
  its last number (`last_number`: `1.5e3` is 1500, `5 million` 5000000; `1,2345` is none) equals the ground
  truth (a softer signal for small models that state the right number without boxing it; a wrong boxed answer
  earns none: `\\boxed{\\frac{1}{2}}` ends with the number 2); plus
  `format_weight` if a non-empty `\\boxed{...}` is present (small models copy the prompt's empty `\\boxed{}`;
  that earns nothing).
- Quantities (`quantity`): when both the boxed answer and the truth are one number (integer, decimal, `a/b` or
  `\\frac{a}{b}` of integers) with at most a currency sign before it, a percent sign and a unit after it, they
  are compared exactly by value, whatever the spelling (`roll_envs.numeric`: integers exactly, others within
  1e-9; a decimal number may carry an exponent, `1.5e3`, `1e-5`, `3.e5`, or be written `1.5 \\times 10^{3}`; math-verify
  read `1e-5` as Euler's number minus 5, so `1e-05` was wrong against `0.00001` and `e-5` right, and missed
  `6.02 \\times 10^{23}` against 602000000000000000000000, whose float it rounds): `1000 dollars`, `\\$1,000`,
  `1000\\text{ dollars}` and `1000` are one answer (Qwen-math and
  math-verify strip units and currency signs; math-verify alone knew only its own list of unit words, so
  `1000 dollars` was wrong); a unit is `\\text{...}`/`\\mathrm{...}` of words, a degree sign, or up to four
  words after a space (the first of three letters or more, or a short unit such as `cm`, `kg`, `ft`: `5 x`,
  `5 pi` or `5xy` are not units), never a word such as `and`, `or`, `times`, `sqrt`, nor one that changes the
  value (`5 squared`, `5 halves`, `5 less`, bare or in `\\text{}`: no quantity, never equal to a truth of `5`;
  math-verify dropped the `\\text{}` of `5\\text{ dozen}` and graded 5, so such a text reaches it as bare words;
  `squared`/`cubed` after a unit word raise the unit, `5 cm squared` is 5). `n-fold` is the multiplier n: `5-fold`,
  `5\\text{-fold}`, `5\\text{ fold}`, `5 fold` and `5` are one answer, either way round (math-verify dropped the
  text of `5\\text{-fold}`, grading 5, but read `5-fold` as 5 minus letters, never 5; in a text that is no quantity
  the fold reaches it dropped, `x = 5-fold` is `x = 5`); a number word is not read (`three-fold`, as `three`, is
  no 3), and a percent of a multiplier (`5-fold%`) is no quantity. An answer wholly in one text command
  is read inside it (`\\text{5 dollars}` is 5; math-verify read it as one symbol, never 5). Thousands separators
  may be LaTeX: `5{,}000` and `5\\!,\\!000` are `5,000` (so `1{,}5` is no number, as `1,5` is not). Spaces
  between thousands groups (`5 000`, `1 234 567`, `5\\,000`, `5\\!000`, a thin space) join them where the
  grouping is certain (roll_envs.rewards._digit_groups: a first group of one to three digits, then groups of three,
  and no other number in the run): in the box, in the truth, in what reaches math-verify (`x = 5 000` was 5 times
  000 to it, right against 0) and in `last_number` alike (`the answer is 5 000` stated 000 there, `5{,}000` too);
  `3 4`, `1234 567` and `10 20 300` are numbers side by side, never merged; a grouping with an exponent
  (`1 000e5`, as `1,000e5`) is no number: a box holding one is wrong, a truth not judged, no last number; so are
  other numbers side by side in a box or a truth (`5 00`, `3 4`, `3 7/2`, `1 234,5`: math-verify read them as 5*0,
  3+4, (3+7)/2, {235, 5}, so `\\boxed{5 00}` was right against 0; `_digit_groups.numbers_side_by_side`), and
  `last_number` states none on their line. A mixed number is its sum everywhere (`3\\frac{1}{2}`, `3\\tfrac12`,
  `3 1/2` and `-3 1/2` are 3.5 and -3.5, as MATH writes `2\\frac{1}{2}` and math-verify reads it: roll_envs.
  rewards._mixed; `3 1/2` was refused, `3\\frac{1}{2} cups` wrong against 3.5, `last_number` stated 3). A
  unicode minus (U+2212) is a minus sign. (A product of variables written with a space, `3 abc`, therefore equals
  a truth of plain `3`; against a truth `3abc` it is verified symbolically as before.) A percent (`%`, `\\%`, the
  word `percent`) equals its number or its hundredth (`75\\%` = `75` = `0.75`, as in both conventions; math-verify
  graded `75%` right against `0.75` but `75\\%` wrong, and `7.5%` wrong against `7.5`); two percents compare as
  numbers. Anything with more in it
  (`1000 dollars and 5`) is no quantity and is verified symbolically, so a unit never hides a second number. A
  quantity with an `e` exponent verified symbolically against a non-quantity reaches math-verify as its plain
  decimal (never as `e`).
- Scale words: `hundred`, `thousand`, `million`, `billion`, `trillion` (a plural or capital too: `millions`,
  `Million`) right after a quantity's value, bare or in `\\text{}`/`\\mbox{}`/`\\mathrm{}` (`5 million`,
  `5\\text{ million}`, `\\$1.5 billion`, `5\\text{ million dollars}`), multiply it, in the truth and the answer
  alike: `5 million`, `5\\text{ million}`, `5,000,000`, `5000000` and `5 \\times 10^6` are one answer, and a scaled
  answer is never its unscaled number (`5 million` is not `5`, either way round). math-verify alone dropped a
  `\\text{ million}` (`5\\text{ million}` was right against 5, wrong against 5000000) and read a bare `million` as
  letters (`5 million` right only against itself). In a text that is no quantity, a scale word after a number or
  a closing bracket reaches math-verify as `\\cdot 10^{k}` (`x = 5\\text{ million}` is `x = 5000000`,
  `\\sqrt{2}\\text{ million}` is not `\\sqrt{2}`), never inside a text command (math-verify read the
  `\\text{5 \\cdot 10^{6}}` that `\\text{5 million}` became as 10: right against 10 and `\\text{3 million}`;
  `\\text{5 million}` is the quantity 5000000); a quantity with a scale word, as its plain value. A scaled percent
  (`5 million%`) is no quantity (math-verify reads it, scale rewritten). The percent rule is unchanged.
- Parsing or verification that crashes or times out, or a boxed answer longer than `MAX_BOXED_CHARS` (not a
  plain number), scores 0 for correctness and is counted (`reward/timeouts`, `reward/errors`). math-verify's
  timeout uses SIGALRM, which works only in a process's main thread: there it is used as is (each of parse and
  verify within `timeout_s`). Called from any other thread (a threaded actor, an
  agentic environment thread), verification runs in a forked child process (roll_core.isolation.ForkedWorker),
  where SIGALRM works again, and a deadline of three times `timeout_s` kills the child if even that fails (a hang
  in C code); a killed child is forked again for the next answer.
- A ground truth math-verify cannot read (it parses to nothing, as a blank one, `\\text{}` or `\\ldots` does, or
  its parse raises) cannot be matched by any response: a boxed response against it is not judged, but counted in
  `bad_answers` (warned once) and marked `RewardResult.failed` (roll's reward guard counts it in
  `failed_unscored`), scoring only its `format_weight`; it was a silent 0 for every sample. A response without a
  box is `no_boxed` as ever.
- What math-verify reads is one line, for the truth and the boxed answer alike: line breaks are spaces, and an
  odd number of bare `$` signs are currency signs, escaped (`\\$`); pairs delimit math inside text and stay.
  math-verify's own math-mode search does not cross a line break, so a matrix or tuple written over lines
  (`\\begin{pmatrix}1\\\\` newline `2\\end{pmatrix}`) scored 0 against the same answer on one line; and a lone
  `$` inside the box ended our `$...$` wrapper, so that `\\boxed{7 \\text{ or } $6}` was graded as its last
  piece, `6` (right against a truth of 6).

`extract_answer` (roll-eval's majority vote) gives the boxed answer in one spelling per value where that is
certain, so that samples the grader would grade alike vote together: a quantity as its exact value (an integer;
a terminating decimal `0.5` for `\\frac{1}{2}`, `1/2`, `0.50`; else a reduced `\\frac{1}{3}` for `2/6`; `5000000`
for `5 million`), units and currency dropped, `%` kept (`75%` is not merged with `75` or `0.75`: the grader
equates each with `75%`, not with each other); `\\dfrac`/`\\tfrac` as `\\frac`; anything else as boxed.
Decimals that only approximate a fraction (`0.333`) keep their own key. `same_answer(first, other)` (the vote's
equivalence, roll_core.eval_metrics) merges what one spelling cannot: `other` graded against a truth of `first`
as a response is (`\\frac{\\sqrt2}{2}` and `\\frac{1}{\\sqrt{2}}`, `x=2` and `2`, `.5` and `0.5`); two quantities
are one answer only when their keys are (the percent rule above); a check that times out or fails says
"different".

Reasoning: only the answer is graded, the text after the last `</think>` (roll_envs.rewards.judge's `final_text`,
as the ifeval reward reads it): a box or number inside a thinking model's reasoning is no answer. A response whose
`<think>` block is never closed (cut off while reasoning, at max_response_length) has no answer: `no_boxed`, no
last-number credit. A response without think tags is read whole.

Covers: numbers, fractions, LaTeX expressions math-verify understands. Does not cover: free-form proofs.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from fractions import Fraction

from roll_core.isolation import CallTimeout, ChildError, ForkedWorker
from roll_envs.boxed import extract_boxed
from roll_envs.numeric import MAX_EXPONENT, fractions_equal, parse_number
from roll_envs.rewards._digit_groups import grouped_exponents, join_digit_groups, numbers_side_by_side, side_by_side_at
from roll_envs.rewards._mixed import MIXED, mixed_value, plain_as_latex
from roll_envs.rewards.base import Reward, RewardResult
from roll_envs.rewards.judge import final_text

log = logging.getLogger(__name__)

#: A decimal number; a minus sign right after a digit, letter or closing bracket is a hyphen or an operator ("pages
#: 10-12", "x-3"), not the number's sign.
_NUMBER = re.compile(r"(?:(?<![\w)\]])-)?\d+(?:,\d{3})*(?:\.\d+)?")
#: A number as `last_number` reads it: digits joined by commas read as one token (so that `1,2345` is not read as
#: `1,234` and then `5`), a decimal part and a decimal exponent (`1.5e3` is 1500, not `1.5` and then `3`; `3.e5`,
#: a mantissa ending in its dot, is 300000, not 5); its sign as in `_NUMBER`.
_STATED_NUMBER = re.compile(r"(?:(?<![\w)\]])-)?(?P<int>\d+(?:,\d+)*)(?:\.\d+|\.(?=[eE][+-]?\d))?(?:[eE][+-]?\d+)?")
#: Commas in a stated number: thousands separators only between groups of three digits (roll_envs.numeric).
_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+")
#: Unicode minus (U+2212), which models copy from rendered text: the same sign as `-`.
_UNICODE_MINUS = "\u2212"
#: A number that is part of a fraction, a power or an index (`3/2`, `2^{10}`, `\frac{1}{2}`, `x_2`) is not a
#: number the response states: `last_number` skips it.
_PART = re.compile(r"[/^_{]$")
_PART_AFTER = re.compile(r"^(?:/|\}\{|\^)")
#: The brace-less arguments of a fraction (`\frac12`): parts, not the number 12.
_FRAC_ARGS = re.compile(r"\\[dtc]?frac\s*\d?$")
#: A bare decimal exponent before digits (`e5`, `E-3` not after a mantissa: `1 000 then e5`): the digits are no
#: number the response states (the `e` of a number is `_STATED_NUMBER`'s, never left before its digits).
_BARE_EXPONENT = re.compile(r"(?<![\w.])[eE][+-]?$")
#: A LaTeX comma between digits, `5{,}000` or `5\!,\!000` (spacing aside, the comma of `5,000`): read as `,`, so
#: that what holds for `5,000` (thousands separator or not) holds for it; `5, 000` (a list) is untouched.
_LATEX_COMMA = re.compile(r"(?<=\d)(?:\\!)*(?:\{,\}|,)(?:\\!)*(?=\d)")
#: Longest boxed answer verified symbolically. Longer ones (model output of thousands of nested braces or
#: parentheses) score 0 and count in `errors` at once: math-verify would spend its whole timeout on them, and its
#: SIGALRM timeout cannot interrupt C code (a regex over the text), so the time is not even bounded.
MAX_BOXED_CHARS = 1000


def last_number(text: str) -> str | None:
    """The last integer or decimal in `text` (thousands separators removed, spaces between thousands groups too
    where the grouping is certain, as `quantity` reads them: `5 000` is 5000; a decimal exponent kept, `1.5e3`, as
    `roll_envs.numeric.parse_number` reads it) that stands alone: not a part of a fraction, power or index
    (`_PART`), nor the digits of a bare exponent (`e5` after no mantissa: `1 000 then e5` gives `1000`, not `5`);
    None when there is none, or when the last one has commas that are no thousands grouping (`1,2345`,
    `1,5`, `1,2,3`: a decimal comma, a typo or a list written without spaces, no one number it surely states).
    A number with a scale word after it is its value (`5 million` gives `5000000`, `1.5 thousand` `1500`), and so is
    a mixed number (`3\\frac{1}{2}`, `3 1/2`: `3.5`); None for numbers side by side on one line (`5 00`, `3 4`), as
    in a box; the digits of a brace-less `\\frac12` are parts, not 12."""
    text = text.replace(_UNICODE_MINUS, "-")
    # `5{,}000`, `5\,000` and `5 000` state 5000 (not 000): separators read as `quantity` reads them
    text = plain_as_latex(join_digit_groups(_LATEX_COMMA.sub(",", text)))  # (`3 1/2` as `3\frac{1}{2}`)
    for m in reversed(list(_STATED_NUMBER.finditer(text))):
        before, after = text[max(0, m.start() - 9) : m.start()], text[m.end() : m.end() + 2]
        if _BARE_EXPONENT.search(text, max(0, m.start() - 3), m.start()):
            continue  # `e5`: an exponent of no number, not the number 5
        if not (_PART.search(before) or _PART_AFTER.match(after) or _FRAC_ARGS.search(before)):
            if any(s <= m.start() < e for s, e in grouped_exponents(text)) or side_by_side_at(text, m.start()):
                return None  # `1 000e5`, `5 00`: no one number (module docstring), never its `000e5` or `00`
            if "," in m["int"] and not _THOUSANDS.fullmatch(m["int"]):
                return None
            number, end = m.group().replace(",", ""), m.end()
            mixed = MIXED.match(text, m.start("int"))
            if mixed is not None and mixed.end("whole") == m.end():  # `3\frac{1}{2}` states 7/2, not 3 (`_mixed`)
                number, end = _value_key((-1 if number[0] == "-" else 1) * mixed_value(mixed)), mixed.end()
            scale = _SCALE.match(text, _SEP.match(text, end).end())
            if scale is None:
                return number
            try:  # `5 million` states 5000000, not 5 (module docstring: "Scale words")
                return _value_key(parse_number(number) * 10 ** _scale_exponent(scale["word"]))
            except ValueError:  # an exponent beyond numeric.MAX_EXPONENT: `_same_number` finds no value either
                return number
    return None


#: Fraction commands that mean `\frac` (a vote key spells them one way).
_FRAC = re.compile(r"\\[dt]frac(?![a-zA-Z])")

#: Longest text read as a quantity: Python's int() refuses strings of more than 4300 digits (ValueError), and a
#: vote key spells the value out in digits. Longer plain numbers are compared as text (`MathReward._verify`).
_MAX_QUANTITY_CHARS = 4000
#: The value a quantity starts with (after an optional sign and currency sign): `\frac{a}{b}` (or `\dfrac`,
#: `\tfrac`, `\frac12` of two digits), `a/b`, or a plain number. The first that matches is the value.
_VALUE = re.compile(
    r"\\[dtc]?frac\s*(?:\{\s*(?P<fn>-?\d+)\s*\}\s*\{\s*(?P<fd>-?\d+)\s*\}|(?P<fn1>\d)(?P<fd1>\d)(?!\d))"
    r"|(?P<sn>\d+)\s*/\s*(?P<sd>\d+)"
    r"|(?P<num>\d+(?:,\d{3})*(?:\.\d+|\.(?=[eE][+-]?\d))?(?:[eE][+-]?\d+)?)"
    r"(?:\s*(?:\\times|\\cdot|×)\s*10\s*\^\s*(?:\{\s*(?P<ten>[+-]?\d+)\s*\}|(?P<ten1>\d)))?"
)
#: A decimal exponent in a number (`1e-5`): math-verify reads the `e` as Euler's number (`_verify`).
_E_EXPONENT = re.compile(r"\d\.?[eE][+-]?\d")
#: A sign and a currency sign before the value, in either order (`-\$5`, `\$-5`).
_LEAD = re.compile(r"(?P<s1>-?)\s*(?:\\\$|\$)?\s*(?P<s2>-?)\s*")
#: Space between a value and what follows it (plain, LaTeX `\ `, `\,`, `\;`, `\:`, `\!`, `~`).
_SEP = re.compile(r"(?:\s|\\[ ,;:!]|~)*")
_PERCENT = re.compile(r"\\?%")
#: A unit: `\text{...}`-like of letters, a degree sign, or words after a space (`quantity`).
#: The text commands a unit (or a scale word) may be written in: `\text{ dollars}`, `\mbox{ million}`.
_WRAP = r"\\(?:text|textrm|textnormal|textit|textbf|mathrm|mathit|mbox)\s*\{"
_TEXT_UNIT = re.compile(_WRAP + r"(?P<words>[A-Za-z .]*)\}")
_DEGREE = re.compile(r"\^\s*(?:\\circ|\{\s*\\circ\s*\})|°")
_WORD_UNIT = re.compile(
    r"(?P<words>(?:[A-Za-z]{3,}|(?:cm|mm|km|kg|mg|ml|ft|lb|oz|hr|yd|mi)\b)(?:\s+[A-Za-z]{2,}){0,3})\.?"
)
_PERCENT_WORDS = {"percent", "percentage", "pct"}
#: Words that make a trailing "unit" part of the answer: connectives and math functions written without `\`.
_NOT_UNITS = {"and", "or", "plus", "minus", "times", "over", "divided", "by", "mod", "not", "sqrt", "root"}
_NOT_UNITS |= {"sin", "cos", "tan", "cot", "csc", "log", "exp", "inf", "infty", "infinity", "pi", "e", "i"}
#: Scale words and the power of ten they multiply the number by (module docstring: "Scale words"); a plural
#: (`5 millions`) or a capital (`5 Million`) is the same word.
_SCALES = {"hundred": 2, "thousand": 3, "million": 6, "billion": 9, "trillion": 12}
_SCALE_WORD = r"(?P<word>(?:hundred|thousand|million|billion|trillion)s?)(?![A-Za-z])"
#: A scale word right after a quantity's value (and its space): bare, or opening a text command
#: (`5\text{ million}`, `5\text{ million dollars}`, whose other words stay a unit).
_SCALE = re.compile(rf"(?P<cmd>{_WRAP})?(?:\s|\\[ ,;:!]|~)*{_SCALE_WORD}(?(cmd)(?P<close>\s*\}})?)", re.IGNORECASE)
#: A scale word after a number, a closing brace or parenthesis anywhere in a text that is no quantity
#: (`\sqrt{2}\text{ million}`, `x = 5 million`): rewritten for math-verify as `\cdot 10^{k}` (`_for_verify`),
#: which would otherwise drop a `\text{}` scale word and read `5\text{ million}` as 5.
_SCALE_AFTER = re.compile(
    rf"(?<=[\d}})])(?:\s|\\[ ,;:!]|~)*(?P<cmd>{_WRAP})?\s*{_SCALE_WORD}(?(cmd)(?P<close>\s*\}})?)", re.IGNORECASE
)
#: Words that change the number (`5 less`, and `_VALUE_WORDS`): the value is not the number. Scale words are read
#: by `_SCALE` right after the value; anywhere else (`5 dollars million`) they make no quantity.
_NOT_UNITS |= {"hundred", "hundreds", "thousand", "thousands", "million", "millions", "billion", "billions"}
_NOT_UNITS |= {"trillion", "trillions", "less", "more", "fewer", "than"}
#: Words that change the number (`5 squared`, `5 halves`) whose `\text{}` math-verify drops, grading `5\text{ dozen}`
#: as 5: such a text reaches it as bare words (`_for_verify`), read as letters, as the bare `5 dozen` is.
#: (`5\text{ less}` needs no such care: math-verify reads the bare `5 less` as 5 too.)
_VALUE_WORDS = {"dozen", "dozens", "squared", "cubed", "factorial", "fold", "power", "half", "halves", "third"}
_VALUE_WORDS |= {"thirds", "fourth", "fourths", "fifth", "fifths", "tenth", "tenths", "hundredth", "hundredths"}
_VALUE_WORDS |= {"thousandth", "thousandths"}
#: After a unit word these raise the unit, not the number (`5 cm squared`, `5\text{ feet cubed}`): still a unit.
_UNIT_POWERS = {"squared", "cubed"}


def _unit_words(words: str) -> list[str]:
    """The lower-case words of a unit (`_TEXT_UNIT`, `_WORD_UNIT`); a dot (`ft.`) separates words."""
    return words.replace(".", " ").lower().split()


def _changes_value(words: list[str]) -> bool:
    """Whether unit words after a number change its value (`_VALUE_WORDS`): `5 squared`, `5 dozen eggs`,
    `5 cm halves`; `5 cm squared` is a unit."""
    return bool(words) and (
        words[0] in _VALUE_WORDS or any(w in _VALUE_WORDS and w not in _UNIT_POWERS for w in words[1:])
    )


#: `n-fold` right after a quantity's value (and its scale word): the multiplier n (module docstring), bare (`5-fold`,
#: `5 fold`, `5fold`) or in a text command (`5\text{-fold}`, `5\text{ fold increase}`, whose other words stay a unit).
_FOLD = re.compile(rf"(?:(?P<cmd>{_WRAP})\s*-?\s*|-?)fold(?![A-Za-z])(?(cmd)(?P<close>\s*\}})?)", re.IGNORECASE)
#: The same after a number in a text that is no quantity (`x = 5-fold`): `_for_verify` drops it.
_FOLD_AFTER = re.compile(rf"(?<=\d)(?:\s|\\[ ,;:!]|~)*(?:{_WRAP}\s*-?\s*fold\s*\}}|-?fold(?![A-Za-z]))", re.IGNORECASE)


#: A whole answer in one text command, `\text{5 million}`, `\text{5 dollars}`: `quantity` reads what is inside it.
#: (math-verify reads such a text as one symbol, `5dollars`, never equal to 5.)
_WHOLE_TEXT = re.compile(_WRAP + r"(?P<body>[^{}]*)\}")
#: A text command and its body (group 1 ends where the body starts): `_for_verify` writes nothing into a body.
_TEXT_BODY = re.compile(rf"({_WRAP})[^{{}}]*\}}")
#: A text command of words after a number or a closing bracket, which math-verify drops (`5\text{ dozen}` is 5; a
#: text alone, `\text{half}`, it reads as a symbol): `_bare_value_words` checks its words.
_TEXT_AFTER = re.compile(rf"(?<=[\d}})])(?:\s|\\[ ,;:!]|~)*{_WRAP}(?P<words>[A-Za-z .]*)\}}")


def quantity(text: str) -> tuple[Fraction, bool] | None:
    """(value, is a percent) of an answer that is one number with at most a sign, a currency sign, a percent sign
    and a unit around it (module docstring: "Quantities"); None for anything else, a zero denominator included,
    and for a text longer than `_MAX_QUANTITY_CHARS`."""
    if len(text) > _MAX_QUANTITY_CHARS:
        return None
    whole = _WHOLE_TEXT.fullmatch(text.strip())
    text = text if whole is None else whole["body"]
    t = plain_as_latex(join_digit_groups(_LATEX_COMMA.sub(",", text.strip().replace(_UNICODE_MINUS, "-"))))
    lead = _LEAD.match(t)
    if lead is None or (lead["s1"] and lead["s2"]):
        return None
    mixed = MIXED.match(t, lead.end())  # `3\frac{1}{2}`, `3 1/2`: 7/2 (roll_envs.rewards._mixed)
    m = mixed or _VALUE.match(t, lead.end())
    if m is None:
        return None
    if mixed is not None:
        value = mixed_value(mixed)
    elif m["num"] is not None:
        try:
            value = parse_number(m["num"])  # (a decimal exponent included)
        except ValueError:  # an exponent beyond numeric.MAX_EXPONENT, or after a thousands separator
            return None
        ten = m["ten"] or m["ten1"]
        if ten is not None:
            if abs(int(ten)) > MAX_EXPONENT:
                return None
            value *= Fraction(10) ** int(ten)
        if max(abs(value.numerator), value.denominator).bit_length() > 3 * _MAX_QUANTITY_CHARS:
            return None  # its key's digits would pass int's string limit (4300 digits)
    else:
        num, den = (m["fn"], m["fd"]) if m["fn"] is not None else (m["fn1"], m["fd1"])
        num, den = (num, den) if num is not None else (m["sn"], m["sd"])
        if int(den) == 0:
            return None
        value = Fraction(int(num), int(den))
    if lead["s1"] or lead["s2"]:
        value = -value
    rest = t[_SEP.match(t, m.end()).end() :]
    spaced = m.end() < len(t) and t[m.end()] in " \t\n~\\"  # a bare word unit needs a space before it
    scale = _SCALE.match(rest)
    if scale is not None:  # `5 million`, `5\text{ million}`: the value is 5000000 (module docstring)
        value *= 10 ** _scale_exponent(scale["word"])
        rest = rest[scale.end() :]
        if scale["cmd"] and not scale["close"]:
            rest = scale["cmd"] + rest  # `\text{ million dollars}`: the other words are a unit, `\text{ dollars}`
        spaced = True  # the scale word ends at a non-letter (`_SCALE_WORD`): a word unit after it stands apart
        rest = rest[_SEP.match(rest).end() :]
        rest = "" if rest == "." else rest  # `5 million.` ends a sentence, as a word unit may (`_WORD_UNIT`)
    fold = _FOLD.match(rest)
    if fold is not None:  # `5-fold`, `5\text{-fold}`: the multiplier 5 (module docstring)
        rest = rest[fold.end() :]
        if fold["cmd"] and not fold["close"]:
            rest = fold["cmd"] + rest  # `\text{-fold increase}`: the other words are a unit
        spaced = True
        rest = rest[_SEP.match(rest).end() :]
        rest = "" if rest == "." else rest
    percent = bool(_PERCENT.match(rest))
    if percent:
        rest = rest[_PERCENT.match(rest).end() :].lstrip()
        rest = rest[_SEP.match(rest).end() :]
    if not rest:  # `5 million%`: which scale? `5-fold%`: a percent of what? no quantity
        return None if percent and (scale or fold) else (value, percent)
    for unit, needs_space in ((_TEXT_UNIT, False), (_DEGREE, False), (_WORD_UNIT, True)):
        u = unit.fullmatch(rest)
        if u is None or (needs_space and not (spaced or percent)):
            continue
        words = _unit_words(u.groupdict().get("words") or "")
        if any(w in _NOT_UNITS for w in words) or _changes_value(words) or (unit is _TEXT_UNIT and not words):
            return None
        if _PERCENT_WORDS.intersection(words):  # "75 percent (of them)": math-verify reads the word as \%
            if percent or scale or fold:
                return None  # "75% percent", "5 million percent", "5-fold percent"
            percent = True
        return value, percent
    return None


def same_quantity(a: tuple[Fraction, bool], b: tuple[Fraction, bool]) -> bool:
    """Whether two quantities are one answer: equal values (roll_envs.numeric's rule), or, when one of them only
    is a percent, its number or its hundredth equal to the other's value (module docstring)."""
    (x, x_pct), (y, y_pct) = a, b
    if x_pct == y_pct:
        return fractions_equal(x, y)
    pct, other = (x, y) if x_pct else (y, x)
    return fractions_equal(pct, other) or fractions_equal(pct / 100, other)


def _value_key(value: Fraction) -> str:
    """One spelling of an exact value: an integer, a terminating decimal, else a reduced `\\frac{p}{q}`."""
    if value.denominator == 1:
        return str(value.numerator)
    sign, v = ("-" if value < 0 else ""), abs(value)
    den, twos, fives = v.denominator, 0, 0
    while den % 2 == 0:
        den, twos = den // 2, twos + 1
    while den % 5 == 0:
        den, fives = den // 5, fives + 1
    if den != 1:
        return f"{sign}\\frac{{{v.numerator}}}{{{v.denominator}}}"
    places = max(twos, fives)
    whole, frac = divmod(v.numerator * 10**places // v.denominator, 10**places)
    return f"{sign}{whole}.{str(frac).zfill(places).rstrip('0')}"


def canonical_answer(boxed: str) -> str:
    """One spelling of a boxed answer per value where that is certain (module docstring): a quantity as its exact
    value (percent sign kept, unit and currency dropped), `\\dfrac`/`\\tfrac` as `\\frac`, anything else
    stripped but unchanged."""
    q = quantity(boxed)
    if q is not None:
        return _value_key(q[0]) + ("%" if q[1] else "")
    return _FRAC.sub(r"\\frac", boxed.strip())


def _same_number(number: str, answer: str) -> bool:
    """A stated number (`last_number`) against the truth as the boxed answer is graded: by value when the truth is
    a quantity (`1,000`, `\\$1000`, `1000 dollars`, `75\\%`; large integers never rounded), else as text."""
    truth = quantity(answer)
    if truth is None or len(number) > _MAX_QUANTITY_CHARS:
        return number.strip() == answer.replace(",", "").strip()
    try:
        stated = parse_number(number)
    except ValueError:  # an exponent beyond numeric.MAX_EXPONENT (`1e99999`): no value to compare
        return False
    return same_quantity((stated, False), truth)


def _scale_exponent(word: str) -> int:
    """The power of ten a scale word (`_SCALE_WORD`: any case, plural or not) multiplies by."""
    return _SCALES[word.lower().removesuffix("s")]


def _scale_power(m: re.Match[str]) -> str:
    """A scale word matched by `_SCALE_AFTER` as the power of ten it stands for; a text command it opened
    (`\\text{ million dollars}`) is opened again for the words after it."""
    power = f" \\cdot 10^{{{_scale_exponent(m['word'])}}}"
    return power + (m["cmd"] if m["cmd"] and not m["close"] else "")


def _bare_value_words(m: re.Match[str]) -> str:
    """A text command matched by `_TEXT_AFTER` as its bare words when they change the value (`_changes_value`),
    which math-verify reads as letters instead of dropping them; else unchanged."""
    return f" {m['words'].strip()} " if _changes_value(_unit_words(m["words"])) else m.group()


def _for_verify(text: str, q: tuple[Fraction, bool] | None) -> str:
    """`text` for math-verify: a quantity written with a decimal exponent (`1e-5`), a scale word or in one text
    command (`\\text{5 dollars}`) as its plain value, since math-verify reads the `e` as Euler's number, drops a
    `\\text{ million}` and reads `\\text{5 dollars}` as one symbol; in a text that is no quantity, each scale word
    after a number as `\\cdot 10^{k}` (`_SCALE_AFTER`), but never inside a text command (math-verify reads
    `\\text{5 \\cdot 10^{6}}` as 10), and a text command of words that change the value as those bare words
    (`_bare_value_words`); anything else unchanged."""
    text = join_digit_groups(text)  # (`x = 5 000` was 5 times 000 to math-verify)
    if q is None:
        text = _FOLD_AFTER.sub("", text)  # `x = 5-fold` is `x = 5` (math-verify read `5\text{-fold}` so already)
        inside = [(m.end(1), m.end()) for m in _TEXT_BODY.finditer(text)]

        def scale_power(m: re.Match[str]) -> str:
            return m.group() if any(s <= m.start() < e for s, e in inside) else _scale_power(m)

        return _TEXT_AFTER.sub(_bare_value_words, _SCALE_AFTER.sub(scale_power, text))
    if not (_E_EXPONENT.search(text) or _SCALE.search(text) or _WHOLE_TEXT.fullmatch(text.strip())):
        return text
    return _value_key(q[0]) + ("\\%" if q[1] else "")


#: Line breaks: math-verify's `$...$` search stops at them (module docstring).
_LINE_BREAKS = re.compile(r"\s+")
#: A dollar sign not escaped as `\$`. A lone one (an odd count) is a currency sign that would close the `$...$`
#: `_verify_latex` wraps a text in; pairs delimit math inside prose (`The answer is $x+1$.`) and stay.
_BARE_DOLLAR = re.compile(r"(?<!\\)\$")


def _one_line(text: str) -> str:
    """`text` as math-verify reads it: white space runs (line breaks included) as one space, and bare `$` signs
    escaped as `\\$` (a currency sign) when they are not pairs of math delimiters."""
    if len(_BARE_DOLLAR.findall(text)) % 2:
        text = _BARE_DOLLAR.sub(r"\\$", text)
    return _LINE_BREAKS.sub(" ", text).strip()


class BadTruthError(ValueError):
    """The ground truth parses to nothing math-verify can compare: no response can match it."""


def _verify_latex(boxed: str, answer: str, timeout_s: int) -> bool:
    """math-verify's symbolic check of `boxed` against `answer`; its timeouts need the main thread (SIGALRM).
    Raises BadTruthError when `answer` parses to nothing or its parse fails (not a timeout)."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    try:
        gold = parse(f"${answer}$", parsing_timeout=timeout_s, raise_on_error=True)
    except TimeoutException:
        raise
    except Exception as exc:
        raise BadTruthError(f"the ground truth {answer[:80]!r} does not parse: {exc}") from exc
    if not gold:  # verify() of an empty gold is False for every response: the truth, not the answer, is wrong
        raise BadTruthError(f"the ground truth {answer[:80]!r} parses to nothing")
    pred = parse(f"${boxed}$", parsing_timeout=timeout_s, raise_on_error=True)
    return bool(verify(gold, pred, timeout_seconds=timeout_s, raise_on_error=True))


def _answer_text(response: str) -> str:
    """The answer part of a response (`final_text`); "" for one cut off inside its `<think>` block (no answer)."""
    text = final_text(response)
    return "" if text is None else text


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
        self._warned_truth = False  # a bad ground truth is logged once: every sample of its problem would repeat it
        # Off the main thread: verification in a forked child (see the module docstring), started on first use.
        self._child = ForkedWorker(_verify_latex, name="math-verify")

    def _verify(self, boxed: str, answer: str, counters: dict[str, int]) -> bool | None:
        """Whether `boxed` is `answer`; None when `answer` is a ground truth math-verify cannot read (counted in
        `bad_answers`). Failures of the check itself are False, counted in `timeouts` or `errors`."""
        from math_verify.errors import TimeoutException

        got, truth = quantity(boxed), quantity(answer)
        boxed, answer = plain_as_latex(boxed), plain_as_latex(answer)  # `x = 3 1/2` is `x = 3\frac{1}{2}` (7/2)
        if got is not None and truth is not None:
            return same_quantity(got, truth)  # exact, units and currency aside (module docstring)
        if truth is None and grouped_exponents(answer):  # `1 000e5`: math-verify reads 000e5 (module docstring)
            return self._bad_truth(f"the ground truth {answer[:80]!r} holds digit groups with an exponent", counters)
        if truth is None and numbers_side_by_side(answer):  # `5 00`, `3 4`: math-verify reads 5*0, 3+4
            return self._bad_truth(f"the ground truth {answer[:80]!r} holds numbers apart by spaces", counters)
        if got is None and (grouped_exponents(boxed) or numbers_side_by_side(boxed)):
            return False
        boxed, answer = _for_verify(boxed, got), _for_verify(answer, truth)
        plain = join_digit_groups(boxed.strip())
        if _NUMBER.fullmatch(plain) and _NUMBER.fullmatch(answer.strip()):  # too long for a quantity
            return plain.replace(",", "") == answer.strip().replace(",", "")
        if len(boxed) > MAX_BOXED_CHARS:
            counters["errors"] += 1
            return False
        boxed, answer = _one_line(boxed), _one_line(answer)
        try:
            if threading.current_thread() is threading.main_thread():
                return _verify_latex(boxed, answer, self.timeout_s)
            # Two parses and a verify, each under SIGALRM in the child; the deadline catches what SIGALRM cannot.
            return bool(self._child.call(boxed, answer, self.timeout_s, timeout=3 * self.timeout_s + 1))
        except (TimeoutException, CallTimeout):
            counters["timeouts"] += 1
        except BadTruthError as exc:
            return self._bad_truth(str(exc), counters)
        except ChildError as exc:
            if exc.kind == BadTruthError.__name__:
                return self._bad_truth(str(exc), counters)
            counters["timeouts" if exc.kind == TimeoutException.__name__ else "errors"] += 1
        except Exception:  # a malformed model answer must not stop training; it is counted
            counters["errors"] += 1
        return False

    def _bad_truth(self, why: str, counters: dict[str, int]) -> None:
        """Count a ground truth math-verify cannot read (logged once); None: `_verify`'s "not judged"."""
        counters["bad_answers"] = counters.get("bad_answers", 0) + 1
        if not self._warned_truth:
            self._warned_truth = True
            log.warning("math reward: %s; its rows are not judged (counted in bad_answers; logged once)", why)
        return None

    def extract_answer(self, response: str) -> str | None:
        """The answer this reward grades: the last non-empty \\boxed{} in one spelling per value
        (`canonical_answer`; None without one); roll-eval's majority vote counts these."""
        boxed = extract_boxed(_answer_text(response)) or None
        return None if boxed is None else canonical_answer(boxed)

    def same_answer(self, first: str, other: str) -> bool:
        """Whether the answers `first` and `other` (`extract_answer`'s keys) are one answer for roll-eval's majority
        vote: `other` graded against a truth of `first` (module docstring); two quantities by exact value and
        percent sign, as their keys."""
        a, b = quantity(first), quantity(other)
        if a is not None and b is not None:  # no symbolic check needed; 75% stays apart from 75 and 0.75
            return a[1] == b[1] and fractions_equal(a[0], b[0])
        return bool(self._verify(other, first, {"timeouts": 0, "errors": 0}))  # a failed check: different answers

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        counters = {"timeouts": 0, "errors": 0, "no_boxed": 0, "bad_answers": 0}
        scores, correct, formatted, failed = [], [], [], []
        for response, answer in zip(responses, answers):
            response = _answer_text(response)  # after the reasoning (module docstring)
            boxed = extract_boxed(response) or None  # an empty \boxed{} (copied from the prompt) is no answer
            verdict = boxed is not None and self._verify(boxed, str(answer), counters)
            failed.append(verdict is None)  # a truth no response can match: not a verdict on this one
            ok = bool(verdict)
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
        return RewardResult(scores=scores, correct=correct, formatted=formatted, counters=counters, failed=failed)
