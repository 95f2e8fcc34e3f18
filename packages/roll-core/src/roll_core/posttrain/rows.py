"""Row files to rows: JSONL, JSON, Parquet, CSV and `datasets` folders, with every bad row a counted skip.

Contract:
- `read_rows(paths, setting)` reads each path (a file, a glob, a folder of Parquet parts such as rollout-only's
  `rows.parquet/`, a glob of such folders such as a sharded rollout's `rows.shard-*-of-4.parquet`, or a folder
  saved by `datasets.save_to_disk`) in order and returns `RawRow`s (where =
  "file:row", the row as a dict). Local only: a path that does not exist is a `ConfigError` naming the setting
  (roll never downloads from a hub). A `datasets` folder of several splits gives its `train` split to `data.path`
  (with a warning naming the splits it leaves) and its one other split (test, validation) to `data.eval_path`;
  other split sets are a `ConfigError` naming them. An unknown file kind, an unreadable file, or a file with no
  rows at all is a `ConfigError` too. A row that cannot be read (not UTF-8, not JSON, not an object, a CSV record
  with more fields than the header has columns: its text was split at an unquoted comma) is recorded in `Skips`
  under a short reason code with its location and detail; a file where every row is bad is a `ConfigError` naming
  the first reason.
- An integer column with nulls (what pandas writes an int column holding a null as: 3.0 and NaN), top-level or a
  struct's field, reads as ints and None in Parquet, `datasets` and JSON rows (roll_core.int_columns, as the RL
  tasks read them): a `prompt_id` of 3.0 was no group id (every rollout row a `wrong_type` skip), an id "3.0".
  CSV values are text, read as written, by design (CSV holds no types; the RL tasks read no CSV): no type is
  guessed, so "007" stays "007", and pandas' 3.0 for an int column with nulls stays "3.0" (write that column as
  pandas' `Int64`, which CSV holds as 3, or the file as JSONL or Parquet).
- `Skips` counts skipped rows per reason (`counts`, the `skipped: dict[str, int]` runs log) and keeps the first
  few details; `check_any(kept, setting)` raises a `ConfigError` naming the first reason when nothing was kept.
- `stable_fraction(key)` and `held_out(...)`: a deterministic held-out split by a stable hash of each row's
  prompt (the same on every machine), rows sharing a prompt, or one but for whitespace, on one side.
"""

from __future__ import annotations

import csv
import glob
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from roll_core.errors import ConfigError
from roll_core.int_columns import float_columns, restore_int_columns
from roll_core.near_duplicates import stable_fraction
from roll_core.posttrain.config import DATASETS, PYARROW

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RawRow:
    """One row of a data file: `where` ("file.jsonl:12", 1-based line or row number) and its columns."""

    where: str
    row: dict[str, Any]
    file: str = ""  # the file it came from (format detection is per file)


