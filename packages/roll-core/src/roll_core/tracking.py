"""Run tracking: metrics JSONL, the resolved config, sample completions and curve plots, plus tracker plugins.

Everything of the core lands in the run's output folder: `metrics.jsonl` (one JSON object per step; the loop, the
summary and the tests read it), `config.yaml`, `samples.jsonl` (a few decoded completions per step, bounded by
`tracking.samples_per_step` and `tracking.sample_max_chars`) and `curves.png` (the collector's metrics, e.g. reward,
accuracy and held-out accuracy, and the trainer's `AGREEMENT_PLOT_KEYS` where a run logs them, against step; at most
four panels a row). Other sinks are backends (`TrackerBackend`,
roll_core.interfaces.tracking) named in `pipeline.trackers` and loaded from the `roll.trackers` entry-point group:
roll-core's own backends (roll_core.trackers: `tensorboard`, `jsonl`, `wandb`) are registered exactly as out-of-tree
plugins are. Several run at once (`pipeline.trackers=[tensorboard,wandb]`); each reads its options from the config's
`tracking` node (roll_core.config.tracking), and the run's name in them is `tracking.run_name`, else `experiment`.
`trackers.json` records which backends were away while a resume redid steps (roll_core.trackers._away): a later
resume with them drops their stale copies of those steps and resends the run folder's.

Writing never raises into the training loop for a plot failure; a metric that is not a finite number is logged as
null in JSONL and left out of what backends receive; a value that is not a number is left out, warned about once
per key; a key that is not a str is a TypeError before anything is recorded (roll_core.tracking_values). A
backend's own errors propagate (see its contract).

Secrets. Backends receive the config as it is (a backend may need its own credentials, e.g. an MLflow tracking URI
with `user:token@`), and redact what they send to a shared service with `redact_config` (params, the W&B/SwanLab
config, the uploaded config.yaml), what they write or say with `redact_text` (run.json, warnings, errors), and the
library exception an error of theirs is raised from with `redact_exception` (a traceback prints its text too). The
run folder's own config.yaml keeps the config unredacted: it is the user's file, and a resume reads it.
"""

from __future__ import annotations

import inspect
import io
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from roll_core.interfaces.tracking import SampleTrackerBackend, TrackerBackend
from roll_core.trackers._away import AwayRecord, keeps_records
from roll_core.trackers.jsonl import JsonlTracker
from roll_core.trackers.replay import kept_metrics, kept_samples
from roll_core.trackers.tensorboard import TensorBoardTracker
from roll_core.tracking_values import MetricValues, json_value

__all__ = [
    "AGREEMENT_PLOT_KEYS",
    "DEFAULT_TRACKERS",
    "JsonlTracker",
    "SampleTrackerBackend",
    "TensorBoardTracker",
    "Tracker",
    "TrackerBackend",
    "TrackerCloseError",
    "close_backends",
    "open_backends",
    "redact_config",
    "redact_exception",
    "redact_text",
]

log = logging.getLogger(__name__)

#: The trainer's rollout/training agreement metrics, drawn in curves.png beside the collector's wherever a run
#: logs them (docs/concepts/rollout-agreement.md): a gap that grows, or a correction masking more and more tokens,
#: is what comes before a run drifts, and is seen here without a tracker backend.
AGREEMENT_PLOT_KEYS: tuple[str, ...] = ("actor/train_infer_logprob_diff", "actor/correction/masked_fraction")

#: Panels drawn on a log scale (when every value is positive): the gap spans 1e-6 (fp32) to 1e-1 (FP8).
_LOG_SCALE = frozenset({"actor/train_infer_logprob_diff"})

#: The run folder's plot of its history (`Tracker.plot`), embedded in report.md.
CURVES = "curves.png"
#: Panels per row of curves.png.
_PANELS_PER_ROW = 4
#: curves.png is redrawn at most this often (seconds) unless forced: a figure costs ~0.4 s on a small CPU, a large
#: share of a fast step (SFT on a small model), and was drawn after every step.
PLOT_EVERY_S = 30.0

#: Backends a Tracker opens when none are named (pipeline.trackers' default).
DEFAULT_TRACKERS: tuple[str, ...] = ("tensorboard",)

