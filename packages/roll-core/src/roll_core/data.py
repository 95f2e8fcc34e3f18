"""Prompt sampling with a resumable position: per-epoch seeded permutations, state = (epoch, position).

The contract of `PromptSampler(size, seed, window=W)` (W: the rollout batch size; with the default 1, the first
point only), over the stream of every index it draws, however the draws cut it (whole batches, dynamic-sampling
refills, one at a time):
- every epoch (`size` prompts in a row, from the run's start) holds every prompt exactly once: an epoch boundary
  inside a draw carries over (the draw ends the old epoch and starts the next), nothing is dropped or skipped;
- any W prompts in a row are distinct (any `size` in a row, for a training set smaller than a batch: every batch
  then holds every prompt, the extra ones in turn, and each epoch repeats the first one's order): the next epoch's
  order is the seed's shuffle with each prompt of the old epoch's last W-1 moved on until it comes back no sooner
  than W draws after its last use (only the first 2(W-1) places can change). Before, a batch straddling two
  epochs could hold a prompt twice (10 prompts, batches of 4: 2 + 2 across the boundary, in 34 of 90 such
  batches) and, smaller than a batch, some prompts twice and others not at all. The asynchronous collector's
  batch is groups started over more than W draws: only W starts in a row are covered there;
- the stream depends only on (size, seed, W); the state (epoch, position, and the changed head of the epoch's
  order when the seam moved prompts) resumes it exactly, mid-epoch or mid-draw. A checkpoint of a roll that
  saved no head continues its epoch in the order it was saved with; later epochs follow the contract. The state
  holds W too (`window`, as given: pipeline.rollout_batch_size): a resume with another one (capped at `size`, the
  window in use) is an info line naming both, since the stream then is neither run's (the epoch goes on in its
  saved order; the next ones keep the new W distinct); a state without it (saved by an older roll) loads as before.
`DomainSampler` mixes several domains (slices of one training list) by fixed per-batch counts or random weights;
each domain keeps its own epoch order under the same contract (W: its count per batch, or the batch size for
weights), and its state (each domain's state, draws made, the batch size) resumes exactly too (the same domains in
the same order and sizes; otherwise a ConfigError naming them). A resume with another batch size (a changed
pipeline.rollout_batch_size) is logged under weights (the mix goes on; each domain's window is the new size from its
next epoch on) and a ConfigError under counts (the cycle of counts is one batch long; the config check refuses
env.counts not summing to it first). `check_counts`: fixed counts sum to the batch size. `make_sampler`
warns when a batch must repeat prompts: a training set (or a domain, for its fixed count or its weight's expected
share) smaller than one batch.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
from collections.abc import Mapping
from typing import Any

from roll_core.errors import ConfigError
from roll_core.seeds import Purpose, derive_seed

log = logging.getLogger(__name__)


class PromptSampler:
    """Draws indices into a list of `size` items, epoch by epoch, without replacement within an epoch; any
    `window` in a row distinct (see the module docstring)."""

    def __init__(self, size: int, seed: int = 0, shuffle: bool = True, window: int = 1) -> None:
        if size < 1:
            raise ValueError("cannot sample from an empty training set")
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.window = min(window, size)  # a list smaller than a batch: any `size` in a row distinct
        self._given_window = window  # (the state's: a resume names the batch size the user set, not the cap)
        self.epoch, self.position = 0, 0
        self._perm = self._permutation(0)
        self._head: list[int] = []  # the start of this epoch's order where it differs from _permutation's

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(derive_seed(self.seed, Purpose.DATA_ORDER, epoch)).shuffle(order)
        return order

    def _next_epoch(self) -> None:
        """Start the next epoch: its permutation, with every prompt of the old epoch's last `window - 1` moved on
        until it is `window` draws from its last use (greedy: each place takes the first prompt, in the shuffled
        order, allowed there)."""
        tail = self._perm[len(self._perm) - (self.window - 1) :] if self.window > 1 else []
        self.epoch += 1
        self.position = 0
        base = self._permutation(self.epoch)
        # Prompt -> first allowed place: `a` draws before the boundary, it may come back at place window - a.
        allowed = {p: self.window - a for a, p in enumerate(reversed(tail), start=1)}
        if not allowed:
            self._perm, self._head = base, []
            return
        # Places 0..window-2 are filled from the first 2(window-1) of the order, which hold at least window-1
        # prompts without a constraint; from place window-1 on every prompt is allowed and the order resumes.
        n = min(self.size, 2 * (self.window - 1))
        rest, head = base[:n], []
        for place in range(min(self.window - 1, n)):
            i = next(i for i, p in enumerate(rest) if allowed.get(p, 0) <= place)
            head.append(rest.pop(i))
        head += rest
        changed = [i for i in range(n) if head[i] != base[i]]
        self._head = head[: changed[-1] + 1] if changed else []
        self._perm = head + base[n:]

    def next(self, k: int) -> list[int]:
        """The next k indices (crossing into the next epoch when needed)."""
        out: list[int] = []
        while len(out) < k:
            if self.position >= self.size:
                self._next_epoch()
            take = min(k - len(out), self.size - self.position)
            out += self._perm[self.position : self.position + take]
            self.position += take
        return out

    def progress(self) -> float:
        """Epochs drawn so far, fractional (1.5: the whole list once and half of it again)."""
        return self.epoch + self.position / self.size

    def state_dict(self) -> dict[str, Any]:
        """Position and identity of the stream; `head` (only when the boundary moved prompts) the start of this
        epoch's order, which depends on the previous epoch's end and so is not rebuilt from (seed, epoch)."""
        state: dict[str, Any] = {"epoch": self.epoch, "position": self.position, "size": self.size, "seed": self.seed}
        state["window"] = self._given_window
        if self._head:
            state["head"] = list(self._head)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved stream exactly; a state of another training set, seed or kind is a ConfigError."""
        if "size" not in state:  # a multi-domain run's state (a KeyError said nothing of what to do)
            raise ConfigError(
                f"the checkpoint's data position is for domains {sorted(state.get('domains', {}))}; this run samples "
                "one training list: resume with the env the run was saved with, or start a new run"
            )
        if state["size"] != self.size or state["seed"] != self.seed:
            raise ConfigError(
                f"the checkpoint's data position is for a training set of {state['size']} prompts drawn with seed "
                f"{state['seed']}; this run has {self.size} prompts and seed {self.seed}: resume with the data and "
                "pipeline.seed the run was saved with, or start a new run"
            )
        base = self._permutation(state["epoch"])
        head = [int(i) for i in state.get("head", ())]  # none: saved by an older roll, or nothing was moved
        if sorted(head) != sorted(base[: len(head)]):
            raise ConfigError(
                f"the checkpoint's data position (epoch {state['epoch']}) holds a start of the epoch's order that "
                "is no reordering of that epoch's shuffle: the state was edited or saved by an incompatible roll"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._head, self._perm = head, head + base[len(head) :]
        saved = state.get("window")  # absent from checkpoints of before: not known
        if saved is not None and min(int(saved), self.size) != self.window:  # (the stream changed silently)
            log.info(
                "the training order resumes with pipeline.rollout_batch_size=%d (the checkpoint's was %d): this "
                "epoch goes on in its saved order; from the next one on, any %d drawn in a row are distinct (not "
                "the order the checkpoint's run would have drawn)",
                self._given_window,
                int(saved),
                self.window,
            )


class DomainSampler:
    """Indices into a training list made of one slice per domain, mixed per draw.

    `counts` (fixed prompts per domain per `batch_size` prompts: the domains follow a fixed cycle of `batch_size`
    slots holding each domain `counts[d]` times, spread evenly, and every draw takes the next slots, so any
    `batch_size` prompts in a row, however they are drawn (a whole batch, a dynamic-sampling refill, one prompt at a
    time by the asynchronous collector), hold exactly `counts`) or `weights` (each prompt's domain drawn at random
    with these shares, from a stream seeded by the draw's number). Exactly one of them is non-empty. Within a
    domain, prompts come in that domain's own epoch order (a `PromptSampler`). Indices come out grouped by domain.
    """

    def __init__(
        self,
        slices: Mapping[str, range],
        *,
        weights: Mapping[str, float],
        counts: Mapping[str, int],
        batch_size: int,
        seed: int = 0,
    ) -> None:
        if bool(weights) == bool(counts):
            raise ValueError("give the domains' weights or their counts (exactly one)")
        check_counts(counts, batch_size)
        self.domains = list(slices)
        self.slices = dict(slices)
        self.weights, self.counts, self.batch_size, self.seed = dict(weights), dict(counts), batch_size, seed
        # A domain's prompts in a batch are consecutive draws of its sampler: at most its count (fixed counts),
        # or the whole batch (weights), so that many in a row are distinct.
        self.samplers = {
            d: PromptSampler(
                len(self.slices[d]),
                seed=derive_seed(seed, Purpose.DOMAIN_ORDER, i),
                window=max(1, counts.get(d, 0)) if counts else batch_size,
            )
            for i, d in enumerate(self.domains)
        }
        self.draws = 0  # draws made (weights) or slots of the cycle taken (counts)
        self.cycle = self._cycle() if counts else []

    def _cycle(self) -> list[str]:
        """`batch_size` slots, domain d in `counts[d]` of them, each slot going to the domain furthest behind its
        share (ties: domain order): [a, b, a, a, b, a] for counts a=4, b=2."""
        given = dict.fromkeys(self.domains, 0)
        out = []
        for j in range(self.batch_size):
            d = max(self.domains, key=lambda d: self.counts.get(d, 0) * (j + 1) / self.batch_size - given[d])
            given[d] += 1
            out.append(d)
        return out

    def split(self, k: int) -> dict[str, int]:
        """Prompts per domain in a draw of `k` (advances the cycle or the random stream)."""
        if self.counts:
            picked = [self.cycle[(self.draws + j) % self.batch_size] for j in range(k)]
            self.draws += k
            return {d: picked.count(d) for d in self.domains}
        rng = random.Random(derive_seed(self.seed, Purpose.DOMAIN_MIX, self.draws))
        self.draws += 1
        picked = rng.choices(self.domains, weights=[self.weights.get(d, 0.0) for d in self.domains], k=k)
        return {d: picked.count(d) for d in self.domains}

    def next(self, k: int) -> list[int]:
        """The next k indices into the whole training list."""
        out: list[int] = []
        for d, n in self.split(k).items():
            if n:
                out += [self.slices[d][i] for i in self.samplers[d].next(n)]
        return out

    def progress(self) -> float:
        """Epochs drawn so far of the domain least drawn (fractional; every domain has its own epochs), among the
        domains that are drawn at all: one weighted or counted 0 is never drawn and held data/epoch at 0."""
        share = self.counts or self.weights
        drawn = [s for d, s in self.samplers.items() if share.get(d, 0) > 0] or list(self.samplers.values())
        return min(s.progress() for s in drawn)

    def state_dict(self) -> dict[str, Any]:
        states = {d: s.state_dict() for d, s in self.samplers.items()}
        return {"draws": self.draws, "batch_size": self.batch_size, "domains": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved mix exactly. Other domains, the same domains in another order (each domain's order
        is seeded by its place: env.tasks listed in another order) or a domain with another number of prompts
        are ConfigErrors naming the domains (they read as a changed pipeline.seed or training set before)."""
        if "domains" not in state or sorted(state["domains"]) != sorted(self.domains):
            raise ConfigError(
                f"sampler state is for domains {sorted(state.get('domains', {})) or 'of a single-domain run'}; "
                f"this run has {sorted(self.domains)}"
            )
        places = {derive_seed(self.seed, Purpose.DOMAIN_ORDER, i): i for i in range(len(self.domains))}
        saved = {d: places.get(s.get("seed")) for d, s in state["domains"].items()}
        if None not in saved.values() and saved != {d: i for i, d in enumerate(self.domains)}:
            order = sorted(saved, key=lambda d: saved[d])
            raise ConfigError(
                f"the checkpoint's domains were in the order {order}; this run has them in the order {self.domains} "
                "(the order of env.tasks, or of the rows' domains with env.route=column): the data position and the "
                f"training list depend on it; resume with the domains in the order {order}"
            )
        for d, s in state["domains"].items():
            if s.get("size") != self.samplers[d].size:
                raise ConfigError(
                    f"the checkpoint's data position is for {s.get('size')} training prompts of domain {d!r}; this "
                    f"run has {self.samplers[d].size}: resume with the data the run was saved with, or start a new run"
                )
        self._check_batch_size(state.get("batch_size"))  # (absent from checkpoints of before: not known)
        for d, s in state["domains"].items():
            # each domain's window is its count or the batch size: the mix's own check says a change once
            self.samplers[d].load_state_dict({k: v for k, v in s.items() if k != "window"})
        self.draws = state["draws"]

    def _check_batch_size(self, saved: int | None) -> None:
        """A checkpoint drawn with batches of another size: counts' cycle of slots would restart mid-cycle in
        another one (a ConfigError); weights' draws go on, said once (it continued silently)."""
        if saved is None or int(saved) == self.batch_size:
            return
        if self.counts:
            raise ConfigError(
                f"the checkpoint's domain mix is a cycle of {saved} prompts per batch (env.counts); this run has "
                f"pipeline.rollout_batch_size={self.batch_size}: resume with pipeline.rollout_batch_size={saved}"
            )
        log.info(
            "the domain mix resumes with pipeline.rollout_batch_size=%d (the checkpoint's was %d): env.weights' "
            "shares are unchanged; each domain keeps its prompts distinct within a batch of the new size from its "
            "next epoch on",
            self.batch_size,
            int(saved),
        )


def check_counts(counts: Mapping[str, int], batch_size: int) -> None:
    """Fixed per-domain counts (none: weights) sum to the batch size; a ConfigError otherwise. The prompts
    collectors' `check_task` calls it with the task's `mixture()` before any model loads (said when the sampler was
    built, after the engines had loaded the model: minutes on a GPU)."""
    if counts and sum(counts.values()) != batch_size:
        raise ConfigError(
            f"env.counts={dict(counts)} sums to {sum(counts.values())}; it must equal "
            f"pipeline.rollout_batch_size={batch_size} (prompts per batch)"
        )


def make_sampler(task: Any, *, batch_size: int, seed: int) -> PromptSampler | DomainSampler:
    """A `DomainSampler` for a multi-domain task (one with `domain_slices()` and `mixture()`), else a
    `PromptSampler` over the task's training set. A training set smaller than a batch (or a domain smaller than
    its count per batch, or than its expected share of a batch under weights) is a warning: every batch (most
    batches, under weights) then holds some prompts more than once."""
    if hasattr(task, "domain_slices") and hasattr(task, "mixture"):
        weights, counts = task.mixture()
        slices = task.domain_slices()
        for d, n in counts.items():
            if d in slices and len(slices[d]) < n:
                log.warning(
                    "domain %r has %d training prompt(s), fewer than its %d per batch (env.counts): every batch "
                    "repeats some of them",
                    d,
                    len(slices[d]),
                    n,
                )
        # Weights draw each batch's split at random, so a domain's count varies; one smaller than its expected
        # share repeats prompts in most batches all the same (counts mode warned, weights said nothing).
        total = sum(w for w in weights.values() if w > 0)
        for d, w in weights.items():
            expected = batch_size * w / total if w > 0 else 0.0
            if d in slices and len(slices[d]) < expected:
                log.warning(
                    "domain %r has %d training prompt(s), fewer than the %.3g per batch its weight gives "
                    "(env.weights: %.3g of pipeline.rollout_batch_size=%d): most batches repeat some of them",
                    d,
                    len(slices[d]),
                    expected,
                    w / total,
                    batch_size,
                )
        return DomainSampler(slices, weights=weights, counts=counts, batch_size=batch_size, seed=seed)
    size = len(task.train_set())
    if size < batch_size:
        log.warning(
            "the training set has %d prompt(s), fewer than pipeline.rollout_batch_size=%d: every batch repeats some "
            "of them (an epoch is shorter than a step)",
            size,
            batch_size,
        )
    return PromptSampler(size, seed=seed, window=batch_size)


def data_fingerprint(problems: list[Any]) -> str:
    """A hash of a training list's prompts, answers, pictures and chat context, in order (a checkpoint's position
    means these problems): rows asking the same question about other pictures, or after other turns (a chat row's
    own system message and earlier turns, `context`; a multi-domain row's is its source problem's), are other
    problems. Pictures count by `roll_core.multimodal.images.source_key` (bytes hashed, paths with their file's
    size, nothing decoded); a row without pictures or context hashes as it always did, so text runs' saved
    fingerprints still match."""
    from roll_core.multimodal.images import source_key

    h = hashlib.sha256()
    for p in problems:
        h.update(repr((getattr(p, "prompt", p), getattr(p, "answer", None))).encode("utf-8", "replace"))
        images = getattr(p, "images", None) or ()
        if images:
            h.update(b"\x01" + "\x00".join(source_key(im) for im in images).encode("utf-8", "replace"))
        context = getattr(p, "context", None) or getattr(getattr(p, "source", None), "context", None) or ()
        if context:
            h.update(b"\x02" + repr([sorted(dict(m).items()) for m in context]).encode("utf-8", "replace"))
        h.update(b"\x00")
    return h.hexdigest()[:16]


class LockedSampler:
    """A sampler shared by threads: `next`, `state_dict` and `load_state_dict` of the wrapped sampler run one at a
    time (the asynchronous collector's driver thread draws prompts while the trainer checkpoints: a state read in
    the middle of a draw that crossed an epoch held the new epoch with the old position, and a resumed run skipped
    an epoch)."""

    def __init__(self, inner: PromptSampler | DomainSampler) -> None:
        self.inner = inner
        self._lock = threading.Lock()

    def next(self, k: int) -> list[int]:
        with self._lock:
            return self.inner.next(k)

    def progress(self) -> float:
        with self._lock:
            return self.inner.progress()

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self.inner.load_state_dict(state)
