"""roll's methods inside vLLM's worker processes (vLLM's `worker_extension_cls`, as OpenRLHF and verl extend it).

vLLM mixes this class into its worker class in every worker process (one per device under tensor parallel; on a
GPU those processes are not the adapter's), so `LLM.collective_rpc("roll_...")` runs these methods where the
model lives. Arguments and results cross as msgpack: plain strings and numbers only.

A weight sync is all or nothing in every worker. vLLM's layer-wise reload writes a layer's new values into the
engine's own tensors (fused ones: qkv_proj, gate_up_proj, experts) once all its parts arrived, and rebuilds what it
derives from them (vLLM-CPU's packed GEMM weights, kept as the layer's `cpu_linear`). Just before that write
(`_saving` wraps the reload's two functions that write a layer, for the length of one sync), `_LayerUndo` keeps
the layer's old tensor values (host copies, roll_engines.infer._sync_undo) and its plain attributes (the old packed
kernels themselves). A sync the sender aborts (`SyncAborted`) or that fails here (a
rejected weight, a sender that died) then ends with every layer the reload had not finished given back its own
tensors, and every layer it finished given back its old values and kernels: the worker holds its complete old
weights. A sync that completes drops the copies when its call returns. Where vLLM's reload internals this relies on
are missing (another vLLM version), syncs keep working but a failed one cannot be undone, and says so.

An undo that fails (or cannot be done) leaves the worker a mix of two weight versions: it keeps the layers the sync
wrote as mixed (roll_engines.infer._sync_undo.MixedWeights, `roll_mixed_layers` counts them for the engine, which
refuses to serve meanwhile) until later syncs that complete have written every one of them again. Syncs while mixed
keep no copies (a mix is not worth restoring); one of them that fails adds the layers it wrote to the mix.

A level-2 sleep discards every weight: `roll_discard_weights` makes every layer a full sync writes count as
discarded in the same tracking (`_roll_weight_layers`: the modules holding a parameter of their own that the reload
loads; a tied LM head's is the embedding's), so the engine serves again only once completed syncs have written each
of them. A layer counts as written only when one sync brought all its parts: vLLM reloads a layer whole and fills
what was not sent from uninitialised memory, so a fused layer (qkv_proj from q/k/v, gate_up_proj from gate/up,
experts) that received only some of them is still unwritten (`_LayerUndo.whole`: every parameter loaded in shards
received all its elements; one loaded in one piece is whole even where its loader pads it). Layers no sync writes
(a vLLM parameter without a trainer counterpart: a VLM's or FP8 model's) must not keep the engine refusing forever:
a completed sync that sent every name any sync ever sent (a full sync; the first sync an engine gets is full:
roll_core.cluster.weight_sync) and wrote none of a layer marks that layer unreachable, lifts it, names it in the
log, and later discards leave it out; a sync that writes it makes it reachable again. Where the reload's writes
cannot be followed, a completed sync lifts it all.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from roll_engines.infer._bucket_channel import SyncAborted, receive_buckets
from roll_engines.infer._sync_undo import EXAMPLES, MixedWeights, SyncUndo

log = logging.getLogger(__name__)

#: torch's own bookkeeping in a module's __dict__ (tensors, children, hooks): what `_LayerUndo` leaves to vLLM.
_MODULE_STATE = frozenset(vars(torch.nn.Module()))
#: vLLM 0.32's functions (vllm.model_executor.model_loader.reload.layerwise) that write a layer's engine tensors.
_WRITERS = ("_layerwise_process", "_finalize_attention_layer")
#: ... and the one that counts the elements each buffered load brings (`_LayerUndo.whole`).
_COUNTER = "get_numel_loaded"
#: A weight loader's arguments naming the part of a fused parameter one load brings (linear layers' q/k/v or
#: gate/up index, FusedMoE's w1/w2/w3).
_SHARD_ARGS = ("loaded_shard_id", "shard_id")


class _LayerUndo:
    """The old state of the layers one reload has written so far: tensor values and plain attributes (none where
    `keep` is False), and which layers it wrote new weights into."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self.tensors = SyncUndo(keep=keep)
        self._attrs: list[tuple[torch.nn.Module, dict[str, Any]]] = []
        self._seen: set[int] = set()
        #: id() of every layer written whole with weights of this sync (an attention layer the reload finalises
        #: without any keeps its values): what a failed undo leaves mixed, what a complete sync rewrote.
        self.loaded: set[int] = set()
        #: id() of every layer this sync brought only some parts of (`whole`): written, not rewritten.
        self.partial: set[int] = set()
        #: Elements each buffered load brought, by id() of its bound arguments (vLLM's count, `_saving`); None where
        #: vLLM's counter is missing: a layer then counts as whole once written.
        self.numel: dict[int, int] | None = {}

    def save(self, layer: torch.nn.Module, info: Any) -> None:
        """Before vLLM writes `layer`'s engine tensors (`info.kernel_tensors`; None on a first load, not a
        reload: nothing to keep)."""
        if (info.load_numel or 0) > 0:
            (self.loaded if self.whole(info) else self.partial).add(id(layer))
        if info.kernel_tensors is None or id(layer) in self._seen or not self.keep:
            return
        self._seen.add(id(layer))
        params, buffers = info.kernel_tensors
        for t in (*params.values(), *buffers.values()):
            self.tensors.save(t.data)
        # The objects themselves: the old `cpu_linear` closure holds the old packed weight.
        self._attrs.append((layer, {k: v for k, v in vars(layer).items() if k not in _MODULE_STATE}))

    def whole(self, info: Any) -> bool:
        """Whether the loads buffered in `info` bring every part of their layer: each parameter loaded in shards
        (q/k/v, gate/up, experts) received all its elements. A parameter loaded in one piece is whole (its loader
        may pad it: a vocabulary padded to 64 rows loads fewer elements than it holds); one never loaded is not
        looked at (a parameter without a trainer counterpart, an FP8 scale, would keep its layer unwritten)."""
        if self.numel is None:
            return True
        got: dict[int, int] = {}
        params: dict[int, torch.Tensor] = {}
        for _, args in info.loaded_weights:
            param = args.arguments.get("param")
            if not isinstance(param, torch.Tensor):
                continue
            if all(args.arguments.get(k) is None for k in _SHARD_ARGS):
                got[id(param)] = -1  # loaded in one piece
            elif got.get(id(param), 0) >= 0:
                got[id(param)] = got.get(id(param), 0) + self.numel.get(id(args), 0)
            params[id(param)] = param
        return all(n < 0 or n >= getattr(params[k], "weight_loader_numel", params[k].numel()) for k, n in got.items())

    def undo(self) -> int:
        """Put back every saved layer's tensor values and attributes; returns the tensors restored."""
        restored = self.tensors.undo()
        while self._attrs:
            layer, attrs = self._attrs.pop()
            state = vars(layer)
            for k in [k for k in state if k not in _MODULE_STATE and k not in attrs]:
                del state[k]  # set by the reload's processing (none existed before)
            state.update(attrs)
        self._seen.clear()
        return restored