#: What a redacted value reads.
REDACTED = "***"
#: The userinfo (`user:password@`) of a URL anywhere in a text.
_URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s?#]+@")
#: A config key (lower case, `-`/`.`/space as `_`) whose value is a credential: `hf_token`, `api_key`, `X-API-Key`,
#: `client_secret`, `password`, `Authorization`... (`max_tokens`, `tokenizer` and `ray_token_auth` are not).
_SECRET_KEY = re.compile(
    r"token$|api_?key|auth_?key|access_?key|private_?key|secret|passw(or)?d|authori[sz]ation|credential|cookie"
)


def redact_text(text: str) -> str:
    """`text` with the userinfo of every URL in it replaced by REDACTED (`https://user:tok@host/x` reads
    `https://***@host/x`): for a URI written to a file or put in a message."""
    return _URL_USERINFO.sub(rf"\g<scheme>{REDACTED}@", text)


class RedactedError(Exception):
    """Stands in for a library's exception whose text held a credential (`redact_exception`): its message is
    `<module>.<type>: <the text, redacted>`."""


def redact_exception(exc: BaseException, _seen: dict[int, BaseException] | None = None) -> BaseException:
    """`exc` fit to be chained (`raise ... from redact_exception(exc)`) and printed: itself when no text in its chain
    (causes and contexts) holds a URL's userinfo, else a `RedactedError` with its traceback and its text through
    `redact_text`, whose causes and contexts are redacted the same way. A traceback prints the whole chain, so the
    `user:token@` in a library's message (MLflow's "API request to http://user:token@host/...") was shown
    however our own message was redacted."""
    seen = {} if _seen is None else _seen
    if id(exc) in seen:  # a chain that loops back
        return seen[id(exc)]
    seen[id(exc)] = exc
    cause = None if exc.__cause__ is None else redact_exception(exc.__cause__, seen)
    context = None if exc.__context__ is None else redact_exception(exc.__context__, seen)
    text = str(exc)
    if redact_text(text) == text and cause is exc.__cause__ and context is exc.__context__:
        return exc
    stand_in = RedactedError(f"{type(exc).__module__}.{type(exc).__qualname__}: {redact_text(text)}")
    stand_in = stand_in.with_traceback(exc.__traceback__)
    stand_in.__cause__, stand_in.__context__ = cause, context
    stand_in.__suppress_context__ = exc.__suppress_context__
    seen[id(exc)] = stand_in
    return stand_in


#: Keys ending in `token` that name a vocabulary token, not a credential (`eos_token`, `image_token`...).
_VOCAB_TOKEN = re.compile(r"(^|_)(bos|eos|pad|unk|sep|cls|mask|stop|special|image|video|audio|vision|think)_token$")


def _secret_key(key: Any) -> bool:
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(key)).lower()
    name = re.sub(r"[^a-z0-9]+", "_", name)
    if name.endswith("_env") or _VOCAB_TOKEN.search(name):  # `api_key_env` names a variable; `eos_token` a token
        return False
    return bool(_SECRET_KEY.search(name))


