"""Weight sync from the trainer to inference engines, as a transport of named tensors in size-bounded buckets.

The pipeline asks `WeightSync.sync()` and never touches tensors. The train engine yields (HF name, tensor) pairs
(`TrainEngine.iter_weights`, a collective on sharded engines); the transport carries them bucket by bucket to
every inference worker, which calls `InferEngine.update_weights(bucket)` between `begin_weight_update()` and
`finish_weight_update()`, or `abort_weight_update()` when the sync failed (`abort_sync`). A bucket holds at most
`bucket_mb` MiB (a single larger tensor travels alone), so neither side ever holds a second full copy of the model
in transit, except the object store, which holds the published buckets until every receiver has read them.

Transports, one class each (`Transport` subclasses in `TRANSPORT_CLASSES`, chosen by name; each `sync()` drives
both sides through the workers' typed methods: roll_core.cluster.roles; buckets, flat buffers, the stateless
process group and CUDA IPC handles are in roll_core.cluster.buckets):
- `inprocess`: local backend; buckets go straight from the train engine to the inference engines.
- `object_store`: Ray; rank 0 of the trainer `ray.put`s each bucket, receivers `ray.get` them (CPU, cross-node).
- `dist`: a `torch.distributed` process group of the trainer's rank 0 and every inference worker, created once
  outside any default group (a TCPStore on rank 0's node, a port probed there); each bucket is flattened into one
  buffer and broadcast (gloo on CPU, nccl/hccl on devices), preceded by a small pickled header. A receiver whose
  engine refuses a bucket receives the rest of the sync and then raises (`SyncGroup.receive_all`); a trainer that
  fails while producing a bucket ends the sync on every receiver, which raises `SyncAbortedError` at once
  (`SyncGroup.send_all`); a sync that failed on either side discards the group (`DistTransport`).
- `cuda_ipc`: colocated roles on one GPU; trainer rank r shares each bucket's device buffer with inference rank r
  through CUDA IPC handles (no copy through host memory); trainer ranks out of step (one ends the sync early, or a
  bucket holds other tensors than rank 0's) fail the sync rather than leave engines with different weights.
- `auto`: inprocess on the local backend; on Ray cuda_ipc for colocated CUDA roles (every engine takes it: each
  copies what it receives into memory it owns), else dist (on CPU too: measured faster than the object store,
  bench/RESULTS.md). `dist` is refused for colocated CUDA roles
  (NCCL refuses two ranks on one GPU).

The trainer casts floating tensors to the inference engines' dtype before bucketing (`weight_dtype`), so fp32
master weights never travel and no receiver stages a wider copy than it keeps; the weights an engine keeps wider
than its dtype (`weight_dtypes`: transformers and vLLM keep a DeepSeek-V3 or GLM-4.5 router and its expert bias in
fp32 under bf16) travel in that dtype (they were rounded to bf16 at every sync).

A sync that fails part way (the trainer dies between buckets, an object-store bucket cannot be fetched, a
broadcast breaks) ends with `InferWorker.abort_weight_update` on every receiver, never `finish_weight_update`: an
engine that implements it (hf, vLLM) puts back what the sync wrote and keeps its weight version, so it serves the old
weights whole rather than a mix under a new version; engines without it are finished as before (`abort_sync`).
A `begin_weight_update` that raises on some rank is such a failure too: the ranks it had begun (paused) are ended.
The abort reaches every receiver (on the local backend too: roll_core.cluster.group) and runs on each only after
its receive returned or failed (roll_core.cluster.infer_role: a receiver the controller stopped waiting for, a
`dist` one past `receivers_grace_s`, may still be writing buckets).

`changed_only` syncs skip what training cannot change (frozen parameters, buffers); the first sync, and the first
after an engine discarded its weights (`sleep(level=2)`), is always full.

LoRA adapter sync (`infer_engine.lora_sync=adapter`, engines whose `weight_format` is "adapter"): the trainer
yields its adapter alone (`TrainEngine.iter_adapter`) at every sync, full or not; the engines loaded the frozen
base from the model path at start and serve the adapter (roll_engines.infer._adapters).

Restarted engines (roll_core.cluster.group: a dead or hung inference worker is re-created): `WeightSync` registers
a restart hook that gives the new engines the trainer's current weights in full through the object store
(whatever the transport: only the new ranks receive), before the call that failed is rerun; the `dist` group,
which lost a member, is rebuilt at the next sync. A sync during which an engine died is redone in full once the
engine is back. A restored engine counts weight versions from its restore on (its `weight_version` restarts).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from roll_core.cluster.buckets import (  # noqa: F401  (re-exported: these lived here)
    Bucket,
    SyncGroup,
    bucket_nbytes,
    buckets,
    flatten,
    open_cuda,
    share_cuda,
    unflatten,
)
from roll_core.cluster.group import Handle
from roll_core.cluster.roles import InferGroup, InferWorker, TrainGroup, TrainWorker

log = logging.getLogger(__name__)


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


def abort_sync(infer: InferGroup, exc: BaseException, ranks: list[int] | None = None) -> None:
    """End a sync that failed with `exc` on the inference `ranks` (all when None) by `abort_weight_update`, not
    `finish_weight_update`: finished, an engine kept the part of the new weights it had received under a new weight
    version. Ending it is best effort: its failure is logged and noted on `exc`, which stays the error to raise (it
    says why the sync failed; a worker that died meanwhile was restarted by the call, and `WeightSync.sync` redoes
    the sync)."""
    reason = f"the weight sync failed: {type(exc).__name__}: {str(exc)[:500]}"
    try:
        if ranks is None:
            infer.abort_weight_update(reason)
        else:
            infer.call_ranks(ranks, InferWorker.abort_weight_update, reason)
    except Exception as abort_exc:
        log.exception("a failed weight sync could not be ended on the inference engines")
        exc.add_note(f"ending the failed sync on the inference engines failed too: {abort_exc!r}")


class Moved(NamedTuple):
    """What a transport moved in one sync."""

    bytes: int
    tensors: int
    buckets: int


class Transport:
    """One way of moving the trainer's weights into every inference worker (one subclass per transport).

    `sync(changed_only)` runs between the engines' `begin_weight_update()` and `finish_weight_update()`, or
    `abort_weight_update()` when it raises (the `WeightSync` facade brackets it), and moves every bucket; `reset()`
    forgets state tied to the current inference workers (a restarted one). Subclasses set `name` and are listed in
    `TRANSPORT_CLASSES`.
    """

    name: ClassVar[str]

    def __init__(
        self,
        train: TrainGroup,
        infer: InferGroup,
        *,
        bucket_bytes: int,
        dtype: str | None,
        dist_backend: str,
        wide: dict[str, str] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.train, self.infer = train, infer
        self.bucket_bytes, self.dtype, self.dist_backend = bucket_bytes, dtype, dist_backend
        self.timeout_s = timeout_s  # a collective group's wait for a member (infer_engine.sync_timeout_s)
        self.wide = wide or {}  # weights the engines keep wider than `dtype`, by name: sent in that dtype

    def sync(self, changed_only: bool) -> Moved:
        raise NotImplementedError

    def reset(self) -> None:
        """Nothing to forget by default."""

    @property
    def _cast(self) -> tuple[str | None, dict[str, str]]:
        """The trainer's weight_buckets' last arguments: the engines' dtype and the weights they keep wider."""
        return self.dtype, self.wide


