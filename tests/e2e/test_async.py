"""Asynchronous training and dynamic sampling end to end on the tiny model: async GRPO learns with every trained
sample within the staleness bound, partial rollout resumes requests under new weights with nothing lost or
duplicated, dynamic sampling refills batches with informative groups, and bad combinations are config errors."""

from __future__ import annotations

import itertools
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from roll_core.interfaces import SamplingParams
from roll_core.testing import reward_curve, run_pipeline, tiny_overrides
from roll_core.testing.infer_engine import RequestsOf

sys.path.insert(0, str(Path(__file__).parent))
from engine_holds import EngineHold


# k=1 learns on Ray with partial rollout in test_learning.py; k=2 here runs the same bound further ahead. CI time:
# `nox -s full_matrix` runs k=1 here.
@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.full_matrix), 2])
def test_async_grpo_learns_within_the_staleness_bound(seven_task: Path, tmp_path: Path, k: int) -> None:
    _, history = run_pipeline(
        tiny_overrides(
            seven_task, tmp_path, "algo=grpo", f"pipeline.async_ratio={k}", "algo.off_policy_correction=token"
        )
    )
    steps = [h for h in history if h["step"] > 0]
    r = reward_curve(history)
    assert sum(r[-4:]) / 4 > sum(r[:4]) / 4 + 0.25, r
    assert all(h["async/staleness_max"] <= k for h in steps)
    assert max(h["async/staleness_max"] for h in steps) == k  # it really ran ahead
    # Samples from an older policy: the trainer's proximal log-probs differ from the behaviour ones.
    assert max(h["actor/train_infer_logprob_diff"] for h in steps) > 1e-3
    assert all(h["data/trained_groups"] == 4 for h in steps)
    epochs = [h["data/epoch"] for h in steps]  # the data drawn, ahead of the trainer by the groups in flight
    assert epochs == sorted(epochs) and epochs[0] > 0, epochs
    # Rollout throughput counts the time between batches, not the trainer's (overlapped, near-zero) wait.
    for prev, h in itertools.pairwise(steps):
        between = h["perf/response_tokens"] / h["perf/rollout_tokens_per_s"]
        assert between >= h["perf/generate_wait_seconds"] + prev["perf/time_train_actor"], (prev, h)


