"""Weight buckets and the means of moving them between processes: the pieces both sides of a weight sync use.

A bucket is an ordered list of (HF name, tensor) of at most a size bound (a single larger tensor travels alone).
`flatten`/`unflatten` turn a bucket into one uint8 buffer and back (the `dist` and `cuda_ipc` transports move one
buffer per bucket); `SyncGroup` is a torch.distributed group of the trainer's rank 0 and the inference workers
outside any default group (its sender ends a sync early, with its error, when it cannot produce a bucket:
`send_all`; a role `discard`s its group when a new rendezvous replaces it); `share_cuda`/`open_cuda` pass a device
buffer to another process on the same GPU.
The trainer's workers send and the inference workers receive with these (roll_core.cluster.roles); the controller
side, one class per transport, is roll_core.cluster.weight_sync. No Ray and no worker classes here.
"""

from __future__ import annotations

import datetime
import logging
import pickle
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

Bucket = list[tuple[str, Tensor]]
log = logging.getLogger(__name__)


class SyncAbortedError(RuntimeError):
    """The sender of a `dist` weight sync failed before the sync ended (its error is quoted); raised on receivers."""


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


def cast(
    named: Iterable[tuple[str, Tensor]], dtype: str | None, wide: Mapping[str, str] | None = None
) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) with floating tensors in `dtype` (what the inference engines hold; None: as they are), except
    those `wide` names, which go in the dtype it gives: weights the engines keep wider than their dtype (a
    DeepSeek-V3 or GLM-4.5 router and its expert bias in fp32 under bf16), which a cast to `dtype` would round.
    A finite value the cast turns into inf (beyond fp16's range) is a ValueError naming it (`_refuse_overflow`)."""
    wide = wide or {}
    for name, t in named:
        if dtype and t.is_floating_point():
            narrowed = t.to(getattr(torch, wide.get(name, dtype)))
            _refuse_overflow(name, t, narrowed)
            t = narrowed
        yield name, t


def _refuse_overflow(name: str, source: Tensor, cast_to: Tensor) -> None:
    """Raise where the cast of a finite weight overflowed to inf: an fp32 weight beyond fp16's 65504 became inf in an
    fp16 engine, which then sampled from NaN logits under the new version with no error. Raised while the bucket is
    produced, the sync fails and every engine keeps its old weights (roll_core.cluster.weight_sync). Checked only
    for a target whose range is much narrower than the source's (fp16 from fp32/bf16): bf16 has fp32's range."""
    if torch.finfo(cast_to.dtype).max * 2 >= torch.finfo(source.dtype).max:
        return
    inf = torch.isinf(cast_to)
    if not bool(inf.any()):
        return
    overflowed = inf & torch.isfinite(source)
    if not bool(overflowed.any()):  # inf already in the trainer's tensor: carried as it is
        return
    largest = float(source[overflowed].abs().max())
    raise ValueError(
        f"weight sync: {int(overflowed.sum())} value(s) of {name!r} overflow {cast_to.dtype} (largest magnitude "
        f"{largest:.6g}, the dtype's max {torch.finfo(cast_to.dtype).max:.6g}): the inference engine would hold inf; "
        "serve in bfloat16 (model.dtype / the inference engine's dtype) or keep these weights in range"
    )


def bucket_nbytes(bucket: Bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


# ---- flat buffers (dist and cuda_ipc) -----------------------------------------------------------------------
#: Each tensor starts at a multiple of this many bytes in a flat buffer: a view of a dtype needs its storage offset
#: to be a multiple of the element size (a 3-element bf16 tensor before an fp32 one would leave it at byte 6).
ALIGN = 64

Spec = tuple[str, tuple[int, ...], str]


def layout(specs: list[Spec]) -> tuple[list[tuple[int, int]], int]:
    """((byte offset, byte count) of each tensor, total bytes) of a flat buffer: both sides compute it from the
    specs alone, so nothing but the specs travels."""
    out, offset = [], 0
    for _, shape, dtype in specs:
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        out.append((offset, n))
        offset = -(-(offset + n) // ALIGN) * ALIGN
    return out, (out[-1][0] + out[-1][1]) if out else 0


def flatten(bucket: Bucket, device: torch.device | str) -> tuple[Tensor, list[Spec]]:
    """One uint8 buffer holding every tensor's bytes (each at its `layout` offset), and the (name, shape, dtype)
    list to cut it again."""
    specs = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in bucket]
    places, total = layout(specs)
    flat = torch.zeros(total, dtype=torch.uint8, device=device)
    for (_, t), (offset, n) in zip(bucket, places):
        flat[offset : offset + n] = t.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
    return flat, specs


def unflatten(buffer: Tensor, specs: list[Spec]) -> Bucket:
    """Inverse of `flatten` (views into `buffer`)."""
    places, _ = layout(specs)
    return [
        (name, buffer[offset : offset + n].view(getattr(torch, dtype)).view(shape))
        for (name, shape, dtype), (offset, n) in zip(specs, places)
    ]


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
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, nccl_options(dist, timeout))
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

    def close(self) -> None:
        """Abort the group and let go of its rendezvous store (on rank 0, the port it listens on): a group being
        replaced by a new rendezvous (after a failed sync, a restarted engine). Idempotent; a later broadcast
        raises. Abort, not a graceful shutdown: a member of a group being replaced may never come back, and NCCL's
        shutdown waits for its pending collectives. The references are dropped even if the abort raises, which is
        then raised (`discard` logs it instead)."""
        pg, self.pg, self._store = self.pg, None, None
        abort = getattr(pg, "abort", None)
        if callable(abort):
            abort()

    def broadcast(self, t: Tensor) -> None:
        if self.pg is None:
            raise RuntimeError("this weight-sync group was closed (a new rendezvous replaced it)")
        self.pg.broadcast(t, 0).wait()

    # The stream of one sync, as rank 0 broadcasts it: per bucket a length (int64), the pickled specs, the flat
    # buffer; then a length of 0 (the end). A negative length -k ends it early: k bytes of the sender's error follow.
    def send(self, bucket: Bucket | None) -> None:
        """Rank 0: header (pickled specs; length 0 ends the sync) then the flat buffer. What can fail here before
        anything is broadcast (flattening, pickling) does, so the receivers are still between buckets then."""
        if bucket is None:
            self.broadcast(torch.zeros(1, dtype=torch.int64, device=self.device))
            return
        self._send_packed(*self._pack(bucket))

    def _pack(self, bucket: Bucket) -> tuple[Tensor, Tensor]:
        """(pickled specs, flat buffer) of a bucket, on the group's device."""
        flat, specs = flatten(bucket, self.device)
        return torch.frombuffer(bytearray(pickle.dumps(specs)), dtype=torch.uint8).to(self.device), flat

    def _send_packed(self, header: Tensor, flat: Tensor) -> None:
        self.broadcast(torch.tensor([header.numel()], dtype=torch.int64, device=self.device))
        self.broadcast(header)
        self.broadcast(flat)

    def send_abort(self, reason: str) -> None:
        """Rank 0, between buckets: end the sync early; every receiver raises `SyncAbortedError` quoting `reason`."""
        text = torch.frombuffer(bytearray((reason or "unknown error").encode()[:65536]), dtype=torch.uint8)
        self.broadcast(torch.tensor([-text.numel()], dtype=torch.int64, device=self.device))
        self.broadcast(text.to(self.device))

    def send_all(self, bucket_iter: Iterable[Bucket]) -> dict[str, int]:
        """Rank 0: one whole sync (every bucket, then the end); {"bytes", "tensors", "buckets"} sent.

        If producing a bucket fails (the engine's weight iterator, a cast, flattening), the receivers are told
        (`send_abort`) before the error is raised: they raise at once instead of waiting in a broadcast for the
        group's timeout. A broadcast that fails (a receiver died) is raised as it is: the stream's place is unknown
        then, and the receivers see the broken connection or time out.

        After any failure but the iterator's own, the rest of `bucket_iter` is produced (and dropped) before the
        error is raised: on a sharded trainer it is a collective (every rank iterates, TrainWorker.send_weights_dist),
        and the other ranks would otherwise wait in its next all-gather for their group's timeout, so the sync that
        WeightSync redoes after a restarted receiver could never run."""
        nbytes = ntensors = nbuckets = 0
        it = iter(bucket_iter)
        while True:
            try:
                bucket = next(it, None)
            except BaseException as exc:  # the iterator itself failed: nothing is left to produce
                self._abort(exc)
                raise
            if bucket is None:
                break
            try:
                packed = self._pack(bucket)  # before any broadcast: a failure here leaves the stream whole
            except BaseException as exc:
                self._abort(exc)
                if isinstance(exc, Exception):  # an interrupt is not waited for
                    _drain(it)
                raise
            try:
                self._send_packed(*packed)
            except Exception:
                _drain(it)
                raise
            nbytes += bucket_nbytes(bucket)
            ntensors += len(bucket)
            nbuckets += 1
        self.send(None)
        return {"bytes": nbytes, "tensors": ntensors, "buckets": nbuckets}

    def _abort(self, exc: BaseException) -> None:
        try:
            self.send_abort(f"{type(exc).__name__}: {exc}")
        except Exception:  # the receivers then time out; the sender's error is the one to raise
            log.exception("weight sync: the receivers could not be told that the sync failed")

    def receive(self) -> Bucket | None:
        """Ranks > 0: the next bucket, or None at the end of a sync; `SyncAbortedError` if the sender gave up."""
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(n)
        size = int(n.item())
        if size == 0:
            return None
        if size < 0:
            text = torch.empty(-size, dtype=torch.uint8, device=self.device)
            self.broadcast(text)
            reason = text.cpu().numpy().tobytes().decode(errors="replace")
            raise SyncAbortedError(f"the trainer's weight sync failed before it ended: {reason}")
        header = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.broadcast(header)
        specs = pickle.loads(header.cpu().numpy().tobytes())
        flat = torch.empty(layout(specs)[1], dtype=torch.uint8, device=self.device)
        self.broadcast(flat)
        return unflatten(flat, specs)

    def receive_all(self, apply: Callable[[Bucket], int]) -> int:
        """Ranks > 0: `apply` each bucket of one sync; the sum of its results. After `apply` raises, the rest of the
        sync is still received (and dropped) and the error raised at its end: rank 0 never waits in a broadcast that
        nobody receives (it did for the group's timeout, 10 minutes, and then failed with gloo's timeout, which
        hid the receiver's error). A sync the sender ended early raises `SyncAbortedError` (chained to `apply`'s
        error, if there was one); the buckets applied before stay applied."""
        total, error = 0, None
        while True:
            try:
                bucket = self.receive()
            except SyncAbortedError as aborted:
                raise aborted from error
            if bucket is None:
                break
            if error is None:
                try:
                    total += apply(bucket)
                except Exception as exc:
                    error = exc
        if error is not None:
            raise error
        return total


def discard(group: SyncGroup | None) -> None:
    """Close `group` (if any) without raising: what a role does with its old group before a new rendezvous. A
    failure to close is logged, never raised: it must not keep the new group from being built."""
    if group is None:
        return
    try:
        group.close()
    except Exception:
        log.warning("weight sync: the previous sync group could not be closed; building the new one", exc_info=True)


def nccl_options(dist: Any, timeout: datetime.timedelta) -> Any:
    """ProcessGroupNCCL options carrying `timeout`. Without them NCCL's group waits its own default (10 minutes in
    torch 2.x) whatever the sync's timeout, so `infer_engine.sync_timeout_s` only bounded gloo."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout  # what torch's own new_group sets (distributed_c10d._new_process_group_helper)
    return options


def _drain(it: Iterator[Bucket]) -> None:
    """Produce and drop what is left of a failed sync's buckets (keeps a sharded trainer's ranks in step)."""
    try:
        for _ in it:
            pass
    except Exception:  # the error that ended the sync is the one to raise
        log.exception("weight sync: the rest of a failed sync's weights could not be produced")


# ---- CUDA IPC ------------------------------------------------------------------------------------------------
def share_cuda(bucket: Bucket) -> tuple[Any, list[Spec], Tensor]:
    """(IPC handle of one flat device buffer, specs, the buffer to keep alive until the receiver copied it)."""
    from torch.multiprocessing.reductions import reduce_tensor

    flat, specs = flatten(bucket, bucket[0][1].device)
    return reduce_tensor(flat), specs, flat


def open_cuda(handle: Any, specs: list[Spec]) -> Bucket:
    """Rebuild a shared bucket in the receiving process (same device, other process)."""
    rebuild, args = handle
    return unflatten(rebuild(*args), specs)
