"""Picture size bounds (model.image_min_pixels / image_max_pixels) in the prompt builder, the image processor
backend roll pins, the prompt-length error for rows with pictures, and the data fingerprint's pictures."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from PIL import Image

from roll_core.errors import ConfigError
from roll_core.models import resolve_model_path
from roll_core.multimodal import VisionProcessor, as_content

CELL = 28 * 28  # one merged 2x2 block of 14-pixel patches: one picture token of the Qwen2-VL families
MESSAGES = [{"role": "user", "content": as_content("colour? <image>", 1)}]


@pytest.fixture(scope="module")
def qwen() -> str:
    return resolve_model_path("builtin:tiny-qwen2.5-vl")  # its processor: 4 to 16 tokens a picture


def _encode(vp: VisionProcessor, picture: Image.Image) -> tuple[list[int], Any]:
    return vp.encode_messages(MESSAGES, [picture])


def test_a_max_pixels_bound_shrinks_the_grid_and_the_placeholders_with_it(qwen: str) -> None:
    picture = Image.new("RGB", (112, 112), (200, 30, 30))
    ids, mm = _encode(VisionProcessor(qwen), picture)
    assert mm.tensors["image_grid_thw"].tolist() == [[1, 8, 8]] and mm.tokens_per_image == [16]  # the folder's 4x4
    small = VisionProcessor(qwen, max_pixels=4 * CELL, min_pixels=CELL)
    ids_s, mm_s = _encode(small, picture)
    assert mm_s.tensors["image_grid_thw"].tolist() == [[1, 4, 4]] and mm_s.tokens_per_image == [4]
    assert mm_s.tensors["pixel_values"].shape[0] == 16  # 4x4 patches
    assert ids_s.count(small.image_token_id) == 4 and ids.count(small.image_token_id) == 16
    assert len(ids) - len(ids_s) == 12  # only the placeholder run changed
    one = VisionProcessor(qwen, min_pixels=CELL, max_pixels=CELL)
    assert _encode(one, picture)[1].tokens_per_image == [1]
    # A min bound alone (the folder's max kept) enlarges a small picture
    assert _encode(VisionProcessor(qwen, min_pixels=16 * CELL), Image.new("RGB", (28, 28)))[1].tokens_per_image == [16]


def test_bounds_apply_to_a_folder_that_still_spells_min_and_max_pixels(qwen: str, tmp_path: Path) -> None:
    """Qwen2.5-VL's hub config spells `min_pixels` / `max_pixels` (no `size`): transformers 5 maps those onto `size`
    at construction, so a `size=` override given to from_pretrained would be silently undone there; roll's bound
    must apply all the same."""
    from roll_core.multimodal.processor import pixel_range

    folder = tmp_path / "legacy"
    shutil.copytree(qwen, folder)
    cfg = json.loads((folder / "preprocessor_config.json").read_text())
    cfg.pop("size")
    cfg.update(min_pixels=4 * CELL, max_pixels=64 * CELL)
    (folder / "preprocessor_config.json").write_text(json.dumps(cfg))
    picture = Image.new("RGB", (224, 224))
    assert _encode(VisionProcessor(folder), picture)[1].tokens_per_image == [64]
    assert _encode(VisionProcessor(folder, max_pixels=9 * CELL), picture)[1].tokens_per_image == [9]
    assert pixel_range(folder, max_pixels=9 * CELL) == (4 * CELL, 9 * CELL)
    assert pixel_range(folder) == (4 * CELL, 64 * CELL)


def test_bounds_that_cannot_apply_are_refused_with_the_setting_named(qwen: str) -> None:
    from roll_core.multimodal.processor import load_image_processor

    with pytest.raises(ValueError, match=r"the processor's min_pixels=3136 is above model.image_max_pixels=1000"):
        load_image_processor(qwen, max_pixels=1000)
    with pytest.raises(ValueError, match=r"model.image_min_pixels=5000 is above model.image_max_pixels=4000"):
        load_image_processor(qwen, min_pixels=5000, max_pixels=4000)
    with pytest.raises(ValueError, match=r"model.image_max_pixels=700 is below one 28x28 cell"):
        load_image_processor(qwen, min_pixels=100, max_pixels=700)
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="must be a positive integer"):
            load_image_processor(qwen, max_pixels=bad)
    with pytest.raises(ValueError, match=r"dynamic-resolution families.*model_type 'llava'.*leave them null"):
        VisionProcessor(resolve_model_path("builtin:tiny-llava"), max_pixels=4 * CELL)


def test_the_image_processor_is_transformers_pil_backend_whatever_is_installed(
    qwen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers 5 picks its torchvision backend wherever torchvision imports: roll asks for PIL by name, so
    the prompt builder resizes alike on every machine."""
    import transformers

    calls: list[dict[str, Any]] = []
    real = transformers.AutoImageProcessor.from_pretrained

    def spy(path: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoImageProcessor, "from_pretrained", spy)
    vp = VisionProcessor(qwen)
    assert calls and all(c.get("backend") == "pil" for c in calls)
    assert type(vp.image_processor).__name__.endswith("Pil")


def test_the_config_refuses_bad_bounds_with_a_config_error() -> None:
    from roll_core.config import ModelConfig, load_config

    assert ModelConfig(name="m", path="p", image_min_pixels=CELL, image_max_pixels=CELL).image_max_pixels == CELL
    with pytest.raises(ValueError, match=r"model.image_max_pixels=0 must be > 0"):
        ModelConfig(name="m", path="p", image_max_pixels=0)
    with pytest.raises(ValueError, match=r"model.image_min_pixels=9 is above model.image_max_pixels=4"):
        ModelConfig(name="m", path="p", image_min_pixels=9, image_max_pixels=4)
    with pytest.raises(ConfigError, match=r"model.image_min_pixels=-1 must be > 0"):
        load_config(["model.image_min_pixels=-1"])