def test_partial_rollout_resumes_requests_and_keeps_every_token_once(tiny_model: str) -> None:
    """Requests aborted at a weight update resume with their prefix: every sample ends with exactly
    max_new_tokens tokens (EOS ignored), part of them under version 0 and part under version 1, and with unchanged
    weights the behaviour log-probs of the whole response equal a teacher-forced forward (the continuation was
    sampled after the kept prefix)."""
    from roll_core.pipelines.sampling import generation_from_samples
    from roll_core.protocol import build_sequences, pad_left
    from roll_core.scheduling.driver import AsyncRollout
    from roll_core.scheduling.scheduler import RolloutScheduler
    from roll_engines.infer.hf import HFInferEngine
    from roll_engines.train.hf import HFTrainEngine

    engine = HFInferEngine(tiny_model, max_new_tokens=300)
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}

    Infer = partial(RequestsOf, engine)  # the InferGroup request API over one in-process engine

    class Problem:  # a roll_core.interfaces.ProblemLike
        id, prompt, answer = "p", "say 7", "7"

    sched = RolloutScheduler(batch_groups=2, group_size=2, max_new_tokens=300, async_ratio=1, partial_rollout=True)
    prompts = iter([[5, 6, 7, 8], [9, 10, 11], [12, 13], [14, 15, 16, 17, 18]] * 4)
    driver = AsyncRollout(
        Infer(), sched, lambda: (Problem(), next(prompts)), SamplingParams(max_new_tokens=300, ignore_eos=True, seed=3)
    )
    hold = EngineHold(engine, tokens=5)  # the engine pauses (as a weight update does) once generation is under way
    driver.start()
    try:
        hold.wait("generation to get under way")  # held: no request can finish before the update's aborts
        under_way = hold.running(5)
        assert under_way
        sync = threading.Thread(target=driver.begin_update)
        sync.start()
        deadline = time.monotonic() + 60
        while not all(s.aborted for s in under_way):  # the update's aborts reached the held engine
            assert time.monotonic() < deadline
            time.sleep(0.01)
        hold.release()  # the engine retires the aborted requests: begin_update returns
        sync.join(60)
        assert not sync.is_alive()
        engine.load_weights(weights)  # same weights, new version: the resumed tokens must continue the prefix
        driver.finish_update()
        groups = driver.take(2) + driver.take(2)
    finally:
        driver.close()
        engine.shutdown()
    assert sched.counters["resumed_requests"] > 0
    samples = [s for g in groups for s in g.samples]
    assert all(len(s.tokens) == 300 and len(s.logprobs) == 300 for s in samples)
    resumed = [s for s in samples if len(s.segments) > 1]
    assert resumed and all((s.min_version, s.max_version) == (0, 1) for s in resumed)
    gen = generation_from_samples(groups, engine.pad_id)
    p_ids, p_mask = pad_left(gen["prompt_ids"], engine.pad_id)
    batch = build_sequences(p_ids, p_mask, gen["responses"], gen["response_mask"])
    batch.update(responses=gen["responses"], response_mask=gen["response_mask"])
    logp = HFTrainEngine(tiny_model, trainable=False, role="reference").compute_logprobs(batch)["logprobs"]
    torch.testing.assert_close(logp, gen["behaviour_logprobs"], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("async_ratio", [0, 1])
def test_dynamic_sampling_refills_the_batch_with_informative_groups(
    seven_task: Path, tmp_path: Path, async_ratio: int
) -> None:
    """Synchronous and asynchronous collectors alike (the asynchronous one did not report its refill rounds)."""
    _, history = run_pipeline(
        tiny_overrides(
            seven_task,
            tmp_path,
            "algo=grpo",
            "algo.drop_uniform_groups=true",
            "pipeline.max_steps=4",
            f"pipeline.async_ratio={async_ratio}",
        )
    )
    steps = [h for h in history if h["step"] > 0]
    # The random model mostly fails: groups without variance are dropped and more prompts are sampled.
    assert steps[0]["data/dropped_groups"] > 0 and steps[0]["data/sampled_groups"] > 4
    assert steps[0]["data/refill_rounds"] >= 1
    for h in steps:
        if h["data/refill_short_groups"] == 0:
            assert h["data/trained_groups"] == 4  # refilled to the full batch, never beyond it
        else:  # the cap was reached: it trains on what it found
            assert h["data/sampled_groups"] >= 16 and h["data/trained_groups"] == 4 - h["data/refill_short_groups"]


def test_a_resumed_async_run_trains_the_prompts_the_uninterrupted_run_would(
    seven_task: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The groups running ahead of the trainer at a checkpoint are started again first by the resumed run: it
    trained other prompts at steps 3 and 4, and the in-flight ones were never trained in that epoch."""
    from roll_core.pipelines.trainer import Trainer

    trained: dict[int, list[str]] = {}
    update = Trainer.update

    def record(self, step, collected, out):
        trained[step] = list(collected.batch["problem_id"])
        return update(self, step, collected, out)

    monkeypatch.setattr(Trainer, "update", record)
    common = ["algo=grpo", "pipeline.async_ratio=1", "pipeline.save_every=2", "algo.group_size=2"]
    run_pipeline(tiny_overrides(seven_task, tmp_path / "full", *common, "pipeline.max_steps=4"))
    full = dict(trained)
    trained.clear()
    run_pipeline(tiny_overrides(seven_task, tmp_path / "resumed", *common, "pipeline.max_steps=2"))
    run_pipeline(
        tiny_overrides(seven_task, tmp_path / "resumed", *common, "pipeline.max_steps=4", "pipeline.resume=true")
    )
    assert sorted(trained) == [1, 2, 3, 4]
    assert trained == full


def test_a_prompt_that_fills_the_engines_context_is_skipped_and_replaced(tmp_path: Path) -> None:
    """Every fourth prompt of 64 is ~40 tokens, the engine's context 40: the asynchronous collector drops such a
    group, counts it in data/skipped_context_prompts and starts the next one, so every step trains its 4 groups
    (one such prompt raised and ended the run; the synchronous collector always skipped them). The take that
    replaces it is no refill round: data/refill_rounds counted it with dynamic sampling off, unlike the synchronous
    collector's (dynamic sampling's refills only)."""
    import json

    rows = [
        {"prompt": f"Q{i}: please think about this carefully say 7" if i % 4 == 0 else f"Q{i}: say 7", "answer": "7"}
        for i in range(64)
    ]
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = ("pipeline.async_ratio=1", "pipeline.max_steps=3", "infer_engine.max_model_len=40")
    _, history = run_pipeline(tiny_overrides(data, tmp_path / "run", *extra))
    steps = [h for h in history if h["step"] > 0]
    assert [h["data/trained_groups"] for h in steps] == [4, 4, 4]
    assert sum(h["data/skipped_context_prompts"] for h in steps) >= 1
    assert [(h["data/refill_rounds"], h["data/dropped_groups"]) for h in steps] == [(0, 0)] * 3


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["pipeline.partial_rollout=true"], "need asynchronous training"),
        (["pipeline.tail_groups=2"], "need asynchronous training"),
        (["pipeline.async_ratio=1", "infer_engine.sleep_level=1"], "set infer_engine.sleep_level=0"),
        (["pipeline.async_ratio=-1"], "pipeline.async_ratio=-1 must be >= 0"),
        (["algo.refill_oversample=0.5"], "must be >= 1"),
        # a resumed response is a new request over prompt + prefix: a grammar would restart, a split stop string
        # go unseen (a constrained 8-digit answer came out as 11 digits)
        (
            ["pipeline.async_ratio=1", "pipeline.partial_rollout=true", "+infer_engine.structured.regex='[0-9]{8}'"],
            r"cannot resume a response under infer_engine\.structured",
        ),
        (
            ["pipeline.async_ratio=1", "pipeline.partial_rollout=true", "infer_engine.stop=['</answer>']"],
            r"cannot resume a response under infer_engine\.stop",
        ),
    ],
)
def test_bad_async_settings_are_config_errors(seven_task: Path, tmp_path: Path, extra: list[str], message: str) -> None:
    with pytest.raises(Exception, match=message):
        run_pipeline(tiny_overrides(seven_task, tmp_path, *extra))


def test_a_vision_policy_stops_at_a_sampled_picture_placeholder_so_its_aborted_responses_resume() -> None:
    """Partial rollout with a vision-language policy that samples picture placeholders (biased to, here): its async
    sampling stops on them (stop_at_pictures), so no aborted prefix holds one; a prefix that did made the engine
    refuse the resumed request, and the rollout thread died."""
    from PIL import Image

    from roll_core.models import resolve_model_path
    from roll_core.multimodal import VisionProcessor, as_content
    from roll_core.pipelines.collectors.prompts_async import stop_at_pictures
    from roll_core.scheduling.driver import AsyncRollout
    from roll_core.scheduling.scheduler import RolloutScheduler
    from roll_engines.infer.hf import HFInferEngine

    path = resolve_model_path("builtin:tiny-qwen2.5-vl")
    vp = VisionProcessor(path)
    engine = HFInferEngine(path, max_new_tokens=32, max_num_seqs=8)
    picture = Image.fromarray(torch.randint(0, 200, (40, 60, 3), dtype=torch.uint8).numpy(), "RGB")
    ids, mm = vp.encode_messages([{"role": "user", "content": as_content("what colour? <image>", 1)}], [picture])
    engine.model.get_output_embeddings().register_forward_hook(
        lambda _m, _i, out: out.index_add_(-1, torch.tensor([vp.image_token_id]), torch.full((*out.shape[:-1], 1), 2.5))
    )

    class Problem:
        id, prompt, answer = "p", "x", "7"

    sched = RolloutScheduler(batch_groups=1, group_size=4, max_new_tokens=32, async_ratio=1, partial_rollout=True)
    params = stop_at_pictures(SamplingParams(max_new_tokens=32, ignore_eos=True, seed=0), vp.tokenizer)
    assert vp.image_token_id in params.stop_token_ids
    driver = AsyncRollout(RequestsOf(engine), sched, lambda: (Problem(), ids, mm), params)
    hold = EngineHold(engine, tokens=6)
    driver.start()
    try:
        hold.wait("generation to get under way")
        under_way = hold.running(6)
        sync = threading.Thread(target=driver.begin_update)
        sync.start()
        deadline = time.monotonic() + 60
        while not all(s.aborted for s in under_way):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        hold.release()
        sync.join(60)
        driver.finish_update()
        groups = driver.take(1) + driver.take(1)
    finally:
        driver.close()
        engine.shutdown()
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 8 and sum(vp.image_token_id in s.tokens for s in samples) > 0  # it did sample them
    assert all(vp.image_token_id not in s.tokens[:-1] for s in samples)  # only as a last, stopping token
