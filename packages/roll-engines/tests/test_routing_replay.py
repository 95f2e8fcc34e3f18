"""Routed-expert replay (roll_engines.infer._routing, roll_engines.train._routing, roll_core.routing) on a tiny
random Qwen3-MoE (2 MoE layers, 4 experts, top-2), no Ray:

(a) a routing forced to differ from the router's (each expert id e -> (e + 1) % 4) is what the trainer computes with:
    its log-probs equal a forward whose routers are patched to choose those experts, packed and padded, and
    differ from the unpatched forward; the gradient reaches the router weights;
(b) the fp32 infer engine's recorded routing is the trainer's own routing at every prompt and response position,
    so replay is a no-op: log-probs with and without replay are equal (and equal the behaviour log-probs);
(c) a bf16 rollout engine against the fp32 trainer, routers scaled down so that routing decisions are near ties:
    the mean |train - infer| log-prob gap over response tokens is smaller with replay than without.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from roll_core.interfaces.inference import SamplingParams
from roll_core.routing import ROUTED_EXPERTS, UNROUTED, routing_layout
from roll_core.sequences import build_sequences, pad_left
from roll_core.testing.models import tiny_model
from roll_engines.infer._routing import RoutingRecorder
from roll_engines.infer.hf import HFInferEngine
from roll_engines.train._routing import RoutingReplay
from roll_engines.train.hf import HFTrainEngine

PROMPTS = [[5, 9, 14, 3, 22, 7], [31, 8, 2], [12, 40, 41, 17, 6]]
N = 2  # samples per prompt (one shared prefill, as a GRPO group)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return tiny_model("qwen3_moe", tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def near_ties(tiny, tmp_path_factory) -> str:
    """The tiny model with near-tie routers: every expert's router row is one shared row v plus 0.02 x noise, so
    logits are v.h (large, rounded in bf16) plus small expert-specific margins, and bf16 rounding flips some
    top-2 choices (about 10% of (position, layer) pairs); experts' outputs scaled up 3x so a flip shows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                shared = torch.randn(1, p.shape[1], generator=gen)
                p.copy_(shared + 0.02 * torch.randn(p.shape, generator=gen))
            elif name.endswith("experts.down_proj"):
                p.mul_(3.0)
    out = tmp_path_factory.mktemp("moe_ties")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def fp32(tiny) -> dict:
    """One fp32 rollout with routing, shared by the tests (each copies the batch before changing it)."""
    return rollout(tiny)


def rollout(path: str, dtype: str = "float32", max_new: int = 10) -> dict:
    """Sample N responses per prompt with routing recorded; the batch in the trainer's padded layout."""
    engine = HFInferEngine(path, dtype=dtype, return_routing=True, max_new_tokens=max_new, temperature=1.0)
    try:
        out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=3), n=N)
    finally:
        engine.shutdown()
    prompts = [p for p in PROMPTS for _ in range(N)]
    ids, mask = pad_left(prompts, engine.pad_id)
    batch = build_sequences(ids, mask, out.responses, out.response_mask)
    batch.update(responses=out.responses, response_mask=out.response_mask)
    p, r = ids.shape[1], out.responses.shape[1]
    batch[ROUTED_EXPERTS] = routing_layout(out.routed_experts, [len(x) for x in prompts], p, r)
    return {"batch": batch, "behaviour": out.logprobs, "rows": out.routed_experts, "path": path}


