"""The `hf` inference engine: any transformers causal LM, continuous batching, exact sampling, on any device.

Implements `roll_core.interfaces.InferEngine` with roll's own decode loop (roll_engines.infer._batcher) instead
of `model.generate`, so that:
- sampling uses exactly roll's `SamplingParams` (a model's `generation_config.json` can carry a repetition penalty
  or other processors that would change the sampled distribution; none is applied);
- the log-prob of each sampled token is gathered per step from the processed distribution, never holding
  (batch, response, vocab) logits;
- stop strings cut the response at the token that completes them, even when that token overhangs the string, and
  one that spans several tokens (as vLLM does: its token ids also end at the completing token; no text is
  returned, so `include_stop_str_in_output` has nothing to cut); each step decodes a tail of
  roll_engines.infer._sampling.stop_window tokens behind the prompt's last tokens (the response's text as vLLM
  reads it: " Human:" stops at a first token "\u2581Human" of a SentencePiece vocabulary);
- requests join and leave the running batch between decode steps (the request API), and the n samples of a
  prompt share one prefill;
- a prompt that is empty or holds an id outside the model's vocabulary is a ValueError to its caller, before it
  joins any batch (its prefill failed every running request); one whose prefill raises all the same (a picture the
  vision tower cannot take) fails alone with a `PrefillError` naming it, its batch going on (_batcher);
- structured outputs (`SamplingParams.structured`, roll_engines.structured): each constrained row's logits are
  masked to the tokens its JSON schema / regex allows before sampling (EOS only where the text is a complete
  match), so the reported log-probs are those of the constrained distribution the trainer replays;
- a request that extends a finished sequence (a conversation's next turn) reuses that sequence's KV and encodes
  only its new tokens (roll_engines.infer._prefix_cache; dropped at every weight update);
- vision-language models (`roll_core.multimodal.is_vision_model`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) load with
  `AutoModelForImageTextToText`; a request's pictures (`Request.mm`, or `generate(..., mm=)`) go in at its prefill
  with explicit 3D rotary positions, and equal ids with other pictures never share a prefill or a cached prefix
  (roll_engines.infer._vision). Placeholder / feature mismatches are a ValueError to the caller.
- `emulate_fp8=True`: the numerics of vLLM's online FP8 rollout (per-tensor e4m3 weights and inputs of the linear
  layers, roll_engines.infer._fp8_emulation), re-applied after every weight sync, to measure the train/infer gap and
  the corrections on a CPU; not faster.
- `return_routing=True` (MoE models): each output carries the top-k experts every MoE layer chose at every prompt
  and generated position (`RequestOutput.routed_experts`, roll_engines.infer._routing), for the trainer's
  routed-expert replay; the prefix cache is off then.
- on CPU, `use_cpu_kernels` (roll_engines.infer._cpu_kernels) picks the kernels: fp32 linears through oneDNN or
  MKL, prepacked weights (fp32, and bf16 where the CPU computes it natively), the skinny product for a batch's last
  rows, and the decode-step attention layout for bf16/fp16 (roll_engines.infer._decode_attention). Prepacked copies
  count in `memory_bytes()` and go at `sleep(level=2)`.

Threads: the batch API drives decode steps in the caller's thread. The request API starts one background thread
on first use; both step under one lock, so a `generate` call and requests can share a batch. A weight sync pauses
stepping between `begin_weight_update` and `finish_weight_update`.

A weight sync is all or nothing. When one fails part way (`update_weights` raises: an unknown name, a wrong shape,
the sender's stream breaking inside a bucket; or the caller ends it with `abort_weight_update`: a sender that died
between buckets), the tensors it wrote get back the old values kept for them (roll_engines.infer._sync_undo: only
what was overwritten, in host memory), `finish_weight_update` keeps the weight version, and requests paused by the
sync resume on the complete old weights. Weights whose undo failed (a mix of two versions, `MixedWeights`) have
nothing to go back to: every new request is refused and running ones fail with an error naming the sync, until a
sync that completes has rewritten every tensor the failed one wrote (a full sync does). Nor have weights discarded
by `sleep(level=2)` (refilled with NaN at `wake_up`): every parameter counts as discarded, and requests are refused
until syncs that complete have rewritten all of them; a partial sync (changed-only) or a failed one does not lift it.
A sync before that `wake_up` is refused (the storage is empty), and a lighter sleep meanwhile keeps level 2.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any, ClassVar

import torch
from torch import Tensor

from roll_core.interfaces.inference import GenerateOutput, Request, RequestOutput, SamplingParams, StructuredOutput
from roll_core.models import prepare_engine_process, resolve_model_path, torch_dtype
from roll_engines._onednn_linear import drop_packed, packed_bytes
from roll_engines.infer._adapters import refuse_adapters
from roll_engines.infer._batcher import Running
from roll_engines.infer._constrained_batcher import Constrained, ConstrainedBatcher
from roll_engines.infer._cpu_kernels import use_cpu_kernels
from roll_engines.infer._fp8_emulation import FP8Emulation
from roll_engines.infer._routing import RoutingRecorder
from roll_engines.infer._rows import caller_error, row_requests
from roll_engines.infer._sampling import StopStrings
from roll_engines.infer._stop_checks import check_stops
from roll_engines.infer._sync_undo import MixedWeights, SyncUndo
from roll_engines.infer._vision import VisionInputs, refuse_pictures

log = logging.getLogger(__name__)


def on_device(where: torch.device, device: torch.device) -> bool:
    """Whether a tensor on `where` is on the engine's `device`: "cuda" (no index, as engines are built) holds
    cuda:0, cuda:1, ...; an indexed device only itself (torch.device("cuda:0") != torch.device("cuda"))."""
    return where.type == device.type and (device.index is None or where.index == device.index)


class HFInferEngine:
    """Sampling engine over a transformers model; weights are replaced in place by `update_weights`."""

    continuous_batching: ClassVar[bool] = True
    #: SamplingParams.structured is honoured (roll_core.interfaces.inference.check_structured).
    structured_outputs: ClassVar[bool] = True

    def __init__(
        self,
        model_path: str,
        *,
        name: str = "hf",
        dtype: str = "float32",
        device: str = "cpu",
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_new_tokens: int = 128,
        stop: Sequence[str] | None = None,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        prefix_cache_mb: float = 1024.0,
        attn_implementation: str = "sdpa",
        trust_remote_code: bool = False,
        world_size: int = 1,
        num_threads: int | None = None,
        seed: int = 0,
        return_routing: bool = False,
        emulate_fp8: bool = False,
        # Every engine gets the runtime's LoRA rank; this one serves no adapters (infer_engine.lora_sync=merged only).
        lora_rank: int = 0,
        # The run's picture size bounds (model.image_*_pixels): not used here, pictures arrive already processed
        # with them (Request.mm, built by roll_core.multimodal.VisionProcessor).
        image_min_pixels: int | None = None,
        image_max_pixels: int | None = None,
    ) -> None:
        refuse_adapters(name, lora_rank)
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        from roll_core.multimodal import is_vision_model

        prepare_engine_process(device, num_threads)
        self.name, self.device = name, torch.device(device)
        self.defaults = SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, stop=tuple(stop or ())
        )
        self.path = resolve_model_path(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=trust_remote_code)
        vision = is_vision_model(self.path)
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        self.model = auto.from_pretrained(
            self.path,
            dtype=torch_dtype(dtype),
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        ).to(self.device)
        self.model.eval().requires_grad_(False)
        self._dtype = torch_dtype(dtype)
        if self.device.type == "cpu":
            # Weights loaded from safetensors stay memory-mapped; the kernel may page them out between steps
            # (measured: 3-10x slower generate calls). Private copies keep them resident.
            for p in itertools.chain(self.model.parameters(), self.model.buffers()):
                p.data = p.data.clone()
            use_cpu_kernels(self.model, vision=vision)
        self._shapes = {k: tuple(p.shape) for k, p in self.model.named_parameters()}
        # The tokenizer's EOS and the generation config's (vLLM stops on both): a fine-tuned checkpoint may have
        # changed one (e.g. the tokenizer's to <|im_end|>) and not the other.
        eos = self.model.generation_config.eos_token_id
        eos = [*(eos if isinstance(eos, list) else [eos]), self.tokenizer.eos_token_id]
        self.eos_ids = {int(e) for e in eos if e is not None}
        # Padding is masked, so any id serves; a tokenizer may declare neither pad nor EOS (generating raised then).
        pads = (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, self.model.generation_config.pad_token_id)
        self._pad_id = next((int(x) for x in pads if x is not None), min(self.eos_ids, default=0))
        # Prompt ids must index the embedding: one that does not failed the whole running batch at its prefill.
        self._vocab = self.model.get_input_embeddings().num_embeddings
        self.vision = VisionInputs(self.model, self.path, self.tokenizer) if vision else None
        limit = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        if limit is None:  # no declared limit (e.g. a state-space model): the configured one, else 4096
            self._max_context = max_model_len or 4096
        else:
            if max_model_len is not None and max_model_len > limit:
                log.warning(
                    "%s engine: max_model_len=%d exceeds the model's max_position_embeddings=%d; using %d "
                    "(longer prompts finish as prompt_too_long)",
                    name,
                    max_model_len,
                    limit,
                    limit,
                )
            self._max_context = min(max_model_len or limit, limit)
        self.seed = seed
        self._seeds = torch.Generator().manual_seed(seed)  # stream of per-request seeds when a request has none
        self._version = 0
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._paused = False
        # Set while a weight update waits for the lock: the stepping threads then hand it over at their next step
        # boundary (a lock is not fair: the stepping thread re-took it at once after each step, measured up to 66
        # steps before an update got in).
        self._pause_wanted = threading.Event()
        self._sleeping = 0
        # What generating is refused for (module docstring): tensors a failed sync whose undo failed left mixed, or
        # the parameters sleep(level=2) discarded and no completed sync has rewritten since.
        self._mixed = MixedWeights()
        # One name per tensor (tied names share the first): what a failed sync left mixed, what a later one rewrote.
        first: dict[tuple[int, tuple[int, ...]], str] = {}
        state = self.model.state_dict()
        self._tensor_names = {k: first.setdefault((v.data_ptr(), tuple(v.shape)), k) for k, v in state.items()}
        self._undo: SyncUndo | None = None  # the sync in progress (begin_weight_update .. finish)
        self._thread: threading.Thread | None = None
        self._stopped = False
        # MoE routed-expert replay: every RequestOutput carries its positions' experts (roll_engines.infer._routing).
        # A reused prefix's routing is not kept, so the prefix cache is off while recording.
        routing = RoutingRecorder(self.model) if return_routing else None
        # vLLM's FP8 rollout numerics (weights rounded at load and after every sync; inputs per call), not its speed.
        self.fp8 = FP8Emulation(self.model) if emulate_fp8 else None
        if routing is not None:
            prefix_cache_mb = 0.0
        self.batcher = ConstrainedBatcher(
            self.model,
            eos_ids=self.eos_ids,
            pad_id=self._pad_id,
            max_num_seqs=max_num_seqs,
            max_context=self._max_context,
            device=self.device,
            version=lambda: self._version,
            prefix_cache_bytes=int(prefix_cache_mb * 2**20),
            vision=self.vision,
            routing=routing,
            name=name,
        )

    # ---- facts --------------------------------------------------------------------------------------------
    @property
    def max_context_length(self) -> int:
        return self._max_context

    @property
    def pad_id(self) -> int:
        return int(self._pad_id)

    @property
    def weight_version(self) -> int:
        return self._version

    def check_sampling(self, params: SamplingParams) -> None:
        """Every field of SamplingParams is supported by roll's own sampler. A structured constraint needs the
        `roll-engines[structured]` extra (outlines-core) and must compile, as vLLM and SGLang check it: a bad schema or
        regex fails here, naming itself (the OpenAI server's early check, a run's wiring), not when submitted.

        Refused as vLLM refuses them (the same params must not run on one engine and fail on the other): an empty stop
        string (vLLM: "stop cannot contain an empty string"; it was dropped here), a stop token id that is not an int
        or lies outside the model's vocabulary [0, V) (vLLM's out-of-vocab check; it could never stop a response):
        roll_engines.infer._stop_checks, the check every engine runs."""
        check_stops(getattr(self, "name", "hf"), params, getattr(self, "_vocab", None))  # also called on the class
        if params.structured is not None:
            from roll_engines.structured import to_regex

            to_regex(params.structured)

    def check_prompt(self, ids: Sequence[int], what: str) -> None:
        """A prompt the model can encode: at least one token (vLLM refuses empty prompts too; here one sampled from
        a row that attends to nothing, or failed every running request), each id an embedding row (an id past the
        vocabulary failed every running request at its prefill, and on CUDA is a device-side assert)."""
        if len(ids) == 0:
            raise ValueError(f"{self.name} engine: {what} is empty (a prompt needs at least one token)")
        if 0 <= min(ids) and max(ids) < self._vocab:
            return
        bad = [int(t) for t in ids if not 0 <= int(t) < self._vocab]
        raise ValueError(
            f"{self.name} engine: {what} has token ids outside the model's vocabulary [0, {self._vocab}): {bad[:5]}"
        )

    # ---- batch API ----------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        n: int = 1,
        mm: Sequence[Any] | None = None,
        first_row: int = 0,
    ) -> GenerateOutput:
        """Sample `n` responses per prompt; row k*n + j is sample j of prompt k.

        With `params.seed` set, row i samples from the stream seeded by (seed, first_row + i): results do not
        depend on how requests were batched, nor on how a batch was split over engines. `mm`: one `MMInputs` (or
        None) per prompt, the pictures of a vision-language prompt (a prompt batch's `mm_inputs` field). Every
        prompt is checked before any starts: a bad one raises ValueError naming it and nothing runs; one whose
        prefill fails all the same raises PrefillError naming it once the others are done. A row refused as it is
        queued (the engine shut down or its weights left mixed meanwhile) aborts the rows queued before it first.
        """
        t0 = time.perf_counter()
        params = params or self.defaults
        if mm is not None and len(mm) != len(prompts):
            raise ValueError(f"{self.name} engine: {len(mm)} mm entries for {len(prompts)} prompts (one per prompt)")
        for k, prompt in enumerate(prompts):
            self.check_prompt(prompt, f"prompt {k}")
        seqs = [self._prepare(req) for req in row_requests(prompts, params, n, first_row, mm)]
        futures: list[Future[RequestOutput]] = []
        try:
            for seq in seqs:  # one by one: rows queued before a refusal are aborted below
                futures.append(self._add(seq))
            self._drive(futures)
        except BaseException:
            # A row refused part way (engine shut down, weights left mixed meanwhile) or an interrupted wait: the rows
            # queued are retired now, not at a next step that may never come (no background loop) holding their KV.
            with self._lock:
                for seq in seqs[: len(futures)]:
                    self.batcher.abort(seq.request.request_id)
                self.batcher.retire()
            raise
        outputs = []
        for i, f in enumerate(futures):
            if (exc := f.exception()) is not None and (named := caller_error(exc, self.name, i, n)) is not exc:
                raise named from exc  # the caller's prompt and row, not an internal request id
            outputs.append(f.result())
        return GenerateOutput.from_requests(outputs, self.pad_id, time.perf_counter() - t0)

    def _drive(self, futures: list[Future]) -> None:
        """Step in this thread until every future is done (the background thread may step too)."""
        while not all(f.done() for f in futures):
            with self._lock:
                if self._paused or self._pause_wanted.is_set():
                    self._work.wait(0.05)
                    continue
                self._step()

    def _step(self) -> None:
        if self._mixed:
            self.batcher.fail_all(self._mixed.error(self.name))
            return
        try:
            self.batcher.step()
        except Exception as exc:  # a broken step must fail the requests it held, never hang their callers
            log.exception("%s engine step failed", self.name)
            self.batcher.fail_all(exc)

    # ---- request API --------------------------------------------------------------------------------------
    def submit(self, request: Request) -> Future[RequestOutput]:
        """Queue one request; the background thread admits it into the running batch at the next step."""
        fut = self._enqueue(request)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"{self.name}-engine", daemon=True)
                self._thread.start()
            self._work.notify_all()
        return fut

    def _enqueue(self, request: Request) -> Future[RequestOutput]:
        return self._add(self._prepare(request))

    def _prepare(self, request: Request) -> Running:
        """The queue entry of a request; raises (to the caller, before it joins any batch) what is wrong with it."""
        p = request.params
        self.check_prompt(request.prompt_ids, f"the prompt of request {request.request_id!r}")
        self.check_sampling(p)
        if self.vision is not None:
            self.vision.check(request, self.name)
        else:
            refuse_pictures(request, self.name, self.path)
        seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        fut: Future[RequestOutput] = Future()
        seq = (Constrained if p.structured is not None else Running)(
            request=request,
            future=fut,
            generator=torch.Generator().manual_seed(seed),
            stop=StopStrings(self.tokenizer, p.stop, prompt=request.prompt_ids),
            max_new=p.max_new_tokens,
        )
        if p.structured is not None:  # compiled here (cached): a bad schema fails the caller, not the batch
            seq.matcher = self._matcher(p.structured)
        return seq

    def _add(self, seq: Running) -> Future[RequestOutput]:
        fut = seq.future
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"{self.name} engine is shut down")
            if self._mixed:
                raise self._mixed.error(self.name)
            self.batcher.add(seq)
        return fut

    def _matcher(self, constraint: StructuredOutput) -> Any:
        from roll_engines.structured import Matcher

        return Matcher(constraint, self.tokenizer)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and (self._paused or not self.batcher.has_work()):
                    self._work.wait()
                if self._stopped:
                    return
                if self._pause_wanted.is_set():  # an update waits for the lock: hand it over
                    self._work.wait(0.05)
                    continue
                self._step()

    def abort(self, request_id: str) -> bool:
        with self._lock:
            return self.batcher.abort(request_id)

    # ---- weights ------------------------------------------------------------------------------------------
    def weight_dtypes(self) -> dict[str, str]:
        """Weights kept wider than the engine's dtype, by name (transformers' `_keep_in_fp32_modules_strict`: a
        DeepSeek-V3 or GLM-4.5 router and its expert bias in fp32 under bf16): the trainer sends them in that dtype."""
        size = torch.empty((), dtype=self._dtype).element_size()
        return {
            k: str(v.dtype).removeprefix("torch.")
            for k, v in self.model.state_dict().items()
            if v.is_floating_point() and v.element_size() > size
        }

    def begin_weight_update(self) -> None:
        self._pause_wanted.set()
        try:
            with self._lock:  # waits for the step in progress only
                self._paused = True
                if self._undo is not None and self._undo.error is None and self._undo.written:
                    # A sync that never finished (its caller failed between begin and finish): it is not known to
                    # be complete, so its writes are undone before this one starts.
                    self._fail_sync(self._undo, RuntimeError("a new sync began before it finished"))
                self._undo = SyncUndo(keep=not self._mixed)
        finally:
            self._pause_wanted.clear()

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> int:
        """Copy tensors in place by name (the trainer's state-dict names); returns bytes received.

        Whatever it raises fails the whole sync: the tensors this sync wrote get their old values back (module
        docstring), later buckets of it are refused, and `finish_weight_update` keeps the version. Outside a sync
        (no `begin_weight_update`) a call is a sync of its own: one that raises is undone alone, one that succeeds
        is finished at once (the version moves on, cached prefixes of the old weights are dropped; they were served
        to the next turn of a conversation)."""
        own = self.model.state_dict()
        nbytes = 0
        with self._lock, torch.no_grad():
            alone = self._undo is None
            undo = SyncUndo(keep=not self._mixed) if alone else self._undo
            if undo.error is not None:
                raise RuntimeError(
                    f"{self.name} engine: this weight sync already failed ({undo.error}) and was undone; "
                    "finish it and sync again"
                ) from undo.error
            try:
                if self._sleeping == 2:  # the storage is empty: each weight would fail for its shape (0,)
                    raise RuntimeError(
                        f"{self.name} engine: sleep(level=2) discarded the weights; wake_up() before a weight sync"
                    )
                for name, value in named_tensors:
                    if name not in own:
                        raise KeyError(f"weight {name!r} is not in the inference model {type(self.model).__name__}")
                    if value.shape != own[name].shape:  # copy_ would broadcast a (1,) tensor over a whole weight
                        raise ValueError(
                            f"weight {name!r}: the sync sent shape {tuple(value.shape)}, the inference model's is "
                            f"{tuple(own[name].shape)}"
                        )
                    undo.save(own[name], self._tensor_names[name])
                    own[name].copy_(value)
                    nbytes += value.numel() * value.element_size()
            except BaseException as exc:
                self._fail_sync(undo, exc)
                raise
            if alone:
                self._undo = undo
                self.finish_weight_update()
        return nbytes

    def abort_weight_update(self, reason: str = "the caller aborted it") -> int:
        """End a sync that failed outside this engine (a sender that died between buckets, a broken transfer):
        undo what it wrote and resume generation on the old weights. Returns the weight version, unchanged."""
        with self._lock:
            if self._undo is None:  # no sync open (begin failed or never ran): nothing to undo, nothing to count
                self._undo = SyncUndo(keep=False)
            if self._undo.error is None:
                self._fail_sync(self._undo, RuntimeError(reason))
            return self.finish_weight_update()

    def _fail_sync(self, undo: SyncUndo, exc: BaseException) -> None:
        """Mark the sync failed and put back the old values of what it wrote (module docstring)."""
        undo.error = exc
        if not undo.written:
            return
        if self._mixed or not undo.keep:  # into mixed or discarded weights (no copies kept): what it wrote joins
            self._mixed.add(undo.names, f"a weight sync that failed part way ({exc!r})")
            return
        try:
            restored = undo.undo()
        except Exception as undo_exc:  # the old values are lost: refuse rather than serve a mix
            log.exception("%s engine: a failed weight sync could not be undone", self.name)
            failed = f"the weight sync to version {self._version + 1} failed part way ({exc!r})"
            self._mixed.add(undo.names, f"{failed} and could not be undone ({undo_exc!r})")
            return
        log.warning(
            "%s engine: a weight sync failed after %d tensor(s) (%r); the %d overwritten restored, version %d kept",
            self.name,
            undo.written,
            exc,
            restored,
            self._version,
        )

    def finish_weight_update(self) -> int:
        """End a sync and resume generation. A failed one (module docstring) keeps the weight version: its error
        reached the caller from `update_weights`, and raising here too would replace it in the caller's `finally`."""
        with self._lock:
            undo, self._undo = self._undo, None
            failed = undo is not None and undo.error is not None
            self.batcher.prefixes.clear()  # cached keys/values belong to the old weights
            # The trainer sent full precision: hold the rounded copy vLLM would (restored weights were rounded).
            if self.fp8 is not None and not failed:
                self.fp8.round_weights()
            # The blocked copies follow writes through the parameters; a write they cannot see (into `p.data`)
            # would leave them stale. Every copy is due anyway after a sync: pack afresh.
            drop_packed(self.model)
            if not failed:
                self._version += 1
                if undo is not None:
                    self._mixed.rewritten(undo.names)
            self._paused = False
            self._work.notify_all()
            return self._version

    def load_weights(self, weights: dict[str, Tensor]) -> int:
        """One-shot full sync (tests, notebooks): begin, update, finish."""
        self.begin_weight_update()
        try:
            return self.update_weights(weights.items())
        finally:
            self.finish_weight_update()

    # ---- memory -------------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        with self._lock:
            self.batcher.retire()  # rows aborted since the last step leave now: a caller may abort, then sleep
            if self.batcher.has_work():
                raise RuntimeError(f"{self.name} engine: cannot sleep while requests run; finish or abort them")
            self.batcher.release()
            if level == 2:
                # Parameters only: buffers are small, and non-persistent ones (rotary tables) are never synced.
                for p in self.model.parameters():
                    p.data = torch.empty(0, dtype=p.dtype, device=self.device)
                drop_packed(self.model)  # the CPU kernels' blocked copies of the weights go with them
                # Every parameter must be rewritten before serving (the names syncs use; tied ones count once).
                self._mixed.discard({self._tensor_names.get(n, n) for n, _ in self.model.named_parameters()})
            elif self.device.type != "cpu":
                self.model.to("cpu")
            # Never lower: a level-1 sleep after a level-2 one left the weights discarded, and `wake_up` then kept
            # their empty storage (every later sync refused for its shapes).
            self._sleeping = max(self._sleeping, level)
            if self.device.type != "cpu":
                from roll_hw import current_platform

                current_platform.empty_cache()

    def wake_up(self) -> None:
        with self._lock:
            if self._sleeping == 2:  # fresh storage of the right shapes; the next full sync fills it
                for name, p in self.model.named_parameters():
                    # NaN, not leftover memory: a weight the sync forgot shows up at once instead of by chance.
                    p.data = torch.full(self._shapes[name], float("nan"), dtype=p.dtype, device=self.device)
                if self.device.type != "cpu":  # the buffers too: a level-1 sleep before the level-2 one moved them
                    self.model.to(self.device)  # to the host (GPU path; not run on CPU)
            elif self._sleeping == 1 and self.device.type != "cpu":
                self.model.to(self.device)
            self._sleeping = 0

    def memory_bytes(self) -> dict[str, int]:
        weights = sum(
            p.numel() * p.element_size()
            for p in itertools.chain(self.model.parameters(), self.model.buffers())
            if on_device(p.device, self.device)
        )
        if self.device.type == "cpu":
            weights += packed_bytes(self.model)  # the CPU kernels' blocked copies (roll_engines._onednn_linear)
        return {"weights": weights, "kv_cache": self.batcher.kv_bytes()}

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            self.batcher.fail_all(RuntimeError(f"{self.name} engine shut down"))
            # The switched forwards refer back to their modules (a cycle): without this the blocked copies would
            # live until the cyclic collector runs.
            drop_packed(self.model)
            self._work.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
