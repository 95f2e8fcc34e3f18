"""Role workers of the RLVR pipeline and their typed worker-group wrappers.

Roles: `TrainWorker` hosts a `TrainEngine` (actor_train, critic, reference, by the engine's `role`),
`InferWorker` hosts an `InferEngine` (actor_infer), `RewardWorker` scores responses with a task's reward. Engines
are built from their `_target_` configs, so roll-core never imports an engine package; the contracts they satisfy
are the protocols in roll_core.interfaces. Each `*Group` class exposes exactly the calls the controller makes,
with types: `actor_infer.generate(batch, params, n=8) -> Batch`; each runs the worker method it names
(`self.call(InferWorker.generate, ...)`, roll_core.cluster.group), never a method name as a string.

Engine config keys in `WORKER_KEYS` configure the worker and its placement, not the engine, and are not passed
to the engine's constructor.

Engines are built on the process's main thread. A Ray actor that serves several calls at once (`max_concurrency`,
the request API) runs its methods on pool threads, but its constructor on the main thread; engines that install
signal handlers or start event loops (SGLang before 0.5.10 calls `signal.signal`, which raises off the main
thread) are therefore built in the inference worker's `__init__`. Training engines need the rendezvous first and
are built in `setup`, on the main thread too (their actors serve one call at a time). `engine_thread()` reports it.
"""

from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import Future
from typing import Any

import torch

from roll_core.cluster.buckets import Bucket, SyncGroup, bucket_nbytes, buckets, cast, open_cuda, share_cuda
from roll_core.cluster.group import Handle, WorkerGroup
from roll_core.cluster.worker import Dispatch, Worker, dispatch, node_address
from roll_core.config.build import build
from roll_core.devices import resolve_device
from roll_core.interfaces import InferEngine, Request, RequestOutput, SamplingParams, Task, TrainEngine
from roll_core.interfaces.runtime import InferEngineRuntime, TrainEngineRuntime, check_engine_kwargs
from roll_core.interfaces.training import METRIC_WEIGHT_PREFIX
from roll_core.protocol import Batch
from roll_core.seeds import Purpose, derive_seed

log = logging.getLogger(__name__)

#: Engine-config keys read by workers, placement and weight sync (never passed to an engine's constructor).
# `dtype` of an inference engine reaches it through the runtime keys (resolved on its node, default model.dtype).
WORKER_KEYS = (
    "world_size",
    "sync_transport",
    "sync_bucket_mb",
    "sleep_level",
    "python",
    "max_concurrency",
    "dtype",
    "structured",  # a sampling setting (SamplingParams.structured), not the engine's
    "lora_sync",  # the engine gets the adapter rank it serves (runtime `lora_rank`) instead
)


def engine_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """The engine's own keys of an engine config (worker keys removed)."""
    return {k: v for k, v in cfg.items() if k not in WORKER_KEYS}


class EngineWorker(Worker):
    """A worker hosting one engine built by `build_engine` (training or inference)."""

    @dispatch(Dispatch.BROADCAST)
    def engine_thread(self) -> tuple[str, bool]:
        """(name of the thread the engine was built on, whether it is the main thread)."""
        return self.engine_thread_name


def build_engine(worker: Worker, cfg: dict[str, Any], runtime: TrainEngineRuntime | InferEngineRuntime) -> Any:
    """Build an engine from its config and the run's values (roll_core.interfaces.runtime) on this worker,
    recording the thread it was built on (`engine_thread`). A key the engine's constructor does not take is a
    TypeError naming it, raised before anything is loaded."""
    from hydra.utils import get_object

    resolved = resolve_device(dict(runtime))
    own = engine_kwargs(cfg)
    if own.get("param_dtype") == "bfloat16" and resolved.get("dtype") == "float32":
        # Pure bf16 asked (model.dtype bfloat16/auto) on a platform that computes in fp32 (no fast bf16): the
        # master weights follow, as the compute dtype did (the engine refuses masters narrower than compute).
        log.warning("train_engine.param_dtype bfloat16 -> float32: the compute dtype resolved to float32 here")
        own["param_dtype"] = "float32"
    check_engine_kwargs(get_object(own["_target_"]), {k: v for k, v in own.items() if k != "_target_"}, resolved)
    engine = build(own, **resolved)
    worker.engine_dtype = str(getattr(engine, "dtype", None) or resolved.get("dtype") or "").removeprefix("torch.")
    current = threading.current_thread()
    worker.engine_thread_name = (current.name, current is threading.main_thread())
    return engine


