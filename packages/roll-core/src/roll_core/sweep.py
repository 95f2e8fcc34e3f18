"""Hydra multirun sweeps of `roll-train`: job slots, per-job status, failure isolation and the sweep summary.

How a sweep runs (`roll-train -m algo=grpo,ppo algo.lr=1e-6,3e-6 hydra/launcher=ray`):
- Hydra expands the overrides into jobs; the Ray launcher (hydra-ray-launcher) starts each job as a Ray task
  that reserves no CPU (roll_core/conf/hydra/launcher/ray.yaml), on the same cluster its RL roles are placed on.
- Each job first takes a slot from a named Ray actor (`JobSlots`) holding `cluster.max_concurrent` permits,
  so a sweep on a small machine queues instead of oversubscribing it (0 = no bound). A slot is a lease the job
  renews every few seconds from a thread: a job that raises releases it at once, and one that is killed
  (SIGKILL, OOM, a lost node) stops renewing, so its slot returns after `lease_s` and the sweep goes on.
- A job that raises is caught, logged and recorded in `<job dir>/job_status.json`; the other jobs go on. A job
  whose process dies (SIGKILL, OOM) is recorded as `killed` by roll's Ray launcher (roll_core.sweep_launcher).
- Trackers see one sweep as one group: each job's `tracking.group` (unless given) is "<experiment>-<sweep folder>"
  (W&B group, MLflow experiment, SwanLab group) and its `tracking.run_name` (unless given) is
  "<experiment>-<job number>", so the jobs are distinct runs of one group (`sweep_tracking`).
- After the last job, `SweepSummaryCallback.on_multirun_end` writes `summary.csv`, `summary.md` and
  `rewards.png` (every job's reward curve) into the sweep folder, and `roll-train` exits non-zero if any job
  failed.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import os
import re
import socket
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

log = logging.getLogger(__name__)
STATUS_FILE = "job_status.json"
SLOTS_NAMESPACE = "roll-sweeps"
_failed_jobs: list[str] = []


class JobSlots:
    """A counting semaphore of leases as a Ray actor (created once per sweep, found by name by every job)."""

    def __init__(self, permits: int, lease_s: float = 60.0) -> None:
        self.permits, self.lease_s = permits, lease_s
        self.leases: dict[str, float] = {}  # holder -> last renewal (monotonic seconds)
        self.expired = 0

    def _expire(self) -> None:
        now = time.monotonic()
        for holder, t in list(self.leases.items()):
            if now - t > self.lease_s:  # its job died without releasing: the slot is free again
                del self.leases[holder]
                self.expired += 1

    def try_acquire(self, holder: str) -> bool:
        self._expire()
        if len(self.leases) < self.permits:
            self.leases[holder] = time.monotonic()
            return True
        return False

    def renew(self, holder: str) -> bool:
        if holder in self.leases:
            self.leases[holder] = time.monotonic()
            return True
        return False

    def release(self, holder: str) -> None:
        self.leases.pop(holder, None)

    def stats(self) -> dict[str, int]:
        self._expire()
        return {"held": len(self.leases), "permits": self.permits, "expired": self.expired}


@contextmanager
def job_slot(
    name: str, permits: int, poll_s: float = 1.0, lease_s: float = 60.0, timeout_s: float | None = None
) -> Iterator[float]:
    """Hold one of `permits` slots named `name` while the block runs; yields the seconds spent waiting.

    The slot is a lease renewed every `lease_s / 4` seconds by a daemon thread; if this process dies, the lease
    lapses after `lease_s` and another job takes the slot. `timeout_s`: give up waiting (TimeoutError).
    Without Ray (a local multirun) or with `permits <= 0` the block runs immediately: the basic launcher already
    runs jobs one at a time.
    """
    try:
        import ray
    except ImportError:
        ray = None
    if permits <= 0 or ray is None or not ray.is_initialized():
        yield 0.0
        return
    # Detached: a non-detached actor dies with the job that happened to create it, while others still queue.
    # `SweepSummaryCallback` removes it when the sweep ends.
    actor = (
        ray.remote(JobSlots)
        .options(name=name, get_if_exists=True, num_cpus=0, namespace=SLOTS_NAMESPACE, lifetime="detached")
        .remote(permits, lease_s)
    )
    import threading
    import uuid

    holder = uuid.uuid4().hex
    t0 = time.perf_counter()
    while not ray.get(actor.try_acquire.remote(holder)):
        if timeout_s is not None and time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"no free sweep slot in {name} after {timeout_s}s: {ray.get(actor.stats.remote())}")
        time.sleep(poll_s)
    waited = time.perf_counter() - t0
    done = threading.Event()

    def renew() -> None:
        while not done.wait(lease_s / 4):
            try:
                if not ray.get(actor.renew.remote(holder)):
                    log.warning("sweep slot lease %s lapsed (this job was too slow to renew it)", holder)
            except Exception as exc:  # keep the job running; the lease may lapse and another job may start
                log.warning("could not renew sweep slot %s: %s", name, exc)

    threading.Thread(target=renew, name="roll-sweep-lease", daemon=True).start()
    try:
        yield waited
    finally:
        done.set()
        try:
            ray.get(actor.release.remote(holder))
        except Exception as exc:  # the job's own result matters more than the slot bookkeeping
            log.warning("could not release sweep slot %s: %s", name, exc)


def slots_name(sweep_dir: str | Path) -> str:
    """A stable name per sweep folder (str hash() is salted per process): every job finds the same actor."""
    return "slots-" + hashlib.sha1(str(Path(sweep_dir).resolve()).encode()).hexdigest()[:16]


def run_sweep_job(cfg: Any, run: Any) -> float:
    """Run one multirun job with failure isolation; returns the value a sweeper optimises (NaN on failure)."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    out = Path(hc.runtime.output_dir)
    sweep_tracking(cfg, hc.sweep.dir, hc.job.num)
    record: dict[str, Any] = {"job": hc.job.num, "overrides": list(hc.overrides.task), "status": "running"}
    permits = int(cfg.cluster.get("max_concurrent", 0) or 0)
    slots = slots_name(hc.sweep.dir)
    t0 = time.perf_counter()
    with job_slot(slots, permits) as waited:
        record["queued_seconds"] = waited
        # Written now too: a job whose process is killed leaves this record (roll_core.sweep_launcher marks it)
        record.update(pid=os.getpid(), host=socket.gethostname())
        out.mkdir(parents=True, exist_ok=True)
        (out / STATUS_FILE).write_text(json.dumps(record, indent=2, default=str))
        t_run = time.perf_counter()
        try:
            summary = run(cfg)
            record.update(status="ok", summary=summary)
        except Exception as exc:  # one job's failure must not stop the sweep
            log.error("sweep job %s failed: %s", hc.job.num, exc)
            record.update(status="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        record["wall_seconds"] = time.perf_counter() - t_run
    record["total_seconds"] = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / STATUS_FILE).write_text(json.dumps(record, indent=2, default=str))
    value = (record.get("summary") or {}).get("final_eval_accuracy")
    return float(value) if isinstance(value, (int, float)) else math.nan


