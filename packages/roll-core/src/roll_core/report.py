"""`report.md`: a short human summary in every run's output folder (roll-train's and roll-eval's).

A training run's report (`write_run_report`, called by the loop when a run ends: finished, stopped by a signal, or
failed with an exception) holds: the status; a config summary (experiment, model, pipeline, algorithm and its key
hyper-parameters, engines, placement, batch and step counts, evaluation settings, seed); `curves.png` embedded when
the run drew it; the first, last and best value of the headline metrics read back from the run's `metrics.jsonl`
(training reward and accuracy, held-out accuracy per evaluation, losses of SFT / DPO / distillation), each as
`mean ± standard error` where its record logged one (`<key>_stderr`: the episode collectors' held-out
eval/success_rate and eval/accuracy, over the held-out episodes), wall time. The held-out accuracy's last value (and
the success rate's and reward's that come with it) is the last evaluation's own (roll_core.eval_history): one that had
no outcome (`eval/n` 0) shows `none` and why, not the earlier evaluation's value as the final model's; the config's
evaluation row counts the held-out problems that evaluation ran (`last_evaluation_size`), not its `eval/n` of 0;
the checkpoints on disk; and the exact commands to resume the run and to evaluate its checkpoints. The commands
repeat the launch's overrides when they are known (Hydra's `.hydra/overrides.yaml` in the run folder, or the
running Hydra job's); otherwise they say so. Writing a report never raises into the run: a failure is one warning.
The numbers come from metrics.jsonl as a resume leaves it (`read_history_counted`): an unreadable line is skipped
and the report says how many were; values under 1e-3 are shown in scientific notation, not as 0.0000.

roll-eval's report (`write_eval_report`) holds the call's settings, the warnings (checkpoints evaluated under other
settings than their run's; models scored on different problem sets, as comparison.md says), the comparison table,
the per-domain and per-difficulty accuracy, comparison.png and the files it wrote; for episodes (agentic tasks, agent
programs) one table whose rates read `mean ± standard error` over the episodes where the result has one
(`<rate>_stderr`). Problems a model was not scored on are listed per reason (`skipped_by_reason`: prompt longer
than model.max_prompt_length, prompt filling the engine's context, unreadable pictures), never under one.
Both reports are written whole or not at all (roll_core.tracking.replace_file: a kill mid-write leaves no cut file).
"""

from __future__ import annotations

import json
import logging
import math
import shlex
from pathlib import Path
from typing import Any

from roll_core.eval_history import last_evaluation, last_evaluation_size, no_outcome
from roll_core.tracking import replace_file

log = logging.getLogger(__name__)

#: Headline metrics of a run's report: (metrics.jsonl key, what it is, True when higher is better).
HEADLINE = (
    ("reward/mean", "train reward", True),
    ("reward/accuracy", "train accuracy", True),
    ("eval/accuracy", "held-out accuracy", True),
    ("eval/reward", "held-out reward", True),
    ("eval/success_rate", "held-out success rate", True),
    ("sft/loss", "SFT loss", False),
    ("eval/sft_loss", "held-out SFT loss", False),
    ("dpo/loss", "DPO loss", False),
    ("dpo/reward_accuracy", "DPO preference accuracy", True),
    ("eval/dpo_loss", "held-out DPO loss", False),
    ("eval/dpo_accuracy", "held-out DPO preference accuracy", True),
    ("distill/kl", "distillation KL", False),
    ("eval/distill_kl", "held-out distillation KL", False),
    ("distill/reverse_kl", "on-policy distillation reverse KL", False),
)

#: The held-out values an evaluation without an outcome does not log (roll_core.eval_history): their last cell is the
#: last evaluation's own, never an earlier one's.
OUTCOME_KEYS = ("eval/accuracy", "eval/success_rate", "eval/reward")


