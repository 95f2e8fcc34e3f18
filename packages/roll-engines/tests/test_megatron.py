"""The `megatron` engine (Megatron-Core on CPU over gloo) beyond the TrainEngine conformance suite (which runs it at
TP=PP=1 in-process with every installed engine, test_train_conformance.py); TP=2 and PP=2 against the `hf` engine
run on Ray in tests/e2e/test_megatron_ray.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
pytestmark = pytest.mark.usefixtures("megatron_process_group")


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_activation_recomputation_gives_the_same_gradients(recompute: str, tmp_path_factory) -> None:
    import os

    import torch

    from roll_core.models import resolve_model_path
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch
    from roll_engines.train.megatron import MegatronTrainEngine

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    path = resolve_model_path("builtin:tiny")
    batch, objective = toy_batch(path), PolicyObjective()
    common = {"dist_backend": "gloo", "use_distributed_optimizer": False, "micro_batch_size": 3}
    plain = MegatronTrainEngine(path, **common).compute_gradients(batch, objective)
    again = MegatronTrainEngine(path, recompute=recompute, **common).compute_gradients(batch, objective)
    for name, g in plain.items():
        torch.testing.assert_close(again[name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_packed_sequences_give_the_padded_logprobs_and_gradients() -> None:
    """Shared-prompt packing (a group's responses one after another in a row, under a block mask) equals the padded
    layout: Megatron rotates by sequence index, so a response placed after a sibling needs its own positions
    (it failed by 1.6e-3 in log-prob before `_rope_at`)."""
    from roll_core.models import resolve_model_path
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch
    from roll_engines.train.megatron import MegatronTrainEngine

    path = resolve_model_path("builtin:tiny")
    batch, objective = toy_batch(path), PolicyObjective(agg="token-mean")
    engine = MegatronTrainEngine(path, dist_backend="gloo", use_distributed_optimizer=False, micro_batch_size=3)
    results = []
    for packed in (False, True):
        engine.pack_sequences = packed
        results.append((engine.compute_logprobs(batch, with_entropy=True), engine.compute_gradients(batch, objective)))
    (padded_lp, padded_g), (packed_lp, packed_g) = results
    mask = batch["response_mask"].bool()
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(packed_lp[key][mask], padded_lp[key][mask], atol=1e-5, rtol=1e-5, msg=key)
    for name, g in padded_g.items():
        torch.testing.assert_close(packed_g[name], g, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_families_convert_exactly(kind: str, tmp_path: Path) -> None:
    """The Qwen2/Qwen3 mappings: log-probs equal plain transformers', and the weights exported in HF names equal the
    HF checkpoint's, biases and q/k norms included."""
    import os

    from safetensors.torch import load_file

    from roll_core.testing.models import assert_matches_transformers, tiny_model
    from roll_engines.train.megatron import MegatronTrainEngine

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny_model(kind, tmp_path / kind)
    hf = load_file(str(Path(path) / "model.safetensors"))
    assert any(k.endswith("q_proj.bias") for k in hf) == (kind == "qwen2")
    assert any(k.endswith("q_norm.weight") for k in hf) == (kind == "qwen3")
    eng = MegatronTrainEngine(path, dist_backend="gloo", use_distributed_optimizer=False, micro_batch_size=4)
    assert_matches_transformers(eng, path, hf)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_entropy_bonus_trains_like_hf(packed: bool) -> None:
    """Entropies from the vocab-parallel logits (two sums all-reduced, no vocabulary gather) equal hf's, and with an
    entropy bonus (entropy_coef 0.5, large enough that a wrong entropy gradient shows) the gradients equal hf's."""
    from roll_core.models import resolve_model_path
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch
    from roll_engines.train.hf import HFTrainEngine
    from roll_engines.train.megatron import MegatronTrainEngine

    path = resolve_model_path("builtin:tiny")
    batch, objective = toy_batch(path), PolicyObjective(agg="token-mean", entropy_coef=0.5)
    common = {"micro_batch_size": 3, "pack_sequences": packed}
    hf = HFTrainEngine(path, **common)
    mega = MegatronTrainEngine(path, dist_backend="gloo", use_distributed_optimizer=False, **common)
    mask = batch["response_mask"].bool()
    want = hf.compute_logprobs(batch, temperature=0.7, with_entropy=True)["entropy"]
    got = mega.compute_logprobs(batch, temperature=0.7, with_entropy=True)["entropy"]
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)
    expected, grads = hf.compute_gradients(batch, objective), mega.compute_gradients(batch, objective)
    plain = mega.compute_gradients(batch, PolicyObjective(agg="token-mean"))
    assert max((plain[n] - g).abs().max() for n, g in expected.items()) > 1e-3  # the bonus changes the gradient
    for name, g in expected.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_vocabulary_projection_runs_on_response_positions_only(packed: bool) -> None:
    """The output layer computes one row per response token (padded: B x R per micro-batch; packed: one per token
    it scores), not one per position: the prompt's logits would be the step's largest tensors and are never used.
    The log-probs are still the hf engine's."""
    from roll_core.models import resolve_model_path
    from roll_core.testing.batches import toy_batch
    from roll_engines.train.hf import HFTrainEngine
    from roll_engines.train.megatron import MegatronTrainEngine

    path = resolve_model_path("builtin:tiny")
    batch = toy_batch(path)
    engine = MegatronTrainEngine(
        path, dist_backend="gloo", use_distributed_optimizer=False, logprob_chunk_size=3, pack_sequences=packed
    )
    rows: list[int] = []
    hook = engine.model.output_layer.register_forward_hook(lambda m, args, out: rows.append(out[0].shape[0]))
    try:
        got = engine.compute_logprobs(batch)["logprobs"]
    finally:
        hook.remove()
    b, r = batch["responses"].shape
    assert len(rows) == -(-b // 3)
    if packed:
        assert sum(rows) == int(batch["response_mask"].sum())  # each packed response token once
    else:
        assert sum(rows) == b * r
    assert sum(rows) < batch["input_ids"].numel() / 2  # not the prompt positions
    want = HFTrainEngine(path, role="reference").compute_logprobs(batch)["logprobs"]
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)


