"""Weight buckets crossing into another process (roll_engines.infer._bucket_channel), and the trainer's cast to the
engines' dtype before bucketing (roll_core.cluster.weight_sync): what vLLM's worker processes receive on every GPU
run, exercised here with host shared memory (the CPU transport; the CUDA IPC buffer is the device-marked twin)."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time

import pytest
import torch

from roll_engines.infer._bucket_channel import (
    BucketSender,
    ChannelError,
    SenderTimeout,
    SyncAborted,
    layout,
    receive_buckets,
)


def _receiver(address: str, authkey: bytes, out, stop_after: int | None) -> None:
    got = []
    for i, (name, t) in enumerate(receive_buckets(address, authkey)):
        got.append((name, str(t.dtype), t.double().tolist()))  # plain data: the queue outlives nothing shared
        if stop_after is not None and i + 1 == stop_after:
            os._exit(3)  # a worker process that dies mid-sync
    out.put(got)


def _named(n: int = 7) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    named = [(f"layer{i}.weight", torch.randn(64, 33 + i, generator=g)) for i in range(n)]
    return [*named, ("position_ids", torch.arange(10))]  # integer tensors keep their dtype


def test_buckets_cross_processes_in_the_engines_dtype() -> None:
    ctx = mp.get_context("spawn")
    named = _named()
    parts = [named[:3], named[3:5], named[5:]]
    sender = BucketSender(1, "cpu", torch.bfloat16, timeout_s=120)
    out = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(sender.address, sender.authkey, out, None))
    proc.start()
    try:
        sent = [sender.send(parts[0])]
        path = sender._handle[1]
        assert sender._shm_path is None and not os.path.exists(path)  # gone once the receiver mapped it
        sent += [sender.send(p) for p in parts[1:]]
    finally:
        sender.close()
    got = out.get(timeout=120)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert [n for n, _, _ in got] == [n for n, _ in named]
    for (_, dtype, values), (_, ref) in zip(got, named):
        expected = ref.to(torch.bfloat16) if ref.is_floating_point() else ref
        assert dtype == str(expected.dtype)
        assert torch.equal(torch.tensor(values, dtype=torch.float64), expected.double())
    # Each bucket crossed in bf16 (half of fp32's bytes for the float tensors) through one reused buffer that holds
    # the largest bucket, not the model.
    assert sent == [sum(t.numel() * (2 if t.is_floating_point() else 8) for _, t in p) for p in parts]
    assert sender.dtypes == {"bfloat16", "int64"}
    assert sender.peak_buffer_bytes == max(layout(p, torch.bfloat16)[1] for p in parts)
    assert sender.peak_buffer_bytes < sum(t.numel() * t.element_size() for _, t in named) / 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the abstract socket namespace is Linux's")
def test_the_channel_socket_leaves_no_file_behind(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The listener's socket was a file in a `pymp-*` folder of /tmp: a killed engine or trainer (no close, no
    exit handler) left one folder per sync there. It is an abstract socket now: no file at all."""
    import multiprocessing.process
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where multiprocessing would make its pymp-* folder
    monkeypatch.setitem(multiprocessing.process.current_process()._config, "tempdir", None)
    sender = BucketSender(1, "cpu", None, timeout_s=30)
    try:
        assert sender.address.startswith("\0roll-bucket-")
        assert list(tmp_path.iterdir()) == []
    finally:
        sender.close(ok=False)


def test_a_receiver_that_dies_fails_the_sync_instead_of_hanging() -> None:
    ctx = mp.get_context("spawn")
    named = _named()
    sender = BucketSender(1, "cpu", None, timeout_s=120)
    out = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(sender.address, sender.authkey, out, 2))
    proc.start()
    try:
        with pytest.raises(ChannelError, match=r"closed its connection|stopped"):
            for i in range(0, len(named), 2):
                sender.send(named[i : i + 2])
    finally:
        sender.close(ok=False)
        proc.join(timeout=60)
    assert proc.exitcode == 3


