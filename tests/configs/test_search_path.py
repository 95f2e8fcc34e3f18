"""Where configs come from: each package ships its own groups, one file per option, and a user's folder goes first.

Covers roll_core.config.search_path and roll-core's Hydra search-path plugin in the editable install; a wheel
install from a folder outside the repository is tests/e2e/test_wheel_install.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

from roll_core.config import ConfigError, compose, to_object
from roll_core.config.search_path import config_dirs, config_packages, group_options, package_dir, user_conf_dir
from roll_core.testing import fill_missing

ROOT = Path(__file__).resolve().parents[2]

#: The groups each package ships (ARCHITECTURE.md: configs ship inside the packages).
SHIPPED = {
    "roll_core.conf": {"algo", "cluster", "experiment", "hw", "hydra", "model", "pipeline", "reward_model"},
    "roll_engines.conf": {"infer_engine", "train_engine"},
    "roll_envs.conf": {"env"},
}


def _options(folder: Path) -> set[str]:
    return {str(p.relative_to(folder).with_suffix("")) for p in folder.rglob("*.yaml")}


def test_each_package_ships_its_own_groups() -> None:
    assert config_packages()[:3] == list(SHIPPED)
    for module, groups in SHIPPED.items():
        folder = package_dir(module)
        assert folder is not None and folder.is_relative_to(ROOT / "packages"), module
        assert {p.name for p in folder.iterdir() if p.is_dir() and p.name[0] not in "_."} == groups, module
    core = package_dir("roll_core.conf")
    assert (core / "rlvr.yaml").is_file()
    assert {"quickstart", "agentic_quickstart"} <= {p.stem for p in (core / "experiment").glob("*.yaml")}


def test_every_option_has_one_source() -> None:
    # One source of truth: a YAML in two folders would let one copy drift while the other is the one composed.
    where = defaultdict(list)
    for folder in config_dirs():
        for option in _options(folder):
            where[option].append(str(folder))
    assert {k: v for k, v in where.items() if len(v) > 1} == {}
    assert user_conf_dir() == ROOT / "conf" and not (ROOT / "conf" / "rlvr.yaml").exists()


def _user_folder(root: Path) -> Path:
    conf = root / "conf"
    (conf / "algo").mkdir(parents=True)
    (conf / "experiment").mkdir()
    (conf / "algo" / "grpo.yaml").write_text(
        "# my GRPO\n# roll-train algo=grpo\ndefaults:\n  - algo_schema\nlr: 0.125\n"
    )
    (conf / "experiment" / "mine.yaml").write_text(
        "# @package _global_\n# mine\n# roll-train experiment=mine\n"
        "defaults:\n  - override /env: countdown\nexperiment: mine\npipeline:\n  max_steps: 3\n"
    )
    return conf


@pytest.mark.parametrize("how", ["conf_dir", "ROLL_CONF_DIR", "cwd"])
def test_a_user_folder_is_searched_before_the_packages(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = _user_folder(tmp_path)
    if how == "ROLL_CONF_DIR":
        monkeypatch.setenv("ROLL_CONF_DIR", str(conf))
    elif how == "cwd":
        monkeypatch.chdir(tmp_path)
    cfg = compose(["experiment=mine"], conf_dir=conf if how == "conf_dir" else None)
    fill_missing(cfg)
    typed = to_object(cfg)
    # The user's algo/grpo.yaml replaces the packaged one; everything else still comes from the packages.
    assert (typed.experiment, typed.algo.lr, typed.pipeline.max_steps) == ("mine", 0.125, 3)
    assert typed.env.name == "countdown" and typed.train_engine.name == "hf" and typed.algo.group_size == 8
    if how != "conf_dir":  # the listing tests and tools read agrees with what Hydra composed
        assert group_options("algo")["grpo"] == (conf / "algo" / "grpo.yaml").resolve()


def test_roll_conf_dir_that_is_not_a_folder_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLL_CONF_DIR", str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"ROLL_CONF_DIR=.*nope is not a folder"):
        compose([])


def test_other_hydra_apps_see_no_roll_groups(tmp_path: Path) -> None:
    # roll's search-path plugin is discovered by every Hydra app in the environment: it must add nothing unless
    # roll registered its configs in that process.
    (tmp_path / "app.yaml").write_text("x: 1\n")
    code = textwrap.dedent(f"""
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra
        with initialize_config_dir(config_dir={str(tmp_path)!r}, version_base=None):
            compose("app")
            print(sorted(s.provider for s in GlobalHydra.instance().config_loader().get_sources()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["['hydra',", "'main',", "'schema']"]


def _plugin_package(root: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str]) -> str:
    """An installed config package (a plugin's `add_config_package`) holding `files`; returns its module name, unique
    per test (a module imported once stays in sys.modules, with its first folder)."""
    import re

    from roll_core.config import search_path

    module = "acme_" + re.sub(r"\W", "_", root.name)
    package = root / "site" / module
    for name, text in {"__init__.py": "", **files}.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    monkeypatch.syspath_prepend(str(root / "site"))
    monkeypatch.setattr(search_path, "_packages", [*config_packages(), module])
    return module


@pytest.mark.parametrize("user_folder", [False, True])
def test_a_plugin_option_that_clashes_with_roll_is_refused(
    user_folder: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Hydra takes the first match; whether the plugin's algo/grpo won depended on whether a user folder existed.
    module = _plugin_package(tmp_path, monkeypatch, {"algo/grpo.yaml": "defaults:\n  - algo_schema\nlr: 0.5\n"})
    monkeypatch.chdir(tmp_path)
    if user_folder:
        (tmp_path / "conf" / "experiment").mkdir(parents=True)
    else:
        monkeypatch.setattr("roll_core.config.search_path.__file__", str(tmp_path / "x.py"))  # not a checkout
    assert (user_conf_dir() is not None) == user_folder
    with pytest.raises(ConfigError, match=rf"algo/grpo \(roll_core\.conf and {module}\).*your own conf folder"):
        compose(["algo=grpo"])


def test_roll_train_names_the_clash_in_one_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from roll_core import cli

    module = _plugin_package(tmp_path, monkeypatch, {"rlvr.yaml": "x: 1\n"})
    monkeypatch.setattr(sys, "argv", ["roll-train"])
    with pytest.raises(SystemExit) as exit_:
        cli.train_main()
    assert exit_.value.code == 2
    assert f"rlvr (roll_core.conf and {module})" in capsys.readouterr().err


def test_a_plugin_option_of_its_own_composes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _plugin_package(tmp_path, monkeypatch, {"algo/acme.yaml": "defaults:\n  - algo_schema\nlr: 0.5\n"})
    cfg = compose(["algo=acme"])
    fill_missing(cfg)
    assert to_object(cfg).algo.lr == 0.5
    assert group_options("algo")["acme"] == tmp_path / "site" / module / "algo" / "acme.yaml"
