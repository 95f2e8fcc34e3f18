"""LoRA adapter sync on the inference side (`infer_engine.lora_sync=adapter`): the engine serves the trainer's adapter.

Contract: the engine was started on the frozen base (the model path, loaded once) with LoRA serving enabled for the
trainer's rank (runtime `lora_rank`); each weight sync brings the adapter alone, `<module>.lora_A.weight` [r, in] and
`<module>.lora_B.weight` [out, r] in peft's saved names with the scaling already folded into B
(roll_engines.train._lora.adapter_weights). `AdapterSync` collects them between `begin()` and `finish(version)`,
checks every module has both matrices of one rank, and writes them as a peft adapter folder (adapter_config.json
with lora_alpha = r, i.e. scaling 1; adapter_model.safetensors) under a per-engine folder in shared memory (named
with the engine process's pid: a killed engine's folder is removed when the next engine starts).

Why a folder: vLLM 0.32 loads LoRA adapters from a path only (`LoRARequest.lora_path`; no tensor-based loading), and
its worker processes (another process on GPUs, one per tensor-parallel rank) read the same node's shared memory.
The adapter is small (r x (in + out) per adapted layer), so writing and reading it costs little next to a merged
sync (bench/RESULTS.md measures both).

Versions: every sync's adapter gets a new id (its weight version); a request runs to its end on the adapter it
started with (vLLM fixes a request's adapter), so a superseded adapter is removed, and its folder deleted, once no
running request uses it (`retire`). Engines without adapter serving refuse a nonzero rank (`refuse_adapters`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from roll_engines.infer._bucket_channel import leftover_prefix, remove_dead_leftovers

#: vLLM's allowed `max_lora_rank` values (vllm.config.lora.MaxLoRARanks in 0.32); the engine rounds the rank up.
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def refuse_adapters(name: str, lora_rank: int) -> None:
    """For engines that cannot serve LoRA adapters: a nonzero `lora_rank` is an error naming the way out."""
    if lora_rank:
        raise ValueError(
            f"infer_engine={name} cannot serve LoRA adapters (lora_rank={lora_rank}): set infer_engine.lora_sync="
            "merged (the trainer sends merged weights), or use infer_engine=vllm"
        )


def vllm_max_rank(lora_rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds `lora_rank`."""
    for r in VLLM_RANKS:
        if r >= lora_rank:
            return r
    raise ValueError(f"lora_rank={lora_rank}: vLLM serves LoRA ranks up to {VLLM_RANKS[-1]}")


