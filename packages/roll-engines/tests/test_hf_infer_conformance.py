"""The `hf` inference engine passes the InferEngine conformance suite; unit tests of its sampling pieces."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from roll_core.interfaces import SamplingParams
from roll_core.testing.infer_engine import InferEngineTestSuite
from roll_engines.infer._sampling import StopStrings, inverse_cdf, processed_logprobs, sample_rows
from roll_engines.infer.hf import HFInferEngine


class TestHFInferEngine(InferEngineTestSuite):
    @classmethod
    def build_engine(cls, model_path: str, **kwargs: Any) -> HFInferEngine:
        return HFInferEngine(model_path, max_num_seqs=8, **kwargs)

    def test_generate_rows_never_take_a_callers_running_id(self, model_path: str, prompts: list[list[int]]) -> None:
        """generate named its rows `batch-0`, `batch-1`, ... : a caller's running request of such a name made the
        row a refused duplicate (a running id is refused) and failed the batch. A fresh engine: its first row."""
        from roll_core.interfaces import Request

        engine = self.build_engine(model_path, seed=0)
        try:
            long = SamplingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True, seed=3)
            theirs = engine.submit(Request("batch-0", prompts[0], long))
            out = engine.generate([prompts[1]], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
            assert out.finish_reasons == ["length"]
            engine.abort("batch-0")  # it may have finished meanwhile: either way it is the caller's, untouched
            r = theirs.result(timeout=300)
            assert r.prompt_ids == prompts[0] and (r.finish_reason == "abort" or len(r.token_ids) == 400)
        finally:
            engine.shutdown()


class _WordTokenizer:
    """Multi-character tokens, so a stop string can end inside a token."""

    vocab: ClassVar[list[str]] = ["The", " answer", " is", " 4", ".\n", "Done", "e."]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids)


def test_stop_string_cut_at_an_overhanging_token() -> None:
    stops = StopStrings(_WordTokenizer(), ["4."])
    seq = [0, 1, 2, 3]  # "The answer is 4"
    assert not stops.hit(seq)
    assert stops.hit([*seq, 4])  # ".\n" completes "4." and overhangs it by a newline
    assert not StopStrings(_WordTokenizer(), ["4."]).hit([3, 2])  # " 4", " is": no "4." anywhere
    assert StopStrings(_WordTokenizer(), ["e"]).hit([0])  # "The" ends with e
    assert StopStrings(_WordTokenizer(), ["e"]).hit([6])  # "e." overhangs "e"


def test_top_k_top_p_log_probs_are_the_truncated_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    t = torch.tensor([1.0, 0.5])
    lp = processed_logprobs(logits, t, [2, 0], [1.0, 0.6])
    # Row 0: top-2 of softmax(logits): probabilities e^2/(e^2+e^1), e^1/(e^2+e^1).
    expect0 = torch.log_softmax(torch.tensor([2.0, 1.0]), -1)
    torch.testing.assert_close(lp[0, :2], expect0)
    assert torch.isinf(lp[0, 2:]).all()
    # Row 1: uniform over 4 tokens, top-p 0.6 keeps the smallest prefix of mass >= 0.6: 3 tokens (0.75).
    assert int(torch.isfinite(lp[1]).sum()) == 3
    torch.testing.assert_close(lp[1][torch.isfinite(lp[1])].exp().sum(), torch.tensor(1.0))


def test_rows_sample_from_their_own_streams() -> None:
    logp = torch.log_softmax(torch.randn(3, 50), -1)
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    first = sample_rows(logp, torch.tensor([False, True, False]), gens)
    assert int(first[1]) == int(logp[1].argmax())
    gens2 = [torch.Generator().manual_seed(s) for s in (1, 3)]
    again = sample_rows(logp[[0, 2]], torch.tensor([False, False]), gens2)  # other batch composition
    assert again.tolist() == [int(first[0]), int(first[2])]


def test_two_level_inverse_cdf_draws_what_one_float64_cumsum_draws() -> None:
    """The blocked draw equals the plain float64 inverse CDF, token for token, on a vocabulary that is not a
    multiple of the block, with zero-mass tokens (also a whole zero block, and a row whose last block is empty)
    and uniforms at 0, just below 1 and exactly on token boundaries."""
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(6, 1000, generator=g) ** 4
    probs[0, ::3] = 0.0
    probs[1, 256:512] = 0.0  # a whole block of zero mass
    probs[2, 700:] = 0.0  # the last blocks empty: the top draw must land on token 699
    probs[3, :999] = 0.0  # one token
    cdf = probs.double().cumsum(-1)
    us = [0.0, 1.0 - 2**-53, 0.5, 0.123456, 0.9999, *torch.rand(40, generator=g, dtype=torch.float64).tolist()]
    for u in us:
        uu = torch.full((6,), u, dtype=torch.float64)
        want = torch.searchsorted(cdf, (uu * cdf[:, -1])[:, None], right=True)[:, 0]
        want = torch.minimum(want, (cdf < cdf[:, -1:]).sum(-1))
        got = inverse_cdf(probs, uu)
        assert got.tolist() == want.tolist(), u
        assert bool((probs.gather(-1, got[:, None]) > 0).all())
    assert int(inverse_cdf(probs[2:3], torch.tensor([1.0 - 2**-53], dtype=torch.float64))) == 699
    assert int(inverse_cdf(probs[3:4], torch.tensor([0.0], dtype=torch.float64))) == 999
    # Tokens whose mass vanishes against the mass before them (1 + 2**-58 rounds to 1 in float64, so one cumsum
    # over the vocabulary never draws them) keep their share here: in-block sums are taken before the offset.
    row = torch.zeros(1, 512)
    row[0, 0], row[0, 256:511] = 1.0, 2.0**-58
    got = int(inverse_cdf(row, torch.tensor([1.0 - 2**-51], dtype=torch.float64)))
    assert 256 <= got < 511, got
    # A block whose float32 sum exceeds its exact total (255 x 0.1: by ~3e-6): a target in that sliver lands on
    # the block's last token of positive mass, not on the zero-mass token after it.
    row = torch.tensor([[0.1] * 255 + [0.0]])
    f32, exact = row.sum().double().item(), row.double().sum().item()
    assert f32 > exact
    sliver = torch.tensor([(exact + (f32 - exact) / 2) / f32], dtype=torch.float64)
    assert int(inverse_cdf(row, sliver)) == 254
    # Exactly on a boundary (target == cdf[i]) the draw is token i + 1, as with right=True.
    row = torch.tensor([[0.25, 0.25, 0.25, 0.25]])
    assert int(inverse_cdf(row, torch.tensor([0.5], dtype=torch.float64), block=2)) == 2


def test_an_empty_batch_samples_nothing() -> None:
    assert sample_rows(torch.zeros(0, 7), torch.zeros(0, dtype=torch.bool), []).shape == (0,)


def test_sampled_frequencies_follow_the_distribution() -> None:
    """Many draws from a known distribution with 300 tokens (two blocks): frequencies within 4 sigma."""
    p = torch.zeros(300)
    p[[3, 100, 260, 299]] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logp = p.log()[None].expand(4000, -1).contiguous()
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    drawn = sample_rows(logp, torch.zeros(4000, dtype=torch.bool), gens)
    counts = torch.bincount(drawn, minlength=300).double() / 4000
    assert set(drawn.unique().tolist()) <= {3, 100, 260, 299}
    sigma = (p.double() * (1 - p.double()) / 4000).sqrt()
    assert bool(((counts - p.double()).abs() <= 4 * sigma + 1e-12).all()), counts[[3, 100, 260, 299]]


def test_generation_config_processors_are_not_applied(tmp_path, tiny: str) -> None:
    """A repetition penalty in generation_config.json must not change roll's sampling (log-probs stay exact)."""
    import shutil

    from transformers import GenerationConfig

    folder = tmp_path / "penalised"
    shutil.copytree(tiny, folder)
    GenerationConfig(repetition_penalty=5.0, eos_token_id=2).save_pretrained(folder)
    eng = HFInferEngine(str(folder), max_new_tokens=8)
    plain = HFInferEngine(tiny, max_new_tokens=8)
    params = SamplingParams(max_new_tokens=8, seed=4)
    a, b = eng.generate([[5, 6, 7]], params, n=4), plain.generate([[5, 6, 7]], params, n=4)
    assert torch.equal(a.responses, b.responses)
    torch.testing.assert_close(a.logprobs, b.logprobs)


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_a_failing_forward_fails_requests_instead_of_hanging(tiny: str, where: str) -> None:
    from concurrent.futures import TimeoutError as FutureTimeout

    from roll_core.interfaces import Request

    eng = HFInferEngine(tiny, max_new_tokens=8)
    forward = eng.model.forward
    calls = {"n": 0}

    def broken(*args, **kwargs):
        calls["n"] += 1
        if where == "prefill" or calls["n"] > 2:
            raise RuntimeError("device lost")
        return forward(*args, **kwargs)

    eng.model.forward = broken
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:  # bounded wait: a hang fails the test instead of stalling the suite
        call = pool.submit(eng.generate, [[5, 6, 7]], SamplingParams(max_new_tokens=8, ignore_eos=True), 2)
        with pytest.raises(RuntimeError, match="device lost"):
            call.result(timeout=120)
    fut = eng.submit(Request("after", [5, 6], SamplingParams(max_new_tokens=4)))
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            fut.result(timeout=120)
    except FutureTimeout:
        pytest.fail("a request hung after the engine's forward failed")
    eng.shutdown()


