"""What the `hf`/`fsdp2` engines read off a micro-batch's response logits: log-probs of the sampled tokens,
entropies, the top-k log-probs (a distillation teacher's targets) and log-probs at given token ids (a student's
at its teacher's top-k ids).

Contract: every function takes fp32 logits already divided by the temperature (and masked, for a constrained
row), so each output is a function of log_softmax(logits / temperature). One log-sum-exp per position serves all
outputs. Outputs keep the autograd graph (training needs `logprobs`, `entropy`, `gathered_logprobs`); the top-k
is for scoring passes only (no-grad callers).

- `logprobs` (..,): log softmax at the sampled token, as roll_algos.losses.token_logprobs computes it.
- `topk_ids` (.., K) long and `topk_logprobs` (.., K) fp32: torch.topk of the log-softmax, sorted descending
  (ties in the order torch.topk breaks them).
- `gathered_logprobs` (.., K) fp32: log softmax at the ids of the micro-batch's `loss_fn.gather_ids_key` tensor
  (b, R, K) long, differentiable. An id outside [0, V) is a ValueError (`check_gather_ids`), never a silent wrong
  value: the packed path's advanced indexing would read a negative id as counted from the end of the vocabulary.
  The engines check the whole batch's gather ids (and that it holds them) on the host before any forward
  (`check_batch_gather_ids`), so a refusal comes before the first collective, on every data-parallel rank
  (_agree.agreed); the per-micro-batch check stays for direct callers.

A batch's token ids are checked once, on the host, before any forward (`check_batch_ids`; the megatron engine calls
`check_token_ids` with its config's vocabulary): every id of `responses` must be in [0, V) for the model's logits
width V (and its input embedding's, as the response is also its input), and every id of `input_ids` (the prompts,
padding included: the padded layout embeds every position) in [0, V') for its input embedding's width V'. An id
outside is a ValueError naming the engine, the tensor, the id, its row and position and the width: on a CPU the
embedding lookup fails with a bare IndexError, on a GPU the gather or the lookup with a device-side assert that
leaves the CUDA context unusable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from roll_algos.losses import entropy_from_logits

#: Output keys of the top-k scoring (`compute_logprobs(..., topk=K)`) and of the training-side gather.
TOPK_IDS, TOPK_LOGPROBS, GATHERED = "topk_ids", "topk_logprobs", "gathered_logprobs"


def gather_ids_of(loss_fn: Any, micro: Mapping[str, Tensor]) -> Tensor | None:
    """The (b, R, K) long ids a loss asks log-probs at (`loss_fn.gather_ids_key`), or None when it asks none.

    A loss that declares a key the micro-batch lacks gets None (its own call then sees no `gathered_logprobs`
    and says so); a key holding anything but a (b, R, K) integer tensor matching `responses` is a ValueError."""
    key = getattr(loss_fn, "gather_ids_key", None)
    if key is None or key not in micro:
        return None
    ids = micro[key]
    resp = micro["responses"]
    if ids.dim() != 3 or ids.shape[:2] != resp.shape or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(
            f"loss_fn.gather_ids_key={key!r} must name a (B, R, K) integer tensor of token ids matching responses "
            f"{tuple(resp.shape)}; got {ids.dtype} {tuple(ids.shape)}"
        )
    return ids


def check_gather_ids(ids: Tensor, vocab: int) -> None:
    """Every id of `ids` must be in [0, vocab): a negative id indexes from the vocabulary's end (the log-prob of
    another token) and a CUDA gather out of range fails with a device-side assert instead of an error."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"gather ids must be token ids in [0, {vocab}) (the vocabulary size); got ids from {int(ids.min())} "
            f"to {int(ids.max())}"
        )


def _rows(module: Any) -> int | None:
    """Rows of an embedding or output projection (its vocabulary width), None when it has none we can read."""
    # A LoRA-adapted layer is peft's wrapper, whose out_features is an embedding's dimension: read its base layer.
    module = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    for attr in ("num_embeddings", "out_features"):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            return value
    return None


