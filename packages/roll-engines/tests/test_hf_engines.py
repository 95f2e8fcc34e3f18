"""hf train and infer engines on the built-in tiny model: log-prob agreement, exact gradient accumulation,
sampling layout, stop strings, weight sync and checkpoints that plain transformers loads."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from roll_core.interfaces import Request, SamplingParams
from roll_core.models import build_tiny_tokenizer, resolve_model_path
from roll_core.pipelines.objectives import PolicyObjective
from roll_core.protocol import build_sequences, pad_left
from roll_engines.infer.hf import HFInferEngine
from roll_engines.train.hf import HFTrainEngine, adamw_kernel, lr_lambda


def _batch(infer: HFInferEngine, prompts: list[str], n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = [infer.tokenizer(p)["input_ids"] for p in prompts]
    gen = infer.generate(ids, infer.defaults.replace(seed=seed), n=n)
    p_ids, p_mask = pad_left([x for x in ids for _ in range(n)], infer.pad_id)
    batch = build_sequences(p_ids, p_mask, gen.responses, gen.response_mask)
    batch.update(responses=gen.responses, response_mask=gen.response_mask, behaviour_logprobs=gen.logprobs)
    return batch


def test_tiny_model_is_deterministic_and_cached(tiny: str) -> None:
    assert resolve_model_path("builtin:tiny") == tiny
    assert (Path(tiny) / "config.json").exists() and (Path(tiny) / "tokenizer.json").exists()
    tok = build_tiny_tokenizer()
    assert tok.decode(tok("a+b=\\boxed{3}")["input_ids"]) == "a+b=\\boxed{3}"
    with pytest.raises(ValueError, match="unknown builtin model 'huge'"):
        resolve_model_path("builtin:huge")


def test_generate_layout_and_logprobs_match_trainer(tiny: str) -> None:
    infer = HFInferEngine(tiny, max_new_tokens=12, temperature=0.8)
    batch = _batch(infer, ["What is 1+2?", "Hi"], n=3)
    assert batch["responses"].shape[0] == 6 and batch["responses"].shape[1] <= 12
    mask = batch["response_mask"]
    assert (mask[:, 1:] <= mask[:, :-1]).all(), "mask must be a prefix"
    train = HFTrainEngine(tiny, trainable=False, role="reference")
    logp = train.compute_logprobs(batch, temperature=0.8)["logprobs"]
    # The trainer recomputes exactly what the sampler reported (same weights, fp32).
    torch.testing.assert_close(logp * mask, batch["behaviour_logprobs"], atol=2e-4, rtol=1e-4)


def test_sampling_is_reproducible_per_seed(tiny: str) -> None:
    infer = HFInferEngine(tiny, max_new_tokens=8)
    a = infer.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, seed=11), n=4).responses
    b = infer.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, seed=11), n=4).responses
    c = infer.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, seed=12), n=4).responses
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_batch_samples_the_same_rows_over_any_number_of_engines(tiny: str, world_size: int) -> None:
    """InferGroup.generate splits a batch over its ranks; each seeded its rows by their place in its own slice (and
    by its rank), so `infer_engine.world_size` changed every sampled response (and roll-eval, on one engine, could
    not reproduce a run's eval/accuracy)."""
    from roll_core.cluster.roles import InferGroup, InferWorker
    from roll_core.protocol import Batch
    from roll_engines.config import HFInferEngineConfig

    def rows(ranks: int) -> list[list[int]]:
        group = InferGroup(
            InferWorker,
            ranks,
            "local",
            name="actor_infer",
            engine=vars(HFInferEngineConfig()),
            runtime={"model_path": tiny},
        )
        try:
            batch = Batch(fields={"prompt_ids": [[5, 6, 7 + i] for i in range(5)]})  # 5 prompts: uneven slices
            out = group.generate(batch, SamplingParams(temperature=1.0, max_new_tokens=6, seed=3), 2)
        finally:
            group.shutdown()
        return [r[m.bool()].tolist() for r, m in zip(out["responses"], out["response_mask"])]

    one = rows(1)
    assert len(one) == 10 and len({tuple(r) for r in one}) > 5  # sampled: rows differ
    assert rows(world_size) == one


def test_step_metrics_weigh_micro_batches_by_their_tokens(tiny: str) -> None:
    """Row 0 has 1 response token with correction weight 3, row 1 four with weight 1; one row per micro-batch. The
    step's actor/correction/weight_mean is the token mean (3 + 4) / 5 = 1.4; it was the mean of the micro-batches'
    means, (3 + 1) / 2 = 2.0."""
    import math

    from roll_algos.corrections import icepop

    ids, pm = pad_left([[5, 6, 7], [8, 9, 10]], 0)
    resp = torch.tensor([[11, 0, 0, 0], [12, 13, 14, 15]])
    rmask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])
    batch = build_sequences(ids, pm, resp, rmask)
    behaviour = torch.full((2, 4), math.log(0.5))
    old = behaviour + torch.tensor([[3.0, 1, 1, 1], [1, 1, 1, 1]]).log()
    weights = icepop(old, behaviour, rmask.float(), low=0.5, high=5.0).weights
    batch.update(
        responses=resp, response_mask=rmask, advantages=rmask.float(), is_weights=weights, behaviour_logprobs=behaviour
    )
    engine = HFTrainEngine(tiny, role="actor", micro_batch_size=1, pack_sequences=False, lr=0.0)
    metrics = engine.train_step(batch, PolicyObjective(variant="ppo"), mini_batches=1)
    assert metrics["actor/correction/weight_mean"] == pytest.approx(1.4, abs=1e-6)

    # The same two rows on two data-parallel ranks, one each: TrainGroup.train's merge weighs each rank's mean by
    # its tokens (1 and 4), not its rows (1 and 1: (3 + 1) / 2 = 2.0).
    from roll_core.cluster.roles import merge_rank_metrics

    per_rank = [
        HFTrainEngine(tiny, role="actor", lr=0.0).train_step(
            {k: v[i : i + 1] for k, v in batch.items()}, PolicyObjective(variant="ppo")
        )
        for i in range(2)
    ]
    assert [m["actor/correction/weight_mean"] for m in per_rank] == pytest.approx([3.0, 1.0])
    merged = merge_rank_metrics(per_rank, [1, 1])
    assert merged["actor/correction/weight_mean"] == pytest.approx(1.4, abs=1e-6)
    assert not any(k.startswith("_weight/") for k in merged)


