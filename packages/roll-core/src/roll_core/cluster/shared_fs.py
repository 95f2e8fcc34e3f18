"""Start-up check that the run folder is one folder for every node that writes into it (a shared filesystem).

On a multi-node Ray cluster the trainer's ranks write their checkpoint shards into the run folder on their own node
(`TrainWorker.save`: the optimizer's shards on every rank) and read them back on resume, while the driver commits
the checkpoint and keeps the run's records there. Without a filesystem mounted at the same path on every node, each
node writes to its own local disk at that path: the run looks healthy and fails only at a resume or an export (shards
missing), or resumes from a stale local copy. `check_run_folder` finds that out before training:

- It checks only Ray groups whose workers write into the run folder (the pipeline passes the trainer's: actor_train
  and the critics), and only the nodes other than the driver's: the local backend, a single node, or writers all on
  the driver's node cost nothing (no marker is written). In Ray client mode (`ray://`) the driver's node is not
  known, so every writer's node is checked.
- The driver writes a marker `<folder>/.roll-shared-fs-<token>` (a random token, also its content), one worker per
  distinct node reads it (by the path the workers are given: the pipeline hands them an absolute one; a relative
  folder from another caller resolves against each worker's working directory), and the marker is removed whatever
  happens. A node that does not see it, sees another token, cannot read it, or does not answer within `timeout_s`
  fails the check: `SharedFolderError` (a ConfigError: roll-train says it in one line) names each such node (Ray
  node id, IP, host, the worker that looked and the path it resolved), the folder, and what to do.
- A reader that misses the marker looks again for up to `wait_s` seconds (NFS and Lustre clients may show a new file
  to other nodes a moment late); a node that sees it answers at once.
- `cluster.check_shared_fs=false` skips the check (with a warning): for a cluster whose per-node folders the user
  gathers into one before resuming.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roll_core.errors import ConfigError

log = logging.getLogger(__name__)

#: The marker's name, before its token.
MARKER_PREFIX = ".roll-shared-fs-"


class SharedFolderError(ConfigError):
    """A node that writes into the run folder does not see the driver's folder; the message names the nodes."""


@dataclass(frozen=True)
class NodeView:
    """What one node's worker saw at the marker's path."""

    node_id: str
    who: str  # the worker that looked: "actor_train rank 1"
    ip: str = ""
    host: str = ""
    path: str = ""  # the marker's absolute path on that node
    status: str = "missing"  # ok | missing | different token | unreadable: ... | no answer: ...

    def describe(self) -> str:
        where = ", ".join(x for x in (self.ip, f"host {self.host}" if self.host else "", self.who) if x)
        return f"node {self.node_id} ({where})"


#: Starts reading the marker (path, token) on one node; returns a function that waits for what it saw
#: (`read_marker`'s mapping). The Ray form runs on a worker of that node (`ray_probe`); tests pass fakes.
Submit = Callable[[str, str], Callable[[], Mapping[str, str]]]


@dataclass(frozen=True)
class Probe:
    """One node to check: its id, the worker that reads there (for messages) and how to read."""

    node_id: str
    who: str
    submit: Submit


def read_marker(path: str, token: str, wait_s: float = 10.0) -> dict[str, str]:
    """Runs on a worker: whether `path` holds `token`, looking again for up to `wait_s` s while it does not.

    Returns this node's address, host name, the absolute path read, and `status`: `ok`, `missing`, `different
    token`, or `unreadable: <error>`. Never raises for what it finds: the driver reports every node at once.
    """
    from roll_core.cluster.worker import node_address

    deadline = time.monotonic() + max(0.0, wait_s)
    while True:
        try:
            status = "ok" if Path(path).read_text().strip() == token else "different token"
        except FileNotFoundError:
            status = "missing"
        except OSError as exc:
            status = f"unreadable: {type(exc).__name__}: {exc}"
        if status == "ok" or time.monotonic() >= deadline:
            break
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    return {"ip": node_address(), "host": socket.gethostname(), "path": os.path.abspath(path), "status": status}


def check_shared_folder(folder: Path, probes: Sequence[Probe]) -> list[NodeView]:
    """Write a marker with a random token into `folder`, have every probe read it, remove it; each node's view.

    Raises `SharedFolderError` naming every node that did not see the marker (missing, another token, unreadable,
    no answer). The marker is removed in every case.
    """
    token = secrets.token_hex(16)
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / f"{MARKER_PREFIX}{token}"
    with open(marker, "w") as f:
        f.write(token)
        f.flush()
        os.fsync(f.fileno())  # on the server before any node is asked to look
    try:
        waits = [(p, p.submit(str(marker), token)) for p in probes]  # every node reads at once
        views = []
        for p, wait in waits:
            try:
                seen = dict(wait())
            except Exception as exc:  # a worker that died or hung: this node is not known to see the folder
                seen = {"status": f"no answer: {type(exc).__name__}: {str(exc).strip()[:200]}"}
            fields = {k: str(seen[k]) for k in ("ip", "host", "path") if k in seen}
            status = str(seen.get("status", "no status reported"))
            views.append(NodeView(node_id=p.node_id, who=p.who, status=status, **fields))
    finally:
        marker.unlink(missing_ok=True)
    bad = [v for v in views if v.status != "ok"]
    if bad:
        raise SharedFolderError(_message(folder, views, bad))
    return views


