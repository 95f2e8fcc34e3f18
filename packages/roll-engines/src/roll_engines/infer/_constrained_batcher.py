"""Structured outputs in the hf inference engine's continuous batcher (roll_engines.infer.hf).

A request under a constraint (`SamplingParams.structured`, roll_engines.structured) runs as `Constrained`, its
matcher walking the tokens it generates; `ConstrainedBatcher` masks each constrained row's logits to the tokens its
matcher allows before the shared sampler runs, so the reported log-probs are those of the masked distribution the
trainer replays. Unconstrained rows are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from roll_engines.infer._batcher import ContinuousBatcher, Running


@dataclass
class Constrained(Running):
    """A running request under a structured-output constraint: its matcher walks the generated tokens."""

    matcher: Any = None


class ConstrainedBatcher(ContinuousBatcher):
    """The continuous batcher with structured outputs: a logits processor masks each constrained row to the tokens
    its matcher allows before the shared sampler runs (so processed log-probs are of the masked distribution), then
    advances the matcher over the sampled token. Unconstrained rows are untouched."""

    def _sample(self, seqs: list[Running], logits: Tensor) -> None:
        from roll_engines.structured import mask_logits

        rows = [i for i, s in enumerate(seqs) if getattr(s, "matcher", None) is not None]
        if rows:
            logits = mask_logits(logits, rows, [seqs[i].matcher.keep(logits.shape[-1]) for i in rows])
        super()._sample(seqs, logits)
        for i in rows:
            seq = seqs[i]
            token = seq.tokens[-1]
            seq.matcher.advance(token)
            # The constraint's EOS ends a complete match even where the model's EOS set lacks it.
            if seq.finish is None and not seq.request.params.ignore_eos and token == seq.matcher.vocab.eos_id:
                seq.finish = "stop"