class TrainWorker(EngineWorker):
    """Hosts a training engine (policy, critic or frozen reference)."""

    def __init__(self, engine: dict[str, Any], runtime: TrainEngineRuntime, **base: Any) -> None:
        super().__init__(**base)
        self._engine_cfg, self._runtime = engine, runtime
        self._sync_group: SyncGroup | None = None
        self._sync_store: Any = None  # rank 0's weight-sync TCPStore, opened by sync_endpoint
        self._ipc: Any = None
        # What weight sync sends: "merged" (iter_weights) or "adapter" (iter_adapter: the inference engines serve the
        # LoRA adapter themselves, infer_engine.lora_sync=adapter); set once by WeightSync.
        self.weight_format = "merged"

    def on_setup(self) -> None:
        self.engine: TrainEngine = build_engine(self, self._engine_cfg, self._runtime)

    @dispatch(Dispatch.DP)
    def compute_logprobs(
        self, batch: Batch, temperature: float = 1.0, with_entropy: bool = False, base: bool = False, topk: int = 0
    ) -> Batch:
        # Passed only when asked: the LoRA base (reference) and top-k (a teacher) need the engine's support.
        kwargs: dict[str, Any] = {"base": True} if base else {}
        if topk:
            kwargs["topk"] = topk
        out = self.engine.compute_logprobs(
            engine_inputs(batch), temperature=temperature, with_entropy=with_entropy, **kwargs
        )
        return Batch(out)

    @dispatch(Dispatch.DP)
    def compute_values(self, batch: Batch) -> Batch:
        return Batch(self.engine.compute_values(engine_inputs(batch)))

    @dispatch(Dispatch.DP)
    def compute_attention_credit(self, batch: Batch, **kwargs: Any) -> Batch:
        """Per-token WAAD and FAI of the policy's attention (algo.attention_credit; hf and fsdp2 engines)."""
        fn = getattr(self.engine, "compute_attention_credit", None)
        if fn is None:
            raise ValueError(f"train engine {self.engine.name!r} cannot read attention maps (algo.attention_credit)")
        return Batch(fn(engine_inputs(batch), **kwargs))

    @dispatch(Dispatch.DP)
    def train(
        self, batch: Batch, loss_fn: Any, mini_batches: int, epochs: int, temperature: float, shuffle_seed: int
    ) -> dict[str, float]:
        return self.engine.train_step(
            engine_inputs(batch),
            loss_fn,
            mini_batches=mini_batches,
            epochs=epochs,
            temperature=temperature,
            # One stream per data-parallel replica: the TP/PP ranks of a replica must see the same order.
            shuffle_seed=derive_seed(shuffle_seed, Purpose.REPLICA_SHUFFLE, self.engine.dp_rank),
        )

    @dispatch(Dispatch.DP)
    def compute_gradients(self, batch: Batch, loss_fn: Any, temperature: float = 1.0) -> dict[str, torch.Tensor]:
        return self.engine.compute_gradients(engine_inputs(batch), loss_fn, temperature)

    @dispatch(Dispatch.BROADCAST)
    def get_weights(self) -> dict[str, torch.Tensor] | None:
        """Full CPU weights on rank 0 (None elsewhere); collective on sharded engines."""
        weights = {k: v.detach().to("cpu", copy=True) for k, v in self.engine.iter_weights()}
        return weights if self.rank == 0 else None

    @dispatch(Dispatch.BROADCAST)
    def save(self, folder: str, tokenizer_path: str | None = None) -> None:
        self.engine.save(folder, tokenizer_path)

    @dispatch(Dispatch.BROADCAST)
    def load(self, folder: str) -> None:
        self.engine.load(folder)

    # ---- weight sync: the sending side (see roll_core.cluster.weight_sync) -------------------------------
    @dispatch(Dispatch.RANK0)
    def weight_buckets(
        self, bucket_bytes: int, changed_only: bool, dtype: str | None = None, wide: dict[str, str] | None = None
    ) -> Any:
        """Buckets of (name, tensor) in order, floating tensors cast to the inference engines' `dtype` first (the
        buckets, and so every transport, carry what the engines hold: half the bytes of fp32 for bf16 engines), those
        named in `wide` to the dtype it gives (buckets.cast). Tensors may be live parameters when no cast is needed.
        A generator: called through the group only on the local backend (the in-process transport); the other
        transports call it on the worker."""
        # Adapter sync sends the adapter at every sync: the engines loaded the (frozen) base themselves.
        named = (
            self.engine.iter_adapter() if self.weight_format == "adapter" else self.engine.iter_weights(changed_only)
        )
        return buckets(cast(named, dtype, wide), bucket_bytes)

    @dispatch(Dispatch.BROADCAST)
    def set_weight_format(self, weight_format: str) -> None:
        """What `weight_buckets` yields from now on: "merged" weights or the LoRA "adapter" alone."""
        if weight_format == "adapter" and not callable(getattr(self.engine, "iter_adapter", None)):
            raise ValueError(f"train engine {type(self.engine).__name__} cannot export a LoRA adapter alone")
        self.weight_format = weight_format

    @dispatch(Dispatch.BROADCAST)
    def publish_weights(
        self, bucket_bytes: int, changed_only: bool, dtype: str | None = None, wide: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """Object-store transport: rank 0 puts CPU buckets in Ray's object store and returns their refs."""
        import ray

        refs, nbytes, ntensors = [], 0, 0
        for bucket in self.weight_buckets(bucket_bytes, changed_only, dtype, wide):  # every rank iterates
            if self.rank == 0:
                cpu = [(k, v.detach().to("cpu", copy=True)) for k, v in bucket]
                refs.append(ray.put(cpu))
                nbytes += bucket_nbytes(cpu)
                ntensors += len(cpu)
        return {"refs": refs, "bytes": nbytes, "tensors": ntensors}

    @dispatch(Dispatch.RANK0)
    def sync_endpoint(self, world_size: int) -> tuple[str, int]:
        """This node's address and the port of the weight-sync rendezvous rank 0 now listens on."""
        host = node_address()
        self._sync_store = SyncGroup.host_store(host, world_size)
        return host, int(self._sync_store.port)

    @dispatch(Dispatch.BROADCAST)
    def join_sync_group(self, host: str, port: int, world_size: int, backend: str) -> None:
        if self.rank == 0:
            self._sync_group = SyncGroup(host, port, 0, world_size, backend, store=self._sync_store)

    @dispatch(Dispatch.BROADCAST)
    def send_weights_dist(
        self, bucket_bytes: int, changed_only: bool, dtype: str | None = None, wide: dict[str, str] | None = None
    ) -> dict[str, int]:
        nbytes = ntensors = nbuckets = 0
        for bucket in self.weight_buckets(bucket_bytes, changed_only, dtype, wide):
            if self.rank == 0:
                self._sync_group.send(bucket)
                nbytes += bucket_nbytes(bucket)
                ntensors += len(bucket)
                nbuckets += 1
        if self.rank == 0:
            self._sync_group.send(None)
        return {"bytes": nbytes, "tensors": ntensors, "buckets": nbuckets}

    @dispatch(Dispatch.BROADCAST)
    def start_ipc_sync(
        self, bucket_bytes: int, changed_only: bool, dtype: str | None = None, wide: dict[str, str] | None = None
    ) -> None:
        self._ipc = {"it": self.weight_buckets(bucket_bytes, changed_only, dtype, wide), "keep": None}

    @dispatch(Dispatch.BROADCAST)
    def next_ipc_bucket(self) -> dict[str, Any] | None:
        """CUDA IPC transport: the next bucket of full tensors on this rank's device, as an IPC handle."""
        self._ipc["keep"] = None  # the receivers copied the previous bucket
        bucket = next(self._ipc["it"], None)
        if bucket is None:
            self._ipc = None
            return None
        handle, specs, flat = share_cuda(bucket)
        self._ipc["keep"] = flat
        return {"handle": handle, "specs": specs, "bytes": bucket_nbytes(bucket)}


def engine_inputs(batch: Batch) -> dict[str, Any]:
    """What a train engine takes: the batch's tensors, plus its per-row pictures (`mm_inputs`: one
    roll_core.multimodal.MMInputs or None per row) when a row has some."""
    out: dict[str, Any] = batch.tensors()
    mm = batch["mm_inputs"] if "mm_inputs" in batch else None
    if mm is not None and any(m is not None for m in mm):
        out["mm_inputs"] = list(mm)
    return out


#: The tensor InferGroup.generate adds to a batch before splitting it: each prompt's index in the whole batch.
PROMPT_INDEX = "prompt_index"


class InferWorker(EngineWorker):
    """Hosts an inference engine: batch generation, single requests, weight updates, sleep and wake-up."""

    def __init__(self, engine: dict[str, Any], runtime: InferEngineRuntime, **base: Any) -> None:
        super().__init__(**base)
        self._engine_cfg, self._runtime = engine, runtime
        self._sync_group: SyncGroup | None = None
        # In the constructor: the actor's main thread, even when it serves calls on a pool (module docstring).
        self.engine: InferEngine = build_engine(self, engine, runtime)

    @dispatch(Dispatch.DP)
    def generate(self, batch: Batch, params: SamplingParams, n: int) -> Batch:
        if params.seed is not None:  # one stream family for every rank: rows differ by their place in the batch
            params = params.replace(seed=derive_seed(params.seed, Purpose.WORKER, 0))
        kwargs: dict[str, Any] = {}
        if PROMPT_INDEX in batch and len(batch) and int(batch[PROMPT_INDEX][0]):
            # This rank's slice starts at that prompt of the whole batch (InferGroup.generate): its rows sample the
            # streams of their place there, so a batch samples the same responses over any number of engines.
            kwargs["first_row"] = int(batch[PROMPT_INDEX][0]) * n
        mm = batch["mm_inputs"] if "mm_inputs" in batch else None
        if mm is not None and any(m is not None for m in mm):  # a vision-language prompt's pictures (Request.mm)
            kwargs["mm"] = mm
        gen = self.engine.generate(batch["prompt_ids"], params, n, **kwargs)
        out = Batch(
            {
                "responses": gen.responses,
                "behaviour_logprobs": gen.logprobs,
                "response_mask": gen.response_mask,
                "truncated": gen.truncated,
            },
            {"finish_reason": gen.finish_reasons},
        )
        if getattr(gen, "routed_experts", None) is not None:  # MoE routing per row; `assemble` lays it out
            from roll_core.routing import ROUTING_ROWS

            out[ROUTING_ROWS] = gen.routed_experts
        out.meta["generate_seconds"] = gen.seconds
        return out

    def submit_local(self, request: Request) -> Future[RequestOutput]:
        """In-process request (local backend): the engine's future, without blocking."""
        return self.engine.submit(request)

    @dispatch(Dispatch.ONE)
    def request(self, request: Request) -> RequestOutput:
        """One request, blocking this call's thread until it finishes (Ray actors serve many at once)."""
        return self.engine.submit(request).result()

    @dispatch(Dispatch.BROADCAST)
    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    @dispatch(Dispatch.RANK0)
    def max_context_length(self) -> int:
        return self.engine.max_context_length

    @dispatch(Dispatch.RANK0)
    def check_sampling(self, params: SamplingParams) -> None:
        from roll_core.interfaces.inference import check_structured

        check_structured(self.engine, params)  # an engine that cannot constrain decoding must not ignore it
        self.engine.check_sampling(params)

    @dispatch(Dispatch.RANK0)
    def continuous_batching(self) -> bool:
        return bool(getattr(self.engine, "continuous_batching", False))

    @dispatch(Dispatch.BROADCAST)
    def sleep(self, level: int = 1) -> None:
        self.engine.sleep(level)

    @dispatch(Dispatch.BROADCAST)
    def wake_up(self) -> None:
        self.engine.wake_up()

    @dispatch(Dispatch.BROADCAST)
    def memory_bytes(self) -> dict[str, int]:
        return self.engine.memory_bytes()

    # ---- weight sync: the receiving side ----------------------------------------------------------------------
    # retry=False: a step of a sync is meaningless alone on a restarted engine; WeightSync redoes the whole sync.
    @dispatch(Dispatch.BROADCAST, retry=False)
    def begin_weight_update(self) -> None:
        self.engine.begin_weight_update()

    @dispatch(Dispatch.BROADCAST, retry=False)
    def finish_weight_update(self) -> int:
        return self.engine.finish_weight_update()

    @dispatch(Dispatch.BROADCAST, retry=False)
    def receive_bucket(self, bucket: Bucket) -> int:
        """In-process transport: one bucket of the trainer's tensors (live parameters, never kept)."""
        return self.engine.update_weights(bucket)

    @dispatch(Dispatch.BROADCAST, retry=False)
    def receive_weights_object_store(self, refs: list[Any]) -> int:
        import ray

        nbytes = 0
        for ref in refs:
            bucket: Bucket | dict[str, torch.Tensor] = ray.get(ref)
            nbytes += self.engine.update_weights(bucket.items() if isinstance(bucket, dict) else bucket)
            del bucket
        return nbytes

    @dispatch(Dispatch.BROADCAST, retry=False)
    def join_sync_group(self, host: str, port: int, world_size: int, backend: str) -> None:
        self._sync_group = SyncGroup(host, port, 1 + self.rank, world_size, backend)

    @dispatch(Dispatch.BROADCAST, retry=False)
    def receive_weights_dist(self) -> int:
        # An engine's error (a weight it does not have) is raised once the trainer's broadcast ended (receive_all).
        return self._sync_group.receive_all(self.engine.update_weights)

    @dispatch(Dispatch.BROADCAST, retry=False)
    def receive_ipc_bucket(self, shared: list[dict[str, Any]]) -> int:
        mine = shared[self.rank]  # trainer rank r shares device r with this rank
        bucket = open_cuda(mine["handle"], mine["specs"])
        nbytes = self.engine.update_weights(bucket)
        # The engine's copies out of the sender's buffer are asynchronous: they must have landed before this call
        # returns, because the sender drops (and the allocator reuses) that buffer as soon as it does.
        torch.cuda.synchronize(bucket[0][1].device)
        return nbytes

    @dispatch(Dispatch.RANK0)
    def weight_format(self) -> str:
        """What the engine takes at a sync: "merged" weights, or the LoRA "adapter" alone (it serves adapters)."""
        return str(getattr(self.engine, "weight_format", "merged"))

    @dispatch(Dispatch.RANK0)
    def weight_dtype(self) -> str:
        """The dtype of the engine's weights (what synced tensors are cast to before they travel)."""
        return self.engine_dtype

    @dispatch(Dispatch.RANK0)
    def weight_dtypes(self) -> dict[str, str]:
        """The weights the engine keeps wider than its dtype, by name (they travel in theirs); {} where it says none."""
        wide = getattr(self.engine, "weight_dtypes", None)
        return dict(wide()) if callable(wide) else {}


class RewardWorker(Worker):
    """Decodes responses and scores them with the task's reward, guarded (roll_core.cluster.reward_guard): a row
    whose reward raises, hangs or is NaN/inf scores a fixed value and is counted; it never fails the call.

    Stateless between calls: a restarted reward worker needs nothing restored.
    """

    def __init__(
        self, env: dict[str, Any], tokenizer_path: str, guard: dict[str, Any] | None = None, **base: Any
    ) -> None:
        super().__init__(**base)
        from transformers import AutoTokenizer

        from roll_core.cluster.reward_guard import GuardedReward

        self.task: Task = build(env)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.reward = GuardedReward(self.task.reward, name=f"reward worker {self.rank}", **(guard or {}))

    @dispatch(Dispatch.DP)
    def score(self, batch: Batch) -> Batch:
        texts = [
            self.tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True)
            for r, m in zip(batch["responses"], batch["response_mask"])
        ]
        # The prompt's text and the row's metadata reach rewards that declare them (judges, remote verifiers,
        # instruction following, multi-domain routing).
        res = self.reward.score(
            texts,
            batch["answer"],
            prompts=batch["prompt_text"] if "prompt_text" in batch else None,
            metadata=batch["metadata"] if "metadata" in batch else None,
        )
        out = Batch(
            {
                "scores": torch.tensor(res.scores, dtype=torch.float32),
                "correct": torch.tensor(res.correct, dtype=torch.float32),
                "formatted": torch.tensor(res.formatted, dtype=torch.float32),
                # rows whose score is a fallback, not a verdict (a rollout-only run does not write them)
                "reward_failed": torch.tensor(res.failed or [False] * len(res.scores), dtype=torch.bool),
            },
            {"response_text": texts},
        )
        out.meta["reward_counters"] = res.counters
        out.meta["reward_failure"] = self.reward.last_failure
        return out


