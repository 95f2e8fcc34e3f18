"""Undoing a weight sync of the hf inference engine that failed part way (roll_engines.infer.hf).

A sync overwrites the engine's tensors in place, bucket by bucket; one that fails after some buckets (a name the
model lacks, a wrong shape, a sender that died) left a model half new and half old, served with no error. Before a
tensor is overwritten its old value is copied here, so the engine can go back to its complete old weights.

Memory: only the tensors already overwritten are held (nothing up front; at most the synced ones, at the end of a
sync), in host memory so that a device engine's peak stays what it was, and all of it is freed when the sync ends.
Staging the new values and swapping at the end would cost as much, and swapping `p.data` would have to follow tied
weights, prepacked CPU kernels and FP8 emulation; copying old values back keeps every tensor where it is.
"""

from __future__ import annotations

import torch
from torch import Tensor


class SyncUndo:
    """The values, from before one weight sync, of the tensors it has overwritten so far; nothing at all where the
    old weights are not worth restoring (`keep=False`: discarded by sleep(level=2))."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.written = 0  # tensors written by this sync
        self.error: BaseException | None = None  # why it failed; None while it holds
        self._saved: list[tuple[Tensor, Tensor]] = []
        self._seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()

    def save(self, target: Tensor) -> None:
        """Before `target` is overwritten. A tensor reached under two names (tied weights) keeps its first copy:
        the second would be of what this sync wrote."""
        self.written += 1
        key = (target.data_ptr(), tuple(target.shape), target.stride())
        if self.keep and key not in self._seen:
            self._seen.add(key)
            self._saved.append((target, target.to("cpu", copy=True)))

    def undo(self) -> int:
        """Give every overwritten tensor its old value (latest first, so overlapping views end on the oldest);
        returns how many."""
        n = len(self._saved)
        with torch.no_grad():
            while self._saved:
                target, old = self._saved.pop()
                target.copy_(old)
        self._seen.clear()
        return n