class InProcessTransport(Transport):
    """Local backend: the trainer's buckets go straight to the inference engines (no copy, no process boundary)."""

    name = "inprocess"

    def sync(self, changed_only: bool) -> Moved:
        nbytes = ntensors = nbuckets = 0
        # RANK0 on the local backend returns rank 0's generator itself: buckets are produced one at a time.
        for bucket in self.train.call(TrainWorker.weight_buckets, self.bucket_bytes, changed_only, *self._cast):
            self.infer.call(InferWorker.receive_bucket, bucket)
            nbytes += bucket_nbytes(bucket)
            ntensors += len(bucket)
            nbuckets += 1
        return Moved(nbytes, ntensors, nbuckets)


class ObjectStoreTransport(Transport):
    """Ray: the trainer's rank 0 `ray.put`s CPU buckets, every receiver `ray.get`s them one at a time."""

    name = "object_store"

    def sync(self, changed_only: bool) -> Moved:
        published = self.train.call(TrainWorker.publish_weights, self.bucket_bytes, changed_only, *self._cast)[0]
        refs = published["refs"]
        # Refs nested in a list are not resolved by Ray on the way: each receiver reads one bucket at a time.
        self.infer.call(InferWorker.receive_weights_object_store, refs)
        return Moved(published["bytes"], published["tensors"], len(refs))

    def restore(self, ranks: list[int]) -> int:
        """Every weight to the restarted inference `ranks` only (whatever the run's transport); bytes sent."""
        published = self.train.call(TrainWorker.publish_weights, self.bucket_bytes, False, *self._cast)[0]
        try:
            self.infer.call_ranks(ranks, InferWorker.begin_weight_update)  # inside: as in WeightSync._sync
            self.infer.call_ranks(ranks, InferWorker.receive_weights_object_store, published["refs"])
        except BaseException as exc:
            abort_sync(self.infer, exc, ranks)
            raise
        self.infer.call_ranks(ranks, InferWorker.finish_weight_update)
        return int(published["bytes"])


