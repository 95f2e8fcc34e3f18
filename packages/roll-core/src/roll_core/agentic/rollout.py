"""The multi-turn rollout loop: every episode advances on its own, one request per turn, no batch-wide barrier.

Each episode runs in its own controller thread: reset its environment (seeded; the episodes of a group share the
seed), then per turn submit one request with the exact token ids of the conversation so far (`Trajectory.context`)
to the inference group (continuous batching merges the turns of all running episodes), decode the response into
the action, step the environment, and append the observation's template ids. An episode ends when the
environment terminates or truncates, at `max_turns`, when the next turn would not fit `max_context_length`
(prompt + everything so far + at least one new token; the collectors lower it to the inference engine's context
where that is shorter, warned: `fit_engine_context`), or when its environment fails (counted, the run goes on).
A trajectory ends with its last response: the observation after the last allowed turn is not encoded or appended
(no turn would read it; it would only lengthen the training sequence, and a long or unencodable one would end a
`max_turns` episode as `max_context` or `env_error`), and an observation whose next turn was not taken (the engine
refused its prompt as too long, the turn was aborted or sampled a picture placeholder, below) is cut off again.
A response cut by `max_tokens_per_turn` does not end the episode: the environment judges the cut text (usually an
invalid action, which teaches brevity); such turns are counted (`Trajectory.cut_turns`, `episode/cut_turn_rate`).
A response cut short of `max_tokens_per_turn` by the context (its budget was what was left of
`max_context_length`, or the engine stopped it at its own context) is judged alike but counted apart
(`Trajectory.context_cut_turns`, `episode/context_cut_turn_rate`): it says the context is too small, not the turns
too long.

Asynchronous collection passes a `TurnGate`: every turn request enters the gate (blocking while a weight sync
runs) and records the weight version it was sampled under (`Trajectory.versions`). With partial rollout the gate
aborts the turns in flight when a sync begins; such a turn keeps its generated tokens and behaviour log-probs and
is resumed under the new weights (prompt + everything so far + the partial turn), within the turn's token budget,
so an episode never loses a turn to a sync. A stop string split across the attempts (the first ends with `</ans`,
the resumed one goes on with `wer>`) is matched by no engine (each reads only its request's new text): it is
matched over the joined tokens and the turn cut at its completing token, finish `stop`, as an unaborted turn
(roll_core.agentic.resume_stops). Without partial rollout a sync waits for the running turns. An aborted
turn request that never brings its result, or whose result raises, is lost after a bound (roll_core.agentic.turn_gate,
"Requests that never return"): the turn resumes with what its earlier attempts generated.

Engine failures. A turn request that was not aborted and whose handle raises (or whose submission does) fails its
episode with the engine's error, a note naming the request, turn, episode and environment seed added: the
synchronous collector's `run` raises it, the asynchronous one raises it in the trainer's next call.

Aborts. A turn request the engine aborts on its own (preemption, with or without a gate) is resumed the same way;
after `max_idle_aborts` such aborts in a row without a token (`pipeline.max_idle_aborts`, passed by the episodes
collector; default `roll_core.idle_aborts.MAX_IDLE_ABORTS`: an engine that refuses the request), or when the
collector closes, the turn is given up. An aborted turn is never scored as the policy's failure: it is cut from the
trajectory (no response, reward or state key) and the episode ends `abort` with `Trajectory.untrained` set, so its
earlier turns are masked out of training too (`to_tensors`; an episode cut short has no outcome to learn from);
such episodes are counted in episode/end_abort. An abort that left the turn's whole budget generated is a turn cut
at its limit (`length`), not an abort.

Observations with pictures (vision-language policies): the turn template renders each observation's pictures
(expanded placeholders, roll_core.agentic.chat) and the trajectory keeps their `MMInputs`; every turn's request
carries all the pictures of the conversation so far (`Request.mm`), in placeholder order. Picture tokens count
against `max_context_length` like any other token. A policy may sample the picture placeholder token itself (a
random model often does): such a turn cannot be trained on or sent back (the model would need a picture for that
token), so the placeholder is a stop token of every turn and a turn that sampled it is cut from the trajectory,
which ends there (`end="image_token"`, counted in episode/end_image_token; a first turn leaves nothing to train
on: the episode is dropped, counted in data/dropped_episodes and data/unsampled_episodes; its reward 0 still counts,
the policy sampled it). An episode whose environment fails at reset, or whose first prompt leaves no room within
`max_context_length` (end `max_context` with no turn), has no turn: the policy never acted, and the collectors
keep it out of the reward metrics and eval/n (roll_core.pipelines.collectors._episode_drops).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.env_manager import EnvFailure, EnvManager
from roll_core.agentic.observation import info_state_key, state_key
from roll_core.agentic.resume_stops import split_stop
from roll_core.agentic.trajectory import Trajectory
from roll_core.agentic.turn_gate import GateClosed, TurnGate
from roll_core.idle_aborts import KEY as IDLE_ABORTS_KEY
from roll_core.idle_aborts import MAX_IDLE_ABORTS, check_max_idle_aborts, idle_backoff_s
from roll_core.interfaces import Request, SamplingParams
from roll_core.interfaces.agentic import INFO_COUNTERS, info_count
from roll_core.seeds import Purpose, derive_seed
from roll_core.thinking import header_opens_think, reply_text

log = logging.getLogger(__name__)


@dataclass
class EpisodeLimits:
    """Where an episode stops regardless of the environment."""

    max_turns: int = 8
    max_context_length: int = 2048
    max_tokens_per_turn: int = 128


def fit_engine_context(limits: Any, infer: Any) -> Any:
    """`limits` (EpisodeLimits, roll_core.agentic.agent_sessions.SessionLimits) with `max_context_length` lowered to
    the inference engine's context (`infer.max_context_length()`, where it has one) when the task's is longer, with a
    warning. Past the engine's context a turn was cut by the engine (judged by the environment as the policy's
    reply), the next prompt refused, and a training row ran past the model's context."""
    get = getattr(infer, "max_context_length", None)
    engine = get() if callable(get) else None
    if isinstance(engine, bool) or not isinstance(engine, int) or engine < 1 or engine >= limits.max_context_length:
        return limits
    log.warning(
        "the task's max_context_length=%d exceeds the inference engine's context of %d tokens: episodes end at %d "
        "(end max_context); lower the env's max_context_length or raise infer_engine.max_model_len",
        limits.max_context_length,
        engine,
        engine,
    )
    return dataclasses.replace(limits, max_context_length=engine)


