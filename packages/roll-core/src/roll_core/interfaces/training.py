"""The training-engine contract: what `actor_train`, `critic` and `reference` workers host.

Data layout (roll_core.protocol): `input_ids`/`attention_mask`/`position_ids` are (B, P+R) with the prompt
left-padded to P and the response right-padded to R; `responses` and `response_mask` are (B, R).

A `TrainEngine` computes log-probs (actor, reference) or values (critic) without gradients, runs optimizer
steps with exact gradient accumulation (`LossFn.units`), yields its full weights for inference engines, and saves
and loads checkpoints that plain transformers reads. Sharded engines (FSDP2, Megatron) run every method on every
rank; methods marked collective must be called on all ranks together.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor


#: Prefix of the per-rank metric weights `train_step` may report (see LossFn); the group's merge drops them.
METRIC_WEIGHT_PREFIX = "_weight/"

#: Suffix of the metrics that are maxima (the policy loss's `ratio_max`): a step reports the largest value over its
#: micro-batches, mini-batches, epochs and data-parallel ranks, never their mean (see LossFn).
MAX_METRIC_SUFFIX = "_max"


def is_max_metric(key: str) -> bool:
    """Whether the train metric `key` is a maximum (named `*_max`), merged by taking the largest value."""
    return key.endswith(MAX_METRIC_SUFFIX)


def largest(values: list[float]) -> float:
    """The merge of a maximum's values: max(values), NaN when any is NaN (Python's max keeps or drops a NaN
    depending on where it stands)."""
    return math.nan if any(math.isnan(v) for v in values) else max(values)


@runtime_checkable
class LossFn(Protocol):
    """What `train_step` needs from a loss: a callable plus its aggregation unit count.

    `outputs` holds "logprobs" (b, R) of the sampled response tokens under log_softmax(logits / temperature), and
    "entropy" (b, R) when `needs_entropy`. A loss may also declare `gather_ids_key: str | None` (read with getattr,
    default None): when it names a (b, R, K) integer tensor of token ids in the micro-batch, the engine adds
    `outputs["gathered_logprobs"]` (b, R, K), log_softmax(logits / temperature) at those ids, fp32 and
    differentiable (a distillation student read at its teacher's top-k ids). Every built-in engine does, padded and
    packed, LoRA included; positions outside the response are meaningless (packed: 0), as for "logprobs".

    Metrics: `train_step` reports each metric's mean over the micro-batches weighted by their `units` (a token mean
    per micro-batch becomes the mini-batch's token mean under token-mean aggregation), except the keys a loss lists
    in `summed_metrics: tuple[str, ...]` (read with getattr, default none): sums (and their counts) whose ratio the
    objective forms itself, averaged alike, and the keys it lists in `token_metrics` (same reading): masked means
    over the micro-batch's response tokens, weighted by its valid tokens (`response_mask`; under sequence-mean
    aggregation the units are rows, and a token mean weighted by rows is not the batch's). Beside each averaged
    metric `k` an engine may report its total weight as `METRIC_WEIGHT_PREFIX + k` (the units, tokens, or
    micro-batch count for summed keys, behind that mean on this rank):
    the group merges the data-parallel ranks' means by those weights (a token mean stays the batch's token mean
    when ranks hold responses of different lengths) and by rows where an engine reports none. A metric named
    `*_max` (`is_max_metric`) is a maximum: the step's value is the largest over its micro-batches and the ranks
    (averaged, a ratio of 5 on one token of one micro-batch in 6 was reported as 2.1).
    """

    needs_entropy: bool

    def __call__(self, outputs: dict[str, Tensor], micro: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss of one micro-batch, aggregated within it, and detached metrics."""
        ...

    def units(self, micro: Mapping[str, Tensor]) -> float:
        """How many aggregation units (tokens or sequences) the micro-batch holds."""
        ...


@runtime_checkable
class TrainEngine(Protocol):
    """What a training worker hosts. Engines take plain values and never a Hydra config."""

    #: Registry name (`train_engine=<name>`).
    name: str
    #: actor | critic | reference.
    role: str

    @property
    def dp_rank(self) -> int: ...

    @property
    def dp_size(self) -> int: ...

    def compute_logprobs(
        self,
        batch: Mapping[str, Tensor],
        temperature: float = 1.0,
        with_entropy: bool = False,
        base: bool = False,
        topk: int = 0,
    ) -> dict[str, Tensor]:
        """{"logprobs": (B, R)} of the response tokens under log_softmax(logits / temperature) (and "entropy").
        `base=True` scores with LoRA adapters disabled (the frozen base: the reference policy of a LoRA run); an
        engine without adapters raises ValueError. `topk=K > 0` adds "topk_ids" (B, R, K) long and "topk_logprobs"
        (B, R, K) fp32: the K largest log_softmax(logits / temperature) values at each response position and their
        token ids, sorted descending (a distillation teacher's targets). Callers pass `topk` only when > 0, so an
        engine without top-k keeps working where nothing asks for it."""
        ...

    def compute_values(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """{"values": (B, R)}: critic values of the states before each response token."""
        ...

    def train_step(
        self,
        batch: Mapping[str, Tensor],
        loss_fn: LossFn,
        *,
        mini_batches: int = 1,
        epochs: int = 1,
        temperature: float = 1.0,
        shuffle_seed: int | None = None,
    ) -> dict[str, float]:
        """`epochs` x `mini_batches` optimizer steps over this rank's rows; averaged metrics (collective). Each
        mini-batch is cut into micro-batches of `micro_batch_size` rows, or of at most `micro_batch_tokens`
        attended tokens when the engine was built with that budget > 0; the gradient is the same either way.

        The step's own metrics (logged as `actor/<name>`, `critic/<name>`): `optimizer_steps` taken and
        `nonfinite_steps` skipped (a NaN/inf loss or gradient; weights, moments and LR schedule untouched);
        `empty_mini_batches`, mini-batches without a trainable token on any rank (no step taken: weight decay and
        Adam's momentum would move the weights on a zero loss);
        `grad_norm`, the mean over the steps taken of the total gradient norm before clipping (absent when none
        was taken: a skipped step has no norm); `lr`, the mean over the steps taken of the learning rate each
        applied (with none taken, the rate the next step will apply)."""
        ...

    def compute_gradients(
        self, batch: Mapping[str, Tensor], loss_fn: LossFn, temperature: float = 1.0
    ) -> dict[str, Tensor]:
        """Full gradients by parameter name of one mini-batch, without an optimizer step (collective)."""
        ...

    def iter_weights(self, changed_only: bool = False) -> Iterator[tuple[str, Tensor]]:
        """(HF name, full tensor) pairs for inference engines; a tensor shared under two names (tied embeddings)
        is yielded once. `changed_only` skips tensors that training never changes (frozen parameters, buffers).
        Collective on sharded engines; only rank 0's pairs are meaningful."""
        ...

    def save(self, folder: str | Path, tokenizer_path: str | None = None) -> None:
        """`folder/model` as an HF folder plus optimizer state (collective)."""
        ...

    def load(self, folder: str | Path) -> None:
        """Restore what `save` wrote (collective); optimizer settings (lr, weight decay) stay the configured ones."""
        ...

    def shutdown(self) -> None:
        """Release what the engine holds beyond its Python objects (process groups, threads); idempotent."""
        ...
