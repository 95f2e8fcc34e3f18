"""The dtype of a `model.dtype=bfloat16` run's exported `model/` folder, engine by engine, as documented
(docs/concepts/trainer-and-collectors.md, `save` of roll_engines.train._hf_checkpoint and .megatron._weights):
- `hf`, `fsdp2`: the trained parameters, fp32 masters (train_engine.param_dtype), bit for bit: a resume reads them
  back from `model/`, the only copy kept, so the folder cannot be bf16 without a resume from rounded weights;
- with LoRA: the merged model in the compute dtype (the base is held in it; the adapter is `adapter/`);
- `megatron`: the compute dtype (its fp32 masters are in `optimizer/`).
(Megatron's saying that the hf engine wrote bf16 like it was wrong: it wrote fp32.)"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from roll_core.pipelines.objectives import PolicyObjective
from roll_core.testing.batches import toy_batch
from roll_core.testing.models import tiny_model


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> str:
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    return tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"), family="qwen2.5")


@pytest.mark.parametrize(
    ("engine", "exported"),
    [
        ("hf", "float32"),
        ("fsdp2", "float32"),
        ("lora", "bfloat16"),
        ("fsdp2_lora", "bfloat16"),
        ("megatron", "bfloat16"),
    ],
)
def test_a_bf16_runs_export_dtype_per_engine(
    base: str, tmp_path: Path, engine: str, exported: str, one_process_train_engine: Callable[..., Any]
) -> None:
    from transformers import AutoModelForCausalLM

    e = one_process_train_engine(engine, base, lr=1e-2, dtype="bfloat16")
    e.train_step(toy_batch(base), PolicyObjective())
    e.save(tmp_path, base)
    folder = tmp_path / "model"
    assert json.loads((folder / "config.json").read_text())["dtype"] == exported
    saved = dict(AutoModelForCausalLM.from_pretrained(folder, dtype="auto").named_parameters())
    assert {str(p.dtype) for p in saved.values()} == {f"torch.{exported}"}
    if engine in ("hf", "fsdp2"):  # the masters themselves, which a resume reads back
        masters = e.get_weights()
        assert {str(w.dtype) for w in masters.values()} == {"torch.float32"}
        for name, w in saved.items():
            torch.testing.assert_close(w, masters[name], atol=0, rtol=0, msg=name)
