"""roll-eval's outputs: an --out folder holding an earlier evaluation's results is refused (it was overwritten
without a word) unless --overwrite; accuracy, pass@k and maj@n carry their standard error over problems, checked
against hand-computed values, in the metrics, the printed lines, comparison.{md,csv,json}."""

from __future__ import annotations

import csv
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest

from roll_core.eval_metrics import breakdown, summarize

# Four problems, two responses each: (extracted answer, correct). The right answer is "7".
PROBLEMS = [
    [("7", 1), ("7", 1)],  # mean correctness 1,   pass@2 1, majority "7": right
    [("7", 1), ("3", 0)],  # 0.5, pass@2 1, tie of a right and a wrong answer: maj 0.5
    [("3", 0), ("3", 0)],  # 0,   pass@2 0, "3": wrong
    [("3", 0), ("7", 1)],  # 0.5, pass@2 1, the same tie sampled the other way round: 0.5
]


def _rows(problems: list[list[tuple[str, int]]]) -> list[dict[str, Any]]:
    return [
        {
            "index": i,
            "problem": f"q{i}",
            "sample": j,
            "extracted": answer,
            "correct": float(c),
            "reward": float(c),
            "formatted": 1.0,
            "length": 10,
            "finish_reason": "stop",
            "domain": "d" if i < 2 else "e",
            "difficulty": None,
            "failed": None,
        }
        for i, samples in enumerate(problems)
        for j, (answer, c) in enumerate(samples)
    ]


def _result(rows: list[dict[str, Any]], ks: list[int]) -> dict[str, Any]:
    """What roll_core.evaluate.evaluate_model returns for a single-turn task."""
    m = summarize(rows, ks)
    return {
        "accuracy": m["accuracy"],
        "reward": m["reward"],
        "n": m["problems"],
        "task": "data",
        "metrics": m,
        "by_domain": breakdown(rows, "domain", ks),
        "by_difficulty": breakdown(rows, "difficulty", ks),
        "skipped_problems": 0,
        "reward_counters": {},
        "rows": rows,
    }


def test_std_error_is_the_sample_std_over_sqrt_m_by_hand() -> None:
    from roll_core.eval_metrics import std_error

    # scores 1, 0, 1, 1: mean 0.75, s^2 = (3 * 0.0625 + 0.5625) / 3 = 0.25, se = 0.5 / 2 = sqrt(0.75 * 0.25 / 3)
    assert std_error([1, 0, 1, 1]) == pytest.approx(0.25)
    assert std_error([1.0, 0.5, 0.0, 0.5]) == pytest.approx(math.sqrt(1 / 24))  # s^2 = 0.5 / 3, / 4 problems
    assert std_error([1, 1, 1]) == 0.0
    assert std_error([0.3]) is None and std_error([]) is None  # no spread to estimate from one value


def test_rate_stderr_is_std_error_of_the_0_1_outcomes_by_hand() -> None:
    from roll_core.eval_metrics import rate_stderr, std_error

    assert rate_stderr(0.75, 4) == pytest.approx(0.25) == std_error([1, 0, 1, 1])  # sqrt(.75 * .25 / 3)
    assert rate_stderr(0.2, 5) == pytest.approx(0.2)  # 1 of 5: sqrt(.2 * .8 / 4) = sqrt(.04)
    assert rate_stderr(0.5, 2) == pytest.approx(0.5) and rate_stderr(1.0, 3) == 0.0
    assert rate_stderr(0.0, 1) is None and rate_stderr(0.0, 0) is None  # no spread to estimate from one episode
    with pytest.raises(ValueError, match="within"):
        rate_stderr(1.5, 4)


def test_agentic_success_rate_has_its_standard_error_in_results_and_report(tmp_path: Path) -> None:
    """An agentic roll-eval reported its success rate without the standard error single-turn accuracy has."""
    import types

    from roll_core.evaluate import episode_result
    from roll_core.report import write_eval_report

    # what an agentic collector's evaluate returns: 3 of 4 held-out episodes succeeded
    m = {
        "eval/accuracy": 0.75,
        "eval/success_rate": 0.75,
        "eval/reward": 0.5,
        "eval/n": 4.0,
        "eval/mean_turns": 2.5,
        "eval/invalid_action_rate": 0.1,
        "eval/tool_calls_mean": 0.0,
        "eval/tool_errors_mean": 0.5,
        "eval/end_success": 0.75,
        "eval/seconds": 1.0,
    }
    r = episode_result(m, "sokoban", agentic=True)
    assert r["success_rate"] == 0.75 and r["success_rate_stderr"] == pytest.approx(0.25)  # sqrt(.75 * .25 / 3)
    assert r["accuracy_stderr"] == pytest.approx(0.25) and r["n"] == 4 and r["ends"] == {"success": 0.75}
    assert r["tool_errors_mean"] == 0.5  # the envs' tool counters reach results.json as training's eval logs them
    program = episode_result({**m, "eval/accuracy": 0.2, "eval/n": 5.0}, "agent", agentic=False)
    assert program["accuracy_stderr"] == pytest.approx(0.2) and "success_rate" not in program  # 1 of 5 episodes
    one = episode_result({**m, "eval/n": 1.0}, "sokoban", agentic=True)
    assert one["success_rate_stderr"] is None  # one episode: no spread to estimate
    t, single = types.SimpleNamespace(label="m", step=3), types.SimpleNamespace(label="o", step=None)
    write_eval_report(tmp_path, [(t, r), (single, one)], settings={"ks": [1], "n": 1}, files={}, argv=["roll-eval"])
    md = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "| model | step | success_rate | accuracy | reward | mean_turns | invalid_action_rate | n |" in md
    assert "| m | 3 | 0.7500 ± 0.2500 | 0.7500 ± 0.2500 | 0.5000 | 2.5000 | 0.1000 | 4 |" in md
    assert "| o | - | 0.7500 | 0.7500 | 0.5000 | 2.5000 | 0.1000 | 1 |" in md


