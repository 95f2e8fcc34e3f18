"""Every random stream of a run is derived here, from the run's seed, a purpose and ids.

Contract: `derive_seed(seed, purpose, *ids)` is a pure function to [0, 2**31) (every engine and `random.Random`
accepts it); different purposes or ids give independent streams (a hash, not arithmetic: `seed * 7919 + step` for
two purposes collides as soon as the ids line up, which is how mini-batch shuffles and agentic seed draws shared
one stream). Purposes are the names in `Purpose`, so a grep finds every stream; an unknown purpose is an error.
"""

from __future__ import annotations

import hashlib
from enum import Enum


class Purpose(str, Enum):
    """What a random stream is for (one per consumer; add one rather than reuse one)."""

    ROLLOUT = "rollout"  # sampling a step's responses (ids: step, refill round)
    ASYNC_ROLLOUT = "async_rollout"  # the asynchronous driver's requests (ids: request number)
    EPISODE_TURN = "episode_turn"  # one agentic turn (ids: episode slot, turn)
    EPISODE_SEEDS = "episode_seeds"  # which environment seeds a step trains on (ids: step)
    SHUFFLE = "shuffle"  # mini-batch order of a step's update (ids: step)
    EVAL = "eval"  # held-out sampling
    DATA_ORDER = "data_order"  # the prompt sampler's epoch order (ids: epoch)
    ENGINE_ROW = "engine_row"  # one row of a batched generate call (ids: row)
    WORKER = "worker"  # one inference worker's share of a call (ids: rank)
    HELD_OUT = "held_out"  # a task's held-out split
    REPLICA_SHUFFLE = "replica_shuffle"  # one data-parallel replica's mini-batch order (seed: SHUFFLE's; ids: dp rank)
    WORKED_EXAMPLES = "worked_examples"  # the solved training problems a task shows before each question
    DOMAIN_ORDER = "domain_order"  # one domain's prompt order in a multi-domain run (ids: domain's position)
    DOMAIN_MIX = "domain_mix"  # which domain each prompt of a draw comes from (ids: draw number)


def derive_seed(seed: int, purpose: Purpose | str, *ids: int) -> int:
    """A seed in [0, 2**31) for the stream `purpose` of run seed `seed` at `ids` (step, row, ...)."""
    name = Purpose(purpose).value  # raises ValueError naming the bad purpose
    h = hashlib.blake2b(name.encode(), digest_size=8)
    for x in (seed, *ids):
        h.update(int(x).to_bytes(16, "little", signed=True))
    return int.from_bytes(h.digest(), "little") % 2**31
