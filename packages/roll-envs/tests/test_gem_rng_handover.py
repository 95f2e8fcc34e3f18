"""GEM's private global RNGs (roll_envs.agentic.gem_adapter._PrivateGlobalRNG): one hung GEM call must not stall
every other GEM environment of the process, nor leave the caller's `random` clobbered."""

from __future__ import annotations

import random
import threading
import time

from roll_envs.agentic.gem_adapter import _PrivateGlobalRNG


def test_a_hung_call_is_handed_over_from_and_never_clobbers_the_global_rng_later() -> None:
    """A GEM call that hangs held one process-wide lock for good: every later GEM call of the process (healthy
    instances included) blocked, and roll's env manager timed out every GEM episode from then on."""
    hung, other = _PrivateGlobalRNG(seed=0, wait_s=0.2), _PrivateGlobalRNG(seed=1, wait_s=0.2)
    before = _PrivateGlobalRNG.handovers
    random.seed(123)
    caller = random.Random(123)
    entered, release = threading.Event(), threading.Event()
    began: list[float] = []  # before the hung call took the RNGs

    def hang() -> None:
        began.append(time.monotonic())
        with hung.active():
            entered.set()
            release.wait(120)  # (a hung call that draws meanwhile disturbs whoever holds the RNGs: unavoidable)

    t = threading.Thread(target=hang, daemon=True)
    t.start()
    assert entered.wait(60)
    drawn: list[float] = []
    got: list[float] = []  # when the healthy call had the RNGs

    def healthy() -> None:
        with other.active():
            drawn.append(random.random())
            got.append(time.monotonic())

    h = threading.Thread(target=healthy, daemon=True)
    h.start()
    h.join(60)  # the hung call holds the RNGs until `release`: a healthy call that waits for it stays alive
    try:
        assert not h.is_alive(), "a healthy GEM call waited for good behind a hung one"
        assert got[0] - began[0] >= 0.2  # it waited `wait_s` for the RNGs before taking them over
        assert drawn == [random.Random(1).random()]  # its own state, not the hung call's
        assert _PrivateGlobalRNG.handovers == before + 1
        assert random.random() == caller.random()  # the caller's RNG as the hung call found it
    finally:
        release.set()
        t.join(60)
    assert not t.is_alive(), "the hung call never returned after its release"
    # The late return left the global RNG alone (restoring the state it saved on entry replayed the caller's draws).
    assert random.random() == caller.random()
    with hung.active():  # the RNGs are free again: no wait
        pass
    with other.active():
        second = random.Random(1)
        second.random()
        assert random.random() == second.random()  # its stream goes on where it stopped
    assert random.random() == caller.random()
