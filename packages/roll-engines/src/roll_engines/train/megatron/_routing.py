"""Routed-expert replay on the `megatron` engine: every MoE layer computes with the experts the rollout engine chose.

The contract is the hf engines' (roll_engines.train._routing): the batch field `routed_experts` (roll_core.routing,
(B, P+R, num_moe_layers, top_k) int16 aligned with `input_ids`, UNROUTED = -1 where nothing was recorded) sets the
experts of every forward (log-probs and training, every micro-batch, packed or padded); an UNROUTED position keeps
the router's own top-k; a batch without the field, with other shapes or with ids out of range is a ValueError.

Hook point: megatron-core's router replay. Its TopKRouter hands the top-k choice to `router.router_replay`
(`get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)`, moe_utils.
topk_routing_with_score_function) when that attribute is set. Each router here gets a `_LayerReplay` there instead
of megatron-core's own RouterReplay, because (1) RouterReplay registers every instance in one class-level list
(`global_router_replay_instances`) shared by every model of the process (an actor and a reference engine in one
process would mix), and (2) its REPLAY_FORWARD takes the target ids as given for every token, with no per-token
fallback; `_LayerReplay` computes the router's own top-k in the same call and keeps it where the replayed ids are
UNROUTED (one pass, no recording forward first). Activation recomputation (recompute=full) re-runs the router in
the backward of the same micro-batch, which with one pipeline stage always follows that micro-batch's forward, so
the current routing is still set; with pipeline stages (1F1B: several forwards before a backward) it would not be,
and routing replay refuses recompute=full with pipeline_parallel_size > 1.

Gate weights are megatron-core's under replay: the scores gathered at the replayed ids. With `norm_topk_prob`
(Qwen3-MoE; Megatron's moe_router_pre_softmax=False) the scores are the logits and Megatron softmaxes the k
gathered logits: exp(l_i) / sum over the replayed j of exp(l_j), exactly the hf engine's softmax(logits) gathered
at the replayed ids and renormalised. Without it (pre-softmax) they are softmax(logits) at the replayed ids, the hf
engine's unrenormalised weights. Either way the router's weights get the policy gradient through the gate weights.

Token order (the whole difficulty): Megatron's GPTModel runs [s, b] activations and the router flattens them to
s * b + b_index tokens. A padded micro-batch (B, S') is the batch's (B, P+R) left-padded by S' - (P+R) columns
(_packed.left_pad), so its routing is left-padded with UNROUTED, then transposed. A packed micro-batch (N, T) maps
every packed token to its padded position through `PackedBatch.origin` (a shared prompt: its first row's; padding
-1 -> UNROUTED), then transposes. Context parallelism keeps this CP rank's contiguous slice of the sequence
(_context.local_slice), and sequence parallelism (TP > 1) this TP rank's contiguous slice of that ([s/TP, b] in the
MoE layer); expert parallelism routes each rank's own tokens before the all-to-all, so nothing changes there.
Every MoE layer is that of the same global layer index (train_engine=megatron maps only models whose every layer is
sparse), so a pipeline stage takes its layers' columns of the field by the routers' global layer numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from roll_core.routing import ROUTED_EXPERTS, UNROUTED
from roll_engines.train._routing import check_routing  # the hf engines' whole-batch check, shared


def megatron_token_order(
    routing: Tensor,
    origin: Tensor | None,
    width: int,
    cp: tuple[int, int] = (1, 0),
    sp: tuple[int, int] = (1, 0),
) -> Tensor:
    """A micro-batch's routing in the order Megatron's routers see its tokens.

    Args:
        routing: (B, P+R, L, K) the micro-batch's `routed_experts` in the padded layout.
        origin: packed micro-batches: (N, T) each packed token's index in the flattened (B * (P+R)) layout, -1 for
            padding (PackedBatch.origin); None: the padded layout.
        width: the model input's width S' (padded: >= P+R, the extra columns left padding; packed: T).
        cp: (context-parallel size, rank): this rank's contiguous 1/CP of the sequence.
        sp: (tensor-parallel size, rank) under sequence parallelism, else (1, 0): this rank's contiguous 1/TP of
            the (CP-local) sequence.
    Returns:
        (S_local * rows, L, K) long: token s * rows + b holds the experts of the model input's (b, s).
    """
    b, s, layers, k = routing.shape
    if origin is not None:
        flat = routing.reshape(b * s, layers, k).long()
        grid = flat[origin.clamp_min(0).cpu()]  # (N, T, L, K)
        grid[origin.cpu() < 0] = UNROUTED
        if grid.shape[1] != width:
            raise RuntimeError(f"routing replay: packed width {grid.shape[1]} but the model input has {width}")
    else:
        if width < s:
            raise RuntimeError(f"routing replay: the model input has {width} columns, the batch's routing {s}")
        grid = torch.full((b, width, layers, k), UNROUTED, dtype=torch.long)
        grid[:, width - s :] = routing.long()  # left padding, as _packed.left_pad pads the inputs
    for size, rank in (cp, sp):
        if size > 1:
            n = grid.shape[1] // size
            grid = grid[:, rank * n : (rank + 1) * n]
    return grid.transpose(0, 1).reshape(-1, layers, k)


class _LayerReplay:
    """What one TopKRouter consults for its top-k (megatron-core's `router_replay` interface)."""

    def __init__(self, owner: MegatronRoutingReplay, layer: int) -> None:
        self.owner, self.layer = owner, layer

    def get_replay_topk(
        self,
        scores: Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[Tensor, Tensor]] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(scores at the chosen experts, chosen expert ids), both (tokens, topk): the replayed ids, the router's
        own where they are UNROUTED (or everywhere when no routing is set: a forward outside the engine's)."""
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        current = self.owner.current
        if current is None:
            return values, own
        want = current[:, self.layer].to(scores.device)
        if want.shape[0] != scores.shape[0]:
            raise RuntimeError(
                f"routing replay: the router saw {scores.shape[0]} tokens, the batch's routing has {want.shape[0]}"
            )
        unrouted = (want < 0).any(-1, keepdim=True)
        idx = torch.where(unrouted, own, want)
        with torch.no_grad():
            self.owner.replayed += int((~unrouted).sum())
            same = (idx.sort(-1).values == own.sort(-1).values).all(-1, keepdim=True)
            self.owner.changed += int((~same & ~unrouted).sum())
        return scores.gather(1, idx), idx


class MegatronRoutingReplay:
    """Replays the current micro-batch's `routed_experts` in every TopKRouter of a Megatron model (this stage's)."""

    def __init__(self, model: torch.nn.Module, hf_config: Any) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not routers:
            raise ValueError(
                "train_engine.routing_replay needs a mixture-of-experts model with top-k routers (Qwen3-MoE, "
                f"Qwen2-MoE); this {hf_config.model_type} model has none"
            )
        if not all(hasattr(r, "router_replay") for r in routers):
            raise ValueError("train_engine.routing_replay on train_engine=megatron needs megatron-core >= 0.16")
        if any(getattr(r.config, "moe_router_fusion", False) for r in routers):
            raise ValueError("train_engine.routing_replay: Megatron's fused router bypasses the replay hook")
        self.num_layers = int(hf_config.num_hidden_layers)  # every layer is sparse (_convert.check_supported)
        self.top_k = int(hf_config.num_experts_per_tok)
        self.num_experts = int(hf_config.num_experts)
        self.current: Tensor | None = None  # (tokens in Megatron's order, layers, top_k) long
        self.replayed = 0
        self.changed = 0
        self.routers = routers
        for r in routers:
            r.router_replay = _LayerReplay(self, int(r.layer_number) - 1)  # layer_number: global, 1-based

    @classmethod
    def of(cls, model: torch.nn.Module, hf_config: Any, role: str) -> MegatronRoutingReplay | None:
        """The replay of `model`; a non-actor role replays only if the model has routers (a dense critic has
        none), the actor must have them (ValueError otherwise)."""
        from roll_engines.train.megatron._convert import is_moe

        if role != "actor" and not is_moe(hf_config):
            return None
        return cls(model, hf_config)

    def check(self, batch: Mapping[str, Any]) -> None:
        """A whole batch's `routed_experts` fits this model (check_routing), before any micro-batch runs."""
        check_routing(batch, self.num_layers, self.top_k, self.num_experts)

    def prepare(self, micro: Mapping[str, Any], width: int, cp: tuple[int, int], sp: tuple[int, int]) -> None:
        """Set the routing of the next forward: `micro`'s field in Megatron's token order (megatron_token_order)
        for a model input of `width` columns, this rank's CP and SP slices."""
        packed = micro.get("_packed")
        origin = packed.origin if packed is not None else None
        self.current = megatron_token_order(micro[ROUTED_EXPERTS], origin, width, cp, sp)

    def clear(self) -> None:
        """No routing set: forwards route by themselves until the next `prepare`."""
        self.current = None

    def changed_fraction(self) -> float:
        """Of the (position, MoE layer) pairs replayed since the last call, the fraction whose replayed experts
        differ from the trainer's own top-k (0 when none were replayed); resets the counts."""
        frac = self.changed / self.replayed if self.replayed else 0.0
        self.replayed = self.changed = 0
        return frac
