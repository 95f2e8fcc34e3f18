"""How the instruct reward reads text (roll_envs.rewards.ifeval; its docstring states the rules): which characters
do not count (invisible ones), compatibility forms, case folding, words, and whole-word phrase matching.

`visible` drops the invisible characters; `plain` is that in NFKC; `fold` is `plain` fully case-folded, the form
in which keywords and first or last phrases are compared. `words` reads `plain` text, so what a reader sees as one
word ("ve\\u200bry", "ｖｅｒｙ") is one word, found by a keyword "very".
"""

from __future__ import annotations

import functools
import re
import unicodedata

#: Invisible characters that are not format characters (category Cf) but that Unicode also marks default-ignorable:
#: the combining grapheme joiner, the Hangul fillers, Khmer's inherent vowels, the variation selectors.
_OTHER_IGNORABLE = frozenset(
    {0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x3164, 0xFFA0, 0x180B, 0x180C, 0x180D, 0x180F}
    | set(range(0xFE00, 0xFE10))
    | set(range(0xE0100, 0xE01F0))
)


def _char_class(cps: list[int]) -> str:
    """A regex character class holding the sorted code points `cps` (as ranges)."""
    ranges: list[list[int]] = []
    for cp in cps:
        if ranges and ranges[-1][1] == cp - 1:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp])
    # No mark or invisible character is special in a class (a bracket, backslash, caret or hyphen): nothing to escape.
    return "[" + "".join(chr(a) if a == b else f"{chr(a)}-{chr(b)}" for a, b in ranges) + "]"


def _unicode_classes() -> tuple[str, tuple[str, str], frozenset[str]]:
    """Regex character classes of every Unicode combining mark (categories Mn, Mc, Me), which `\\w` leaves out
    (without them a Devanagari or Thai word, or a decomposed accent, falls apart into pieces), and of every
    invisible character, those in the BMP and those past it (format characters, category Cf: zero-width space,
    soft hyphen, BOM, word joiner, direction marks, tags, ...; and `_OTHER_IGNORABLE`); and every comma
    (punctuation, category Po, that Unicode names a comma: "ARABIC COMMA", "IDEOGRAPHIC COMMA", ...)."""
    marks, invisible, commas = [], [], set()
    for cp in (*range(0x30000), *range(0xE0000, 0xE1000)):  # no mark, invisible or comma lies elsewhere
        category = unicodedata.category(chr(cp))
        if category == "Cf" or cp in _OTHER_IGNORABLE:
            invisible.append(cp)
        if category.startswith("M"):
            marks.append(cp)
        elif category == "Po" and "COMMA" in unicodedata.name(chr(cp), ""):
            commas.add(chr(cp))
    bmp = [cp for cp in invisible if cp < 0x10000]
    astral = [cp for cp in invisible if cp >= 0x10000]
    return _char_class(marks), (_char_class(bmp), _char_class(astral)), frozenset(commas)


_M, _INVISIBLE_CLASSES, COMMAS = _unicode_classes()
# Two passes, as a class of BMP characters compiles to a table (one lookup a character) and one reaching past the
# BMP to a list of ranges (a test per range: 4x slower); most answers hold no character past the BMP.
_INVISIBLE_BMP, _INVISIBLE_ASTRAL = (re.compile(c) for c in _INVISIBLE_CLASSES)
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")
#: A letter or digit with the marks on it (marks and `[^\W_]` are disjoint, so the nesting cannot backtrack).
_WC = rf"[^\W_]{_M}*"
_WORD = re.compile(rf"(?:{_WC})+(?:(?:['’-]|(?<=\d)[.,](?=\d))(?:{_WC})+)*")
_JOINERS = "'’-"


def visible(text: str) -> str:
    """`text` without its invisible characters (see `_unicode_classes`)."""
    if text.isascii():
        return text
    text = _INVISIBLE_BMP.sub("", text)
    return _INVISIBLE_ASTRAL.sub("", text) if _ASTRAL.search(text) else text


def plain(text: str) -> str:
    """`visible(text)` in NFKC: compatibility forms read as what they stand for ("ｖｅｒｙ" is "very")."""
    return text if text.isascii() else unicodedata.normalize("NFKC", visible(text))


