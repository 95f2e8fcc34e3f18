"""The hf inference engine's inputs: prompts it cannot encode are refused to their caller without failing the
running batch, one whose prefill fails all the same fails alone, checkpoints whose tokenizer lacks pad/EOS ids
still generate, and the context limit is the one configured where the model declares none."""

from __future__ import annotations

import logging
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from roll_core.interfaces import Request, SamplingParams
from roll_core.testing import reference_greedy
from roll_engines.infer import _batcher
from roll_engines.infer.hf import HFInferEngine

LONG = SamplingParams(temperature=1.0, max_new_tokens=300, ignore_eos=True, seed=4)


def _running(engine: HFInferEngine, request_id: str) -> None:
    """Wait until `request_id` is in the running batch with tokens, then pause the engine (nothing steps)."""
    deadline = time.monotonic() + 60
    while not any(s.request.request_id == request_id and s.tokens for s in engine.batcher.running):
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.005)
    engine.begin_weight_update()


@pytest.mark.parametrize("bad", [[], [5, 99], [-1, 5]], ids=["empty", "past-vocab", "negative"])
def test_a_prompt_the_model_cannot_encode_is_refused_and_the_running_batch_goes_on(tiny: str, bad: list[int]) -> None:
    """An id past the vocabulary (the tiny model has 99 tokens) made the prefill raise, which failed every request
    in the running batch (on CUDA: a device-side assert); an empty prompt was sampled from a row that attends to
    nothing (a garbage response, or with no other prompt a failed batch)."""
    engine = HFInferEngine(tiny)
    try:
        fut = engine.submit(Request("bg", [5, 6, 7], LONG))
        _running(engine, "bg")
        try:
            with pytest.raises(ValueError, match="request 'bad'"):
                engine.submit(Request("bad", bad, SamplingParams(max_new_tokens=4)))
        finally:
            engine.finish_weight_update()
        with pytest.raises(ValueError, match="prompt 1 "):
            engine.generate([[5, 6], bad], SamplingParams(max_new_tokens=4, seed=0))
        out = fut.result(timeout=120)
        assert out.finish_reason == "length" and len(out.token_ids) == 300
        # The engine still serves: the refused prompt left nothing behind.
        assert engine.generate([[5, 6]], SamplingParams(max_new_tokens=3, seed=0)).response_mask.sum() == 3
        assert not engine.batcher.has_work()
    finally:
        engine.shutdown()


def test_the_batcher_itself_fails_only_an_empty_prompts_request(tiny: str) -> None:
    """Past the engine's check (a caller of the batcher's own queue): the empty prompt's request fails alone and a
    prompt admitted with it samples what it samples alone (the empty row was sampled from a row attending to
    nothing; alone, its prefill of width 0 raised and failed the batch)."""
    engine = HFInferEngine(tiny)
    try:
        greedy = SamplingParams(temperature=0, max_new_tokens=5)
        good = engine._prepare(Request("good", [5, 6, 7], greedy))
        empty = engine._prepare(Request("e", [5], greedy))
        empty.request.prompt_ids = []
        lone = engine._prepare(Request("e2", [5], greedy))
        lone.request.prompt_ids = []
        with engine._lock:
            engine.batcher.add(lone)
            engine.batcher.step()
            assert not engine.batcher.has_work()
            engine.batcher.add(empty)
            engine.batcher.add(good)
            while engine.batcher.has_work():
                engine.batcher.step()
        for seq in (lone, empty):
            with pytest.raises(ValueError, match="empty prompt"):
                seq.future.result(timeout=0)
        assert good.future.result(timeout=0).token_ids == reference_greedy(tiny, [5, 6, 7], 5)[0]
    finally:
        engine.shutdown()


