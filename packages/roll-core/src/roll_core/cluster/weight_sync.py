"""Weight sync from the trainer to inference engines, as a transport of named tensors in size-bounded buckets.

The pipeline asks `WeightSync.sync()` and never touches tensors. The train engine yields (HF name, tensor) pairs
(`TrainEngine.iter_weights`, a collective on sharded engines); the transport carries them bucket by bucket to
every inference worker, which calls `InferEngine.update_weights(bucket)` between `begin_weight_update()` and
`finish_weight_update()`. A bucket holds at most `bucket_mb` MiB (a single larger tensor travels alone), so
neither side ever holds a second full copy of the model in transit, except the object store, which holds the
published buckets until every receiver has read them.

Transports:
- `inprocess`: local backend; buckets go straight from the train engine to the inference engines.
- `object_store`: Ray; rank 0 of the trainer `ray.put`s each bucket, receivers `ray.get` them (CPU, cross-node).
- `dist`: a `torch.distributed` process group of the trainer's rank 0 and every inference worker, created once
  outside any default group (a TCPStore on rank 0's node, a port probed there); each bucket is flattened into one
  buffer and broadcast (gloo on CPU, nccl/hccl on devices), preceded by a small pickled header.
- `cuda_ipc`: colocated roles on one GPU; trainer rank r shares each bucket's device buffer with inference rank r
  through CUDA IPC handles (no copy through host memory).
- `auto`: inprocess on the local backend; on Ray cuda_ipc for colocated CUDA roles (every engine takes it: each
  copies what it receives into memory it owns), else dist (on CPU too: measured faster than the object store,
  bench/RESULTS.md). `dist` is refused for colocated CUDA roles
  (NCCL refuses two ranks on one GPU).

The trainer casts floating tensors to the inference engines' dtype before bucketing (`weight_dtype`), so fp32
master weights never travel and no receiver stages a wider copy than it keeps.

`changed_only` syncs skip what training cannot change (frozen parameters, buffers); the first sync, and the first
after an engine discarded its weights (`sleep(level=2)`), is always full.

Restarted engines (roll_core.cluster.group: a dead or hung inference worker is re-created): `WeightSync` registers
a restart hook that gives the new engines the trainer's current weights in full through the object store
(whatever the transport: only the new ranks receive), before the call that failed is rerun; the `dist` group,
which lost a member, is rebuilt at the next sync. A sync during which an engine died is redone in full once the
engine is back. A restored engine counts weight versions from its restore on (its `weight_version` restarts).
"""

from __future__ import annotations

import datetime
import logging
import pickle
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "inprocess", "object_store", "dist", "cuda_ipc")
Bucket = list[tuple[str, Tensor]]


def buckets(named: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group (name, tensor) pairs in order into buckets of at most `bucket_bytes` (an oversized tensor alone)."""
    current: Bucket = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if current and size + n > bucket_bytes:
            yield current
            current, size = [], 0
        current.append((name, t))
        size += n
    if current:
        yield current


def bucket_nbytes(bucket: Bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


# ---- flat buffers (dist and cuda_ipc) -----------------------------------------------------------------------
def flatten(bucket: Bucket, device: torch.device | str) -> tuple[Tensor, list[tuple[str, tuple[int, ...], str]]]:
    """One uint8 buffer holding every tensor's bytes, and the (name, shape, dtype) list to cut it again."""
    specs = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in bucket]
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8).to(device) for _, t in bucket]
    return (torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)), specs


def unflatten(buffer: Tensor, specs: list[tuple[str, tuple[int, ...], str]]) -> Bucket:
    """Inverse of `flatten` (views into `buffer`)."""
    out, offset = [], 0
    for name, shape, dtype in specs:
        dt = getattr(torch, dtype)
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
        out.append((name, buffer[offset : offset + n].view(dt).view(shape)))
        offset += n
    return out