def test_multi_turn_prefix_reuse_matches_full_prefill(tiny: str) -> None:
    """A conversation's next turn reuses the previous turn's KV: same greedy tokens and log-probs as encoding the
    whole conversation again, and only the new tokens are encoded."""
    from roll_core.interfaces import Request

    def conversation(engine: HFInferEngine) -> list:
        greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
        ids, outs = [5, 6, 7, 8], []
        for turn in range(3):
            out = engine.submit(Request(f"t{turn}", ids, greedy)).result(timeout=60)
            outs.append(out)
            ids = ids + out.token_ids + [20 + turn, 21, 22]  # the response, then an "observation"
        return outs

    reuse = HFInferEngine(tiny)
    plain = HFInferEngine(tiny, prefix_cache_mb=0)
    a, b = conversation(reuse), conversation(plain)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    assert reuse.batcher.prefixes.hits == 2 and plain.batcher.prefixes.hits == 0
    assert reuse.batcher.prefixes.reused_tokens == (4 + 5) + (4 + 6 + 3 + 5)  # all but each turn's last token
    reuse.load_weights(dict(reuse.model.state_dict()))  # a weight update drops the stored prefixes
    assert not reuse.batcher.prefixes.entries


def test_memory_bytes_counts_weights_on_an_unindexed_device() -> None:
    """Engines are built with device "cuda" while their weights land on cuda:0: `memory_bytes` counts them there
    (an equality test counted none, so a GPU's weights read 0)."""
    from roll_engines.infer.hf import on_device

    cuda, cuda0, cuda1, cpu = (torch.device(d) for d in ("cuda", "cuda:0", "cuda:1", "cpu"))
    assert cuda0 != cuda  # what the old comparison tripped on
    assert on_device(cuda0, cuda) and on_device(cuda1, cuda) and on_device(cuda0, cuda0)
    assert not on_device(cuda1, cuda0) and not on_device(cpu, cuda) and not on_device(cuda0, cpu)
    assert on_device(cpu, cpu)


