"""Data rows with pictures in the forms real VLM data sets use: base64 text and data URIs read, URLs and
unreadable text counted skips (never an OSError ending the load or the run), a `datasets` folder's Image feature
kept encoded (not every picture decoded and held at load) yet read as the same upright picture."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest

from roll_core.multimodal import digest, load_image
from roll_envs.tasks.base import Problem
from roll_envs.tasks.dataset import load_problems
from roll_envs.tasks.visual import VisualReward, VisualTask

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402


def noise(seed: int, size: int = 48) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB")


def png(im: Image.Image, **kw: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG", **kw)
    return buf.getvalue()


def test_base64_rows_load_and_urls_or_unreadable_text_are_counted_skips(tmp_path: Path) -> None:
    pics = [noise(1), noise(2)]
    b64 = [base64.b64encode(png(im)).decode() for im in pics]
    assert min(len(b) for b in b64) > 4096  # longer than a file name may be
    rows = [
        {"prompt": "<image>Which?", "images": [b64[0]], "answer": "1"},
        {"prompt": "<image> or <image>?", "images": [f"data:image/png;base64,{b64[1]}", b64[0]], "answer": "2"},
        {"prompt": "<image>Online?", "images": ["https://example.com/cat.png"], "answer": "3"},
        {"prompt": "<image>Garbage?", "images": ["A" * 5000], "answer": "4"},
        {"prompt": "<image>Cut short?", "images": [b64[0][:3001]], "answer": "5"},
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems, skipped = load_problems(data)
    assert [p.answer for p in problems] == ["1", "2"]
    assert [digest(load_image(im)) for p in problems for im in p.images] == [digest(pics[i]) for i in (0, 1, 0)]
    reasons = dict(skipped)
    assert sorted(reasons) == [3, 4, 5]
    assert "is a URL" in reasons[3] and "not a readable picture" in reasons[4] and "not valid base64" in reasons[5]
    assert all(len(r) < 600 for r in reasons.values())  # a base64 value is not logged whole


def test_a_datasets_folder_keeps_its_pictures_encoded_and_reads_them_upright(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    exif = Image.Exif()
    exif[274] = 6  # stored sideways: every reader (datasets' decode included) shows it rotated
    big = Image.fromarray(np.tile(np.arange(256, dtype=np.uint8), (512, 2))[..., None].repeat(3, -1), "RGB")
    stored = [png(noise(3, 64), exif=exif.tobytes()), png(big)]
    ds = datasets.Dataset.from_dict(
        {
            "prompt": ["<image>Rotated?", "<image>Big?", "Text only."],
            "images": [[{"bytes": stored[0], "path": None}], [{"bytes": stored[1], "path": None}], []],
            "answer": ["a", "b", "c"],
        },
        features=datasets.Features(
            {
                "prompt": datasets.Value("string"),
                "images": datasets.Sequence(datasets.Image()),
                "answer": datasets.Value("string"),
            }
        ),
    )
    ds.save_to_disk(str(tmp_path / "ds"))
    decoded = list(datasets.load_from_disk(str(tmp_path / "ds")))  # what datasets itself shows
    problems, skipped = load_problems(tmp_path / "ds")
    assert not skipped and [p.answer for p in problems] == ["a", "b", "c"] and len(problems[2].images) == 0
    for p, row in zip(problems[:2], decoded):
        (held,) = p.images
        assert isinstance(held, dict) and isinstance(held["bytes"], bytes)  # encoded, not a decoded PIL picture
        assert digest(load_image(held)) == digest(load_image(row["images"][0]))
    assert load_image(problems[0].images[0]).size == (64, 64) and problems[1].images[0]["bytes"] == stored[1]
    assert len(problems[1].images[0]["bytes"]) < 512 * 512 * 3 // 10  # what is held: the PNG, not the pixels


@pytest.fixture(scope="module")
def vlm() -> tuple[object, object]:
    from transformers import AutoTokenizer

    from roll_core.models import resolve_model_path
    from roll_core.pipelines.rollout import vision_processor

    path = resolve_model_path("builtin:tiny-qwen2.5-vl")
    tok = AutoTokenizer.from_pretrained(path)
    return tok, vision_processor(path, tok)


def test_a_task_picture_unreadable_at_prompt_time_is_a_counted_skip(vlm, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task's own problems (not checked at load) with a picture that cannot be read: skipped and counted by
    prompt_batch, never an OSError or DecompressionBombError in the middle of a run."""
    from roll_core.pipelines.rollout import prompt_batch

    tok, proc = vlm
    task = VisualTask(VisualReward(), train_size=2, eval_size=1)
    bomb = png(Image.new("RGB", (300, 300), (1, 2, 3)))
    bad = [
        Problem("t:long", "<image>Long?", "1", images=["B" * 5000]),
        Problem("t:bomb", "<image>Bomb?", "1", images=[bomb]),
        Problem("t:url", "<image>Url?", "1", images=["http://example.com/a.png"]),
    ]
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 20_000)  # 90,000 pixels > 2 x the limit: a bomb
    metrics: dict = {}
    batch = prompt_batch(tok, task, [*task.train_set(), *bad], 512, metrics, None, proc)
    assert len(batch) == 2 and metrics["data/skipped_bad_images"] == 3


