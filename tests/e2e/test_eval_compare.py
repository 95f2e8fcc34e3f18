"""report.md of a real run, and roll-eval comparing that run's checkpoints, as a user meets them.

One tiny roll-train run (subprocess, 2 steps, a checkpoint and an evaluation after each) on a benchmark-like file
whose rows carry `domain` and `difficulty`, scored by tests/e2e/digit_reward.py (the response's last digit against
the answer, which a random tiny model hits now and then and learns within steps). Then:
- its report.md holds the numbers of its metrics.jsonl, embeds its curves.png and names its checkpoints;
- the report's own evaluation command, run as written, reproduces the run's last held-out accuracy (roll-eval
  with n=1 samples as the training run's evaluation does);
- the report's comparison command (the run folder: every checkpoint in step order, --n 4) with --k 1,2,4 writes a
  table, csv, json, plot and samples.jsonl whose numbers equal a recomputation from samples.jsonl done here with
  the textbook formula (math.comb), per model, per domain and per difficulty;
- a run that fails (a reward that always raises) still leaves a report.md whose status names the error;
- roll-eval's argument errors (k > n, n > 1 at temperature 0, a folder without checkpoints) exit 2 before any
  model loads.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from roll_core.cli import eval_main
from roll_core.testing import tiny_overrides

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # digit_reward: named in the config by module, imported by in-process evaluations
BIN = Path(sys.executable).parent
REWARD = ["env/reward=custom", "env.reward._target_=digit_reward.LastDigitReward"]


def _bench(path: Path, rows: int) -> Path:
    """Prompts whose answer is 7, in two domains and three difficulties (every fourth row has none: "unknown")."""
    lines = []
    for i in range(rows):
        row = {"prompt": f"Q{i}: say 7", "answer": "7", "domain": ("arith", "logic")[i % 2]}
        if i % 4:
            row["difficulty"] = ("easy", "medium", "hard")[i % 3]
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("eval-compare")
    data, bench = _bench(tmp / "train.jsonl", 100), _bench(tmp / "bench.jsonl", 8)  # bench: the held-out rows
    out = tmp / "run"
    overrides = [o for o in tiny_overrides(data, out) if not o.startswith("env.reward.")]
    overrides += [*REWARD, f"env.eval_path={bench}", "pipeline.max_steps=2", "pipeline.save_every=1"]
    overrides += ["pipeline.eval_every=2", "pipeline.trackers=[]", "pipeline.eval_temperature=1.0"]
    overrides += ["pipeline.rollout_batch_size=2", "algo.group_size=4", "train_engine.micro_batch_size=8"]  # CI time
    env = dict(
        os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [str(BIN / "roll-train"), *overrides], cwd=tmp, capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _history(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _block(report: str, title: str) -> str:
    """The command of the fenced block after `title`."""
    m = re.search(re.escape(title) + r"\n\n```bash\n(.+)\n```", report)
    assert m, f"no {title!r} command in report.md:\n{report}"
    return m.group(1)


def test_run_report_holds_the_runs_numbers_curves_and_checkpoints(run: Path) -> None:
    report = (run / "report.md").read_text()
    history = _history(run)
    assert "- status: finished" in report and "- steps done: 2 of 2" in report
    by_step = {h["step"]: h for h in history}

    def cell(key: str, step: int, value: float) -> str:
        se = by_step[step].get(f"{key}_stderr")  # the held-out accuracy's standard error over the problems
        return f"{value:.4f} ± {se:.4f} ({step})" if se is not None else f"{value:.4f} ({step})"

    for key in ("reward/mean", "reward/accuracy", "eval/accuracy", "eval/reward"):
        pts = [(h["step"], h[key]) for h in history if h.get(key) is not None]
        assert len(pts) >= 2, key
        best = max(pts, key=lambda p: p[1])
        row = next(line for line in report.splitlines() if f"(`{key}`)" in line)
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1:4] == [cell(key, s, v) for s, v in (pts[0], pts[-1], best)], row
    assert all(by_step[s].get("eval/accuracy_stderr") is not None for s in (0, 2))
    assert [h["step"] for h in history if "eval/accuracy" in h] == [0, 2]  # eval_every=2: steps 0 and 2
    assert "![curves](curves.png)" in report and (run / "curves.png").stat().st_size > 1000
    checkpoints = re.findall(r"^- `(.+)`$", report, flags=re.M)
    assert [Path(c).name for c in checkpoints] == ["step_000001", "step_000002"]
    assert all((Path(c) / "actor" / "model" / "config.json").is_file() for c in checkpoints)
    resume = shlex.split(_block(report, "Resume:"))
    assert resume[0] == "roll-train" and resume[-1] == f"pipeline.resume_from={run.resolve()}"
    assert "env.reward._target_=digit_reward.LastDigitReward" in resume  # the launch's overrides, repeated


def test_report_eval_command_reproduces_the_runs_last_evaluation(run: Path, capsys: pytest.CaptureFixture) -> None:
    argv = shlex.split(_block((run / "report.md").read_text(), "Evaluate the latest checkpoint:"))
    assert argv[0] == "roll-eval" and argv[1].endswith("step_000002")
    out = run.parent / "eval-last"
    assert eval_main([*argv[1:], "--out", str(out)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    m = re.match(r"accuracy (\d\.\d{4}) on (\d+) held-out problems of data", first)
    assert m, first
    last = [h for h in _history(run) if "eval/accuracy" in h][-1]
    assert float(m.group(1)) == pytest.approx(last["eval/accuracy"], abs=1e-4)
    assert int(m.group(2)) == int(last["eval/n"])
    assert (out / "report.md").is_file() and (out / "samples.jsonl").is_file()


def _pass_at_k(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _majority_grade(copies: list[dict]) -> float:
    """An answer's grade from its graded copies (failed ones give none): 1 when most are right, 0 when most are
    wrong, 0.5 on an even split, 0 when none is graded."""
    right = sum(r["correct"] > 0 for r in copies if not r.get("failed"))
    wrong = sum(r["correct"] <= 0 for r in copies if not r.get("failed"))
    return 0.5 if right == wrong and right else float(right > wrong)


def _recompute(rows: list[dict], ks: list[int]) -> dict[str, float]:
    """The metrics of sample records, written out independently of roll_core.eval_metrics."""
    by_problem: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        by_problem[r["index"]].append(r)
    out = {
        "accuracy": sum(r["correct"] for r in rows) / len(rows),
        "reward": sum(r["reward"] for r in rows) / len(rows),
        "length_mean": sum(r["length"] for r in rows) / len(rows),
        "truncation_rate": sum(r["finish_reason"] == "length" for r in rows) / len(rows),
        "format_rate": sum(r["formatted"] for r in rows) / len(rows),
        "problems": len(by_problem),
        "samples": len(rows),
    }
    for k in ks:
        out[f"pass@{k}"] = sum(
            _pass_at_k(len(s), sum(r["correct"] > 0 for r in s), k) for s in by_problem.values()
        ) / len(by_problem)
    hits = 0.0
    for s in by_problem.values():
        s = sorted(s, key=lambda r: r["sample"])
        votes = Counter(r["extracted"] for r in s if r["extracted"] is not None)
        if votes:  # answers tied at the most votes: the fraction of them that are right
            top = max(votes.values())
            tied = [a for a in votes if votes[a] == top]
            hits += sum(_majority_grade([r for r in s if r["extracted"] == a]) for a in tied) / len(tied)
    out["maj"] = hits / len(by_problem)
    return out


def test_compare_every_checkpoint_of_the_run(run: Path, capsys: pytest.CaptureFixture) -> None:
    argv = shlex.split(_block((run / "report.md").read_text(), "Compare every checkpoint (pass@k, maj@n):"))
    assert argv[1] == str(run.resolve()) and "--n" in argv
    out = run.parent / "compare"
    assert eval_main([*argv[1:], "--k", "1,2,4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| step_1 | 1 |" in printed and "| step_2 | 2 |" in printed, printed

    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    ks = [1, 2, 4]
    assert {r["model"] for r in rows} == {"step_1", "step_2"}
    # every problem has 4 responses per model, the same problems for both models
    per_model = {m: Counter(r["index"] for r in rows if r["model"] == m) for m in ("step_1", "step_2")}
    assert per_model["step_1"] == per_model["step_2"] and set(per_model["step_1"].values()) == {4}
    assert {r["domain"] for r in rows} == {"arith", "logic"}
    assert {r["difficulty"] for r in rows} == {"easy", "medium", "hard", "unknown"}
    for r in rows:  # auditable: each record names its problem, holds the response and its reward's view
        assert r["problem"] == f"data:bench.jsonl:{r['index'] + 1}" and r["answer"] == "7"
        assert isinstance(r["response"], str) and 0 < r["length"] <= 6  # model.max_response_length=6
        assert r["finish_reason"] in ("stop", "length") and (r["finish_reason"] == "stop" or r["length"] == 6)
        assert r["extracted"] == (re.findall(r"\d", r["response"]) or [None])[-1]
        assert r["correct"] == float(r["extracted"] == "7") and r["formatted"] == float(r["extracted"] is not None)
        assert r["reward"] == pytest.approx(r["correct"] + 0.1 * r["formatted"])

    table = list(csv.DictReader((out / "comparison.csv").open()))
    payload = json.loads((out / "comparison.json").read_text())
    assert payload["ks"] == ks and payload["n"] == 4 and [m["label"] for m in payload["models"]] == ["step_1", "step_2"]
    checked = 0
    for model in ("step_1", "step_2"):
        mine = [r for r in rows if r["model"] == model]
        groups = {("all", "all"): mine}
        for key in ("domain", "difficulty"):
            for value in {r[key] for r in mine}:
                groups[(key, value)] = [r for r in mine if r[key] == value]
        entry = next(m for m in payload["models"] if m["label"] == model)
        for (kind, group), subset in groups.items():
            expected = _recompute(subset, ks)
            line = next(t for t in table if (t["model"], t["breakdown"], t["group"]) == (model, kind, group))
            stored = entry["metrics"] if kind == "all" else entry[f"by_{kind}"][group]
            for name, value in expected.items():
                assert float(line[name]) == pytest.approx(value, abs=1e-9), (model, kind, group, name)
                assert stored[name] == pytest.approx(value, abs=1e-9), (model, kind, group, name)
                checked += 1
    assert checked >= 2 * 5 * 11
    # step_2 minus step_1, problem by problem (the same problems: asserted above), with the differences' error
    (paired,) = payload["paired"]
    assert (paired["model"], paired["baseline"], paired["problems"]) == ("step_2", "step_1", len(per_model["step_1"]))
    scores = {
        (m, i): _recompute([r for r in rows if r["model"] == m and r["index"] == i], ks)
        for m in ("step_1", "step_2")
        for i in per_model[m]
    }
    for name in ("accuracy", *(f"pass@{k}" for k in ks), "maj"):
        diffs = [scores[("step_2", i)][name] - scores[("step_1", i)][name] for i in per_model["step_1"]]
        assert paired[name] == pytest.approx(statistics.mean(diffs), abs=1e-9), name
        assert paired[f"{name}_stderr"] == pytest.approx(statistics.stdev(diffs) / math.sqrt(len(diffs)), abs=1e-9)
    overall = {m["label"]: m["metrics"] for m in payload["models"]}
    # the numbers say something: some responses are right, and pass@k grows with k
    assert any(0 < m["accuracy"] < 1 for m in overall.values()), overall
    assert all(m["pass@1"] <= m["pass@2"] <= m["pass@4"] for m in overall.values())
    md = (out / "comparison.md").read_text()
    assert "| step_2 | 2 | " + f"{overall['step_2']['accuracy']:.4f}" in md and "## Accuracy per difficulty" in md
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    assert "![comparison](comparison.png)" in report and "maj@4" in report


def test_a_failed_run_writes_its_report(tmp_path: Path) -> None:
    """The loop writes report.md when the run raises: the status names the error; the numbers logged before it stay."""
    from roll_core.cluster.reward_guard import RewardFailureError
    from roll_core.testing import run_pipeline

    out = tmp_path / "failed"
    overrides = [o for o in tiny_overrides(_bench(tmp_path / "rows.jsonl", 40), out) if not o.startswith("env.reward.")]
    overrides += ["env/reward=custom", "env.reward._target_=digit_reward.BrokenReward", "pipeline.max_steps=3"]
    overrides += ["pipeline.max_reward_failure_steps=1", "pipeline.trackers=[]", "pipeline.rollout_batch_size=2"]
    with pytest.raises(RewardFailureError):
        run_pipeline(overrides)
    report = (out / "report.md").read_text()
    assert "- status: failed: RewardFailureError: " in report and "the reward service is down" in report, report
    assert "- steps done: 0 of 3" in report and "None saved." in report


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--n", "2", "--k", "4"], r"pass@k needs 1 <= k <= n samples per problem \(--n 2\)"),
        (["--n", "4", "pipeline.eval_temperature=0"], r"evaluation temperature is 0.*pipeline.eval_temperature"),
    ],
)
def test_roll_eval_refuses_bad_sampling_before_loading(
    run: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    assert eval_main([str(run), "model=tiny", *extra]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_roll_eval_exits_1_when_the_reward_failed_on_every_row(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A reward that fails on every row (its service down): the accuracy line is still written, with the outputs,
    but roll-eval says the reward failed and exits 1 (it printed a plausible 0.0000 and exited 0)."""
    argv = ["builtin:tiny", "model=tiny", "env/reward=custom", "env.reward._target_=digit_reward.BrokenReward"]
    assert eval_main([*argv, "pipeline.eval_size=4", "--out", str(tmp_path / "ev")]) == 1
    err = capsys.readouterr().err
    assert "the reward failed on every row of builtin:tiny (4 rows; " in err and "says nothing" in err, err[-2000:]
    assert (tmp_path / "ev" / "report.md").is_file()


