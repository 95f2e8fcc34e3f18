"""The model inputs of one row's pictures, as they travel in the batch protocol and in inference requests.

`MMInputs` holds, for one prompt (or one agentic trajectory), everything a vision-language model needs beside the
token ids: the processor's tensors (`pixel_values`, and for the Qwen-VL families `image_grid_thw`: one row per
picture), how many placeholder tokens each picture expanded to, each picture's digest and, for engines that run
their own processor (vLLM), the pictures themselves. A batch carries one `MMInputs` (or None for a text-only row)
per row in the non-tensor field `mm_inputs`, so `Batch.split`/`index`/`concat` keep it with its row.

Per-picture tensors are stacked along dim 0 in placeholder order, so the inputs of several rows are the
concatenation of theirs (`merge`), in the order their placeholder tokens appear in the flattened batch: this is
the order the models consume them in (`masked_scatter` over the image-token positions).

Contract: `check_tokens` is called wherever ids and pictures meet (prompt building, engines): the number of
image placeholder tokens must equal the number of picture features, else a ValueError says which row, how many
tokens and how many features (a mismatch otherwise becomes a shape error deep in the model, or worse, a
silently shifted batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

#: Tensors that hold one entry per picture (dim 0 counts pictures), as opposed to per-patch tensors.
PER_IMAGE_KEYS = ("image_grid_thw", "image_sizes")


@dataclass(eq=False)
class MMInputs:
    """The pictures of one prompt or trajectory and the tensors the model takes for them.

    Attributes:
        tensors: processor outputs, e.g. `pixel_values` (num_patches, C*T*P*P) and `image_grid_thw` (num_images, 3)
            for Qwen-VL families; `pixel_values` (num_images, 3, H, W) for LLaVA-style ones.
        tokens_per_image: placeholder tokens each picture occupies in the ids, in order.
        digests: `images.digest` of each picture, in order.
        images: the RGB PIL pictures (for engines with their own processor); `without_images()` drops them.
    """

    tensors: dict[str, Tensor]
    tokens_per_image: list[int]
    digests: list[str]
    images: list[Any] | None = field(default=None, repr=False)

    def __eq__(self, other: object) -> bool:
        """Equal pictures (digests) with equal placeholder counts and equal tensors; the PIL pictures are not
        compared (the digests are their pixels). A dataclass's own `==` compared the tensors with `==`, which raises
        for a tensor of more than one element: a batch's `union` with a copy of its pictures (one that went through
        Ray) raised "Boolean value of Tensor ... is ambiguous" instead of answering."""
        if not isinstance(other, MMInputs):
            return NotImplemented
        return (
            self.digests == other.digests
            and self.tokens_per_image == other.tokens_per_image
            and self.tensors.keys() == other.tensors.keys()
            and all(_same(t, other.tensors[k]) for k, t in self.tensors.items())
        )

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    @property
    def num_images(self) -> int:
        return len(self.tokens_per_image)

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens_per_image)

    def key(self) -> tuple[str, ...]:
        """What, with the token ids, identifies a prompt (prefix caching, shared-prompt packing)."""
        return tuple(self.digests)

    def without_images(self) -> MMInputs:
        """The same inputs without the PIL pictures (what the trainer needs; smaller to send)."""
        return replace(self, images=None)

    def extend(self, other: MMInputs) -> MMInputs:
        """Pictures of `self` followed by those of `other` (a later turn's observation)."""
        return merge([self, other])


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())


def merge(items: Sequence[MMInputs | None]) -> MMInputs | None:
    """The inputs of several rows (or turns) in order, None entries skipped; None when no row has a picture."""
    real = [m for m in items if m is not None and m.num_images]
    if not real:
        return None
    keys = set(real[0].tensors)
    for m in real[1:]:
        if set(m.tensors) != keys:
            raise ValueError(f"cannot merge pictures with different tensors: {sorted(keys)} vs {sorted(m.tensors)}")
    tensors = {k: torch.cat([m.tensors[k] for m in real], dim=0) for k in sorted(keys)}
    images = None
    if all(m.images is not None for m in real):
        images = [im for m in real for im in m.images or []]
    return MMInputs(
        tensors,
        [n for m in real for n in m.tokens_per_image],
        [d for m in real for d in m.digests],
        images,
    )


def count_image_tokens(ids: Tensor | Sequence[int], image_token_id: int) -> int:
    """How many placeholder tokens `ids` holds."""
    t = ids if isinstance(ids, Tensor) else torch.as_tensor(list(ids))
    return int((t == image_token_id).sum())


def check_tokens(ids: Tensor | Sequence[int], mm: MMInputs | None, image_token_id: int, where: str = "row") -> None:
    """Raise ValueError unless the image placeholders in `ids` match the pictures' feature counts."""
    n_tok = count_image_tokens(ids, image_token_id)
    n_feat = mm.num_tokens if mm is not None else 0
    if n_tok != n_feat:
        pics = mm.num_images if mm is not None else 0
        raise ValueError(
            f"{where}: {n_tok} image placeholder token(s) (id {image_token_id}) in the ids but {pics} picture(s) "
            f"with {n_feat} feature(s): every picture must appear once in the prompt as its processor expanded it "
            "(a truncated prompt, a picture without its placeholder, or a placeholder typed in the text)"
        )
