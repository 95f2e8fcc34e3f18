"""`pipeline.trackers=[wandb]`: a Weights & Biases run per roll run (the `roll-core[wandb]` extra).

Options: `tracking.wandb` (roll_core.config.tracking.WandbConfig). The run is `wandb.init(project, entity, name=the
run name, group=tracking.wandb.group or tracking.group, config=the resolved config with credentials redacted
(roll_core.tracking.redact_config), dir=<run>)`, so W&B's files land in `<run>/wandb/`. Mode `auto` (the
default) is online only when W&B can authenticate (WANDB_API_KEY, or a `wandb login` in ~/.netrc) or WANDB_MODE
says otherwise; else offline: nothing leaves the machine, and
`wandb sync <run>/wandb/offline-run-*` uploads later. Metrics are logged at the trainer's step (W&B's own step);
samples as a `samples` table (step, prompt, response, reward, ...) at their step. A metric named as W&B's own
(RESERVED: W&B dropped `_step` and overwrote `_runtime` without a word) or the table, or named "" (dropped), is
logged under another name, with a warning (roll_core.trackers.mlflow_keys.KeyNames: the name and a suffix).

Resume. `<run>/wandb/roll-run.json` records the W&B run id and the last step W&B holds, written before a step is
handed to W&B (`run.log`): a kill between the two leaves it a step ahead of W&B, never behind. Ahead, the resume
from the step before starts a new W&B run that replays the history (below): a W&B run more, no value lost or
stale. Behind (it was written after), the resume continued the W&B run and redid a step W&B held: W&B drops a step
below its current one, or merges it into the stale row. W&B history cannot be deleted (its "rewind" is a private
preview), so `truncate(last_step)` on a resumed run does one of two things:
- W&B holds nothing after `last_step` (the checkpoint was at the last logged step, as after a preemption):
  the same W&B run id is resumed (`resume="allow"`) and continues, sent first the steps up to `last_step` it
  lacks (an attempt that ran without wandb) from metrics.jsonl; nothing is lost or duplicated.
- W&B holds steps after `last_step` (a crash between checkpoints; the run redoes them, with other values): the
  same id would keep the stale values and W&B would drop the redone ones (its steps only increase), so a new
  W&B run is started (same name and group, tag `resumed`, config `roll_resumed_from=<old id>`) that replays steps
  0..last_step from metrics.jsonl and samples.jsonl, then continues. The old run stays in W&B, as it was.
The same happens when a resumed run adds wandb to its trackers (no earlier W&B run): the history is replayed.

Network failures. A new run needs W&B to answer `wandb.init` (a wrong URL or key fails before training; once open,
W&B's own service buffers and resends). A resumed run (a preemption, a restart after a fault) whose W&B does not
answer (wandb.errors.CommError, after W&B's `init_timeout`, WANDB_INIT_TIMEOUT) goes on without it: a warning says
so, and the W&B run is opened (continued or replaced, as above) at a later log once RETRY_S has passed (doubling up
to MAX_RETRY_S, as each try holds the step up to `init_timeout`), then sent the steps it lacks from metrics.jsonl;
`close()` tries once more, and an error says that a later resume sends what W&B still lacks (roll-run.json still
names what W&B holds).
"""

from __future__ import annotations

import json
import logging
import math
import netrc
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from roll_core.config.tracking import WANDB, backend_options, tracking_config
from roll_core.trackers.background import describe_failure, schedule_retry
from roll_core.trackers.mlflow_keys import KeyNames
from roll_core.trackers.replay import kept_metrics, kept_samples
from roll_core.tracking import redact_config

log = logging.getLogger(__name__)
#: The run folder's record of its W&B run: {"id": ..., "last_step": ...}.
STATE_FILE = "roll-run.json"
#: Where samples go in W&B.
SAMPLES_KEY = "samples"
#: Seconds before a resumed run whose W&B did not answer tries to open its W&B run again (doubling per failure).
RETRY_S = 300.0
MAX_RETRY_S = 3600.0
#: History keys W&B writes itself (a metric so named was lost), and the sample table's.
RESERVED = ("_step", "_runtime", "_timestamp", "_wandb", SAMPLES_KEY)


def wandb_key(key: str) -> str:
    """`key` as W&B keeps it: an empty (or blank) name, which W&B dropped, is `_`; others as they are."""
    return key if key.strip() else "_"


