"""The batch protocol: what flows between the controller and the role workers.

A `Batch` is a `TensorDict` of tensors sharing the leading batch dimension, plus typed non-tensor per-row fields
(prompt ids, ground truths, domains: lists of Python values, one per row) and a batch-level `meta` dict. A batch
owns its containers: one built from a TensorDict, a fields dict or a meta dict holds shallow copies of them (the
tensors and values are shared), so setting a key on it never changes another batch.

Splitting is uneven by design: `split(k)` gives k parts whose sizes differ by at most one (the first
`len % k` parts get the extra row), never requires divisibility (k may exceed the row count: the last parts are
empty), and `Batch.concat` restores the original order. Concat needs every batch to hold the same tensor keys (with
equal dtypes and trailing shapes: pad responses first, roll_core.pipelines.sampling.concat_generations) and the same
field keys; the first batch's meta wins. Tensors pickle as compact contiguous buffers (a view of a larger tensor is
copied out, never shipped with its whole storage), so a batch crosses Ray's object store without per-row overhead.

Sequence layout used by the RLVR pipeline (all right-aligned prompts, left-aligned responses):
- `prompts` (B, P) left-padded, `responses` (B, R) right-padded, `response_mask` (B, R) 1 for generated tokens;
- `input_ids` = cat(prompts, responses) (B, P+R), `attention_mask` (B, P+R), `position_ids` (B, P+R).
"""

from __future__ import annotations