def test_chat_rows_place_pictures_at_the_markers_of_earlier_user_turns(vlm, tmp_path: Path) -> None:
    """A chat-messages row whose `<image>` markers stand in earlier user turns: each picture replaces its marker
    where it stands, in order across the messages. Only the last user message's markers were counted and every
    picture went into it: the earlier marker stayed literal text (LLaVA's placeholder token itself) and a row with
    markers in two turns was skipped for a count mismatch."""
    from roll_core.pipelines.rollout import prompt_batch
    from roll_envs.rewards.math import MathReward
    from roll_envs.tasks.dataset import FileTask

    tok, proc = vlm
    small, wide = noise(1, 56), Image.fromarray(np.zeros((56, 112, 3), dtype=np.uint8), "RGB")  # 4 and 8 tokens
    small.save(tmp_path / "small.png")
    wide.save(tmp_path / "wide.png")

    def chat(first: str, reply: str, last: str) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": "Look closely."},
            {"role": "user", "content": first},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": last},
        ]

    rows = [
        {"prompt": chat("<image> What is this?", "Noise.", "And <image>?"), "images": ["small.png", "wide.png"]},
        {"prompt": chat("<image> What is this?", "Noise.", "Its colour?"), "images": ["small.png"]},
        {"prompt": chat("A <image> B <image>", "Two.", "Which is wider?"), "images": ["wide.png", "small.png"]},
        {"prompt": chat("What is this?", "An <image>.", "Sure?"), "images": ["small.png"]},
        {"prompt": chat("<image> and <image>?", "Two.", "Why?"), "images": ["small.png"]},
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({**r, "answer": "1"}) + "\n" for r in rows))
    task = FileTask(MathReward(), path=str(data), eval_fraction=0.0)
    reasons = {n: why for _, n, why in task.skipped}
    assert sorted(reasons) == [4, 5]
    assert "message 2 (assistant)" in reasons[4] and "pictures go in user messages" in reasons[4]
    assert "2 <image> marker(s) but the row has 1 picture(s)" in reasons[5]

    metrics: dict = {}
    batch = prompt_batch(tok, task, task.train_set(), 1024, metrics, None, proc)
    assert len(batch) == 3 and metrics["data/skipped_bad_images"] == 0
    want = [  # image tokens per user turn, and the pictures in prompt order
        ([4, 8], [small, wide]),
        ([4, 0], [small]),
        ([8 + 4, 0], [wide, small]),
    ]
    for ids, mm, (per_turn, pics) in zip(batch["prompt_ids"], batch["mm_inputs"], want):
        text = tok.decode(ids)
        assert "<image>" not in text  # every marker replaced by its picture
        assert [t.count("<|image_pad|>") for t in text.split("<|user|>")[1:]] == per_turn
        assert mm.digests == [digest(p) for p in pics] and sum(mm.tokens_per_image) == sum(per_turn)
    # Pictures stand exactly where their markers stood: around the first turn's text of the third row.
    third = tok.decode(batch["prompt_ids"][2]).split("<|user|>")[1]
    assert third.index("A") < third.index("<|image_pad|>") < third.index("B") < third.rindex("<|image_pad|>")


def test_a_task_marker_outside_user_messages_or_miscounted_is_a_counted_skip(vlm) -> None:
    """Problems built by a task (not checked at load): a marker in a system message, or markers across the user
    turns that do not match the pictures, skip the row (data/skipped_bad_images), never a literal marker."""
    from roll_core.pipelines.rollout import prompt_batch

    tok, proc = vlm
    task = VisualTask(VisualReward(), train_size=1, eval_size=1)
    pic = noise(2, 56)
    bad = [
        Problem("t:sys", "Q?", "1", images=[pic], context=({"role": "system", "content": "See <image>."},)),
        Problem("t:two", "Q?", "1", images=[pic], context=({"role": "user", "content": "<image><image>"},)),
    ]
    metrics: dict = {}
    batch = prompt_batch(tok, task, [*task.train_set(), *bad], 512, metrics, None, proc)
    assert len(batch) == 1 and metrics["data/skipped_bad_images"] == 2
