"""Structured outputs in the hf inference engine's continuous batcher (roll_engines.infer.hf).

A request under a constraint (`SamplingParams.structured`, roll_engines.structured) runs as `Constrained`, its
matcher walking the tokens it generates; `ConstrainedBatcher` masks each constrained row's logits to the tokens its
matcher allows before the shared sampler runs, so the reported log-probs are those of the masked distribution the
trainer replays. Unconstrained rows are untouched.

A row the mask cannot keep in its constraint fails alone with a `ConstraintViolation` naming the constraint (the
protocol's finish reasons have none for it, and a response outside its constraint must not reach the trainer):
- a state that allows no id within the logits width (a tokenizer with ids the model has no logits for): masking
  every entry would sample uniformly over all tokens;
- a sampled token the matcher refuses (`advance` False): the mask and the matcher disagree.
Its row leaves the batch at the step's end like a finished one; the other rows go on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from roll_engines.infer._batcher import ContinuousBatcher, Running, settle


@dataclass
class Constrained(Running):
    """A running request under a structured-output constraint: its matcher walks the generated tokens."""

    matcher: Any = None
    # Set when the constraint could not be kept (module docstring): the request fails with it when it retires.
    error: BaseException | None = None


class ConstrainedBatcher(ContinuousBatcher):
    """The continuous batcher with structured outputs: a logits processor masks each constrained row to the tokens
    its matcher allows before the shared sampler runs (so processed log-probs are of the masked distribution), then
    advances the matcher over the sampled token. Unconstrained rows are untouched; a row whose constraint cannot be
    kept fails with a ConstraintViolation (module docstring)."""

    def _sample(self, seqs: list[Running], logits: Tensor) -> None:
        from roll_engines.structured import mask_logits

        width = logits.shape[-1]
        rows: list[int] = []
        keeps: list[Tensor] = []
        for i, seq in enumerate(seqs):
            if getattr(seq, "matcher", None) is None:
                continue
            keep = seq.matcher.keep(width)
            if not bool(keep.any()):
                allowed = seq.matcher.allowed()
                seq.error = _violation(
                    seq,
                    f"after {len(seq.tokens)} generated tokens the constraint allows {len(allowed)} token ids, none "
                    f"below the model's logits width {width} (lowest {min(allowed, default=None)}): the tokenizer has "
                    "ids the model has no logits for, and sampling this row would ignore the constraint",
                )
                continue  # sampled unmasked below with the batch, its token discarded: the request fails
            rows.append(i)
            keeps.append(keep)
        if rows:
            logits = mask_logits(logits, rows, keeps)
        super()._sample(seqs, logits)
        for i in rows:
            seq = seqs[i]
            token = seq.tokens[-1]
            if not seq.matcher.advance(token):  # its state stays where the token was refused
                seq.error = _violation(
                    seq,
                    f"sampled token {token} (generated token {len(seq.tokens)}), which the constraint does not allow "
                    "there: the logits mask and the constraint's matcher disagree",
                )
            # The constraint's EOS ends a complete match even where the model's EOS set lacks it.
            elif seq.finish is None and not seq.request.params.ignore_eos and token == seq.matcher.vocab.eos_id:
                seq.finish = "stop"
        for seq in seqs:
            if getattr(seq, "error", None) is not None:
                seq.finish = "abort"  # retired at the step's end (its KV freed, never a reusable prefix)

    def _resolve(self, seq: Running) -> None:
        """A row whose constraint could not be kept fails with its ConstraintViolation; others resolve as usual."""
        error = getattr(seq, "error", None)
        if error is not None:
            settle(seq.future, exc=error)
            return
        super()._resolve(seq)


def _violation(seq: Constrained, what: str) -> BaseException:
    """The ConstraintViolation of `seq`: its constraint, the matcher's state (in the constraint's automaton) and
    `what` went wrong; its `detail` leaves out the request id (a `generate` caller names the row instead)."""
    from roll_engines.structured import ConstraintViolation

    rid = seq.request.request_id
    detail = f"structured output {seq.matcher.describe()} (automaton state {seq.matcher.state}): {what}"
    return ConstraintViolation(rid, f"request {rid!r}: {detail}", detail)
