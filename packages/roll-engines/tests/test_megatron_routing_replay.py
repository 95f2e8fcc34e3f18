"""Routed-expert replay on the `megatron` engine (roll_engines.train.megatron._routing), TP=PP=1 in-process over
gloo, on the tiny random Qwen3-MoE (2 MoE layers, 4 experts, top-2) and roll's toy batch (3 prompts x 2 responses):

(a) a routing forced to differ from the router's everywhere (expert e -> (e + 1) % 4) is what Megatron computes
    with, packed and padded: its log-probs equal the hf train engine's under the same replay and differ from its
    own routing's; its gradients (training path, full recomputation) equal the hf engine's and reach the router;
(b) replaying the router's own choice (the transformers model's top-k, recorded at every padded position) changes
    no routing decision (the replay's own count: any misplaced token would show) and no log-prob;
(c) batches without the field, of the wrong shape, layer count or top-k, or with ids out of range are refused.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
pytestmark = pytest.mark.usefixtures("megatron_process_group")

from roll_core.routing import ROUTED_EXPERTS, UNROUTED  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    from roll_core.testing.models import tiny_model

    return tiny_model("qwen3_moe", tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def batch(tiny: str) -> dict:
    """roll's toy batch with the transformers model's own routing (padded forward) at its attended positions,
    UNROUTED at padding (as roll_core.routing.routing_layout lays out a rollout's)."""
    from transformers import AutoModelForCausalLM

    from roll_core.testing.batches import toy_batch
    from roll_engines.infer._routing import RoutingRecorder

    out = toy_batch(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    rec = RoutingRecorder(model)
    with torch.no_grad():
        model(**{k: out[k] for k in ("input_ids", "attention_mask", "position_ids")})
    own = rec._take(tuple(out["input_ids"].shape))
    out[ROUTED_EXPERTS] = own.masked_fill(out["attention_mask"][..., None, None] == 0, UNROUTED)
    return out


def _megatron(path: str, **kw):
    from roll_engines.train.megatron import MegatronTrainEngine

    common = {"dist_backend": "gloo", "micro_batch_size": 3, "logprob_chunk_size": 4, "routing_replay": True}
    return MegatronTrainEngine(path, use_distributed_optimizer=False, **{**common, **kw})


def _logprobs(engine, batch: dict, pack: bool) -> torch.Tensor:
    engine.pack_sequences = pack
    return engine.compute_logprobs(batch)["logprobs"] * batch["response_mask"]


def forced(batch: dict) -> dict:
    """Each expert e -> (e + 1) % 4 (a top-2 set never maps to itself) where recorded."""
    field = batch[ROUTED_EXPERTS]
    return {**batch, ROUTED_EXPERTS: torch.where(field >= 0, (field + 1) % 4, field)}


def unrouted(batch: dict) -> dict:
    return {**batch, ROUTED_EXPERTS: torch.full_like(batch[ROUTED_EXPERTS], UNROUTED)}


def test_forced_routing_is_what_megatron_computes_with(tiny: str, batch: dict) -> None:
    from roll_engines.train.hf import HFTrainEngine

    mask = batch["response_mask"].bool()
    want = HFTrainEngine(tiny, role="actor", routing_replay=True).compute_logprobs(forced(batch))["logprobs"]
    engine = _megatron(tiny)
    own = _logprobs(engine, unrouted(batch), pack=True)  # every position UNROUTED: the router's own choice
    assert engine.routing.replayed == 0
    for pack in (True, False):
        got = _logprobs(engine, forced(batch), pack)
        # Layer 0 everywhere differs from the router's own choice; layer 1's router sees layer 0's forced output,
        # so its own choice can now and then be the forced one (measured: 1 in 50).
        assert engine.routing.changed_fraction() > 0.95, pack
        torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=0, msg=f"pack={pack}")
        assert (got - own)[mask].abs().mean() > 3e-3  # the forced experts change the policy (300x atol)


def test_replaying_the_routers_own_choice_changes_nothing(tiny: str, batch: dict) -> None:
    mask = batch["response_mask"].bool()
    engine = _megatron(tiny)
    recorded = int(batch["attention_mask"].sum()) * 2  # attended positions x MoE layers
    for pack in (True, False):
        own = _logprobs(engine, unrouted(batch), pack)
        assert engine.routing.changed_fraction() == 0.0
        replayed = _logprobs(engine, batch, pack)
        # Padded: every attended (position, layer); packed: each shared prompt once.
        counted = engine.routing.replayed
        assert counted == recorded if not pack else 0 < counted < recorded
        assert engine.routing.changed_fraction() == 0.0, pack  # the recorded top-k is the router's, token by token
        torch.testing.assert_close(replayed[mask], own[mask], atol=1e-6, rtol=0)


def test_forced_routing_gradients_equal_hf(tiny: str, batch: dict) -> None:
    """The training path (full recomputation re-runs the routers in the backward) under a forced routing (a packed
    micro-batch of this batch is one row, where a transposed token order would go unseen: padded here)."""
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_engines.train.hf import HFTrainEngine

    objective = PolicyObjective(agg="token-mean")
    expected = HFTrainEngine(tiny, routing_replay=True, micro_batch_size=3).compute_gradients(forced(batch), objective)
    engine = _megatron(tiny, recompute="full", pack_sequences=False)  # padded: (b, s) -> [s, b] is no identity
    grads = engine.compute_gradients(forced(batch), objective)
    assert engine.routing.changed_fraction() > 0.95
    routers = [n for n in grads if n.endswith("mlp.gate.weight")]
    assert len(routers) == 2 and all(grads[n].abs().max() > 0 for n in routers)
    for name, g in expected.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-4, msg=name)


