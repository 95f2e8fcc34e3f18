"""What a weight sync holds after it failed or was replaced: the roles' old `dist` groups (a process group, the
rendezvous store and its port) are closed when a new rendezvous replaces them, and the `cuda_ipc` sender's bucket
iterator and last shared buffer are released when a sync fails part way or a new one starts. Role objects are
used directly (no Ray); CUDA sharing is replaced by a CPU stand-in."""

from __future__ import annotations

import gc
import logging
import socket
import weakref
from typing import Any

import pytest
import torch

from roll_core.cluster import infer_role, roles
from roll_core.cluster.buckets import flatten
from roll_core.cluster.roles import InferWorker, TrainWorker


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _trainer(engine: Any = None) -> TrainWorker:
    worker = TrainWorker.__new__(TrainWorker)  # rank 0 of the sending side alone, without Ray
    worker.rank, worker.engine, worker.weight_format = 0, engine, "merged"
    return worker


def test_a_new_rendezvous_closes_the_trainers_old_group_and_frees_its_port() -> None:
    """A group of the trainer alone (world 1, gloo), rebuilt as after a failed sync. The old group is closed and its
    store's port released even while something else still refers to it (a traceback, a thread): replaced without
    a close, it listened for as long as any reference lived."""
    worker = _trainer()
    host, first_port = worker.sync_endpoint(1, 30)
    worker.join_sync_group(host, first_port, 1, "gloo", 30)
    old = worker._sync_group  # a stray reference
    assert old is not None and _listening(first_port)

    host, second_port = worker.sync_endpoint(1, 30)
    worker.join_sync_group(host, second_port, 1, "gloo", 30)
    assert old.pg is None, "the replaced group was not closed"
    assert not _listening(first_port), "the replaced group's store still listens on its port"
    assert _listening(second_port) and worker._sync_group is not old
    with pytest.raises(RuntimeError, match="was closed"):
        old.broadcast(torch.zeros(1))
    worker._sync_group.broadcast(torch.ones(1))  # the new group works
    worker._sync_group.close()


class _FakeGroup:
    """Stands in for SyncGroup in the role modules: counts its closes; `fail_build`: the rendezvous fails."""

    fail_build = False

    def __init__(self, host: str, port: int, rank: int, world_size: int, *args: Any, **kwargs: Any) -> None:
        if _FakeGroup.fail_build:
            raise TimeoutError("the rendezvous timed out")
        self.port, self.rank, self.closed = port, rank, 0

    def close(self) -> None:
        self.closed += 1


class _Unclosable(_FakeGroup):
    def close(self) -> None:
        raise RuntimeError("the old group's abort failed")


@pytest.fixture
def fake_groups(monkeypatch: pytest.MonkeyPatch) -> type[_FakeGroup]:
    _FakeGroup.fail_build = False
    monkeypatch.setattr(infer_role, "SyncGroup", _FakeGroup)
    monkeypatch.setattr(roles, "SyncGroup", _FakeGroup)
    return _FakeGroup


def test_an_inference_worker_closes_its_old_group_before_joining_a_new_one(fake_groups, caplog) -> None:
    worker = InferWorker.__new__(InferWorker)
    worker.rank = 1
    worker.join_sync_group("127.0.0.1", 1000, 3, "gloo")
    first = worker._sync_group
    worker.join_sync_group("127.0.0.1", 1001, 3, "gloo")
    assert first.closed == 1 and worker._sync_group.port == 1001 and worker._sync_group.rank == 2

    # An old group that fails to close is logged; the new group is still built.
    worker._sync_group = _Unclosable.__new__(_Unclosable)
    with caplog.at_level(logging.WARNING, logger="roll_core.cluster.buckets"):
        worker.join_sync_group("127.0.0.1", 1002, 3, "gloo")
    assert worker._sync_group.port == 1002
    assert "could not be closed" in caplog.text and "abort failed" in caplog.text

    # A rendezvous that fails leaves no group behind: not the stale one (closed), never used again.
    current = worker._sync_group
    fake_groups.fail_build = True
    with pytest.raises(TimeoutError):
        worker.join_sync_group("127.0.0.1", 1003, 3, "gloo")
    assert current.closed == 1 and worker._sync_group is None


def test_a_failed_trainer_rendezvous_leaves_no_stale_group(fake_groups) -> None:
    worker = _trainer()
    worker._sync_store = None
    worker.join_sync_group("127.0.0.1", 1000, 2, "gloo")
    first = worker._sync_group
    fake_groups.fail_build = True
    with pytest.raises(TimeoutError):
        worker.join_sync_group("127.0.0.1", 1001, 2, "gloo")
    assert first.closed == 1 and worker._sync_group is None


# ---- cuda_ipc: the sender's iterator and buffer ------------------------------------------------------------------
class _Engine:
    """A trainer whose weights are produced one by one; `finished` counts iterators that ended (closed or not)."""

    def __init__(self, n: int = 4) -> None:
        self.n, self.finished = n, 0

    def iter_weights(self, changed_only: bool = False):
        try:
            for i in range(self.n):
                yield f"w{i}", torch.full((16,), float(i))
        finally:
            self.finished += 1


class _Sharing:
    """`share_cuda` on CPU: flattens the bucket; keeps weak references to every buffer it handed out. `fail`: the
    bucket holding "w2" cannot be shared (the device ran out of memory)."""

    def __init__(self) -> None:
        self.buffers: list[weakref.ref] = []
        self.fail = False

    def __call__(self, bucket: list) -> tuple[Any, list, torch.Tensor]:
        if self.fail and bucket[0][0] == "w2":
            raise RuntimeError("CUDA out of memory")
        flat, specs = flatten(bucket, "cpu")
        self.buffers.append(weakref.ref(flat))
        return ("handle", len(self.buffers)), specs, flat

    def held(self) -> list[int]:
        """The buffers still alive, by the order they were shared."""
        gc.collect()
        return [i for i, ref in enumerate(self.buffers) if ref() is not None]


