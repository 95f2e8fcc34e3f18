"""Weight-sync building blocks without Ray: buckets, flat buffers, a gloo group between threads, transport choice."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from roll_core.cluster.ports import free_port
from roll_core.cluster.weight_sync import SyncGroup, bucket_nbytes, buckets, flatten, resolve_transport, unflatten


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(10, 10, generator=g)),  # 400 bytes
        ("a.bias", torch.randn(10, generator=g)),  # 40
        ("b.weight", torch.randn(30, 10, generator=g)),  # 1200: larger than a bucket of 1000, travels alone
        ("c.half", torch.randn(4, 4, generator=g).to(torch.bfloat16)),  # 32
        ("d.index", torch.arange(6)),  # 48, int64
    ]


def test_buckets_keep_order_and_bound_size() -> None:
    named = _named()
    got = list(buckets(named, bucket_bytes=1000))
    assert [[k for k, _ in b] for b in got] == [["a.weight", "a.bias"], ["b.weight"], ["c.half", "d.index"]]
    assert [bucket_nbytes(b) for b in got] == [440, 1200, 80]
    assert [k for b in got for k, _ in b] == [k for k, _ in named]


def test_flatten_roundtrip_mixed_dtypes() -> None:
    """Every tensor comes back equal, whatever sizes and dtypes precede it: odd-sized bf16 and bool tensors before
    fp32 ones would leave a view at a storage offset its dtype cannot take (each starts at a multiple of ALIGN)."""
    from roll_core.cluster.buckets import ALIGN, layout

    odd = [
        ("bf16", torch.randn(3).bfloat16()),
        ("f32", torch.randn(2, 3)),
        ("mask", torch.tensor([True, False, True])),
        ("i64", torch.arange(5)),
        ("empty", torch.empty(0, 4)),
        ("f16", torch.randn(7).half()),
    ]
    for named in (_named(), odd):
        flat, specs = flatten(named, "cpu")
        places, total = layout(specs)
        assert flat.dtype == torch.uint8 and flat.numel() == total >= bucket_nbytes(named)
        assert all(offset % ALIGN == 0 for offset, _ in places)
        for (k, t), (k2, t2) in zip(named, unflatten(flat.clone(), specs), strict=True):
            assert k == k2 and t2.dtype == t.dtype and t2.shape == t.shape and torch.equal(t, t2)


def test_gloo_group_broadcasts_buckets_between_threads() -> None:
    port = free_port()
    named = _named()
    received: dict[int, list] = {}

    def receiver(rank: int) -> None:
        group = SyncGroup("127.0.0.1", port, rank, 3, "gloo", timeout_s=60)
        got = []
        while (bucket := group.receive()) is not None:
            got += [(k, t.clone()) for k, t in bucket]
        received[rank] = got

    threads = [threading.Thread(target=receiver, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    sender = SyncGroup("127.0.0.1", port, 0, 3, "gloo", timeout_s=60)
    for bucket in buckets(named, 1000):
        sender.send(bucket)
    sender.send(None)
    for t in threads:
        t.join(timeout=60)
    for rank in (1, 2):
        assert [k for k, _ in received[rank]] == [k for k, _ in named]
        for (_, a), (_, b) in zip(named, received[rank]):
            assert torch.equal(a, b)


def test_a_worker_whose_engine_refuses_a_bucket_receives_the_sync_to_its_end_then_raises() -> None:
    """An inference worker whose engine refuses a bucket (a weight it does not have) goes on receiving the `dist`
    sync, so the trainer's broadcasts complete, and then raises the engine's error. It used to stop receiving: the
    trainer then waited in a broadcast for the group's timeout (10 minutes) and the sync failed with gloo's timeout,
    the engine's error never read."""
    from roll_core.cluster.roles import InferWorker

    class Engine:
        def __init__(self) -> None:
            self.loaded: list[str] = []

        def update_weights(self, named) -> int:
            named = list(named)
            if any(k == "extra.weight" for k, _ in named):
                raise KeyError("weight 'extra.weight' is not in the inference model")
            self.loaded += [k for k, _ in named]
            return sum(bucket_nbytes([(k, t)]) for k, t in named)

    worker = InferWorker.__new__(InferWorker)  # the receiving side alone: its rank and its engine
    worker.rank, worker.engine = 0, Engine()
    store = SyncGroup.host_store("127.0.0.1", 2)
    raised: list[BaseException] = []

    def receive() -> None:
        worker.join_sync_group("127.0.0.1", store.port, 2, "gloo")
        try:
            worker.receive_weights_dist()
        except BaseException as exc:
            raised.append(exc)

    def send() -> None:  # rank 0, as TrainWorker.send_weights_dist: buckets of 256 KiB (gloo waits for a receiver)
        group = SyncGroup("127.0.0.1", store.port, 0, 2, "gloo", store=store)
        for name in ("a.weight", "extra.weight", "b.weight", "c.weight"):
            group.send([(name, torch.zeros(256, 256))])
        group.send(None)

    threads = [threading.Thread(target=fn, daemon=True) for fn in (receive, send)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "the trainer was left waiting in a broadcast"
    assert len(raised) == 1 and isinstance(raised[0], KeyError) and "extra.weight" in str(raised[0])
    assert worker.engine.loaded == ["a.weight"]  # nothing after the refused bucket is applied


def _rank_0_workers(trainer: Any) -> tuple[Any, Any]:
    """Rank 0 of a TrainWorker over `trainer` (an engine with `iter_weights`) and of an InferWorker whose engine
    takes every bucket (counting its bytes), without Ray: the two sides of a `dist` sync."""
    from roll_core.cluster.roles import InferWorker, TrainWorker

    class Engine:
        def update_weights(self, named) -> int:
            return sum(bucket_nbytes([(k, t)]) for k, t in named)

    train = TrainWorker.__new__(TrainWorker)
    train.rank, train.engine, train.weight_format = 0, trainer, "merged"
    infer = InferWorker.__new__(InferWorker)
    infer.rank, infer.engine = 0, Engine()
    return train, infer


def test_a_train_worker_whose_weights_fail_mid_sync_ends_the_receivers_sync() -> None:
    """TrainWorker.send_weights_dist (rank 0) over a real gloo group: its engine's weight iterator raises after the
    first bucket. The receiving InferWorker raises SyncAbortedError quoting the trainer's error within seconds (it
    sent bucket by bucket with `send` and stopped: the receiver waited in a broadcast for the group's timeout)."""
    from roll_core.cluster.buckets import SyncAbortedError

    class Trainer:
        def iter_weights(self, changed_only: bool = False):
            yield "a.weight", torch.zeros(256, 256)
            raise ValueError("the engine lost a shard")

    train, infer = _rank_0_workers(Trainer())
    store = SyncGroup.host_store("127.0.0.1", 2)
    raised: dict[str, BaseException] = {}

    def receive() -> None:
        infer.join_sync_group("127.0.0.1", store.port, 2, "gloo")
        try:
            infer.receive_weights_dist()
        except BaseException as exc:
            raised["infer"] = exc

    def send() -> None:
        train._sync_group = SyncGroup("127.0.0.1", store.port, 0, 2, "gloo", store=store, timeout_s=60)
        try:
            train.send_weights_dist(256 * 1024, False)
        except BaseException as exc:
            raised["train"] = exc

    t0 = time.monotonic()
    threads = [threading.Thread(target=fn, daemon=True) for fn in (receive, send)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a side was left waiting in a broadcast"
    assert isinstance(raised["train"], ValueError) and isinstance(raised["infer"], SyncAbortedError)
    assert "the engine lost a shard" in str(raised["infer"]) and time.monotonic() - t0 < 20


def test_a_trainer_that_fails_mid_sync_ends_it_on_every_receiver_at_once() -> None:
    """The trainer's weight iterator raises after the first bucket. Its receivers were left waiting in a broadcast
    for the group's timeout (10 minutes by default) and then failed with gloo's timeout, the trainer's error unseen.
    Now `send_all` tells them: each raises SyncAbortedError quoting the trainer's error at once (the group's timeout
    here is 60 s), keeps the bucket it applied, and the group's stream stays whole: the next sync goes through."""
    from roll_core.cluster.buckets import SyncAbortedError

    store = SyncGroup.host_store("127.0.0.1", 3, timeout_s=60)
    groups: dict[int, SyncGroup] = {}
    outcome: dict[int, list] = {1: [], 2: []}

    def receiver(rank: int) -> None:
        groups[rank] = group = SyncGroup("127.0.0.1", store.port, rank, 3, "gloo", timeout_s=60)
        applied: list[str] = []
        for _ in range(2):  # the failed sync, then the next one
            try:
                group.receive_all(lambda bucket: applied.extend(k for k, _ in bucket) or 0)
                outcome[rank].append(list(applied))
            except SyncAbortedError as exc:
                outcome[rank].append((exc, list(applied)))
            applied.clear()

    def failing():
        yield [("a.weight", torch.ones(4))]
        raise ValueError("iter_weights broke at b.weight")

    threads = [threading.Thread(target=receiver, args=(r,), daemon=True) for r in (1, 2)]
    for t in threads:
        t.start()
    sender = SyncGroup("127.0.0.1", store.port, 0, 3, "gloo", timeout_s=60, store=store)
    with pytest.raises(ValueError, match="iter_weights broke"):
        sender.send_all(failing())
    sent = sender.send_all(buckets(_named(), 1000))
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads), "a receiver was left waiting in the failed sync"
    assert sent == {"bytes": 1720, "tensors": 5, "buckets": 3}
    for rank in (1, 2):
        (aborted, applied), second = outcome[rank]
        assert isinstance(aborted, SyncAbortedError) and applied == ["a.weight"]
        assert "ValueError: iter_weights broke at b.weight" in str(aborted)
        assert second == [k for k, _ in _named()]


class _Handle:
    """A finished call of a fake group: its values, or its error; records that it was read."""

    def __init__(self, value=None, error: BaseException | None = None) -> None:
        self.value, self.error, self.read = value, error, False

    def wait(self, timeout=None) -> bool:
        return True

    def values(self):
        self.read = True
        if self.error is not None:
            raise self.error
        return self.value


class _Side:
    """A fake train or inference group for DistTransport: answers each method from `answers` (name -> callable)."""

    def __init__(self, world_size: int, answers: dict) -> None:
        self.world_size, self.answers, self.handles = world_size, answers, []
        self.calls: list[str] = []

    def call(self, method, *args):
        self.calls.append(method.__name__)
        return self.answers[method.__name__]()

    def submit(self, method, *args):
        self.calls.append(method.__name__)
        self.handles.append(self.answers[method.__name__]())
        return self.handles[-1]


def test_a_dist_sync_that_failed_on_the_trainer_rebuilds_its_group_and_reads_the_receivers_outcome() -> None:
    """The trainer fails during a `dist` sync: its error is raised after the receivers' outcome was read (their
    abort error logged, not left unread), and the next sync builds a new group. The group was kept: the next sync
    broadcast into a stream whose receivers could still wait in the failed one, and the receivers' error was never
    read."""
    from roll_core.cluster.buckets import SyncAbortedError
    from roll_core.cluster.weight_sync import DistTransport

    failing = [True]  # the first sync fails on the trainer, the next one goes through

    def send() -> _Handle:
        if failing[0]:
            return _Handle(error=ValueError("iter_weights broke"))
        return _Handle([{"bytes": 8, "tensors": 1, "buckets": 1}])

    def receive() -> _Handle:
        return _Handle(error=SyncAbortedError("the trainer's sync failed")) if failing[0] else _Handle([8, 8])

    train = _Side(1, {"sync_endpoint": lambda: ("127.0.0.1", 1), "join_sync_group": _Handle, "send_weights_dist": send})
    infer = _Side(2, {"join_sync_group": _Handle, "receive_weights_dist": receive})
    transport = DistTransport(train, infer, bucket_bytes=1024, dtype=None, dist_backend="gloo")
    with pytest.raises(ValueError, match="iter_weights broke"):
        transport.sync(False)
    failed_receive = infer.handles[-1]
    assert failed_receive.read and isinstance(failed_receive.error, SyncAbortedError)
    failing[0] = False
    assert transport.sync(False).bytes == 8
    assert train.calls.count("sync_endpoint") == 2  # a new group for the sync after the failed one
    assert infer.calls.count("join_sync_group") == 2


@pytest.mark.parametrize(
    ("name", "backend", "placement", "platform", "expected"),
    [
        ("auto", "local", "colocated", "cpu", "inprocess"),
        ("auto", "ray", "colocated", "cpu", "dist"),
        ("auto", "ray", "colocated", "cuda", "cuda_ipc"),
        ("auto", "ray", "disaggregated", "cuda", "dist"),
        ("auto", "ray", "colocated", "npu", "dist"),
        ("dist", "ray", "colocated", "cpu", "dist"),
    ],
)
def test_auto_transport(name: str, backend: str, placement: str, platform: str, expected: str) -> None:
    assert resolve_transport(name, backend, placement, platform) == expected


@pytest.mark.parametrize(
    ("name", "backend", "placement", "platform", "message"),
    [
        ("dist", "local", "colocated", "cpu", "needs separate processes: use cluster=ray"),
        ("inprocess", "ray", "colocated", "cpu", "needs cluster=local"),
        ("cuda_ipc", "ray", "colocated", "cpu", "needs CUDA/ROCm devices"),
        ("cuda_ipc", "ray", "disaggregated", "cuda", "needs cluster.placement=colocated"),
        ("carrier_pigeon", "ray", "colocated", "cpu", "is not one of"),
        # NCCL refuses two ranks on one GPU, and colocated trainer rank 0 shares its GPU with inference rank 0.
        ("dist", "ray", "colocated", "cuda", "use sync_transport=cuda_ipc"),
        ("dist", "ray", "colocated", "rocm", "use sync_transport=cuda_ipc"),
    ],
)
def test_impossible_transport_is_a_clear_error(
    name: str, backend: str, placement: str, platform: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_transport(name, backend, placement, platform)


def test_engine_python_resolution(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from roll_core.cluster.launch import resolve_python

    assert resolve_python(None, "vllm") is None
    assert resolve_python("auto", "torch") is None  # importable here: same environment
    venv_python = tmp_path / "venvs" / "fancy" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.symlink_to(sys.executable)  # venv pythons are symlinks: the path must be kept, not resolved
    monkeypatch.setenv("ROLL_VENVS_DIR", str(tmp_path / "venvs"))
    assert resolve_python("auto", "fancy") == str(venv_python)
    assert resolve_python(str(venv_python), "fancy") == str(venv_python)
    with pytest.raises(ValueError, match=r"nox -s nothere_venv"):
        resolve_python("auto", "nothere")
    with pytest.raises(ValueError, match="no such executable"):
        resolve_python(str(tmp_path / "missing" / "python"), "vllm")


def _on_each_rank(ranks: list, call: Callable[[Any], object]) -> dict[int, object]:
    """`call(worker)` for every train rank at once, each on a thread of its own (the ranks of a collective): what each
    returned or raised, after all ended (none may still wait in the collective)."""
    outcome: dict[int, object] = {}

    def run(rank: int) -> None:
        try:
            outcome[rank] = call(ranks[rank])
        except BaseException as exc:
            outcome[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return outcome


def test_a_broadcast_that_fails_on_rank_0_leaves_no_train_rank_waiting_in_the_weight_iterator() -> None:
    """A receiver dies mid-sync: rank 0's broadcast of the second bucket fails. On a sharded trainer the weight
    iterator is a collective (every rank iterates, an all-gather per tensor: a barrier here), so rank 0 must go on
    producing the rest of it. It stopped: rank 1 waited in the next all-gather for its group's timeout, and the sync
    WeightSync redoes after restarting the receiver could never run."""
    from roll_core.cluster.roles import TrainWorker

    names = [f"layer{i}.weight" for i in range(5)]
    gather = threading.Barrier(2, timeout=5)  # the all-gather of each tensor, across the two train ranks

    class Sharded:
        def __init__(self) -> None:
            self.produced: list[str] = []

        def iter_weights(self, changed_only: bool = False):
            for name in names:
                gather.wait()
                self.produced.append(name)
                yield name, torch.full((8,), float(len(self.produced)))

    class ReceiverDied(SyncGroup):
        """Rank 0's group: the first bucket's three broadcasts (length, header, buffer) go, then the peer is gone."""

        def __init__(self) -> None:
            self.device, self.broadcasts = torch.device("cpu"), 0

        def broadcast(self, t: torch.Tensor) -> None:
            self.broadcasts += 1
            if self.broadcasts > 3:
                raise RuntimeError("Connection closed by peer")

    ranks = []
    for rank in (0, 1):
        worker = TrainWorker.__new__(TrainWorker)
        worker.rank, worker.engine, worker.weight_format = rank, Sharded(), "merged"
        worker._sync_group = ReceiverDied() if rank == 0 else None
        ranks.append(worker)
    outcome = _on_each_rank(ranks, lambda w: w.send_weights_dist(32, False))  # one tensor (32 bytes) per bucket
    assert isinstance(outcome[0], RuntimeError) and "Connection closed by peer" in str(outcome[0])
    assert outcome[1] == {"bytes": 0, "tensors": 0, "buckets": 0}, outcome[1]  # not a broken barrier
    assert ranks[0].engine.produced == ranks[1].engine.produced == names
    assert ranks[0]._sync_group.broadcasts == 4  # nothing more went into the broken stream


def test_a_bucket_that_cannot_be_packed_aborts_the_receivers_and_keeps_the_train_ranks_in_step() -> None:
    """Packing a bucket fails on rank 0 (before any broadcast): the receivers are told (a negative length, then the
    error's text) and rank 0 still produces the rest of the weights, which the other ranks' collective needs."""
    produced: list[str] = []

    def weights():
        for name in ("a", "b", "c"):
            produced.append(name)
            yield [(name, torch.zeros(2))]

    class Recording(SyncGroup):
        def __init__(self) -> None:
            self.device, self.sent = torch.device("cpu"), []

        def broadcast(self, t: torch.Tensor) -> None:
            self.sent.append(t.clone())

        def _pack(self, bucket):
            if bucket[0][0] == "b":
                raise TypeError("cannot pickle the specs")
            return super()._pack(bucket)

    group = Recording()
    with pytest.raises(TypeError, match="cannot pickle"):
        group.send_all(weights())
    assert produced == ["a", "b", "c"]
    assert len(group.sent) == 5 and int(group.sent[3].item()) == -group.sent[4].numel()  # a's 3, then the abort
    assert bytes(group.sent[4].tolist()).decode() == "TypeError: cannot pickle the specs"


class _IpcTrain:
    """A fake train group for CudaIpcTransport: `next_ipc_bucket` answers each rank's next entry (None: ended)."""

    def __init__(self, per_rank: list[list]) -> None:
        self.per_rank, self.world_size = [iter(r) for r in per_rank], len(per_rank)

    def call(self, method, *args):
        if method.__name__ == "start_ipc_sync":
            return [None] * self.world_size
        return [next(r, None) for r in self.per_rank]


class _IpcInfer:
    def __init__(self, world_size: int) -> None:
        self.world_size, self.received = world_size, []

    def call(self, method, *args):
        self.received.append(args[0])
        return [entry["bytes"] for entry in args[0]]


def _shared(*names: str, shape=(4,), dtype: str = "bfloat16") -> dict:
    return {"handle": object(), "specs": [(k, shape, dtype) for k in names], "bytes": 8 * len(names)}


def test_cuda_ipc_counts_what_every_rank_received() -> None:
    from roll_core.cluster.weight_sync import CudaIpcTransport

    train = _IpcTrain([[_shared("a", "b"), _shared("c")], [_shared("a", "b"), _shared("c")]])
    infer = _IpcInfer(2)
    moved = CudaIpcTransport(train, infer, bucket_bytes=16, dtype="bfloat16", dist_backend="nccl").sync(False)
    assert tuple(moved) == (24, 3, 2)
    assert [[len(e["specs"]) for e in shared] for shared in infer.received] == [[2, 2], [1, 1]]


@pytest.mark.parametrize(
    ("rank1", "message", "delivered"),
    [
        ([_shared("a", "b")], r"trainer ranks \[1\] ended the sync after 1 buckets", 1),  # one bucket short
        ([_shared("a", "b"), _shared("c"), _shared("d")], r"trainer ranks \[0\] ended the sync after 2 buckets", 2),
        ([_shared("a", "b"), _shared("c", dtype="float32")], r"bucket 1 of trainer ranks \[1\] holds other", 1),
    ],
)
def test_cuda_ipc_trainer_ranks_out_of_step_are_an_error_not_engines_with_different_weights(
    rank1, message, delivered
) -> None:
    """Inference rank r takes trainer rank r's bucket. The sync ended when rank 0's did: a rank 1 with more buckets
    left its engine without them (or one with other tensors gave it other weights), and the sync succeeded."""
    from roll_core.cluster.weight_sync import CudaIpcTransport

    train = _IpcTrain([[_shared("a", "b"), _shared("c")], rank1])
    infer = _IpcInfer(2)
    transport = CudaIpcTransport(train, infer, bucket_bytes=16, dtype="bfloat16", dist_backend="nccl")
    with pytest.raises(RuntimeError, match=message):
        transport.sync(False)
    assert len(infer.received) == delivered  # nothing past the point where the ranks disagree


def test_an_object_store_put_that_fails_on_rank_0_leaves_no_train_rank_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The object-store transport: rank 0's `ray.put` of the second bucket fails (the object store is full). The
    weight iterator is a collective on a sharded trainer, so rank 0 goes on iterating it to the end and raises then;
    it stopped at the failure, and the other ranks waited in their next all-gather until their group timed out."""
    import ray

    from roll_core.cluster.roles import TrainWorker

    names = [f"layer{i}.weight" for i in range(4)]
    gather = threading.Barrier(2, timeout=5)  # the all-gather of each tensor, across the two train ranks

    class Sharded:
        def __init__(self) -> None:
            self.produced: list[str] = []

        def iter_weights(self, changed_only: bool = False):
            for name in names:
                gather.wait()
                self.produced.append(name)
                yield name, torch.ones(8)

    puts: list[int] = []

    def put(value: object) -> object:
        puts.append(1)
        if len(puts) == 2:
            raise MemoryError("the object store is full")
        return object()

    monkeypatch.setattr(ray, "put", put)
    ranks = []
    for rank in (0, 1):
        worker = TrainWorker.__new__(TrainWorker)
        worker.rank, worker.engine, worker.weight_format = rank, Sharded(), "merged"
        ranks.append(worker)
    outcome = _on_each_rank(ranks, lambda w: w.publish_weights(32, False))  # one tensor (32 bytes) per bucket
    assert isinstance(outcome[0], MemoryError), outcome[0]
    assert outcome[1] == {"refs": [], "bytes": 0, "tensors": 0}, outcome[1]  # not a broken barrier
    assert ranks[0].engine.produced == ranks[1].engine.produced == names
    assert len(puts) == 2  # nothing more was put after the failure


def test_only_rank_0_keeps_host_copies_of_the_weights_it_returns() -> None:
    """`get_weights` is collective on a sharded engine (every rank iterates) but only rank 0 returns the weights:
    the other ranks kept a host copy of the whole model too."""
    from roll_core.cluster.roles import TrainWorker

    copies: list[int] = []

    class Weight:
        """A tensor stand-in that counts the host copies made of it."""

        def detach(self) -> Weight:
            return self

        def to(self, *args: object, **kwargs: object) -> torch.Tensor:
            copies.append(1)
            return torch.ones(4)

    class Engine:
        def iter_weights(self, changed_only: bool = False):
            for i in range(3):
                yield f"w{i}", Weight()

    out = {}
    for rank in (0, 1):
        worker = TrainWorker.__new__(TrainWorker)
        worker.rank, worker.engine = rank, Engine()
        copies.clear()
        out[rank] = (worker.get_weights(), len(copies))
    assert sorted(out[0][0]) == ["w0", "w1", "w2"] and out[0][1] == 3
    assert out[1] == (None, 0)


class _Threaded:
    """A one-rank group whose calls run the real worker method (`submit`: on a thread), for DistTransport."""

    world_size = 1

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def call(self, method: Callable, *args: Any) -> Any:
        return method(self.worker, *args)

    def submit(self, method: Callable, *args: Any) -> Any:
        done: dict[str, Any] = {}

        def run() -> None:
            try:
                done["value"] = method(self.worker, *args)
            except BaseException as exc:
                done["error"], done["at"] = exc, time.monotonic()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()

        class Handle:
            def wait(self, timeout: float | None = None) -> bool:
                thread.join(timeout)
                return not thread.is_alive()

            def values(self) -> list[Any]:
                thread.join()
                if "error" in done:
                    raise done["error"]
                return [done["value"]]

        handle = Handle()
        handle.done = done  # type: ignore[attr-defined]
        return handle


def test_a_dist_sync_group_waits_for_a_stalled_trainer_only_sync_timeout_s() -> None:
    """`infer_engine.sync_timeout_s` reaches the collective group of both sides: with 2 s, an engine whose trainer
    stalls before its first bucket leaves the broadcast after ~2 s with gloo's timeout. The groups were built with
    a fixed 600 s (and NCCL's with its own default whatever was asked): a stalled trainer held the engines 10 min."""
    from roll_core.cluster.weight_sync import DistTransport

    release = threading.Event()

    class Trainer:
        def iter_weights(self, changed_only: bool = False):
            release.wait(20)  # stalled (a hung device, a slow gather) longer than the sync's timeout
            raise RuntimeError("the trainer gave up")
            yield  # a generator

    train, infer = _rank_0_workers(Trainer())
    receivers = _Threaded(infer)
    submitted: list[Any] = []
    submit = receivers.submit
    receivers.submit = lambda *a: submitted.append(submit(*a)) or submitted[-1]  # type: ignore[method-assign]
    transport = DistTransport(
        _Threaded(train), receivers, bucket_bytes=1024, dtype=None, dist_backend="gloo", timeout_s=2
    )
    transport.receivers_grace_s = 30
    t0 = time.monotonic()
    outcome: dict[str, BaseException] = {}

    def sync() -> None:
        try:
            transport.sync(False)
        except BaseException as exc:
            outcome["sync"] = exc

    syncing = threading.Thread(target=sync, daemon=True)
    syncing.start()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not (len(submitted) == 2 and "error" in submitted[1].done):
        time.sleep(0.1)
    release.set()
    syncing.join(30)
    assert len(submitted) == 2, "the receivers never got to their receive"
    error, at = submitted[1].done.get("error"), submitted[1].done.get("at", float("inf"))
    assert error is not None and at - t0 < 10, f"the engine waited {at - t0:.0f} s for a stalled trainer"
    assert "timeout" in str(error).lower() or "timed out" in str(error).lower(), error
    assert isinstance(outcome.get("sync"), RuntimeError)