def check_token_ids(ids: Tensor, width: int | None, who: str, which: str, what: str) -> None:
    """Every id of the host tensor `ids` (B, L) (or (B, R, K) gather ids) must be in [0, `width`) (None: nothing to
    check against); else a ValueError naming the engine (`who`), the tensor (`which`), the first offending id with its
    row and position (its index, for gather ids), and the width (`what` says what it is the width of)."""
    if width is None or not ids.numel():
        return
    bad = (ids < 0) | (ids >= width)
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        where = f"row {at[0]}, position {at[1]}" if len(at) == 2 else f"index {tuple(at)}"
        raise ValueError(
            f"{who}: {which} token id {int(ids[tuple(at)])} ({where}) is outside [0, {width}), the width of {what} "
            "(a prompt or a student from another tokenizer, a wider padded vocabulary than this model's, or a "
            "corrupted batch?); on a CPU it fails with a bare IndexError, on a GPU with a device-side assert"
        )


def check_response_ids(responses: Tensor, model: torch.nn.Module, who: str) -> None:
    """Every id of the host tensor `responses` (B, R) must be a token of `model` (a transformers model, not a
    peft wrapper): in [0, V) for V the rows of its output projection (the logits' width, what the log-probs gather
    at) and of its input embedding (the response is fed back as input). A model with no output projection (a
    critic's score head) is checked against its input embedding only. `who` names the engine in the error."""
    check_token_ids(responses, _rows(model.get_output_embeddings()), who, "response", "the model's logits")
    check_token_ids(responses, _rows(model.get_input_embeddings()), who, "response", "the model's input embedding")


def check_batch_ids(tensors: Mapping[str, Tensor], model: torch.nn.Module, who: str, loss_fn: Any = None) -> None:
    """`check_response_ids` on `tensors["responses"]`, then every id of `tensors["input_ids"]` (B, P+R), the
    prompts and their padding included, against the rows of `model`'s input embedding; with a `loss_fn` (None:
    scoring, no gather ids) its gather ids too (`check_batch_gather_ids`, against the logits' width)."""
    check_response_ids(tensors["responses"], model, who)
    width = _rows(model.get_input_embeddings())
    check_token_ids(tensors["input_ids"], width, who, "input_ids", "the model's input embedding")
    if loss_fn is not None:
        check_batch_gather_ids(tensors, loss_fn, _rows(model.get_output_embeddings()), who, "the model's logits")


def check_batch_gather_ids(tensors: Mapping[str, Tensor], loss_fn: Any, width: int | None, who: str, what: str) -> None:
    """When `loss_fn` declares a `gather_ids_key`, the batch must hold it (else a ValueError naming `who`, the key
    and the batch's keys), as a (B, R, K) integer tensor of ids matching `responses` (`gather_ids_of`), each in
    [0, `width`) (None: no width to check against; `what` says what it is the width of), else a ValueError naming
    the key, the first offending id and its index. Run on the whole batch, on the host, before any forward:
    `check_gather_ids` refused the same ids per micro-batch, mid-forward, on one data-parallel rank while the others
    waited in a collective; a batch without the key reached the loss, which raised on that rank alone after the
    forward's collectives (the others waited in the backward's)."""
    key = getattr(loss_fn, "gather_ids_key", None)
    if key is not None and key not in tensors:
        raise ValueError(
            f"{who}: the loss gathers log-probs at the batch's {key!r} (loss_fn.gather_ids_key), which this batch "
            f"lacks (it holds {sorted(tensors)})"
        )
    ids = gather_ids_of(loss_fn, tensors)
    if ids is not None:
        check_token_ids(ids, width, who, f"loss_fn.gather_ids_key={loss_fn.gather_ids_key!r}", what)


