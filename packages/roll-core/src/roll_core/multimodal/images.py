"""Images as data rows hold them, turned into RGB PIL images.

A row's image may be a file path (absolute, or relative to the data file's folder), raw encoded bytes, base64 text
of those bytes (bare, or a `data:image/...;base64,` URI), a `{"bytes": ..., "path": ...}` dict (what Parquet files
written by `datasets` hold), a PIL image, or a uint8 array: a numpy array, or a torch tensor on any device (copied
to the CPU), of shape (H, W) (grey), channel-last (H, W, C) or channel-first (C, H, W), C being 1 (grey), 3 (RGB)
or 4 (RGBA). The layout rule (`_channel_last`): a last side of 1, 3 or 4 is the channels, whatever the first;
otherwise a first side of 1, 3 or 4 is (torchvision's layout). So a shape that reads both ways, (3, 5, 4) say, is a
3 x 5 RGBA picture, never a 5 x 4 RGB one: a channel-first picture 1, 3 or 4 pixels wide must be transposed by its
giver. A URL is refused: a run fetches nothing from the network (download the pictures, give their paths).
Anything else, an unreadable file, undecodable bytes, an array of another dtype or shape, a tensor without data
(the meta device) or a picture with a zero side (0 x H) is a `ValueError` naming what was given (long values
shortened): a wrong picture never reaches the model silently, and no other exception escapes (a name too long for
the file system, a decompression bomb, an image processor dividing by a zero side, numpy refusing a GPU tensor),
so callers that skip bad rows on ValueError never crash on one.

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
    if getattr(value, "shape", None) is not None:
        arr = _channel_last(_host_array(value))
        mode = {1: "L", 3: "RGB", 4: "RGBA"}[arr.shape[-1]]
        return _rgb(Image.fromarray(arr[..., 0] if mode == "L" else arr, mode), copy=False)
    raise ValueError(
        f"cannot read an image from a {type(value).__name__}: give a path, bytes, base64 text, a {{'bytes', 'path'}} "
        "dict, a PIL image or an (H, W), (H, W, C) or (C, H, W) uint8 array (C: 1, 3 or 4)"
    )


def _host_array(value: Any) -> Any:  # -> np.ndarray
    """`value` (a numpy array, a torch tensor on any device, another array-like) as a uint8 numpy array in host
    memory; ValueError for another dtype or values that cannot be read (a tensor on the meta device has none)."""
    import sys

    import numpy as np

    torch = sys.modules.get("torch")  # (not imported: `value` is no tensor)
    if torch is not None and isinstance(value, torch.Tensor):
        if value.dtype != torch.uint8:  # (before numpy: bfloat16 has no numpy dtype)
            raise ValueError(f"an image tensor must be uint8; got {value.dtype} {tuple(value.shape)}")
        if value.device.type == "meta":
            raise ValueError(
                f"an image tensor on the meta device holds no values (shape {tuple(value.shape)}): give one with data"
            )
        # numpy reads host memory only: a GPU tensor was a TypeError from np.asarray (no caller's except ValueError)
        value = value.detach().cpu()
    try:
        arr = np.asarray(value)
    except Exception as exc:  # an array-like numpy cannot read (a GPU array of another library...)
        raise ValueError(
            f"cannot read the values of a {type(value).__name__} image ({type(exc).__name__}: {exc})"
        ) from None
    if arr.dtype != np.uint8:
        raise ValueError(f"an image array must be uint8; got {arr.dtype} {tuple(arr.shape)}")
    return arr


def _channel_last(arr: Any) -> Any:  # -> np.ndarray (H, W, C)
    """A uint8 picture array as (H, W, C), C in 1, 3, 4 (the module docstring's rule: a last side of 1, 3 or 4 is
    the channels; else a first one is, and is moved last); ValueError for any other shape."""
    import numpy as np

    if arr.ndim == 2:
        return arr[..., None]
    if arr.ndim == 3 and arr.shape[-1] in (1, 3, 4):
        return arr
    if arr.ndim == 3 and arr.shape[0] in (1, 3, 4):
        return np.ascontiguousarray(arr.transpose(1, 2, 0))  # (PIL reads contiguous rows)
    raise ValueError(
        f"an image array must be (H, W), (H, W, C) or (C, H, W) with C 1, 3 or 4 channels; got shape {tuple(arr.shape)}"
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
    size is the same); a PIL image, an array or a tensor by a hash of its pixels (already decoded)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and value.device.type != "meta":
        # A tensor has no tobytes: its repr, which elides all but the corners of a large one, was the id (two
        # pictures alike at the corners shared it). A contiguous clone's storage holds exactly its values, in
        # order (a plain clone keeps a permuted view's strides: two layouts of other values could share bytes).
        data = value.detach().cpu().clone(memory_format=torch.contiguous_format)
        h = hashlib.blake2b(repr([tuple(data.shape), str(data.dtype)]).encode(), digest_size=8)
        h.update(bytes(data.untyped_storage()))
        return "x:" + h.hexdigest()
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
