"""`pipeline.trackers=[swanlab]`: a SwanLab experiment per roll run (the `roll-core[swanlab]` extra).

Options: `tracking.swanlab` (roll_core.config.tracking.SwanlabConfig). The experiment is `swanlab.init(project,
workspace, experiment_name=the run name, tags, config=the resolved config, logdir=<run>/swanlog, mode)`. Mode `auto`
(the default) is SWANLAB_MODE when set, else `cloud` when SwanLab can authenticate (SWANLAB_API_KEY, or a `swanlab
login`), else `local`: files under `<run>/swanlog` only, no network and no login; view them with
`swanlab watch <run>/swanlog`. `offline` writes the same backup file without the dashboard's database (upload later
with `swanlab sync <run>/swanlog/run-*`). SwanLab 0.6 has no run groups: `tracking.swanlab.group` (else
`tracking.group`, a sweep's) becomes a tag. Metrics are logged at their step; samples as a `samples` text column at
their step, one text per row (the row as JSON, its reward as caption). A metric name SwanLab refuses (blank, or
starting or ending with `.` or `/`: SwanLab raised ValueError into the training loop) or cuts (past 255
characters) is logged under a name it takes (`swanlab_key`), kept distinct from every other key's and from
`samples` (roll_core.trackers.mlflow_keys.KeyNames: a suffix and a warning). The console is not captured (SwanLab's log
proxy is off) and the hardware monitor follows `tracking.swanlab.hardware_monitor`.

Resume. SwanLab 0.6 cannot reopen an experiment and ignores a step logged twice, so a resumed run (`truncate`) is a
new experiment (same project and name, tag `resumed`) that replays steps 0..last_step from the run folder's
metrics.jsonl and samples.jsonl, then continues; the earlier attempt's experiment stays as it was. The same happens
in one process when `truncate` drops steps the open experiment already holds. `<run>/swanlog/roll-run.json` names the
current experiment's folder.

Network failures. A new run needs SwanLab's cloud to answer `swanlab.init` (a wrong key or host fails before
training). A resumed run whose cloud does not answer (connection refused, a timeout, a 5xx) goes on without it: a
warning says so, and the experiment is started, and sent the steps from metrics.jsonl, at a later log once RETRY_S
has passed (doubling up to MAX_RETRY_S); `close()` tries once more, and an error says what SwanLab lacks.

SwanLab keeps one experiment per process (a module-level run): opening this backend while another SwanLab run is
open in the process is an error.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

from roll_core.config.tracking import SWANLAB, backend_options, tracking_config
from roll_core.errors import Extra
from roll_core.trackers.background import describe_failure, schedule_retry
from roll_core.trackers.mlflow_keys import KeyNames
from roll_core.trackers.replay import kept_metrics, kept_samples
from roll_core.tracking import redact_config, redact_text

log = logging.getLogger(__name__)
#: The run folder's record of its current SwanLab experiment: {"run_dir": ..., "last_step": ...}.
STATE_FILE = "roll-run.json"
#: The text column of the sample completions.
SAMPLES_KEY = "samples"
#: Local mode's dashboard package (swanlab[dashboard], in roll-core[swanlab]).
SWANBOARD = Extra("swanboard", "tracking.swanlab.mode=local", "swanboard", "roll-core[swanlab]")
#: Seconds before a resumed run whose SwanLab cloud did not answer tries to start its experiment again (doubling).
RETRY_S = 300.0
MAX_RETRY_S = 3600.0
#: SwanLab's longest metric name (it cuts longer ones, and raised ValueError for two cut alike in one log).
MAX_KEY = 255


def swanlab_key(key: str) -> str:
    """`key` as SwanLab 0.6 takes it (swanlab.data.formatter.check_key_format): no blank at either end, at most
    MAX_KEY long, not empty, neither starting nor ending with `.` or `/` (such an end becomes `_`). Not
    one-to-one: the tracker's KeyNames keeps distinct keys distinct."""
    clean = key.strip()[:MAX_KEY].rstrip() or "_"
    if clean[0] in "./":
        clean = "_" + clean[1:]
    if clean[-1] in "./":
        clean = clean[:-1] + "_"
    return clean


def _import_swanlab() -> ModuleType:
    SWANLAB.require()
    with warnings.catch_warnings():  # swankit's enums warn about Python 3.13 at import; nothing a user can change
        warnings.simplefilter("ignore", DeprecationWarning)
        import swanlab

    return swanlab


def has_api_key() -> bool:
    """Whether SwanLab could authenticate here (SWANLAB_API_KEY, or a `swanlab login`)."""
    if os.environ.get("SWANLAB_API_KEY"):
        return True
    from swanlab.error import KeyFileError
    from swanlab.package import get_key

    try:
        get_key()
    except (KeyFileError, OSError, ValueError):
        return False
    return True


