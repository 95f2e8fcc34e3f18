"""roll-eval's labels of checkpoints that are not given as `checkpoints/step_N`, and comparisons of models scored on
different problems (roll_core.eval_compare)."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_core.eval_compare import expand_targets, x_axis


def _checkpoint(folder: Path) -> Path:
    """A roll checkpoint folder: its policy in actor/model."""
    (folder / "actor" / "model").mkdir(parents=True)
    (folder / "actor" / "model" / "config.json").write_text("{}")
    return folder


def test_a_checkpoint_not_named_step_n_is_labelled_by_its_folder_name(tmp_path: Path) -> None:
    """A copied or renamed checkpoint (run/best, run/final) is labelled by its folder's name (both were labelled
    by the policy subfolder, "model" and "model#2"), and is a checkpoint of its run: with a step_N checkpoint of
    the same run the labels stay short, with another run's they name their run."""
    run = tmp_path / "run"
    best, final = _checkpoint(run / "best"), _checkpoint(run / "final")
    step = _checkpoint(run / "checkpoints" / "step_000004")
    _checkpoint(tmp_path / "other" / "checkpoints" / "step_000002")

    targets = expand_targets([str(best), str(final)])
    assert [(t.label, t.step, t.run, t.model) for t in targets] == [
        ("best", None, "run", str(best / "actor" / "model")),
        ("final", None, "run", str(final / "actor" / "model")),
    ]
    assert [t.label for t in expand_targets([str(step), str(best)])] == ["step_4", "best"]
    assert [t.label for t in expand_targets([str(best), str(tmp_path / "other")])] == ["run/best", "other/step_2"]


def test_a_checkpoints_actor_model_folder_keeps_its_step(tmp_path: Path) -> None:
    """The policy folder of a checkpoint given directly (.../checkpoints/step_N/actor/model, what report.md calls
    "its actor/model") is that checkpoint: step N of its run, on the step axis (it was "model", "model#2" with no
    step, on the model axis)."""
    run = tmp_path / "run"
    models = [_checkpoint(run / "checkpoints" / f"step_{n:06d}") / "actor" / "model" for n in (4, 8)]

    targets = expand_targets([str(m) for m in models])

    assert [(t.label, t.step, t.run, t.model, t.source) for t in targets] == [
        ("step_4", 4, "run", str(models[0]), str(models[0])),
        ("step_8", 8, "run", str(models[1]), str(models[1])),
    ]
    assert x_axis(targets) == ("checkpoint step", [4.0, 8.0])
    # a copied checkpoint's policy folder: labelled by the checkpoint folder's name, not "model"
    best = _checkpoint(run / "best") / "actor" / "model"
    assert [t.label for t in expand_targets([str(best)])] == ["best"]
    # a Hugging Face folder that happens to be called model (not inside a checkpoint) keeps its name
    hf = tmp_path / "hf" / "model"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    assert [(t.label, t.step) for t in expand_targets([str(hf)])] == [("model", None)]


def _result(problems: list[str]) -> dict:
    from roll_core.eval_metrics import breakdown, summarize

    rows = [
        {"index": i, "problem": p, "sample": 0, "correct": 1.0, "reward": 1.0, "length": 3, "finish_reason": "stop",
         "formatted": 1.0, "domain": None, "difficulty": "unknown"}
        for i, p in enumerate(problems)
    ]  # fmt: skip
    return {
        "task": "data",
        "metrics": summarize(rows, [1]),
        "by_domain": breakdown(rows, "domain", [1]),
        "by_difficulty": breakdown(rows, "difficulty", [1]),
        "skipped_problems": 0,
        "reward_counters": {},
        "rows": rows,
    }


def test_models_scored_on_different_problems_are_said_to_be(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A model whose tokenizer makes two prompts too long is scored on the other problems only: 1.0 beside the
    other model's 1.0 over all four read as a tie on one benchmark. The comparison says which problems it lacks."""
    import json

    from roll_core.eval_compare import EvalTarget, write_outputs

    a, b = EvalTarget("a", "a"), EvalTarget("b", "b")
    results = [(a, _result(["q1", "q2", "q3", "q4"])), (b, _result(["q1", "q3"]))]
    write_outputs(tmp_path / "ev", results, [1], 1, {})
    (note,) = json.loads((tmp_path / "ev" / "comparison.json").read_text())["warnings"]
    assert note.startswith("b was scored on 2 of the 4 problems") and "missing: q2, q4;" in note
    assert f"**Warning:** {note}" in (tmp_path / "ev" / "comparison.md").read_text()
    assert note in caplog.text
    write_outputs(tmp_path / "same", [(a, _result(["q1"])), (b, _result(["q1"]))], [1], 1, {})
    assert json.loads((tmp_path / "same" / "comparison.json").read_text())["warnings"] == []


def test_labels_are_unique_whatever_the_inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A repeat was labelled `<label>#<count>` without looking at the other labels: `a`, `a`, `a#2` gave two `a#2`
    (one table column, one results file, for two models). A repeat now takes the first `#k` no input or earlier
    label holds; an input's own name is kept."""
    monkeypatch.chdir(tmp_path)  # hub ids: not folders here

    def labels(args: list[str]) -> list[str]:
        return [t.label for t in expand_targets(args)]

    assert labels(["a", "a", "a#2"]) == ["a", "a#3", "a#2"]
    assert labels(["a#2", "a", "a"]) == ["a#2", "a", "a#3"]
    assert labels(["a", "a", "a", "a#3"]) == ["a", "a#2", "a#4", "a#3"]
    assert labels(["a#2", "a#2", "a"]) == ["a#2", "a#2#2", "a"]
    for args in (["a", "a", "a#2", "a#2", "a#3", "a"], ["x"] * 5 + ["x#2", "x#4"]):
        got = labels(args)
        assert len(set(got)) == len(got), got