def test_a_sync_ended_before_its_receivers_connected_leaves_no_accepting_thread() -> None:
    """A sync that fails before every receiver connected (a worker failed first): its accepting thread stayed
    blocked in accept() (closing the socket does not wake it on Linux), one thread per such sync."""

    def accepting() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "roll-bucket-accept"]

    before = set(accepting())
    sender = BucketSender(2, "cpu", None, timeout_s=5)
    (mine,) = set(accepting()) - before
    sender.close(ok=False)
    mine.join(timeout=60)
    assert not mine.is_alive()


def test_an_aborted_sync_raises_in_the_receiver() -> None:
    """`close(ok=False)` after some buckets: the receiver's stream raises SyncAborted (vLLM's worker then undoes
    what it loaded), where it used to break with a bare EOFError, as if the sender had died."""
    sender = BucketSender(1, "cpu", None, timeout_s=60)
    got: list[str] = []
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            got.extend(name for name, _ in receive_buckets(sender.address, sender.authkey))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    try:
        sender.send(_named(2)[:2])
    finally:
        sender.close(ok=False)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert [type(e) for e in errors] == [SyncAborted]


def test_a_failed_loader_call_stops_the_sender() -> None:
    """The workers' RPC failed before any of them connected: the sender raises instead of waiting forever."""

    def dead() -> bool:
        raise RuntimeError("roll_load_weights raised in the worker")

    sender = BucketSender(2, "cpu", None, alive=dead, timeout_s=120)
    try:
        with pytest.raises(RuntimeError, match="raised in the worker"):
            sender.send(_named(2))
    finally:
        sender.close(ok=False)