@contextmanager
def _saving(undo: _LayerUndo | None) -> Iterator[bool]:
    """Within: `undo` saves each layer before vLLM's reload writes it; yields whether it can (module docstring)."""
    if undo is None:
        yield False
        return
    from vllm.model_executor.model_loader.reload import layerwise

    originals = {name: getattr(layerwise, name, None) for name in _WRITERS}
    if any(fn is None for fn in originals.values()):
        log.warning("vLLM's layer-wise reload lacks %s: a failed weight sync cannot be undone", _WRITERS)
        yield False
        return
    numel = undo.numel
    count = getattr(layerwise, _COUNTER, None)
    if count is None or numel is None:
        log.warning("vLLM's layer-wise reload lacks %s: a layer counts as written once any part is", _COUNTER)
        undo.numel = None

    def saving(fn: Any) -> Any:
        def write(layer: torch.nn.Module, info: Any, *args: Any, **kwargs: Any) -> Any:
            undo.save(layer, info)
            return fn(layer, info, *args, **kwargs)

        return write

    def counting(loader: Any, args: Any) -> Any:
        n, ret = count(loader, args)
        numel[id(args)] = int(n)  # type: ignore[index]  # kept in `info.loaded_weights` until its layer is written
        return n, ret

    if undo.numel is not None:
        originals[_COUNTER] = count
    for name, fn in originals.items():
        setattr(layerwise, name, counting if name == _COUNTER else saving(fn))
    try:
        yield True
    finally:
        for name, fn in originals.items():
            setattr(layerwise, name, fn)


