"""The tracker contract: where a run's metrics go besides its own `metrics.jsonl` (TensorBoard, W&B, MLflow, ...).

A backend is a class registered under the `roll.trackers` entry-point group and named in `pipeline.trackers`
(roll-core's own `tensorboard`, `jsonl` and `wandb` in roll_core.trackers are declared exactly as an out-of-tree
plugin is). Several run side by side: `pipeline.trackers=[tensorboard,wandb]` is the one way to pick them.
`roll_core.tracking.Tracker` builds each named backend once per run with keyword arguments `run_dir`, `config`,
`name` and `resume` (the constructor below), then calls:

- `log(step, metrics)` once per logged step, steps increasing except after `truncate`; `metrics` holds only finite
  numbers (a NaN/inf metric is null in metrics.jsonl and left out here), step 0 is the evaluation before training;
- `truncate(last_step)` when a resumed run restarts after its checkpoint at `last_step`: records of later steps
  must go (they are logged again, possibly with other values);
- `samples(step, rows)` with a few decoded completions (dicts of JSON values), only on backends that define it
  (`SampleTrackerBackend`);
- `close()` at the end of the run, also of a failed one; it may be called twice. A backend whose service marks a
  run failed defines `close(failed: bool | None = None)`: the Tracker then passes whether the run failed (its
  caller's word, else whether an exception propagates); None, when used on its own: that same fallback.

A backend may assume it is the only writer of its own state (a folder under `run_dir`, a remote run); it must not
write metrics.jsonl, config.yaml, samples.jsonl or curves.png (the Tracker's). Its errors propagate into the
training loop: a backend that talks to a server handles its own network failures. A missing optional dependency
is raised at construction as one line naming the pip extra (`roll_core.errors.Extra.require`). The config check of
`pipeline.trackers` imports the backend's module (`registry.load`), so heavy imports (wandb, mlflow) belong in
`__init__`, not at module level. A class attribute `extra` (that `Extra`, or None) lets roll-doctor say whether the
backend's package is installed without building it.

Options: the backend gets the whole resolved config and reads its own node with
`roll_core.config.tracking.backend_options(config, "<name>")` (typed `tracking.wandb`, `tracking.mlflow`,
`tracking.swanlab`; a plugin's free-form `tracking.plugins.<name>` dict). Grouping: `tracking_config(config).group`
is the group of related runs (a Hydra sweep sets it: every job of one sweep shares it, each has its own `name`);
a backend maps it onto its service's notion (W&B group, MLflow experiment, SwanLab group). Every backend passes the
conformance suite roll_core.testing.trackers.TrackerTestSuite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class TrackerBackend(Protocol):
    """A metrics sink named in `pipeline.trackers` (see the module docstring for the call order)."""

    def __init__(self, *, run_dir: Path, config: dict[str, Any], name: str, resume: bool) -> None:
        """Open the sink.

        Args:
            run_dir: the run's output folder (exists); a backend keeps local files under its own subfolder.
            config: the resolved run config as plain containers (what config.yaml says).
            name: the run's name (`tracking.run_name`, else `experiment`; a sweep job's is distinct per job), e.g.
                the run name of a remote service.
            resume: the run continues an earlier one in the same folder; `truncate` follows before any `log`.
        """

    def log(self, step: int, metrics: dict[str, float | int]) -> None:
        """Record the finite metrics of `step`: floats, and Python ints for integer counts (numpy and tensor
        integers arrive as ints; bools as 0.0/1.0)."""

    def truncate(self, last_step: int) -> None:
        """Forget every record of a step after `last_step` (a resumed run redoes them)."""

    def close(self) -> None:
        """Flush and release the sink (idempotent)."""


@runtime_checkable
class SampleTrackerBackend(TrackerBackend, Protocol):
    """A backend that also records decoded completions."""

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Record a few completions of `step` (each row a dict of JSON values: prompt, response, reward, ...)."""