class DistTransport(Transport):
    """A torch.distributed group of the trainer's rank 0 and every inference worker (built at the first sync and
    after a restart or a failed sync): each bucket is broadcast as one flat buffer after a pickled header.

    A sync that fails on either side discards the group: its receivers may still wait in it (a trainer that died, or
    failed mid-broadcast), and the next sync must not share a stream with them. When the trainer's side fails, its
    receivers are waited for (up to `receivers_grace_s`: a trainer that failed between buckets ended the sync on
    them, SyncGroup.send_all) and their errors logged; the trainer's error is raised. A receiver still receiving
    then (a hung trainer that timed out may yet send) is aborted only once its receive ends: the worker's
    `abort_weight_update` waits for it (roll_core.cluster.infer_role), so no bucket lands after the abort."""

    name = "dist"
    #: Seconds to wait for the receivers of a sync whose sender failed, before giving up on them (they leave at the
    #: group's timeout then).
    receivers_grace_s: float = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._group_ready = False

    def reset(self) -> None:
        self._group_ready = False  # a group that lost a member, or whose stream broke, is rebuilt at the next sync

    def sync(self, changed_only: bool) -> Moved:
        if not self._group_ready:
            world = 1 + self.infer.world_size
            host, port = self.train.call(TrainWorker.sync_endpoint, world, self.timeout_s)
            a = self.train.submit(TrainWorker.join_sync_group, host, port, world, self.dist_backend, self.timeout_s)
            b = self.infer.submit(InferWorker.join_sync_group, host, port, world, self.dist_backend, self.timeout_s)
            self._both(a, b)
            self._group_ready = True
        sent = self.train.submit(TrainWorker.send_weights_dist, self.bucket_bytes, changed_only, *self._cast)
        got = self.infer.submit(InferWorker.receive_weights_dist)
        stats = self._both(sent, got)[0]
        return Moved(stats["bytes"], stats["tensors"], stats["buckets"])

    def _both(self, sender: Handle, receivers: Handle) -> list[Any]:
        """The sender's per-rank results once the receivers finished too. Any failure discards the group; a
        sender's failure is raised after the receivers left (bounded wait), theirs logged."""
        try:
            out = sender.values()
        except BaseException:
            self.reset()
            self._release(receivers)
            raise
        try:
            receivers.values()
        except BaseException:
            self.reset()
            raise
        return out

    def _release(self, receivers: Handle) -> None:
        if not receivers.wait(self.receivers_grace_s):
            log.warning(
                "weight sync failed on the trainer; inference ranks still wait in it after %.0f s (they give up at "
                "the group's timeout, and the sync's abort waits for them there); the next sync builds a new group",
                self.receivers_grace_s,
            )
            return
        try:
            receivers.values()
        except Exception as exc:  # the trainer's error is the one to raise; this is the receivers' account of it
            log.warning("weight sync failed on the trainer; the inference ranks left it with: %s", exc)


class CudaIpcTransport(Transport):
    """Colocated roles on one GPU: trainer rank r shares each bucket's device buffer with inference rank r."""

    name = "cuda_ipc"

    def sync(self, changed_only: bool) -> Moved:
        """One sync, bucket by bucket. A failure (a receiver raised, a trainer rank failed or ran out of step) ends
        the sync on the trainer before it is raised: its ranks released the bucket iterator and the last shared
        buffer only at the next sync otherwise, holding device memory (and the weights being produced) meanwhile."""
        try:
            return self._sync(changed_only)
        except Exception:
            self._end_on_trainer()
            raise

    def _end_on_trainer(self) -> None:
        # Best effort: the sync's own error is the one to raise; a trainer that cannot end it (dead, or failing
        # again) ends it at its next `start_ipc_sync` anyway.
        try:
            self.train.call(TrainWorker.end_ipc_sync)
        except Exception as exc:
            log.warning("cuda_ipc weight sync failed; ending it on the trainer failed too: %s", exc)

    def _sync(self, changed_only: bool) -> Moved:
        self.train.call(TrainWorker.start_ipc_sync, self.bucket_bytes, changed_only, *self._cast)
        nbytes = ntensors = nbuckets = 0
        while True:
            shared = self.train.call(TrainWorker.next_ipc_bucket)  # one entry per train rank (device r = infer r)
            shared = shared[: self.infer.world_size]
            # Each inference rank takes its own trainer rank's bucket: ranks out of step would leave some engines
            # with other weights than the rest (or without the tail of the sync), and nothing else would notice.
            ends = [s is None for s in shared]
            if any(ends) and not all(ends):
                raise RuntimeError(
                    f"cuda_ipc weight sync: trainer ranks {[r for r, e in enumerate(ends) if e]} ended the sync "
                    f"after {nbuckets} buckets, the others did not: the inference engines would hold different weights"
                )
            if ends[0]:
                break
            layouts = [[(k, tuple(shape), dt) for k, shape, dt in s["specs"]] for s in shared]
            if any(lay != layouts[0] for lay in layouts):
                bad = [r for r, lay in enumerate(layouts) if lay != layouts[0]]
                raise RuntimeError(
                    f"cuda_ipc weight sync: bucket {nbuckets} of trainer ranks {bad} holds other tensors (names, "
                    "shapes or dtypes) than rank 0's: the inference engines would hold different weights"
                )
            self.infer.call(InferWorker.receive_ipc_bucket, shared)
            nbytes += shared[0]["bytes"]
            ntensors += len(shared[0]["specs"])
            nbuckets += 1
        return Moved(nbytes, ntensors, nbuckets)


