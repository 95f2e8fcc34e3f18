"""Role workers of the RLVR pipeline and their typed worker-group wrappers.

Roles: `TrainWorker` hosts a `TrainEngine` (actor_train, critic, reference, by the engine's `role`),
`InferWorker` hosts an `InferEngine` (actor_infer), `RewardWorker` scores responses with a task's reward. Engines
are built from their `_target_` configs, so roll-core never imports an engine package; the contracts they satisfy
are the protocols in roll_core.interfaces. Each `*Group` class exposes exactly the calls the controller makes,
with types: `actor_infer.generate(batch, params, n=8) -> Batch`; each runs the worker method it names
(`self.call(InferWorker.generate, ...)`, roll_core.cluster.group), never a method name as a string.

The inference role lives in roll_core.cluster.infer_role and the engine-hosting base (`WORKER_KEYS`,
`build_engine`, the thread engines are built on) in roll_core.cluster.engine_worker; their names are re-exported
here.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from roll_core.cluster.buckets import SyncGroup, bucket_nbytes, buckets, cast, discard, share_cuda
from roll_core.cluster.engine_worker import WORKER_KEYS, EngineWorker, build_engine, engine_kwargs
from roll_core.cluster.group import WorkerGroup
from roll_core.cluster.infer_role import PROMPT_INDEX, InferGroup, InferWorker, RequestHandle
from roll_core.cluster.worker import Dispatch, Worker, dispatch, node_address
from roll_core.config.build import build
from roll_core.interfaces import Task, TrainEngine
from roll_core.interfaces.runtime import TrainEngineRuntime
from roll_core.interfaces.training import METRIC_WEIGHT_PREFIX, is_max_metric, largest
from roll_core.protocol import Batch
from roll_core.seeds import Purpose, derive_seed

__all__ = [  # the engine worker's and the inference role's names stay importable from here
    "PROMPT_INDEX",
    "WORKER_KEYS",
    "EngineWorker",
    "InferGroup",
    "InferWorker",
    "RequestHandle",
    "RewardGroup",
    "RewardWorker",
    "TrainGroup",
    "TrainWorker",
    "build_engine",
    "engine_inputs",
    "engine_kwargs",
    "merge_rank_metrics",
]

log = logging.getLogger(__name__)


class TrainWorker(EngineWorker):
    """Hosts a training engine (policy, critic or frozen reference)."""

    def __init__(self, engine: dict[str, Any], runtime: TrainEngineRuntime, **base: Any) -> None:
        super().__init__(**base)
        self._engine_cfg, self._runtime = engine, runtime
        self._sync_group: SyncGroup | None = None
        self._sync_store: Any = None  # rank 0's weight-sync TCPStore, opened by sync_endpoint, until its group owns it
        self._ipc: Any = None  # the cuda_ipc sync in progress: its bucket iterator and the buffer last shared
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
        """Full CPU weights on rank 0 (None elsewhere); collective on sharded engines: every rank iterates, only rank 0
        keeps copies (each rank held the whole model in host memory)."""
        weights = {}
        for k, v in self.engine.iter_weights():
            if self.rank == 0:
                weights[k] = v.detach().to("cpu", copy=True)
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
        """What `weight_buckets` yields from now on: "merged" weights or the LoRA "adapter" alone.

        Called when the run's WeightSync is built, before the first rollout: an engine's optional
        `check_adapter_sync()` raises here what its `iter_adapter` would refuse (an adapter on an embedding that a
        target regex reached without naming it), not at the first sync after a rollout and a training step."""
        if weight_format == "adapter" and not callable(getattr(self.engine, "iter_adapter", None)):
            raise ValueError(f"train engine {type(self.engine).__name__} cannot export a LoRA adapter alone")
        check = getattr(self.engine, "check_adapter_sync", None)
        if weight_format == "adapter" and callable(check):
            check()
        self.weight_format = weight_format

    @dispatch(Dispatch.BROADCAST)
    def publish_weights(
        self, bucket_bytes: int, changed_only: bool, dtype: str | None = None, wide: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """Object-store transport: rank 0 puts CPU buckets in Ray's object store and returns their refs. A put that
        fails (the object store full) is raised once every bucket has been iterated: on a sharded engine the
        iteration is a collective, and the other ranks waited in its next all-gather until their group timed out."""
        import ray

        refs, nbytes, ntensors = [], 0, 0
        failure: Exception | None = None
        for bucket in self.weight_buckets(bucket_bytes, changed_only, dtype, wide):  # every rank iterates, to the end
            if self.rank == 0 and failure is None:
                try:
                    cpu = [(k, v.detach().to("cpu", copy=True)) for k, v in bucket]
                    refs.append(ray.put(cpu))
                except Exception as exc:
                    failure = exc
                    continue
                nbytes += bucket_nbytes(cpu)
                ntensors += len(cpu)
        if failure is not None:
            raise failure
        return {"refs": refs, "bytes": nbytes, "tensors": ntensors}

    @dispatch(Dispatch.RANK0)
    def sync_endpoint(self, world_size: int, timeout_s: float = 600.0) -> tuple[str, int]:
        """This node's address and the port of the weight-sync rendezvous rank 0 now listens on."""
        # A new rendezvous replaces the last one (a failed sync, a restarted engine): its group and store (the port
        # it listens on) are closed now, not whenever the last reference to them goes.
        group, self._sync_group, self._sync_store = getattr(self, "_sync_group", None), None, None
        discard(group)
        host = node_address()
        self._sync_store = SyncGroup.host_store(host, world_size, timeout_s)
        return host, int(self._sync_store.port)

    @dispatch(Dispatch.BROADCAST)
    def join_sync_group(self, host: str, port: int, world_size: int, backend: str, timeout_s: float = 600.0) -> None:
        """Rank 0 joins the weight-sync group at `host:port` (its own store, from `sync_endpoint`), closing the
        group it held before first; a rendezvous that fails leaves no group (the stale one is never reused)."""
        if self.rank == 0:
            group, self._sync_group = getattr(self, "_sync_group", None), None
            discard(group)
            store = getattr(self, "_sync_store", None)
            self._sync_group = SyncGroup(host, port, 0, world_size, backend, timeout_s, store=store)
            self._sync_store = None  # the group holds it now: closing the group releases its port

    @dispatch(Dispatch.BROADCAST)
    def send_weights_dist(
        self, bucket_bytes: int, changed_only: bool, dtype: str | None = None, wide: dict[str, str] | None = None
    ) -> dict[str, int]:
        it = self.weight_buckets(bucket_bytes, changed_only, dtype, wide)
        if self.rank == 0:  # a failure while producing a bucket ends the sync on the receivers (SyncAbortedError)
            return self._sync_group.send_all(it)
        for _ in it:  # every rank iterates: a collective on sharded engines
            pass
        return {"bytes": 0, "tensors": 0, "buckets": 0}

    @dispatch(Dispatch.BROADCAST)
    def start_ipc_sync(
        self, bucket_bytes: int, changed_only: bool, dtype: str | None = None, wide: dict[str, str] | None = None
    ) -> None:
        """CUDA IPC transport: begin a sync (`next_ipc_bucket` yields its buckets). One left unfinished (it failed
        part way) is ended first: its iterator closed, its last buffer released."""
        self.end_ipc_sync()
        self._ipc = {"it": self.weight_buckets(bucket_bytes, changed_only, dtype, wide), "keep": None}

    @dispatch(Dispatch.BROADCAST)
    def next_ipc_bucket(self) -> dict[str, Any] | None:
        """CUDA IPC transport: the next bucket of full tensors on this rank's device, as an IPC handle; None once the
        sync ended. A bucket that cannot be produced or shared ends the sync here (`end_ipc_sync`) before raising."""
        ipc = getattr(self, "_ipc", None)
        if ipc is None:
            raise RuntimeError("next_ipc_bucket outside a cuda_ipc weight sync: call start_ipc_sync first")
        ipc["keep"] = None  # the receivers copied the previous bucket
        try:
            bucket = next(ipc["it"], None)
            if bucket is None:
                self.end_ipc_sync()
                return None
            handle, specs, flat = share_cuda(bucket)
        except BaseException:
            self.end_ipc_sync()  # the sync cannot go on: nothing of it stays on the device until the next one
            raise
        ipc["keep"] = flat
        return {"handle": handle, "specs": specs, "bytes": bucket_nbytes(bucket)}

    @dispatch(Dispatch.BROADCAST)
    def end_ipc_sync(self) -> None:
        """CUDA IPC transport: end the sync in progress, if any: release the buffer last shared and close the bucket
        iterator (the weights it was producing). Idempotent. For a controller whose sync failed on the receiving
        side: the buffer and the iterator's tensors were otherwise held on the device until the next sync started.
        A failure closing the iterator is logged: it must not keep a new sync from starting."""
        ipc, self._ipc = getattr(self, "_ipc", None), None
        if ipc is None:
            return
        ipc["keep"] = None
        close = getattr(ipc["it"], "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                log.warning(
                    "weight sync: the bucket iterator of an unfinished cuda_ipc sync failed to close", exc_info=True
                )


