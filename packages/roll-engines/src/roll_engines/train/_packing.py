"""Shared-prompt sequence packing for the training engines' forward passes (log-probs, values, training).

A GRPO batch holds G samples per prompt: rows that repeat one prompt. The padded layout (roll_core.sequences) runs
every row as its own (P+R)-wide sequence, so a ~95-token prompt is recomputed G times for ~21-token answers and
the padding columns are computed too. Packing runs each distinct prompt once, followed by every response that
continues it, with no padding between them::

    row 0: [prompt_a, resp_a1, resp_a2, ..., resp_aG, prompt_b, resp_b1, ..., pad]

under a 4D block attention mask (each response attends causally to its own prompt and to itself, never to a
sibling response or another prompt) and the batch's own position ids (a response continues its prompt's
positions). The log-prob of a response's first token comes from its prompt's last position. A prompt and all
its responses form one *segment*. Segments are placed first-fit-decreasing into rows; the row capacity (from
`max(longest segment, P + R)` doubling up to one row for the whole micro-batch) is the one with the lowest
estimated cost, since dense masked attention costs the square of the row length while padding costs linear
layers: a GRPO micro-batch of one or two groups is one row; long unrelated multi-turn rows stay apart.

Contract:
- Input is one micro-batch in the padded layout: `input_ids`/`attention_mask`/`position_ids` (B, P+R) and
  `responses` (B, R). Tokens under `attention_mask` are real: prompt columns are the context, and every attended
  response column (generated tokens and multi-turn observations alike) is a "response" token for attention.
- May assume the response part of `attention_mask` is a prefix per row and the last prompt column is attended
  for rows with a response (true of `build_sequences` and agentic `to_tensors`); `pack` returns None otherwise,
  and for a micro-batch with no response token, and the caller runs the padded path.
- Results equal the padded path at every attended response position (up to float summation order); positions
  outside the attention mask are 0 (the padded path leaves meaningless values there that every loss masks).
- Vision-language rows (`pictures`, roll_engines.train._vision.MicroPictures): a segment's key adds the row's
  prompt pictures' digests (equal prompt ids with other pictures are other prompts); the packed row takes each
  segment's prompt pictures once, then its members' response pictures, in packed order (`PackedBatch.mm`); mrope
  positions (3, B, P+R) are gathered per section exactly as 1D positions are.
- Sliding-window layers (Gemma2/3, Mistral, Qwen2 with `use_sliding_window`) get the block mask cut to their
  window measured in padded-row columns, per layer type (roll_engines.train._packed_masks): a segment's rows share
  its prompt only if the prompt sits at the same columns in each (always so for left-padded prompts).
- Must not be used for models whose attention ignores a custom 4D mask: `unsupported_reason` says why a model
  cannot take it (attention implementation other than sdpa/eager; local, chunked, convolution or recurrent
  layers; bidirectional attention; a window in a vision-language model; ALiBi; modeling code outside
  transformers' mask utilities); the engine then keeps the padded path.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from roll_engines.train._packed_masks import MaskPlan, mask_plan, packed_masks

if TYPE_CHECKING:
    from roll_engines.train._vision import MicroPictures

#: Attention implementations that apply a custom 4D mask as given (transformers' masking_utils passes 4D masks
#: through untouched; flash-attention kernels take no dense mask).
SUPPORTED_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch in packed form (N rows of T tokens) and where each response token's output lands.

    Attributes:
        input_ids: (N, T) token ids; padding at row ends repeats the row's last id (its outputs are unused).
        position_ids: (N, T) the batch's position ids of each token ((3, N, T) for mrope); padding 0.
        allowed: (N, 1, T, T) bool, True where query token q may attend key token k.
        keep: (N, T) bool, the positions whose outputs are needed (each predicts at least one response token).
        source: (K,) index of each response token's predicting position among the `keep` positions (row-major).
        rows, cols: (K,) where each response token sits in the (B, R) output.
        targets: (K,) the response token ids.
        shape: (B, R) of the output.
        mm: the pictures' processor tensors in the packed placeholder order ({} without pictures).
        origin: (N, T) long, each packed token's index in the micro-batch's flattened (B * (P+R)) padded layout
            (a shared prompt's tokens: its first row's); -1 for padding (per-position inputs: routed-expert replay).
        width: P+R, the padded row width `origin` counts in (0: unknown).
    """

    input_ids: Tensor
    position_ids: Tensor
    allowed: Tensor
    keep: Tensor
    source: Tensor
    rows: Tensor
    cols: Tensor
    targets: Tensor
    shape: tuple[int, int]
    mm: dict[str, Tensor] = field(default_factory=dict)
    origin: Tensor | None = None
    width: int = 0

    @property
    def tokens(self) -> int:
        """Positions the model computes (N * T, padding included)."""
        return self.input_ids.numel()

    def to(self, device: torch.device) -> PackedBatch:
        """Every tensor on `device`."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        moved["mm"] = {k: v.to(device) for k, v in self.mm.items()}
        return PackedBatch(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in moved.items()})

    def attention_mask(self, attn_implementation: str) -> Tensor:
        """The full-attention 4D mask in the form the attention implementation adds or applies: bool for sdpa (True
        attends), additive float for eager (0 attends, the fp32 minimum blocks; eager adds it to the scores)."""
        return packed_masks(self, MaskPlan(), attn_implementation)

    def columns(self) -> Tensor:
        """(N, T) long: each token's column in its padded row (a shared prompt's: the same in each of its rows);
        0 for padding (which attends only to itself)."""
        if self.origin is None or self.width < 1:
            raise ValueError("this PackedBatch carries no padded-row columns (origin and width): cannot window it")
        return torch.where(self.origin >= 0, self.origin % self.width, 0)

    def scatter(self, values: Tensor) -> Tensor:
        """(K, ...) per-response-token values -> (B, R, ...), 0 where no response token is attended (keeps the
        graph)."""
        out = values.new_zeros((*self.shape, *values.shape[1:]))
        return out.index_put((self.rows, self.cols), values)


def _prompt_keys(
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    prompt_width: int,
    extra: list[bytes] | None = None,
) -> list[bytes]:
    """A key per row equal for rows whose attended prompt tokens and their positions (1D (B, L) or mrope
    (3, B, L)) are identical, and whose `extra` keys (their prompt pictures' digests) are equal."""
    keys = []
    pos3 = position_ids if position_ids.dim() == 3 else position_ids[None]
    for i, (ids, am) in enumerate(zip(input_ids[:, :prompt_width], attention_mask[:, :prompt_width])):
        m = am.bool()
        pos = pos3[:, i, :prompt_width][:, m]
        key = ids[m].cpu().numpy().tobytes() + b"|" + pos.cpu().numpy().tobytes()
        keys.append(key + b"|" + extra[i] if extra is not None else key)
    return keys


def prompt_order(
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    response_width: int,
    extra: list[bytes] | None = None,
) -> Tensor:
    """A stable permutation (B,) that puts rows sharing a prompt next to each other, groups in first-seen order.

    Micro-batches are cut from consecutive rows, so grouping first lets a shuffled mini-batch still share its
    prompts; the set of rows per mini-batch (hence the gradient) does not change.

    Args:
        input_ids, attention_mask, position_ids: (B, P+R) padded layout.
        response_width: R.
        extra: per-row keys the prompt must also agree on (the rows' pictures, _vision.picture_keys).
    """
    keys = _prompt_keys(input_ids, attention_mask, position_ids, input_ids.shape[1] - response_width, extra)
    first: dict[bytes, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    return torch.tensor(sorted(range(len(keys)), key=lambda i: (first[keys[i]], i)), dtype=torch.long)


def _first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices of `lengths` grouped into bins of at most `capacity` (a longer item alone)."""
    bins: list[list[int]] = []
    fill: list[int] = []
    for j in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        for k, used in enumerate(fill):
            if used + lengths[j] <= capacity:
                bins[k].append(j)
                fill[k] += lengths[j]
                break
        else:
            bins.append([j])
            fill.append(lengths[j])
    return bins


def _place(lengths: list[int], width: int, hidden_size: int) -> list[list[int]]:
    """Segments (by length) into rows: the cheapest of first-fit layouts with row capacities C0, 2*C0, ... up
    to one row, C0 = max(longest segment, padded width `width`).

    Cost of N rows of T tokens (padding included), in units of 4 * hidden FLOPs: N*T * 6*hidden (the linear
    layers, ~24 * hidden^2 FLOPs per token) + N*T^2 (dense masked attention, ~4 * hidden FLOPs per token pair).
    Few long rows waste attention on masked pairs; many short rows waste linear layers on padding.
    """
    total, capacity = sum(lengths), max(width, max(lengths))
    best: tuple[int, list[list[int]]] | None = None
    while True:
        bins = _first_fit(lengths, capacity)
        t = max(sum(lengths[j] for j in b) for b in bins)
        cost = len(bins) * t * (6 * hidden_size + t)
        if best is None or cost < best[0]:
            best = (cost, bins)
        if len(bins) == 1 or capacity >= total:
            return best[1]
        capacity *= 2


def pack(
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    responses: Tensor,
    hidden_size: int,
    pictures: MicroPictures | None = None,
) -> PackedBatch | None:
    """Pack one micro-batch (see the module docstring); None when it does not meet the contract.

    Args:
        input_ids, attention_mask, position_ids: (B, P+R) padded layout (left-padded prompts, right-padded
            responses), on any device (packing runs on the CPU).
        responses: (B, R) response token ids.
        hidden_size: the model's hidden size, to weigh padding against attention when splitting into rows
            (0 favours short rows; a huge value, one row).
        pictures: the micro-batch's pictures (vision-language rows); position_ids are then (3, B, P+R) for an
            mrope family.
    Returns:
        The packed micro-batch on the CPU, or None (no response token; a non-prefix response mask; a row with a
        response whose last prompt column is not attended).
    """
    ids, am, pos = (t.detach().cpu() for t in (input_ids, attention_mask, position_ids))
    flat = pos.dim() == 2
    pos = pos[None] if flat else pos  # (S, B, P+R): S = 1, or 3 mrope sections
    b, r = responses.shape
    p = ids.shape[1] - r
    resp_am = am[:, p:].bool()
    lengths = resp_am.sum(1)
    if int(lengths.sum()) == 0 or p == 0:
        return None
    if (resp_am[:, 1:] & ~resp_am[:, :-1]).any():  # a hole in a row's response attention: not a prefix
        return None
    if not am[lengths > 0, p - 1].bool().all():  # the first response token's predictor must be a real token
        return None

    # Segments: one per distinct prompt (first-seen order), holding the rows that continue it. The key also holds
    # the prompt's columns (equal for equal left-padded prompts): a sliding window counts padded-row columns.
    keys = _prompt_keys(ids, am, pos, p, pictures.keys if pictures is not None else None)
    keys = [k + b"|" + am[i, :p].bool().numpy().tobytes() for i, k in enumerate(keys)]
    groups: dict[bytes, list[int]] = {}
    for i in range(b):
        if int(lengths[i]) > 0:  # a row without response tokens needs no computation
            groups.setdefault(keys[i], []).append(i)
    segments = []
    for members in groups.values():
        pm = am[members[0], :p].bool()
        seg_len = int(pm.sum()) + sum(int(lengths[i]) for i in members)
        segments.append((seg_len, members, pm))

    rows_of = _place([s[0] for s in segments], ids.shape[1], hidden_size)
    fill = [sum(segments[j][0] for j in row) for row in rows_of]
    n, t = len(rows_of), max(fill)

    out_ids = torch.zeros((n, t), dtype=ids.dtype)
    out_pos = torch.zeros((pos.shape[0], n, t), dtype=pos.dtype)
    # Per token: its segment (pads get a unique negative id, so they attend only to themselves) and its
    # response row (-1 for prompt tokens, which every response of the segment sees).
    seg = -1 - torch.arange(n * t).view(n, t)
    owner = torch.full((n, t), -1, dtype=torch.long)
    origin = torch.full((n, t), -1, dtype=torch.long)
    width = ids.shape[1]
    src_flat, rows, cols, targets = [], [], [], []
    order: list[tuple[int, list[int]]] = []  # (prompt row, member rows) per segment in packed order: pictures
    for row, members_of_row in enumerate(rows_of):
        at = 0
        for j in members_of_row:
            _, members, pm = segments[j]
            order.append((members[0], members))
            plen = int(pm.sum())
            out_ids[row, at : at + plen] = ids[members[0], :p][pm]
            out_pos[:, row, at : at + plen] = pos[:, members[0], :p][:, pm]
            origin[row, at : at + plen] = members[0] * width + pm.nonzero()[:, 0]
            seg[row, at : at + plen] = j
            prompt_last = row * t + at + plen - 1
            at += plen
            for i in members:
                m = int(lengths[i])
                out_ids[row, at : at + m] = ids[i, p : p + m]
                out_pos[:, row, at : at + m] = pos[:, i, p : p + m]
                seg[row, at : at + m] = j
                owner[row, at : at + m] = i
                origin[row, at : at + m] = i * width + p + torch.arange(m)
                # Response token c is predicted by the token before it: the prompt's last one for c = 0.
                src_flat += [prompt_last, *range(row * t + at, row * t + at + m - 1)]
                rows += [i] * m
                cols += range(m)
                targets += responses[i, :m].tolist()
                at += m
        if at < t:  # padding repeats a real id so embedding lookups stay in range
            out_ids[row, at:] = out_ids[row, at - 1]

    causal = torch.ones(t, t, dtype=torch.bool).tril()
    same_seg = seg[:, :, None] == seg[:, None, :]
    visible = (owner[:, None, :] < 0) | (owner[:, :, None] == owner[:, None, :])
    allowed = (same_seg & visible & causal)[:, None]  # (N, 1, T, T)

    src = torch.tensor(src_flat, dtype=torch.long)
    uniq, inverse = torch.unique(src, sorted=True, return_inverse=True)  # a prompt's last position serves G rows
    keep = torch.zeros(n * t, dtype=torch.bool)
    keep[uniq] = True
    return PackedBatch(
        input_ids=out_ids,
        position_ids=out_pos[0] if flat else out_pos,
        allowed=allowed,
        keep=keep.view(n, t),
        source=inverse,
        rows=torch.tensor(rows, dtype=torch.long),
        cols=torch.tensor(cols, dtype=torch.long),
        targets=torch.tensor(targets, dtype=responses.dtype),
        shape=(b, r),
        mm=pictures.packed(order) if pictures is not None else {},
        origin=origin,
        width=width,
    )


def _decoder(model: torch.nn.Module) -> tuple[torch.nn.Module, object, torch.nn.Module]:
    """(the transformers model inside `model`, its config, its decoder model: the one whose forward builds masks)."""
    from roll_engines.train._lora import base_model

    inner = base_model(model)
    backbone = getattr(inner, "base_model", inner)
    # A vision-language model's decoder (and its masks) is its language model's (LLaVA wraps any causal LM).
    return inner, getattr(inner, "config", None), getattr(backbone, "language_model", backbone)


def _plan(config: object, backbone: torch.nn.Module) -> MaskPlan | str:
    """`mask_plan` of a model from its config (a vision-language model's: its text config)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return mask_plan(text, backbone, vision_language=text is not config)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run packed sequences (None if it can).

    Packing needs the attention to apply the packed masks as given: transformers' modeling code that builds its
    masks with `masking_utils.create_causal_mask` (which passes a 4D mask through), an sdpa or eager attention
    implementation, full or sliding-window attention in every layer (no local, chunked, convolution or recurrent
    layers: they see tokens by their place in the row; no bidirectional attention; sliding windows only where
    `_packed_masks.mask_plan` sees how the model applies them, and not in a vision-language model) and no ALiBi bias
    (a bias by distance in the row). A causal LM must also select logits with `slice_logits_to_keep` (a 2D boolean
    `logits_to_keep` keeps a different set of positions per row).
    """
    inner, config, backbone = _decoder(model)
    if config is None:
        return f"{type(inner).__name__} has no transformers config"
    attn = getattr(config, "_attn_implementation", None)
    if attn not in SUPPORTED_ATTENTION:
        return f"attn_implementation={attn!r} takes no custom 4D mask (packing needs one of {SUPPORTED_ATTENTION})"
    plan = _plan(config, backbone)
    if isinstance(plan, str):
        return plan
    modeling = sys.modules.get(type(backbone).__module__)
    if not type(backbone).__module__.startswith("transformers.models.") or modeling is None:
        return f"{type(backbone).__name__} is not a transformers model (remote code may ignore a 4D mask)"
    if not hasattr(modeling, "create_causal_mask"):
        return f"{type(backbone).__name__} does not build its masks with transformers.masking_utils"
    # ALiBi biases by distance in the row (Bloom and Falcon build it from the 2D mask, MPT from the row length
    # in `build_mpt_alibi_tensor`): a packed response would be biased by its distance past its siblings.
    if any("alibi" in name.lower() for name in vars(modeling)):
        return f"{type(backbone).__name__} uses ALiBi, a bias by distance in the row"
    head = next((c for c in type(inner).__mro__ if c.__module__.startswith("transformers.models.")), None)
    head_module = sys.modules.get(head.__module__) if head is not None else None
    if hasattr(inner, "lm_head") and not hasattr(head_module, "slice_logits_to_keep"):
        return f"{type(inner).__name__} cannot keep the logits of a different set of positions per row"
    return None


def packed_forward(
    model: torch.nn.Module,
    packed: PackedBatch,
    *,
    critic: bool,
    temperature: float = 1.0,
    with_entropy: bool | str = False,
    autocast: contextlib.AbstractContextManager | None = None,
    topk: int = 0,
    gather_ids: Tensor | None = None,
) -> dict[str, Tensor]:
    """Run `model` on a packed micro-batch (on the model's device) and scatter its outputs back to (B, R).

    Args:
        model: a transformers causal LM (logits) or token-classification model with one label (critic values).
        packed: from `pack`, already on the model's device.
        critic: return `values` (B, R) instead of `logprobs` (B, R) (and `entropy` (B, R) if `with_entropy`).
        autocast: the compute-dtype context the model runs under (None: none).
        topk: K > 0 adds `topk_ids` (B, R, K) long and `topk_logprobs` (B, R, K) (roll_engines.train._logits).
        gather_ids: (B, R, K') token ids: adds `gathered_logprobs` (B, R, K'), the log-probs at those ids.
    """
    from roll_algos.losses import entropy_from_logits
    from roll_engines.train._logits import GATHERED, check_gather_ids, topk_of

    _, config, backbone = _decoder(model)
    plan = _plan(config, backbone)
    if isinstance(plan, str):  # the block mask alone would give such a model other outputs than the padded path
        raise ValueError(f"cannot run this model packed: {plan}")
    kwargs = dict(
        input_ids=packed.input_ids,
        # One mask, or {layer type: mask} with sliding-window layers cut to their window (_packed_masks).
        attention_mask=packed_masks(packed, plan, config._attn_implementation),
        position_ids=packed.position_ids,
        **packed.mm,  # pictures in the packed placeholder order (vision-language models)
    )
    with autocast if autocast is not None else contextlib.nullcontext():
        if critic:
            scores = model(**kwargs).logits  # (N, T, 1): the score head is cheap, keep every position
            return {"values": packed.scatter(scores[packed.keep][packed.source, 0].float())}
        # Only the predicting positions go through the vocabulary projection: (U, V), row-major order.
        logits = model(**kwargs, logits_to_keep=packed.keep).logits
    logits = logits.float()  # temperature and log-softmax in fp32 whatever the compute dtype
    if temperature != 1.0:
        logits = logits / temperature
    # log softmax(logits)[target] as in roll_algos.losses.token_logprobs, but a prompt's last position predicts
    # the first token of each of its responses: index its logsumexp instead of copying its (V,) logits G times.
    picked = logits[packed.source, packed.targets]
    lse = torch.logsumexp(logits, dim=-1)  # (U,)
    out = {"logprobs": packed.scatter(picked - lse[packed.source])}
    if with_entropy:  # "metric": logged only, computed without a graph (roll_engines.train._logits.entropy_request)
        with torch.set_grad_enabled(torch.is_grad_enabled() and with_entropy != "metric"):
            out["entropy"] = packed.scatter(entropy_from_logits(logits)[packed.source])
    if topk > 0:  # per predicting position (U, K), then copied to each response token it predicts
        out.update({k: packed.scatter(v[packed.source]) for k, v in topk_of(logits, lse, topk).items()})
    if gather_ids is not None:
        check_gather_ids(gather_ids, logits.shape[-1])  # indexing would take a negative id from the end
        ids = gather_ids.to(logits.device).long()[packed.rows, packed.cols]  # (tokens, K')
        out[GATHERED] = packed.scatter(logits[packed.source[:, None], ids] - lse[packed.source, None])
    return out