def test_bad_routing_is_refused(tiny: str, batch: dict) -> None:
    engine = _megatron(tiny)
    field = batch[ROUTED_EXPERTS]
    with pytest.raises(ValueError, match=r"infer_engine\.return_routing"):
        engine.compute_logprobs({k: v for k, v in batch.items() if k != ROUTED_EXPERTS})
    for bad in (field[:, 1:], field[:, :, :1], field[..., :1]):  # positions, MoE layers, top_k
        with pytest.raises(ValueError, match=r"MoE layers, top_k"):
            engine.compute_logprobs({**batch, ROUTED_EXPERTS: bad})
    for bad in (field + 4, field - 3):
        with pytest.raises(ValueError, match=r"expert ids outside \[-1, 4\)"):
            engine.compute_logprobs({**batch, ROUTED_EXPERTS: bad})


def test_dense_model_and_layouts_are_refused(tmp_path) -> None:
    from roll_core.config.compose import load_config
    from roll_core.errors import ConfigError
    from roll_core.models import resolve_model_path

    with pytest.raises(ValueError, match="mixture-of-experts"):
        _megatron(resolve_model_path("builtin:tiny"))
    on = ["experiment=quickstart", "train_engine=megatron", "train_engine.routing_replay=true"]
    on += ["infer_engine.return_routing=true"]
    assert load_config(on).train_engine.routing_replay
    pipeline = ["train_engine.pipeline_parallel_size=2", "train_engine.world_size=2"]
    assert load_config([*on, *pipeline, "train_engine.recompute=selective"]).train_engine.routing_replay
    with pytest.raises(ConfigError, match="recompute=full with pipeline_parallel_size=1"):
        load_config([*on, *pipeline, "train_engine.recompute=full"])


@pytest.fixture(scope="module")
def near_ties(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with near-tie routers (as test_routing_replay.py's): each expert's router row is one shared
    row plus 0.02 x noise, so bf16 rounding flips some top-2 choices; experts' outputs 3x so that a flip shows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(1, p.shape[1], generator=gen) + 0.02 * torch.randn(p.shape, generator=gen))
            elif name.endswith("experts.down_proj"):
                p.mul_(3.0)
    out = tmp_path_factory.mktemp("moe_ties")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return str(out)


def test_replay_shrinks_the_bf16_rollout_gap(near_ties: str, capsys: pytest.CaptureFixture) -> None:
    """A bf16 hf rollout recording its routing against the fp32 Megatron trainer: the mean |train - infer|
    log-prob gap over response tokens is smaller with replay than with the trainer's own routing."""
    from roll_core.interfaces.inference import SamplingParams
    from roll_core.routing import routing_layout
    from roll_core.sequences import build_sequences, pad_left
    from roll_engines.infer.hf import HFInferEngine

    prompts = [[5, 9, 14, 3, 22, 7], [31, 8, 2], [12, 40, 41, 17, 6]]
    infer = HFInferEngine(near_ties, dtype="bfloat16", return_routing=True, max_new_tokens=16, temperature=1.0)
    try:
        out = infer.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, seed=3), n=2)
    finally:
        infer.shutdown()
    rows = [p for p in prompts for _ in range(2)]
    ids, mask = pad_left(rows, infer.pad_id)
    batch = build_sequences(ids, mask, out.responses, out.response_mask)
    batch.update(responses=out.responses, response_mask=out.response_mask)
    widths = (ids.shape[1], out.responses.shape[1])
    batch[ROUTED_EXPERTS] = routing_layout(out.routed_experts, [len(x) for x in rows], *widths)
    engine = _megatron(near_ties)
    resp = batch["response_mask"].bool()
    gap_replay = (engine.compute_logprobs(batch)["logprobs"] - out.logprobs)[resp].abs().mean().item()
    changed = engine.routing.changed_fraction()
    gap_plain = (engine.compute_logprobs(unrouted(batch))["logprobs"] - out.logprobs)[resp].abs().mean().item()
    with capsys.disabled():
        print(
            f"\nmegatron, bf16 rollout / fp32 trainer, {int(resp.sum())} response tokens, {changed:.1%} of replayed "
            f"(position, layer) routings differ from the trainer's: mean |diff| without replay {gap_plain:.5f}, "
            f"with {gap_replay:.5f}"
        )
    assert changed > 0  # the near ties do flip under bf16
    assert gap_replay < 0.5 * gap_plain


