"""Runs that survive faults on Ray: a reward that raises, returns NaN or hangs on some rows; an inference engine or a
reward worker killed mid-run; a worker that hangs past the call timeout; a trainer that dies (a clear error naming
the checkpoint to resume from and why the worker died; the run restarts from it); a rank another caller restarted
while a call ran (rerun once, the other ranks waited for). One Ray instance for the module (the `ray_cluster`
fixture)."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from roll_core.cluster.group import CallTimeoutError, RayOptions, WorkerDiedError, WorkerGroup
from roll_core.testing import tiny_overrides

sys.path.insert(0, str(Path(__file__).parent))  # fault_helpers: env.reward._target_=fault_helpers.FaultyReward
# importable by Ray workers too (the fixture puts this folder on PYTHONPATH)
from fault_workers import Finisher, Napper, Quitter

pytestmark = pytest.mark.ray


def _pipeline(overrides: list[str]) -> Any:
    from roll_core.cli import pipeline_class
    from roll_core.config import load_config

    cfg = load_config(overrides)
    return pipeline_class(cfg.pipeline.name)(cfg)


def _history(pipeline: Any) -> list[dict[str, Any]]:
    from roll_core.tracking import Tracker

    return [h for h in Tracker.read_metrics(Path(pipeline.out) / "metrics.jsonl") if h["step"] > 0]


def _total(history: list[dict[str, Any]], key: str) -> float:
    return sum(h.get(key, 0.0) for h in history)


def test_reward_that_raises_returns_nan_or_hangs_is_counted_and_the_run_finishes(
    ray_cluster: Any, seven_task: Path, tmp_path: Path
) -> None:
    """Rows whose reward raised, was NaN or hung score 0 and are counted; the rows around them keep their scores."""
    from fault_helpers import fault_of

    pipeline = _pipeline(
        tiny_overrides(
            seven_task,
            tmp_path,
            "cluster=ray",
            "pipeline.max_steps=2",
            "env.reward._target_=fault_helpers.FaultyReward",
            # Clocks far from any real scoring time, so load cannot turn a healthy row into a failed one: a hung row
            # sleeps 60 s (FaultyReward) against a 1 s row timeout, where a healthy row takes milliseconds (a child
            # forked anew after a kill included). The batch timeout also bounds the whole row-by-row pass (batch +
            # 3 x row timeout: reward_guard): at 1 s + 3 x 0.5 s, on a loaded machine the 41 rows below ran out of
            # time and the rows never tried counted as timeouts (errors 3, not 5). A batch fails at once when it
            # holds a "raise" row (1 row in 8 raises: nearly every batch), so the longer batch timeout seldom costs.
            "pipeline.reward_batch_timeout_s=10",
            "pipeline.reward_timeout_s=1",
        )
    )
    try:
        pipeline.run()
        history = _history(pipeline)
        assert [h["step"] for h in history] == [1, 2]
        for key in ("reward/errors", "reward/nonfinite", "reward/timeouts"):
            assert _total(history, key) > 0, (key, history)
        assert all(math.isfinite(h["reward/mean"]) for h in history)
        # The same counts, row by row, from a direct call: every faulty row scores 0, the others their reward.
        texts = [f"the answer is {i}" for i in range(40)] + ["so 7"]
        out = pipeline.collector.reward.score(_text_batch(pipeline.tokenizer, texts, "7"))
        kinds = [fault_of(out["response_text"][i]) for i in range(len(texts))]
        counters = out.meta["reward_counters"]
        assert counters["errors"] == kinds.count("raise") > 0
        assert counters["nonfinite"] == kinds.count("nan") > 0
        assert counters["timeouts"] == kinds.count("hang") > 0
        for k, s in zip(kinds, out["scores"].tolist()):
            assert (s == 0.0) if k != "ok" else math.isfinite(s)
        assert kinds[-1] == "ok" and out["scores"][-1] == 1.0  # "so 7" is right (last-number credit)
    finally:
        pipeline.shutdown()


def _text_batch(tokenizer: Any, texts: list[str], answer: str) -> Any:
    import torch

    from roll_core.protocol import Batch, pad_left

    ids, mask = pad_left([tokenizer.encode(t, add_special_tokens=False) for t in texts], 0)
    return Batch({"responses": ids, "response_mask": mask.to(torch.long)}, {"answer": [answer] * len(texts)})


def test_killed_inference_and_reward_workers_are_restarted_and_the_run_completes(
    ray_cluster: Any, seven_task: Path, tmp_path: Path
) -> None:
    """ray.kill of the engine during step 1's weight sync and step 2's generation, and of the reward worker during
    step 2's scoring: each is re-created, the engine gets the trained weights back, the sync is redone and the other
    calls rerun, and every step completes. Then the trainer dies: an error names the checkpoint to resume from."""
    import ray

    pipeline = _pipeline(
        tiny_overrides(
            seven_task,
            tmp_path,
            "cluster=ray",
            "pipeline.max_steps=2",
            "pipeline.save_every=1",
            # The trainer recomputes log-probs each step: a restored engine that missed the trained weights shows
            # up as a large train/infer log-prob gap on the step it served.
            "algo.off_policy_correction=token",
        )
    )
    # method -> the call (= step) during which its worker is killed
    kills = {"receive_weights_dist": 1, "generate": 2, "score": 2}
    seen: dict[str, int] = {}

    def killing(group: Any) -> None:
        submit = group.submit

        def wrapped(method: Any, *args: Any, **kwargs: Any) -> Any:
            name = method.__name__  # calls name the worker method (roll_core.cluster.group)
            seen[name] = seen.get(name, 0) + 1
            due = kills.get(name) == seen[name]
            if due and name == "score":
                # Scoring seven_task's rows takes milliseconds: a kill sent after the call could land after it had
                # returned (the final CI beside a quickstart saw no reward restart). Dead before the call instead.
                worker = group.workers[0]
                ray.kill(worker)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    try:
                        ray.get(worker.__ray_ready__.remote(), timeout=5)
                    except Exception:  # RayActorError (or a timeout): it is going or gone
                        break
            handle = submit(method, *args, **kwargs)
            if due and name != "score":
                ray.kill(group.workers[0])
            return handle

        group.submit = wrapped

    killing(pipeline.roles.actor_infer)
    killing(pipeline.collector.reward)
    try:
        pipeline.run()
        history = _history(pipeline)
        assert [h["step"] for h in history] == [1, 2]
        assert [h["faults/restarts"] for h in history] == [1, 2]
        assert history[0]["faults/restarts_actor_infer"] == 1
        assert history[1]["faults/restarts_actor_infer"] == history[1]["faults/restarts_reward"] == 1
        assert pipeline.trainer.weight_sync.restores == 2
        assert max(h["actor/train_infer_logprob_diff"] for h in history) < 1e-4, history

        ray.kill(pipeline.roles.actor_train.workers[0])
        with pytest.raises(WorkerDiedError, match=r"actor_train rank 0 .* resume from the checkpoint .*step_000002"):
            pipeline.roles.actor_train.get_weights()
    finally:
        pipeline.shutdown()


def test_killed_trainer_restarts_the_run_from_its_latest_checkpoint(
    ray_cluster: Any, seven_task: Path, tmp_path: Path
) -> None:
    """ray.kill of the trainer at the start of step 3: its ranks cannot be re-created alone, so the run is rebuilt
    from step 2's checkpoint (run_with_restarts, as roll-train runs every job) and step 3 is redone."""
    import ray

    from roll_core.cli import pipeline_class
    from roll_core.config import load_config
    from roll_core.pipelines.run_control import run_with_restarts

    built: list[Any] = []
    dead_seen: list[list[str]] = []

    def make(cfg: Any) -> Any:
        pipeline = pipeline_class(cfg.pipeline.name)(cfg)
        if not built:
            step = pipeline.step

            def killing(n: int) -> dict[str, Any]:
                if n == 3:
                    ray.kill(pipeline.roles.actor_train.workers[0])
                    # ray.kill is asynchronous: an idle actor may still answer a probe sent right after it, so wait
                    # (bounded) for the probe to see the death, as it does after the error a dead rank raises.
                    deadline, dead = time.monotonic() + 30.0, []
                    while not dead and time.monotonic() < deadline:
                        dead = pipeline.cluster.dead_workers()
                        if not dead:
                            time.sleep(0.2)
                    dead_seen.append(dead)
                return step(n)

            pipeline.step = killing
        built.append(pipeline)
        return pipeline

    cfg = load_config(
        tiny_overrides(seven_task, tmp_path, "cluster=ray", "pipeline.max_steps=3", "pipeline.save_every=2")
    )
    summary = run_with_restarts(make, cfg)
    assert dead_seen == [["actor_train rank 0"]]  # the probe that tells a fault from a bug sees the dead rank
    assert summary["run_restarts"] == 1 and len(built) == 2 and built[1].start_step == 3
    history = _history(built[1])
    assert [h["step"] for h in history] == [1, 2, 3]
    assert [h["faults/run_restarts"] for h in history] == [0, 0, 1]
    assert all(math.isfinite(h["actor/pg_loss"]) for h in history)


