"""How a mini-batch's rows are cut into micro-batches for gradient accumulation (hf, fsdp2, megatron engines).

Two modes:
- rows (`micro_batch_tokens=0`, the default): consecutive runs of `micro_batch_size` rows, whatever their lengths
  (in prompt order when the engine packs sequences, so a prompt's rows share micro-batches).
- token budget (`micro_batch_tokens=N > 0`, verl's dynamic batch size): micro-batches whose real token count (the
  sum of their rows' `attention_mask`) stays <= N; a row longer than N is alone in its micro-batch. Rows are
  placed first-fit-decreasing (fewest micro-batches for the budget). Given `groups` (rows sharing a prompt, when
  the engine packs sequences), a group that fits the budget stays in one micro-batch, so its prompt is computed
  once; a larger group is cut into consecutive runs that fit. The count is of attended tokens in the padded
  layout, an upper bound of what a packed forward computes (a shared prompt counts once per row).

Contract: every row of the mini-batch lands in exactly one micro-batch and each micro-batch lists its rows in
increasing order, so the per-micro-batch losses, scaled by `loss_fn.units(micro) / units of the mini-batch`, add
up to the mini-batch's loss whatever the cut (exact gradient accumulation). The cut is deterministic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from roll_core.interfaces.training import METRIC_WEIGHT_PREFIX, is_max_metric, largest
from roll_core.routing import ROUTED_EXPERTS, UNROUTED
from roll_engines.train._packing import _first_fit, _prompt_keys, prompt_order


def check_micro_batch_tokens(micro_batch_tokens: int) -> int:
    """`micro_batch_tokens` as an int >= 0 (0: off), else a ValueError naming the option."""
    if isinstance(micro_batch_tokens, bool) or not isinstance(micro_batch_tokens, int) or micro_batch_tokens < 0:
        raise ValueError(
            f"train_engine.micro_batch_tokens={micro_batch_tokens!r} must be an int >= 0 (0: micro-batches of "
            "micro_batch_size rows; N: micro-batches of at most N attended tokens)"
        )
    return micro_batch_tokens


def prompt_groups(keys: list[bytes]) -> list[list[int]]:
    """Runs of consecutive equal keys (rows already in prompt order, roll_engines.train._packing.prompt_order)."""
    groups: list[list[int]] = []
    for i, k in enumerate(keys):
        if groups and keys[groups[-1][0]] == k:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def token_budget_rows(attention_mask: Tensor, budget: int, groups: list[list[int]] | None = None) -> list[list[int]]:
    """Row indices of each micro-batch of at most `budget` attended tokens (see the module docstring).

    Args:
        attention_mask: (B, S) of the mini-batch's rows.
        budget: > 0 tokens per micro-batch.
        groups: lists of row indices kept together when they fit (rows sharing a prompt), covering every row once;
            None: every row on its own.
    Returns:
        Micro-batches as sorted row-index lists, ordered by their first row; [] for an empty mini-batch.
    """
    if budget <= 0:
        raise ValueError(f"a token budget must be > 0, got {budget}")
    lengths = [int(x) for x in attention_mask.sum(1).tolist()]
    units = groups if groups is not None else [[i] for i in range(len(lengths))]
    pieces: list[list[int]] = []
    for unit in units:
        if sum(lengths[i] for i in unit) <= budget:
            pieces.append(list(unit))
            continue
        run: list[int] = []  # a group over budget: consecutive runs of its rows that fit (a long row alone)
        used = 0
        for i in unit:
            if run and used + lengths[i] > budget:
                pieces.append(run)
                run, used = [], 0
            run.append(i)
            used += lengths[i]
        pieces.append(run)
    bins = _first_fit([sum(lengths[i] for i in p) for p in pieces], budget)
    micros = [sorted(i for j in b for i in pieces[j]) for b in bins]
    return sorted(micros, key=lambda rows: rows[0])


def micro_rows(mini: Mapping[str, Tensor], size: int, budget: int, grouped: bool) -> list[Tensor]:
    """Row indices (into `mini`, padded layout) of each micro-batch: runs of `size` rows when `budget` is 0, else
    micro-batches of at most `budget` attended tokens, rows sharing a prompt together when `grouped` (rows already
    in prompt order: the engine packs sequences)."""
    n = mini["input_ids"].shape[0]
    if not budget:
        return [torch.tensor(rows, dtype=torch.long) for rows in row_micros(n, size)]
    groups = None
    if grouped:
        p = mini["input_ids"].shape[1] - mini["responses"].shape[1]
        from roll_engines.train._vision import picture_keys

        keys = _prompt_keys(mini["input_ids"], mini["attention_mask"], mini["position_ids"], p, picture_keys(mini))
        groups = prompt_groups(keys)
    return [torch.tensor(rows, dtype=torch.long) for rows in token_budget_rows(mini["attention_mask"], budget, groups)]


def micro_batches(
    mini: Mapping[str, Tensor], size: int, budget: int = 0, group_prompts: bool = False
) -> list[dict[str, Tensor]]:
    """`mini` (padded layout) cut into micro-batches by `micro_rows`; with `group_prompts` (the engine packs
    sequences) its rows are first put in prompt order (_packing.prompt_order), as the hf engine does, so a prompt's
    rows share a micro-batch (and its packed forward computes the prompt once) even after the train step shuffled
    the rows, in row micro-batches as under a budget. The rows of the mini-batch are unchanged, so is its
    gradient."""
    grouped = group_prompts and mini["input_ids"].shape[0] > 1
    if grouped:
        from roll_engines.train._vision import picture_keys

        r = mini["responses"].shape[1]
        order = prompt_order(mini["input_ids"], mini["attention_mask"], mini["position_ids"], r, picture_keys(mini))
        mini = {k: v[order] for k, v in mini.items()}
    return [{k: v[rows] for k, v in mini.items()} for rows in micro_rows(mini, size, budget, grouped)]


def mini_batch_rows(order: Tensor, counts: list[int], rank: int, mini_batches: int) -> list[Tensor]:
    """This data-parallel rank's rows of each of a step's `mini_batches` mini-batches: `order` (its row indices, in
    the epoch's order) cut into consecutive runs, so that mini-batch i holds, over all ranks (`counts`: the rows of
    every rank, this one's at `rank`), the rows one process would give it (`torch.tensor_split` of sum(counts)).

    The ranks' rows are dealt round-robin (rank r's j-th row comes after every rank's (j-1)-th and ranks < r's j-th)
    and that sequence is cut into the one-process sizes, so each rank's share of a mini-batch is within a row of
    its proportion. Each rank cutting its own rows with `tensor_split` made the optimizer steps depend on the
    data-parallel size: 2 ranks of 2 rows with 4 mini-batches took 2 steps of 2 rows, not 4 of 1 (the LR schedule
    counts 4), and 2 ranks of 3 rows with 2 mini-batches took steps of 4 and 2 rows, not 3 and 3."""
    if len(order) != counts[rank]:
        raise ValueError(f"rank {rank} holds {len(order)} rows but the ranks' counts say {counts[rank]}")
    sizes = [len(c) for c in torch.tensor_split(torch.arange(sum(counts)), mini_batches)]
    ends = torch.tensor(sizes).cumsum(0)
    # Place of this rank's j-th row in the round-robin sequence: every rank's rows before their j-th, then the
    # j-th rows of the ranks before this one that have one.
    j = torch.arange(counts[rank])
    place = sum(torch.clamp(j, max=c) for c in counts) + sum((j < c).long() for c in counts[:rank])
    local = torch.bincount(torch.bucketize(place, ends, right=True), minlength=mini_batches)[:mini_batches]
    return list(torch.split(order, local.tolist()))


def rank_counts(n: int, rank: int, size: int, reduce_sum: Callable[[Tensor], Tensor]) -> list[int]:
    """The rows every data-parallel rank holds (this one's `n` at `rank`), for `mini_batch_rows`: a (size,) tensor
    holding `n` at `rank`, summed over the ranks by `reduce_sum` (collective; skipped for one rank)."""
    if size == 1:
        return [n]
    t = torch.zeros(size, dtype=torch.float64)
    t[rank] = n
    return [int(x) for x in reduce_sum(t).tolist()]


def mini_batch_units(loss_fn: Any, micros: list[Mapping[str, Any]], reduce_sum: Callable[[Tensor], Tensor]) -> float:
    """The loss units (`loss_fn.units`) of a mini-batch's `micros` summed over the data-parallel ranks by `reduce_sum`
    (collective: every rank calls it once per mini-batch, and all get the same answer), or 0 when no rank holds a
    trainable token (`response_mask`), which the engines take as "no optimizer step". Under seq-mean-token-sum(-norm)
    the units are rows, empty ones included: a mini-batch of empty responses had units, a zero loss and still took
    an AdamW step (weight decay and the moments moved the weights, the LR schedule advanced). A micro-batch without
    a `response_mask` counts its rows as trainable (nothing tells them apart)."""
    units = sum(loss_fn.units(m) for m in micros)
    tokens = sum(float(m["response_mask"].sum()) if "response_mask" in m else len(m["input_ids"]) for m in micros)
    total, trainable = reduce_sum(torch.tensor([units, tokens], dtype=torch.float64)).tolist()
    return float(total) if trainable > 0 else 0.0


def row_micros(n: int, size: int) -> list[list[int]]:
    """Consecutive runs of `size` rows (the last may be shorter)."""
    return [list(range(s, min(s + size, n))) for s in range(0, n, size)]


def padding_row(batch: Mapping[str, Any]) -> dict[str, Any]:
    """One row that trains nothing: the batch's first row (or zeros of its shapes when it has none) with an empty
    response mask and zero-valued training signals, attending to every position so every value stays finite.
    Its replayed routing (`routed_experts`) is UNROUTED everywhere: the row routes by itself, and is not counted as
    a replayed position (zeros would replay expert 0 at every position and layer, and count as changed routings in
    `actor/routing_replay_changed_fraction`). A per-row list (the rows' pictures, `mm_inputs`) keeps the first row's
    entry (its ids hold those pictures' placeholders), or None."""
    row = {
        k: (v[:1].clone() if v.shape[0] else torch.zeros((1, *v.shape[1:]), dtype=v.dtype))
        for k, v in batch.items()
        if isinstance(v, Tensor)
    }
    row.update({k: list(v[:1]) if len(v) else [None] for k, v in batch.items() if k not in row})
    for k, v in row.items():
        if not isinstance(v, Tensor):
            continue
        if k == "attention_mask":
            row[k] = torch.ones_like(v)
        elif k == ROUTED_EXPERTS:
            row[k] = torch.full_like(v, UNROUTED)
        elif k not in ("input_ids", "position_ids", "responses", "prompts"):
            row[k] = torch.zeros_like(v)
    return row


def metric_weights(
    loss_fn: Any, micro: Mapping[str, Any], metrics: Mapping[str, Any], units: float
) -> list[tuple[str, float, float]]:
    """(name, value, weight) of a real micro-batch's metrics for `MetricMeans.add`: a key of the loss's
    `summed_metrics` weighs 1, one of its `token_metrics` (a masked token mean) the micro-batch's valid response
    tokens, any other its loss `units`. Token means weighed by units were misweighted under sequence-mean
    aggregation, where units are rows: one-row micro-batches of 1 and 7 tokens gave each row's mean half the say."""
    summed, token = getattr(loss_fn, "summed_metrics", ()), getattr(loss_fn, "token_metrics", ())
    tokens = float(micro["response_mask"].sum()) if token else units
    return [(k, float(v), 1.0 if k in summed else tokens if k in token else units) for k, v in metrics.items()]


class MetricMeans:
    """A step's metrics over its micro-batches, each weighted by its loss units (`loss_fn.units(micro)`: valid
    tokens under token-mean aggregation, rows under sequence means) or, for a token mean, its valid tokens
    (`metric_weights`): a per-micro-batch token mean (the correction weight's, the train/infer gap's, the clip
    fraction) averaged unweighted over micro-batches of different sizes (token-budget cuts, prompt-grouped packing)
    misweighted its tokens. Where every weight is 0 (micro-batches
    without units) the values weigh alike. A maximum (`*_max`: roll_core.interfaces.training.is_max_metric) is the
    largest value (NaN if any is): a mean of micro-batch maxima depended on the cut (one token at ratio 5 in six
    one-row micro-batches was reported as 2.1)."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._plain: dict[str, list[float]] = {}

    def add(self, key: str, value: float, weight: float = 1.0) -> None:
        self._sums[key] = self._sums.get(key, 0.0) + value * weight
        self._weights[key] = self._weights.get(key, 0.0) + weight
        self._plain.setdefault(key, []).append(value)

    def means(self) -> dict[str, float]:
        """Each key's weighted mean (a maximum's largest value), and its total weight under `METRIC_WEIGHT_PREFIX +
        key` (what the group's merge over data-parallel ranks weighs this rank's mean by: ranks hold different
        numbers of tokens)."""
        out = {}
        for k, v in self._plain.items():
            if is_max_metric(k):
                out[k] = largest(v)
            else:
                out[k] = self._sums[k] / self._weights[k] if self._weights[k] > 0 else sum(v) / len(v)
        out.update({METRIC_WEIGHT_PREFIX + k: self._weights[k] for k in self._plain})
        return out
