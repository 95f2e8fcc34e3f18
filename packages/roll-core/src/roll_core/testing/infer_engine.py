"""Conformance suite of `roll_core.interfaces.InferEngine`: every inference engine's tests subclass it.

Usage::

    from roll_core.testing.infer_engine import InferEngineTestSuite

    class TestMyEngine(InferEngineTestSuite):
        @classmethod
        def build_engine(cls, model_path: str, **kwargs):
            return MyEngine(model_path, **kwargs)

The suite runs on the built-in tiny model (override `model`) and checks the contract against plain transformers:
layout and masks of the batch API, greedy tokens and log-probs equal to a cache-free transformers reference,
sampled log-probs equal to the trainer's recomputation, seeded reproducibility, finish reasons, stop strings and
stop tokens, the request API (concurrent requests, joining a running batch without changing results, abort, a
running request's id refused to a second request), weight updates (outputs follow new weights; the version
increases), sleep and wake-up, and over-long prompts.
`logprob_atol` states the engine's numerical tolerance against transformers in fp32.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from roll_core.interfaces import (
    FINISH_REASONS,
    GenerateOutput,
    InferEngine,
    Request,
    SamplingParams,
    UnsupportedSamplingError,
)
from roll_core.testing import reference_greedy, teacher_forced_logprobs

PROMPTS = ["What is 1+2?", "Hi", "abc def ghi"]


class RequestsOf:
    """The InferGroup request API (`submit_request`, `abort`) over one in-process engine: what the async driver and
    the agentic rollout call, without worker groups."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def submit_request(self, request: Any, route_key: str | None = None) -> Any:
        return self.engine.submit(request)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def check_sampling(self, params: Any) -> None:
        """What InferGroup.check_sampling does on a worker: structured outputs refused where unsupported first."""
        from roll_core.interfaces.inference import check_structured

        check_structured(self.engine, params)
        self.engine.check_sampling(params)


