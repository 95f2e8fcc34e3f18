"""Pictures given as arrays and torch tensors (roll_core.multimodal.images): a tensor on any device is read from a
CPU copy (numpy's TypeError on a GPU tensor, and its RuntimeError on one that tracks gradients, escaped every caller's
`except ValueError`); a meta tensor, which holds no values, is a ValueError; channel-first (C, H, W) arrays are read
as such, and a shape that reads both ways follows the documented rule: a last side of 1, 3 or 4 is the channels (a
(3, H, 4) array was already an RGBA picture 3 tall while every other channel-first one was refused)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from roll_core.multimodal import load_image
from roll_core.multimodal.images import source_key


def _pixels(h: int, w: int, c: int) -> np.ndarray:
    """(h, w, c) uint8 values, distinct at every position and channel (alpha 255: opaque)."""
    arr = (np.arange(h * w * c, dtype=np.int64).reshape(h, w, c) * 7 % 251).astype(np.uint8)
    if c == 4:
        arr[..., 3] = 255
    return arr


def _rgb(arr_hwc: np.ndarray) -> np.ndarray:
    """The RGB values `load_image` gives for an opaque (h, w, c) picture."""
    return np.repeat(arr_hwc, 3, axis=2) if arr_hwc.shape[2] == 1 else arr_hwc[..., :3]


@pytest.mark.parametrize(
    ("shape", "layout"),
    [
        ((5, 7, 3), "last"),
        ((5, 7, 4), "last"),
        ((5, 7, 1), "last"),
        ((3, 5, 7), "first"),
        ((4, 5, 7), "first"),
        ((1, 5, 7), "first"),
        # Both ways: the last side wins (a 3 x 5 RGBA picture, not a 5 x 4 RGB one), whatever the first side is.
        ((3, 5, 4), "last"),
        ((4, 5, 3), "last"),
        ((3, 5, 3), "last"),
        ((4, 5, 4), "last"),
        ((1, 5, 3), "last"),
        ((3, 5, 1), "last"),
    ],
)
def test_channel_layout_rule(shape: tuple[int, int, int], layout: str) -> None:
    if layout == "last":
        hwc = _pixels(*shape)
        given = hwc
    else:
        c, h, w = shape
        hwc = _pixels(h, w, c)
        given = np.ascontiguousarray(hwc.transpose(2, 0, 1))
    assert given.shape == shape
    im = load_image(given)
    assert im.mode == "RGB" and im.size == (hwc.shape[1], hwc.shape[0])
    np.testing.assert_array_equal(np.asarray(im), _rgb(hwc))


@pytest.mark.parametrize("shape", [(5, 7, 2), (2, 5, 7), (5, 7, 5), (2, 5, 7, 3), (7,)])
def test_a_shape_without_a_channel_side_is_a_value_error(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=rf"\(C, H, W\) with C 1, 3 or 4 channels; got shape \({shape[0]},"):
        load_image(np.zeros(shape, np.uint8))


def test_a_torch_tensor_is_read_channel_first_or_last() -> None:
    hwc = _pixels(5, 7, 3)
    for tensor in (torch.from_numpy(hwc), torch.from_numpy(hwc).permute(2, 0, 1)):  # (the CHW one: a view)
        np.testing.assert_array_equal(np.asarray(load_image(tensor)), hwc)


def test_a_tensor_that_tracks_gradients_is_a_value_error_not_a_runtime_error() -> None:
    # Only float tensors track gradients: the picture must be uint8, said as such (numpy's RuntimeError before).
    t = torch.zeros(3, 5, 7, requires_grad=True)
    with pytest.raises(ValueError, match=r"image tensor must be uint8; got torch.float32 \(3, 5, 7\)"):
        load_image(t)
    bf16 = torch.zeros(5, 7, 3, dtype=torch.bfloat16)  # (numpy has no bfloat16: a TypeError before)
    with pytest.raises(ValueError, match=r"must be uint8; got torch\.bfloat16"):
        load_image(bf16)


def test_a_tensor_off_the_cpu_is_copied_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here: a tensor numpy refuses until it is moved (what a CUDA tensor is), read through .detach().cpu().
    hwc = _pixels(5, 7, 3)
    moved: list[bool] = []

    class OffCPU(torch.Tensor):
        def __array__(self, *args: object, **kwargs: object) -> np.ndarray:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first.")

        def cpu(self, *args: object, **kwargs: object) -> torch.Tensor:
            moved.append(True)
            return self.as_subclass(torch.Tensor).clone()

    t = torch.from_numpy(hwc).as_subclass(OffCPU)
    with pytest.raises(TypeError):
        np.asarray(t)
    np.testing.assert_array_equal(np.asarray(load_image(t)), hwc)
    assert moved == [True]


def test_a_meta_tensor_is_a_value_error() -> None:
    t = torch.empty(5, 7, 3, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match=r"meta device holds no values \(shape \(5, 7, 3\)\)"):
        load_image(t)


def test_an_array_like_numpy_cannot_read_is_a_value_error() -> None:
    class Unreadable:
        shape = (5, 7, 3)

        def __array__(self, *args: object, **kwargs: object) -> np.ndarray:
            raise TypeError("device memory")

    with pytest.raises(ValueError, match=r"cannot read the values of a Unreadable image \(TypeError: device memory\)"):
        load_image(Unreadable())


def test_a_tensors_source_key_hashes_every_pixel() -> None:
    a = torch.zeros(64, 64, 3, dtype=torch.uint8)
    b = a.clone()
    b[32, 32, 1] = 9  # a middle pixel: the repr of a 12288-value tensor elides it
    assert repr(a) == repr(b)
    assert source_key(a) != source_key(b)
    assert source_key(a) == source_key(a.clone())
    assert source_key(a[1:]) == source_key(a[1:].clone())  # a view keys by its own values, not its storage's
    # the same values in another memory layout key alike; other values in the same storage bytes do not
    square = torch.arange(4, dtype=torch.uint8).reshape(2, 2)
    assert source_key(square.t()) == source_key(square.t().contiguous())
    assert source_key(square.t()) != source_key(square)
