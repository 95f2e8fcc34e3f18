"""EnvManager: failures end one call (counted), and a hung environment never costs a healthy one its time."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from roll_core.agentic.env_manager import EnvFailure, EnvManager
from roll_core.testing.held_requests import threads_left


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
    assert m.counters() == {"env_errors": 1, "env_timeouts": 1, "leaked_threads": 1, "env_close_errors": 0}


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

    release = threading.Event()

    class Seeded:
        def __init__(self, slow: bool) -> None:
            if slow:
                release.wait(60)  # until episode C has built its own environment
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

    # 2 s: room for C's quick build on a loaded machine; B's build waits for `release`, so it times out anyway.
    manager = EnvManager(factory, 1, step_timeout_s=2.0)
    manager.reset(0, 111)
    with pytest.raises(EnvFailure):
        manager.step(0, "x")
    with pytest.raises(EnvFailure) as b:
        manager.reset(0, 222)
    assert b.value.kind == "env_timeout"
    assert manager.reset(0, 333)[0] == "seed 333"
    release.set()  # B's build returns in its leaked thread: wait until that thread has done all it does
    assert not threads_left("roll-env-0-", within_s=60)
    assert manager.step(0, "go")[0] == "stepped seed 333"
    assert len(built) == 3 and manager.counters()["leaked_threads"] == 1


class _Closing:
    """Records its close() calls in `closed` (instance numbers). step("raise") raises, step("hang") hangs until
    `release` is set; an instance built with `close_raises` raises from close() (after recording it)."""

    def __init__(self, number: int, closed: list[int], release: threading.Event, close_raises: bool) -> None:
        self.number, self.closed, self.release, self.close_raises = number, closed, release, close_raises

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return f"env {self.number}", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if action == "raise":
            raise RuntimeError(f"step of env {self.number} broke")
        if action == "hang":
            self.release.wait(10)
        return "ok", 0.0, False, False, {}

    def close(self) -> None:
        self.closed.append(self.number)
        if self.close_raises:
            raise OSError(f"close of env {self.number} broke")


def test_environments_are_closed_when_dropped_and_when_the_manager_closes() -> None:
    """Instances were never closed: a failed slot's was dropped and close() only set a flag (an environment holding
    a container or a connection kept it for the run). Dropped instances are closed (a hung call's once it returns,
    not under it), all at close(), once each; a close that raises is counted and never replaces the call's error."""
    closed: list[int] = []
    release = threading.Event()
    built: list[_Closing] = []

    def factory() -> _Closing:
        built.append(_Closing(len(built), closed, release, close_raises=len(built) == 2))
        return built[-1]

    m = EnvManager(factory, 4, step_timeout_s=2.0, threads=4)  # instances 0-3; 2's close raises
    try:
        for slot in range(3):
            m.reset(slot, seed=slot)
        with pytest.raises(EnvFailure, match="step of env 0 broke"):
            m.step(0, "raise")
        assert closed == [0]
        with pytest.raises(EnvFailure, match="step of env 2 broke") as err:  # not the close's OSError
            m.step(2, "raise")
        assert err.value.kind == "env_error" and closed == [0, 2] and m.counters()["env_close_errors"] == 1
        assert m.bad_observation(1, ValueError("bad picture")).kind == "env_error" and closed == [0, 2, 1]
        assert m.reset(0, seed=5)[0] == "env 4"  # the slot's replacement
        with pytest.raises(EnvFailure) as err:
            m.step(0, "hang")
        assert err.value.kind == "env_timeout" and closed == [0, 2, 1]  # not closed while its step still runs
        release.set()
        deadline = time.monotonic() + 60
        while 4 not in closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert closed == [0, 2, 1, 4]
    finally:
        release.set()
        m.close()
    assert sorted(closed) == [0, 1, 2, 3, 4] and len(built) == 5  # 3 (never reset) too; each once
    m.close()
    assert len(closed) == 5
    assert m.counters() == {"env_errors": 3, "env_timeouts": 1, "leaked_threads": 1, "env_close_errors": 1}
    with pytest.raises(RuntimeError, match="closed"):
        m.reset(0, seed=1)


class _Returns:
    """An environment whose step returns `out` (what a third-party environment might return)."""

    def __init__(self, out: tuple[Any, ...]) -> None:
        self.out = out

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return "start", {}

    def step(self, action: str) -> tuple[Any, ...]:
        return self.out