def patched_logprobs(path: str, batch: dict, forced: torch.Tensor) -> torch.Tensor:
    """Response log-probs of a plain padded forward whose routers choose `forced` (B, P+R, layers, k) experts,
    the weights being softmax(logits) at them, renormalised (written independently of the replay hook)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    routers = RoutingRecorder(model).routers
    for layer, router in enumerate(routers):

        def forward(hidden, layer=layer, router=router):
            logits = F.linear(hidden, router.weight)
            idx = forced[:, :, layer].reshape(-1, router.top_k).long()
            w = logits.softmax(-1).gather(-1, idx)
            return logits, w / w.sum(-1, keepdim=True), idx

        router.forward = forward
    r = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits
    logp = logits[:, -r - 1 : -1].log_softmax(-1).gather(-1, batch["responses"][..., None])[..., 0]
    return logp * batch["response_mask"]


def trainer_logprobs(
    path: str, batch: dict, replay: bool, pack: bool = True, stats: dict | None = None
) -> torch.Tensor:
    engine = HFTrainEngine(path, role="actor", routing_replay=replay, pack_sequences=pack, logprob_chunk_size=4)
    out = engine.compute_logprobs(batch)["logprobs"] * batch["response_mask"]
    if stats is not None:
        stats["changed"] = engine.routing.changed_fraction()
    return out


def test_recorded_routing_layout(fp32):
    """Each request's routing covers prompt + response; only the never-fed last token is unrouted, and the
    batch field is aligned with input_ids."""
    ro = fp32
    batch, rows = ro["batch"], ro["rows"]
    prompts = [p for p in PROMPTS for _ in range(N)]
    p = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        n = int(batch["response_mask"][i].sum())
        assert row.shape == (len(prompt) + n, 2, 2) and row.dtype == torch.int16
        assert (row[:-1] >= 0).all() and (row[-1] == UNROUTED).all()
        field = batch[ROUTED_EXPERTS][i]
        assert (field[: p - len(prompt)] == UNROUTED).all()  # left padding
        assert torch.equal(field[p - len(prompt) : p + n], row)
    # The N samples of a prompt share one prefill: equal prompt routing.
    assert torch.equal(rows[0][: len(PROMPTS[0])], rows[1][: len(PROMPTS[0])])


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_forced_routing_is_what_the_trainer_computes_with(tiny, fp32, pack, own_routing):
    batch = dict(fp32["batch"])
    own = own_routing(tiny, batch)
    # Each expert e -> (e + 1) % 4: a top-2 set never maps to itself, so every routing differs from the router's.
    forced = ((own.long() + 1) % 4).to(torch.int16)
    batch[ROUTED_EXPERTS] = forced
    mask = batch["response_mask"].bool()
    stats: dict = {}
    replayed = trainer_logprobs(tiny, batch, replay=True, pack=pack, stats=stats)
    assert stats["changed"] == 1.0
    expected = patched_logprobs(tiny, batch, forced)
    plain = trainer_logprobs(tiny, batch, replay=False, pack=pack)
    torch.testing.assert_close(replayed[mask], expected[mask], atol=2e-5, rtol=1e-5)
    assert (replayed - plain)[mask].abs().mean() > 3e-3  # the forced experts change the policy (100x atol)


def test_replay_gradient_reaches_the_router(tiny, fp32):
    """The replayed experts' weights are the trainer's router probabilities: the loss has a router gradient."""
    batch = fp32["batch"]
    engine = HFTrainEngine(tiny, role="actor", routing_replay=True, micro_batch_size=8)
    logp = engine._forward(batch, 1.0, False)["logprobs"]
    (logp * batch["response_mask"]).sum().backward()
    grads = [r.weight.grad for r in engine.routing.routers]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    assert engine.routing.replayed > 0
    assert engine.routing.changed_fraction() == 0.0  # fp32 rollout: the trainer's own choices everywhere


def test_assemble_lays_out_the_engines_routing(fp32):
    """The synchronous pipeline's path: a generation's per-row routing (ROUTING_ROWS) becomes routed_experts
    aligned with input_ids in `assemble`, and survives merge_scored (rounds of other widths)."""
    from transformers import AutoTokenizer

    from roll_core.pipelines.rollout import assemble
    from roll_core.pipelines.sampling import merge_scored
    from roll_core.protocol import Batch
    from roll_core.routing import ROUTING_ROWS

    batch = fp32["batch"]
    tok = AutoTokenizer.from_pretrained(fp32["path"])
    prompts = [p for p in PROMPTS for _ in range(N)]
    gen = Batch(
        {k: batch[k] for k in ("responses", "response_mask")} | {"behaviour_logprobs": fp32["behaviour"]},
        {"finish_reason": ["stop"] * len(prompts), ROUTING_ROWS: fp32["rows"]},
    )
    out = assemble(tok, Batch({}, {"prompt_ids": prompts}), gen)
    assert torch.equal(out["input_ids"], batch["input_ids"])
    assert torch.equal(out[ROUTED_EXPERTS], batch[ROUTED_EXPERTS])
    short = assemble(tok, Batch({}, {"prompt_ids": prompts[:2]}), gen.index(slice(0, 2)))
    short_gen = Batch(
        {k: short[k][:, :3] for k in ("responses", "response_mask", "behaviour_logprobs")},
        {"finish_reason": ["length"] * 2, ROUTING_ROWS: [r[: len(prompts[0]) + 3] for r in fp32["rows"][:2]]},
    )
    short = assemble(tok, Batch({}, {"prompt_ids": prompts[:2]}), short_gen)
    merged = merge_scored(tok, [out, short])
    assert merged[ROUTED_EXPERTS].shape[:2] == merged["input_ids"].shape
    assert torch.equal(merged[ROUTED_EXPERTS][: len(prompts)], out[ROUTED_EXPERTS])


def test_fp32_rollout_routing_equals_the_trainers_own(tiny, fp32, own_routing):
    ro = fp32
    batch = ro["batch"]
    field, own = batch[ROUTED_EXPERTS], own_routing(tiny, batch)
    recorded = field >= 0
    assert recorded.any()
    # Top-k order may differ only between exactly equal probabilities: compare sets.
    assert torch.equal(field.sort(-1).values[recorded], own.sort(-1).values[recorded])
    mask = batch["response_mask"].bool()
    with_replay = trainer_logprobs(tiny, batch, replay=True)
    without = trainer_logprobs(tiny, batch, replay=False)
    torch.testing.assert_close(with_replay[mask], without[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(with_replay[mask], ro["behaviour"][mask], atol=1e-4, rtol=1e-4)


def test_padding_passes_route_by_themselves(tiny, fp32, own_routing, monkeypatch):
    """A data-parallel rank with fewer micro-batches than its peers runs padding rows; they replay nothing (all
    UNROUTED), so with the batch's routing equal to the trainer's own, the changed fraction stays 0 with padding
    passes as without (expert 0 everywhere counted ~20 % changed)."""
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_engines.train._micro import padding_row

    batch = dict(fp32["batch"])
    batch[ROUTED_EXPERTS] = own_routing(tiny, batch)
    assert torch.equal(padding_row(batch)[ROUTED_EXPERTS], torch.full_like(batch[ROUTED_EXPERTS][:1], UNROUTED))
    engine = HFTrainEngine(tiny, role="actor", routing_replay=True, pack_sequences=False, logprob_chunk_size=4)
    monkeypatch.setattr(engine, "_all_reduce_max", lambda n: n + 1)  # one padding pass after the real ones
    engine.compute_logprobs(batch)
    assert engine.routing.changed_fraction() == 0.0
    # A forward outside training (old log-probs of a batch routed otherwise) is not the step's: the step's fraction
    # counts its own forwards only (it had counted the earlier ones too).
    other = dict(batch)
    other[ROUTED_EXPERTS] = (batch[ROUTED_EXPERTS] + 1) % engine.routing.num_experts
    engine.compute_logprobs(other)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(0))
    out = engine.train_step(batch, PolicyObjective(), mini_batches=1)
    assert out["routing_replay_changed_fraction"] == 0.0


def test_replay_shrinks_the_bf16_rollout_gap(near_ties, capsys, own_routing):
    ro = rollout(near_ties, dtype="bfloat16", max_new=16)
    batch, behaviour = ro["batch"], ro["behaviour"]
    mask = batch["response_mask"].bool()
    own = own_routing(near_ties, batch)
    recorded = batch[ROUTED_EXPERTS] >= 0
    flipped = (batch[ROUTED_EXPERTS].sort(-1).values != own.sort(-1).values).any(-1)[recorded.all(-1)]
    gap_replay = (trainer_logprobs(near_ties, batch, replay=True) - behaviour)[mask].abs().mean().item()
    gap_plain = (trainer_logprobs(near_ties, batch, replay=False) - behaviour)[mask].abs().mean().item()
    with capsys.disabled():
        print(
            f"\nbf16 rollout / fp32 trainer, {int(mask.sum())} response tokens, {flipped.float().mean():.1%} of "
            f"(position, layer) routings differ: mean |diff| without replay {gap_plain:.5f}, with {gap_replay:.5f}"
        )
    assert flipped.any()  # the near ties do flip under bf16
    assert gap_replay < 0.5 * gap_plain  # measured: 0.0046 without replay, 0.0009 with


def test_bad_routing_is_refused(tiny, fp32):
    batch = fp32["batch"]
    engine = HFTrainEngine(tiny, role="actor", routing_replay=True)
    with pytest.raises(ValueError, match=r"infer_engine\.return_routing"):
        engine.compute_logprobs({k: v for k, v in batch.items() if k != ROUTED_EXPERTS})
    with pytest.raises(ValueError, match="expert ids outside"):
        engine.compute_logprobs({**batch, ROUTED_EXPERTS: batch[ROUTED_EXPERTS] + 4})
    with pytest.raises(ValueError, match="MoE layers, top_k"):
        engine.compute_logprobs({**batch, ROUTED_EXPERTS: batch[ROUTED_EXPERTS][..., :1]})


def _tiny_family(kind: str) -> torch.nn.Module:
    """A random 2-layer MoE of `kind` (4 experts, top-2), small enough to build per test."""
    from transformers import GptOssConfig, GptOssForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        num_local_experts=4,
        head_dim=8,
    )
    if kind == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**common)).eval()
    return GptOssForCausalLM(GptOssConfig(**common, layer_types=["full_attention"] * 2)).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_replaying_a_models_own_routing_changes_nothing(kind, dtype):
    """Mixtral renormalises its top-k always (it has no norm_topk_prob), GPT-OSS takes the softmax over the chosen
    experts' logits: the replay gave both Qwen's gating, so with the model's own experts its gate weights summed to
    ~0.5 (Mixtral: logits off by 8e-3; GPT-OSS 5e-2) while the changed fraction read 0. In bf16 the replayed
    weights keep the router's dtype: Mixtral's are fp32, and rounding them to bf16 moved the logits by 2e-3."""
    from roll_engines.infer._routing import model_routing

    model = _tiny_family(kind).to(dtype)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(7).expand(2, 7)}
    with torch.no_grad():
        ref = model(**batch).logits
    own = model_routing(model, batch)
    replay = RoutingReplay(model)
    replay.current = own.reshape(-1, *own.shape[2:]).long()
    with torch.no_grad():
        got = model(**batch).logits
    assert replay.changed_fraction() == 0.0
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)  # bf16: bit for bit (1e-6 is below its rounding)


def test_a_router_whose_gating_roll_does_not_replay_is_refused(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    for router in RoutingRecorder(model).routers:
        router.__class__ = type("AcmeTopKRouter", (type(router),), {})
    with pytest.raises(ValueError, match=r"routers \(AcmeTopKRouter\) compute their gate weights .* supported"):
        RoutingReplay(model)


def test_a_family_whose_gating_changed_fails_at_the_first_forward(tiny, fp32, monkeypatch):
    """A transformers release that changes a supported family's gating (here: scores halved): the replayed weights
    would differ from the router's own; the first forward says so instead of training with rescaled experts."""
    engine = HFTrainEngine(tiny, role="actor", routing_replay=True, pack_sequences=False, logprob_chunk_size=4)
    cls = type(engine.routing.routers[0])
    real = cls.forward

    def changed(self, hidden):
        logits, scores, idx = real(self, hidden)
        return logits, scores * 0.5, idx

    monkeypatch.setattr(cls, "forward", changed)
    with pytest.raises(RuntimeError, match=r"Qwen3MoeTopKRouter's gate weights are not what roll computes"):
        engine.compute_logprobs(dict(fp32["batch"]))