def sweep_group(experiment: str, sweep_dir: str | Path) -> str:
    """The tracker group of a sweep: "<experiment>-<sweep folder name>", with the date folder of Hydra's default
    layout (multirun/<date>/<time>) kept in it, so two days' sweeps started at the same time are two groups."""
    path = Path(sweep_dir)
    label = path.name
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", path.parent.name):
        label = f"{path.parent.name}_{label}"
    return f"{experiment}-{label}"


def sweep_tracking(cfg: Any, sweep_dir: str | Path, job_num: int) -> None:
    """Set a sweep job's `tracking.group` (the sweep's, shared) and `tracking.run_name` (the job's own) on its
    composed config, in place, unless the command line set them; config.yaml then records both."""
    tracking = cfg.get("tracking") if hasattr(cfg, "get") else None
    if tracking is None:  # a config without the node (another primary config): nothing to name
        return
    experiment = str(cfg.get("experiment") or "sweep")
    if tracking.get("group") is None:
        tracking.group = sweep_group(experiment, sweep_dir)
    if tracking.get("run_name") is None:
        tracking.run_name = f"{experiment}-{job_num}"


def _metrics(job_dir: Path) -> list[dict[str, Any]]:
    path = job_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """Collect every job of a sweep folder and write summary.csv, summary.md and rewards.png; returns the rows."""
    sweep_dir = Path(sweep_dir)
    rows: list[dict[str, Any]] = []
    curves: dict[str, list[tuple[int, float]]] = {}
    statuses = [json.loads(p.read_text()) for p in sweep_dir.glob(f"*/{STATUS_FILE}")]
    # Label jobs by the overrides that differ between them (the swept parameters), not the shared ones.
    values: dict[str, set[str]] = {}
    for st in statuses:
        for o in st["overrides"]:
            key, _, val = o.partition("=")
            values.setdefault(key, set()).add(val)
    swept = {k for k, v in values.items() if len(v) > 1 or len(statuses) == 1}
    for status_path in sorted(
        sweep_dir.glob(f"*/{STATUS_FILE}"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else p.parent.name,
    ):
        st = json.loads(status_path.read_text())
        hist = _metrics(status_path.parent)
        rewards = [(h["step"], h["reward/mean"]) for h in hist if h.get("reward/mean") is not None]
        evals = [h["eval/accuracy"] for h in hist if h.get("eval/accuracy") is not None]
        label = " ".join(o for o in st["overrides"] if o.partition("=")[0] in swept) or f"job {st['job']}"
        curves[label] = rewards
        rows.append(
            {
                "job": st["job"],
                "params": label,
                "status": st["status"],
                "final_reward": rewards[-1][1] if rewards else None,
                "best_reward": max((r for _, r in rewards), default=None),
                "final_eval_accuracy": evals[-1] if evals else None,
                "best_eval_accuracy": max(evals, default=None),
                "wall_seconds": round(st.get("wall_seconds", 0.0), 1),
                "queued_seconds": round(st.get("queued_seconds", 0.0), 1),
                "error": st.get("error", ""),
                "overrides": " ".join(st["overrides"]),
            }
        )
    if not rows:
        return rows
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    header = [h for h in rows[0] if h != "overrides"]  # the CSV keeps every override; the table the swept ones
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r[k]) for k in header) + " |")
    (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")
    _plot(curves, sweep_dir / "rewards.png")
    return rows


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|").replace("\n", " ")[:120]


def _plot(curves: dict[str, list[tuple[int, float]]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no rewards.png")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, pts in curves.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("reward/mean")
    ax.grid(alpha=0.3)
    if any(curves.values()):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class SweepSummaryCallback(Callback):
    """Hydra callback: before a multirun on the Ray launcher, start its local Ray instance on loopback; after it,
    summarise its jobs and remember failures for the exit code."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        start_sweep_ray(config.hydra.launcher)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        _remove_slots(config.hydra.sweep.dir)
        rows = summarize(config.hydra.sweep.dir)
        failed = [r["params"] for r in rows if r["status"] != "ok"]
        _failed_jobs.extend(failed)
        log.info("sweep summary: %d jobs, %d failed -> %s/summary.md", len(rows), len(failed), config.hydra.sweep.dir)
        if failed:
            log.error("failed jobs: %s", "; ".join(failed))


def start_sweep_ray(launcher: Any) -> bool:
    """Start the Ray launcher's local instance (`hydra.launcher.ray.init` without an address) the way `Cluster`
    starts one: listening on loopback only (`loopback_only`). The launcher then finds Ray running and uses it.
    Returns whether it started one; another launcher, an `init.address` to join, or a running Ray: nothing."""
    from omegaconf import OmegaConf

    if not str(launcher.get("_target_", "")).endswith(".RayLauncher"):  # hydra-ray-launcher's or roll's
        return False
    init = OmegaConf.to_container(launcher.ray.init, resolve=True)
    assert isinstance(init, dict)
    if init.pop("address", None):
        return False
    import ray

    if ray.is_initialized():
        return False
    from roll_core.cluster.launch import loopback_only

    with loopback_only():
        ray.init(address="local", _node_ip_address="127.0.0.1", **init)
    log.info("sweep: started a local Ray instance on loopback (hydra.launcher.ray.init.address=auto joins a cluster)")
    return True


def _remove_slots(sweep_dir: str) -> None:
    try:
        import ray
    except ImportError:
        return
    if ray.is_initialized():
        try:
            ray.kill(ray.get_actor(slots_name(sweep_dir), namespace=SLOTS_NAMESPACE))
        except ValueError:  # no slots actor: the sweep ran without max_concurrent
            pass


def failed_jobs() -> list[str]:
    """Overrides of the jobs that failed in this process's sweeps."""
    return list(_failed_jobs)
