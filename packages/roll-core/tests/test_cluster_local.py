"""Worker groups on the local backend: dispatch modes, typed calls, clear errors."""

from __future__ import annotations

import pytest
import torch

from roll_core.cluster.group import WorkerGroup
from roll_core.cluster.worker import Dispatch, Worker, dispatch
from roll_core.protocol import Batch


class Doubler(Worker):
    def __init__(self, factor: int = 2, **base):
        super().__init__(**base)
        self.factor = factor

    @dispatch(Dispatch.DP)
    def double(self, batch: Batch) -> Batch:
        return Batch({"x": batch["x"] * self.factor, "rank": torch.full((len(batch),), self.rank)})

    @dispatch(Dispatch.RANK0)
    def who(self) -> int:
        return self.rank

    def undeclared(self) -> None:
        pass


def test_dp_split_is_uneven_and_ordered() -> None:
    group = WorkerGroup(Doubler, 3, "local", factor=10)
    out = group.call(Doubler.double, Batch({"x": torch.arange(7).float()}))
    assert out["x"].tolist() == [0, 10, 20, 30, 40, 50, 60]
    assert out["rank"].tolist() == [0, 0, 0, 1, 1, 2, 2]


def test_broadcast_and_rank0() -> None:
    group = WorkerGroup(Doubler, 2, "local")
    assert [r[:2] for r in group.call(Doubler.ping)] == [(0, 2), (1, 2)]
    assert group.call(Doubler.who) == 0


def test_undeclared_method_and_bad_args() -> None:
    group = WorkerGroup(Doubler, 1, "local")
    with pytest.raises(TypeError, match="decorate it with @dispatch"):
        group.call(Doubler.undeclared)
    with pytest.raises(TypeError, match="needs a Batch"):
        group.call(Doubler.double, [1, 2])
    with pytest.raises(TypeError, match="needs a Batch as its first argument, got no argument"):
        group.call(Doubler.double)
    # Calls name the method (type-checked), never a string, and only the group's own worker class's methods.
    with pytest.raises(TypeError, match=r"pass the worker method \(Doubler\.double\), not its name"):
        group.call("double", Batch({"x": torch.arange(2)}))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="is not a method of Doubler"):
        group.call(Batch.concat, [])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown backend"):
        WorkerGroup(Doubler, 1, "mpi")


def test_local_backend_runs_in_this_process() -> None:
    import os

    group = WorkerGroup(Doubler, 2, "local")
    assert {pid for _, _, pid in group.call(Doubler.ping)} == {os.getpid()}


def test_rendezvous_port_is_held_until_setup() -> None:
    """Rank 0's rendezvous port is reserved from when it is announced until set-up has started the store on it:
    nobody else is given it in between (a port picked, released and bound later was taken in CI: EADDRINUSE)."""
    import datetime
    import socket

    import torch.distributed as dist

    class StoreWorker(Worker):
        def on_setup(self) -> None:  # what an engine's init_process_group does on rank 0
            self.store = dist.TCPStore(
                "127.0.0.1", self.rendezvous[1], 1, is_master=True, timeout=datetime.timedelta(seconds=10)
            )

    w = StoreWorker(rank=0, world_size=1)
    host, port, _ = w.rendezvous_endpoint()
    with socket.socket() as stranger, pytest.raises(OSError):
        stranger.bind((host, port))
    w.setup(host, port, export_env=False)
    w.store.set("k", "v")
    assert w._port_reservation is None and w.store.get("k") == b"v"


def test_train_metrics_merge_weighs_ranks_by_rows_and_an_empty_rank_by_nothing() -> None:
    """TrainGroup.train's merge: a rank given no rows (a batch smaller than the data-parallel size) returns no loss
    metrics (packages/roll-engines/tests/test_train_hf.py runs a real one); the merge neither fails on it nor lets
    it weigh; uneven ranks weigh by their rows."""
    from roll_core.cluster.roles import merge_rank_metrics

    both = merge_rank_metrics([{"loss": 1.0, "lr": 0.1}, {"loss": 4.0, "lr": 0.1}], [3, 1])
    assert both == {"loss": 1.75, "lr": 0.1}
    assert merge_rank_metrics([{"loss": 2.0, "g": 5.0}, {"g": 5.0}], [2, 0]) == {"loss": 2.0, "g": 5.0}
    assert merge_rank_metrics([{"g": 2.0}, {"g": 4.0}], [0, 0]) == {"g": 3.0}  # an empty batch: alike
    # Ranks that report their units (tokens) weigh by them, not by rows; the weight keys are dropped; a key some
    # rank reports no weight for falls back to rows.
    w = "_weight/"
    units = merge_rank_metrics([{"clip": 0.5, w + "clip": 10.0}, {"clip": 0.1, w + "clip": 30.0}], [1, 1])
    assert units == {"clip": pytest.approx(0.2)}
    assert merge_rank_metrics([{"clip": 0.5, w + "clip": 10.0}, {"clip": 0.1}], [1, 3]) == {"clip": pytest.approx(0.2)}


