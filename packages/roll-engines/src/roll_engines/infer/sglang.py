"""The `sglang` inference engine: SGLang's offline `Engine` behind roll's InferEngine contract (GPU only).

Written against SGLang 0.5.x (read: 0.5.6, the release verl pins, and 0.5.23); 0.4 lacks request ids and memory
tags and is refused. There is no CPU build of SGLang, so this adapter's tests are marked `cuda` and run in
`nox -s device -- cuda`; on CPU machines it imports lazily and its config composes.

How the contract maps:
- One driver thread owns SGLang's event loop (`engine.loop`). Every request is an `async_generate` task on that
  loop; between short `run_until_complete` waits the driver takes new requests, aborts and control calls (weight
  updates, sleep), so SGLang's synchronous methods always run on a loop that is not already running.
- Requests are sent with n=1 (the prompt repeated per sample, as verl does): SGLang replaces caller request ids
  when n > 1, which would make abort impossible. Abort matches ids by prefix, so roll's ids get a unique suffix.
  A request id still running is refused (ValueError on its future), as the hf and vllm engines do: `abort` names
  requests by it, and the first of two to finish dropped the shared entry. The batch API's rows go by random ids
  (`generate-<uuid4>`), never one a caller's running request could hold. SGLang drops an abort for a request its
  tokenizer manager has not registered yet (a task created while the loop was idle); such aborts are sent again
  once it has.
- Log-probs: SGLang reports `log_softmax(logits / T)` before top-k/top-p truncation, which equals roll's contract
  only without truncation; `check_sampling` therefore refuses top_p < 1 and top_k > 0 (use infer_engine=vllm).
  Greedy requests report `log_softmax(logits)`, as the contract says.
- Seeds: SGLang applies `sampling_seed` only in deterministic mode (`deterministic=True`: its pytorch sampler,
  slower); otherwise seeded requests are not reproducible and the engine says so once.
- Weights: `update_weights_from_tensor` per bucket (CUDA tensors copied first: SGLang re-shares what it gets with
  its scheduler processes, and torch refuses to re-share a tensor received from another process, as the cuda_ipc
  transport's are), inside `begin_weight_update()`/`end_weight_update()` on 0.5.21+
  (without them SGLang silently returns failure), then `flush_cache()`. Every (success, message) is checked.
  A sync is NOT all or nothing here: SGLang loads each bucket into the model in its scheduler processes as it
  arrives and offers no way to keep or put back the values it overwrites (the hf and vllm engines do: their
  `abort_weight_update`). This engine has no `abort_weight_update`, so a sync that fails between buckets is
  finished (roll_core.cluster.infer_role.InferWorker.abort_weight_update) and serves the buckets it received,
  mixed with the old weights, under a new version until a later sync succeeds.
- Structured outputs: `SamplingParams.structured` becomes SGLang's `regex` sampling parameter, the regex
  roll_engines.structured derives (a JSON schema through outlines-core), so every engine constrains the same
  language. SGLang applies the grammar's vocabulary mask to the logits before its sampler; that its reported
  log-probs are those of the masked distribution, and that its masks equal outlines-core's (exact in principle with
  `grammar_backend="outlines"`), is NOT verified here (no SGLang on CPU): check on a GPU before trusting ratios.
- Sleep: `release_memory_occupation(tags)` / `resume_memory_occupation(tags)` (needs `enable_memory_saver`);
  level 1 releases the KV cache and CUDA graphs, level 2 the weights too.
- `shutdown()` fails every request and control call not yet resolved (their callers never wait for ever; later
  calls raise at once, `abort` answers False), then kills every child process of this process (SGLang's
  behaviour): host one engine per Ray actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any, ClassVar

from torch import Tensor

from roll_core.interfaces import (
    GenerateOutput,
    Request,
    RequestOutput,
    SamplingParams,
    UnsupportedSamplingError,
)
from roll_core.models import resolve_model_path
from roll_engines.infer._adapters import refuse_adapters
from roll_engines.infer._rows import DriverAborts, RequestRefused, row_requests, run_rows
from roll_engines.infer._stop_checks import check_stops

log = logging.getLogger(__name__)


def _finish_reason(meta: dict[str, Any]) -> str:
    kind = (meta.get("finish_reason") or {}).get("type", "abort")
    return {"stop": "stop", "length": "length"}.get(kind, "abort")


def to_sglang_sampling(params: SamplingParams, max_new_tokens: int) -> dict[str, Any]:
    """roll SamplingParams -> SGLang's sampling_params dict (n is always 1)."""
    out: dict[str, Any] = {
        # Greedy by roll's rule (below GREEDY_TEMPERATURE), where SGLang's own threshold is 1e-6.
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k or -1,
        "max_new_tokens": max_new_tokens,
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": False,
        "n": 1,
    }
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        out["sampling_seed"] = int(params.seed) % (2**31)
    if params.structured is not None:
        from roll_engines.structured import to_regex

        out["regex"] = to_regex(params.structured)
    return out


