"""The batch protocol: what flows between the controller and the role workers.

A `Batch` is a `TensorDict` of tensors sharing the leading batch dimension, plus typed non-tensor per-row fields
(prompt ids, ground truths, domains: lists of Python values, one per row) and a batch-level `meta` dict.

Splitting is uneven by design: `split(k)` gives k parts whose sizes differ by at most one (the first
`len % k` parts get the extra row), never requires divisibility, and `Batch.concat` restores the original order.
Tensors pickle as contiguous buffers, so a batch crosses Ray's object store without per-row overhead.

Sequence layout used by the RLVR pipeline (all right-aligned prompts, left-aligned responses):
- `prompts` (B, P) left-padded, `responses` (B, R) right-padded, `response_mask` (B, R) 1 for generated tokens;
- `input_ids` = cat(prompts, responses) (B, P+R), `attention_mask` (B, P+R), `position_ids` (B, P+R).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor

from roll_core.sequences import build_sequences, pad_left

__all__ = ["Batch", "build_sequences", "pad_left"]


class Batch:
    """Tensors (TensorDict, batch dim 0) + per-row non-tensor fields + batch-level meta."""

    def __init__(
        self,
        tensors: dict[str, Tensor] | TensorDict | None = None,
        fields: dict[str, Sequence[Any]] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        tensors = tensors if tensors is not None else {}
        sizes = {int(v.shape[0]) for v in tensors.values()} | {len(v) for v in (fields or {}).values()}
        if len(sizes) > 1:
            detail = {k: int(v.shape[0]) for k, v in tensors.items()} | {k: len(v) for k, v in (fields or {}).items()}
            raise ValueError(f"batch entries disagree on the number of rows: {detail}")
        n = sizes.pop() if sizes else 0
        self.td = tensors if isinstance(tensors, TensorDict) else TensorDict(dict(tensors), batch_size=[n])
        self.fields: dict[str, list[Any]] = {k: list(v) for k, v in (fields or {}).items()}
        self.meta: dict[str, Any] = dict(meta or {})
        self._n = n

    # ---- access -------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._n

    def __contains__(self, key: str) -> bool:
        return key in self.td.keys() or key in self.fields

    def __getitem__(self, key: str) -> Any:
        if key in self.fields:
            return self.fields[key]
        return self.td[key]

    def __setitem__(self, key: str, value: Tensor | Sequence[Any]) -> None:
        n = int(value.shape[0]) if isinstance(value, Tensor) else len(value)
        if self._n and n != self._n:
            raise ValueError(f"{key!r} has {n} rows, batch has {self._n}")
        if not self._n and not len(self.td.keys()) and not self.fields:
            self._n = n
            self.td = TensorDict({}, batch_size=[n])
        if isinstance(value, Tensor):
            self.fields.pop(key, None)
            self.td[key] = value
        else:
            if key in self.td.keys():
                del self.td[key]
            self.fields[key] = list(value)

    def keys(self) -> list[str]:
        """Tensor keys then field keys."""
        return [str(k) for k in self.td.keys()] + list(self.fields)

    def tensors(self) -> dict[str, Tensor]:
        """The tensor entries as a plain dict (what engines consume)."""
        return {str(k): v for k, v in self.td.items()}

    def __repr__(self) -> str:
        shapes = {str(k): tuple(v.shape) for k, v in self.td.items()}
        return f"Batch(n={self._n}, tensors={shapes}, fields={list(self.fields)}, meta={list(self.meta)})"

    # ---- row operations -----------------------------------------------------------------------------------
    def index(self, rows: Tensor | Sequence[int] | slice) -> Batch:
        """Rows selected by an index tensor, list or slice (order kept)."""
        if isinstance(rows, slice):
            idx = list(range(self._n))[rows]
        else:
            idx = rows.tolist() if isinstance(rows, Tensor) else list(rows)
        t = torch.as_tensor(idx, dtype=torch.long)
        td = self.td[t] if len(idx) else TensorDict({k: v[:0] for k, v in self.td.items()}, batch_size=[0])
        return Batch(td, {k: [v[i] for i in idx] for k, v in self.fields.items()}, self.meta)

    def select(self, *keys: str) -> Batch:
        """Only the named entries (tensors or fields); meta is kept."""
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"batch has no {missing}; it has {self.keys()}")
        td = self.td.select(*[k for k in keys if k in self.td.keys()])
        return Batch(td, {k: self.fields[k] for k in keys if k in self.fields}, self.meta)

    def union(self, other: Batch) -> Batch:
        """Entries of both batches (same rows). A key in both must hold equal values."""
        if len(other) != self._n:
            raise ValueError(f"cannot union batches of {self._n} and {len(other)} rows")
        out = Batch(self.td.clone(recurse=False), dict(self.fields), {**self.meta, **other.meta})
        for k, v in other.td.items():
            if k in self.td.keys() and not torch.equal(self.td[k], v):
                raise ValueError(f"union: tensor {k!r} differs between the batches")
            out.td[k] = v
        for k, v in other.fields.items():
            if k in self.fields and self.fields[k] != v:
                raise ValueError(f"union: field {k!r} differs between the batches")
            out.fields[k] = list(v)
        return out

    def repeat_interleave(self, n: int) -> Batch:
        """Each row repeated n times consecutively (a prompt's group of n samples stays contiguous)."""
        idx = torch.arange(self._n).repeat_interleave(n)
        return self.index(idx)

    # ---- splitting across workers -------------------------------------------------------------------------
    @staticmethod
    def split_sizes(n: int, parts: int) -> list[int]:
        """Sizes of an uneven split of n rows into `parts` (differ by at most one, larger first)."""
        if parts < 1:
            raise ValueError(f"parts must be >= 1, got {parts}")
        base, extra = divmod(n, parts)
        return [base + (1 if i < extra else 0) for i in range(parts)]

    def split(self, parts: int) -> list[Batch]:
        """Uneven contiguous split; each part's meta records `split_index` and the `split_sizes`."""
        sizes = self.split_sizes(self._n, parts)
        out, start = [], 0
        for i, size in enumerate(sizes):
            part = self.index(slice(start, start + size))
            part.meta = {**self.meta, "split_index": i, "split_sizes": sizes}
            out.append(part)
            start += size
        return out

    def chunks(self, size: int) -> Iterator[Batch]:
        """Consecutive chunks of at most `size` rows."""
        for s in range(0, self._n, size):
            yield self.index(slice(s, s + size))

    @staticmethod
    def concat(batches: Iterable[Batch]) -> Batch:
        """Rows of all batches in order; every batch must have the same keys. Split metadata is dropped."""
        batches = [b for b in batches]
        if not batches:
            return Batch()
        keys = set(batches[0].keys())
        for b in batches[1:]:
            if set(b.keys()) != keys:
                raise ValueError(f"cannot concat batches with keys {sorted(keys)} and {sorted(b.keys())}")
        meta = {k: v for k, v in batches[0].meta.items() if k not in ("split_index", "split_sizes")}
        nonempty = [b for b in batches if len(b)] or batches[:1]
        td = torch.cat([b.td for b in nonempty]) if len(nonempty[0].td.keys()) else None
        fields = {k: [x for b in nonempty for x in b.fields[k]] for k in nonempty[0].fields}
        return Batch(td, fields, meta)

    def to(self, device: str | torch.device) -> Batch:
        """Tensors moved to `device`."""
        return Batch(self.td.to(device), self.fields, self.meta)

    # ---- pickling (Ray) -----------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {"tensors": self.tensors(), "fields": self.fields, "meta": self.meta, "n": self._n}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.td = TensorDict(state["tensors"], batch_size=[state["n"]])
        self.fields, self.meta, self._n = state["fields"], state["meta"], state["n"]
