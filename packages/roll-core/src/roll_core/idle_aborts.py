"""Requests an inference engine aborts on its own without a token (preemption, a pause, a refusal): how often they are
retried and how long to wait between tries, one rule for every caller (RLVR's asynchronous driver, the synchronous
RLVR collector's resumes, its evaluation's and pipeline=rollout's, agentic turns, the agent endpoint's turns).

Contract: a request aborted `max_idle_aborts` times in a row without a token is a refusal (the caller drops the row
or ends the turn, untrained). Every caller takes `max_idle_aborts` from `pipeline.max_idle_aborts` where it is built
from the config; `MAX_IDLE_ABORTS` is only its default (the schema's, and a caller's built without a config). Before
the next try after the `idle`-th such abort a caller waits `idle_backoff_s(idle)`: doubling from `IDLE_BACKOFF_S`, at
most `IDLE_BACKOFF_MAX_S` (`idle_backoff_total_s(max_idle_aborts)` in all, about 3.5 s with the default). Retried at
once, an engine paused for a moment (a weight sync, a preemption waiting for KV-cache blocks) used up every try
within milliseconds and the request was refused; an abort that came with tokens resets the count (no wait).
`check_max_idle_aborts` is the callers' check of a value given without the config (which validates its own).
"""

from __future__ import annotations

#: Default of `max_idle_aborts` (pipeline.max_idle_aborts): the engine's own aborts of one request in a row, none
#: with a token, after which it is refused.
MAX_IDLE_ABORTS = 8
#: The wait after the first idle abort, doubled after each further one, up to `IDLE_BACKOFF_MAX_S`.
IDLE_BACKOFF_S = 0.05
IDLE_BACKOFF_MAX_S = 1.0
#: The config key every caller's `max_idle_aborts` comes from (its errors name it).
KEY = "pipeline.max_idle_aborts"


def check_max_idle_aborts(value: object) -> int:
    """`value` if it is an integer >= 1 (not a bool), else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_idle_aborts={value!r} must be an integer >= 1 (aborts in a row: {KEY})")
    return value


def idle_backoff_s(idle: int) -> float:
    """Seconds to wait before the next try of a request the engine aborted `idle` (>= 1) times in a row without a
    token; 0 for `idle` < 1."""
    if idle < 1:
        return 0.0
    return min(IDLE_BACKOFF_S * 2 ** (idle - 1), IDLE_BACKOFF_MAX_S)


def idle_backoff_total_s(max_idle_aborts: int = MAX_IDLE_ABORTS) -> float:
    """The longest a request the engine keeps refusing waits in all before it is refused after `max_idle_aborts`
    idle aborts (no wait follows the last one)."""
    return sum(idle_backoff_s(k) for k in range(1, max_idle_aborts))
