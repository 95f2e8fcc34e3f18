"""The multi-turn rollout loop's episode limits: every way an episode ends is recorded with its reason, the context
never exceeds max_context_length, and responses cut by the per-turn token limit are counted.

The inference side is a scripted request engine (fixed response lengths, honest finish reasons) so each limit is
hit at a known turn; the real engines run the same loop in tests/e2e/test_agentic.py."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.env_manager import EnvManager
from roll_core.agentic.rollout import AgenticRollout, EpisodeLimits
from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.pipelines.collectors.episodes import episode_metrics as _episode_metrics


class Corridor:
    """Walk right `length` times to win; any other reply is invalid. Never truncates by itself."""

    def __init__(self, length: int = 100) -> None:
        self.length, self.pos = length, 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.pos = 0
        return "You are at 0.", {"state": "0"}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        valid = action.strip().startswith("a")
        self.pos += int(valid)
        done = self.pos >= self.length
        info = {"state": str(self.pos), "invalid_action": not valid, "success": done}
        return f"You are at {self.pos}.", float(done), done, False, info


class ScriptedEngine:
    """`submit_request` answers with `lengths[turn]` copies of token 'a' (cut at max_new_tokens: 'length')."""

    def __init__(self, tokenizer: Any, lengths: list[int]) -> None:
        self.token = tokenizer("a", add_special_tokens=False)["input_ids"][0]
        self.lengths, self.requests = lengths, []

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        self.requests.append(request)
        turn = int(request.request_id.rsplit("-", 1)[1])
        want = self.lengths[min(turn, len(self.lengths) - 1)]
        n = min(want, request.params.max_new_tokens)
        out = RequestOutput(
            request.request_id,
            request.prompt_ids,
            [self.token] * n,
            [-0.5] * n,
            "length" if n < want or n == request.params.max_new_tokens else "stop",
        )
        fut: Future = Future()
        fut.set_result(out)
        return fut


def _run(limits: EpisodeLimits, lengths: list[int], corridor: int = 100, episodes: int = 2):
    tok = build_tiny_tokenizer()
    engine = ScriptedEngine(tok, lengths)
    envs = EnvManager(lambda: Corridor(corridor), 0, step_timeout_s=10)
    rollout = AgenticRollout(engine, envs, TurnTemplate(tok, "Walk."), tok, limits)
    trajs = rollout.run(list(range(episodes)), [0] * episodes, SamplingParams(max_new_tokens=999))
    return trajs, engine


def test_episode_that_reaches_its_goal_terminates() -> None:
    trajs, _ = _run(EpisodeLimits(max_turns=8, max_context_length=2048, max_tokens_per_turn=16), [3], corridor=2)
    assert [(t.end, t.turns, t.success, t.reward, t.cut_turns) for t in trajs] == [("terminated", 2, True, 1.0, 0)] * 2


def test_max_turns_ends_the_episode() -> None:
    trajs, _ = _run(EpisodeLimits(max_turns=3, max_context_length=2048, max_tokens_per_turn=16), [3])
    assert [(t.end, t.turns, t.success) for t in trajs] == [("max_turns", 3, False)] * 2
    assert all(sum(t.mask) == 9 for t in trajs)  # 3 turns x 3 generated tokens, nothing else trained


@pytest.mark.parametrize("context", [60, 75, 90])
def test_max_context_ends_the_episode_and_is_never_exceeded(context: int) -> None:
    trajs, engine = _run(EpisodeLimits(max_turns=50, max_context_length=context, max_tokens_per_turn=8), [8])
    for t in trajs:
        assert t.end == "max_context" and 1 <= t.turns < 50 and t.length <= context
    # Every request asked for at most what still fits.
    assert all(len(r.prompt_ids) + r.params.max_new_tokens <= context for r in engine.requests)


def test_responses_cut_by_the_turn_limit_are_counted_and_go_to_the_environment() -> None:
    limits = EpisodeLimits(max_turns=4, max_context_length=2048, max_tokens_per_turn=5)
    trajs, engine = _run(limits, [2, 9, 3, 12])  # turns 2 and 4 want more than 5 tokens
    assert all(r.params.max_new_tokens == 5 for r in engine.requests)
    assert [(t.end, t.turns, t.cut_turns) for t in trajs] == [("max_turns", 4, 2)] * 2
    assert all(sum(t.mask) == 2 + 5 + 3 + 5 for t in trajs)
    m = _episode_metrics(trajs, None, None)
    assert m["episode/cut_turn_rate"] == pytest.approx(0.5) and m["episode/end_max_turns"] == 1.0


class Pictured:
    """Observations with one picture; the text of the first (`first`) or of the next ones (`echo`) spells the vision
    model's picture placeholder, as an environment that echoes a reply would."""

    def __init__(self, where: str, placeholder: str) -> None:
        self.where, self.placeholder = where, placeholder

    def _obs(self, spelt: bool) -> dict[str, Any]:
        from PIL import Image

        text = f"'{self.placeholder}' is not an action" if spelt else "Move."
        return {"text": text, "images": [Image.new("RGB", (28, 28), (200, 20, 20))]}

    def reset(self, seed: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        return self._obs(self.where == "first"), {}

    def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        return self._obs(self.where == "echo"), 0.5, False, False, {}


@pytest.mark.parametrize("where", ["first", "echo"])
def test_an_observation_spelling_the_picture_placeholder_fails_its_episode_not_the_rollout(where: str) -> None:
    from roll_core.models import resolve_model_path
    from roll_core.multimodal import VisionProcessor

    vp = VisionProcessor(resolve_model_path("builtin:tiny-qwen2.5-vl"))
    placeholder = vp.tokenizer.convert_ids_to_tokens(vp.image_token_id)
    envs = EnvManager(lambda: Pictured(where, placeholder), 0, step_timeout_s=10)
    template = TurnTemplate(vp.tokenizer, "Play.", vision=vp)
    rollout = AgenticRollout(ScriptedEngine(vp.tokenizer, [2]), envs, template, vp.tokenizer, EpisodeLimits(3, 4096, 8))
    trajs = rollout.run([0, 1], [0, 0], SamplingParams(max_new_tokens=8))
    assert [t.end for t in trajs] == ["env_error"] * 2
    assert all("could not be encoded" in t.error for t in trajs)
    assert envs.counters()["env_errors"] == 2
    # the first observation: nothing to train on; an echoed one: the turn before it keeps its reward
    assert [t.turns for t in trajs] == ([0, 0] if where == "first" else [1, 1])
