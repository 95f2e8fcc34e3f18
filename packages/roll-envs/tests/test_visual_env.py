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


def test_the_env_manager_keeps_pictures_and_fails_malformed_ones_as_env_errors() -> None:
    class Broken:
        def reset(self, seed: int | None = None) -> tuple[Any, dict[str, Any]]:
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
    with pytest.raises(EnvFailure, match="list of pictures"):
        broken.step(0, "x")
    assert broken.counters()["env_errors"] == 2
