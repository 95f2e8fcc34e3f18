"""Multi-turn training on hand-built trajectories (mask holes at observations): the trainer's log-probs equal a
plain transformers forward on every assistant token, and nothing at an observation or padding position is trained
(garbage advantages there change no gradient)."""

from __future__ import annotations

import torch

from roll_core.agentic.trajectory import Trajectory, to_tensors
from roll_core.models import resolve_model_path
from roll_core.pipelines.objectives import PolicyObjective


def _batch() -> dict[str, torch.Tensor]:
    a = Trajectory(env_seed=1, group=0, prompt_ids=[5, 6, 7])
    a.add_response([10, 11], [0.0, 0.0])
    a.turn_rewards.append(0.0)
    a.add_observation([20, 21, 22])
    a.add_response([12, 13, 14], [0.0, 0.0, 0.0])
    a.turn_rewards.append(1.0)
    b = Trajectory(env_seed=1, group=0, prompt_ids=[8])
    b.add_response([15], [0.0])
    b.turn_rewards.append(0.0)
    b.add_observation([23])
    b.add_response([16, 17], [0.0, 0.0])
    b.turn_rewards.append(0.0)
    t = to_tensors([a, b], pad_id=0)
    return {k: v for k, v in t.items() if isinstance(v, torch.Tensor)}


def test_multi_turn_logprobs_and_gradients_respect_the_holes() -> None:
    from transformers import AutoModelForCausalLM

    from roll_engines.train.hf import HFTrainEngine

    path = resolve_model_path("builtin:tiny")
    batch = _batch()
    mask = batch["response_mask"]
    assert mask.tolist() == [[1, 1, 0, 0, 0, 1, 1, 1], [1, 0, 1, 1, 0, 0, 0, 0]]
    engine = HFTrainEngine(path, lr=1e-2, micro_batch_size=1)
    logp = engine.compute_logprobs(batch)["logprobs"]

    # Reference: one transformers forward per trajectory over its exact ids (prompt, responses, observations).
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    for i in range(2):
        keep = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][keep]
        with torch.no_grad():
            ref = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
        start = int((batch["prompts"][i] != 0).sum())  # this row's prompt length (prompts are left-padded with 0)
        n = int(keep.sum()) - start  # tokens after the prompt (responses and observations)
        expected = ref[start - 1 : start - 1 + n].gather(-1, ids[start:, None]).squeeze(-1)
        got = logp[i, :n]
        m = mask[i, :n].bool()
        torch.testing.assert_close(got[m], expected[m], atol=1e-5, rtol=1e-5)

    # Nothing but assistant tokens is trained: advantages and behaviour log-probs at holes and padding are ignored.
    objective = PolicyObjective(agg="token-mean")
    batch["old_logprobs"] = logp.detach() * mask
    batch["advantages"] = torch.tensor([[1.0] * 8, [-1.0] * 8]) * mask
    clean = engine.compute_gradients(dict(batch), objective)
    dirty = dict(batch)
    dirty["advantages"] = torch.where(mask.bool(), batch["advantages"], torch.full_like(batch["advantages"], 1e6))
    dirty["old_logprobs"] = torch.where(mask.bool(), batch["old_logprobs"], torch.full_like(logp, -50.0))
    grads = engine.compute_gradients(dirty, objective)
    assert set(grads) == set(clean) and any(g.abs().sum() > 0 for g in clean.values())
    for name, g in clean.items():
        torch.testing.assert_close(grads[name], g, msg=name)
