"""The hf train engine's attention maps for attention-based credit (roll_engines.train._attention): the rows it reads
are transformers' own (`output_attentions` under eager attention, padding excluded), its streamed WAAD / FAI equal
roll_algos.attention_credit's functions on those whole maps whatever the row blocks, and the model's attention
implementation is restored afterwards."""

from __future__ import annotations

import os

import pytest
import torch

from roll_algos import attention_credit as AC
from roll_core.testing.batches import toy_batch
from roll_core.testing.models import tiny_model
from roll_engines.train.hf import HFTrainEngine


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen2 with grouped-query attention (4 query heads over 2 key heads) and random q/k/v biases."""
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    return tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def eager(path: str) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """toy_batch (6 rows, left-padded prompts, responses of 1..7 tokens) and transformers' eager maps of it."""
    from transformers import AutoModelForCausalLM

    batch = toy_batch(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            output_attentions=True,
        )
    return batch, out.attentions


def test_maps_are_the_models_eager_attention_on_the_response_rows(path: str, eager) -> None:
    batch, maps = eager
    eng = HFTrainEngine(path, logprob_chunk_size=4)  # sdpa model: the capture reads its maps all the same
    got = eng.attention_maps(batch, layers=[0, -1])
    n_layers = len(maps)
    assert sorted(got) == [0, n_layers - 1]
    r = batch["responses"].shape[1]
    p = batch["input_ids"].shape[1] - r
    keys = batch["attention_mask"].bool()
    for layer in got:
        want = maps[layer][:, :, p - 1 :]  # rows P-1 .. P+R-1
        assert got[layer].shape == want.shape
        for i in range(len(keys)):
            # Real rows (the last prompt token and the response tokens) over real keys; padding excluded.
            rows = torch.cat([torch.ones(1, dtype=torch.bool), batch["response_mask"][i].bool()])
            a, b = got[layer][i][:, rows][..., keys[i]], want[i][:, rows][..., keys[i]]
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
            assert torch.allclose(a.sum(-1), torch.ones(()), atol=1e-5)  # each row a distribution over real keys
    assert eng.model.config._attn_implementation == "sdpa"  # restored


@pytest.mark.parametrize("chunk_rows", [1, 3, 64])
def test_streamed_waad_and_fai_equal_the_reference_on_whole_maps(path: str, eager, chunk_rows: int) -> None:
    batch, maps = eager
    r = batch["responses"].shape[1]
    p = batch["input_ids"].shape[1] - r
    eng = HFTrainEngine(path, logprob_chunk_size=4)
    got = eng.compute_attention_credit(batch, layers=[-1], window=3, head_fraction=0.5, chunk_rows=chunk_rows)
    # Reference: whole eager maps of the last layer, sequence coordinates, then the response slice.
    attn = maps[-1]
    seq_mask = torch.zeros(batch["input_ids"].shape)
    seq_mask[:, p:] = batch["response_mask"]
    dist = AC.head_distance(attn, seq_mask)
    local, glob = AC.select_heads(dist, 0.5, local=True), AC.select_heads(dist, 0.5, local=False)
    assert not (local & glob).any()  # 4 heads: 2 local, 2 global per row
    want_waad = AC.head_mean(AC.generated_by(AC.waad(attn, 3)), local)[:, p:] * batch["response_mask"]
    want_fai = AC.head_mean(AC.fai(attn, seq_mask), glob)[:, p:]
    assert got["waad"].shape == got["fai"].shape == batch["response_mask"].shape
    torch.testing.assert_close(got["waad"], want_waad.float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(got["fai"], want_fai.float(), atol=1e-5, rtol=0)
    assert got["waad"][batch["response_mask"] > 0].min() > 0  # every generating row looks back somewhat


def test_bad_requests_are_refused(path: str, eager) -> None:
    batch, _ = eager
    eng = HFTrainEngine(path)
    with pytest.raises(ValueError, match="layer 9 does not exist"):
        eng.compute_attention_credit(batch, layers=[9])
    with pytest.raises(ValueError, match=r"head fraction=0 must lie in \(0, 1\]"):
        eng.compute_attention_credit(batch, head_fraction=0)
    with pytest.raises(ValueError, match="window=0 must be >= 1"):  # raised inside the capturing forward
        eng.compute_attention_credit(batch, window=0)
    assert eng.model.config._attn_implementation == "sdpa"  # restored after an error too


def test_the_objective_scales_the_advantages_of_the_boosted_tokens(path: str, eager) -> None:
    """roll_core's hook with this engine as the actor: the advantages that reach the loss are the estimator's times
    gamma on the strategy's tokens, and the fraction boosted and the mean weight are logged."""
    from types import SimpleNamespace

    from roll_core.pipelines.metrics import StepLog
    from roll_core.pipelines.objectives.attention_credit import apply_attention_credit

    batch, _ = eager
    mask = batch["response_mask"].float()
    algo = SimpleNamespace(  # the AlgoConfig fields the hook reads
        attention_credit="anchor",
        attention_credit_layers=[-1],
        attention_credit_window=10,
        attention_credit_heads=0.5,
        attention_credit_chunk_rows=4,
        attention_credit_ratio=0.34,
        attention_credit_gamma=3.0,
        attention_credit_coupling=1,
    )
    eng, out = HFTrainEngine(path, logprob_chunk_size=4), StepLog()
    adv = batch["advantages"]
    got = apply_attention_credit(batch, adv, mask, algo, eng, out)
    scores = eng.compute_attention_credit(batch, layers=[-1], head_fraction=0.5, chunk_rows=4)
    boosted = AC.anchor_tokens(scores["fai"], mask, 0.34)
    # Responses of 3 7 5 1 6 4 tokens: ceil(.34 n) = 2 3 2 1 3 2 anchors, 13 of 26 tokens.
    assert boosted.sum(-1).tolist() == [2, 3, 2, 1, 3, 2]
    torch.testing.assert_close(got, torch.where(boosted, 3 * adv, adv))
    assert out["actor/attention_credit/boosted_fraction"] == pytest.approx(13 / 26)
    assert out["actor/attention_credit/weight_mean"] == pytest.approx(1 + 2 * 13 / 26)


def test_fsdp2_reads_the_same_scores_as_hf(path: str, eager, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fsdp2 engine (one gloo rank) inherits the method: sharded weights, same WAAD / FAI."""
    import torch.distributed as dist

    from roll_core.cluster.ports import free_port
    from roll_engines.train.fsdp2 import FSDP2TrainEngine

    batch, _ = eager
    kw = dict(layers=[0, 1], window=4, head_fraction=0.25, chunk_rows=5)
    want = HFTrainEngine(path, logprob_chunk_size=4).compute_attention_credit(batch, **kw)
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    try:
        eng = FSDP2TrainEngine(path, dist_backend="gloo", logprob_chunk_size=4)
        got = eng.compute_attention_credit(batch, **kw)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    for k in ("waad", "fai"):
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0)
