"""Weights in and out of the `megatron` training engine: weight sync, HF exports and checkpoint folders.

`MegatronWeightsAndCheckpoints` is a mixin of `MegatronTrainEngine` (roll_engines.train.megatron.engine), as
roll_engines.train._hf_checkpoint is of the `hf` engine. It gives `iter_weights` (what weight sync sends: full tensors
in HF names, streamed at most a layer at a time, collective over TP, PP and EP ranks: _export), `get_weights`, and
`save`/`load` of a checkpoint folder: `model/` an HF folder written by global rank 0 (fsync'ed before `save` returns),
`optimizer/` a Megatron distributed checkpoint written by every rank, and with LoRA `adapter/` a peft adapter folder
(the trained state; `model/` is then merged). Both load at any TP/PP/DP layout. `_weights` reads an HF folder into
_convert.load_hf's input (the engine's first load uses it too). It uses the engine's `model`, `ddp`, `optimizer`,
`overlap`, `lora`, `hf_config`, `critic`, `compute_dtype`, `device`, `path`, `_seed`, `_step` and `_shims()`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from roll_engines.train._checkpoint_fit import _saved_rank, refuse_unfit
from roll_engines.train._hf_checkpoint import _restored_on_failure, fsync_written
from roll_engines.train._safetensors_file import read_safetensors_folder
from roll_engines.train._settings import rebased
from roll_engines.train.megatron import _convert as C
from roll_engines.train.megatron import _critic as V
from roll_engines.train.megatron import _export as X
from roll_engines.train.megatron import _lora as L
from roll_engines.train.megatron._checkpoint import (
    read_optimizer,
    save_optimizer,
    stepped,
    write_optimizer,
    written_or_reset,
)
from roll_engines.train.megatron._optimizer import finish_param_gather


class MegatronWeightsAndCheckpoints:
    """Weights out (sync, export), weights in, and checkpoint folders of the megatron engine."""

    model: Any
    ddp: Any
    optimizer: Any
    overlap: tuple[bool, bool]
    lora: tuple[int, float, list[str] | str] | None
    hf_config: Any
    critic: bool
    compute_dtype: torch.dtype  # Megatron's params_dtype: the model's weights (the fp32 masters are the optimizer's)
    device: torch.device
    path: str
    _seed: int
    _step: int  # the LR schedule's position (optimizer steps taken)
    optimizer_steps_per_step: int  # the plan's optimizer steps per training step (the engine's runtime)
    role: str
    _shims: Callable[[], AbstractContextManager[None]]  # the engine's (_cpu.engine_shims)

    def _weights(self, path: str) -> tuple[dict[str, Tensor], Any, dict[str, Tensor] | None]:
        """(HF tensors of the folder at `path`, the HF config, the critic's value head or None): load_hf's input."""
        hf = read_safetensors_folder(path)
        return hf, self.hf_config, V.head_tensors(hf, self.hf_config, self._seed) if self.critic else None

    def _gather_params(self) -> None:
        """Finish the parameter all-gather that overlap_param_gather left to the next forward (collective): the
        weights are read outside a forward (export, weight sync, save) or overwritten (load) right after a step."""
        if self.optimizer is not None and self.overlap[1]:
            with self._shims():
                finish_param_gather(self.ddp)

    # ---- weights ------------------------------------------------------------------------------------------
    def _export(
        self, grads: bool = False, changed_only: bool = False, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, Tensor]]:
        """(HF name, full tensor) of every weight (or main gradient), streamed piece by piece (_export): gathered
        over TP, a MoE layer's experts over EP and fused as transformers holds them, each stage's pieces broadcast
        over PP; in `dtype`, else the parameters' own. Collective; the same pairs in the same order on every rank."""
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        self._gather_params()
        offset = get_transformer_layer_offset(self.model.config)
        local = X.local_tensors(self.model, bool(self.lora), grads, changed_only)
        pieces = X.stage_pieces(local, self.hf_config, self.critic, offset, dtype)
        yield from X.pairs(X.over_stages(pieces, self.device), self._shims)

    @functools.cached_property
    def _hf_skeleton(self) -> Any:
        """The HF model on the meta device (built once: a meta model of a Qwen2-7B config takes 1.9 s here, which
        every weight sync and save paid). A causal LM carries `model_path`'s generation_config.json, as
        `from_pretrained` would: built from the config alone, the exported folder lost the model's sampling defaults
        and extra stop ids (an `eos_token_id` list), so the folder generated past the turn's end."""
        # In the exported dtype: save_pretrained writes the skeleton's parameter dtype into config.json (meta: free).
        skeleton = V.hf_skeleton(self.hf_config, self.critic).to(self.compute_dtype)
        if skeleton.can_generate():
            from transformers import GenerationConfig

            try:
                skeleton.generation_config = GenerationConfig.from_pretrained(self.path)
            except OSError:  # the folder has none: the config's defaults are what from_pretrained would give too
                pass
        return skeleton

    def iter_weights(self, changed_only: bool = False) -> Iterator[tuple[str, Tensor]]:
        """Full weights in HF names, streamed in the Megatron model's order, layer by layer, in the parameters' dtype
        (a bf16 model's are bf16; collective over TP, PP and EP ranks, at most one layer in flight: _export). With
        LoRA the weights are merged (W + alpha/r * B @ A) and `changed_only` sends only the adapted ones."""
        yield from self._export(changed_only=changed_only and bool(self.lora))

    def get_weights(self) -> dict[str, Tensor]:
        """Every weight in HF names, fp32 CPU copies (tests, tools; exact: the weights' own values upcast)."""
        return {k: v.to("cpu", copy=True) for k, v in self._export(dtype=torch.float32)}

    def save(self, folder: str | Path, tokenizer_path: str | None = None) -> None:
        """`folder/model` (HF folder, written by global rank 0) and `folder/optimizer` (a Megatron distributed
        checkpoint of the optimizer state, every parameter's moments under its global name and shape, written by
        all ranks: collective). Both load at any TP/PP/DP layout. With LoRA, `model` is merged and `adapter` is a
        peft adapter folder (the trained state; resume reads it, over the base of `model_path`).

        `model` holds the weights the model computes with, in their own dtype (the compute dtype, Megatron's
        params_dtype, which config.json names): a model.dtype=bfloat16 run's folder is bf16, like its base's. The
        fp32 masters are the optimizer's and travel in `optimizer` (resume restores them from there). The `hf` and
        `fsdp2` engines differ: their parameters are the fp32 masters (train_engine.param_dtype) and resume reads
        them back from `model`, so their folder is fp32 in the same run (roll_engines.train._hf_checkpoint `save`)."""
        import torch.distributed as dist

        folder = Path(folder)
        weights = {}  # every rank streams the export (collective); rank 0 writes it
        # Each tensor is copied to host at once: uncast, the export may hand out a live parameter (no gather
        # needed), and device copies of the whole model on rank 0 would double its accelerator memory until the write.
        for k, v in self._export():
            if dist.get_rank() == 0:
                weights[k] = v.to("cpu", copy=True)
        if self.lora:
            with self._shims():
                adapter = X.all_stages(L.adapter_tensors(self.model, self.hf_config))
            if dist.get_rank() == 0:
                L.save_adapter(folder / "adapter", adapter, L.adapter_config(*self.lora, self.path))
        if dist.get_rank() == 0:
            from transformers import AutoTokenizer

            self._hf_skeleton.save_pretrained(folder / "model", state_dict=weights, safe_serialization=True)
            AutoTokenizer.from_pretrained(tokenizer_path or self.path).save_pretrained(folder / "model")
            for part in (p for p in (folder / "model", folder / "adapter") if p.is_dir()):  # durable on return
                fsync_written(part, 0, True)  # (roll_core.checkpoint, Writers: each rank flushes what it wrote)
        if self.optimizer is None:
            return
        with self._shims():
            save_optimizer(folder / "optimizer", self.model, self.optimizer, self._step, self.optimizer_steps_per_step)

    def load(self, folder: str | Path) -> None:
        """Weights from `folder/model` (with LoRA: the adapter from `folder/adapter`; the base stays what
        `model_path` holds) and the optimizer state from `folder/optimizer`, both at any layout.

        All or nothing: a folder that fails to load (a missing, truncated or misshapen shard, no `optimizer/`)
        raises and leaves the engine as it was. `model/` (LoRA: `adapter/`) is read, mapped and checked (names,
        shapes) and the optimizer state read into tensors of its own (_checkpoint.read_optimizer) before anything is
        written; the adapter is put back (small) if writing the optimizer's state or the weights then fails, and a
        fresh optimizer (a resume's, read in place) is put back to fresh; a stepped one's error then says that its
        state is inconsistent and must be loaded again (no copy of it is kept: _checkpoint.written_or_reset). (The
        weights were written first: a folder without `optimizer/`, or with a truncated optimizer shard, raised with
        the new weights loaded, and a misshapen tensor only after the tensors before it had been copied.)

        A folder of a run without this role (a GRPO checkpoint resumed by a PPO run's critic), or saved training
        every weight where this engine trains a LoRA adapter (or the reverse), is refused first, naming both sides
        and the ways on (`refuse_unfit_megatron`); an adapter of another rank or alpha by _lora.load_adapter."""
        import torch.distributed as dist

        folder = Path(folder)
        # A folder of a run without this role, or saved with LoRA on where this engine has it off (or the reverse),
        # is refused by name before anything is read (each rank reads the same folder: all refuse alike).
        refuse_unfit_megatron(folder, self.role, self.lora[0] if self.lora else 0, self.optimizer is not None)
        self._gather_params()  # no pending all-gather of the old weights may land on the loaded ones
        mapped = adapter = loaded = None
        fresh = self.optimizer is not None and not stepped(self.optimizer)  # (before the read primes it)
        with self._shims():
            if self.lora:  # (the base stays what model_path holds; only the adapter was trained)
                adapter = L.load_adapter(self.model, self.hf_config, folder / "adapter", *self.lora[:2], write=False)
            else:
                mapped = self._mapped(str(folder / "model"))
            if self.optimizer is not None:
                loaded = read_optimizer(folder / "optimizer", self.model, self.optimizer)
                # The schedule's position in this run's plan, re-based when a training step now takes another number
                # of optimizer steps (as hf's: _settings.rebased); a corrupt record raises before anything is written.
                position = rebased(
                    int(loaded["step"]),
                    loaded.get("optimizer_steps_per_step"),
                    self.optimizer_steps_per_step,
                    self.role,
                    say=dist.get_rank() == 0,
                )
        trained = [p for p in self.model.parameters() if p.requires_grad] if self.lora else []
        # On failure the adapter is put back first, then a fresh optimizer reset (its masters from the weights put
        # back); a stepped one's error says it must be loaded again (_checkpoint.written_or_reset).
        reset = written_or_reset(self.model, self.optimizer, fresh) if loaded is not None else contextlib.nullcontext()
        with self._shims(), reset, _restored_on_failure(trained):
            if adapter is not None:
                L.write_adapter(adapter)
            if loaded is not None:
                write_optimizer(self.optimizer, loaded)
            if mapped is not None:  # last: an fp32 model's optimizer parameters are its weights (or views of them)
                C.write_mapped(self.model, mapped)
        if loaded is not None:
            self._step = position

    def _mapped(self, path: str) -> dict[str, Tensor]:
        """This rank's Megatron tensors of the HF folder at `path`, mapped and checked (names, shapes), nothing
        written (_convert.load_hf); an error names the folder."""
        try:
            return C.load_hf(self.model, *self._weights(path), write=False)
        except KeyError as e:  # a tensor the mapping needs is not there: a lost shard, or another model's folder
            raise RuntimeError(f"{path} has no tensor {e}: the folder is incomplete, or not this model's") from e
        except (RuntimeError, ValueError) as e:
            if type(e) not in (RuntimeError, ValueError):
                raise
            raise type(e)(f"{path}: {e}") from e


def refuse_unfit_megatron(folder: Path, role: str, lora_rank: int, trains: bool) -> None:
    """Raise, naming checkpoint `folder`, what it holds and the ways on (as the hf family's
    roll_engines.train._checkpoint_fit), when this engine (`role`, adapter rank `lora_rank`, 0: none; `trains`: it has
    an optimizer) cannot resume it: FileNotFoundError for no such folder (it said `model/` "has no *.safetensors
    weights"); ValueError for a full-weights checkpoint given a LoRA engine (a bare FileNotFoundError on
    adapter/adapter_config.json) and a LoRA one given an engine training every weight (Megatron's "Cannot merge two
    lists with different lengths" from the optimizer's param_groups). An hf-family checkpoint is refused by
    _checkpoint.read_optimizer; an engine that trains nothing loads a LoRA checkpoint's merged `model/`."""
    # trains=False: refuse_unfit's other refusal, of a Megatron-written optimizer/, is the hf family's
    refuse_unfit(folder, "megatron", role, lora_rank, trains=False)
    if trains and not lora_rank and (folder / "adapter").is_dir():
        saved = _saved_rank(folder / "adapter")
        raise ValueError(
            f"{folder} is a LoRA checkpoint (adapter/, rank {saved}), and this {role} trains every weight "
            f"(train_engine.lora_rank=0): its optimizer state is the adapter's. Resume with "
            f"train_engine.lora_rank={saved} (and the saved lora_alpha), or start a new run from its merged weights "
            f"(model.path={folder / 'model'})"
        )