class NapperGroup(WorkerGroup[Napper]):
    worker_cls = Napper
    restartable = True


def test_hung_worker_is_restarted_then_a_timeout_past_the_budget_names_role_method_and_timeout(
    ray_cluster: Any, tmp_path: Path
) -> None:
    marker = tmp_path / "napped"
    group = NapperGroup(
        Napper,
        1,
        "ray",
        name="napper",
        ray_options=RayOptions(num_cpus=0.1),
        call_timeout_s=1.5,
        max_restarts=1,
        marker=str(marker),
    )
    try:
        pid = group.call(Napper.nap, 60.0)[0]  # the first incarnation hangs; it is killed, the restarted one answers
        assert pid != int(marker.read_text())
        assert group.restarts == 1 and group.timeouts == 1
        marker.unlink()  # the next call hangs again, and the restart budget is spent
        with pytest.raises(
            CallTimeoutError,
            match=r"napper\.nap\(\) did not return within 1\.5s on rank\(s\) 0 .*cluster\.max_restarts=1",
        ):
            group.call(Napper.nap, 60.0)
    finally:
        group.shutdown()


def test_a_dead_rank_of_a_group_that_may_not_restart_fails_the_call_without_waiting_for_the_others(
    ray_cluster: Any, tmp_path: Path
) -> None:
    """Rank 1 dies while rank 0 waits 120 s (a sharded trainer's rank in a collective with it): the call fails
    naming rank 1 while rank 0 still waits, not after it."""
    marker = tmp_path / "waited"
    group = WorkerGroup(Quitter, 2, "ray", name="sharded", ray_options=RayOptions(num_cpus=0.1), marker=str(marker))
    try:
        with pytest.raises(WorkerDiedError, match=r"sharded rank 1 on node [0-9a-f]+ died during quit_or_wait\(\)"):
            group.call(Quitter.quit_or_wait, 120.0)
        assert not marker.exists()
    finally:
        group.shutdown()


