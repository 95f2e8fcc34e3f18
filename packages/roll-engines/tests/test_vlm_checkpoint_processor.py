"""A vision-language checkpoint keeps its model folder's processor settings (roll_engines.train._vision
`keep_processor_config`), so transformers' `AutoProcessor` on the checkpoint expands each picture placeholder as
roll's prompts did: a hub LLaVA folder's `processor_config.json` (patch_size, vision_feature_select_strategy,
num_additional_image_tokens) was not copied, and `AutoProcessor` on the checkpoint failed at its first picture
(`patch_size` None). A `processor_config.json` in transformers 5's layout nests an image processor that transformers
reads before `preprocessor_config.json`: the copy nests the run's, so the run's picture size bounds still apply.
Tiny random models built from configs; the LLaVA folder gets the processor file its hub folders have."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from roll_core.models import resolve_model_path
from roll_core.multimodal import VisionProcessor, as_content

CELL = 28 * 28  # one Qwen2.5-VL picture token


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))


def _copy(name: str, to: Path) -> Path:
    shutil.copytree(resolve_model_path(f"builtin:{name}"), to)
    return to


def test_a_llava_checkpoint_expands_placeholders_in_transformers_as_roll_did(tmp_path: Path) -> None:
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, LlavaProcessor

    from roll_engines.train.hf import HFTrainEngine

    src = _copy("tiny-llava", tmp_path / "src")
    tok = AutoTokenizer.from_pretrained(src)
    settings = dict(patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    images = AutoImageProcessor.from_pretrained(src)
    LlavaProcessor(images, tok, chat_template=tok.chat_template, **settings).save_pretrained(src)  # as on the hub
    HFTrainEngine(str(src), role="reference").save(tmp_path / "ckpt", tokenizer_path=str(src))
    saved = tmp_path / "ckpt" / "model"
    pic = Image.new("RGB", (50, 36), (20, 180, 40))
    _, mm = VisionProcessor(src).encode_messages([{"role": "user", "content": as_content("<image> hi", 1)}], [pic])
    assert mm is not None and mm.tokens_per_image == [4]
    for folder in (src, saved):
        processor = AutoProcessor.from_pretrained(folder)
        assert {k: getattr(processor, k) for k in settings} == settings, folder
        out = processor(text=["<image> hi"], images=[pic], return_tensors="pt")
        assert int((out["input_ids"] == processor.image_token_id).sum()) == mm.num_tokens, folder
        torch.testing.assert_close(out["pixel_values"], mm.tensors["pixel_values"], atol=0, rtol=0)


def test_a_nested_image_processor_is_the_runs_with_its_picture_size_bounds(tmp_path: Path) -> None:
    from transformers import AutoImageProcessor

    from roll_engines.train.hf import HFTrainEngine

    src = _copy("tiny-qwen2.5-vl", tmp_path / "src")
    own = json.loads((src / "preprocessor_config.json").read_text())
    nested = {"image_processor": own, "processor_class": "Qwen2_5_VLProcessor"}  # transformers 5's save layout
    (src / "processor_config.json").write_text(json.dumps(nested))
    (src / "video_preprocessor_config.json").write_text(json.dumps({"fps": 2.0, "max_frames": 8}))
    HFTrainEngine(str(src), role="reference", image_max_pixels=4 * CELL, image_min_pixels=CELL).save(
        tmp_path / "ckpt", tokenizer_path=str(src)
    )
    saved = tmp_path / "ckpt" / "model"
    copied = json.loads((saved / "processor_config.json").read_text())
    assert copied["processor_class"] == "Qwen2_5_VLProcessor"
    read = AutoImageProcessor.from_pretrained(saved, backend="pil")  # (the nested one, read first)
    assert (read.size["shortest_edge"], read.size["longest_edge"]) == (CELL, 4 * CELL)
    pic = Image.new("RGB", (140, 84), (9, 9, 200))
    msgs = [{"role": "user", "content": as_content("x <image>", 1)}]
    ids, mm = VisionProcessor(src, min_pixels=CELL, max_pixels=4 * CELL).encode_messages(msgs, [pic])
    ids_c, mm_c = VisionProcessor(saved).encode_messages(msgs, [pic])
    assert mm is not None and mm_c is not None and mm.num_tokens < 16  # the bound shrank the picture
    assert ids == ids_c and mm.tokens_per_image == mm_c.tokens_per_image
    video = "video_preprocessor_config.json"
    assert (saved / video).read_text() == (src / video).read_text()
