"""The multi-turn rollout loop's episode limits: every way an episode ends is recorded with its reason, the context
never exceeds max_context_length, responses cut by the per-turn token limit are counted, and a trajectory ends with
its last response. Training on episodes refuses structured outputs (the trainer could not replay them per turn).

The inference side is a scripted request engine (fixed response lengths, honest finish reasons) so each limit is
hit at a known turn; the real engines run the same loop in tests/e2e/test_agentic.py."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import pytest
import torch

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


class WalkTask:
    """An agentic task of `Corridor` walks, in process: what the episodes collector is built around."""

    name, max_turns, max_context_length, max_tokens_per_turn = "walk", 2, 2048, 4
    step_timeout_s, env_threads, num_workers = 10.0, 1, 0
    make_env, system_prompt, examples = Corridor, lambda self: None, lambda self: []
    train_seeds, eval_seeds = lambda self, count, seed: list(range(count)), lambda self: [0]


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

    def ctx(structured: dict, train: object) -> SimpleNamespace:
        algo = SimpleNamespace(drop_uniform_groups=False, reward_clip=None, overlong_buffer=0)
        cfg = SimpleNamespace(
            algo=algo,
            pipeline=SimpleNamespace(name="agentic", max_idle_aborts=8),
            infer_engine=SimpleNamespace(structured=structured),
            model=SimpleNamespace(chat_template_kwargs={}),
        )
        sampling = SamplingParams(structured=structured or None)
        tok = build_tiny_tokenizer()
        return SimpleNamespace(
            cfg=cfg, task=WalkTask(), tokenizer=tok, sampling=sampling, infer=None, model_path="", train=train
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


def test_an_observation_the_template_cannot_encode_fails_its_episode_not_the_rollout() -> None:
    """Pictures for a text model: the first observation cannot be encoded, so the episode ends as an env_error
    (counted, nothing to train on) and the rollout goes on."""
    tok = build_tiny_tokenizer()
    envs = EnvManager(lambda: Pictured("first", "<image>"), 0, step_timeout_s=10)
    rollout = AgenticRollout(ScriptedEngine(tok, [2]), envs, TurnTemplate(tok, "Play."), tok, EpisodeLimits(3, 4096, 8))
    trajs = rollout.run([0, 1], [0, 0], SamplingParams(max_new_tokens=8))
    assert [t.end for t in trajs] == ["env_error"] * 2
    assert all("could not be encoded" in t.error and "not a vision-language model" in t.error for t in trajs)
    assert envs.counters()["env_errors"] == 2
    assert [t.turns for t in trajs] == [0, 0]


@pytest.mark.parametrize("where", ["first", "echo"])
def test_an_observation_spelling_the_picture_placeholder_is_text(where: str) -> None:
    """Observations are untrusted text (roll_core.agentic.turn_text), the first (reset's) as a later one: an
    environment that spells the placeholder gets its text ids, not a picture placeholder, so the episode goes on
    (it ended as an env_error) and every placeholder id in the context belongs to a picture."""
    from roll_core.models import resolve_model_path
    from roll_core.multimodal import VisionProcessor

    vp = VisionProcessor(resolve_model_path("builtin:tiny-qwen2.5-vl"))
    placeholder = vp.tokenizer.convert_ids_to_tokens(vp.image_token_id)
    envs = EnvManager(lambda: Pictured(where, placeholder), 0, step_timeout_s=10)
    template = TurnTemplate(vp.tokenizer, "Play.", vision=vp)
    rollout = AgenticRollout(ScriptedEngine(vp.tokenizer, [2]), envs, template, vp.tokenizer, EpisodeLimits(3, 4096, 8))
    trajs = rollout.run([0, 1], [0, 0], SamplingParams(max_new_tokens=8))
    assert [t.end for t in trajs] == ["max_turns"] * 2 and envs.counters()["env_errors"] == 0
    for t in trajs:
        assert t.context().count(vp.image_token_id) == sum(t.mm.tokens_per_image) and len(t.mm.tokens_per_image) == 3
        assert f"'{placeholder}' is not an action" in vp.tokenizer.decode(t.context())


class AbortingEngine:
    """Turn `turn` of every episode: the engine aborts its first `aborts` requests on its own after `partial` tokens
    each (preemption; a refusal when `partial` is 0); every other request gets `length` tokens 'a' ('stop', or
    'length' when cut at max_new_tokens)."""

    def __init__(self, tokenizer: Any, *, turn: int, aborts: int, partial: int, length: int = 3) -> None:
        self.token = tokenizer("a", add_special_tokens=False)["input_ids"][0]
        self.turn, self.aborts, self.partial, self.length = turn, aborts, partial, length
        self.requests: list[Request] = []

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        self.requests.append(request)
        turn, _, attempt = request.request_id.split("-turn-")[1].partition("-")
        budget = request.params.max_new_tokens
        if int(turn) == self.turn and int(attempt or 0) < self.aborts:
            n, finish = min(self.partial, budget), "abort"
        else:
            n = min(self.length, budget)
            finish = "length" if n == budget else "stop"
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, [self.token] * n, [-0.5] * n, finish))
        return fut

    def abort(self, request_id: str) -> bool:
        return False


def _run_aborting(engine_kwargs: dict[str, Any], limits: EpisodeLimits, gate: Any = None):
    tok = build_tiny_tokenizer()
    engine = AbortingEngine(tok, **engine_kwargs)
    envs = EnvManager(lambda: Corridor(100), 0, step_timeout_s=10)
    rollout = AgenticRollout(engine, envs, TurnTemplate(tok, "Walk."), tok, limits, gate)
    (traj,) = rollout.run([0], [0], SamplingParams(max_new_tokens=999, seed=1))
    return traj, engine


def test_a_turn_the_engine_preempts_is_resumed_not_scored_as_a_failure() -> None:
    """An abort the engine makes on its own (no gate: a synchronous run) used to end the episode `abort` with the
    partial turn trained at reward 0; it is resumed from its partial output within the turn's budget."""
    traj, engine = _run_aborting(dict(turn=1, aborts=2, partial=2), EpisodeLimits(3, 2048, 16))
    assert (traj.end, traj.turns, traj.untrained, traj.resumed_turns) == ("max_turns", 3, False, 2)
    assert traj.turn_ids.count(1) == 2 + 2 + 3  # both partial outputs kept, then the rest of the turn
    turn1 = [r for r in engine.requests if "-turn-1" in r.request_id]
    assert [r.params.max_new_tokens for r in turn1] == [16, 14, 12]  # one budget for the whole turn
    assert turn1[2].prompt_ids == turn1[0].prompt_ids + [engine.token] * 4  # resumed after its partial output
    assert len({r.params.seed for r in turn1}) == 3


@pytest.fixture
def fast_idle_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal's tries without the waits between them (roll_core.idle_aborts; ~3.5 s each otherwise)."""
    from roll_core import idle_aborts

    monkeypatch.setattr(idle_aborts, "IDLE_BACKOFF_S", 0.0)


class PausedEngine(AbortingEngine):
    """Aborts every request without a token until `pause_s` after the first one (an engine paused for a weight sync,
    or preempting until KV-cache blocks free up), then answers."""

    def __init__(self, tokenizer: Any, pause_s: float) -> None:
        super().__init__(tokenizer, turn=-1, aborts=0, partial=0)
        self.pause_s, self.start = pause_s, None

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        self.start = self.start or time.monotonic()
        if time.monotonic() - self.start < self.pause_s:
            self.requests.append(request)
            fut: Future = Future()
            fut.set_result(RequestOutput(request.request_id, request.prompt_ids, [], [], "abort"))
            return fut
        return super().submit_request(request, route_key)


def test_a_turn_waits_out_an_engine_paused_for_a_moment() -> None:
    """Retried at once, the tries of a turn an engine refused for 0.3 s were used up within milliseconds and the
    episode ended untrained; with the waits between tries (roll_core.idle_aborts) the turn is sampled."""
    tok = build_tiny_tokenizer()
    engine = PausedEngine(tok, pause_s=0.3)
    envs = EnvManager(lambda: Corridor(100), 0, step_timeout_s=10)
    rollout = AgenticRollout(engine, envs, TurnTemplate(tok, "Walk."), tok, EpisodeLimits(2, 2048, 16))
    (traj,) = rollout.run([0], [0], SamplingParams(max_new_tokens=999, seed=1))
    assert (traj.end, traj.turns, traj.untrained) == ("max_turns", 2, False)
    assert 1 <= traj.resumed_turns < 8


@pytest.mark.usefixtures("fast_idle_retries")
def test_a_turn_the_engine_keeps_refusing_ends_the_episode_untrained() -> None:
    """An engine that aborts a turn every time without a token is given up after MAX_IDLE_ABORTS tries: the aborted
    turn is cut (no response, reward 0 or state key) and the episode is masked out of training, counted as
    end=abort, instead of a reward-0 trajectory that trained aborted work as the policy's failure."""
    from roll_algos.trajectories import check_trajectory_batch, episode_group_advantages
    from roll_core.agentic.trajectory import to_tensors

    traj, engine = _run_aborting(dict(turn=1, aborts=10**6, partial=0), EpisodeLimits(3, 2048, 16))
    assert (traj.end, traj.turns, traj.untrained, traj.turn_rewards) == ("abort", 1, True, [0.0])
    assert max(traj.turn_ids) == 0 and traj.turn_ids.count(0) == 3 and len(traj.state_keys) == 1  # turn 0 only
    from roll_core.agentic.rollout import MAX_IDLE_ABORTS

    assert sum("-turn-1" in r.request_id for r in engine.requests) == MAX_IDLE_ABORTS
    assert _episode_metrics([traj], None, None)["episode/end_abort"] == 1.0
    ok, _ = _run_aborting(dict(turn=1, aborts=0, partial=0), EpisodeLimits(3, 2048, 16))
    ok.turn_rewards = [1.0, 0.0, 0.0]  # a group of two: the aborted one must not be its baseline
    batch = to_tensors([traj, ok], pad_id=0)
    assert batch["response_mask"][0].sum() == 0 and batch["turn_mask"][0].sum() == 0
    assert batch["response_mask"][1].sum() == 9
    check_trajectory_batch(
        batch["response_mask"], batch["turn_ids"], turn_mask=batch["turn_mask"], state_keys=batch["state_keys"]
    )
    adv = episode_group_advantages(batch["episode_rewards"], batch["group_ids"], batch["response_mask"])
    assert float(adv.abs().sum()) == 0.0  # the aborted row is absent: the other is a group of one


@pytest.mark.usefixtures("fast_idle_retries")
def test_a_first_turn_abort_leaves_nothing_and_a_spent_budget_is_a_cut_turn() -> None:
    refused, _ = _run_aborting(dict(turn=0, aborts=10**6, partial=0), EpisodeLimits(3, 2048, 16))
    assert (refused.end, refused.turns, refused.tokens, refused.untrained) == ("abort", 0, [], True)
    # an abort that arrives with the turn's whole budget generated: a turn cut at its limit, judged by the env
    full, engine = _run_aborting(dict(turn=1, aborts=1, partial=16), EpisodeLimits(3, 2048, 16))
    assert (full.end, full.turns, full.cut_turns, full.resumed_turns, full.untrained) == ("max_turns", 3, 1, 0, False)
    assert sum("-turn-1" in r.request_id for r in engine.requests) == 1


def test_with_a_gate_the_engines_own_abort_resumes_and_a_closed_collector_does_not() -> None:
    from roll_core.agentic.rollout import TurnGate

    tok_engine = AbortingEngine(build_tiny_tokenizer(), turn=0, aborts=0, partial=0)
    gate = TurnGate(tok_engine, partial_rollout=True)
    traj, _ = _run_aborting(dict(turn=1, aborts=1, partial=2), EpisodeLimits(3, 2048, 16), gate)
    assert (traj.end, traj.turns, traj.resumed_turns, traj.untrained) == ("max_turns", 3, 1, False)
    assert traj.versions == [0, 0, 0]
    gate.close()
    closed, engine = _run_aborting(dict(turn=0, aborts=0, partial=0), EpisodeLimits(3, 2048, 16), gate)
    assert (closed.end, closed.turns, closed.untrained) == ("abort", 0, True) and not engine.requests


class SameTextPictures:
    """A visual environment that gives no info["state"]: every observation's text is the same, its picture shows
    the position (red at 0, green at 1, blue at 2)."""

    COLOURS = ((200, 20, 20), (20, 200, 20), (20, 20, 200))

    def __init__(self) -> None:
        self.pos = 0

    def _obs(self) -> dict[str, Any]:
        from PIL import Image

        return {"text": "Where are you?", "images": [Image.new("RGB", (28, 28), self.COLOURS[self.pos % 3])]}

    def reset(self, seed: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        self.pos = 0
        return self._obs(), {}

    def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        self.pos += 1
        return self._obs(), 0.0, False, False, {}


def test_the_default_state_key_of_a_visual_observation_includes_its_pictures() -> None:
    """Without info["state"] the anchor-state key was the observation's text alone: every state of a visual
    environment whose text does not change ("The lake: <image>") was one GiGPO step group, mixing the step
    advantages of different states. The key now holds a digest of each picture's pixels."""
    from roll_algos.trajectories import anchor_state_advantages
    from roll_core.agentic.observation import state_key
    from roll_core.agentic.trajectory import to_tensors
    from roll_core.models import resolve_model_path
    from roll_core.multimodal import VisionProcessor

    vp = VisionProcessor(resolve_model_path("builtin:tiny-qwen2.5-vl"))
    envs = EnvManager(SameTextPictures, 0, step_timeout_s=10)
    template = TurnTemplate(vp.tokenizer, "Play.", vision=vp)
    rollout = AgenticRollout(ScriptedEngine(vp.tokenizer, [2]), envs, template, vp.tokenizer, EpisodeLimits(3, 4096, 4))
    a, b = rollout.run([0, 1], [0, 0], SamplingParams(max_new_tokens=4))
    assert a.state_keys == b.state_keys  # the same states in both episodes: one key each
    assert len(set(a.state_keys)) == 3  # three positions, three pictures, one text
    assert all(k.startswith("Where are you?\n[image ") for k in a.state_keys)
    assert state_key("text only") == "text only"
    # GiGPO: turn k of the two episodes groups with turn k of the other only
    batch = to_tensors([a, b], pad_id=0)
    returns = torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, 0.5]])
    step = anchor_state_advantages(returns, batch["turn_mask"], batch["group_ids"], batch["state_keys"])
    # each step group is the two visits of one state: (1 - 0.5) / std([1, 0]) = 0.7071 (pooled over all six
    # turns, the text-only key gave 0.5 / std([1, 0, .5, 0, 1, .5]) = 1.118)
    expected = torch.tensor([[1.0, -1.0, 0.0], [-1.0, 1.0, 0.0]]) * 0.5 / 0.5**0.5
    torch.testing.assert_close(step, expected, atol=1e-4, rtol=0)