@pytest.fixture
def shared(monkeypatch: pytest.MonkeyPatch) -> _Sharing:
    sharing = _Sharing()
    monkeypatch.setattr(roles, "share_cuda", sharing)
    return sharing


def test_a_bucket_that_cannot_be_shared_releases_the_sync(shared) -> None:
    engine = _Engine()
    worker = _trainer(engine)
    shared.fail = True
    worker.start_ipc_sync(64, False)  # one 64-byte tensor per bucket
    assert worker.next_ipc_bucket()["bytes"] == 64
    assert worker.next_ipc_bucket()["bytes"] == 64
    with pytest.raises(RuntimeError, match="out of memory"):
        worker.next_ipc_bucket()
    assert worker._ipc is None and engine.finished == 1  # the weight iterator was closed, not left suspended
    assert shared.held() == []  # no shared buffer is kept
    with pytest.raises(RuntimeError, match="start_ipc_sync first"):
        worker.next_ipc_bucket()


def test_end_ipc_sync_releases_a_sync_abandoned_by_its_caller(shared) -> None:
    """The receivers failed after the first bucket: the controller ends the sync on the trainer, which releases
    the buffer it shared and closes the weight iterator at once (they were held until the next sync)."""
    engine = _Engine()
    worker = _trainer(engine)
    worker.start_ipc_sync(64, False)
    worker.next_ipc_bucket()
    assert shared.held() == [0] and engine.finished == 0
    worker.end_ipc_sync()
    assert shared.held() == [] and engine.finished == 1 and worker._ipc is None
    worker.end_ipc_sync()  # idempotent


def test_a_new_ipc_sync_ends_the_unfinished_one_first(shared, caplog) -> None:
    engine = _Engine()
    worker = _trainer(engine)
    worker.start_ipc_sync(64, False)
    worker.next_ipc_bucket()
    worker.start_ipc_sync(64, False)
    assert engine.finished == 1 and shared.held() == []
    names = []
    while (out := worker.next_ipc_bucket()) is not None:
        names += [k for k, _, _ in out["specs"]]
    assert names == ["w0", "w1", "w2", "w3"] and worker._ipc is None and engine.finished == 2

    class Stubborn:  # an iterator whose close raises: logged, the new sync still starts
        def __next__(self):
            return [("x", torch.zeros(2))]

        def close(self):
            raise RuntimeError("close failed")

    worker._ipc = {"it": Stubborn(), "keep": None}
    with caplog.at_level(logging.WARNING, logger="roll_core.cluster.roles"):
        worker.start_ipc_sync(64, False)
    assert "failed to close" in caplog.text
    assert worker.next_ipc_bucket()["specs"][0][0] == "w0"


class _OneRank:
    """A train group of one real `TrainWorker` (rank 0), called directly: what `CudaIpcTransport` asks of it."""

    def __init__(self, worker: TrainWorker, fail_end: bool = False) -> None:
        self.worker, self.world_size, self.fail_end, self.ended = worker, 1, fail_end, 0

    def call(self, method: Any, *args: Any) -> list:
        if method.__name__ == "end_ipc_sync":
            self.ended += 1
            if self.fail_end:
                raise ConnectionError("the trainer actor died")
        return [getattr(self.worker, method.__name__)(*args)]


class _Receivers:
    """Inference ranks whose engine refuses the second bucket."""

    world_size = 1

    def __init__(self) -> None:
        self.received = 0

    def call(self, method: Any, shared: list) -> list:
        self.received += 1
        if self.received == 2:
            raise ValueError("the engine refused bucket 1")
        return [entry["bytes"] for entry in shared]


@pytest.mark.parametrize("fail_end", [False, True])
def test_a_cuda_ipc_sync_that_failed_on_the_receivers_is_ended_on_the_trainer(shared, caplog, fail_end) -> None:
    """A receiver raised after the first bucket: the transport ends the sync on the trainer before it raises, so the
    last shared buffer and the weight iterator are released at once (they were held until the next sync). An
    `end_ipc_sync` that fails itself is logged; the receivers' error is the one raised."""
    from roll_core.cluster.weight_sync import CudaIpcTransport

    engine = _Engine()
    train = _OneRank(_trainer(engine), fail_end=fail_end)
    transport = CudaIpcTransport(train, _Receivers(), bucket_bytes=64, dtype=None, dist_backend="nccl")
    with (
        caplog.at_level(logging.WARNING, logger="roll_core.cluster.weight_sync"),
        pytest.raises(ValueError, match="refused"),
    ):
        transport.sync(False)
    assert train.ended == 1
    if fail_end:
        assert "ending it on the trainer failed too: the trainer actor died" in caplog.text
        assert train.worker._ipc is not None  # the fake trainer did not end it: the next start_ipc_sync will
    else:
        assert train.worker._ipc is None and engine.finished == 1 and shared.held() == []
        assert caplog.text == ""


def test_a_successful_cuda_ipc_sync_is_not_ended_twice(shared) -> None:
    from roll_core.cluster.weight_sync import CudaIpcTransport

    engine = _Engine()
    train = _OneRank(_trainer(engine))

    class Accepting(_Receivers):
        def call(self, method: Any, shared: list) -> list:
            return [entry["bytes"] for entry in shared]

    moved = CudaIpcTransport(train, Accepting(), bucket_bytes=64, dtype=None, dist_backend="nccl").sync(False)
    assert tuple(moved) == (256, 4, 4) and train.ended == 0 and engine.finished == 1 and shared.held() == []