def check_temperature(temperature: float) -> None:
    """A scoring or training temperature must be finite and at least GREEDY_TEMPERATURE (1e-5): the logits are
    divided by it, and 0 (or a tinier divisor) gives inf and NaN log-probs. Greedy decoding has no log-probs to
    recompute at its temperature (the sampler reports log_softmax(logits) for it: score those at temperature 1)."""
    from roll_core.interfaces.inference import GREEDY_TEMPERATURE

    if not (math.isfinite(float(temperature)) and float(temperature) >= GREEDY_TEMPERATURE):
        raise ValueError(
            f"temperature={temperature!r} must be finite and at least GREEDY_TEMPERATURE={GREEDY_TEMPERATURE}: the "
            "logits are divided by it (0 gives inf/NaN log-probs); greedy rollouts report log_softmax(logits), "
            "scored at temperature 1"
        )


def check_topk(topk: int, vocab: int) -> None:
    """`topk` must be within [0, vocabulary size] (0: no top-k)."""
    if topk < 0 or topk > vocab:
        raise ValueError(f"topk={topk} must be between 0 (off) and the vocabulary size {vocab}")


def topk_of(logits: Tensor, lse: Tensor, k: int) -> dict[str, Tensor]:
    """Top-k log-probs of fp32 `logits` (.., V) with their log-sum-exp `lse` (..): {"topk_ids" (.., k) long,
    "topk_logprobs" (.., k) fp32}, sorted descending."""
    check_topk(k, logits.shape[-1])
    values, ids = torch.topk(logits, k, dim=-1, sorted=True)  # log_softmax is monotone: top-k of the logits
    return {TOPK_IDS: ids, TOPK_LOGPROBS: values - lse.unsqueeze(-1)}


def response_outputs(
    logits: Tensor,
    responses: Tensor,
    *,
    with_entropy: bool | str = False,
    topk: int = 0,
    gather_ids: Tensor | None = None,
) -> dict[str, Tensor]:
    """Outputs of a padded micro-batch from its response logits.

    Args:
        logits: (b, R, V) fp32, divided by the temperature; position c predicts response token c.
        responses: (b, R) sampled token ids.
        with_entropy: add "entropy" (b, R); "metric": computed without gradient (a loss that only logs it).
        topk: K > 0 adds "topk_ids" (b, R, K) and "topk_logprobs" (b, R, K).
        gather_ids: (b, R, K') ids: adds "gathered_logprobs" (b, R, K').
    Returns:
        {"logprobs": (b, R), ...} fp32 (ids long).
    """
    lse = torch.logsumexp(logits, dim=-1)  # (b, R)
    out = {"logprobs": torch.gather(logits, -1, responses.unsqueeze(-1)).squeeze(-1) - lse}
    if with_entropy == "metric":  # logged only (no entropy bonus): no graph of two more (b, R, V) tensors
        with torch.no_grad():
            out["entropy"] = entropy_from_logits(logits)
    elif with_entropy:
        out["entropy"] = entropy_from_logits(logits)
    if topk > 0:
        out.update(topk_of(logits, lse, topk))
    if gather_ids is not None:
        check_gather_ids(gather_ids, logits.shape[-1])
        out[GATHERED] = torch.gather(logits, -1, gather_ids.to(logits.device).long()) - lse.unsqueeze(-1)
    return out


def empty_outputs(keys: list[str], r: int, topk: int) -> dict[str, Tensor]:
    """Outputs of a rank with no rows: (0, R) per key, (0, R, K) for the top-k keys."""
    out = {k: torch.zeros(0, r) for k in keys}
    if topk > 0:
        out[TOPK_IDS] = torch.zeros(0, r, topk, dtype=torch.long)
        out[TOPK_LOGPROBS] = torch.zeros(0, r, topk)
    return out


def entropy_request(loss_fn: Any) -> bool | str:
    """What a train engine's forward computes for `loss_fn`'s entropy: False, True (with gradient: an entropy
    bonus), or "metric" (logged only: `loss_fn.entropy_grad` is False)."""
    if not getattr(loss_fn, "needs_entropy", False):
        return False
    return True if getattr(loss_fn, "entropy_grad", True) else "metric"
