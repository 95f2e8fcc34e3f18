"""Agentic turns at their edges: a stop string split across a resumed turn's attempts, the two kinds of cut turns,
a `<think>` spelt by an observation, and the config-time check of a task's context against the engine's.

- A turn aborted mid-string (its first attempt ends with the stop string's start, the resumed one completes it) is
  cut where the same turn run without an abort stops, on the hf engine: identical ids, log-probs and text (no
  engine saw the string whole: the turn ran on to its budget).
- A turn cut by the per-turn token limit (`episode/cut_turn_rate`) is told from one whose budget was cut to the
  remaining context, or that the engine cut at its own context (`episode/context_cut_turn_rate`).
- An observation whose last ids spell `<think>` (an added token that keeps its id) does not make the environment
  read the next reply as unfinished reasoning: only the template's own generation header opens the block.
- `pipeline=agentic` / `agent`: the config-time warning compares the task's max_context_length with the engine's
  context, not model.max_prompt_length + max_response_length (which these pipelines do not read).
"""

from __future__ import annotations

import logging
import sys
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.env_manager import EnvManager
from roll_core.agentic.rollout import AgenticRollout, EpisodeLimits
from roll_core.interfaces import Request, RequestOutput, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))  # agentic_turn_harness, shared by the agentic turn tests
from agentic_turn_harness import RecordingEngine, ScriptedEngine, hf_infer_group, seeded_words, split_point

ENGINE_CONTEXT = 256


