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


# ---- extras: each one's requirements are used by the package's code ------------------------------------------
# Module a distribution installs, where it is not the distribution's name with "-" as "_".
IMPORT_OF = {
    "hydra-ray-launcher": "hydra_plugins.hydra_ray_launcher",
    "megatron-core": "megatron.core",
    "nvidia-ml-py": "pynvml",
    "mlflow-skinny": "mlflow",
    "pillow": "PIL",
}
# Requirements used without an `import` of their own in the package: (package, requirement) -> (file, text that
# shows the use). Anything else an extra lists must be imported somewhere in the package's src/.
USED_WITHOUT_IMPORT = {
    ("roll-core", "gguf"): ("packages/roll-core/src/roll_core/models.py", "gguf_file="),  # transformers reads GGUF
    ("roll-core", "accelerate"): ("packages/roll-core/src/roll_core/models.py", "gguf_file="),  # ... and needs it
    ("roll-core", "tensorboard"): (
        "packages/roll-core/src/roll_core/trackers/tensorboard.py",
        "torch.utils.tensorboard",
    ),
    ("roll-core", "hydra-optuna-sweeper"): (
        "packages/roll-core/src/roll_core/conf/experiment/sweep_optuna.yaml",
        "override /hydra/sweeper: optuna",
    ),
    # MLflow's SQL store (the default store in the run folder) runs on SQLAlchemy and Alembic; mlflow-skinny omits them.
    ("roll-core", "sqlalchemy"): ("packages/roll-core/src/roll_core/trackers/mlflow.py", "sqlite:///"),
    ("roll-core", "alembic"): ("packages/roll-core/src/roll_core/trackers/mlflow.py", "sqlite:///"),
    # SwanLab's local mode (swanboard) needs peewee 3; pynvml 12 keeps swanlab's `import pynvml` from warning.
    ("roll-core", "peewee"): ("packages/roll-core/src/roll_core/trackers/swanlab.py", "SWANBOARD.require()"),
    ("roll-core", "pynvml"): ("packages/roll-core/src/roll_core/trackers/swanlab.py", "import swanlab"),
    # gem-llm is installed with --no-deps (its antlr4 pin conflicts with omegaconf's): the extra carries its imports.
    ("roll-envs", "numpy"): ("packages/roll-envs/src/roll_envs/agentic/gem_adapter.py", "import gem"),
    ("roll-envs", "reasoning-gym"): ("packages/roll-envs/src/roll_envs/agentic/gem_adapter.py", "import gem"),
}
# Extras with no requirements of their own name code that needs only the package's dependencies.
EMPTY_EXTRAS = {
    ("roll-engines", "hf"): "packages/roll-engines/src/roll_engines/train/hf.py",
    ("roll-engines", "fsdp"): "packages/roll-engines/src/roll_engines/train/fsdp2.py",
}
TOOL_EXTRAS = {"test"}  # test tools, not code the package runs
EXTRA_MENTION = re.compile(r"\b(roll-(?:hw|algos|core|engines|envs))\[([a-z0-9_,-]+)\]")


def extras(pkg: str) -> dict[str, list[str]]:
    return pyproject(pkg)["project"].get("optional-dependencies", {})


def imported_modules(pkg: str) -> set[str]:
    """Every module name imported anywhere in the package's src/ (lazy imports inside functions included)."""
    found: set[str] = set()
    for path in (ROOT / "packages" / pkg / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _requirement(text: str) -> tuple[str, set[str]]:
    from packaging.requirements import Requirement

    req = Requirement(text)
    return req.name.lower(), set(req.extras)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_every_extra_names_code_that_uses_it(pkg: str) -> None:
    """No placeholder extras: each requirement of an extra is imported by the package's code (or used as listed in
    USED_WITHOUT_IMPORT), self-references name extras that exist, and an empty extra names existing code."""
    declared = extras(pkg)
    modules = imported_modules(pkg)
    unused = []
    for extra, reqs in declared.items():
        if not reqs:
            code = EMPTY_EXTRAS.get((pkg, extra))
            assert code and (ROOT / code).is_file(), f"{pkg}[{extra}] is empty and names no code (EMPTY_EXTRAS)"
            continue
        for text in reqs:
            name, sub = _requirement(text)
            if name == pkg:
                assert sub <= set(declared), f"{pkg}[{extra}] refers to missing extras {sorted(sub - set(declared))}"
                continue
            if extra in TOOL_EXTRAS:
                continue
            if (pkg, name) in USED_WITHOUT_IMPORT:
                path, needle = USED_WITHOUT_IMPORT[(pkg, name)]
                if needle not in (ROOT / path).read_text():
                    unused.append(f"{extra}: {text} ({path} no longer has {needle!r})")
                continue
            module = IMPORT_OF.get(name, name.replace("-", "_"))
            if not any(m == module or m.startswith(module + ".") for m in modules):
                unused.append(f"{extra}: {text} (nothing in packages/{pkg}/src imports {module})")
    assert not unused, f"{pkg} extras list dependencies no code of {pkg} uses: {unused}"
    for key in [*USED_WITHOUT_IMPORT, *EMPTY_EXTRAS]:  # the tables hold no stale entries
        if key[0] == pkg and key in EMPTY_EXTRAS:
            assert declared.get(key[1]) == [], f"EMPTY_EXTRAS lists {pkg}[{key[1]}], which is not an empty extra"
        elif key[0] == pkg:
            assert any(_requirement(r)[0] == key[1] for rs in declared.values() for r in rs), f"stale entry {key}"


def test_extras_named_in_docs_and_noxfile_exist() -> None:
    """Every `roll-<pkg>[extra]` in the READMEs, DEVELOPERS.md, the sources and noxfile's EXTRAS is declared."""
    files = [ROOT / "README.md", ROOT / "noxfile.py", *ROOT.glob("*.md"), *ROOT.glob("packages/*/README.md")]
    files += [p for pkg in PACKAGES for p in (ROOT / "packages" / pkg / "src").rglob("*.py")]
    mentions = {
        (m[1], e, f.name) for f in set(files) for m in EXTRA_MENTION.finditer(f.read_text()) for e in m[2].split(",")
    }
    nox = ast.parse((ROOT / "noxfile.py").read_text())
    for node in nox.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EXTRAS" for t in node.targets):
            for pkg, spec in ast.literal_eval(node.value).items():
                mentions |= {(pkg, e, "noxfile.py EXTRAS") for e in spec.strip("[]").split(",")}
    assert any(where == "noxfile.py EXTRAS" for _, _, where in mentions)
    missing = sorted(m for m in mentions if m[1] not in extras(m[0]))
    assert not missing, f"extras named but not declared: {missing}"