#: Endings of the names vLLM's AutoWeightsLoader may drop when the model has no such parameter
#: (vllm/model_executor/models/utils.py `AutoWeightsLoader.load_weights` adds ".bias" for every model: "Ignore
#: unexpected biases (typically from GPTQ models)", whose checkpoints carry a zero bias for every linear; Qwen3-MoE's
#: and LFM2-MoE's loaders add "_bias" for quantized experts' checkpoints).
_BIASES = (".bias", "_bias")


@contextmanager
def _refusing_biases(current: list[Any], dropped: list[str]) -> Iterator[None]:
    """Within (one reload): a synced bias the engine's model has no parameter for, which vLLM 0.32 drops without a
    word, raises naming it unless it is all zeros (what vLLM's rule is for, GPTQ checkpoints' zero biases: dropping
    a zero bias changes nothing; its vLLM name is added to `dropped`). A nonzero one is a mismatched layout or a
    converter's wrong name: the engine served without it, under the new version. vLLM drops them in two places:
    `AutoWeightsLoader._can_ignore_unexpected` (a bias of any module: o_proj, down_proj, ...; `current` is [the
    tensor vLLM's loader holds then]: it consumes a sync's tensors one at a time, as `_naming` relies on) and the
    fused layers' own `load_weights` (vllm/model_executor/layers/linear.py, MergedColumnParallelLinear and
    QKVParallelLinear: `if param is None and name == "bias": continue`, q/k/v and gate/up biases). Other names vLLM
    drops by a model's own rule (prefixes, quantization scales) are left to it. Models whose hand-written loader
    skips biases itself (DeepSeek-V2/V3, GLM-4-MoE-Lite, MiniCPM, Falcon, ...: `name not in params_dict`) are not
    covered."""
    try:
        from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
        from vllm.model_executor.models.utils import AutoWeightsLoader
    except ImportError:  # another vLLM version
        yield
        return

    def check(qualname: str, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and not torch.count_nonzero(tensor):
            dropped.append(qualname)
            return
        raise ValueError(
            f"the engine's model has no parameter {qualname!r} for this nonzero bias (vLLM drops biases its model "
            "lacks, meant for GPTQ checkpoints' zero ones): the trainer's layout or weight names do not match it"
        )

    ignoring = AutoWeightsLoader.__dict__.get("_can_ignore_unexpected")

    def strict(loader: Any, qualname: str) -> bool:
        ignore = ignoring(loader, qualname)
        if ignore and qualname.endswith(_BIASES):
            if not any(qualname.startswith(p) for p in loader.ignore_unexpected_prefixes):  # the model's own rule
                check(qualname, current[0] if current else None)
        return ignore

    def screening(load: Any) -> Any:
        def load_weights(layer: torch.nn.Module, weights: Any) -> Any:
            def screened() -> Iterator[tuple[str, Any]]:
                for name, tensor in weights:
                    if name == "bias" and getattr(layer, "bias", None) is None:
                        check(f"{getattr(layer, 'prefix', '?')}.bias", tensor)
                        continue
                    yield name, tensor

            return load(layer, screened())

        return load_weights

    patches: list[tuple[type, str, Any]] = []
    if ignoring is not None:
        patches.append((AutoWeightsLoader, "_can_ignore_unexpected", strict))
    for cls in (MergedColumnParallelLinear, QKVParallelLinear):
        if "load_weights" in cls.__dict__:
            patches.append((cls, "load_weights", screening(cls.__dict__["load_weights"])))
    if len(patches) < 3:
        log.warning("vLLM's loaders are not 0.32's: some biases its model lacks may be dropped unchecked")
    originals = [(cls, name, cls.__dict__[name]) for cls, name, _ in patches]
    for cls, name, fn in patches:
        setattr(cls, name, fn)
    try:
        yield
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)


def _naming(exc: BaseException, loading: list[Any], count: int) -> BaseException:
    """The error of a reload that failed while vLLM loaded one tensor, naming it: vLLM's loaders refuse a wrong
    shape with a bare `assert` (the sync failed with "AssertionError()", through collective_rpc with "Worker failed
    with error ''"), leaving the trainer no clue which of its tensors. `exc` itself for any other failure."""
    if not loading or not isinstance(exc, Exception):
        return exc
    name, shape, dtype = loading
    return RuntimeError(
        f"vLLM's weight loader failed on {name!r} (shape {shape}, {dtype}), tensor {count} of this sync (a shape "
        f"or name the engine's model does not have?): {type(exc).__name__}: {exc}"
    )