def _message(folder: Path, views: Sequence[NodeView], bad: Sequence[NodeView]) -> str:
    absolute = folder if folder.is_absolute() else Path.cwd() / folder
    lines = [
        f"the run folder {absolute} is not shared with every node that writes into it: the driver wrote a marker "
        f"there ({MARKER_PREFIX}<token>) and {len(bad)} of the {len(views)} other node(s) did not see it:"
    ]
    lines += [f"  {v.describe()}: {v.status} at {v.path or '?'}" for v in bad]
    ok = [v.describe() for v in views if v.status == "ok"]
    if ok:
        lines.append(f"  seen by: {', '.join(ok)}")
    lines.append(
        "Checkpoint shards written there would land on each node's own disk: a resume or an export would find them "
        "missing, or read a stale local copy. Mount a shared filesystem (NFS, Lustre, a shared volume in KubeRay) at "
        "the same path on every node and put pipeline.output_dir on it"
        + (
            "; give an absolute pipeline.output_dir (a relative one is resolved in each worker's working directory)"
            if not folder.is_absolute()
            else ""
        )
        + ". If you gather the nodes' folders into one yourself before resuming, cluster.check_shared_fs=false "
        "skips this check"
    )
    return "\n".join(lines)


# ---- Ray --------------------------------------------------------------------------------------------------------
def _read_in_actor(_worker: Any, path: str, token: str, wait_s: float) -> dict[str, str]:
    """`read_marker` inside a worker's actor (Ray's `__ray_call__` passes the worker instance first)."""
    return read_marker(path, token, wait_s)


def ray_probe(actor: Any, timeout_s: float, wait_s: float) -> Submit:
    """Reads the marker in `actor`'s process (so on its node and with its working directory), waiting at most
    `timeout_s` seconds from submission for its answer."""

    def submit(path: str, token: str) -> Callable[[], Mapping[str, str]]:
        import ray

        ref = actor.__ray_call__.remote(_read_in_actor, path, token, wait_s)
        deadline = time.monotonic() + timeout_s
        return lambda: ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))

    return submit


def driver_node_id() -> str | None:
    """The Ray node this driver runs on; None where that is not this process's node (Ray client mode)."""
    import ray

    try:
        from ray.util.client import ray as client

        if client.is_connected():
            return None
    except ImportError:
        pass
    return str(ray.get_runtime_context().get_node_id())


def nodes_to_probe(groups: Iterable[Any], driver_node: str | None) -> dict[str, tuple[Any, int]]:
    """Node id -> (group, rank) of one worker on each node other than `driver_node` that hosts a worker of a Ray
    group in `groups` (their `backend`, `nodes`: node id per rank); the first rank found on each node reads."""
    found: dict[str, tuple[Any, int]] = {}
    for g in groups:
        if g is None or getattr(g, "backend", "local") != "ray":
            continue
        for rank, node in enumerate(g.nodes):
            if node != driver_node and node not in found:
                found[node] = (g, rank)
    return found


def check_run_folder(
    folder: Path,
    groups: Iterable[Any],
    *,
    enabled: bool = True,
    timeout_s: float = 120.0,
    wait_s: float = 10.0,
) -> list[NodeView] | None:
    """The pipeline's check (see the module docstring): `groups` are the worker groups that write into `folder`.

    Returns each checked node's view, or None when there was nothing to check (no Ray group, every writer on the
    driver's node) or the check is off (`enabled`: cluster.check_shared_fs). Raises `SharedFolderError`.
    """
    ray_groups = [g for g in groups if g is not None and getattr(g, "backend", "local") == "ray"]
    if not ray_groups:
        return None
    targets = nodes_to_probe(ray_groups, driver_node_id())
    if not targets:
        return None
    if not enabled:
        log.warning(
            "cluster.check_shared_fs=false: not checking that the %d other node(s) writing into %s see the same folder",
            len(targets),
            folder,
        )
        return None
    probes = [
        Probe(node, f"{g.name} rank {rank}", ray_probe(g.workers[rank], timeout_s, wait_s))
        for node, (g, rank) in targets.items()
    ]
    views = check_shared_folder(folder, probes)
    log.info(
        "shared run folder checked: %s is seen by the driver and %d other node(s): %s",
        folder,
        len(views),
        ", ".join(v.describe() for v in views),
    )
    return views
