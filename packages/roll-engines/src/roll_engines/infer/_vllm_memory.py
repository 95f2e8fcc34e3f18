"""The memory side of the `vllm` engine (roll_engines.infer.vllm): sleep, wake-up and what it holds.

Contract: `VLLMMemory` is a mixin of VLLMInferEngine, which provides `_control(fn)` (`fn` on its driver thread),
`_discard_weights` (roll_engines.infer._vllm_weights), `llm`, `name`, `device`, `on_cpu`, `_adapters`,
`_kv_cache_gb`, `_base_used` (`_device_used` before vLLM started), `_slept` and `_warned_sleep`.
- Sleep: vLLM's sleep mode exists on CUDA only (`enable_sleep_mode`); on CPU `sleep()` keeps everything (vLLM
  preallocates its KV cache, `kv_cache_gb`) and says so once in the log. Level 2 (on CPU too) leaves requests refused
  until syncs that complete have rewritten every layer; it is refused with LoRA adapter sync, whose syncs never
  resend the base.
- `memory_bytes`: on CPU the model as each worker measured it and the configured KV cache; on CUDA what the
  engine's device gained since before the engine started (vLLM pools weights and KV cache), measured, so that
  sleep's release is observed rather than assumed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


class VLLMMemory:
    """`sleep`, `wake_up` and `memory_bytes` of VLLMInferEngine (module docstring: what the engine provides)."""

    name: str
    llm: Any
    device: torch.device
    on_cpu: bool
    _adapters: Any
    _kv_cache_gb: int
    _base_used: int
    _slept: int
    _warned_sleep: bool

    def sleep(self, level: int = 1) -> None:
        """Level 1 frees the KV cache, level 2 the weights too: then requests are refused until syncs that complete
        have rewritten every layer (roll_engines.infer._vllm_weights). On CPU vLLM keeps everything, and level 2
        is refused all the same: what a GPU would serve from discarded weights fails here too."""
        if level >= 2 and self._adapters is not None:
            raise ValueError(
                f"{self.name}: sleep(level=2) discards the base weights, which adapter sync never resends "
                "(infer_engine.lora_sync=adapter): use sleep_level 1"
            )
        if level >= 2:  # first: running requests are aborted while vLLM is awake
            self._control(self._discard_weights)
        if self.on_cpu:
            if not self._warned_sleep:
                log.warning("vLLM's sleep mode does not exist on CPU: %s keeps its weights and KV cache", self.name)
                self._warned_sleep = True
            return
        self._control(lambda: self.llm.sleep(level=level))
        self._slept = level

    def wake_up(self) -> None:
        if self._slept:
            self._control(self.llm.wake_up)
            self._slept = 0

    def memory_bytes(self) -> dict[str, int]:
        """CPU: the model as each worker measured it at load, and the configured KV cache. CUDA: see below."""
        if self.on_cpu:
            weights = sum(self._control(lambda: self.llm.collective_rpc("roll_model_bytes")))
            return {"weights": int(weights), "kv_cache": self._kv_cache_gb * 2**30}
        # On CUDA vLLM's allocator pools weights and KV cache together: report what the device gained since before
        # this engine started (under "weights"), measured, so that sleep's release is observed rather than assumed.
        return {"weights": max(0, _device_used(self.device) - self._base_used), "kv_cache": 0}


def _device_used(device: torch.device) -> int:
    """Bytes in use on the engine's `device`, all processes (0 on CPU or without CUDA). The engine's own device, not
    the current one: an engine on cuda:1 in a process whose current device is cuda:0 measured the wrong GPU."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)
