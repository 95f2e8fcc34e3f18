"""roll_core.multimodal: pictures from every row form, their processing into expanded ids + MMInputs, the
placeholder/feature agreement check, merging rows' inputs, and mrope positions from the model's own rule."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from roll_core.models import resolve_model_path
from roll_core.multimodal import (
    MMInputs,
    VisionProcessor,
    as_content,
    check_tokens,
    digest,
    is_vision_model,
    load_image,
    merge,
    mrope_positions,
)

RED = (220, 20, 20)


def _png(colour: tuple[int, int, int], size: tuple[int, int] = (56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm() -> tuple[str, VisionProcessor]:
    path = resolve_model_path("builtin:tiny-qwen2.5-vl")
    return path, VisionProcessor(path)


def test_every_row_form_gives_the_same_rgb_picture(tmp_path: Path) -> None:
    data = _png(RED)
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(data)
    gray = Image.new("L", (56, 56), 90)
    forms = [
        data,
        {"bytes": data, "path": None},
        {"bytes": None, "path": "pics/a.png"},
        "pics/a.png",
        str(tmp_path / "pics" / "a.png"),
        Image.open(io.BytesIO(data)),
        np.full((56, 56, 3), RED, dtype=np.uint8),
    ]
    digests = {digest(load_image(f, base_dir=tmp_path)) for f in forms}
    assert len(digests) == 1
    img = load_image(forms[0])
    assert img.mode == "RGB" and img.size == (56, 56) and img.getpixel((3, 3)) == RED
    assert load_image(gray).mode == "RGB"  # converted, never passed through in another mode
    assert digest(load_image(_png((20, 220, 20)))) not in digests  # other pixels, other digest


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("missing.png", "does not exist"),
        (b"not a picture", "not a readable picture"),
        ({"path": None, "bytes": None}, "needs 'bytes' or 'path'"),
        (np.zeros((4, 4, 3), dtype=np.float32), "must be uint8"),
        (42, "cannot read an image from a int"),
    ],
)
def test_a_bad_picture_is_a_clear_error(tmp_path: Path, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_image(value, base_dir=tmp_path)


def test_image_markers_place_the_pictures() -> None:
    assert as_content("no pictures", 0) == "no pictures"
    assert as_content("What is <image> next to <image>?", 2) == [
        {"type": "text", "text": "What is "},
        {"type": "image"},
        {"type": "text", "text": " next to "},
        {"type": "image"},
        {"type": "text", "text": "?"},
    ]
    assert as_content("Which colour?", 1) == [{"type": "image"}, {"type": "text", "text": "Which colour?"}]
    with pytest.raises(ValueError, match=r"1 <image> marker.* but 2 picture"):
        as_content("<image> only one", 2)
    with pytest.raises(ValueError, match=r"marker.* but no picture"):
        as_content("<image>", 0)


def test_processor_expands_each_placeholder_to_its_picture_features(vlm: tuple[str, VisionProcessor]) -> None:
    path, vp = vlm
    assert is_vision_model(path) and not is_vision_model(resolve_model_path("builtin:tiny"))
    pics = [Image.new("RGB", (56, 56), RED), Image.new("RGB", (30, 80), (0, 0, 200))]
    ids, mm = vp.encode_messages([{"role": "user", "content": as_content("A <image> B <image>", 2)}], pics)
    assert mm is not None
    # 56x56 -> 4x4 patches of 14 -> 2x2 merged tokens; 30x80 is resized to 28x84 -> 2x6 patches -> 1x3 tokens...
    grid = mm.tensors["image_grid_thw"]
    assert grid.shape == (2, 3) and mm.tokens_per_image == [int(g.prod()) // 4 for g in grid]
    assert mm.tensors["pixel_values"].shape == (int(grid.prod(dim=1).sum()), 3 * 2 * 14 * 14)
    assert sum(t == vp.image_token_id for t in ids) == mm.num_tokens
    text = vp.tokenizer.decode(ids)
    first = text.index("<|image_pad|>")
    assert text[first:].startswith("<|image_pad|>" * mm.tokens_per_image[0] + "<|vision_end|>")
    assert text.startswith("<|user|>A <|vision_start|>") and text.endswith("<|assistant|>")
    # the same conversation without pictures and a picture without its placeholder are refused
    with pytest.raises(ValueError, match="more picture placeholders than the row's 0"):
        vp.encode_messages([{"role": "user", "content": as_content("A <image>", 1)}], [])
    with pytest.raises(ValueError, match=r"0 picture placeholder.* but the row 1 picture"):
        vp.encode_text("<|user|>no placeholder", pics[:1])


def test_placeholder_and_feature_counts_must_agree() -> None:
    mm = MMInputs({"pixel_values": torch.zeros(16, 8)}, [4], ["d"])
    check_tokens([5, 9, 9, 9, 9, 6], mm, 9)
    with pytest.raises(ValueError, match=r"row 3: 3 image placeholder token\(s\) \(id 9\).* 1 picture\(s\) with 4"):
        check_tokens([5, 9, 9, 9, 6], mm, 9, "row 3")
    with pytest.raises(ValueError, match=r"2 image placeholder.* 0 picture"):
        check_tokens([9, 9], None, 9)


def test_merge_concatenates_rows_in_order() -> None:
    a = MMInputs({"pixel_values": torch.ones(4, 2), "image_grid_thw": torch.tensor([[1, 2, 2]])}, [1], ["a"], ["A"])
    b = MMInputs(
        {"pixel_values": torch.zeros(8, 2), "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2]])}, [1, 1], ["b", "c"]
    )
    m = merge([a, None, b])
    assert m is not None and m.digests == ["a", "b", "c"] and m.tokens_per_image == [1, 1, 1]
    assert m.tensors["pixel_values"].shape == (12, 2) and m.tensors["pixel_values"][:4].eq(1).all()
    assert m.tensors["image_grid_thw"].shape == (3, 3) and m.images is None  # b holds no PIL pictures
    assert merge([None, None]) is None
    assert a.extend(a).key() == ("a", "a") and a.without_images().images is None
    with pytest.raises(ValueError, match="different tensors"):
        merge([a, MMInputs({"other": torch.ones(1)}, [1], ["x"])])


def test_mrope_positions_are_the_models_own_on_a_padded_batch(vlm: tuple[str, VisionProcessor]) -> None:
    """Left-padded prompts with pictures of different sizes + right-padded responses: the positions roll passes
    give the same logits as transformers computing them itself, row by row without padding."""
    from transformers import AutoModelForImageTextToText

    path, vp = vlm
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    rows = [
        vp.encode_messages([{"role": "user", "content": as_content("hi <image>", 1)}], [Image.new("RGB", (56, 56))]),
        vp.encode_messages([{"role": "user", "content": as_content("<image> x", 1)}], [Image.new("RGB", (84, 56))]),
    ]
    responses = [[40, 41, 42], [43]]
    width_p, width_r = max(len(r[0]) for r in rows), max(len(r) for r in responses)
    ids = torch.zeros(2, width_p + width_r, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, ((p, _), resp) in enumerate(zip(rows, responses, strict=True)):
        ids[b, width_p - len(p) : width_p] = torch.tensor(p)
        ids[b, width_p : width_p + len(resp)] = torch.tensor(resp)
        mask[b, width_p - len(p) : width_p + len(resp)] = 1
    mm = merge([r[1] for r in rows])
    pos = mrope_positions(model, ids, mask, mm, vp.image_token_id)
    assert pos.shape == (3, 2, width_p + width_r)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, **mm.tensors).logits
        for b, ((p, m), resp) in enumerate(zip(rows, responses, strict=True)):
            alone = torch.tensor([p + resp])
            model.model.rope_deltas = None
            want = model(
                input_ids=alone,
                mm_token_type_ids=(alone == vp.image_token_id).int(),
                **m.tensors,
            ).logits[0]
            got = logits[b][mask[b].bool()]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # a response token's 3 sections are equal and continue the prompt's largest position
    b0 = pos[:, 0, width_p : width_p + 3]
    assert (b0 == b0[0]).all() and int(b0[0, 0]) == int(pos[:, 0, :width_p].max()) + 1


def test_a_sampled_picture_placeholder_cuts_the_response_before_it(vlm: tuple[str, VisionProcessor]) -> None:
    """RLVR on a VLM: a response that samples `<|image_pad|>` ends before it (no picture stands behind it, the
    trainer could not match it to features); rows without one and text batches are untouched."""
    from roll_core.pipelines.rollout import assemble
    from roll_core.protocol import Batch

    _, vp = vlm
    ids, mm = vp.encode_messages(
        [{"role": "user", "content": as_content("c? <image>", 1)}], [Image.new("RGB", (56, 56))]
    )
    img, a, b = vp.image_token_id, 40, 41
    responses = torch.tensor([[a, b, img, a, b], [a, b, a, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    gen = Batch({"responses": responses, "response_mask": mask}, {"finish_reason": ["length", "stop"]})
    metrics: dict[str, float] = {}
    out = assemble(vp.tokenizer, Batch(fields={"prompt_ids": [ids, ids], "mm_inputs": [mm, mm]}), gen, metrics)
    pad = vp.tokenizer.pad_token_id
    assert out["responses"].tolist() == [[a, b, pad, pad, pad], [a, b, a, 0, 0]]
    assert out["response_mask"].tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert metrics["data/picture_token_cuts"] == 1
    assert int((out["input_ids"][0] == img).sum()) == mm.num_tokens  # only the prompt's placeholders are left
    text = assemble(vp.tokenizer, Batch(fields={"prompt_ids": [ids, ids]}), gen, {})  # no mm_inputs: untouched
    assert torch.equal(text["responses"], responses)


def test_a_llava_prompt_starts_with_the_bos_transformers_processor_adds(tmp_path: Path) -> None:
    """LLaVA-1.5's template spells no BOS and its Llama tokenizer adds one to a text: transformers' processor gives
    the model a BOS, so roll's single-turn prompts and agentic first turns do too (same ids as LlavaProcessor)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaProcessor

    from roll_core.agentic.chat import TurnTemplate
    from roll_core.multimodal.tiny import build_tiny_llava

    build_tiny_llava(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)  # the tiny tokenizer adds no BOS: make it add one, as Llama's
    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    tok.save_pretrained(tmp_path)
    vp = VisionProcessor(tmp_path)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    picture = Image.new("RGB", (30, 30), RED)
    ids, _ = vp.encode_messages(messages, [picture])
    hf = LlavaProcessor(
        image_processor=AutoImageProcessor.from_pretrained(tmp_path),
        tokenizer=vp.tokenizer,
        chat_template=vp.chat_template,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    want = hf.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=True, processor_kwargs={"images": [picture]}
    )["input_ids"][0]
    assert ids[0] == vp.tokenizer.bos_token_id and ids == list(want)
    first, _ = TurnTemplate(vp.tokenizer, vision=vp).initial_turn({"text": "colour?", "images": [picture]})
    assert first == ids  # the agentic first turn: the same prompt
    # A tokenizer that adds no BOS (Qwen's; the tiny default): nothing added
    plain = VisionProcessor(resolve_model_path("builtin:tiny-llava"))
    assert plain.encode_messages(messages, [picture])[0] == ids[1:]


def test_pictures_compare_by_value_so_a_batch_unions_with_its_copy() -> None:
    import pickle

    from roll_core.protocol import Batch

    grid = torch.tensor([[1, 2, 2]])
    a = MMInputs({"pixel_values": torch.arange(8.0).view(4, 2), "image_grid_thw": grid}, [1], ["a"], ["PIL"])
    batch = Batch(fields={"mm_inputs": [a, None]})
    copy = pickle.loads(pickle.dumps(batch))  # what a batch is after a trip through Ray
    assert copy["mm_inputs"][0] is not a and copy["mm_inputs"][0] == a and a.without_images() == a
    assert len(batch.union(copy)) == 2  # was: RuntimeError "Boolean value of Tensor ... is ambiguous"
    other = MMInputs({"pixel_values": torch.zeros(4, 2), "image_grid_thw": grid}, [1], ["a"])
    assert other != a and MMInputs(dict(a.tensors), [1], ["b"]) != a and a != "a"
    with pytest.raises(ValueError, match="field 'mm_inputs' differs"):
        batch.union(Batch(fields={"mm_inputs": [other, None]}))
