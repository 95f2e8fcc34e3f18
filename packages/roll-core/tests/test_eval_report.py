"""roll_core.report on a run folder laid out as a run leaves it: numbers from metrics.jsonl, the curves link,
checkpoints, the resume / eval commands built from Hydra's recorded overrides, a failed run's status, and the
never-raise contract. (A real run's report and roll-eval's are in tests/e2e/test_eval_compare.py.)"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from roll_core.config import load_config
from roll_core.report import commands, headline, write_run_report


def _run_folder(root: Path, *, overrides: list[str] | None) -> tuple[Path, list[Path]]:
    out = root / "run"
    out.mkdir()
    history = [
        {"step": 0, "eval/accuracy": 0.25, "eval/reward": 0.3, "eval/math/accuracy": 0.2, "eval/n": 16.0},
        {"step": 1, "reward/mean": 0.5, "reward/accuracy": 0.4, "sft/loss": 2.0},
        {"step": 2, "reward/mean": 0.9, "reward/accuracy": None, "sft/loss": 1.5, "eval/accuracy": 0.75},
        {"step": 3, "reward/mean": 0.7, "reward/accuracy": 0.6, "sft/loss": 1.7, "eval/accuracy": 0.5},
    ]
    lines = [json.dumps(h) for h in history]
    (out / "metrics.jsonl").write_text("\n".join([*lines[:2], "{not json", *lines[2:]]) + "\n")
    (out / "curves.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"0" * 2000)
    ckpts = []
    for step in (2, 3):
        c = out / "checkpoints" / f"step_{step:06d}"
        (c / "actor" / "model").mkdir(parents=True)
        ckpts.append(c)
    if overrides is not None:
        (out / ".hydra").mkdir()
        (out / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    return out, ckpts


def test_headline_first_last_best_with_direction() -> None:
    rows = {
        r["key"]: r
        for r in headline(
            [
                {"step": 1, "reward/mean": 0.5, "sft/loss": 2.0},
                {"step": 2, "reward/mean": 0.9, "sft/loss": 1.5},
                {"step": 3, "reward/mean": 0.7, "sft/loss": float("nan")},
            ]
        )
    }
    assert rows["reward/mean"]["first"] == (1, 0.5) and rows["reward/mean"]["last"] == (3, 0.7)
    assert rows["reward/mean"]["best"] == (2, 0.9)
    assert rows["sft/loss"]["best"] == (2, 1.5) and rows["sft/loss"]["last"] == (2, 1.5)  # NaN is no value
    assert "eval/accuracy" not in rows
    # The post-training runs' own numbers: on-policy distillation's KL, DPO's and offline distillation's held-out
    post = {
        r["key"]: r
        for r in headline(
            [
                {"step": 0, "eval/dpo_accuracy": 0.5, "eval/dpo_loss": 0.69, "eval/distill_kl": 2.0},
                {"step": 1, "distill/reverse_kl": 0.8, "eval/dpo_accuracy": 0.75, "eval/dpo_loss": 0.6},
                {"step": 2, "distill/reverse_kl": 0.3, "eval/distill_kl": 1.2},
            ]
        )
    }
    assert post["distill/reverse_kl"]["best"] == (2, 0.3) and post["eval/dpo_accuracy"]["best"] == (1, 0.75)
    assert post["eval/dpo_loss"]["best"] == (1, 0.6) and post["eval/distill_kl"]["last"] == (2, 1.2)


def test_a_domain_named_with_a_slash_is_in_the_numbers() -> None:
    """`eval/<domain>/accuracy` for a domain with a "/" in its name (`math/algebra`): left out of the report's numbers
    without a word; `eval/accuracy` stays the overall row, not a domain with an empty name."""
    rows = {
        r["key"]: r
        for r in headline(
            [
                {"step": 0, "eval/accuracy": 0.5, "eval/math/algebra/accuracy": 0.25, "eval/code/accuracy": 0.75},
                {"step": 2, "eval/accuracy": 0.6, "eval/math/algebra/accuracy": 0.5, "eval/code/accuracy": 0.7},
            ]
        )
    }
    assert list(rows) == ["eval/accuracy", "eval/code/accuracy", "eval/math/algebra/accuracy"]
    algebra = rows["eval/math/algebra/accuracy"]
    assert algebra["what"] == "held-out accuracy, math/algebra"
    assert (algebra["first"], algebra["last"], algebra["best"]) == ((0, 0.25), (2, 0.5), (2, 0.5))
    assert rows["eval/code/accuracy"]["what"] == "held-out accuracy, code"


def test_run_report_numbers_curves_checkpoints_and_commands(tmp_path: Path) -> None:
    launched = ["experiment=quickstart", "algo.lr=1e-5", "pipeline.output_dir=/x/run", "pipeline.resume=true"]
    out, ckpts = _run_folder(tmp_path, overrides=launched)
    cfg = load_config(["experiment=quickstart", "model=tiny"])
    path = write_run_report(out, cfg, status="finished", wall_seconds=3725.0, checkpoints=ckpts)
    text = path.read_text()
    assert "- status: finished" in text and "- steps done: 3 of 12" in text and "- wall time: 1h 02m 05s" in text
    assert "| held-out accuracy (`eval/accuracy`) | 0.2500 (0) | 0.5000 (3) | 0.7500 (2) | 3 |" in text
    assert "| train accuracy (`reward/accuracy`) | 0.4000 (1) | 0.6000 (3) | 0.6000 (3) | 2 |" in text
    assert "| SFT loss (`sft/loss`) | 2.0000 (1) | 1.7000 (3) | 1.5000 (2) | 3 |" in text  # lower is better
    assert "| held-out accuracy, math (`eval/math/accuracy`) | 0.2000 (0)" in text
    assert "![curves](curves.png)" in text
    assert f"- `{ckpts[0].resolve()}`" in text and f"- `{ckpts[1].resolve()}`" in text
    assert "| algorithm | grpo: advantages grpo, lr 5e-06, group size 8" in text
    assert "| engines | train hf, inference hf |" in text
    assert "| evaluation | every 4 steps on 16 held-out problems (pipeline.eval_size 64), temperature" in text
    cmds = commands(out.resolve(), launched, ckpts[-1].resolve(), "quickstart")
    assert shlex.split(cmds["resume"]) == [
        "roll-train",
        "experiment=quickstart",
        "algo.lr=1e-5",
        "pipeline.output_dir=/x/run",
        f"pipeline.resume_from={out.resolve()}",
    ]
    assert shlex.split(cmds["eval"]) == ["roll-eval", str(ckpts[-1].resolve()), "experiment=quickstart", "algo.lr=1e-5"]
    assert shlex.split(cmds["compare"])[:2] == ["roll-eval", str(out.resolve())] and "--n" in cmds["compare"]
    agentic = commands(out.resolve(), launched, ckpts[-1].resolve(), "quickstart", episodes=True)
    assert "--n" not in agentic["compare"]  # one episode per seed: roll-eval refuses --n > 1 there
    assert cmds["resume"] in text and cmds["eval"] in text and cmds["compare"] in text
    assert "not recorded" not in text


def test_failed_run_without_curves_checkpoints_or_overrides(tmp_path: Path) -> None:
    out, _ = _run_folder(tmp_path, overrides=None)
    (out / "curves.png").unlink()
    cfg = load_config(["model=tiny"])
    text = write_run_report(out, cfg, status="failed: ValueError: boom", wall_seconds=None, checkpoints=[]).read_text()
    assert "- status: failed: ValueError: boom" in text and "- wall time: unknown" in text
    assert "curves.png" not in text and "None saved." in text
    assert "The launch's overrides are not recorded" in text and "Evaluate the latest" not in text
    assert f"roll-train pipeline.resume_from={out.resolve()}" in text


def test_report_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert write_run_report(blocker / "run", object(), status="finished", wall_seconds=1.0, checkpoints=[]) is None
    assert "could not write" in caplog.text


def _checkpoint(run: Path, step: int) -> Path:
    folder = run / "checkpoints" / f"step_{step:06d}"
    (folder / "actor" / "model").mkdir(parents=True)
    (folder / "actor" / "model" / "config.json").write_text("{}")
    return folder


def test_eval_targets_labels_and_plot_axis(tmp_path: Path) -> None:
    from roll_core.errors import ConfigError
    from roll_core.eval_compare import expand_targets, x_axis

    a, b = tmp_path / "run-a", tmp_path / "run-b"
    for step in (10, 2):
        _checkpoint(a, step)
    (a / "checkpoints" / "step_000012.tmp").mkdir()  # a save in progress is no checkpoint
    _checkpoint(b, 4)
    hf = tmp_path / "base-model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")

    one_run = expand_targets([str(a)])
    assert [(t.label, t.step, t.run) for t in one_run] == [("step_2", 2, "run-a"), ("step_10", 10, "run-a")]
    assert one_run[0].model == str(a / "checkpoints" / "step_000002" / "actor" / "model")
    assert x_axis(one_run) == ("checkpoint step", [2.0, 10.0])
    assert [t.label for t in expand_targets([str(a / "checkpoints")])] == ["step_2", "step_10"]

    mixed = expand_targets([str(hf), str(a / "checkpoints" / "step_000010"), str(b), "builtin:tiny", str(hf)])
    assert [t.label for t in mixed] == ["base-model", "run-a/step_10", "run-b/step_4", "builtin:tiny", "base-model#2"]
    assert x_axis(mixed) == ("model", [0.0, 1.0, 2.0, 3.0, 4.0])
    assert x_axis(expand_targets([str(a), str(b)]))[0] == "model"  # two runs' steps would interleave

    # Two sweeps' job 0 (Hydra names every sweep's jobs 0, 1, ...): two runs, told apart by their sweep folder
    s1, s2 = tmp_path / "sweepA" / "0", tmp_path / "sweepB" / "0"
    _checkpoint(s1, 2)
    _checkpoint(s2, 2)
    jobs = expand_targets([str(s1), str(s2)])
    assert [t.label for t in jobs] == ["sweepA/0/step_2", "sweepB/0/step_2"] and x_axis(jobs)[0] == "model"

    empty = tmp_path / "empty-run"
    empty.mkdir()
    with pytest.raises(ConfigError, match="nothing to evaluate there"):
        expand_targets([str(empty)])
    with pytest.raises(ConfigError, match="needs a model"):
        expand_targets([])


def test_roll_eval_names_rows_the_reward_could_not_score(capsys: pytest.CaptureFixture) -> None:
    """A reward that failed on some rows (a verifier down for part of the run): the accuracy counts them wrong, so
    roll-eval says how many and why (it said nothing unless every row failed); the exit status stays 0. Every row
    failed: exit 1 and the one line it had."""
    from types import SimpleNamespace

    from roll_core.cli import _reward_failures

    some = {"reward_counters": {"rows": 8, "failed_rows": 3, "failed_timeout": 3}}
    none = {"reward_counters": {"rows": 8, "failed_rows": 0}}
    assert _reward_failures([(SimpleNamespace(label="a"), some), (SimpleNamespace(label="b"), none)]) == 0
    err = capsys.readouterr().err
    assert "could not score 3 of 8 rows of a (timeout 3): they count as wrong" in err and " of b " not in err
    every = {"reward_counters": {"rows": 4, "failed_rows": 4, "failed_exception": 4}}
    assert _reward_failures([(SimpleNamespace(label="c"), every)]) == 1
    err = capsys.readouterr().err
    assert "failed on every row of c (4 rows; exception 4)" in err and "could not score" not in err


def _report_numbers(out: Path, metrics: bytes) -> list[str]:
    """The report's header lines and its Numbers table, for a run folder holding `metrics` as its metrics.jsonl."""
    out.mkdir(exist_ok=True)
    (out / "metrics.jsonl").write_bytes(metrics)
    path = write_run_report(out, load_config(["model=tiny"]), status="finished", wall_seconds=59.6, checkpoints=[])
    assert path is not None, "the report was not written"
    lines = path.read_text().splitlines()
    head = [x for x in lines if x.startswith("- ") and not x.startswith("- folder")]
    table = lines[lines.index("## Numbers") + 2 : lines.index("## Checkpoints") - 1]
    return head + table


