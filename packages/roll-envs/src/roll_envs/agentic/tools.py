"""Tools a model can call from a tool-using environment (`roll_envs.agentic.tool_env`).

Contract: a tool has a `name`, a one-line `description`, and `__call__(arg: str) -> str` that never raises: errors
come back as text starting with "error:" so the model can read and fix them, or as a `ToolText` that says itself
whether the call failed (`ToolText.error`), for a tool whose output need not start so (the code tool shows what a
program printed before its error line, and a program that prints `error: ...` and succeeds did not fail). Tools are
deterministic and offline.

Built-ins (`TOOLS`, `get_tool(name, **kwargs)`):
- `calculator`: arithmetic on numbers with + - * / // % **, unary minus and parentheses, parsed with Python's `ast`
  and evaluated node by node. Names, calls, attributes, subscripts and everything else are refused; exponents are
  bounded (|exponent| <= `max_exponent`, results of at most `max_digits` digits). `^` is read as `**`, `×`/`÷` as
  `*`/`/`. Nothing is ever passed to `eval`/`exec`.
- `python`: the calculator's subset plus abs, min, max, round and sum over literal lists. It is NOT a Python
  interpreter and NOT a sandbox: it never executes code (use `code` for real Python in the sandbox).
- `retrieval`: BM25 search over a local corpus (a list of documents or a JSONL file) returning top-k snippets.
- `code`: runs a real Python program, only inside roll's OS sandbox (`code_tool.py`, `roll_envs.sandbox`), and
  returns what it printed. Needs bubblewrap (`roll-envs[code]`).
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable


@runtime_checkable
class Tool(Protocol):
    """A callable tool: text in, text out, never raising."""

    name: str
    description: str

    def __call__(self, arg: str) -> str: ...


class ToolError(ValueError):
    """A refused or failed evaluation; its message is shown to the model."""


class ToolText(str):
    """A tool's output text that says whether the call failed (`error`), whatever the text starts with: the tool
    env counts a failed call (info["tool_error_outputs"]) by it rather than by an `error:` prefix. A code run that
    printed and then crashed reads `partial output ... error: ...` and was counted a success, one that printed
    `error: ...` and succeeded a failure."""

    error: bool

    def __new__(cls, text: str, error: bool) -> ToolText:
        out = super().__new__(cls, text)
        out.error = bool(error)
        return out

    def __getnewargs__(self) -> tuple[str, bool]:  # (pickled across processes with its flag)
        return str(self), self.error


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_REFUSED = {
    ast.Name: "names are not allowed",
    ast.Call: "function calls are not allowed",
    ast.Attribute: "attribute access is not allowed",
    ast.Subscript: "subscripts are not allowed",
    ast.Lambda: "lambdas are not allowed",
}


def _format(value: Any) -> str:
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e16:
            return str(int(value))
        return repr(value)
    return str(value)


class _Evaluator:
    """Walks an expression's AST; only the listed node types and `functions` are evaluated."""

    def __init__(
        self, max_exponent: int, max_digits: int, functions: dict[str, Callable[..., Any]] | None = None
    ) -> None:
        self.max_exponent, self.max_digits = max_exponent, max_digits
        self.functions = functions or {}

    def evaluate(self, text: str, max_chars: int) -> Any:
        text = text.strip().replace("^", "**").replace("×", "*").replace("÷", "/").rstrip("=").strip()
        if not text:
            raise ToolError("empty expression")
        if len(text) > max_chars:
            raise ToolError(f"expression too long ({len(text)} characters, at most {max_chars})")
        try:
            tree = ast.parse(text, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            raise ToolError(f"not an arithmetic expression ({type(exc).__name__})") from None
        return self._walk(tree.body)

    def _check_size(self, value: Any) -> Any:
        if isinstance(value, int) and value.bit_length() > self.max_digits * 3.33:
            raise ToolError(f"result too large (more than {self.max_digits} digits)")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("result is not a finite number")
        return value

    def _walk(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
                return self._check_size(node.value)
            raise ToolError(f"only numbers are allowed, not {type(node.value).__name__}")
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._number(self._walk(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            # Numbers only: `[1] * 10**9` would otherwise build a list of a billion items.
            left, right = self._number(self._walk(node.left)), self._number(self._walk(node.right))
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            try:
                result = _BINOPS[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except OverflowError:
                raise ToolError("result too large") from None
            if isinstance(result, complex):
                raise ToolError("complex result (negative number to a fractional power)")
            return self._check_size(result)
        if isinstance(node, (ast.List, ast.Tuple)) and self.functions:
            return [self._walk(e) for e in node.elts]
        if isinstance(node, ast.Call) and self.functions:
            return self._call(node)
        for kind, why in _REFUSED.items():
            if isinstance(node, kind):
                return self._refuse(why, node)
        raise ToolError(f"unsupported syntax: {type(node).__name__}")

    @staticmethod
    def _number(value: Any) -> Any:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ToolError("arithmetic needs numbers, not lists")
        return value

    def _refuse(self, why: str, node: ast.AST) -> Any:
        name = node.id if isinstance(node, ast.Name) else None
        raise ToolError(f"{why}" + (f" (got {name!r})" if name else "") + "; use numbers and + - * / // % **")

    def _check_power(self, base: Any, exponent: Any) -> None:
        if abs(exponent) > self.max_exponent:
            raise ToolError(f"exponent too large ({exponent}; at most {self.max_exponent})")
        if abs(base) > 1 and abs(exponent) * math.log10(abs(base)) > self.max_digits:
            raise ToolError(f"result too large (more than {self.max_digits} digits)")

    def _call(self, node: ast.Call) -> Any:
        if not isinstance(node.func, ast.Name) or node.func.id not in self.functions:
            shown = node.func.id if isinstance(node.func, ast.Name) else type(node.func).__name__
            raise ToolError(f"unknown function {shown!r}; available: {', '.join(sorted(self.functions))}")
        if node.keywords:
            raise ToolError("keyword arguments are not allowed")
        args = [self._walk(a) for a in node.args]
        try:
            return self._check_size(self.functions[node.func.id](*args))
        except ToolError:
            raise
        except (TypeError, ValueError, OverflowError) as exc:
            raise ToolError(f"{node.func.id}(): {exc}") from None


class Calculator:
    """Safe arithmetic (see the module docstring); `calculator: 12*(3+4)` -> `84`."""

    name = "calculator"
    description = "evaluates arithmetic: numbers, + - * / // % ** and parentheses, e.g. 12*(3+4)"
    _functions: ClassVar[dict[str, Callable[..., Any]]] = {}

    def __init__(self, max_exponent: int = 100, max_digits: int = 1000, max_chars: int = 500) -> None:
        self.max_chars = max_chars
        self._evaluator = _Evaluator(max_exponent, max_digits, self._functions)

    def evaluate(self, expression: str) -> Any:
        """The value of `expression` (int or float); `ToolError` with the reason otherwise."""
        return self._evaluator.evaluate(expression, self.max_chars)

    def __call__(self, arg: str) -> str:
        try:
            return _format(self.evaluate(str(arg)))
        except ToolError as exc:
            return f"error: {exc}"
        except Exception as exc:  # a tool never raises: any surprise is reported as text
            return f"error: {type(exc).__name__}"


def _sum(values: Any) -> Any:
    if not isinstance(values, list):
        raise ToolError("sum() takes a list, e.g. sum([1, 2, 3])")
    return sum(values)


def _round(value: Any, digits: Any = None) -> Any:
    if digits is not None and (not isinstance(digits, int) or abs(digits) > 20):
        raise ToolError("round(x, n) needs an integer n with |n| <= 20")
    return round(value) if digits is None else round(value, digits)


def _minmax(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        values = args[0] if len(args) == 1 and isinstance(args[0], list) else list(args)
        if not values or any(isinstance(v, list) for v in values):
            raise ToolError(f"{fn.__name__}() takes numbers or one list of numbers")
        return fn(values)

    return call


class PythonExpression(Calculator):
    """A restricted expression evaluator, NOT a sandbox and NOT Python: the calculator's subset plus abs, min, max,
    round and sum over literal lists. It never runs code (no exec/eval). Real Python execution will run only in
    roll's code sandbox (the `code` tool); this tool keeps the `python` name so prompts written for it keep working."""

    name = "python"
    description = "evaluates one arithmetic expression with abs, min, max, round, sum, e.g. sum([1, 2, 3]) * 2"
    _functions: ClassVar[dict[str, Callable[..., Any]]] = {
        "abs": abs,
        "min": _minmax(min),
        "max": _minmax(max),
        "round": _round,
        "sum": _sum,
    }

    def __call__(self, arg: str) -> str:
        result = super().__call__(arg)
        return result if not result.startswith("[") else "error: the result must be a number, not a list"


_TOKEN = re.compile(r"\w+")


def _tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


class Retrieval:
    """BM25 search over a local corpus: `retrieval: capital of France` -> the top `k` snippets, best first."""

    name = "retrieval"
    description = "searches a local document collection, e.g. capital of France"

    def __init__(
        self,
        documents: Sequence[str] | None = None,
        path: str | Path | None = None,
        k: int = 3,
        snippet_chars: int = 300,
        text_key: str = "text",
        k1: float = 1.5,
        b: float = 0.75,
    ) -> None:
        docs = list(documents or [])
        if path is not None:
            docs += self._read_jsonl(Path(path), text_key)
        if not docs or not all(isinstance(d, str) for d in docs):
            raise ValueError("retrieval needs a non-empty list of text documents (documents= or path=)")
        self.documents, self.k, self.snippet_chars, self.k1, self.b = docs, k, snippet_chars, k1, b
        self._tf = [Counter(_tokens(d)) for d in docs]
        self._len = [sum(tf.values()) for tf in self._tf]
        self._avg = sum(self._len) / len(docs) or 1.0
        df = Counter(t for tf in self._tf for t in tf)
        n = len(docs)
        self._idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}

    @staticmethod
    def _read_jsonl(path: Path, text_key: str) -> list[str]:
        docs = []
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            text = row if isinstance(row, str) else row.get(text_key) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: expected a string or an object with a {text_key!r} string")
            docs.append(text)
        return docs

    def search(self, query: str) -> list[tuple[int, float]]:
        """(document index, BM25 score) of the top `k` documents with a positive score."""
        terms = set(_tokens(query))
        scores = []
        for i, tf in enumerate(self._tf):
            norm = self.k1 * (1 - self.b + self.b * self._len[i] / self._avg)
            s = sum(self._idf[t] * tf[t] * (self.k1 + 1) / (tf[t] + norm) for t in terms if t in tf)
            if s > 0:
                scores.append((i, s))
        scores.sort(key=lambda x: (-x[1], x[0]))
        return scores[: self.k]

    def _snippet(self, doc: str, terms: set[str]) -> str:
        if len(doc) <= self.snippet_chars:
            return doc
        starts = [m.start() for m in _TOKEN.finditer(doc) if m.group().lower() in terms]
        start = max(0, (starts[0] if starts else 0) - self.snippet_chars // 4)
        end = start + self.snippet_chars
        return ("..." if start else "") + doc[start:end] + ("..." if end < len(doc) else "")

    def __call__(self, arg: str) -> str:
        query = str(arg)[:1000]
        if not _tokens(query):
            return "error: empty query; write a few keywords"
        hits = self.search(query)
        if not hits:
            return "no results"
        terms = set(_tokens(query))
        return "\n".join(f"[{rank}] {self._snippet(self.documents[i], terms)}" for rank, (i, _) in enumerate(hits, 1))


def _code_tool(**kwargs: Any) -> Tool:
    # Imported on use: the sandbox probes bubblewrap when a code tool is built, not when tools are listed.
    from roll_envs.agentic.code_tool import CodeTool

    return CodeTool(**kwargs)


#: Tool factories by name: `TOOLS[name](**kwargs)` builds one.
TOOLS: dict[str, Callable[..., Tool]] = {
    "calculator": Calculator,
    "python": PythonExpression,
    "retrieval": Retrieval,
    "code": _code_tool,
}


def get_tool(name: str, **kwargs: Any) -> Tool:
    """Build a registered tool by name; ValueError listing the available tools otherwise."""
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}; available: {', '.join(sorted(TOOLS))}")
    return TOOLS[name](**kwargs)
