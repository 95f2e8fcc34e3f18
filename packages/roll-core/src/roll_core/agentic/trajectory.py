"""A multi-turn trajectory as tokens, and a batch of trajectories in the trainer's layout.

One trajectory: the initial prompt's ids, then alternately a response (generated tokens, loss mask 1, with the
behaviour log-probs the engine reported) and an observation turn (template and environment text, mask 0). The
trainer sees the initial prompt as `prompts` (left-padded) and everything after it as `responses` (right-padded)
with a `response_mask` that has holes; `turn_ids` gives each assistant token its turn index (-1 elsewhere).

Pictures: `mm` is the `MMInputs` of every picture the trajectory holds (the first prompt's, then each observation's,
in the order their placeholder tokens appear in `context()`), None for text. It is what each turn's request carries
(`Request.mm`: the turn's prompt holds every earlier picture) and, per row, the batch field `mm_inputs` of
`to_tensors` (without the PIL pictures: the trainer takes the tensors). Picture tokens are ids like any other:
`length` and the context limits count them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from roll_core.multimodal.inputs import MMInputs, merge

#: Why an episode ended.
END_REASONS = (
    "terminated",
    "truncated",
    "max_turns",
    "max_context",
    "env_error",
    "env_timeout",
    "abort",  # a turn aborted for good (collector closed, engine refusal): cut, the episode `untrained`
    "image_token",  # the policy sampled a picture placeholder token; that turn is cut (roll_core.agentic.rollout)
)


@dataclass
class Trajectory:
    """One episode of one environment seed, token-in-token-out."""

    env_seed: int
    group: int
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)  # everything after the prompt
    mask: list[int] = field(default_factory=list)  # 1 on generated tokens
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob of generated tokens, 0 elsewhere
    turn_ids: list[int] = field(default_factory=list)  # turn index of generated tokens, -1 elsewhere
    turn_rewards: list[float] = field(default_factory=list)
    state_keys: list[str] = field(default_factory=list)  # environment state before each turn's action
    invalid_actions: int = 0
    tool_calls: int = 0
    # The episode's sums of the env's numeric info counters (roll_core.interfaces.agentic.INFO_COUNTERS: tool errors,
    # ignored tool calls, error outputs), each key present once a step was taken.
    counters: dict[str, int] = field(default_factory=dict)
    cut_turns: int = 0  # responses stopped by the per-turn token limit (passed to the environment as they are)
    # responses stopped by the context instead: a budget cut to the context left, or the engine's own context
    context_cut_turns: int = 0
    success: bool = False
    end: str = ""
    error: str = ""
    texts: list[str] = field(default_factory=list)  # decoded responses, for logs
    # Weight version each turn's oldest token was sampled under (asynchronous collection; 0 when synchronous).
    versions: list[int] = field(default_factory=list)
    resumed_turns: int = 0  # turns aborted at a weight sync and resumed under the new weights (partial rollout)
    # Kept out of training: every token masked out by `to_tensors` (an episode that ended on an aborted turn has no
    # outcome to learn from; scoring it would train aborted work as a failure). Its reward still reaches the logs.
    untrained: bool = False
    mm: MMInputs | None = field(default=None, repr=False)  # every picture so far, in placeholder order

    @property
    def min_version(self) -> int:
        """The oldest weight version any of its tokens was sampled under."""
        return min(self.versions, default=0)

    @property
    def turns(self) -> int:
        return len(self.turn_rewards)

    @property
    def reward(self) -> float:
        return float(sum(self.turn_rewards))

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)

    def add_response(self, ids: list[int], logprobs: list[float]) -> None:
        turn = len(self.turn_rewards)
        self.tokens += ids
        self.mask += [1] * len(ids)
        self.logprobs += list(logprobs)
        self.turn_ids += [turn] * len(ids)

    def add_observation(self, ids: list[int], mm: MMInputs | None = None) -> None:
        """Append an observation turn's ids and (after the earlier ones) its pictures."""
        if mm is not None:
            self.mm = merge([self.mm, mm])
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.turn_ids += [-1] * len(ids)

    def truncate(self, n: int, mm: MMInputs | None) -> None:
        """Keep the first `n` ids after the prompt (cut an observation no kept turn read) and the pictures `mm` (the
        ones before it)."""
        del self.tokens[n:], self.mask[n:], self.logprobs[n:], self.turn_ids[n:]
        self.mm = mm

    def context(self) -> list[int]:
        """The model's input for its next turn: every id so far, exactly as produced."""
        return self.prompt_ids + self.tokens