# ---- a process group outside the default one -----------------------------------------------------------------
class SyncGroup:
    """A stateless torch.distributed group (rank 0 = trainer) used only for weight broadcasts.

    It never touches the default process group, so FSDP's group on the trainer and an engine's own groups stay
    independent (the pattern vLLM's StatelessProcessGroup and OpenRLHF's custom groups follow).
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float = 600.0,
        store: Any | None = None,
    ):
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
            self.device = torch.device("cpu")
        elif backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size)
            self.device = torch.device("cuda", torch.cuda.current_device())
        elif backend == "hccl":  # pragma: no cover - Ascend only
            import torch_npu

            self.pg = torch_npu._C._distributed_c10d.ProcessGroupHCCL(store, rank, world_size, timeout)
            self.device = torch.device("npu", torch.npu.current_device())
        else:
            raise ValueError(f"weight sync over torch.distributed supports gloo, nccl, hccl; not {backend!r}")
        self._store = store  # keep the store alive as long as the group

    @staticmethod
    def host_store(host: str, world_size: int, timeout_s: float = 600.0) -> Any:
        """Rank 0's rendezvous store, listening on a port the OS picks (`store.port`); pass it as `store=`.

        Binding before the port is announced closes the race of picking a free port, releasing it and binding it
        again later (another process took it in between: EADDRINUSE, seen in CI)."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout)

    def broadcast(self, t: Tensor) -> None:
        self.pg.broadcast(t, 0).wait()

    def send(self, bucket: Bucket | None) -> None:
        """Rank 0: header (pickled specs; length 0 ends the sync) then the flat buffer."""
        if bucket is None:
            self.broadcast(torch.zeros(1, dtype=torch.int64, device=self.device))
            return
        flat, specs = flatten(bucket, self.device)
        header = torch.frombuffer(bytearray(pickle.dumps(specs)), dtype=torch.uint8).to(self.device)
        self.broadcast(torch.tensor([header.numel()], dtype=torch.int64, device=self.device))
        self.broadcast(header)
        self.broadcast(flat)

    def receive(self) -> Bucket | None:
        """Ranks > 0: the next bucket, or None at the end of a sync."""
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(n)
        if int(n.item()) == 0:
            return None
        header = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(header)
        specs = pickle.loads(header.cpu().numpy().tobytes())
        total = sum(
            int(torch.Size(s).numel()) * torch.empty((), dtype=getattr(torch, d)).element_size() for _, s, d in specs
        )
        flat = torch.empty(total, dtype=torch.uint8, device=self.device)
        self.broadcast(flat)
        return unflatten(flat, specs)


# ---- CUDA IPC ------------------------------------------------------------------------------------------------
def share_cuda(bucket: Bucket) -> tuple[Any, list[tuple[str, tuple[int, ...], str]], Tensor]:
    """(IPC handle of one flat device buffer, specs, the buffer to keep alive until the receiver copied it)."""
    from torch.multiprocessing.reductions import reduce_tensor

    flat, specs = flatten(bucket, bucket[0][1].device)
    return reduce_tensor(flat), specs, flat


def open_cuda(handle: Any, specs: list[tuple[str, tuple[int, ...], str]]) -> Bucket:
    """Rebuild a shared bucket in the receiving process (same device, other process)."""
    rebuild, args = handle
    return unflatten(rebuild(*args), specs)


@dataclass
class SyncStats:
    """What one sync moved."""

    transport: str
    bytes: int
    tensors: int
    buckets: int
    seconds: float
    full: bool
    version: int

    def metrics(self) -> dict[str, float]:
        return {
            "sync/bytes": float(self.bytes),
            "sync/seconds": self.seconds,
            "sync/buckets": float(self.buckets),
            "sync/tensors": float(self.tensors),
            "sync/full": float(self.full),
            "sync/weight_version": float(self.version),
        }


def resolve_transport(name: str, backend: str, placement: str, platform_name: str) -> str:
    """The concrete transport for `auto` (and a clear error for impossible choices)."""
    if name not in TRANSPORTS:
        raise ValueError(f"weight sync transport {name!r} is not one of {', '.join(TRANSPORTS)}")
    if backend == "local":
        if name not in ("auto", "inprocess"):
            raise ValueError(f"sync_transport={name} needs separate processes: use cluster=ray, or inprocess/auto")
        return "inprocess"
    if name == "inprocess":
        raise ValueError("sync_transport=inprocess needs cluster=local (roles in one process)")
    if name == "cuda_ipc" and platform_name not in ("cuda", "rocm"):
        raise ValueError(f"sync_transport=cuda_ipc needs CUDA/ROCm devices; this run is on {platform_name}")
    if name == "cuda_ipc" and placement != "colocated":
        raise ValueError("sync_transport=cuda_ipc shares device memory: it needs cluster.placement=colocated")
    if name == "dist" and placement == "colocated" and platform_name in ("cuda", "rocm"):
        raise ValueError(
            "sync_transport=dist puts the trainer's rank 0 and inference rank 0 in one NCCL group, and colocated they "
            "share a GPU, which NCCL refuses: use sync_transport=cuda_ipc (or auto), or cluster.placement=disaggregated"
        )
    if name != "auto":
        return name
    if platform_name in ("cuda", "rocm") and placement == "colocated":
        return "cuda_ipc"
    # Measured on CPU (bench/RESULTS.md): a gloo broadcast moves 135M parameters 2.3x faster than the object store.
    return "dist"