def test_roll_eval_says_in_one_line_when_every_prompt_fills_the_engines_context(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Arithmetic prompts of 70 tokens, an engine context of 40: exit 2 with the way out (it was a traceback)."""
    argv = ["builtin:tiny", "model=tiny", "infer_engine.max_model_len=40", "pipeline.eval_size=2"]
    assert eval_main([*argv, "--out", str(tmp_path / "ev")]) == 2
    err = capsys.readouterr().err
    assert "every prompt fills the inference engine's context" in err and "infer_engine.max_model_len" in err
    assert "Traceback" not in err


def test_roll_eval_refuses_a_folder_without_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert eval_main([str(tmp_path), "model=tiny"]) == 2
    assert "nothing to evaluate there" in capsys.readouterr().err


def test_roll_eval_builds_the_engine_as_the_run_did(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """model.attn_implementation and model.trust_remote_code reach roll-eval's inference engine as they reach the
    training run's (they were dropped: a custom-code model could not be evaluated, and eager attention ran sdpa)."""
    import roll_core.evaluate as ev

    seen: dict = {}

    class Stop(Exception):
        pass

    def group(self, cls, name, n, **kw):
        seen.update(kw.get("runtime", {}))
        raise Stop

    monkeypatch.setattr(ev.Cluster, "group", group)
    from roll_core.config import load_config

    cfg = load_config(["model=tiny", "model.attn_implementation=eager", "model.trust_remote_code=true"])
    with pytest.raises(Stop):
        ev.evaluate_model(cfg, samples=2)
    assert seen["attn_implementation"] == "eager" and seen["trust_remote_code"] is True, seen


@pytest.mark.parametrize("bad", [["--samples", "0"], ["--samples", "-3"], ["--n", "-2", "--k", "1"], ["--n", "0"]])
def test_roll_eval_refuses_a_sample_count_below_1(bad: list[str], capsys: pytest.CaptureFixture) -> None:
    """--samples 0 silently meant pipeline.eval_size, -3 was a traceback: both a usage error (exit 2). --n -2 was
    reported as a bad --k."""
    with pytest.raises(SystemExit) as exit_:
        eval_main(["builtin:tiny", "model=tiny", *bad])
    assert exit_.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def test_roll_eval_refuses_an_out_file_before_evaluating(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--out naming a file failed after every model was evaluated, losing the results: refused first."""
    taken = tmp_path / "results.txt"
    taken.write_text("x")
    assert eval_main(["builtin:tiny", "model=tiny", "--out", str(taken)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_a_quoted_home_path_is_a_model_not_an_override() -> None:
    from roll_core.cli import _is_override

    assert not _is_override("~/models/step_4") and _is_override("~pipeline.eval_size") and _is_override("a=b")