def _rank(rank: int, world: int, port: int, path: str, data: str, out: str, kw: dict) -> None:
    """One gloo rank of a multi-rank layout: per layout (packed, padded), the counts of replaying the router's own
    choice and the log-probs and counts of the forced routing, saved per rank."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from roll_engines.train.megatron import MegatronTrainEngine

    batches = torch.load(data, weights_only=False)
    engine = MegatronTrainEngine(
        path,
        dist_backend="gloo",
        num_threads=1,
        world_size=world,
        micro_batch_size=3,
        logprob_chunk_size=4,
        routing_replay=True,
        use_distributed_optimizer=False,
        **kw,
    )
    results = {}
    for pack in (True, False):
        engine.pack_sequences = pack
        engine.compute_logprobs(batches["own"])
        own = (engine.routing.replayed, engine.routing.changed_fraction())
        got = engine.compute_logprobs(batches["forced"])["logprobs"]
        results[pack] = {"own": own, "forced": (got, engine.routing.changed_fraction())}
    results["last_stage"] = ps.is_pipeline_last_stage()
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "layout",
    [
        # CP=2 x TP=2 with sequence parallelism: each rank's router sees a quarter of every sequence ([s/4, b]),
        # widths padded to a multiple of 4 (left padding of unpacked rows).
        {"context_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True},
        # EP=2 over DP=4: routers before the all-to-all, global expert ids. (EP x TP + SP does not run on gloo, replay
        # or not: Megatron all-gathers the TP ranks' uneven token counts, which gloo refuses.)
        pytest.param(
            {"expert_model_parallel_size": 2},
            marks=pytest.mark.full_matrix,
        ),
        # PP=2 x TP=2 + SP: each stage's routers take their own layers' columns (global layer numbers).
        pytest.param(
            {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True},
            marks=pytest.mark.full_matrix,
        ),
    ],
    ids=["cp2-tp2-sp", "ep2-dp4", "pp2-tp2-sp"],
)
def test_parallel_layouts_replay_each_ranks_tokens(tiny: str, batch: dict, tmp_path, layout: dict) -> None:
    """Four gloo ranks: every rank's routers get exactly their own tokens' recorded experts (replaying the router's
    own choice changes none on any rank), and the forced routing gives the hf engine's log-probs on every rank."""
    import multiprocessing

    import torch.multiprocessing as mp

    from roll_core.cluster.ports import free_port
    from roll_engines.train.hf import HFTrainEngine

    data, out = tmp_path / "batches.pt", tmp_path / "out"
    torch.save({"own": batch, "forced": forced(batch)}, data)
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "transformers", "megatron.core", "roll_engines.train.megatron", "roll_core.testing.train_engine"]
    )
    ranks = mp.start_processes(
        _rank, args=(4, free_port(), tiny, str(data), str(out), layout), nprocs=4, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + 240
    while not ranks.join(timeout=1):  # raises what a rank raised
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            pytest.fail("the four Megatron ranks did not finish in 240 s")
    want = HFTrainEngine(tiny, role="actor", routing_replay=True).compute_logprobs(forced(batch))["logprobs"]
    mask = batch["response_mask"].bool()
    for rank in range(4):
        results = torch.load(f"{out}.{rank}", weights_only=False)
        last = results.pop("last_stage")
        for pack, got in results.items():
            replayed, changed = got["own"]
            assert replayed > 0 and changed == 0.0, (rank, pack, got["own"])
            logprobs, changed = got["forced"]
            # (a rank's few tokens: layer 1's own choice under layer 0's forced output is the forced one more often)
            assert changed > 0.5, (rank, pack)
            if not last:  # earlier pipeline stages return zeros
                continue
            torch.testing.assert_close(logprobs[mask], want[mask], atol=1e-5, rtol=0, msg=f"rank {rank} pack={pack}")