def _step(out: tuple[Any, ...]) -> tuple[Any, ...]:
    m = EnvManager(lambda: _Returns(out), 1, step_timeout_s=5.0)
    m.reset(0, seed=3)
    return m.step(0, "a")


def test_numpy_rewards_and_flags_are_coerced() -> None:
    np = pytest.importorskip("numpy")
    assert _step(("o", np.float32(1.5), np.bool_(True), np.bool_(False), {})) == ("o", 1.5, True, False, {})
    assert _step(("o", np.array(-2.0), np.array([False]), 0, {})) == ("o", -2.0, False, False, {})
    assert _step(("o", 1, 1, np.int64(0), None)) == ("o", 1.0, True, False, {})


@pytest.mark.parametrize(
    "out, why",
    [
        # bool("False") is True: the episode ended "terminated" on a flag that said it goes on
        (("o", 0.0, "False", False, {}), "terminated"),
        (("o", 0.0, False, "True", {}), "truncated"),
        (("o", 0.0, None, False, {}), "terminated"),
        (("o", 0.0, 2, False, {}), "terminated"),
        # float("1.0") made a string a reward; the contract says a reward that is not a number fails
        (("o", "1.0", False, False, {}), "reward"),
        (("o", None, False, False, {}), "reward"),
        (("o", [1.0], False, False, {}), "reward"),
        (("o", float("nan"), False, False, {}), "reward"),
        (("o", 10**400, False, False, {}), "reward"),
    ],
)
def test_a_malformed_reward_or_flag_fails_its_episode_clearly(out: tuple[Any, ...], why: str) -> None:
    m = EnvManager(lambda: _Returns(out), 1, step_timeout_s=5.0)
    m.reset(0, seed=3)
    with pytest.raises(EnvFailure) as err:
        m.step(0, "a")
    assert err.value.kind == "env_error" and f"step returned the {why}" in str(err.value)
    assert m.counters()["env_errors"] == 1


class _OldGymReset(_Returns):
    """An old-Gym environment: reset returns the observation alone (here `reset_out`)."""

    def __init__(self, reset_out: Any) -> None:
        super().__init__(("o", 0.0, False, False, {}))
        self.reset_out = reset_out

    def reset(self, seed: int | None = None) -> Any:
        return self.reset_out


@pytest.mark.parametrize(
    "reset_out",
    [
        # a 2-element observation was split into (observation, info): silently where the second part read as a
        # dict (empty, or pairs), else with an error naming no contract
        ("left", ""),
        ("a", [("k", "v")]),
        ("left", "right"),
        (3, 5),
        "abc",  # "too many values to unpack"
        ("a", "b", {}),
    ],
)
def test_a_reset_that_is_not_observation_and_info_fails_its_episode_naming_the_contract(reset_out: Any) -> None:
    m = EnvManager(lambda: _OldGymReset(reset_out), 1, step_timeout_s=5.0)
    with pytest.raises(EnvFailure) as err:
        m.reset(0, seed=3)
    assert err.value.kind == "env_error" and "reset returns a 2-tuple (observation, info dict)" in str(err.value)
    assert m.counters()["env_errors"] == 1
    # the contract's results pass, info None read as {}
    assert EnvManager(lambda: _OldGymReset(("o", None)), 1).reset(0, seed=3) == ("o", {})
    assert EnvManager(lambda: _OldGymReset(["o", {"k": 1}]), 1).reset(0, seed=3) == ("o", {"k": 1})


@pytest.mark.parametrize("out", [("o", 1.0, True, {}), ("o", 1.0, False, False, {}, "extra"), "o"])
def test_a_step_that_is_not_gymnasiums_five_values_fails_naming_the_contract(out: Any) -> None:
    """An old-Gym step's (obs, reward, done, info) failed with a bare "not enough values to unpack"."""
    m = EnvManager(lambda: _Returns(out), 1, step_timeout_s=5.0)
    m.reset(0, seed=3)
    with pytest.raises(EnvFailure) as err:
        m.step(0, "a")
    assert err.value.kind == "env_error" and "(observation, reward, terminated, truncated, info)" in str(err.value)
    assert m.counters()["env_errors"] == 1