def test_report_skips_and_counts_unreadable_lines_and_reads_a_redone_history_as_a_resume_leaves_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A history that a resume did not truncate (steps 2 and 3 redone after a checkpoint at 1) counted the abandoned
    attempt: best reward 0.95 at a step whose value was replaced, and 6 points for 4 steps. A half-written line was
    skipped without a word: the numbers left it out silently."""
    rows = [
        {"step": 0, "eval/accuracy": 0.25},
        {"step": 1, "reward/mean": 0.5},
        {"step": 2, "reward/mean": 0.9},
        {"step": 3, "reward/mean": 0.95, "eval/accuracy": 0.75},
        {"step": 2, "reward/mean": 0.6},
        {"step": 3, "reward/mean": 0.7, "eval/accuracy": 0.5},
    ]
    half_written = '{"step": 4, "rew\n'
    text = "".join(json.dumps(r) + "\n" for r in rows) + half_written + json.dumps({"step": 4, "reward/mean": 0.8})
    assert _report_numbers(tmp_path / "run", text.encode()) == [
        "- status: finished",
        "- steps done: 4 of 20",
        "- metrics.jsonl: 1 unreadable line(s) skipped, 2 record(s) of redone steps superseded (the numbers below "
        "leave them out)",
        "- wall time: 1m 00s",
        "| metric | first (step) | last (step) | best (step) | points |",
        "|---|---|---|---|---|",
        "| train reward (`reward/mean`) | 0.5000 (1) | 0.8000 (4) | 0.8000 (4) | 4 |",
        "| held-out accuracy (`eval/accuracy`) | 0.2500 (0) | 0.5000 (3) | 0.5000 (3) | 2 |",
    ]
    assert "1 unreadable line(s) skipped" in caplog.text


def test_report_survives_a_line_of_bad_bytes_or_a_step_that_is_not_a_number(tmp_path: Path) -> None:
    """A byte that is not UTF-8 (what a power cut can leave) or a record whose step is text made the whole report
    fail (one warning, no report.md) instead of costing that line."""
    good = b'{"step": 1, "sft/loss": 2.0}\n{"step": 2, "sft/loss": 1.5}\n'
    assert _report_numbers(tmp_path / "run", good + b'{"step": 3, "sft/loss": \xff\xfe}\n{"step": "4"}\n') == [
        "- status: finished",
        "- steps done: 2 of 20",
        "- metrics.jsonl: 2 unreadable line(s) skipped, 0 record(s) of redone steps superseded (the numbers below "
        "leave them out)",
        "- wall time: 1m 00s",
        "| metric | first (step) | last (step) | best (step) | points |",
        "|---|---|---|---|---|",
        "| SFT loss (`sft/loss`) | 2.0000 (1) | 1.5000 (2) | 1.5000 (2) | 2 |",
    ]


def test_report_shows_small_values_instead_of_zeros(tmp_path: Path) -> None:
    """A distillation KL that fell to 4e-05 read "0.0000" as last and best: the table could not tell it from 0."""
    rows = [{"step": 1, "distill/kl": 0.25}, {"step": 2, "distill/kl": 4e-05}, {"step": 3, "distill/kl": 0.0}]
    assert _report_numbers(tmp_path / "run", "".join(json.dumps(r) + "\n" for r in rows).encode())[-1] == (
        "| distillation KL (`distill/kl`) | 0.2500 (1) | 0.0000 (3) | 0.0000 (3) | 3 |"
    )
    rows[2]["distill/kl"] = 1.5e-4
    assert _report_numbers(tmp_path / "run", "".join(json.dumps(r) + "\n" for r in rows).encode())[-1] == (
        "| distillation KL (`distill/kl`) | 0.2500 (1) | 1.500e-04 (3) | 4.000e-05 (2) | 3 |"
    )


def test_a_run_without_evaluations_is_not_reported_as_evaluating_every_0_steps(tmp_path: Path) -> None:
    """pipeline.eval_every=0 turns the loop's evaluations off; the report's config row read "every 0 steps on 64
    held-out problems (pipeline.eval_size 64), temperature ..." for a run that evaluated nothing."""
    out, ckpts = _run_folder(tmp_path, overrides=None)
    cfg = load_config(["model=tiny", "pipeline.eval_every=0"])
    text = write_run_report(out, cfg, status="finished", wall_seconds=1.0, checkpoints=ckpts).read_text()
    assert "| evaluation | none (pipeline.eval_every=0) |" in text
    assert "every 0 steps" not in text


