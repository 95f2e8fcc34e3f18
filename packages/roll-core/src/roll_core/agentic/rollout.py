"""The multi-turn rollout loop: every episode advances on its own, one request per turn, no batch-wide barrier.

Each episode runs in its own controller thread: reset its environment (seeded; the episodes of a group share the
seed), then per turn submit one request with the exact token ids of the conversation so far (`Trajectory.context`)
to the inference group (continuous batching merges the turns of all running episodes), decode the response into
the action, step the environment, and append the observation's template ids. An episode ends when the
environment terminates or truncates, at `max_turns`, when the next turn would not fit `max_context_length`
(prompt + everything so far + at least one new token), or when its environment fails (counted, the run goes on).
A response cut by `max_tokens_per_turn` does not end the episode: the environment judges the cut text (usually an
invalid action, which teaches brevity); such turns are counted (`Trajectory.cut_turns`, `episode/cut_turn_rate`).
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.env_manager import EnvFailure, EnvManager
from roll_core.agentic.trajectory import Trajectory
from roll_core.interfaces import Request, SamplingParams


@dataclass
class EpisodeLimits:
    """Where an episode stops regardless of the environment."""

    max_turns: int = 8
    max_context_length: int = 2048
    max_tokens_per_turn: int = 128


def task_turns(task: Any, tokenizer: Any) -> tuple[TurnTemplate, EpisodeLimits]:
    """The turn template (system prompt, demonstrations) and episode limits of an agentic task."""
    examples = task.examples() if hasattr(task, "examples") else []
    limits = EpisodeLimits(task.max_turns, task.max_context_length, task.max_tokens_per_turn)
    return TurnTemplate(tokenizer, task.system_prompt(), examples), limits


class AgenticRollout:
    """Runs episodes against an inference group (`submit_request`) and an env manager."""

    def __init__(
        self,
        infer: Any,
        envs: EnvManager,
        template: TurnTemplate,
        tokenizer: Any,
        limits: EpisodeLimits,
    ) -> None:
        self.infer, self.envs, self.template, self.tokenizer, self.limits = infer, envs, template, tokenizer, limits
        self._ids = itertools.count()

    def run(self, seeds: list[int], groups: list[int], params: SamplingParams) -> list[Trajectory]:
        """One episode per (seed, group) pair, all concurrently; trajectories in the input order."""
        self.envs.grow(len(seeds))
        with ThreadPoolExecutor(max_workers=max(1, len(seeds)), thread_name_prefix="roll-episode") as pool:
            futures = [
                pool.submit(self._episode, slot, seed, group, params)
                for slot, (seed, group) in enumerate(zip(seeds, groups))
            ]
            return [f.result() for f in futures]

    def _episode(self, slot: int, seed: int, group: int, params: SamplingParams) -> Trajectory:
        lim = self.limits
        try:
            obs, info = self.envs.reset(slot, seed)
        except EnvFailure as exc:
            return Trajectory(env_seed=seed, group=group, prompt_ids=[], end=exc.kind, error=str(exc))
        traj = Trajectory(env_seed=seed, group=group, prompt_ids=self.template.initial(obs))
        key = f"episode-{next(self._ids)}"
        for turn in range(lim.max_turns):
            room = lim.max_context_length - traj.length
            if room < 1:
                traj.end = "max_context"
                break
            sample_seed = None if params.seed is None else (params.seed * 1_000_003 + slot * 1009 + turn) % 2**31
            request = Request(
                f"{key}-turn-{turn}",
                traj.context(),
                params.replace(max_new_tokens=min(lim.max_tokens_per_turn, room), seed=sample_seed),
            )
            out = self.infer.submit_request(request, route_key=key).result()
            if out.finish_reason == "prompt_too_long":
                traj.end = "max_context"
                break
            traj.cut_turns += int(out.finish_reason == "length")
            traj.state_keys.append(str(info.get("state", obs)))
            traj.add_response(out.token_ids, out.logprobs)
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            traj.texts.append(text)
            if out.finish_reason == "abort":
                traj.turn_rewards.append(0.0)
                traj.end = "abort"
                break
            try:
                obs, reward, terminated, truncated, info = self.envs.step(slot, text)
            except EnvFailure as exc:
                traj.turn_rewards.append(0.0)
                traj.end, traj.error = exc.kind, str(exc)
                break
            traj.turn_rewards.append(reward)
            traj.invalid_actions += int(bool(info.get("invalid_action")))
            traj.tool_calls += int(info.get("tool_calls", 0) or 0)
            if terminated or truncated:
                traj.success = bool(info.get("success", False))
                traj.end = "terminated" if terminated else "truncated"
                break
            obs_ids = self.template.observation(obs, out.token_ids)
            if traj.length + len(obs_ids) >= lim.max_context_length:
                traj.end = "max_context"
                break
            traj.add_observation(obs_ids)
        else:
            traj.end = "max_turns"
        return traj
