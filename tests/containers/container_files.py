"""Readers for the container files, for tests/containers/test_images.py: Dockerfiles and .dockerignore.

- `parse_dockerfile` turns a Dockerfile into its instructions (continuation lines joined, comments and the parser
  directive dropped), each with the line it starts on.
- `copy_sources` splits a COPY/ADD into its flags, sources and destination (shell and JSON forms).
- `DockerIgnore` answers "does the build context leave this path out?" with Docker's own semantics (moby's
  patternmatcher, which BuildKit uses): patterns are cleaned and made relative to the context root, `*` and `?`
  never cross a `/`, `**` crosses any number of folders, a pattern that matches a parent folder matches everything
  under it, `!pattern` re-includes, and the last matching pattern wins.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction: its keyword (upper case), its argument text, the line it starts on."""

    cmd: str
    args: str
    line: int


def parse_dockerfile(path: Path) -> list[Instruction]:
    """The instructions of a Dockerfile (backslash continuations joined; comment lines inside one are skipped)."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue  # a comment (or the `# syntax=` directive), even between continuation lines
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        text = " ".join(p for p in pending if p)
        pending = []
        cmd, _, args = text.partition(" ")
        out.append(Instruction(cmd.upper(), args.strip(), start))
    if pending:
        raise ValueError(f"{path}: the last instruction ends with a line continuation")
    return out


def copy_sources(instr: Instruction) -> tuple[dict[str, str], list[str], str]:
    """(flags, sources, destination) of a COPY or ADD instruction."""
    words = shlex.split(instr.args)
    flags: dict[str, str] = {}
    while words and words[0].startswith("--"):
        name, _, value = words.pop(0)[2:].partition("=")
        flags[name] = value
    rest = " ".join(words)
    if rest.startswith("["):
        words = json.loads(rest)
    if len(words) < 2:
        raise ValueError(f"line {instr.line}: {instr.cmd} needs a source and a destination: {instr.args!r}")
    return flags, words[:-1], words[-1]


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    """Every `ARG NAME=default` of a Dockerfile (quotes removed); an ARG without a default maps to ""."""
    out: dict[str, str] = {}
    for instr in instructions:
        if instr.cmd == "ARG":
            name, _, value = instr.args.partition("=")
            out[name.strip()] = shlex.split(value)[0] if value.strip() else ""
    return out


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """moby/patternmatcher's translation of one cleaned pattern to an anchored regular expression."""
    out = "^"
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "*":
            if i + 1 < len(pattern) and pattern[i + 1] == "*":
                i += 1
                if i + 1 < len(pattern) and pattern[i + 1] == "/":
                    i += 1  # `**/` is `**`
                out += ".*" if i + 1 >= len(pattern) else "(.*/)?"
            else:
                out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        elif ch == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                raise ValueError(f"unterminated character class in .dockerignore pattern {pattern!r}")
            out += pattern[i : end + 1]
            i = end
        else:
            out += re.escape(ch)
        i += 1
    return re.compile(out + "$")


class DockerIgnore:
    """The patterns of a .dockerignore, and whether a context-relative path is left out of the build context."""

    def __init__(self, lines: list[str]) -> None:
        self.patterns: list[tuple[bool, re.Pattern[str], str]] = []  # (is an exception, regex, cleaned text)
        for raw in lines:
            text = raw.strip()
            if not text or text.startswith("#"):
                continue
            exception = text.startswith("!")
            if exception:
                text = text[1:].strip()
            text = posixpath.normpath(text)
            if len(text) > 1 and text.startswith("/"):
                text = text[1:]
            self.patterns.append((exception, _pattern_regex(text), text))

    @classmethod
    def from_file(cls, path: Path) -> DockerIgnore:
        """Read `path`; a missing file leaves everything in."""
        return cls(path.read_text().splitlines() if path.is_file() else [])

    def excluded(self, path: str) -> bool:
        """Whether the context leaves `path` (relative to the context root, `/`-separated) out."""
        path = posixpath.normpath(path)
        parents = path.split("/")[:-1]
        matched = False
        for exception, regex, _ in self.patterns:
            if exception != matched:
                continue  # an exclusion of an excluded path, or an exception for an included one, changes nothing
            hit = bool(regex.match(path)) or any(regex.match("/".join(parents[: i + 1])) for i in range(len(parents)))
            if hit:
                matched = not exception
        return matched
