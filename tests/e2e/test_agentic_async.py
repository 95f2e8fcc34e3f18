"""Asynchronous agentic training: episodes generated ahead of the trainer, turns resumed across weight syncs.

What runs: the hf inference engine in this process (its continuous batcher, the same request path vLLM and
SGLang serve), the TurnGate of roll_core.agentic.rollout, the asynchronous episodes collector and the trainer.
"""

from __future__ import annotations

import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from roll_core.testing import reward_curve, run_pipeline
from roll_core.testing.infer_engine import RequestsOf

sys.path.insert(0, str(Path(__file__).parent))  # agentic_toy: env=py:agentic_toy:<Class>
from agentic_toy import SAY_DIGIT_OVERRIDES, SayDigit
from engine_holds import EngineHold


def test_a_turn_aborted_at_a_sync_resumes_and_keeps_every_token_once(tiny_model: str) -> None:
    """A weight sync in the middle of long turns: with partial rollout the running turns are aborted and resumed
    under the new version. Every turn still has exactly its token budget (EOS ignored), the episode keeps its
    earlier turns, the resumed turns carry version 0 (their oldest token), and with unchanged weights the
    behaviour log-probs of the whole trajectory equal a teacher-forced forward: no token was lost or repeated."""
    from transformers import AutoTokenizer

    from roll_core.agentic.chat import TurnTemplate
    from roll_core.agentic.env_manager import EnvManager
    from roll_core.agentic.rollout import AgenticRollout, EpisodeLimits, TurnGate
    from roll_core.agentic.trajectory import to_tensors
    from roll_core.interfaces import SamplingParams
    from roll_engines.infer.hf import HFInferEngine
    from roll_engines.train.hf import HFTrainEngine

    budget = 120
    engine = HFInferEngine(tiny_model, max_new_tokens=budget)
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}

    Infer = partial(RequestsOf, engine)  # the InferGroup request API over one in-process engine

    tok = AutoTokenizer.from_pretrained(tiny_model)
    gate = TurnGate(Infer(), partial_rollout=True)
    envs = EnvManager(lambda: SayDigit(turns=2), 0)
    rollout = AgenticRollout(Infer(), envs, TurnTemplate(tok), tok, EpisodeLimits(2, 1024, budget), gate)
    params = SamplingParams(max_new_tokens=budget, ignore_eos=True, seed=3)
    result: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: result.update(trajs=rollout.run([1, 1, 2, 2], [0, 0, 1, 1], params)))
    # The engine pauses (as a weight update does) once the four episodes' first turns are under way: held at the
    # first one, an episode whose first request came late (a loaded CI machine) ran wholly after the sync.
    hold = EngineHold(engine, tokens=5, count=4)
    try:
        worker.start()
        deadline = time.monotonic() + 60
        hold.wait("the first turns to get under way")  # held: no turn can finish before the sync's aborts reach it

        def mid_turn() -> list[Any]:
            return hold.running(5)

        assert mid_turn()
        sync = threading.Thread(target=gate.begin_update)
        sync.start()
        while not all(s.aborted for s in mid_turn()):  # the gate's aborts reached the held engine
            assert time.monotonic() < deadline
            time.sleep(0.01)
        engine.finish_weight_update()  # ends the hold: the engine retires the aborted turns, begin_update returns
        sync.join(60)
        assert not sync.is_alive()
        engine.load_weights(weights)  # same weights, new version: the resumed tokens must continue the prefix
        gate.finish_update(1)
        worker.join(120)
    finally:
        engine.shutdown()
        envs.close()
    trajs = result["trajs"]
    assert sum(t.resumed_turns for t in trajs) > 0
    for t in trajs:
        assert t.turns == 2 and t.end == "terminated", t
        assert t.turn_ids.count(0) == budget and t.turn_ids.count(1) == budget  # each turn: exactly its budget
        assert len(t.versions) == 2 and t.min_version == 0
    assert any(t.versions == [0, 1] for t in trajs)  # a turn admitted after the sync runs under the new version
    batch = to_tensors(trajs, tok.pad_token_id or 0)
    logp = HFTrainEngine(tiny_model, trainable=False, role="reference").compute_logprobs(batch)["logprobs"]
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(logp[mask], batch["behaviour_logprobs"][mask], atol=2e-4, rtol=1e-4)


def test_async_agentic_grpo_learns_within_the_staleness_bound(tmp_path: Path) -> None:
    """pipeline=agentic pipeline.async_ratio=1 with partial rollout and decoupled PPO learns the toy task; every
    trained episode is at most one version old, some are exactly one (generation ran ahead), and none is
    dropped."""
    summary, history = run_pipeline(
        [
            *SAY_DIGIT_OVERRIDES,
            "env.eval_size=8",
            "algo=grpo",
            "algo.group_size=8",
            "algo.lr=1e-2",
            "algo.off_policy_correction=token",
            "pipeline.rollout_batch_size=4",
            "pipeline.max_steps=12",
            "pipeline.async_ratio=1",
            "pipeline.partial_rollout=true",
            "pipeline.eval_every=12",
            "pipeline.progress=false",
            f"pipeline.output_dir={tmp_path}",
            "train_engine.micro_batch_size=16",
        ]
    )
    steps = [h for h in history if h["step"] > 0]
    r = reward_curve(history)
    assert sum(r[-4:]) / 4 > sum(r[:4]) / 4 + 0.2, r
    assert max(h["async/staleness_max"] for h in steps) == 1.0
    assert all(h["data/trained_groups"] == 4 and h["data/dropped_episodes"] == 0 for h in steps)
    assert summary["final_eval_accuracy"] is not None
