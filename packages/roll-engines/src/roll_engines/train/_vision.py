"""Vision-language models in the training engines (`hf`, `fsdp2`): loading, the pictures a micro-batch's forward
takes, and what shared-prompt packing needs to know about them.

A training batch may carry the per-row non-tensor field `mm_inputs` (roll_core.multimodal: one `MMInputs` or None
per row, the pictures whose placeholder tokens are in that row's ids). The engines keep it beside the tensors
(`engine_batch`) and index it with its rows wherever they cut the batch (`take`), so a chunk or micro-batch always
holds its own rows' pictures.

Contract:
- `Vision.of(path)` is None for a text model; for a folder that `roll_core.multimodal.is_vision_model` accepts, it
  holds the placeholder token id and whether the family takes 3D (mrope) rotary positions. Such a model loads
  with `AutoModelForImageTextToText` (`model_class`); a critic of a vision model is refused (transformers has no
  token-classification head for these families).
- `Vision.check(batch)` runs `check_tokens` on every row before any forward: the image placeholders among a row's
  attended ids must match its pictures' feature counts, else a ValueError naming the row (a truncated prompt
  would otherwise become a shape error deep in the model or a silently shifted batch). A text model given
  pictures is a ValueError naming the first row that has some.
- `Vision.micro(model, micro)` gives a micro-batch's pictures: the merged processor tensors in row order (= the
  order of the placeholders in the flattened (b, L) ids, what the model's `masked_scatter` consumes), the
  (3, b, L) positions of an mrope family from the model's own `get_rope_index` (always passed explicitly, so
  transformers never caches `rope_deltas` on the model), and for packing each row's prompt pictures, response
  pictures (agentic observations) and a prompt key: two rows share a packed prompt only if their prompt ids AND
  their prompt pictures' digests are equal (for single-turn rows the prompt pictures are all of the row's,
  `mm.key()`).
- Weight names: sync sends the model's own names (`model.visual.*`, `model.language_model.*`); checkpoints are
  written by `save_pretrained` in the family's hub layout and read back through `own_names`.
- Picture size: `Vision.of(path, min_pixels, max_pixels)` keeps the run's bounds (model.image_*_pixels; checked
  against the folder's image processor at once, a ValueError for bounds that cannot apply) and `save_processor`
  writes the checkpoint's image processor with them, so `roll eval`, transformers and vLLM on the checkpoint
  resize pictures to the grid the run trained on, the processor chat template the run rendered prompts with
  (`keep_processor_template`) and the folder's processor settings (`keep_processor_config`: LLaVA's patch size and
  feature strategy, which transformers' processor expands placeholders by). The trainer itself runs no image
  processor: each row's `MMInputs` holds the tensors the prompt builder made.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from roll_core.multimodal import (
    FAMILIES,
    MMInputs,
    check_tokens,
    is_vision_model,
    load_image_processor,
    merge,
    model_type,
    mrope_positions,
)
from roll_core.multimodal.inputs import PER_IMAGE_KEYS

#: The batch protocol's per-row field holding each row's pictures (roll_core.multimodal.MMInputs or None).
MM_KEY = "mm_inputs"


def engine_batch(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The tensors of `batch` plus its `mm_inputs` list (when it has one with a picture): what the engines index."""
    out: dict[str, Any] = {k: v for k, v in batch.items() if isinstance(v, Tensor)}
    mm = batch.get(MM_KEY)
    if mm is not None and any(m is not None for m in mm):
        mm = list(mm)
        n = out["input_ids"].shape[0]
        if len(mm) != n:
            raise ValueError(f"the batch has {n} rows but {len(mm)} {MM_KEY} entries (one per row, None for none)")
        out[MM_KEY] = mm
    return out


def take(batch: Mapping[str, Any], rows: Tensor | slice) -> dict[str, Any]:
    """The rows `rows` (a long index tensor or a slice) of an `engine_batch`, pictures included."""
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, Tensor) or isinstance(rows, slice):
            out[k] = v[rows]
        else:
            out[k] = [v[i] for i in rows.tolist()]
    return out


def tensors_of(batch: Mapping[str, Any]) -> dict[str, Tensor]:
    """Only the tensors (what a loss function reads)."""
    return {k: v for k, v in batch.items() if isinstance(v, Tensor)}


def picture_keys(batch: Mapping[str, Any]) -> list[bytes] | None:
    """Per row, the digests of its pictures as bytes (rows with equal ids but other pictures differ); None
    when the batch has no pictures."""
    mm = batch.get(MM_KEY)
    if mm is None:
        return None
    return ["|".join(m.key()).encode() if m is not None else b"" for m in mm]


def slice_pictures(mm: MMInputs | None, start: int, stop: int) -> MMInputs | None:
    """Pictures `start:stop` of `mm` (in placeholder order) with their tensors; None when the range is empty."""
    if mm is None or start >= stop:
        return None
    if start == 0 and stop == mm.num_images:
        return mm
    tensors = {}
    for key, t in mm.tensors.items():
        if key in PER_IMAGE_KEYS or "image_grid_thw" not in mm.tensors:
            counts = [1] * mm.num_images  # one entry per picture (LLaVA's (num_images, 3, H, W) pixel_values)
        else:
            counts = [int(c) for c in mm.tensors["image_grid_thw"].prod(-1).tolist()]  # patches per picture
        if sum(counts) != t.shape[0]:
            raise ValueError(f"{key} has {t.shape[0]} entries, not one per picture or patch of {mm.num_images}")
        offsets = [0, *torch.tensor(counts).cumsum(0).tolist()]
        tensors[key] = t[offsets[start] : offsets[stop]]
    images = mm.images[start:stop] if mm.images is not None else None
    return MMInputs(tensors, mm.tokens_per_image[start:stop], mm.digests[start:stop], images)


@dataclass
class MicroPictures:
    """The pictures of one micro-batch (b rows), as the padded and the packed forward take them.

    Attributes:
        tensors: processor tensors of all rows' pictures, merged in row order ({} when none).
        positions: (3, b, L) mrope positions (None for 1D-position families).
        prompt: per row, the pictures whose placeholders are in the prompt part.
        response: per row, the pictures in the response part (agentic observations), else None.
        keys: per row, the prompt pictures' digests as bytes (part of the packing key).
    """

    tensors: dict[str, Tensor]
    positions: Tensor | None
    prompt: list[MMInputs | None]
    response: list[MMInputs | None]
    keys: list[bytes]

    def packed(self, order: Sequence[tuple[int, Sequence[int]]]) -> dict[str, Tensor]:
        """Merged tensors of a packed layout: for each (prompt row, member rows) segment in packed order, the prompt
        row's prompt pictures once, then each member's response pictures."""
        pieces: list[MMInputs | None] = []
        for first, members in order:
            pieces.append(self.prompt[first])
            pieces += [self.response[i] for i in members]
        merged = merge(pieces)
        return dict(merged.tensors) if merged is not None else {}


