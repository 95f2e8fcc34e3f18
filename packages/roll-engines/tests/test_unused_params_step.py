"""Every trained parameter takes every optimizer step on every engine, one the step's backward never reached included
(roll_engines.train._optim.stepped_params): a vision-language model's vision tower in a step without pictures.

FSDP2's reduce-scatter gives such a parameter a zero gradient (and Megatron's gradient buffers always hold one), so
AdamW decays it and its moments carry on; torch's AdamW skipped it on the hf engine, whose gradient was None. A
text-only step at weight decay 0.1 left hf's vision tower as it was while fsdp2 decayed it (up to 8.5e-5 apart),
and a text-only step after a step with pictures moved fsdp2's tower by its momentum (1.7e-2) and not hf's."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from roll_core.pipelines.objectives import PolicyObjective

SETTINGS = {"lr": 1e-2, "micro_batch_size": 4}


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from roll_core.models import resolve_model_path

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    return resolve_model_path("builtin:tiny-qwen2.5-vl")


def _batch(path: str, pictures: bool) -> dict[str, Any]:
    """Three rows in the trainer's layout, each prompt with a picture or none (`mm_inputs`)."""
    from PIL import Image

    from roll_core.multimodal import VisionProcessor, as_content
    from roll_core.sequences import build_sequences, pad_left

    vp = VisionProcessor(path)
    pics = [[Image.new("RGB", (56, 56), (40 * i, 200, 9))] if pictures else [] for i in range(3)]
    prompts = [vp.encode_messages([{"role": "user", "content": as_content("look", len(p))}], p) for p in pics]
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(10, 60, (3, 4), generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    p_ids, p_mask = pad_left([ids for ids, _ in prompts], vp.tokenizer.pad_token_id)
    batch: dict[str, Any] = build_sequences(p_ids, p_mask, responses, mask)
    batch.update(prompts=p_ids, responses=responses, response_mask=mask)
    batch["advantages"] = torch.tensor([1.0, -0.5, 0.3])[:, None] * mask
    batch["old_logprobs"] = torch.zeros(mask.shape)
    batch["mm_inputs"] = [mm for _, mm in prompts]
    return batch


def _tower(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in weights.items() if k.startswith("model.visual.")}


def test_a_text_only_step_decays_the_vision_tower(path: str) -> None:
    """AdamW's first step on a zero gradient moves nothing but the decay: w * (1 - lr * weight_decay), biases and
    norms (no decay) as they were."""
    from roll_engines.train.hf import HFTrainEngine

    engine = HFTrainEngine(path, weight_decay=0.1, **SETTINGS)
    before = _tower(engine.get_weights())
    engine.train_step(_batch(path, pictures=False), PolicyObjective())
    after = _tower(engine.get_weights())
    factor = 1 - SETTINGS["lr"] * 0.1
    for name, w in before.items():
        want = w if w.ndim < 2 or name.endswith(".bias") else w * factor
        torch.testing.assert_close(after[name], want, atol=1e-7, rtol=1e-6, msg=name)


# torch warns when an FSDP2 root returns a view (the VLM's logits do); a false alarm, as in test_vlm_train.py.
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor:UserWarning")
def test_hf_equals_fsdp2_over_steps_with_and_without_pictures(path: str) -> None:
    """A step with pictures, then a text-only one (the tower's momentum carries on), at weight decay 0: hf's
    weights equal fsdp2's (a gloo group of one in this process)."""
    import torch.distributed as dist

    from roll_engines.train.fsdp2 import FSDP2TrainEngine
    from roll_engines.train.hf import HFTrainEngine

    batches = [_batch(path, pictures=True), _batch(path, pictures=False)]
    try:
        sharded = FSDP2TrainEngine.conformance_engine(path, **SETTINGS)
        for batch in batches:
            sharded.train_step(batch, PolicyObjective())
        got = sharded.get_weights()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    single = HFTrainEngine(path, **SETTINGS)
    start = _tower(single.get_weights())
    for batch in batches:
        single.train_step(batch, PolicyObjective())
    want = single.get_weights()
    moved = max((_tower(want)[k] - w).abs().max().item() for k, w in start.items())
    assert moved > 1e-3  # the tower trained
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, atol=1e-6, rtol=1e-5, msg=name)
