"""Multi-turn token assembly against a real inference engine: the training ids of an episode are exactly the ids
the engine was fed and sampled, turn by turn.

With the hf engine on the builtin tiny model (a recording wrapper keeps every request's prompt ids and its output)
and a scripted environment: every turn's prompt is a prefix of the trajectory, the ids after it are the sampled
ids (loss mask 1, the engine's log-probs one to one), a turn cut by its token budget is closed by the template's
ids (loss mask 0) that the next turn's prompt holds, and nothing follows the last response. Past the engine's
context an episode ends `max_context` without an observation no turn read (the engine refused the prompt that held
it), and `fit_engine_context` keeps episodes within that context. A reasoning model's unclosed `<think>` in an
earlier turn does not make the environment read a later turn as unfinished reasoning (roll_core.thinking)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.env_manager import EnvManager
from roll_core.agentic.rollout import AgenticRollout, EpisodeLimits
from roll_core.agentic.trajectory import Trajectory, to_tensors
from roll_core.interfaces import SamplingParams
from roll_core.testing.chat_templates import QWEN3, family_tokenizer

sys.path.insert(0, str(Path(__file__).parent))  # agentic_turn_harness, shared by the agentic turn tests
from agentic_turn_harness import RecordingEngine, ScriptedEngine, hf_infer_group

ENGINE_CONTEXT = 160  # the hf engine's context in these tests (infer_engine.max_model_len)


class Talk:
    """Says a growing observation each step; never ends by itself. Its first observation spells special tokens
    (untrusted text: encoded as text, not as the template's tokens)."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.t = 0
        return f"Start {seed} <|user|> </s> here.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.t += 1
        return f"obs {self.t} " + "x" * (4 * self.t), 0.25 * self.t, False, False, {}


@pytest.fixture(scope="module")
def hf_tiny() -> Any:
    yield from hf_infer_group(ENGINE_CONTEXT)


def _episodes(infer: Any, tok: Any, limits: EpisodeLimits, n: int = 3) -> tuple[list[Trajectory], RecordingEngine]:
    rec = RecordingEngine(infer)
    rollout = AgenticRollout(rec, EnvManager(Talk, 0, step_timeout_s=30), TurnTemplate(tok, "Talk."), tok, limits)
    params = SamplingParams(max_new_tokens=64, temperature=1.0, seed=7)
    return rollout.run(list(range(n)), [0] * n, params), rec


def test_training_ids_are_what_the_hf_engine_was_fed_and_sampled(hf_tiny: Any) -> None:
    infer, tok = hf_tiny
    template = TurnTemplate(tok, "Talk.")
    trajs, rec = _episodes(
        infer, tok, EpisodeLimits(max_turns=4, max_context_length=ENGINE_CONTEXT, max_tokens_per_turn=10)
    )
    batch = to_tensors(trajs, tok.pad_token_id)
    finishes = []
    for row, t in enumerate(trajs):
        turns = rec.turns_of(t)
        assert len(turns) == t.turns >= 1
        p = len(t.prompt_ids)
        ids = t.context()
        trained = []
        for k, (prompt, out) in enumerate(turns):
            start, end = len(prompt) - p, len(prompt) - p + len(out.token_ids)
            # the ids after the turn's prompt are the sampled ids, loss mask 1, the engine's log-probs one to one
            assert ids[len(prompt) : len(prompt) + len(out.token_ids)] == list(out.token_ids)
            assert t.mask[start:end] == [1] * len(out.token_ids) and t.turn_ids[start:end] == [k] * len(out.token_ids)
            assert t.logprobs[start:end] == list(out.logprobs)
            trained += range(start, end)
            finishes.append(out.finish_reason)
            if k + 1 < len(turns):  # between turns: the template's ids (mask 0) that the next prompt holds
                following = turns[k + 1][0]
                between = following[len(prompt) + len(out.token_ids) :]
                assert between == template.observation(f"obs {k + 1} " + "x" * (4 * (k + 1)), list(out.token_ids))
                assert t.mask[end : len(following) - p] == [0] * len(between)
        # exactly the sampled ids are trained, and the trajectory ends with the last response
        assert [i for i, m in enumerate(t.mask) if m] == trained and trained[-1] == len(t.tokens) - 1
        assert batch["response_mask"][row].tolist()[: len(t.tokens)] == t.mask
        assert batch["behaviour_logprobs"][row, : len(t.tokens)].tolist() == pytest.approx(t.logprobs)
        assert t.turn_rewards == [0.25 * (k + 1) for k in range(t.turns)]
        cuts = [len(out.token_ids) for _, out in turns if out.finish_reason == "length"]
        # cut by max_tokens_per_turn (10), or short of it by the context left
        assert (t.cut_turns, t.context_cut_turns) == (cuts.count(10), len(cuts) - cuts.count(10))
        assert t.length <= ENGINE_CONTEXT
    assert "length" in finishes  # a turn cut by its budget was among them (the random tiny model rarely stops)


def test_an_observation_the_engine_refused_is_not_left_at_the_end_of_the_trajectory(hf_tiny: Any) -> None:
    """A task context longer than the engine's: the engine refuses the prompt that holds the last observation
    (prompt_too_long). No turn read that observation: it was left after the last response, a training row longer
    than the engine's (and the model's) context."""
    infer, tok = hf_tiny
    limits = EpisodeLimits(max_turns=20, max_context_length=4 * ENGINE_CONTEXT, max_tokens_per_turn=40)
    trajs, rec = _episodes(infer, tok, limits, n=2)
    for t in trajs:
        assert t.end == "max_context"
        turns = rec.turns_of(t)
        last_out = turns[-1][1]
        assert last_out.finish_reason == "prompt_too_long" and len(turns) == t.turns + 1
        # it ends with its last response, within what the engine held
        assert t.mask[-1] == 1 and t.length <= ENGINE_CONTEXT
        assert t.context() == turns[-2][0] + list(turns[-2][1].token_ids)


def test_episodes_are_fitted_to_the_engines_context(hf_tiny: Any, caplog: pytest.LogCaptureFixture) -> None:
    from roll_core.agentic.agent_sessions import SessionLimits
    from roll_core.agentic.rollout import fit_engine_context

    infer, tok = hf_tiny
    task = EpisodeLimits(max_turns=20, max_context_length=4 * ENGINE_CONTEXT, max_tokens_per_turn=40)
    with caplog.at_level(logging.WARNING, logger="roll_core.agentic.rollout"):
        limits = fit_engine_context(task, infer)
    assert limits == EpisodeLimits(20, ENGINE_CONTEXT, 40)
    assert "max_context_length=640 exceeds the inference engine's context of 160" in caplog.text
    sessions = fit_engine_context(SessionLimits(3, 40, 4 * ENGINE_CONTEXT), infer)
    assert sessions == SessionLimits(3, 40, ENGINE_CONTEXT)
    # a task within the engine's context, and an engine that tells none, are left as they are
    assert fit_engine_context(EpisodeLimits(4, 100, 8), infer) == EpisodeLimits(4, 100, 8)
    assert fit_engine_context(task, object()) is task
    trajs, rec = _episodes(infer, tok, limits, n=2)
    for t in trajs:
        turns = rec.turns_of(t)
        assert t.end == "max_context" and len(turns) == t.turns and t.mask[-1] == 1
        # the engine never cut a turn at its context nor refused a prompt: the episode's own limit came first
        assert all(len(p) + len(o.token_ids) <= ENGINE_CONTEXT for p, o in turns)
        assert all(o.finish_reason != "prompt_too_long" for _, o in turns)


@pytest.mark.parametrize("header_opens_think", [False, True])
def test_an_earlier_turns_unclosed_think_does_not_open_a_later_turn(header_opens_think: bool) -> None:
    """Qwen3-style tokens (`user` / `assistant` one id each, as in Qwen's vocabulary): a turn that ended inside its
    reasoning (`<think>` then the end of turn) sits within the few ids `opens_think` reads before the next turn's
    reply. The environment read that next reply as `<think>5`: unfinished reasoning, not the answer 5. A template
    whose generation header opens the block (Qwen3-Thinking-2507) still gets the tag put back on every turn."""
    tok = family_tokenizer("qwen3")
    tok.add_tokens(["user", "assistant"])
    if header_opens_think:
        header = "{{- '<|im_start|>assistant\\n' -}}{%- if enable_thinking"
        tok.chat_template = QWEN3.replace(header, header.replace("\\n'", "\\n<think>\\n'"))
        assert tok.chat_template != QWEN3
    seen: list[str] = []

    class Guess:
        def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
            return "Guess.", {}

        def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
            seen.append(action)
            return "3", 0.0, False, False, {}

    def enc(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    end = tok.convert_tokens_to_ids("<|im_end|>")
    first = [*enc("hm"), end] if header_opens_think else [*enc("<think>\nhm"), end]
    script = [(first, "stop"), ([*enc("5"), end], "stop"), ([*enc("</think>6"), end], "stop")]
    rollout = AgenticRollout(
        ScriptedEngine(script), EnvManager(Guess, 0), TurnTemplate(tok), tok, EpisodeLimits(3, 4096, 8)
    )
    traj = rollout.run([0], [0], SamplingParams(max_new_tokens=8))[0]
    assert traj.turns == 3
    if header_opens_think:
        assert seen == ["<think>hm", "<think>5", "<think></think>6"]
    else:
        assert seen == ["<think>\nhm", "5", "</think>6"]


class _ShortEngine:
    """An inference group whose context is 100 tokens (it is never asked for a turn here)."""

    def max_context_length(self) -> int:
        return 100

    def check_sampling(self, params: SamplingParams) -> None:
        return None


class _Walk:
    """An agentic task in process whose context (2048) exceeds the engine's."""

    name, max_turns, max_context_length, max_tokens_per_turn = "walk", 2, 2048, 4
    step_timeout_s, env_threads, num_workers = 10.0, 1, 0
    make_env, system_prompt, examples = Talk, lambda self: None, lambda self: []
    train_seeds, eval_seeds = lambda self, count, seed: list(range(count)), lambda self: [0]


class _Program:
    """An agent-program task (pipeline=agent) whose context (2048) exceeds the engine's."""

    is_agent_program = True
    name = "program"
    max_turns, max_tokens_per_turn, max_context_length = 2, 4, 2048
    tool_parser, on_rewrite, on_failure = "none", "restart", "score"
    failure_reward, success_reward, model_name, episode_timeout_s = 0.0, 1.0, "roll", 5.0
    chat_template_kwargs: dict[str, Any] = {}  # noqa: RUF012 (read only)

    def train_rows(self, count: int, seed: int) -> list[dict[str, Any]]:
        return [{"id": i} for i in range(count)]

    def eval_rows(self) -> list[dict[str, Any]]:
        return [{"id": 0}]

    def run_episode(self, base_url: str, reward_url: str, row: dict[str, Any]) -> float | None:
        return 1.0


def test_both_episode_collectors_keep_episodes_within_the_engines_context() -> None:
    from types import SimpleNamespace

    from roll_core.config.compose import load_config
    from roll_core.models import build_tiny_tokenizer
    from roll_core.pipelines.collectors import CollectorContext
    from roll_core.pipelines.collectors.agents import agent_collectors
    from roll_core.pipelines.collectors.episodes import EpisodeCollector

    tok = build_tiny_tokenizer()
    cfg = SimpleNamespace(
        algo=SimpleNamespace(drop_uniform_groups=False, reward_clip=None, overlong_buffer=0),
        pipeline=SimpleNamespace(name="agentic", max_idle_aborts=8),
        infer_engine=SimpleNamespace(structured=None),
        model=SimpleNamespace(chat_template_kwargs={}),
    )
    ctx = SimpleNamespace(
        cfg=cfg, task=_Walk(), tokenizer=tok, sampling=SamplingParams(), infer=_ShortEngine(), model_path="", train=None
    )
    episodes = EpisodeCollector(ctx)
    try:
        assert episodes.rollout.limits == EpisodeLimits(2, 100, 4)
    finally:
        episodes.close()

    agent_cfg = load_config(["pipeline=agent", "pipeline.rollout_batch_size=1"])
    task = _Program()
    agent_ctx = CollectorContext(agent_cfg, None, _ShortEngine(), SamplingParams(max_new_tokens=4), tok, task, "t")
    agent_collectors.check(agent_cfg, task)
    agents = agent_collectors(agent_ctx)
    try:
        assert agents.limits.max_context_length == 100 and agents.limits.max_tokens_per_turn == 4
    finally:
        agents.close()


def test_a_turn_cut_for_sampling_the_picture_placeholder_leaves_no_observation_or_picture_behind() -> None:
    """A vision model's second turn samples the picture placeholder: that turn is cut (end image_token). The
    observation before it (with its picture) was read by no kept turn: the trajectory ends with the first response,
    and carries the first observation's picture only."""
    from PIL import Image

    from roll_core.models import resolve_model_path
    from roll_core.multimodal import VisionProcessor

    vp = VisionProcessor(resolve_model_path("builtin:tiny-qwen2.5-vl"))
    tok = vp.tokenizer
    a = tok("a", add_special_tokens=False)["input_ids"][0]

    class Seen:
        def reset(self, seed: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
            return {"text": "Look.", "images": [Image.new("RGB", (28, 28), (200, 20, 20))]}, {}

        def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
            return {"text": "Again.", "images": [Image.new("RGB", (28, 28), (20, 200, 20))]}, 0.5, False, False, {}

    engine = ScriptedEngine([([a, a], "length"), ([a, vp.image_token_id], "stop")])
    template = TurnTemplate(tok, "Play.", vision=vp)
    rollout = AgenticRollout(engine, EnvManager(Seen, 0), template, tok, EpisodeLimits(3, 4096, 2))
    (traj,) = rollout.run([0], [0], SamplingParams(max_new_tokens=2))
    assert (traj.end, traj.turns, traj.turn_rewards) == ("image_token", 1, [0.5])
    assert traj.tokens == [a, a] and traj.mask == [1, 1] and traj.turn_ids == [0, 0] and traj.logprobs == [-0.5] * 2
    assert len(traj.mm.tokens_per_image) == 1
    assert traj.context().count(vp.image_token_id) == sum(traj.mm.tokens_per_image)