class RollWorkerExtension:
    """Methods vLLM adds to its worker (names prefixed `roll_`: vLLM refuses an extension that shadows its own)."""

    def roll_load_weights(self, address: str, authkey_hex: str, keep: bool = True) -> dict[str, int]:
        """Reload the model's weights from the buckets one sync streams through `address`: {"received": tensors,
        "restored": tensors put back (0 unless the sender aborted)}. A sync that fails here is undone and raises.

        One `reload_weights` call spans every bucket of the sync (vLLM's layer-wise reload processes a layer, e.g.
        repacks its fused q/k/v weight on CPU, once all its parts have arrived, whichever bucket carried them).
        `keep`: keep the old values of what the sync overwrites (module docstring); False where they are not worth
        restoring (discarded by a level-2 sleep)."""
        count = 0
        names: set[str] = set()
        stream = receive_buckets(address, bytes.fromhex(authkey_hex))
        mixed = self._roll_mixed()
        undo = _LayerUndo(keep=keep and not mixed)  # a mix is not worth keeping (module docstring)
        undoable = False
        loading: list[Any] = []  # the tensor vLLM's loader holds now (name, shape, dtype); empty between tensors
        current: list[Any] = []  # ... and that tensor itself (`_refusing_biases`)
        dropped: list[str] = []  # zero biases the engine's model has no parameter for (`_refusing_biases`)

        def counted() -> Any:
            nonlocal count
            for item in stream:
                count += 1
                names.add(item[0])
                loading[:] = [item[0], tuple(item[1].shape), str(item[1].dtype).removeprefix("torch.")]
                current[:] = [item[1]]
                yield item
                loading.clear()  # the loader asks for the next one: done with this tensor (and its layer)
                current.clear()

        try:
            with _saving(undo) as undoable, _refusing_biases(current, dropped):
                try:
                    self.reload_weights(weights_iterator=counted())  # type: ignore[attr-defined]
                    for _ in stream:  # what the loader left unread: acknowledge it so the sender finishes the sync
                        count += 1
                except BaseException:
                    self._roll_drop_reload()
                    raise
        except SyncAborted:
            return {"received": count, "restored": self._roll_undo(undo, undoable, "the sender aborted it")}
        except BaseException as exc:
            error = _naming(exc, loading, count)
            self._roll_undo(undo, undoable, repr(error))
            if error is exc:
                raise
            raise error from exc
        finally:
            stream.close()
        if dropped:  # harmless (zero), but the trainer sends weights the engine does not have: say which
            log.info("a weight sync sent %d zero bias(es) the engine's model lacks: %s", len(dropped), dropped[:8])
        self._roll_refresh_tied_heads()
        self._roll_repack_cpu_experts()
        if undoable:
            mixed.rewritten(undo.loaded)
            self._roll_reached(names, undo)
            if undo.partial:  # vLLM filled the parts not sent from uninitialised memory (module docstring)
                layers = self._roll_weight_layers()
                log.warning(
                    "a weight sync brought only some parts of %d fused layer(s): %s",
                    len(undo.partial),
                    sorted(layers.get(k, "?") for k in undo.partial)[:8],
                )
            if mixed.discarded:  # a partial sync after a level-2 sleep: say which layers it left out
                left = self._roll_mixed_names()
                log.warning("discarded by %s: %d layer(s) still to be rewritten: %s", mixed.since, len(left), left[:8])
        else:  # the writes could not be followed: a sync that completed is taken to have rewritten them all
            mixed.clear()
        return {"received": count, "restored": 0}

    def roll_discard_weights(self) -> dict[str, Any]:
        """A level-2 sleep discarded the weights: every layer a sync writes counts as unwritten until syncs that
        complete have written it (module docstring). Returns how many layers that is and a few names, as
        `roll_mixed_layers`."""
        unreachable = self._roll_reach()[1]
        layers = [k for k in self._roll_weight_layers() if k not in unreachable]
        mixed = self._roll_mixed()
        mixed.discard(layers)
        return {"left": len(mixed.keys), "names": self._roll_mixed_names()[:EXAMPLES]}

    def _roll_reach(self) -> tuple[set[str], set[int]]:
        """(every name a completed sync sent here, the layers no full sync writes: module docstring)."""
        state = vars(self)
        if "_roll_reach_state" not in state:
            state["_roll_reach_state"] = (set(), set())
        return state["_roll_reach_state"]

    def _roll_reached(self, names: set[str], undo: _LayerUndo) -> None:
        """After a sync that completed, having sent `names` and written what `undo` followed: a full one (every name
        any sync sent before) lifts the discarded layers it wrote no part of, which no sync writes (module
        docstring); a layer any sync writes is reachable."""
        sent, unreachable = self._roll_reach()
        full = names >= sent
        sent |= names
        written = undo.loaded | undo.partial
        unreachable -= written
        mixed = self._roll_mixed()
        if not (full and mixed.discarded):
            return
        never = {k for k in mixed.keys if k not in written and isinstance(k, int)}
        if never:
            layers = self._roll_weight_layers()
            log.warning(
                "a full weight sync wrote nothing of %d layer(s) discarded by %s (vLLM parameters no trainer tensor "
                "maps to): not waited for, now or after later discards: %s",
                len(never),
                mixed.since,
                sorted(layers.get(k, "?") for k in never)[:8],
            )
            unreachable |= never
            mixed.rewritten(never)

    def _roll_weight_layers(self) -> dict[int, str]:
        """{id(): name} of every layer a full sync writes: each module holding a parameter of its own that vLLM's
        reload loads (not its bookkeeping tensors: SKIP_LOAD_TENSORS), a parameter shared with an earlier module (a
        tied LM head's) counted there. Matched `_LayerUndo.loaded` after a full sync of dense, tied-embedding,
        Qwen3-MoE and fp32-router MoE models on vLLM-CPU 0.32."""
        try:
            from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS as skip
        except ImportError:  # another vLLM version: the names of 0.32's
            skip = {"_expert_map", "expert_mask", "expert_global_to_physical", "expert_physical_to_global"}
            skip |= {"expert_local_to_global", "e_score_correction_bias"}
        layers: dict[int, str] = {}
        owned: set[int] = set()
        for name, module in self.model_runner.model.named_modules():  # type: ignore[attr-defined]
            params = [p for k, p in module._parameters.items() if p is not None and k not in skip]
            if any(id(p) not in owned for p in params):
                layers[id(module)] = name
            owned.update(id(p) for p in params)
        return layers

    def _roll_mixed(self) -> MixedWeights:
        """The layers this worker holds as a mix of two weight versions (module docstring)."""
        state = vars(self)
        if "_roll_mixed_weights" not in state:  # vLLM builds the worker: no __init__ of ours runs
            state["_roll_mixed_weights"] = MixedWeights()
        return state["_roll_mixed_weights"]

    def roll_mixed_layers(self) -> dict[str, Any]:
        """How many layers a failed sync that could not be undone (or a level-2 sleep) left mixed here ("left"; 0:
        the weights are whole), and a few of their names ("names")."""
        return {"left": len(self._roll_mixed().keys), "names": self._roll_mixed_names()[:EXAMPLES]}

    def _roll_mixed_names(self) -> list[str]:
        """The names of the layers still mixed or discarded, sorted."""
        layers = self._roll_weight_layers()
        return sorted(layers.get(k, str(k)) if isinstance(k, int) else str(k) for k in self._roll_mixed().keys)

    def _roll_drop_reload(self) -> None:
        """End a reload that stopped part way: every layer still waiting for weights gets its own tensors back
        (vLLM's reload had swapped them for placeholders on the meta device), unprocessed."""
        from vllm.model_executor.model_loader.reload import layerwise

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        for layer in model.modules():
            info = layerwise.get_layerwise_info(layer)
            if info.can_load():  # initialised for this reload and not processed
                if info.kernel_tensors is not None:
                    layerwise._place_kernel_tensors(layer, info)
                info.reset()
        if hasattr(model, "_original_do_torchao_reload"):
            model._do_torchao_reload = model._original_do_torchao_reload
        layerwise.LOADING_LAYERS.clear()

    def _roll_undo(self, undo: _LayerUndo, undoable: bool, why: str) -> int:
        """Give the layers a failed reload wrote their old state; tensors restored (-1: none were kept, `keep`).
        Raises where the old state is lost: the caller must not take the worker's weights for the old ones."""
        mixed = self._roll_mixed()
        if mixed:  # no copies were kept (a mix); what this sync wrote is part of the mix now
            mixed.add(undo.loaded | undo.partial if undoable else ["untracked"], why)
            log.error("weight sync failed (%s) into mixed weights: %d layer(s) mixed", why, len(mixed.keys))
            return -1
        if not undo.keep:
            log.warning("weight sync failed (%s); the old weights were not kept (discarded before it)", why)
            return -1
        written = len(undo._seen)
        try:
            if not undoable:
                raise RuntimeError("vLLM's reload could not be followed")
            restored = undo.undo()
        except Exception as exc:
            # Every layer it wrote, restored or not: the next sync rewrites them all the same.
            mixed.add(undo.loaded | undo.partial | undo._seen if undoable else ["untracked"], why)
            raise RuntimeError(
                f"a weight sync failed part way ({why}) and could not be undone ({exc!r}): the worker holds a mix "
                "of old and new weights"
            ) from exc
        log.warning("weight sync failed (%s): %d layer(s) written, %d tensor(s) restored", why, written, restored)
        return restored

    def _roll_repack_cpu_experts(self) -> None:
        """Repack MoE experts' weights for vLLM-CPU's grouped GEMM after a reload.

        vLLM 0.32 prepacks `w13_weight`/`w2_weight` at load (`fused_experts.process_weights_after_loading`) but skips
        that step on a weight update (`UnquantizedFusedMoEMethod`: on a GPU, CUDA graphs hold the parameters'
        addresses), so on CPU the reloaded experts held the trainer's plain layout while the kernel read them as
        packed: after any sync, even of unchanged weights, a Qwen3-MoE generated other tokens. CPU only: the GPU
        kernels read the layout the update writes."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        for module in self.model_runner.model.modules():  # type: ignore[attr-defined]
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None and hasattr(module, "w13_weight"):
                experts.process_weights_after_loading(module)

    def _roll_refresh_tied_heads(self) -> None:
        """Rebuild the kernels of an LM head tied to the input embeddings from the weights just loaded.

        A tied head receives nothing in a sync (the trainer sends the shared tensor once, under the embedding's
        name, and vLLM's loaders skip `lm_head` when tied): the reload puts the head's shared weight back, now
        holding the new values, but never re-runs its post-load processing, and on CPU that processing packed a
        separate copy of the weight for the head's product (vLLM 0.32 `dispatch_cpu_unquantized_gemm`). Without
        this the head samples from the weights the engine was loaded with (measured: log-prob gap 1.9)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        model = self.model_runner.model  # type: ignore[attr-defined]
        modules = list(model.modules())
        embeddings = {
            m.weight.data_ptr()
            for m in modules
            if type(m) is VocabParallelEmbedding and getattr(m, "weight", None) is not None
        }
        for head in modules:
            if isinstance(head, ParallelLMHead) and head.weight.numel() and head.weight.data_ptr() in embeddings:
                head.quant_method.process_weights_after_loading(head)

    def roll_weight_dtypes(self) -> dict[str, str]:
        """Parameters kept wider than the model's dtype, by name (vLLM keeps a DeepSeek-V3 or GLM-4.5 router and its
        expert bias in fp32 under bf16): the trainer sends those in that dtype (roll_core.cluster.weight_sync)."""
        runner = self.model_runner  # type: ignore[attr-defined]
        size = runner.model_config.dtype.itemsize
        return {
            name: str(p.dtype).removeprefix("torch.")
            for name, p in runner.model.named_parameters()
            if p.is_floating_point() and p.element_size() > size
        }

    def roll_model_bytes(self) -> int:
        """Bytes of this worker's model as vLLM measured it at load (repacked CPU weights included)."""
        runner = self.model_runner  # type: ignore[attr-defined]
        measured = int(getattr(runner, "model_memory_usage", 0) or 0)
        if measured:
            return measured
        return sum(p.numel() * p.element_size() for p in runner.model.parameters())

    def roll_moe_layers(self) -> list[int]:
        """Decoder-layer numbers of the model's MoE layers, ascending: the columns of vLLM's routed-experts rows
        that hold routing (a dense layer's column is never written; roll_engines.infer._vllm_routing)."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCaptureSource

        model = self.model_runner.model  # type: ignore[attr-defined]
        # The modules vLLM binds its capturer to (bind_routed_experts_capturer), by the same tests.
        sources = (MoERunner, RoutedExpertsCaptureSource)
        return sorted({int(m.layer_id) for m in model.modules() if isinstance(m, sources)})
