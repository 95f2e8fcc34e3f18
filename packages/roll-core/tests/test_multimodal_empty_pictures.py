"""A picture with a zero side (0 x H, W x 0: an environment's crop of nothing, an empty array in a data row) is a
ValueError where it is read, like any picture that cannot be shown: the env manager ends that episode as a counted
`env_error` and the prompt builders skip that row. It used to load as a 0-pixel RGB image and then divide by zero
in the image processor (Qwen-VL's resize, CLIP's), a ZeroDivisionError that the rollout's `except ValueError`
did not catch: one bad observation ended the whole run."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from PIL import Image

from roll_core.agentic.env_manager import EnvFailure, EnvManager
from roll_core.models import resolve_model_path
from roll_core.multimodal import VisionProcessor, check_image, load_image
from roll_core.pipelines.rollout import BadPictures, encode_prompt

EMPTY = {
    "PIL 0x0": lambda: Image.new("RGB", (0, 0)),
    "PIL RGBA 0x40": lambda: Image.new("RGBA", (0, 40)),
    "array 40x0x3": lambda: np.zeros((40, 0, 3), np.uint8),
    "array 0x7 grey": lambda: np.zeros((0, 7), np.uint8),
}


@pytest.mark.parametrize("name", sorted(EMPTY))
def test_a_picture_without_pixels_is_a_value_error_where_it_is_read(name: str) -> None:
    for read in (load_image, check_image):
        with pytest.raises(ValueError, match=r"has no pixels"):
            read(EMPTY[name]())
    assert load_image(np.zeros((1, 1, 3), np.uint8)).size == (1, 1)  # one pixel is a picture


def test_an_environment_returning_one_is_a_counted_env_error_not_a_crash() -> None:
    class Cropper:
        """Its picture is a crop of its canvas; seed 0 crops nothing."""

        def reset(self, seed: int | None = None) -> tuple[Any, dict[str, Any]]:
            width = 0 if seed == 0 else 8
            return {"text": "you see <image>", "images": [np.zeros((8, width, 3), np.uint8)]}, {}

        def step(self, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
            raise AssertionError("not stepped")

    manager = EnvManager(Cropper, 1)
    with pytest.raises(EnvFailure, match="has no pixels"):
        manager.reset(0, 0)
    assert manager.counters()["env_errors"] == 1
    obs, _ = manager.reset(0, 1)
    assert obs["images"][0].size == (8, 8)


def test_a_problem_holding_one_is_a_bad_pictures_skip() -> None:
    vp = VisionProcessor(resolve_model_path("builtin:tiny-qwen2.5-vl"))

    class Problem:
        id, images = "p0", [Image.new("RGB", (0, 30))]

    class Task:
        def messages(self, problem: Any) -> list[dict[str, str]]:
            return [{"role": "user", "content": "what is <image> ?"}]

    with pytest.raises(BadPictures, match="has no pixels"):
        encode_prompt(vp.tokenizer, Task(), Problem(), 512, processor=vp)
