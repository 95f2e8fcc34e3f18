"""The multi-turn rollout loop's episode limits: every way an episode ends is recorded with its reason, the context
never exceeds max_context_length, responses cut by the per-turn token limit are counted, and a trajectory ends with
its last response. Training on episodes refuses structured outputs (the trainer could not replay them per turn).

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


def _run(limits: EpisodeLimits, lengths: list[int], corridor: int = 100, episodes: int = 2, **sampling: Any):
    tok = build_tiny_tokenizer()
    engine = ScriptedEngine(tok, lengths)
    envs = EnvManager(lambda: Corridor(corridor), 0, step_timeout_s=10)
    rollout = AgenticRollout(engine, envs, TurnTemplate(tok, "Walk."), tok, limits)
    trajs = rollout.run(list(range(episodes)), [0] * episodes, SamplingParams(max_new_tokens=999, **sampling))
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


def test_the_last_allowed_turn_ends_the_trajectory_with_its_response() -> None:
    """No turn reads the observation after the last allowed one: it is not appended (it lengthened every training
    sequence), so an episode whose turns all fit ends `max_turns` where that observation would not have fit."""
    limits = EpisodeLimits(max_turns=2, max_context_length=2048, max_tokens_per_turn=4)
    (full, _), _ = _run(limits, [3])
    assert (full.end, full.turns, full.mask[-3:], full.turn_ids[-1]) == ("max_turns", 2, [1, 1, 1], 1)
    tight = EpisodeLimits(max_turns=2, max_context_length=full.length + 1, max_tokens_per_turn=4)
    trajs, _ = _run(tight, [3])
    assert [(t.end, t.turns, t.tokens, t.cut_turns) for t in trajs] == [("max_turns", 2, full.tokens, 0)] * 2


def test_an_observation_no_turn_reads_cannot_fail_the_episode() -> None:
    """A last observation the template cannot encode (pictures for a text model) is not encoded: the episode keeps
    its end (`max_turns`, not a counted env_error whose last reward on_failure would replace) and its rewards."""

    class LastWithPicture(Corridor):
        def step(self, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
            from PIL import Image

            obs, _, done, truncated, info = super().step(action)
            return {"text": obs, "images": [Image.new("RGB", (8, 8))]}, 0.25, done, truncated, info

    tok = build_tiny_tokenizer()
    envs = EnvManager(LastWithPicture, 0, step_timeout_s=10)
    rollout = AgenticRollout(ScriptedEngine(tok, [2]), envs, TurnTemplate(tok), tok, EpisodeLimits(1, 2048, 4))
    trajs = rollout.run([0, 1], [0, 0], SamplingParams(max_new_tokens=4))
    assert [(t.end, t.turn_rewards, t.error) for t in trajs] == [("max_turns", [0.25], "")] * 2
    assert envs.counters()["env_errors"] == 0


def test_structured_outputs_are_refused_for_training_on_episodes() -> None:
    """Every turn is sampled under infer_engine.structured, but the trajectory batch cannot carry the constraint for
    the trainer to replay (its responses interleave turns and observations): a training run's collector refuses it;
    roll-eval's (no train group) samples under it."""
    from types import SimpleNamespace

    from roll_core.agentic.trajectory import to_tensors
    from roll_core.errors import ConfigError
    from roll_core.interfaces.inference import STRUCTURED_KEY
    from roll_core.pipelines.collectors.episodes import EpisodeCollector

    trajs, engine = _run(EpisodeLimits(2, 2048, 4), [3], episodes=1, structured={"regex": "a+"})
    assert all(r.params.structured is not None for r in engine.requests)  # what the engine's log-probs are of
    assert STRUCTURED_KEY not in to_tensors(trajs, 0)  # what the trainer would replay: nothing

    class Task:
        name, max_turns, max_context_length, max_tokens_per_turn = "walk", 2, 2048, 4
        step_timeout_s, env_threads, num_workers = 10.0, 1, 0
        make_env, system_prompt, examples = Corridor, lambda self: None, lambda self: []
        train_seeds, eval_seeds = lambda self, count, seed: list(range(count)), lambda self: [0]

    def ctx(structured: dict, train: object) -> SimpleNamespace:
        algo = SimpleNamespace(drop_uniform_groups=False, reward_clip=None, overlong_buffer=0)
        cfg = SimpleNamespace(
            algo=algo,
            pipeline=SimpleNamespace(name="agentic"),
            infer_engine=SimpleNamespace(structured=structured),
            model=SimpleNamespace(chat_template_kwargs={}),
        )
        sampling = SamplingParams(structured=structured or None)
        tok = build_tiny_tokenizer()
        return SimpleNamespace(
            cfg=cfg, task=Task(), tokenizer=tok, sampling=sampling, infer=None, model_path="", train=train
        )

    EpisodeCollector(ctx({}, train=object())).close()
    EpisodeCollector(ctx({"regex": "a+"}, train=None)).close()  # roll-eval
    with pytest.raises(ConfigError, match=r"infer_engine\.structured=.*cannot replay a per-turn constraint"):
        EpisodeCollector(ctx({"regex": "a+"}, train=object()))


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
