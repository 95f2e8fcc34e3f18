"""The shared run folder check (roll_core.cluster.shared_fs) with fake node workers: a node "sees" the folder when
its worker reads the marker at the driver's path, and has its own disk when it reads the same path under another
root. The real Ray path runs in tests/e2e/test_multinode.py (every simulated node shares this machine's disk)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from roll_core.cluster import shared_fs
from roll_core.cluster.shared_fs import (
    MARKER_PREFIX,
    Probe,
    SharedFolderError,
    check_run_folder,
    check_shared_folder,
    nodes_to_probe,
    read_marker,
)
from roll_core.errors import ConfigError


def node_worker(root: Path, disk: Path, ip: str) -> Callable[[str, str], Callable[[], Mapping[str, str]]]:
    """A fake worker whose node mounts `disk` where the driver has `root` (disk == root: a shared filesystem)."""

    def submit(path: str, token: str) -> Callable[[], Mapping[str, str]]:
        local = disk / Path(path).relative_to(root)
        seen = {**read_marker(str(local), token, wait_s=0.0), "ip": ip}
        return lambda: seen

    return submit


def markers(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"{MARKER_PREFIX}*"))


def test_a_node_with_its_own_disk_fails_the_check_and_is_named(tmp_path: Path) -> None:
    run, elsewhere = tmp_path / "run", tmp_path / "node_b_disk"
    (elsewhere / "run").mkdir(parents=True)
    probes = [
        Probe("node-a", "actor_train rank 0", node_worker(tmp_path, tmp_path, "10.0.0.1")),
        Probe("node-b", "actor_train rank 1", node_worker(tmp_path, elsewhere, "10.0.0.2")),
    ]
    with pytest.raises(SharedFolderError) as info:
        check_shared_folder(run, probes)
    msg = str(info.value)
    assert isinstance(info.value, ConfigError)  # roll-train reports it in one line, no run restart
    bad = [line for line in msg.splitlines() if ": missing at " in line]
    assert len(bad) == 1 and "node node-b (10.0.0.2" in bad[0] and "actor_train rank 1" in bad[0]
    assert str(elsewhere / "run" / MARKER_PREFIX) in bad[0]  # the path that node looked at
    assert "1 of the 2 other node(s)" in msg and f"run folder {run} " in msg
    assert "seen by: node node-a (10.0.0.1" in msg
    assert "pipeline.output_dir" in msg and "NFS" in msg and "cluster.check_shared_fs=false" in msg
    assert markers(run) == [] and markers(elsewhere / "run") == []  # the marker is gone


def test_every_node_that_sees_the_marker_passes_and_the_marker_is_removed(tmp_path: Path) -> None:
    run = tmp_path / "run"  # not there yet: the check makes it
    probes = [Probe(f"node-{n}", f"rank {n}", node_worker(tmp_path, tmp_path, f"10.0.0.{n}")) for n in (1, 2)]
    views = check_shared_folder(run, probes)
    assert [(v.node_id, v.status, v.ip) for v in views] == [("node-1", "ok", "10.0.0.1"), ("node-2", "ok", "10.0.0.2")]
    assert all(Path(v.path).parent == run and Path(v.path).name.startswith(MARKER_PREFIX) for v in views)
    assert views[0].path == views[1].path
    assert run.is_dir() and markers(run) == []


def test_a_stale_copy_and_a_worker_that_does_not_answer_fail(tmp_path: Path) -> None:
    """A node whose disk holds a file of that name with another token (a stale copy), and one whose worker raises."""
    run, elsewhere = tmp_path / "run", tmp_path / "stale"

    def stale(path: str, token: str) -> Callable[[], Mapping[str, str]]:
        local = elsewhere / Path(path).relative_to(tmp_path)
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text("another run's token")
        return lambda: read_marker(str(local), token, wait_s=0.0)

    def dead(path: str, token: str) -> Callable[[], Mapping[str, str]]:
        def wait() -> Mapping[str, str]:
            raise TimeoutError("no answer in 120 s")

        return wait

    with pytest.raises(SharedFolderError) as info:
        check_shared_folder(run, [Probe("node-s", "critic rank 0", stale), Probe("node-d", "critic rank 1", dead)])
    msg = str(info.value)
    assert "node node-s (" in msg and ": different token at " in msg
    assert "node node-d (critic rank 1): no answer: TimeoutError: no answer in 120 s" in msg
    assert "2 of the 2 other node(s)" in msg and "seen by" not in msg
    assert markers(run) == []


def test_read_marker_looks_again_while_the_file_is_not_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A marker that shows up late (NFS attribute caches) is seen within wait_s; without it, `missing`."""
    marker = tmp_path / f"{MARKER_PREFIX}t"
    sleeps: list[float] = []

    def sleep(s: float) -> None:  # the file appears during the first pause
        sleeps.append(s)
        marker.write_text("t")

    monkeypatch.setattr(shared_fs.time, "sleep", sleep)
    assert read_marker(str(marker), "t", wait_s=30.0)["status"] == "ok" and len(sleeps) == 1
    assert read_marker(str(tmp_path / "nothing"), "t", wait_s=0.0)["status"] == "missing"


class FakeGroup:
    def __init__(self, name: str, backend: str, nodes: list[str], workers: list | None = None) -> None:
        self.name, self.backend, self.nodes = name, backend, nodes
        self.workers = workers or [None] * len(nodes)


def test_one_worker_per_node_other_than_the_drivers() -> None:
    train = FakeGroup("actor_train", "ray", ["head", "a", "a", "b"])
    critic = FakeGroup("critic", "ray", ["b", "c"])
    local = FakeGroup("local_role", "local", ["x"])
    found = nodes_to_probe([train, None, local, critic], "head")
    assert {n: (g.name, r) for n, (g, r) in found.items()} == {
        "a": ("actor_train", 1),
        "b": ("actor_train", 3),
        "c": ("critic", 1),
    }
    assert nodes_to_probe([FakeGroup("actor_train", "ray", ["head", "head"])], "head") == {}
    assert set(nodes_to_probe([train], None)) == {"head", "a", "b"}  # client mode: the driver's node is unknown


def test_pipeline_entry_checks_ray_writers_on_other_nodes_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run, elsewhere = tmp_path / "run", tmp_path / "disk_b"
    monkeypatch.setattr(shared_fs, "driver_node_id", lambda: "head")
    monkeypatch.setattr(shared_fs, "ray_probe", lambda worker, timeout_s, wait_s: worker)  # fake workers read
    shared = node_worker(tmp_path, tmp_path, "10.0.0.1")
    own_disk = node_worker(tmp_path, elsewhere, "10.0.0.2")

    # Local backend, or every writer on the driver's node: nothing written, nothing asked.
    assert check_run_folder(run, [FakeGroup("actor_train", "local", ["local"]), None]) is None
    assert check_run_folder(run, [FakeGroup("actor_train", "ray", ["head"], [own_disk])]) is None
    assert not run.exists()

    train = FakeGroup("actor_train", "ray", ["head", "node-a", "node-b"], [own_disk, shared, own_disk])
    with pytest.raises(SharedFolderError, match=r"node node-b \(10\.0\.0\.2, .+, actor_train rank 2\): missing at "):
        check_run_folder(run, [train])
    assert markers(run) == []
    views = check_run_folder(run, [FakeGroup("actor_train", "ray", ["head", "node-a"], [own_disk, shared])])
    assert views is not None and [(v.node_id, v.status) for v in views] == [("node-a", "ok")]
    assert check_run_folder(run, [train], enabled=False) is None  # cluster.check_shared_fs=false
    assert markers(run) == []
