"""Pictures in problems: the synthetic visual task (answers read back from the pixels), its reward, data rows with
pictures (JSONL paths, Parquet {bytes, path} dicts, a `datasets` folder, Geometry3K-style and verl-style rows; bad
pictures and marker mismatches are counted skips), and prompt building for a vision-language model (expanded
picture tokens, `mm_inputs`, max_prompt_length counting them, a text model refusing pictures)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from roll_core.errors import ConfigError
from roll_core.multimodal import check_tokens, digest, load_image
from roll_envs.rewards.math import MathReward
from roll_envs.tasks.base import Problem, Task
from roll_envs.tasks.dataset import FileTask, load_problems
from roll_envs.tasks.visual import COLOURS, POSITIONS, SHAPES, VisualReward, VisualTask

PIL = pytest.importorskip("PIL")
from PIL import Image, ImageDraw  # noqa: E402

WHITE = (255, 255, 255)


def pixels(im: Image.Image) -> list[tuple[int, int, int]]:
    im = im.convert("RGB")
    return [im.getpixel((x, y)) for y in range(im.size[1]) for x in range(im.size[0])]


def ink_box(im: Image.Image) -> tuple[int, int, int, int]:
    """Bounding box of the non-white pixels."""
    mask = Image.eval(im.convert("L"), lambda v: 255 if v < 250 else 0)
    box = mask.getbbox()
    assert box is not None, "the picture is blank"
    return box


# ---- the synthetic task -----------------------------------------------------------------------------------------
def test_colour_answers_are_the_colour_covering_most_pixels() -> None:
    task = VisualTask(VisualReward(), kind="colour", num_colours=4, train_size=60, eval_size=20, seed=3)
    names = list(COLOURS)[:4]
    for p in [*task.train_set(), *task.eval_set()]:
        (im,) = p.images
        counts = {c: pixels(im).count(COLOURS[c]) for c in names}
        assert max(counts, key=counts.get) == p.answer, (p.id, counts)
        assert counts[p.answer] > sum(v for c, v in counts.items() if c != p.answer)  # never a tie
        assert p.prompt.endswith("<image>") and "red, green, blue, yellow" in p.prompt
    assert {p.answer for p in task.train_set()} == set(names)  # every colour is drawn


def test_count_position_and_shape_answers_match_the_drawing() -> None:
    count = VisualTask(VisualReward(), kind="count", max_count=4, train_size=40, eval_size=4)
    for p in count.train_set():
        (im,) = p.images
        cells = 0
        for r in range(4):
            for q in range(4):
                cell = im.crop((q * 14, r * 14, (q + 1) * 14, (r + 1) * 14))
                cells += any(px != WHITE for px in pixels(cell))
        assert str(cells) == p.answer, p.id
    position = VisualTask(VisualReward(), kind="position", train_size=40, eval_size=4)
    for p in position.train_set():
        x0, y0, x1, y1 = ink_box(p.images[0])
        cx, cy, s = (x0 + x1) / 2, (y0 + y1) / 2, p.images[0].size[0]
        where = {"left": s / 2 - cx, "right": cx - s / 2, "top": s / 2 - cy, "bottom": cy - s / 2}
        assert max(where, key=where.get) == p.answer, (p.id, where)
    shape = VisualTask(VisualReward(), kind="shape", train_size=60, eval_size=4)
    for p in shape.train_set():
        im = p.images[0]
        x0, y0, x1, y1 = ink_box(im)
        fill = sum(px != WHITE for px in pixels(im.crop((x0, y0, x1, y1)))) / ((x1 - x0) * (y1 - y0))
        # A square fills its box, a circle pi/4 of it, a triangle half.
        guess = "square" if fill > 0.92 else "circle" if fill > 0.65 else "triangle"
        assert guess == p.answer, (p.id, fill)
    assert {p.answer for p in shape.train_set()} == set(SHAPES)
    assert {p.answer for p in position.train_set()} == set(POSITIONS)


def test_seeded_pictures_and_the_blank_control() -> None:
    a, b = (VisualTask(VisualReward(), train_size=30, eval_size=10, seed=5) for _ in range(2))
    assert [digest(p.images[0]) for p in a.train_set()] == [digest(p.images[0]) for p in b.train_set()]
    other = VisualTask(VisualReward(), train_size=30, eval_size=10, seed=6)
    assert [digest(p.images[0]) for p in a.train_set()] != [digest(p.images[0]) for p in other.train_set()]
    assert not {p.prompt for p in a.train_set()} & {p.prompt for p in a.eval_set()}
    blank = VisualTask(VisualReward(), train_size=30, eval_size=10, seed=5, blank=True)
    # Same problems and answers, pictures of the same size with nothing on them.
    assert [(p.prompt, p.answer) for p in blank.train_set()] == [(p.prompt, p.answer) for p in a.train_set()]
    assert all(set(pixels(p.images[0])) == {WHITE} for p in blank.train_set())
    assert all(p.images[0].size == q.images[0].size for p, q in zip(blank.train_set(), a.train_set()))
    assert [(p.prompt, p.answer) for p in blank.eval_set()] == [(p.prompt, p.answer) for p in a.eval_set()]
    # No held-out picture is a training picture (kind=position's small space drew 54 of 100 again)
    for kind in ("colour", "count", "position", "shape"):
        task = VisualTask(VisualReward(), kind=kind, train_size=1000, eval_size=100)
        train = {digest(p.images[0]) for p in task.train_set()}
        assert not train & {digest(p.images[0]) for p in task.eval_set()}, kind
    with pytest.raises(ValueError, match=r"env\.kind"):
        VisualTask(VisualReward(), kind="texture")
    with pytest.raises(ValueError, match=r"env\.dominance"):
        VisualTask(VisualReward(), dominance=0.5)


def test_visual_reward_reads_the_named_choice() -> None:
    reward = VisualReward(correct_weight=1.0, format_weight=0.1)
    meta = [{"choices": ["red", "green", "blue"]}] * 6
    responses = ["Red.", "blue", "It is green, not red", "\\boxed{green} (red was close)", "purple", ""]
    res = reward.score(responses, ["red", "red", "red", "green", "red", "red"], metadata=meta)
    assert res.correct == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]  # the last choice named wins; a box wins over the text
    assert res.formatted == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert res.scores == pytest.approx([1.1, 0.1, 1.1, 1.1, 0.0, 0.0])
    assert reward.score(["3 shapes"], ["3"]).correct == [0.0]  # without choices: the last word
    assert reward.score(["there are 3"], ["3"]).correct == [1.0]


# ---- data rows with pictures ------------------------------------------------------------------------------------
def draw(colour: tuple[int, int, int], size: int = 40) -> Image.Image:
    im = Image.new("RGB", (size, size), WHITE)
    ImageDraw.Draw(im).rectangle((4, 4, size - 5, size - 5), fill=colour)
    return im


def png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def test_jsonl_rows_with_relative_paths_round_trip_and_bad_pictures_are_skipped(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    pics = [draw((200, 0, 0)), draw((0, 0, 200))]
    for i, im in enumerate(pics):
        im.save(tmp_path / "img" / f"{i}.png")
    (tmp_path / "img" / "junk.png").write_bytes(b"not a picture")
    rows = [
        {"problem": "<image>What is the area?", "images": ["img/0.png"], "answer": "12"},
        {"problem": "Compare <image> with <image>.", "images": ["img/0.png", "img/1.png"], "answer": "2"},
        {"problem": "No markers: pictures first.", "image": "img/1.png", "answer": "3"},
        {"problem": "<image>Missing file", "images": ["img/9.png"], "answer": "1"},
        {"problem": "<image>Not a picture", "images": ["img/junk.png"], "answer": "1"},
        {"problem": "<image><image>Two markers, one picture", "images": ["img/0.png"], "answer": "1"},
        {"problem": "<image>A marker without a picture", "answer": "1"},
        {"problem": "Plain text row", "answer": "4"},
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems, skipped = load_problems(data, prompt_key="problem")
    assert [len(p.images) for p in problems] == [1, 2, 1, 0]
    assert [n for n, _ in skipped] == [4, 5, 6, 7]
    reasons = dict(skipped)
    assert "does not exist" in reasons[4] and "not a readable picture" in reasons[5]
    assert (
        "2 <image> marker(s) but the row has 1" in reasons[6] and "1 <image> marker(s) but the row has 0" in reasons[7]
    )
    # Relative paths resolved against the data file's folder; the pixels round trip.
    assert digest(load_image(problems[1].images[1])) == digest(pics[1])
    assert "images" not in problems[0].metadata and "image" not in problems[2].metadata
    task = FileTask(MathReward(), path=str(data), prompt_key="problem", eval_fraction=0.0)
    assert task.skipped_rows == {str(data): 4}


def test_parquet_rows_geometry3k_style_round_trip(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pics = [draw((0, 150, 0)), draw((150, 0, 150), size=60)]
    rows = {
        "problem": ["<image>Find x.", "<image>Find the angle.", "<image>Broken."],
        "images": [
            [{"bytes": png(pics[0]), "path": "a.png"}],
            [{"bytes": png(pics[1]), "path": None}],
            [{"bytes": b"\x89PNG garbage", "path": "c.png"}],
        ],
        "answer": ["3\\sqrt{2}", "45", "1"],
    }
    path = tmp_path / "geo.parquet"
    pq.write_table(pa.table(rows), path)
    problems, skipped = load_problems(path, prompt_key="problem")
    assert [p.answer for p in problems] == ["3\\sqrt{2}", "45"] and [n for n, _ in skipped] == [3]
    assert [digest(load_image(p.images[0])) for p in problems] == [digest(im) for im in pics]


def test_datasets_folder_with_an_image_feature(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    pics = [draw((10, 20, 200)), draw((220, 200, 20))]
    ds = datasets.Dataset.from_dict(
        {
            "prompt": ["<image>Colour?", "<image>Colour?"],
            "images": [[pics[0]], [pics[1]]],
            "answer": ["blue", "yellow"],
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
    problems, skipped = load_problems(tmp_path / "ds")
    assert not skipped and [digest(load_image(p.images[0])) for p in problems] == [digest(im) for im in pics]
    # Same question, different pictures: different problems (the split keys on the pictures too).
    from roll_envs.tasks.base import split_key

    assert split_key(problems[0]) != split_key(problems[1])


def test_verl_style_rows_chat_prompt_and_nested_answer(tmp_path: Path) -> None:
    draw((1, 2, 3)).save(tmp_path / "p.png")
    row = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image>How many sides?"}],
        "images": [{"path": "p.png"}],
        "reward_model": {"ground_truth": "4", "style": "rule"},
    }
    (tmp_path / "v.jsonl").write_text(json.dumps(row) + "\n")
    (p,), skipped = load_problems(tmp_path / "v.jsonl", answer_key="reward_model.ground_truth")
    assert not skipped and p.prompt == "<image>How many sides?" and p.answer == "4"
    assert p.images == [str(tmp_path / "p.png")]


# ---- prompts for a vision-language model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vlm() -> tuple[object, object]:
    from transformers import AutoTokenizer

    from roll_core.models import resolve_model_path
    from roll_core.pipelines.rollout import vision_processor

    path = resolve_model_path("builtin:tiny-qwen2.5-vl")
    tok = AutoTokenizer.from_pretrained(path)
    return tok, vision_processor(path, tok)


def test_prompt_batch_expands_picture_tokens_and_carries_mm_inputs(vlm, tmp_path: Path) -> None:
    from roll_core.pipelines.rollout import prompt_batch

    tok, proc = vlm
    task = VisualTask(VisualReward(), train_size=4, eval_size=2, size=112)  # 112 px: 16 picture tokens
    text = Problem("t:1", "What is 2 + 2?", "4")
    draw((5, 5, 5)).save(tmp_path / "gone.png")
    gone = Problem("t:2", "<image>Gone?", "1", images=[str(tmp_path / "gone.png")])
    (tmp_path / "gone.png").unlink()  # read at load time, deleted before its prompt is built
    problems = [*task.train_set()[:3], text, gone]
    metrics: dict = {}
    batch = prompt_batch(tok, task, problems, 512, metrics, None, proc)
    assert len(batch) == 4 and metrics["data/skipped_bad_images"] == 1 and metrics["data/skipped_long_prompts"] == 0
    mm = batch["mm_inputs"]
    assert mm[3] is None and all(m.num_images == 1 and m.tokens_per_image == [16] for m in mm[:3])
    for ids, m in zip(batch["prompt_ids"], mm):
        check_tokens(ids, m, proc.image_token_id)
    ids = batch["prompt_ids"][0]
    assert ids.count(proc.image_token_id) == 16
    assert tok.decode(ids).endswith("<|vision_start|>" + "<|image_pad|>" * 16 + "<|vision_end|><|assistant|>")
    assert torch.equal(mm[0].tensors["image_grid_thw"], torch.tensor([[1, 8, 8]]))
    assert mm[0].key() == (digest(task.train_set()[0].images[0]),)
    # max_prompt_length counts the picture tokens: a limit the text fits in but not text + picture skips the row.
    n = len(ids)
    metrics = {}
    batch = prompt_batch(tok, task, [task.train_set()[0], text], n - 1, metrics, None, proc)
    assert len(batch) == 1 and batch["mm_inputs"] == [None] and metrics["data/skipped_long_prompts"] == 1


def test_a_text_model_given_pictures_is_an_error_naming_the_model_and_row(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from roll_core.models import resolve_model_path
    from roll_core.pipelines.rollout import check_pictures, encode_prompt, vision_processor

    path = resolve_model_path("builtin:tiny")
    assert vision_processor(path) is None
    task = VisualTask(VisualReward(), train_size=3, eval_size=1)
    with pytest.raises(ConfigError, match=r"problem visual:colour:1 has 1 picture\(s\) but model.path=builtin:tiny"):
        check_pictures(None, task.train_set(), "builtin:tiny")
    check_pictures(None, [Problem("t", "text", "1")], "builtin:tiny")  # text rows are fine
    with pytest.raises(ValueError, match="visual:colour:1 has 1 picture"):
        encode_prompt(AutoTokenizer.from_pretrained(path), task, task.train_set()[0], 256)


def test_worked_examples_stay_text_and_the_pictures_go_in_the_last_user_message(vlm) -> None:
    from roll_core.pipelines.rollout import encode_prompt

    tok, proc = vlm

    class WithExample(Task):
        def __init__(self) -> None:
            super().__init__(VisualReward())
            self.examples = [("Say red.", "red")]

    p = VisualTask(VisualReward(), train_size=1, eval_size=1).train_set()[0]
    ids, _, mm = encode_prompt(tok, WithExample(), p, 512, None, proc)
    text = tok.decode(ids)
    assert text.startswith("<|user|>Say red.<|assistant|>red<|user|>Picture 1")
    assert mm is not None and ids.count(proc.image_token_id) == mm.num_tokens == 4