def test_a_tokenizer_without_pad_and_eos_ids_still_generates(tiny: str, tmp_path: Path) -> None:
    """Padding fell back to the tokenizer's EOS only: with neither declared, every prefill raised (torch.full of
    None) and `pad_id` too. The generation config's EOS pads now; padding is masked, so results are unchanged."""
    from transformers import AutoTokenizer

    shutil.copytree(tiny, tmp_path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tiny)
    tok.pad_token, tok.eos_token = None, None
    tok.save_pretrained(tmp_path)
    engine = HFInferEngine(str(tmp_path))
    try:
        assert engine.tokenizer.pad_token_id is None and engine.tokenizer.eos_token_id is None
        # generation_config.json's pad (the model config's) pads, its EOS stops
        assert engine.pad_id == engine.model.generation_config.pad_token_id == 0 and engine.eos_ids == {2}
        greedy = SamplingParams(temperature=0, max_new_tokens=6)
        out = engine.generate([[5, 6], [7, 8, 9, 10]], greedy)  # rows of different lengths: left padding
        for i, prompt in enumerate([[5, 6], [7, 8, 9, 10]]):
            ref, _ = reference_greedy(tiny, prompt, 6)
            assert out.responses[i][out.response_mask[i].bool()].tolist() == ref
    finally:
        engine.shutdown()


