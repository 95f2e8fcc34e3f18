"""The package graph: dependencies point down, siblings are ranges, no module imports an undeclared sibling."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["roll-hw", "roll-algos", "roll-core", "roll-engines", "roll-envs"]
IMPORT_NAME = {p: p.replace("-", "_") for p in PACKAGES}
# What each package may depend on (DEVELOPERS.md's table); transitive siblings must be declared to be imported.
ALLOWED = {
    "roll-hw": set(),
    "roll-algos": set(),
    "roll-core": {"roll-hw", "roll-algos"},
    "roll-engines": {"roll-hw", "roll-algos", "roll-core"},
    "roll-envs": {"roll-hw", "roll-algos", "roll-core"},
}


def pyproject(pkg: str) -> dict:
    return tomllib.loads((ROOT / "packages" / pkg / "pyproject.toml").read_text())


def existing() -> list[str]:
    return [p for p in PACKAGES if (ROOT / "packages" / p / "pyproject.toml").exists()]


def declared_siblings(pkg: str) -> dict[str, str]:
    out = {}
    for req in pyproject(pkg)["project"].get("dependencies", []):
        name = re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0]
        if name in PACKAGES:
            out[name] = req
    return out


def imported_siblings(pkg: str) -> dict[str, set[str]]:
    """sibling import name -> files importing it, over the package's src/ (tests excluded)."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "packages" / pkg / "src").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in IMPORT_NAME.values() and top != IMPORT_NAME[pkg]:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_all_five_packages_exist() -> None:
    assert existing() == PACKAGES


@pytest.mark.parametrize("pkg", PACKAGES)
def test_dependencies_point_down(pkg: str) -> None:
    assert set(declared_siblings(pkg)) <= ALLOWED[pkg]


@pytest.mark.parametrize("pkg", PACKAGES)
def test_siblings_are_ranges_not_pins(pkg: str) -> None:
    for req in declared_siblings(pkg).values():
        assert "==" not in req and "<" in req and ">=" in req, f"{pkg} pins {req!r}; use a range like >=0.1,<0.2"


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_undeclared_sibling_import(pkg: str) -> None:
    declared = {IMPORT_NAME[d] for d in declared_siblings(pkg)}
    for sibling, files in imported_siblings(pkg).items():
        assert sibling in declared, f"{pkg} imports {sibling} (in {sorted(files)}) without declaring it"


def test_roll_algos_depends_on_torch_only() -> None:
    deps = pyproject("roll-algos")["project"]["dependencies"]
    assert [re.split(r"[<>=]", d)[0] for d in deps] == ["torch"]


def test_roll_hw_has_no_required_dependencies() -> None:
    assert pyproject("roll-hw")["project"]["dependencies"] == []


@pytest.mark.parametrize("pkg", PACKAGES)
def test_package_layout(pkg: str) -> None:
    base = ROOT / "packages" / pkg
    meta = pyproject(pkg)["project"]
    assert meta["name"] == pkg and re.fullmatch(r"\d+\.\d+\.\d+", meta["version"])
    for f in ("README.md", "CHANGELOG.md", f"src/{IMPORT_NAME[pkg]}/__init__.py", "tests"):
        assert (base / f).exists(), f"{pkg} lacks {f}"
    assert meta["version"] in (base / "CHANGELOG.md").read_text()


def test_hardware_and_engine_extras() -> None:
    assert {"cuda", "rocm", "npu"} <= set(pyproject("roll-hw")["project"]["optional-dependencies"])
    assert {"hf", "fsdp", "megatron", "vllm", "sglang"} <= set(
        pyproject("roll-engines")["project"]["optional-dependencies"]
    )
    assert {"gem", "code"} <= set(pyproject("roll-envs")["project"]["optional-dependencies"])
