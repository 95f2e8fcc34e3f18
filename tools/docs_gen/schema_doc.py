"""What the source says about a config dataclass: each field's doc comment, type, default and allowed values.

Contract: `describe_schema(cls)` returns one `FieldDoc` per `dataclasses.fields(cls)` entry, in declaration order,
inherited fields included. A field's doc is the block of `#` comment lines right above its declaration (roll's
convention, schema.py), else a trailing comment on its line, searched through the class and then its bases (an
engine schema that only changes a default keeps the base's text). Allowed values are read from the class's
`__post_init__` (and its bases'), the checks roll writes there: `one_of("x", self.f, CHOICES)`, a test
`self.f in CHOICES` / `self.f not in CHOICES` that is a whole `if` or a call argument, a loop
`for key, allowed in choices().items(): ...getattr(self, key)...`, and `Literal[...]` annotations. `CHOICES` is
evaluated in the class's module (plus the imports inside the method), so a tuple defined elsewhere
(`TRANSPORTS`, the installed entry points) shows what is accepted in this build. What cannot be evaluated shows as
its source text; nothing is guessed.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

MISSING_TEXT = "required"


@dataclass(frozen=True)
class FieldDoc:
    """One option of a typed node, as the reference shows it."""

    name: str
    type: str
    default: str
    doc: str
    allowed: tuple[str, ...]
    # The dataclass of a nested node (documented in its own section), or None.
    nested: type | None


@cache
def _class_ast(cls: type) -> tuple[ast.ClassDef, list[str]] | None:
    """The class's AST and its source lines (dedented), or None where the source is not available."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return None
    tree = ast.parse(source)
    node = tree.body[0]
    return (node, source.splitlines()) if isinstance(node, ast.ClassDef) else None


def _comments(source_lines: list[str]) -> dict[int, str]:
    """1-based line number -> comment text (without '#'), for every comment token of the source."""
    out: dict[int, str] = {}
    tokens = tokenize.generate_tokens(io.StringIO("\n".join(source_lines) + "\n").readline)
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string[1:].strip()
    return out


def _own_field_docs(cls: type) -> dict[str, str]:
    """field name -> doc comment, for the fields declared in `cls`'s own body."""
    parsed = _class_ast(cls)
    if parsed is None:
        return {}
    node, lines = parsed
    comments = _comments(lines)
    docs: dict[str, str] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above: list[str] = []
        line = stmt.lineno - 1
        # The comment block directly above: consecutive lines that are only a comment.
        while line >= 1 and line in comments and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        trailing = comments.get(stmt.lineno) if not lines[stmt.lineno - 1].lstrip().startswith("#") else None
        text = " ".join(above) if above else (trailing or "")
        docs[stmt.target.id] = text.strip()
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """field name -> doc comment, the nearest class in the MRO that documents it winning."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            for name, text in _own_field_docs(klass).items():
                if text or name not in docs:
                    docs[name] = text
    return docs


def _method_namespace(cls: type, func: ast.FunctionDef) -> dict[str, Any]:
    """The globals of `cls`'s module plus what `func` imports in its body (imports inside methods are common in
    roll's configs: composing must not import torch)."""
    module = sys.modules.get(cls.__module__) or importlib.import_module(cls.__module__)
    namespace = dict(vars(module))
    for node in ast.walk(func):
        try:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mod = importlib.import_module(node.module)
                for alias in node.names:
                    attr = getattr(mod, alias.name, None)
                    if attr is None:  # `from package import submodule`
                        attr = importlib.import_module(f"{node.module}.{alias.name}")
                    namespace[alias.asname or alias.name] = attr
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    namespace[alias.asname or alias.name.split(".")[0]] = importlib.import_module(alias.name)
        except ImportError:
            continue  # an optional dependency: its checks show as source text
    return namespace