def test_vision_processor_takes_the_runs_bounds_and_refuses_them_for_a_text_model(qwen: str) -> None:
    from roll_core.pipelines.rollout import vision_processor

    model = SimpleNamespace(image_min_pixels=CELL, image_max_pixels=4 * CELL)
    vp = vision_processor(qwen, None, model)
    assert _encode(vp, Image.new("RGB", (112, 112)))[1].tokens_per_image == [4]
    assert vision_processor(resolve_model_path("builtin:tiny"), None, SimpleNamespace()) is None
    with pytest.raises(ConfigError, match=r"model.image_max_pixels=3136 bound\(s\) pictures.* is a text model"):
        vision_processor(resolve_model_path("builtin:tiny"), None, model)
    with pytest.raises(ConfigError, match="dynamic-resolution families"):
        vision_processor(resolve_model_path("builtin:tiny-llava"), None, model)


def test_engines_get_only_the_bounds_that_are_set(qwen: str) -> None:
    """What the roles pass the engines (roll_core.multimodal.engine_pixels): nothing for an unbounded run, so an
    engine that takes no pictures is never handed a key it does not know."""
    from roll_core.multimodal import engine_pixels

    assert engine_pixels(SimpleNamespace(image_min_pixels=None, image_max_pixels=None), qwen) == {}
    assert engine_pixels(SimpleNamespace(image_min_pixels=None, image_max_pixels=9), qwen) == {"image_max_pixels": 9}
    assert engine_pixels(SimpleNamespace(), resolve_model_path("builtin:tiny")) == {}
    with pytest.raises(ConfigError, match=r"model.image_min_pixels=5 bound\(s\) pictures.* is a text model"):
        engine_pixels(SimpleNamespace(image_min_pixels=5, image_max_pixels=None), resolve_model_path("builtin:tiny"))


class _Task:
    def messages(self, problem: Any) -> list[dict[str, Any]]:
        return [{"role": "user", "content": problem.prompt}]


def _problem(i: int, prompt: str, images: tuple = ()) -> SimpleNamespace:
    return SimpleNamespace(id=f"p{i}", prompt=prompt, answer="a", images=images, metadata={})


def test_prompts_too_long_for_their_pictures_name_the_picture_tokens_and_image_max_pixels(qwen: str) -> None:
    from roll_core.pipelines.rollout import PromptsTooLong, prompt_batch

    vp = VisionProcessor(qwen)
    rows = [_problem(i, "colour? <image>", (Image.new("RGB", (112, 112)),)) for i in range(2)]
    with pytest.raises(PromptsTooLong, match=r"16 of them picture tokens.*lower model.image_max_pixels") as exc:
        prompt_batch(vp.tokenizer, _Task(), rows, 10, {}, processor=vp)
    assert "raise model.max_prompt_length" in str(exc.value)
    # Text rows: the message names the prompt length only
    with pytest.raises(PromptsTooLong, match=r"tokens\): raise model.max_prompt_length$"):
        prompt_batch(vp.tokenizer, _Task(), [_problem(0, "a long question " * 5)], 10, {}, processor=vp)


def _png(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_the_data_fingerprint_tells_rows_apart_by_their_pictures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same prompts and answers, other pictures (replaced, reordered, a file rewritten in place): another
    training list for a resumed run. Nothing is decoded, and text rows hash as before (saved runs still match)."""
    import hashlib

    from roll_core.data import data_fingerprint

    red, blue = _png((255, 0, 0)), _png((0, 0, 255))
    rows = [_problem(0, "which colour?", (red,)), _problem(1, "which colour?", (blue,))]
    fp = data_fingerprint(rows)
    assert data_fingerprint([_problem(0, "which colour?", (red,)), _problem(1, "which colour?", (blue,))]) == fp
    swapped = [_problem(0, "which colour?", (blue,)), _problem(1, "which colour?", (red,))]
    assert data_fingerprint(swapped) != fp
    both = [_problem(0, "which colour?", (red, blue))]
    assert data_fingerprint(both) != data_fingerprint([_problem(0, "which colour?", (blue, red))])
    # Every form a row holds (dicts as datasets writes them, paths, PIL pictures) counts
    assert data_fingerprint([_problem(0, "q", ({"bytes": red, "path": None},))]) != data_fingerprint(
        [_problem(0, "q", ({"bytes": blue, "path": None},))]
    )
    pic = tmp_path / "a.png"
    pic.write_bytes(red)
    before = data_fingerprint([_problem(0, "q", (str(pic),))])
    pic.write_bytes(red + b"\0" * 7)  # replaced in place, under the same name
    assert data_fingerprint([_problem(0, "q", (str(pic),))]) != before
    assert data_fingerprint([_problem(0, "q", (Image.new("RGB", (4, 4), (1, 1, 1)),))]) != data_fingerprint(
        [_problem(0, "q", (Image.new("RGB", (4, 4), (2, 2, 2)),))]
    )
    # Cheap: no picture is decoded (bytes that are no picture at all still hash)
    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("decoded a picture"))
    assert data_fingerprint([_problem(0, "q", (b"not a picture",))]) != data_fingerprint([_problem(0, "q")])
    # A text list's fingerprint is the one saved runs hold
    text = [_problem(0, "2+2?"), _problem(1, "3+3?")]
    h = hashlib.sha256()
    for p in text:
        h.update(repr((p.prompt, p.answer)).encode())
        h.update(b"\x00")
    assert data_fingerprint(text) == h.hexdigest()[:16]
