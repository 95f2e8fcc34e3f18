"""A weight sync that fails between buckets ends with `abort_weight_update` on every inference worker, whatever the
transport: the hf engine puts back what the sync wrote and serves the old weights whole under the old version. It
used to be ended with `finish_weight_update` (in a `finally`), so the engines served the buckets received before the
failure mixed with the old weights, under a bumped weight version. Engines without `abort_weight_update` (a plugin's)
are still finished.

The trainer is a fake group on the local backend whose engine yields perturbed copies of the tiny model's weights;
the inference side is a real local InferGroup. Failures: the trainer's weight iterator raises after some buckets
(in-process and `dist`: a sender that died), or `ray.get` of a bucket fails (object store, and the restore of a
restarted rank through it; `ray` is a fake module: put keeps the object, get can lose one).
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

import pytest
import torch

from roll_core.cluster.roles import InferGroup, InferWorker, TrainWorker
from roll_core.cluster.weight_sync import TRANSPORT_CLASSES, WeightSync
from roll_core.cluster.worker import Dispatch, dispatch_mode
from roll_core.interfaces import Request, SamplingParams
from roll_core.models import resolve_model_path
from roll_core.protocol import Batch
from roll_hw.cpu import CpuPlatform

PROMPTS = [[5, 17, 42, 9], [3, 8]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
FAIL_AFTER = 10  # tensors the trainer yields before it fails: several buckets of 4 KiB reached the engines


class _Done:
    """A finished call's per-rank results (or its error), as group handles give them."""

    def __init__(self, fn: Any) -> None:
        self.out: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Any) -> None:
        try:
            self.out = [fn()]
        except BaseException as exc:
            self.error = exc

    def wait(self, timeout: float | None = None) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def values(self) -> list[Any]:
        self.wait()
        if self.error is not None:
            raise self.error
        return self.out


class _Trainer:
    """The trainer's group (one rank, local backend) around a real TrainWorker whose engine yields `weights`, and
    raises after `fail_after` of them when set. `submit` runs the call on a thread (the `dist` sender must run while
    the receivers, called in this thread, receive)."""

    backend, world_size = "local", 1

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights, self.fail_after = weights, None
        self.worker = TrainWorker.__new__(TrainWorker)
        self.worker.rank, self.worker.engine, self.worker.weight_format = 0, self, "merged"
        self.worker._sync_group = self.worker._sync_store = None

    def iter_weights(self, changed_only: bool = False):
        for i, (name, value) in enumerate(self.weights.items()):
            if i == self.fail_after:
                raise RuntimeError("trainer rank 0 died between buckets")
            yield name, value

    def call(self, method: Any, *args: Any) -> Any:
        out = getattr(self.worker, method.__name__)(*args)
        return out if dispatch_mode(TrainWorker, method.__name__) is Dispatch.RANK0 else [out]

    def submit(self, method: Any, *args: Any) -> _Done:
        return _Done(lambda: getattr(self.worker, method.__name__)(*args))


class _Ref:
    def __init__(self, value: Any, index: int) -> None:
        self.value, self.index = value, index


def _fake_ray(monkeypatch: pytest.MonkeyPatch, lost: int) -> None:
    """`ray.put` keeps the bucket; `ray.get` of the `lost`-th one fails as a lost object does."""
    put: list[_Ref] = []

    def get(ref: _Ref) -> Any:
        if ref.index == lost:
            raise RuntimeError(f"ObjectLostError: bucket {ref.index} was lost (its owner, the trainer, died)")
        return ref.value

    fake = types.SimpleNamespace(put=lambda v: put.append(_Ref(v, len(put))) or put[-1], get=get)
    monkeypatch.setitem(sys.modules, "ray", fake)


