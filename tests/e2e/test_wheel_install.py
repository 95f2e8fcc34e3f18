"""A non-editable install of roll's five packages works from any folder: no conf/ there, no ROLL_CONF_DIR.

Builds wheels of the five packages from this checkout (pip wheel with hatchling, offline), installs them (not
editable, no dependencies) into a new venv that sees .venvs/wheel's packages (roll's third-party dependencies over
.venvs/bare's torch; `nox -s tests` or `nox -s wheel_venv` builds it), then runs the console scripts from a temp
folder outside the repository: `roll-train --cfg job experiment=quickstart` composes from the packaged configs, a
one-step run of the tiny model finishes, `roll-doctor` runs; and with roll-envs uninstalled, composing names the
missing package. About 40 s on 2 cores (the one-step run is most of it).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHEEL_PYTHON = Path(os.environ.get("ROLL_WHEEL_PYTHON") or ROOT / ".venvs" / "wheel" / "bin" / "python")
PACKAGES = ["roll-hw", "roll-algos", "roll-core", "roll-engines", "roll-envs"]

pytestmark = pytest.mark.skipif(
    not WHEEL_PYTHON.exists(),
    reason=f"{WHEEL_PYTHON} is absent: `nox -s tests` builds it (or `nox -s wheel_venv`)",
)


def _run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, **kwargs)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], Path]:
    """(the new venv's bin/, the environment to run its scripts with, a working folder outside the repository)."""
    tmp = tmp_path_factory.mktemp("wheel-install")
    wheels = tmp / "wheels"
    build = [str(WHEEL_PYTHON), "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    proc = _run([*build, "-w", str(wheels), *(str(ROOT / "packages" / p) for p in PACKAGES)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(wheels.glob("*.whl"))) == len(PACKAGES)

    venv = tmp / "venv"
    proc = _run([str(WHEEL_PYTHON), "-m", "venv", "--without-pip", str(venv)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    python = venv / "bin" / "python"
    # The dependencies (pip included) come from .venvs/wheel and .venvs/bare: their site folders, not copies.
    sites = "import sys; print('\\n'.join(p for p in sys.path if p.endswith('site-packages')))"
    dep_sites = _run([str(WHEEL_PYTHON), "-c", sites]).stdout
    own_site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    (Path(own_site) / "_roll_deps.pth").write_text(dep_sites)
    proc = _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", *map(str, wheels.glob("*.whl"))])
    assert proc.returncode == 0, proc.stderr[-3000:]

    work = tmp / "work"  # a user's folder: no conf/ in it, nothing of the repository above it
    work.mkdir()
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": str(tmp / "home"),
        "ROLL_CACHE_DIR": str(tmp / "cache"),
        "HF_HUB_OFFLINE": "1",
    }
    return venv / "bin", env, work


def test_the_install_is_not_the_checkout(installed: tuple[Path, dict[str, str], Path]) -> None:
    bin_dir, env, work = installed
    code = "import roll_core.conf, roll_engines.conf, roll_envs.conf as m; print(m.__file__)"
    proc = _run([str(bin_dir / "python"), "-c", code], env=env, cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(str(bin_dir.parent)) and str(ROOT) not in proc.stdout


def test_roll_train_composes_the_quickstart_from_any_folder(installed: tuple[Path, dict[str, str], Path]) -> None:
    bin_dir, env, work = installed
    proc = _run([str(bin_dir / "roll-train"), "--cfg", "job", "experiment=quickstart"], env=env, cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Groups of all three packages: roll-core's experiment and model, roll-engines' engines, roll-envs' env.
    for line in ("experiment: quickstart", "path: builtin:smollm2-135m", "max_num_seqs: 64", "digits: 1"):
        assert line in proc.stdout, line
    assert not (work / "conf").exists()


@pytest.mark.parametrize("experiment", ["agentic_sokoban", "sweep_tiny"])
def test_the_readmes_other_experiments_ship_with_the_wheel(
    installed: tuple[Path, dict[str, str], Path], experiment: str
) -> None:
    """They lived in the repository's conf/, which a wheel install does not have."""
    bin_dir, env, work = installed
    proc = _run([str(bin_dir / "roll-train"), "--cfg", "job", f"experiment={experiment}"], env=env, cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"experiment: {experiment}" in proc.stdout


def test_a_sweep_without_the_sweep_extra_is_one_line(installed: tuple[Path, dict[str, str], Path]) -> None:
    """This install has no roll-core[sweep] (nox's WHEEL_VENV): the Optuna sweep says which extra to install."""
    bin_dir, env, work = installed
    proc = _run([str(bin_dir / "roll-train"), "-m", "experiment=sweep_optuna"], env=env, cwd=work)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = "roll-train: hydra/sweeper=optuna needs hydra-optuna-sweeper: pip install 'roll-core[sweep]'"
    assert proc.stderr.strip().splitlines()[-1] == line and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_a_one_step_tiny_run_finishes(installed: tuple[Path, dict[str, str], Path]) -> None:
    bin_dir, env, work = installed
    out = work / "run"
    overrides = [
        "experiment=quickstart",
        "model=tiny",
        "model.max_response_length=6",
        "env.examples=0",  # the worked example makes the prompt longer than the tiny model's limit
        "algo.group_size=2",
        "pipeline.rollout_batch_size=2",
        "pipeline.max_steps=1",
        "pipeline.eval_every=0",
        "pipeline.progress=false",
        f"pipeline.output_dir={out}",
        "train_engine.micro_batch_size=4",
    ]
    proc = _run([str(bin_dir / "roll-train"), *overrides], env=env, cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward/mean" in r] == [1]


def test_roll_doctor_runs(installed: tuple[Path, dict[str, str], Path]) -> None:
    bin_dir, env, work = installed
    proc = _run([str(bin_dir / "roll-doctor")], env=env, cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cpu" in proc.stdout


def test_without_roll_envs_composing_names_the_package(installed: tuple[Path, dict[str, str], Path]) -> None:
    """Last: it uninstalls roll-envs from the module's venv."""
    bin_dir, env, work = installed
    proc = _run([str(bin_dir / "python"), "-m", "pip", "uninstall", "-q", "-y", "roll-envs"], env=env, cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _run([str(bin_dir / "roll-train"), "--cfg", "job", "experiment=quickstart"], env=env, cwd=work)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "The 'env' config group ships with roll-envs, which is not installed: pip install 'roll-envs[math]'" in (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr
