"""Prefix reuse across requests: a finished sequence's KV is kept so a request that extends it (a conversation's
next turn: the same ids plus a response and an observation) prefills only its new tokens.

Multi-turn rollouts resend the whole conversation every turn; without reuse every turn re-encodes everything
before it (quadratic in the number of turns). Entries are keyed by the exact token ids the cache holds, taken
(removed) by the first request they prefix, evicted least-recently-stored first beyond a byte budget, and all
dropped when the weights change (their keys and values belong to the old weights).
"""

from __future__ import annotations

from collections import OrderedDict

from torch import Tensor

KV = list[tuple[Tensor, Tensor]]  # per layer: keys and values of one row, (1, H, L, D)


class PrefixStore:
    """Finished sequences' KV by token ids, within a byte budget."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.entries: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.reused_tokens = 0

    @staticmethod
    def _size(kv: KV) -> int:
        return sum(t.numel() * t.element_size() for k, v in kv for t in (k, v))

    def put(self, ids: tuple[int, ...], kv: KV) -> None:
        size = self._size(kv)
        if not ids or size > self.budget:
            return
        old = self.entries.pop(ids, None)
        if old is not None:
            self.bytes -= self._size(old)
        self.entries[ids] = kv
        self.bytes += size
        while self.bytes > self.budget:
            _, evicted = self.entries.popitem(last=False)
            self.bytes -= self._size(evicted)

    def take(self, prompt: list[int]) -> tuple[int, KV] | None:
        """The longest stored sequence that is a strict prefix of `prompt` (at least one new token must remain to
        be encoded); removed from the store. None when nothing matches."""
        best = None
        n = len(prompt)
        for ids in self.entries:
            m = len(ids)
            if m < n and (best is None or m > len(best)) and tuple(prompt[:m]) == ids:
                best = ids
        if best is None:
            return None
        kv = self.entries.pop(best)
        self.bytes -= self._size(kv)
        self.hits += 1
        self.reused_tokens += len(best)
        return len(best), kv

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0