#: The transports by name (`infer_engine.sync_transport`; `auto` is resolved by `resolve_transport`).
TRANSPORT_CLASSES: dict[str, type[Transport]] = {
    cls.name: cls for cls in (InProcessTransport, ObjectStoreTransport, DistTransport, CudaIpcTransport)
}
TRANSPORTS = ("auto", *TRANSPORT_CLASSES)


class WeightSync:
    """Moves the trainer's weights into every inference worker through one transport (see module docstring)."""

    def __init__(
        self,
        train: TrainGroup,
        infer: InferGroup,
        *,
        transport: str,
        bucket_mb: float,
        placement: str,
        platform: Any,
        timeout_s: float = 600.0,
    ):
        self.train, self.infer = train, infer
        name = resolve_transport(transport, train.backend, placement, platform.name)
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        # What the engines hold: the trainer casts before bucketing, so fp32 master weights never travel.
        self.dtype: str | None = infer.call(InferWorker.weight_dtype) or None
        # An engine serving LoRA adapters itself (infer_engine.lora_sync=adapter) is sent the adapter alone.
        self.weight_format: str = infer.call(InferWorker.weight_format)
        if self.weight_format != "merged":
            train.call(TrainWorker.set_weight_format, self.weight_format)
        # Weights the engines keep wider than that dtype travel in theirs (merged weights: an adapter is not kept).
        self.wide: dict[str, str] = infer.call(InferWorker.weight_dtypes) if self.weight_format == "merged" else {}
        kw = {
            "bucket_bytes": self.bucket_bytes,
            "dtype": self.dtype,
            "dist_backend": platform.dist_backend,
            "wide": self.wide,
            "timeout_s": timeout_s,
        }
        self.transport: Transport = TRANSPORT_CLASSES[name](train, infer, **kw)
        # Restarted engines get every weight through the object store, whatever the run's transport.
        self._restorer = ObjectStoreTransport(train, infer, **kw)
        self.synced_once = False
        self.restores = 0  # restarted engines given the trainer's weights
        # A restore may start on another thread (the asynchronous driver's request failed) while a sync runs: they
        # take turns under the inference group's restart lock (one lock, so no lock-order deadlock), re-entrant
        # because an engine that dies during a sync is restored inside it.
        self._lock = getattr(infer, "restart_lock", None) or threading.RLock()
        if name != "inprocess":
            infer.add_restart_hook(self.restore)

    def sync(self, full: bool | None = None) -> SyncStats:
        """One sync; `full=None` sends only changed tensors after the first sync (and always after a level-2
        sleep, which the pipeline reports by `require_full()`). An engine that dies during the sync is restarted
        and the sync redone in full."""
        with self._lock:
            restarts = self.infer.restarts
            try:
                return self._sync(full)
            except Exception as exc:
                # An engine that died mid-sync surfaces as its own error, or as the trainer's (a broken broadcast).
                healed = self.infer.check_health()
                if not healed and self.infer.restarts == restarts:
                    raise
                log.warning("weight sync interrupted by a restarted inference engine (%s): redoing it in full", exc)
                self.transport.reset()
                return self._sync(True)

    def restore(self, ranks: list[int]) -> None:
        """Give restarted inference ranks the trainer's current weights (all of them, through the object store)."""
        with self._lock:
            self.transport.reset()  # a `dist` group that lost a member is rebuilt at the next sync
            nbytes = self._restorer.restore(ranks)
            self.restores += len(ranks)
        log.warning("inference rank(s) %s restored with the trainer's weights (%d bytes)", ranks, nbytes)

    def _sync(self, full: bool | None) -> SyncStats:
        full = (not self.synced_once) if full is None else full
        t0 = time.perf_counter()
        try:
            # Inside: a begin that raised on one rank left the ranks it had begun paused, never ended.
            self.infer.begin_weight_update()
            moved = self.transport.sync(not full)
        except BaseException as exc:
            abort_sync(self.infer, exc)
            raise
        versions = self.infer.finish_weight_update()
        self.synced_once = True
        return SyncStats(self.transport.name, *moved, time.perf_counter() - t0, full, max(versions))

    def require_full(self) -> None:
        """The next sync must send everything (an engine discarded its weights)."""
        self.synced_once = False