def test_a_dead_rank_is_reported_with_rays_account_of_why_it_died(ray_cluster: Any, tmp_path: Path) -> None:
    """The error said only "rank 1 died during quit_or_wait()": why (killed by the OOM killer, a segfault, its
    process exited; Ray's pid and exit detail) was dropped with Ray's exception. Now it is quoted and chained."""
    import ray

    group = WorkerGroup(
        Quitter, 2, "ray", name="sharded", ray_options=RayOptions(num_cpus=0.1), marker=str(tmp_path / "waited")
    )
    try:
        with pytest.raises(WorkerDiedError) as err:
            group.call(Quitter.quit_or_wait, 120.0)
    finally:
        group.shutdown()
    assert isinstance(err.value.__cause__, ray.exceptions.RayActorError)
    assert "Ray's report: The actor died unexpectedly" in str(err.value)
    assert "Worker exit type: SYSTEM_ERROR" in str(err.value)  # the process exited: not killed, not OOM


class FinisherGroup(WorkerGroup[Finisher]):
    worker_cls = Finisher
    restartable = True


def test_a_rank_another_caller_restarted_is_rerun_once_and_the_running_ranks_are_waited_for(
    ray_cluster: Any, tmp_path: Path
) -> None:
    """Rank 0 dies while rank 1 still works, and another caller (a request thread, a health check) has already
    restarted it, spending the last restart: the call reruns rank 0 and waits for rank 1. It failed with
    KeyError: 1 (rank 1 was dropped from the wait). Waiting on the handle again returns the same results; it reran
    rank 0 a second time (a call with side effects done twice)."""
    marker = tmp_path / "finished"
    group = FinisherGroup(
        Finisher, 2, "ray", name="finishers", ray_options=RayOptions(num_cpus=0.1), max_restarts=1, marker=str(marker)
    )
    try:
        handle = group.submit(Finisher.work, 5.0)
        started, deadline = Path(f"{marker}.started"), time.monotonic() + 60
        while not (started.exists() and len(started.read_text().split()) == 2):  # both ranks work (no fixed sleep)
            assert time.monotonic() < deadline, "the ranks never started working"
            time.sleep(0.05)
        group.restart([0], "another caller saw rank 0 die")  # what a concurrent caller's fault repair does
        first = handle.values()
        assert len(first) == 2 and group.restarts == 1
        assert handle.values() == first
        assert sorted(marker.read_text().split()) == ["0", "1"]  # each rank finished once: rank 0 rerun once
    finally:
        group.shutdown()