def _sum_counters(parts: list[Batch]) -> dict[str, int]:
    total: dict[str, int] = {}
    for p in parts:
        for k, v in p.meta.get("reward_counters", {}).items():
            total[k] = total.get(k, 0) + v
    return total


def merge_rank_metrics(per_rank: list[dict[str, float]], rows: list[int]) -> dict[str, float]:
    """One step's metrics from every rank's: each key's mean over the ranks that report it, weighted by the weight
    each rank reports for it (`METRIC_WEIGHT_PREFIX + key`: the loss units behind a token or sequence mean) where
    every reporting rank gives one, else by the rows each rank trained (`rows`, one per entry of `per_rank`). A rank
    given no rows (a batch smaller than the data-parallel size) reports no loss metrics and weighs nothing; where
    no reporting rank has weight (an empty batch), the reporting ranks weigh alike. The weight keys are dropped."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for d in per_rank for k in d if not k.startswith(METRIC_WEIGHT_PREFIX)):
        wkey = METRIC_WEIGHT_PREFIX + key
        reporting = [(d, n) for d, n in zip(per_rank, rows, strict=True) if key in d]
        by_units = all(wkey in d for d, _ in reporting)
        pairs = [(d[key], float(d[wkey]) if by_units else n) for d, n in reporting]
        total = sum(w for _, w in pairs)
        out[key] = sum(v * w for v, w in pairs) / total if total else sum(v for v, _ in pairs) / len(pairs)
    return out


class TrainGroup(WorkerGroup[TrainWorker]):
    """actor_train, critic or reference."""

    worker_cls = TrainWorker
    one_process_per_rank = True

    def compute_logprobs(
        self, batch: Batch, temperature: float = 1.0, with_entropy: bool = False, base: bool = False, topk: int = 0
    ) -> Batch:
        """Log-probs of the responses; `base=True` with LoRA adapters disabled (the reference policy); `topk=K`
        adds "topk_ids" and "topk_logprobs" (B, R, K) (a distillation teacher's targets)."""
        return self.call(TrainWorker.compute_logprobs, batch, temperature, with_entropy, base, topk)

    def compute_values(self, batch: Batch) -> Batch:
        return self.call(TrainWorker.compute_values, batch)

    def compute_attention_credit(self, batch: Batch, **kwargs: Any) -> Batch:
        """{"waad", "fai"} (B, R) of the policy's attention over the responses (roll_algos.attention_credit)."""
        return self.call(TrainWorker.compute_attention_credit, batch, **kwargs)

    def train(
        self, batch: Batch, loss_fn: Any, *, mini_batches: int, epochs: int, temperature: float, shuffle_seed: int
    ) -> dict[str, float]:
        per_rank: list[dict[str, float]] = self.call(
            TrainWorker.train, batch, loss_fn, mini_batches, epochs, temperature, shuffle_seed
        )
        sizes = Batch.split_sizes(len(batch), self.mesh.dp)
        return merge_rank_metrics(per_rank, [sizes[self.mesh.dp_rank(r)] for r in range(len(per_rank))])

    def get_weights(self) -> dict[str, torch.Tensor]:
        """Full CPU weights (tests, tools; the pipeline syncs through roll_core.cluster.weight_sync)."""
        return self.call(TrainWorker.get_weights)[0]

    def save(self, folder: str, tokenizer_path: str | None = None) -> None:
        self.call(TrainWorker.save, folder, tokenizer_path)

    def load(self, folder: str) -> None:
        self.call(TrainWorker.load, folder)


class RequestHandle:
    """A request in flight on one inference rank."""

    def __init__(self, request_id: str, rank: int, pending: Future | Handle) -> None:
        self.request_id, self.rank, self._pending = request_id, rank, pending

    def done(self) -> bool:
        if isinstance(self._pending, Future):
            return self._pending.done()
        import ray

        ready, _ = ray.wait(self._pending.refs, timeout=0)
        return bool(ready)

    def result(self, timeout: float | None = None) -> RequestOutput:
        if isinstance(self._pending, Future):
            return self._pending.result(timeout)
        if timeout is None:
            return self._pending.result()
        import ray

        ready, _ = ray.wait(self._pending.refs, timeout=timeout)
        if not ready:
            raise TimeoutError(f"request {self.request_id} not finished after {timeout}s")
        return self._pending.result()


class InferGroup(WorkerGroup[InferWorker]):
    """actor_infer: the batch API for RLVR and the request API for multi-turn and partial rollout.

    Restartable: an engine that died or hung is re-created and given the trainer's weights by the restart hook
    that roll_core.cluster.weight_sync.WeightSync registers, then the failed call is rerun on it.
    """

    worker_cls = InferWorker
    restartable = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inflight = [0] * self.world_size  # requests routed to each rank and not yet collected
        self._rank_of: dict[str, int] = {}
        self._ids = itertools.count()

    def generate(self, batch: Batch, params: SamplingParams, n: int) -> Batch:
        """n samples of every prompt in `batch["prompt_ids"]`, rows grouped per prompt, split over the ranks. The rows
        sampled do not depend on the number of ranks: each rank seeds its rows by their place in `batch`."""
        indexed = batch.union(Batch({PROMPT_INDEX: torch.arange(len(batch))}))
        parts = self.submit(InferWorker.generate, indexed, params, n).values()
        out = Batch.concat(_pad_responses(parts))
        out.meta["generate_seconds"] = max(p.meta.get("generate_seconds", 0.0) for p in parts)
        return out

    def submit_request(self, request: Request, route_key: str | None = None, rank: int | None = None) -> RequestHandle:
        """Start one request on the least-loaded rank, or the rank `route_key` hashes to (a conversation's turns
        reuse one engine's prefix cache), or on `rank` itself (the async driver's partial-GPU mode places every
        request: roll_core.scheduling.pool)."""
        if rank is not None:
            if not 0 <= rank < self.world_size:
                raise IndexError(f"{self.name} has ranks 0..{self.world_size - 1}, not {rank}")
        elif route_key is not None:
            rank = _stable_hash(route_key) % self.world_size
        else:
            rank = min(range(self.world_size), key=lambda r: self._inflight[r])
        self._inflight[rank] += 1
        self._rank_of[request.request_id] = rank
        if self.backend == "local":
            fut = self.workers[rank].submit_local(request)
            fut.add_done_callback(lambda _f, r=rank, rid=request.request_id: self._collected(r, rid))
            return RequestHandle(request.request_id, rank, fut)
        handle = self.submit_to(rank, InferWorker.request, request)
        return _TrackedHandle(request.request_id, rank, handle, self._collected)

    def _collected(self, rank: int, request_id: str) -> None:
        if self._rank_of.pop(request_id, None) is not None:
            self._inflight[rank] -= 1

    def abort(self, request_id: str) -> bool:
        """Abort a request wherever it runs; True if an engine knew it."""
        return any(self.call(InferWorker.abort, request_id))

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def max_context_length(self) -> int:
        return int(self.call(InferWorker.max_context_length))

    def continuous_batching(self) -> bool:
        """Whether the engine merges requests submitted while others run (what asynchronous rollout needs)."""
        return bool(self.call(InferWorker.continuous_batching))

    def check_sampling(self, params: SamplingParams) -> None:
        """Raises UnsupportedSamplingError (naming the engine) for parameters it cannot honour."""
        self.call(InferWorker.check_sampling, params)

    def sleep(self, level: int = 1) -> None:
        self.call(InferWorker.sleep, level)

    def wake_up(self) -> None:
        self.call(InferWorker.wake_up)

    def memory_bytes(self) -> list[dict[str, int]]:
        return self.call(InferWorker.memory_bytes)

    def begin_weight_update(self) -> None:
        self.call(InferWorker.begin_weight_update)

    def finish_weight_update(self) -> list[int]:
        return self.call(InferWorker.finish_weight_update)


class _TrackedHandle(RequestHandle):
    """A Ray request handle that releases its rank's in-flight count when the result is read, or when reading it
    raises for any reason but a timeout (a failed request is no longer in flight: counted, it skewed least-loaded
    routing away from its rank for the rest of the run)."""

    def __init__(self, request_id: str, rank: int, pending: Handle, collected: Any) -> None:
        super().__init__(request_id, rank, pending)
        self._collected = collected

    def result(self, timeout: float | None = None) -> RequestOutput:
        try:
            out = super().result(timeout)
        except TimeoutError:  # (Ray's GetTimeoutError too) still running: still in flight
            raise
        except BaseException:
            self._collected(self.rank, self.request_id)
            raise
        self._collected(self.rank, self.request_id)
        return out


def _stable_hash(key: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class RewardGroup(WorkerGroup[RewardWorker]):
    """reward. Restartable: reward workers hold no state, so a re-created one just reruns the failed call."""

    worker_cls = RewardWorker
    restartable = True

    def score(self, batch: Batch) -> Batch:
        """Scores of every row. `meta["reward_counters"]`: the workers' summed counters (the guard's FAILURE_COUNTERS
        among them); `meta["reward_all_failed"]`: every row's score was replaced (the reward raised, hung or was
        NaN/inf on all); `meta["reward_failure"]`: the first failure as one line, or None."""
        from roll_core.cluster.reward_guard import all_rows_failed

        context = [k for k in ("prompt_text", "metadata") if k in batch]
        handle = self.submit(RewardWorker.score, batch.select("responses", "response_mask", "answer", *context))
        parts = handle.values()
        out = Batch.concat(parts)
        out.meta["reward_counters"] = _sum_counters(parts)
        out.meta["reward_all_failed"] = all_rows_failed(out.meta["reward_counters"])
        failures = [p.meta["reward_failure"] for p in parts if p.meta.get("reward_failure")]
        out.meta["reward_failure"] = failures[0] if failures else None
        return out


def _pad_responses(parts: list[Batch]) -> list[Batch]:
    """Ranks return responses of different lengths R_i: right-pad all to the longest before concatenating."""
    r = max(p["responses"].shape[1] for p in parts)
    out = []
    for p in parts:
        extra = r - p["responses"].shape[1]
        if extra:
            t = p.tensors()
            for k in ("responses", "behaviour_logprobs", "response_mask"):
                t[k] = torch.nn.functional.pad(t[k], (0, extra))
            p = Batch(t, p.fields, p.meta)
        out.append(p)
    return out
