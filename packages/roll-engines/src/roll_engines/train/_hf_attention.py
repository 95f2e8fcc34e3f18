"""Attention-based credit of the `hf` training engine (roll_algos.attention_credit; roll_engines.train._attention).

`HFAttentionCredit` is a mixin of `HFTrainEngine`: `compute_attention_credit` (each response token's WAAD and
FAI) and `attention_maps` (the maps themselves, for checks), from a padded no-grad forward per chunk of rows whose
attention probabilities are captured layer by layer. Text policies only (not the critic, not vision-language
models). It uses the engine's `model`, `role`, `vision`, `device`, `compute_dtype`, `autocast`, `routing`,
`logprob_chunk_size`, `forward_tokens`, `_checked` (the batch's checks, agreed over data-parallel ranks before any
forward) and `_all_reduce_max`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from roll_engines.train._lora import base_model
from roll_engines.train._micro import padding_row as _padding_row


class HFAttentionCredit:
    """Attention maps and the token scores attention-based credit reads, on an hf-family engine."""

    model: torch.nn.Module
    role: str
    vision: Any
    device: torch.device
    compute_dtype: torch.dtype
    autocast: bool
    routing: Any
    logprob_chunk_size: int
    forward_tokens: int

    @torch.no_grad()
    def compute_attention_credit(
        self,
        batch: Mapping[str, Tensor],
        *,
        layers: list[int] | None = None,
        window: int = 10,
        head_fraction: float = 0.25,
        chunk_rows: int = 128,
    ) -> dict[str, Tensor]:
        """{"waad", "fai"} (B, R) of the response tokens, for attention-based credit (roll_algos.attention_credit):
        the WAAD (clip `window`) of the row that generated each token over the `head_fraction` most local heads of
        `layers` (negative from the top; None or empty: the middle layer), and each token's FAI over the most global
        ones, heads chosen per row by mean attention distance. A padded no-grad forward per `logprob_chunk_size` rows
        reads the maps in blocks of `chunk_rows` rows (roll_engines.train._attention: memory rows x heads x
        chunk_rows x (P+R) floats for one layer at a time). 0 outside the response mask."""
        parts = self._attention_pass(batch, layers, window, chunk_rows, head_fraction=head_fraction)
        return {k: torch.cat([p[k] for p in parts]) for k in ("waad", "fai")}

    @torch.no_grad()
    def attention_maps(self, batch: Mapping[str, Tensor], layers: list[int] | None = None) -> dict[int, Tensor]:
        """{layer: (B, H, R+1, P+R)} the attention probabilities of rows P-1 .. P+R-1 (those attention credit reads)
        of the asked layers, as `compute_attention_credit` computes them (for checks; memory grows as (P+R)^2)."""
        parts = self._attention_pass(batch, layers, 1, 1 << 30, keep_maps=True)
        return {i: torch.cat([p[i] for p in parts]) for i in parts[0]} if parts else {}

    def _attention_pass(
        self,
        batch: Mapping[str, Tensor],
        layers: list[int] | None,
        window: int,
        chunk_rows: int,
        head_fraction: float = 1.0,
        keep_maps: bool = False,
    ) -> list[dict]:
        from roll_engines.train import _attention as A

        if self.role == "critic":
            raise ValueError("attention credit reads the policy's attention: the critic has none to give")
        if self.vision is not None:
            raise ValueError("attention credit reads text models; this one is a vision-language model")
        model = base_model(self.model)
        picked = A.resolve_layers(list(layers or []), int(model.config.num_hidden_layers))
        tensors = self._checked(batch)  # ids and replayed routing, refused on every rank before any forward
        n = tensors["input_ids"].shape[0]
        chunks = [
            {k: v[s : s + self.logprob_chunk_size] for k, v in tensors.items()}
            for s in range(0, n, self.logprob_chunk_size)
        ]
        was_training = self.model.training
        self.model.eval()
        parts: list[dict] = []
        try:
            # Sharded forwards are collective: every rank runs as many chunks as the busiest one (padding rows).
            for i in range(self._all_reduce_max(len(chunks))):
                micro = chunks[i] if i < len(chunks) else _padding_row(tensors)
                rec = A.micro_recorder(micro, picked, window, chunk_rows, keep_maps)
                if self.routing is not None:
                    self.routing.prepare(micro, None)
                ids = micro["input_ids"].to(self.device)
                self.forward_tokens += ids.numel()
                autocast = torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.autocast)
                with A.capturing(model, rec), autocast:
                    self.model(
                        input_ids=ids,
                        attention_mask=micro["attention_mask"].to(self.device),
                        position_ids=micro["position_ids"].to(self.device),
                        logits_to_keep=1,
                    )
                if i < len(chunks):
                    parts.append(rec.maps if keep_maps else rec.token_scores(head_fraction))
        finally:
            self.model.train(was_training)
        return parts
