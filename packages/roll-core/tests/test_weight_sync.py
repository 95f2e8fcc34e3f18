"""Weight-sync building blocks without Ray: buckets, flat buffers, a gloo group between threads, transport choice."""

from __future__ import annotations

import threading

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
