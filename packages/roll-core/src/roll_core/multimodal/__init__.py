"""Vision-language inputs: pictures in data rows and observations, their processing, and their travel through the
batch protocol (field `mm_inputs`: one `MMInputs` or None per row) and inference requests (`Request.mm`).

- images: `load_image` (paths, bytes, dicts, PIL, arrays -> RGB) and `digest`.
- inputs: `MMInputs`, `merge`, `check_tokens` (placeholder / feature count agreement).
- processor: `VisionProcessor` (messages + pictures -> ids + MMInputs), `is_vision_model`, `as_content`,
  `mrope_positions`.
- tiny: tiny random VLMs built from configs (`builtin:tiny-qwen2.5-vl`, `builtin:tiny-qwen2-vl`).
"""

from roll_core.multimodal.images import PILLOW, digest, load_image
from roll_core.multimodal.inputs import MMInputs, check_tokens, count_image_tokens, merge
from roll_core.multimodal.processor import (
    FAMILIES,
    IMAGE_MARKER,
    VisionProcessor,
    as_content,
    is_vision_model,
    model_type,
    mrope_positions,
)

__all__ = [
    "FAMILIES",
    "IMAGE_MARKER",
    "PILLOW",
    "MMInputs",
    "VisionProcessor",
    "as_content",
    "check_tokens",
    "count_image_tokens",
    "digest",
    "is_vision_model",
    "load_image",
    "merge",
    "model_type",
    "mrope_positions",
]