@pytest.mark.usefixtures("fast_idle_retries")
@pytest.mark.parametrize("n", [3, 11])
def test_pipeline_max_idle_aborts_decides_when_an_episodes_turn_is_given_up(n: int) -> None:
    """`pipeline.max_idle_aborts=N` (only RLVR's async driver read it: agentic turns were given up at the module's 8
    whatever was set): the rollout the episodes collector builds from the config gives a turn the engine keeps
    aborting without a token up at its N-th abort, ending the episode untrained."""
    from types import SimpleNamespace

    from roll_core.config.compose import load_config
    from roll_core.pipelines.collectors.episodes import EpisodeCollector

    cfg = load_config(["pipeline=agentic", f"pipeline.max_idle_aborts={n}"])
    tok = build_tiny_tokenizer()
    engine = AbortingEngine(tok, turn=1, aborts=10**6, partial=0)
    ctx = SimpleNamespace(
        cfg=cfg, task=WalkTask(), tokenizer=tok, sampling=SamplingParams(), infer=engine, model_path="", train=None
    )
    collector = EpisodeCollector(ctx)
    try:
        (traj,) = collector.rollout.run([0], [0], SamplingParams(max_new_tokens=999, seed=1))
    finally:
        collector.close()
    assert (traj.end, traj.turns, traj.untrained) == ("abort", 1, True)
    assert sum("-turn-1" in r.request_id for r in engine.requests) == n


