"""Emulated FP8 rollout (`infer_engine.emulate_fp8`): the rounding is e4m3's with a per-tensor scale, the hf engine
holds rounded linear weights after its load and after every weight sync (never the trainer's full-precision
copy), the LM head and embeddings are untouched, and the log-probs it reports move away from the trainer's by far
more than an unquantized engine's while the trainer's log-probs of the same tokens stay exact."""

from __future__ import annotations

import torch

from roll_core.protocol import build_sequences, pad_left
from roll_engines.infer._fp8_emulation import E4M3_MAX, fp8_round
from roll_engines.infer.hf import HFInferEngine
from roll_engines.train.hf import HFTrainEngine


def test_fp8_round_by_hand() -> None:
    # amax 448 -> scale 1: e4m3 keeps 3 mantissa bits, so 0.3 = 1.2 * 2^-2 rounds to 1.25 * 2^-2 = 0.3125,
    # 5.3 = 1.325 * 2^2 to 1.375 * 2^2 = 5.5, and 100 = 1.5625 * 2^6 to 1.5 * 2^6 = 96 (ties to even).
    t = torch.tensor([448.0, 1.0, 0.3, -0.3, 5.3, 100.0, 0.0])
    torch.testing.assert_close(fp8_round(t), torch.tensor([448.0, 1.0, 0.3125, -0.3125, 5.5, 96.0, 0.0]))
    # The scale follows amax: the same tensor scaled by 1/64 rounds to the same values scaled by 1/64.
    torch.testing.assert_close(fp8_round(t / 64), fp8_round(t) / 64)
    assert fp8_round(t.double()).dtype == torch.float64 and E4M3_MAX == 448.0
    # Rounding a rounded tensor changes nothing (amax maps onto 448 exactly).
    w = torch.randn(64, 32)
    torch.testing.assert_close(fp8_round(fp8_round(w)), fp8_round(w), rtol=0, atol=0)
    assert (fp8_round(w) - w).abs().max() > 0


def _linears(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    head = model.get_output_embeddings()
    return {
        n: m.weight.detach().clone()
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head
    }


def test_engine_holds_rounded_weights_after_load_and_every_sync(tiny: str) -> None:
    plain = HFInferEngine(tiny)
    fp8 = HFInferEngine(tiny, emulate_fp8=True)
    raw, held = _linears(plain.model), _linears(fp8.model)
    assert raw.keys() == held.keys() and len(raw) >= 7  # q, k, v, o, gate, up, down per layer
    for name in raw:
        torch.testing.assert_close(held[name], fp8_round(raw[name]), rtol=0, atol=0)
        assert not torch.equal(held[name], raw[name]), name
    # Each such layer's input is rounded per call (W8A8, vLLM's dynamic per-tensor activation scale).
    layer = next(m for m in fp8.model.modules() if isinstance(m, torch.nn.Linear))
    x = torch.randn(3, 5, layer.in_features)
    with torch.no_grad():
        want = torch.nn.functional.linear(fp8_round(x), layer.weight, layer.bias)
        torch.testing.assert_close(layer(x), want, rtol=0, atol=0)
        assert not torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-6)
    head = fp8.model.get_output_embeddings().weight
    torch.testing.assert_close(head, plain.model.get_output_embeddings().weight, rtol=0, atol=0)
    # A sync sends full-precision weights (here: perturbed, as after a training step); the engine rounds them.
    sent = {k: v + 0.01 * torch.randn_like(v) for k, v in plain.model.state_dict().items()}
    fp8.load_weights(sent)
    after = _linears(fp8.model)
    prefix = {n: n + ".weight" for n in after}
    for name in after:
        torch.testing.assert_close(after[name], fp8_round(sent[prefix[name]]), rtol=0, atol=0)
    plain.shutdown()
    fp8.shutdown()


def test_gap_to_the_trainer_grows_and_the_trainer_stays_exact(tiny: str) -> None:
    trainer = HFTrainEngine(tiny, trainable=False, role="reference")
    gaps = {}
    for emulate in (False, True):
        engine = HFInferEngine(tiny, emulate_fp8=emulate, max_new_tokens=12)
        prompts = [[5, 6, 7, 8], [9, 10, 11]]
        out = engine.generate(prompts, engine.defaults.replace(seed=3, ignore_eos=True), n=4)
        p_ids, p_mask = pad_left([p for p in prompts for _ in range(4)], engine.pad_id)
        batch = build_sequences(p_ids, p_mask, out.responses, out.response_mask)
        batch.update(responses=out.responses, response_mask=out.response_mask)
        logp = trainer.compute_logprobs(batch)["logprobs"]
        mask = out.response_mask.bool()
        gaps[emulate] = (logp - out.logprobs)[mask].abs().mean().item()
        engine.shutdown()
    print(f"mean |train - infer| log-prob gap: {gaps}")
    assert gaps[False] < 1e-4, gaps  # the same kernels up to reduction order
    assert gaps[True] > 100 * max(gaps[False], 1e-7) and gaps[True] > 1e-3, gaps


def test_a_mixture_of_experts_is_refused(tmp_path) -> None:
    """vLLM's FP8 rounds the routed experts (3-D fused weights here) and not the routers; rounding the nn.Linear
    layers only left most of an MoE's weights exact and understated the gap, silently."""
    import pytest

    from roll_core.testing.models import tiny_model

    path = tiny_model("qwen3_moe", str(tmp_path))
    with pytest.raises(ValueError, match=r"emulate_fp8: .* is a mixture of experts"):
        HFInferEngine(path, emulate_fp8=True)


def test_a_sync_of_a_wrongly_shaped_tensor_is_refused(tiny: str) -> None:
    """copy_ broadcast a (1,) tensor over a whole weight (every entry 0.5)."""
    import pytest

    engine = HFInferEngine(tiny)
    name, weight = next((k, v) for k, v in engine.model.state_dict().items() if v.dim() == 1)
    before = weight.clone()
    with pytest.raises(ValueError, match=rf"weight '{name}': the sync sent shape \(1,\)"):
        engine.update_weights([(name, torch.tensor([0.5]))])
    assert torch.equal(engine.model.state_dict()[name], before)
