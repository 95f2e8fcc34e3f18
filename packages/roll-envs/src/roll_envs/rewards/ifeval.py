"""Instruction following with verifiable constraints (IFEval-style): constraint checkers and their reward.

A constraint is data, a dict with a `type` and that type's arguments (an unknown type or key is an error; a key
that some type takes, given as null, is absent: a Parquet or Arrow list of constraint structs gives each
constraint every field of the list, null where another type's field is)::

    {"type": "word_count", "max": 20}             # count | min | max (inclusive; count excludes min/max)
    {"type": "sentence_count", "min": 2, "max": 3}
    {"type": "paragraphs", "count": 2}
    {"type": "bullets", "count": 3}
    {"type": "keywords", "include": ["ocean"], "min_count": 1}   # each word or phrase, min_count times at least
    {"type": "forbidden", "words": ["very"]}
    {"type": "json", "keys": ["answer"]}
    {"type": "case", "mode": "lower"}             # lower | upper
    {"type": "starts_with", "phrase": "Sure"}
    {"type": "ends_with", "phrase": "That is all"}
    {"type": "no_commas"}
    {"type": "quotation"}

Definitions (what each checker counts; tests/test_ifeval.py checks each by hand):
- A *word* is a maximal run of Unicode letters and digits (with the combining marks that follow them: the vowel
  signs of Hindi or Thai, a decomposed accent; "नमस्ते" and "สวัสดี" are one word each), in which a single
  apostrophe (' or ’) or hyphen between two such characters, or a `.` or `,` between two digits, joins the parts:
  "don't", "well-known", "3.14" and "1,000" are one word each; "e.g." is two ("e", "g"); `_` and punctuation
  separate words. A script written without spaces (Chinese, Thai) counts each unbroken run as one word.
- A *sentence* ends at a run of `.`, `!`, `?`, `…`, `।`, `॥` or `؟` (closing quotes or brackets may follow) that
  is followed by whitespace or the end of the text, at a run of `。`, `！` or `？` wherever it is (those scripts put
  no space after them), and at every line break; only pieces with at least one word count. So "Hi. How are you?"
  is 2, "3.14 is pi." is 1, every bullet line is its own sentence, and an abbreviation ("Dr. Smith") ends a
  sentence: there is no abbreviation list.
- A *paragraph* is a piece of the text between blank lines (lines empty or whitespace only, a no-break space
  included) holding a word.
- A *bullet* is a line whose first non-blank character is `-` or `*`, followed by a space or tab and then text that
  is not only dashes, asterisks, blanks and invisible characters: "- milk" and "  * eggs" (nested bullets count
  too) are bullets; "**bold**", "-5 degrees", "---", "- - -" and "- \\u200b" are not; numbered items are not.
- *keywords* / *forbidden*: a whole-word (or whole-phrase) match, case-insensitive: "very" is not in "everything";
  a space in a phrase matches any run of whitespace, line breaks included. A match may not touch a word: the
  character before it is no letter, digit or mark, nor a joiner (`'`, `’`, `-`) after one, nor (before a digit)
  a `.`/`,` after a digit; likewise after it ("known" is not in "well-known", "3" not in "3.14", "C++" not in
  "C++11").
- *Case-insensitive* means Unicode's full case folding (`str.casefold`), as starts_with and ends_with compare:
  "straße" is "STRASSE" (what `str.upper` makes of it, so a keyword survives an all-capitals answer), and a
  dotted "İ" or a dotless "ı" is an "i".
- *json*: the response, stripped of surrounding whitespace and optionally of one enclosing ```json (```JSON,
  ```Json or ```; on its own lines or on one) fence,
  parses as a JSON object holding every listed key at its top level; nothing may precede or follow it.
- *case*: lower means no uppercase or titlecase letter ("ǅ") and at least one lowercase one, as `str.islower`
  (IFEval's reading); upper the reverse (text without any cased letter, e.g. digits only or Chinese, satisfies
  neither).
- *starts_with* / *ends_with*: the response, stripped of surrounding whitespace (and, as IFEval's end check does,
  of the double quotes around it: `"... That is all."` ends with "That is all", so quotation and ends_with can
  both be met), begins (ends) with the phrase, case-insensitive, and the match is whole words as *word* reads
  them ("Sure" is not met by "Surely", "Don" not by "Don't", "all" not by "over-all"); a run of whitespace, line
  breaks included, reads as one space on both sides ("My  answer is" starts with "My answer is"). For ends_with,
  trailing sentence-ending punctuation (the `.`, `!`, `?`, `…`, `।`, `॥`, `؟`, `。`, `！` and `？` that end a
  sentence) is ignored on both sides ("that is all." ends with "That is all", "谢谢。" with "谢谢"); anything
  else after the phrase (a `)`, an emoji) is not: the answer must end with it.
- *Invisible characters do not count*: format characters (Unicode category Cf: zero-width space, non-joiner and
  joiner, soft hyphen, BOM, word joiner, direction marks, tags, ...) and the other characters Unicode marks
  default-ignorable (variation selectors, the combining grapheme joiner, the Hangul fillers) are dropped before
  words, sentences, paragraphs, a bullet's text, keywords, first/last phrases and quotation are read: "ve\\u200bry"
  is the word "very" (a forbidden word cannot hide behind one, nor a word count grow by one), a Persian word
  written with a zero-width non-joiner is one word, and a line holding only a zero-width space is blank.
- *Compatibility forms read as what they stand for* (NFKC, after the invisibles are dropped) wherever words are
  counted or matched (word_count, keywords, forbidden, starts_with, ends_with) and for no_commas: fullwidth
  "ｖｅｒｙ" is "very", the ligature "ﬁ" is "fi", a superscript "²" or circled "①" is a digit ("x²" is the one
  word "x2"), "½" is "1⁄2" (two words, as "1/2" is), "™" is the word "TM", "🄂" holds a comma ("1,"), and a
  decomposed accent is composed (a keyword "café" typed with a combining accent is the precomposed word).
  Sentence ends, paragraphs, bullets, case and json read the characters as written: "你好！谢谢" stays two
  sentences (NFKC would make `！` a `!`, which ends one only before a space), modifier letters "ᴴᴵ" are
  lowercase as `str.islower` reads them, and a JSON key is the exact string a JSON parser reads (an invisible
  character before or inside the object breaks it, as it breaks the parser).
- *Look-alike letters of other scripts are not folded* (no homoglyph table): "vеry" with a Cyrillic "е" is not
  "very", since a real multilingual answer writes Cyrillic and a fold would merge distinct words.
- *no_commas*: no comma of any script: no punctuation mark (Unicode category Po) that Unicode names a comma:
  `,`, the fullwidth `，`, the ideographic `、` (Japanese's comma), the Arabic `،`, the small `﹐`, ...
- *quotation*: the stripped response starts and ends with a double quote (" or “ ”) and holds a word inside.

Reasoning: the constraints apply to the answer, the text after the last `</think>` (roll_envs.rewards.judge's
`final_text`): a thinking model's reply (Qwen3's default) starts with its `<think>` block, whose words, commas,
capitals and first line met or broke constraints on the answer's behalf (a correct JSON answer after its
reasoning scored 0). A reply whose `<think>` block is never closed (cut off while reasoning) has no answer: it is
blank.

`InstructionReward.score` reads row i's constraints from `metadata[i]["constraints"]` (a list, or its JSON text)
when given, else from `answers[i]` (the list as JSON). Scores: the fraction of the row's constraints met (1 or 0
with `all_or_nothing`); `correct` = 1 when all are met; `formatted` = 1 when the response is not blank. A blank
response meets no constraint (a forbidden word is trivially absent from nothing). Rows whose constraints are
missing or invalid score 0 and are counted (`bad_constraints`, with the first reason logged), never raised on, and
are marked `RewardResult.failed` (a malformed ground truth says nothing about the response: the reward guard counts
such rows in `failed_unscored`, so data whose constraints never arrive stops the run instead of training on 0);
`unmet_<type>` counts the unmet constraints of each type present in the batch.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Re-exported: the reading rules live in _ifeval_text (this module documents them).
from roll_envs.rewards._ifeval_text import COMMAS, count_phrase, fold, has_word, inside_word, plain, visible, words
from roll_envs.rewards.base import Reward, RewardResult
from roll_envs.rewards.judge import final_text

log = logging.getLogger(__name__)


# A sentence end: terminal punctuation (and closing quotes/brackets) before whitespace or the end; or a line break.
_SENTENCE_END = re.compile(r"[.!?…।॥؟]+[\"'”’)\]]*(?=\s|$)|[。！？]+[\"'”’)\]」』]*|\n")
_BLANK_LINE = re.compile(r"\n[^\S\n]*\n")
_BULLET = re.compile(r"[ \t]*[-*][ \t]+(.*)")
# One enclosing fence, its language tag in any case, on separate lines or on one (```json {"a": 1}```), as the
# reference IFEval's JSON check strips it.
_FENCE = re.compile(r"```(?:json)?[ \t]*\n?(.*?)\s*```", re.S | re.I)
# What ends a sentence (`_SENTENCE_END`), ignored at the end of an ends_with phrase and of the answer.
_TRAILING_STOPS = ".!?…।॥؟。！？"
_QUOTES = '"“”'


def sentences(text: str) -> list[str]:
    """The sentences of `text` that hold a word, stripped, without their ending punctuation (module docstring).
    Invisible characters are dropped first: a zero-width space after a full stop must not hide a sentence end."""
    return [s.strip() for s in _SENTENCE_END.split(visible(text)) if has_word(s)]


def paragraphs(text: str) -> list[str]:
    """The paragraphs of `text` (pieces between blank lines) that hold a word, stripped; a line holding only
    invisible characters is blank."""
    return [p.strip() for p in _BLANK_LINE.split(visible(text)) if has_word(p)]


def bullets(text: str) -> list[str]:
    """The text of each markdown bullet line (`-` or `*`, see the module docstring)."""
    out = []
    for line in text.splitlines():
        m = _BULLET.fullmatch(line)
        # Markdown sees no bullet after an invisible character, but "- \u200b" shows an empty bullet.
        if m and visible(m.group(1)).replace("-", "").replace("*", "").strip():
            out.append(m.group(1).strip())
    return out


def json_object(text: str) -> dict[str, Any] | None:
    """The JSON object that the whole of `text` is (optionally in one ```json fence), or None."""
    body = text.strip()
    fenced = _FENCE.fullmatch(body)
    if fenced:
        body = fenced.group(1)
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser's recursion limit
        return None
    return value if isinstance(value, dict) else None


# --- argument checks (a constraint from data is validated before it is checked) --------------------------------


def _int(c: Mapping[str, Any], key: str, low: int = 0) -> int:
    value = c[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{key!r} must be an integer >= {low}, got {value!r}")
    return value


def _text(c: Mapping[str, Any], key: str) -> str:
    value = c[key]
    if not isinstance(value, str) or not has_word(value):
        raise ValueError(f"{key!r} must be text holding a word, got {value!r}")
    return value


def _texts(c: Mapping[str, Any], key: str, *, allow_empty: bool = False) -> list[str]:
    value = c[key]
    if not isinstance(value, list) or (not value and not allow_empty):
        raise ValueError(f"{key!r} must be a {'' if allow_empty else 'non-empty '}list of texts, got {value!r}")
    for v in value:
        if not isinstance(v, str) or not v.strip():
            raise ValueError(f"{key!r} must hold non-empty texts, got {v!r}")
    return value


def _phrases(c: Mapping[str, Any], key: str) -> None:
    """Keywords: texts that hold something visible (one of invisible characters alone would match nothing)."""
    for v in _texts(c, key):
        if not fold(v).strip():
            raise ValueError(f"{key!r} must hold visible texts, got {v!r}")


def bounds(c: Mapping[str, Any]) -> tuple[int, int | None]:
    """(min, max) of a counting constraint (`count`, or `min` and/or `max`); max None: no upper bound."""
    if "count" in c:
        if "min" in c or "max" in c:
            raise ValueError("give either 'count' or 'min'/'max', not both")
        n = _int(c, "count")
        return n, n
    if "min" not in c and "max" not in c:
        raise ValueError("needs 'count', 'min' or 'max'")
    lo = _int(c, "min") if "min" in c else 0
    hi = _int(c, "max") if "max" in c else None
    if hi is not None and hi < lo:
        raise ValueError(f"'min' {lo} is above 'max' {hi}")
    return lo, hi


def _in_bounds(n: int, c: Mapping[str, Any]) -> bool:
    lo, hi = bounds(c)
    return n >= lo and (hi is None or n <= hi)


def _bounds_words(c: Mapping[str, Any], unit: str) -> str:
    lo, hi = bounds(c)

    def n(k: int) -> str:
        return f"{k} {unit}" if k == 1 else f"{k} {unit}s"

    if lo == hi:
        return f"exactly {n(lo)}"
    if hi is None:
        return f"at least {n(lo)}"
    return f"at most {n(hi)}" if lo == 0 else f"between {lo} and {n(hi)}"


def _mode(c: Mapping[str, Any]) -> None:
    if c["mode"] not in ("lower", "upper"):
        raise ValueError(f"'mode' must be 'lower' or 'upper', got {c['mode']!r}")


def _keywords(c: Mapping[str, Any]) -> None:
    _phrases(c, "include")
    if "min_count" in c:
        _int(c, "min_count", low=1)


def _folded(text: str) -> str:
    """`fold`, stripped, each run of whitespace one space (an invisible difference must not decide a match)."""
    return " ".join(fold(text).split())


def _bodies(response: str) -> set[str]:
    """The stripped response, and the same without the double quotes around it (a phrase may itself end in one)."""
    text = _folded(response)
    return {text, text.strip(_QUOTES).strip()}


def _starts(response: str, phrase: str) -> bool:
    phrase = _folded(phrase)
    # Whole words: the phrase may not end inside a word of the text ("Sure" vs "Surely", "Don" vs "Don't").
    return bool(phrase) and any(
        text.startswith(phrase) and not inside_word(text, len(phrase)) for text in _bodies(response)
    )


def _ends(response: str, phrase: str) -> bool:
    phrase = _folded(phrase).rstrip(_TRAILING_STOPS).rstrip()
    for text in _bodies(response):
        text = text.rstrip(_TRAILING_STOPS).rstrip()
        if phrase and text.endswith(phrase) and not inside_word(text, len(text) - len(phrase)):
            return True
    return False


def _case(response: str, mode: str) -> bool:
    # str's own tests: a titlecase letter ("ǅ") is neither lower nor upper, and breaks both.
    return response.islower() if mode == "lower" else response.isupper()


def _quoted(response: str) -> bool:
    text = visible(response).strip()
    return len(text) >= 2 and (text[0], text[-1]) in (('"', '"'), ("“", "”")) and has_word(text[1:-1])


def _quote_list(items: Sequence[str]) -> str:
    quoted = [f'"{w}"' for w in items]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _describe_keywords(c: Mapping[str, Any]) -> str:
    n = c.get("min_count", 1)
    many = len(c["include"]) > 1
    what = f"the {'words' if many else 'word'} {_quote_list(c['include'])}"
    return f"Use {what} at least {n} times{' each' if many else ''}." if n > 1 else f"Include {what}."


@dataclass(frozen=True)
class Kind:
    """One constraint type: its keys (required, optional), argument check, checker and plain-words description."""

    required: frozenset[str]
    optional: frozenset[str]
    validate: Callable[[Mapping[str, Any]], Any]
    check: Callable[[Mapping[str, Any], str], bool]
    describe: Callable[[Mapping[str, Any]], str]


_BOUND_KEYS = frozenset({"count", "min", "max"})
_NONE: frozenset[str] = frozenset()

#: Every constraint type (name -> Kind).
KINDS: dict[str, Kind] = {
    "word_count": Kind(
        _NONE, _BOUND_KEYS, bounds, lambda c, r: _in_bounds(len(words(r)), c),
        lambda c: f"Answer in {_bounds_words(c, 'word')}.",
    ),
    "sentence_count": Kind(
        _NONE, _BOUND_KEYS, bounds, lambda c, r: _in_bounds(len(sentences(r)), c),
        lambda c: f"Write {_bounds_words(c, 'sentence')}.",
    ),
    "paragraphs": Kind(
        _NONE, _BOUND_KEYS, bounds, lambda c, r: _in_bounds(len(paragraphs(r)), c),
        lambda c: f"Write {_bounds_words(c, 'paragraph')}, separated by blank lines.",
    ),
    "bullets": Kind(
        _NONE, _BOUND_KEYS, bounds, lambda c, r: _in_bounds(len(bullets(r)), c),
        lambda c: f'Format your answer as {_bounds_words(c, "bullet point")} (lines starting with "- ").',
    ),
    "keywords": Kind(
        frozenset({"include"}), frozenset({"min_count"}), _keywords,
        lambda c, r: all(count_phrase(r, w) >= c.get("min_count", 1) for w in c["include"]),
        _describe_keywords,
    ),
    "forbidden": Kind(
        frozenset({"words"}), _NONE, lambda c: _phrases(c, "words"),
        lambda c, r: not any(count_phrase(r, w) for w in c["words"]),
        lambda c: f"Do not use the {'words' if len(c['words']) > 1 else 'word'} {_quote_list(c['words'])}.",
    ),
    "json": Kind(
        _NONE, frozenset({"keys"}), lambda c: _texts(c, "keys", allow_empty=True) if "keys" in c else None,
        lambda c, r: (obj := json_object(r)) is not None and all(k in obj for k in c.get("keys", ())),
        lambda c: "Give your whole answer as a JSON object"
        + (f" with the {'keys' if len(c['keys']) > 1 else 'key'} {_quote_list(c['keys'])}." if c.get("keys") else "."),
    ),
    "case": Kind(
        frozenset({"mode"}), _NONE, _mode, lambda c, r: _case(r, c["mode"]),
        lambda c: f"Write your whole answer in {'lowercase' if c['mode'] == 'lower' else 'capital'} letters only.",
    ),
    "starts_with": Kind(
        frozenset({"phrase"}), _NONE, lambda c: _text(c, "phrase"), lambda c, r: _starts(r, c["phrase"]),
        lambda c: f'Start your answer with the {"word" if len(words(c["phrase"])) == 1 else "phrase"} "{c["phrase"]}".',
    ),
    "ends_with": Kind(
        frozenset({"phrase"}), _NONE, lambda c: _text(c, "phrase"), lambda c, r: _ends(r, c["phrase"]),
        lambda c: f'End your answer with the {"word" if len(words(c["phrase"])) == 1 else "phrase"} "{c["phrase"]}".',
    ),
    "no_commas": Kind(
        _NONE, _NONE, lambda c: None, lambda c, r: COMMAS.isdisjoint(plain(r)),
        lambda c: "Do not use any commas.",
    ),
    "quotation": Kind(
        _NONE, _NONE, lambda c: None, lambda c, r: _quoted(r),
        lambda c: "Wrap your whole answer in double quotation marks.",
    ),
}  # fmt: skip
#: Every argument some type takes: one of them given as null is absent (module docstring).
_ARGUMENTS = frozenset().union(*(k.required | k.optional for k in KINDS.values()))
#: Why a row in IFEval's format is refused (its ids are not mapped: their counting differs from these types').
IFEVAL_HINT = (
    "IFEval's rows (`instruction_id_list` and `kwargs`, ids like 'length_constraints:number_words') are not read: "
    "the constraints are roll's own types (roll_envs.rewards.ifeval), whose counting differs from IFEval's, so "
    "write each row's `constraints` in them"
)


_IFEVAL_ID = r"[a-z_-]+:[a-z_]+"
# Text that is only IFEval ids, bare or in a list that is not JSON: "punctuation:no_comma", a Python list's repr
# "['startend:quotation']", ids separated by commas. (An id ends where a separator must follow: no backtracking.)
_SEP = r"[\s\[\]'\",]"
_IFEVAL_IDS_TEXT = re.compile(rf"{_SEP}*{_IFEVAL_ID}(?:{_SEP}+{_IFEVAL_ID})*{_SEP}*")


def _ifeval_shaped(value: Any) -> bool:
    """Whether `value` looks like IFEval's instruction ids or an {instruction_id(_list), kwargs} object."""
    items = value if isinstance(value, list) else [value]
    return any(
        (isinstance(v, str) and re.fullmatch(_IFEVAL_ID, v))
        or (isinstance(v, Mapping) and ({"instruction_id", "instruction_id_list"} & set(v)))
        for v in items
    )


def validate_constraint(c: Any) -> dict[str, Any]:
    """`c` as a checked constraint dict; ValueError naming what is wrong (unknown type or key, bad argument)."""
    if not isinstance(c, Mapping):
        raise ValueError(f"a constraint must be an object with a 'type', got {type(c).__name__} {str(c)[:60]!r}")
    c = {k: v for k, v in c.items() if not (v is None and k in _ARGUMENTS)}
    kind_name = c.get("type")
    kind = KINDS.get(kind_name) if isinstance(kind_name, str) else None
    if kind is None:
        raise ValueError(f"unknown constraint type {kind_name!r}; known: {', '.join(KINDS)}")
    keys = set(c) - {"type"}
    missing = sorted(kind.required - keys)
    unknown = sorted(keys - kind.required - kind.optional)
    if missing or unknown:
        takes = sorted(kind.required | kind.optional)
        problem = f"lacks {missing}" if missing else f"does not take {unknown}"
        raise ValueError(f"constraint {kind_name!r} {problem}; it takes {takes or 'no arguments'}")
    try:
        kind.validate(c)
    except ValueError as exc:
        raise ValueError(f"constraint {kind_name!r}: {exc}") from None
    return dict(c)


def parse_constraints(value: Any) -> list[dict[str, Any]]:
    """A row's constraints (a list of constraint dicts, or that list as JSON text), validated; ValueError else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            if _IFEVAL_IDS_TEXT.fullmatch(value):
                raise ValueError(f"{IFEVAL_HINT}; got {value[:80]!r}") from None
            raise ValueError(f"constraints are not JSON: {value[:60]!r}") from None
    if _ifeval_shaped(value):
        raise ValueError(f"{IFEVAL_HINT}; got {str(value)[:80]!r}")
    if not isinstance(value, list) or not value:
        raise ValueError(f"constraints must be a non-empty list, got {str(value)[:60]!r}")
    return [validate_constraint(c) for c in value]


def check(constraint: Mapping[str, Any], response: str) -> bool:
    """Whether `response` meets one validated constraint (a blank response meets none)."""
    return bool(response.strip()) and KINDS[constraint["type"]].check(constraint, response)


def describe(constraint: Mapping[str, Any]) -> str:
    """One validated constraint in plain words, as a prompt states it ("Answer in at most 20 words.")."""
    return KINDS[constraint["type"]].describe(constraint)


class InstructionReward(Reward):
    """Fraction of a row's constraints a response meets (see the module docstring)."""

    def __init__(self, all_or_nothing: bool = False) -> None:
        self.all_or_nothing = all_or_nothing

    def score(
        self,
        responses: Sequence[str],
        answers: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardResult:
        """Score `responses[i]` against row i's constraints (`metadata[i]["constraints"]`, else `answers[i]`)."""
        if len(responses) != len(answers) or (metadata is not None and len(metadata) != len(responses)):
            raise ValueError(
                f"{len(responses)} responses, {len(answers)} answers"
                + ("" if metadata is None else f", {len(metadata)} metadata rows")
            )
        counters = {"bad_constraints": 0, "empty_response": 0, "check_errors": 0}
        scores, correct, formatted, failed = [], [], [], []
        for i, (response, answer) in enumerate(zip(responses, answers)):
            meta = metadata[i] if metadata is not None else None
            source = meta["constraints"] if isinstance(meta, Mapping) and "constraints" in meta else answer
            answer_text = final_text(response)  # the answer after the reasoning (see the module docstring)
            response = "" if answer_text is None else answer_text
            nonblank = bool(response.strip())
            formatted.append(float(nonblank))
            failed.append(False)
            try:
                constraints = parse_constraints(source)
            except ValueError as exc:
                if not counters["bad_constraints"]:
                    log.warning("ifeval reward: row %d has bad constraints (scored 0): %s", i, exc)
                counters["bad_constraints"] += 1
                failed[-1] = True
                scores.append(0.0)
                correct.append(0.0)
                continue
            met = 0
            for c in constraints:
                key = f"unmet_{c['type']}"
                counters.setdefault(key, 0)
                try:
                    ok = check(c, response)
                except Exception as exc:  # a checker bug must cost one row, never the run
                    log.warning("ifeval reward: checking %s raised %s: %s", c, type(exc).__name__, exc)
                    counters["check_errors"] += 1
                    ok = False
                met += ok
                counters[key] += not ok
            counters["empty_response"] += not nonblank
            all_met = met == len(constraints)
            scores.append(float(all_met) if self.all_or_nothing else met / len(constraints))
            correct.append(float(all_met))
        return RewardResult(scores=scores, correct=correct, formatted=formatted, counters=counters, failed=failed)


@dataclass
class InstructionRewardConfig:
    """IFEval-style constraints (word/sentence/bullet counts, keywords, JSON, case, ...) read from each row."""

    _target_: str = "roll_envs.rewards.ifeval.InstructionReward"
    # 1 only when every constraint of the row is met (else the fraction met).
    all_or_nothing: bool = False