def test_the_reported_learning_rate_is_hfs_step_for_step() -> None:
    """With a warmup, each step's `lr` metric is the hf engine's: the rate the step's optimizer step applied
    (Megatron sets it on its optimizer's groups before stepping). Both reported the schedule's value after the step
    (with a warm-up of 4, LR x 2/4 for a step that trained at LR x 1/4); Megatron once one step behind hf's."""
    from roll_core.models import resolve_model_path
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch
    from roll_engines.train.hf import HFTrainEngine
    from roll_engines.train.megatron import MegatronTrainEngine

    path = resolve_model_path("builtin:tiny")
    batch = toy_batch(path)
    common = {"micro_batch_size": 3, "lr": 1e-3, "warmup_steps": 4, "total_steps": 10}
    hf = HFTrainEngine(path, **common)
    mega = MegatronTrainEngine(path, dist_backend="gloo", use_distributed_optimizer=False, **common)
    for step in range(2):
        want = hf.train_step(batch, PolicyObjective())["lr"]
        got = mega.train_step(batch, PolicyObjective())["lr"]
        assert want == pytest.approx(1e-3 * (step + 1) / 4)  # the warm-up's rate for this step
        assert got == pytest.approx(want) and mega.optimizer.param_groups[0]["lr"] == pytest.approx(want)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_what_the_mapping_cannot_carry_is_refused(change: dict, message: str) -> None:
    """Dynamic-NTK RoPE (frequencies that change with the sequence length; test_megatron_rope.py has the scaled
    types that map and the other refusals), o_proj / MLP biases (dropped
    on load: gaps of 0.4-0.6, untrained, missing from exports) and an MLP activation other than SiLU (Megatron's
    is always SwiGLU) are refused, not silently approximated."""
    from transformers import LlamaConfig

    from roll_engines.train.megatron._convert import check_supported

    shape = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    with pytest.raises(ValueError, match=message):
        check_supported(LlamaConfig(**shape, **change), tp=1, pp=1)
    check_supported(LlamaConfig(**shape), tp=1, pp=1)  # the plain model maps