def test_stop_strings_end_responses(tiny: str) -> None:
    infer = HFInferEngine(tiny, max_new_tokens=24, stop=["e"], temperature=1.5)
    gen = infer.generate([[10, 11]], infer.defaults.replace(seed=0), n=16)
    texts = [infer.tokenizer.decode(r[m.bool()]) for r, m in zip(gen.responses, gen.response_mask)]
    stopped = [t for t, tr in zip(texts, gen.truncated) if not tr and not t.endswith("</s>")]
    assert stopped and all(t.endswith("e") and "e" not in t[:-1] for t in stopped)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradient_accumulation_is_exact(tiny: str, agg: str) -> None:
    infer = HFInferEngine(tiny, max_new_tokens=10)
    batch = _batch(infer, ["abc", "What is 2+2?", "x"], n=2, seed=3)
    batch["advantages"] = torch.randn(batch["responses"].shape) * batch["response_mask"]
    objective = PolicyObjective(agg=agg, norm_length=10)

    def grads(micro: int) -> dict[str, torch.Tensor]:
        return HFTrainEngine(tiny, micro_batch_size=micro).compute_gradients(batch, objective)

    whole, split = grads(6), grads(4)  # 6 rows as one micro-batch vs 4 + 2
    assert whole.keys() == split.keys() and any(g.abs().sum() > 0 for g in whole.values())
    for name in whole:
        torch.testing.assert_close(whole[name], split[name], atol=1e-6, rtol=1e-4, msg=name)


def test_a_rank_given_no_rows_merges_into_the_step_metrics(tiny: str) -> None:
    """A data-parallel rank given no rows (a batch smaller than the rank count) trains nothing and reports no loss
    metrics; TrainGroup.train's merge (roll_core.cluster.roles.merge_rank_metrics) gives the rows' rank's."""
    from roll_core.cluster.roles import merge_rank_metrics

    infer = HFInferEngine(tiny, max_new_tokens=8)
    batch = _batch(infer, ["abc"], n=2)
    batch["advantages"] = torch.ones_like(batch["behaviour_logprobs"]) * batch["response_mask"]
    full = HFTrainEngine(tiny, lr=1e-2).train_step(batch, PolicyObjective())
    empty = HFTrainEngine(tiny, lr=1e-2).train_step({k: v[:0] for k, v in batch.items()}, PolicyObjective())
    assert "actor/pg_loss" in full and set(empty) < set(full)
    assert merge_rank_metrics([full, empty], [2, 0]) == {k: v for k, v in full.items() if not k.startswith("_weight/")}


