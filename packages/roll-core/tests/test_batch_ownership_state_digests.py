"""Leftovers of the batch-protocol and agentic credit hunts, each checked against what the old code did.

- `Batch(td)` owns its TensorDict container (roll_core.protocol): setting a key on one batch no longer sets it on
  every batch built on the same TensorDict, nor does making a tensor a field delete it from the others.
- `Batch.index` refuses non-integer indices: a float tensor or entry was truncated (0.9 picked row 0, 2.7 row 2).
- The local backend's `InferGroup.submit_request` passes a request and its output by value, as Ray does: a caller
  changing its request after the submit changed what the engine read, and one changing an output changed the
  engine's own lists.
- GiGPO's anchor state of an `info["state"]` array is a digest of its bytes (roll_core.agentic.observation
  .info_state_key): NumPy prints arrays of more than 1,000 elements with "...", so two different boards shared a
  key, and their steps one step group.
- `on_failure: drop` leaves a failed episode's reward as it is and keeps the episode out of the reward metrics
  (roll_core.pipelines.collectors.episodes): scored `failure_reward` anyway, it counted in reward/mean.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from roll_core.protocol import Batch

# ---- Batch ownership ------------------------------------------------------------------------------------------


def test_batches_built_on_one_tensordict_do_not_share_their_keys() -> None:
    td = TensorDict({"a": torch.arange(3), "b": torch.ones(3)}, batch_size=[3])
    one, two = Batch(td), Batch(td, {"f": [1, 2, 3]})
    one["x"] = torch.zeros(3)  # old: "x" appeared in `two` and in `td`
    assert two.keys() == ["a", "b", "f"] and sorted(td.keys()) == ["a", "b"]
    one["a"] = ["p", "q", "r"]  # a tensor made a field: old, "a" was deleted from `two`'s TensorDict too
    assert two["a"].tolist() == [0, 1, 2] and "a" in td.keys()
    assert one.keys() == ["b", "x", "a"]
    assert torch.equal(two["b"], td["b"])  # the tensors themselves are shared, as field values are


def test_a_batch_copy_made_by_with_field_does_not_change_the_original() -> None:
    from roll_core.pipelines.sampling import _with_field

    base = Batch({"a": torch.arange(2)}, {"p": [[1], [2]]})
    copy = _with_field(base, "mm_inputs", None)
    copy["extra"] = torch.ones(2)
    assert base.keys() == ["a", "p"]


# ---- Batch.index: integers only -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows",
    [torch.tensor([0.9, 2.7]), [0.9, 2.0], np.array([1.0, 2.0]), [np.float32(1.0)], [torch.tensor(1.5)]],
    ids=["float-tensor", "float-list", "float-array", "numpy-float", "0d-float-tensor"],
)
def test_index_refuses_float_rows(rows: Any) -> None:
    batch = Batch({"a": torch.arange(4) * 10}, {"f": list("wxyz")})
    with pytest.raises(ValueError, match="rows must be integers or a bool mask"):
        batch.index(rows)  # old: truncated, [0.9, 2.7] gave rows [0, 2]


def test_index_still_takes_integers_of_every_kind() -> None:
    batch = Batch({"a": torch.arange(4) * 10}, {"f": list("wxyz")})
    assert batch.index([np.int64(3), torch.tensor(1), -4])["f"] == ["z", "x", "w"]
    assert batch.index(torch.tensor([2, 0], dtype=torch.int32))["a"].tolist() == [20, 0]
    assert batch.index(np.array([1]))["f"] == ["x"]
    assert len(batch.index(torch.tensor([]))) == 0  # an empty index (float32 by default) picks nothing


# ---- the local backend's request API: by value ----------------------------------------------------------------


class _KeepingEngine:
    """Holds each request until `release()`; answers with its own `reply` list and the request's `prompt_ids` (the
    same objects: what a plugin engine may hand back), and keeps what it answered."""

    def __init__(self) -> None:
        self.reply = [7, 8]
        self.held: list[tuple[Any, Future]] = []
        self.submitted = threading.Event()

    def submit(self, request: Any) -> Future:
        fut: Future = Future()
        self.held.append((request, fut))
        self.submitted.set()
        return fut

    def release(self) -> None:
        from roll_core.interfaces import RequestOutput

        for request, fut in self.held:
            fut.set_result(RequestOutput(request.request_id, request.prompt_ids, self.reply, [-0.5, -0.5], "stop"))

    def shutdown(self) -> None:
        pass


def test_local_submit_request_passes_the_request_and_its_output_by_value() -> None:
    from roll_core.cluster.roles import InferGroup, InferWorker
    from roll_core.cluster.worker import Worker
    from roll_core.interfaces import Request

    class KeepingWorker(InferWorker):
        def __init__(self, **base: Any) -> None:
            Worker.__init__(self, **base)
            self.engine = _KeepingEngine()

    infer = InferGroup(KeepingWorker, 1, "local", name="actor_infer")
    engine = infer.workers[0].engine
    request = Request("r0", [5, 6])
    handle = infer.submit_request(request)
    assert engine.submitted.wait(30)
    request.prompt_ids.append(99)  # the caller reuses its list after the submit (over Ray: the engine has a copy)
    engine.release()
    out = handle.result(timeout=30)
    assert engine.held[0][0].prompt_ids == [5, 6]  # old: [5, 6, 99]
    assert out.prompt_ids == [5, 6] and out.token_ids == [7, 8]
    out.token_ids.append(0)
    out.prompt_ids.append(0)
    assert engine.reply == [7, 8]  # old: the engine's own reply list grew
    assert handle.result(timeout=30).token_ids == [7, 8]  # every read is the engine's answer
    assert infer._inflight == [0]


# ---- GiGPO anchor states of array states ----------------------------------------------------------------------


def _board(cell: int, value: int, size: int = 2000) -> np.ndarray:
    b = np.zeros(size, dtype=np.int64)
    b[cell] = value
    return b


def test_info_state_key_tells_large_boards_apart_and_keeps_equal_states_together() -> None:
    from roll_core.agentic.observation import info_state_key

    a, b = _board(1000, 1), _board(1000, 2)
    assert str(a) == str(b)  # the premise: NumPy prints both as "[0 0 0 ... 0 0 0]"
    assert info_state_key(a) != info_state_key(b)
    assert info_state_key(a) == info_state_key(_board(1000, 1))  # equal arrays built apart: one key
    assert info_state_key({"grid": a, "turn": 1}) != info_state_key({"grid": b, "turn": 1})
    assert info_state_key([a, "x"]) == info_state_key([_board(1000, 1), "x"])
    strided = np.arange(4000)[::2]
    assert info_state_key(strided) == info_state_key(strided.copy())
    assert info_state_key(a) != info_state_key(a.astype(np.int32))  # dtype counts
    assert info_state_key(a) != info_state_key(a.reshape(40, 50))  # shape counts
    assert info_state_key(torch.zeros(2000)) != info_state_key(torch.zeros(2000).index_fill(0, torch.tensor([1000]), 1))
    assert info_state_key(torch.ones(3, dtype=torch.bfloat16)) == info_state_key(torch.ones(3, dtype=torch.bfloat16))
    obj = np.array(["p", None], dtype=object)
    assert info_state_key(obj) == info_state_key(np.array(["p", None], dtype=object))
    # states without arrays key as their text, as before (a list and a tuple print differently)
    assert info_state_key("3,4") == "3,4" and info_state_key([1, 2]) == "[1, 2]" and info_state_key((1, 2)) == "(1, 2)"
    assert info_state_key(("a",)) == "('a',)" and info_state_key({"k": [1]}) == "{'k': [1]}"
    assert info_state_key((a,)).startswith("(array(") and info_state_key((a,)).endswith(",)")


class _TwoTokens:
    def __init__(self, tokenizer: Any) -> None:
        self.ids = tokenizer("a", add_special_tokens=False)["input_ids"][:1] * 2

    def submit_request(self, request: Any, route_key: str | None = None) -> Future:
        from roll_core.interfaces import RequestOutput

        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, list(self.ids), [-0.5, -0.5], "stop"))
        return fut


class _BigBoard:
    """A 2,000-cell board that reads the same to the model every turn; the first instance's first move writes 1
    into its middle cell, the second's writes 2 (two different states after turn one)."""

    def __init__(self, branch: int) -> None:
        self.branch, self.steps = branch, 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.steps = 0
        return "the board", {"state": np.zeros(2000, dtype=np.int64)}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        state = _board(1000, 1 + self.branch)
        return "the board", float(self.steps == 2), self.steps == 2, False, {"state": state}


