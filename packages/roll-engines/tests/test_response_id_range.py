"""A response token id outside the model's vocabulary is a ValueError naming the engine, the id and the width,
raised once per batch before any forward (roll_engines.train._logits.check_response_ids): on a GPU the gather or
the embedding lookup would fail with a device-side assert that kills the CUDA context, on a CPU with a bare
IndexError, and the packed path's advanced indexing would read a negative id from the vocabulary's end."""

from __future__ import annotations

import pytest
import torch

from roll_core.pipelines.objectives import PolicyObjective
from roll_core.sequences import build_sequences, pad_left
from roll_engines.train.hf import HFTrainEngine


def _batch(vocab: int, response_ids: list[list[int]], *, into_input: bool = True) -> dict[str, torch.Tensor]:
    """Two rows of three response tokens after short prompts. `into_input=False`: the response's tokens in
    `input_ids` stay valid (3) and only `responses` carries the given ids (a corrupted batch)."""
    responses = torch.tensor(response_ids)
    mask = torch.ones_like(responses)
    p_ids, p_mask = pad_left([[5, 6], [7]], 0)
    out = build_sequences(p_ids, p_mask, responses if into_input else torch.full_like(responses, 3), mask)
    out.update(responses=responses, response_mask=mask)
    out["advantages"] = torch.ones(responses.shape)
    out["old_logprobs"] = torch.zeros(responses.shape)
    return out


@pytest.mark.parametrize("pack", [True, False])
def test_an_id_past_the_vocabulary_is_named(tiny: str, pack: bool) -> None:
    eng = HFTrainEngine(tiny, role="reference", name="teacher", pack_sequences=pack)
    vocab = int(eng.model.get_output_embeddings().out_features)
    # In range up to the last id: scored as before.
    ok = eng.compute_logprobs(_batch(vocab, [[3, 4, vocab - 1], [vocab - 1, 3, 4]]))["logprobs"]
    assert ok.shape == (2, 3) and torch.isfinite(ok).all()
    # A wider student's token (also the model's input here).
    with pytest.raises(ValueError, match=rf"reference engine 'teacher'.*token id {vocab + 7}.*\[0, {vocab}\)"):
        eng.compute_logprobs(_batch(vocab, [[3, 4, 5], [vocab + 7, 3, 4]]))
    # Only `responses` corrupted: input ids valid, the gather alone would read the bad id.
    with pytest.raises(ValueError, match=rf"token id {vocab}\b.*\[0, {vocab}\)"):
        eng.compute_logprobs(_batch(vocab, [[3, 4, vocab], [3, 4, 5]], into_input=False))
    # A negative id (packed: indexing would silently take the vocabulary's last token).
    with pytest.raises(ValueError, match=rf"token id -1\b.*\[0, {vocab}\)"):
        eng.compute_logprobs(_batch(vocab, [[3, 4, -1], [3, 4, 5]], into_input=False))


def test_training_checks_the_batch_too(tiny: str) -> None:
    eng = HFTrainEngine(tiny, name="policy", lr=1e-3)
    vocab = int(eng.model.get_output_embeddings().out_features)
    bad = _batch(vocab, [[3, 4, vocab + 1], [3, 4, 5]], into_input=False)
    objective = PolicyObjective()
    with pytest.raises(ValueError, match=rf"actor engine 'policy'.*token id {vocab + 1}"):
        eng.train_step(bad, objective)
    with pytest.raises(ValueError, match=rf"token id {vocab + 1}"):
        eng.compute_gradients(bad, objective)


def test_a_prompt_id_past_the_embedding_is_named(tiny: str) -> None:
    """`input_ids` are checked too (roll_engines.train._logits.check_batch_ids), prompts and their padding: an id
    outside the input embedding was a bare IndexError on CPU (a device-side assert on a GPU), padded or packed."""
    eng = HFTrainEngine(tiny, name="policy", lr=1e-3)
    vocab = int(eng.model.get_input_embeddings().num_embeddings)
    for pack in (True, False):
        eng.pack_sequences = pack
        batch = _batch(vocab, [[3, 4, 5], [3, 4, 5]])
        batch["input_ids"][1, 1] = vocab + 3  # row 1's prompt token (left-padded by one)
        with pytest.raises(ValueError, match=rf"actor engine 'policy': input_ids token id {vocab + 3} \(row 1, "):
            eng.compute_logprobs(batch)
        batch["input_ids"][1, 1] = 7
        batch["input_ids"][0, 0] = -2
        for call in (eng.train_step, eng.compute_gradients):
            with pytest.raises(ValueError, match=rf"input_ids token id -2 \(row 0, position 0\).*\[0, {vocab}\)"):
                call(batch, PolicyObjective())
        batch["input_ids"][0, 0] = 5
        assert torch.isfinite(eng.compute_logprobs(batch)["logprobs"]).all()  # the repaired batch scores