def test_weight_sync_casts_to_the_engines_dtype_before_bucketing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 inference engine receives bf16 buckets (the trainer's fp32 master weights never travel), and the
    engine then holds exactly the cast trainer weights."""
    from roll_core.cluster.roles import InferGroup, InferWorker, TrainGroup, TrainWorker
    from roll_core.cluster.weight_sync import WeightSync
    from roll_core.models import resolve_model_path
    from roll_engines.config import HFInferEngineConfig, HFTrainEngineConfig
    from roll_hw.cpu import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "supports_bf16", classmethod(lambda cls: True))  # whatever this CPU has
    path = resolve_model_path("builtin:tiny")
    train = TrainGroup(
        TrainWorker, 1, "local", engine=vars(HFTrainEngineConfig()), runtime={"model_path": path, "lr": 1e-3}
    )
    infer = InferGroup(
        InferWorker,
        1,
        "local",
        engine=vars(HFInferEngineConfig()),
        runtime={"model_path": path, "max_new_tokens": 4, "dtype": "bfloat16"},
    )
    try:
        engine = infer.workers[0].engine
        seen: list[torch.dtype] = []
        original = engine.update_weights

        def record(bucket):
            bucket = list(bucket)
            seen.extend(t.dtype for _, t in bucket)
            return original(bucket)

        engine.update_weights = record
        sync = WeightSync(train, infer, transport="auto", bucket_mb=0.05, placement="colocated", platform=CpuPlatform)
        assert sync.dtype == "bfloat16"
        stats = sync.sync()
        weights = train.get_weights()
        floats = [v for v in weights.values() if v.is_floating_point()]
        assert seen and set(seen) == {torch.bfloat16}
        assert stats.bytes == sum(v.numel() * 2 for v in floats) + sum(
            v.numel() * v.element_size() for v in weights.values() if not v.is_floating_point()
        )
        held = dict(engine.model.named_parameters())
        for name, p in held.items():
            if name in weights:
                assert torch.equal(p.detach(), weights[name].to(torch.bfloat16)), name
    finally:
        train.shutdown()
        infer.shutdown()


class _ClosedByPeer:
    """A receiver's connection whose other end is gone: writing to it raises EPIPE, as the socket does once the
    receiver process closed it (the vLLM undo test met it when a rejected bucket stopped the worker's reload)."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def send(self, obj) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def __getattr__(self, name: str):
        return getattr(self.conn, name)


def test_a_receiver_gone_before_a_bucket_is_sent_fails_the_sync_naming_it() -> None:
    """The next bucket's announcement to a receiver that already closed its connection raised a bare
    BrokenPipeError ("[Errno 32] Broken pipe"); it is the channel's error naming what happened, as a reply lost is."""
    ctx = mp.get_context("spawn")
    named = _named(4)
    sender = BucketSender(1, "cpu", None, timeout_s=120)
    out = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(sender.address, sender.authkey, out, None))
    proc.start()
    try:
        sender.send(named[:2])  # connected and acknowledged
        sender._conns = [_ClosedByPeer(c) for c in sender._conns]
        with pytest.raises(ChannelError, match=r"closed its connection mid-sync \(\[Errno 32\] Broken pipe\)"):
            sender.send(named[2:])
    finally:
        sender.close(ok=False)
        proc.join(timeout=60)


def test_a_receiver_dead_at_the_end_costs_the_others_nothing_and_is_named() -> None:
    """close(ok=True) with receiver 0 gone (its reload stopped after the last bucket): the raw BrokenPipeError of
    its `send(None)` stopped the loop, so receiver 1 never got the end, read EOF and failed a complete sync."""
    sender = BucketSender(2, "cpu", None, timeout_s=60)
    named = _named(2)
    got: list[list[str]] = [[], []]
    errors: list[list[BaseException]] = [[], []]

    def receive(i: int) -> None:
        stream = receive_buckets(sender.address, sender.authkey, timeout_s=60)
        try:
            for name, _ in stream:
                got[i].append(name)
                if i == 0 and len(got[i]) == len(named):  # the whole bucket acknowledged: then this worker stops
                    break
        except BaseException as exc:
            errors[i].append(exc)
        finally:
            stream.close()

    first = threading.Thread(target=receive, args=(0,), daemon=True)
    first.start()
    deadline = time.monotonic() + 60  # receiver 0 connects first: the connection order is the one the error names
    while not sender._conns:
        assert time.monotonic() < deadline, "receiver 0 never connected"
        time.sleep(0.01)
    second = threading.Thread(target=receive, args=(1,), daemon=True)
    second.start()
    sender.send(named)
    first.join(timeout=30)
    assert not first.is_alive()
    with pytest.raises(ChannelError, match=r"1 weight receiver\(s\) closed .*: receiver 0 of 2 \(connection order\)"):
        sender.close(ok=True)
    second.join(timeout=30)
    assert not second.is_alive()
    assert errors == [[], []]
    assert got == [[n for n, _ in named]] * 2


def test_a_hung_sender_times_the_receiver_out_naming_the_bound() -> None:
    """A sender alive but silent (no next bucket, no end): `conn.recv()` had no bound and held vLLM's worker, and
    with it the engine, forever; now the receiver gives up after its timeout_s with an error naming it. (2 s: the
    bound runs from the receiver's connect, before the first bucket was sent; 0.5 s ran out there on a loaded
    machine.)"""
    sender = BucketSender(1, "cpu", None, timeout_s=60)
    errors: list[BaseException] = []
    got: list[str] = []

    def receive() -> None:
        try:
            got.extend(name for name, _ in receive_buckets(sender.address, sender.authkey, timeout_s=2))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    try:
        sender.send(_named(2))  # then the sender hangs: nothing more for the receiver
        thread.join(timeout=60)
        assert not thread.is_alive()
    finally:
        sender.close(ok=False)
    assert got == [n for n, _ in _named(2)]
    assert [type(e) for e in errors] == [SenderTimeout]
    assert "nothing from the sender for 2s after 1 bucket(s)" in str(errors[0])
    assert "timeout_s" in str(errors[0]) and "infer_engine.sync_timeout_s" in str(errors[0])


_SMALL_SHM = r"""
import sys, threading, torch
from roll_engines.infer._bucket_channel import BucketSender, receive_buckets
weight = torch.arange(1024 * 1024, dtype=torch.float32)  # 4 MiB: more than the 1 MiB /dev/shm (Docker's: 64 MiB)
sender = BucketSender(1, "cpu", None, timeout_s=60)
got = []
thread = threading.Thread(target=lambda: got.extend(receive_buckets(sender.address, sender.authkey)), daemon=True)
thread.start()
try:
    sender.send([("embed.weight", weight)])
    print("staged in", sender._handle[1], flush=True)
except RuntimeError as exc:
    print("refused:", exc, flush=True)
finally:
    sender.close(ok=True)
thread.join(30)
print("received", len(got), bool(got) and torch.equal(got[0][1], weight), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a private /dev/shm needs Linux namespaces")
@pytest.mark.parametrize("tmp_room", ["disk", "none", "readonly"])
def test_a_dev_shm_too_small_for_the_staging_buffer_is_no_crash(tmp_path, tmp_room: str) -> None:
    """The CPU staging buffer was a sparse file in /dev/shm: one larger than the room there (a Docker container's
    64 MiB and an embedding of hundreds) killed the engine with SIGBUS at the first write past it, with no word of
    why. Its blocks are reserved now: it is staged in the temp folder instead (`disk`), or, with no room there either
    (`none`), the send raises an error naming the size and what to do. A /dev/shm that cannot be written at all
    (`readonly`) raised a bare OSError from the open; it is staged in the temp folder too. Run in a private mount
    namespace whose /dev/shm is a 1 MiB tmpfs (`unshare`; skipped where that is not allowed)."""
    import shutil
    import subprocess

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-Urm", "true"]).returncode != 0:
        pytest.skip("no unprivileged mount namespace here")
    small = tmp_path / "small"
    small.mkdir()
    script = tmp_path / "stage.py"
    script.write_text(_SMALL_SHM)
    mounts = f"mount -t tmpfs -o {'ro,' if tmp_room == 'readonly' else ''}size=1m tmpfs /dev/shm"
    if tmp_room == "none":
        mounts += f" && mount -t tmpfs -o size=1m tmpfs {small}"
    env = {**os.environ, "TMPDIR": str(small if tmp_room == "none" else tmp_path)}
    done = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", f'{mounts} && exec "$0" "$1"', sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])  # -7 / 135: SIGBUS
    if tmp_room != "none":
        assert f"staged in {tmp_path}" in done.stdout and "received 1 True" in done.stdout, done.stdout
        assert "no room for a 4194304-byte staging buffer in ['/dev/shm" in done.stderr, done.stderr[-2000:]
        reason = "Read-only file system" if tmp_room == "readonly" else "No space left on device"
        assert f"/dev/shm ({reason})" in done.stderr, done.stderr[-2000:]
    else:
        assert "refused: weight sync: no room for a staging buffer of 4194304 bytes" in done.stdout, done.stdout
        assert "--shm-size" in done.stdout
    assert not list(small.iterdir()) and not list(tmp_path.glob("roll-weights-*"))  # nothing left behind


# ---- leftovers of killed processes in /dev/shm ----------------------------------------------------------------
def _dead_pid() -> int:
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: its pid names no process (until reused, which would only keep its files)
    return proc.pid


def _ns() -> str:
    return str(os.stat("/proc/self/ns/pid").st_ino)


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="pid namespaces are told apart through /proc")
def test_a_new_staging_file_removes_those_of_dead_processes_only(tmp_path, caplog) -> None:
    """A process killed mid-sync (its close never ran) left its staging file in /dev/shm, RAM for as long as the node
    runs. Creating a new one removes those of dead pids of this pid namespace and user; never a live process's (pid 1:
    alive, or PermissionError), another namespace's (a container sharing /dev/shm), a LoRA folder or a foreign name."""
    import logging

    from roll_engines.infer import _bucket_channel as channel

    dead, ns = _dead_pid(), _ns()
    (tmp_path / f"roll-weights-{dead}-{ns}-aaaaaaaaaaaa").write_bytes(b"x" * 1000)
    (tmp_path / f"roll-weights-{dead}-{ns}-bbbbbbbbbbbb").write_bytes(b"x" * 24)
    keep = [
        f"roll-weights-{os.getpid()}-{ns}-cccccccccccc",  # this process
        f"roll-weights-1-{ns}-dddddddddddd",  # alive (PermissionError where not root)
        f"roll-weights-{dead}-{int(ns) + 1}-eeeeeeeeeeee",  # another pid namespace: its pid may be alive there
        f"roll-weights-{dead}-ffffffffffff",  # no namespace in the name: not one this sweep can judge
        f"roll-lora-{dead}-{ns}-vllm-x",  # another kind
        f"pymp-{dead}-{ns}-x",
    ]
    for name in keep:
        (tmp_path / name).write_bytes(b"y")
    with caplog.at_level(logging.WARNING, logger=channel.__name__):
        path = channel._shared_file(64, [str(tmp_path)])
    assert os.path.basename(path).startswith(f"roll-weights-{os.getpid()}-{ns}-") and os.path.getsize(path) == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*keep, os.path.basename(path)])
    assert f"removed 2 leftover roll-weights entries of dead processes (1024 bytes) from {tmp_path}" in caplog.text
    caplog.clear()
    assert channel.remove_dead_leftovers(str(tmp_path), "weights") == (0, 0) and caplog.text == ""