def to_request_output(request: Request, result: dict[str, Any], version: int, name: str = "sglang") -> RequestOutput:
    """SGLang's result dict -> RequestOutput (token ids and log-probs from `output_token_logprobs`).

    Raises ValueError (RequestRefused, naming the request's id; a `generate` row's is renamed by its prompt and row)
    for generated tokens without their log-probs: made-up behaviour log-probs (0.0 would say probability 1) would
    silently skew every off-policy ratio and the train/infer gap."""
    meta = result.get("meta_info", {})
    pairs = meta.get("output_token_logprobs") or []
    if not pairs and result.get("output_ids"):
        raise RequestRefused.of(
            name,
            request.request_id,
            f"SGLang returned {len(result['output_ids'])} generated tokens without their log-probs "
            "(meta_info.output_token_logprobs is missing); roll needs them as the behaviour log-probs",
        )
    tokens = [int(t) for _, t, *_ in pairs]
    logprobs = [float(lp) for lp, *_ in pairs]
    return RequestOutput(request.request_id, list(request.prompt_ids), tokens, logprobs, _finish_reason(meta), version)


class SGLangInferEngine(DriverAborts):
    """SGLang `Engine` (tensor parallel inside it) implementing roll_core.interfaces.InferEngine."""

    continuous_batching: ClassVar[bool] = True
    #: SamplingParams.structured is honoured (roll_core.interfaces.inference.check_structured).
    structured_outputs: ClassVar[bool] = True

    def __init__(
        self,
        model_path: str,
        *,
        name: str = "sglang",
        dtype: str = "bfloat16",
        device: str = "cuda",
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_new_tokens: int = 128,
        stop: Sequence[str] | None = None,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        mem_fraction_static: float | None = None,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        enable_memory_saver: bool = True,
        disable_cuda_graph: bool = False,
        base_gpu_id: int = 0,
        log_level: str = "error",
        trust_remote_code: bool = False,
        deterministic: bool = False,
        # SGLang's grammar backend for structured outputs (None: SGLang's default, xgrammar); "outlines" makes its
        # masks those the trainer replays (needs the `outlines` package in SGLang's environment).
        grammar_backend: str | None = None,
        # Every engine gets model.attn_implementation (roll_core.interfaces.runtime); this one picks its own
        # attention backend, so the value is not used.
        attn_implementation: str = "sdpa",
        # Every engine gets the runtime's LoRA rank; this one serves no adapters (infer_engine.lora_sync=merged only).
        lora_rank: int = 0,
        # The run's picture size bounds (model.image_*_pixels, set for vision-language models only): this adapter
        # sends no pictures (they are refused per request), so bounds are refused at once.
        image_min_pixels: int | None = None,
        image_max_pixels: int | None = None,
    ) -> None:
        refuse_adapters(name, lora_rank)
        if image_min_pixels is not None or image_max_pixels is not None:
            raise ValueError(
                f"{name} engine: the sglang adapter sends no pictures, so model.image_min_pixels/image_max_pixels "
                "have nothing to bound: use infer_engine=vllm or hf for a vision-language model"
            )
        from roll_engines.config import SGLANG

        SGLANG.require()
        import sglang

        version = tuple(int(x) for x in sglang.__version__.split(".")[:2] if x.isdigit())
        if version < (0, 5):
            raise ImportError(f"infer_engine=sglang needs sglang >= 0.5 (request ids, memory tags); found {version}")
        if device != "cuda" and not device.startswith("cuda"):
            raise ValueError(f"infer_engine=sglang runs on CUDA devices only, not {device!r}")
        base_gpu_id = _base_gpu_id(name, device, base_gpu_id)
        self.name = name
        self.defaults = SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, stop=tuple(stop or ())
        )
        self.check_sampling(self.defaults)
        path = resolve_model_path(model_path)
        from transformers import AutoConfig, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self._pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        limit = config.max_position_embeddings
        self._context = min(max_model_len or limit, limit)
        self._vocab = int(config.get_text_config().vocab_size)  # SGLang's vocab_size: the logits' width
        kwargs: dict[str, Any] = {
            "model_path": path,
            "tp_size": tensor_parallel_size,
            "dtype": dtype,
            # null outside a run config (which resolves it by placement): SGLang's usual disaggregated share.
            "mem_fraction_static": 0.8 if mem_fraction_static is None else mem_fraction_static,
            "random_seed": seed,
            "enable_memory_saver": enable_memory_saver,
            "disable_cuda_graph": disable_cuda_graph,
            "base_gpu_id": base_gpu_id,
            "log_level": log_level,
            "context_length": self._context,
            "trust_remote_code": trust_remote_code,
        }
        if grammar_backend:
            kwargs["grammar_backend"] = grammar_backend
        if deterministic:  # SGLang honours per-request seeds only in deterministic mode (its pytorch sampler)
            kwargs["enable_deterministic_inference"] = True
        self._deterministic = deterministic
        self._warned_seed = False
        if max_num_seqs:  # roll's engine-neutral name (infer_engine.max_num_seqs); null: SGLang's choice
            kwargs["max_running_requests"] = max_num_seqs
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        self._memory_saver = enable_memory_saver
        self._base_used = _device_used()  # what the device held before this engine: memory_bytes subtracts it
        self.engine = sglang.Engine(**kwargs)  # on the caller's (main) thread: 0.5.6 installs signal handlers
        self._version = 0
        self._ids = itertools.count()
        self._jobs: queue.Queue = queue.Queue()
        # task -> (request, its future, SGLang's rid, the weight version it started under)
        self._tasks: dict[asyncio.Task, tuple[Request, Future, str, int]] = {}
        self._rids: dict[str, str] = {}  # roll request id -> SGLang rid of the running request
        # Aborted rids SGLang had not registered yet (it drops such an abort): sent again once it has.
        self._unsent_aborts: set[str] = set()
        self._slept: list[str] = []
        self._paused = False  # between begin_weight_update and finish_weight_update the loop does not run
        self._stopped = False
        # Held while checking `_stopped` and queueing a job, and by `shutdown` while setting it: a job queued after
        # shutdown drained the queue would wait forever (no driver is left to take it).
        self._queueing = threading.Lock()
        self._driver = threading.Thread(target=self._drive, name=f"{name}-driver", daemon=True)
        self._driver.start()

    # ---- facts --------------------------------------------------------------------------------------------
    @property
    def max_context_length(self) -> int:
        return int(self._context)

    @property
    def pad_id(self) -> int:
        return int(self._pad_id)

    def check_sampling(self, params: SamplingParams) -> None:
        """Refused before anything is queued (`submit`, and `generate` before any row): an empty stop string or a
        stop token id outside the vocabulary (roll_engines.infer._stop_checks, as every engine: SGLang itself takes
        them, an empty string ending every response at its first token and such an id never stopping one), a
        structured constraint that does not compile, and top-k/top-p truncation (module docstring: log-probs)."""
        check_stops(getattr(self, "name", "sglang"), params, getattr(self, "_vocab", None))
        if params.structured is not None:  # a bad schema fails here, naming itself, not inside SGLang
            from roll_engines.structured import to_regex

            to_regex(params.structured)
        if params.top_p < 1 or params.top_k > 0:
            raise UnsupportedSamplingError(
                f"infer_engine={self.name if hasattr(self, 'name') else 'sglang'} reports log-probs before "
                "top-k/top-p truncation, so the trainer could not match them: use top_p=1 and top_k=0, or "
                "infer_engine=vllm"
            )

    # ---- the driver thread --------------------------------------------------------------------------------
    def _drive(self) -> None:
        loop = self.engine.loop
        while not self._stopped:
            self._take_jobs(block=not self._tasks or self._paused)
            if self._tasks and not self._paused:
                done, _ = loop.run_until_complete(
                    asyncio.wait(list(self._tasks), timeout=0.02, return_when=asyncio.FIRST_COMPLETED)
                )
                for task in done:
                    self._complete(task)
                self._resend_aborts()

    def _resend_aborts(self) -> None:
        """Send again the aborts SGLang dropped: a request whose task had not yet run (created while the loop was
        idle: the same batch of jobs, or a weight sync pausing it) is not in its tokenizer manager's table, and
        `abort_request` returns without a word; the request then ran to its end."""
        if not self._unsent_aborts:
            return
        manager = self.engine.tokenizer_manager
        live = {rid for _, _, rid, _ in self._tasks.values()}
        for rid in list(self._unsent_aborts):
            if rid not in live:  # ended meanwhile
                self._unsent_aborts.discard(rid)
            elif rid in getattr(manager, "rid_to_state", (rid,)):
                manager.abort_request(rid=rid)
                self._unsent_aborts.discard(rid)

    def _complete(self, task: asyncio.Task) -> None:
        request, fut, _, version = self._tasks.pop(task)
        self._rids.pop(request.request_id, None)
        try:  # the version it started under: the oldest its tokens came from (an update may have run meanwhile)
            fut.set_result(to_request_output(request, task.result(), version, self.name))
        except RequestRefused as exc:  # roll's own (its message names the request id, which may say "context")
            fut.set_exception(exc)
        except ValueError as exc:  # SGLang raises for a prompt it refuses (status 400)
            if "context" in str(exc).lower() or "too long" in str(exc).lower():
                fut.set_result(RequestOutput(request.request_id, request.prompt_ids, [], [], "prompt_too_long"))
            else:
                fut.set_exception(exc)
        except Exception as exc:
            fut.set_exception(exc)

    def _take_jobs(self, block: bool) -> None:
        try:
            job = self._jobs.get(timeout=0.5) if block else self._jobs.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload, fut = job
            try:
                if kind == "request":
                    self._start(payload, fut)
                else:
                    fut.set_result(payload())  # a control call: SGLang's sync API on an idle loop
            except Exception as exc:
                fut.set_exception(exc)
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return

    def _start(self, request: Request, fut: Future) -> None:
        if request.params.seed is not None and not self._deterministic and not self._warned_seed:
            log.warning(
                "%s: SGLang ignores per-request seeds unless started deterministic (infer_engine.deterministic=true, "
                "its slower pytorch sampler): seeded requests are not reproducible",
                self.name,
            )
            self._warned_seed = True
        p = request.params
        room = self._context - len(request.prompt_ids) - 1
        if room < 1:
            fut.set_result(RequestOutput(request.request_id, request.prompt_ids, [], [], "prompt_too_long"))
            return
        if request.request_id in self._rids:  # before SGLang takes it: a second run of a running id is unabortable
            raise ValueError(
                f"{self.name}: request id {request.request_id!r} is already running; a running request's id must be "
                "unique (abort names requests by it)"
            )
        rid = f"roll-{next(self._ids)}-{request.request_id}-"  # abort matches by prefix: make ids prefix-free
        coro = self.engine.async_generate(
            input_ids=list(request.prompt_ids),
            sampling_params=to_sglang_sampling(p, min(p.max_new_tokens, room)),
            return_logprob=True,
            rid=rid,
        )
        task = self.engine.loop.create_task(coro)
        self._tasks[task] = (request, fut, rid, self._version)
        self._rids[request.request_id] = rid

    def _queue_job(self, kind: str, payload: Any, fut: Future) -> None:
        with self._queueing:
            if self._stopped:  # no driver thread would ever take it
                raise RuntimeError(f"{self.name} engine shut down")
            self._jobs.put((kind, payload, fut))

    def _control(self, fn: Callable[[], Any]) -> Any:
        """`fn` on the driver thread; RuntimeError after `shutdown` (at once, or when shutdown fails the job)."""
        fut: Future = Future()
        self._queue_job("control", fn, fut)
        return fut.result()

    # ---- batch and request API ----------------------------------------------------------------------------
    def submit(self, request: Request) -> Future[RequestOutput]:
        """Queue one request; RuntimeError after `shutdown`."""
        self.check_sampling(request.params)
        _refuse_pictures(self.name, [request.mm], f"request {request.request_id!r}")
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
        """n samples per prompt (rows grouped per prompt; row i seeded by (params.seed, first_row + i)). When a row
        fails (or the wait is interrupted), the batch's other rows are aborted before the error is raised: none keeps
        running in SGLang for nobody (as the hf and vllm engines do)."""
        _refuse_pictures(self.name, mm or [], "a prompt")
        t0 = time.perf_counter()
        params = params or self.defaults
        self.check_sampling(params)  # before any row starts: a refusal part way would leave the first rows running
        requests = row_requests(prompts, params, n, first_row)
        # (a shutdown meanwhile is no abort failure: `_abort_rows` tells it from an abort that failed)
        outputs = run_rows(requests, self.submit, self._abort_rows, self.name, n)  # errors name prompt and row
        return GenerateOutput.from_requests(outputs, self.pad_id, time.perf_counter() - t0)

    def _abort_now(self, request_id: str) -> bool:
        """On the driver thread: abort `request_id` in SGLang; False when it is not running."""
        rid = self._rids.get(request_id)
        if rid is None:
            return False
        manager = self.engine.tokenizer_manager
        manager.abort_request(rid=rid)
        if rid not in getattr(manager, "rid_to_state", (rid,)):  # not registered yet: the abort was dropped
            self._unsent_aborts.add(rid)
        return True

    # ---- weights ------------------------------------------------------------------------------------------
    def begin_weight_update(self) -> None:
        def do() -> None:
            self._paused = True
            if hasattr(self.engine, "begin_weight_update"):  # sglang >= 0.5.21
                _check(self.engine.begin_weight_update(), f"{self.name}: begin_weight_update")

        self._control(do)

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> int:
        # SGLang re-shares what it is given with its scheduler processes (CUDA IPC), and torch refuses to share a
        # CUDA tensor this process received from another one (the cuda_ipc transport's buckets): hand it copies
        # this process owns, one bucket at a time (dropped when the call returns).
        named = [(k, t.clone() if t.is_cuda else t) for k, t in named_tensors]

        def do() -> Any:
            return self.engine.update_weights_from_tensor(named_tensors=named, flush_cache=False)

        _check(self._control(do), f"{self.name}: update_weights_from_tensor")
        return sum(t.numel() * t.element_size() for _, t in named)

    def finish_weight_update(self) -> int:
        def do() -> None:
            try:
                if hasattr(self.engine, "end_weight_update"):
                    _check(self.engine.end_weight_update(), f"{self.name}: end_weight_update")
                self.engine.flush_cache()
            finally:
                self._paused = False

        self._control(do)
        self._version += 1
        return self._version

    # ---- memory -------------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        if not self._memory_saver:
            raise RuntimeError(f"{self.name}: sleep needs enable_memory_saver=true")
        tags = ["kv_cache", "cuda_graph"] if level == 1 else ["kv_cache", "cuda_graph", "weights"]
        self._control(lambda: self.engine.release_memory_occupation(tags=tags))
        self._slept = tags

    def wake_up(self) -> None:
        if self._slept:
            tags, self._slept = self._slept, []
            self._control(lambda: self.engine.resume_memory_occupation(tags=tags))

    def memory_bytes(self) -> dict[str, int]:
        """Device memory this engine added on its first GPU since it started (SGLang's scheduler processes hold it,
        not this one): measured, not assumed, so that sleep's release is observed; weights and KV cache pooled."""
        return {"weights": max(0, _device_used() - self._base_used), "kv_cache": 0}

    def shutdown(self) -> None:
        """Stop the driver thread and fail every request and control call it has not resolved (running or queued):
        their callers get an error, never wait forever; later calls raise at once (`abort`: False)."""
        with self._queueing:  # no job is queued after this (`_queue_job`)
            self._stopped = True
            self._jobs.put(("control", lambda: None, Future()))
        self._driver.join(timeout=10)
        futures = [fut for _, fut, _, _ in self._tasks.values()]
        while not self._jobs.empty():  # queued, never taken (the driver has stopped: no other consumer)
            futures.append(self._jobs.get_nowait()[2])
        for fut in futures:
            with contextlib.suppress(InvalidStateError):  # resolved meanwhile by a driver that outlived the join
                fut.set_exception(RuntimeError(f"{self.name} engine shut down"))
        self._tasks.clear()
        self._rids.clear()
        self._unsent_aborts.clear()
        self.engine.shutdown()