def test_training_changes_weights_and_sync_copies_them(tiny: str) -> None:
    infer = HFInferEngine(tiny, max_new_tokens=8)
    batch = _batch(infer, ["abc"], n=4)
    batch["advantages"] = torch.ones_like(batch["behaviour_logprobs"]) * batch["response_mask"]
    eng = HFTrainEngine(tiny, lr=1e-2, micro_batch_size=2)
    before = eng.compute_logprobs(batch)["logprobs"]
    metrics = eng.train_step(batch, PolicyObjective())
    after = eng.compute_logprobs(batch)["logprobs"]
    assert metrics["grad_norm"] > 0 and metrics["lr"] == pytest.approx(1e-2)
    m = batch["response_mask"].bool()
    assert after[m].sum() > before[m].sum()  # positive advantage raised the sampled tokens' log-probs
    nbytes = infer.load_weights(eng.get_weights())
    assert nbytes == sum(p.numel() * 4 for p in infer.model.parameters())  # tied tensors would travel once
    for k, v in eng.model.state_dict().items():
        torch.testing.assert_close(infer.model.state_dict()[k], v)


def test_adamw_uses_the_fused_kernel_where_torch_has_one(tiny: str) -> None:
    """CPU's default AdamW is a per-tensor loop (~15x slower than fused for a 135M model, bench/RESULTS.md); the
    fused kernel gives the same update up to float reassociation."""
    assert HFTrainEngine(tiny).optimizer.defaults["fused"] is True
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
    grads = [torch.randn(4, 3) for _ in params]
    updated = []
    for kernel in ({}, adamw_kernel(params)):
        ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt = torch.optim.AdamW(ps, lr=0.1, weight_decay=0.01, **kernel)
        for _ in range(3):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
        updated.append(ps)
    for a, b in zip(*updated):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert adamw_kernel([torch.zeros(2, device="meta")]) == {}  # no fused kernel for that device: torch's default


