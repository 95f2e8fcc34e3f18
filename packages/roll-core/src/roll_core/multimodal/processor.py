"""A vision-language model's prompt processor: chat messages with pictures -> token ids + `MMInputs`.

`VisionProcessor(path)` reads the model folder: the tokenizer, the image processor and the chat template (the
processor's own where the folder has one, picked as transformers picks it: `processor_config.json`'s, then
`chat_template.json`, then `chat_template.jinja` (roll_core.multimodal.templates); else the tokenizer's).
`encode_messages` renders the messages with the template (each picture one placeholder), tokenizes (adding the
BOS a processor adds: `with_bos`), runs the image processor and expands each placeholder token into as many copies
as that picture has features, as the model family's transformers processor does. The expansion is done here rather
than by `AutoProcessor` because transformers' Qwen-VL processors also build a video processor that needs
torchvision, which has no build matching the CPU torch wheel; the image processor itself runs on PIL. The family
rule (`FAMILIES`) is the one place that knows how many tokens a picture takes; a family not listed is a ValueError
naming the families that are.

Messages follow transformers' multimodal chat format: a message's `content` is a string or a list of
`{"type": "image"}` / `{"type": "text", "text": ...}` items. `as_content(text, n)` turns a row's text with `<image>`
markers (the common VLM RL data format) into such a list.

Image processors: `load_image_processor` is the one place roll builds a model's image processor (the prompt
builder's, a checkpoint's saved one), and `pixel_range` the bounds vLLM is given, so every consumer resizes to the
same grid:
- Picture size (model.image_min_pixels / image_max_pixels): a dynamic-resolution family (Qwen-VL: `Family.resize`)
  resizes each picture to an area in [min_pixels, max_pixels] (multiples of patch x merge on each side), and a
  picture takes area / (patch x merge)^2 tokens; null keeps the folder's own bound (Qwen2.5-VL's allows 12845056
  pixels: ~16k tokens per picture). The bounds are passed as the `min_pixels` / `max_pixels` constructor keywords,
  which transformers 5 maps onto `size={"shortest_edge", "longest_edge"}` whatever the folder's layout; passing
  `size=` to `from_pretrained` instead is silently undone by a folder that still spells `min_pixels` /
  `max_pixels` (Qwen2.5-VL's hub config does). Bounds are refused for a fixed-size family (LLaVA: every picture
  is resized and cropped to one size), when not positive, when min > max (with the folder's own other bound
  included), and below one (patch x merge)^2 cell (the smallest picture the family makes).
- Backend: pinned to transformers' PIL backend (`BACKEND`). Left to itself transformers 5 picks its torchvision
  backend where torchvision imports and PIL elsewhere, so the same run would resize differently on two machines.
  vLLM cannot be pinned the same way (docs/recipes/vision.md: its processor resizes with torchvision; the grid,
  hence every placeholder count, is the same, pixel values differ slightly).
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
from roll_core.multimodal.templates import processor_template

#: The marker data rows use for "a picture goes here" in a prompt text.
IMAGE_MARKER = "<image>"


@dataclass(frozen=True)
class Family:
    """How one model family lays out pictures in the ids.

    Attributes:
        image_token: the placeholder token the processor expands (one per feature).
        tokens: (image processor output, picture index, model config) -> placeholder tokens of that picture.
        mrope: whether the model takes 3D (temporal, height, width) rotary positions computed from the pictures.
        resize: whether pictures keep their aspect and are resized to an area within [min_pixels, max_pixels]
            (dynamic resolution: the picture size bounds apply), rather than to one fixed size.
        check: (model config) -> None, a ValueError for a model of the family whose picture token count `tokens`
            cannot tell (raised when a `VisionProcessor` is built, not at the first picture).
    """

    image_token: str
    tokens: Callable[[Mapping[str, Tensor], int, Any], int]
    mrope: bool
    resize: bool = False
    check: Callable[[Any], None] | None = None


def _qwen_tokens(out: Mapping[str, Tensor], i: int, config: Any) -> int:
    merge = int(getattr(config.vision_config, "spatial_merge_size", 2))
    return int(out["image_grid_thw"][i].prod()) // (merge * merge)


#: LLaVA vision towers (vision_config.model_type) by the class tokens their features start with: CLIP's one CLS
#: token, none for SigLIP (llava-interleave). transformers' processor counts them as `num_additional_image_tokens`.
LLAVA_CLASS_TOKENS = {"clip_vision_model": 1, "siglip_vision_model": 0}


def _llava_class_tokens(config: Any) -> int:
    """Class tokens of a LLaVA model's vision tower; ValueError for a tower roll does not know the features of."""
    tower = str(getattr(config.vision_config, "model_type", ""))
    if tower not in LLAVA_CLASS_TOKENS:
        raise ValueError(
            f"a LLaVA model with a {tower!r} vision tower: roll cannot tell how many features its pictures take "
            f"(known towers: {', '.join(sorted(LLAVA_CLASS_TOKENS))})"
        )
    return LLAVA_CLASS_TOKENS[tower]


