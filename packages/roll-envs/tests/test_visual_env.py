"""The visual FrozenLake (roll_envs.agentic.visual): the Env conformance suite with picture observations, pictures
that are a function of the state (same state, same pixels; different states, different pixels), a map that is in
the picture and never in the text, and the env manager's normal form for picture observations."""

from __future__ import annotations

from typing import Any

import pytest

from roll_core.agentic.env_manager import EnvFailure, EnvManager
from roll_core.multimodal import digest
from roll_core.testing.envs import EnvTestSuite
from roll_envs.agentic import make_env
from roll_envs.agentic.frozen_lake import shortest_path
from roll_envs.agentic.visual import COLOURS, VisualFrozenLakeEnv


class TestVisualFrozenLake(EnvTestSuite):
    @classmethod
    def build_env(cls) -> VisualFrozenLakeEnv:
        return VisualFrozenLakeEnv()

    @classmethod
    def solving_actions(cls, env: Any, seed: int) -> list[str]:
        return [f"\\boxed{{{m}}}" for m in shortest_path(env.size, env.holes)]

    @classmethod
    def illegal_actions(cls, env: Any, seed: int) -> list[str]:
        return ["\\boxed{up}", "\\boxed{left}"]  # off the lake from the top-left start


def test_the_picture_is_a_function_of_the_state() -> None:
    env = make_env("visual_frozen_lake")
    assert isinstance(env, VisualFrozenLakeEnv)
    seen: dict[str, str] = {}  # state key -> picture digest
    for seed in range(6):
        obs, info = env.reset(seed=seed)
        trail = [(obs, info)]
        for move in shortest_path(env.size, env.holes) or []:
            obs, _, _, _, info = env.step(f"\\boxed{{{move}}}")
            trail.append((obs, info))
        obs, _, _, _, info = env.step("\\boxed{up}")  # a finished episode: same state, same picture again
        trail.append((obs, info))
        for o, i in trail:
            (pic,) = o["images"]
            assert pic.mode == "RGB" and pic.size == (112, 112)
            d = digest(pic)
            assert seen.setdefault(i["state"], d) == d, f"state {i['state']!r} drawn two ways"
    assert len(set(seen.values())) == len(seen) > 20  # different states, different pictures


def test_the_map_is_in_the_picture_and_not_in_the_text() -> None:
    env = VisualFrozenLakeEnv(cell_px=10)
    obs, info = env.reset(seed=3)
    text, (pic,) = obs["text"], obs["images"]
    assert text.count("<image>") == 1 and "H" not in text.replace("<image>", "")  # no map rows in the text
    assert pic.size == (40, 40)
    rows = info["state"].split("\n")
    for r, row in enumerate(rows):  # the centre pixel of each cell is its kind's colour
        for c, kind in enumerate(row):
            want = COLOURS["P" if kind == "P" else kind if kind in "HG" else "S" if (r, c) == (0, 0) else "F"]
            assert pic.getpixel((c * 10 + 5, r * 10 + 5)) == want, (r, c, kind)
    assert "picture" in env.instructions() and "dark blue" in env.instructions()
    for reply in ("<image>", "<image><image> up"):  # quoted back in the invalid-action message, defused
        obs, *_ = env.step(reply)
        assert obs["text"].count("<image>") == 1 and obs["text"].endswith("The lake: <image>"), obs["text"]


