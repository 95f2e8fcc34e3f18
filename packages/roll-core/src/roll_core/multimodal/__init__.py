"""Vision-language inputs: pictures in data rows and observations, their processing, and their travel through the
batch protocol (field `mm_inputs`: one `MMInputs` or None per row) and inference requests (`Request.mm`).

- images: `load_image` (paths, bytes, base64, dicts, PIL, arrays -> upright RGB), `check_image` (header only) and
  `digest`.
- inputs: `MMInputs`, `merge`, `check_tokens` (placeholder / feature count agreement).
- processor: `VisionProcessor` (messages + pictures -> ids + MMInputs), `is_vision_model`, `as_content`,
  `mrope_positions`, and the image processor every consumer builds the same way: `load_image_processor` (PIL
  backend, the run's picture size bounds), `pixel_range`, `image_pixels`, `engine_pixels`.
- tiny: tiny random VLMs built from configs (`builtin:tiny-qwen2.5-vl`, `builtin:tiny-qwen2-vl`).
"""

from __future__ import annotations

import importlib
from typing import Any

# Names resolve on first use (PEP 562): `roll_core.multimodal.images` alone (what a task's config schema imports, so
# what composing a config imports) must not import torch through `inputs` and `processor`.
_WHERE = {
    "PILLOW": "images",
    "check_image": "images",
    "digest": "images",
    "load_image": "images",
    "MMInputs": "inputs",
    "check_tokens": "inputs",
    "count_image_tokens": "inputs",
    "merge": "inputs",
    "BACKEND": "processor",
    "FAMILIES": "processor",
    "IMAGE_MARKER": "processor",
    "VisionProcessor": "processor",
    "as_content": "processor",
    "engine_pixels": "processor",
    "image_pixels": "processor",
    "is_vision_model": "processor",
    "load_image_processor": "processor",
    "model_type": "processor",
    "mrope_positions": "processor",
    "pixel_range": "processor",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


__all__ = [
    "BACKEND",
    "FAMILIES",
    "IMAGE_MARKER",
    "PILLOW",
    "MMInputs",
    "VisionProcessor",
    "as_content",
    "check_image",
    "check_tokens",
    "count_image_tokens",
    "digest",
    "engine_pixels",
    "image_pixels",
    "is_vision_model",
    "load_image",
    "load_image_processor",
    "merge",
    "model_type",
    "mrope_positions",
    "pixel_range",
]
