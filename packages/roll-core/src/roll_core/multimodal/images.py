"""Images as data rows hold them, turned into RGB PIL images.

A row's image may be a file path (absolute, or relative to the data file's folder), raw encoded bytes, base64 text
of those bytes (bare, or a `data:image/...;base64,` URI), a `{"bytes": ..., "path": ...}` dict (what Parquet files
written by `datasets` hold), a PIL image, or an (H, W), (H, W, 3) or (H, W, 4) uint8 array. A URL is refused: a
run fetches nothing from the network (download the pictures, give their paths). Anything else, an unreadable file,
undecodable bytes or a picture with a zero side (0 x H) is a `ValueError` naming what was given (long values
shortened): a wrong picture never reaches the model silently, and no other exception escapes (a name too long for
the file system, a decompression bomb, an image processor dividing by a zero side), so callers that skip bad rows
on ValueError never crash on one.

The picture is the one viewers, transformers' `load_image`, `datasets`' Image feature and vLLM show: the EXIF
orientation is applied (a phone photo stored sideways is upright), and transparency is composited onto white as
transformers' `convert_to_rgb`, Qwen-VL's own loader and vLLM do (PIL's plain `convert("RGB")` turns transparent
pixels black: a diagram of black lines on a transparent background became an all-black picture). Grey pictures
deeper than 8 bits are scaled to 8 bits first (`_eight_bit`): a 16-bit PNG (mode I;16 or I) by 255/65535, a float
one (mode F) from 0..1 (other float ranges are a ValueError: no scale is standard); PIL's `convert("RGB")` clipped
them, every value over 255 (over 1/255 of a 16-bit range) turned white.

`check_image(value, base_dir)` reads only a picture's header (cheap enough for every row of a data set at load) and
returns the value in a form `load_image` reads without the base folder.

`digest(image)` identifies a picture by its pixels (mode, size and bytes): two rows whose prompt tokens are equal
but whose pictures differ must never share a KV-cache prefix or a packed prompt, and this is what tells them apart.

`source_key(value)` identifies a picture as a row holds it, without decoding it (cheap enough for every row of a
data set): a hash of its bytes, or its path with the file's size.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from pathlib import Path
from typing import Any

from roll_core.errors import Extra

PILLOW = Extra("PIL", "images in data rows or observations (multimodal models)", "pillow", "roll-core[vision]")

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_DATA_URI = re.compile(r"^data:([^,;]*)((?:;[^,;]*)*),", re.IGNORECASE)
#: Bare base64 text (standard or URL-safe alphabet, line breaks allowed). The shortest encoded picture is far
#: longer than 64 characters; shorter text is read as a path only.
_BASE64 = re.compile(r"^[A-Za-z0-9+/_\-\s]{64,}={0,2}\s*$")
_ORIENTATION = 274  # the EXIF Orientation tag
WHITE = (255, 255, 255)


def load_image(value: Any, base_dir: str | Path | None = None) -> Any:  # -> PIL.Image.Image
    """The RGB PIL image `value` holds (see the module docstring for the accepted forms)."""
    PILLOW.require()
    from PIL import Image

    if isinstance(value, Image.Image):
        return _rgb(value, copy=False)
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return load_image(value["bytes"], base_dir)
        if value.get("path"):
            return load_image(value["path"], base_dir)
        raise ValueError(f"an image dict needs 'bytes' or 'path'; got keys {sorted(value)}")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _decode(io.BytesIO(bytes(value)), f"image bytes ({len(value)} bytes) are")
    if isinstance(value, (str, Path)):
        src, what = _source(value, base_dir)
        return _decode(src if isinstance(src, Path) else io.BytesIO(src), what)
    shape = getattr(value, "shape", None)
    if shape is not None and (len(shape) == 2 or (len(shape) == 3 and shape[-1] in (3, 4))):
        import numpy as np

        arr = np.asarray(value)
        if arr.dtype != np.uint8:
            raise ValueError(f"an image array must be uint8 (H, W[, 3 or 4]); got {arr.dtype} {tuple(arr.shape)}")
        mode = {2: "L", 3: "RGB", 4: "RGBA"}[arr.shape[-1] if arr.ndim == 3 else 2]
        return _rgb(Image.fromarray(arr, mode), copy=False)
    raise ValueError(
        f"cannot read an image from a {type(value).__name__}: give a path, bytes, base64 text, a {{'bytes', 'path'}} "
        "dict, a PIL image or an (H, W[, 3 or 4]) uint8 array"
    )


def check_image(value: Any, base_dir: str | Path | None = None) -> Any:
    """`value` after checking by its header alone (PIL's `verify`: no full decode) that it is a picture, in a form
    `load_image` reads without `base_dir`: a path becomes an absolute path (str), base64 text its bytes, bytes
    `bytes`; a `{"bytes", ...}` dict is kept, a `{"path"}` one becomes the path; PIL images and arrays are
    loaded whole (cheap: already decoded). ValueError says why `value` is no picture."""
    PILLOW.require()
    if isinstance(value, dict):
        if value.get("bytes") is None and value.get("path"):
            return check_image(value["path"], base_dir)
        if value.get("bytes") is None:
            raise ValueError(f"an image dict needs 'bytes' or 'path'; got keys {sorted(value)}")
        check_image(value["bytes"], base_dir)
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        _verify(io.BytesIO(data), f"{len(data)} bytes are")
        return data
    if isinstance(value, (str, Path)):
        src, what = _source(value, base_dir)
        _verify(src if isinstance(src, Path) else io.BytesIO(src), what)
        return str(src) if isinstance(src, Path) else src
    return load_image(value)


def digest(image: Any) -> str:
    """A short stable id of a picture's pixels (PIL image)."""
    h = hashlib.sha1(f"{image.mode}:{image.size}".encode())
    h.update(image.tobytes())
    return h.hexdigest()[:16]


def source_key(value: Any) -> str:
    """A stable text id of a picture as a data row holds it (any `load_image` form), never decoded: encoded bytes
    (or a `{"bytes"}` dict's) and text that names no file (base64, a data URI) by a hash of their content; a path by
    the path and the file's size (a stat: a picture replaced in place under its name changes the id unless its
    size is the same); a PIL image or an array by a hash of its pixels (already decoded)."""
    if isinstance(value, dict):
        value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "b:" + hashlib.blake2b(bytes(value), digest_size=8).hexdigest()
    if isinstance(value, (str, Path)):
        try:
            size = Path(value).expanduser().stat().st_size
        except (OSError, ValueError):  # no such file, or a name too long to be one (base64 text)
            return "t:" + hashlib.blake2b(str(value).encode("utf-8", "replace"), digest_size=8).hexdigest()
        return f"p:{value}:{size}"
    if hasattr(value, "tobytes"):
        h = hashlib.blake2b(digest_size=8)
        layout = [getattr(value, name, None) for name in ("mode", "size", "shape", "dtype")]
        h.update(repr(layout).encode())
        h.update(value.tobytes())
        return "x:" + h.hexdigest()
    return "r:" + repr(value)


def _shown(value: Any, limit: int = 80) -> str:
    """`value` for a message: a base64 picture is tens of kilobytes of text."""
    text = repr(str(value))
    return text if len(text) <= limit else f"{text[: limit - 3]}...' ({len(str(value))} characters)"


def _source(value: str | Path, base_dir: str | Path | None) -> tuple[Path | bytes, str]:
    """(the file a path names or the bytes base64 text holds, how a message names it); ValueError for a URL, or a
    file that is not there (and text that is no base64)."""
    text = str(value)
    if isinstance(value, str):
        uri = _DATA_URI.match(text)
        if uri is not None:
            if "base64" not in [p.strip().lower() for p in uri.group(2).split(";")]:
                raise ValueError(f"image data URI {_shown(value)} is not base64-encoded (';base64,' expected)")
            data = _b64(text[uri.end() :], value)
            return data, f"image data URI {_shown(value)} ({len(data)} bytes) is"
        if _URL.match(text):
            raise ValueError(
                f"image {_shown(value)} is a URL: roll does not fetch pictures from the network; download them and "
                "give their paths (or put their bytes in the rows)"
            )
    path = Path(text).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    try:
        found = path.is_file()
    except (OSError, ValueError):  # a name too long for the file system (base64 text), a NUL character...
        found = False
    if found:
        return path, f"image file {path} is"
    missing = f"image file {_shown(value)} does not exist (looked at {_shown(path)})"
    if isinstance(value, str) and _BASE64.match(text):
        data = _b64(text, value, f"; nor is it a file: {missing}")
        return data, f"image {_shown(value)} (no such file: read as base64, {len(data)} bytes) is"
    raise ValueError(missing)


def _b64(text: str, value: Any, context: str = "") -> bytes:
    """The bytes of base64 text (either alphabet, line breaks and missing padding allowed)."""
    body = "".join(text.split())
    if len(body) % 4 == 1:  # no padding makes this valid (what b64decode says in its own terms)
        raise ValueError(f"image {_shown(value)} is not valid base64 ({len(body)} characters){context}")
    body += "=" * (-len(body) % 4)
    try:
        return base64.b64decode(body.replace("-", "+").replace("_", "/"), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"image {_shown(value)} is not valid base64 ({exc}){context}") from None


def _verify(src: Any, what: str) -> None:
    from PIL import Image

    try:
        with Image.open(src) as im:
            im.verify()
    except Exception as exc:  # PIL raises many kinds for bad data (DecompressionBombError is no OSError)
        raise ValueError(f"{what} not a readable picture ({type(exc).__name__}: {exc})") from None


def _decode(src: Any, what: str) -> Any:
    """The RGB picture in a file or a bytes buffer (the file closed again)."""
    from PIL import Image

    try:
        with Image.open(src) as im:
            return _rgb(im, copy=True)  # (a new image: closing the file destroys the opened one's pixels)
    except Exception as exc:  # UnidentifiedImageError, truncated data, DecompressionBombError, bad EXIF...
        raise ValueError(f"{what} not a readable picture ({type(exc).__name__}: {exc})") from None


def _rgb(im: Any, copy: bool) -> Any:
    """`im` upright (EXIF orientation) and in RGB, transparency composited onto white (module docstring); `im`
    itself when it already is both and `copy` is False. A picture with a zero side is a ValueError: it shows
    nothing, and the image processors divide by its sides (a ZeroDivisionError no caller's `except ValueError`
    caught: one such observation ended the rollout, not its episode)."""
    from PIL import Image, ImageOps

    if not (im.width and im.height):
        raise ValueError(f"a picture of {im.width}x{im.height} pixels has no pixels: give one at least 1x1")
    try:
        orientation = im.getexif().get(_ORIENTATION)
    except Exception:  # malformed EXIF: the pixels as stored (what every reader falls back to)
        orientation = None
    if orientation not in (None, 1):
        im, copy = ImageOps.exif_transpose(im), False
    if im.mode == "RGB":
        return im.copy() if copy else im
    if im.mode in ("I", "F") or im.mode.startswith("I;16"):
        im = _eight_bit(im)
    if _transparent(im):
        rgba = im.convert("RGBA")
        out = Image.new("RGB", rgba.size, WHITE)
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return im.convert("RGB")


def _eight_bit(im: Any) -> Any:
    """A 16-bit or 32-bit integer (I;16*, I) or float (F) grey picture as 8-bit grey (L), or grey and alpha (LA) when
    a PNG's tRNS made one grey level transparent. Integer pictures are 16-bit ones (what PIL opens a 16-bit PNG as):
    0..65535 scaled to 0..255; float ones are 0..1. Values outside that range are a ValueError (a 32-bit picture,
    floats of another scale: clipping or guessing a scale would be a wrong picture)."""
    import numpy as np
    from PIL import Image

    arr = np.asarray(im)
    if im.mode == "F":
        if not np.isfinite(arr).all():
            raise ValueError("a float picture (mode F) holds NaN or infinite values")
        top, scale = 1.0, "a float picture (mode F) must hold 0..1"
    else:
        arr = arr.astype(np.int64)  # (I;16B arrives big-endian; the values are what matter)
        top, scale = 65535, f"a {im.mode} picture is read as 16-bit grey and must hold 0..65535"
    low, high = arr.min(), arr.max()
    if low < 0 or high > top:
        raise ValueError(f"{scale}; got values {low:g}..{high:g}: give an 8-bit or 16-bit picture")
    grey = Image.fromarray(np.rint(arr * (255.0 / top)).astype(np.uint8), "L")
    level = im.info.get("transparency")
    if im.mode == "F" or not isinstance(level, int):
        return grey
    alpha = Image.fromarray(np.where(arr == level, 0, 255).astype(np.uint8), "L")
    return Image.merge("LA", (grey, alpha))


def _transparent(im: Any) -> bool:
    """Whether `im` has transparency: an alpha band (RGBA, LA, PA), a palette with alpha, or a transparent entry
    (a PNG's tRNS: P, L)."""
    has = getattr(im, "has_transparency_data", None)  # Pillow >= 10.1
    if has is not None:
        return bool(has)
    palette = getattr(im, "palette", None)
    return "A" in im.getbands() or "transparency" in im.info or (im.mode == "P" and palette.mode == "RGBA")
