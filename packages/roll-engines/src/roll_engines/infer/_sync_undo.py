"""Undoing a weight sync of the hf inference engine that failed part way (roll_engines.infer.hf).

A sync overwrites the engine's tensors in place, bucket by bucket; one that fails after some buckets (a name the
model lacks, a wrong shape, a sender that died) left a model half new and half old, served with no error. Before a
tensor is overwritten its old value is copied here, so the engine can go back to its complete old weights.

Memory: only the tensors already overwritten are held (nothing up front; at most the synced ones, at the end of a
sync), in host memory so that a device engine's peak stays what it was, and all of it is freed when the sync ends.
Staging the new values and swapping at the end would cost as much, and swapping `p.data` would have to follow tied
weights, prepacked CPU kernels and FP8 emulation; copying old values back keeps every tensor where it is.

When the undo itself fails (a copy back raises: out of host or device memory, a broken device), the engine holds a
mix of two weight versions and must not serve it: `MixedWeights` names what is mixed (the tensors or layers the
failed sync wrote) and why, every token-serving call raises `mixed_error` instead, and a later sync that completes
and rewrites every one of them (a full sync does) makes the weights whole again. Syncs while mixed keep no copies:
a mix is not worth restoring, and one that fails adds what it wrote to the mix.

Weights discarded by `sleep(level=2)` are tracked the same way (`MixedWeights.discard`, with every tensor or layer
the engine loads): each is refused until syncs that complete have rewritten all of them; a sync that sends only some
(a changed-only sync) or fails leaves the rest discarded, and the error (`mixed_error(..., discarded=True)`) says a
sync that sends every weight must come first.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import torch
from torch import Tensor


class SyncUndo:
    """The values, from before one weight sync, of the tensors it has overwritten so far; nothing at all where the
    old weights are not worth restoring (`keep=False`: discarded by sleep(level=2), or already mixed)."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.written = 0  # tensors written by this sync
        self.error: BaseException | None = None  # why it failed; None while it holds
        self._saved: list[tuple[Tensor, Tensor]] = []
        self._seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
        #: The names (one per tensor) of what this sync wrote, kept or not: what it leaves mixed if not undone.
        self.names: set[Hashable] = set()

    def save(self, target: Tensor, name: Hashable | None = None) -> None:
        """Before `target` (named `name`, if tracked) is overwritten. A tensor reached under two names (tied
        weights) keeps its first copy: the second would be of what this sync wrote."""
        self.written += 1
        if name is not None:
            self.names.add(name)
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


class MixedWeights:
    """What a failed sync that could not be undone left holding a mix of two weight versions, or what a level-2
    sleep discarded and no completed sync has rewritten since (module docstring): keys of tensors (hf) or layers
    (vLLM's workers), and which sync (or sleep) did it. Empty (falsy) while the weights are whole."""

    def __init__(self) -> None:
        self.keys: set[Hashable] = set()
        self.since: str | None = None  # the failed sync and why its undo failed, or the sleep; None while whole
        self.discarded = False  # the first cause was a level-2 sleep: a sync of every weight is due

    def __bool__(self) -> bool:
        return bool(self.keys)

    def add(self, keys: Iterable[Hashable], since: str) -> None:
        """`keys` were written by a failed sync and not restored (`since`: which, and why); the first failure stays
        the one named."""
        self.keys.update(keys)
        if self.keys and self.since is None:
            self.since = since

    def rewritten(self, keys: Iterable[Hashable]) -> None:
        """A sync that completed wrote `keys`: those hold its version now, whole again once none is left."""
        self.keys.difference_update(keys)
        if not self.keys:
            self.since, self.discarded = None, False

    def discard(self, keys: Iterable[Hashable], since: str = "sleep(level=2)") -> None:
        """Every weight was discarded (`keys`: all the engine loads): none is servable until rewritten, and
        nothing of an earlier mix is left."""
        self.keys = set(keys)
        self.since, self.discarded = since, bool(self.keys)

    def clear(self) -> None:
        """The weights are taken as whole (a completed sync whose writes could not be followed)."""
        self.keys.clear()
        self.since, self.discarded = None, False

    def error(self, engine: str) -> RuntimeError:
        """What a token-serving call of `engine` raises while any key is left (`mixed_error`), naming a few."""
        examples = sorted(str(k) for k in self.keys)[:EXAMPLES]
        return mixed_error(engine, self.since, len(self.keys), discarded=self.discarded, examples=examples)


#: How many of the weights still to be rewritten an error names.
EXAMPLES = 5


def mixed_error(
    engine: str, since: str | None, left: int, discarded: bool = False, examples: Sequence[str] = ()
) -> RuntimeError:
    """The error every token-serving call of an engine with mixed weights raises (`left`: tensors or layers, 0 when
    not known, still to be rewritten, of which `examples` are named); `discarded`: its weights were discarded by
    `since` (a level-2 sleep)."""
    what = f" ({left} still to be rewritten)" if left > 0 else ""
    named = ""
    if examples:  # last, so that what a caller matches of the message above stays as it was
        more = ", ..." if left > len(examples) else ""
        named = f"; not rewritten yet: {', '.join(examples)}{more}"
    if discarded:
        return RuntimeError(
            f"{engine} engine: refusing to generate: its weights were discarded by {since}; a weight sync that "
            f"sends every weight must come first: syncs that complete must have rewritten all of them{what} (a "
            f"full sync does; a partial or failed one leaves the rest discarded){named}"
        )
    return RuntimeError(
        f"{engine} engine: refusing to generate: its weights are a mix of two versions since {since}; the next "
        f"weight sync that completes and rewrites every weight that sync wrote{what} (a full sync, or reloading the "
        f"engine) makes them whole again{named}"
    )
