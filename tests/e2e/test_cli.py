"""The command-line entry points as a user runs them: roll-train (Hydra app) and roll-eval, in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from roll_core.testing import tiny_overrides

BIN = Path(sys.executable).parent


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, ROLL_CONF_DIR=str(Path(__file__).resolve().parents[2] / "conf"))
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=600)


def test_roll_train_runs_and_roll_eval_scores_the_checkpoint(seven_task: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    overrides = tiny_overrides(seven_task, out, "pipeline.max_steps=4", "pipeline.eval_every=2")
    proc = _run([str(BIN / "roll-train"), *overrides], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.rindex("\n{") + 1 :])  # the printed summary is last
    assert summary["output_dir"] == str(out) and summary["final_eval_accuracy"] is not None
    for f in ("metrics.jsonl", "config.yaml", "curves.png", "samples.jsonl"):
        assert (out / f).exists(), f
    ckpt = out / "checkpoints" / "step_000004"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt / "actor" / "model")  # plain transformers loads it
    ev = _run(
        [
            str(BIN / "roll-eval"),
            str(ckpt),
            "model=tiny",
            "env=file",
            f"env.path={seven_task}",
            "model.max_response_length=6",
        ],
        tmp_path,
    )
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert ev.stdout.startswith("accuracy ") and "held-out problems" in ev.stdout


def test_roll_train_config_errors_exit_2_with_suggestion(tmp_path: Path) -> None:
    proc = _run([str(BIN / "roll-train"), "algo.lrr=1e-5"], tmp_path)
    assert proc.returncode == 2
    assert "Key 'lrr' not in 'AlgoConfig'" in proc.stderr and "Did you mean 'algo.lr'?" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _run([str(BIN / "roll-train"), "algo=grpo", "algo.group_size=1"], tmp_path)
    assert proc.returncode == 2 and "set algo.group_size >= 2" in proc.stderr


@pytest.mark.parametrize("flag", ["--help"])
def test_roll_eval_help(flag: str, tmp_path: Path) -> None:
    proc = _run([str(BIN / "roll-eval"), flag], tmp_path)
    assert proc.returncode == 0 and "held-out accuracy" in proc.stdout
