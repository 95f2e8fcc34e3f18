"""roll-eval given what users give it by mistake: a checkpoint evaluated under other settings than its run's (said,
with the command that evaluates it as its run did), a data file as the model, a missing --data file, a tokenizer or
model preset of another model (one line each, before an engine starts), and roll-train's help page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from roll_core.config import load_config
from roll_core.config.resume import config_dict
from roll_core.errors import ConfigError
from roll_core.eval_compare import expand_targets, run_settings_changed, run_settings_notes

TRAINED = ["model=tiny", "model.max_response_length=6", "env=file", "env.path=/data/seven.jsonl", "algo.lr=3e-3"]


def _run(root: Path, overrides: list[str] | None, steps: tuple[int, ...] = (2, 4)) -> Path:
    """A run folder as roll-train leaves it: checkpoints recording the run's config, Hydra's overrides record."""
    from roll_core.config.compose import compose

    run = root / "run"
    saved = config_dict(compose(TRAINED))  # composed, not validated: env.path names no file here
    for step in steps:
        ckpt = run / "checkpoints" / f"step_{step:06d}"
        (ckpt / "actor" / "model").mkdir(parents=True)
        (ckpt / "actor" / "model" / "config.json").write_text("{}")
        (ckpt / "config.yaml").write_text(yaml.safe_dump(saved))
    if overrides is not None:
        (run / ".hydra").mkdir()
        (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    return run


def _eval_cfg(*overrides: str) -> Any:
    from roll_core.config.compose import compose

    return compose(list(overrides))


def test_a_checkpoint_evaluated_under_other_settings_than_its_runs_is_said(tmp_path: Path) -> None:
    """roll-eval composes its config from the command line (roll-train's defaults: env=arithmetic, the tiny preset's
    response limit 16), not from the checkpoint: `roll-eval run/` without the run's overrides scored the checkpoints
    on another task and said nothing. The differing settings are listed, once per run, with the command that
    evaluates as the run did; keys the command line sets on purpose are not."""
    run = _run(tmp_path, TRAINED)
    targets = expand_targets([str(run)])
    lines = run_settings_changed(targets[0], _eval_cfg())
    assert "model.max_response_length: 6 -> 16" in lines
    assert 'env.name: "data" -> "arithmetic"' in lines
    assert not any(k.startswith(("model.path", "algo.", "pipeline.output_dir")) for k in lines)  # not what scores

    notes = run_settings_notes(targets, [_eval_cfg()] * 2, [], data=False, samples=False)
    assert len(notes) == 1  # both checkpoints of the run: one note
    assert notes[0].startswith("step_2, step_4 were trained with other settings than this evaluation uses")
    assert "  model.max_response_length: 6 -> 16\n" in notes[0]
    assert notes[0].endswith(f"evaluate as the run did with: roll-eval {run} {' '.join(TRAINED)}")

    # The run's own settings: nothing to say. A deliberate key=value (sampled pass@k) is not a mismatch.
    same = _eval_cfg(*TRAINED, "pipeline.eval_temperature=0.7")
    assert run_settings_notes(targets, [same] * 2, ["pipeline.eval_temperature=0.7"], data=False, samples=False) == []
    # A benchmark file (--data) replaces the task on purpose: only the model's settings are compared.
    bench = ["model=tiny", "env=file", "env.path=/bench.jsonl"]
    assert run_settings_notes(targets[:1], [_eval_cfg(*bench, "model.max_response_length=6")], [], data=True,
                              samples=False) == []  # fmt: skip
    (note,) = run_settings_notes(targets[:1], [_eval_cfg(*bench)], [], data=True, samples=False)
    assert "\n  model.max_response_length: 6 -> 16\nThe accuracy" in note
    # A run folder without Hydra's record: the note says which overrides to give instead of a command.
    other = _run(tmp_path / "b", None, steps=(2,))
    note = run_settings_notes(expand_targets([str(other)]), [_eval_cfg()], [], data=False, samples=False)[0]
    assert note.startswith("step_2 was trained") and "give the overrides the run was launched with" in note
    # A model that is not a roll checkpoint, or one recording no config: nothing to compare.
    (other / "checkpoints" / "step_000002" / "config.yaml").unlink()
    assert run_settings_changed(expand_targets([str(other)])[0], _eval_cfg()) == []


def test_roll_eval_prints_the_note_before_evaluating_and_writes_it_in_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import roll_core.evaluate
    from roll_core.cli import eval_main

    run = _run(tmp_path, TRAINED, steps=(2,))
    seen: list[str] = []

    def evaluate_model(cfg: Any, **_: Any) -> dict[str, Any]:
        seen.append(capsys.readouterr().err)  # what was said before the evaluation started
        return {"accuracy": 0.5, "reward": 0.5, "n": 2, "task": "arithmetic"}

    monkeypatch.setattr(roll_core.evaluate, "evaluate_model", evaluate_model)
    assert eval_main([str(run / "checkpoints" / "step_000002"), "--out", str(tmp_path / "ev")]) == 0
    assert "roll-eval: warning: step_2 was trained with other settings" in seen[0]
    assert "model.max_response_length: 6 -> 16" in seen[0]
    report = (tmp_path / "ev" / "report.md").read_text()
    assert "**Warning:** step_2 was trained with other settings" in report
    assert "  model.max_response_length: 6 -> 16" in report and "evaluate as the run did with: roll-eval" in report


def test_a_file_given_as_the_model_is_called_a_file(tmp_path: Path) -> None:
    """A benchmark file in the model's place was "model.path=rows.jsonl does not exist" (it does)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1", "answer": "2"}\n')
    with pytest.raises(ConfigError, match=r"rows\.jsonl is a file, not a model: .* goes to --data"):
        expand_targets([str(rows)])


