"""Weight buckets from an engine adapter's process into the processes that hold the model (vLLM's workers).

On a GPU, vLLM runs its engine core (and with tensor parallel, one worker per device) in processes of its own, and
`collective_rpc` serialises its arguments with msgpack: tensors cannot be handed over as Python objects (an iterator
of them cannot be serialised at all). So the adapter passes only an address through `collective_rpc`, and the
workers pull the buckets through this channel, one at a time:

- `BucketSender` (adapter side) owns one staging buffer of the largest bucket seen, never the whole model: host
  shared memory (a file under /dev/shm that both processes map; the temp folder where /dev/shm has no room for it:
  `_shared_file`) on CPU, a device buffer shared through a CUDA IPC
  handle on GPUs. Each bucket is cast to the engine's dtype as it is copied in (the trainer's fp32 never crosses,
  except for the weights the model keeps wider: `wide`),
  announced to every receiver over a local socket (`multiprocessing.connection`, pickled specs only), and the
  buffer is reused only after every receiver acknowledged that it copied the bucket out.
- `receive_buckets` (worker side) is a generator of (name, tensor) over the whole sync: it clones each bucket into
  memory the worker owns (vLLM's layer-wise reload keeps references until a layer is complete, and the sender
  overwrites the buffer), synchronises the device before acknowledging (the copies are asynchronous on CUDA), and
  ends when the sender closes the sync. Fed to vLLM's `reload_weights(weights_iterator=...)`, the whole sync is one
  reload, so fused groups (q/k/v, gate/up) split across buckets still load together.

`BucketSender.close()` ends the sync for the receivers: `ok=True` ends their stream (the sync is complete),
`ok=False` makes it raise `SyncAborted` (the sync failed on the sending side: the receivers put back what it wrote,
roll_engines.infer._vllm_worker). Either way it releases the staging buffer, so nothing of the sync stays behind in
the adapter's process. A receiver found dead at `close(ok=True)` does not cost the others their end: all live ones
get it, then `ChannelError` names the dead ones. Neither side waits on the other unbounded (`TIMEOUT_S`).
A process killed mid-sync never closes, so the staging file leaves its folder as soon as every receiver mapped it
(unlinked once they acknowledged the first bucket staged in it; the mappings live on). One killed before that (named
with its pid and pid namespace) is removed when a later one is created, from every folder a staging file may go to
(`remove_dead_leftovers`, which LoRA adapter folders use too: roll_engines.infer._adapters), as are the files of roll
versions that named them by pid alone, once an hour old.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)
ALIGN = 64  # bytes: every tensor starts at an offset its dtype can be viewed at
#: Default bound of each side's wait for the other (the sender's for a connection or an acknowledgement, a
#: receiver's for the next message). infer_engine.sync_timeout_s has the same default but does not reach this
#: channel: it is a worker key (roll_core.cluster.engine_worker.WORKER_KEYS), never given to the vLLM engine.
TIMEOUT_S = 600.0
#: Age (seconds since last modified) from which a staging file of roll's old naming (pid, no pid namespace) whose pid
#: is dead here is removed: its pid may belong to a live process of another pid namespace, but no sync of the roll
#: versions that wrote it kept one file this long (one file lives one sync at most).
OLD_NAMING_AGE_S = 3600.0
Spec = tuple[str, tuple[int, ...], str, int]  # name, shape, dtype, byte offset into the buffer


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(
    named: Sequence[tuple[str, Tensor]], dtype: torch.dtype | None, wide: Mapping[str, str] | None = None
) -> tuple[list[Spec], int]:
    """Specs of a bucket as staged (floating tensors cast to `dtype`, those named in `wide` to the dtype it gives)
    and the bytes it needs."""
    specs, offset = [], 0
    for name, t in named:
        dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        if wide and name in wide and t.is_floating_point():
            dt = getattr(torch, wide[name])
        specs.append((name, tuple(t.shape), str(dt).removeprefix("torch."), offset))
        offset = _aligned(offset + t.numel() * torch.empty((), dtype=dt).element_size())
    return specs, offset


def views(buffer: Tensor, specs: Sequence[Spec]) -> list[tuple[str, Tensor]]:
    """(name, tensor) views into a uint8 `buffer` laid out by `layout`."""
    out = []
    for name, shape, dtype, offset in specs:
        dt = getattr(torch, dtype)
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
        out.append((name, buffer[offset : offset + n].view(dt).view(shape)))
    return out


def _socket_address() -> str | None:
    """Linux: a socket in the abstract namespace (no file; gone with its last holder). A path socket sits in a
    `pymp-*` folder of /tmp that a killed engine or trainer never removes: one per sync of a killed process."""
    return "\0roll-bucket-" + os.urandom(8).hex() if sys.platform.startswith("linux") else None


@functools.cache
def _pid_namespace() -> str | None:
    """This process's pid namespace (Linux: the inode of /proc/self/ns/pid; "0" where there are none), or None where
    it cannot be told (Linux without /proc). Containers that share /dev/shm (docker --ipc=host, the containers of a
    Kubernetes pod) have pid namespaces of their own: another's live process may have a pid that is dead here."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return None if sys.platform.startswith("linux") else "0"


