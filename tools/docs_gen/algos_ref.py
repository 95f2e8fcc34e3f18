"""The algorithms reference: roll-algos' module and function docstrings (the math of every loss and estimator).

Contract: `algorithms_page()` returns the page's markdown: for each module of `MODULES`, its docstring, then each
public function and class (its `__all__`, else its public names) with its signature and docstring. Docstrings are
Google style: prose paragraphs and `- ` lists stay as they are; `Args:` / `Returns:` / `Raises:` sections become
lists. Formulas written in plain text become TeX where docs_gen.ascii_math recognises them and KaTeX accepts the
result (checked under Node.js at build time); every other formula stays as the docstring writes it. Nothing is
rewritten by hand here: a changed docstring changes the page.
"""

from __future__ import annotations

import importlib
import inspect
import re

from docs_gen.ascii_math import find_formulas
from docs_gen.katex import check_tex
from docs_gen.markdown import inline, slug

MODULES = ("advantages", "losses", "corrections", "asyppo", "kl", "preference", "distill", "sft", "trajectories")
SECTIONS = ("Args", "Arguments", "Returns", "Raises", "Yields", "Example", "Examples", "Note")
_MATH = "\x00MATH{}\x00"


def _public(module) -> list[tuple[str, object]]:
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    out = []
    for name in names:
        obj = getattr(module, name, None)
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module.__name__:
            out.append((name, obj))
    return out


def _with_math(text: str, formulas: list[str]) -> str:
    """Inline markdown of `text` with its recognised formulas swapped for placeholders (their TeX goes into
    `formulas`; `_resolve` puts back those KaTeX accepts)."""
    out, pos = [], 0
    for start, end, tex in find_formulas(text):
        out.append(inline(text[pos:start]))
        out.append(_MATH.format(len(formulas)))
        formulas.append(tex + "\x01" + text[start:end])
        pos = end
    out.append(inline(text[pos:]))
    return "".join(out)


def _blocks(doc: str) -> list[tuple[str, list[str]]]:
    """A docstring as blocks: ("para", lines), ("list", items), ("section", [name, *items])."""
    blocks: list[tuple[str, list[str]]] = []
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
            continue
        header = re.match(rf"^({'|'.join(SECTIONS)}):\s*$", line.strip())
        if header and not line.startswith(" "):
            items: list[str] = []
            i += 1
            while i < len(lines) and (lines[i].startswith(" ") or not lines[i].strip()):
                text = lines[i].strip()
                if (text and lines[i].startswith("    ") and not lines[i].startswith("     ")) or not items:
                    if text:
                        items.append(text)
                elif text:
                    items[-1] += " " + text
                i += 1
            blocks.append(("section", [header.group(1), *items]))
            continue
        if line.lstrip().startswith("- "):
            items = []
            while i < len(lines) and lines[i].strip():
                if lines[i].lstrip().startswith("- "):
                    items.append(lines[i].lstrip()[2:].strip())
                else:
                    items[-1] += " " + lines[i].strip()
                i += 1
            blocks.append(("list", items))
            continue
        para = []
        while i < len(lines) and lines[i].strip() and not lines[i].lstrip().startswith("- "):
            if re.match(rf"^({'|'.join(SECTIONS)}):\s*$", lines[i].strip()):
                break
            para.append(lines[i].strip())
            i += 1
        blocks.append(("para", para))
    return blocks


def docstring_markdown(doc: str, formulas: list[str]) -> str:
    """Markdown of one docstring (see the module docstring); formulas are collected into `formulas`."""
    out = []
    for kind, body in _blocks(doc):
        if kind == "para":
            out.append(_with_math(" ".join(body), formulas))
        elif kind == "list":
            out.append("\n".join(f"- {_with_math(item, formulas)}" for item in body))
        else:
            name, *items = body
            lines = [f"**{name}**", ""]
            for item in items:
                m = re.match(r"^([A-Za-z_][\w, ]*?)(\s*\([^)]*\))?:\s+(.*)$", item)
                if m and name in ("Args", "Arguments", "Raises"):
                    lines.append(f"- `{m.group(1)}`{inline(m.group(2) or '')}: {_with_math(m.group(3), formulas)}")
                else:
                    lines.append(f"- {_with_math(item, formulas)}")
            out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def _signature(name: str, obj: object) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        sig = "(...)"
    kind = "class " if inspect.isclass(obj) else ""
    return f"```python\n{kind}{name}{sig}\n```\n"


def _resolve(markdown: str, formulas: list[str]) -> str:
    """Put each formula back: as `\\(TeX\\)` where KaTeX renders it, else as the docstring's text."""
    texs = [f.split("\x01", 1)[0] for f in formulas]
    errors = check_tex(texs)

    def back(m: re.Match) -> str:
        i = int(m.group(1))
        tex, source = formulas[i].split("\x01", 1)
        return f"\\({tex}\\)" if errors[i] is None else inline(source)

    return re.sub("\x00MATH(\\d+)\x00", back, markdown)


def algorithms_page() -> str:
    """The page (see the module docstring)."""
    formulas: list[str] = []
    lines = ["# Algorithms", ""]
    lines.append(
        "The math of every advantage estimator and loss, generated at build time from the docstrings of "
        "`roll-algos` (pure torch functions: no Ray, no configs). Conventions: per-token tensors are `(B, T)` with "
        "a 0/1 `mask`, sequence-level ones `(B,)`, and a group's samples are contiguous rows. Config keys choose "
        "among them: `algo.adv_estimator`, `algo.policy_loss`, `algo.loss_agg`, `algo.kl_kind` (see the "
        "[configuration reference](config/algo.md)).\n"
    )
    for name in MODULES:
        module = importlib.import_module(f"roll_algos.{name}")
        lines += [f"## `roll_algos.{name}` {{ #{slug(name)} }}", ""]
        lines.append(docstring_markdown(inspect.getdoc(module) or "", formulas))
        for obj_name, obj in _public(module):
            lines += [f"### `{obj_name}` {{ #{slug(name)}-{slug(obj_name)} }}", "", _signature(obj_name, obj)]
            lines.append(docstring_markdown(inspect.getdoc(obj) or "(no docstring)", formulas))
    return _resolve("\n".join(lines), formulas)