def redact_config(config: Any) -> Any:
    """A copy of a config (plain containers) fit to send to a shared tracking service: the value of every key named
    like a credential (`_SECRET_KEY`, e.g. `hf_token`, `api_key`, `secret`, `password`, a header `X-API-Key` or
    `Authorization`; not `*_env`, which names a variable) is REDACTED, and URLs in strings lose their userinfo
    (`redact_text`). The run folder's config.yaml is not redacted (the user's own file)."""
    if isinstance(config, dict):
        return {k: REDACTED if _secret_key(k) and v is not None else redact_config(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [redact_config(v) for v in config]
    return redact_text(config) if isinstance(config, str) else config


def open_backends(
    names: Sequence[str], run_dir: Path, config: dict[str, Any], name: str, resume: bool
) -> list[TrackerBackend]:
    """Build the `roll.trackers` backends `names` names, in order; closes the built ones if a later one fails.

    Raises:
        ValueError: a name is given twice.
        roll_core.registry.PluginNotFoundError: a name is not installed (the message lists what is).
        roll_core.errors.MissingExtraError: a backend's optional dependency is missing (one line naming the extra).
    """
    from roll_core import registry

    if isinstance(names, str):  # "tensorboard" would iterate as letters
        raise TypeError(f"trackers must be a list of names, not the string {names!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"trackers {list(names)} name a backend twice")
    backends: list[TrackerBackend] = []
    try:
        for tracker in names:
            cls = registry.load("roll.trackers", tracker)
            backends.append(cls(run_dir=run_dir, config=config, name=name, resume=resume))
    except BaseException:
        # every built one is closed, and the construction error is the one raised: a close that raised here skipped
        # the backends after it and replaced the error that says why the run could not start
        closing = close_backends(list(zip(names, backends)), failed=True)
        if closing is not None:
            log.error("%s (while the trackers' start failed)", closing)
        raise
    return backends


def close_backend(backend: TrackerBackend, failed: bool) -> None:
    """`backend.close(failed=failed)` when its `close` takes `failed` (roll's own backends), else `backend.close()`
    (a plugin written before it: it may still read sys.exc_info)."""
    try:
        takes_failed = "failed" in inspect.signature(backend.close).parameters
    except (TypeError, ValueError):  # a close without a signature Python can read (a builtin): the plain call
        takes_failed = False
    if takes_failed:
        backend.close(failed=failed)  # type: ignore[call-arg]
    else:
        backend.close()


class TrackerCloseError(RuntimeError):
    """One or more tracker backends raised in `close` (the others were closed); the message names each and its
    error, and the first backend's error is its cause."""


def close_backends(named: Sequence[tuple[str, TrackerBackend]], failed: bool) -> BaseException | None:
    """Close every backend (`close_backend`), whatever the others raise; returns None when all closed, else the one
    error to report: a `TrackerCloseError` naming every backend whose close raised (a plugin's error said neither
    which backend failed nor that the others were closed, and a second backend's error was lost), or an interrupt
    (KeyboardInterrupt, SystemExit) as it is, with the other failures logged."""
    failures: list[tuple[str, BaseException]] = []
    for name, backend in named:
        try:
            close_backend(backend, failed)
        except BaseException as exc:  # the others still close (their final flush); reported together below
            failures.append((name, exc))
    if not failures:
        return None
    said = "; ".join(f"{name!r}: {type(exc).__name__}: {exc}" for name, exc in failures)
    others = f" ({len(named) - len(failures)} other backend(s) closed)" if len(named) > len(failures) else ""
    message = redact_text(f"tracker backend(s) failed to close{others}: {said}")
    interrupt = next((exc for _, exc in failures if not isinstance(exc, Exception)), None)
    if interrupt is not None:  # a second Ctrl-C stays what it is; what else failed is said here, once
        if len(failures) > 1:
            log.error("%s", message)
        return interrupt
    error = TrackerCloseError(message)
    error.__cause__ = redact_exception(failures[0][1])
    return error


def _backend_name(backend: TrackerBackend, names: dict[int, str]) -> str:
    """The `pipeline.trackers` name a backend was opened under, else its class's name (one added by hand)."""
    return names.get(id(backend), type(backend).__name__)


class Tracker:
    """Writes metrics.jsonl, config.yaml and samples.jsonl, plots curves, and forwards to the tracker backends."""

    def __init__(
        self,
        out_dir: str | Path,
        config_yaml: str | None = None,
        trackers: Sequence[str] = DEFAULT_TRACKERS,
        resume: bool = False,
        name: str | None = None,
    ) -> None:
        """Open the run folder's files and the backends.

        Args:
            out_dir: the run folder (created if missing).
            config_yaml: the resolved config; written to config.yaml and given to backends as containers.
            trackers: `roll.trackers` entry-point names (pipeline.trackers); `()` writes only the core files.
            resume: keep metrics.jsonl's and samples.jsonl's records (a later `truncate` drops the steps the run
                redoes); otherwise earlier ones in the folder are removed.
            name: the run name backends see; default: the config's `tracking.run_name`, else its `experiment`, else
                the folder's name.
        """
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {}
        if config_yaml is not None:
            # whole or not at all: a resume reads it back, and a kill mid-write left it cut
            replace_file(self.dir / "config.yaml", config_yaml)
            from omegaconf import OmegaConf

            parsed = OmegaConf.to_container(OmegaConf.create(config_yaml))
            config = parsed if isinstance(parsed, dict) else {}
        self.metrics_path = self.dir / "metrics.jsonl"
        self._plotted_at: float | None = None  # time.monotonic() of the last curves.png
        self._values = MetricValues()  # checks and converts `log`'s metrics, warning once per key
        if not resume:  # an earlier run's records in this folder (a run stopped before its first checkpoint)
            # curves.png too: report.md embeds it, and a run that ended before its first plot showed the earlier
            # run's curves beside "No metrics were logged"
            for stale in (self.metrics_path, self.dir / "samples.jsonl", self.dir / CURVES):
                stale.unlink(missing_ok=True)
        self.history: list[dict[str, Any]] = self.read_metrics(self.metrics_path) if resume else []
        from roll_core.config.tracking import tracking_config

        options = tracking_config(config)
        run_name = name or options.run_name or str(config.get("experiment") or self.dir.name)
        self.samples_per_step, self.sample_max_chars = options.samples_per_step, options.sample_max_chars
        self.backends: list[TrackerBackend] = open_backends(trackers, self.dir, config, run_name, resume)
        self._names = {id(b): str(n) for n, b in zip(trackers, self.backends)}  # for messages about a backend
        # which backends missed steps redone while they were away (a resume without them): trackers.json
        recorded = [str(n) for n, b in zip(trackers, self.backends) if keeps_records(b)]
        self._away = AwayRecord(self.dir, recorded, resume)

    @staticmethod
    def read_metrics(path: str | Path) -> list[dict[str, Any]]:
        """All records of a metrics.jsonl (empty when the file is missing); see `read_records`."""
        return read_records(Path(path))

    def truncate(self, last_step: int) -> None:
        """Drop records after `last_step` (a resumed run re-does the steps after its checkpoint): metrics,
        samples, and each backend's (`TrackerBackend.truncate`); curves.png when it drew a dropped step (redrawn at
        the next `plot`). A backend that was away while an earlier attempt redid steps (trackers.json) is truncated
        before them instead, and sent the steps after them up to `last_step` from the run folder's files."""
        kept = [h for h in self.history if h["step"] <= last_step]
        if len(kept) < len(self.history):  # curves.png drew the dropped steps: gone until the next plot draws it
            (self.dir / CURVES).unlink(missing_ok=True)
            self._plotted_at = None
        self.history = kept
        _replace_text(self.metrics_path, "".join(json.dumps(h) + "\n" for h in self.history))
        samples = self.dir / "samples.jsonl"
        if samples.exists():
            keep = [row for row in read_records(samples) if row.get("step", 0) <= last_step]
            _replace_text(samples, "".join(json.dumps(row) + "\n" for row in keep))
        floors = self._away.truncate(last_step)
        for backend in self.backends:
            floor = floors.get(self._names.get(id(backend), ""), last_step)
            backend.truncate(floor)
            if floor < last_step:  # it holds stale steps after `floor`, redone while it was away: resent
                self._resend(backend, floor, last_step)
        self._away.caught_up(list(floors))

    def _resend(self, backend: TrackerBackend, after: int, last_step: int) -> None:
        """Log to `backend` the run folder's metrics (and samples) of the steps in (`after`, `last_step`]."""
        samples = kept_samples(self.dir, last_step, after) if isinstance(backend, SampleTrackerBackend) else {}
        for step, metrics in kept_metrics(self.dir, last_step, after):
            backend.log(step, metrics)
            if step in samples:
                backend.samples(step, samples.pop(step))  # type: ignore[attr-defined]

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append `step`'s numeric metrics to metrics.jsonl (NaN/inf, and an int past a float's range, as null) and
        pass the finite ones to backends.

        Numbers are Python, numpy or one-element torch values: integers as ints (a numpy count stays `3`, not
        `3.0`), others as floats, bools as 0.0/1.0; other values are not metrics and are left out, with a warning
        once per key (roll_core.tracking_values). Nothing of the step is recorded when a key is refused.

        Raises:
            TypeError: a key is not a str (it names the key and its type).
            ValueError: a metric is named `step` (it would relabel the record).
        """
        if "step" in metrics:
            raise ValueError("a metric may not be named 'step' (it is the record's step number)")
        clean = self._values.record(metrics)
        record = {"step": step, **clean}
        line = json.dumps(record) + "\n"  # (built before anything is kept: the history and the file agree)
        self.history.append(record)
        with open(self.metrics_path, "a") as f:
            f.write(line)
        finite = {k: v for k, v in clean.items() if v is not None}
        for backend in self.backends:
            backend.log(step, finite)

    def sync(self) -> None:
        """Force metrics.jsonl and samples.jsonl to disk (before a checkpoint: after a power cut a checkpoint of step
        N must not survive the metric records of the steps up to N, which a resumed run does not redo)."""
        for path in (self.metrics_path, self.dir / "samples.jsonl"):
            if path.exists():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Append decoded completions to samples.jsonl and pass them to backends that record samples.

        Values are written as strict JSON: numpy and one-element torch numbers as numbers, NaN/inf as null (a bare
        NaN token is not JSON; a numpy float raised TypeError), also inside lists and dicts. A row may hold neither
        `step` (it would relabel it) nor `rows_left_out`. What is kept is bounded (`tracking.samples_per_step`,
        `tracking.sample_max_chars`; see `bounded_samples`): the file grew by whatever the collectors passed.
        Backends receive the rows as written (plain Python values, NaN/inf as None)."""
        if any("step" in row for row in rows):
            raise ValueError("a sample row may not hold 'step' (it is the record's step number)")
        if any(LEFT_OUT in row for row in rows):
            raise ValueError(f"a sample row may not hold {LEFT_OUT!r} (it counts the step's rows left out)")
        rows = bounded_samples(rows, self.samples_per_step, self.sample_max_chars)
        if not rows:
            return
        # Backends get the rows as written, as a resume replays them: given the raw ones, W&B's and SwanLab's
        # json.dumps raised TypeError into the training loop on a numpy number (a reward, an episode's task row).
        rows = [json_value(row) for row in rows]
        # built whole before the file opens: a value json cannot write leaves no partial rows behind
        text = "".join(json.dumps({"step": step, **row}, allow_nan=False) + "\n" for row in rows)
        with open(self.dir / "samples.jsonl", "a") as f:
            f.write(text)
        for backend in self.backends:
            if isinstance(backend, SampleTrackerBackend):
                backend.samples(step, rows)

    def plot(
        self, keys: tuple[str, ...] = ("reward/mean", "reward/accuracy", "eval/accuracy"), force: bool = True
    ) -> Path | None:
        """Write curves.png with one panel per key present in the history (rows of `_PANELS_PER_ROW`). Unless
        `force`, at most once per `PLOT_EVERY_S` (the loop forces it at checkpoints and at the end); None when
        skipped or not written."""
        import time

        if not force and self._plotted_at is not None and time.monotonic() - self._plotted_at < PLOT_EVERY_S:
            return None
        self._plotted_at = time.monotonic()
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log.warning("matplotlib is not installed: no curves.png")
            return None
        path = self.dir / CURVES
        fig = None
        try:  # a picture is never worth a run: a full disk or a flaky network folder only costs the plot
            fig = curve_figure(self.history, keys)
            if fig is None:
                return None
            # whole or not at all: report.md embeds it, and a kill mid-savefig left a cut PNG in the run folder
            buf = io.BytesIO()
            fig.savefig(buf, dpi=110, format="png")
            replace_file(path, buf.getvalue())
        except Exception as exc:
            log.warning("curves.png not written: %s: %s", type(exc).__name__, exc)
            return None
        finally:
            if fig is not None:
                plt.close(fig)
        return path

    def close(self, failed: bool | None = None) -> None:
        """Close every backend once (idempotent: a failed run's cleanup may call it again); all are closed even
        when one raises, and one error naming each that raised is raised after. `failed`: whether the run failed
        (W&B, MLflow and SwanLab end their run failed); None, for a caller that does not know: whether an exception
        propagates. A caller that knows says so: a run that ended well inside someone's `except` (a retry) read as
        failed.

        Raises:
            TrackerCloseError: a backend's close raised (each such backend is named; the others were closed).
        """
        if failed is None:
            failed = sys.exc_info()[0] is not None
        backends, self.backends = self.backends, []
        error = close_backends([(_backend_name(b, self._names), b) for b in backends], failed)
        if error is not None:
            raise error


def _is_accuracy(key: str) -> bool:
    """Whether `key` is an accuracy (a fraction of 0..1): `reward/accuracy`, `eval/<domain>/accuracy`,
    `dpo/reward_accuracy`."""
    return key.rsplit("/", 1)[-1].endswith("accuracy")


def curve_figure(history: Sequence[dict[str, Any]], keys: Sequence[str]):  # -> matplotlib Figure | None
    """The figure of curves.png: one panel per key with a value in `history` (in `keys`' order), value against
    step (whole-number ticks), `_PANELS_PER_ROW` panels a row, `_LOG_SCALE` keys on a log axis where every value is
    positive, an accuracy (a key whose last part ends in `accuracy`) on the axis 0..1 when every value is in it;
    None when no key has a value. Needs matplotlib (the caller checks)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, MaxNLocator

    present = [k for k in keys if any(h.get(k) is not None for h in history)]
    if not present:
        return None
    cols = min(len(present), _PANELS_PER_ROW)
    rows = -(-len(present) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(present) :]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, present):
        pts = [(h["step"], h[key]) for h in history if h.get(key) is not None]
        # unclipped: a point at accuracy 0 or 1 sits on the axis' edge and was drawn half
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, clip_on=False)
        # steps are whole: a short run's axis was ticked 1.5, 2.5 (one step alone: its own tick, in an axis of +-0.05)
        steps = sorted({p[0] for p in pts})
        ax.xaxis.set_major_locator(FixedLocator(steps) if len(steps) == 1 else MaxNLocator(integer=True))
        if key in _LOG_SCALE and all(p[1] > 0 for p in pts):
            ax.set_yscale("log")
        elif _is_accuracy(key) and all(0.0 <= p[1] <= 1.0 for p in pts):
            # on its full range: a flat 0 spanned -0.04..0.04, a small change filled the panel like a large one
            ax.set_ylim(0.0, 1.0)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


#: The key of a step's last kept sample row that counts the rows `tracking.samples_per_step` left out.
LEFT_OUT = "rows_left_out"


def bounded_samples(rows: list[dict[str, Any]], max_rows: int, max_chars: int) -> list[dict[str, Any]]:
    """The first `max_rows` of `rows` (the last one kept gets `rows_left_out`: how many were dropped), each text value
    (inside lists and dicts too) longer than `max_chars` cut to its first and last halves around a marker saying how
    many characters were cut; `max_chars=0`: texts kept whole. The rows are copies where anything changed."""
    kept = [_cut_texts(row, max_chars) if max_chars else row for row in rows[:max_rows]]
    if kept and len(rows) > len(kept):
        kept[-1] = {**kept[-1], LEFT_OUT: len(rows) - len(kept)}
    return kept


def _cut_texts(v: Any, max_chars: int) -> Any:
    if isinstance(v, str):
        if len(v) <= max_chars:
            return v
        head, tail = max_chars - max_chars // 2, max_chars // 2
        return f"{v[:head]}[... {len(v) - head - tail} characters cut ...]{v[len(v) - tail :] if tail else ''}"
    if isinstance(v, dict):
        return {k: _cut_texts(x, max_chars) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_cut_texts(x, max_chars) for x in v]
    return v


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON records of a .jsonl file the tracker appends to ([] when missing). A half-written last line (a
    process killed mid-write: OOM, preemption, a full disk) is dropped with a warning, as the resume that reads it
    rewrites the file; an unreadable line before the last is a ValueError naming the file and the line."""
    if not path.exists():
        return []
    lines = [(i, line) for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    out = []
    for k, (i, line) in enumerate(lines):
        try:
            out.append(json.loads(line))
        except ValueError as exc:
            if k < len(lines) - 1:
                raise ValueError(f"{path}:{i} is not a JSON record ({exc}): fix or remove that line") from None
            log.warning("%s: its last line (%d) is half-written (a process killed mid-write): dropped", path, i)
    return out


def _replace_text(path: Path, text: str) -> None:
    """Write `path` whole through a temporary file renamed over it: a crash mid-write (a resumed run truncating
    its history) leaves the old file, never half of the new one (written in place, the run's history was lost)."""
    replace_file(path, text)


def replace_file(path: str | Path, data: str | bytes) -> None:
    """Write `path` whole or not at all: `data` (text is written as UTF-8) goes to a temporary file beside it,
    synced, then renamed over it (os.replace). A crash mid-write leaves the old file (or none), never half of the
    new one; the temporary file is removed when the write fails. Used for the run's history (`_replace_text`), the run
    folder's config.yaml and curves.png, roll-eval's and the run's reports (report.md, comparison files, plots)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: two writers never share one
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
