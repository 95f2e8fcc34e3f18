"""A second stop signal while a run stops (Ctrl-C twice, a scheduler's SIGTERM repeated) aborts it cleanly.

`roll-train` in a real process: SIGTERM in step 2's update (the run finishes the step and saves), then SIGTERM again
while step 2's checkpoint is written, or while the stopped run shuts down. The partial checkpoint is dropped, the
latest complete one stays the one to resume from, and the user gets one line naming it and exit 128 + N. It was a
KeyboardInterrupt traceback, exit 1, and report.md said `failed: KeyboardInterrupt: ` with nothing on how to resume.
`roll-eval` stopped the same way keeps the models it finished (roll_core.eval_stop).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from roll_core.checkpoint import CheckpointManager
from roll_core.testing import tiny_overrides

#: roll-train with SIGTERM sent in step 2's update and again at argv[1]: `save` (once step 2's weights are in its
#: staging folder) or `shutdown` (the run over, its engines being shut down).
DRIVER = """
import os, signal, sys
from roll_core.cluster.launch import Cluster
from roll_core.pipelines.trainer import Trainer

update, save, shutdown = Trainer.update, Trainer.save, Cluster.shutdown
second = sys.argv[1]

def killing_update(self, step, *args, **kwargs):
    if step == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return update(self, step, *args, **kwargs)

def killing_save(self, folder, *args, **kwargs):
    out = save(self, folder, *args, **kwargs)
    if folder.name == "step_000002.tmp" and second == "save":
        os.kill(os.getpid(), signal.SIGTERM)
    return out

def killing_shutdown(self, *args, **kwargs):
    if second == "shutdown":
        os.kill(os.getpid(), signal.SIGTERM)
    return shutdown(self, *args, **kwargs)

Trainer.update, Trainer.save, Cluster.shutdown = killing_update, killing_save, killing_shutdown
from roll_core.cli import train_main

sys.argv = ["roll-train", *sys.argv[2:]]
train_main()
"""


@pytest.mark.parametrize("second", ["save", "shutdown"])
def test_a_second_sigterm_while_a_run_stops_exits_143_naming_the_checkpoint_to_resume(
    seven_task: Path, tmp_path: Path, second: str
) -> None:
    """The second SIGTERM in step 2's checkpoint write: the partial checkpoint is dropped, step 1's is the one to
    resume from. In the shutdown after the run stopped (step 2 saved): the summary is lost, not the checkpoint."""
    run = tmp_path / "run"
    overrides = tiny_overrides(seven_task, run, "pipeline.max_steps=4", "pipeline.save_every=1", "pipeline.keep_last=2")
    p = subprocess.run([sys.executable, "-c", DRIVER, second, *overrides], capture_output=True, text=True, timeout=300)
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr + p.stdout, p.stderr[-3000:]
    latest = run / "checkpoints" / ("step_000001" if second == "save" else "step_000002")
    during = (
        "stopping: the step in progress and any checkpoint being written were dropped"
        if second == "save"
        else "ending the run (its steps were over: final curves, trackers, shutdown)"
    )
    line = (
        f"roll-train: aborted by a second SIGTERM while {during}; the latest complete checkpoint is {latest}: "
        "pipeline.resume=true continues from it"
    )
    assert line in p.stderr.splitlines(), p.stderr[-3000:]
    assert (run / "checkpoints").is_dir() and CheckpointManager(run).latest() == latest
    assert not list((run / "checkpoints").glob("*.tmp"))  # no partial step_000002 left
    status = (run / "report.md").read_text().splitlines()[2]
    if second == "save":  # report.md says what happened (it said `failed: KeyboardInterrupt: `)
        assert status == f"- status: {line.removeprefix('roll-train: ')}"
    else:  # written before the shutdown: the run's own stop
        assert status == "- status: stopped by signal 15 (resume from step_000002)"
    assert (run / ".roll.lock").read_text() == ""  # released: the next launch may take the folder


#: roll-eval with the signal argv[1] sent inside the evaluation of model number argv[2] (1-based).
EVAL_DRIVER = """
import os, signal, sys
from roll_core import evaluate

real, calls = evaluate.sample_rows, []

def stopping_sample_rows(*args, **kwargs):
    calls.append(1)
    if len(calls) == int(sys.argv[2]):
        os.kill(os.getpid(), signal.Signals[sys.argv[1]])
    return real(*args, **kwargs)

evaluate.sample_rows = stopping_sample_rows
from roll_core.cli import eval_main

sys.exit(eval_main(sys.argv[3:]))
"""


def test_a_stopped_roll_eval_keeps_the_models_it_evaluated_and_exits_128_plus_n(
    seven_task: Path, tmp_path: Path
) -> None:
    """SIGTERM in the second of two models: the first one's results are written (report.md names the one not
    evaluated), one line says so, exit 143. SIGINT in the first: one line, nothing written, exit 130. Both were lost
    (Ctrl-C a traceback with exit 1; SIGTERM killed the process without a word)."""
    from roll_core.models import resolve_model_path

    folder = str(resolve_model_path("builtin:tiny"))  # the same model as a folder: a second target
    common = ["env=file", f"env.path={seven_task}", "env.eval_size=2", "model.max_response_length=4"]

    def launch(sig: str, at: int, out: Path) -> subprocess.CompletedProcess:
        argv = [sig, str(at), "builtin:tiny", folder, *common, "--out", str(out)]
        return subprocess.run([sys.executable, "-c", EVAL_DRIVER, *argv], capture_output=True, text=True, timeout=300)

    p = launch("SIGTERM", 2, tmp_path / "two")
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr + p.stdout, p.stderr[-3000:]
    stopped = [line for line in p.stderr.splitlines() if line.startswith("roll-eval: stopped by SIGTERM")]
    assert len(stopped) == 1 and stopped[0].endswith(
        ": writing the results of the 1 of 2 models evaluated (report.md lists the others)"
    ), p.stderr[-3000:]
    report = (tmp_path / "two" / "report.md").read_text()
    assert "**Warning:** the evaluation was stopped by SIGTERM: 1 model(s) were not evaluated" in report
    assert (tmp_path / "two" / "samples.jsonl").read_text().count("\n") == 2  # the first model's 2 problems
    p = launch("SIGINT", 1, tmp_path / "none")
    assert p.returncode == 128 + signal.SIGINT, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr + p.stdout, p.stderr[-3000:]
    assert p.stderr.rstrip().endswith(": no model was evaluated, nothing was written"), p.stderr[-3000:]
    assert not (tmp_path / "none").exists()