def leftover_prefix(kind: str) -> str:
    """The start of the name of a shared-memory entry of `kind` ("weights": a staging file; "lora": an adapter
    folder) that this process creates: its pid and pid namespace, by which `remove_dead_leftovers` tells whose it is."""
    return f"roll-{kind}-{os.getpid()}-{_pid_namespace() or 0}-"


def _pid_alive(pid: int) -> bool:
    if pid <= 0:  # 0 and negatives signal process groups: never a pid roll wrote
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):  # PermissionError: it exists under another user
        return True
    return True


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def remove_dead_leftovers(folder: str, kind: str) -> tuple[int, int]:
    """Remove from `folder` the entries of `kind` (named by `leftover_prefix`) of dead processes: created in this pid
    namespace, by this user, by a pid that no longer runs. A process killed mid-sync (OOM killer, SIGKILL, a node
    agent) never ran its close, and /dev/shm is RAM that lives as long as the node: one staging buffer (the largest
    bucket) or adapter folder stayed there per killed process. Staging files of roll's old naming (`roll-weights-`,
    pid, 12 hex digits: no pid namespace) of a dead pid and this user go too, once `OLD_NAMING_AGE_S` old: nothing
    else ever removed them. Entries of live pids, of other pid namespaces or users, and any other name are kept.
    Returns (entries removed, their bytes), and logs them."""
    ns = _pid_namespace()
    if os.name == "nt" or ns is None:  # Windows: os.kill(pid, 0) would end the process; no namespace: cannot tell
        return 0, 0
    pattern = re.compile(rf"roll-{re.escape(kind)}-(\d+)-{ns}-")
    # roll's old staging-file naming: judged by age as well (OLD_NAMING_AGE_S)
    old = re.compile(r"roll-weights-(\d+)-[0-9a-f]{12}") if kind == "weights" else None
    removed = nbytes = 0
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0, 0
    now = time.time()
    for entry in entries:
        match, aged = pattern.match(entry.name), False
        if match is None and old is not None:
            match = old.fullmatch(entry.name)
            aged = match is not None
        if match is None or _pid_alive(int(match.group(1))):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if st.st_uid != os.getuid() or (aged and now - st.st_mtime < OLD_NAMING_AGE_S):
                continue
            if entry.is_dir(follow_symlinks=False):
                size = _tree_bytes(entry.path)
                shutil.rmtree(entry.path)
            else:
                size = st.st_size
                os.unlink(entry.path)
        except OSError:  # removed meanwhile by another process's sweep, or not ours to remove after all
            continue
        removed, nbytes = removed + 1, nbytes + size
    if removed:
        log.warning(
            "removed %d leftover roll-%s entr%s of dead processes (%d bytes) from %s",
            removed,
            kind,
            "y" if removed == 1 else "ies",
            nbytes,
            folder,
        )
    return removed, nbytes