class SkipRow(Exception):
    """Raised by row parsers: the row is skipped under `reason` (a short code) with a human-readable `detail`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class Skips:
    """Skipped rows: a count per reason code and the first few (where, reason, detail) for the error and the log."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: list[tuple[str, str, str]] = field(default_factory=list)
    keep: int = 10

    def add(self, where: str, reason: str, detail: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if len(self.examples) < self.keep:
            self.examples.append((where, reason, detail))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def merge(self, other: Skips) -> None:
        for reason, n in other.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + n
        self.examples += other.examples[: max(0, self.keep - len(self.examples))]

    def first(self) -> str:
        """The first skipped row, as "where: reason: detail"."""
        where, reason, detail = self.examples[0]
        return f"{where}: {reason}: {detail}"

    def log_summary(self, what: str) -> None:
        """One warning listing the counts and the first rows (nothing when no row was skipped)."""
        if self.total:
            shown = "; ".join(f"{w}: {d}" for w, _, d in self.examples)
            log.warning("%s: skipped %d row(s) %s; first: %s", what, self.total, dict(self.counts), shown)

    def check_any(self, kept: int, setting: str) -> None:
        """A ConfigError naming the first skip reason when every row was skipped."""
        if kept == 0 and self.total:
            raise ConfigError(
                f"{setting}: no usable rows ({self.total} skipped {dict(self.counts)}; first: {self.first()}): fix "
                "the rows, or set data.format and the data.*_key column names"
            )


def apply(rows: Sequence[RawRow], parse: Callable[[RawRow], T], skips: Skips) -> list[T]:
    """`parse` each row; a `SkipRow` it raises is recorded in `skips` and the row left out."""
    out = []
    for raw in rows:
        try:
            out.append(parse(raw))
        except SkipRow as skip:
            skips.add(raw.where, skip.reason, skip.detail)
    return out


# ---- reading ----------------------------------------------------------------------------------------------------
def expand(paths: Sequence[str], setting: str) -> list[Path]:
    """Paths and globs to existing files or folders, in order (a glob's matches sorted)."""
    if not paths:
        raise ConfigError(f"{setting} is not set: give a data file, a glob or a list of them")
    out: list[Path] = []
    for p in paths:
        if glob.has_magic(p):
            matches = sorted(glob.glob(p))
            if not matches:
                raise ConfigError(f"{setting}: no file matches {p!r}")
            # A match may be a folder of parts too: rows.shard-*-of-4.parquet reads a sharded rollout's outputs.
            out += [part for m in matches for part in (_parquet_parts(Path(m)) or [Path(m)])]
        elif Path(p).is_dir() and _parquet_parts(Path(p)):
            out += _parquet_parts(Path(p))  # a folder of Parquet parts (rollout-only output): one table
        elif Path(p).exists():
            out.append(Path(p))
        else:
            raise ConfigError(
                f"{setting}: {p} does not exist (roll reads local files only; save a hub data set with "
                "datasets' save_to_disk, or as Parquet/JSONL, first)"
            )
    return out


def _parquet_parts(folder: Path) -> list[Path]:
    """The sorted *.parquet files of a folder that is not a `datasets` save (which has its own json manifest); []
    for a file."""
    if not folder.is_dir() or (folder / "dataset_info.json").exists() or (folder / "dataset_dict.json").exists():
        return []
    return sorted(folder.glob("*.parquet"))


def read_rows(paths: Sequence[str], setting: str, skips: Skips) -> list[RawRow]:
    """Every row of every file in `paths` (concatenated in order); unreadable rows go to `skips` as `unreadable`."""
    rows: list[RawRow] = []
    for path in expand(paths, setting):
        own = Skips()
        got = _read_file(path, setting, own)
        if not got and not own.total:
            raise ConfigError(f"{setting}: {path} holds no rows (empty file)")
        own.check_any(len(got), f"{setting} ({path})")
        skips.merge(own)
        rows += got
    return rows


def _read_file(path: Path, setting: str, skips: Skips) -> list[RawRow]:
    # A part of a folder of parts is named with its folder: every shard has its own part-0000000.parquet.
    name = f"{path.parent.name}/{path.name}" if path.parent.suffix.lower() == ".parquet" else path.name
    if path.is_dir():
        return [RawRow(f"{name}:{i + 1}", r, str(path)) for i, r in enumerate(_read_datasets(path, setting))]
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        PYARROW.require()
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow's message does not name the setting
            raise ConfigError(f"{setting}: cannot read {path} as Parquet ({exc})") from exc
        rows = _int_columns(table.to_pylist(), float_columns(table.schema))
        return [RawRow(f"{name}:{i + 1}", r, str(path)) for i, r in enumerate(rows)]
    if suffix in (".jsonl", ".json"):
        return _read_json(path, setting, skips)
    if suffix == ".csv":
        try:
            with open(path, newline="", encoding="utf-8-sig") as f:
                reader = csv.DictReader(f)
                out = []
                for i, r in enumerate(reader):
                    where = f"{name}:{i + 2}"  # line numbers count the header as line 1
                    if None in r:  # fields beyond the header's columns: the row's text was split at a comma
                        cols = len(reader.fieldnames or [])
                        detail = f"{cols + len(r[None])} fields for {cols} columns (an unquoted comma? quote the field)"
                        skips.add(where, "unreadable", detail)
                        continue
                    out.append(RawRow(where, dict(r), str(path)))
                return out
        except (UnicodeDecodeError, csv.Error) as exc:
            raise ConfigError(f"{setting}: cannot read {path} as CSV ({exc})") from exc
    raise ConfigError(
        f"{setting}: unsupported data file {path}: use .jsonl, .json, .parquet, .csv or a folder written by "
        "datasets' save_to_disk"
    )


def _read_datasets(path: Path, setting: str) -> list[dict[str, Any]]:
    DATASETS.require()
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # a folder that is not a saved dataset
        raise ConfigError(
            f"{setting}: cannot read {path} as a folder written by datasets' save_to_disk ({exc})"
        ) from exc
    if isinstance(ds, datasets.DatasetDict) and len(ds) > 1:
        # Training rows are the 'train' split; held-out rows the one split beside it (it read 'train' there too:
        # the held-out metrics were measured on training rows).
        held = setting.endswith("eval_path")
        splits = [s for s in ds if s != "train"] if held else [s for s in ds if s == "train"]
        if len(splits) != 1:
            which = "the one split beside 'train'" if held else "a 'train' split"
            hint = next((s for s in ds if s != "train"), next(iter(ds))) if held else next(iter(ds))
            raise ConfigError(
                f"{setting}: {path} holds splits {list(ds)}, not {which}: point {setting} at one split's folder "
                f"({path / hint})"
            )
        if not held:  # the other splits are never read here: say so, as the RL loader does (roll_envs.tasks.dataset)
            others = [s for s in ds if s != "train"]
            hint = (
                f"its {others[0]!r} split is held out only when data.eval_path names this folder too"
                if len(others) == 1
                else "point data.eval_path at one split's folder to hold it out"
            )
            log.warning("%s holds the splits %s: reading 'train' only (%s)", path, sorted(ds), hint)
        ds = ds[splits[0]]
    elif isinstance(ds, datasets.DatasetDict):
        ds = next(iter(ds.values()))
    return _int_columns([dict(r) for r in ds], float_columns(ds.data.schema))  # (rows nest as the Arrow table does)


def _int_columns(rows: list[dict[str, Any]], floating: Sequence[tuple[str, ...]] | None) -> list[dict[str, Any]]:
    """`rows` with their integer columns with nulls (pandas' float columns: 3.0 and NaN) as ints and None
    (roll_core.int_columns): a `prompt_id` of 3.0 was a `wrong_type` skip of every rollout row, an id in text "3.0".
    `floating`: the Arrow schema's float columns; None for JSON rows (judged by their values)."""
    restore_int_columns(list(enumerate(rows)), floating)
    return rows


def _read_json(path: Path, setting: str, skips: Skips) -> list[RawRow]:
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark (Windows editors)
    name = path.name
    if data.lstrip()[:1] == b"[":  # a JSON list of objects (one document); anything else is JSON lines
        try:
            items = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{setting}: cannot read {path} as a JSON list ({exc})") from exc
        numbered = list(enumerate(items, start=1))
    else:
        numbered = []
        # line by line: one bad line is a skipped row, not the end of the file
        for lineno, raw in enumerate(data.splitlines(), start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                skips.add(f"{name}:{lineno}", "unreadable", f"not UTF-8 text (byte {exc.start})")
                continue
            if not line.strip():
                continue
            try:
                numbered.append((lineno, json.loads(line)))
            except json.JSONDecodeError as exc:
                skips.add(f"{name}:{lineno}", "unreadable", f"invalid JSON ({exc.msg})")
    _int_columns([item for _, item in numbered if isinstance(item, dict)], None)
    out = []
    for n, item in numbered:
        if isinstance(item, dict):
            out.append(RawRow(f"{name}:{n}", item, str(path)))
        else:
            skips.add(f"{name}:{n}", "unreadable", f"row is {type(item).__name__}, not an object")
    return out


# ---- held-out split ---------------------------------------------------------------------------------------------
def held_out(
    items: Sequence[T], keys: Sequence[str], size: int, setting: str, loose_keys: Sequence[str] | None = None
) -> tuple[list[T], list[T]]:
    """(train, held-out): whole prompt groups (items with equal `keys`) in the order of their stable hash are held
    out until at least `size` items are (so it may exceed `size` by part of one group); order kept on both sides.
    With `loose_keys` (one per item: `loose_prompt_keys`), an item whose loose key a held-out item has is held out
    too, counted in one warning: "Q?" and "Q?\\n" are one problem to the model, and their exact keys' hashes could
    put them on both sides (a held-out problem also trained on). The sides of prompts without such twins are what
    they were (the exact key's hash decides them), so a resumed run keeps its split. A ConfigError when nothing is
    left to train on."""
    if size <= 0:
        return list(items), []
    groups: dict[str, int] = {}
    for k in keys:
        groups[k] = groups.get(k, 0) + 1
    held_keys: set[str] = set()
    n = 0
    for k in sorted(groups, key=lambda k: (stable_fraction(k), k)):
        if n >= size:
            break
        held_keys.add(k)
        n += groups[k]
    if loose_keys is not None:
        near = {lk for lk, k in zip(loose_keys, keys, strict=True) if k in held_keys}
        twins = [k for lk, k in zip(loose_keys, keys, strict=True) if k not in held_keys and lk in near]
        if twins:
            log.warning(
                "%s: %d row(s) repeat a held-out row's prompt but for whitespace: held out with it (a held-out "
                "problem that is trained on measures nothing)",
                setting,
                len(twins),
            )
            held_keys.update(twins)
    train = [it for it, k in zip(items, keys, strict=True) if k not in held_keys]
    held = [it for it, k in zip(items, keys, strict=True) if k in held_keys]
    if not train:
        raise ConfigError(
            f"{setting}: every row fell in the held-out split ({len(held)} rows, data.eval_size={size}): lower "
            "data.eval_size or give data.eval_path"
        )
    return train, held