@dataclass(frozen=True)
class Vision:
    """What the engines need to know about a vision-language model (see the module docstring)."""

    image_token_id: int
    mrope: bool
    family: str
    #: The run's picture size bounds (None: the folder's image processor's own).
    min_pixels: int | None = None
    max_pixels: int | None = None

    @classmethod
    def of(cls, path: str, min_pixels: int | None = None, max_pixels: int | None = None) -> Vision | None:
        """The model folder's vision facts; None for a text model (ValueError if picture size bounds are given)."""
        bounded = min_pixels is not None or max_pixels is not None
        if not is_vision_model(path):
            if bounded:
                raise ValueError(
                    f"model.image_min_pixels / image_max_pixels bound pictures, but {path} is not a vision-language "
                    f"model (model_type {model_type(path)!r})"
                )
            return None
        from transformers import AutoConfig

        if bounded:  # refused here, at engine start, rather than at the first checkpoint
            load_image_processor(path, min_pixels, max_pixels)

        config = AutoConfig.from_pretrained(path)
        token = getattr(config, "image_token_id", None)
        if token is None:
            token = getattr(config, "image_token_index", None)
        if token is None:
            raise ValueError(f"{path}: the {config.model_type} config names no image_token_id")
        kind = model_type(path)
        return cls(int(token), FAMILIES[kind].mrope, kind, min_pixels, max_pixels)

    def check(self, batch: Mapping[str, Any]) -> None:
        """Placeholders vs pictures of every row (ValueError naming the row; see the module docstring)."""
        ids, am = batch["input_ids"], batch["attention_mask"].bool()
        mm = batch.get(MM_KEY) or [None] * ids.shape[0]
        for i in range(ids.shape[0]):
            check_tokens(ids[i][am[i]], mm[i], self.image_token_id, f"batch row {i}")

    def micro(self, model: torch.nn.Module, micro: Mapping[str, Any]) -> MicroPictures | None:
        """The micro-batch's pictures and positions (None when it has no picture)."""
        mm = micro.get(MM_KEY)
        merged = merge(mm) if mm is not None else None
        if merged is None:
            return None
        ids, am = micro["input_ids"].cpu(), micro["attention_mask"].cpu()
        positions = mrope_positions(model, ids, am, merged, self.image_token_id) if self.mrope else None
        p = ids.shape[1] - micro["responses"].shape[1]
        prompt, response, keys = [], [], []
        for i, m in enumerate(mm):
            in_prompt = int(((ids[i, :p] == self.image_token_id) & am[i, :p].bool()).sum())
            k = _pictures_in(m, in_prompt, i)
            prompt.append(slice_pictures(m, 0, k))
            response.append(slice_pictures(m, k, m.num_images if m is not None else 0))
            keys.append("|".join(m.digests[:k]).encode() if m is not None else b"")
        return MicroPictures(dict(merged.tensors), positions, prompt, response, keys)


def _pictures_in(mm: MMInputs | None, tokens: int, row: int) -> int:
    """How many of the row's first pictures fill exactly `tokens` placeholders (the prompt part's)."""
    used = k = 0
    while mm is not None and k < mm.num_images and used < tokens:
        used += mm.tokens_per_image[k]
        k += 1
    if used != tokens:
        raise ValueError(f"row {row}: a picture's placeholders straddle the prompt/response boundary")
    return k


def refuse_pictures(batch: Mapping[str, Any], path: str) -> None:
    """A text model given pictures: ValueError naming the first row that has some."""
    mm = batch.get(MM_KEY) or []
    row = next((i for i, m in enumerate(mm) if m is not None and m.num_images), None)
    if row is not None:
        raise ValueError(
            f"batch row {row} carries {mm[row].num_images} picture(s) but {path} is not a vision-language model "
            f"(model_type {model_type(path)!r}; supported: {', '.join(sorted(FAMILIES))})"
        )


def checked_batch(batch: Mapping[str, Any], vision: Vision | None, path: str) -> dict[str, Any]:
    """`engine_batch(batch)` with each row's placeholders checked against its pictures (a text model: refused if
    any row has pictures)."""
    rows = engine_batch(batch)
    if vision is not None:
        vision.check(rows)
    else:
        refuse_pictures(rows, path)
    return rows


def model_class(vision: Vision | None, role: str) -> Any:
    """The transformers auto class that loads the engine's model."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForTokenClassification

    if vision is not None:
        if role == "critic":
            raise ValueError(
                f"a {vision.family} vision-language model cannot be the critic (transformers has no value head for "
                "it): use a GRPO-style algorithm (no critic) or a text critic model"
            )
        return AutoModelForImageTextToText
    return AutoModelForTokenClassification if role == "critic" else AutoModelForCausalLM


def own_names(model: torch.nn.Module, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """A checkpoint's `weights` under the model's own parameter names.

    transformers' `save_pretrained` writes a vision-language model in its original hub layout (Qwen2.5-VL's
    `visual.*` and `model.layers.*`, LLaVA's `language_model.model.*`), which `from_pretrained` renames on load,
    while the model's `state_dict` (what weight sync sends) uses the new names (`model.visual.*`,
    `model.language_model.*`). The renaming is transformers' own save-time one, matched by tensor identity.
    """
    from transformers.core_model_loading import revert_weight_conversion

    own = model.state_dict()
    by_id = {id(t): name for name, t in own.items()}
    rename = {saved: by_id[id(t)] for saved, t in revert_weight_conversion(model, dict(own)).items() if id(t) in by_id}
    return {rename.get(k, k): v for k, v in weights.items()}


def hidden_size(config: Any) -> int:
    """The language model's hidden size (a vision-language config keeps it in its text config)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "hidden_size", 0) or 0)