def test_checkpoint_of_a_trained_engine_loads_with_plain_transformers_and_into_a_fresh_engine(
    tiny: str, tmp_path: Path
) -> None:
    """Saved after a training step, so that a checkpoint of the initial weights, or a load that does nothing,
    cannot pass: plain transformers and a fresh engine both get the trained weights, not the base model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    infer = HFInferEngine(tiny, max_new_tokens=8)
    batch = _batch(infer, ["abc", "What is 2+2?"], n=2)
    batch["advantages"] = torch.ones_like(batch["behaviour_logprobs"]) * batch["response_mask"]
    eng = HFTrainEngine(tiny, lr=1e-2)
    eng.train_step(batch, PolicyObjective())
    eng.save(tmp_path / "ckpt")
    trained = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
    base = {k: v.detach().clone() for k, v in HFTrainEngine(tiny, lr=1e-2).model.state_dict().items()}
    changed = [k for k in trained if not torch.equal(trained[k], base[k])]
    assert changed, "the training step changed no weight: the round trip below would prove nothing"

    assert list((tmp_path / "ckpt" / "model").glob("*.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, trained[k], msg=k)
    tok = AutoTokenizer.from_pretrained(tmp_path / "ckpt" / "model")
    assert tok("What is 2+2?")["input_ids"] == infer.tokenizer("What is 2+2?")["input_ids"]

    other = HFTrainEngine(tiny, lr=1e-2)
    other.load(tmp_path / "ckpt")
    loaded = other.model.state_dict()
    assert loaded.keys() == trained.keys()
    for k in trained:
        torch.testing.assert_close(loaded[k], trained[k], atol=0, rtol=0, msg=k)
    assert not all(torch.equal(loaded[k], base[k]) for k in changed)


def test_critic_values_shape(tiny: str) -> None:
    infer = HFInferEngine(tiny, max_new_tokens=6)
    batch = _batch(infer, ["ab"], n=2)
    critic = HFTrainEngine(tiny, role="critic", lr=1e-3)
    values = critic.compute_values(batch)["values"]
    assert values.shape == batch["responses"].shape and torch.isfinite(values).all()


def test_lr_schedule() -> None:
    f = lr_lambda("cosine", warmup_steps=2, total_steps=6)
    assert [round(f(s), 3) for s in range(6)] == [0.5, 1.0, 1.0, 0.854, 0.5, 0.146]
    assert lr_lambda("linear", 0, 4)(2) == pytest.approx(0.5)
    assert lr_lambda("constant", 3, 10)(0) == pytest.approx(1 / 3)


def test_bad_role_and_temperature(tiny: str) -> None:
    with pytest.raises(ValueError, match="role must be"):
        HFTrainEngine(tiny, role="judge")
    with pytest.raises(ValueError, match=r"temperature=-1\.0 must be >= 0"):
        HFInferEngine(tiny, temperature=-1.0)


def test_gradient_checkpointing_gives_the_same_gradients(tiny: str) -> None:
    infer = HFInferEngine(tiny, max_new_tokens=8)
    batch = _batch(infer, ["abc", "xyz"], n=2, seed=1)
    batch["advantages"] = torch.linspace(-1, 1, 4)[:, None] * batch["response_mask"]
    plain = HFTrainEngine(tiny).compute_gradients(batch, PolicyObjective())
    ckpt = HFTrainEngine(tiny, gradient_checkpointing=True).compute_gradients(batch, PolicyObjective())
    for name, g in plain.items():
        torch.testing.assert_close(ckpt[name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_iter_weights_sends_tied_tensors_once_and_skips_frozen(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tiny_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tied")
    tok.save_pretrained(tmp_path / "tied")
    eng = HFTrainEngine(str(tmp_path / "tied"))
    names = [k for k, _ in eng.iter_weights()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # one tensor, sent once
    assert len(names) == len(set(names)) == len(list(eng.model.parameters()))
    eng.model.model.norm.weight.requires_grad_(False)
    changed = [k for k, _ in eng.iter_weights(changed_only=True)]
    assert "model.norm.weight" not in changed and len(changed) == len(names) - 1


def test_a_non_finite_loss_skips_the_step_without_touching_weights_or_schedule(tiny: str) -> None:
    infer = HFInferEngine(tiny, max_new_tokens=8)
    batch = _batch(infer, ["abc"], n=4)
    batch["advantages"] = torch.ones_like(batch["behaviour_logprobs"]) * batch["response_mask"]
    eng = HFTrainEngine(tiny, lr=1e-2, micro_batch_size=2, warmup_steps=5, total_steps=10, lr_schedule="cosine")
    objective = PolicyObjective()

    class NanLoss(PolicyObjective):
        def __call__(self, outputs: dict, micro: dict) -> tuple:
            loss, m = super().__call__(outputs, micro)
            return loss * float("nan"), m

    nan_loss = NanLoss()

    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    lr0 = eng.scheduler.get_last_lr()[0]
    bad = eng.train_step(batch, nan_loss, mini_batches=2)
    assert bad["nonfinite_steps"] == 2 and bad["optimizer_steps"] == 0 and "grad_norm" not in bad
    assert eng.scheduler.get_last_lr()[0] == lr0 and not eng.optimizer.state  # no LR step, no Adam moments
    for k, v in eng.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    good = eng.train_step(batch, objective, mini_batches=2)
    assert good["nonfinite_steps"] == 0 and good["grad_norm"] > 0 and eng.scheduler.get_last_lr()[0] > lr0
    assert good["optimizer_steps"] == 2


def test_fp16_loss_scaler_overflows_are_not_non_finite_steps(tiny: str) -> None:
    """fp16 compute: the loss scaler's first steps overflow by design while it lowers its scale. Those skips are
    `scaler_skipped_steps` (the scale halves each time), not `nonfinite_steps`, which would stop the run as a
    blow-up; a NaN loss under fp16 still is one."""
    from roll_core.testing.batches import toy_batch

    batch = toy_batch(tiny)
    batch["advantages"] = batch["advantages"] * 200.0  # finite, but an fp16 backward at scale 2^16 overflows
    eng = HFTrainEngine(tiny, lr=1e-4, dtype="float16", param_dtype="float32", micro_batch_size=6)
    steps = [eng.train_step(batch, PolicyObjective(), mini_batches=1) for _ in range(7)]
    assert all(m["nonfinite_steps"] == 0 for m in steps)
    skips = [m["scaler_skipped_steps"] for m in steps]
    assert skips[0] == 1 and sum(skips) >= 2 and sum(m["optimizer_steps"] for m in steps) == 7 - sum(skips)
    scales = [m["loss_scale"] for m in steps]
    assert scales[0] == 2.0**15 and scales[1] == 2.0**14  # halved after each overflow

    class NanLoss(PolicyObjective):
        def __call__(self, outputs: dict, micro: dict) -> tuple:
            loss, m = super().__call__(outputs, micro)
            return loss * float("nan"), m

    bad = eng.train_step(batch, NanLoss(), mini_batches=1)
    assert bad["nonfinite_steps"] == 1 and bad["scaler_skipped_steps"] == 0 and bad["optimizer_steps"] == 0


def test_a_loaded_optimizer_takes_the_configured_lr_and_keeps_its_moments_and_position(
    tiny: str, tmp_path: Path
) -> None:
    """Resuming with a changed lr / weight decay: the checkpoint brings Adam's moments and the schedule's position,
    the run's config brings the rates (before, the saved lr and weight decay came back and the new ones were
    silently ignored)."""
    infer = HFInferEngine(tiny, max_new_tokens=8)
    batch = _batch(infer, ["abc"], n=2)
    batch["advantages"] = torch.ones_like(batch["behaviour_logprobs"]) * batch["response_mask"]
    schedule = dict(warmup_steps=4, total_steps=10, lr_schedule="cosine")
    saved = HFTrainEngine(tiny, lr=1e-2, weight_decay=0.1, **schedule)
    saved.train_step(batch, PolicyObjective(), mini_batches=2)  # two optimizer steps: warm-up at 2/4 next
    saved.save(tmp_path / "ckpt")
    assert saved.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 3 / 4)

    resumed = HFTrainEngine(tiny, lr=1e-4, weight_decay=0.0, betas=(0.8, 0.9), **schedule)
    resumed.load(tmp_path / "ckpt")
    group = resumed.optimizer.param_groups[0]
    assert resumed.scheduler.last_epoch == 2  # the position is the checkpoint's
    groups = resumed.optimizer.param_groups  # matrices, then biases and norms (no weight decay)
    assert group["lr"] == pytest.approx(1e-4 * 3 / 4) and resumed.scheduler.get_last_lr() == [g["lr"] for g in groups]
    assert len(groups) == 2 and all(g["lr"] == group["lr"] and tuple(g["betas"]) == (0.8, 0.9) for g in groups)
    assert group["weight_decay"] == 0.0 and tuple(group["betas"]) == (0.8, 0.9)
    moments = {n: s["exp_avg"] for n, s in zip(range(len(group["params"])), resumed.optimizer.state.values())}
    assert moments and all(float(m.abs().sum()) > 0 for m in moments.values())  # Adam's state came back
    out = resumed.train_step(batch, PolicyObjective())
    assert out["optimizer_steps"] == 1 and resumed.scheduler.get_last_lr()[0] == pytest.approx(1e-4 * 4 / 4)


@pytest.mark.parametrize("kind", ["hf", "fsdp2"])
def test_a_checkpoint_saved_before_the_first_step_changes_no_update(tiny: str, tmp_path: Path, kind: str) -> None:
    """Saving a never-stepped optimizer: torch's DCP built its state with a zero-lr step, leaving Adam at step 1
    with zero moments on the live engine and in the checkpoint, so the first real update (here, and after a resume
    from that checkpoint) took step 2's bias corrections. Both runs now take the fresh engine's first update."""
    import torch.distributed as dist

    from roll_core.testing.batches import toy_batch
    from roll_engines.train.fsdp2 import FSDP2TrainEngine

    batch = toy_batch(tiny)
    kw = dict(lr=1e-3, weight_decay=0.1, micro_batch_size=6)

    def build() -> HFTrainEngine:
        return FSDP2TrainEngine.conformance_engine(tiny, **kw) if kind == "fsdp2" else HFTrainEngine(tiny, **kw)

    def stepped(engine: HFTrainEngine) -> dict[str, torch.Tensor]:
        engine.train_step(batch, PolicyObjective())
        return engine.get_weights()

    try:
        want = stepped(build())
        saved = build()
        saved.save(tmp_path / "ckpt")
        resumed = build()
        resumed.load(tmp_path / "ckpt")
        for got in (stepped(saved), stepped(resumed)):
            for name, w in want.items():
                torch.testing.assert_close(got[name], w, atol=1e-6, rtol=0, msg=name)
    finally:
        if kind == "fsdp2" and dist.is_initialized():
            dist.destroy_process_group()


def test_the_engine_stops_on_the_tokenizers_eos_and_the_generation_configs(tiny: str, tmp_path: Path) -> None:
    """A fine-tuned checkpoint may change its tokenizer's EOS and not generation_config.json's (or the reverse):
    the engine stops on both, as vLLM does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(tiny), AutoTokenizer.from_pretrained(tiny)
    assert model.generation_config.eos_token_id == tok.eos_token_id == 2
    tok.eos_token = tok.convert_ids_to_tokens(5)  # the tokenizer's EOS changed, the generation config's not
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    engine = HFInferEngine(str(tmp_path))
    try:
        assert engine.eos_ids == {2, 5}
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", ["hf", "fsdp2"])
def test_a_checkpoint_whose_tensors_do_not_match_is_refused(tiny: str, tmp_path: Path, kind: str) -> None:
    """A model/ folder with renamed (or missing) tensors: loading raises, naming them (fsdp2 loaded it silently,
    the unmatched layers keeping their initial weights under the optimizer state of the trained ones)."""
    from safetensors.torch import load_file, save_file

    from roll_engines.train.fsdp2 import FSDP2TrainEngine

    def build() -> HFTrainEngine:
        if kind == "hf":
            return HFTrainEngine(tiny, lr=1e-2)
        return FSDP2TrainEngine.conformance_engine(tiny, lr=1e-2)

    try:
        build().save(tmp_path / "ckpt", tiny)
        f = tmp_path / "ckpt" / "model" / "model.safetensors"
        weights = load_file(f)
        save_file({("x." + k if "layers.0." in k else k): v for k, v in weights.items()}, f, metadata={"format": "pt"})
        with pytest.raises(RuntimeError, match=r"checkpoint mismatch: .*model\.layers\.0\."):
            build().load(tmp_path / "ckpt")
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def test_save_honours_trust_remote_code_for_the_tokenizer(tiny: str, tmp_path: Path) -> None:
    """A model whose tokenizer is custom code: saving passes trust_remote_code on (it raised after writing model/,
    leaving a checkpoint without optimizer state)."""
    import json
    import shutil

    src = tmp_path / "remote"
    shutil.copytree(tiny, src)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    base = cfg.get("tokenizer_class", "PreTrainedTokenizerFast")
    (src / "my_tok.py").write_text(f"from transformers import {base} as Base\n\nclass MyTokenizer(Base):\n    pass\n")
    cfg["tokenizer_class"] = "MyTokenizer"
    cfg["auto_map"] = {"AutoTokenizer": [None, "my_tok.MyTokenizer"]}
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    engine = HFTrainEngine(str(src), trust_remote_code=True)
    engine.save(tmp_path / "ckpt", str(src))
    assert (tmp_path / "ckpt" / "engine.pt").exists() and (tmp_path / "ckpt" / "model" / "tokenizer.json").exists()