def test_a_vllm_shutdown_closes_the_channel_of_an_unfinished_sync(tmp_path, monkeypatch) -> None:
    """A sync whose caller failed between begin and finish left its sender open: the staging file stayed in /dev/shm
    after the engine shut down (and its workers' stream waited out its timeout). The engine is built without vLLM:
    shutdown needs only its driver thread and tables."""
    import queue

    from roll_engines.infer import _bucket_channel as channel
    from roll_engines.infer._vllm_requests import RequestTable
    from roll_engines.infer.vllm import VLLMInferEngine

    shared_file = channel._shared_file
    monkeypatch.setattr(channel, "_shared_file", lambda nbytes: shared_file(nbytes, [str(tmp_path)]))
    engine = VLLMInferEngine.__new__(VLLMInferEngine)
    engine.name, engine._queueing, engine._stopped, engine._jobs = "vllm", threading.Lock(), False, queue.Queue()
    engine._driver = threading.Thread(target=lambda: engine._jobs.get())  # takes the stop job
    engine._driver.start()
    engine._deferred, engine._pending, engine._adapters = [], RequestTable("vllm"), None
    engine.llm = engine.engine = object()
    engine._sender = sender = BucketSender(1, "cpu", torch.bfloat16, timeout_s=5)
    sender._reserve(64)  # the staging buffer of the sync's first bucket
    assert [p.name for p in tmp_path.glob("roll-weights-*")] == [os.path.basename(sender._shm_path)]
    engine.shutdown()
    assert list(tmp_path.iterdir()) == [] and engine._sender is None and sender._listener._listener is None
    assert not engine._driver.is_alive()


