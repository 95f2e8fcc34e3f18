"""A missing optional dependency is one line naming the pip extra, before anything is built and at the import site.

Absence is simulated: `sys.modules[name] = None` makes `import name` fail as if it were not installed (in a
subprocess for the CLI, with monkeypatch in this process otherwise). Each optional component is covered twice:
`roll_core.errors.check_installed` on the typed run config (what `roll-train` / `roll-eval` run first) and the
component's own import site (what a worker on another machine would hit).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from roll_core.config import compose, to_object
from roll_core.errors import MissingExtraError, check_installed

REPO = Path(__file__).resolve().parents[1]


def _block(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Make `import name` (and of its submodules, even ones already imported here) fail as if not installed."""
    for name in names:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.setitem(sys.modules, loaded, None)
        monkeypatch.setitem(sys.modules, name, None)


def _assert_one_line(exc: pytest.ExceptionInfo, extra: str) -> None:
    message = str(exc.value)
    assert "\n" not in message, message
    assert f"pip install '{extra}'" in message, message


#: (id, overrides, modules made absent, expected fragment of the message, the pip extra it names)
CASES = [
    (
        "megatron",
        ["train_engine=megatron"],
        ["megatron"],
        "train_engine=megatron needs megatron-core",
        "roll-engines[megatron]",
    ),
    ("lora-hf", ["train_engine.lora_rank=4"], ["peft"], "train_engine.lora_rank > 0 needs peft", "roll-engines[lora]"),
    (
        "lora-fsdp2",
        ["train_engine=fsdp2", "train_engine.lora_rank=4", "cluster=ray"],
        ["peft"],
        "train_engine.lora_rank > 0 needs peft",
        "roll-engines[lora]",
    ),
    ("sglang", ["infer_engine=sglang"], ["sglang"], "infer_engine=sglang needs SGLang", "roll-engines[sglang]"),
    (
        "vllm-here",
        ["infer_engine=vllm", "infer_engine.python=null"],
        ["vllm"],
        "infer_engine=vllm needs vLLM",
        "roll-engines[vllm]",
    ),
    ("ray", ["cluster=ray"], ["ray"], "cluster=ray needs Ray", "roll-core[ray]"),
    ("tensorboard", [], ["tensorboard"], "needs tensorboard", "roll-core[track]"),
    (
        "math",
        ["env=arithmetic"],
        ["math_verify"],
        "the math reward (boxed answers) needs math-verify",
        "roll-envs[math]",
    ),
    ("parquet", ["env=file", "env.path=train.parquet"], ["pyarrow"], "Parquet data", "roll-envs[data]"),
    (
        "gem",
        ["env=agentic", "env.env=gem:game:Sudoku-v0-easy"],
        ["gem"],
        "env.env=gem:<id> needs GEM",
        "roll-envs[gem]",
    ),
    (
        "skyrl",
        ["env=agentic", "env.env=skyrl:gsm8k"],
        ["skyrl_gym"],
        "env.env=skyrl:<id> needs SkyRL-Gym",
        "roll-envs[skyrl]",
    ),
    ("gym", ["env=agentic", "env.env=gym:CartPole-v1"], ["gymnasium"], "env.env=gym:<id> needs gymnasium", "gymnasium"),
]