def _llava_tokens(out: Mapping[str, Tensor], i: int, config: Any) -> int:
    # One feature per vision patch of the (resized, cropped) picture plus the tower's class tokens; the "default"
    # strategy drops the first feature whatever it is (transformers' rule: a SigLIP tower then loses a patch). A
    # CLS token counted for SigLIP made one placeholder more than the model's features: every prompt failed.
    h, w = out["pixel_values"].shape[-2:]
    patch = int(config.vision_config.patch_size)
    n = (h // patch) * (w // patch) + _llava_class_tokens(config)
    return n - 1 if config.vision_feature_select_strategy == "default" else n


FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family("<|image_pad|>", _qwen_tokens, mrope=True, resize=True),
    "qwen2_5_vl": Family("<|image_pad|>", _qwen_tokens, mrope=True, resize=True),
    "qwen3_vl": Family("<|image_pad|>", _qwen_tokens, mrope=True, resize=True),
    "llava": Family("<image>", _llava_tokens, mrope=False, check=_llava_class_tokens),
}

#: transformers' image processor backend roll loads (module docstring): PIL, which every install has.
BACKEND = "pil"


def pixel_kwargs(min_pixels: int | None = None, max_pixels: int | None = None) -> dict[str, int]:
    """The picture size bounds that are set, as image processor keywords (`min_pixels`, `max_pixels`); {} for
    none. ValueError (naming the model.* key) for a bound that is not a positive integer."""
    out: dict[str, int] = {}
    for key, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model.image_{key}={value!r} must be a positive integer (pixels) or null")
        out[key] = value
    if len(out) == 2 and out["min_pixels"] > out["max_pixels"]:
        raise ValueError(
            f"model.image_min_pixels={out['min_pixels']} is above model.image_max_pixels={out['max_pixels']}"
        )
    return out


def load_image_processor(
    path: str | Path,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    trust_remote_code: bool = False,
) -> Any:
    """The image processor of the model folder `path` (PIL backend), with the picture size bounds that are given
    (None: the folder's own). ValueError when a bound cannot apply (module docstring)."""
    from transformers import AutoImageProcessor

    bounds = pixel_kwargs(min_pixels, max_pixels)
    kind = model_type(path)
    if bounds and (kind not in FAMILIES or not FAMILIES[kind].resize):
        resizing = sorted(k for k, f in FAMILIES.items() if f.resize)
        raise ValueError(
            f"model.image_min_pixels / image_max_pixels bound the picture size of dynamic-resolution families "
            f"({', '.join(resizing)}); {path} (model_type {kind!r}) resizes every picture to one fixed size or "
            "takes none: leave them null"
        )
    processor = AutoImageProcessor.from_pretrained(path, backend=BACKEND, trust_remote_code=trust_remote_code, **bounds)
    if bounds:
        low, high = _size_range(processor, path)
        cell = int(getattr(processor, "patch_size", 14)) * int(getattr(processor, "merge_size", 2))
        if low > high:
            given = "model.image_min_pixels" if "min_pixels" in bounds else "the processor's min_pixels"
            other = "model.image_max_pixels" if "max_pixels" in bounds else "the processor's max_pixels"
            raise ValueError(
                f"{given}={low} is above {other}={high} ({path}): set both model.image_min_pixels and "
                "model.image_max_pixels"
            )
        if high < cell * cell:
            raise ValueError(
                f"model.image_max_pixels={high} is below one {cell}x{cell} cell ({cell * cell} pixels, one picture "
                f"token), the smallest picture {kind} makes: raise it"
            )
    return processor