def _check(result: Any, what: str) -> None:
    """SGLang's weight calls answer (success, message) instead of raising: a failure must not pass silently."""
    if isinstance(result, tuple) and result and not result[0]:
        raise RuntimeError(f"{what} failed: {result[1] if len(result) > 1 else result}")


def _base_gpu_id(name: str, device: str, base_gpu_id: int) -> int:
    """SGLang's first GPU for a worker on `device`: SGLang counts from `base_gpu_id` (0 by default) whatever device
    the process made current, so a worker on `cuda:N` (N > 0: under Ray's NOSET switch every GPU of the node is
    visible and roll_core.devices resolves the assigned one; or a caller's explicit device) gets N. An explicit
    `base_gpu_id` that names another GPU than `device` is refused: one of the two is wrong."""
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if base_gpu_id not in (0, index):
        raise ValueError(
            f"{name} engine: base_gpu_id={base_gpu_id} but this worker's device is {device}: SGLang "
            "would load on another GPU than the one the worker was given; leave base_gpu_id at 0 (the device decides)"
        )
    if index:
        log.info(
            "%s engine: SGLang told to start at GPU %d (base_gpu_id; the worker's device is %s)", name, index, device
        )
    return index or base_gpu_id


def _device_used() -> int:
    """Bytes in use on the current CUDA device, all processes (0 without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def _refuse_pictures(name: str, mm: Sequence[Any], what: str) -> None:
    """The SGLang adapter sends token ids only: pictures would be dropped silently, so they are refused."""
    if any(m is not None and m.num_images for m in mm):
        raise ValueError(
            f"{name} engine: {what} carries pictures; the sglang adapter does not send them: use infer_engine=hf "
            "(CPU or GPU) or infer_engine=vllm (GPU) for vision-language models"
        )