def engine_inputs(batch: Batch) -> dict[str, Any]:
    """What a train engine takes: the batch's tensors, plus its per-row pictures (`mm_inputs`: one
    roll_core.multimodal.MMInputs or None per row) when a row has some."""
    out: dict[str, Any] = batch.tensors()
    mm = batch["mm_inputs"] if "mm_inputs" in batch else None
    if mm is not None and any(m is not None for m in mm):
        out["mm_inputs"] = list(mm)
    return out


class RewardWorker(Worker):
    """Decodes responses and scores them with the task's reward, guarded (roll_core.cluster.reward_guard): a row
    whose reward raises, hangs or is NaN/inf scores a fixed value and is counted; it never fails the call.

    A reply whose prompt (`prompt_ids`: the chat-templated prompt) opened a `<think>` block reaches the reward with
    the tag put back (roll_core.thinking.reply_text). Opened means: the chat template's own generation header opens
    the block (`header_opens_think`, rendered with `chat_template_kwargs`: model.chat_template_kwargs, as the prompts
    were) and the prompt's ids end inside it (`opens_think`); a prompt whose user text ends with `<think>` opens
    nothing. A tokenizer without a chat template (the prompts used a processor's own) falls back to the ids alone.

    Stateless between calls: a restarted reward worker needs nothing restored.
    """

    def __init__(
        self,
        env: dict[str, Any],
        tokenizer_path: str,
        guard: dict[str, Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        **base: Any,
    ) -> None:
        super().__init__(**base)
        from transformers import AutoTokenizer

        from roll_core.cluster.reward_guard import GuardedReward

        self.task: Task = build(env)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.reward = GuardedReward(self.task.reward, name=f"reward worker {self.rank}", **(guard or {}))
        self.header_opens_think = template_opens_think(self.tokenizer, chat_template_kwargs)

    @dispatch(Dispatch.DP)
    def score(self, batch: Batch) -> Batch:
        texts = [
            self.tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True)
            for r, m in zip(batch["responses"], batch["response_mask"])
        ]
        # A template that opens <think>: the reply's reasoning carries no opening tag. (A worker state without the
        # header's verdict, as tests build one, reads the ids alone.)
        if "prompt_ids" in batch and getattr(self, "header_opens_think", None) is not False:
            from roll_core.thinking import opens_think, reply_text

            replies = [reply_text(t, opens_think(self.tokenizer, p)) for t, p in zip(texts, batch["prompt_ids"])]
        else:
            replies = texts
        # The prompt's text and the row's metadata reach rewards that declare them (judges, remote verifiers,
        # instruction following, multi-domain routing).
        res = self.reward.score(
            replies,
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


def template_opens_think(tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> bool | None:
    """Whether `tokenizer`'s chat template opens `<think>` in its generation header, rendered with
    `chat_template_kwargs` (roll_core.thinking.header_opens_think); None (logged) where it has no chat template or
    cannot render one: the prompt's ids alone then decide."""
    from roll_core.thinking import header_opens_think

    if not getattr(tokenizer, "chat_template", None):
        log.info("reward worker: the tokenizer has no chat template: a prompt's last ids say whether it opened <think>")
        return None
    try:
        return header_opens_think(tokenizer, (), chat_template_kwargs)
    except Exception as exc:  # a template that needs other messages (a system one) or renders no plain user turn
        log.warning(
            "reward worker: the chat template's generation header could not be read (%s: %s): a prompt's last ids "
            "say whether it opened <think>",
            type(exc).__name__,
            exc,
        )
        return None


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
    no reporting rank has weight (an empty batch), the reporting ranks weigh alike. A maximum (`*_max`,
    `is_max_metric`) is the largest of the ranks' values. The weight keys are dropped."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for d in per_rank for k in d if not k.startswith(METRIC_WEIGHT_PREFIX)):
        wkey = METRIC_WEIGHT_PREFIX + key
        reporting = [(d, n) for d, n in zip(per_rank, rows, strict=True) if key in d]
        if is_max_metric(key):
            out[key] = largest([d[key] for d, _ in reporting])
            continue
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
        # One result per replica, in data-parallel order (Handle.values): replica d trained sizes[d] rows. (Read as
        # global ranks, `dp_rank(d)` put a tensor-parallel mesh's replica 1 at rank 1, replica 0's second TP rank.)
        return merge_rank_metrics(per_rank, Batch.split_sizes(len(batch), self.mesh.dp))

    def get_weights(self) -> dict[str, torch.Tensor]:
        """Full CPU weights (tests, tools; the pipeline syncs through roll_core.cluster.weight_sync)."""
        return self.call(TrainWorker.get_weights)[0]

    def save(self, folder: str, tokenizer_path: str | None = None) -> None:
        self.call(TrainWorker.save, folder, tokenizer_path)

    def load(self, folder: str) -> None:
        self.call(TrainWorker.load, folder)


class RewardGroup(WorkerGroup[RewardWorker]):
    """reward. Restartable: reward workers hold no state, so a re-created one just reruns the failed call."""

    worker_cls = RewardWorker
    restartable = True

    def score(self, batch: Batch) -> Batch:
        """Scores of every row. `meta["reward_counters"]`: the workers' summed counters (the guard's FAILURE_COUNTERS
        among them); `meta["reward_all_failed"]`: every row's score was replaced (the reward raised, hung or was
        NaN/inf on all); `meta["reward_failure"]`: the first failure as one line, or None."""
        from roll_core.cluster.reward_guard import all_rows_failed

        # prompt_ids: whether a prompt opened <think> (RewardWorker), read with the template's header
        context = [k for k in ("prompt_text", "metadata", "prompt_ids") if k in batch]
        handle = self.submit(RewardWorker.score, batch.select("responses", "response_mask", "answer", *context))
        parts = handle.values()
        out = Batch.concat(parts)
        out.meta["reward_counters"] = _sum_counters(parts)
        out.meta["reward_all_failed"] = all_rows_failed(out.meta["reward_counters"])
        failures = [p.meta["reward_failure"] for p in parts if p.meta.get("reward_failure")]
        out.meta["reward_failure"] = failures[0] if failures else None
        return out
