"""LoRA training against the hf inference engine it syncs to, and the training forward against the scoring one:
- rollout/training agreement after 0, 1 and several changed-only merged syncs, with adapters on the embedding and
  the (untied) LM head as well as a linear layer, and `compute_logprobs(base=True)` staying the base model;
- a checkpoint's attention dropout rate (a plain float transformers' attention layers read in training mode) is
  off in training forwards, as dropout modules already were (roll_engines.train._dropout);
- a frozen reference in fp16 builds (the fp16 refusal is for trained parameters);
- GPT-2's fused `c_attn` (transformers' Conv1D) is synced whole by a changed-only sync, bias included."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from roll_core.models import resolve_model_path
from roll_core.pipelines.objectives import PolicyObjective
from roll_core.protocol import build_sequences, pad_left
from roll_core.testing.train_engine import toy_batch
from roll_engines.infer.hf import HFInferEngine
from roll_engines.train.hf import HFTrainEngine

pytest.importorskip("peft")
LORA = {"lora_rank": 4, "lora_alpha": 8.0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    return resolve_model_path("builtin:tiny")


def _rollout(infer: HFInferEngine, seed: int) -> dict[str, torch.Tensor]:
    ids = [infer.tokenizer(p)["input_ids"] for p in ("What is 1+2?", "Hi")]
    gen = infer.generate(ids, infer.defaults.replace(seed=seed), n=3)
    p_ids, p_mask = pad_left([x for x in ids for _ in range(3)], infer.pad_id)
    batch = build_sequences(p_ids, p_mask, gen.responses, gen.response_mask)
    batch.update(responses=gen.responses, response_mask=gen.response_mask, behaviour_logprobs=gen.logprobs)
    return batch


def test_rollout_logprobs_equal_the_trainers_after_each_changed_only_sync(tiny: str) -> None:
    """The sampler's log-probs equal the LoRA trainer's on the sampled rows after 0, 1 and 3 updates (the first
    sync full, the rest changed-only), and the base with adapters off stays the reference engine's model."""
    targets = ["q_proj", "embed_tokens", "lm_head"]
    train = HFTrainEngine(tiny, lr=5e-2, micro_batch_size=3, weight_decay=0.1, lora_target_modules=targets, **LORA)
    infer = HFInferEngine(tiny, max_new_tokens=8, temperature=0.8)
    reference = HFTrainEngine(tiny, role="reference")
    toy = toy_batch(tiny)
    updates = 0
    for target in (0, 1, 3):
        while updates < target:
            assert train.train_step(toy, PolicyObjective())["optimizer_steps"] == 1.0
            updates += 1
        infer.load_weights(dict(train.iter_weights(changed_only=updates > 0)))
        batch = _rollout(infer, seed=target)
        mask = batch["response_mask"]
        mine = train.compute_logprobs(batch, temperature=0.8)["logprobs"] * mask
        torch.testing.assert_close(mine, batch["behaviour_logprobs"], atol=1e-4, rtol=0)
    base = train.compute_logprobs(toy, base=True)["logprobs"]
    torch.testing.assert_close(base, reference.compute_logprobs(toy)["logprobs"], atol=0, rtol=0)
    assert (train.compute_logprobs(toy)["logprobs"] - base).abs().max() > 0.1  # the adapters learned


