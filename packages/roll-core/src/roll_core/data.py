"""Prompt sampling with a resumable position: per-epoch seeded permutations, state = (epoch, position).

The permutation of epoch e depends only on (seed, e), so restoring (epoch, position) after a crash continues with
exactly the prompts the uninterrupted run would have seen. An epoch boundary inside a request wraps around.
"""

from __future__ import annotations

import random
from typing import Any

from roll_core.seeds import Purpose, derive_seed


class PromptSampler:
    """Draws indices into a list of `size` items, epoch by epoch, without replacement within an epoch."""

    def __init__(self, size: int, seed: int = 0, shuffle: bool = True) -> None:
        if size < 1:
            raise ValueError("cannot sample from an empty training set")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(derive_seed(self.seed, Purpose.DATA_ORDER, epoch)).shuffle(order)
        return order

    def next(self, k: int) -> list[int]:
        """The next k indices (crossing into the next epoch when needed)."""
        out: list[int] = []
        while len(out) < k:
            if self.position >= self.size:
                self.epoch += 1
                self.position = 0
                self._perm = self._permutation(self.epoch)
            take = min(k - len(out), self.size - self.position)
            out += self._perm[self.position : self.position + take]
            self.position += take
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "size": self.size, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != self.size or state["seed"] != self.seed:
            raise ValueError(
                f"sampler state is for size={state['size']}, seed={state['seed']}; "
                f"this run has size={self.size}, seed={self.seed}"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._perm = self._permutation(self.epoch)
