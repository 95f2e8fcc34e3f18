"""Repository-level contracts: top-level layout, the CI matrix follows noxfile, .ci/run runs the README command."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import tomllib
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


def _pins(path: Path) -> dict[str, str]:
    """name -> version of every exact pin (`name==version`) in a constraints file."""
    from packaging.utils import canonicalize_name

    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonicalize_name(name)] = version.strip()
    return pins


def _requirements() -> list[tuple[str, str]]:
    """(package, requirement) for every dependency and extra requirement of roll's packages."""
    out = []
    for path in sorted(ROOT.glob("packages/*/pyproject.toml")):
        meta = tomllib.loads(path.read_text())["project"]
        reqs = meta.get("dependencies", []) + [r for v in meta.get("optional-dependencies", {}).values() for r in v]
        out += [(path.parent.name, r) for r in reqs]
    return out


def test_constraints_pin_torch_and_agree_with_the_packages() -> None:
    """Every hardware's constraints pin torch exactly (a plain `torch` pulls a CUDA build onto CPU runners), and every
    exact pin satisfies what roll's packages require of that distribution: a raised floor in a pyproject without a
    new pin (or a pin below a package's range) fails here instead of in pip's resolver on a runner."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    files = sorted((ROOT / "constraints").glob("*.txt"))
    assert {f.stem for f in files} >= {"cpu", "cuda", "rocm", "npu"}
    requirements = _requirements()
    assert any(canonicalize_name(Requirement(r).name) == "torch" for _, r in requirements)
    for f in files:
        pins = _pins(f)
        if f.stem in ("cpu", "cuda", "rocm", "npu"):
            assert "torch" in pins, f"constraints/{f.name} does not pin torch"
        for pkg, text in requirements:
            req = Requirement(text)
            version = pins.get(canonicalize_name(req.name))
            if version is not None:
                assert req.specifier.contains(version, prereleases=True), (
                    f"constraints/{f.name} pins {req.name}=={version}, but {pkg} requires {text!r}"
                )