def test_the_env_manager_keeps_pictures_and_fails_malformed_ones_as_env_errors() -> None:
    class Broken:
        def reset(self, seed: int | None = None) -> tuple[Any, dict[str, Any]]:
            if seed == 1:
                return "a text observation", {}
            return {"text": "look", "images": ["/no/such/picture.png"]}, {}

        def step(self, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
            return {"text": "x", "images": "not a list"}, 0.0, False, False, {}

    manager = EnvManager(VisualFrozenLakeEnv, 1)
    obs, info = manager.reset(0, 5)
    assert obs["text"] == "The lake: <image>" and len(obs["images"]) == 1 and info["seed"] == 5
    obs, *_ = manager.step(0, "\\boxed{down}")
    assert isinstance(obs, dict) and obs["images"][0].size == (112, 112)
    broken = EnvManager(Broken, 1)
    with pytest.raises(EnvFailure, match="does not exist"):
        broken.reset(0, 0)
    assert broken.reset(0, 1)[0] == "a text observation"  # a failed slot gets a new environment at its reset
    with pytest.raises(EnvFailure, match="list of pictures"):
        broken.step(0, "x")
    assert broken.counters()["env_errors"] == 2


# ---- observations with pictures through the turn template and the trajectory -----------------------------------
@pytest.fixture(scope="module")
def vision() -> Any:
    from roll_core.models import resolve_model_path
    from roll_core.multimodal import VisionProcessor

    return VisionProcessor(resolve_model_path("builtin:tiny-qwen2.5-vl"))


def _blocks(ids: list[int], tok: Any) -> list[int]:
    """Placeholder run lengths between each <|vision_start|> and <|vision_end|> (asserting nothing else is there)."""
    start, end, pad = (tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"))
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == start:
            j = ids.index(end, i)
            assert set(ids[i + 1 : j]) == {pad}, "a picture block holds only placeholders"
            runs.append(j - i - 1)
            i = j
        else:
            assert ids[i] != pad, "a placeholder outside a picture block"
        i += 1
    return runs


def test_a_three_turn_conversation_holds_each_picture_once_in_order(vision: Any) -> None:
    """initial_turn + two observation turns: every picture is one expanded placeholder block in the context, in
    observation order; the trajectory's MMInputs merge the turns' pictures in that order; to_tensors hands the
    trainer one MMInputs per row (no PIL pictures) whose feature count matches the row's placeholders."""
    from roll_core.agentic.chat import TurnTemplate
    from roll_core.agentic.trajectory import Trajectory, to_tensors
    from roll_core.multimodal import check_tokens, merge

    tok = vision.tokenizer
    template = TurnTemplate(tok, "Walk to the goal.", vision=vision)
    trajs = []
    for seed, cell in ((1, 28), (2, 14)):  # 16 and 4 picture tokens per picture
        env = VisualFrozenLakeEnv(cell_px=cell)
        obs, _ = env.reset(seed=seed)
        digests = [digest(obs["images"][0])]
        ids, mm = template.initial_turn(obs)
        traj = Trajectory(env_seed=seed, group=0, prompt_ids=ids, mm=mm)
        for move in (shortest_path(env.size, env.holes) or [])[:2]:  # two safe moves: three states
            reply = tok(f"\\boxed{{{move}}}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            traj.add_response(reply, [-0.5] * len(reply))
            traj.turn_rewards.append(0.0)
            obs, *_ = env.step(f"\\boxed{{{move}}}")
            digests.append(digest(obs["images"][0]))
            obs_ids, obs_mm = template.observation_turn(obs, reply)
            assert obs_mm.num_images == 1 and _blocks(obs_ids, tok) == obs_mm.tokens_per_image
            traj.add_observation(obs_ids, obs_mm)
        per_picture = (cell * 4 // 28) ** 2
        assert _blocks(traj.context(), tok) == [per_picture] * 3
        assert traj.mm.digests == digests and len(set(digests)) == 3
        assert traj.mm.tokens_per_image == [per_picture] * 3
        check_tokens(traj.context(), traj.mm, vision.image_token_id)
        assert traj.length == len(traj.context())  # the context limits count picture tokens
        trajs.append(traj)
    batch = to_tensors(trajs, tok.pad_token_id)
    rows = batch["mm_inputs"]
    assert [m.digests for m in rows] == [t.mm.digests for t in trajs] and all(m.images is None for m in rows)
    for i, m in enumerate(rows):
        check_tokens(batch["input_ids"][i][batch["attention_mask"][i].bool()], m, vision.image_token_id)
    both = merge(rows)  # the forward of the batch: rows' pictures in row order
    assert both.tensors["image_grid_thw"].shape == (6, 3)
    assert both.tensors["pixel_values"].shape[0] == int(both.tensors["image_grid_thw"].prod(-1).sum())


def test_pictures_need_a_vision_model_and_placeholders_typed_in_text_are_text(vision: Any) -> None:
    from transformers import AutoTokenizer

    from roll_core.agentic.chat import TurnTemplate
    from roll_core.models import resolve_model_path

    obs, _ = VisualFrozenLakeEnv().reset(seed=0)
    text_model = TurnTemplate(AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny")))
    with pytest.raises(ValueError, match="not a vision-language model"):
        text_model.initial_turn(obs)
    assert text_model.initial_turn("a text observation")[1] is None  # text stays text
    template = TurnTemplate(vision.tokenizer, vision=vision)
    # observations are untrusted text (roll_core.agentic.turn_text), the first as a later one: a typed placeholder
    # is text, not a picture's; the pictures' placeholders are the template's, checked against the pictures
    first, mm = template.initial_turn({"text": "look <|image_pad|>", "images": obs["images"]})
    assert first.count(vision.image_token_id) == sum(mm.tokens_per_image)
    assert "look <|image_pad|>" in vision.tokenizer.decode(first)
    typed, _ = template.observation_turn("a typed <|image_pad|>", [vision.tokenizer.eos_token_id])
    assert vision.image_token_id not in typed and "a typed <|image_pad|>" in vision.tokenizer.decode(typed)
    ids, mm = template.initial_turn("no picture yet")
    assert mm is None and vision.image_token_id not in ids


def test_demonstrations_with_pictures_are_refused() -> None:
    from roll_envs.agentic.task import AgenticTask

    with pytest.raises(ValueError, match="hold pictures"):
        AgenticTask("visual_frozen_lake", demonstrations=1)