class InferEngineTestSuite:
    """Shared tests; subclasses implement `build_engine`."""

    #: Model the suite runs on ("builtin:tiny" is built locally in seconds).
    model: ClassVar[str] = "builtin:tiny"
    #: Tolerance of reported log-probs against transformers' fp32 computation.
    logprob_atol: ClassVar[float] = 1e-4
    #: Whether `sleep(level=2)` must visibly release the weights' memory.
    releases_weights: ClassVar[bool] = True
    #: Whether `sleep(level=1)` must visibly release the KV cache.
    releases_kv_cache: ClassVar[bool] = True
    #: Whether the engine reports log-probs of top-k/top-p truncated distributions (else it must refuse them).
    supports_truncation: ClassVar[bool] = True

    @classmethod
    def build_engine(cls, model_path: str, **kwargs: Any) -> InferEngine:
        raise NotImplementedError("subclasses return an engine for model_path")

    # ---- fixtures -----------------------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, tmp_path_factory: pytest.TempPathFactory) -> str:
        import os

        from roll_core.models import resolve_model_path

        os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
        return resolve_model_path(cls.model)

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, model_path: str):
        eng = cls.build_engine(model_path, max_new_tokens=16, seed=0)
        yield eng
        eng.shutdown()

    @pytest.fixture(scope="class")
    @classmethod
    def prompts(cls, model_path: str) -> list[list[int]]:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        return [list(tok(p)["input_ids"]) for p in PROMPTS]

    # ---- the contract -------------------------------------------------------------------------------------
    def test_satisfies_protocol(self, engine: InferEngine) -> None:
        assert isinstance(engine, InferEngine)
        assert isinstance(engine.name, str) and engine.name
        assert engine.max_context_length > 16 and isinstance(engine.pad_id, int)
        engine.check_sampling(SamplingParams(temperature=0.7, stop=("x",)))
        truncated = SamplingParams(temperature=0.7, top_p=0.9, top_k=5)
        if self.supports_truncation:
            engine.check_sampling(truncated)
        else:
            with pytest.raises(UnsupportedSamplingError, match=engine.name):
                engine.check_sampling(truncated)

    def test_batch_layout_groups_and_masks(self, engine: InferEngine, prompts: list[list[int]]) -> None:
        n = 3
        out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=10, seed=1), n=n)
        assert isinstance(out, GenerateOutput)
        rows = len(prompts) * n
        assert out.responses.shape == out.logprobs.shape == out.response_mask.shape
        assert out.responses.shape[0] == rows and 1 <= out.responses.shape[1] <= 10
        assert out.responses.dtype == torch.long and out.logprobs.dtype == torch.float32
        mask = out.response_mask
        assert (mask[:, 1:] <= mask[:, :-1]).all(), "the response mask must be a prefix"
        assert (mask.sum(-1) >= 1).all()
        assert (out.logprobs[mask == 0] == 0).all() and (out.logprobs[mask == 1] <= 0).all()
        assert (out.responses[mask == 0] == engine.pad_id).all()
        assert len(out.finish_reasons) == rows and set(out.finish_reasons) <= set(FINISH_REASONS)
        lengths = mask.sum(-1)
        for i, reason in enumerate(out.finish_reasons):
            assert (reason == "length") == (int(lengths[i]) == 10 and reason != "stop")
        assert torch.equal(out.truncated, torch.tensor([r == "length" for r in out.finish_reasons]).long())

    def test_greedy_equals_transformers(self, engine: InferEngine, prompts: list[list[int]], model_path: str) -> None:
        out = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12), n=2)
        for k, prompt in enumerate(prompts):
            ref_tokens, ref_logp = reference_greedy(model_path, prompt, 12)
            for j in range(2):  # both samples of a greedy group are the reference
                row = k * 2 + j
                got = out.responses[row][out.response_mask[row].bool()].tolist()
                assert got == ref_tokens, f"prompt {k}: {got} != transformers {ref_tokens}"
                lp = out.logprobs[row][: len(got)].tolist()
                assert lp == pytest.approx(ref_logp, abs=self.logprob_atol)

    def test_greedy_reports_the_full_distribution_whatever_top_k_and_top_p(
        self, engine: InferEngine, prompts: list[list[int]], model_path: str
    ) -> None:
        """Greedy requests report log_softmax(logits) (the protocol): top-k/top-p a request carries do not truncate
        them (an evaluation that keeps its configured top_k)."""
        if not self.supports_truncation:
            pytest.skip(f"{engine.name} refuses top-k/top-p")
        ref_tokens, ref_logp = reference_greedy(model_path, prompts[0], 8)
        params = SamplingParams(temperature=0, max_new_tokens=8, top_k=2, top_p=0.3)
        out = engine.submit(Request("gk", prompts[0], params)).result(timeout=300)
        assert out.token_ids == ref_tokens
        assert out.logprobs == pytest.approx(ref_logp, abs=self.logprob_atol)

    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    def test_sampled_logprobs_equal_trainer_recomputation(
        self, engine: InferEngine, prompts: list[list[int]], model_path: str, temperature: float
    ) -> None:
        out = engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=10, seed=7), n=2)
        for row in range(out.responses.shape[0]):
            tokens = out.responses[row][out.response_mask[row].bool()].tolist()
            ref = teacher_forced_logprobs(model_path, prompts[row // 2], tokens, temperature)
            assert out.logprobs[row][: len(tokens)].tolist() == pytest.approx(ref, abs=self.logprob_atol)

    def test_a_slice_samples_what_the_whole_batch_samples_for_its_rows(
        self, engine: InferEngine, prompts: list[list[int]]
    ) -> None:
        """`first_row`: the slice of a batch that starts at row r samples, row for row, what the whole batch's call
        samples there (what lets a batch split over engines sample what one engine would)."""
        params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=21)

        def rows(out: Any) -> list[list[int]]:
            return [r[m.bool()].tolist() for r, m in zip(out.responses, out.response_mask)]

        whole = rows(engine.generate(prompts[:3], params, n=2))
        assert rows(engine.generate(prompts[1:3], params, n=2, first_row=2)) == whole[2:]
        assert rows(engine.generate(prompts[2:3], params, n=2, first_row=4)) == whole[4:]

    def test_seeded_sampling_is_reproducible(self, engine: InferEngine, prompts: list[list[int]]) -> None:
        a = engine.generate(prompts[:1], SamplingParams(max_new_tokens=10, seed=11), n=4)
        b = engine.generate(prompts[:1], SamplingParams(max_new_tokens=10, seed=11), n=4)
        c = engine.generate(prompts[:1], SamplingParams(max_new_tokens=10, seed=12), n=4)
        assert torch.equal(a.responses, b.responses) and not torch.equal(a.responses, c.responses)
        assert len({tuple(r.tolist()) for r in a.responses}) > 1, "the n samples of a prompt must differ"

    def test_stop_tokens_and_stop_strings(self, engine: InferEngine, prompts: list[list[int]], model_path: str) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        ref, _ = reference_greedy(model_path, prompts[0], 12)
        # Stop token: the greedy response's 4th token ends it there (kept, mask 1).
        out = engine.generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(ref[3],)))
        got = out.responses[0][out.response_mask[0].bool()].tolist()
        assert got == ref[: ref.index(ref[3]) + 1] and out.finish_reasons == ["stop"]
        # ignore_eos ignores the model's EOS only: a stop token still ends the response.
        greedy_past_eos = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(ref[3],), ignore_eos=True)
        out = engine.generate(prompts[:1], greedy_past_eos)
        got = out.responses[0][out.response_mask[0].bool()].tolist()
        assert got == ref[: ref.index(ref[3]) + 1] and out.finish_reasons == ["stop"]
        # Stop string: text of tokens 2..3 of the greedy response; the response ends at the completing token.
        stop = tok.decode(ref[2:4])
        out = engine.generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=12, stop=(stop,)))
        got = out.responses[0][out.response_mask[0].bool()].tolist()
        assert stop in tok.decode(got) and stop not in tok.decode(got[:-1]), (stop, tok.decode(got))
        assert out.finish_reasons == ["stop"]

    def test_request_api_concurrent_and_abort(self, engine: InferEngine, prompts: list[list[int]]) -> None:
        long = SamplingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True, seed=3)
        # Paused (as during a weight sync) nothing advances, so the abort lands whatever the engine's speed.
        engine.begin_weight_update()
        futures = {f"r{i}": engine.submit(Request(f"r{i}", prompts[i % 3], long)) for i in range(4)}
        time.sleep(0.1)
        try:
            assert engine.abort("r1") is True
            assert engine.abort("no-such-request") is False
        finally:
            engine.finish_weight_update()
        results = {rid: f.result(timeout=300) for rid, f in futures.items()}
        assert results["r1"].finish_reason == "abort" and len(results["r1"].token_ids) < 400
        assert len(results["r1"].token_ids) == len(results["r1"].logprobs)
        for rid in ("r0", "r2", "r3"):
            assert results[rid].finish_reason == "length" and len(results[rid].token_ids) == 400
            assert results[rid].prompt_ids == prompts[int(rid[1]) % 3]
        assert engine.abort("r0") is False  # finished requests cannot be aborted
        # A running request aborted mid-way keeps what it generated (tokens and their log-probs).
        fut = engine.submit(Request("mid", prompts[0], long))
        deadline = time.monotonic() + 30
        while not fut.done() and time.monotonic() < deadline:
            time.sleep(0.01)
            if engine.abort("mid"):
                break
        out = fut.result(timeout=300)
        assert len(out.token_ids) == len(out.logprobs)
        assert out.finish_reason == "abort" or len(out.token_ids) == 400

    def test_a_running_request_id_is_refused_and_the_first_stays_abortable(
        self, engine: InferEngine, prompts: list[list[int]]
    ) -> None:
        """A second request under the id of one still running is refused with a ValueError (raised by `submit` or
        on its future): `abort` names requests by id and could reach only one of the two. The first runs on and
        aborts; the id is free again once its request resolved."""
        long = SamplingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True, seed=3)
        first = engine.submit(Request("dup", prompts[0], long))
        with pytest.raises(ValueError, match=r"request id 'dup' is already running"):
            engine.submit(Request("dup", prompts[1], long)).result(timeout=300)
        assert engine.abort("dup") is True
        out = first.result(timeout=300)
        assert out.finish_reason == "abort" and len(out.token_ids) < 400 and out.prompt_ids == prompts[0]
        again = engine.submit(Request("dup", prompts[1], SamplingParams(max_new_tokens=3, ignore_eos=True)))
        assert again.result(timeout=300).finish_reason == "length"

    def test_joining_a_running_batch_changes_nothing(self, engine: InferEngine, prompts: list[list[int]]) -> None:
        greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
        alone = engine.submit(Request("alone", prompts[2], greedy)).result(timeout=300)
        busy = SamplingParams(temperature=1.0, max_new_tokens=300, ignore_eos=True, seed=5)
        background = [engine.submit(Request(f"bg{i}", prompts[i % 2], busy)) for i in range(3)]
        time.sleep(0.1)
        joined = engine.submit(Request("joined", prompts[2], greedy)).result(timeout=300)
        for f in background:
            f.result(timeout=300)
        assert joined.token_ids == alone.token_ids
        assert joined.logprobs == pytest.approx(alone.logprobs, abs=self.logprob_atol)

    def test_requests_from_many_threads(self, engine: InferEngine, prompts: list[list[int]]) -> None:
        results: dict[int, Any] = {}

        def one(i: int) -> None:
            p = SamplingParams(temperature=0, max_new_tokens=8)
            results[i] = engine.submit(Request(f"t{i}", prompts[i % 3], p)).result(timeout=300)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == list(range(6))
        for i, r in results.items():  # greedy: equal prompts give equal answers whatever the interleaving
            assert r.token_ids == results[i % 3].token_ids

    def test_prompt_longer_than_context_is_refused(self, engine: InferEngine) -> None:
        too_long = [5] * (engine.max_context_length + 1)
        out = engine.submit(Request("long", too_long, SamplingParams(max_new_tokens=4))).result(timeout=300)
        assert out.finish_reason == "prompt_too_long" and out.token_ids == []

    # ---- weights and memory -------------------------------------------------------------------------------
    def test_weight_update_changes_outputs_to_the_new_model(
        self, engine: InferEngine, prompts: list[list[int]], model_path: str, tmp_path: Path
    ) -> None:
        original, changed, folder = _perturbed(model_path, tmp_path / "changed", seed=0)
        ref, _ = reference_greedy(str(folder), prompts[0], 12)
        greedy = SamplingParams(temperature=0, max_new_tokens=12)
        before = engine.submit(Request("w0", prompts[0], greedy)).result(timeout=300)
        try:
            engine.begin_weight_update()
            # Submitted while paused: it starts once generation resumes, on the new weights, and says so.
            during = engine.submit(Request("wd", prompts[0], greedy))
            named = list(_unique_params(changed))
            received = sum(engine.update_weights(named[i : i + 3]) for i in range(0, len(named), 3))  # buckets
            version = engine.finish_weight_update()
            assert received == sum(t.numel() * t.element_size() for _, t in named)
            after = engine.submit(Request("w1", prompts[0], greedy)).result(timeout=300)
            assert after.token_ids == ref and after.weight_version == version > before.weight_version
            queued = during.result(timeout=300)
            assert queued.token_ids == ref and queued.weight_version == version
        finally:
            engine.begin_weight_update()
            engine.update_weights(list(_unique_params(original)))
            engine.finish_weight_update()
        restored = engine.submit(Request("w2", prompts[0], greedy)).result(timeout=300)
        assert restored.token_ids == before.token_ids

    def test_no_old_keys_and_values_outlive_a_sync(
        self, engine: InferEngine, prompts: list[list[int]], model_path: str, tmp_path: Path
    ) -> None:
        """A weight update while a request runs (asynchronous training without partial rollout): afterwards a prompt
        cached before it, and a continuation of the request that ran across it, are computed with the new weights
        only (vLLM could not clear its prefix cache while a request held blocks; the hf engine stored the crossing
        row's old keys and values after the clear)."""
        original, changed, folder = _perturbed(model_path, tmp_path / "changed", seed=1)
        budget = engine.max_context_length
        cached = [5 + (7 * i) % 90 for i in range(min(96, budget // 4))]  # whole KV blocks (vLLM's are 16 tokens)
        greedy = SamplingParams(temperature=0, max_new_tokens=6)  # stops at EOS, as the reference does
        # Long enough to be running at the update, short enough that its continuation fits the context.
        long_new = (budget - len(prompts[1])) // 2 - 4
        long = SamplingParams(temperature=1.0, max_new_tokens=long_new, seed=3, ignore_eos=True)
        # Old keys and values give log-prob gaps of 0.1-1 (measured); a perturbed model's float noise through
        # cached blocks reached 4e-5 here: a tolerance between the two.
        tol = max(10 * self.logprob_atol, 1e-3)

        def update(model: Any) -> int:
            engine.begin_weight_update()
            engine.update_weights(list(_unique_params(model)))
            return engine.finish_weight_update()

        try:
            for attempt in range(3):  # a loaded machine may let the request finish first: try again
                engine.submit(Request(f"c0-{attempt}", cached, greedy)).result(timeout=300)  # its prefix is cached
                running = engine.submit(Request(f"x-{attempt}", prompts[1], long))
                time.sleep(0.01)  # admitted and prefilled
                version = update(changed)
                if not running.done():
                    break
                running.result(timeout=300)
                update(original)
            else:
                pytest.skip(f"{engine.name} finished the request before each update: nothing crossed one")
            again = engine.submit(Request("c1", cached, greedy)).result(timeout=300)
            ref_tokens, ref_logp = reference_greedy(str(folder), cached, 6)
            assert again.token_ids == ref_tokens, f"{again.token_ids} vs {ref_tokens}"
            assert again.logprobs == pytest.approx(ref_logp, abs=tol), f"{again.logprobs} vs {ref_logp}"
            first = running.result(timeout=300)
            # Its tokens came from both versions: it reports the oldest, the one it was admitted under.
            assert first.weight_version == version - 1, (first.weight_version, version)
            follow = [*prompts[1], *first.token_ids, 7, 8]  # extends what the crossing request computed
            got = engine.submit(Request("f", follow, greedy)).result(timeout=300)
            ref_tokens, ref_logp = reference_greedy(str(folder), follow, 6)
            seen = f"{got.token_ids} {got.logprobs} vs {ref_tokens} {ref_logp} ({len(first.token_ids)} crossed)"
            assert got.token_ids == ref_tokens, seen
            assert got.logprobs == pytest.approx(ref_logp, abs=tol), seen
        finally:
            update(original)

    def test_sleep_and_wake_up(self, engine: InferEngine, prompts: list[list[int]], model_path: str) -> None:
        from transformers import AutoModelForCausalLM

        greedy = SamplingParams(temperature=0, max_new_tokens=10)
        before = engine.generate(prompts[:1], greedy).responses
        awake = engine.memory_bytes()
        engine.sleep(level=1)
        if self.releases_kv_cache:  # level 1 frees the KV cache (and prefix cache); weights may stay or move off
            asleep = engine.memory_bytes()
            assert asleep["kv_cache"] == 0, asleep
            assert sum(asleep.values()) <= sum(awake.values()) - awake["kv_cache"], (awake, asleep)
        engine.wake_up()
        assert torch.equal(engine.generate(prompts[:1], greedy).responses, before)
        held = engine.memory_bytes()["weights"]
        engine.sleep(level=2)
        if self.releases_weights:
            assert engine.memory_bytes()["weights"] < held / 10
        engine.wake_up()
        # Level 2 discarded the weights: a full sync restores them.
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        engine.begin_weight_update()
        engine.update_weights(list(_unique_params(model)))
        engine.finish_weight_update()
        assert torch.equal(engine.generate(prompts[:1], greedy).responses, before)


def _perturbed(model_path: str, folder: Path, seed: int) -> tuple[Any, Any, Path]:
    """(the model as loaded, a copy with every weight moved by 0.5 x N(0, 1) noise of `seed`, the folder the copy and
    the tokenizer are saved in, for reference_greedy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    changed = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in changed.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    changed.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(folder)
    return original, changed, folder


def _unique_params(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters once each (tied ones under their first name) plus persistent buffers: what a trainer syncs."""
    persistent = set(model.state_dict())
    out = [(k, v.detach()) for k, v in model.named_parameters()]
    return out + [(k, v) for k, v in model.named_buffers() if k in persistent]