def _shared_memory() -> str | None:
    """/dev/shm where it exists (RAM-backed, seen by every process of the node), else the temp folder."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


class AdapterSync:
    """The adapters of one engine: collected per sync, written as peft folders, retired when unused."""

    def __init__(self, engine_name: str, lora_rank: int, dtype: torch.dtype, folder: str | None = None) -> None:
        """`folder`: where the adapter folders go (default /dev/shm, else the temp folder). The folders that killed
        engines left there (their `close` never ran) are removed first: /dev/shm is RAM that lives with the node."""
        self.name, self.rank, self.dtype = engine_name, int(lora_rank), dtype
        folder = folder or _shared_memory() or tempfile.gettempdir()
        remove_dead_leftovers(folder, "lora")
        self.root = Path(tempfile.mkdtemp(prefix=f"{leftover_prefix('lora')}{engine_name}-", dir=folder))
        self._parts: dict[str, Tensor] | None = None
        self.folders: dict[int, Path] = {}  # adapter id -> its folder, while vLLM may still load it
        self.requests: dict[int, Any] = {}  # adapter id -> its vLLM LoRARequest (what requests carry)
        self.current: int = 0  # id of the adapter new requests use (0: the base, before the first sync)
        self.last: dict[str, int] = {}  # what the last sync brought: bytes, tensors, rank

    def begin(self) -> None:
        self._parts = {}

    def discard(self) -> None:
        """Drop what an aborted sync collected: nothing is loaded, later buckets are refused until `begin`."""
        self._parts = None

    def receive(self, named: Iterable[tuple[str, Tensor]]) -> int:
        """Keep one bucket's adapter matrices (copied, in the engine's dtype); bytes received."""
        if self._parts is None:
            raise RuntimeError(f"{self.name}: update_weights outside begin_weight_update/finish_weight_update")
        nbytes = 0
        for key, value in named:
            if not key.endswith(_SUFFIXES):
                self._parts = None  # a failed sync loads nothing, not the part that arrived
                raise ValueError(
                    f"{self.name}: infer_engine.lora_sync=adapter takes LoRA adapter matrices (<module>.lora_A/"
                    f"lora_B.weight) only, and got {key!r}: the trainer sent merged weights (a train engine "
                    "without adapter export, or lora_rank=0)"
                )
            t = value.detach().to("cpu", self.dtype if value.is_floating_point() else None, copy=True)
            self._parts[key] = t.contiguous()
            nbytes += t.numel() * t.element_size()
        return nbytes

    def finish(self, adapter_id: int) -> Path | None:
        """Write the collected adapter as a peft folder for `adapter_id` (> 0); None when the sync brought none.

        Raises ValueError for an incomplete adapter or a rank above the engine's."""
        parts, self._parts = self._parts, None
        if not parts:
            return None
        modules = {k.removesuffix(s) for k in parts for s in _SUFFIXES if k.endswith(s)}
        ranks = set()
        for m in sorted(modules):
            a, b = parts.get(f"{m}.lora_A.weight"), parts.get(f"{m}.lora_B.weight")
            if a is None or b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
                shapes = [None if t is None else tuple(t.shape) for t in (a, b)]
                raise ValueError(f"{self.name}: adapter of {m} is incomplete or misshapen (A, B shapes {shapes})")
            ranks.add(int(a.shape[0]))
        if len(ranks) != 1 or max(ranks) > self.rank:
            raise ValueError(
                f"{self.name}: adapter ranks {sorted(ranks)}; this engine serves one rank <= {self.rank} (the "
                "trainer's train_engine.lora_rank)"
            )
        (r,) = ranks
        folder = self.root / f"v{adapter_id}"
        folder.mkdir(parents=True, exist_ok=True)
        from safetensors.torch import save_file

        save_file(parts, str(folder / "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": r,
            "lora_alpha": r,  # scaling 1: B arrives multiplied by the trainer's alpha / r
            "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
            "bias": "none",
            "lora_dropout": 0.0,
            "fan_in_fan_out": False,
            "inference_mode": True,
        }
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
        self.folders[adapter_id] = folder
        self.last = {
            "bytes": sum(t.numel() * t.element_size() for t in parts.values()),
            "tensors": len(parts),
            "rank": r,
        }
        return folder

    def load(self, adapter_id: int, add_lora: Callable[[Any], object]) -> bool:
        """Finish the sync (`finish`) and load its adapter through `add_lora` (vLLM's: every worker reads the
        folder now, so a bad adapter fails this call and leaves the current one serving); it becomes `current`.
        False when the sync brought no adapter."""
        folder = self.finish(adapter_id)
        if folder is None:
            return False
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"{self.name}-v{adapter_id}", adapter_id, str(folder))
        try:
            add_lora(request)
        except BaseException:
            shutil.rmtree(self.folders.pop(adapter_id), ignore_errors=True)
            raise
        self.requests[adapter_id], self.current = request, adapter_id
        return True

    def retire(self, in_use: set[int], remove: Callable[[int], object]) -> list[int]:
        """Remove (`remove(id)`: the engine's remove_lora) and delete every superseded adapter no request uses."""
        done = []
        for adapter_id in [i for i in self.folders if i != self.current and i not in in_use]:
            remove(adapter_id)
            shutil.rmtree(self.folders.pop(adapter_id), ignore_errors=True)
            self.requests.pop(adapter_id, None)
            done.append(adapter_id)
        return done

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.folders.clear()