@pytest.mark.parametrize(
    ("overrides", "blocked", "fragment", "extra"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_run_config_check_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, overrides: list[str], blocked: list[str], fragment: str, extra: str
) -> None:
    typed = to_object(compose(overrides))
    if all(importlib.util.find_spec(name) is not None for name in blocked):
        check_installed(typed)  # installed here: the check passes (vLLM and SGLang are not in the test venv)
    _block(monkeypatch, *blocked)
    with pytest.raises(MissingExtraError, match=re.escape(fragment)) as exc:
        check_installed(typed)
    _assert_one_line(exc, extra)


def test_datasets_folder_and_code_sandbox(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    folder = to_object(compose(["env=file", f"env.path={tmp_path}"]))
    code = to_object(compose(["env=code"]))
    _block(monkeypatch, "datasets")
    with pytest.raises(MissingExtraError, match="a datasets folder") as exc:
        check_installed(folder)
    _assert_one_line(exc, "roll-envs[data]")

    import roll_envs.sandbox.bwrap as bwrap

    def no_bwrap(explicit: str | None = None) -> str:
        raise FileNotFoundError("no usable bubblewrap")

    monkeypatch.setattr(bwrap, "find_bwrap", no_bwrap)
    with pytest.raises(MissingExtraError, match="env=code") as exc:
        check_installed(code)
    _assert_one_line(exc, "roll-envs[code]")
    # Explicitly unsandboxed runs need no bwrap.
    check_installed(
        to_object(compose(["env=code", "env.reward.allow_unsandboxed_execution_i_understand_the_risk=true"]))
    )


def test_vllm_auto_python_without_venv_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    typed = to_object(compose(["infer_engine=vllm"]))  # python=auto: here, else <repo>/.venvs/vllm
    compose_module = sys.modules["roll_core.config.compose"]  # the package exports a function of the same name
    _block(monkeypatch, "vllm")
    monkeypatch.delenv("ROLL_VENVS_DIR", raising=False)
    monkeypatch.setattr(compose_module, "find_conf_dir", lambda: tmp_path / "conf")  # no .venvs next to it
    with pytest.raises(MissingExtraError, match="nox -s vllm_venv") as exc:
        check_installed(typed)
    _assert_one_line(exc, "roll-engines[vllm]")


def test_engines_in_another_environment_are_not_checked_here(monkeypatch: pytest.MonkeyPatch) -> None:
    _block(monkeypatch, "sglang", "megatron")
    typed = to_object(compose(["infer_engine=sglang", f"infer_engine.python={sys.executable}"]))
    check_installed(typed)  # the engine's own venv is its business
    # A cluster joined by address: workers may have what the driver lacks.
    joined = to_object(compose(["train_engine=megatron", "cluster=ray", "cluster.address=auto"]))
    check_installed(joined)


# ---- import sites (reached when the early check is skipped, e.g. in a worker on another machine) ------------------
def test_import_sites_name_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from roll_core.cluster.launch import Cluster
    from roll_core.config.schema import ClusterConfig, HwConfig
    from roll_core.models import convert_gguf
    from roll_core.tracking import Tracker
    from roll_engines.infer.sglang import SGLangInferEngine
    from roll_engines.train._lora import apply_lora
    from roll_engines.train.megatron import MegatronTrainEngine
    from roll_envs.agentic.gem_adapter import GemEnv, GymTextEnv
    from roll_envs.agentic.skyrl_adapter import SkyRLEnv
    from roll_envs.rewards.math import MathReward
    from roll_envs.tasks.dataset import _rows

    sites = [
        ("megatron", lambda: MegatronTrainEngine("builtin:tiny"), "roll-engines[megatron]"),
        ("peft", lambda: apply_lora(None, 4, 16.0, 0.0, "all-linear"), "roll-engines[lora]"),
        ("sglang", lambda: SGLangInferEngine("builtin:tiny", device="cuda"), "roll-engines[sglang]"),
        ("tensorboard", lambda: Tracker(tmp_path / "run"), "roll-core[track]"),
        ("ray", lambda: Cluster(ClusterConfig(backend="ray"), HwConfig(platform="cpu")), "roll-core[ray]"),
        ("gguf", lambda: convert_gguf(tmp_path / "m.gguf", tmp_path / "out"), "roll-core[gguf]"),
        ("math_verify", MathReward, "roll-envs[math]"),
        ("pyarrow", lambda: _rows(tmp_path / "rows.parquet"), "roll-envs[data]"),
        ("datasets", lambda: _rows(tmp_path), "roll-envs[data]"),
        ("gem", lambda: GemEnv("game:Sudoku-v0-easy"), "roll-envs[gem]"),
        ("gymnasium", lambda: GymTextEnv("CartPole-v1"), "gymnasium"),
        ("skyrl_gym", lambda: SkyRLEnv("gsm8k", rows=[{"prompt": "x"}]), "roll-envs[skyrl]"),
    ]
    for module, build, extra in sites:
        with monkeypatch.context() as m:
            _block(m, module)
            with pytest.raises(MissingExtraError) as exc:
                build()
            _assert_one_line(exc, extra)


def test_gem_dependencies_of_the_extra_count_as_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """roll-envs[gem] installs what `import gem` needs: a missing reasoning_gym is the same one line."""
    import importlib

    from roll_envs.agentic.gem_adapter import GemEnv

    real = importlib.import_module

    def import_module(name: str, package: str | None = None):
        if name == "gem":  # gem-llm is there, but its own import needs reasoning_gym
            raise ModuleNotFoundError("No module named 'reasoning_gym'", name="reasoning_gym")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", import_module)
    with pytest.raises(MissingExtraError) as exc:
        GemEnv("game:Sudoku-v0-easy")
    _assert_one_line(exc, "roll-envs[gem]")


# ---- the CLI: one line on stderr, exit code 2, nothing built ------------------------------------------------------
@pytest.mark.parametrize(
    ("blocked", "override", "line"),
    [
        (
            "megatron",
            "train_engine=megatron",
            "roll-train: train_engine=megatron needs megatron-core: pip install 'roll-engines[megatron]'",
        ),
        (
            "math_verify",
            "env=arithmetic",
            "roll-train: the math reward (boxed answers) needs math-verify: pip install 'roll-envs[math]'",
        ),
    ],
)
def test_cli_prints_one_line_naming_the_extra(tmp_path: Path, blocked: str, override: str, line: str) -> None:
    script = (
        "import sys\n"
        f"sys.modules[{blocked!r}] = None\n"
        f"sys.argv = ['roll-train', {override!r}, 'hydra.run.dir={tmp_path}', 'hydra.output_subdir=null']\n"
        "from roll_core.cli import train_main\n"
        "train_main()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == line, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_roll_eval_needs_neither_ray_nor_tensorboard_nor_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """roll-eval scores with the inference engine in this process and writes no TensorBoard events."""
    typed = to_object(compose(["cluster=ray", "train_engine=megatron"]))
    _block(monkeypatch, "ray", "tensorboard", "megatron")
    check_installed(typed, training=False)
    with pytest.raises(MissingExtraError, match="roll-core"):
        check_installed(typed)


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "hydra/launcher=ray",
            "roll-train: hydra/launcher=ray needs hydra-ray-launcher: pip install 'roll-core[sweep]'",
        ),
        (
            "hydra/sweeper=optuna",
            "roll-train: hydra/sweeper=optuna needs hydra-optuna-sweeper: pip install 'roll-core[sweep]'",
        ),
    ],
)
def test_a_sweep_plugin_that_is_not_installed_is_one_line(tmp_path: Path, override: str, line: str) -> None:
    """Hydra finds its plugins by scanning the `hydra_plugins` namespace package; the portion that holds the two
    plugins roll-core[sweep] installs is taken off it, as if they were not installed (roll's own portion stays). Hydra
    said "Unknown plugin class" with a traceback for the launcher and listed sweeper options for Optuna."""
    script = (
        "import sys\nfrom pathlib import Path\nimport hydra_plugins\n"
        "hydra_plugins.__path__ = [p for p in hydra_plugins.__path__ if not any((Path(p) / d).exists() for d in "
        "('hydra_ray_launcher', 'hydra_optuna_sweeper'))]\n"
        f"sys.argv = ['roll-train', '-m', {override!r}, 'algo.lr=1e-6,2e-6', 'hydra.sweep.dir={tmp_path}']\n"
        "from roll_core.cli import train_main\n"
        "train_main()\n"
    )
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == line, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not list(tmp_path.glob("*/metrics.jsonl"))  # no job ran