def _perturbed(path: str) -> dict[str, torch.Tensor]:
    """The tiny model's weights, each moved by noise: the trainer's after a (large) step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    return {k: v.detach() + 0.5 * torch.randn(v.shape, generator=gen) for k, v in model.named_parameters()}


def _infer(path: str, ranks: int, engine: dict[str, Any] | None = None) -> InferGroup:
    runtime: dict[str, Any] = {"model_path": path, "max_new_tokens": 8}
    if engine is None:
        from roll_engines.config import HFInferEngineConfig

        engine, runtime["num_threads"] = vars(HFInferEngineConfig()), 1
    return InferGroup(InferWorker, ranks, "local", engine=engine, runtime=runtime)


@pytest.mark.parametrize("transport", ["inprocess", "object_store", "dist", "restore"])
def test_a_sync_that_fails_between_buckets_leaves_every_engine_on_its_old_weights(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = resolve_model_path("builtin:tiny")
    trainer = _Trainer(_perturbed(path))
    infer = _infer(path, 1 if transport == "dist" else 2)  # local ranks run one after the other: one joins a group
    try:
        sync = WeightSync(
            trainer, infer, transport="auto", bucket_mb=4 / 1024, placement="colocated", platform=CpuPlatform
        )
        if transport in ("object_store", "dist"):
            kw = {"bucket_bytes": sync.bucket_bytes, "dtype": sync.dtype, "dist_backend": "gloo", "wide": sync.wide}
            sync.transport = TRANSPORT_CLASSES[transport](trainer, infer, **kw)
        if transport in ("object_store", "restore"):
            _fake_ray(monkeypatch, lost=3)
        else:
            trainer.fail_after = FAIL_AFTER
        ranks = list(range(infer.world_size))
        received = [0] * len(ranks)
        for r in ranks:  # counts what reached each engine: the failure came after some of the sync was applied
            engine = infer.workers[r].engine
            apply = engine.update_weights
            engine.update_weights = lambda named, r=r, apply=apply: (
                received.__setitem__(r, received[r] + 1) or apply(named)
            )
        prompts = Batch(fields={"prompt_ids": PROMPTS})
        before = infer.generate(prompts, GREEDY, n=1)["responses"]
        versions = [infer.submit_request(Request(f"v{r}", PROMPTS[0], GREEDY), rank=r).result(60) for r in ranks]
        versions = [o.weight_version for o in versions]

        with pytest.raises(RuntimeError, match=r"died between buckets|ObjectLostError"):
            if transport == "restore":
                sync.restore(ranks)  # restarted ranks given the trainer's weights through the object store
            else:
                sync.sync()
        # Buckets were applied before the failure on every rank (through the object store too: local ranks read one
        # after the other, and rank 0's failure no longer keeps the call from rank 1).
        assert min(received) >= 2, received

        after = infer.generate(prompts, GREEDY, n=1)["responses"]
        assert torch.equal(after, before), (before, after)
        now = [infer.submit_request(Request(f"a{r}", PROMPTS[0], GREEDY), rank=r).result(60) for r in ranks]
        assert [o.weight_version for o in now] == versions  # the old weights, under the old version

        # The next sync goes through: the engines take the trainer's weights and count a version.
        trainer.fail_after = None
        if transport in ("object_store", "restore"):
            _fake_ray(monkeypatch, lost=-1)
        sync.sync()
        synced = infer.generate(prompts, GREEDY, n=1)["responses"]
        assert not torch.equal(synced, before)  # the perturbation changes what is generated
        now = [infer.submit_request(Request(f"s{r}", PROMPTS[0], GREEDY), rank=r).result(60) for r in ranks]
        assert [o.weight_version for o in now] == [v + 1 for v in versions]
    finally:
        infer.shutdown()


def test_an_engine_without_abort_weight_update_is_finished_after_a_failed_sync() -> None:
    """The plugin engine `recompute` has no `abort_weight_update` and holds a lock from `begin_weight_update` to
    `finish_weight_update`: a failed sync must still finish it, or it never generates again."""
    pytest.importorskip("roll_dummy_engine")
    from roll_dummy_engine import RecomputeInferEngineConfig

    path = resolve_model_path("builtin:tiny")
    trainer = _Trainer(_perturbed(path))
    trainer.fail_after = FAIL_AFTER
    infer = _infer(path, 1, vars(RecomputeInferEngineConfig()))
    try:
        assert not hasattr(infer.workers[0].engine, "abort_weight_update")
        sync = WeightSync(
            trainer, infer, transport="auto", bucket_mb=4 / 1024, placement="colocated", platform=CpuPlatform
        )
        first = infer.submit_request(Request("before", PROMPTS[0], GREEDY)).result(60)
        with pytest.raises(RuntimeError, match="died between buckets"):
            sync.sync()
        # Finished (its lock released): it generates, and counts the sync as finish_weight_update does.
        out = infer.submit_request(Request("after", PROMPTS[0], GREEDY)).result(60)
        assert len(out.token_ids) == 8 and out.weight_version == first.weight_version + 1
    finally:
        infer.shutdown()


def test_an_abort_that_comes_while_a_dist_receive_runs_waits_for_it_and_undoes_every_bucket() -> None:
    """The controller gives up on a `dist` sync while a receiver still receives (the trainer's call timed out, or
    `DistTransport.receivers_grace_s` passed) and aborts it, over a real gloo group: a Ray actor serves calls on a
    pool of threads, so the abort ran beside the receive. The engine put back its old weights, then the rest of the
    sync (the trainer resumed) was written into them: a mix served under the old version. The abort now waits for
    the receive to return, then undoes both buckets: the old weights whole, under the old version."""
    from roll_core.cluster.buckets import SyncGroup

    path = resolve_model_path("builtin:tiny")
    new = _perturbed(path)
    infer = _infer(path, 1)
    worker, engine = infer.workers[0], infer.workers[0].engine
    store = SyncGroup.host_store("127.0.0.1", 2, timeout_s=60)
    sender: SyncGroup | None = None
    try:
        prompts = Batch(fields={"prompt_ids": PROMPTS})
        before = infer.generate(prompts, GREEDY, n=1)["responses"]
        version = infer.submit_request(Request("v", PROMPTS[0], GREEDY)).result(60).weight_version
        steps: list[str] = []
        landed = threading.Event()
        apply, abort = engine.update_weights, engine.abort_weight_update
        engine.update_weights = lambda named: (apply(named), steps.append("bucket"), landed.set())[0]
        engine.abort_weight_update = lambda reason: (steps.append("abort"), abort(reason))[1]

        infer.begin_weight_update()

        def receive() -> int:
            worker.join_sync_group("127.0.0.1", store.port, 2, "gloo")
            return worker.receive_weights_dist()

        receiving = _Done(receive)
        sender = SyncGroup("127.0.0.1", store.port, 0, 2, "gloo", timeout_s=60, store=store)
        names = list(new)
        sender.send([(k, new[k]) for k in names[: len(names) // 2]])
        assert landed.wait(30), "the first bucket never reached the engine"
        aborting = _Done(lambda: worker.abort_weight_update("the trainer's call timed out"))
        aborting.wait(1.0)  # time for an abort that does not wait to end the sync before the rest arrives
        sender.send([(k, new[k]) for k in names[len(names) // 2 :]])  # the trainer resumes: the rest of the sync
        sender.send(None)
        assert receiving.wait(30) and aborting.wait(30), "the receive or the abort never ended"
        assert receiving.values()[0] > 0 and aborting.values() == [version]

        after = infer.generate(prompts, GREEDY, n=1)["responses"]
        assert torch.equal(after, before), (before, after)
        assert infer.submit_request(Request("a", PROMPTS[0], GREEDY)).result(60).weight_version == version
        assert steps == ["bucket", "bucket", "abort"]  # the abort ran once the receive had returned
    finally:
        worker._sync_group = sender = None
        infer.shutdown()


def test_a_begin_that_fails_on_one_rank_leaves_no_other_rank_paused() -> None:
    """`begin_weight_update` pauses an engine's generation until the sync ends. When it raised on rank 1 (its engine
    could not begin), the sync raised before any abort, and rank 0, begun, stayed paused: its requests waited
    forever. Every rank is now ended by `abort_weight_update` (the hf engine's abort takes a rank whose begin failed)
    and serves its old weights under its old version; the next sync goes through."""
    path = resolve_model_path("builtin:tiny")
    trainer = _Trainer(_perturbed(path))
    infer = _infer(path, 2)
    try:
        sync = WeightSync(
            trainer, infer, transport="auto", bucket_mb=4 / 1024, placement="colocated", platform=CpuPlatform
        )
        prompts = Batch(fields={"prompt_ids": PROMPTS})
        before = infer.generate(prompts, GREEDY, n=1)["responses"]
        versions = [infer.submit_request(Request(f"v{r}", PROMPTS[0], GREEDY), rank=r).result(60) for r in (0, 1)]
        engine = infer.workers[1].engine
        begin = engine.begin_weight_update

        def refuse() -> None:
            raise RuntimeError("rank 1's engine could not begin the sync")

        engine.begin_weight_update = refuse
        with pytest.raises(RuntimeError, match="could not begin"):
            sync.sync()
        # Rank 0 generates (it waited in its pause: the request timed out), on its old weights and version.
        out = [infer.submit_request(Request(f"a{r}", PROMPTS[0], GREEDY), rank=r).result(30) for r in (0, 1)]
        assert [o.weight_version for o in out] == [o.weight_version for o in versions]
        assert torch.equal(infer.generate(prompts, GREEDY, n=1)["responses"], before)

        engine.begin_weight_update = begin
        assert sync.sync().version == versions[0].weight_version + 1
        assert not torch.equal(infer.generate(prompts, GREEDY, n=1)["responses"], before)
    finally:
        infer.shutdown()