def _shared_file(nbytes: int, folders: Sequence[str] | None = None) -> str:
    """A new file of `nbytes` to map as the staging buffer: in /dev/shm, else (no room there) the temp folder.

    Its blocks are allocated here (`posix_fallocate`): a sparse file (`truncate`) in a /dev/shm too small for it
    (Docker's default is 64 MiB; one embedding of a 0.5B model is 272 MiB) killed the engine with SIGBUS at the
    first write past the room. A file in the temp folder is shared through the page cache as well (slower); so is
    one where /dev/shm cannot be written (a read-only mount). The leftovers of killed processes in all those folders
    are removed first (`remove_dead_leftovers`): a file left in the temp folder stayed while /dev/shm had room."""
    if folders is None:
        folders = [f for f in ("/dev/shm",) if os.path.isdir(f)] + [tempfile.gettempdir()]
    for folder in folders:
        remove_dead_leftovers(folder, "weights")
    tried = []
    for folder in folders:
        path = os.path.join(folder, leftover_prefix("weights") + uuid.uuid4().hex[:12])
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT):
                raise
            tried.append(f"{folder} ({exc.strerror})")
            continue
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, nbytes)
            else:  # macOS: no way to reserve the blocks
                os.ftruncate(fd, nbytes)
        except OSError as exc:
            os.unlink(path)
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            tried.append(f"{folder} ({exc.strerror})")
            continue
        finally:
            os.close(fd)
        if tried:
            log.warning("weight sync: no room for a %d-byte staging buffer in %s; staged in %s", nbytes, tried, folder)
        return path
    raise RuntimeError(
        f"weight sync: no room for a staging buffer of {nbytes} bytes (the largest bucket, or a single tensor larger "
        f"than infer_engine.sync_bucket_mb) in {', '.join(tried)}: give the container more shared memory "
        "(docker run --shm-size) or free space there (or write access: the temp folder is TMPDIR)"
    )


class ChannelError(RuntimeError):
    """The receiving side stopped (its process died or its reload raised) before the sync ended."""


class SenderTimeout(TimeoutError):
    """Raised by `receive_buckets` when the sender sent nothing (next bucket, end or abort) within its timeout."""


class SyncAborted(Exception):
    """Raised by `receive_buckets` when the sender ended the sync as failed (`BucketSender.close(ok=False)`)."""


#: The message that aborts a sync (a bucket is a dict of buffer and specs; None ends a complete sync).
_ABORT = {"abort": True}