def test_dense_model_is_refused(tmp_path):
    dense = tiny_model("qwen3", tmp_path)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        HFInferEngine(dense, return_routing=True)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        HFTrainEngine(dense, role="actor", routing_replay=True)


def test_config_refusals():
    """Replay needs the engine's record and the synchronous pipeline (train_engine=megatron's own refusals:
    test_megatron_routing_replay.py)."""
    from roll_core.config.compose import load_config
    from roll_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"set infer_engine\.return_routing=true"):
        load_config(["experiment=quickstart", "train_engine.routing_replay=true"])
    on = ["experiment=quickstart", "train_engine.routing_replay=true", "infer_engine.return_routing=true"]
    with pytest.raises(ConfigError, match="synchronous pipeline"):
        load_config([*on, "pipeline.async_ratio=1"])
    agentic = ["experiment=agentic_quickstart", "train_engine.routing_replay=true", "infer_engine.return_routing=true"]
    with pytest.raises(ConfigError, match=r"pipeline=agentic: multi-turn trajectories do not carry"):
        load_config(agentic)  # it was accepted, then failed at the first train step after a whole rollout
    cfg = load_config(on)
    assert cfg.train_engine.routing_replay and cfg.infer_engine.return_routing


def test_an_empty_micro_batch_is_prepared(tiny):
    """A rank's empty share of a short batch: `routing.max()` of no ids raised torch's bare "max(): Expected
    reduction dim to be specified for input.numel() == 0"; it sets an empty routing, and the whole-batch check (the
    Megatron replay's, run before any forward) passes an empty batch and refuses a bad one."""
    from transformers import AutoModelForCausalLM

    replay = RoutingReplay(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32))
    layers, k = len(replay.routers), replay.top_k
    ids = torch.zeros((0, 5), dtype=torch.long)
    empty = {"input_ids": ids, ROUTED_EXPERTS: torch.zeros((0, 5, layers, k), dtype=torch.int16)}
    replay.check(empty)
    replay.prepare(empty, None)
    assert replay.current is not None and tuple(replay.current.shape) == (0, layers, k)
    bad = torch.full((1, 5, layers, k), replay.num_experts, dtype=torch.int16)
    with pytest.raises(ValueError, match="expert ids outside"):  # a non-empty one is still checked
        replay.check({"input_ids": torch.zeros((1, 5), dtype=torch.long), ROUTED_EXPERTS: bad})
