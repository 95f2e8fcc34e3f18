"""Environment workers: env managers hosted by a worker group (`env.num_workers` > 0), in-process or on Ray.

An `EnvWorker` builds the run's agentic task from the env config and hosts one `EnvManager` (many environment
instances, stepped concurrently on its threads, each call under the per-step timeout). `RemoteEnvManager` gives the
rollout the `EnvManager` API over a group: slot `s` lives on rank `s % num_workers`. Failures cross the process
boundary as values, not exceptions, and are raised again on the controller as `EnvFailure`, so an environment that
raises or hangs on a remote worker ends its episode and is counted exactly as in-process. Environments then run
beside the trainer's processes instead of inside the controller: heavy or leaky environments (simulators, games
with native code) can be spread over nodes and cannot stall the controller's threads.
"""

from __future__ import annotations

from typing import Any

from roll_core.agentic.env_manager import EnvFailure, EnvManager
from roll_core.agentic.observation import Observation
from roll_core.cluster.group import WorkerGroup
from roll_core.cluster.worker import Dispatch, Worker, dispatch
from roll_core.config.build import build


class EnvWorker(Worker):
    """Hosts an `EnvManager` over the task built from `env` (an agentic env config)."""

    def __init__(self, env: dict[str, Any], **base: Any) -> None:
        super().__init__(**base)
        self.manager = EnvManager.for_task(build(env))

    @dispatch(Dispatch.ONE)
    def grow(self, slots: int) -> None:
        self.manager.grow(slots)

    @dispatch(Dispatch.ONE)
    def reset(self, slot: int, seed: int) -> tuple[str, Any]:
        try:
            return "ok", self.manager.reset(slot, seed)
        except EnvFailure as exc:
            return "failed", (exc.kind, str(exc))

    @dispatch(Dispatch.ONE)
    def step(self, slot: int, action: str) -> tuple[str, Any]:
        try:
            return "ok", self.manager.step(slot, action)
        except EnvFailure as exc:
            return "failed", (exc.kind, str(exc))

    @dispatch(Dispatch.ONE)
    def bad_observation(self, slot: int, error: str) -> tuple[str, str]:
        failure = self.manager.bad_observation(slot, ValueError(error))
        return failure.kind, str(failure)

    @dispatch(Dispatch.BROADCAST)
    def counters(self) -> dict[str, int]:
        return self.manager.counters()

    @dispatch(Dispatch.BROADCAST)
    def close(self) -> None:
        self.manager.close()


class EnvGroup(WorkerGroup[EnvWorker]):
    """The `env` role: environment managers on `num_workers` workers."""

    worker_cls = EnvWorker


class RemoteEnvManager:
    """The `EnvManager` API over an `EnvGroup`: slot `s` runs on rank `s % world_size` as its local slot
    `s // world_size`."""

    def __init__(self, group: EnvGroup) -> None:
        self.group, self.n = group, group.world_size

    def _where(self, slot: int) -> tuple[int, int]:
        return slot % self.n, slot // self.n

    def grow(self, slots: int) -> None:
        handles = [
            self.group.submit_to(r, EnvWorker.grow, -(-(slots - r) // self.n)) for r in range(min(self.n, slots))
        ]
        for h in handles:
            h.result()

    @staticmethod
    def _unwrap(out: tuple[str, Any]) -> Any:
        status, value = out
        if status == "failed":
            kind, message = value
            raise EnvFailure(kind, message)
        return value

    def reset(self, slot: int, seed: int) -> tuple[Observation, dict[str, Any]]:
        rank, local = self._where(slot)
        return self._unwrap(self.group.submit_to(rank, EnvWorker.reset, local, seed).result())

    def step(self, slot: int, action: str) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        rank, local = self._where(slot)
        return self._unwrap(self.group.submit_to(rank, EnvWorker.step, local, action).result())

    def bad_observation(self, slot: int, error: Exception) -> EnvFailure:
        """As `EnvManager.bad_observation`, counted on the slot's worker."""
        rank, local = self._where(slot)
        kind, message = self.group.submit_to(rank, EnvWorker.bad_observation, local, str(error)).result()
        return EnvFailure(kind, message)

    def counters(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for part in self.group.call(EnvWorker.counters):
            for k, v in part.items():
                total[k] = total.get(k, 0) + v
        return total

    def close(self) -> None:
        self.group.call(EnvWorker.close)