def test_rollout_keys_array_states_by_their_bytes() -> None:
    from roll_core.agentic.chat import TurnTemplate
    from roll_core.agentic.env_manager import EnvManager
    from roll_core.agentic.rollout import AgenticRollout, EpisodeLimits
    from roll_core.interfaces import SamplingParams
    from roll_core.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    branches = iter(range(2))
    envs = EnvManager(lambda: _BigBoard(next(branches)), 2, step_timeout_s=30.0)
    try:
        rollout = AgenticRollout(_TwoTokens(tok), envs, TurnTemplate(tok, "Play."), tok, EpisodeLimits(4, 2048, 8))
        trajs = [rollout.episode(slot, 7, 0, SamplingParams(max_new_tokens=8)) for slot in range(2)]
    finally:
        envs.close()
    assert [t.turns for t in trajs] == [2, 2]
    (a0, a1), (b0, b1) = (t.state_keys for t in trajs)
    assert a0 == b0  # both acted first on the empty board: one step group
    assert a1 != b1  # old: "[0 0 0 ... 0 0 0]" for both, one step group for two different boards


# ---- on_failure: drop ----------------------------------------------------------------------------------------


def _episodes() -> list[Any]:
    from roll_core.agentic.trajectory import Trajectory

    ok = Trajectory(env_seed=0, group=0, prompt_ids=[1])
    ok.turn_rewards, ok.end, ok.success = [0.0, 1.0], "terminated", True
    failed = Trajectory(env_seed=1, group=0, prompt_ids=[1])
    failed.turn_rewards, failed.end = [0.25, 0.0], "env_error"
    return [ok, failed]


def test_drop_leaves_failed_episodes_unscored_and_out_of_the_reward_metrics() -> None:
    from roll_core.pipelines.collectors.episodes import episode_metrics, score_failures

    trajs = _episodes()
    assert score_failures(SimpleNamespace(on_failure="drop", failure_reward=-1.0), trajs) is True
    assert trajs[1].turn_rewards == [0.25, 0.0]  # old: [0.25, -1.0]
    m = episode_metrics(trajs, None, None, drop_failures=True)
    assert m["reward/mean"] == 1.0 and m["reward/std"] == 0.0  # old: (1.0 + -0.75) / 2 = 0.125
    assert m["episode/success_rate"] == 1.0 and m["episode/turns_mean"] == 2.0  # old success: 0.5
    assert m["episode/end_env_error"] == 0.5 and m["episode/end_terminated"] == 0.5  # end reasons: every episode

    scored = _episodes()
    assert score_failures(SimpleNamespace(on_failure="score", failure_reward=-1.0), scored) is False
    assert scored[1].turn_rewards == [0.25, -1.0]
    m = episode_metrics(scored, None, None)
    assert m["reward/mean"] == pytest.approx((1.0 - 0.75) / 2) and m["episode/success_rate"] == 0.5