def test_an_evaluation_that_scored_no_problem_is_reported_as_zero_problems() -> None:
    """`eval/n` 0 (every held-out prompt skipped) was falsy: the config row read "on 64 held-out problems", the
    pipeline.eval_size, for an evaluation that scored none. No evaluation logged yet: the setting is all it knows."""
    from roll_core.report import config_rows

    cfg = load_config(["experiment=quickstart", "model=tiny"])
    rows = dict(config_rows(cfg, 0.0))
    assert rows["evaluation"].startswith("every 4 steps on 0 held-out problems (pipeline.eval_size 64), temperature")
    assert dict(config_rows(cfg, 16.0))["evaluation"].startswith("every 4 steps on 16 held-out problems")
    assert dict(config_rows(cfg))["evaluation"].startswith("every 4 steps on 64 held-out problems")


#: An agentic run: the step-4 evaluation had no outcome (its 4 held-out episodes' resets failed: eval/n 0, no
#: accuracy, success rate or reward), after one at step 2 that scored 0.5 on 4 episodes.
_NO_OUTCOME = [
    {"step": 0, "eval/n": 4.0, "eval/accuracy": 0.25, "eval/success_rate": 0.25, "eval/reward": 0.25},
    {"step": 1, "reward/mean": 0.5},
    {"step": 2, "reward/mean": 0.6, "eval/n": 4.0, "eval/accuracy": 0.5, "eval/success_rate": 0.5, "eval/reward": 0.5},
    {"step": 3, "reward/mean": 0.7},
    {"step": 4, "reward/mean": 0.8, "eval/n": 0.0, "eval/reset_failed_episodes": 4.0, "eval/aborted_episodes": 0.0},
]


