"""roll-train's run and sweep folders, claimed before Hydra writes into them (`RunFolderCallback`, a Hydra callback).

Why: Hydra writes `.hydra/` (config.yaml, hydra.yaml, overrides.yaml) and opens the job log in the run folder before
the job runs, and the pipeline takes the folder's lock (roll_core.run_lock) only when it is built. So a second run
into a running run's folder replaced that run's config record before it was refused, whether the folder came from
the command line, a config file / experiment preset, or Hydra's default `outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}`
(two runs a script starts in the same second: the refused one's config.yaml stood in the folder of the one that ran).
`on_run_start` (`on_multirun_start` for a sweep folder) runs after Hydra composed the config and before it writes
anything, so it sees the folder Hydra will use however it was set, interpolations resolved.

Contract:
- A folder the config names (a `hydra.run.dir` / `hydra.sweep.dir` without `${now:...}`) is locked
  (`hold_run_folder`): another live process holding it refuses this run with its ConfigError, before Hydra writes.
- A time-stamped folder (its value uses `${now:...}`: Hydra's default, or a user's `runs/${now:%H-%M-%S}`) is meant
  to be new to each launch: when it already exists (a run started in the same second, or earlier under a coarser
  stamp) this run takes `<folder>_2`, `_3`, ... (`claim_fresh_folder`: an exclusive mkdir, so two processes never
  take one folder). Every run started together runs, each in its own folder. A `pipeline.output_dir` stamped with
  `${now:...}` (the command line's, or a config file's that becomes the run folder) is such a folder too, and the
  folder taken is written back into it: the pipeline writes where pipeline.output_dir says (roll_core.cli.run_job).
- `pipeline.output_dir` set in a config file while hydra.run.dir is Hydra's default becomes the run folder, as the
  command line's does (roll_core.cli.run_dir_overrides): .hydra/ and the job log go into the run's own folder, not a
  stray outputs/<date>/<time>/.
- The folder taken is written back into the config (hydra.run.dir / hydra.sweep.dir), so Hydra uses exactly the
  folder locked; a sweep's new folder is also added to `hydra.overrides.hydra`, from which Hydra composes each job's
  config again.
- The locks are held until `release_claimed()` (roll-train's exit); the pipeline shares them (run_lock is re-entrant).
- Hydra turns an Exception a callback raises into a warning and goes on, so a refusal leaves the callback as
  `FolderRefused` (a BaseException carrying the ConfigError), which roll-train raises again as the ConfigError.
Does not cover: a primary config without `hydra.callbacks.run_folder` (a user's own `rlvr.yaml` replacing roll's):
only the pipeline's own lock then guards the folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf, open_dict, read_write

from roll_core.errors import ConfigError
from roll_core.run_lock import RunLock, claim_fresh_folder, hold_run_folder

#: Hydra's own run folder (hydra/output/default.yaml): left so, a config's pipeline.output_dir takes its place.
HYDRA_DEFAULT_RUN_DIR = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"

_claimed: list[RunLock] = []  # the folders this process claimed, released by release_claimed()


class FolderRefused(BaseException):
    """A run refused its folder (or one it cannot name to Hydra); `error` is the ConfigError roll-train prints.
    A BaseException: Hydra's callback runner catches Exception (and only warns)."""

    def __init__(self, error: ConfigError) -> None:
        super().__init__(str(error))
        self.error = error


class RunFolderCallback(Callback):
    """Hydra callback (`hydra.callbacks.run_folder` in rlvr.yaml, listed first): claims the run folder before Hydra
    writes into it, or the sweep folder before a multirun starts (see the module docstring)."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        _claim(config, "run")

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        _claim(config, "sweep")


def release_claimed() -> None:
    """Give back the folders this process claimed (idempotent)."""
    while _claimed:
        _claimed.pop().release()


def _claim(config: Any, kind: str) -> None:
    """Claim the folder of `hydra.<kind>.dir` (kind "run" or "sweep") and write the one taken back into `config`."""
    stamped = kind == "run" and _adopt_output_dir(config)
    node = config.hydra[kind]
    raw = str(OmegaConf.to_container(node, resolve=False)["dir"])
    stamped = stamped or "${now:" in raw
    try:
        folder = Path(_resolve(config, f"hydra.{kind}.dir"))
    except Exception:  # a broken interpolation: Hydra's own resolution reports it, as without roll
        return
    try:
        if stamped:
            taken, lock = claim_fresh_folder(folder)
        else:
            taken, lock = folder, hold_run_folder(folder)
        _claimed.append(lock)
        if taken != folder and kind == "sweep":
            _pin_sweep_dir(config, folder, taken)
    except ConfigError as exc:
        raise FolderRefused(exc) from None
    with read_write(config.hydra), open_dict(config.hydra):
        node.dir = str(taken)
    if kind == "run" and taken != folder:
        _follow_output_dir(config, folder, taken)


def _resolve(config: Any, key: str) -> str:
    """`key`'s value as Hydra's run_job resolves it: with HydraConfig set (a `${hydra:...}` in it resolves), which is
    put back as it was; `${now:...}` is cached in `config`, so Hydra later reads the same time."""
    from hydra.core.hydra_config import HydraConfig

    instance = HydraConfig.instance()
    before, readonly = instance.cfg, OmegaConf.is_readonly(config.hydra)
    instance.set_config(config)
    try:
        return str(OmegaConf.select(config, key))
    finally:
        instance.cfg = before
        OmegaConf.set_readonly(config.hydra, readonly)


def _adopt_output_dir(config: Any) -> bool:
    """hydra.run.dir := pipeline.output_dir when a config file set the latter and left the former to Hydra; True when
    the value adopted is time-stamped (`${now:...}` in pipeline.output_dir: resolved here, the stamp no longer shows
    in hydra.run.dir, and the folder was taken as a named one, so a second launch in the same second shared it)."""
    out = OmegaConf.select(config, "pipeline.output_dir", default=None)
    raw = OmegaConf.to_container(config.hydra.run, resolve=False)["dir"]
    if out is None or not str(out).strip() or raw != HYDRA_DEFAULT_RUN_DIR:
        return False
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.run.dir = os.path.expanduser(str(out))
    return "${now:" in str(OmegaConf.to_container(config.pipeline, resolve=False).get("output_dir"))


def _follow_output_dir(config: Any, base: Path, taken: Path) -> None:
    """pipeline.output_dir := `taken` where it names `base`, the time-stamped folder another launch had: the run folder
    became `taken` (its .hydra/ record and job log), and the pipeline, which writes where pipeline.output_dir says
    (roll_core.cli.run_job), wrote into the other launch's folder (or was refused there as in use)."""
    out = OmegaConf.select(config, "pipeline.output_dir", default=None)
    if out is None or os.path.abspath(os.path.expanduser(str(out))) != os.path.abspath(base):
        return
    with read_write(config), open_dict(config):
        config.pipeline.output_dir = str(taken)


def _pin_sweep_dir(config: Any, base: Path, folder: Path) -> None:
    """Add `hydra.sweep.dir=<folder>` to the overrides each sweep job's config is composed from again (Hydra's
    load_sweep_config): without it a job's config resolved the time-stamped folder again, `base`."""
    text = str(folder)
    if "\\" in text or "$" in text:  # Hydra's override grammar would read these as escapes or an interpolation
        raise ConfigError(
            f"the sweep folder {base} exists, and its free name {text} cannot be passed to Hydra (a backslash or $ "
            "in it): give this sweep its own hydra.sweep.dir"
        )
    quoted = "'" + text.replace("'", "\\'") + "'"
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.overrides.hydra.append(f"hydra.sweep.dir={quoted}")
