"""The inference role: `InferWorker` hosts an `InferEngine` (actor_infer) and `InferGroup` is the controller's
typed handle on its ranks.

Two APIs: the batch API (`InferGroup.generate(batch, params, n)`, split over the ranks, rows seeded by their place
in the whole batch so the samples do not depend on the number of ranks) for RLVR, and the request API
(`submit_request` -> `RequestHandle`, least-loaded or conversation-pinned routing) for multi-turn and partial
rollout. The receiving side of weight sync (roll_core.cluster.weight_sync) is here too. The worker builds its engine
in its constructor, on the actor's main thread (roll_core.cluster.engine_worker).

The steps of a weight update on one worker (begin, each receive, finish, abort) run one at a time, under one
lock: a Ray actor serves the request API on a pool of threads (`max_concurrency`), and a failed sync's
`abort_weight_update` may come while a receive the controller stopped waiting for still runs (a `dist` receiver
still in a broadcast after `DistTransport.receivers_grace_s`, or a rank still applying its last bucket when another
rank's error was raised first). Run beside it, the abort put back the old weights and a bucket landing afterwards
was written into them: a mix, served under the old version. The abort waits until the receive returned or failed
(a receiver stuck in a broadcast leaves it at the sync group's timeout, or dies with the trainer's connection).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from concurrent.futures import Future
from typing import Any

import torch

from roll_core.cluster.buckets import Bucket, SyncGroup, discard, open_cuda
from roll_core.cluster.engine_worker import EngineWorker, build_engine
from roll_core.cluster.group import Handle, WorkerGroup
from roll_core.cluster.worker import Dispatch, by_value, dispatch
from roll_core.interfaces import InferEngine, Request, RequestOutput, SamplingParams
from roll_core.interfaces.runtime import InferEngineRuntime
from roll_core.protocol import Batch
from roll_core.seeds import Purpose, derive_seed

#: The tensor InferGroup.generate adds to a batch before splitting it: each prompt's index in the whole batch.
PROMPT_INDEX = "prompt_index"
#: Meta key of a rank's `generate` result: its engine's pad id (InferGroup.generate pads narrower ranks with it).
PAD_ID = "pad_id"


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
        pad = getattr(self.engine, "pad_id", None)
        if isinstance(pad, int):  # what InferGroup.generate pads a narrower rank's responses with
            out.meta[PAD_ID] = pad
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
    def _update_lock(self) -> threading.Lock:
        """The lock each weight-update step holds (module docstring). Made on first use, atomically (a dict's
        setdefault under the GIL), so a worker built without its constructor (a test's receiving side) has one."""
        return self.__dict__.setdefault("_weight_update_lock", threading.Lock())

    # retry=False: a step of a sync is meaningless alone on a restarted engine; WeightSync redoes the whole sync.
    @dispatch(Dispatch.BROADCAST, retry=False)
    def begin_weight_update(self) -> None:
        with self._update_lock():
            self.engine.begin_weight_update()

    @dispatch(Dispatch.BROADCAST, retry=False)
    def finish_weight_update(self) -> int:
        with self._update_lock():
            return self.engine.finish_weight_update()

    @dispatch(Dispatch.BROADCAST, retry=False)
    def abort_weight_update(self, reason: str) -> int:
        """End a sync that failed outside the engine (the trainer died between buckets, a bucket could not be
        fetched): the engine puts back what the sync wrote and keeps its weight version. Engines without the
        optional `abort_weight_update` (roll_core.interfaces.InferEngine) are finished as before: they must resume
        generating (a plugin's engine may hold a lock from `begin_weight_update` until `finish_weight_update`)."""
        with self._update_lock():
            abort = getattr(self.engine, "abort_weight_update", None)
            if not callable(abort):
                return self.engine.finish_weight_update()
            return abort(reason)

    @dispatch(Dispatch.BROADCAST, retry=False)
    def receive_bucket(self, bucket: Bucket) -> int:
        """In-process transport: one bucket of the trainer's tensors (live parameters, never kept)."""
        with self._update_lock():
            return self.engine.update_weights(bucket)

    @dispatch(Dispatch.BROADCAST, retry=False)
    def receive_weights_object_store(self, refs: list[Any]) -> int:
        import ray

        with self._update_lock():
            nbytes = 0
            for ref in refs:
                bucket: Bucket | dict[str, torch.Tensor] = ray.get(ref)
                nbytes += self.engine.update_weights(bucket.items() if isinstance(bucket, dict) else bucket)
                del bucket
            return nbytes

    @dispatch(Dispatch.BROADCAST, retry=False)
    def join_sync_group(self, host: str, port: int, world_size: int, backend: str, timeout_s: float = 600.0) -> None:
        """Join the weight-sync group at `host:port` as rank 1 + this rank, closing the group held before first.
        Not under the update lock: a receive still stuck in the old group (its sync failed) must not delay the new
        rendezvous (closed, the old group's next broadcast raises; NCCL's abort also ends one in progress)."""
        group, self._sync_group = getattr(self, "_sync_group", None), None
        discard(group)
        self._sync_group = SyncGroup(host, port, 1 + self.rank, world_size, backend, timeout_s)

    @dispatch(Dispatch.BROADCAST, retry=False)
    def receive_weights_dist(self) -> int:
        with self._update_lock():
            # An engine's error (a weight it does not have) is raised once the trainer's broadcast ended (receive_all).
            return self._sync_group.receive_all(self.engine.update_weights)

    @dispatch(Dispatch.BROADCAST, retry=False)
    def receive_ipc_bucket(self, shared: list[dict[str, Any]]) -> int:
        with self._update_lock():
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
        """The request's output (a copy of the engine's on the local backend, as Ray deserialises one per read)."""
        if isinstance(self._pending, Future):
            return _output_copy(self._pending.result(timeout))
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
        # A rank given no prompts (fewer prompts than engines: a refill round, a small eval set) lacks the per-row
        # fields an engine adds only with rows (MoE routing, `routed_experts_rows`): Batch.concat refused its keys.
        rows = [p for p in parts if len(p)] or parts[:1]
        pad = next((p.meta[PAD_ID] for p in parts if PAD_ID in p.meta), 0)
        out = Batch.concat(_pad_responses(rows, pad))
        out.meta.pop(PAD_ID, None)
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
            # By value, as over Ray (roll_core.cluster.worker.by_value): the engine gets its own token list, so a
            # caller changing its request after the submit (or an engine changing it) changes nothing on the other
            # side; RequestHandle.result hands out a copy of the output for the same reason.
            request = dataclasses.replace(request, prompt_ids=list(request.prompt_ids))
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

    def abort_weight_update(self, reason: str) -> list[int]:
        """End a failed sync on every rank (InferWorker.abort_weight_update): the weight versions, unchanged where
        the engine can undo the sync."""
        return self.call(InferWorker.abort_weight_update, reason)


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


def _output_copy(out: RequestOutput) -> RequestOutput:
    """`out` by value: its lists and routing tensor copied (roll_core.cluster.worker.by_value), so the caller and the
    engine (which may keep what it returned, or hand the request's own `prompt_ids` back) never share them."""
    if not isinstance(out, RequestOutput):  # a test double's future: as it is
        return out
    return dataclasses.replace(
        out,
        prompt_ids=list(out.prompt_ids),
        token_ids=list(out.token_ids),
        logprobs=list(out.logprobs),
        routed_experts=by_value(out.routed_experts),
    )


def _stable_hash(key: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def _pad_responses(parts: list[Batch], pad_id: int = 0) -> list[Batch]:
    """Ranks return responses of different lengths R_i: right-pad all to the longest before concatenating, responses
    with the engine's `pad_id` (as each engine pads its own rows: padded with 0, the rows of a narrower rank held a
    real token id where one engine's held the pad id, so a batch differed with the number of engines), the
    log-probs and the mask with 0."""
    r = max(p["responses"].shape[1] for p in parts)
    out = []
    for p in parts:
        extra = r - p["responses"].shape[1]
        if extra:
            t = p.tensors()
            for k in ("responses", "behaviour_logprobs", "response_mask"):
                t[k] = torch.nn.functional.pad(t[k], (0, extra), value=pad_id if k == "responses" else 0)
            p = Batch(t, p.fields, p.meta)
        out.append(p)
    return out
