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
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_roll_train_runs_and_roll_eval_scores_the_checkpoint(seven_task: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    overrides = tiny_overrides(seven_task, out, "pipeline.max_steps=4", "pipeline.eval_every=2")
    proc = _run([str(BIN / "roll-train"), *overrides], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.rindex("\n{") + 1 :])  # the printed summary is last
    assert summary["output_dir"] == str(out) and summary["final_eval_accuracy"] is not None
    # pipeline.output_dir is Hydra's run folder too: no stray outputs/<date>/<time>/ in the working directory.
    assert not (tmp_path / "outputs").exists() and (out / ".hydra" / "overrides.yaml").is_file()
    for f in ("metrics.jsonl", "config.yaml", "curves.png", "samples.jsonl"):
        assert (out / f).exists(), f
    again = _run([str(BIN / "roll-train"), *overrides], tmp_path)  # the same folder again: one line, exit 2
    assert again.returncode == 2 and "already holds the checkpoints of a run" in again.stderr
    assert "Traceback" not in again.stderr, again.stderr[-2000:]
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
    # A benchmark file (--data: every row held out; it failed on every file, its rows leaving no training set)
    bench = _run(
        [str(BIN / "roll-eval"), str(ckpt), "model=tiny", "model.max_response_length=6", "--data", str(seven_task)],
        tmp_path,
    )
    assert bench.returncode == 0, bench.stderr[-3000:]
    rows = sum(1 for line in seven_task.read_text().splitlines() if line.strip())
    assert f"on {rows} held-out problems" in bench.stdout, bench.stdout


def test_roll_train_config_errors_exit_2_with_suggestion(tmp_path: Path) -> None:
    proc = _run([str(BIN / "roll-train"), "algo.lrr=1e-5"], tmp_path)
    assert proc.returncode == 2
    assert "Key 'lrr' not in 'AlgoConfig'" in proc.stderr and "Did you mean 'algo.lr'?" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _run([str(BIN / "roll-train"), "algo=grpo", "algo.group_size=1"], tmp_path)
    assert proc.returncode == 2 and "set algo.group_size >= 2" in proc.stderr
    # A misspelled experiment (it silently ran the defaults, exit 0: the group was optional)
    proc = _run([str(BIN / "roll-train"), "experiment=quickstrt"], tmp_path)
    assert proc.returncode == 2 and "Could not find 'experiment/quickstrt'" in proc.stderr, proc.stderr[-2000:]
    assert "quickstart" in proc.stderr and "Traceback" not in proc.stderr  # the options are listed


def test_errors_found_while_building_the_run_exit_2_without_traceback(seven_task: Path, tmp_path: Path) -> None:
    """Combinations only the pipeline can judge (they need the built task or engines) are config errors too."""
    proc = _run([str(BIN / "roll-train"), *tiny_overrides(seven_task, tmp_path / "a", "pipeline=agentic")], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "invalid config" in proc.stderr and "pipeline=agentic needs an agentic env" in proc.stderr
    assert "Traceback" not in proc.stderr
    gigpo = tiny_overrides(seven_task, tmp_path / "b", "algo.adv_estimator=gigpo")
    proc = _run([str(BIN / "roll-train"), *gigpo], tmp_path)
    assert proc.returncode == 2 and "use pipeline=agentic" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "outputs").exists()  # the runs named their folders (pipeline.output_dir)