class BucketSender:
    """Adapter side of one weight sync to `receivers` processes (see module docstring).

    `alive()` is polled while waiting on receivers: it raises (or returns False) once the call that runs them has
    failed, so a receiver that died never leaves the sender waiting."""

    def __init__(
        self,
        receivers: int,
        device: torch.device | str,
        dtype: torch.dtype | None,
        alive: Callable[[], bool] = lambda: True,
        timeout_s: float = TIMEOUT_S,
        wide: Mapping[str, str] | None = None,
    ) -> None:
        self.receivers, self.device, self.dtype = receivers, torch.device(device), dtype
        self.wide = dict(wide or {})  # weights the model keeps wider than `dtype`: staged in theirs
        self._alive, self._timeout = alive, timeout_s
        self.authkey = os.urandom(16)
        address = _socket_address()
        self._listener = Listener(address=address, family="AF_UNIX", authkey=self.authkey)
        self.address: str = address or str(self._listener.address)  # (Listener gives an abstract one back as bytes)
        self._conns: list[Connection] = []
        self._lock = threading.Lock()  # `_conns` and `_closed` between the accepting thread and `close`
        self._closed = False
        self._accepted = threading.Event()
        self._accept_error: BaseException | None = None
        threading.Thread(target=self._accept, name="roll-bucket-accept", daemon=True).start()
        self._buffer: Tensor | None = None
        self._handle: Any = None
        self._shm_path: str | None = None
        self.peak_buffer_bytes = 0  # the largest staging buffer this sync allocated
        self.buckets = self.bytes = 0
        self.dtypes: set[str] = set()  # dtypes of what crossed (tests: the engine's dtype)

    # ---- connections --------------------------------------------------------------------------------------
    def _accept(self) -> None:
        try:
            while len(self._conns) < self.receivers:
                conn = self._listener.accept()
                with self._lock:
                    if self._closed:  # accepted after `close` took the list: its receiver must not wait forever
                        conn.close()
                        return
                    self._conns.append(conn)
        except BaseException as exc:  # the listener closed under us (a failed sync)
            self._accept_error = exc
        finally:
            self._accepted.set()

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self._timeout
        while not ready():
            if not self._alive():
                raise ChannelError(f"the weight receivers stopped while the sender waited for {what}")
            if time.monotonic() > deadline:
                raise ChannelError(f"no {what} from the weight receivers within {self._timeout:.0f}s")

    def _connected(self) -> None:
        self._wait(lambda: self._accepted.wait(0.05), "a connection")
        if self._accept_error is not None or len(self._conns) < self.receivers:
            raise ChannelError(f"{len(self._conns)} of {self.receivers} weight receivers connected")

    # ---- the staging buffer -------------------------------------------------------------------------------
    def _reserve(self, nbytes: int) -> None:
        if self._buffer is not None and self._buffer.numel() >= nbytes:
            return
        self._release()
        if self.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._handle = ("cuda_ipc", reduce_tensor(self._buffer))
        else:
            self._shm_path = _shared_file(nbytes)
            self._buffer = torch.from_file(self._shm_path, shared=True, size=nbytes, dtype=torch.uint8)
            self._handle = ("shm", self._shm_path, nbytes)
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, nbytes)

    def _release(self) -> None:
        self._buffer, self._handle = None, None
        self._unlink()

    def _unlink(self) -> None:
        """Remove the staging file's name; whoever maps it (this process, receivers) keeps the mapping until dropped."""
        if self._shm_path is not None:
            try:
                os.unlink(self._shm_path)
            except FileNotFoundError:
                pass
            self._shm_path = None

    # ---- the protocol -------------------------------------------------------------------------------------
    def send(self, named: Sequence[tuple[str, Tensor]]) -> int:
        """Stage one bucket (cast to the engine's dtype) and wait until every receiver copied it; its bytes."""
        if not named:
            return 0
        specs, nbytes = layout(named, self.dtype, self.wide)
        self._reserve(max(nbytes, 1))
        assert self._buffer is not None
        payload = 0
        with torch.no_grad():
            for (_, src), (_, dst) in zip(named, views(self._buffer, specs)):
                dst.copy_(src.detach().reshape(dst.shape))
                payload += dst.nbytes
        if self._buffer.is_cuda:  # the receivers read from another process: the copies must have landed
            torch.cuda.current_stream(self._buffer.device).synchronize()
        self._connected()
        for conn in self._conns:
            try:
                conn.send({"buffer": self._handle, "specs": specs})
            except OSError as exc:  # EPIPE, ECONNRESET: it stopped (its reload failed) before this bucket was sent
                raise ChannelError(f"a weight receiver closed its connection mid-sync ({exc})") from exc
        for conn in self._conns:
            self._wait(lambda c=conn: c.poll(0.05), "an acknowledgement")
            try:
                reply = conn.recv()
            except (EOFError, OSError) as exc:
                raise ChannelError(f"a weight receiver closed its connection mid-sync ({exc})") from exc
            if reply != "ok":
                raise ChannelError(f"a weight receiver failed: {reply}")
        # Every receiver mapped the buffer (it acknowledged a bucket it read there): its file need not outlive a
        # kill of this process now. Left named to the end of the sync, it stayed in /dev/shm for ever when the
        # engine was killed mid-sync (unless a later sync of this user and pid namespace came to sweep it).
        self._unlink()
        self.buckets += 1
        self.bytes += payload
        self.dtypes.update(d for _, _, d, _ in specs)
        return payload

    def close(self, ok: bool = True) -> None:
        """End the sync and release the staging buffer and the socket. `ok`: the sync is complete (the receivers'
        streams end); otherwise it failed and every connected receiver's stream raises `SyncAborted`."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        gone: list[str] = []
        try:
            if ok and self.buckets:
                # Every live receiver gets the end, whichever died: stopping at the first dead one left the others
                # to read EOF (their complete sync failed) and the caller with a bare BrokenPipeError.
                for i, conn in enumerate(conns):
                    try:
                        conn.send(None)
                    except OSError as exc:  # EPIPE, ECONNRESET: that receiver stopped (its reload failed)
                        gone.append(f"receiver {i} of {len(conns)} (connection order) ({exc})")
            elif not ok:
                for conn in conns:
                    try:
                        conn.send(_ABORT)
                    except OSError:  # that receiver already stopped (its reload failed): nothing to tell it
                        pass
        finally:
            for conn in conns:
                conn.close()
            # A receiver that never connected (its worker failed first) leaves the accepting thread in accept(), and
            # on Linux closing the socket from this thread does not wake it: one thread per such sync lived on. A
            # shutdown does (accept raises EINVAL).
            sock = getattr(getattr(self._listener, "_listener", None), "_socket", None)
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._listener.close()
            self._release()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        if gone:
            raise ChannelError(
                f"{len(gone)} weight receiver(s) closed their connection before the end of a complete sync: "
                f"{'; '.join(gone)}; the others got the end"
            )


def _open(handle: Any, cache: dict[Any, Tensor]) -> Tensor:
    key = handle[1] if handle[0] == "shm" else id(handle)
    if handle[0] == "shm":
        if key not in cache:
            cache.clear()  # the sender replaced its buffer: drop the old mapping
            cache[key] = torch.from_file(handle[1], shared=True, size=handle[2], dtype=torch.uint8)
        return cache[key]
    rebuild, args = handle[1]
    return rebuild(*args)


def receive_buckets(address: str, authkey: bytes, timeout_s: float = TIMEOUT_S) -> Iterator[tuple[str, Tensor]]:
    """Worker side: every (name, tensor) of one sync, in worker-owned memory (see module docstring); raises
    `SyncAborted` where the sender aborted the sync, and `SenderTimeout` where nothing came from it for `timeout_s`
    (a sender hung while alive held vLLM's worker, and with it the engine, forever)."""
    conn = Client(address, family="AF_UNIX", authkey=authkey)
    cache: dict[Any, Tensor] = {}

    def next_message() -> Any:
        if not conn.poll(timeout_s):
            raise SenderTimeout(
                f"weight sync: nothing from the sender for {timeout_s:g}s after {received} bucket(s) (its process "
                "hung, or its caller stopped between buckets without finishing or aborting the sync); the bound is "
                f"receive_buckets' timeout_s ({TIMEOUT_S:.0f}s by default, the default of infer_engine.sync_timeout_s, "
                "which does not reach this channel)"
            )
        return conn.recv()

    received = 0
    try:
        while (msg := next_message()) is not None:
            received += 1
            if "abort" in msg:
                raise SyncAborted("the sender aborted the weight sync")
            try:
                buffer = _open(msg["buffer"], cache)
                # Onto this worker's own device (under TP the buffer lives on the adapter's device, not every rank's).
                here = torch.device("cuda", torch.cuda.current_device()) if buffer.is_cuda else buffer.device
                owned = [(name, t.to(here, copy=True)) for name, t in views(buffer, msg["specs"])]
                if buffer.is_cuda:
                    torch.cuda.current_stream(buffer.device).synchronize()
                del buffer
            except Exception as exc:
                conn.send(f"{type(exc).__name__}: {exc}")
                raise
            conn.send("ok")
            yield from owned
            del owned
    finally:
        cache.clear()
        conn.close()
