"""The `megatron` engine (TP=PP=1 in-process over gloo, one engine for the module) on a checkpoint whose HF config
asks for dropout (attention_dropout and hidden_dropout 0.5):
- its training forwards compute the log-probs its scoring passes compute (TransformerConfig's dropout rates are 0
  whatever the checkpoint says, as the hf engine's since roll_engines.train._dropout), padded and packed;
- a batch's token ids are checked once, on the host, before any forward (`compute_logprobs`, `train_step`,
  `compute_gradients`): a `responses` or `input_ids` id outside [0, vocab_size) is a ValueError naming the engine,
  the tensor, the id and its place. Megatron's vocab-parallel cross entropy read an out-of-shard target as logit 0
  (a silent, finite log-prob), its padding rows (ids in [vocab_size, padded vocab)) give -inf, and the embedding
  raised a bare IndexError at TP=1 (under TP it embeds such an id as zeros)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
pytestmark = pytest.mark.usefixtures("megatron_process_group")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    """The built-in tiny Llama saved with attention_dropout=0.5 and hidden_dropout=0.5, as a Megatron actor."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from roll_core.models import resolve_model_path
    from roll_engines.train.megatron import MegatronTrainEngine

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    tiny = resolve_model_path("builtin:tiny")
    out = tmp_path_factory.mktemp("dropout-model")
    cfg = AutoConfig.from_pretrained(tiny)
    cfg.attention_dropout, cfg.hidden_dropout = 0.5, 0.5
    AutoModelForCausalLM.from_pretrained(tiny, config=cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    assert AutoConfig.from_pretrained(out).attention_dropout == 0.5
    common = {"dist_backend": "gloo", "use_distributed_optimizer": False, "lr": 1e-3}
    # One micro-batch for scoring and training alike: the same rows in the same forward.
    return MegatronTrainEngine(str(out), name="policy", micro_batch_size=8, logprob_chunk_size=8, **common)


class _Recording:
    """PolicyObjective that keeps the log-probs of each training forward it is handed (and the model's mode)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from roll_core.pipelines.objectives import PolicyObjective

        self.inner, self.model, self.seen = PolicyObjective(), model, []
        self.needs_entropy = self.inner.needs_entropy

    def __call__(self, outputs: dict, micro: dict):
        self.seen.append((self.model.training, outputs["logprobs"].detach().cpu().clone()))
        return self.inner(outputs, micro)

    def units(self, micro: dict) -> float:
        return self.inner.units(micro)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_training_forwards_equal_the_scoring_pass_despite_the_checkpoints_dropout(engine, packed: bool) -> None:
    from roll_core.testing.batches import toy_batch

    engine.pack_sequences = packed
    batch = toy_batch(engine.path)
    mask = batch["response_mask"].bool()
    scored = engine.compute_logprobs(batch)["logprobs"]
    loss = _Recording(engine.model)
    grads = engine.compute_gradients(batch, loss)
    assert any(g.abs().max() > 0 for g in grads.values())
    assert [training for training, _ in loss.seen] == [True]  # one micro-batch, in training mode
    trained = loss.seen[0][1]
    torch.testing.assert_close(trained[mask], scored[mask], atol=0, rtol=0)
    assert engine.model.config.attention_dropout == 0.0 and engine.model.config.hidden_dropout == 0.0
    rates = {n: m.p for n, m in engine.model.named_modules() if isinstance(m, torch.nn.Dropout)}
    assert rates and set(rates.values()) == {0.0}


def _batch(response_ids: list[list[int]], prompts: list[list[int]], *, into_input: bool = True) -> dict:
    """Two rows of three response tokens after `prompts`. `into_input=False`: the responses' tokens in `input_ids`
    stay valid (3) and only `responses` carries the given ids (a corrupted batch)."""
    from roll_core.sequences import build_sequences, pad_left

    responses = torch.tensor(response_ids)
    mask = torch.ones_like(responses)
    p_ids, p_mask = pad_left(prompts, 0)
    out = build_sequences(p_ids, p_mask, responses if into_input else torch.full_like(responses, 3), mask)
    out.update(responses=responses, response_mask=mask)
    out["advantages"] = torch.ones(responses.shape)
    out["old_logprobs"] = torch.zeros(responses.shape)
    return out


def test_token_ids_outside_the_vocabulary_are_refused_before_any_forward(engine) -> None:
    from roll_core.pipelines.objectives import PolicyObjective

    engine.pack_sequences = True
    vocab = int(engine.hf_config.vocab_size)
    prompts = [[5, 6], [7]]
    ok = engine.compute_logprobs(_batch([[3, 4, vocab - 1], [vocab - 1, 3, 4]], prompts))["logprobs"]
    assert ok.shape == (2, 3) and torch.isfinite(ok).all()
    who = r"actor engine 'policy'"
    # Only `responses` corrupted: the cross entropy read the id as logit 0, a finite log-prob (-4.45 for all three).
    # (vocab_size itself is the first padding row under TP > 1: checked against the config, not the padded width.)
    for bad in (vocab, vocab + 7, -1):
        with pytest.raises(ValueError, match=rf"{who}: response token id {bad} \(row 0, position 2\).*\[0, {vocab}\)"):
            engine.compute_logprobs(_batch([[3, 4, bad], [3, 4, 5]], prompts, into_input=False))
    # In the input too (the embedding's IndexError at TP=1).
    with pytest.raises(ValueError, match=rf"response token id {vocab + 2} \(row 1, position 0\)"):
        engine.compute_logprobs(_batch([[3, 4, 5], [vocab + 2, 3, 4]], prompts))
    # A prompt id (row 1 is left-padded by one: its prompt token sits at position 1).
    prompt_bad = rf"{who}: input_ids token id {vocab + 3} \(row 1, position 1\).*\[0, {vocab}\)"
    with pytest.raises(ValueError, match=prompt_bad):
        engine.compute_logprobs(_batch([[3, 4, 5], [3, 4, 5]], [[5, 6], [vocab + 3]]))
    bad = _batch([[3, 4, vocab + 1], [3, 4, 5]], prompts, into_input=False)
    before = {k: v.clone() for k, v in engine.get_weights().items()}
    with pytest.raises(ValueError, match=rf"{who}: response token id {vocab + 1}"):
        engine.train_step(bad, PolicyObjective())
    with pytest.raises(ValueError, match=rf"{who}: response token id {vocab + 1}"):
        engine.compute_gradients(bad, PolicyObjective())
    negative = _batch([[3, 4, 5], [3, 4, 5]], [[-4, 6], [7]])
    with pytest.raises(ValueError, match=r"input_ids token id -4 \(row 0, position 0\)"):
        engine.train_step(negative, PolicyObjective())
    after = engine.get_weights()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing trained