class Toolbox(Corridor):
    """A Corridor whose steps report the tool counters of roll_envs' ToolUseEnv: step k (from 1) reports
    tool_errors 1 on even steps, ignored_tool_calls k, tool_error_outputs 1 on step 3 (as a float, as JSON gives)."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.k = 0
        # a reset's info is no step: its counts are not summed
        return super().reset(seed)[0], {"state": "0", "tool_errors": 7, "ignored_tool_calls": 7}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        obs, reward, done, truncated, info = super().step(action)
        self.k += 1
        counts = {"tool_calls": 1, "tool_errors": int(self.k % 2 == 0), "ignored_tool_calls": self.k}
        return obs, reward, done, truncated, {**info, **counts, "tool_error_outputs": 1.0 if self.k == 3 else 0}


def test_the_envs_tool_counters_are_summed_per_episode_and_reach_the_metrics() -> None:
    """ToolUseEnv's tool_errors, ignored_tool_calls and tool_error_outputs were dropped by the rollout (only
    tool_calls reached the metrics): a tool that raised on every call did not show in the run's metrics."""
    tok = build_tiny_tokenizer()
    envs = EnvManager(Toolbox, 0, step_timeout_s=10)
    rollout = AgenticRollout(ScriptedEngine(tok, [2]), envs, TurnTemplate(tok), tok, EpisodeLimits(4, 2048, 4))
    trajs = rollout.run([0, 1], [0, 0], SamplingParams(max_new_tokens=4))
    assert [(t.end, t.turns, t.tool_calls) for t in trajs] == [("max_turns", 4, 4)] * 2
    # 4 steps: errors on steps 2 and 4, ignored 1+2+3+4, one error output (step 3)
    want = {"tool_errors": 2, "ignored_tool_calls": 10, "tool_error_outputs": 1}
    assert [t.counters for t in trajs] == [want] * 2
    trajs[1].counters = {"tool_errors": 0, "ignored_tool_calls": 0, "tool_error_outputs": 0}
    m = _episode_metrics(trajs, None, None)
    assert m["episode/tool_calls_mean"] == 4.0
    assert m["episode/tool_errors_mean"] == 1.0
    assert m["episode/ignored_tool_calls_mean"] == 5.0
    assert m["episode/tool_error_outputs_mean"] == 0.5
    quiet = _episode_metrics(_run(EpisodeLimits(2, 2048, 4), [2])[0], None, None)  # an env without tools: zeros
    assert [quiet[f"episode/{k}_mean"] for k in want] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", ["1", -1, 0.5, float("nan")])
def test_a_tool_count_that_is_no_count_fails_its_episode_as_an_env_error(bad: Any) -> None:
    """A count that is not a whole number >= 0 would be a wrong metric (or, as a string, raised out of the rollout
    and stopped the run): the env manager fails that step as a counted env_error naming the key."""

    class BadCount(Corridor):
        def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
            obs, reward, done, truncated, info = super().step(action)
            return obs, reward, done, truncated, {**info, "tool_errors": bad}

    tok = build_tiny_tokenizer()
    envs = EnvManager(BadCount, 0, step_timeout_s=10)
    rollout = AgenticRollout(ScriptedEngine(tok, [2]), envs, TurnTemplate(tok), tok, EpisodeLimits(4, 2048, 4))
    (traj,) = rollout.run([0], [0], SamplingParams(max_new_tokens=4))
    assert (traj.end, traj.turns) == ("env_error", 1) and "info['tool_errors']" in traj.error
    assert envs.counters()["env_errors"] == 1