def test_max_model_len_is_honoured_where_the_model_declares_no_limit(
    tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config without max_position_embeddings (a state-space model's, a remote-code one's) capped the context at
    4096 whatever max_model_len said: longer prompts finished as prompt_too_long, silently."""
    from transformers import AutoModelForCausalLM

    load = AutoModelForCausalLM.from_pretrained

    def undeclared(*args: object, **kwargs: object) -> object:
        model = load(*args, **kwargs)
        # Strict config dataclasses refuse None and fall back to a class default on `del`: the text config the
        # engine reads is swapped for one without the field, as a remote-code config without it would be.
        object.__setattr__(model.config, "get_text_config", lambda *a, **k: SimpleNamespace())
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", undeclared)
    for configured, expected in ((8192, 8192), (None, 4096)):
        engine = HFInferEngine(tiny, max_model_len=configured)
        try:
            assert engine.max_context_length == expected
        finally:
            engine.shutdown()


def test_a_max_model_len_past_the_models_limit_is_cut_with_a_warning(
    tiny: str, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import AutoConfig

    declared = AutoConfig.from_pretrained(tiny).max_position_embeddings
    with caplog.at_level(logging.WARNING, logger="roll_engines.infer.hf"):
        engine = HFInferEngine(tiny, max_model_len=declared + 100)
    try:
        assert engine.max_context_length == declared
        assert f"max_model_len={declared + 100} exceeds" in caplog.text
    finally:
        engine.shutdown()


POISON = 66  # an id of the injected failure below


def _poison(engine: HFInferEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every prefill forward that holds a prompt with POISON raise (what a bad row does to its batch)."""
    forward = engine.model.forward

    def poisoned(*args: object, input_ids: torch.Tensor | None = None, **kwargs: object) -> object:
        if input_ids is not None and input_ids.shape[1] > 1 and bool((input_ids == POISON).any()):
            raise RuntimeError("an injected per-row failure")
        return forward(*args, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(engine.model, "forward", poisoned)


@pytest.mark.parametrize("static", [False, True], ids=["continuous", "static-batching"])
def test_a_prefill_failure_fails_only_its_own_requests(
    tiny: str, monkeypatch: pytest.MonkeyPatch, static: bool
) -> None:
    """A prefill that raised failed every request admitted with it and every running one. A text prompt past the
    engine's checks is not known to fail its prefill (a picture can: test_vlm_infer), so the failure is injected:
    a forward raises whenever it holds the poisoned prompt. Only that prompt's requests (both its samples) fail,
    naming themselves; the others, and the request already decoding, give the tokens and seeded samples they give
    without it. `static`: a cache that cannot be merged (sliding windows) admits the retry's later part once the
    batch is empty."""
    if static:
        monkeypatch.setattr(_batcher, "plain_layers", lambda cache: False)
    engine = HFInferEngine(tiny, prefix_cache_mb=0)
    _poison(engine, monkeypatch)
    prompts = {"a": [5, 6, 7], "b": [8, 9], "bad": [10, POISON, 11], "c": [12, 13, 14, 15], "d": [16]}
    seeded = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)

    def run(with_bad: bool) -> dict[str, Future]:
        futs = {}
        with engine._lock:
            if not static:  # decoding while the others are admitted
                long_run = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
                futs["running"] = engine._enqueue(Request("running", [20, 21, 22], long_run))
                engine.batcher.step()
            for k, ids in prompts.items():
                for j in range(2 if with_bad or k != "bad" else 0):  # two samples of a prompt: one prefill
                    futs[f"{k}{j}"] = engine._enqueue(Request(f"{k}{j}", ids, seeded.replace(seed=j)))
            while engine.batcher.has_work():
                engine.batcher.step()
        return futs

    try:
        ref, got = run(with_bad=False), run(with_bad=True)
        for j in range(2):
            with pytest.raises(RuntimeError, match=rf"request 'bad{j}': its prefill failed \(RuntimeError: an inj"):
                got.pop(f"bad{j}").result(timeout=0)
        assert got.keys() == ref.keys()
        for k, fut in ref.items():
            assert got[k].result(timeout=0).token_ids == fut.result(timeout=0).token_ids, k
            assert got[k].result(timeout=0).logprobs == pytest.approx(fut.result(timeout=0).logprobs, abs=1e-5), k
        assert static == (not engine.batcher.mergeable)
    finally:
        engine.shutdown()


def test_a_generate_row_refused_part_way_aborts_the_rows_queued_before_it(
    tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows are queued one by one; one refused as it is queued (here: a sync that failed on another thread left the
    weights mixed just then) raised, and the rows queued before it stayed in the batch for nobody: `sleep` refused
    ("requests run") and a background loop would decode them. They are aborted before the error is raised."""
    engine = HFInferEngine(tiny)
    name = next(iter(engine._tensor_names.values()))
    add, queued = engine.batcher.add, []

    def add_then_mix(seq: _batcher.Running) -> None:
        add(seq)
        queued.append(seq)
        if len(queued) == 2:  # the third row is refused
            engine._mixed.add({name}, "a weight sync that failed part way (injected)")

    monkeypatch.setattr(engine.batcher, "add", add_then_mix)
    try:
        with pytest.raises(RuntimeError, match="mix of two versions since a weight sync that failed part way"):
            engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, seed=0), n=3)
        assert len(queued) == 2 and not engine.batcher.has_work()
        assert [s.future.result(timeout=0).finish_reason for s in queued] == ["abort", "abort"]
        engine._mixed.rewritten({name})
        monkeypatch.setattr(engine.batcher, "add", add)
        engine.sleep(1)  # nothing left running
        engine.wake_up()
        assert engine.generate([[5, 6]], SamplingParams(max_new_tokens=3, seed=0)).response_mask.sum() == 3
    finally:
        engine.shutdown()


def test_a_generate_interrupted_mid_decode_frees_its_rows_at_once(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupt (KeyboardInterrupt in the thread that drives generate) only marked the running rows aborted: with
    no background loop (generate drives the batch itself) no next step came, so they stayed in the batch holding
    their KV cache, their futures never resolved and `sleep` refused ("requests run"). They are retired at once."""
    engine = HFInferEngine(tiny, prefix_cache_mb=0)
    add, step, queued, steps = engine.batcher.add, engine.batcher.step, [], []

    def add_and_keep(seq: _batcher.Running) -> None:
        add(seq)
        queued.append(seq)

    def step_then_interrupt() -> None:
        step()
        steps.append(1)
        if len(steps) == 3:  # decoding, 4 tokens each (the first step samples a first token and decodes one)
            assert len(engine.batcher.running) == 4 and engine.batcher.kv_bytes() > 0
            raise KeyboardInterrupt

    monkeypatch.setattr(engine.batcher, "add", add_and_keep)
    monkeypatch.setattr(engine.batcher, "step", step_then_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.generate([[5, 6, 7], [8, 9]], LONG, n=2)
        assert engine._thread is None  # no background loop would step them later
        assert not engine.batcher.has_work() and engine.batcher.kv_bytes() == 0
        outs = [s.future.result(timeout=0) for s in queued]
        assert [o.finish_reason for o in outs] == ["abort"] * 4 and all(len(o.token_ids) == 4 for o in outs)
        engine.sleep(1)  # nothing left running
        engine.wake_up()
        monkeypatch.setattr(engine.batcher, "step", step)
        assert engine.generate([[5, 6]], SamplingParams(max_new_tokens=3, seed=0)).response_mask.sum() == 3
    finally:
        engine.shutdown()