def test_an_mlp_width_tensor_parallelism_does_not_divide_is_refused() -> None:
    """Megatron splits each MLP's width over the tensor-parallel ranks: intermediate_size=130 at TP=4 failed deep in
    Megatron's layer build with a bare assertion; refused naming the setting."""
    from transformers import LlamaConfig

    from roll_engines.train.megatron._convert import check_supported

    shape = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide the model's intermediate_size=130"):
        check_supported(LlamaConfig(**shape, intermediate_size=130), tp=4, pp=1)
    check_supported(LlamaConfig(**shape, intermediate_size=130), tp=2, pp=1)


def test_a_checkpoint_tensor_the_mapping_does_not_carry_is_refused(tmp_path: Path) -> None:
    """A decoder tensor the HF -> Megatron mapping never reads (here an MLP bias added to the file) would be dropped
    on load, untrained and missing from every export: the engine refuses the checkpoint, naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from roll_core.models import resolve_model_path
    from roll_engines.train.megatron import MegatronTrainEngine

    folder = tmp_path / "model"
    shutil.copytree(resolve_model_path("builtin:tiny"), folder)
    (weights,) = folder.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.down_proj.bias"] = torch.zeros(tensors["model.norm.weight"].shape)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=r"1 tensors roll's Megatron mapping does not carry .*down_proj\.bias"):
        MegatronTrainEngine(str(folder), dist_backend="gloo", use_distributed_optimizer=False)


def test_an_untied_checkpoint_without_lm_head_is_refused(tmp_path: Path) -> None:
    """tie_word_embeddings=false and no lm_head.weight in the files: transformers starts that lm_head at random;
    the engine used the input embeddings in its place, silently another model than hf's and vLLM's."""
    import shutil

    from safetensors.torch import load_file, save_file

    from roll_core.models import resolve_model_path
    from roll_engines.train.megatron import MegatronTrainEngine

    folder = tmp_path / "model"
    shutil.copytree(resolve_model_path("builtin:tiny"), folder)
    (weights,) = folder.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors["lm_head.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=r"no lm_head\.weight and its config does not tie it"):
        MegatronTrainEngine(str(folder), dist_backend="gloo", use_distributed_optimizer=False)


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed-optimizer", "plain-optimizer"])
def test_a_checkpoint_saved_before_the_first_update_resumes_as_a_fresh_engine(
    tiny: str, tmp_path: Path, distributed: bool
) -> None:
    """A save before the optimizer ever stepped (the first steps trained nothing: every response masked): the
    distributed optimizer's save failed on its missing Adam `step`, ending the run. The save holds a fresh
    optimizer's state; the engine that saved and one resumed from the folder both take a fresh engine's update."""
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch
    from roll_engines.train.megatron import MegatronTrainEngine

    batch = toy_batch(tiny)
    empty = {**batch, "response_mask": torch.zeros_like(batch["response_mask"])}

    def build() -> MegatronTrainEngine:
        kw = {"lr": 1e-3, "weight_decay": 0.1, "micro_batch_size": 6, "use_distributed_optimizer": distributed}
        return MegatronTrainEngine(tiny, dist_backend="gloo", **kw)

    def stepped(engine: MegatronTrainEngine) -> dict[str, torch.Tensor]:
        assert engine.train_step(batch, PolicyObjective())["optimizer_steps"] == 1
        return engine.get_weights()

    want = stepped(build())
    saved = build()
    assert saved.train_step(empty, PolicyObjective())["optimizer_steps"] == 0
    saved.save(tmp_path / "ckpt", tiny)
    resumed = build()
    resumed.load(tmp_path / "ckpt")
    for got in (stepped(saved), stepped(resumed)):
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, atol=1e-6, rtol=0, msg=name)
