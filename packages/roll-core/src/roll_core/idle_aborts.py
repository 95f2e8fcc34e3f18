"""Requests an inference engine aborts on its own without a token (preemption, a pause, a refusal): how often they are
retried and how long to wait between tries, one rule for every caller (the RLVR collector's resumes, agentic turns,
the agent endpoint's turns).

Contract: a request aborted `MAX_IDLE_ABORTS` times in a row without a token is a refusal (the caller drops the row or
ends the turn, untrained). Before the next try after the `idle`-th such abort a caller waits `idle_backoff_s(idle)`:
doubling from `IDLE_BACKOFF_S`, at most `IDLE_BACKOFF_MAX_S` (`idle_backoff_total_s()` in all, about 3.5 s). Retried at
once, an engine paused for a moment (a weight sync, a preemption waiting for KV-cache blocks) used up every try
within milliseconds and the request was refused; an abort that came with tokens resets the count (no wait).
"""

from __future__ import annotations

#: The engine's own aborts of one request in a row, none with a token, after which it is refused.
MAX_IDLE_ABORTS = 8
#: The wait after the first idle abort, doubled after each further one, up to `IDLE_BACKOFF_MAX_S`.
IDLE_BACKOFF_S = 0.05
IDLE_BACKOFF_MAX_S = 1.0


def idle_backoff_s(idle: int) -> float:
    """Seconds to wait before the next try of a request the engine aborted `idle` (>= 1) times in a row without a
    token; 0 for `idle` < 1."""
    if idle < 1:
        return 0.0
    return min(IDLE_BACKOFF_S * 2 ** (idle - 1), IDLE_BACKOFF_MAX_S)


def idle_backoff_total_s() -> float:
    """The longest a request the engine keeps refusing waits in all before it is refused."""
    return sum(idle_backoff_s(k) for k in range(1, MAX_IDLE_ABORTS))