def test_weights_a_bf16_engine_keeps_in_fp32_arrive_unrounded(tmp_path, tiny: str) -> None:
    """A bf16 engine keeps a GLM-4.5/DeepSeek-V3 router and its expert bias in fp32 (as vLLM does); the sync cast
    every floating tensor to bf16, so after each sync the engine routed with rounded values (the bias, which picks
    the experts, off by up to 1.3e-3 here) while the trainer used its fp32 ones. Those weights now travel in fp32;
    the rest still in bf16."""
    from roll_core.cluster.roles import InferGroup, InferWorker, TrainGroup, TrainWorker
    from roll_core.cluster.weight_sync import WeightSync
    from roll_core.testing.models import FP32_ROUTER_KEYS, tiny_fp32_router_moe
    from roll_engines.config import HFInferEngineConfig, HFTrainEngineConfig
    from roll_hw.cpu import CpuPlatform

    path = tiny_fp32_router_moe(tmp_path / "glm", tiny)
    train = TrainGroup(TrainWorker, 1, "local", engine=vars(HFTrainEngineConfig()), runtime={"model_path": path})
    bf16 = {"model_path": path, "dtype": "bfloat16"}
    infer = InferGroup(InferWorker, 1, "local", engine=vars(HFInferEngineConfig()), runtime=bf16)
    try:
        sync = WeightSync(train, infer, transport="auto", bucket_mb=0.05, placement="colocated", platform=CpuPlatform)
        router = FP32_ROUTER_KEYS
        assert getattr(sync, "wide", dict.fromkeys(router, "float32")) == dict.fromkeys(router, "float32")
        trained = {k: v.detach().clone() for k, v in train.workers[0].engine.iter_weights()}
        with torch.no_grad():  # the trainer's fp32 weights as training leaves them: not on the bf16 grid
            for v in trained.values():
                v.add_(1e-3 * torch.randn_like(v))
        train.workers[0].engine.load_weights(trained)
        sync.sync()
        held = infer.workers[0].engine.model.state_dict()
        for name, value in trained.items():
            want = value if name in router else value.to(torch.bfloat16)
            assert held[name].dtype == want.dtype and torch.equal(held[name], want), name
    finally:
        train.shutdown()
        infer.shutdown()
