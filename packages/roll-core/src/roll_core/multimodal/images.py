"""Images as data rows hold them, turned into RGB PIL images.

A row's image may be a file path (absolute, or relative to the data file's folder), raw encoded bytes, a
`{"bytes": ..., "path": ...}` dict (what Parquet files written by `datasets` hold), a PIL image, or an (H, W, 3)
uint8 array. Anything else, an unreadable file or undecodable bytes is a `ValueError` naming what was given:
a wrong picture never reaches the model silently.

`digest(image)` identifies a picture by its pixels (mode, size and bytes): two rows whose prompt tokens are equal
but whose pictures differ must never share a KV-cache prefix or a packed prompt, and this is what tells them apart.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

from roll_core.errors import Extra

PILLOW = Extra("PIL", "images in data rows or observations (multimodal models)", "pillow", "roll-core[vision]")


def load_image(value: Any, base_dir: str | Path | None = None) -> Any:  # -> PIL.Image.Image
    """The RGB PIL image `value` holds (see the module docstring for the accepted forms)."""
    PILLOW.require()
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value if value.mode == "RGB" else value.convert("RGB")
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return load_image(value["bytes"], base_dir)
        if value.get("path"):
            return load_image(value["path"], base_dir)
        raise ValueError(f"an image dict needs 'bytes' or 'path'; got keys {sorted(value)}")
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            with Image.open(io.BytesIO(bytes(value))) as im:
                return im.convert("RGB")
        except (UnidentifiedImageError, OSError) as exc:
            raise ValueError(f"image bytes ({len(value)} bytes) are not a readable picture: {exc}") from exc
    if isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        if not path.is_file():
            raise ValueError(f"image file {str(value)!r} does not exist (looked at {path})")
        try:
            with Image.open(path) as im:
                return im.convert("RGB")
        except (UnidentifiedImageError, OSError) as exc:
            raise ValueError(f"image file {path} is not a readable picture: {exc}") from exc
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) == 3 and shape[-1] == 3:
        import numpy as np

        arr = np.asarray(value)
        if arr.dtype != np.uint8:
            raise ValueError(f"an image array must be uint8 (H, W, 3); got {arr.dtype} {tuple(arr.shape)}")
        return Image.fromarray(arr, "RGB")
    raise ValueError(
        f"cannot read an image from a {type(value).__name__}: give a path, bytes, a {{'bytes', 'path'}} dict, "
        "a PIL image or an (H, W, 3) uint8 array"
    )


def digest(image: Any) -> str:
    """A short stable id of a picture's pixels (PIL image)."""
    h = hashlib.sha1(f"{image.mode}:{image.size}".encode())
    h.update(image.tobytes())
    return h.hexdigest()[:16]
