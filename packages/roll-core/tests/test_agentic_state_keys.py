"""GiGPO's anchor states from an environment that does not track its state: an info "state" of None is absent (the
rollout keys the turn by its observation, roll_core.agentic.step_values.checked_info), not the text "None" that put
every turn of a group, whatever state it acted in, into one step group.

Episodes run through the real rollout loop (scripted engine, roll_core.agentic.rollout) and the batch through the
`gigpo` estimator as the RL objective loads it; the expected advantages are worked out by hand in the test."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
import torch

from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.env_manager import EnvManager
from roll_core.agentic.rollout import AgenticRollout, EpisodeLimits
from roll_core.agentic.step_values import checked_info
from roll_core.agentic.trajectory import to_tensors
from roll_core.algorithms import AdvantageInputs, load_estimator
from roll_core.config.schema import AlgoConfig
from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.models import build_tiny_tokenizer


class _TwoTokens:
    """The request API: every turn is two 'a' tokens, finish `stop`."""

    def __init__(self, tokenizer: Any) -> None:
        self.ids = tokenizer("a", add_special_tokens=False)["input_ids"][:1] * 2

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, list(self.ids), [-0.5, -0.5], "stop"))
        return fut


class _Rooms:
    """Two steps from room A: the first instance (`branch` 0) walks to room B and wins 1.0, the second to room C and
    wins 0.5. Its info's "state" is None throughout (it does not track one)."""

    def __init__(self, branch: int) -> None:
        self.branch, self.steps = branch, 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.steps = 0
        return "room A", {"state": None}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        if self.steps == 1:
            return ("room B", "room C")[self.branch], 0.0, False, False, {"state": None}
        return "done", (1.0, 0.5)[self.branch], True, False, {"state": None, "success": True}


def test_a_none_state_is_absent_and_gigpo_groups_turns_by_their_observations() -> None:
    tok = build_tiny_tokenizer()
    branches = iter(range(2))
    envs = EnvManager(lambda: _Rooms(next(branches)), 2, step_timeout_s=30.0)
    rollout = AgenticRollout(_TwoTokens(tok), envs, TurnTemplate(tok, "Walk."), tok, EpisodeLimits(4, 2048, 8))
    trajs = [rollout.episode(slot, 7, 0, SamplingParams(max_new_tokens=8)) for slot in range(2)]
    envs.close()
    assert [(t.end, t.turn_rewards) for t in trajs] == [("terminated", [0.0, 1.0]), ("terminated", [0.0, 0.5])]
    assert [t.state_keys for t in trajs] == [["room A", "room B"], ["room A", "room C"]]

    batch = to_tensors(trajs, tok.pad_token_id or 0)
    mask = batch["response_mask"].float()
    turns = {k: batch[k] for k in ("turn_rewards", "turn_mask", "turn_ids", "state_keys")}
    inputs = AdvantageInputs(batch["episode_rewards"], torch.zeros_like(mask), mask, None, batch["group_ids"], turns)
    adv, _ = load_estimator("gigpo", trajectories=True)(inputs, AlgoConfig(group_size=2))
    # Episode level: rewards 1.0 and 0.5, mean 0.75, std 0.25 * sqrt(2): +-1/sqrt(2). Step level (gamma 1): room A's
    # returns 1.0 and 0.5 give +-1/sqrt(2) again; rooms B and C are steps of one: 0. (With every key "None" the four
    # turns made one step group, returns 1, 1, 0.5, 0.5: +-sqrt(3)/2 on both turns.)
    h = 2**-0.5
    expected = [{0: 2 * h, 1: h}, {0: -2 * h, 1: -h}]
    for row, want in enumerate(expected):
        for turn, value in want.items():
            on = batch["turn_ids"][row] == turn
            assert bool(on.any())
            assert adv[row][on].tolist() == pytest.approx([value] * int(on.sum()), abs=1e-5)
    assert bool((adv[mask == 0] == 0).all())


def test_checked_info_leaves_a_none_state_out_and_keeps_the_others() -> None:
    assert "state" not in checked_info({"state": None, "success": False})
    assert checked_info({"state": "3,4"})["state"] == "3,4"
    assert checked_info({"state": 0})["state"] == 0  # (an integer state, FrozenLake's, stays a key)
