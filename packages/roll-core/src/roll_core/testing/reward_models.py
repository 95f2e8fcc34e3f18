"""Stand-ins for tests of the reward-model role (roll_core.pipelines.reward_model, roll_core.cluster.reward_model).

- `tiny_classifier_model(tok, ...)`: a seeded tiny Llama sequence classifier (or causal LM) over tokenizer `tok`,
  its score head spread N(0, 1) so that scores differ clearly between inputs; `tiny_classifier(folder, tok, ...)`
  saves one with its tokenizer as an HF folder (what `reward_model.path` names).
- `FixedScorer(*batches)`: a scorer returning given raw scores, one list per call (the normalisation arithmetic is
  checked by hand against it); `scoring_rows(task)` the (batch, scored) pair `RewardModelScoring.apply` reads;
  `reward_model_config(**fields)` a `reward_model=hf` config whose model is never loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from roll_core.protocol import Batch

__all__ = ["FixedScorer", "reward_model_config", "scoring_rows", "tiny_classifier", "tiny_classifier_model"]


def tiny_classifier_model(
    tok: Any,
    layers: int = 2,
    max_position_embeddings: int = 256,
    num_labels: int = 1,
    pad: bool = True,
    causal: bool = False,
    spread: bool = True,
) -> Any:
    """A Llama of hidden size 32 (4 heads), `layers` layers, over `tok`'s vocabulary, initialised under
    torch.manual_seed(0): a sequence classifier with `num_labels` labels, its score head drawn N(0, 1) when
    `spread`, or (`causal`) a causal LM. `pad`: the config's pad token is `tok`'s; else none (the model then reads
    each row's last token)."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_position_embeddings,
        num_labels=num_labels,
        pad_token_id=tok.pad_token_id if pad else None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg) if causal else LlamaForSequenceClassification(cfg)
    if spread and not causal:
        with torch.no_grad():
            model.score.weight.normal_(0.0, 1.0)
    return model


def tiny_classifier(folder: str | Path, tok: Any, **kw: Any) -> str:
    """`tiny_classifier_model(tok, **kw)` saved with `tok` in `folder` (returned as a str)."""
    model = tiny_classifier_model(tok, **kw)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


class FixedScorer:
    """A scorer returning given raw scores, one list per call (each call's list as long as its batch)."""

    def __init__(self, *batches: list[float]) -> None:
        self.batches = list(batches)

    def score(self, batch: Batch) -> Batch:
        """The next list as `rm_scores` (float32), none truncated."""
        raw = torch.tensor(self.batches.pop(0), dtype=torch.float32)
        assert len(raw) == len(batch)
        return Batch({"rm_scores": raw, "rm_truncated": torch.zeros(len(raw), dtype=torch.bool)})


def scoring_rows(task: list[float]) -> tuple[Batch, Batch]:
    """Rows `p{i}` / `r{i}` whose task rewards (`scores`) are `task`: the prompts batch and the scored batch."""
    n = len(task)
    batch = Batch(fields={"prompt_text": [f"p{i}" for i in range(n)]})
    scored = Batch({"scores": torch.tensor(task)}, {"response_text": [f"r{i}" for i in range(n)]})
    return batch, scored


def reward_model_config(**fields: Any) -> Any:
    """A RewardModelConfig of name hf whose path is never read, with `fields`."""
    from roll_core.config.reward_model import RewardModelConfig

    return RewardModelConfig(name="hf", path="/unused", **fields)
