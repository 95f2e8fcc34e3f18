"""roll-algos writes its formulas in plain text (`G_t = r_t + gamma * G_{next valid t}`); this turns the clear ones
into TeX for KaTeX, and leaves the rest as text.

Contract: `find_formulas(text)` returns (start, end, tex) spans of `text` that are formulas: an equation whose left
side is a short symbol (`h = ...`, `KL_t = ...`, `loss = ...`, `coef *= ...`), or the text after a code name and a
colon at the start of a line (`` `ppo`: max(-A r, ...) ``). A span's right side runs to the next `;`, a sentence
end, two spaces, or a comma followed by prose, and is converted only if every word in it is a symbol (one letter,
optionally subscripted), a Greek letter, a known function (exp, log, clip, mean, sum_t, ...) or a code name
(`old_logp`, `clip_low`); one English word and the span stays text. Brackets must balance. The conversion is
syntactic (no meaning is inferred) and every result is checked by KaTeX at build time (docs_gen.katex), so a
formula is either rendered exactly as written or not at all.
"""

from __future__ import annotations

import re

GREEK = {
    "alpha": r"\alpha",
    "beta": r"\beta",
    "gamma": r"\gamma",
    "delta": r"\delta",
    "lambda": r"\lambda",
    "lam": r"\lambda",
    "mu": r"\mu",
    "pi": r"\pi",
    "theta": r"\theta",
    "sigma": r"\sigma",
    "tau": r"\tau",
    "rho": r"\rho",
    "eps": r"\epsilon",
    "epsilon": r"\epsilon",
}
FUNCTIONS = {
    "exp": r"\exp",
    "log": r"\log",
    "min": r"\min",
    "max": r"\max",
    "sum": r"\sum",
    "sqrt": r"\operatorname{sqrt}",
    "mean": r"\operatorname{mean}",
    "std": r"\operatorname{std}",
    "var": r"\operatorname{var}",
    "clip": r"\operatorname{clip}",
    "sg": r"\operatorname{sg}",
    "softmax": r"\operatorname{softmax}",
    "KL": r"\mathrm{KL}",
}
# Short code names the formulas use as variables (rendered upright, as names).
NAMES = {"logp", "ref", "loss", "ratio", "coef", "error", "target", "horizon", "tail", "pT", "pS"}

_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+(?:\.\d+)?(?:e-?\d+)?)|(?P<word>[A-Za-z][A-Za-z0-9]*(?:_(?:\{[^{}]*\}|[A-Za-z0-9]+(?:,[A-Za-z0-9]\b)?))*)"
    r"|(?P<op>\*=|\+=|-=|>=|<=|!=|->|\+-|[-+*/^=<>(),\[\]|'!])|(?P<ws>\s+))"
)
_LHS = r"[A-Za-z][A-Za-z0-9]*(?:_(?:\{[^{}]*\}|[A-Za-z0-9]+))?(?:\([A-Za-z0-9_, ]{1,12}\))?"
_EQUATION = re.compile(rf"(?<![\w`])(?P<lhs>{_LHS})\s*(?P<op>\*=|\+=|=)\s+")
_NAMED = re.compile(r"^(?:\s*-\s+)?`[^`]+`(?:\s*\([^)]*\))?:\s+", re.M)


def _word_tex(word: str) -> str | None:
    """TeX of one word, or None when it is prose."""
    head, _, sub = word.partition("_")
    if not sub:
        if len(word) == 1:
            return word
        if word in GREEK:
            return GREEK[word]
        if word in FUNCTIONS:
            return FUNCTIONS[word]
        if word in NAMES or (len(word) <= 3 and any(c.isdigit() for c in word)):
            return rf"\mathrm{{{word}}}"
        return None
    if sub.startswith("{") and sub.endswith("}"):
        inner = sub[1:-1]
        sub_tex = rf"\text{{{inner}}}" if " " in inner else (_word_tex(inner) or rf"\text{{{inner}}}")
    else:
        sub_tex = sub if len(sub) <= 2 or "," in sub else rf"\mathrm{{{sub}}}"
    if len(head) == 1 or head in GREEK or head in NAMES or head in ("sum", "mean", "std", "KL", "var"):
        base = _word_tex(head)
        return f"{base}_{{{sub_tex}}}"
    # A code name (old_logp, clip_low): upright, underscores kept.
    return rf"\mathrm{{{word.replace('_', chr(92) + '_')}}}"


_OPS = {"*": r"\cdot", ">=": r"\ge", "<=": r"\le", "!=": r"\ne", "+-": r"\pm", "->": r"\to", "*=": r"\mathrel{*}="}


def to_tex(expr: str) -> str | None:
    """TeX of a plain-text formula, or None when it holds prose, unbalanced brackets or nothing mathematical."""
    pos, parts, depth, prev_atom, has_op = 0, [], 0, False, False
    expr = expr.strip()
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None or m.end() == pos:
            return None
        pos = m.end()
        if m.group("ws"):
            continue
        if m.group("num") or m.group("word"):
            tex = m.group("num") or _word_tex(m.group("word"))
            if tex is None:
                return None
            if prev_atom:
                parts.append(r"\,")
            parts.append(tex)
            prev_atom = m.group("word") not in FUNCTIONS
            continue
        op = m.group("op")
        if op in "([":
            depth += 1
        elif op in ")]":
            depth -= 1
            if depth < 0:
                return None
        has_op = has_op or op not in "(),[]'"
        if op in "([" and prev_atom and parts and parts[-1] in FUNCTIONS.values():
            pass
        parts.append(_OPS.get(op, op))
        prev_atom = op in ")]'"
    if depth != 0 or not has_op:
        return None
    return " ".join(parts).replace(r" \, ", r" \, ")


def _right_side_end(text: str, start: int) -> int:
    """Where a formula starting at `start` ends (see the module docstring)."""
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth < 0:
                return i
        elif depth == 0:
            if c == ";" or c == "\n" or text.startswith("  ", i):
                return i
            if c == "." and (i + 1 == len(text) or text[i + 1] in " \n"):
                return i
            if (
                c == ","
                and re.match(r", (?:[a-z]{3,}|[A-Z][a-z]+) ", text[i:])
                and not re.match(r", (?:exp|log|min|max|sum|mean|std|clip|sqrt|eps|beta|gamma|sigma)\b", text[i:])
            ):
                return i
        i += 1
    return i


def find_formulas(text: str) -> list[tuple[int, int, str]]:
    """Formula spans of `text`: (start, end, tex), non-overlapping, in order (see the module docstring)."""
    spans: list[tuple[int, int, str]] = []
    code_spans = [m.span() for m in re.finditer(r"`[^`]*`", text)]

    def in_code(i: int) -> bool:
        return any(a <= i < b for a, b in code_spans)

    candidates = []
    for m in _NAMED.finditer(text):
        candidates.append((m.end(), m.end()))
    for m in _EQUATION.finditer(text):
        if not in_code(m.start()):
            candidates.append((m.start(), m.end()))
    for start, rhs in sorted(candidates):
        if spans and start < spans[-1][1]:
            continue
        end = _right_side_end(text, rhs)
        source = text[start:end].rstrip(", ")
        if not source.strip() or in_code(start):
            continue
        tex = to_tex(source)
        if tex is not None:
            spans.append((start, start + len(source), tex))
    return spans