def _report_text(out: Path, rows: list[dict], *overrides: str) -> str:
    out.mkdir(exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(["experiment=quickstart", "model=tiny", *overrides])
    path = write_run_report(out, cfg, status="finished", wall_seconds=1.0, checkpoints=[])
    assert path is not None, "the report was not written"
    return path.read_text()


def test_the_config_row_counts_the_episodes_an_evaluation_without_an_outcome_ran(tmp_path: Path) -> None:
    """The last evaluation had no outcome (eval/n 0, its 4 resets failed): the config row read "every 4 steps on 0
    held-out problems" for a run evaluating 4. eval/n plus the episodes counted out of it is what ran."""
    text = _report_text(tmp_path / "run", _NO_OUTCOME)
    assert "| evaluation | every 4 steps on 4 held-out problems (pipeline.eval_size 64), temperature" in text
    some = [*_NO_OUTCOME[:4], {**_NO_OUTCOME[4], "eval/n": 1.0, "eval/reset_failed_episodes": 2.0}]
    some[4]["eval/context_refused_episodes"], some[4]["eval/aborted_episodes"] = 1.0, 1.0
    assert "every 4 steps on 5 held-out problems" in _report_text(tmp_path / "some", some)
    # an evaluation whose every prompt was skipped (pipeline=rlvr: none ran, nothing counted apart) still reads 0
    skipped = [{"step": 0, "eval/n": 0.0, "eval/accuracy": float("nan")}]
    assert "every 4 steps on 0 held-out problems" in _report_text(tmp_path / "skipped", skipped)


def test_the_last_held_out_accuracy_is_the_last_evaluations_and_says_it_had_no_outcome(tmp_path: Path) -> None:
    """report.md's "last (step)" cell showed 0.5000 (2), the last LOGGED accuracy, as the final model's, while the
    run summary and the sweep (roll_core.eval_history) have none: the step-4 evaluation had no outcome."""
    why = "none: last evaluation (step 4) had no outcome (eval/n 0: eval/reset_failed_episodes=4)"
    table = _report_numbers(tmp_path / "run", "".join(json.dumps(r) + "\n" for r in _NO_OUTCOME).encode())[-4:]
    assert table == [
        "| train reward (`reward/mean`) | 0.5000 (1) | 0.8000 (4) | 0.8000 (4) | 4 |",
        f"| held-out accuracy (`eval/accuracy`) | 0.2500 (0) | {why} | 0.5000 (2) | 2 |",
        f"| held-out reward (`eval/reward`) | 0.2500 (0) | {why} | 0.5000 (2) | 2 |",
        f"| held-out success rate (`eval/success_rate`) | 0.2500 (0) | {why} | 0.5000 (2) | 2 |",
    ]
    # the only evaluation had no outcome: the accuracy's row says so (no row at all said nothing)
    only = [{"step": 0, "eval/n": 0.0, "eval/context_refused_episodes": 2.0}, {"step": 1, "reward/mean": 0.5}]
    assert _report_numbers(tmp_path / "only", "".join(json.dumps(r) + "\n" for r in only).encode())[-1] == (
        "| held-out accuracy (`eval/accuracy`) | - | none: last evaluation (step 0) had no outcome (eval/n 0: "
        "eval/context_refused_episodes=2) | - | 0 |"
    )
    # an evaluation with an outcome after it: the last logged value is its own, as before
    rows = [*_NO_OUTCOME, {"step": 5, "eval/n": 4.0, "eval/accuracy": 0.75, "eval/accuracy_stderr": 0.25}]
    (acc,) = [r for r in headline(rows) if r["key"] == "eval/accuracy"]
    assert acc["last"] == (5, 0.75) and acc["stderr"]["last"] == 0.25 and "no_outcome" not in acc


def test_the_config_row_counts_the_held_out_problems_an_evaluation_skipped(tmp_path: Path) -> None:
    """An RLVR evaluation of 8 held-out problems scored 5 (eval/n): 2 prompts over model.max_prompt_length, 1 filling
    the engine's context. The row read "on 5 held-out problems", as for a held-out set of 5."""
    skipped = {"eval/skipped_long_prompts": 2.0, "eval/skipped_context_prompts": 1.0, "eval/skipped_bad_images": 0.0}
    rows = [{"step": 0, "eval/n": 5.0, "eval/accuracy": 0.6, **skipped}]
    assert "| evaluation | every 4 steps on 8 held-out problems (pipeline.eval_size 64)" in _report_text(tmp_path, rows)