def test_auto_platform_on_a_cpu_head_of_an_accelerator_cluster_is_an_error(monkeypatch) -> None:
    """hw.platform=auto is probed on the driver: a CPU-only head of a GPU cluster ran every worker on CPU without a
    word. Now that is a config error naming the setting; a CPU cluster, or an accelerator driver, passes."""
    import pytest
    import ray

    from roll_core.cluster.launch import Cluster
    from roll_core.errors import ConfigError
    from roll_hw.cpu import CpuPlatform

    cluster = Cluster.__new__(Cluster)
    cluster.platform = CpuPlatform
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0, "GPU": 8.0})
    with pytest.raises(ConfigError, match=r"the Ray cluster offers 8 GPU: name the workers' platform"):
        cluster._check_auto_platform()
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0})
    cluster._check_auto_platform()


class _EchoEngine:
    """Answers every request at once with two tokens, and records the requests it was given."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def submit(self, request):
        from concurrent.futures import Future

        from roll_core.interfaces import RequestOutput

        self.seen.append(request.request_id)
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, list(request.prompt_ids), [1, 2], [-0.5, -0.5], "length"))
        return fut

    def shutdown(self) -> None:
        pass


def test_partial_gpu_mode_places_every_request_on_the_engine_its_pool_chose() -> None:
    """The async driver's partial-GPU mode calls `infer.submit_request(request, rank=engine)`; InferGroup took no
    `rank` (TypeError in the driver's thread, raised by `take`): requests go to the pool's engine, never a shrunk
    one."""
    from roll_core.cluster.roles import InferGroup, InferWorker
    from roll_core.interfaces import Request, SamplingParams
    from roll_core.scheduling.driver import AsyncRollout
    from roll_core.scheduling.pool import EnginePool
    from roll_core.scheduling.scheduler import RolloutScheduler

    class EchoWorker(InferWorker):
        def __init__(self, **base) -> None:
            Worker.__init__(self, **base)
            self.engine = _EchoEngine()

    infer = InferGroup(EchoWorker, 2, "local", name="actor_infer")
    assert infer.submit_request(Request("direct", [5]), rank=1).result().token_ids == [1, 2]
    with pytest.raises(IndexError, match=r"has ranks 0\.\.1, not 2"):
        infer.submit_request(Request("nowhere", [5]), rank=2)
    pool = EnginePool([0, 1], active=[1])  # engine 0's devices train: nothing may run there
    sched = RolloutScheduler(batch_groups=2, group_size=2, max_new_tokens=2, async_ratio=0)
    driver = AsyncRollout(infer, sched, lambda: ("problem", [5, 6]), SamplingParams(max_new_tokens=2), pool=pool)
    try:
        groups = driver.take(2)
    finally:
        driver.close()
    assert [len(s.tokens) for g in groups for s in g.samples] == [2, 2, 2, 2]
    assert infer.workers[0].engine.seen == [] and len(infer.workers[1].engine.seen) == 5  # 4 samples + "direct"


class _RoutingEngine:
    """A MoE engine recording routing: each row of prompt k carries (len(prompt) + 2, 2 layers, top-2) ids = k."""

    def generate(self, prompts, params, n, first_row: int = 0, **_):
        from roll_core.interfaces import GenerateOutput, RequestOutput

        outs = [
            RequestOutput(
                f"r{k}", list(p), [7, 8], [-0.1, -0.2], "length", routed_experts=torch.full((len(p) + 2, 2, 2), k)
            )
            for k, p in enumerate(prompts, start=first_row // n)
            for _ in range(n)
        ]
        return GenerateOutput.from_requests(outs, 0)

    def shutdown(self) -> None:
        pass


def test_generate_with_routing_on_more_engines_than_prompts() -> None:
    """3 engines, 2 prompts: the third rank generates nothing, so its part has no `routed_experts_rows` (the engine
    adds the field only with rows); concatenating it with the others' raised ValueError (cannot concat), which broke
    every refill round or eval set smaller than the engine count when routing was recorded."""
    from roll_core.cluster.roles import InferGroup, InferWorker
    from roll_core.interfaces import SamplingParams
    from roll_core.routing import ROUTING_ROWS

    class RoutingWorker(InferWorker):
        def __init__(self, **base) -> None:
            Worker.__init__(self, **base)
            self.engine = _RoutingEngine()

    infer = InferGroup(RoutingWorker, 3, "local", name="actor_infer")
    gen = infer.generate(Batch({}, {"prompt_ids": [[1, 2], [3]]}), SamplingParams(max_new_tokens=2), n=2)
    assert gen["responses"].tolist() == [[7, 8]] * 4
    rows = gen[ROUTING_ROWS]
    assert [tuple(r.shape) for r in rows] == [(4, 2, 2), (4, 2, 2), (3, 2, 2), (3, 2, 2)]
    assert [int(r.unique()) for r in rows] == [0, 0, 1, 1]  # each row its own prompt's routing, in order
    empty = infer.generate(Batch({}, {"prompt_ids": []}), SamplingParams(max_new_tokens=2), n=2)
    assert len(empty) == 0


def test_a_role_colocated_in_a_disaggregated_cluster_is_a_config_error_not_extra_devices(monkeypatch) -> None:
    """reward_model.placement=colocated promises the trainer's devices; with cluster.placement=disaggregated those
    are the trainer's whole, and the role got a new "shared" placement group: whole GPUs reserved for its 1/5 share
    (never placed on a cluster the other roles fill, after placement_timeout_s). Now a ConfigError says what to set;
    the same role disaggregated in a colocated cluster still gets its own group."""
    import importlib

    from roll_core.cluster.launch import Cluster
    from roll_core.config.schema import ClusterConfig
    from roll_core.errors import ConfigError
    from roll_hw.cpu import CpuPlatform

    ray_pg = importlib.import_module("ray.util.placement_group")  # the module (ray.util's attribute: a function)
    made: list[list[dict[str, float]]] = []
    monkeypatch.setattr(ray_pg, "placement_group", lambda bundles, strategy: made.append(bundles) or "pg")

    def cluster(placement: str) -> Cluster:
        c = Cluster.__new__(Cluster)
        c.cfg, c.platform, c._pgs, c._node_devices = ClusterConfig(placement=placement), CpuPlatform, {}, {}
        c._wait_ready = lambda *a: None
        return c

    with pytest.raises(ConfigError, match=r"reward_model\.placement=colocated time-shares the trainer's devices"):
        cluster("disaggregated")._placement("reward_model", 1, placement="colocated")
    assert made == []
    opts = cluster("colocated")._placement("reward_model", 2, placement="disaggregated")
    assert len(made) == 1 and opts.placement == ("pg", [0, 1]) and opts.num_cpus == ClusterConfig().cpus_per_worker


def test_a_failed_ray_request_is_no_longer_counted_in_flight() -> None:
    """InferGroup routes a request to the rank with the fewest in flight; a Ray request whose result raised (its
    engine refused it) stayed counted, skewing routing away from its rank for the rest of the run. A timeout
    leaves it counted (it still runs); a result or an error releases it."""
    from roll_core.cluster.infer_role import _TrackedHandle

    class Pending:  # a Ray handle's result
        def __init__(self, outcome: object) -> None:
            self.outcome, self.refs = outcome, []

        def result(self) -> object:
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome

    released: list[str] = []
    collected = lambda rank, rid: released.append(rid)
    assert _TrackedHandle("ok", 0, Pending("out"), collected).result() == "out"
    with pytest.raises(RuntimeError, match="refused"):
        _TrackedHandle("bad", 0, Pending(RuntimeError("refused")), collected).result()
    with pytest.raises(TimeoutError):
        _TrackedHandle("slow", 0, Pending(TimeoutError("not yet")), collected).result()
    assert released == ["ok", "bad"]


class Fragile(Worker):
    """Rank `fail_rank` raises while it is built or set up; every rank records its teardown in `log`."""

    def __init__(self, fail_rank: int, where: str, log: list, **base):
        super().__init__(**base)
        self.where, self.fail_rank, self.log = where, fail_rank, log
        if where == "init" and self.rank == fail_rank:
            raise RuntimeError("engine could not be built")

    def on_setup(self) -> None:
        if self.where == "setup" and self.rank == self.fail_rank:
            raise RuntimeError("engine could not be set up")

    def teardown(self) -> None:
        self.log.append(self.rank)


@pytest.mark.parametrize(("where", "torn_down"), [("init", [0]), ("setup", [0, 1, 2])])
def test_a_local_group_that_fails_to_start_tears_down_the_ranks_it_built(where: str, torn_down: list[int]) -> None:
    """The ranks built before the failure are torn down (their engines' threads and memory released) and the
    worker's own error is raised; they were left running."""
    log: list[int] = []
    with pytest.raises(RuntimeError, match=f"engine could not be {'built' if where == 'init' else 'set up'}"):
        WorkerGroup(Fragile, 3, "local", fail_rank=1, where=where, log=log)
    assert sorted(log) == torn_down


class Aborter(Worker):
    """Ranks in `failing` raise from `abort`; every rank records the calls it got in `log` (shared, in order)."""

    def __init__(self, failing: tuple[int, ...], log: list, **base):
        super().__init__(**base)
        self.failing, self.log = failing, log

    @dispatch(Dispatch.BROADCAST)
    def abort(self, reason: str) -> int:
        self.log.append((self.rank, reason))
        if self.rank in self.failing:
            raise ValueError(f"rank {self.rank} could not undo the sync")
        return self.rank


def test_a_local_call_reaches_every_rank_when_one_raises_and_names_the_ranks_that_failed() -> None:
    """Rank 0 raises: ranks 1 and 2 still get the call, as every Ray actor does (the call was sent to each), and the
    error raised is rank 0's own (its type kept, as Ray's is an instance of it), noted with the failing ranks and
    the other failure. The local backend stopped at rank 0: an `abort_weight_update` never reached rank 1."""
    log: list = []
    group = WorkerGroup(Aborter, 3, "local", name="actor_infer", failing=(0, 2), log=log)
    with pytest.raises(ValueError, match="rank 0 could not undo the sync") as err:
        group.call(Aborter.abort, "the sync failed")
    assert log == [(0, "the sync failed"), (1, "the sync failed"), (2, "the sync failed")]
    assert err.value.__notes__ == [
        "actor_infer.abort() raised on rank(s) 0, 2 of the 3 called; rank 0's error raised; "
        "rank 2: ValueError: rank 2 could not undo the sync"
    ]
    log.clear()
    with pytest.raises(ValueError, match="rank 2 could not undo") as err:  # some ranks only: the same
        group.call_ranks([2, 1], Aborter.abort, "again")
    assert log == [(2, "again"), (1, "again")]
    assert err.value.__notes__ == ["actor_infer.abort() raised on rank(s) 2 of the 2 called; rank 2's error raised"]
    ok = WorkerGroup(Aborter, 2, "local", failing=(), log=[])
    assert ok.call(Aborter.abort, "fine") == [0, 1]


class RestartableDoublers(WorkerGroup[Doubler]):
    worker_cls = Doubler
    restartable = True


def test_an_explicit_restart_the_group_cannot_do_raises_a_clear_error_and_keeps_the_workers() -> None:
    """`restart()` on the local backend failed with an AttributeError from deep in the actor spawn; past
    `max_restarts` it restarted anyway (tested on Ray: test_group_ray_calls). Now both refuse up front, naming why."""
    group = RestartableDoublers(Doubler, 2, "local", max_restarts=3)
    workers = list(group.workers)
    with pytest.raises(RuntimeError, match=r"cannot restart rank\(s\) \[0\] \(asked\).*backend=local"):
        group.restart([0], "asked")
    with pytest.raises(RuntimeError, match=r"0 restart\(s\) already, cluster.max_restarts=0"):
        WorkerGroup(Doubler, 1, "local").restart([0])  # not restartable: no budget at all
    for bad in ([], [2], [0, 0], [-1]):
        with pytest.raises(ValueError, match=r"restart needs distinct ranks in \[0, 2\)"):
            group.restart(bad)
    assert group.workers == workers and group.restarts == 0
    assert group.call(Doubler.who) == 0