def vocab_size(config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "vocab_size", None)


def save_processor(vision: Vision | None, path: str, folder: Path, trust_remote_code: bool = False) -> None:
    """A vision model's checkpoint also holds its image processor, with the run's picture size bounds (and the
    processor's chat template), so the folder loads in `roll-eval`, transformers and serving engines like the
    original and resizes pictures to the grid the run trained on."""
    if vision is None:
        return
    processor = load_image_processor(path, vision.min_pixels, vision.max_pixels, trust_remote_code)
    processor.save_pretrained(folder)
    keep_processor_config(Path(path), folder)
    keep_processor_template(Path(path), folder, trust_remote_code)


#: Processor files a checkpoint copies from the model folder as they are (Qwen3-VL's video processor settings).
PROCESSOR_FILES = ("video_preprocessor_config.json",)


def keep_processor_config(source: Path, folder: Path) -> None:
    """Copy `source`'s processor settings into the checkpoint `folder` (its image processor already saved):
    `processor_config.json` (LLaVA's `patch_size`, `vision_feature_select_strategy`, `num_additional_image_tokens`,
    which transformers' processor expands each picture placeholder by; without them `AutoProcessor` on the
    checkpoint failed at its first picture, `patch_size` None) and `PROCESSOR_FILES`.

    transformers reads an image processor nested in `processor_config.json` (its 5.x save layout) BEFORE
    `preprocessor_config.json`: the copy's nested one is replaced by the one saved here, which holds the run's picture
    size bounds (the source's own would undo them for every reader of the checkpoint)."""
    config_file = source / "processor_config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text(encoding="utf-8"))
        if isinstance(config.get("image_processor"), dict):
            config["image_processor"] = json.loads((folder / "preprocessor_config.json").read_text(encoding="utf-8"))
        (folder / "processor_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for name in PROCESSOR_FILES:
        if (source / name).is_file() and not (folder / name).exists():
            shutil.copyfile(source / name, folder / name)


def keep_processor_template(source: Path, folder: Path, trust_remote_code: bool = False) -> None:
    """Make the checkpoint `folder` (its tokenizer already saved) render prompts with the template the run rendered
    them with: `source`'s processor template (picked as transformers picks it: roll_core.multimodal.templates),
    falling back to the tokenizer's, which the saved tokenizer carries.

    A hub folder in the legacy layout keeps the processor's template in `chat_template.json` and the tokenizer's in
    `tokenizer_config.json`; transformers 5 saves the tokenizer's as `chat_template.jinja`, which the tokenizer then
    reads first (and roll's processor did too): where the two templates differed, `roll-eval` on the checkpoint
    rendered every prompt with the tokenizer's template, not the one the run trained on. The tokenizer's template
    then goes back into `tokenizer_config.json` (where the tokenizer reads it when the folder has no
    `chat_template.jinja`) and the processor's into `chat_template.json`, the source's layout, which roll and
    transformers' processors read alike."""
    from roll_core.multimodal.templates import processor_template

    template = processor_template(source)
    if template is None:
        return
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        if jinja.read_text(encoding="utf-8") == template:
            return
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
        jinja.unlink()
        shutil.rmtree(folder / "additional_chat_templates", ignore_errors=True)
        tokenizer.save_pretrained(folder, save_jinja_files=False)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2) + "\n")
