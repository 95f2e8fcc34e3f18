"""Checks roll's launchers run on a batch of sweep jobs before any of them starts: the Ray launcher
(roll_core.sweep_launcher) and the basic one (`check_basic_batch`: hydra_plugins.roll_basic_launcher, the default).

Contract:
- `check_job_configs` refuses (ConfigError naming the job and its overrides) a job whose config roll would refuse
  when the job starts: a key no schema declares (a misspelt key added with a `+`, which Hydra's struct mode lets
  in) or a value a schema's check refuses (`algo.lr=1e-3,-1`). Hydra's sweepers only compose the jobs' configs
  before a batch starts; roll's own checks ran inside each job, so a sweep with one bad value failed that job after
  the jobs before it had trained (hours), and one with a bad key in every job started them all to fail each. A job
  whose config cannot be resolved here (an interpolation of the driver's environment, `${oc.env:...}` set only on
  the workers) is left to its own check, with a warning: that is no proof the job's config is wrong.
- `check_job_resources` refuses a job's own Ray task (`hydra.launcher.ray.remote`: num_cpus, num_gpus, memory,
  resources) that no node of a Ray instance started by the sweep can hold: Ray keeps such a task pending forever
  (it only logs "infeasible"), so the sweep hung with no error. On a joined cluster (`init.address`), which an
  autoscaler may grow, it is a warning.
- `check_basic_batch` checks quietly (`quiet=True`): the config checks' warnings (a near-greedy group temperature)
  are not logged by the batch check, because each job of the basic launcher runs next in this process and logs them
  when its own config is checked; they came twice per job. Refusals are unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from roll_core.errors import ConfigError

log = logging.getLogger(__name__)


def check_job_configs(
    cfgs: Sequence[DictConfig], job_overrides: Sequence[Sequence[str]], *, quiet: bool = False
) -> None:
    """Refuse the batch when one job's task config (`cfgs`: the configs the launcher composed, with their `hydra`
    node; `job_overrides`: their overrides, for the message) fails roll's config check (`to_object`: unknown keys,
    the schemas' checks), before any job starts. The job's `${hydra:...}` interpolations resolve against its own
    Hydra config, as in the job. `quiet`: the checks' warnings are not logged (the job logs them when it runs)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf.errors import InterpolationResolutionError

    from roll_core.config.compose import to_object

    hydra_config = HydraConfig.instance()
    saved = hydra_config.cfg
    try:
        for cfg, overrides in zip(cfgs, job_overrides):
            task = copy.deepcopy(cfg)
            with read_write(task), open_dict(task):  # what Hydra's run_job hands the task function
                del task["hydra"]
            try:
                hydra_config.set_config(copy.deepcopy(cfg))
            except AssertionError:  # no Hydra-made `hydra` node: a `${hydra:...}` cannot resolve (warned below)
                hydra_config.cfg = None
            try:
                with _no_warnings() if quiet else contextlib.nullcontext():
                    to_object(task)
            except ConfigError as exc:
                cause = exc.__cause__
                if isinstance(cause, InterpolationResolutionError):  # the driver is not the job's machine
                    log.warning(
                        "sweep job %s: its config cannot be resolved before it starts (%s): it is checked when it runs",
                        cfg.hydra.job.num,
                        cause,
                    )
                    continue
                raise ConfigError(
                    f"sweep job {cfg.hydra.job.num} ({' '.join(overrides)}) has an invalid config; no job of this "
                    f"batch was started:\n{exc}"
                ) from exc
    finally:
        hydra_config.cfg = saved


def check_basic_batch(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> None:
    """`check_job_configs` for a batch of Hydra's basic (in-process) launcher, before its first job runs: `launcher`
    holds the multirun's `config` and `hydra_context` (its config loader composes each job's config as the launcher
    will). That launcher composed and ran its jobs one after another, so a bad value's job failed only after the
    jobs before it had trained (`roll-train -m algo.group_size=2,0` trained job 0 first)."""
    assert launcher.config is not None and launcher.hydra_context is not None
    cfgs: list[DictConfig] = []
    for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
        cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
        with open_dict(cfg):  # as BasicLauncher.launch sets them (the message names the job by its number)
            cfg.hydra.job.id = idx
            cfg.hydra.job.num = idx
        cfgs.append(cfg)
    check_job_configs(cfgs, job_overrides, quiet=True)  # each job, run next in this process, logs its own warnings


@contextlib.contextmanager
def _no_warnings() -> Iterator[None]:
    """Drop log records up to WARNING while the block runs (errors still log); the earlier threshold after it."""
    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(before)


def task_resources(remote: Any) -> dict[str, float]:
    """The resources Ray reserves for a sweep job's own task with `ray.remote(**remote)` (`hydra.launcher.ray.remote`),
    by Ray's resource names; a CPU when num_cpus is not given (Ray's default for a task)."""
    opts = OmegaConf.to_container(remote, resolve=True) if remote else {}
    assert isinstance(opts, dict)
    need: dict[str, float] = {"CPU": float(1 if opts.get("num_cpus") is None else opts["num_cpus"])}
    need["GPU"] = float(opts.get("num_gpus") or 0)
    need["memory"] = float(opts.get("memory") or 0)
    for name, amount in (opts.get("resources") or {}).items():
        need[str(name)] = float(amount or 0)
    if opts.get("accelerator_type"):
        need[f"accelerator_type:{opts['accelerator_type']}"] = 0.001  # what Ray asks for it
    return {k: v for k, v in need.items() if v > 0}


def _node_resources() -> list[dict[str, float]] | None:
    """The total resources of each alive node of the Ray instance this process is connected to; None without one."""
    import ray

    if not ray.is_initialized():  # nothing to compare with: Ray itself refuses to run the jobs
        return None
    return [dict(n.get("Resources") or {}) for n in ray.nodes() if n.get("Alive")]


def check_job_resources(launcher: Any) -> None:
    """Refuse a sweep whose jobs' own Ray task (`launcher.ray_cfg.remote`) no node can hold: a ConfigError naming
    what it asks and what the largest node has, on a Ray instance the sweep started (no `init.address`); a warning
    on a joined cluster, where an autoscaler may add a node that holds it."""
    need = task_resources(OmegaConf.select(launcher.ray_cfg, "remote"))
    if not need:
        return
    nodes = _node_resources()
    if nodes is None or any(all(node.get(k, 0.0) >= v for k, v in need.items()) for node in nodes):
        return
    asks = ", ".join(f"{k}={v:g}" for k, v in sorted(need.items()))
    has = "; ".join(", ".join(f"{k}={node.get(k, 0.0):g}" for k in sorted(need)) for node in nodes) or "no node"
    message = (
        f"each sweep job's own Ray task asks for {asks} (hydra.launcher.ray.remote), but no node of the Ray "
        f"instance has that (its nodes: {has}): Ray would keep the jobs waiting forever"
    )
    if OmegaConf.select(launcher.ray_cfg, "init.address"):
        log.warning("%s, unless the cluster adds a node that has it", message)
        return
    raise ConfigError(
        f"{message}. Ask for less in hydra.launcher.ray.remote (roll's default reserves no CPU and no GPU: a job's "
        "RL roles reserve their own), or give hydra.launcher.ray.init more (num_cpus, num_gpus)"
    )