def test_a_weight_update_pauses_at_the_next_step_boundary(tiny: str) -> None:
    """begin_weight_update takes the engine at the next step boundary, while requests keep running: no decode step
    starts between the call and its return (a lock is not fair: the stepping thread re-took it after each step, and
    an update waited up to 66 steps here), and the requests resume afterwards under the new version."""
    engine = HFInferEngine(tiny, max_new_tokens=8)
    steps = [0]
    real_step = engine.batcher.step

    def counted() -> None:
        steps[0] += 1
        real_step()

    engine.batcher.step = counted
    # Long enough to be running when the update comes (the tiny model decodes a step in about a millisecond).
    long = SamplingParams(temperature=1.0, max_new_tokens=480, seed=0, ignore_eos=True)
    during: list[int] = []
    # CI time: 8 trials of ~2 s (12 took 27 s on 2 cores); a loaded machine may stall this thread until a batch has
    # finished, so trials go on (16 at most) until 8 updates found their batch decoding.
    for trial in range(16):
        batch = [engine.submit(Request(f"long-{trial}-{i}", [5, 6, 7, 8 + i], long)) for i in range(8)]
        first = steps[0]
        deadline = time.monotonic() + 60
        while steps[0] < first + 2:  # a step admits every queued row: all 8 admitted and decoding (no fixed sleep)
            assert time.monotonic() < deadline, f"the batch never started decoding: {steps[0] - first} steps in 60 s"
            time.sleep(0.001)
        before = steps[0]
        engine.begin_weight_update()
        if not any(f.done() for f in batch):  # an update that found the batch running (a loaded machine may not)
            during.append(steps[0] - before)
        engine.finish_weight_update()
        assert all(len(f.result(timeout=300).token_ids) == 480 for f in batch)  # resumed and finished
        if len(during) == 8:
            break
    assert len(during) >= 4, f"the batch had finished before most updates: {during}"
    assert max(during) <= 1, f"decode steps that started while an update waited: {during}"
    engine.shutdown()


