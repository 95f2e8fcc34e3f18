"""Checkpoints: atomic, complete, the last K kept; the policy folder loads with plain transformers.

Layout: `<out>/checkpoints/step_000010/` holding `actor/model/` (HF `save_pretrained`: safetensors + config +
tokenizer), `actor/engine.pt` (optimizer, LR scheduler), `critic/` (PPO; AsyPPO adds `critic_1/`, ...), `state.json`
(step, sampler position, KL controller, RNG states) and `config.yaml` (the run config it was saved with, which a resumed
run is compared with: roll_core.config.resume). A checkpoint is written into `step_000010.tmp/`, flushed to disk (every
file and folder fsync'ed: a rename can reach the disk before the data it names, so a power cut could otherwise leave a
complete-looking folder of empty files; a flush's write error fails the save) and renamed when complete, so a crash
mid-save never leaves a folder that `latest()` would pick. Saving a step again (a run redoing steps after a rollback)
first moves the old folder to `step_000010.replaced/` and deletes it only once the new one is in place: a crash between
the two renames leaves the old checkpoint, which `list()` still finds. A pruned checkpoint is renamed to
`step_000008.deleting/` before its files are deleted (left-overs of a crash go at the next save), so a crash or a file
that will not go (NFS's busy `.nfs*` files) never leaves a folder that lists as complete with files missing. What
crashed saves and prunes leave behind (`.tmp`, `.deleting`, a `.replaced` beside its complete folder) is deleted before
the next save writes anything, so it never fills the disk. A save that fails (a full disk) is the caller's to `discard`
(roll_core.pipelines.loop: `CheckpointError`); the checkpoints already there are untouched until a new one is complete.

Writers: the trainer's ranks write their shards into the staging folder, each from its own node on a cluster (the run
folder must then be one shared folder: roll_core.cluster.shared_fs; the loop hands them an absolute path), between
`staging()` and the return of every rank's save; a rank's save returns once it has flushed the files it wrote
(an fsync flushes only what the calling node wrote: the driver's `fsync_tree` does not make another node's shards
durable on NFS or Lustre). Everything else is the driver's: staging, state.json, the rename,
pruning, `discard` and the clean-up of left-overs (on a shared folder it sees and deletes what every node left).
Completeness is the driver's alone: `list()` takes only a folder under its final name (`step_N`, or `step_N.replaced`)
with a state.json, and `commit` writes state.json and renames only after every rank's save returned. What a failed or
interrupted save leaves (some ranks' shards; a rank still writing after another rank's error made the driver discard
the folder, recreating `step_N.tmp/`; even state.json written before the rename) stays under `.tmp`, never listed, so a
resume never starts from a partial checkpoint; the next save deletes it (a file that will not go yet, such as NFS's
`.nfs*` while a straggler holds it open, stays in that unlisted folder until a later save).
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

#: The run config a checkpoint was saved with, inside its folder.
CONFIG = "config.yaml"

#: A checkpoint folder's name: complete (`step_N`), or the previous save of a step being replaced.
_NAME = re.compile(r"step_(\d+)(\.replaced)?")


class UnsureCheckpointError(OSError):
    """A save whose rename may not have reached the disk and could not be taken back: `folder` is listed as a
    complete checkpoint but may be lost (or partial) after a crash."""

    def __init__(self, errno_: int | None, message: str, folder: Path) -> None:
        super().__init__(errno_, message)
        self.folder = folder


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (a full disk, a quota, a permission); the message names the step, the
    cause and the latest complete checkpoint, which the failed save left intact."""


def step_of(folder: Path) -> int | None:
    """The step of a checkpoint folder's name (`step_N`, `step_N.replaced`, ...), or None for another name."""
    m = re.match(r"step_(\d+)(?:\.|$)", folder.name)
    return int(m.group(1)) if m else None