@pytest.fixture(scope="module")
def dropout_model(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with attention_dropout 0.5 in its config (Llama's attention reads it as a float)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("attention-dropout")
    cfg = AutoConfig.from_pretrained(tiny)
    cfg.attention_dropout = 0.5
    AutoModelForCausalLM.from_pretrained(tiny, config=cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("pack", [True, False])
def test_a_checkpoints_attention_dropout_is_off_in_training_forwards(
    tiny: str, dropout_model: str, lora: bool, pack: bool
) -> None:
    """Only dropout modules were zeroed: Llama-family attention passes `dropout=self.attention_dropout` to its
    kernel in training mode, so the log-probs a step trained on were 0.15-0.26 off the ones its scoring pass
    computed (the PPO ratio of unchanged weights was not 1)."""
    eng = HFTrainEngine(dropout_model, pack_sequences=pack, **(LORA if lora else {}))
    batch = toy_batch(tiny)
    scored = eng.compute_logprobs(batch)["logprobs"]
    eng.model.train()
    with torch.no_grad():
        trained = eng._forward(batch, 1.0, False)["logprobs"]
    torch.testing.assert_close(trained * batch["response_mask"], scored * batch["response_mask"], atol=0, rtol=0)
    assert eng.model.config.attention_dropout == 0.0  # (Falcon reads its config's rate in the forward)


def test_disable_dropout_reaches_every_kind_of_rate() -> None:
    """Dropout modules of every kind (Dropout2d is no Dropout subclass), float rates on modules, nested configs."""
    from transformers import LlamaConfig, LlavaConfig

    from roll_engines.train._dropout import disable_dropout

    model = torch.nn.Sequential(torch.nn.Dropout(0.1), torch.nn.Dropout2d(0.2), torch.nn.Linear(2, 2))
    model[2].resid_pdrop = 0.3
    model[2].keep = 0.4  # not a dropout rate: untouched
    model.config = LlavaConfig(text_config=LlamaConfig(attention_dropout=0.1).to_dict())
    model.config.hidden_dropout = 0.2
    zeroed = disable_dropout(model)
    assert model[0].p == model[1].p == model[2].resid_pdrop == 0.0 and model[2].keep == 0.4
    assert model.config.text_config.attention_dropout == 0.0 and model.config.hidden_dropout == 0.0
    assert {"0.p", "1.p", "2.resid_pdrop", "config.hidden_dropout", "config.text_config.attention_dropout"} <= set(
        zeroed
    )


def test_a_frozen_fp16_reference_builds_and_is_the_lora_base(tiny: str) -> None:
    """model.dtype=float16 (hf and fsdp2 take it, with a loss scaler) built the reference and teacher engines with
    the trainable engine's refusal of fp16 parameters: any fp16 run with a KL term or a teacher failed to start.
    A frozen engine holds fp16 weights (its linear weights, beside fp32 masters: roll_engines.train._precision);
    the fp16 LoRA actor's base, held wholly in fp16, scores as a pure fp16 reference does."""
    ref = HFTrainEngine(tiny, role="reference", dtype="float16")
    assert ref.optimizer is None and ref.model.lm_head.weight.dtype == torch.float16
    batch = toy_batch(tiny)
    mask = batch["response_mask"]
    got = ref.compute_logprobs(batch)["logprobs"]
    want = HFTrainEngine(tiny, role="reference").compute_logprobs(batch)["logprobs"]
    torch.testing.assert_close(got * mask, want * mask, atol=2e-3, rtol=0)
    pure = HFTrainEngine(tiny, role="reference", dtype="float16", param_dtype="float16")
    assert all(p.dtype == torch.float16 for p in pure.model.parameters())
    lora = HFTrainEngine(tiny, dtype="float16", lr=1e-2, micro_batch_size=6, **LORA)
    torch.testing.assert_close(
        lora.compute_logprobs(batch, base=True)["logprobs"], pure.compute_logprobs(batch)["logprobs"], atol=0, rtol=0
    )
    with pytest.raises(ValueError, match="param_dtype=float16 cannot train"):
        HFTrainEngine(tiny, dtype="float16", param_dtype="float16")


@pytest.fixture(scope="module")
def gpt2(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    out = tmp_path_factory.mktemp("tiny-gpt2")
    tok = AutoTokenizer.from_pretrained(tiny)
    torch.manual_seed(0)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    cfg = GPT2Config(
        vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=256, tie_word_embeddings=False, **ids
    )
    GPT2LMHeadModel(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def test_a_changed_only_sync_sends_gpt2s_fused_attention_whole(tiny: str, gpt2: str) -> None:
    """GPT-2's q|k|v is one transformers Conv1D (`c_attn`, weight stored transposed, with a bias): the changed-only
    sync's fused groups were found from torch's Linear alone, so it sent `c_attn.weight` without `c_attn.bias`
    (vLLM reloads a fused layer whole). It now sends the attention modules whole and nothing of the MLPs; the merge
    is peft's and the hf engine synced with it scores as the trainer."""
    with pytest.warns(UserWarning, match="fan_in_fan_out"):  # peft: Conv1D's weight is transposed
        eng = HFTrainEngine(gpt2, lr=5e-2, micro_batch_size=6, lora_target_modules=["c_attn"], **LORA)
    batch = toy_batch(tiny)
    eng.train_step(batch, PolicyObjective())
    changed = {k for k, _ in eng.iter_weights(changed_only=True)}
    attention = {k for k, _ in HFTrainEngine(gpt2).iter_weights() if ".attn." in k}
    assert "transformer.h.0.attn.c_attn.bias" in changed
    assert changed == attention
    merged = dict(eng.iter_weights())
    for k, v in copy.deepcopy(eng.model).merge_and_unload().state_dict().items():
        torch.testing.assert_close(merged[k], v, msg=k)
    infer = HFInferEngine(gpt2)
    infer.load_weights(dict(eng.iter_weights(changed_only=True)))
    view = HFTrainEngine(gpt2, role="reference")
    view.load_weights(dict(infer.model.state_dict()))
    torch.testing.assert_close(
        view.compute_logprobs(batch)["logprobs"], eng.compute_logprobs(batch)["logprobs"], atol=1e-5, rtol=0
    )