def test_a_missing_data_file_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """It said "data file nope.jsonl does not exist: check env.path", a setting the user never wrote."""
    from roll_core.cli import eval_main

    assert eval_main(["builtin:tiny", "--data", str(tmp_path / "nope.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"roll-eval: --data {tmp_path / 'nope.jsonl'} does not exist" in err and "env.path" not in err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.tokenizer=/nope/tokenizer"], r"model\.tokenizer=/nope/tokenizer: no tokenizer could be loaded"),
        # A preset of another family (Qwen's stop tokens) on a llama-shaped checkpoint
        (["model=qwen2_5", "model.path=builtin:tiny"], r"'<\|im_end\|>' is not a token of the tokenizer.*model="),
    ],
)
def test_a_tokenizer_or_preset_of_another_model_is_one_config_error_before_an_engine_starts(
    overrides: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both were tracebacks (transformers' OSError, the sampling setup's ValueError) after the inference engine had
    loaded the model."""
    import roll_core.evaluate

    def no_engine(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an engine was started before the settings were checked")

    monkeypatch.setattr(roll_core.evaluate, "Cluster", no_engine)
    cfg = load_config(["model=tiny", *overrides])
    with pytest.raises(ConfigError, match=message):
        roll_core.evaluate.evaluate_model(cfg, samples=2)


def test_roll_train_help_lists_options_not_schemas() -> None:
    """Hydra's page began "cli is powered by Hydra" and listed every group's schema (algo_schema, ...) as if it
    were an option; roll-train's says what the program is and how to run it."""
    from roll_core.cli import HELP_HEADER, help_groups
    from roll_core.registry import register_all_configs

    register_all_configs()
    groups = dict(line.split(": ", 1) for line in help_groups().splitlines())
    assert "_schema" not in help_groups()
    assert "grpo" in groups["algo"].split(", ") and "quickstart" in groups["experiment"].split(", ")
    assert "math" in groups["env/reward"].split(", ")  # a nested group, stored by its package in Python only
    assert not any(g.startswith("hydra") for g in groups)
    assert HELP_HEADER.startswith("roll-train: ") and "Usage: roll-train" in HELP_HEADER


def test_home_relative_data_and_out_are_expanded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`--data=~/bench.jsonl` and `--out=~/ev` reach roll-eval unexpanded (the shell expands a tilde only where a
    word starts): the benchmark was "does not exist", the outputs went to a folder literally named `~`."""
    import roll_core.evaluate
    from roll_core.cli import eval_main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    seen: list[Any] = []

    def evaluate_model(cfg: Any, **_: Any) -> dict[str, Any]:
        seen.append(cfg.env.path)
        return {"accuracy": 1.0, "reward": 1.0, "n": 1, "task": "data"}

    monkeypatch.setattr(roll_core.evaluate, "evaluate_model", evaluate_model)
    assert eval_main(["builtin:tiny", "--data=~/bench.jsonl", "--out=~/ev"]) == 0, capsys.readouterr().err
    assert seen == [str(tmp_path / "bench.jsonl")]
    assert (tmp_path / "ev" / "report.md").is_file() and not (tmp_path / "~").exists()


def test_a_benchmark_file_still_compares_the_runs_system_prompt(tmp_path: Path) -> None:
    """--data replaces the task with a benchmark, so the task's settings were not compared at all: a run trained with
    env.system_prompt, scored on a benchmark without it, was prompted as it never was in training, and nothing said
    so. The system prompt is compared; the benchmark's own settings (path, columns, reward) are not."""
    from roll_core.config.compose import compose

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_000002"
    (ckpt / "actor" / "model").mkdir(parents=True)
    (ckpt / "actor" / "model" / "config.json").write_text("{}")
    trained = [*TRAINED, "env.system_prompt=Think step by step."]
    (ckpt / "config.yaml").write_text(yaml.safe_dump(config_dict(compose(trained))))
    targets = expand_targets([str(run)])
    bench = ["model=tiny", "model.max_response_length=6", "env=file", "env.path=/bench.jsonl", "env.answer_key=sol"]
    (note,) = run_settings_notes(targets, [_eval_cfg(*bench)], [], data=True, samples=False)
    assert '\n  env.system_prompt: "Think step by step." -> null\nThe accuracy' in note
    assert "answer_key" not in note and "env.path" not in note
    same = _eval_cfg(*bench, "env.system_prompt=Think step by step.")
    assert run_settings_notes(targets, [same], [], data=True, samples=False) == []
    # set on the command line: a deliberate change, not a mismatch
    given = ["env.system_prompt=Answer briefly."]
    assert run_settings_notes(targets, [_eval_cfg(*bench, *given)], given, data=True, samples=False) == []
