"""Picture size bounds (model.image_min_pixels / image_max_pixels) in the engines: on the hf path a prompt built
with a small bound has fewer placeholders, which the hf sampler and trainer both take (their log-probs agree);
the trainer's checkpoint saves its image processor with the bound (so `roll eval` on it builds the same prompts);
vLLM is given both bounds, resolved as the prompt builder resolves them. Bounds that cannot apply fail at engine
start. Tiny random Qwen2.5-VL, fp32, CPU."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from roll_core.models import resolve_model_path
from roll_core.multimodal import MMInputs, VisionProcessor, as_content
from roll_core.sequences import build_sequences, pad_left

CELL = 28 * 28  # one picture token of the Qwen2-VL families (2x2 patches of 14 pixels)
SMALL = {"min_pixels": CELL, "max_pixels": 4 * CELL}


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))


@pytest.fixture(scope="module")
def path() -> str:
    return resolve_model_path("builtin:tiny-qwen2.5-vl")  # its own processor: 4 to 16 tokens a picture


def _pictures() -> list[Image.Image]:
    g = torch.Generator().manual_seed(0)
    return [
        Image.fromarray(torch.randint(0, 255, (h, w, 3), generator=g, dtype=torch.uint8).numpy(), "RGB")
        for w, h in ((112, 112), (140, 84))
    ]


def _prompts(vp: VisionProcessor) -> list[tuple[list[int], MMInputs]]:
    a, b = _pictures()
    return [
        vp.encode_messages([{"role": "user", "content": as_content("what is <image> ?", 1)}], [a]),
        vp.encode_messages([{"role": "user", "content": as_content("<image> or <image>", 2)}], [b, a]),
    ]


def test_a_small_bound_gives_fewer_placeholders_that_the_hf_sampler_and_trainer_both_take(path: str) -> None:
    from roll_engines.infer.hf import HFInferEngine
    from roll_engines.train.hf import HFTrainEngine

    full, small = _prompts(VisionProcessor(path)), _prompts(VisionProcessor(path, **SMALL))
    assert [m.tokens_per_image for _, m in full] == [[16], [15, 16]]
    assert [m.tokens_per_image for _, m in small] == [[4], [2, 4]]
    image_token = VisionProcessor(path).image_token_id
    for (ids, mm), (ids_s, mm_s) in zip(full, small, strict=True):
        assert ids_s.count(image_token) == mm_s.num_tokens < ids.count(image_token) == mm.num_tokens
    infer = HFInferEngine(path, max_new_tokens=6, temperature=0.8, **{f"image_{k}": v for k, v in SMALL.items()})
    n = 2
    try:
        gen = infer.generate([p for p, _ in small], infer.defaults.replace(seed=5), n=n, mm=[m for _, m in small])
    finally:
        infer.shutdown()
    # (a seed whose samples hold no picture placeholder: the pipeline cuts a response at one, rollout.assemble)
    assert image_token not in gen.responses[gen.response_mask.bool()].tolist()
    p_ids, p_mask = pad_left([p for p, _ in small for _ in range(n)], infer.pad_id)
    batch: dict[str, Any] = build_sequences(p_ids, p_mask, gen.responses, gen.response_mask)
    batch.update(responses=gen.responses, response_mask=gen.response_mask)
    batch["mm_inputs"] = [m for _, m in small for _ in range(n)]
    train = HFTrainEngine(path, role="reference", image_max_pixels=4 * CELL, image_min_pixels=CELL)
    logp = train.compute_logprobs(batch, temperature=0.8)["logprobs"]
    torch.testing.assert_close(logp * gen.response_mask, gen.logprobs, atol=2e-4, rtol=1e-4)


def test_the_checkpoint_saves_the_runs_bound_so_eval_builds_the_same_prompts(path: str, tmp_path: Path) -> None:
    from roll_engines.train.hf import HFTrainEngine

    eng = HFTrainEngine(path, lr=1e-2, image_max_pixels=4 * CELL, image_min_pixels=CELL)
    eng.save(tmp_path / "ckpt", tokenizer_path=path)
    saved = tmp_path / "ckpt" / "model"
    size = json.loads((saved / "preprocessor_config.json").read_text())["size"]
    assert size == {"shortest_edge": CELL, "longest_edge": 4 * CELL}
    # roll eval on the checkpoint (no bound given): the run's prompts, pixel for pixel
    for (ids, mm), (ids_c, mm_c) in zip(
        _prompts(VisionProcessor(path, **SMALL)), _prompts(VisionProcessor(saved)), strict=True
    ):
        assert ids == ids_c and mm.tokens_per_image == mm_c.tokens_per_image
        torch.testing.assert_close(mm.tensors, mm_c.tensors, atol=0, rtol=0)
    # No bound: the folder's own processor is saved as it was
    plain = HFTrainEngine(path, role="reference")
    plain.save(tmp_path / "plain", tokenizer_path=path)
    size = json.loads((tmp_path / "plain" / "model" / "preprocessor_config.json").read_text())["size"]
    assert size == json.loads((Path(path) / "preprocessor_config.json").read_text())["size"]


def test_bounds_that_cannot_apply_fail_at_engine_start(path: str) -> None:
    from roll_engines.train.hf import HFTrainEngine

    with pytest.raises(ValueError, match=r"is not a vision-language model"):
        HFTrainEngine(resolve_model_path("builtin:tiny"), role="reference", image_max_pixels=4 * CELL)
    with pytest.raises(ValueError, match=r"dynamic-resolution families.*'llava'"):
        HFTrainEngine(resolve_model_path("builtin:tiny-llava"), role="reference", image_max_pixels=4 * CELL)
    with pytest.raises(ValueError, match=r"processor's min_pixels=3136 is above model.image_max_pixels=1000"):
        HFTrainEngine(path, role="reference", image_max_pixels=1000)


def test_vllm_gets_both_bounds_resolved_against_the_folders_processor(path: str) -> None:
    """vLLM's engine arguments (no vLLM needed to build them): the run's bounds as `mm_processor_kwargs`, the other
    bound filled from the folder's processor (transformers refuses a processor call's `size` with one edge)."""
    from roll_engines.infer._vllm_args import engine_args

    common: dict[str, Any] = dict(
        on_cpu=False, dtype="bfloat16", seed=0, tensor_parallel_size=1, max_num_seqs=8, max_model_len=512,
        enforce_eager=True, enable_prefix_caching=True, trust_remote_code=False, gpu_memory_utilization=0.5,
    )  # fmt: skip
    assert "mm_processor_kwargs" not in engine_args(path, vision=True, **common)
    kwargs = engine_args(path, vision=True, image_max_pixels=9 * CELL, **common)
    assert kwargs["mm_processor_kwargs"] == {"min_pixels": 4 * CELL, "max_pixels": 9 * CELL}  # min: the folder's
    kwargs = engine_args(path, vision=True, image_min_pixels=CELL, image_max_pixels=4 * CELL, **common)
    assert kwargs["mm_processor_kwargs"] == {"min_pixels": CELL, "max_pixels": 4 * CELL}
    with pytest.raises(ValueError, match="is a text model"):
        engine_args(resolve_model_path("builtin:tiny"), vision=False, image_max_pixels=4 * CELL, **common)
    with pytest.raises(ValueError, match="dynamic-resolution families"):
        engine_args(resolve_model_path("builtin:tiny-llava"), vision=True, image_max_pixels=4 * CELL, **common)


def test_every_engine_that_serves_pictures_takes_the_bound_keys() -> None:
    """The keys roll_core.multimodal.engine_pixels hands the engines of a bounded run (none for an unbounded one)."""
    from roll_core.interfaces.runtime import accepted_keys
    from roll_engines.infer.hf import HFInferEngine
    from roll_engines.infer.vllm import VLLMInferEngine
    from roll_engines.train.fsdp2 import FSDP2TrainEngine
    from roll_engines.train.hf import HFTrainEngine

    for engine in (HFTrainEngine, FSDP2TrainEngine, HFInferEngine, VLLMInferEngine):
        assert {"image_min_pixels", "image_max_pixels"} <= (accepted_keys(engine) or set()), engine.__name__