def to_tensors(trajectories: list[Trajectory], pad_id: int) -> dict[str, Any]:
    """The trainer's layout (roll_core.protocol) plus turn structure:

    `prompts` (B, P) left-padded, `responses`/`response_mask`/`behaviour_logprobs`/`turn_ids` (B, R) right-padded,
    `turn_rewards`/`turn_mask` (B, K), `episode_rewards` (B,), `group_ids` (B,), and `state_keys` (B lists);
    `mm_inputs` (B entries: each trajectory's `MMInputs` without PIL pictures, or None) when any trajectory has
    pictures.

    An `untrained` trajectory keeps its row (the batch stays aligned with per-trajectory fields) with an all-zero
    `response_mask` and `turn_mask` and `turn_ids` -1: every trajectory estimator treats such a row as absent
    (roll_algos.trajectories) and the loss sees none of its tokens.
    """
    from roll_core.sequences import build_sequences, pad_left

    b = len(trajectories)
    r = max((len(t.tokens) for t in trajectories), default=0)
    k = max((t.turns for t in trajectories), default=0)
    responses = torch.full((b, r), pad_id, dtype=torch.long)
    mask = torch.zeros((b, r), dtype=torch.long)
    logp = torch.zeros((b, r), dtype=torch.float32)
    turn_ids = torch.full((b, r), -1, dtype=torch.long)
    turn_rewards = torch.zeros((b, max(k, 1)), dtype=torch.float32)
    turn_mask = torch.zeros((b, max(k, 1)), dtype=torch.long)
    for i, t in enumerate(trajectories):
        n = len(t.tokens)
        if n:
            responses[i, :n] = torch.tensor(t.tokens)
            logp[i, :n] = torch.tensor(t.logprobs)
            if not t.untrained:
                mask[i, :n] = torch.tensor(t.mask)
                turn_ids[i, :n] = torch.tensor(t.turn_ids)
        if t.turns:
            turn_rewards[i, : t.turns] = torch.tensor(t.turn_rewards)
            turn_mask[i, : t.turns] = int(not t.untrained)
    prompts, prompt_mask = pad_left([t.prompt_ids for t in trajectories], pad_id)
    out: dict[str, Any] = build_sequences(prompts, prompt_mask, responses, mask)
    # Observation tokens inside the response are real context: attend to every token up to the trajectory's length
    # (by position: a template token may share the pad id, e.g. SmolLM2's <|im_end|>).
    lengths = torch.tensor([len(t.tokens) for t in trajectories], dtype=torch.long)
    present = (torch.arange(r)[None, :] < lengths[:, None]).long()
    out["attention_mask"] = torch.cat([prompt_mask, present], dim=1)
    out["position_ids"] = (out["attention_mask"].cumsum(1) - 1).clamp_min(0)
    out.update(
        prompts=prompts,
        responses=responses,
        response_mask=mask,
        behaviour_logprobs=logp,
        turn_ids=turn_ids,
        turn_rewards=turn_rewards,
        turn_mask=turn_mask,
        episode_rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        group_ids=torch.tensor([t.group for t in trajectories], dtype=torch.long),
    )
    out["state_keys"] = [list(t.state_keys) for t in trajectories]
    if any(t.mm is not None for t in trajectories):
        out["mm_inputs"] = [t.mm.without_images() if t.mm is not None else None for t in trajectories]
    return out
