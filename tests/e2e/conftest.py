"""Shared fixtures of the end-to-end tests: one Ray instance shared by the modules that need one, a tiny learnable
task, a run helper, the bad-input corpus of a test_bad_inputs_*.py module, and the setup of the stop-then-resume
tests (a SIGTERM in a chosen step, a tiny run that evaluates after every step)."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from roll_core.testing import constant_answer_task, tiny_overrides


@pytest.fixture(scope="session", autouse=True)
def _model_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))


# The local Ray instance the test modules share (a start costs 10-15 s on 2 cores and a dozen modules use one).
_SHARED_RAY: dict[str, str] = {}


def _start_shared_ray(ray) -> None:
    ray.init(
        address="local",  # a new instance even when another cluster runs on this machine
        num_cpus=8,
        include_dashboard=False,
        namespace="roll-tests",
        ignore_reinit_error=True,
        # Workers import test helpers the way the controller does (env.env=py:agentic_toy:<Class>).
        runtime_env={
            "env_vars": {
                "ROLL_CACHE_DIR": os.environ["ROLL_CACHE_DIR"],
                "PYTHONPATH": os.pathsep.join(
                    p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p
                ),
            }
        },
    )
    _SHARED_RAY["address"] = ray.get_runtime_context().gcs_address


def _is_shared_ray_up(ray) -> bool:
    return ray.is_initialized() and ray.get_runtime_context().gcs_address == _SHARED_RAY.get("address")


def _ray_leftovers(ray, wait_s: float = 10.0) -> list[str]:
    """What a module left in the shared instance: live actors, placement groups, CPUs still held. Kills and removals
    are asynchronous, so this waits (bounded) for them to settle; an empty list means the instance is as new."""
    from ray._private import state
    from ray.util.placement_group import placement_group_table

    deadline = time.monotonic() + wait_s
    while True:
        actors = state.actors().values()
        left = [f"actor {a.get('Name') or a.get('ActorClassName')}" for a in actors if a["State"] != "DEAD"]
        left += [f"placement group {g}" for g, t in placement_group_table().items() if t["state"] != "REMOVED"]
        free, total = ray.available_resources().get("CPU", 0.0), ray.cluster_resources().get("CPU", 0.0)
        if free < total:
            left.append(f"{total - free:g} of {total:g} CPUs held")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@pytest.fixture(scope="session")
def _shared_ray_session():
    """Stops the shared instance at the end of the session (if it is still the one running)."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and _is_shared_ray_up(ray):
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(_shared_ray_session):
    """A local Ray instance for the test modules that need one, shared between them: the first starts it, later
    ones reuse it as long as each module leaves it as it found it (no actor, placement group or CPU left). After
    a module that leaves something behind it is stopped, and the next module starts a new one; a module that
    replaces it (tests/e2e/test_multinode*.py start their own cluster) makes the next module start a new one too."""
    ray = pytest.importorskip("ray")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    if not _is_shared_ray_up(ray):
        if ray.is_initialized():  # some other instance: this module gets the shared one, as it always has
            ray.shutdown()
        _start_shared_ray(ray)
    yield ray
    if _is_shared_ray_up(ray):
        left = _ray_leftovers(ray)
        if left:  # not clean: the next module gets a new instance, as if each module had its own
            print(f"\nshared Ray instance stopped: the module left {', '.join(left)}", file=sys.__stderr__)
            ray.shutdown()


@pytest.fixture(scope="session")
def seven_task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A task a random tiny model learns within a few steps: every answer is 7."""
    return constant_answer_task(tmp_path_factory.mktemp("data") / "seven.jsonl")


@pytest.fixture
def sigterm_in_step(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """`sigterm_in_step(at)`: SIGTERM to this process once step `at` has run (a preemption arriving during the
    step). It patches `Pipeline.step` with the test's own `monkeypatch`: the test's `monkeypatch.undo()` takes it
    back (before a resume)."""

    def arm(at: int) -> None:
        from roll_core.pipelines.loop import Pipeline

        real = Pipeline.step

        def step(self: Pipeline, n: int) -> Any:
            out = real(self, n)
            if n == at:
                os.kill(os.getpid(), signal.SIGTERM)
            return out

        monkeypatch.setattr(Pipeline, "step", step)

    return arm


@pytest.fixture
def stopped_run(
    seven_task: Path, tmp_path: Path, sigterm_in_step: Callable[[int], None]
) -> Callable[[int, int], tuple[Path, list[str]]]:
    """`stopped_run(max_steps, stop_in)`: the run folder (tmp_path / "run") and overrides of a tiny run on
    `seven_task` that evaluates 4 held-out problems after every step, with a SIGTERM armed in step `stop_in`
    (`sigterm_in_step`). The stop-then-resume tests run it, `monkeypatch.undo()` (no more signals), and resume it
    with `[*overrides, "pipeline.resume=true"]`."""

    def setup(max_steps: int, stop_in: int) -> tuple[Path, list[str]]:
        run = tmp_path / "run"
        base = [o for o in tiny_overrides(seven_task, run, "pipeline.trackers=[]") if not o.startswith("pipeline.eval")]
        base += [f"pipeline.max_steps={max_steps}", "pipeline.eval_every=1", "env.eval_size=4"]
        sigterm_in_step(stop_in)
        return run, base

    return setup


@pytest.fixture(scope="session")
def tiny_model(_model_cache: None) -> str:
    """Path of the built-in tiny model (built once per session into the cache)."""
    from roll_core.models import resolve_model_path

    return resolve_model_path("builtin:tiny")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, seven_task: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """The bad-input corpus of a test_bad_inputs_*.py module (a `bad_input_corpus.Corpus` for its rows; one per
    module, so each module's shared run and table are its own), and the table of the rows it tried at its end."""
    # Imported here, not above: the module asking for it has put this folder on sys.path and registered
    # bad_input_corpus for assertion rewriting before its own import of it (a conftest import would come first).
    from bad_input_corpus import open_corpus

    yield from open_corpus(tmp_path_factory, seven_task, request.config)