class CheckpointManager:
    """Creates, lists, prunes and finds checkpoints under `<out>/checkpoints`.

    `config` (a plain nested dict, roll_core.config.resume.config_dict) is recorded in every checkpoint as
    `config.yaml`; without it, the run folder's `config.yaml` (the one roll_core.tracking.Tracker writes: the
    config in effect) is copied, when there is one.
    """

    def __init__(self, out_dir: str | Path, keep_last: int = 2, config: Mapping[str, Any] | None = None) -> None:
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        self.root = Path(out_dir) / "checkpoints"
        self.keep_last = keep_last
        self.config = config

    def staging(self, step: int) -> Path:
        """An empty temporary folder to write step `step` into; first deletes what crashed saves left (see the
        module docstring): a `.tmp` of a step no save repeats (a stop's save, a changed cadence) stayed forever."""
        self._clean_leftovers()
        tmp = self.root / f"step_{step:06d}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return tmp

    def discard(self, tmp: Path) -> None:
        """Delete the staging folder of a save that failed (its partial files would hold the disk's space)."""
        shutil.rmtree(tmp, ignore_errors=True)

    def _clean_leftovers(self) -> None:
        if not self.root.is_dir():
            return
        # A `.replaced` copy is garbage once its step's new folder is complete (list() picks that one).
        complete = {step_of(p) for p in self.root.glob("step_*[0-9]") if (p / "state.json").exists()}
        for p in self.root.glob("step_*"):
            stale_copy = p.name.endswith(".replaced") and step_of(p) in complete
            if p.is_dir() and (p.name.endswith((".tmp", ".deleting")) or stale_copy):
                shutil.rmtree(p, ignore_errors=True)

    def commit(self, tmp: Path, step: int, state: dict[str, Any]) -> Path:
        """Write state.json, rename the staging folder into place, prune old checkpoints. A flush of the rename that
        fails takes the new folder back to `tmp` (the caller discards it) and the old one of the step back into
        place before raising, so that the failure leaves, and `latest()` names, only checkpoints known on disk."""
        state = {**state, "step": step, "rng": rng_state()}
        torch.save(state.pop("rng"), tmp / "rng.pt")
        self._write_config(tmp)
        (tmp / "state.json").write_text(json.dumps(state, indent=2))
        fsync_tree(tmp)
        final = self.root / f"step_{step:06d}"
        replaced = final.with_name(final.name + ".replaced")
        if final.exists():
            if replaced.exists():  # a copy beside a complete folder: garbage (list() picks the complete one)
                shutil.rmtree(replaced)
            final.rename(replaced)
        # Else a `.replaced` left alone (a crash between the renames of an earlier save) is the step's only complete
        # copy: it goes only once the new folder is in place.
        tmp.rename(final)
        try:
            fsync_dir(self.root)  # the rename itself
            fsync_dir(self.root.parent)  # and, at the first save, `checkpoints/` itself
        except OSError as exc:
            # Left in place, the new folder was listed as complete though its name may not be on disk: the save's
            # failure message named it the intact checkpoint to resume from, and said its folder was deleted.
            self._withdraw(final, tmp, replaced, exc)
            raise
        shutil.rmtree(replaced, ignore_errors=True)
        for old in self.list()[: -self.keep_last]:
            _delete(old)
        return final

    @staticmethod
    def _withdraw(final: Path, tmp: Path, replaced: Path, cause: OSError) -> None:
        """Undo `commit`'s renames after the flush failed with `cause`: the new folder back to `tmp`, the step's old
        one (moved to `replaced`) back to `final`. When that fails too: an OSError (from `cause`) naming the folder."""
        try:
            final.rename(tmp)
            if replaced.exists():
                replaced.rename(final)
        except OSError as undo:
            why = f"{cause.strerror or cause}; {final} may not be on disk, and taking it back failed ({undo})"
            raise UnsureCheckpointError(cause.errno, why, final) from cause

    def list(self) -> list[Path]:
        """Complete checkpoints, oldest first: one per step, `step_N` or, when a crash left only that, the
        `step_N.replaced` folder a new save of the step had moved aside."""
        if not self.root.exists():
            return []
        found: dict[int, Path] = {}
        for p in self.root.glob("step_*"):
            m = _NAME.fullmatch(p.name)
            if m is None or not p.is_dir() or not (p / "state.json").exists():
                continue
            step = int(m.group(1))
            if step not in found or m.group(2) is None:  # the complete folder wins over the replaced one
                found[step] = p
        return [found[k] for k in sorted(found)]

    def latest(self) -> Path | None:
        found = self.list()
        return found[-1] if found else None

    def _write_config(self, tmp: Path) -> None:
        if self.config is not None:
            import yaml

            (tmp / CONFIG).write_text(yaml.safe_dump(dict(self.config), sort_keys=False))
        elif (self.root.parent / CONFIG).is_file():
            shutil.copyfile(self.root.parent / CONFIG, tmp / CONFIG)

    @staticmethod
    def read_config(folder: Path) -> dict[str, Any] | None:
        """The run config checkpoint `folder` was saved with (a plain nested dict), or None when it records none."""
        path = Path(folder) / CONFIG
        if not path.is_file():
            return None
        import yaml

        loaded = yaml.safe_load(path.read_text())
        return loaded if isinstance(loaded, dict) else None

    @staticmethod
    def read_state(folder: Path) -> dict[str, Any]:
        state = json.loads((folder / "state.json").read_text())
        if (folder / "rng.pt").exists():
            # weights_only: a checkpoint folder may come from elsewhere; unpickling arbitrary objects runs code.
            set_rng_state(torch.load(folder / "rng.pt", weights_only=True))
        return state


