"""EnvManager: failures end one call (counted), and a hung environment never costs a healthy one its time."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from roll_core.agentic.env_manager import EnvFailure, EnvManager


class _Env:
    """reset(seed): seed 0 hangs until `release` is set (at most `hang_s`, so that no thread outlives the tests
    for long), seed 1 raises, anything else answers at once. `hanging` counts the hung calls that started."""

    hang_s = 30.0
    release = threading.Event()
    hanging = threading.Semaphore(0)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        if seed == 0:
            self.hanging.release()
            self.release.wait(self.hang_s)
        if seed == 1:
            raise ValueError("broken")
        return f"obs-{seed}", {"seed": seed}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return action, float(len(action)), True, False, {}


@pytest.fixture(autouse=True)
def _release_hung_calls(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(_Env, "release", threading.Event())
    monkeypatch.setattr(_Env, "hanging", threading.Semaphore(0))
    yield
    _Env.release.set()


def test_results_errors_and_timeouts_are_told_apart_and_counted() -> None:
    m = EnvManager(_Env, 3, step_timeout_s=0.5, threads=4)
    assert m.reset(2, seed=7) == ("obs-7", {"seed": 7})
    assert m.step(2, "abc") == ("abc", 3.0, True, False, {})
    with pytest.raises(EnvFailure) as err:
        m.reset(1, seed=1)
    assert err.value.kind == "env_error" and "ValueError: broken" in str(err.value)
    broken = m.envs[0]
    with pytest.raises(EnvFailure) as err:
        m.reset(0, seed=0)
    assert err.value.kind == "env_timeout"
    assert m.envs[0] is not broken  # the hung instance is replaced, the slot works again
    assert m.reset(0, seed=5)[0] == "obs-5"
    assert m.counters() == {"env_errors": 1, "env_timeouts": 1, "leaked_threads": 1}


def test_hung_environments_do_not_make_healthy_ones_time_out() -> None:
    """With every thread taken by hung calls, a healthy call still gets its full timeout once it runs (a fixed
    thread pool queued it behind the hung ones and timed it out: 2 of ~10 e2e runs failed that way), and it runs
    while the hung calls still hang: a timed-out call gives its place back at once, not when it returns."""
    m = EnvManager(_Env, 6, step_timeout_s=0.5, threads=2)
    outcomes: dict[int, str] = {}

    def reset(slot: int, seed: int) -> None:
        try:
            outcomes[slot] = m.reset(slot, seed)[0]
        except EnvFailure as exc:
            outcomes[slot] = exc.kind

    hung = [threading.Thread(target=reset, args=(s, 0)) for s in (0, 1)]
    for t in hung:
        t.start()
    for _ in hung:  # both places are now taken by a hanging reset
        assert _Env.hanging.acquire(timeout=_Env.hang_s)
    healthy = [threading.Thread(target=reset, args=(s, 10 + s)) for s in (2, 3, 4, 5)]
    for t in healthy:
        t.start()
    guard = time.monotonic() + _Env.hang_s / 2  # a hang guard: a call that waits for a hung one never ends here
    for t in [*hung, *healthy]:
        t.join(timeout=max(guard - time.monotonic(), 0.0))
    # Nothing released the hung resets: the healthy ones ran in the places their timeouts gave back.
    assert outcomes == {0: "env_timeout", 1: "env_timeout", 2: "obs-12", 3: "obs-13", 4: "obs-14", 5: "obs-15"}
    assert not _Env.release.is_set() and sum(t.name == "roll-env-0-reset" for t in threading.enumerate()) >= 1
    assert m.counters()["leaked_threads"] == 2
    leaked = [t for t in threading.enumerate() if t.name.startswith("roll-env-")]
    assert leaked and all(t.daemon for t in leaked)  # a hung environment never blocks the process from exiting


def test_a_factory_that_fails_while_replacing_a_broken_environment_fails_one_episode_only() -> None:
    """The replacement of a failed environment is built at its slot's next reset, inside the call: a factory that
    raises then (a service briefly down) is that episode's counted env_error, never an exception out of the
    rollout; once the factory works again the slot does too."""
    built = {"n": 0, "down": False}

    def factory() -> _Env:
        built["n"] += 1
        if built["down"]:
            raise ConnectionError("sandbox service busy")
        return _Env()

    m = EnvManager(factory, 1, step_timeout_s=2.0, threads=2)
    built["down"] = True
    with pytest.raises(EnvFailure):
        m.reset(0, seed=1)  # the environment raises: its slot is emptied, nothing is built yet
    with pytest.raises(EnvFailure) as err:
        m.reset(0, seed=5)
    assert err.value.kind == "env_error" and "ConnectionError: sandbox service busy" in str(err.value)
    built["down"] = False
    assert m.reset(0, seed=5)[0] == "obs-5"
    assert m.counters()["env_errors"] == 2


def test_a_rebuild_that_timed_out_never_replaces_the_next_episodes_environment() -> None:
    """Episode B's rebuild of a failed slot hangs past the timeout (B ends, counted); episode C builds its own. When
    B's build finally returns it must not land in the slot: C would step an environment reset with B's seed."""

    class Seeded:
        def __init__(self, slow: bool) -> None:
            if slow:
                time.sleep(0.6)
            self.seed: int | None = None

        def reset(self, seed: int | None = None) -> tuple[str, dict]:
            self.seed = seed
            return f"seed {seed}", {}

        def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
            if self.seed == 111:
                raise RuntimeError("boom")  # episode A's environment breaks: the slot is rebuilt
            return f"stepped seed {self.seed}", 0.0, False, False, {}

    built = []

    def factory() -> Seeded:
        built.append(None)
        return Seeded(slow=len(built) == 2)  # the first rebuild (episode B's) is slow

    manager = EnvManager(factory, 1, step_timeout_s=0.3)
    manager.reset(0, 111)
    with pytest.raises(EnvFailure):
        manager.step(0, "x")
    with pytest.raises(EnvFailure) as b:
        manager.reset(0, 222)
    assert b.value.kind == "env_timeout"
    assert manager.reset(0, 333)[0] == "seed 333"
    time.sleep(0.6)  # B's build returns in its leaked thread
    assert manager.step(0, "go")[0] == "stepped seed 333"
    assert len(built) == 3 and manager.counters()["leaked_threads"] == 1