# ---- 1. a stop string split across a resumed turn's attempts --------------------------------------------------------
class Talk:
    """Says a few words the seed picks (the tiny model's greedy reply depends on them); never ends by itself."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return seeded_words(seed), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "more", 0.0, False, False, {}


@pytest.fixture(scope="module")
def hf_tiny() -> Any:
    yield from hf_infer_group(ENGINE_CONTEXT)


def _turn_0(request: Request, earlier: int) -> bool:
    """The first attempt of each episode's turn 0 (a weight sync's abort mid-turn)."""
    return request.request_id.endswith("-turn-0")


def _turn(infer: Any, tok: Any, seed: int, stop: tuple[str, ...], keep: int | None) -> tuple[Any, list[Request]]:
    """One greedy turn of an episode on env seed `seed` (greedy: a resumed attempt goes on as the unaborted one)."""
    engine = RecordingEngine(infer, keep, cut=_turn_0)
    rollout = AgenticRollout(engine, EnvManager(Talk, 0), TurnTemplate(tok, "Talk."), tok, EpisodeLimits(1, 200, 48))
    (traj,) = rollout.run([seed], [0], SamplingParams(max_new_tokens=48, temperature=0.0, stop=stop))
    return traj, engine.requests


def test_a_stop_string_split_across_an_abort_ends_the_turn_as_without_the_abort(hf_tiny: Any) -> None:
    infer, tok = hf_tiny
    found = None
    for seed in range(40):  # a greedy response long enough to hold a stop string in its middle
        free, _ = _turn(infer, tok, seed, (), None)
        found = split_point(tok, free.tokens)
        if found is not None:
            break
    assert found is not None, "no greedy response of the tiny model held a usable stop string"
    stop, k = found
    whole, _ = _turn(infer, tok, seed, (stop,), None)
    # without an abort the engine stops at the token completing the string (kept)
    assert whole.tokens == free.tokens[: k + 1] and whole.texts[0].endswith(stop) and whole.cut_turns == 0
    # the first attempt ends inside the string (its first token), the resumed one completes it
    split, requests = _turn(infer, tok, seed, (stop,), k - 1)
    assert split.resumed_turns == 1 and len(requests) == 2
    assert requests[1].prompt_ids == requests[0].prompt_ids + free.tokens[: k - 1]
    assert stop not in tok.decode(free.tokens[: k - 1]) and stop not in tok.decode(free.tokens[k - 1 : k + 1])
    assert split.tokens == whole.tokens and split.texts == whole.texts and split.mask == whole.mask
    assert split.logprobs == pytest.approx(whole.logprobs, abs=1e-4)
    assert split.cut_turns == 0 and split.end == whole.end == "max_turns"


def test_split_stop_reads_the_text_as_the_engines_do() -> None:
    """Unit cases of roll_core.agentic.resume_stops.split_stop on a character-level vocabulary."""
    from roll_core.agentic.resume_stops import split_stop
    from roll_core.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()

    def enc(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    prompt = enc("ask: </answer>")  # a string in the prompt never stops the response
    tokens = enc("so </ans") + enc("wer> and more </answer>")
    start = len(enc("so </ans"))
    assert split_stop(tok, prompt, tokens, start, ["</answer>"]) == len(enc("so </answer>"))
    # a string complete before the latest attempt is no new stop; one within it stops where the engine did
    assert split_stop(tok, prompt, tokens, start, ["</ans", "wer> a"]) == len(enc("so </answer> a"))
    assert split_stop(tok, prompt, tokens, start, ["so </"]) is None
    assert split_stop(tok, prompt, tokens, start, ["nope", " </answ"]) == len(enc("so </answ"))
    assert split_stop(tok, prompt, tokens, 0, ["</answer>"]) is None  # no earlier attempt: the engine matched it
    assert split_stop(tok, prompt, tokens, start, []) is None
    # a string that only the prompt and the response together spell is not one (the engines read after the prompt)
    assert split_stop(tok, enc("<"), enc("/a") + enc("nswer>"), 2, ["</answer>"]) is None


# ---- 2. turns cut by the per-turn limit and turns cut by the context ------------------------------------------------
class LengthEngine:
    """Turn k answers `wants[k]` tokens 'a', cut at the request's budget ('length'); `engine_cut[k]`: the engine cut
    it at its own context after that many tokens ('length' short of the budget)."""

    def __init__(self, tok: Any, wants: list[int], engine_cut: dict[int, int] | None = None) -> None:
        self.token = tok("a", add_special_tokens=False)["input_ids"][0]
        self.wants, self.engine_cut = wants, engine_cut or {}
        self.budgets: list[int] = []

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        turn = int(request.request_id.rsplit("-", 1)[1])
        budget = request.params.max_new_tokens
        self.budgets.append(budget)
        n = min(self.wants[turn], budget, self.engine_cut.get(turn, budget))
        finish = "length" if n == budget or turn in self.engine_cut else "stop"
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, [self.token] * n, [-0.5] * n, finish))
        return fut

    def abort(self, request_id: str) -> bool:
        return False


class Walk:
    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return "Go.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "Go on.", 0.0, False, False, {}


def _walk(limits: EpisodeLimits, engine: LengthEngine) -> Any:
    from roll_core.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    rollout = AgenticRollout(engine, EnvManager(Walk, 0), TurnTemplate(tok, "Walk."), tok, limits)
    (traj,) = rollout.run([0], [0], SamplingParams(max_new_tokens=999))
    return traj


def test_turns_cut_by_the_context_are_counted_apart_from_turns_cut_by_the_turn_limit() -> None:
    from roll_core.models import build_tiny_tokenizer
    from roll_core.pipelines.collectors.episodes import episode_metrics

    tok = build_tiny_tokenizer()
    # how long the episode is after two turns of 8 tokens: the third turn gets 5 tokens of room, fewer than 8
    probe = _walk(EpisodeLimits(2, 4096, 8), LengthEngine(tok, [9, 9]))
    assert (probe.turns, probe.cut_turns) == (2, 2)
    obs = len(TurnTemplate(tok, "Walk.").observation("Go on.", [probe.tokens[-1]]))
    context = probe.length + obs + 5
    engine = LengthEngine(tok, [9, 9, 9, 9])
    traj = _walk(EpisodeLimits(5, context, 8), engine)
    assert engine.budgets == [8, 8, 5]  # the third turn's budget is the context left
    assert (traj.turns, traj.end) == (3, "max_context")
    assert (traj.cut_turns, traj.context_cut_turns) == (2, 1)
    # a turn the engine cut at its own context, short of its budget, is a context cut too
    engine_cut = _walk(EpisodeLimits(3, 4096, 8), LengthEngine(tok, [9, 9, 9], engine_cut={1: 4}))
    assert (engine_cut.turns, engine_cut.cut_turns, engine_cut.context_cut_turns) == (3, 2, 1)
    m = episode_metrics([traj, engine_cut], None, None)
    assert m["episode/cut_turn_rate"] == pytest.approx(4 / 6)
    assert m["episode/context_cut_turn_rate"] == pytest.approx(2 / 6)


# ---- 3. an observation that spells <think> ------------------------------------------------------------------------
@pytest.mark.parametrize("header_opens_think", [False, True])
def test_an_observation_ending_with_think_does_not_open_the_reply(header_opens_think: bool) -> None:
    """Qwen3's tokens (thinking on: `<think>` is an added token that is no framing, so an observation's `<think>`
    keeps its id) and an environment whose observations end with `<think>`: the ids before each turn end with it
    and the generation header, within the tail `opens_think` read. The environment got `<think>5`, unfinished
    reasoning, for the answer 5. A header that opens the block still puts the tag back on every turn."""
    from roll_core.testing.chat_templates import QWEN3, family_tokenizer

    tok = family_tokenizer("qwen3")
    tok.add_tokens(["user", "assistant"])  # one id each, as in Qwen's vocabulary (a shorter header)
    if header_opens_think:
        header = "{{- '<|im_start|>assistant\\n' -}}{%- if enable_thinking"
        tok.chat_template = QWEN3.replace(header, header.replace("\\n'", "\\n<think>\\n'"))
        assert tok.chat_template != QWEN3
    think = tok.convert_tokens_to_ids("<think>")
    seen: list[str] = []

    class Thinker:
        def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
            return "Say a number, e.g. after <think>", {}

        def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
            seen.append(action)
            return "Again <think>", 0.0, False, False, {}

    def enc(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    end = tok.convert_tokens_to_ids("<|im_end|>")
    script = [([*enc("5"), end], "stop"), ([*enc("6"), end], "stop")]
    template = TurnTemplate(tok)
    rollout = AgenticRollout(ScriptedEngine(script), EnvManager(Thinker, 0), template, tok, EpisodeLimits(2, 4096, 8))
    (traj,) = rollout.run([0], [0], SamplingParams(max_new_tokens=8))
    assert traj.turns == 2
    # the observations' <think> kept its id, within the 16 ids before each turn
    obs_ids = template.observation("Again <think>", [*enc("5"), end])
    assert think in traj.prompt_ids[-16:] and think in obs_ids[-16:]
    assert seen == (["<think>5", "<think>6"] if header_opens_think else ["5", "6"])


def test_header_opens_think_reads_the_templates_generation_header_only() -> None:
    from roll_core.testing.chat_templates import family_tokenizer
    from roll_core.thinking import header_opens_think

    r1, qwen3 = family_tokenizer("deepseek_r1"), family_tokenizer("qwen3")
    assert not header_opens_think(qwen3)  # the model writes <think> itself
    assert not header_opens_think(qwen3, chat_template_kwargs={"enable_thinking": False})  # an empty, closed block
    assert not header_opens_think(r1)
    r1.chat_template = r1.chat_template.replace(
        "{{- '<|Assistant|>' -}}{%- endif -%}", "{{- '<|Assistant|><think>\\n' -}}{%- endif -%}"
    )
    assert header_opens_think(r1)
    history = [{"role": "user", "content": "<think>"}, {"role": "assistant", "content": "<think>"}]
    assert header_opens_think(r1, history) and not header_opens_think(qwen3, history)


# ---- 4. the config-time check of a task's context ---------------------------------------------------------------
class _Engine:
    def __init__(self, context: int) -> None:
        self.context = context

    def check_sampling(self, params: SamplingParams) -> None:
        return None

    def max_context_length(self) -> int:
        return self.context


def _cfg(pipeline: str, task_context: int | None, prompt: int = 512, response: int = 512) -> Any:
    env = SimpleNamespace(name="walk") if task_context is None else SimpleNamespace(max_context_length=task_context)
    return SimpleNamespace(
        infer_engine=SimpleNamespace(name="hf"),
        model=SimpleNamespace(max_prompt_length=prompt, max_response_length=response),
        pipeline=SimpleNamespace(name=pipeline),
        env=env,
    )


@pytest.mark.parametrize("pipeline", ["agentic", "agent"])
def test_an_agentic_tasks_context_past_the_engines_is_warned_at_config_time(
    pipeline: str, caplog: pytest.LogCaptureFixture
) -> None:
    from roll_core.pipelines.wiring import _check_infer_engine

    def warned(cfg: Any, engine: int) -> str:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="roll_core.pipelines.wiring"):
            _check_infer_engine(cfg, _Engine(engine), SamplingParams())
        return caplog.text

    # prompt + response fit the engine (1024 <= 2048); the task's 4096 does not
    text = warned(_cfg(pipeline, 4096), 2048)
    assert "env.max_context_length=4096 exceeds the hf engine's context of 2048 tokens" in text
    assert "max_prompt_length" not in text
    # prompt + response past the engine, the task within it: the pipeline reads neither length, nothing to say
    assert warned(_cfg(pipeline, 1024, prompt=2048, response=2048), 2048) == ""
    assert warned(_cfg(pipeline, 2048), 2048) == ""
    # the single-turn pipeline keeps its prompt + response warning
    assert "max_prompt_length + max_response_length = 4096" in warned(_cfg("rlvr", None, 2048, 2048), 2048)


def test_the_composed_agentic_config_is_checked_against_the_engines_context(caplog: pytest.LogCaptureFixture) -> None:
    from roll_core.config.compose import load_config
    from roll_core.pipelines.wiring import _check_infer_engine

    cfg = load_config(["pipeline=agentic", "env=sokoban", "env.max_context_length=3000"])
    with caplog.at_level(logging.WARNING, logger="roll_core.pipelines.wiring"):
        _check_infer_engine(cfg, _Engine(2500), SamplingParams())
    assert "env.max_context_length=3000 exceeds the hf engine's context of 2500 tokens" in caplog.text
