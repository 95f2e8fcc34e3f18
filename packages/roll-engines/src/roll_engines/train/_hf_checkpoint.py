"""Weight sync and checkpoints of the `hf` training engine (roll_engines.train.hf; FSDP2 overrides the hooks).

`HFWeightsAndCheckpoints` is a mixin of `HFTrainEngine`: `iter_weights`/`iter_adapter` (what weight sync sends),
`get_weights`/`load_weights`, `save`/`load` of a checkpoint folder (`model/` an HF folder, `optimizer/` a
torch.distributed.checkpoint keyed by parameter name, `engine.pt` scheduler, its optimizer steps per training
step and scaler; LoRA adds `adapter/`).
It uses the engine's `model`, `optimizer`, `scheduler`, `scaler`, `lora`, `vision`, `dp_rank`, `path`; sharded
engines override `_full_tensor`, `_save_model`, `_save_lora`, `_read_model_folder`, `_check_full_weights`,
`_load_full_weights` and `_on_every_rank` (what one rank reads or writes alone: its failure raises on every rank,
not only on it).

A rank's `save` returns only once the files it wrote are on disk (`fsync_written`): on a shared filesystem (NFS,
Lustre) the driver's flush of the checkpoint (roll_core.checkpoint) does not flush what other nodes' processes
wrote, so a crash after the checkpoint was declared complete could have lost a rank's shard.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from roll_core.checkpoint import fsync_dir, fsync_tree
from roll_engines.train import _vision as V
from roll_engines.train._checkpoint_fit import refuse_unfit
from roll_engines.train._lora import (
    ADAPTER,
    adapter_weights,
    base_model,
    in_parents,
    is_linear,
    load_adapter,
    merged_weights,
    save_lora,
    sync_parents,
)
from roll_engines.train._optim import read_optimizer, save_optimizer, write_optimizer, written_or_reset
from roll_engines.train._safetensors_file import read_safetensors
from roll_engines.train._settings import reapply, rebased, snapshot

T = TypeVar("T")


class HFWeightsAndCheckpoints:
    """Weights out (sync), weights in, and checkpoint folders of an hf-family engine."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    optimizer_steps_per_step: int  # the plan's optimizer steps per training step (the engine's runtime)
    scaler: Any
    vision: Any
    dp_rank: int
    path: str
    name: str
    role: str
    _trust_remote_code: bool
    loaded_use_cache: bool | None  # the loaded config's use_cache (the engine's `_load`)

    def iter_weights(self, changed_only: bool = False) -> Iterator[tuple[str, Tensor]]:
        """(name, full tensor) for weight sync, in a fixed order; tied parameters once (under their first name).

        Tensors may be the live parameters (no copy): receivers copy them before the next optimizer step.
        `changed_only` skips frozen parameters and buffers (but not a frozen parameter of a module with a trained
        one: roll_engines.train._lora.sync_parents). Collective on sharded engines (every rank iterates).
        With LoRA the tensors are merged (W + scaling * B @ A) under the base model's names, and `changed_only`
        sends only the adapted weights.
        """
        if self.lora:
            yield from merged_weights(self.model, self._full_tensor, changed_only)
            return
        persistent = set(self.model.state_dict().keys())
        # A frozen parameter beside a trained one in the same module still goes (fused groups arrive whole).
        linears = {f"{n}.weight" for n, m in self.model.named_modules() if is_linear(m)}
        trained = (n for n, p in self.model.named_parameters() if p.requires_grad and n in linears)
        parents = sync_parents(trained) if changed_only else set()
        for name, p in self.model.named_parameters():  # deduplicates shared (tied) parameters
            if changed_only and not p.requires_grad and not in_parents(name, parents):
                continue
            yield name, self._full_tensor(p.detach())
        if changed_only:
            return
        for name, b in self.model.named_buffers():
            if name in persistent:
                yield name, self._full_tensor(b)

    def iter_adapter(self) -> Iterator[tuple[str, Tensor]]:
        """The LoRA adapter alone for an inference engine that serves adapters (infer_engine.lora_sync=adapter):
        (peft saved name, full tensor), B scaled by alpha / r (roll_engines.train._lora.adapter_weights).
        Collective on sharded engines (every rank iterates)."""
        if not self.lora:
            raise ValueError(f"{self.name} engine: adapter weight sync needs LoRA (train_engine.lora_rank > 0)")
        yield from adapter_weights(self.model, self._full_tensor)

    def _full_tensor(self, t: Tensor) -> Tensor:
        return t

    def get_weights(self) -> dict[str, Tensor]:
        """Full CPU copies of `iter_weights()` (tests, notebooks)."""
        return {k: v.to("cpu", copy=True) for k, v in self.iter_weights()}

    def load_weights(self, weights: Mapping[str, Tensor]) -> None:
        """Load a full state dict, e.g. `get_weights()`'s (reference refresh, tests): every parameter must be filled
        (a tied LM head by the embedding, as `iter_weights` sends it once) and nothing else given, else RuntimeError.
        Sharded engines shard rank 0's (collective: every rank calls; the other ranks' `weights` are not read)."""
        self._load_full_weights(dict(weights))

    def shutdown(self) -> None:
        """Nothing beyond Python objects to release (megatron tears down its parallel state and overrides this)."""
        return None

    def save(self, folder: str | Path, tokenizer_path: str | None = None) -> None:
        """Write `folder/model` (an HF folder: safetensors + tokenizer), `folder/optimizer` (a
        torch.distributed.checkpoint of AdamW's state, keyed by parameter name, sharded by rank) and
        `folder/engine.pt` (scheduler and grad-scaler state). Collective on sharded engines.

        The optimizer checkpoint is resharded on load, so a run saved on N ranks resumes on M ranks (or on the
        single-process `hf` engine), from a shared filesystem or from per-node copies of the folder. Each rank
        returns once the files it wrote are flushed to disk (`fsync_written`).

        `model` holds the trained parameters in their own dtype, train_engine.param_dtype (fp32 by default), not
        model.dtype (the compute dtype): a model.dtype=bfloat16 run exports fp32 (config.json `dtype: float32`,
        twice a bf16 base's size). They are the master weights: `load` (resume) reads them back from `model`, and no
        other copy is kept, so a bf16 export would resume from rounded weights. Load or serve the folder in bf16 to
        match the run's compute (`from_pretrained(..., dtype=torch.bfloat16)`, vLLM `--dtype bfloat16`). With LoRA
        `model` is merged into the base, which is held in the compute dtype (a bf16 run's `model` is bf16); the
        trained state is `adapter/` (param_dtype). (The `megatron` engine exports its compute dtype: its fp32
        masters are in its optimizer checkpoint.)
        """
        folder = Path(folder)
        self._write(folder, tokenizer_path)
        # Rank 0 wrote everything but the other ranks' optimizer shards; they wrote only those, in `optimizer/`.
        if self.dp_rank == 0:
            fsync_written(folder, rank=0, coordinator=True)
        elif self.optimizer is not None:
            fsync_written(folder / "optimizer", rank=self.dp_rank, coordinator=False)

    def _write(self, folder: Path, tokenizer_path: str | None) -> None:
        # Rank 0 writes model/ (and the tokenizer) alone: its failure must reach the others before the optimizer's
        # collective save, where they waited for it until the process group timed out (`_on_every_rank`).
        self._on_every_rank(lambda: self._write_model(folder, tokenizer_path), f"writing {folder / 'model'}")
        if self.optimizer is None:
            return
        save_optimizer(self.model, self.optimizer, folder / "optimizer")
        if self.dp_rank == 0:
            # The steps per training step the count was taken at: a resume with another number re-bases it.
            state = {
                "scheduler": self.scheduler.state_dict(),
                "optimizer_steps_per_step": self.optimizer_steps_per_step,
            }
            if self.scaler is not None:
                state["scaler"] = self.scaler.state_dict()
                # The skips in a row so far: pipeline.max_loss_scale_skips counts across a resume, not from 0 again
                state["scaler_streak"] = int(getattr(self, "scaler_streak", 0))
            torch.save(state, folder / "engine.pt")

    def _write_model(self, folder: Path, tokenizer_path: str | None) -> None:
        """`model/` (LoRA: `adapter/` too) with the tokenizer and processor (collective on sharded engines)."""
        with _config_as_loaded(self.model, self.loaded_use_cache):
            if self.lora:
                self._save_lora(folder)
            else:
                self._save_model(folder / "model")
        if self.dp_rank == 0:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(
                tokenizer_path or self.path, trust_remote_code=self._trust_remote_code
            ).save_pretrained(folder / "model")
            V.save_processor(self.vision, self.path, folder / "model", trust_remote_code=self._trust_remote_code)

    def _on_every_rank(self, work: Callable[[], T], what: str) -> T:
        """`work()`, where a sharded engine makes a failure on any rank (one rank alone reading or writing) raise on
        every rank before any goes on to its next collective (roll_engines.train.fsdp2). One process: `work()`."""
        return work()

    def _save_model(self, folder: Path) -> None:
        self.model.save_pretrained(folder, safe_serialization=True)

    def _save_lora(self, folder: Path) -> None:
        """`adapter/` (peft format) and `model/`, the merged model that plain transformers loads (collective)."""
        save_lora(self.model, self.iter_weights(), self._full_tensor, self.dp_rank == 0, folder)

    def load(self, folder: str | Path) -> None:
        """Restore weights, optimizer, scheduler and scaler written by `save` (at any data-parallel size). The
        optimizer's hyperparameters and base LR stay this engine's configured ones (roll_engines.train._settings);
        Adam's moments and the schedule's position come from the checkpoint (the position re-based when a training
        step now takes another number of optimizer steps: _settings.rebased).

        A folder of another engine (Megatron's), of a run without this role, or saved with LoRA on where this engine
        has it off (or the reverse) is refused first, naming both sides (roll_engines.train._checkpoint_fit).

        All or nothing: a folder that fails to load (a missing or corrupt shard, no `optimizer/` or `engine.pt`)
        raises, on every rank, and leaves the engine as it was. `engine.pt` and `model/` are read and checked
        (every parameter filled, nothing else, shapes) before anything is written; the optimizer's state is read
        (_optim.read_optimizer: a stepped optimizer's into copies of its tensors) before it and the weights are
        written; a LoRA adapter (small) is put back if a later step fails. (The weights were written first: a folder
        without `optimizer/`, or with a truncated optimizer shard, raised with the new weights loaded.)

        Writing the load (optimizer, weights, scheduler, scaler) can still fail after a good read: a fresh engine (a
        resume's, whose optimizer was read in place) is then put back to fresh and the error raised as it is; a
        stepped engine's optimizer state was overwritten with no copy kept, and it raises a RuntimeError saying so
        (load a checkpoint again: _optim.written_or_reset). (A failed write left a fresh engine with part of the
        checkpoint's moments at step 0, and a stepped one with them beside its own weights, with no word of it.)"""
        folder = Path(folder)
        weights = small = None
        # A folder of another engine, role or LoRA setting is refused by name before anything is read.
        lora_rank = int(self.model.peft_config[ADAPTER].r) if self.lora else 0
        fit = lambda: refuse_unfit(folder, self.name, self.role, lora_rank, self.optimizer is not None)
        self._on_every_rank(fit, f"checking {folder}")
        if not self.lora:  # (LoRA: the base stays what model_path holds; only the adapter was trained)
            weights = self._on_every_rank(lambda: self._read_weights(folder / "model"), f"reading {folder / 'model'}")
            with _naming(folder / "model", self.path):
                self._check_full_weights(weights)
        if self.optimizer is not None:
            small = self._on_every_rank(lambda: _read_engine_state(folder), f"reading {folder / 'engine.pt'}")
            # The position in this run's plan, re-based when a training step now takes another number of optimizer
            # steps (_settings.rebased; a corrupt record raises here, before anything is written).
            position = rebased(
                int(small["scheduler"]["last_epoch"]),
                small.get("optimizer_steps_per_step"),
                self.optimizer_steps_per_step,
                self.role,
                say=self.dp_rank == 0,
            )
        trained = [p for p in self.model.parameters() if p.requires_grad] if self.lora else []
        fresh = self.optimizer is not None and not self.optimizer.state  # (before the read primes it)
        with _restored_on_failure(trained):
            if self.lora:
                with _naming(folder / "adapter", self.path, lambda: _targets_differ(folder / "adapter", self.model)):
                    self._load_adapter(folder / "adapter")
            if self.optimizer is None:
                if weights is not None:
                    self._load_full_weights(weights, checked=True)
                return
            configured = snapshot(self.optimizer)  # this run's lr, weight decay, betas: the checkpoint's would win
            loaded = read_optimizer(self.model, self.optimizer, folder / "optimizer")
            kept = [self.scheduler] + ([self.scaler] if self.scaler is not None else [])
            with written_or_reset(self.optimizer, fresh, kept):
                write_optimizer(self.model, self.optimizer, loaded)
                if weights is not None:
                    self._load_full_weights(weights, checked=True)
                self.scheduler.load_state_dict({**small["scheduler"], "last_epoch": position})
                # The configured settings take effect at that position (a resume with a changed algo.lr).
                reapply(self.optimizer, configured, self.scheduler)
                if self.scaler is not None and "scaler" in small:
                    self.scaler.load_state_dict(small["scaler"])
                    self.scaler_streak = int(small.get("scaler_streak", 0))

    def _load_adapter(self, folder: Path) -> None:
        """Load a checkpoint's `adapter/` folder (the fsdp2 engine reads it on rank 0 and broadcasts it)."""
        load_adapter(self.model, folder)

    def _read_weights(self, folder: Path) -> dict[str, Tensor]:
        """`_read_model_folder` under this model's own names (a vision-language model's)."""
        weights = self._read_model_folder(folder)
        if self.vision and weights:  # (a sharded engine's rank other than 0 reads none)
            weights = V.own_names(base_model(self.model), weights)
        return weights

    def _read_model_folder(self, folder: Path) -> dict[str, Tensor]:
        """The full state dict of a checkpoint's `model/` folder (sharded engines read it on rank 0 only and
        return {} elsewhere: `_load_full_weights` then takes rank 0's)."""
        weights: dict[str, Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            weights.update(read_safetensors(f))
        return weights

    def _check_full_weights(self, weights: dict[str, Tensor]) -> None:
        """RuntimeError unless `weights` fill the model exactly (`mismatch`), before any is written (sharded
        engines: rank 0's weights, checked on rank 0 and raised on every rank)."""
        problem = mismatch(self.model, weights)
        if problem is not None:
            raise RuntimeError(problem)

    def _load_full_weights(self, weights: dict[str, Tensor], checked: bool = False) -> None:
        """Write a full state dict into the model, `_check_full_weights` first unless already `checked`: the check
        after `load_state_dict` (which copies every tensor it can before it raises for a misshapen one) left a
        refused state dict half loaded."""
        if not checked:
            self._check_full_weights(weights)
        self.model.load_state_dict(weights, strict=False)


#: A file torch.distributed.checkpoint names after the rank that wrote it (Megatron's torch_dist save too, which may
#: put a group name first): a shard `__3_0.distcp`, a rank's own metadata `__3.metadata`.
_RANK_FILE = re.compile(r"__(\d+)(?:_\d+\.distcp|\.metadata)$")


def fsync_written(folder: Path, rank: int, coordinator: bool) -> None:
    """Flush to disk what rank `rank`'s part of a checkpoint save wrote under `folder`, before its save returns:
    the files (a rank's shards by their name, `_RANK_FILE`; the `coordinator`, the rank that writes everything else,
    every file that names no other rank), every folder under `folder` and `folder`'s own entry in its parent.

    Each rank flushes its own files, and only those: on a shared filesystem an fsync flushes only what the calling
    node wrote (the driver's flush of the whole checkpoint does not reach other nodes' data), and every rank
    flushing every rank's shards would cost ranks x shards flushes. A write error while flushing (EIO, a full disk
    or quota on a network filesystem) is raised: the save fails instead of being taken as durable."""

    def written_here(path: Path) -> bool:
        m = _RANK_FILE.search(path.name)
        return int(m.group(1)) == rank if m else coordinator

    fsync_tree(folder, include=written_here)
    fsync_dir(folder.parent)


def _read_engine_state(folder: Path) -> dict[str, Any]:
    """A checkpoint's `engine.pt` (scheduler, scaler), after checking it has an `optimizer/` (local); one without
    `engine.pt` (another engine's is refused before: _checkpoint_fit) says what is missing."""
    if not (folder / "optimizer").is_dir():
        raise FileNotFoundError(f"{folder} has no optimizer checkpoint (optimizer/): it is a weights-only folder")
    if not (folder / "engine.pt").is_file():
        raise FileNotFoundError(
            f"{folder} has optimizer/ but no engine.pt (the LR schedule's position and the loss scaler): the "
            "checkpoint is incomplete (a file lost or not copied); resume from another checkpoint"
        )
    return torch.load(folder / "engine.pt", map_location="cpu", weights_only=True)


@contextlib.contextmanager
def _config_as_loaded(model: torch.nn.Module, use_cache: bool | None) -> Iterator[None]:
    """`model.config.use_cache` as the loaded checkpoint had it (`use_cache`; None: it had none, as a
    vision-language config, whose text config holds it) while the body saves the model, back to the engine's False
    after it. The engine turns the KV cache off for its training forwards (roll_engines.train.hf `_load`): saved as
    it was, every checkpoint's config.json said `use_cache: false` (a vision-language model's gained the key), so a
    plain `model(ids)` on the exported folder returned no cache where the base model's returned one (a hand-written
    decoding loop recomputed the whole prefix at every token)."""
    config = getattr(model, "config", None)
    if config is None:
        yield
        return
    if use_cache is None:
        if "use_cache" in vars(config):
            delattr(config, "use_cache")
    else:
        config.use_cache = use_cache
    try:
        yield
    finally:
        config.use_cache = False


@contextlib.contextmanager
def _naming(path: Path, model_path: str, why: Callable[[], str | None] = lambda: None) -> Iterator[None]:
    """A RuntimeError of the body (a checkpoint's tensors that do not fit the model: `mismatch`, peft's
    `set_adapter`) raised again naming the checkpoint's `path`, the model this engine built (`model_path`) and `why`
    (a cause read off the folder), where it names neither: "checkpoint mismatch: shapes [...]" said nothing of which
    folder, or which of a run's roles, did not fit."""
    try:
        yield
    except RuntimeError as e:
        if type(e) is not RuntimeError or str(path) in str(e):
            raise
        cause = why()
        raise RuntimeError(
            f"{path} does not fit this engine's model ({model_path}): {e}" + (f"; {cause}" if cause else "")
        ) from e


def _targets_differ(adapter: Path, model: torch.nn.Module) -> str | None:
    """How the layers a saved adapter (`adapter/adapter_config.json`) adapts differ from those `model`'s adapter
    does (train_engine.lora_target_modules), or None where they agree or cannot be read (local)."""
    import json

    try:
        saved = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
        ours = model.peft_config[ADAPTER].target_modules
        saved, ours = ({t} if isinstance(t, str) else set(t) for t in (saved, ours))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # (never in place of the error it explains)
        return None
    if saved == ours:
        return None
    # (names or suffixes or a pattern, as each run's peft config holds them: shown, not matched against each other)
    shown = lambda t: ", ".join(sorted(t)[:4]) + (f", ... ({len(t)} in all)" if len(t) > 4 else "")
    return (
        f"it was saved with other target modules (train_engine.lora_target_modules): saved {shown(saved)}; this "
        f"run {shown(ours)}. Resume with the saved lora_target_modules"
    )


@contextlib.contextmanager
def _restored_on_failure(params: list[Tensor]) -> Iterator[None]:
    """Put `params` (a LoRA adapter's: small) back as they were if the body raises (local: each rank its shards)."""
    saved = [p.detach().clone() for p in params]
    try:
        yield
    except BaseException:  # (torch.distributed.checkpoint's CheckpointException is no Exception)
        with torch.no_grad():
            for p, old in zip(params, saved):
                p.copy_(old)
        raise


def mismatch(model: torch.nn.Module, weights: Mapping[str, Tensor]) -> str | None:
    """What makes `weights` no full state dict of `model` (`check_loaded`'s names, then shapes); None if they are
    one. Local."""
    own = model.state_dict()
    try:
        check_loaded(weights, [k for k in own if k not in weights], [k for k in weights if k not in own], model)
    except RuntimeError as e:
        return str(e)
    shapes = [f"{k} {tuple(w.shape)} for {tuple(own[k].shape)}" for k, w in weights.items() if w.shape != own[k].shape]
    return f"checkpoint mismatch: shapes {shapes[:5]}" if shapes else None


def check_loaded(
    weights: Mapping[str, Tensor], missing: Sequence[str], unexpected: Sequence[str], model: torch.nn.Module
) -> None:
    """RuntimeError naming what a checkpoint's full state dict did not fill or did not match: a layer that silently
    kept its initial weights would train on from the wrong start. A name of `model`'s that shares its tensor with a
    name `weights` holds (a tied LM head, saved and synced once under the embedding's name) is not missing.

    Ties are read from the model, not guessed from names: the rule "lm_head.weight is filled by
    model.embed_tokens.weight" refused every tied model whose embedding is named otherwise (a vision-language model's
    `model.language_model.embed_tokens`, GPT-2's `transformer.wte`: they could neither resume nor take back their own
    `get_weights`), and let an untied model's head be left out silently."""
    filled = set(weights)
    for names in shared_names(model):
        if filled.intersection(names):
            filled.update(names)
    missing = [k for k in missing if k not in filled]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint mismatch: missing {list(missing)[:5]}, unexpected {list(unexpected)[:5]}")


def shared_names(model: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter `model` holds under more than one name (tied embeddings), in state-dict form."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]
