"""A discrete-event cluster simulator that drives the real `RolloutScheduler` (sync vs async vs partial rollout).

Nothing here is mocked on the scheduler's side: `Simulation` calls `capacity / start / pending / submitted /
on_result / take / begin_update / finish_update` exactly as `roll_core.scheduling.driver` does over real engines,
only the engines and the trainer are simulated, on a virtual clock (an event heap: no threads, no sleeping,
deterministic for a seed).

Model (every constant is a field of `Hardware` or `Workload`; defaults describe a Qwen3-8B-like policy on
H100-class accelerators, one engine per device):

- Decode is memory-bound continuous batching: one decode step of an engine takes `a + b * running` seconds and
  gives every running request one token; at most `max_running` requests run, the rest wait in the engine's FIFO
  queue. Admitting a request stalls its engine for `prefill_s_per_token * (prompt + prefix)` seconds (no prefix
  cache: a resumed request re-prefills its prefix). New requests go to the least-loaded engine (running + queued).
- Response lengths are long-tailed: log L = log(median) + sigma_prompt * z_group + sigma_sample * z_sample
  (a per-prompt difficulty shared by the group, plus per-sample noise), capped at `max_new_tokens` (those end
  with finish="length"). `length_stats` reports the distribution.
- The trainer needs `6 * params * tokens / (train_devices * flops_per_device)` seconds per batch (prompt +
  response tokens; `flops_per_device` is an *effective* rate that folds in MFU and the old/ref log-prob passes),
  then `weight_sync_s` to push weights; engines pause for that time (the trainer is busy for it too).
- Synchronous mode (async_ratio 0) is colocated: every device serves generation, then every device trains, then
  weights sync. Async modes are disaggregated: `train_fraction` of the devices train (default 3/8), the rest
  generate; `best_split` picks the fastest fraction of {1/8, 1/4, 3/8, 1/2} by simulating a small cluster.
- The batch is `batch_groups` groups (default: `groups_per_device * devices`, i.e. weak scaling).
- Without partial rollout a request runs across a weight update in place (its tokens mix versions; the scheduler
  books the oldest). With partial rollout it is aborted at `begin_update`, its prefix reported, and resumed after.

Omitted: prefix caching, chunked prefill, KV growth with context length (b is an average), preemption, network
contention, stragglers/failures, reward and environment latency (the "agentic" preset only has longer, more
variable responses), and any effect of staleness on learning.

`CountedScheduler` answers the scheduler's `complete()` from the driver's exact count (the stock scan makes every
refill quadratic in the batch); results are identical to the stock class (tested).

For speed, one simulated token id stands for `token_unit` real tokens (lengths are rounded up to whole units and
a step emits one unit); `token_unit=1` is exact. Token ids are response positions, so a trained sample must hold
exactly `range(L)`: checked at every batch, together with the staleness bound (the scheduler's book and an
independent one from the engines' weight versions) and conservation of every generated token.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from roll_core.scheduling.scheduler import GroupState, RolloutScheduler


@dataclass(frozen=True)
class Workload:
    """Prompts and response lengths (tokens) of one RL task."""

    name: str
    prompt_tokens: int  # mean; uniform in [0.75, 1.25] x this
    median_response: float
    sigma_prompt: float  # log-length spread shared by a group (prompt difficulty)
    sigma_sample: float  # log-length spread within a group
    max_new_tokens: int
    group_size: int
    groups_per_device: float  # batch = groups_per_device * devices groups (weak scaling)


PRESETS: dict[str, Workload] = {
    # Math RLVR (ROLL Flash's throughput-scaling runs use Qwen3-8B models): GRPO groups of 16, a 16k cap,
    # median 2k tokens, p99 ~15k, 0.7% truncated (our choice of parameters, not the paper's data).
    "rlvr": Workload("rlvr", 512, 2048.0, 0.6, 0.6, 16384, 16, 0.5),
    # Agentic stand-in: a multi-turn trajectory as one long, very variable generation (no environment latency).
    "agentic": Workload("agentic", 2048, 3072.0, 0.8, 0.75, 32768, 8, 0.5),
}


@dataclass(frozen=True)
class Hardware:
    """Costs of one accelerator (defaults: an 8B model on an H100-class device)."""

    params: float = 8e9
    flops_per_device: float = 1.5e14  # 989 TFLOP/s bf16 x 25% MFU x 6/10 (old + ref log-prob forwards)
    decode_base_s: float = 0.010  # a: weights read once per step
    decode_per_request_s: float = 0.0002  # b: KV reads and sampling per running request
    prefill_s_per_token: float = 5e-5  # ~20k prompt tokens/s
    max_running: int = 128
    engine_devices: int = 1  # tensor-parallel size of one engine
    weight_sync_s: float = 5.0


@dataclass(frozen=True)
class Mode:
    """A scheduling policy: async ratio k, partial rollout, and tail groups as a fraction of the batch."""

    name: str
    async_ratio: int
    partial: bool = False
    tail_fraction: float = 0.0


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("sync", 0),
        Mode("k1", 1),
        Mode("k2", 2),
        Mode("k1+partial", 1, partial=True),
        Mode("k1+tail", 1, tail_fraction=0.25),
    )
}
SPLITS = (1 / 8, 1 / 4, 3 / 8, 1 / 2)
DEFAULT_TRAIN_FRACTION = 3 / 8


@dataclass
class SimResult:
    """Metrics of one run, measured over the training steps after `warmup` (steady state)."""

    mode: str
    devices: int
    train_devices: int
    infer_devices: int
    batch_groups: int
    steps: int
    samples_per_s: float
    tokens_per_s: float  # trained response tokens per second (fairer than samples/s when drops bias lengths)
    util: float  # busy device-seconds / (devices x window)
    util_infer: float
    util_train: float
    mean_staleness: float
    max_staleness: int
    max_true_staleness: int  # from the engines' weight versions (never more than the scheduler's book)
    stale_groups: int
    resumed_requests: int
    trained_samples: int
    trained_mean_len: float  # mean response tokens of trained samples (vs `length_stats`: dropping is length-biased)
    wasted_token_frac: float  # generated tokens of dropped (stale) groups / all generated tokens
    sim_time: float
    events: int
    counters: dict[str, int] = field(default_factory=dict)


def _log_lengths(w: Workload, rng: random.Random) -> list[float]:
    zg = rng.gauss(0.0, 1.0)
    mu = math.log(w.median_response) + w.sigma_prompt * zg
    return [mu + w.sigma_sample * rng.gauss(0.0, 1.0) for _ in range(w.group_size)]


def sample_group(w: Workload, rng: random.Random, unit: int = 1) -> tuple[int, list[int]]:
    """(prompt units, response lengths in units) of one group."""
    prompt = math.ceil(w.prompt_tokens * rng.uniform(0.75, 1.25) / unit)
    cap = w.max_new_tokens // unit
    return prompt, [min(cap, max(1, math.ceil(math.exp(x) / unit))) for x in _log_lengths(w, rng)]


def length_stats(w: Workload, n_groups: int = 4000, seed: int = 0) -> dict[str, float]:
    """Response-length statistics (tokens) of a preset: mean, p50/p90/p99, share at the cap, mean group max."""
    rng = random.Random(seed)
    groups = [
        [min(w.max_new_tokens, max(1, math.ceil(math.exp(x)))) for x in _log_lengths(w, rng)] for _ in range(n_groups)
    ]
    flat = sorted(x for g in groups for x in g)
    q = lambda p: float(flat[min(len(flat) - 1, int(p * len(flat)))])
    return {
        "mean": sum(flat) / len(flat),
        "p50": q(0.5),
        "p90": q(0.9),
        "p99": q(0.99),
        "at_cap": sum(x >= w.max_new_tokens for x in flat) / len(flat),
        "group_max_mean": sum(max(g) for g in groups) / len(groups),
    }


@dataclass
class _Req:
    rid: str
    sample: object  # the scheduler's SampleState
    offset: int  # response position of the first token this request generates
    end: int  # response position where it stops (the sample's length)
    input_units: int
    finish: str
    join: int = 0  # engine step count at admission
    version: int = 0  # weights version of the engine at admission


class _Engine:
    """One continuous-batching engine; decode steps are not simulated one by one: the clock jumps to the next
    request completion (time = t0 + (steps to go) * dt, with dt constant while the running set is)."""

    def __init__(self, idx: int, hw: Hardware, unit: int) -> None:
        self.idx, self.unit = idx, unit
        self.a, self.b = unit * hw.decode_base_s, unit * hw.decode_per_request_s
        self.prefill, self.max_running = unit * hw.prefill_s_per_token, hw.max_running
        self.t0, self.s0, self.dt = 0.0, 0, self.a  # at t0 the engine has done s0 steps; dt per step now
        self.running: dict[str, _Req] = {}
        self.ends: list[tuple[int, str]] = []  # (step at which it completes, rid); lazy deletion
        self.queue: dict[str, _Req] = {}  # FIFO of requests waiting for a slot
        self.busy, self.epoch, self.version = 0.0, 0, 0

    def load(self) -> int:
        return len(self.running) + len(self.queue)

    def _advance(self, t: float) -> None:
        """Bring the engine to the first step boundary >= t (a step in progress completes with the old batch)."""
        if self.running:
            if t > self.t0:
                k = math.ceil((t - self.t0) / self.dt - 1e-6)
                self.s0 += k
                self.t0 += k * self.dt
                self.busy += k * self.dt
        elif t > self.t0:
            self.t0 = t

    def _steps_done(self, t: float) -> int:
        if self.running and t > self.t0:
            return self.s0 + int((t - self.t0) / self.dt + 1e-6)
        return self.s0

    def _start(self, req: _Req) -> None:
        """Admit a request: prefill stalls the engine, then it decodes from the next step on."""
        req.join, req.version = self.s0, self.version
        self.running[req.rid] = req
        heapq.heappush(self.ends, (self.s0 + req.end - req.offset, req.rid))
        stall = self.prefill * req.input_units
        self.t0 += stall
        self.busy += stall

    def _admit(self) -> None:
        while self.queue and len(self.running) < self.max_running:
            self._start(self.queue.pop(next(iter(self.queue))))
        self.dt = self.a + self.b * len(self.running)

    def submit(self, req: _Req, t: float) -> None:
        self._advance(t)
        if len(self.running) < self.max_running:
            self._start(req)
            self.dt = self.a + self.b * len(self.running)
        else:
            self.queue[req.rid] = req

    def abort(self, rid: str, t: float) -> tuple[_Req, int]:
        """Remove a request; returns it and the tokens (units) it generated by time t."""
        req = self.queue.pop(rid, None)
        if req is not None:
            return req, 0
        req = self.running[rid]
        gen = min(self._steps_done(t) - req.join, req.end - req.offset)
        self._advance(t)
        del self.running[rid]
        self._admit()
        return req, gen

    def pop_finished(self, t: float) -> list[_Req]:
        self._advance(t)
        done = []
        while self.ends and self.ends[0][0] <= self.s0:
            req = self.running.pop(heapq.heappop(self.ends)[1], None)
            if req is not None:
                done.append(req)
        self._admit()
        return done

    def pause(self, t: float, until: float) -> None:
        self._advance(t)
        self.t0 = max(self.t0, until)

    def next_time(self) -> float | None:
        while self.ends and self.ends[0][1] not in self.running:
            heapq.heappop(self.ends)
        return self.t0 + (self.ends[0][0] - self.s0) * self.dt if self.ends else None

    def busy_until(self, t: float) -> float:
        return self.busy + (max(0.0, t - self.t0) if self.running else 0.0)


_ENGINE, _TRAIN_DONE, _SYNC_DONE = 0, 1, 2


class SimulationError(AssertionError):
    """A contract the simulation checks was broken (staleness bound, token conservation, scheduler books)."""


def _check(ok: bool, msg: object) -> None:
    if not ok:  # not `assert`: the checks must survive python -O
        raise SimulationError(msg)


class CountedScheduler(RolloutScheduler):
    """The real `RolloutScheduler`, except that `complete()` returns the driver's exact count of complete groups.

    The stock `complete()` scans every sample of every group and `capacity()` (called by every `start`) calls it
    whenever an older-version group runs, so refilling B groups costs O(B x groups x group_size): minutes of
    Python at 1024 devices. Only the count changes, not the policy; `check=True` asserts it equals the scan."""

    def __init__(self, count: Callable[[], int], check: bool = False, **kw: int | bool) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self._count, self._check = count, check

    def complete(self) -> int:
        n = self._count()
        if self._check:
            _check(n == super().complete(), f"driver count {n} != scheduler scan {super().complete()}")
        return n


class Simulation:
    """One run: `devices` accelerators, one workload, one scheduling mode (see the module docstring)."""

    def __init__(
        self,
        devices: int,
        workload: Workload | str = "rlvr",
        mode: Mode | str = "sync",
        *,
        hardware: Hardware | None = None,
        steps: int = 20,
        warmup: int = 4,
        seed: int = 0,
        token_unit: int = 16,
        batch_groups: int | None = None,
        train_fraction: float | None = None,
        fast_count: bool = True,
        check_count: bool = False,
    ) -> None:
        self.w = PRESETS[workload] if isinstance(workload, str) else workload
        self.mode = MODES[mode] if isinstance(mode, str) else mode
        self.hw, self.unit = hardware or Hardware(), token_unit
        if self.w.max_new_tokens % token_unit:
            raise ValueError("max_new_tokens must be a multiple of token_unit")
        if not 0 <= warmup < steps:
            raise ValueError("need 0 <= warmup < steps")
        self.devices, self.steps, self.warmup = devices, steps, warmup
        self.B = batch_groups or max(1, round(self.w.groups_per_device * devices))
        k = self.mode.async_ratio
        self.colocated = k == 0
        tp = self.hw.engine_devices
        if self.colocated:
            self.n_train, self.n_infer = devices, devices
        else:
            frac = DEFAULT_TRAIN_FRACTION if train_fraction is None else train_fraction
            self.n_infer = max(tp, (devices - max(1, round(frac * devices))) // tp * tp)
            self.n_train = devices - self.n_infer
            if self.n_train < 1:
                raise ValueError(f"{devices} devices cannot hold a trainer and an engine of {tp}")
        self.rng = random.Random(seed)
        sched_kw: dict = dict(
            batch_groups=self.B,
            group_size=self.w.group_size,
            max_new_tokens=self.w.max_new_tokens // token_unit,
            async_ratio=k,
            tail_groups=round(self.mode.tail_fraction * self.B),
            partial_rollout=self.mode.partial,
        )
        self.sched = (
            CountedScheduler(lambda: self.n_ready, check_count, **sched_kw)
            if fast_count
            else RolloutScheduler(**sched_kw)
        )
        self.engines = [_Engine(i, self.hw, token_unit) for i in range(self.n_infer // tp)]
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = itertools.count()
        self.rids = itertools.count()
        self.now = 0.0
        self.req_engine: dict[str, _Engine] = {}
        self.true_min: dict[tuple[int, int], int] = {}  # oldest engine version of any token of a sample
        self.buffer: list[GroupState] = []
        self.n_ready = 0  # complete groups in the scheduler (taken or dropped ones leave)
        self.trainer_busy = False
        self.step = 0
        self.train_busy = 0.0  # seconds the trainer computed
        self.units = {"generated": 0, "ignored": 0, "trained": 0, "dropped": 0}
        self.staleness: list[int] = []
        self.batch_units: list[int] = []  # trained response units per step
        self.max_true = 0
        self.marks = {0: (0.0, 0.0, 0.0)}  # step -> (time, engine busy device-s, train busy s)
        self.events = 0

    def _push(self, t: float, kind: int, arg: object) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, arg))

    def _kick(self, eng: _Engine) -> None:
        eng.epoch += 1
        t = eng.next_time()
        if t is not None:
            self._push(t, _ENGINE, (eng, eng.epoch))

    # ---- the driver (what driver.py does over real engines) -----------------------------------------------
    def _fill(self) -> None:
        """Start groups up to the budget; submit every pending sample to the least-loaded engine."""
        s = self.sched
        for _ in range(s.capacity()):  # starting a group lowers capacity() by exactly one
            prompt, lengths = sample_group(self.w, self.rng, self.unit)
            s.start(lengths, [0] * prompt)
        _check(s.capacity() == 0, "capacity() did not drop by one per start")
        pending = list(s.pending())
        if not pending:
            return
        loads = [(e.load(), e.idx) for e in self.engines]
        heapq.heapify(loads)
        touched = set()
        for sample, ids, budget in pending:
            g = sample.group
            offset = len(ids) - len(g.prompt_ids)
            length = g.payload[sample.index]
            end = min(length, offset + budget)
            finish = "length" if end == self.sched.max_new or end < length else "stop"
            rid = f"r{next(self.rids)}"
            req = _Req(rid, sample, offset, end, len(ids), finish)
            load, i = heapq.heappop(loads)
            heapq.heappush(loads, (load + 1, i))
            eng = self.engines[i]
            s.submitted(sample, rid)
            eng.submit(req, self.now)
            self.req_engine[rid] = eng
            touched.add(i)
        for i in sorted(touched):
            self._kick(self.engines[i])

    def _report(self, req: _Req, gen: int, finish: str) -> GroupState | None:
        """Hand an engine result to the scheduler (tokens are response positions offset..offset+gen)."""
        self.req_engine.pop(req.rid, None)
        self.units["generated"] += gen
        if gen >= req.end - req.offset:
            finish = req.finish  # it was complete when the abort came
        if req.rid not in self.sched.by_request:
            self.units["ignored"] += gen  # a request of a dropped group
        elif gen:
            key = (req.sample.group.gid, req.sample.index)
            self.true_min[key] = min(self.true_min.get(key, req.version), req.version)
        group = self.sched.on_result(req.rid, list(range(req.offset, req.offset + gen)), [0.0] * gen, finish)
        if group is not None:
            self.n_ready += 1
        return group

    @staticmethod
    def _units_of(groups: list[GroupState]) -> int:
        return sum(len(seg.tokens) for g in groups for s in g.samples for seg in s.segments)

    def _try_take(self) -> None:
        need = self.B - len(self.buffer)
        if self.trainer_busy or self.n_ready < need:
            return
        before = dict(self.sched.groups)
        got = self.sched.take(need)
        taken = {g.gid for g in got}
        dropped = [g for gid, g in before.items() if gid not in self.sched.groups and gid not in taken]
        self.n_ready -= len(got) + len(dropped)
        self.units["dropped"] += self._units_of(dropped)
        self.buffer += got
        if len(self.buffer) == self.B:
            self._train()
        self._fill()  # dropped groups free budget; fewer complete groups may allow tail groups

    def _train(self) -> None:
        """Check the batch (staleness bound, exact tokens) and start the trainer on it."""
        v, k, unit = self.sched.version, self.mode.async_ratio, self.unit
        tokens = 0
        units_before = self.units["trained"]
        for g in self.buffer:
            st = v - g.min_version
            true_st = v - min(self.true_min.pop((g.gid, s.index)) for s in g.samples)
            _check(0 <= true_st <= st <= k, f"group {g.gid}: staleness {st} (engines: {true_st}) > k={k} at v{v}")
            self.staleness.append(st)
            self.max_true = max(self.max_true, true_st)
            for s in g.samples:
                n = g.payload[s.index]
                _check(s.tokens == list(range(n)), f"group {g.gid} sample {s.index}: tokens lost or duplicated")
                _check(sum(len(seg.logprobs) for seg in s.segments) == n, f"group {g.gid}: logprobs != tokens")
                self.units["trained"] += n
                tokens += n + len(g.prompt_ids)
        self.batch_units.append(self.units["trained"] - units_before)
        self.buffer = []
        self.trainer_busy = True
        dur = 6 * self.hw.params * tokens * unit / (self.n_train * self.hw.flops_per_device)
        self.train_busy += dur
        self._push(self.now + dur, _TRAIN_DONE, None)

    def _on_train_done(self) -> None:
        self.step += 1
        self.marks[self.step] = (self.now, self._engine_busy(self.now), self.train_busy)
        if self.step == self.steps:
            return
        for rid in self.sched.begin_update():  # partial rollout: abort, keep the prefix, resume after the update
            req, gen = self.req_engine[rid].abort(rid, self.now)
            self._report(req, gen, "abort")
        until = self.now + self.hw.weight_sync_s
        for e in self.engines:
            e.pause(self.now, until)
            self._kick(e)
        self._push(until, _SYNC_DONE, None)

    def _on_sync_done(self) -> None:
        before = dict(self.sched.groups)
        doomed = self.sched.finish_update()
        self.units["dropped"] += self._units_of([g for gid, g in before.items() if gid not in self.sched.groups])
        for rid in doomed:
            eng = self.req_engine[rid]
            req, gen = eng.abort(rid, self.now)
            _check(self._report(req, gen, "abort") is None, f"{rid} of a dropped group completed a group")
            self._kick(eng)
        for e in self.engines:
            e.version = self.sched.version
        self.trainer_busy = False
        self._fill()
        self._try_take()

    def _engine_busy(self, t: float) -> float:
        return sum(e.busy_until(t) for e in self.engines) * self.hw.engine_devices

    # ---- running ------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        self._fill()
        while self.step < self.steps:
            if not self.heap:
                raise RuntimeError(f"deadlock at t={self.now:.1f}s: {self.sched.counters}, ready={self.n_ready}")
            t, _, kind, arg = heapq.heappop(self.heap)
            self.now = t
            self.events += 1
            if kind == _ENGINE:
                eng, epoch = arg  # type: ignore[misc]
                if epoch != eng.epoch:
                    continue
                completed = False
                for req in eng.pop_finished(t):
                    completed |= self._report(req, req.end - req.offset, req.finish) is not None
                self._kick(eng)
                if completed:
                    self._try_take()
            elif kind == _TRAIN_DONE:
                self._on_train_done()
            else:
                self._on_sync_done()
        return self._result()

    def _result(self) -> SimResult:
        self._check_conservation()
        (t0, e0, tr0), (t1, e1, tr1) = self.marks[self.warmup], self.marks[self.steps]
        window = t1 - t0
        n_steps = self.steps - self.warmup
        eng_dev_s, train_dev_s = e1 - e0, (tr1 - tr0) * self.n_train
        c = dict(self.sched.counters)
        return SimResult(
            mode=self.mode.name,
            devices=self.devices,
            train_devices=self.n_train,
            infer_devices=self.n_infer,
            batch_groups=self.B,
            steps=self.steps,
            samples_per_s=n_steps * self.B * self.w.group_size / window,
            tokens_per_s=sum(self.batch_units[self.warmup :]) * self.unit / window,
            util=(eng_dev_s + train_dev_s) / (self.devices * window),
            util_infer=eng_dev_s / (self.n_infer * window),
            util_train=train_dev_s / (self.n_train * window),
            mean_staleness=sum(self.staleness) / len(self.staleness),
            max_staleness=max(self.staleness),
            max_true_staleness=self.max_true,
            stale_groups=c["stale_groups"],
            resumed_requests=c["resumed_requests"],
            trained_samples=self.steps * self.B * self.w.group_size,
            trained_mean_len=self.units["trained"] * self.unit / (self.steps * self.B * self.w.group_size),
            wasted_token_frac=(self.units["dropped"] + self.units["ignored"]) / max(1, self.units["generated"]),
            sim_time=self.now,
            events=self.events,
            counters=c,
        )

    def _check_conservation(self) -> None:
        """Every token an engine reported is trained, in a dropped group, or still held: none lost or doubled."""
        u = self.units
        held = self._units_of(list(self.sched.groups.values())) + self._units_of(self.buffer)
        _check(u["generated"] - u["ignored"] == u["trained"] + u["dropped"] + held, f"token books: {u}, held={held}")


def best_split(
    workload: Workload | str, mode: Mode | str, devices: int = 32, **kw: object
) -> tuple[float, dict[float, float]]:
    """The train fraction of SPLITS with the most samples/s on a `devices` cluster, and samples/s of each."""
    rates = {f: simulate(devices, workload, mode, train_fraction=f, **kw).samples_per_s for f in SPLITS}
    return max(rates, key=lambda f: rates[f]), rates


def simulate(devices: int, workload: Workload | str = "rlvr", mode: Mode | str = "sync", **kw: object) -> SimResult:
    """Run one simulation (keyword arguments as `Simulation`)."""
    return Simulation(devices, workload, mode, **kw).run()  # type: ignore[arg-type]