def named_checkpoint_folder(folder: str | Path) -> Path | None:
    """The checkpoint that `pipeline.resume_from=<run>/checkpoints/step_N` names, or None when `folder` names no
    checkpoint (a run folder). A `step_*` folder of a `checkpoints/` folder is taken only when `list()` takes it: what
    a killed save left (`step_N.tmp`: its state.json may be written, a rank's shards not), a pruned one being deleted
    (`.deleting`) or an earlier save a newer one of its step replaced was taken before, and the run loaded it (partly,
    or failed inside an engine's load) after moving its complete newer checkpoints aside. Those are a ConfigError
    naming the complete checkpoints. Another name with a state.json (a user's copy, `checkpoints/best`) is taken as
    before: no save or prune of roll's touches it. One a rollback set aside (`checkpoints/abandoned-*/step_N`) is a
    ConfigError saying how to move it back."""
    from roll_core.errors import ConfigError

    folder = Path(folder).expanduser()
    if folder.parent.name.startswith("abandoned-") and folder.parent.parent.name == "checkpoints":
        # set aside by a rollback (pipeline/run_control.set_aside_newer): out of list()'s sight on purpose
        home = folder.parent.parent
        raise ConfigError(
            f"pipeline.resume_from={folder}: a checkpoint set aside when the run was rolled back to an earlier one "
            f"(in {folder.parent.name}/); roll resumes only from {home}. To resume from it, move it back "
            f"(mv {folder} {home}/) after moving aside or deleting the checkpoints there that are newer than it, then "
            f"pipeline.resume_from={home / folder.name}"
        )
    if folder.parent.name != "checkpoints":
        return None
    if step_of(folder) is None:
        return folder if (folder / "state.json").exists() else None
    run = folder.parent.parent
    complete = CheckpointManager(run).list()
    if any(p.name == folder.name for p in complete):
        return folder
    names = ", ".join(p.name for p in complete) or "none"
    latest = f" (its latest, {complete[-1].name})" if complete else ""
    raise ConfigError(
        f"pipeline.resume_from={folder}: not a complete checkpoint ({_why_incomplete(folder)}); the complete "
        f"checkpoints of {run} are: {names}. Name one of them, or pipeline.resume_from={run} to continue from the "
        f"latest{latest}"
    )