def read_history(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl ([] when absent) as a resume leaves them; unreadable lines are skipped with a
    warning (see `read_history_counted`)."""
    return read_history_counted(path)[0]


def read_history_counted(path: Path) -> tuple[list[dict[str, Any]], int, int]:
    """(records, lines skipped, records superseded) of a metrics.jsonl; ([], 0, 0) when absent.

    A line that is not a JSON object with an integer `step` (a half-written line, bytes a power cut left) is
    skipped and counted, not silently: the report's numbers leave it out and say so. A record whose step is not
    after the one before it starts a redo (a resume whose history was not truncated): the earlier records of the
    steps it redoes are superseded, as `Tracker.truncate` would have dropped them; otherwise the abandoned attempt's
    values counted as first / best and the steps were listed twice."""
    if not path.is_file():
        return [], 0, 0
    out: list[dict[str, Any]] = []
    skipped = superseded = 0
    # errors="replace": an undecodable byte spoils its line (skipped below), not the whole report
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            skipped += 1
            continue
        step = rec.get("step") if isinstance(rec, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            skipped += 1
            continue
        if out and out[-1]["step"] >= step:
            kept = [r for r in out if r["step"] < step]
            superseded += len(out) - len(kept)
            out = kept
        out.append(rec)
    if skipped or superseded:
        log.warning(
            "%s: %d unreadable line(s) skipped, %d record(s) of redone steps superseded", path, skipped, superseded
        )
    return out, skipped, superseded


def headline(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each HEADLINE metric the history holds (plus each `eval/<domain>/accuracy`): its first, last and best
    value with their steps (`first`, `last`, `best`: (step, value)), and in `stderr` the standard error the same
    record logged with each of them (`<key>_stderr`, e.g. an episode collector's eval/success_rate_stderr; None
    where it logged none). For OUTCOME_KEYS `last` is the last evaluation's own value (a NaN as logged; None when it
    had no outcome, `no_outcome` then saying why: an eval/accuracy row is there even without any value logged)."""
    keys = [(k, what, up) for k, what, up in HEADLINE]
    # the domain is everything between `eval/` and `/accuracy`: a domain named with a "/" (`eval/a/b/accuracy`) was
    # left out of the numbers (`eval/accuracy` itself is the HEADLINE's)
    domains = {k: k[len("eval/") : -len("/accuracy")] for h in history for k in h if _domain_key(k)}
    keys += [(k, f"held-out accuracy, {d}", True) for k, d in sorted(domains.items())]
    last_eval, why = last_evaluation(history), no_outcome(history)
    rows = []
    for key, what, up in keys:
        recs = [h for h in history if _finite(h.get(key))]
        own = _own_last(key, recs, last_eval, why) if key in OUTCOME_KEYS else None
        if not recs and (own is None or key != "eval/accuracy"):
            continue
        pts = [((h["step"], h[key]), _stderr(h, key)) for h in recs]
        ends: dict[str, int] = {}
        if pts:
            order = range(len(pts))
            best = max(order, key=lambda i: pts[i][0][1]) if up else min(order, key=lambda i: pts[i][0][1])
            ends = {"first": 0, "last": len(pts) - 1, "best": best}
        row: dict[str, Any] = {"key": key, "what": what, "count": len(pts), "stderr": {}}
        for c in ("first", "last", "best"):
            row[c], row["stderr"][c] = pts[ends[c]] if c in ends else (None, None)
        if own is not None:
            row["last"], row["stderr"]["last"], row["no_outcome"] = own
        rows.append(row)
    return rows


def _own_last(
    key: str, recs: list[dict[str, Any]], last_eval: dict[str, Any] | None, why: str | None
) -> tuple[tuple[int, Any], float | None, str | None] | None:
    """(point, stderr, why) of the last evaluation's own `key` where it is not the last logged value (`recs`: the
    records with a finite one): a NaN as logged, or None with `why` (eval_history.no_outcome); None otherwise."""
    if last_eval is None or (recs and last_eval["step"] <= recs[-1]["step"]):
        return None
    value = last_eval.get(key)
    if value is None and why is None:  # not logged, though the evaluation had an outcome: the last logged one stands
        return None
    return (last_eval["step"], value), _stderr(last_eval, key), why if value is None else None


def _stderr(record: dict[str, Any], key: str) -> float | None:
    """The standard error `record` logged with `key` (`<key>_stderr`), None where it logged no finite one."""
    err = record.get(f"{key}_stderr")
    return err if _finite(err) else None


def _domain_key(key: str) -> bool:
    """`eval/<domain>/accuracy` with a non-empty domain (which may hold "/")."""
    return key.startswith("eval/") and key.endswith("/accuracy") and len(key) > len("eval//accuracy")


def _finite(v: Any) -> bool:
    """A metric value that is a finite number (not None, NaN or a string)."""
    return isinstance(v, (int, float)) and math.isfinite(v)


def launch_overrides(out: Path) -> list[str] | None:
    """The overrides of the launch the run's current config comes from: the running Hydra job's, else the run
    folder's .hydra/overrides.yaml; None when neither is known (a run built in Python). The running job first: a
    resumed run that found its folder (pipeline.resume=true from Hydra's generated folders) was launched in another
    folder, and the run folder's file holds the first launch's overrides, which would revert what the resume
    changed (its algo.lr, say)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except Exception:  # not inside a Hydra job
        pass
    recorded = out / ".hydra" / "overrides.yaml"
    if recorded.is_file():
        import yaml

        loaded = yaml.safe_load(recorded.read_text())
        if isinstance(loaded, list):
            return [str(x) for x in loaded]
    return None


def _drop(overrides: list[str], *keys: str) -> list[str]:
    """`overrides` without those setting one of `keys` (or a key under one ending in '.')."""
    kept = []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if not any(key == k or (k.endswith(".") and key.startswith(k)) for k in keys):
            kept.append(o)
    return kept


def commands(
    out: Path, overrides: list[str] | None, latest: Path | None, experiment: str, *, episodes: bool = False
) -> dict[str, str]:
    """Resume and evaluation command lines for the run in `out` (see the module docstring); `episodes`: an agentic
    run, whose comparison samples one episode per seed (no --n)."""
    base = overrides if overrides is not None else ([f"experiment={experiment}"] if experiment != "rlvr" else [])
    resume = _drop(base, "pipeline.resume", "pipeline.resume_from", "hydra.")
    evaluate = _drop(base, "pipeline.resume", "pipeline.resume_from", "pipeline.output_dir", "hydra.")
    q = shlex.join
    out_cmd = {"resume": q(["roll-train", *resume, f"pipeline.resume_from={out}"])}
    if latest is not None:
        out_cmd["eval"] = q(["roll-eval", str(latest), *evaluate])
        sampled = [] if episodes else ["--n", "4", "pipeline.eval_temperature=0.7"]
        out_cmd["compare"] = q(["roll-eval", str(out), *evaluate, *sampled])
    return out_cmd


def _value(v: Any) -> str:
    if not isinstance(v, float):
        return str(v)
    # 4 decimals hid a small KL or loss: 4e-05 read "0.0000", first, last and best alike
    return f"{v:.3e}" if 0 < abs(v) < 1e-3 else f"{v:.4f}"


def _headline_cell(point: tuple[int, Any] | None, stderr: float | None, why: str | None = None) -> str:
    """`value (step)`, or `value ± standard error (step)` when the record logged one (as roll-eval's tables); `none:
    <why>` for an evaluation without an outcome (`why`: roll_core.eval_history.no_outcome); `-` with no value."""
    if point is None:
        return "-"
    step, value = point
    if value is None:
        return f"none: {why}" if why else f"none ({step})"
    return f"{_value(value)} ({step})" if stderr is None else f"{_value(value)} ± {_value(stderr)} ({step})"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s"


def config_rows(cfg: Any, eval_n: float | None = None) -> list[tuple[str, str]]:
    """(setting, value) lines of the config summary; `eval_n`: the held-out problems an evaluation ran
    (roll_core.eval_history.last_evaluation_size: the task's held-out split may be smaller than pipeline.eval_size).
    A run with pipeline.eval_every=0 evaluates nothing, and its row says so."""
    a, p, m = cfg.algo, cfg.pipeline, cfg.model
    g = getattr
    temp = p.eval_temperature if p.eval_temperature is not None else f"{cfg.infer_engine.temperature} (engine's)"
    # eval_every=0 turns the loop's evaluations off: the row read "every 0 steps on 64 held-out problems"
    evaluation = (
        # `is not None`: an evaluation that scored none (every prompt skipped) read pipeline.eval_size problems
        f"every {p.eval_every} steps on {int(eval_n) if eval_n is not None else p.eval_size} held-out problems "
        f"(pipeline.eval_size {p.eval_size}), temperature {temp}"
        if p.eval_every > 0
        else "none (pipeline.eval_every=0)"
    )
    return [
        ("experiment", cfg.experiment),
        ("model", f"{m.path} ({m.dtype}; prompt <= {m.max_prompt_length}, response <= {m.max_response_length})"),
        ("pipeline", p.name),
        (
            "algorithm",
            f"{g(a, 'name', '?')}: advantages {g(a, 'adv_estimator', '?')}, lr {g(a, 'lr', '?')}, group size "
            f"{g(a, 'group_size', '?')}, KL coef {g(a, 'kl_coef', '?')}, loss {g(a, 'loss_agg', '?')}",
        ),
        ("engines", f"train {g(cfg.train_engine, 'name', '?')}, inference {g(cfg.infer_engine, 'name', '?')}"),
        ("placement", f"{cfg.cluster.placement} on {cfg.cluster.backend} (hw {cfg.hw.platform})"),
        ("batch", f"{p.rollout_batch_size} prompts x {g(a, 'group_size', '?')} responses per step"),
        ("steps", f"{p.max_steps} (checkpoint every {p.save_every or 'run end'}, keep {p.keep_last})"),
        ("evaluation", evaluation),
        ("seed", str(p.seed)),
    ]


def write_run_report(
    out: str | Path,
    cfg: Any,
    *,
    status: str,
    wall_seconds: float | None,
    checkpoints: list[Path],
) -> Path | None:
    """Write `<out>/report.md` for a training run (see the module docstring); None (and a warning) on failure."""
    out = Path(out)
    try:
        history, skipped, superseded = read_history_counted(out / "metrics.jsonl")
        steps = [h["step"] for h in history if h["step"] > 0]
        lines = [f"# Run report: {cfg.experiment}", "", f"- status: {status}"]
        lines += [f"- steps done: {max(steps) if steps else 0} of {cfg.pipeline.max_steps}"]
        if skipped or superseded:
            lines += [
                f"- metrics.jsonl: {skipped} unreadable line(s) skipped, {superseded} record(s) of redone steps "
                "superseded (the numbers below leave them out)"
            ]
        lines += [f"- wall time: {_duration(wall_seconds)}", f"- folder: `{out.resolve()}`", "", "## Config", ""]
        lines += ["| setting | value |", "|---|---|"]
        # the problems the last evaluation ran: one without an outcome logged eval/n 0 ("on 0 held-out problems")
        eval_n = last_evaluation_size(history)
        lines += [f"| {k} | {v} |" for k, v in config_rows(cfg, eval_n)]
        lines += ["", "Full config: [config.yaml](config.yaml); metrics: [metrics.jsonl](metrics.jsonl).", ""]
        if (out / "curves.png").is_file():
            lines += ["## Curves", "", "![curves](curves.png)", ""]
        rows = headline(history)
        lines += ["## Numbers", ""]
        if rows:
            lines += ["| metric | first (step) | last (step) | best (step) | points |", "|---|---|---|---|---|"]
            for r in rows:
                why = {"last": r.get("no_outcome")}
                cells = [_headline_cell(r[c], r["stderr"][c], why.get(c)) for c in ("first", "last", "best")]
                lines.append(f"| {r['what']} (`{r['key']}`) | " + " | ".join(cells) + f" | {r['count']} |")
        else:
            lines.append("No metrics were logged.")
        lines += ["", "## Checkpoints", ""]
        lines += [f"- `{c.resolve()}`" for c in checkpoints] or ["None saved."]
        latest = checkpoints[-1].resolve() if checkpoints else None
        overrides = launch_overrides(out)
        episodes = cfg.pipeline.name in ("agentic", "agent")
        cmds = commands(out.resolve(), overrides, latest, cfg.experiment, episodes=episodes)
        lines += ["", "## Commands", ""]
        if overrides is None:
            lines += ["(The launch's overrides are not recorded: add the ones the run used.)", ""]
        lines += ["Resume:", "", "```bash", cmds["resume"], "```", ""]
        if "eval" in cmds:
            lines += ["Evaluate the latest checkpoint:", "", "```bash", cmds["eval"], "```", ""]
            what = "" if episodes else " (pass@k, maj@n)"
            lines += [f"Compare every checkpoint{what}:", "", "```bash", cmds["compare"], "```", ""]
        path = out / "report.md"
        out.mkdir(parents=True, exist_ok=True)
        replace_file(path, "\n".join(lines))  # whole or not at all: a kill mid-write leaves no cut report
        return path
    except Exception as exc:  # a report is a convenience: it never turns a finished run into a failed one
        log.warning("could not write %s/report.md: %s", out, exc)
        return None


def _episode_cell(result: dict[str, Any], name: str) -> str:
    """A cell of the episodes table: a rate as `mean ± standard error` when the result has one (as the single-turn
    tables show accuracy), other floats to 4 places."""
    value, se = result[name], result.get(f"{name}_stderr")
    if not isinstance(value, float):
        return str(value)
    return f"{value:.4f}" if se is None else f"{value:.4f} ± {se:.4f}"


def write_eval_report(
    out: Path,
    results: list[tuple[Any, dict[str, Any]]],
    *,
    settings: dict[str, Any],
    files: dict[str, Path],
    argv: list[str],
    notes: list[str] | tuple[str, ...] = (),
) -> Path:
    """Write `<out>/report.md` for a roll-eval call: settings, warnings (`notes`: checkpoints evaluated under other
    settings than their run's, roll_core.eval_compare.run_settings_notes; models scored on different problems,
    roll_core.eval_compare.problem_set_notes), comparison table, breakdowns, paired differences (several models:
    roll_core.eval_paired), plot, files."""
    from roll_core.eval_compare import breakdown_table, problem_set_notes, table
    from roll_core.eval_paired import paired_differences, paired_section

    ks, n = settings["ks"], settings["n"]
    lines = ["# Evaluation report", "", f"- command: `{shlex.join(argv)}`"]
    lines += [f"- {k}: {v}" for k, v in settings.items() if k not in ("ks", "n", "argv")]
    warnings = []
    for note in notes:  # a head line, the differing settings, what to do
        head, _, rest = note.partition("\n")
        listed, _, tail = rest.rpartition("\n")
        warnings += [f"**Warning:** {head}", "", "```text", listed, "```", "", tail, ""]
    if any("rows" not in r for _, r in results):  # episodes: success, turns, invalid actions (what they report)
        names = ("success_rate", "accuracy", "reward", "mean_turns", "invalid_action_rate", "n")
        cols = [c for c in names if all(c in r for _, r in results)]
        lines += [
            "",
            *warnings,
            "## Results",
            "",
            "| model | step | " + " | ".join(cols) + " |",
            "|" + "---|" * (len(cols) + 2),
        ]
        for t, r in results:
            cells = [_episode_cell(r, c) for c in cols]
            lines.append(f"| {t.label} | {'-' if t.step is None else t.step} | " + " | ".join(cells) + " |")
        lines += ["", "## Files", "", *(f"- [{p.name}]({p.name})" for p in files.values())]
        replace_file(out / "report.md", "\n".join(lines) + "\n")
        return out / "report.md"
    lines += [f"- responses per problem (n): {n}; pass@k for k in {', '.join(map(str, ks))}; maj@{n}", ""]
    lines += _skipped_lines(results)
    lines += warnings
    # models scored on different problems (comparison.md says so too): this table is the one most read
    lines += [line for note in problem_set_notes(results) for line in (f"**Warning:** {note}", "")]
    lines += ["## Results", "", table(results, ks, n), ""]
    lines += ["## Accuracy per domain", "", breakdown_table(results, "by_domain", "accuracy"), ""]
    lines += ["## Accuracy per difficulty", "", breakdown_table(results, "by_difficulty", "accuracy"), ""]
    lines += paired_section(paired_differences(results, ks), ks, n)  # each model minus the first, per problem
    if "png" in files:
        lines += ["## Plot", "", f"![comparison]({files['png'].name})", ""]
    lines += ["## Files", ""]
    lines += [f"- [{p.name}]({p.name})" for p in files.values()]
    path = out / "report.md"
    replace_file(path, "\n".join(lines) + "\n")  # whole or not at all (UTF-8: the tables' ±, non-ASCII paths)
    return path


#: The reason each count of a roll-eval result's `skipped_by_reason` (roll_core.evaluate.SKIP_REASONS) is shown with.
SKIP_WHY = {
    "prompt_length": "prompt longer than model.max_prompt_length",
    "engine_context": "prompt fills the inference engine's context, infer_engine.max_model_len",
    "bad_pictures": "pictures could not be read or placed",
}


def _skipped_lines(results: list[tuple[Any, dict[str, Any]]]) -> list[str]:
    """One line per reason problems were skipped for, with each model's count (`skipped_by_reason`); a result
    without the split (written by hand, or by an older roll) is shown under "reason not recorded"."""
    by_reason: dict[str, dict[str, int]] = {}
    for t, r in results:
        split = r.get("skipped_by_reason")
        if split is None:
            split = {"unknown": r.get("skipped_problems") or 0}
        for reason, count in split.items():
            if count:
                by_reason.setdefault(reason, {})[t.label] = count
    lines = []
    for reason, counts in by_reason.items():
        lines += [f"- problems skipped ({SKIP_WHY.get(reason, 'reason not recorded')}): {counts}", ""]
    return lines
