"""Routed-expert replay in the training engines: MoE layers compute with the experts the rollout engine chose.

The rollout engine records each MoE layer's top-k expert ids per position (roll_engines.infer._routing); the batch
carries them as `routed_experts` (roll_core.routing: (B, P+R, num_moe_layers, top_k) int16, aligned with
`input_ids`). With `train_engine.routing_replay=true` a forward hook on every router replaces its top-k choice
by the batch's, as Megatron-LM's router replay (`moe_router_replay`) and verl's R3 ("Stabilizing MoE RL by
Aligning Training and Inference Routers") do:

- the experts are the replayed ids; the gate weights are still the trainer's own router probabilities,
  softmax(router_logits) gathered at the replayed ids (and renormalised over them where the model normalises its
  top-k, `norm_topk_prob`: then exactly R3's softmax over the replayed experts' logits), so the policy gradient
  reaches the router weights through the weights of the experts that were used;
- the router logits (the load-balancing loss's input) are untouched;
- a position whose replayed ids hold -1 (UNROUTED: padding, the last generated token, no record) keeps the
  router's own choice.

Contract: `prepare(micro, packed)` runs before every forward of the engine and sets the routing that forward
uses (packed micro-batches are mapped through `PackedBatch.origin`); a batch without `routed_experts`, with
other shapes or with expert ids out of range is a ValueError. `replayed` / `changed` count the positions
replayed and those whose replayed experts differ from the trainer's own choice (summed over layers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from roll_core.routing import ROUTED_EXPERTS, UNROUTED
from roll_engines.infer._routing import moe_routers, require_routers

if TYPE_CHECKING:
    from roll_engines.train._packing import PackedBatch


class RoutingReplay:
    """Forward hooks on every router of a model that replay the current micro-batch's `routed_experts`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = require_routers(model, "train_engine.routing_replay")
        self.top_k = int(self.routers[0].top_k)
        self.num_experts = int(self.routers[0].weight.shape[0])
        self.current: Tensor | None = None  # (tokens, layers, top_k) long on the model's device
        self.replayed = 0
        self.changed = 0
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(i))

    @classmethod
    def of(cls, model: torch.nn.Module, role: str) -> RoutingReplay | None:
        """The replay of `model`; a non-actor role (reference, critic) sharing the setting replays only if the
        model has routers (a dense critic has none), the actor must have them."""
        if role != "actor" and not moe_routers(model):
            return None
        return cls(model)

    def prepare(self, micro: Mapping[str, Any], packed: PackedBatch | None) -> None:
        """Set the routing of the next forward: `micro`'s `routed_experts` in the padded layout (packed None)
        or mapped to `packed`'s token order."""
        routing = micro.get(ROUTED_EXPERTS)
        if routing is None:
            raise ValueError(
                f"train_engine.routing_replay=true but the batch has no {ROUTED_EXPERTS!r}: the rollout engine must "
                "record them (infer_engine.return_routing=true) and the batch carry them (the synchronous RLVR "
                "pipeline does; agentic trajectories do not yet)"
            )
        ids = micro["input_ids"]
        want = (*ids.shape, len(self.routers), self.top_k)
        if tuple(routing.shape) != want:
            raise ValueError(
                f"{ROUTED_EXPERTS} has shape {tuple(routing.shape)}; this batch and model need {want} "
                "(rows, P+R, MoE layers, top_k)"
            )
        if int(routing.max()) >= self.num_experts or int(routing.min()) < UNROUTED:
            raise ValueError(f"{ROUTED_EXPERTS} holds expert ids outside [-1, {self.num_experts})")
        flat = routing.reshape(-1, len(self.routers), self.top_k).long()
        if packed is not None:
            origin = packed.origin.reshape(-1).cpu()
            flat = flat[origin.clamp_min(0)]
            flat[origin < 0] = UNROUTED
        device = next(iter(self.routers[0].parameters())).device
        self.current = flat.to(device)

    def changed_fraction(self) -> float:
        """Of the (position, MoE layer) pairs replayed since the last call, the fraction whose replayed experts
        differ from the trainer's own top-k (0 when none were replayed); resets the counts."""
        frac = self.changed / self.replayed if self.replayed else 0.0
        self.replayed = self.changed = 0
        return frac

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, args: tuple, output: tuple) -> tuple | None:
            if self.current is None:
                return None
            logits, _, own = output
            want = self.current[:, layer]
            if want.shape[0] != own.shape[0]:
                raise RuntimeError(
                    f"routing replay: the router saw {own.shape[0]} tokens, the batch's routing has {want.shape[0]}"
                )
            unrouted = (want < 0).any(-1, keepdim=True)
            idx = torch.where(unrouted, own, want)
            # Megatron's router replay: the trainer's probabilities at the replayed experts (the router's gradient).
            weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, idx)
            if getattr(module, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            with torch.no_grad():
                self.replayed += int((~unrouted).sum())
                same = (idx.sort(-1).values == own.sort(-1).values).all(-1, keepdim=True)
                self.changed += int((~same & ~unrouted).sum())
            return logits, weights.to(logits.dtype), idx

        return hook
