"""Agentic episodes whose observations are pictures, on the tiny random Qwen2.5-VL (builtin:tiny-qwen2.5-vl).

What runs: the visual FrozenLake (roll_envs.agentic.visual) in the env manager, the agentic rollout loop with the
vision turn template, and the hf inference engine in this process (its continuous batcher: the request path vLLM
and SGLang serve), then a teacher-forced transformers forward of the whole trajectories with their pictures and
3D rotary positions, and a short `pipeline=agentic env=visual_frozen_lake` training run.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch

from roll_core.testing import run_pipeline
from roll_core.testing.infer_engine import RequestsOf

VLM = "builtin:tiny-qwen2.5-vl"


class Recorded(RequestsOf):
    """The request API over one in-process engine, keeping every request it passes on."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.requests: list[Any] = []

    def submit_request(self, request: Any, route_key: str | None = None) -> Any:
        self.requests.append(request)
        return super().submit_request(request, route_key)


def _blocks(ids: list[int], vision: Any) -> list[int]:
    """Placeholder run lengths, one per picture block, in order."""
    out, run = [], 0
    for t in [*ids, -1]:
        if t == vision.image_token_id:
            run += 1
        elif run:
            out, run = [*out, run], 0
    return out


def test_visual_episodes_carry_every_picture_and_their_logprobs_are_the_models() -> None:
    """Two-to-three-turn episodes: each turn's request carries every picture of its prompt (one placeholder block
    per picture, digests in order, a prefix of the trajectory's), the trajectory's pictures match its ids, and
    the behaviour log-probs equal a teacher-forced forward of the whole trajectories with their pictures and
    mrope positions (the model's own get_rope_index) to 1e-4."""
    from transformers import AutoModelForImageTextToText

    from roll_core.agentic.chat import TurnTemplate
    from roll_core.agentic.env_manager import EnvManager
    from roll_core.agentic.rollout import AgenticRollout, EpisodeLimits
    from roll_core.agentic.trajectory import to_tensors
    from roll_core.interfaces import SamplingParams
    from roll_core.models import resolve_model_path
    from roll_core.multimodal import VisionProcessor, check_tokens, merge, mrope_positions
    from roll_engines.infer.hf import HFInferEngine
    from roll_envs.agentic.visual import VisualFrozenLakeEnv

    path = resolve_model_path(VLM)
    vision = VisionProcessor(path)
    tok = vision.tokenizer
    budget = 6
    engine = HFInferEngine(path, max_new_tokens=budget)
    infer = Recorded(engine)
    envs = EnvManager(partial(VisualFrozenLakeEnv, cell_px=14), 0)  # 4 picture tokens a picture
    template = TurnTemplate(tok, "Walk to G.", vision=vision)
    rollout = AgenticRollout(infer, envs, template, tok, EpisodeLimits(3, 1024, budget))
    params = SamplingParams(max_new_tokens=budget, temperature=1.0, ignore_eos=True, seed=3)
    try:
        trajs = rollout.run([1, 1, 2], [0, 0, 1], params)
    finally:
        engine.shutdown()
        envs.close()
    assert max(t.turns for t in trajs) >= 2 and all(t.end in ("max_turns", "terminated", "image_token") for t in trajs)
    assert trajs[0].prompt_ids == trajs[1].prompt_ids and trajs[0].mm.digests[0] == trajs[1].mm.digests[0]
    by_episode: dict[str, list[Any]] = {}
    for r in infer.requests:
        by_episode.setdefault(r.request_id.rsplit("-turn-", 1)[0], []).append(r)
    # one request per turn (and one for a turn cut because it sampled a picture placeholder)
    assert sorted(len(v) for v in by_episode.values()) == sorted(t.turns + (t.end == "image_token") for t in trajs)
    for t in trajs:
        assert t.mm.num_images == len(_blocks(t.context(), vision)) >= t.turns
        assert _blocks(t.context(), vision) == t.mm.tokens_per_image
        check_tokens(t.context(), t.mm, vision.image_token_id)
    for reqs in by_episode.values():
        traj = next(t for t in trajs if t.context()[: len(reqs[-1].prompt_ids)] == reqs[-1].prompt_ids)
        for k, r in enumerate(reqs):  # turn k's prompt holds the first k+1 pictures, exactly
            assert r.mm.num_images == k + 1 and r.mm.digests == traj.mm.digests[: k + 1]
            check_tokens(r.prompt_ids, r.mm, vision.image_token_id, r.request_id)
    batch = to_tensors(trajs, tok.pad_token_id or 0)
    pictures = merge(batch["mm_inputs"])
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ids, attn = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        pos = mrope_positions(model, ids, attn, pictures, vision.image_token_id)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, **pictures.tensors).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    p = batch["prompts"].shape[1]
    teacher = logp[:, p - 1 :]
    mask = batch["response_mask"].bool()
    assert int(mask.sum()) == sum(t.turns for t in trajs) * budget
    torch.testing.assert_close(teacher[mask], batch["behaviour_logprobs"][mask], atol=1e-4, rtol=0)


