"""Rollout-only output (`pipeline=rollout`): scored samples as rows of a JSONL file or of a folder of Parquet parts,
written step by step so that a stopped run resumes where its checkpoint left it.

Layouts (chosen by the suffix of `rollout.output`):
- `rows.jsonl`: one JSON object per line. Each step's rows are appended in one write, flushed and fsync'd. The
  state (`rows`, `bytes`) is what the file held at the checkpoint: on resume the file is cut back to `bytes`, so
  rows written after the checkpoint are dropped and written again (a resumed run's file equals an uninterrupted
  run's, same seed).
- `rows.parquet`: a folder of that name holding one file per step, `part-<step:07d>.parquet` (the layout pyarrow's
  `pq.read_table(folder)`, pandas, Spark, DuckDB and roll's `data.path=rows.parquet` read as one table). A part
  is written under a temporary name, fsync'd and renamed (the folder fsync'd too): it is whole or absent, and
  durable once `write` returns. The state lists the parts: on resume the parts of later steps are deleted.

Row fields (ROW_FIELDS; the SFT and DPO readers, roll_core.posttrain, take `prompt_ids`, `response_ids`, `reward`,
`correct` and group a prompt's samples by `prompt_id`): prompt_id (text), prompt (the user message), answer (the task's
ground truth), prompt_ids (the chat-templated prompt), response (decoded, special tokens skipped), response_ids
(the generated tokens, end-of-sequence token included when generated), response_logprobs (behaviour log-probs of
response_ids at the sampling temperature), reward (the task reward's score, plus the reward model's when one is
configured), correct, formatted (bool), finish_reason (stop | length | abort), metadata (the problem's metadata
with its `domain`; JSON text in Parquet, so that every part has one column type), sample (index among the
prompt's samples), shard (`rollout.shard`).

A run that starts fresh (not resumed) refuses an output that already holds rows: another run's rows would mix
in. Not thread-safe: one writer per output, driven by the collector's loop.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from roll_core.errors import ConfigError
from roll_core.posttrain.config import PYARROW

log = logging.getLogger(__name__)

#: Every row's fields, in order.
ROW_FIELDS = (
    "prompt_id",
    "prompt",
    "answer",
    "prompt_ids",
    "response",
    "response_ids",
    "response_logprobs",
    "reward",
    "correct",
    "formatted",
    "finish_reason",
    "metadata",
    "sample",
    "shard",
)

#: The output suffixes and their layouts.
KINDS = {".jsonl": "jsonl", ".parquet": "parquet"}


def output_kind(path: str | Path, setting: str = "rollout.output") -> str:
    """`jsonl` or `parquet` from the suffix of `path`; a ConfigError for any other suffix."""
    kind = KINDS.get(Path(path).suffix.lower())
    if kind is None:
        raise ConfigError(f"{setting}={path}: name a .jsonl file or a .parquet folder (rows.jsonl, rows.parquet)")
    return kind


def holds_rows(path: str | Path) -> bool:
    """True when `path` is a non-empty JSONL file or a folder holding Parquet parts."""
    p = Path(path)
    if p.is_dir():
        return any(p.glob("part-*.parquet"))
    return p.exists() and p.stat().st_size > 0


def _parquet_schema() -> Any:
    import pyarrow as pa

    return pa.schema(
        [
            ("prompt_id", pa.string()),
            ("prompt", pa.string()),
            ("answer", pa.string()),
            ("prompt_ids", pa.list_(pa.int32())),
            ("response", pa.string()),
            ("response_ids", pa.list_(pa.int32())),
            # float32: the engines' log-probs are float32, stored exactly.
            ("response_logprobs", pa.list_(pa.float32())),
            ("reward", pa.float64()),
            ("correct", pa.bool_()),
            ("formatted", pa.bool_()),
            ("finish_reason", pa.string()),
            ("metadata", pa.string()),
            ("sample", pa.int32()),
            ("shard", pa.int32()),
        ]
    )


class RolloutWriter:
    """Appends each step's rows to `path` (see the module docstring for the layouts and the resume rule).

    Call `restore(state)` with a checkpoint's `state_dict()` before the first `write` of a resumed run; a run
    without one calls `start(resume=...)` (the collector does this on its first write).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.kind = output_kind(self.path)
        if self.kind == "parquet":
            PYARROW.require()
        self.rows = 0  # rows written (and kept) so far
        self.bytes = 0  # JSONL: the file's length after the last write
        self.parts: list[str] = []  # Parquet: the part files written, in step order
        self.ready = False  # start() or restore() ran

    # ---- where the output starts ---------------------------------------------------------------------------
    def start(self, *, resume: bool) -> None:
        """A run without a checkpoint: refuse an output that holds rows, or (a resumed run that never reached its
        first checkpoint) drop them."""
        if holds_rows(self.path):
            if not resume:
                raise ConfigError(
                    f"rollout.output={self.path} already holds rows: delete it, choose another rollout.output, or "
                    "resume the run that wrote it (pipeline.resume=true)"
                )
            log.warning("%s: dropping rows written before the first checkpoint (the run redoes them)", self.path)
        self.restore({"kind": self.kind, "rows": 0, "bytes": 0, "parts": []})

    def restore(self, state: dict[str, Any]) -> None:
        """Cut the output back to what it held at the checkpoint `state` (rows written after it are dropped)."""
        if state.get("kind", self.kind) != self.kind:
            raise ConfigError(
                f"rollout.output={self.path} is {self.kind} but the checkpoint wrote {state['kind']}: resume with the "
                "same rollout.output"
            )
        self.rows = int(state["rows"])
        if self.kind == "jsonl":
            self._restore_jsonl(int(state["bytes"]))
        else:
            self._restore_parquet(list(state["parts"]))
        self.ready = True

    def _restore_jsonl(self, size: int) -> None:
        have = self.path.stat().st_size if self.path.exists() else 0
        if have < size:
            raise ConfigError(
                f"rollout.output={self.path} holds {have} bytes but the checkpoint wrote {size} ({self.rows} rows): "
                "the file was moved, cut or replaced; restore it or start a new run"
            )
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    raise ConfigError(
                        f"rollout.output={self.path}: byte {size} (the checkpoint's end of rows) is not a line end: "
                        "the file was changed since the checkpoint; restore it or start a new run"
                    )
        if have > size:
            with open(self.path, "rb") as f:
                f.seek(size)
                dropped = f.read().count(b"\n")
            log.info("%s: dropping %d row(s) written after the checkpoint", self.path, dropped)
            os.truncate(self.path, size)
        self.bytes = size

    def _restore_parquet(self, parts: list[str]) -> None:
        missing = [p for p in parts if not (self.path / p).exists()]
        if missing:
            raise ConfigError(
                f"rollout.output={self.path} lacks {len(missing)} part(s) the checkpoint wrote (first: {missing[0]}): "
                "restore them or start a new run"
            )
        keep = set(parts)
        if self.path.is_dir():
            for f in sorted(self.path.iterdir()):
                # Later steps' parts, and temporary files of a write cut short.
                if f.name not in keep and (f.name.startswith("part-") or f.name.startswith(".part-")):
                    log.info("%s: dropping %s (written after the checkpoint)", self.path, f.name)
                    f.unlink()
        self.parts = parts

    # ---- writing --------------------------------------------------------------------------------------------
    def write(self, step: int, rows: Sequence[dict[str, Any]]) -> None:
        """Append `rows` (dicts with ROW_FIELDS) as step `step`'s; durable when this returns."""
        if not self.ready:
            raise RuntimeError("RolloutWriter.write before start() or restore()")
        if not rows:
            return
        for r in rows:
            if tuple(r) != ROW_FIELDS:
                raise ValueError(f"a rollout row has fields {list(r)}, expected {list(ROW_FIELDS)}")
        if self.kind == "jsonl":
            self._write_jsonl(rows)
        else:
            self._write_parquet(step, rows)
        self.rows += len(rows)

    def _write_jsonl(self, rows: Sequence[dict[str, Any]]) -> None:
        # default=str: a data column JSON cannot hold (a Parquet timestamp in the metadata) is written as its text, as
        # the remote reward sends it (it failed the whole rollout at step 1)
        data = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows).encode("utf-8")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        with open(self.path, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # a checkpoint taken after this step counts these bytes: they must be on disk
        if created:  # and the file itself: its name lives in the folder
            _fsync_dir(self.path.parent)
        self.bytes += len(data)

    def _write_parquet(self, step: int, rows: Sequence[dict[str, Any]]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        name = f"part-{step:07d}.parquet"
        if name in self.parts:
            raise RuntimeError(f"{self.path}: step {step}'s part was already written")
        cols = {k: [r[k] for r in rows] for k in ROW_FIELDS}
        cols["metadata"] = [json.dumps(m, ensure_ascii=False, sort_keys=True, default=str) for m in cols["metadata"]]
        table = pa.Table.from_pydict(cols, schema=_parquet_schema())
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / f".{name}.tmp"
        pq.write_table(table, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.path / name)
        # The rename lives in the folder: unsynced, a crash after the next checkpoint could lose the part the
        # checkpoint lists, and the run could not resume.
        _fsync_dir(self.path)
        self.parts.append(name)

    def state_dict(self) -> dict[str, Any]:
        """What the output holds now (a checkpoint's view of it)."""
        return {"kind": self.kind, "rows": self.rows, "bytes": self.bytes, "parts": list(self.parts)}


def _fsync_dir(folder: Path) -> None:
    """Flush `folder`'s entries (a file created or renamed in it) to disk; a no-op where folders cannot be opened."""
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_rollout(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a rollout output (JSONL file or Parquet folder), in order; Parquet's metadata decoded."""
    path = Path(path)
    if output_kind(path) == "jsonl":
        # split on "\n" only: str.splitlines also splits on U+2028/U+0085, which a response may hold unescaped
        return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    PYARROW.require()
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for part in sorted(path.glob("part-*.parquet")):
        for r in pq.read_table(part).to_pylist():
            r["metadata"] = json.loads(r["metadata"])
            rows.append(r)
    return rows
