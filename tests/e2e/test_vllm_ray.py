"""vLLM in its own venv as the rollout engine of a GRPO run on Ray (the trainer stays in the main venv).

The engine actor starts with .venvs/vllm's python (Ray runtime_env py_executable), built by `nox -s vllm_venv`
(the tests session builds it). Skips when that venv is absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from roll_core.testing import reward_curve, run_pipeline, tiny_overrides

pytestmark = [pytest.mark.ray, pytest.mark.slow]
VLLM_PYTHON = os.environ.get("ROLL_VLLM_PYTHON") or str(Path(__file__).parents[2] / ".venvs/vllm/bin/python")


@pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(), reason=f"no vLLM venv at {VLLM_PYTHON} (nox -s vllm_venv)")
def test_grpo_learns_with_vllm_in_its_own_venv(ray_cluster, seven_task: Path, tmp_path: Path) -> None:
    _, history = run_pipeline(
        tiny_overrides(
            seven_task,
            tmp_path,
            "model.path=builtin:tiny-wide",  # vLLM's CPU attention needs heads of >= 32 dimensions
            "infer_engine=vllm",
            f"infer_engine.python={VLLM_PYTHON}",
            "infer_engine.max_model_len=512",
            "infer_engine.kv_cache_gb=1",
            "cluster=ray",
        )
    )
    r = reward_curve(history)
    assert sum(r[-4:]) / 4 > sum(r[:4]) / 4 + 0.25, r
    steps = [h for h in history if h["step"] > 0]
    # After every sync vLLM samples from exactly the trainer's policy (processed log-probs, reloaded weights).
    assert max(h["actor/train_infer_logprob_diff"] for h in steps) < 1e-4
    assert [h["sync/weight_version"] for h in steps] == list(range(1, len(steps) + 1))


@pytest.mark.full_matrix
@pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(), reason=f"no vLLM venv at {VLLM_PYTHON} (nox -s vllm_venv)")
def test_lora_adapter_sync_with_vllm_in_its_own_venv(ray_cluster, seven_task: Path, tmp_path: Path) -> None:
    """`train_engine.lora_rank=4 infer_engine.lora_sync=adapter`: the wiring gives the Ray engine its rank, the `dist`
    transport carries the adapter alone (tiny-wide, rank 4: 139264 fp32 bytes, the first sync too), and vLLM samples
    from exactly the trainer's policy after every sync (measured 2.3e-7; ~36 s with Ray's start, 2 cores)."""
    _, history = run_pipeline(
        tiny_overrides(
            seven_task,
            tmp_path,
            "model.path=builtin:tiny-wide",
            "infer_engine=vllm",
            f"infer_engine.python={VLLM_PYTHON}",
            "infer_engine.max_model_len=512",
            "infer_engine.kv_cache_gb=1",
            "cluster=ray",
            "train_engine.lora_rank=4",
            "infer_engine.lora_sync=adapter",
            "pipeline.max_steps=3",
        )
    )
    steps = [h for h in history if h["step"] > 0]
    assert max(h["actor/train_infer_logprob_diff"] for h in steps) < 1e-4
    assert [h["sync/bytes"] for h in steps] == [139_264.0] * 3
    assert [h["sync/weight_version"] for h in steps] == [1, 2, 3]
