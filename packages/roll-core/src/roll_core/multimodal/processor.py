"""A vision-language model's prompt processor: chat messages with pictures -> token ids + `MMInputs`.

`VisionProcessor(path)` reads the model folder: the tokenizer, the image processor and the chat template (the
processor's own `chat_template.jinja`/`.json` where the folder has one, else the tokenizer's). `encode_messages`
renders the messages with the template (each picture one placeholder), tokenizes (adding the BOS a processor
adds: `with_bos`), runs the image processor and
expands each placeholder token into as many copies as that picture has features, as the model family's
transformers processor does. The expansion is done here rather than by `AutoProcessor` because transformers'
Qwen-VL processors also build a video processor that needs torchvision, which has no build matching the CPU torch
wheel; the image processor itself runs on PIL. The family rule (`FAMILIES`) is the one place that knows how many
tokens a picture takes; a family not listed is a ValueError naming the families that are.

Messages follow transformers' multimodal chat format: a message's `content` is a string or a list of
`{"type": "image"}` / `{"type": "text", "text": ...}` items. `as_content(text, n)` turns a row's text with `<image>`
markers (the common VLM RL data format) into such a list.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from roll_core.multimodal.images import digest, load_image
from roll_core.multimodal.inputs import MMInputs, check_tokens

#: The marker data rows use for "a picture goes here" in a prompt text.
IMAGE_MARKER = "<image>"


@dataclass(frozen=True)
class Family:
    """How one model family lays out pictures in the ids.

    Attributes:
        image_token: the placeholder token the processor expands (one per feature).
        tokens: (image processor output, picture index, model config) -> placeholder tokens of that picture.
        mrope: whether the model takes 3D (temporal, height, width) rotary positions computed from the pictures.
    """

    image_token: str
    tokens: Callable[[Mapping[str, Tensor], int, Any], int]
    mrope: bool


def _qwen_tokens(out: Mapping[str, Tensor], i: int, config: Any) -> int:
    merge = int(getattr(config.vision_config, "spatial_merge_size", 2))
    return int(out["image_grid_thw"][i].prod()) // (merge * merge)


def _llava_tokens(out: Mapping[str, Tensor], i: int, config: Any) -> int:
    # One token per vision patch of the (resized, cropped) picture; the "default" strategy drops the CLS token.
    h, w = out["pixel_values"].shape[-2:]
    patch = int(config.vision_config.patch_size)
    return (h // patch) * (w // patch) + (0 if config.vision_feature_select_strategy == "default" else 1)


FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family("<|image_pad|>", _qwen_tokens, mrope=True),
    "qwen2_5_vl": Family("<|image_pad|>", _qwen_tokens, mrope=True),
    "qwen3_vl": Family("<|image_pad|>", _qwen_tokens, mrope=True),
    "llava": Family("<image>", _llava_tokens, mrope=False),
}


def model_type(path: str | Path) -> str:
    """The `model_type` of a model folder's config.json ('' when it has none)."""
    cfg = Path(path) / "config.json"
    return str(json.loads(cfg.read_text()).get("model_type", "")) if cfg.is_file() else ""


def is_vision_model(path: str | Path) -> bool:
    """Whether the folder holds a vision-language model roll can feed pictures to."""
    return model_type(path) in FAMILIES


def as_content(text: str, num_images: int) -> list[dict[str, str]] | str:
    """A user message's content for `text` and `num_images` pictures: `<image>` markers place the pictures where
    they stand (their count must equal `num_images`); without markers the pictures come first."""
    if not num_images:
        if IMAGE_MARKER in text:
            raise ValueError(f"the prompt has {text.count(IMAGE_MARKER)} {IMAGE_MARKER} marker(s) but no picture")
        return text
    parts = text.split(IMAGE_MARKER)
    if len(parts) == 1:
        return [*({"type": "image"} for _ in range(num_images)), {"type": "text", "text": text}]
    if len(parts) - 1 != num_images:
        raise ValueError(f"the prompt has {len(parts) - 1} {IMAGE_MARKER} marker(s) but {num_images} picture(s)")
    content: list[dict[str, str]] = []
    for j, part in enumerate(parts):
        if j:
            content.append({"type": "image"})
        if part:
            content.append({"type": "text", "text": part})
    return content