import operator
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
        scalars = [str(k) for k, v in tensors.items() if v.ndim == 0]
        if scalars:
            raise ValueError(f"batch tensors need a leading row dimension; {scalars} are 0-d (put scalars in meta)")
        detail = {str(k): int(v.shape[0]) for k, v in tensors.items()} | {k: len(v) for k, v in (fields or {}).items()}
        if isinstance(tensors, TensorDict) and tensors.batch_dims:
            # A TensorDict's own batch size counts too: fields must match it even when it holds no tensors.
            detail["<TensorDict batch_size>"] = int(tensors.batch_size[0])
        sizes = set(detail.values())
        if len(sizes) > 1:
            raise ValueError(f"batch entries disagree on the number of rows: {detail}")
        n = sizes.pop() if sizes else 0
        if isinstance(tensors, TensorDict) and not tensors.batch_dims:
            # A TensorDict without a batch dimension cannot be indexed by row; Ray's round trip gave it [n] while the
            # local backend kept it and failed: both backends now get the row dimension here.
            tensors = TensorDict(dict(tensors.items()), batch_size=[n], device=tensors.device)
        # A TensorDict given is copied shallowly (its tensors are shared, as the fields' values are): kept as it was,
        # a key set on this batch (or a tensor made a field, deleted from the TensorDict) changed every other batch
        # built on the same TensorDict, while the fields and meta were this batch's own.
        self.td = (
            tensors.clone(recurse=False)
            if isinstance(tensors, TensorDict)
            else TensorDict(dict(tensors), batch_size=[n])
        )
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
        if isinstance(value, Tensor) and value.ndim == 0:
            raise ValueError(f"{key!r} is a 0-d tensor; batch tensors need a leading row dimension")
        n = int(value.shape[0]) if isinstance(value, Tensor) else len(value)
        # A batch with entries fixes its row count, 0 included: an empty batch must not take a 3-row field.
        has_entries = bool(len(self.td.keys()) or self.fields)
        if (self._n or has_entries) and n != self._n:
            raise ValueError(f"{key!r} has {n} rows, batch has {self._n}")
        if not self._n and not has_entries:
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
    def index(self, rows: Tensor | Sequence[int] | Sequence[bool] | slice) -> Batch:
        """Rows selected by integer indices (tensor or list, order kept, negatives count from the end), a slice, or a
        boolean mask (tensor or list) of exactly len(self) entries.

        Raises:
            ValueError: a mask of the wrong length, an index tensor of more than one dimension, a uint8 tensor
                (torch reads one as a mask, its values read as indices: ambiguous), or a non-integer index (a float
                tensor or entry: truncated, it picked another row).
            IndexError: an index out of range.
        """
        if isinstance(rows, slice):
            idx = list(range(self._n))[rows]
        else:
            if not isinstance(rows, Tensor | list | tuple | range) and hasattr(rows, "__array__"):
                rows = torch.as_tensor(rows)  # a numpy array: its bool dtype must still read as a mask
            if isinstance(rows, Tensor):
                if rows.ndim > 1:
                    raise ValueError(f"index: rows must be 1-d, got shape {tuple(rows.shape)}")
                if rows.dtype == torch.uint8:  # torch reads it as a mask, a list of its values as indices
                    raise ValueError("index: a uint8 tensor is ambiguous (mask or indices): pass a bool mask or longs")
                if (rows.is_floating_point() or rows.is_complex()) and rows.numel():
                    # `int()` truncated each value (0.9 picked row 0); an empty one (torch.tensor([])) picks nothing
                    raise ValueError(f"index: rows must be integers or a bool mask, got a {rows.dtype} tensor")
                vals = rows.reshape(-1).tolist()
                is_mask = rows.dtype == torch.bool
            else:
                vals = list(rows)
                # Only an all-bool, non-empty list is a mask (bool is an int subclass: check the type exactly). A
                # numpy bool or 0-d bool tensor (`list(mask)`) is a bool too: read as 0/1 it picked rows 0 and 1.
                is_mask = bool(vals) and all(_is_bool(v) for v in vals)
                vals = [bool(v) for v in vals] if is_mask else vals
            if is_mask:
                # A mask read as indices would silently pick rows 0 and 1 over and over.
                if len(vals) != self._n:
                    raise ValueError(f"index: boolean mask has {len(vals)} entries, batch has {self._n} rows")
                vals = [i for i, keep in enumerate(vals) if keep]
            idx = [_row(i) for i in vals]
        bad = [i for i in idx if not -self._n <= i < self._n]
        if bad:
            raise IndexError(f"index: rows {bad[:5]} out of range for a batch of {self._n} rows")
        idx = [i % self._n for i in idx] if self._n else idx
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
        """Entries of both batches (same rows). A key in both must hold equal values of the same kind (tensor or
        field) and dtype (NaNs compare equal). Meta is merged; on a shared meta key `other`'s value wins."""
        if len(other) != self._n:
            raise ValueError(f"cannot union batches of {self._n} and {len(other)} rows")
        kinds = [k for k in other.td.keys() if k in self.fields] + [k for k in other.fields if k in self.td.keys()]
        if kinds:
            raise ValueError(f"union: {sorted(map(str, kinds))} are a tensor in one batch and a field in the other")
        out = Batch(self.td.clone(recurse=False), dict(self.fields), {**self.meta, **other.meta})
        for k, v in other.td.items():
            if k in self.td.keys() and not _same_tensor(self.td[k], v):
                mine = self.td[k]
                raise ValueError(
                    f"union: tensor {k!r} differs between the batches ({mine.dtype}{tuple(mine.shape)} vs "
                    f"{v.dtype}{tuple(v.shape)})"
                )
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
        """Consecutive chunks of at most `size` rows (size >= 1; an empty batch gives no chunks)."""
        if size < 1:
            raise ValueError(f"chunk size must be >= 1, got {size}")
        for s in range(0, self._n, size):
            yield self.index(slice(s, s + size))

    @staticmethod
    def concat(batches: Iterable[Batch]) -> Batch:
        """Rows of all batches in order.

        Every batch must hold the same tensor keys and field keys; each tensor key must agree in dtype and in every
        dimension but the first across the non-empty batches (pad ragged responses first: no silent dtype promotion,
        no implicit padding). Empty batches are skipped, so their widths never matter. Meta is the first batch's
        (later batches' meta is dropped), less the split metadata.

        Raises:
            ValueError: differing keys, a key that is a tensor in one batch and a field in another, or a tensor
                whose dtype or trailing shape differs.
        """
        batches = [b for b in batches]
        if not batches:
            return Batch()
        t_keys, f_keys = {str(k) for k in batches[0].td.keys()}, set(batches[0].fields)
        for b in batches[1:]:
            if {str(k) for k in b.td.keys()} != t_keys or set(b.fields) != f_keys:
                raise ValueError(
                    f"cannot concat batches with tensors {sorted(t_keys)}, fields {sorted(f_keys)} and "
                    f"tensors {sorted(map(str, b.td.keys()))}, fields {sorted(b.fields)}"
                )
        meta = {k: v for k, v in batches[0].meta.items() if k not in ("split_index", "split_sizes")}
        nonempty = [b for b in batches if len(b)] or batches[:1]
        for k in sorted(t_keys):
            layouts = {(b.td[k].dtype, tuple(b.td[k].shape[1:])) for b in nonempty}
            if len(layouts) > 1:
                got = [f"{b.td[k].dtype}{tuple(b.td[k].shape)}" for b in nonempty]
                raise ValueError(f"cannot concat tensor {k!r}: dtypes/trailing shapes differ across batches: {got}")
        td = torch.cat([b.td for b in nonempty]) if len(nonempty[0].td.keys()) else None
        fields = {k: [x for b in nonempty for x in b.fields[k]] for k in nonempty[0].fields}
        return Batch(td, fields, meta)

    def to(self, device: str | torch.device) -> Batch:
        """Tensors moved to `device`."""
        return Batch(self.td.to(device), self.fields, self.meta)

    # ---- pickling (Ray) -----------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # torch pickles a tensor's whole storage: a 2-row slice of a 1 GB buffer would ship the full GB.
        tensors = {k: _compact(v) for k, v in self.tensors().items()}
        batch_size = list(self.td.batch_size)  # all batch dims: the local backend's copy keeps them too
        return {"tensors": tensors, "fields": self.fields, "meta": self.meta, "n": self._n, "batch_size": batch_size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.td = TensorDict(state["tensors"], batch_size=state.get("batch_size", [state["n"]]))
        self.fields, self.meta, self._n = state["fields"], state["meta"], state["n"]


def _row(v: Any) -> int:
    """An index entry as an int: ints, NumPy integers and integer 0-d tensors (`operator.index`); ValueError for
    anything else (a float was truncated by `int()`: 2.7 picked row 2)."""
    try:
        return operator.index(v)
    except TypeError:
        raise ValueError(f"index: rows must be integers or a bool mask, got {v!r:.40} ({type(v).__name__})") from None


def _is_bool(v: Any) -> bool:
    """A Python bool, a numpy bool or a 0-d bool tensor (an entry of a boolean mask given as a list)."""
    if isinstance(v, bool):
        return True
    if isinstance(v, Tensor):
        return v.ndim == 0 and v.dtype == torch.bool
    # np.bool_ without importing numpy: named "bool" in numpy 2, "bool_" in numpy 1.x (roll-core pins neither)
    return type(v).__name__ in ("bool", "bool_") and type(v).__module__ == "numpy"


def _compact(t: Tensor) -> Tensor:
    """`t` itself when it owns exactly its contiguous storage, else a compact contiguous copy (for pickling)."""
    if not isinstance(t, Tensor):
        return t
    exact = t.is_contiguous() and t.storage_offset() == 0
    if exact and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    """Equal dtype, shape and values, NaN equal to NaN (union's conflict test)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() or a.is_complex():
        nan_a, nan_b = a.isnan(), b.isnan()
        return bool(torch.equal(nan_a, nan_b) and torch.equal(a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)))
    return bool(torch.equal(a, b))
