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
- each router family's own gating: softmax over every expert then gathered (Qwen2/3-MoE, OLMoE: renormalised over
  the top-k where `norm_topk_prob`; Mixtral, Qwen3-VL-MoE: always), or softmax over the chosen experts' logits
  (GPT-OSS); a router of another family is refused (`GATING`), and the first forward checks on the positions
  whose replayed experts are the router's own that the replayed weights are the router's (a new transformers
  release that changes a family's gating fails loudly instead of scaling expert outputs silently);
- the router logits (the load-balancing loss's input) are untouched;
- a position whose replayed ids hold -1 (UNROUTED: padding, the last generated token, no record) keeps the
  router's own choice.

Contract: `check(batch)` (`check_routing`) refuses a batch without `routed_experts`, with other shapes or with
expert ids out of range (a ValueError); the engines call it on the whole batch, on the host, before any forward
(inside _agree.agreed, so a refusal on one data-parallel rank is raised on every rank instead of leaving the others
in their first collective). `prepare(micro, packed)` runs before every forward of the engine and sets the routing
that forward uses from a micro-batch of a checked batch, or a padding row made from one (its rows are the batch's:
nothing left to check; packed micro-batches are mapped through `PackedBatch.origin`). `replayed` / `changed` count
the positions replayed and those whose replayed experts differ from the trainer's own choice (summed over layers).
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


#: Router class -> how its gate weights come from its logits at given experts: "softmax" (over every expert,
#: gathered; renormalised over the top-k iff the router's `norm_topk_prob`), "softmax_renorm" (the same, always
#: renormalised), "topk_softmax" (softmax over the chosen experts' logits).
GATING = {
    "Qwen2MoeTopKRouter": "softmax",
    "Qwen3MoeTopKRouter": "softmax",
    "OlmoeTopKRouter": "softmax",
    "MixtralTopKRouter": "softmax_renorm",
    "Qwen3VLMoeTextTopKRouter": "softmax_renorm",
    "GptOssTopKRouter": "topk_softmax",
}


def gate_weights(module: torch.nn.Module, logits: Tensor, idx: Tensor) -> Tensor:
    """(tokens, top_k) fp32 gate weights of `module` (a router in `GATING`) at experts `idx` (tokens, top_k), from
    its logits (tokens, num_experts): what the router itself computes for its own top-k."""
    kind = GATING[type(module).__name__]
    if kind == "topk_softmax":
        return torch.softmax(logits.float().gather(-1, idx), dim=-1)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, idx)
    if kind == "softmax_renorm" or getattr(module, "norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def check_routing(batch: Mapping[str, Any], num_layers: int, top_k: int, num_experts: int) -> None:
    """ValueError unless `batch` carries `routed_experts` of shape (B, P+R, num_layers, top_k) (B, P+R: its
    `input_ids`') with ids in [-1, num_experts). Host work only: an empty batch (a rank's share of a short one)
    passes (no max of no ids)."""
    routing = batch.get(ROUTED_EXPERTS)
    if routing is None:
        raise ValueError(
            f"train_engine.routing_replay=true but the batch has no {ROUTED_EXPERTS!r}: the rollout engine must "
            "record them (infer_engine.return_routing=true) and the batch carry them (the synchronous RLVR "
            "pipeline does; agentic trajectories do not yet)"
        )
    want = (*batch["input_ids"].shape, num_layers, top_k)
    if tuple(routing.shape) != want:
        raise ValueError(
            f"{ROUTED_EXPERTS} has shape {tuple(routing.shape)}; this batch and model need {want} "
            "(rows, P+R, MoE layers, top_k)"
        )
    if routing.numel() and (int(routing.max()) >= num_experts or int(routing.min()) < UNROUTED):
        raise ValueError(f"{ROUTED_EXPERTS} holds expert ids outside [-1, {num_experts})")


class RoutingReplay:
    """Forward hooks on every router of a model that replay the current micro-batch's `routed_experts`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = require_routers(model, "train_engine.routing_replay")
        unknown = sorted({type(r).__name__ for r in self.routers} - set(GATING))
        if unknown:  # replaying ids under another family's gating would rescale every expert output
            raise ValueError(
                f"train_engine.routing_replay: {type(model).__name__}'s routers ({', '.join(unknown)}) compute their "
                f"gate weights in a way roll does not replay; supported routers: {', '.join(sorted(GATING))}"
            )
        self._checked: set[int] = set()  # routers whose gating was checked against their own output
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

    def check(self, batch: Mapping[str, Any]) -> None:
        """A whole batch's `routed_experts` fits this model (`check_routing`), before any micro-batch runs."""
        check_routing(batch, len(self.routers), self.top_k, self.num_experts)

    def prepare(self, micro: Mapping[str, Any], packed: PackedBatch | None) -> None:
        """Set the routing of the next forward: `micro`'s `routed_experts` (a micro-batch of a batch `check`
        passed) in the padded layout (packed None) or mapped to `packed`'s token order."""
        routing = micro[ROUTED_EXPERTS]
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

    @staticmethod
    def _check(module: torch.nn.Module, logits: Tensor, scores: Tensor, own: Tensor) -> None:
        """Raise unless `gate_weights` at the router's own experts gives the router's own weights `scores`."""
        mine = gate_weights(module, logits, own)
        tol = 1e-5 if scores.dtype == torch.float32 else 1e-2
        if not torch.allclose(mine, scores.float(), atol=tol, rtol=tol):
            raise RuntimeError(
                f"routing replay: {type(module).__name__}'s gate weights are not what roll computes for its family "
                f"({GATING[type(module).__name__]}; max difference {float((mine - scores.float()).abs().max()):.3g}): "
                "this transformers version changed the router; turn train_engine.routing_replay off"
            )

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
            weights = gate_weights(module, logits, idx)
            with torch.no_grad():
                self.replayed += int((~unrouted).sum())
                same = (idx.sort(-1).values == own.sort(-1).values).all(-1, keepdim=True)
                self.changed += int((~same & ~unrouted).sum())
                if layer not in self._checked:
                    self._check(module, logits, output[1], own)
                    self._checked.add(layer)
            # In the dtype of the router's own weights: Mixtral keeps them fp32 in a bf16 model, and rounding them
            # to bf16 changed its outputs (2e-3 in the logits) with its own experts replayed.
            return logits, weights.to(output[1].dtype), idx

        return hook
