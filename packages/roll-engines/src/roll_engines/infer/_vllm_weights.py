"""Weight updates of the `vllm` inference engine (roll_engines.infer.vllm): the receiving side of a sync.

`collective_rpc` serialises its arguments (msgpack across processes), so tensors never go through it.
`update_weights` stages each bucket, cast to the engine's dtype (parameters the model keeps wider, e.g. a router
in fp32, in theirs: `weight_dtypes`), in one reusable buffer (host shared memory on
CPU, a CUDA IPC-shared device buffer on GPUs: roll_engines.infer._bucket_channel) and the workers pull it from
there inside one `collective_rpc("roll_load_weights")` (roll_engines.infer._vllm_worker, vLLM's
`worker_extension_cls`) that feeds vLLM's layer-wise `reload_weights`: a bucket may split a fused group (q/k/v,
gate/up), the reload processes each layer once all its parts arrived. The RPC starts with the first bucket of
a sync (the driver thread stays free for control calls until then); `finish_weight_update` ends the stream,
frees the staging buffer and resets the prefix cache (cached prefixes hold the old weights' keys) and, for a
multimodal model, the encoder cache (pictures' features: vLLM's reload clears the workers' copies but not the
scheduler's record of them, so a picture seen before the sync failed its next request with "Encoder cache miss").

A weight sync is all or nothing, as the hf engine's. One that fails on the sending side ends with
`abort_weight_update(reason)` (roll_core.cluster.weight_sync, through InferWorker): the stream is aborted, every
worker puts back the old values of what the sync had written (roll_engines.infer._vllm_worker: host copies of the
engine's tensors it overwrote, kept only during the sync), the caches are reset as a finish resets them, and the
engine serves on with its weight version unchanged. One that fails in the workers (a rejected weight) is undone
there the same way and raises from `update_weights` or `finish_weight_update`, which keeps the version. A sync left
open (its caller failed before finishing or aborting) is aborted by the next `begin_weight_update`. With adapter sync
an aborted sync loads no adapter.

A level-2 sleep discards the weights (on a GPU; on CPU vLLM keeps them and the engine refuses all the same): every
worker then counts every layer a full sync writes as discarded (`roll_discard_weights`), and the engine refuses to
serve (`mixed_error(..., discarded=True)`) until syncs that complete have rewritten all of them: a changed-only
sync leaves the layers it did not send discarded (a fused layer counts only once all its parts were sent), and one
that fails lifts nothing; layers no full sync writes (vLLM parameters without a trainer counterpart) are not waited
for (roll_engines.infer._vllm_worker), and the error counts what is left and names a few layers. Nothing of
discarded weights is kept for an undo (nothing worth restoring): a sync into them that fails leaves what it wrote.

A worker whose undo failed holds a mix of two weight versions. After every merged-weight sync that reached the
workers (finished, aborted, or left open and aborted by the next begin) the engine asks them
(`roll_mixed_layers`); while any layer is mixed it refuses to serve: running requests fail and every new one
raises `mixed_error`, naming the sync that failed, until syncs that complete have rewritten those layers (a full
sync does).

`VLLMWeightUpdates` is a mixin of `VLLMInferEngine`: it uses the engine's driver thread (`_control`,
`_submit_control`), its `llm`/`engine`, the staging channel's receivers, the adapter collector (`_adapters`, None
unless infer_engine.lora_sync=adapter) and the weight version it reports (`_version`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
from torch import Tensor

from roll_engines.infer._bucket_channel import BucketSender, ChannelError
from roll_engines.infer._sync_undo import EXAMPLES, mixed_error

log = logging.getLogger(__name__)


class VLLMWeightUpdates:
    """begin / update / finish of a weight sync on a vLLM engine (full weights or the LoRA adapter alone)."""

    _adapters: Any
    _sender: BucketSender | None
    _loading: Any
    #: A level-2 sleep discarded the weights and completed syncs have not rewritten every layer since: requests
    #: are refused (`_mixed` says so), and a sync keeps no copies.
    _discarded: bool = False
    #: Since which failed sync (or sleep) the workers hold a mix of two weight versions, or discarded layers (None:
    #: whole), and how many layers.
    _mixed: str | None = None
    _mixed_layers: int = 0
    _mixed_names: tuple[str, ...] = ()  # a few of those layers (the workers' names), for the error

    def begin_weight_update(self) -> None:
        # A sync that never finished (its caller failed): undone before anything else, since its workers' call
        # holds the driver thread until its stream ends.
        failed = self._end_stream("a new sync began before it finished")

        def do() -> None:  # on the driver thread: no step is in progress once this runs
            self._paused = True
            if failed is not None:
                self._check_mixed(failed)

        self._control(do)
        if self._adapters is not None:  # the adapter alone: collected here, loaded by vLLM at the finish
            self._adapters.begin()
            return
        device = "cpu" if self.on_cpu else f"cuda:{torch.cuda.current_device()}"
        self._sender = BucketSender(self._receivers, device, self.dtype, alive=self._loading_alive, wide=self._wide)
        self._loading = None

    def _loading_alive(self) -> bool:
        if self._loading is not None and self._loading.done():
            self._loading.result()  # raises the workers' error
            return False  # returned before the sync ended
        return True

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> int:
        if self._adapters is not None:
            return self._adapters.receive(named_tensors)
        if self._sender is None:
            raise RuntimeError(f"{self.name}: update_weights outside begin_weight_update/finish_weight_update")
        named = list(named_tensors)
        if named and self._loading is None:  # the workers start pulling with the first bucket of the sync
            sender, keep = self._sender, not self._discarded
            self._loading = self._submit_control(
                lambda: self.llm.collective_rpc("roll_load_weights", args=(sender.address, sender.authkey.hex(), keep))
            )
        try:
            return self._sender.send(named)
        except (ChannelError, OSError):  # a worker closed the channel: its own failure is the cause
            _raise_workers_error(self._loading)
            raise

    def finish_weight_update(self) -> int:
        if self._adapters is not None:
            return self._finish_adapter_update()
        sender, loading, self._sender, self._loading = self._sender, self._loading, None, None
        loaded, error = False, "it could not finish"
        try:
            if sender is not None:
                try:
                    sender.close(ok=True)
                except (ChannelError, OSError):  # a worker whose reload failed closed the channel: its error first
                    _raise_workers_error(loading)
                    raise
            if loading is not None:
                loading.result()
            loaded = True
        except Exception as exc:
            error = repr(exc)
            raise
        finally:
            if sender is not None:
                self.last_sync = {
                    "bytes": sender.bytes,
                    "buckets": sender.buckets,
                    "dtypes": sorted(sender.dtypes),
                    "peak_buffer_bytes": sender.peak_buffer_bytes,
                }

            def do() -> None:
                try:
                    if loading is not None:  # before the version moves: a mix is named by the sync that failed
                        self._check_mixed(None if loaded else error)
                    self._reset_prefix_cache()
                    if self._multimodal:  # pictures' features (module docstring); no request runs now
                        self.engine.reset_encoder_cache()
                finally:
                    # On the driver thread, before it admits the requests queued behind this job: they sample
                    # from the new weights and must say so (set after `_control`, they reported one version old).
                    if loaded:
                        self._version += 1
                    self._paused = False

            self._control(do)
        return self._version

    def abort_weight_update(self, reason: str = "the caller aborted it") -> int:
        """End a sync that failed outside this engine (a sender that died between buckets, a broken transfer):
        every worker puts back what it wrote, the caches are reset and generation resumes on the old weights.
        Returns the weight version, unchanged (module docstring)."""
        if self._adapters is not None:
            self._adapters.discard()  # the adapter collected so far is never loaded
        failed = None
        try:
            failed = self._end_stream(reason)
        finally:

            def do() -> None:
                try:
                    if failed is not None:
                        self._check_mixed(failed)
                    if self._adapters is None:  # as a finish does: a worker whose undo failed changed its weights
                        self._reset_prefix_cache()
                        if self._multimodal:
                            self.engine.reset_encoder_cache()
                finally:
                    self._paused = False

            self._control(do)
        return self._version

    def _end_stream(self, reason: str) -> str | None:
        """Abort the merged-weight sync in progress, if any: the workers undo what it wrote (their call returns
        once they have). A worker's failure is logged, not raised: this runs where the sync already failed.
        Returns why it failed where it reached the workers (then `_check_mixed` is due), else None."""
        sender, loading, self._sender, self._loading = self._sender, self._loading, None, None
        if sender is not None:
            sender.close(ok=False)
        if loading is None:  # no bucket reached the workers: nothing was written
            return None
        try:
            results = loading.result()
        except Exception as exc:  # the workers' own failure: undone there, unless the error says it could not be
            log.exception("%s: a weight sync failed in vLLM's workers (then aborted: %s)", self.name, reason)
            return f"{reason}; in vLLM's workers: {exc!r}"
        restored = [r.get("restored", 0) for r in results]
        if any(n < 0 for n in restored):
            log.error("%s: weight sync aborted (%s) without copies to restore", self.name, reason)
            return reason
        log.warning(
            "%s: weight sync aborted (%s) after %s tensor(s) per worker; %s restored, version %d kept",
            self.name,
            reason,
            [r.get("received", 0) for r in results],
            restored,
            self._version,
        )
        return reason

    def _check_mixed(self, failure: str | None) -> None:
        """(driver thread, after a merged-weight sync reached the workers; `failure`: why it failed, None if it
        completed) Whether any worker holds a mix of two versions: serving stops, or resumes (module docstring)."""
        try:
            layers = self._count_mixed(self.llm.collective_rpc("roll_mixed_layers"))
        except Exception as exc:  # the workers cannot say: their weights are not known to be whole
            log.exception("%s: could not ask vLLM's workers whether their weights are whole", self.name)
            layers, failure = max(self._mixed_layers, 1), f"{failure or 'a weight sync'} (then asking: {exc!r})"
            self._mixed_layers = layers
        if not layers:
            if self._mixed is not None:
                log.warning("%s: weights whole again since %s: serving resumes", self.name, self._mixed)
            self._mixed, self._mixed_layers, self._mixed_names, self._discarded = None, 0, (), False
            return
        if self._mixed is None:
            self._mixed = (
                f"the weight sync to version {self._version + 1} failed part way ({failure}) and could not be undone"
            )
        error = self._mixed_error()
        log.error("%s", error)
        self._fail_pending(error, abort=True)  # what they sampled from here on would come from the mix

    def _discard_weights(self) -> None:
        """(driver thread) A level-2 sleep discarded the weights: every worker counts every layer as discarded, and
        serving stops until completed syncs have rewritten them all (module docstring)."""
        self._discarded, self._mixed = True, "sleep(level=2)"
        try:
            self._count_mixed(self.llm.collective_rpc("roll_discard_weights"))
        except Exception:  # the workers' count is unknown: still refused, until a completed sync's count says
            log.exception("%s: could not mark the workers' weights discarded", self.name)
            self._mixed_layers, self._mixed_names = 0, ()
        self._fail_pending(self._mixed_error(), abort=True)  # what they sampled from here on would be garbage

    def _count_mixed(self, results: list[dict[str, Any]]) -> int:
        """Keep the workers' answers (`roll_mixed_layers`): layers still mixed or discarded, summed over the
        workers, and a few of their names; returns the count."""
        self._mixed_layers = sum(int(r["left"]) for r in results)
        self._mixed_names = tuple(sorted({str(n) for r in results for n in r["names"]}))[:EXAMPLES]
        return self._mixed_layers

    def _mixed_error(self) -> RuntimeError:
        return mixed_error(
            self.name, self._mixed, self._mixed_layers, discarded=self._discarded, examples=self._mixed_names
        )

    def _reset_prefix_cache(self) -> None:
        """Drop the prefix cache's blocks after a weight change (driver thread). vLLM refuses while any running
        request holds blocks (0.32: it logs a warning and returns False), and a cache kept across the update would
        serve old-weight keys and values to every later prompt sharing a cached prefix: the running requests are
        then preempted, their keys and values recomputed under the new weights when they resume (tokens kept)."""
        if not self.llm.reset_prefix_cache():
            self.llm.reset_prefix_cache(reset_running_requests=True)

    def _finish_adapter_update(self) -> int:
        """Load the synced adapter as a new LoRA adapter (id = the new weight version) on the driver thread; new
        requests use it, superseded adapters go once unused. A sync that brought no adapter keeps the current one.

        An id is never given to vLLM for two adapters: vLLM keeps the adapter it holds under an id and does not read
        the folder again when asked to add that id (vllm/lora/worker_manager.py `add_adapter`), so a second adapter
        under it would be served stale. Ids are versions, which move once vLLM holds the adapter, even where what
        follows fails (retiring, the prefix cache); an `add_lora` that fails removes the id from vLLM (a worker may
        hold it while another failed), since the next sync reuses it."""
        adapters, new_id = self._adapters, self._version + 1
        assert adapters is not None

        def add_lora(request: Any) -> object:
            try:
                return self.engine.add_lora(request)
            except BaseException:
                try:
                    self.engine.remove_lora(request.lora_int_id)
                except Exception:  # the add's own error is the one to raise
                    log.exception("%s: could not remove adapter %d after its load failed", self.name, new_id)
                raise

        def do() -> None:
            loaded = False
            try:
                loaded = adapters.load(new_id, add_lora)
                if loaded:
                    self._retire_adapters()
                self._reset_prefix_cache()
                # Before the driver admits the requests queued behind this job (they run on the new adapter).
                self._version = new_id
            finally:
                if loaded:  # new requests run on it (`adapters.current`): its version, its id used up
                    self._version = new_id
                self._paused = False

        self._control(do)
        self.last_sync = dict(adapters.last)
        return self._version


def _raise_workers_error(loading: Future | None, wait_s: float = 60.0) -> None:
    """Raise the workers' error where their reload failed (its call ends as it fails): the channel's own error
    ("Broken pipe", "closed its connection") hid which weight they rejected and why. Returns if they did not."""
    if loading is None:
        return
    try:
        loading.result(timeout=wait_s)
    except FutureTimeout:
        return