def test_visual_agentic_training_runs(tmp_path: Path) -> None:
    """`pipeline=agentic env=visual_frozen_lake model.path=builtin:tiny-qwen2.5-vl`, two GRPO steps: the trainer
    takes the trajectories' pictures and recomputes the engine's log-probs on every sampled token."""
    _, history = run_pipeline(
        [
            "experiment=vlm_agentic",
            "pipeline.max_steps=2",
            "pipeline.eval_every=0",
            "pipeline.progress=false",
            f"pipeline.output_dir={tmp_path}",
        ]
    )
    steps = [h for h in history if h["step"] > 0]
    assert len(steps) == 2 and all(h["data/dropped_episodes"] == 0 for h in steps)
    assert all(h["episode/turns_mean"] > 1 for h in steps)
    assert max(h["actor/train_infer_logprob_diff"] for h in steps) < 1e-4


def test_a_turn_that_samples_a_picture_placeholder_is_cut_and_ends_the_episode() -> None:
    """A policy that samples the picture placeholder token (weights set so that it always does): the token stops
    the turn at once (it is a stop token of every turn), the turn is cut (its ids could be neither trained on nor
    sent back without a picture) and the episode ends with `image_token`, nothing sent to the environment."""
    from roll_core.agentic.chat import TurnTemplate
    from roll_core.agentic.env_manager import EnvManager
    from roll_core.agentic.rollout import AgenticRollout, EpisodeLimits
    from roll_core.interfaces import SamplingParams
    from roll_core.models import resolve_model_path
    from roll_core.multimodal import VisionProcessor
    from roll_engines.infer.hf import HFInferEngine
    from roll_envs.agentic.visual import VisualFrozenLakeEnv

    path = resolve_model_path(VLM)
    vision = VisionProcessor(path)
    engine = HFInferEngine(path, max_new_tokens=6)
    # Layers add nothing, every text embedding has +1 in dimension 0, the final norm keeps only that dimension
    # and only the placeholder's output row reads it: the placeholder's logit is large and positive everywhere.
    weights = {}
    for name, w in engine.model.state_dict().items():
        if "language_model" in name and name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(w)
        elif name.endswith("language_model.embed_tokens.weight"):
            weights[name] = torch.cat([torch.ones_like(w[:, :1]), w[:, 1:]], dim=1)
        elif name.endswith("language_model.norm.weight"):
            weights[name] = torch.nn.functional.one_hot(torch.tensor(0), w.numel()).to(w.dtype)
        elif name == "lm_head.weight":
            weights[name] = torch.zeros_like(w)
            weights[name][vision.image_token_id, 0] = 50.0
    assert len(weights) == 3 + 2 * 2  # two layers
    engine.load_weights(weights)
    infer = Recorded(engine)
    envs = EnvManager(VisualFrozenLakeEnv, 0)
    rollout = AgenticRollout(
        infer, envs, TurnTemplate(vision.tokenizer, vision=vision), vision.tokenizer, EpisodeLimits(3)
    )
    try:
        (traj,) = rollout.run([4], [0], SamplingParams(max_new_tokens=6, temperature=1.0, seed=0))
    finally:
        engine.shutdown()
        envs.close()
    (request,) = infer.requests
    assert vision.image_token_id in request.params.stop_token_ids
    assert traj.end == "image_token" and traj.turns == 0 and traj.tokens == [] and traj.versions == []
    assert traj.mm.num_images == 1 and traj.state_keys == []
