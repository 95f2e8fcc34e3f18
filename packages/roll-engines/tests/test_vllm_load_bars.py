"""vLLM's weight-loading progress bar follows roll's off-a-terminal choice (roll_core.library_bars).

roll-train sets HF_HUB_DISABLE_PROGRESS_BARS=1 when stderr is not a terminal and engine workers inherit it; vLLM's
own "Loading safetensors checkpoint shards" bar does not read that variable, so `engine_args` turns it off
(`use_tqdm_on_load=False`). In the vLLM venv the keyword is also checked against vLLM's EngineArgs.
"""

from __future__ import annotations

import pytest

from roll_engines.infer._vllm_args import engine_args


def _kwargs() -> dict:
    return engine_args(
        "some/model",
        on_cpu=False,  # (on CPU it reads the folder's context length)
        dtype="bfloat16",
        seed=0,
        tensor_parallel_size=1,
        max_num_seqs=4,
        max_model_len=256,
        enforce_eager=True,
        enable_prefix_caching=True,
        trust_remote_code=False,
        gpu_memory_utilization=0.5,
    )


@pytest.mark.parametrize("value", ["1", "true", "YES"])
def test_off_a_terminal_vllm_loads_without_its_bar(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", value)
    assert _kwargs()["use_tqdm_on_load"] is False


@pytest.mark.parametrize("value", [None, "0", ""])
def test_on_a_terminal_vllm_keeps_its_default_bar(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", value)
    assert "use_tqdm_on_load" not in _kwargs()


def test_vllm_takes_the_keyword(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm", reason="vLLM runs in its own venv: nox -s vllm_venv (the tests session runs it there)")
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    assert EngineArgs(model="some/model", use_tqdm_on_load=_kwargs()["use_tqdm_on_load"]).use_tqdm_on_load is False
