"""roll_core.multimodal.images: the picture a row holds is the one viewers, transformers, `datasets` and vLLM show
(EXIF orientation applied, transparency on white), base64 text and data URIs are read, URLs refused, and every
unreadable value is a ValueError (what the prompt builders count as a skipped row), never another exception."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from roll_core.multimodal import check_image, digest, load_image

WHITE, BLACK, RED, BLUE = (255, 255, 255), (0, 0, 0), (220, 20, 20), (20, 20, 220)


def _encoded(im: Image.Image, fmt: str = "PNG", **kw: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _diagram(mode: str) -> Image.Image:
    """Black ink on a transparent background: how line diagrams (geometry data sets) are often stored."""
    im = Image.new("RGBA", (40, 40), (0, 0, 0, 0))
    ImageDraw.Draw(im).line((0, 0, 39, 39), fill=(0, 0, 0, 255), width=3)
    return im if mode == "RGBA" else im.convert(mode)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparency_is_composited_onto_white_as_transformers_and_vllm_do(mode: str, tmp_path: Path) -> None:
    im = _diagram(mode)
    if mode == "P":  # a palette picture with a transparent entry (tRNS)
        assert "transparency" in Image.open(io.BytesIO(_encoded(im))).info
    (tmp_path / "d.png").write_bytes(_encoded(im))
    for value in (im, _encoded(im), str(tmp_path / "d.png")):
        rgb = load_image(value)
        assert rgb.mode == "RGB"
        assert rgb.getpixel((35, 4)) == WHITE  # the background (PIL's plain convert("RGB") gave black)
        assert rgb.getpixel((20, 20)) == BLACK  # the ink
    from transformers.image_transforms import convert_to_rgb

    stored = Image.open(io.BytesIO(_encoded(im)))  # (an in-memory P picture keeps alpha in its palette: missed there)
    assert digest(load_image(stored)) == digest(convert_to_rgb(stored, return_numpy=False).convert("RGB"))


def test_exif_orientation_is_applied_like_every_viewer_and_datasets(tmp_path: Path) -> None:
    im = Image.new("RGB", (40, 20), RED)
    ImageDraw.Draw(im).rectangle((20, 0, 39, 19), fill=BLUE)  # left red, right blue as stored
    exif = Image.Exif()
    exif[274] = 6  # "rotate 90 degrees clockwise to display"
    data = _encoded(im, exif=exif.tobytes())
    upright = load_image(data)
    assert upright.size == (20, 40)  # stored 40x20, shown 20x40
    assert upright.getpixel((10, 5)) == RED and upright.getpixel((10, 35)) == BLUE
    (tmp_path / "p.png").write_bytes(data)
    assert digest(load_image(str(tmp_path / "p.png"))) == digest(upright)
    assert digest(load_image(Image.open(io.BytesIO(data)))) == digest(upright)
    datasets = pytest.importorskip("datasets")
    shown = datasets.Image().decode_example({"bytes": data, "path": None})
    assert digest(load_image(shown)) == digest(upright)  # a datasets folder's decoded picture: the same one
    assert load_image(upright) is upright  # already upright RGB: not copied


def test_base64_text_and_data_uris_are_pictures_and_urls_are_refused() -> None:
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8), "RGB")
    data = _encoded(noise)
    b64 = base64.b64encode(data).decode()
    want = digest(noise)
    assert len(b64) > 4096  # longer than any file name: stat() fails with ENAMETOOLONG
    forms = [
        b64,
        base64.urlsafe_b64encode(data).decode().rstrip("="),
        base64.encodebytes(data).decode(),  # with line breaks
        f"data:image/png;base64,{b64}",
        {"bytes": None, "path": f"data:image/png;base64,{b64}"},
    ]
    for form in forms:
        assert digest(load_image(form)) == want
        assert check_image(form) == data  # decoded once, at load
    with pytest.raises(ValueError, match=r"is a URL: roll does not fetch"):
        load_image("https://example.com/cat.png")
    with pytest.raises(ValueError, match=r"is a URL"):
        check_image("s3://bucket/cat.png")
    with pytest.raises(ValueError, match=r"not base64-encoded"):
        load_image("data:image/svg+xml;utf8,<svg/>")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("A" * 300, "not a readable picture"),  # a name too long for the file system: was an OSError
        ("Zm9v" * 2000, "not a readable picture"),  # base64 of no picture
        ("data:image/png;base64,@@@", "not valid base64"),
        ("x" * 100 + "/" + "y" * 300, "not valid base64.* does not exist"),  # too long a name
    ],
)
def test_unreadable_text_is_a_short_value_error(value: str, message: str, tmp_path: Path) -> None:
    for reader in (load_image, check_image):
        with pytest.raises(ValueError, match=message) as err:
            reader(value, tmp_path)
        assert len(str(err.value)) < 500  # the value is shortened in the message, not logged whole


def test_a_decompression_bomb_is_a_value_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    data = _encoded(Image.new("RGB", (56, 56), RED))
    (tmp_path / "big.png").write_bytes(data)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 3136 pixels > 2 x the limit: PIL's error, not OSError
    for value in (data, str(tmp_path / "big.png"), {"bytes": data}):
        with pytest.raises(ValueError, match="DecompressionBombError"):
            load_image(value)
        with pytest.raises(ValueError, match="DecompressionBombError"):
            check_image(value)


def test_grey_and_rgba_arrays_are_pictures() -> None:
    grey = load_image(np.full((8, 8), 90, dtype=np.uint8))
    assert grey.mode == "RGB" and grey.getpixel((1, 1)) == (90, 90, 90)
    rgba = np.zeros((8, 8, 4), dtype=np.uint8)
    rgba[:4, :, :] = (200, 0, 0, 255)  # top half opaque red, bottom half transparent
    im = load_image(rgba)
    assert im.getpixel((1, 1)) == (200, 0, 0) and im.getpixel((1, 6)) == WHITE
    with pytest.raises(ValueError, match="must be uint8"):
        load_image(np.zeros((4, 4), dtype=np.float32))


def test_check_image_keeps_the_forms_rows_are_split_by(tmp_path: Path) -> None:
    data = _encoded(Image.new("RGB", (20, 20), RED))
    (tmp_path / "a.png").write_bytes(data)
    assert check_image("a.png", tmp_path) == str(tmp_path / "a.png")
    assert check_image({"path": "a.png"}, tmp_path) == str(tmp_path / "a.png")
    row = {"bytes": data, "path": "x.png"}
    assert check_image(row) is row and check_image(bytearray(data)) == data
    with pytest.raises(ValueError, match="does not exist"):
        check_image("missing.png", tmp_path)
    with pytest.raises(ValueError, match="not a readable picture"):
        check_image(b"not a picture")