# ---- a sender killed mid-sync, roll's old naming, every folder swept ------------------------------------------
def _killed_sender(folder: str, out) -> None:
    from roll_engines.infer import _bucket_channel as channel

    shared_file = channel._shared_file
    channel._shared_file = lambda nbytes: shared_file(nbytes, [folder])
    sender = BucketSender(1, "cpu", torch.bfloat16, timeout_s=120)
    out.put((sender.address, sender.authkey))
    sender.send(_named(3))
    out.put("acknowledged")
    threading.Event().wait(120)  # SIGKILLed here, mid-sync: no close, no exit handler


def _recording_receiver(address: str, authkey: bytes, out) -> None:
    try:
        for name, _ in receive_buckets(address, authkey, timeout_s=120):
            out.put(name)
    except BaseException as exc:
        out.put(type(exc).__name__)
    out.put(None)


def test_an_engine_killed_mid_sync_leaves_no_staging_file(tmp_path) -> None:
    """The staging file stayed named until the sync closed: an engine (the sender's process) SIGKILLed mid-sync
    left it in /dev/shm until a later sync of the same user and pid namespace came to sweep it, for ever where none
    came. It is unlinked once every receiver mapped it (acknowledged its first bucket), so the kill leaves nothing;
    the receiver still got the bucket, and its stream then fails (the sender is gone)."""
    import signal

    ctx = mp.get_context("spawn")
    out, got = ctx.Queue(), ctx.Queue()
    sender = ctx.Process(target=_killed_sender, args=(str(tmp_path), out))
    sender.start()
    receiver = None
    try:
        address, authkey = out.get(timeout=120)
        receiver = ctx.Process(target=_recording_receiver, args=(address, authkey, got))
        receiver.start()
        assert out.get(timeout=120) == "acknowledged"
        os.kill(sender.pid, signal.SIGKILL)
        sender.join(timeout=60)
        assert sender.exitcode == -signal.SIGKILL
        names = [got.get(timeout=120) for _ in range(len(_named(3)) + 2)]
        assert names == [n for n, _ in _named(3)] + ["EOFError", None]
        assert list(tmp_path.iterdir()) == []
    finally:
        for proc in (sender, receiver):
            if proc is not None and proc.is_alive():
                proc.kill()
            if proc is not None:
                proc.join(timeout=60)
        for leftover in tmp_path.glob("roll-weights-*"):  # on a failure: no file of this test stays behind
            leftover.unlink()


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="pid namespaces are told apart through /proc")
def test_staging_files_of_roll_s_old_naming_are_removed_once_an_hour_old(tmp_path, caplog) -> None:
    """Roll named its staging files `roll-weights-<pid>-<12 hex>` before they carried the pid namespace, and the
    sweep judged only the new names: those that killed engines left (one was in this machine's /dev/shm, 15 h
    old) stayed for ever. A dead pid's one, of this user, an hour old or more goes; a younger one (its pid may live in
    another pid namespace, mid-sync), a live pid's, another user's and near-miss names stay."""
    import logging

    from roll_engines.infer import _bucket_channel as channel

    dead = _dead_pid()
    old = time.time() - 2 * 3600  # two hours

    def make(name: str, age: float | None = old, size: int = 10) -> None:
        path = tmp_path / name
        path.write_bytes(b"x" * size)
        if age is not None:
            os.utime(path, (age, age))

    make(f"roll-weights-{dead}-0123456789ab", size=1000)
    keep = [
        f"roll-weights-{dead}-ba9876543210",  # young: maybe a live sync of another pid namespace
        f"roll-weights-{os.getpid()}-cccccccccccc",  # alive here
        f"roll-weights-{dead}-dddddddddddd-x",  # not the old naming
        f"roll-weights-{dead}-eeeeeeeeeee",  # 11 hex digits
    ]
    make(keep[0], age=None)
    for name in keep[1:]:
        make(name)
    if os.getuid() == 0:  # only root can give a file to another user
        keep.append(f"roll-weights-{dead}-ffffffffffff")
        make(keep[-1])
        os.chown(tmp_path / keep[-1], 12345, -1)
        os.utime(tmp_path / keep[-1], (old, old))
    with caplog.at_level(logging.WARNING, logger=channel.__name__):
        assert channel.remove_dead_leftovers(str(tmp_path), "weights") == (1, 1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep)
    assert "removed 1 leftover roll-weights entry of dead processes (1000 bytes)" in caplog.text
    assert channel.remove_dead_leftovers(str(tmp_path), "lora") == (0, 0)  # LoRA folders never had this naming


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="pid namespaces are told apart through /proc")
def test_a_new_staging_file_sweeps_every_folder_it_may_go_to(tmp_path) -> None:
    """Leftovers were swept only in the folders tried: one a killed engine left in the temp folder (staged there when
    /dev/shm was full) stayed as long as /dev/shm had room for the next staging files."""
    from roll_engines.infer import _bucket_channel as channel

    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    (tmp / f"roll-weights-{_dead_pid()}-{_ns()}-aaaaaaaaaaaa").write_bytes(b"x" * 10)
    path = channel._shared_file(64, [str(shm), str(tmp)])
    try:
        assert os.path.dirname(path) == str(shm)
        assert list(tmp.iterdir()) == []
    finally:
        os.unlink(path)