def test_an_engine_context_below_every_prompt_is_one_line_exit_2(seven_task: Path, tmp_path: Path) -> None:
    """A context past the chat template but below every prompt of a step (the tiny task's are 32-33 tokens): one
    line naming both limits, exit 2 (it was a bare ValueError with a traceback, exit 1, after the first rollout)."""
    extra = ("infer_engine.max_model_len=25", "pipeline.max_steps=1")
    proc = _run([str(BIN / "roll-train"), *tiny_overrides(seven_task, tmp_path / "run", *extra)], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "roll-train: invalid config:\nevery prompt fills the inference engine's context" in proc.stderr
    assert "raise infer_engine.max_model_len" in proc.stderr and "lower model.max_prompt_length" in proc.stderr


def test_a_platform_this_machine_lacks_is_one_line_exit_2(tmp_path: Path) -> None:
    """hw.platform naming an installed platform this machine cannot run (the test plugin's `dummy`, off without
    ROLL_DUMMY_PLATFORM) was roll_hw's PlatformUnavailableError with a traceback, exit 1, in both commands."""
    env = {k: v for k, v in os.environ.items() if k not in ("ROLL_DUMMY_PLATFORM", "ROLL_PLATFORM")}
    train = [str(BIN / "roll-train"), "hw.platform=dummy", f"pipeline.output_dir={tmp_path / 'run'}"]
    evaluate = [str(BIN / "roll-eval"), "builtin:tiny", "hw.platform=dummy", "--out", str(tmp_path / "eval")]
    for name, cmd in (("roll-train", train), ("roll-eval", evaluate)):
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 2, (name, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert f"{name}: hw.platform: platform 'dummy' requested is unavailable: set ROLL_DUMMY_PLATFORM=1" in (
            proc.stderr
        )
        assert "or use hw=auto" in proc.stderr


def test_roll_train_help_imports_no_torch(tmp_path: Path) -> None:
    """`roll-train --help` (and `--cfg job`) compose the config from every installed package's `roll.configs` entry
    point; torch (~3 s here) came in through roll_envs' schemas (roll_core.interfaces, roll_core.multimodal) and the
    dummy engine plugin's `__init__`. The config printed is the composed one. `--cfg job` also validates it as a run
    does (roll_core.cli_dry_run), whose checks read roll-algos' lists: torch is then imported on purpose."""
    script = (
        "import sys\n"
        "sys.argv = ['roll-train', *sys.argv[1:]]\n"
        "from roll_core.cli import train_main\n"
        "try:\n    train_main()\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    for args in (["--help"], ["--cfg", "job", "experiment=quickstart"]):
        proc = _run([sys.executable, "-c", script, *args], tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        torch = args == ["--help"]  # (--cfg job validates: see the docstring)
        assert not torch or proc.stdout.strip().splitlines()[-1] == "TORCH False", (args, proc.stdout[-2000:])
        if args == ["--help"]:  # roll-train's own page (Hydra's began "cli is powered by Hydra"), no schemas
            assert "roll-train: train a model" in proc.stdout and "\nenv/reward: " in proc.stdout
            assert "_schema" not in proc.stdout and "\n  lr: " in proc.stdout  # the composed config follows
        else:
            assert "experiment: quickstart" in proc.stdout


@pytest.mark.parametrize("flag", ["--help"])
def test_roll_eval_help(flag: str, tmp_path: Path) -> None:
    proc = _run([str(BIN / "roll-eval"), flag], tmp_path)
    assert proc.returncode == 0 and "held-out accuracy" in proc.stdout


def test_ctrl_c_checkpoints_and_resume_true_finds_the_run(seven_task: Path, tmp_path: Path) -> None:
    """SIGINT mid-run: the step finishes, a checkpoint is written and roll-train exits 130. A new launch with
    pipeline.resume=true (a fresh Hydra folder, as every launch gets) finds that run, says so, and continues it:
    metrics and samples hold every step once."""
    import signal
    import time

    runs = tmp_path / "outputs"
    overrides = [o for o in tiny_overrides(seven_task, tmp_path, "pipeline.max_steps=40") if "output_dir" not in o]
    env = dict(os.environ)
    first = runs / "day" / "run1"
    proc = subprocess.Popen(
        [str(BIN / "roll-train"), *overrides, f"hydra.run.dir={first}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not ((first / "metrics.jsonl").exists() and len((first / "metrics.jsonl").read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "SIGINT received: finishing this step" in out + err
    done = [json.loads(line)["step"] for line in (first / "metrics.jsonl").read_text().splitlines()]
    assert 2 <= done[-1] < 40 and done == list(range(1, done[-1] + 1))
    assert (first / "checkpoints" / f"step_{done[-1]:06d}" / "state.json").exists()

    second = runs / "day" / "run2"
    proc2 = _run([str(BIN / "roll-train"), *overrides, "pipeline.max_steps=" + str(done[-1] + 2),
                  "pipeline.resume=true", f"hydra.run.dir={second}"], tmp_path)  # fmt: skip
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert f"continuing the latest run of 'rlvr': {first}" in proc2.stdout + proc2.stderr
    steps = [json.loads(line)["step"] for line in (first / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, done[-1] + 3))  # every step once, continued in the first run's folder
    sample_steps = {json.loads(line)["step"] for line in (first / "samples.jsonl").read_text().splitlines()}
    assert sample_steps == set(steps)


# CI time (31-41 s): tests/e2e/test_ray_exposure.py starts the same instance (`Cluster` with RAY_AUTH_MODE removed,
# as roll-train cluster=ray does) and checks token auth is on while a worker runs; `nox -s full_matrix` runs this.
@pytest.mark.full_matrix
@pytest.mark.ray
def test_a_ray_instance_roll_starts_keeps_token_auth(seven_task: Path, tmp_path: Path) -> None:
    """roll-train cluster=ray starts a local Ray instance with Ray's token authentication on (nobody on the network
    can submit work to it) unless the user opts out."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    overrides = tiny_overrides(seven_task, tmp_path / "run", "cluster=ray", "pipeline.max_steps=1")
    proc = subprocess.run(
        [str(BIN / "roll-train"), *overrides], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Token authentication is enabled for this Ray cluster" in proc.stdout + proc.stderr


# CI time (~17 s: two launches): the report's resume line; `nox -s full_matrix` runs it.
@pytest.mark.full_matrix
def test_a_resumed_runs_report_repeats_the_resume_launchs_overrides(seven_task: Path, tmp_path: Path) -> None:
    """Hydra's generated folders: the resume launch (pipeline.resume=true, algo.lr changed) runs in a folder of its
    own and continues the earlier run's; the report's commands repeated the first launch's overrides, so pasting
    its resume command reverted algo.lr."""
    base = [o for o in tiny_overrides(seven_task, tmp_path / "unused") if not o.startswith("pipeline.output_dir=")]
    first = _run([str(BIN / "roll-train"), *base, "pipeline.max_steps=2", "algo.lr=1e-6"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _run(
        [str(BIN / "roll-train"), *base, "pipeline.max_steps=3", "algo.lr=2e-6", "pipeline.resume=true"], tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout[resumed.stdout.rindex("\n{") + 1 :])
    report = (Path(summary["output_dir"]) / "report.md").read_text()
    assert "algo.lr=2e-6" in report and "algo.lr=1e-6" not in report, report[-2000:]