@functools.lru_cache(maxsize=64)  # a response is folded once for all its keywords
def fold(text: str) -> str:
    """`plain(text)` fully case-folded ("ß" is "ss", as "STRASSE" is). Folding turns "İ" into "i" and a combining
    dot, which would keep "İstanbul" from matching "istanbul": that dot is dropped (an "i" has one); a dotless "ı"
    reads as "i" too (the keyword match has always read it so: `re.IGNORECASE` pairs them)."""
    folded = plain(text).casefold()
    if not folded.isascii():  # the dot goes before NFKC may move a mark between it and its "i"
        folded = unicodedata.normalize("NFKC", folded.replace("i\u0307", "i").replace("ı", "i"))
    return folded


def words(text: str) -> list[str]:
    """The words of `plain(text)` (see roll_envs.rewards.ifeval's docstring)."""
    return _WORD.findall(plain(text))


def has_word(text: str) -> bool:
    """Whether `plain(text)` holds a word."""
    return _WORD.search(plain(text)) is not None


def _word_char(ch: str) -> bool:
    """A character inside a word: a letter, a digit or a combining mark (see `words`)."""
    return ch.isalnum() or unicodedata.category(ch).startswith("M")


def _joiner(text: str, j: int) -> bool:
    """Whether `text[j]` joins two parts of one word as `words` reads it ("don't", "well-known", "3.14")."""
    if not 0 < j < len(text) - 1:
        return False
    if text[j] in _JOINERS:
        return _word_char(text[j - 1]) and text[j + 1].isalnum()
    return text[j] in ".," and text[j - 1].isdecimal() and text[j + 1].isdecimal()


def inside_word(text: str, k: int) -> bool:
    """Whether the cut before `text[k]` falls inside one word (module docstring): "Don" is not the first word of
    "Don't", nor "all" the last of "over-all", as keywords read them."""
    return 0 < k < len(text) and (
        (_word_char(text[k - 1]) and _word_char(text[k])) or _joiner(text, k) or _joiner(text, k - 1)
    )


def _opens(text: str, i: int) -> bool:
    """Whether a phrase may start at `text[i]`: no word character right before it, nor a joiner that follows one
    ("well-" before "known", "don'" before "t"), nor a digit and `.`/`,` before a digit ("3." before "14")."""
    if i == 0:
        return True
    before = text[i - 1]
    if _word_char(before):
        return False
    if i == 1:
        return True
    if before in _JOINERS:
        return not _word_char(text[i - 2])
    return not (before in ".," and text[i - 2].isdecimal() and text[i].isdecimal())


def _closes(text: str, j: int) -> bool:
    """Whether a phrase may end before `text[j]`: no word character there, nor a joiner before a letter or digit
    ("well" before "-known"), nor `.`/`,` between a digit and a digit ("3" before ".14")."""
    if j == len(text):
        return True
    after = text[j]
    if _word_char(after):
        return False
    if j + 1 == len(text):
        return True
    if after in _JOINERS:
        return not text[j + 1].isalnum()
    return not (after in ".," and text[j - 1].isdecimal() and text[j + 1].isdecimal())


@functools.lru_cache(maxsize=1024)
def _phrase_pattern(folded_phrase: str) -> re.Pattern[str]:
    """The folded phrase, any run of whitespace standing for each space (literal parts: no lookaround, so a
    search jumps from one occurrence of the first part to the next)."""
    parts = folded_phrase.split()
    if not parts:
        raise ValueError("a phrase to count must hold a visible character")
    return re.compile(r"\s+".join(re.escape(part) for part in parts))


def count_phrase(text: str, phrase: str) -> int:
    """Whole-word, case-insensitive occurrences of `phrase` in `text` (non-overlapping, from the left; any run of
    whitespace in the text matches a space of the phrase; both are read `fold`ed)."""
    text, pattern = fold(text), _phrase_pattern(fold(phrase))
    n, pos = 0, 0
    while (m := pattern.search(text, pos)) is not None:
        start, end = m.span()
        if _opens(text, start) and _closes(text, end):
            n, pos = n + 1, end
        else:
            pos = start + 1  # an occurrence inside a word: the next may overlap it
    return n