def task_turns(
    task: Any, tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None, vision: Any = None
) -> tuple[TurnTemplate, EpisodeLimits]:
    """The turn template (system prompt, demonstrations; `chat_template_kwargs`: model.chat_template_kwargs;
    `vision`: the VisionProcessor of a vision-language model) and episode limits of an agentic task."""
    examples = task.examples()
    limits = EpisodeLimits(task.max_turns, task.max_context_length, task.max_tokens_per_turn)
    return TurnTemplate(tokenizer, task.system_prompt(), examples, chat_template_kwargs, vision), limits


class AgenticRollout:
    """Runs episodes against an inference group (`submit_request`) and an env manager. `max_idle_aborts`
    (pipeline.max_idle_aborts): the engine's own aborts of a turn request in a row, none with a token, after which
    the turn is given up (module docstring)."""

    def __init__(
        self,
        infer: Any,
        envs: EnvManager,
        template: TurnTemplate,
        tokenizer: Any,
        limits: EpisodeLimits,
        gate: TurnGate | None = None,
        *,
        max_idle_aborts: int = MAX_IDLE_ABORTS,
    ) -> None:
        self.infer, self.envs, self.template, self.tokenizer, self.limits = infer, envs, template, tokenizer, limits
        self.gate = gate
        self.max_idle_aborts = check_max_idle_aborts(max_idle_aborts)
        self._ids = itertools.count()

    @functools.cached_property
    def _header_opens_think(self) -> tuple[bool, bool]:
        """Whether the template's generation header opens `<think>` (roll_core.thinking.header_opens_think): before
        the first turn, and after an observation (read once; the messages' own text never counts)."""
        t = self.template
        later = [*t.prefix, {"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]
        first, then = (
            header_opens_think(self.tokenizer, m, t.template_kwargs, t.chat_template) for m in (t.prefix, later)
        )
        return first, then

    def run(
        self, seeds: list[int], groups: list[int], params: SamplingParams, *, first_slot: int = 0
    ) -> list[Trajectory]:
        """One episode per (seed, group) pair, all concurrently, on environment slots from `first_slot` on;
        trajectories in the input order."""
        self.envs.grow(first_slot + len(seeds))
        with ThreadPoolExecutor(max_workers=max(1, len(seeds)), thread_name_prefix="roll-episode") as pool:
            futures = [
                pool.submit(self.episode, first_slot + i, seed, group, params, i)
                for i, (seed, group) in enumerate(zip(seeds, groups))
            ]
            return [f.result() for f in futures]

    def _generate(self, rid: str, key: str, context: list[int], params: SamplingParams, traj: Trajectory) -> Any:
        """One turn's response (token ids, log-probs, finish reason), resumed after an abort (see the module
        docstring): "abort" only when the collector closed or the engine refused the request `max_idle_aborts`
        times in a row; "length" when an abort left the turn's whole budget generated; "stop" where a stop string
        of `params.stop` split across attempts completes (cut there, as without the abort)."""
        tokens: list[int] = []
        logprobs: list[float] = []
        version: int | None = None
        idle = 0  # the engine's own aborts in a row that brought no token
        for attempt in itertools.count():
            budget = params.max_new_tokens - len(tokens)
            sub = f"{rid}-{attempt}" if attempt else rid
            if self.gate is None and attempt == 0:
                seed = params.seed  # what a synchronous turn sampled before resumption existed
            else:
                seed = None if params.seed is None else derive_seed(params.seed, Purpose.EPISODE_TURN, attempt)
            if self.gate is not None:
                v = self.gate.enter(sub)
                version = v if version is None else min(version, v)
            try:
                req = Request(sub, context + tokens, params.replace(max_new_tokens=budget, seed=seed), mm=traj.mm)
                try:
                    handle = self.infer.submit_request(req, route_key=key)
                    out = handle.result() if self.gate is None else self.gate.wait(sub, handle)
                except Exception as exc:  # the engine's own type is kept (a dead worker is a fault a restart fixes)
                    exc.add_note(
                        f"turn request {sub} (turn {traj.turns} of {key}, env seed {traj.env_seed}) failed in the "
                        "inference engine"
                    )
                    raise
            finally:
                asked = self.gate.leave(sub) if self.gate is not None else False
            if out is None:  # the gate aborted it and it never brought a result: lost, nothing of it is kept
                out_tokens, out_logprobs, finish = [], [], "abort"
            else:
                out_tokens, out_logprobs, finish = list(out.token_ids), list(out.logprobs), out.finish_reason
            earlier = len(tokens)
            tokens += out_tokens
            logprobs += out_logprobs
            # a stop string the earlier attempts began and this one completed: no engine saw it whole
            cut = split_stop(self.tokenizer, context, tokens, earlier, params.stop) if params.stop else None
            if cut is not None:
                del tokens[cut:], logprobs[cut:]
                finish = "stop"  # cut where an unaborted turn stopped (roll_core.agentic.resume_stops)
            if finish == "abort" and len(tokens) >= params.max_new_tokens:
                finish = "length"  # the abort raced the budget's end: the turn is complete, cut at its limit
            closed = self.gate is not None and self.gate.closed
            # A constrained turn (roll-eval's infer_engine.structured) cannot go on from a prefix: the engine would
            # start the constraint over after it.
            if finish == "abort" and not closed and not (params.structured is not None and tokens):
                # A sync's abort (`asked`) or the engine's own with a token resumes at once; the engine's own
                # without one (preemption, or a refusal: SGLang aborts a prompt it cannot hold) a few times only.
                idle = 0 if asked or out_tokens else idle + 1
                if idle < self.max_idle_aborts:
                    traj.resumed_turns += 1
                    # an engine paused for a moment used up every try within milliseconds (roll_core.idle_aborts)
                    time.sleep(idle_backoff_s(idle))
                    continue
                log.warning(
                    "the engine aborted turn request %s %d times in a row without a token: the episode ends "
                    "(end=abort, not trained; an engine that only pauses that often: raise %s)",
                    rid,
                    idle,
                    IDLE_ABORTS_KEY,
                )
            if self.gate is not None:
                traj.versions.append(version)  # type: ignore[arg-type]
            return tokens, logprobs, finish
        raise AssertionError("unreachable")

    def episode(self, slot: int, seed: int, group: int, params: SamplingParams, index: int | None = None) -> Trajectory:
        """One episode on environment slot `slot`; `index` keys its sampling seeds (the slot when None)."""
        try:
            return self._episode(slot, seed, group, params, slot if index is None else index)
        except GateClosed:
            return Trajectory(
                env_seed=seed, group=group, prompt_ids=[], end="abort", error="collector closed", untrained=True
            )

    def _episode(self, slot: int, seed: int, group: int, params: SamplingParams, index: int) -> Trajectory:
        lim = self.limits
        try:
            obs, info = self.envs.reset(slot, seed)
        except EnvFailure as exc:
            return Trajectory(env_seed=seed, group=group, prompt_ids=[], end=exc.kind, error=str(exc))
        try:
            prompt_ids, mm = self.template.initial_turn(obs)
        except ValueError as exc:  # pictures for a text model, say: this episode fails, not the rollout
            failure = self.envs.bad_observation(slot, exc)
            return Trajectory(env_seed=seed, group=group, prompt_ids=[], end=failure.kind, error=str(failure))
        traj = Trajectory(env_seed=seed, group=group, prompt_ids=prompt_ids, mm=mm)
        key = f"episode-{next(self._ids)}"
        unread: tuple[int, Any] | None = None  # where the last observation starts, and the pictures before it
        for turn in range(lim.max_turns):
            room = lim.max_context_length - traj.length
            if room < 1:
                traj.end = "max_context"
                break
            sample_seed = None if params.seed is None else derive_seed(params.seed, Purpose.EPISODE_TURN, index, turn)
            # The template's end-of-turn token stops a turn even where the model's eos is another token (Gemma 3).
            stops = (*params.stop_token_ids, *self.template.stop_token_ids)
            if self.template.picture_token_id is not None:
                stops = (*stops, self.template.picture_token_id)
            stops = tuple(dict.fromkeys(stops))
            turn_params = params.replace(
                max_new_tokens=min(lim.max_tokens_per_turn, room), seed=sample_seed, stop_token_ids=stops
            )
            context = traj.context()
            token_ids, logprobs, finish = self._generate(f"{key}-turn-{turn}", key, context, turn_params, traj)
            picture = self.template.picture_token_id
            sampled_picture = picture is not None and picture in token_ids
            if unread is not None and (finish in ("prompt_too_long", "abort") or sampled_picture):
                traj.truncate(*unread)  # no kept turn reads the last observation (module docstring)
            if finish == "prompt_too_long":
                del traj.versions[traj.turns :]  # no turn was taken
                traj.end = "max_context"
                break
            if finish == "abort":
                # Aborted work is not the policy's failure: the partial turn is cut and the whole episode is kept
                # out of training (`Trajectory.untrained`), counted in episode/end_abort.
                del traj.versions[traj.turns :]
                traj.end, traj.untrained = "abort", True
                traj.error = "collector closed" if self.gate is not None and self.gate.closed else "engine abort"
                break
            if sampled_picture:
                del traj.versions[traj.turns :]  # the cut turn's weight version (gate runs)
                traj.end = "image_token"
                break
            if finish == "length":  # short of max_tokens_per_turn: the context cut it (its budget, or the engine)
                by_context = len(token_ids) < lim.max_tokens_per_turn
                traj.context_cut_turns += int(by_context)
                traj.cut_turns += int(not by_context)
            traj.state_keys.append(info_state_key(info["state"]) if "state" in info else state_key(obs))
            traj.add_response(token_ids, logprobs)
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            traj.texts.append(text)
            # a template whose generation header opens <think>: the env reads the reply with its opening tag (cut
            # off while reasoning, its tool call or answer is not taken: roll_core.thinking). Only the header counts:
            # an earlier turn's unclosed <think>, or an observation's, did not open this one.
            action = reply_text(text, self._header_opens_think[turn > 0])
            try:
                obs, reward, terminated, truncated, info = self.envs.step(slot, action)
            except EnvFailure as exc:
                traj.turn_rewards.append(0.0)
                traj.end, traj.error = exc.kind, str(exc)
                break
            traj.turn_rewards.append(reward)
            traj.invalid_actions += int(bool(info.get("invalid_action")))
            traj.tool_calls += info_count(info, "tool_calls")
            for counter in INFO_COUNTERS:  # tool errors, ignored calls...: summed per episode (the env contract)
                traj.counters[counter] = traj.counters.get(counter, 0) + info_count(info, counter)
            if terminated or truncated:
                traj.success = bool(info.get("success", False))
                traj.end = "terminated" if terminated else "truncated"
                break
            if turn + 1 == lim.max_turns:  # no turn reads the next observation: nothing to append (see above)
                traj.end = "max_turns"
                break
            try:
                obs_ids, obs_mm = self.template.observation_turn(obs, token_ids)
            except ValueError as exc:  # (as for the first observation)
                failure = self.envs.bad_observation(slot, exc)
                traj.end, traj.error = failure.kind, str(failure)
                break
            if traj.length + len(obs_ids) >= lim.max_context_length:  # picture tokens included
                traj.end = "max_context"
                break
            unread = (len(traj.tokens), traj.mm)
            traj.add_observation(obs_ids, obs_mm)
        else:
            traj.end = "max_turns"
        return traj