class VisionProcessor:
    """Prompt processing for a vision-language model folder (see the module docstring)."""

    def __init__(self, path: str | Path, tokenizer: Any = None) -> None:
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        self.path = str(path)
        kind = model_type(path)
        if kind not in FAMILIES:
            raise ValueError(
                f"{path}: model_type {kind!r} is not a vision-language family roll feeds pictures to; "
                f"supported: {', '.join(sorted(FAMILIES))}"
            )
        self.family = FAMILIES[kind]
        self.config = AutoConfig.from_pretrained(path)
        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)
        self.image_processor = AutoImageProcessor.from_pretrained(path)
        self.image_token_id = int(self.tokenizer.convert_tokens_to_ids(self.family.image_token))
        self.chat_template = _processor_template(Path(path)) or self.tokenizer.chat_template
        # Whether the tokenizer puts a BOS before a text (Llama's does, Qwen's has none): see `with_bos`.
        bos = self.tokenizer.bos_token_id
        self._bos = bos if bos is not None and self.tokenizer("")["input_ids"][:1] == [bos] else None

    def with_bos(self, ids: list[int]) -> list[int]:
        """`ids` of a templated prompt with the BOS that transformers' processors add to one that does not start
        with it (`ProcessorMixin.apply_chat_template`: LLaVA-1.5's template spells none, and the model was trained
        with one); unchanged for a tokenizer that adds no BOS or a template that spells it."""
        return ids if self._bos is None or ids[:1] == [self._bos] else [self._bos, *ids]

    @property
    def mrope(self) -> bool:
        return self.family.mrope

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> str:
        """The chat-templated text, one placeholder per picture (not yet expanded)."""
        return self.tokenizer.apply_chat_template(
            list(messages),
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kw,
        )

    def process_images(self, images: Sequence[Any], base_dir: str | Path | None = None) -> MMInputs | None:
        """Pictures (any form `load_image` takes) -> their model inputs; None for no picture."""
        if not images:
            return None
        pics = [load_image(im, base_dir) for im in images]
        out = dict(self.image_processor(images=pics, return_tensors="pt"))
        tensors = {k: v for k, v in out.items() if isinstance(v, Tensor)}
        counts = [self.family.tokens(tensors, i, self.config) for i in range(len(pics))]
        return MMInputs(tensors, counts, [digest(p) for p in pics], pics)

    def expand(self, ids: Sequence[int], mm: MMInputs | None) -> list[int]:
        """Ids with each single picture placeholder repeated to that picture's feature count."""
        out: list[int] = []
        i = 0
        for t in ids:
            if t == self.image_token_id:
                if mm is None or i >= mm.num_images:
                    have = mm.num_images if mm else 0
                    raise ValueError(f"the prompt has more picture placeholders than the row's {have} picture(s)")
                out.extend([t] * mm.tokens_per_image[i])
                i += 1
            else:
                out.append(t)
        if mm is not None and i != mm.num_images:
            raise ValueError(f"the prompt has {i} picture placeholder(s) but the row {mm.num_images} picture(s)")
        return out

    def encode_text(self, text: str, images: Sequence[Any], base_dir: str | Path | None = None):
        """(ids, MMInputs | None) for an already templated text with one placeholder per picture."""
        mm = self.process_images(images, base_dir)
        ids = self.expand(self.with_bos(self.tokenizer(text, add_special_tokens=False)["input_ids"]), mm)
        check_tokens(ids, mm, self.image_token_id, "prompt")
        return ids, mm

    def encode_messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        images: Sequence[Any],
        add_generation_prompt: bool = True,
        base_dir: str | Path | None = None,
        **template_kwargs: Any,
    ) -> tuple[list[int], MMInputs | None]:
        """(ids, MMInputs | None) of a conversation whose `{"type": "image"}` items take `images` in order."""
        return self.encode_text(self.render(messages, add_generation_prompt, **template_kwargs), images, base_dir)

    def positions(self, input_ids: Tensor, attention_mask: Tensor, mm: MMInputs | None, model: Any) -> Tensor | None:
        """(3, B, L) rotary positions for an mrope family from the model's own `get_rope_index`; None otherwise."""
        return mrope_positions(model, input_ids, attention_mask, mm, self.image_token_id) if self.mrope else None


def mrope_positions(model: Any, input_ids: Tensor, attention_mask: Tensor, mm: MMInputs | None, image_token_id: int):
    """(3, B, L) positions of a Qwen-VL-family batch, computed by the model's `get_rope_index` (the model's own
    rule, so trainer and engine agree with transformers by construction). `mm` holds the batch's pictures in
    placeholder order; padding positions are 1 as transformers sets them."""
    inner = model.model if hasattr(model, "model") and hasattr(model.model, "get_rope_index") else model
    inner = getattr(inner, "base_model", inner)
    while not hasattr(inner, "get_rope_index") and hasattr(inner, "model"):
        inner = inner.model
    types = (input_ids == image_token_id).to(torch.int32)
    grid = mm.tensors.get("image_grid_thw") if mm is not None else None
    pos, _ = inner.get_rope_index(
        input_ids, mm_token_type_ids=types, image_grid_thw=grid, attention_mask=attention_mask
    )
    return pos


def _processor_template(folder: Path) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    js = folder / "chat_template.json"
    if js.is_file():
        return json.loads(js.read_text()).get("chat_template")
    return None
