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
