"""What `roll-eval` evaluates and what it writes: the models of one call, and their comparison files.

Targets: each model argument is a Hugging Face folder, a hub id, `builtin:<name>`, a roll checkpoint folder
(`.../checkpoints/step_000012`, or one copied under another name such as `best/`: its `actor/model`), a
checkpoint's `actor/model` folder itself, a run folder (every checkpoint under its `checkpoints/`, in step order)
or a `checkpoints/` folder itself. Labels are the checkpoint's `step_N` (its step taken from the folder name, also
when its `actor/model` is given), a checkpoint folder's own name when it is not `step_N` (`best`), both prefixed
with the run's folder name when the call names several runs, or the model's name; repeated labels get `#2`, `#3`.

Outputs, in the `--out` folder (one engine start per model, written after all models ran):
- `samples.jsonl`: one record per response (model label and step, problem, domain, difficulty, sample index,
  response, ground truth, extracted answer, reward, correct, formatted, length, finish reason, `failed`: null,
  "reward" or "engine" for a response never graded), for audits and recomputation.
- `comparison.csv`: one row per (model, breakdown, group): `all/all`, `domain/<d>`, `difficulty/<d>`, with every
  metric of roll_core.eval_metrics.summarize, the standard errors over problems (`accuracy_stderr`,
  `pass@k_stderr`, `maj_stderr`) beside their metrics; `comparison.json`: the same per model, with the call's
  settings and, with several models, `paired`: each later model's paired difference from the first over the
  problems both were scored on (roll_core.eval_paired); `comparison.md`: the overall table, the per-domain /
  per-difficulty accuracy tables and the paired differences, accuracy, pass@k and maj@n shown as
  `mean ± standard error`.
- `comparison.png` (needs matplotlib, roll-core[track]): accuracy, maj@n and pass@k against the checkpoint step
  (or the model's position when not every model is a checkpoint), and pass@k against k per model, each point with
  its standard error bar.
- `report.md`: what ran (roll_core.report.write_eval_report).
Each file is written whole or not at all (a temporary file renamed over it: a crash leaves no cut file), and a plot
that fails (other than matplotlib missing) is logged and left out, never losing the other files or report.md.
An `--out` folder already holding any of these files (OUTPUT_FILES: a previous evaluation's, or a run's
report.md) is refused before anything is evaluated unless `--overwrite` is given, which removes them first
(roll_core.cli.run_eval): a second call into one folder replaced the first call's results without a word.
Models of one call are scored on one problem list with one seed, but a model can lose problems the others keep (a
prompt over model.max_prompt_length in its tokenizer, or filling its engine's context): their numbers then compare
different problem sets, which `problem_set_notes` says (logged, and in comparison.json's `warnings` and
comparison.md).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roll_core.errors import ConfigError
from roll_core.eval_paired import paired_differences, paired_section

log = logging.getLogger(__name__)

_STEP = re.compile(r"step_(\d+)$")


@dataclass(frozen=True)
class EvalTarget:
    """One model of a `roll-eval` call: its label, what `model.path` gets, and its checkpoint step (or None)."""

    label: str
    model: str
    step: int | None = None
    source: str = ""
    #: The run folder's name of a checkpoint, `step_N` or not ("" for other models).
    run: str = ""


def _checkpoint_model(folder: Path) -> Path | None:
    """The policy folder of a roll checkpoint folder, or None when `folder` is not one."""
    model = folder / "actor" / "model"
    return model if (model / "config.json").is_file() else None


def _checkpoints_under(folder: Path) -> list[Path]:
    """Complete checkpoints (`step_N` with a policy) under a run folder or a `checkpoints/` folder, step order."""
    root = folder / "checkpoints" if (folder / "checkpoints").is_dir() else folder
    found = [p for p in root.glob("step_*") if p.is_dir() and _STEP.search(p.name) and _checkpoint_model(p)]
    return sorted(found, key=lambda p: int(_STEP.search(p.name).group(1)))  # type: ignore[union-attr]


def _checkpoint_folder(path: Path) -> Path | None:
    """The roll checkpoint folder `path` names: itself (it holds actor/model), or the checkpoint whose
    `actor/model` it is; None for anything else."""
    if path.is_dir() and _checkpoint_model(path) is not None:
        return path
    if path.name == "model" and path.parent.name == "actor" and _checkpoint_model(path.parent.parent) is not None:
        return path.parent.parent
    return None


def expand_targets(models: list[str]) -> list[EvalTarget]:
    """The models of `roll-eval A B C` (see the module docstring); a run folder without checkpoints is an error."""
    if not models:
        raise ConfigError("roll-eval needs a model: a model folder, hub id, builtin:<name>, checkpoint or run folder")
    # (run folder, model path, step, source, checkpoint name): the name labels a checkpoint that is not step_N
    raw: list[tuple[Path | None, str, int | None, str, str]] = []
    for arg in models:
        path = Path(arg).expanduser()
        if path.is_file():  # model.path's check would call it missing; a benchmark file is the usual slip
            raise ConfigError(
                f"{arg} is a file, not a model: give a model folder (config.json), a roll checkpoint or run folder, "
                "a hub id or builtin:<name>; a benchmark file to evaluate on goes to --data"
            )
        ckpt = _checkpoint_folder(path)
        if ckpt is not None:
            where = ckpt.resolve()  # `.` or `..` given: the names come from the real folders
            m = _STEP.search(where.name)
            # a run's checkpoints live in <run>/checkpoints/; a copied one (<run>/best) in the run folder itself
            run_dir = where.parent.parent if where.parent.name == "checkpoints" else where.parent
            step = int(m.group(1)) if m else None
            raw.append((run_dir, str(_checkpoint_model(ckpt)), step, arg, where.name))
        elif path.is_dir() and not (path / "config.json").is_file():
            found = _checkpoints_under(path)
            if not found:
                raise ConfigError(
                    f"{arg}: neither a model folder (config.json), a roll checkpoint (actor/model) nor a run folder "
                    "with checkpoints/step_*: nothing to evaluate there"
                )
            run_dir = path.resolve() if path.name != "checkpoints" else path.resolve().parent
            for ckpt in found:
                step = int(_STEP.search(ckpt.name).group(1))  # type: ignore[union-attr]
                raw.append((run_dir, str(_checkpoint_model(ckpt)), step, str(ckpt), ckpt.name))
        else:
            raw.append((None, arg, None, arg, ""))
    runs = _run_names({r for r, *_ in raw if r is not None})
    bases = []
    for run, model, step, _, name in raw:
        if run is not None:
            label = f"step_{step}" if step is not None else name
            bases.append(f"{runs[run]}/{label}" if len(runs) > 1 else label)
        else:
            bases.append(model.rstrip("/").rsplit("/", 1)[-1] if Path(model).is_dir() else model)
    targets = []
    for (run, model, step, source, _), label in zip(raw, _unique_labels(bases), strict=True):
        targets.append(EvalTarget(label, model, step, source, runs[run] if run is not None else ""))
    return targets


def _unique_labels(bases: list[str]) -> list[str]:
    """`bases` made unique: a repeat gets `#k`, the smallest k >= 2 that neither an earlier label nor any input
    holds (`a`, `a`, `a#2` gave two `a#2`, one table column and one results file for two models)."""
    given = set(bases)  # a later input's own name stays its own
    out: list[str] = []
    used: set[str] = set()
    for base in bases:
        label, k = base, 1
        while label in used or (label != base and label in given):
            k += 1
            label = f"{base}#{k}"
        out.append(label)
        used.add(label)
    return out


#: Settings that decide how a model is prompted, sampled and scored (fnmatch over dotted keys): a checkpoint evaluated
#: under other values than its run's is measured on another problem than the one its run logged as eval/accuracy.
RUN_SETTINGS = (
    "model.*",
    "env.*",
    "reward_model.*",
    "infer_engine.temperature",
    "infer_engine.top_p",
    "infer_engine.top_k",
    "infer_engine.stop",
    "infer_engine.structured*",
    "pipeline.eval_temperature",
    "pipeline.eval_size",
    "pipeline.seed",
)
#: ... except those that say where the weights are or how fast the scoring runs.
NOT_RUN_SETTINGS = (
    "model.path",
    "env.*workers",
    "env.*threads",
    "env.*timeout*",
    "reward_model.batch_size",
    "reward_model.world_size",
    "reward_model.placement",
    "reward_model.offload",
)
#: Task settings still compared when `--data` replaces the task with a benchmark file: how the model is prompted
#: (the benchmark is another problem list, not another way of asking; a run trained with a system prompt and
#: scored without it is measured on a prompt it never saw).
DATA_PROMPT_SETTINGS = ("env.system_prompt",)


def checkpoint_folder(target: EvalTarget) -> Path | None:
    """The roll checkpoint folder a target evaluates (the one holding its `actor/model`), or None."""
    if not target.run:
        return None
    return Path(target.model).parent.parent


def run_settings_changed(
    target: EvalTarget, cfg: Any, *, ignore: tuple[str, ...] = (), keep: tuple[str, ...] = ()
) -> list[str]:
    """One line "key: the run's -> now" per RUN_SETTINGS key (not under a pattern of `ignore`, unless it is under
    one of `keep`) whose value in this evaluation's config `cfg` differs from the config checkpoint `target` was
    saved with. [] for a model that is no roll checkpoint or a checkpoint recording no config; a key only one side
    has (another roll version's) is skipped.
    """
    import fnmatch

    from roll_core.checkpoint import CheckpointManager
    from roll_core.config.resume import _flatten, _same, _show, config_dict

    folder = checkpoint_folder(target)
    saved = CheckpointManager.read_config(folder) if folder is not None else None
    if not saved:
        return []
    old, new = _flatten(saved), _flatten(config_dict(cfg))

    def matches(key: str, patterns: tuple[str, ...]) -> bool:
        return any(key == p or fnmatch.fnmatchcase(key, p) or key.startswith(p + ".") for p in patterns)

    lines = []
    for key in sorted(old.keys() & new.keys()):
        skipped = matches(key, NOT_RUN_SETTINGS) or (matches(key, ignore) and not matches(key, keep))
        if matches(key, RUN_SETTINGS) and not skipped:
            if not _same(old[key], new[key]):
                lines.append(f"{key}: {_show(old[key])} -> {_show(new[key])}")
    return lines


def run_settings_notes(
    targets: list[EvalTarget], configs: list[Any], overrides: list[str], *, data: bool, samples: bool
) -> list[str]:
    """Warnings (one per run and set of differences) for checkpoints evaluated under other settings than their run's
    (`run_settings_changed`): their accuracy is not the one the run logged, and nothing said so (roll-eval composes
    its config from the command line, roll-train's defaults included, not from the checkpoint). Not compared: keys
    the command line sets (`key.sub=value`: a deliberate change, such as pipeline.eval_temperature for --n > 1; a
    group choice such as `env=...` is compared), the task under `--data` (a benchmark) except how the model is
    prompted (DATA_PROMPT_SETTINGS), `pipeline.eval_size` under `--samples`. Each note names the command that
    evaluates the checkpoint as its run did, when the run folder records its launch's overrides."""
    from roll_core.report import commands, launch_overrides

    given = tuple(o.split("=", 1)[0].lstrip("+~") for o in overrides if "." in o.split("=", 1)[0])
    ignore = given + (("env", "pipeline.eval_size") if data else ()) + (("pipeline.eval_size",) if samples else ())
    keep = tuple(k for k in DATA_PROMPT_SETTINGS if k not in given) if data else ()
    grouped: dict[tuple[str, tuple[str, ...]], list[EvalTarget]] = {}
    for target, cfg in zip(targets, configs):
        lines = run_settings_changed(target, cfg, ignore=ignore, keep=keep)
        if lines:
            grouped.setdefault((target.run, tuple(lines)), []).append(target)
    notes = []
    for (_, lines), group in grouped.items():
        ckpt = checkpoint_folder(group[-1])
        assert ckpt is not None
        run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
        shown = [*lines[:20], *([f"... and {len(lines) - 20} more"] if len(lines) > 20 else [])]
        recorded = launch_overrides(run_dir)
        several = len(group) > 1
        how = (
            f"evaluate as the run did with: {commands(run_dir, recorded, run_dir if several else ckpt, '')['eval']}"
            if recorded is not None
            else "give the overrides the run was launched with (experiment=..., env=..., model=...)"
        )
        names = ", ".join(t.label for t in group)
        notes.append(
            f"{names} {'were' if several else 'was'} trained with other settings than this evaluation uses (the "
            f"run's -> now):\n  " + "\n  ".join(shown) + f"\nThe accuracy here is not the one the run logged; {how}"
        )
    return notes


def _run_names(folders: set[Path]) -> dict[Path, str]:
    """A short distinct name per run folder: its name, with as many parent folders as it takes to tell apart runs
    of the same name (Hydra sweep jobs are all `0`, `1`, ...: `sweepA/0` vs `sweepB/0`)."""
    names: dict[Path, str] = {}
    for depth in range(1, 64):
        names = {f: "/".join(f.parts[-depth:]) for f in folders}
        if len(set(names.values())) == len(folders):
            break
    return names


def x_axis(targets: list[EvalTarget]) -> tuple[str, list[float]]:
    """(axis name, positions) of the comparison plot: checkpoint steps when every target is a checkpoint of one
    run (several runs' steps would interleave), else the model's position in the call."""
    steps = [t.step for t in targets]
    one_run = len({t.run for t in targets}) == 1
    if all(s is not None for s in steps) and one_run and len(set(steps)) == len(steps):
        return "checkpoint step", [float(s) for s in steps]  # type: ignore[arg-type]
    return "model", [float(i) for i in range(len(targets))]


METRIC_COLUMNS = (
    "accuracy",
    "maj",
    "reward",
    "length_mean",
    "truncation_rate",
    "format_rate",
    "problems",
    "samples",
    "failed",
)


#: The files a roll-eval call writes into its --out folder (an existing one is refused without --overwrite).
OUTPUT_FILES = (
    "samples.jsonl",
    "comparison.csv",
    "comparison.json",
    "comparison.md",
    "comparison.png",
    "results.json",
    "report.md",
)


def existing_outputs(out: Path) -> list[Path]:
    """The OUTPUT_FILES already in folder `out` (a previous evaluation's results a new one would replace)."""
    return [out / name for name in OUTPUT_FILES if (out / name).exists()]


def metric_names(ks: list[int]) -> list[str]:
    """The columns of a results table, pass@k after accuracy."""
    return ["accuracy", *(f"pass@{k}" for k in ks), *METRIC_COLUMNS[1:]]


def csv_columns(ks: list[int]) -> list[str]:
    """metric_names with each mean's standard error over problems (`<metric>_stderr`) right after it."""
    names = []
    for c in metric_names(ks):
        names += [c, f"{c}_stderr"] if c == "accuracy" or c == "maj" or c.startswith("pass@") else [c]
    return names


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def _cell(metrics: dict[str, Any], name: str) -> str:
    """A table cell: the metric, with ` ± <standard error>` when summarize gave one (accuracy, pass@k, maj)."""
    se = metrics.get(f"{name}_stderr")
    if metrics.get(name) is None or se is None:
        return _fmt(metrics.get(name))
    return f"{_fmt(metrics[name])} ± {se:.4f}"


def table(results: list[tuple[EvalTarget, dict[str, Any]]], ks: list[int], n: int) -> str:
    """The overall metrics of every model as a Markdown table (maj is maj@n); accuracy, pass@k and maj@n as
    `mean ± standard error over problems` (roll_core.eval_metrics.std_error)."""
    names = metric_names(ks)
    head = ["model", "step", *(f"maj@{n}" if c == "maj" else c for c in names)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for target, res in results:
        m = res["metrics"]
        lines.append("| " + " | ".join([target.label, _fmt(target.step), *(_cell(m, c) for c in names)]) + " |")
    return "\n".join(lines)


def breakdown_table(results: list[tuple[EvalTarget, dict[str, Any]]], key: str, metric: str) -> str:
    """`metric` per group of `key` (by_domain / by_difficulty) and model, groups as rows."""
    groups: list[str] = []
    for _, res in results:
        groups += [g for g in res[key] if g not in groups]
    head = [key.removeprefix("by_"), *(t.label for t, _ in results)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        cells = []
        for _, res in results:
            m = res[key].get(g)
            cells.append(f"{_cell(m, metric)} (n={m['problems']})" if m else "-")
        lines.append("| " + " | ".join([g, *cells]) + " |")
    return "\n".join(lines)


def problem_set_notes(results: list[tuple[EvalTarget, dict[str, Any]]]) -> list[str]:
    """One warning per model whose evaluated problems (the `problem` ids of its rows) are not every model's: its
    numbers and the others' are over different problems. [] when every model saw the same problems."""
    sets = {t.label: {r["problem"] for r in res["rows"]} for t, res in results}
    union = set().union(*sets.values()) if sets else set()
    notes = []
    for label, seen in sets.items():
        missing = sorted(union - seen, key=str)
        if missing:
            shown = ", ".join(map(str, missing[:5])) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            notes.append(
                f"{label} was scored on {len(seen)} of the {len(union)} problems the models of this comparison were "
                f"scored on (missing: {shown}; skipped for its prompt length or its engine's context): its numbers "
                "and the others' are over different problems"
            )
    return notes


def write_outputs(
    out: Path, results: list[tuple[EvalTarget, dict[str, Any]]], ks: list[int], n: int, settings: dict[str, Any]
) -> dict[str, Path]:
    """Write samples.jsonl, comparison.{csv,json,md} and comparison.png (when matplotlib is installed) into `out`,
    each whole or not at all (roll_core.tracking.replace_file); returns the written paths by name. A plot that
    fails is logged and left out (the numbers, and the report.md written next, do not depend on it)."""
    from roll_core.tracking import replace_file

    out.mkdir(parents=True, exist_ok=True)
    paths = {"samples": out / "samples.jsonl", "csv": out / "comparison.csv", "json": out / "comparison.json"}
    samples = (
        json.dumps({"model": target.label, "step": target.step, **row}) + "\n"
        for target, res in results
        for row in res["rows"]
    )
    replace_file(paths["samples"], "".join(samples))
    names = csv_columns(ks)
    table_text = io.StringIO(newline="")
    writer = csv.writer(table_text)
    writer.writerow(["model", "step", "path", "breakdown", "group", *names])
    for target, res in results:
        step = "" if target.step is None else target.step
        groups = [("all", {"all": res["metrics"]}), ("domain", res["by_domain"])]
        for kind, by in [*groups, ("difficulty", res["by_difficulty"])]:
            for g, m in by.items():
                cells = ["" if m.get(c) is None else m[c] for c in names]
                writer.writerow([target.label, step, target.model, kind, g, *cells])
    replace_file(paths["csv"], table_text.getvalue())
    warnings = problem_set_notes(results)
    for note in warnings:
        log.warning("%s", note)
    paired = paired_differences(results, ks)  # each model minus the first, per problem (roll_core.eval_paired)
    payload = {
        **settings,
        "ks": ks,
        "n": n,
        "warnings": warnings,
        "paired": paired,
        "models": [
            {
                "label": t.label,
                "step": t.step,
                "model": t.model,
                "source": t.source,
                "task": r["task"],
                "metrics": r["metrics"],
                "by_domain": r["by_domain"],
                "by_difficulty": r["by_difficulty"],
                "skipped_problems": r["skipped_problems"],
                "skipped_by_reason": r.get("skipped_by_reason"),
                "reward_counters": r["reward_counters"],
            }
            for t, r in results
        ],
    }
    replace_file(paths["json"], json.dumps(payload, indent=2))
    md = [
        "# roll-eval comparison",
        "",
        *(line for note in warnings for line in (f"**Warning:** {note}", "")),
        table(results, ks, n),
        "",
        "## Accuracy per domain",
        "",
        breakdown_table(results, "by_domain", "accuracy"),
        "",
        "## Accuracy per difficulty",
        "",
        breakdown_table(results, "by_difficulty", "accuracy"),
        "",
        *paired_section(paired, ks, n),
    ]
    paths["md"] = out / "comparison.md"
    replace_file(paths["md"], "\n".join(md))  # (UTF-8: the ± of the tables)
    try:
        png = plot(out / "comparison.png", results, ks, n)
    except Exception as exc:  # a plot is a view of the numbers above: its failure must not lose them or report.md
        log.warning("comparison.png could not be drawn (left out): %s: %s", type(exc).__name__, exc, exc_info=True)
        png = None
    if png is not None:
        paths["png"] = png
    return paths


def plot(path: Path, results: list[tuple[EvalTarget, dict[str, Any]]], ks: list[int], n: int) -> Path | None:
    """comparison.png (see the module docstring), written whole or not at all; None, with one log line naming the
    extra, without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install roll-core[track]): no comparison.png")
        return None
    from roll_core.tracking import replace_file

    targets = [t for t, _ in results]
    axis, xs = x_axis(targets)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    try:
        _draw(left, right, results, targets, axis, xs, ks, n)
        fig.tight_layout()
        image = io.BytesIO()
        fig.savefig(image, format="png", dpi=110)
    finally:  # a failed drawing leaves no open figure behind
        plt.close(fig)
    replace_file(path, image.getvalue())
    return path


def _draw(
    left: Any,
    right: Any,
    results: list[tuple[EvalTarget, dict[str, Any]]],
    targets: list[EvalTarget],
    axis: str,
    xs: list[float],
    ks: list[int],
    n: int,
) -> None:
    """The two panels of comparison.png: metrics against the step (or model), pass@k against k."""
    series = [("accuracy", "accuracy"), *((f"pass@{k}", f"pass@{k}") for k in ks if k > 1), ("maj", f"maj@{n}")]

    def err(m: dict[str, Any], key: str) -> float:  # the standard error bar (none with one problem)
        return m.get(f"{key}_stderr") or 0.0

    for key, name in series:
        # in x order: checkpoints named out of step order (step_30 step_10 step_20) drew a line back and forth
        pts = sorted(
            ((x, r["metrics"]) for x, (_, r) in zip(xs, results) if r["metrics"].get(key) is not None),
            key=lambda p: p[0],
        )
        if pts:
            ys, yerr = [m[key] for _, m in pts], [err(m, key) for _, m in pts]
            left.errorbar([p[0] for p in pts], ys, yerr=yerr, marker="o", capsize=3, label=name)
    left.set_xlabel(axis)
    if axis == "model":
        left.set_xticks(xs, [t.label for t in targets], rotation=20, ha="right", fontsize=8)
    left.set_ylim(-0.02, 1.02)
    left.set_title("held-out metrics")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    for target, res in results:
        m = res["metrics"]
        at = [k for k in ks if m.get(f"pass@{k}") is not None]
        yerr = [err(m, f"pass@{k}") for k in at]
        right.errorbar(at, [m[f"pass@{k}"] for k in at], yerr=yerr, marker="o", capsize=3, label=target.label)
    right.set_xscale("log", base=2)
    right.set_xticks(ks, [str(k) for k in ks])
    right.set_xlabel("k")
    right.set_ylim(-0.02, 1.02)
    right.set_title("pass@k")
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