def _self_attr(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _evaluate(expr: ast.AST, namespace: dict[str, Any]) -> tuple[str, ...]:
    """The values of a choices expression, each as YAML would spell it; the source text where it cannot run."""
    try:
        value = eval(compile(ast.Expression(expr), "<choices>", "eval"), namespace)  # roll's own source
        return tuple(format_value(v) for v in value)
    except Exception:
        return (f"`{ast.unparse(expr)}`",)


def _post_init_choices(cls: type) -> dict[str, tuple[str, ...]]:
    """field -> allowed values, from the checks in `cls`'s own __post_init__ (see the module docstring)."""
    parsed = _class_ast(cls)
    if parsed is None:
        return {}
    node, _ = parsed
    found: dict[str, tuple[str, ...]] = {}
    for func in node.body:
        if not (isinstance(func, ast.FunctionDef) and func.name == "__post_init__"):
            continue
        namespace = _method_namespace(cls, func)
        for sub in ast.walk(func):
            if isinstance(sub, ast.Call) and getattr(sub.func, "id", None) == "one_of" and len(sub.args) >= 3:
                name = _self_attr(sub.args[1])
                if name:
                    found[name] = _evaluate(sub.args[2], namespace)
            # `self.f in X` as a whole `if` test or a call argument (`_check("mode", self.mode in MODES, ...)`).
            tests = [sub.test] if isinstance(sub, ast.If) else list(sub.args) if isinstance(sub, ast.Call) else []
            for test in tests:
                if (
                    isinstance(test, ast.Compare)
                    and len(test.ops) == 1
                    and isinstance(test.ops[0], (ast.In, ast.NotIn))
                    and _self_attr(test.left)
                ):
                    found[_self_attr(test.left)] = _evaluate(test.comparators[0], namespace)
            # for key, allowed in choices().items(): one_of(..., getattr(self, key), allowed)
            if (
                isinstance(sub, ast.For)
                and isinstance(sub.iter, ast.Call)
                and isinstance(sub.iter.func, ast.Attribute)
                and sub.iter.func.attr == "items"
                and "getattr(self" in ast.unparse(sub)
            ):
                try:
                    table = eval(compile(ast.Expression(sub.iter.func.value), "<choices>", "eval"), namespace)
                    for key, values in dict(table).items():
                        found[key] = tuple(format_value(v) for v in values)
                except Exception:
                    continue
    return found


def allowed_values(cls: type) -> dict[str, tuple[str, ...]]:
    """field -> allowed values over the class and its bases (a subclass's own check wins)."""
    out: dict[str, tuple[str, ...]] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            out.update(_post_init_choices(klass))
    return out


def format_value(value: Any) -> str:
    """A default or choice as a user would write it in YAML or on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "???" if value == "???" else value
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value):
        return f"({type(value).__name__} defaults)"
    return repr(value)


def _type_text(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    return text or str(annotation).replace("typing.", "")


def _nested_type(cls: type, name: str) -> type | None:
    """The dataclass a field holds, if any (resolved through the module's names: annotations are strings)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:
        return None
    hint = hints.get(name)
    candidates = [hint, *typing.get_args(hint)] if hint is not None else []
    for cand in candidates:
        if isinstance(cand, type) and dataclasses.is_dataclass(cand):
            return cand
    return None


def _literal_choices(cls: type, name: str) -> tuple[str, ...]:
    try:
        hint = typing.get_type_hints(cls).get(name)
    except Exception:
        return ()
    for cand in [hint, *typing.get_args(hint)]:
        if typing.get_origin(cand) is typing.Literal:
            return tuple(format_value(v) for v in typing.get_args(cand))
    return ()


def describe_schema(cls: type) -> list[FieldDoc]:
    """Every field of the dataclass `cls` with its doc, type, default and allowed values (module docstring)."""
    docs = field_docs(cls)
    choices = allowed_values(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = format_value(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = format_value(f.default_factory())
        else:
            default = MISSING_TEXT
        if default == "???":  # omegaconf.MISSING: composition fails unless a config group or override sets it
            default = MISSING_TEXT
        out.append(
            FieldDoc(
                name=f.name,
                type=_type_text(f.type),
                default=default,
                doc=docs.get(f.name, ""),
                allowed=choices.get(f.name) or _literal_choices(cls, f.name),
                nested=_nested_type(cls, f.name),
            )
        )
    return out
