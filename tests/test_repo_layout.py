"""Repository-level contracts: top-level layout, the CI matrix follows noxfile, .ci/run runs the README command."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_top_level_entries() -> None:
    for entry in (
        "packages",
        "conf",
        "tests",
        "noxfile.py",
        "README.md",
        ".ci/run",
        ".github/workflows",
        "bench",
        "examples",
        "constraints/cpu.txt",
    ):
        assert (ROOT / entry).exists(), entry


def _nox_sessions() -> set[str]:
    import nox.registry

    spec = importlib.util.spec_from_file_location("roll_noxfile", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return set(nox.registry.get())


def test_ci_matrix_matches_nox_sessions() -> None:
    sessions = _nox_sessions()
    workflow = yaml.safe_load((ROOT / ".github/workflows/ci.yml").read_text())
    used: set[str] = set()
    for job in workflow["jobs"].values():
        for step in job.get("steps", []):
            for m in re.finditer(r"nox\s+-s\s+([\w-]+)", step.get("run", "")):
                used.add(m.group(1))
    assert used == sessions, f"ci.yml runs {sorted(used)}, noxfile defines {sorted(sessions)}"
    cpu_pkgs = workflow["jobs"]["unit"]["strategy"]["matrix"]["package"]
    assert cpu_pkgs == ["roll-hw", "roll-algos", "roll-core", "roll-engines", "roll-envs"]
    assert set(workflow["jobs"]["device"]["strategy"]["matrix"]["hardware"]) == {"cuda", "rocm", "npu"}


def test_ci_run_uses_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- test-command -->\s*```bash\n(.+?)\n```", readme, re.S)
    assert m, "README.md must mark its test command with <!-- test-command -->"
    assert m.group(1).strip() in (ROOT / ".ci/run").read_text()


def test_cpu_constraints_pin_the_cpu_torch() -> None:
    assert "torch==2.13.0\n" in (ROOT / "constraints/cpu.txt").read_text()