def test_offline_distill_metrics_are_the_batch_token_mean_whatever_the_micro_batches(tiny: str) -> None:
    """distill/kl (and loss, masses) from micro-batches of 1 row, one row with 1 response token and one with 8:
    the batch's token-mean, as with one micro-batch (a plain mean of per-micro-batch means weighed the 1-token row
    as much as the 8-token one)."""
    from roll_core.pipelines.objectives.distill_offline import _MEANS, _SUM, _TOKENS, TopKDistillLoss
    from roll_core.posttrain.distill import TEACHER_IDS, TEACHER_LOGPROBS

    g = torch.Generator().manual_seed(0)
    prompts, responses = torch.tensor([[5, 6], [7, 8]]), torch.randint(10, 60, (2, 8), generator=g)
    mask = torch.tensor([[1] + [0] * 7, [1] * 8])
    batch = build_sequences(prompts, torch.ones_like(prompts), responses, mask)
    batch.update(responses=responses, response_mask=mask)
    batch[TEACHER_IDS] = torch.randint(10, 60, (2, 8, 3), generator=g)
    batch[TEACHER_LOGPROBS] = torch.log_softmax(torch.randn(2, 8, 3, generator=g), -1) - 0.5

    def metrics(micro: int) -> dict[str, float]:
        m = HFTrainEngine(tiny, micro_batch_size=micro, lr=0.0).train_step(batch, TopKDistillLoss())
        return {k: m[k + _SUM] / m[_TOKENS] for k in _MEANS}

    whole, split = metrics(2), metrics(1)
    for k in _MEANS:
        assert split[k] == pytest.approx(whole[k], rel=1e-5), k