def not_a_run_hint(folder: str | Path) -> str:
    """Why `pipeline.resume_from=<folder>` finds no run there (it holds no complete checkpoint under
    `checkpoints/`), with the value that does, for its error: no such folder; a run's `checkpoints/` folder itself
    (the run folder or one `step_N` is meant); a folder inside a checkpoint (its `actor/`, `actor/model`: the
    checkpoint is meant, or `model.path` for a new run from its weights); a run whose only saves did not finish.
    The error named `<folder>/checkpoints`, a folder that did not exist, and nothing of what was meant."""
    folder = Path(folder).expanduser()
    if not folder.exists():
        return "no such folder"
    if folder.name == "checkpoints":
        latest = CheckpointManager(folder.parent).latest()
        if latest is not None:
            return (
                f"it is the checkpoints/ folder of the run {folder.parent}: pipeline.resume_from={folder.parent} "
                f"continues it from its latest checkpoint ({latest.name}), pipeline.resume_from={latest} from that one"
            )
    for inside in folder.parents:
        if inside.parent.name == "checkpoints" and (inside / "state.json").is_file():
            return (
                f"it lies inside the checkpoint {inside}: pipeline.resume_from={inside} resumes from it; to start a "
                f"new run from its weights: model.path={inside / 'actor' / 'model'}"
            )
    # (the run's checkpoints/ folder itself named: its own unfinished saves, not those of a checkpoints/ inside it)
    saves = folder if folder.name == "checkpoints" else folder / "checkpoints"
    unfinished = sorted(p.name for p in saves.glob("step_*.tmp"))
    if unfinished:
        return f"only a save that did not finish: {', '.join(unfinished)}"
    return "no checkpoints/step_N folder with a state.json"


def _why_incomplete(folder: Path) -> str:
    """Why `list()` does not take `folder`, a `step_*` folder of a `checkpoints/` folder."""
    name = folder.name
    if not folder.is_dir():
        return "no such folder"
    if name.endswith(".tmp"):
        return "the staging folder of a save that did not finish: it may hold part of the files"
    if name.endswith(".deleting"):
        return "a pruned checkpoint being deleted: its files may be gone"
    m = _NAME.fullmatch(name)
    if m is not None and m.group(2) and (folder.with_name(name.removesuffix(".replaced")) / "state.json").exists():
        return f"an earlier save of its step, replaced by {name.removesuffix('.replaced')}"
    if m is not None:
        return "no state.json: its save did not finish"
    return "not a checkpoint's name: step_N"


def _delete(folder: Path) -> None:
    """Delete a checkpoint folder, first renamed out of `list()`'s sight (`.deleting`): with a state.json and
    without its weights, a half-deleted one was listed (in the run report, for `pipeline.resume_from`)."""
    doomed = folder.with_name(folder.name + ".deleting")
    try:
        if doomed.exists():
            shutil.rmtree(doomed)
        folder.rename(doomed)
    except OSError:  # deleted in place, as before, where it cannot be renamed
        doomed = folder
    shutil.rmtree(doomed, ignore_errors=True)


def fsync_tree(root: Path, include: Callable[[Path], bool] | None = None) -> None:
    """Flush every file under `root`, and every folder (their entries), to disk; a folder that cannot be read is an
    error (os.walk skips it silently: its files went unflushed into a checkpoint marked complete). `include` (a
    file's path -> flush it?) limits the files, not the folders: a trainer rank flushes only the files it wrote
    (roll_engines.train._hf_checkpoint.fsync_written), another node's being its writer's to flush."""
    for folder, _, files in os.walk(root, onerror=_raise):
        for name in files:
            if include is not None and not include(Path(folder, name)):
                continue
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(folder)


#: What a filesystem that does not flush folders answers (some FUSE, CIFS and network mounts): nothing was lost.
_FSYNC_REFUSED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EACCES, errno.EPERM}


def _raise(exc: OSError) -> None:
    raise exc


def fsync_dir(folder: str | Path) -> None:
    """Flush a folder's entries (names created or renamed in it); a no-op where folders cannot be opened (Windows)
    or flushed. A write error (EIO, a full disk or quota on a network filesystem) is raised: swallowed, the save
    went on as durable and pruned the older checkpoints, so a crash could leave none complete."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _FSYNC_REFUSED:
            raise
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states of this process, as tensors, lists and numbers only (so that they load
    with `torch.load(weights_only=True)`)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
