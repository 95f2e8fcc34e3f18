"""Grey pictures deeper than 8 bits (roll_core.multimodal.images._eight_bit): a 16-bit PNG (PIL mode I;16, or I in
older Pillows and from other files) and a float picture (mode F) are scaled to 8 bits before RGB. PIL's
convert("RGB") clipped them: every 16-bit value over 255 (all but the darkest 0.4 % of the range) became white, and
a 0..1 float picture black."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from roll_core.multimodal import load_image

#: A 16-bit grey ramp: black, 1/4, mid grey, 3/4, white.
RAMP16 = np.array([[0, 16384, 32768, 49152, 65535]], dtype=np.uint16)
#: Its 8-bit picture: round(v * 255 / 65535).
RAMP8 = [0, 64, 128, 191, 255]


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def _grey(rgb: Image.Image) -> list[int]:
    assert rgb.mode == "RGB"
    arr = np.asarray(rgb)
    assert (arr == arr[..., :1]).all()  # grey: R = G = B
    return arr[0, :, 0].tolist()


def test_a_16_bit_png_is_scaled_not_clipped(tmp_path: Path) -> None:
    data = _png(Image.fromarray(RAMP16))
    assert Image.open(io.BytesIO(data)).mode.startswith("I")  # what PIL opens a 16-bit grey PNG as
    (tmp_path / "depth.png").write_bytes(data)
    for value in (data, str(tmp_path / "depth.png"), {"bytes": data, "path": None}):
        assert _grey(load_image(value)) == RAMP8  # clipped: [0, 255, 255, 255, 255]
    i32 = Image.fromarray(RAMP16.astype(np.int32))  # mode I: a 16-bit PNG in Pillow < 10, 16-bit TIFFs
    assert i32.mode == "I" and _grey(load_image(i32)) == RAMP8
    big = Image.frombytes("I;16B", (5, 1), RAMP16.astype(">u2").tobytes())  # big-endian samples (16-bit TIFFs)
    assert _grey(load_image(big)) == RAMP8


def test_a_float_picture_is_scaled_from_0_to_1() -> None:
    im = Image.fromarray((RAMP16 / 65535.0).astype(np.float32))
    assert im.mode == "F" and _grey(load_image(im)) == RAMP8  # clipped: [0, 0, 0, 0, 1]


def test_a_16_bit_pngs_transparent_level_is_composited_onto_white() -> None:
    im = Image.fromarray(RAMP16)
    buf = io.BytesIO()
    im.save(buf, format="PNG", transparency=16384)  # tRNS: the 1/4 grey level is transparent
    opened = Image.open(io.BytesIO(buf.getvalue()))
    assert opened.info.get("transparency") == 16384
    assert _grey(load_image(buf.getvalue())) == [0, 255, 128, 191, 255]


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.array([[0.0, 2.0]], dtype=np.float32), r"mode F\) must hold 0\.\.1; got values 0\.\.2"),
        (np.array([[0.0, np.nan]], dtype=np.float32), "NaN or infinite"),
        (np.array([[0, 70000]], dtype=np.int32), r"must hold 0\.\.65535; got values 0\.\.70000"),
        (np.array([[-1, 5]], dtype=np.int32), r"got values -1\.\.5"),
    ],
)
def test_values_no_scale_fits_are_a_value_error(array: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_image(Image.fromarray(array))