def test_an_entropy_only_logged_keeps_no_graph(tiny: str) -> None:
    """entropy_coef=0 (every preset but AsyPPO): actor/entropy is logged without autograd keeping the entropy's
    (b, R, V) intermediates for backward (measured on a 32k vocabulary: 375 MiB saved per micro-batch instead of
    125); the value is the same, and a bonus still gets its gradient."""
    from roll_core.testing.batches import toy_batch

    batch = toy_batch(tiny)
    batch["advantages"] = batch["response_mask"].float()
    saved: list[int] = []

    def kept(coef: float) -> tuple[int, float]:
        saved.clear()
        hook = (lambda t: (saved.append(t.numel() * t.element_size()), t)[1], lambda t: t)
        with torch.autograd.graph.saved_tensors_hooks(*hook):
            m = HFTrainEngine(tiny, micro_batch_size=8).train_step(batch, PolicyObjective(entropy_coef=coef))
        return sum(saved), m["actor/entropy"]

    (logged, ent0), (bonus, ent1) = kept(0.0), kept(0.01)
    assert logged < bonus and ent0 == pytest.approx(ent1)


def test_a_request_aborted_across_an_update_reports_the_version_it_was_sampled_under(tiny: str) -> None:
    """Aborted while the engine was paused for an update, the request resolves after it: every token came from
    version 0, and it said 1."""
    from roll_core.interfaces import Request

    engine = HFInferEngine(tiny)
    try:
        fut = engine.submit(Request("r", [5, 6, 7], SamplingParams(max_new_tokens=400, ignore_eos=True, seed=1)))
        deadline = time.monotonic() + 60
        while not (engine.batcher.running and engine.batcher.running[0].tokens):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        engine.begin_weight_update()  # paused: no token is sampled from here on
        engine.abort("r")
        engine.update_weights([(k, v.detach().clone()) for k, v in engine.model.named_parameters()])
        assert engine.finish_weight_update() == 1
        out = fut.result(timeout=60)
        assert out.finish_reason == "abort" and out.token_ids and out.weight_version == 0
        after = engine.submit(Request("s", [5, 6], SamplingParams(max_new_tokens=2, seed=1))).result(timeout=60)
        assert after.weight_version == 1
    finally:
        engine.shutdown()
