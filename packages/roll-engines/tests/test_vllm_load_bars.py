"""vLLM's weight-loading progress bar follows roll's off-a-terminal choice (roll_core.library_bars).

roll-train sets HF_HUB_DISABLE_PROGRESS_BARS=1 when stderr is not a terminal and engine workers inherit it; vLLM's
own "Loading safetensors checkpoint shards" bar does not read that variable, so `engine_args` turns it off
(`use_tqdm_on_load=False`). In the vLLM venv the keyword is also checked against vLLM's EngineArgs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture
def engine_kwargs(vllm_engine_args: Callable[..., dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """The engine arguments as the environment stands when called (on_cpu=False: on CPU `engine_args` reads the
    folder's context length, and "some/model" is no folder)."""
    return lambda: vllm_engine_args("some/model", on_cpu=False, dtype="bfloat16")


@pytest.mark.parametrize("value", ["1", "true", "YES"])
def test_off_a_terminal_vllm_loads_without_its_bar(
    monkeypatch: pytest.MonkeyPatch, value: str, engine_kwargs: Callable[[], dict[str, Any]]
) -> None:
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", value)
    assert engine_kwargs()["use_tqdm_on_load"] is False


@pytest.mark.parametrize("value", [None, "0", ""])
def test_on_a_terminal_vllm_keeps_its_default_bar(
    monkeypatch: pytest.MonkeyPatch, value: str | None, engine_kwargs: Callable[[], dict[str, Any]]
) -> None:
    if value is None:
        monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", value)
    assert "use_tqdm_on_load" not in engine_kwargs()


def test_vllm_takes_the_keyword(monkeypatch: pytest.MonkeyPatch, engine_kwargs: Callable[[], dict[str, Any]]) -> None:
    pytest.importorskip("vllm", reason="vLLM runs in its own venv: nox -s vllm_venv (the tests session runs it there)")
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    assert (
        EngineArgs(model="some/model", use_tqdm_on_load=engine_kwargs()["use_tqdm_on_load"]).use_tqdm_on_load is False
    )
