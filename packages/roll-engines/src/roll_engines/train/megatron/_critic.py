"""The `megatron` engine's critic: Megatron's GPTModel with its output layer replaced by a value head, exchanged with
Hugging Face as a token-classification model (`AutoModelForTokenClassification`, num_labels=1), the same model the
`hf` and `fsdp2` critics train.

| Megatron | HF (…ForTokenClassification) | sharding |
|---|---|---|
| output_layer.weight (1, H) | score.weight | replicated |
| output_layer.bias (1,) | score.bias | replicated |
| (every other tensor) | as the causal LM's, under `model.` | as there |

A critic starts from a causal LM (no `score.*` in the folder: a new head, N(0, initializer_range) and bias 0 from
the engine's seed, as transformers initialises it) or from a critic checkpoint (its head). The head is replicated
on every tensor-parallel rank: its input is the whole hidden state (under sequence parallelism gathered from the
sequence shards first, the backward handing each rank its own shard's gradient), so its gradients are equal on
every TP rank and Megatron counts them once in the grad norm.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


class ValueHead(torch.nn.Module):
    """hidden (S, B, H) -> values (S, B, 1), called as Megatron calls its output layer (returns (output, bias))."""

    def __init__(self, hidden: int, sequence_parallel: bool, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype))  # the model's dtype, as its input's
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def attach(model: Any) -> None:
    """Replace the last stage's output layer by a ValueHead (other stages have none)."""
    if model.post_process:
        config = model.config
        model.output_layer = ValueHead(config.hidden_size, bool(config.sequence_parallel), config.params_dtype)


def head_tensors(hf: Mapping[str, Tensor], cfg: Any, seed: int) -> dict[str, Tensor]:
    """The value head's Megatron tensors: a critic checkpoint's `score.*`, or a new head (see the module doc)."""
    if "score.weight" in hf:
        bias = hf.get("score.bias", torch.zeros(1))
        return {"output_layer.weight": hf["score.weight"].float(), "output_layer.bias": bias.float()}
    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(cfg, "initializer_range", 0.02))
    weight = torch.randn(1, cfg.hidden_size, generator=gen) * std
    return {"output_layer.weight": weight, "output_layer.bias": torch.zeros(1)}


def to_hf(name: str, t: Tensor) -> dict[str, Tensor]:
    """HF name of a value-head tensor (replicated: no TP gather)."""
    return {"score." + name.rsplit(".", 1)[1]: t}


def response_values(values: Tensor, micro: Mapping[str, Any]) -> dict[str, Tensor]:
    """Values (B, R) of a micro-batch's response positions (the state before each response token, as the hf
    critic reads them) from the head's output (B, S, 1): padded rows or the packed layout."""
    packed = micro.get("_packed")
    if packed is not None:
        return {"values": packed.scatter(values[packed.keep][packed.source][:, 0].float())}
    r = micro["responses"].shape[1]
    return {"values": values[:, -r - 1 : -1, 0].float()}


def hf_skeleton(cfg: Any, critic: bool) -> Any:
    """The HF model whose checkpoints the engine reads and writes, on the meta device (its parameter order and
    `save_pretrained`): the causal LM, or for the critic a one-label token classifier of the same config."""
    import copy

    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if critic:
        cfg = copy.deepcopy(cfg)
        cfg.num_labels = 1
    with torch.device("meta"):
        return (AutoModelForTokenClassification if critic else AutoModelForCausalLM).from_config(cfg)