def test_agent_program_episodes_the_engine_refused_are_counted_and_none_with_an_outcome_is_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An agent program's roll-eval left the episodes the engine refused out of `n` and the accuracy without a
    count, and with every episode refused reported an accuracy of 0.0 on 0 problems."""
    from roll_core.config.compose import ConfigError
    from roll_core.evaluate import episode_result

    # what pipeline=agent's evaluate returns: 6 held-out rows, 2 refused, 1 of the other 4 succeeded, 1 failed
    m = {"eval/accuracy": 0.25, "eval/reward": 0.25, "eval/n": 4.0, "eval/aborted_episodes": 2.0}
    m["eval/failed_episodes"] = 1.0
    with caplog.at_level("WARNING", logger="roll_core.evaluate"):
        r = episode_result(m, "agent", agentic=False)
    assert r["n"] == 4 and r["aborted_episodes"] == 2 and r["failed_episodes"] == 1
    assert r["accuracy_stderr"] == pytest.approx(0.25)  # sqrt(.25 * .75 / 3), over the 4 with an outcome
    assert "2 held-out episode(s) of agent were refused" in caplog.text
    with pytest.raises(ConfigError, match="no held-out episode had an outcome"):
        episode_result({**m, "eval/n": 0.0, "eval/accuracy": 0.0, "eval/aborted_episodes": 6.0}, "agent", False)
    with pytest.raises(ConfigError, match="no held-out episode had an outcome"):  # agentic: every seed refused
        episode_result({**m, "eval/n": 0.0, "eval/success_rate": 0.0}, "sokoban", True)


def test_summarize_gives_each_means_standard_error_over_problems() -> None:
    """Per problem, not per response: the 8 responses below are 4 problems, not 8 independent draws."""
    m = summarize(_rows(PROBLEMS), [1, 2])
    assert m["accuracy"] == pytest.approx(0.5)
    # per-problem mean correctness 1, .5, 0, .5: s^2 = (.25 + 0 + .25 + 0) / 3, se = sqrt(1/6 / 4)
    assert m["accuracy_stderr"] == pytest.approx(math.sqrt(1 / 24))
    assert m["pass@1_stderr"] == pytest.approx(math.sqrt(1 / 24))  # pass@1 is the per-problem mean correctness
    # pass@2 per problem 1, 1, 0, 1: 0.75 +- sqrt(.75 * .25 / 3) = 0.25
    assert m["pass@2"] == pytest.approx(0.75) and m["pass@2_stderr"] == pytest.approx(0.25)
    # majority right on 1, .5 (a tie), 0, .5 (a tie): 0.5 +- sqrt(1/24), as the accuracy
    assert m["maj"] == pytest.approx(0.5) and m["maj_stderr"] == pytest.approx(math.sqrt(1 / 24))
    # one response per problem, scores 1, 0, 1, 1: 0.75 +- 0.25
    single = summarize(_rows([[("7", 1)], [("3", 0)], [("7", 1)], [("7", 1)]]), [1])
    assert single["accuracy"] == pytest.approx(0.75) and single["accuracy_stderr"] == pytest.approx(0.25)
    assert single["pass@1_stderr"] == pytest.approx(0.25) and single["maj_stderr"] == pytest.approx(0.25)
    one = summarize(_rows(PROBLEMS[:1]), [1])
    assert one["accuracy_stderr"] is None and one["maj_stderr"] is None  # one problem: no spread to estimate


def test_comparison_files_show_mean_plus_minus_standard_error(tmp_path: Path) -> None:
    from roll_core.eval_compare import EvalTarget, write_outputs

    single = _rows([[("7", 1)], [("3", 0)], [("7", 1)], [("7", 1)]])
    a, b = EvalTarget("a", "a", 1), EvalTarget("b", "b", 2)
    results = [(a, _result(_rows(PROBLEMS), [1])), (b, _result(single, [1]))]
    write_outputs(tmp_path, results, [1], 2, {})
    md = (tmp_path / "comparison.md").read_text(encoding="utf-8")
    assert "| b | 2 | 0.7500 ± 0.2500 | 0.7500 ± 0.2500 | 0.7500 ± 0.2500 | 0.7500 |" in md  # acc, pass@1, maj@2
    assert f"| a | 1 | 0.5000 ± {math.sqrt(1 / 24):.4f} |" in md
    # domain d: a's problems score 1 and .5 (0.75 +- sqrt(.125 / 2)), b's 1 and 0 (0.5 +- sqrt(.5 / 2))
    assert "| d | 0.7500 ± 0.2500 (n=2) | 0.5000 ± 0.5000 (n=2) |" in md
    table = {r["model"]: r for r in csv.DictReader((tmp_path / "comparison.csv").open()) if r["breakdown"] == "all"}
    assert float(table["b"]["accuracy_stderr"]) == pytest.approx(0.25)
    assert float(table["a"]["maj_stderr"]) == pytest.approx(math.sqrt(1 / 24))
    stored = json.loads((tmp_path / "comparison.json").read_text())["models"][0]["metrics"]
    assert stored["accuracy_stderr"] == pytest.approx(math.sqrt(1 / 24))


def _fake_eval(monkeypatch: pytest.MonkeyPatch, rows: list[dict[str, Any]]) -> list[Any]:
    import roll_core.evaluate

    calls: list[Any] = []

    def evaluate_model(cfg: Any, *, samples: Any, n: int, ks: list[int]) -> dict[str, Any]:
        calls.append(cfg)
        return _result(rows, ks)

    monkeypatch.setattr(roll_core.evaluate, "evaluate_model", evaluate_model)
    return calls


def test_an_out_folder_holding_earlier_results_is_refused_before_evaluating_unless_overwrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A second `roll-eval ... --out ev` replaced the first call's samples.jsonl, comparison.* and report.md without
    a word: it is refused (exit 2, before hours of evaluation) naming the folder, its files and --overwrite. With
    --overwrite the earlier files go (none mixes with the new ones), other files stay; the printed lines carry the
    standard errors. (One composed call: composing the config takes seconds.)"""
    from roll_core.cli import eval_main

    out = tmp_path / "ev"
    out.mkdir()
    (out / "samples.jsonl").write_text("earlier\n")
    (out / "results.json").write_text("[]")
    (out / "notes.txt").write_text("mine")
    calls = _fake_eval(monkeypatch, _rows(PROBLEMS))
    argv = ["builtin:tiny", "--n", "2", "pipeline.eval_temperature=0.7", "--out", str(out)]
    assert eval_main(argv) == 2
    assert capsys.readouterr().err == (
        f"roll-eval: --out {out} already holds the results of an earlier evaluation or run (samples.jsonl, "
        "results.json): give another --out, or add --overwrite to replace them\n"
    )
    assert calls == [] and (out / "samples.jsonl").read_text() == "earlier\n"

    assert eval_main([*argv, "--overwrite"]) == 0, capsys.readouterr().err
    assert len(calls) == 1
    samples = (out / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 8 and json.loads(samples[0])["problem"] == "q0"
    assert not (out / "results.json").exists()  # an earlier agentic call's: not this call's results
    assert (out / "notes.txt").read_text() == "mine" and (out / "report.md").is_file()
    first, second, *_ = capsys.readouterr().out.splitlines()
    assert first.startswith(
        f"accuracy 0.5000 on 4 held-out problems of data (± {math.sqrt(1 / 24):.4f} standard error over problems, "
        "mean reward 0.5000"
    )
    assert re.match(r"accuracy (\d\.\d{4}) on (\d+) held-out problems of data", first)  # what scripts parse
    assert second.startswith(f"pass@1 0.5000 ± {math.sqrt(1 / 24):.4f}, pass@2 0.7500 ± 0.2500, maj@2 0.5000 ± ")
    # a folder without roll-eval's files is used as before
    from roll_core.eval_compare import existing_outputs

    assert existing_outputs(tmp_path / "new") == [] and existing_outputs(tmp_path) == []


def test_reports_are_written_in_utf8_whatever_the_locale(tmp_path: Path) -> None:
    """report.md was written in the locale's encoding: under an ASCII locale (LANG=C without Python's UTF-8 mode) a
    `±` of the tables or a non-ASCII checkpoint path raised UnicodeEncodeError after the whole evaluation ran."""
    import subprocess
    import sys

    script = (
        "import sys, types; from pathlib import Path; from roll_core.report import write_eval_report\n"
        "t = types.SimpleNamespace(label='mod\\u00e8le', step=3)\n"
        "r = {'success_rate': 0.5, 'accuracy': 0.5, 'n': 2}\n"
        "write_eval_report(Path(sys.argv[1]), [(t, r)], settings={'ks': [1], 'n': 1}, files={},"
        " argv=['roll-eval', '/runs/mod\\u00e8le \\u00b1 1'])\n"  # (escaped: an ASCII locale's command line)
    )
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    text = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "/runs/modèle ± 1" in text and "| modèle | 3 |" in text