def has_api_key() -> bool:
    """Whether W&B could authenticate here: WANDB_API_KEY, or a ~/.netrc entry for the W&B host (`wandb login`)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def resolve_mode(mode: str) -> str:
    """`tracking.wandb.mode` as W&B takes it: `auto` is WANDB_MODE when set, else online with an API key, else
    offline (a run without credentials never tries the network)."""
    if mode != "auto":
        return mode
    return os.environ.get("WANDB_MODE") or ("online" if has_api_key() else "offline")


def _cell(value: Any) -> Any:
    """A table cell: scalars as they are, anything else as its JSON text."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return json.dumps(value)


class WandbTracker:
    """A W&B run (see the module docstring for modes and resume)."""

    extra = WANDB

    def __init__(self, *, run_dir: Path, config: dict[str, Any], name: str, resume: bool) -> None:
        WANDB.require()
        import wandb

        self._wandb = wandb
        self.options = backend_options(config, "wandb")
        self.group = self.options.group or tracking_config(config).group
        self.config, self.name = config, name
        self.run_dir = Path(run_dir)
        self.state_path = self.run_dir / "wandb" / STATE_FILE
        self.mode = resolve_mode(self.options.mode)
        self.run: Any = None
        self.closed = False
        self.last_step = -1  # the last step the current W&B run holds
        # A resumed run whose W&B run is not open yet: the recorded run is valid up to this step (`_open`).
        self.resume_step: int | None = None
        self.seen_step = -1  # the last step given to this backend while its run is not open
        self.failures = 0  # failed tries to open it (warned about at the first)
        self.retry_at = 0.0
        self.keys = KeyNames("metric", RESERVED, clean=wandb_key, max_len=1000, backend="W&B", logger=log)
        if not resume:
            self._start()
        # On resume, the first truncate (or log) decides: continue the recorded W&B run or start a new one.

    def _start(self, *, resume_id: str | None = None, holds: int = -1, resumed_from: str | None = None) -> None:
        """Open a W&B run: a new one, or the recorded `resume_id` holding steps up to `holds`."""
        wandb = self._wandb
        config = redact_config(self.config)  # no credentials in W&B (roll_core.tracking: secrets)
        tags = list(self.options.tags)
        if resumed_from is not None:
            config["roll_resumed_from"] = resumed_from
            tags.append("resumed")
        self.run = wandb.init(
            project=self.options.project or os.environ.get("WANDB_PROJECT") or "roll",
            entity=self.options.entity,
            name=self.name,
            group=self.group,
            tags=tags,
            job_type=self.options.job_type,
            notes=self.options.notes,
            config=config,
            dir=self.options.dir or str(self.run_dir),
            mode=self.mode,
            id=resume_id,
            resume="allow" if resume_id else None,
            reinit="create_new",  # several roll runs in one process (tests, notebooks) each get their own
        )
        if self.mode == "offline" and resume_id is None:
            log.info("W&B is offline (no API key): upload later with `wandb sync %s`", Path(self.run.dir).parent)
        self.last_step = holds
        self._save_state()

    def _save_state(self) -> None:
        if self.run is None or self.mode == "disabled":
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"id": self.run.id, "last_step": self.last_step}))
        tmp.replace(self.state_path)  # a crash mid-write keeps the previous record

    def _replay(self, last_step: int, after: int = -1) -> None:
        """Log what the run folder's own files hold of the steps in (`after`, `last_step`] into the W&B run."""
        samples = kept_samples(self.run_dir, last_step, after)
        for step, metrics in kept_metrics(self.run_dir, last_step, after):
            self.log(step, metrics)
            if step in samples:
                self.samples(step, samples.pop(step))

    def truncate(self, last_step: int) -> None:
        """Continue the recorded W&B run when it holds nothing after `last_step`, else start a new one replaying
        steps 0..last_step (W&B cannot delete steps; see the module docstring). A W&B that does not answer is warned
        about, and the run is opened at a later log."""
        if self.run is not None:  # truncating a live run: the same decision, from the record it keeps current
            if self.last_step <= last_step:
                return
            self._finish()
        self.resume_step = last_step if self.resume_step is None else min(self.resume_step, last_step)
        self.seen_step = max(self.seen_step, last_step)
        self._open(last_step)

    def _open(self, upto: int) -> bool:
        """Open a resumed run's W&B run (the recorded one when it holds nothing after `resume_step`, else a new one)
        and send it the steps up to `upto` it lacks from the run folder's files; False (warned at the first failure)
        when W&B does not answer: the steps wait in metrics.jsonl."""
        assert self.resume_step is not None
        state = json.loads(self.state_path.read_text()) if self.state_path.exists() else None
        holds = None if state is None or int(state["last_step"]) > self.resume_step else int(state["last_step"])
        try:
            if state is not None and holds is not None:
                self._start(resume_id=str(state["id"]), holds=holds)
            else:
                self._start(resumed_from=None if state is None else str(state["id"]))
        except (self._wandb.errors.CommError, TimeoutError) as exc:
            if isinstance(exc, self._wandb.errors.AuthenticationError):
                raise  # a refused key: trying again would not help
            self._unreachable(exc)
            return False
        self.resume_step = None
        self._replay(upto, after=-1 if holds is None else holds)  # (continued: steps an attempt without W&B logged)
        return True

    def _unreachable(self, exc: BaseException) -> None:
        """Count a failed open, set when to try again, warn at the first failure."""
        if self._wandb.run is None:  # W&B's service keeps a failed run's id "in use": the next try would fail on it
            try:
                self._wandb.teardown()
            except Exception as error:  # the next try says what is wrong, if anything
                log.debug("wandb.teardown after a failed init: %s", error)
        wait = schedule_retry(self, exc, RETRY_S, MAX_RETRY_S)
        if wait is not None:
            log.warning(
                "W&B did not answer (%s): this resumed run goes on without it; its W&B run is opened, and sent its "
                "steps from metrics.jsonl, after %.0f s",
                describe_failure(exc),
                wait,
            )

    def _ensure_run(self, step: int) -> bool:
        """Whether the W&B run is open to log `step`; a resumed run's is opened here when `truncate` did not (it
        was not called, or W&B did not answer: tried again once `retry_at` has passed)."""
        if self.closed:
            raise RuntimeError("WandbTracker used after close()")
        if self.run is not None:
            return True
        if self.resume_step is None:  # a resumed run logged without truncating first: keep what precedes this step
            self.resume_step = step - 1
        self.seen_step = max(self.seen_step, step)
        return time.monotonic() >= self.retry_at and self._open(step - 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Log the metrics at W&B step `step`."""
        if not self._ensure_run(step):
            return  # metrics.jsonl holds the step: sent when the W&B run opens
        names = self.keys.names_of(metrics)  # (W&B dropped a metric named as its own, without a word)
        self._handing(step)
        self.run.log({names[k]: v for k, v in metrics.items()}, step=step)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Log the rows as the `samples` table at `step` (columns: step, then every key in the rows' order)."""
        if not self.options.log_samples or not rows or not self._ensure_run(step):
            return  # (samples.jsonl holds the rows: sent when the W&B run opens)
        columns = ["step", *dict.fromkeys(k for row in rows for k in row if k != "step")]
        data = [[step, *(_cell(row.get(c)) for c in columns[1:])] for row in rows]
        table = self._wandb.Table(columns=columns, data=data)
        self._handing(step)
        self.run.log({SAMPLES_KEY: table}, step=step)

    def _handing(self, step: int) -> None:
        """Record that W&B may hold `step`, before it is handed over (module docstring, Resume: a kill between
        the two leaves the record ahead of W&B, never behind)."""
        if step > self.last_step:
            self.last_step = step
            self._save_state()

    def _finish(self, failed: bool = False) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else None)  # None: W&B's default, 0
            self.run = None

    def close(self, failed: bool | None = None) -> None:
        """Finish the W&B run (idempotent), with exit code 1 when `failed` (W&B showed a failed run `finished`;
        None: whether an exception propagates, for a caller that does not say). A resumed run whose W&B run never
        opened tries once more to open it and send its steps."""
        if failed is None:
            failed = sys.exc_info()[0] is not None
        if self.run is None and self.resume_step is not None and not self.closed and not self._open(self.seen_step):
            log.error(
                "W&B did not answer: this attempt's steps (up to %d) are not in W&B; a resume of this run sends them "
                "from metrics.jsonl",
                self.seen_step,
            )
        self._finish(failed)
        self.closed = True