class WeightSync:
    """Moves the trainer's weights into every inference worker through one transport (see module docstring)."""

    def __init__(self, train: Any, infer: Any, *, transport: str, bucket_mb: float, placement: str, platform: Any):
        self.train, self.infer = train, infer
        self.transport = resolve_transport(transport, train.backend, placement, platform.name)
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.dist_backend = platform.dist_backend
        # What the engines hold: the trainer casts before bucketing, so fp32 master weights never travel.
        self.dtype: str | None = infer.call("weight_dtype") or None
        self._group_ready = False
        self.synced_once = False
        self.restores = 0  # restarted engines given the trainer's weights
        # A restore may start on another thread (the asynchronous driver's request failed) while a sync runs: they
        # take turns under the inference group's restart lock (one lock, so no lock-order deadlock), re-entrant
        # because an engine that dies during a sync is restored inside it.
        self._lock = getattr(infer, "restart_lock", None) or threading.RLock()
        if self.transport != "inprocess" and hasattr(infer, "add_restart_hook"):
            infer.add_restart_hook(self.restore)

    def sync(self, full: bool | None = None) -> SyncStats:
        """One sync; `full=None` sends only changed tensors after the first sync (and always after a level-2
        sleep, which the pipeline reports by `require_full()`). An engine that dies during the sync is restarted
        and the sync redone in full."""
        with self._lock:
            restarts = getattr(self.infer, "restarts", 0)
            try:
                return self._sync(full)
            except Exception as exc:
                # An engine that died mid-sync surfaces as its own error, or as the trainer's (a broken broadcast).
                healed = self.infer.check_health() if hasattr(self.infer, "check_health") else []
                if not healed and getattr(self.infer, "restarts", 0) == restarts:
                    raise
                log.warning("weight sync interrupted by a restarted inference engine (%s): redoing it in full", exc)
                self._group_ready = False
                return self._sync(True)

    def restore(self, ranks: list[int]) -> None:
        """Give restarted inference ranks the trainer's current weights (all of them, through the object store)."""
        with self._lock:
            self._group_ready = False  # a `dist` group that lost a member is rebuilt at the next sync
            published = self.train.call("publish_weights", self.bucket_bytes, False, self.dtype)[0]
            self.infer.call_ranks(ranks, "begin_weight_update")
            try:
                self.infer.call_ranks(ranks, "receive_weights_object_store", published["refs"])
            finally:
                self.infer.call_ranks(ranks, "finish_weight_update")
            self.restores += len(ranks)
        log.warning("inference rank(s) %s restored with the trainer's weights (%d bytes)", ranks, published["bytes"])

    def _sync(self, full: bool | None) -> SyncStats:
        full = (not self.synced_once) if full is None else full
        t0 = time.perf_counter()
        self.infer.begin_weight_update()
        try:
            nbytes, ntensors, nbuckets = getattr(self, f"_sync_{self.transport}")(not full)
        finally:
            versions = self.infer.finish_weight_update()
        self.synced_once = True
        return SyncStats(self.transport, nbytes, ntensors, nbuckets, time.perf_counter() - t0, full, max(versions))

    def require_full(self) -> None:
        """The next sync must send everything (an engine discarded its weights)."""
        self.synced_once = False

    # ---- transports ---------------------------------------------------------------------------------------
    def _sync_inprocess(self, changed_only: bool) -> tuple[int, int, int]:
        nbytes = ntensors = nbuckets = 0
        for bucket in self.train.workers[0].weight_buckets(self.bucket_bytes, changed_only, self.dtype):
            for w in self.infer.workers:
                w.engine.update_weights(bucket)
            nbytes += bucket_nbytes(bucket)
            ntensors += len(bucket)
            nbuckets += 1
        return nbytes, ntensors, nbuckets

    def _sync_object_store(self, changed_only: bool) -> tuple[int, int, int]:
        published = self.train.call("publish_weights", self.bucket_bytes, changed_only, self.dtype)[0]
        refs, nbytes, ntensors = published["refs"], published["bytes"], published["tensors"]
        # Refs nested in a list are not resolved by Ray on the way: each receiver reads one bucket at a time.
        self.infer.call("receive_weights_object_store", refs)
        return nbytes, ntensors, len(refs)

    def _sync_dist(self, changed_only: bool) -> tuple[int, int, int]:
        if not self._group_ready:
            world = 1 + self.infer.world_size
            host, port = self.train.call("sync_endpoint", world)
            a = self.train.submit("join_sync_group", host, port, world, self.dist_backend)
            b = self.infer.submit("join_sync_group", host, port, world, self.dist_backend)
            a.values(), b.values()
            self._group_ready = True
        sent = self.train.submit("send_weights_dist", self.bucket_bytes, changed_only, self.dtype)
        got = self.infer.submit("receive_weights_dist")
        stats = sent.values()[0]
        got.values()
        return stats["bytes"], stats["tensors"], stats["buckets"]

    def _sync_cuda_ipc(self, changed_only: bool) -> tuple[int, int, int]:
        self.train.call("start_ipc_sync", self.bucket_bytes, changed_only, self.dtype)
        nbytes = ntensors = nbuckets = 0
        while True:
            shared = self.train.call("next_ipc_bucket")  # one entry per train rank (same device as infer rank r)
            if shared[0] is None:
                break
            self.infer.call("receive_ipc_bucket", shared[: self.infer.world_size])
            nbytes += shared[0]["bytes"]
            ntensors += len(shared[0]["specs"])
            nbuckets += 1
        return nbytes, ntensors, nbuckets
