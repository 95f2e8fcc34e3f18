"""Recording the experts a MoE model routes each token to, per layer (the rollout side of routed-expert replay).

Megatron-LM reports GRPO on Qwen3-30B-A3B collapsing without routing replay: the rollout engine picks experts under
its numerics, the trainer re-routes under its own, and the two policies differ by more than the sampling noise. The
`hf` inference engine built with `return_routing=True` records, at every forward it runs, each MoE layer's top-k
expert ids; the trainer (roll_engines.train._routing) then computes with exactly those experts.

Contract:
- `moe_routers(model)` lists the model's router modules in layer order: transformers' `*TopKRouter`s (Qwen3-MoE,
  Qwen2-MoE), whose forward maps (tokens, hidden) to (router_logits, top-k weights, top-k ids). A model without
  one is refused by `RoutingRecorder` with a ValueError naming it (a dense model has nothing to replay).
- `RoutingRecorder` hooks every router; after each forward of the decode loop the batcher calls `prefill` or
  `decode`, which hand each running request the (positions, num_moe_layers, top_k) int16 ids of the positions that
  forward computed. `result(seq)` is the request's routing: one row per prompt token and per generated token,
  (prompt_len + len(tokens), num_moe_layers, top_k) int16. The last generated token was never fed to the model (no
  routing was computed for it): its row is -1, which the trainer reads as "route it yourself" (its output predicts
  nothing the trainer scores).
- Reused prefixes (the engine's prefix cache) hold no routing: the engine disables that cache while recording.
- `model_routing(model, batch)` is the reference: the experts `model`'s own routers choose at every position of a
  padded batch in one forward (what a replayed trainer would compute without replay).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from roll_engines.infer._batcher import Running

#: Where a position's routing was not computed (the last generated token, padding): the trainer routes it itself.
UNROUTED = -1


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE router modules in layer order (transformers' `*TopKRouter`: Qwen3-MoE, Qwen2-MoE)."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "weight")
    ]


def require_routers(model: torch.nn.Module, what: str) -> list[torch.nn.Module]:
    """`moe_routers(model)`, or a ValueError saying that `what` needs a MoE model with top-k routers."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError(
            f"{what} needs a mixture-of-experts model with top-k routers (Qwen3-MoE, Qwen2-MoE); "
            f"{type(model).__name__} has none"
        )
    if len({int(r.top_k) for r in routers}) != 1:
        raise ValueError(f"{what}: the MoE layers of {type(model).__name__} route to different numbers of experts")
    return routers


class RoutingRecorder:
    """Forward hooks on every router of `model` keeping the top-k ids of the latest forward, per layer."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = require_routers(model, "infer_engine.return_routing")
        self.top_k = int(self.routers[0].top_k)
        self._last: list[Tensor | None] = [None] * len(self.routers)
        self._handles = [router.register_forward_hook(self._hook(i)) for i, router in enumerate(self.routers)]

    def remove(self) -> None:
        """Detach the hooks (the model then routes without recording)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, args: tuple, output: tuple) -> None:
            self._last[layer] = output[2].detach()

        return hook

    def _take(self, shape: tuple[int, int]) -> Tensor:
        """The latest forward's ids as (B, T, num_moe_layers, top_k) int16 on the CPU (the ids of one forward)."""
        if any(t is None for t in self._last):
            raise RuntimeError("routing: a forward ran without reaching every MoE router")
        ids = torch.stack([t.reshape(*shape, self.top_k) for t in self._last], dim=2)
        self._last = [None] * len(self.routers)
        return ids.to("cpu", torch.int16)

    def prefill(self, new: list[Running], rows: list[int], attn: Tensor) -> None:
        """After a prefill of left-padded prompts `attn` (U, P): request `new[i]` gets row `rows[i]`'s routing at
        its attended (real) prompt positions."""
        ids = self._take(tuple(attn.shape))
        real = attn.bool().cpu()
        for seq, row in zip(new, rows):
            seq.routing = [ids[row][real[row]]]

    def decode(self, running: list[Running]) -> None:
        """After a decode step (one fed token per running row): each row's routing of the token it was fed."""
        ids = self._take((len(running), 1))
        for i, seq in enumerate(running):
            seq.routing.append(ids[i])

    def result(self, seq: Running) -> Tensor:
        """(prompt_len + len(tokens), num_moe_layers, top_k) int16: the routing of every position of the request;
        rows it never computed (the last generated token, an aborted prefill) are UNROUTED."""
        n = seq.prompt_len + len(seq.tokens)
        out = torch.full((n, len(self.routers), self.top_k), UNROUTED, dtype=torch.int16)
        done = torch.cat(seq.routing) if seq.routing else out[:0]
        out[: min(n, done.shape[0])] = done[:n]
        return out


@torch.no_grad()
def model_routing(model: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The experts `model`'s own routers choose in one padded forward of `batch` (input_ids, attention_mask,
    position_ids, each (B, T)): (B, T, num_moe_layers, top_k) int16 on the CPU. The hooks it adds are removed."""
    recorder = RoutingRecorder(model)
    try:
        model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")})
        return recorder._take(tuple(batch["input_ids"].shape))
    finally:
        recorder.remove()
