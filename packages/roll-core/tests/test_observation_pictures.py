"""Pictures in agentic observations stay the pictures that were observed.

An environment may hand back the same PIL image object every step and redraw it in place (one canvas per
environment). The rollout keeps each observation's pictures (`MMInputs.images`) for the whole episode: every later
turn's request carries them again, and engines that run their own image processor (vLLM) process them again at
each turn. Pictures aliased with the environment's canvas would then show the latest state in place of the earlier
ones, while the trainer's tensors and digests hold the states as observed: the behaviour log-probs of later turns
would come from other pictures than the ones trained on.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from PIL import Image

from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.env_manager import EnvManager
from roll_core.models import resolve_model_path
from roll_core.multimodal import VisionProcessor, digest, merge

RED, BLUE = (220, 20, 20), (20, 20, 220)


class CanvasEnv:
    """One canvas per environment, redrawn in place every step and returned as the observation's picture."""

    def __init__(self) -> None:
        self.canvas = Image.new("RGB", (56, 56), RED)

    def reset(self, seed: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        self.canvas.paste(RED, (0, 0, 56, 56))
        return {"text": "Now: <image>", "images": [self.canvas]}, {}

    def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        self.canvas.paste(BLUE, (0, 0, 56, 56))
        return {"text": "Now: <image>", "images": [self.canvas]}, 0.0, False, False, {}


@pytest.fixture(scope="module")
def vision() -> VisionProcessor:
    return VisionProcessor(resolve_model_path("builtin:tiny-qwen2.5-vl"))


def test_a_canvas_the_environment_redraws_in_place_keeps_each_observed_picture(vision: VisionProcessor) -> None:
    envs = EnvManager(CanvasEnv, 1)
    try:
        template = TurnTemplate(vision.tokenizer, vision=vision)
        first, _ = envs.reset(0, 0)
        _, mm_first = template.initial_turn(first)
        reply = vision.tokenizer("up", add_special_tokens=False)["input_ids"] + [vision.tokenizer.eos_token_id]
        second, *_ = envs.step(0, "up")
        _, mm_second = template.observation_turn(second, reply)
    finally:
        envs.close()
    episode = merge([mm_first, mm_second])  # what the next turn's request carries (Trajectory.mm)
    assert episode.images is not None and len(episode.images) == 2
    # The pictures sent to an engine with its own processor are the ones the digests and tensors were made from.
    assert [digest(im) for im in episode.images] == episode.digests
    assert episode.images[0].getpixel((0, 0)) == RED and episode.images[1].getpixel((0, 0)) == BLUE
    again = vision.process_images(episode.images)
    torch.testing.assert_close(again.tensors, episode.tensors, atol=0, rtol=0)
