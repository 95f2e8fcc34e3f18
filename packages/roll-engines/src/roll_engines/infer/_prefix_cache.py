"""Prefix reuse across requests: a finished sequence's KV is kept so a request that extends it (a conversation's
next turn: the same ids plus a response and an observation) prefills only its new tokens.

Multi-turn rollouts resend the whole conversation every turn; without reuse every turn re-encodes everything
before it (quadratic in the number of turns). Entries are keyed by the exact token ids the cache holds and the
digests of the pictures among them (a vision-language prompt: equal ids with other pictures are another prompt, and
must never reuse these keys and values), taken
(removed) by the first request they prefix, evicted least-recently-stored first beyond a byte budget, and all
dropped when the weights change (their keys and values belong to the old weights).
"""

from __future__ import annotations

from collections import OrderedDict

from torch import Tensor

KV = list[tuple[Tensor, Tensor]]  # per layer: keys and values of one row, (1, H, L, D)
Key = tuple[tuple[int, ...], tuple[str, ...]]  # (token ids, digests of the pictures among them)


class PrefixStore:
    """Finished sequences' KV by token ids, within a byte budget."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.entries: OrderedDict[Key, KV] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.reused_tokens = 0

    @staticmethod
    def _size(kv: KV) -> int:
        return sum(t.numel() * t.element_size() for k, v in kv for t in (k, v))

    def put(self, ids: tuple[int, ...], kv: KV, pictures: tuple[str, ...] = ()) -> None:
        """Store the KV of `ids`, whose placeholders are those of the pictures with digests `pictures`."""
        size = self._size(kv)
        if not ids or size > self.budget:
            return
        key = (ids, tuple(pictures))
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= self._size(old)
        self.entries[key] = kv
        self.bytes += size
        while self.bytes > self.budget:
            _, evicted = self.entries.popitem(last=False)
            self.bytes -= self._size(evicted)

    def take(self, prompt: list[int], pictures: tuple[str, ...] = ()) -> tuple[int, KV, int] | None:
        """The longest stored sequence that is a strict prefix of `prompt` (at least one new token must remain to
        be encoded) and whose pictures are the first pictures of `pictures` (the prompt's digests, in order);
        removed from the store. Returns (prefix length, KV, pictures in the prefix); None when nothing matches."""
        best: Key | None = None
        n = len(prompt)
        for key in self.entries:
            ids, pics = key
            m = len(ids)
            if (
                m < n
                and (best is None or m > len(best[0]))
                and tuple(pictures[: len(pics)]) == pics
                and tuple(prompt[:m]) == ids
            ):
                best = key
        if best is None:
            return None
        kv = self.entries.pop(best)
        self.bytes -= self._size(kv)
        self.hits += 1
        self.reused_tokens += len(best[0])
        return len(best[0]), kv, len(best[1])

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0