def _size_range(processor: Any, path: str | Path) -> tuple[int, int]:
    """(min_pixels, max_pixels) a dynamic-resolution image processor resizes to."""
    size = processor.size
    get = size.get if isinstance(size, Mapping) else lambda k: getattr(size, k, None)
    low, high = get("shortest_edge"), get("longest_edge")
    if low is None or high is None:
        raise ValueError(f"{path}: the image processor's size {size!r} has no shortest_edge/longest_edge pixel bounds")
    return int(low), int(high)


def pixel_range(
    path: str | Path, min_pixels: int | None = None, max_pixels: int | None = None, trust_remote_code: bool = False
) -> tuple[int, int]:
    """(min_pixels, max_pixels) the folder's image processor resizes pictures to under the given bounds (the
    folder's own where None): both, resolved, for an engine with its own processor (vLLM) to resize the same."""
    return _size_range(load_image_processor(path, min_pixels, max_pixels, trust_remote_code), path)


def image_pixels(model: Any) -> dict[str, int | None]:
    """The picture size bounds of a `model` config (roll_core.config.ModelConfig) as VisionProcessor keywords."""
    return {
        "min_pixels": getattr(model, "image_min_pixels", None),
        "max_pixels": getattr(model, "image_max_pixels", None),
    }


def engine_pixels(model: Any, model_path: str | Path) -> dict[str, int]:
    """The engine constructor keys (`image_min_pixels`, `image_max_pixels`) that carry a run's picture size bounds
    to the engines that resize pictures (vLLM) or save an image processor (the hf / fsdp2 trainers' checkpoints):
    only the bounds that are set, so an engine that takes no pictures never sees one. ConfigError naming the bounds
    for a text model (a setting nothing would read)."""
    from roll_core.errors import ConfigError

    out = {f"image_{k}": v for k, v in image_pixels(model).items() if v is not None}
    if out and not is_vision_model(model_path):
        given = ", ".join(f"model.{k}={v}" for k, v in out.items())
        raise ConfigError(f"{given} bound(s) pictures, but model.path={model_path} is a text model: leave them null")
    return out


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
    """Prompt processing for a vision-language model folder (see the module docstring); `min_pixels` /
    `max_pixels`: the run's picture size bounds (model.image_min_pixels / image_max_pixels; None: the folder's)."""

    def __init__(
        self,
        path: str | Path,
        tokenizer: Any = None,
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.path = str(path)
        kind = model_type(path)
        if kind not in FAMILIES:
            raise ValueError(
                f"{path}: model_type {kind!r} is not a vision-language family roll feeds pictures to; "
                f"supported: {', '.join(sorted(FAMILIES))}"
            )
        self.family = FAMILIES[kind]
        self.config = AutoConfig.from_pretrained(path)
        if self.family.check is not None:
            self.family.check(self.config)
        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)
        self.image_processor = load_image_processor(path, min_pixels, max_pixels)
        self.image_token_id = int(self.tokenizer.convert_tokens_to_ids(self.family.image_token))
        self.chat_template = processor_template(path) or self.tokenizer.chat_template
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


#: The processor's own template of a folder, as transformers picks it (roll_core.multimodal.templates).
_processor_template = processor_template