def resolve_mode(mode: str) -> str:
    """`tracking.swanlab.mode` as SwanLab takes it: `auto` is SWANLAB_MODE when set, else cloud when logged in,
    else local (a run without credentials never asks for a login or uses the network)."""
    if mode != "auto":
        return mode
    return os.environ.get("SWANLAB_MODE") or ("cloud" if has_api_key() else "local")


class SwanlabTracker:
    """A SwanLab experiment (see the module docstring for modes and resume)."""

    extra = SWANLAB

    def __init__(self, *, run_dir: Path, config: dict[str, Any], name: str, resume: bool) -> None:
        self._swanlab = _import_swanlab()
        self.options = backend_options(config, "swanlab")
        self.mode = resolve_mode(self.options.mode)
        if self.mode == "local":
            SWANBOARD.require()
        group = self.options.group or tracking_config(config).group
        self.tags = [*self.options.tags, *([group] if group else [])]
        self.config, self.name = config, name
        self.run_dir = Path(run_dir)
        self.logdir = Path(self.options.logdir) if self.options.logdir else self.run_dir / "swanlog"
        self.run: Any = None
        self.last_step = -1  # the last step the open experiment holds
        self.resume_step: int | None = None  # a resumed run whose experiment is not started yet: keep up to this
        self.seen_step = -1  # the last step given to this backend while no experiment is open
        self.failures = 0  # failed tries to start it (warned about at the first)
        self.retry_at = 0.0
        self.keys = KeyNames("metric", [SAMPLES_KEY], clean=swanlab_key, max_len=MAX_KEY, backend="SwanLab", logger=log)
        if not resume:
            self._start()
        # On resume, the first truncate (or log) starts the experiment that replays the kept steps.

    def _start(self, *, resumed: bool = False) -> None:
        from swanlab.data.run.main import SwanLabRun

        if SwanLabRun.is_started():
            raise RuntimeError("a SwanLab run is already open in this process (SwanLab keeps one per process)")
        self.logdir.mkdir(parents=True, exist_ok=True)
        settings = self._swanlab.Settings(
            hardware_monitor=self.options.hardware_monitor,
            requirements_collect=False,  # a pip freeze per run: slow, and the run folder's config says what ran
            log_proxy_type="none",  # roll's console stays roll's (SwanLab would re-route stdout and stderr)
        )
        self.run = self._swanlab.init(
            project=self.options.project or os.environ.get("SWANLAB_PROJ_NAME") or "roll",
            workspace=self.options.workspace,
            experiment_name=self.name,
            tags=[*self.tags, *(["resumed"] if resumed else [])],
            config=redact_config(self.config),  # no credentials in SwanLab (roll_core.tracking: secrets)
            logdir=str(self.logdir),
            mode=self.mode,
            settings=settings,
        )
        self.last_step = -1
        self._save_state()

    def _save_state(self) -> None:
        if self.run is None or self.mode == "disabled":
            return
        state = {"run_dir": str(Path(self.run.public.run_dir).resolve()), "last_step": self.last_step}
        tmp = self.logdir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.logdir / STATE_FILE)  # a crash mid-write keeps the previous record

    def _replay(self, last_step: int) -> None:
        """Log what the run folder's own files hold up to `last_step` into the fresh experiment."""
        samples = kept_samples(self.run_dir, last_step)
        for step, metrics in kept_metrics(self.run_dir, last_step):
            self.log(step, metrics)
            if step in samples:
                self.samples(step, samples.pop(step))

    def truncate(self, last_step: int) -> None:
        """Keep the open experiment when it holds nothing after `last_step`; else (and on resume) a new experiment
        replays steps 0..last_step (see the module docstring)."""
        if self.run is not None:
            if self.last_step <= last_step:
                return
            self._finish()
        self.resume_step = last_step if self.resume_step is None else min(self.resume_step, last_step)
        self.seen_step = max(self.seen_step, last_step)
        self._open(last_step)

    def _open(self, upto: int) -> bool:
        """Start a resumed run's experiment and replay steps 0..`upto`; False (warned at the first failure) when
        SwanLab's cloud does not answer: the steps wait in metrics.jsonl."""
        try:
            self._start(resumed=True)
        except Exception as exc:
            if not _unreachable(exc):
                raise
            wait = schedule_retry(self, exc, RETRY_S, MAX_RETRY_S)
            if wait is not None:
                log.warning(
                    "SwanLab did not answer (%s): this resumed run goes on without it; its experiment is started, "
                    "and sent its steps from metrics.jsonl, after %.0f s",
                    describe_failure(exc),
                    wait,
                )
            return False
        self.resume_step = None
        self._replay(upto)
        return True

    def _ensure_run(self, step: int) -> bool:
        """Whether an experiment is open to log `step`; a resumed run's is started here when `truncate` did not (it
        was not called, or SwanLab did not answer: tried again once `retry_at` has passed)."""
        if self.run is not None:
            return True
        if self.resume_step is None:  # a resumed run logged without truncating first: keep what precedes this step
            self.resume_step = step - 1
        self.seen_step = max(self.seen_step, step)
        return time.monotonic() >= self.retry_at and self._open(step - 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Log the metrics at SwanLab step `step`."""
        if not self._ensure_run(step):
            return  # metrics.jsonl holds the step: sent when the experiment starts
        if metrics:
            names = self.keys.names_of(metrics)  # (a name SwanLab refuses raised into the training loop)
            self.run.log({names[k]: v for k, v in metrics.items()}, step=step)
        self.last_step = max(self.last_step, step)
        self._save_state()

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Log the rows as the `samples` text column at `step`: each row as JSON, its reward as caption."""
        if not self.options.log_samples or not rows or not self._ensure_run(step):
            return  # (samples.jsonl holds the rows: sent when the experiment starts)
        texts = [
            self._swanlab.Text(json.dumps(row, ensure_ascii=False), caption=f"reward {row.get('reward')}")
            for row in rows
        ]
        self.run.log({SAMPLES_KEY: texts}, step=step)
        self.last_step = max(self.last_step, step)
        self._save_state()

    def _finish(self, failed: bool = False) -> None:
        run, self.run = self.run, None
        if not failed:
            run.finish()
            return
        from swanlab import swanlab_settings
        from swanlab.data.run.helper import SwanLabRunState

        # SwanLab 0.6 hands a crashed run's error to its callbacks (the local dashboard's status, the backup file's
        # `success` that `swanlab sync` uploads) only while its console proxy covers stderr, and their status is
        # "error given": with roll's proxy off, a CRASHED run read as successful everywhere but the cloud. The
        # setting is read only at init and here, and `finish` resets SwanLab's settings after.
        settings = swanlab_settings.get_settings()
        swanlab_settings.set_settings(settings.model_copy(update={"log_proxy_type": "stderr"}))
        try:
            run.finish(state=SwanLabRunState.CRASHED, error=_failure_text())
        except BaseException:
            swanlab_settings.set_settings(settings)
            raise

    def close(self, failed: bool | None = None) -> None:
        """Finish the experiment (idempotent), CRASHED when `failed` (None: whether an exception propagates, for a
        caller that does not say; SwanLab showed a failed run as successful). A resumed run whose experiment never
        started tries once more."""
        if failed is None:
            failed = sys.exc_info()[0] is not None
        if self.run is None and self.resume_step is not None and not self._open(self.seen_step):
            log.error(
                "SwanLab did not answer: this attempt's steps (up to %d) are in no SwanLab experiment; a resume of "
                "this run sends them from metrics.jsonl",
                self.seen_step,
            )
        self.resume_step = None
        if self.run is not None:
            self._finish(failed)


def _failure_text() -> str:
    """The error SwanLab records with a crashed run: the exception propagating (credentials redacted), if any."""
    exc = sys.exc_info()[1]
    return "the roll run failed" if exc is None else redact_text(f"{type(exc).__name__}: {exc}")


def _unreachable(exc: BaseException) -> bool:
    """Whether SwanLab's cloud did not answer (connection refused, a timeout, a 5xx), as opposed to a refusal."""
    from swanlab.error import ApiError, NetworkError

    if isinstance(exc, ApiError):
        status = getattr(exc.resp, "status_code", None)
        return status is None or status >= 500
    return isinstance(exc, (OSError, NetworkError))  # (requests' ConnectionError and Timeout are OSErrors)


def read_local_run(run_dir: str | Path) -> dict[str, Any]:
    """A SwanLab experiment folder (`<logdir>/run-*`) read with SwanLab's own reader of its backup file (what
    `swanlab sync` uploads: swanlab.log.backup): {"project", "name", "tags", "config", "history": {step: {key:
    value}}, "samples": {step: [row, ...]}, "success"}."""
    import yaml

    _import_swanlab()
    from swanlab.log.backup import BackupHandler
    from swanlab.log.backup.datastore import DataStore
    from swanlab.log.backup.models import ModelsParser

    run_dir = Path(run_dir)
    store = DataStore()
    store.open_for_scan(str(run_dir / BackupHandler.BACKUP_FILE))
    with ModelsParser() as parser:
        for record in store:
            if record is not None:
                parser.parse_record(record)
        _, project, experiment, _, runtime, _, scalars, medias, footer = parser.get_parsed()
    history: dict[int, dict[str, float]] = {}
    for scalar in scalars:
        history.setdefault(scalar.step, {})[scalar.key] = scalar.metric["data"]
    samples: dict[int, list[dict[str, Any]]] = {}
    for media in medias:
        if media.key == SAMPLES_KEY:
            samples.setdefault(media.step, []).extend(json.loads(text) for text in media.metric["data"])
    config_file = run_dir / "files" / (runtime.config_filename or "config.yaml")
    wrapped = yaml.safe_load(config_file.read_text()) if config_file.exists() else {}
    return {
        "project": project.name,
        "name": experiment.name,
        "tags": list(experiment.tags or []),
        "config": {k: v["value"] for k, v in (wrapped or {}).items()},  # SwanLab stores {desc, sort, value}
        "history": history,
        "samples": samples,
        "success": bool(footer and footer.success),
    }
