"""A discrete-event cluster simulation that drives the real `RolloutScheduler` (sync vs async, take orders,
partial rollout, agentic episodes).

Nothing is mocked on the scheduler's side: `Simulation` calls `capacity / start / pending / submitted / on_result /
observe / take / begin_update / finish_update` as a driver does over real engines (it submits nothing between
`begin_update` and `finish_update`, like `roll_core.scheduling.driver`); only the engines (`async_sim.engine`),
the environments and the trainer are simulated, on a virtual clock (an event heap: no threads, no sleeping,
deterministic for a seed). Workloads and costs: `async_sim.model`.

- The trainer needs `6 * params * tokens / (train_devices * flops_per_device)` seconds per batch (prompt and every
  response token, observations included; `flops_per_device` is an *effective* rate that folds in MFU and the
  old/ref log-prob passes), then `weight_sync_s` to push weights; engines pause for that time.
- Synchronous mode (async_ratio 0) is colocated: every device serves generation, then every device trains, then
  weights sync. Async modes are disaggregated: `train_fraction` of the devices train (default 3/8), the rest
  generate; `best_split` picks the fastest fraction of {1/8, 1/4, 3/8, 1/2} by simulating a small cluster.
- The batch is `batch_groups` groups (default: `groups_per_device * devices`, i.e. weak scaling).
- Routing: a sample's first request goes to the least-loaded engine (running + queued), its later ones (next
  turns, resumed requests) to the same engine (its prefix cache is there), as sticky routing does.
- Without partial rollout a request runs across a weight update in place (its tokens mix versions; the scheduler
  books the oldest). With partial rollout it is aborted at `begin_update`, its prefix reported, and resumed after.
- An episode's turn ends, the environment step takes its latency (engines keep serving other requests), then the
  observation is appended and the next turn is submitted.
- Partial-GPU mode (ROLL's partial_gpu_mode; `Mode.partial_gpu`, async only): each training device group of an
  engine's size also holds an engine. Whenever the trainer would idle (from the start, and after a weight sync that
  left no batch ready) those engines are lent to the rollout: after `Hardware.lend_s` (train states offloaded,
  engine woken at the current weights) they join the routing pool (`roll_core.scheduling.pool.EnginePool`) and
  take over the newest requests of the engines above the mean load (`expand(rebalance=True)`: aborted, prefix kept,
  resumed there with a prefill of the context). When a batch is complete the pool shrinks: their requests are
  aborted and resumed on the inference engines (prefix kept, context prefilled again, their cached prefixes lost),
  and training starts `Hardware.reclaim_s` later (engine offloaded, train states reloaded; a lend still under way
  is finished first). No token is lost or generated twice: the same checks as in every mode. Assumed: a lent
  engine is as fast and holds as many requests as an inference one (the train states wait in host memory), and
  the devices are lent whenever the trainer waits, however short the wait (as ROLL does after every weight sync).

Omitted: chunked prefill, KV growth with context length (b is an average) and KV memory limits (the prefix cache
is unbounded), preemption, network contention, stragglers/failures, reward latency, and any effect of staleness on
learning.

For speed, one simulated token id stands for `token_unit` real tokens (lengths are rounded up to whole units and a
step emits one unit); `token_unit=1` is exact. Token ids are response positions, so a trained sample must hold
exactly `range(L)` with its generated positions masked in: checked at every batch, together with the staleness
bound (the scheduler's book, and an independent one from the engines' weight versions) and conservation of every
generated token (trained, dropped as stale, or still held).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
from dataclasses import dataclass, field

from async_sim.engine import Engine, Req
from async_sim.model import MODES, PRESETS, Hardware, Mode, Turn, Workload, sample_group
from roll_core.scheduling.pool import EnginePool
from roll_core.scheduling.scheduler import GroupState, RolloutScheduler, SampleState

SPLITS = (1 / 8, 1 / 4, 3 / 8, 1 / 2)
DEFAULT_TRAIN_FRACTION = 3 / 8
_ENGINE, _TRAIN_DONE, _SYNC_DONE, _ENV, _LENT = 0, 1, 2, 3, 4


@dataclass
class SimResult:
    """Metrics of one run; rates and utilization over the training steps after `warmup` (steady state), in whole
    cycles of k + 1 steps (`Simulation.measured_until`)."""

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
    mean_staleness: float  # trainer version - oldest token's version, per trained group
    max_staleness: int
    max_true_staleness: int  # from the engines' weight versions (never more than the scheduler's book)
    max_admission_staleness: int  # trainer version - the version at which the group was admitted
    token_staleness: float  # mean over trained generated tokens of (trainer version - the token's booked version)
    stale_groups: int
    resumed_requests: int
    trained_samples: int
    trained_mean_len: float  # mean response tokens of trained samples (observations included)
    wasted_token_frac: float  # generated tokens of dropped (stale) groups / all generated tokens
    sim_time: float
    events: int
    counters: dict[str, int] = field(default_factory=dict)
    util_lent: float = 0.0  # partial-GPU: share of the training devices' time spent generating
    lent_token_frac: float = 0.0  # partial-GPU: share of generated tokens that the training devices generated
    lends: int = 0  # partial-GPU: times the training devices joined the rollout
    moved_requests: int = 0  # partial-GPU: requests aborted and resumed elsewhere when the pool grew or shrank


class SimulationError(AssertionError):
    """A contract the simulation checks was broken (staleness bound, token conservation, scheduler books)."""


def _check(ok: bool, msg: object) -> None:
    if not ok:  # not `assert`: the checks must survive python -O
        raise SimulationError(msg)


def _turn_at(plan: list[Turn], pos: int) -> int:
    """The index of the turn that generates response position `pos`."""
    i = bisect.bisect_right([t[0] for t in plan], pos) - 1
    _check(plan[i][0] <= pos < plan[i][1], f"position {pos} is not generated by any turn of {plan}")
    return i


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
        if self.mode.partial_gpu and self.colocated:
            raise ValueError(
                f"mode {self.mode.name!r}: partial-GPU mode lends training devices of a disaggregated "
                "(async_ratio >= 1) cluster; a colocated one has none to lend"
            )
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
        self.sched = RolloutScheduler(
            batch_groups=self.B,
            group_size=self.w.group_size,
            max_new_tokens=self.w.max_new_tokens // token_unit,
            async_ratio=k,
            tail_groups=round(self.mode.tail_fraction * self.B),
            partial_rollout=self.mode.partial,
            order=self.mode.order,
        )
        n_lent = self.n_train // tp if self.mode.partial_gpu else 0
        self.n_engines_infer = self.n_infer // tp
        self.engines = [Engine(i, self.hw, token_unit) for i in range(self.n_engines_infer + n_lent)]
        self.lent = self.engines[self.n_engines_infer :]  # engines of the training devices (partial-GPU)
        if self.mode.partial_gpu and not self.lent:
            raise ValueError(f"{self.n_train} training devices cannot hold an engine of {tp}")
        self.pool = EnginePool(range(len(self.engines)), active=range(self.n_engines_infer))
        self.lent_state = "idle"  # idle (training or syncing) -> waking -> serving -> idle
        self.lent_epoch = 0  # bumped when a lend is cancelled (its wake-up event is ignored)
        self.lent_ready = 0.0
        self.lends = self.moved = 0
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = itertools.count()
        self.rids = itertools.count()
        self.now = 0.0
        self.req_engine: dict[str, Engine] = {}
        self.true_min: dict[tuple[int, int], int] = {}  # oldest engine version of any token of a sample
        self.buffer: list[GroupState] = []
        self.trainer_busy = False
        self.syncing = False  # between begin_update and finish_update: the driver submits nothing
        self.step = 0
        self.train_busy = 0.0  # seconds the trainer computed
        self.units = {"generated": 0, "ignored": 0, "trained": 0, "trained_generated": 0, "lent_generated": 0}
        self.staleness: list[int] = []
        self.token_age = [0, 0]  # sum of (version - token version) over trained generated units, and their count
        self.batch_units: list[int] = []  # trained response units per step
        self.max_true = self.max_admission = 0
        self.marks = {0: (0.0, 0.0, 0.0, 0.0)}  # step -> (time, engine busy dev-s, lent engines' busy dev-s, train s)
        self.events = 0

    def _push(self, t: float, kind: int, arg: object) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, arg))

    def _kick(self, eng: Engine) -> None:
        eng.epoch += 1
        t = eng.next_time()
        if t is not None:
            self._push(t, _ENGINE, (eng, eng.epoch))

    # ---- the driver (what driver.py does over real engines) -----------------------------------------------
    def _fill(self) -> None:
        """Start groups up to the budget; submit every pending sample (sticky, else to the least-loaded engine: the
        pool's routing)."""
        if self.syncing:
            return
        s = self.sched
        for _ in range(s.capacity()):  # starting a group lowers capacity() by exactly one
            prompt, plans = sample_group(self.w, self.rng, self.unit)
            s.start(plans, [0] * prompt)
        _check(s.capacity() == 0, "capacity() did not drop by one per start")
        touched = set()
        for sample, ids, budget in list(s.pending()):
            g = sample.group
            key = (g.gid, sample.index)
            plan: list[Turn] = g.payload[sample.index]
            offset = len(ids) - len(g.prompt_ids)
            i = _turn_at(plan, offset)
            end = min(plan[i][1], offset + budget)
            last = i == len(plan) - 1
            finish = "length" if end == s.max_new or end < plan[i][1] else "stop"
            rid = f"r{next(self.rids)}"
            final = last and plan[i][3] == 0.0  # no environment step after this turn
            req = Req(rid, sample, offset, end, len(ids), finish, final=final, key=key)
            eng = self.engines[self.pool.assign(rid, key)]  # type: ignore[index]
            s.submitted(sample, rid)
            eng.submit(req, self.now)
            self.req_engine[rid] = eng
            touched.add(eng.idx)
        for j in sorted(touched):
            self._kick(self.engines[j])

    def _report(self, req: Req, gen: int, finish: str) -> GroupState | None:
        """Hand an engine result to the scheduler (tokens are response positions offset..offset+gen)."""
        self.req_engine.pop(req.rid, None)
        eng = self.engines[self.pool.release(req.rid)]  # type: ignore[index]
        self.units["generated"] += gen
        if eng.idx >= self.n_engines_infer:
            self.units["lent_generated"] += gen
        if gen >= req.end - req.offset:
            finish = req.finish  # it was complete when the abort came
        smp: SampleState = req.sample  # type: ignore[assignment]
        key = (smp.group.gid, smp.index)
        if req.rid not in self.sched.by_request:
            self.units["ignored"] += gen  # a request of a dropped group
        elif gen:
            self.true_min[key] = min(self.true_min.get(key, req.version), req.version)
        tokens = list(range(req.offset, req.offset + gen))
        group = self.sched.on_result(req.rid, tokens, [0.0] * gen, finish, final=req.final)
        if smp.awaiting_env:  # a turn ended: the environment answers after its latency
            plan = smp.group.payload[smp.index]
            self._push(self.now + plan[_turn_at(plan, req.offset)][3], _ENV, (smp, req.offset))
        elif smp.finish is not None:
            self.pool.forget(key)
            eng.forget(key)
        return group

    def _on_env(self, smp: SampleState, offset: int) -> None:
        plan: list[Turn] = smp.group.payload[smp.index]
        i = _turn_at(plan, offset)
        group = self.sched.observe(smp, list(range(plan[i][1], plan[i][2])), done=i == len(plan) - 1)
        if group is not None:
            self._try_take()
        self._fill()

    def _try_take(self) -> None:
        need = self.B - len(self.buffer)
        if self.trainer_busy or self.sched.complete() < need:
            return
        got = self.sched.take(need)
        self.buffer += got
        if len(self.buffer) == self.B:
            self._train()
        self._fill()  # dropped groups free budget; fewer complete groups may allow tail groups

    def _train(self) -> None:
        """Check the batch (staleness bound, exact tokens and masks) and start the trainer on it."""
        v, k, unit = self.sched.version, self.mode.async_ratio, self.unit
        tokens = 0
        units_before = self.units["trained"]
        for g in self.buffer:
            st = v - g.min_version
            true_st = v - min(self.true_min.pop((g.gid, s.index)) for s in g.samples)
            _check(0 <= true_st <= st <= k, f"group {g.gid}: staleness {st} (engines: {true_st}) > k={k} at v{v}")
            self.staleness.append(st)
            self.max_true = max(self.max_true, true_st)
            self.max_admission = max(self.max_admission, v - g.start_version)
            for s in g.samples:
                plan: list[Turn] = g.payload[s.index]
                n = plan[-1][2]
                mask = [1] * n
                for _, gen_end, obs_end, _ in plan:
                    mask[gen_end:obs_end] = [0] * (obs_end - gen_end)
                _check(s.tokens == list(range(n)), f"group {g.gid} sample {s.index}: tokens lost or duplicated")
                _check(s.mask == mask, f"group {g.gid} sample {s.index}: observation mask wrong")
                _check(len(s.logprobs) == n, f"group {g.gid}: logprobs != tokens")
                for seg in s.segments:
                    if seg.generated:
                        self.token_age[0] += (v - seg.version) * len(seg.tokens)
                        self.token_age[1] += len(seg.tokens)
                self.units["trained"] += n
                self.units["trained_generated"] += sum(mask)
                tokens += n + len(g.prompt_ids)
        self.batch_units.append(self.units["trained"] - units_before)
        self.buffer = []
        self.trainer_busy = True
        start = self._reclaim() if self.lent else self.now
        dur = 6 * self.hw.params * tokens * unit / (self.n_train * self.hw.flops_per_device)
        self.train_busy += dur
        self._push(start + dur, _TRAIN_DONE, None)

    # ---- partial-GPU mode: the training devices serve rollout while the trainer would idle ----------------
    def _lend(self) -> None:
        """The trainer waits for a batch: wake the training devices' engines (they join after `lend_s`)."""
        if not self.lent or self.trainer_busy or self.lent_state != "idle":
            return
        self.lent_state = "waking"
        self.lent_epoch += 1
        self.lent_ready = self.now + self.hw.lend_s
        self._push(self.lent_ready, _LENT, self.lent_epoch)

    def _on_lent(self, epoch: int) -> None:
        """The lent engines are up at the current weights: they join the pool and take over requests of the
        loaded engines (aborted, prefix kept, resumed on them)."""
        if epoch != self.lent_epoch or self.lent_state != "waking":
            return  # cancelled: the batch was ready before the engines woke
        self.lent_state = "serving"
        self.lends += 1
        for e in self.lent:
            e.version = self.sched.version
            e.pause(self.now, self.now)  # idle until now
        self._abort_and_resume(self.pool.expand([e.idx for e in self.lent], rebalance=True))

    def _reclaim(self) -> float:
        """A batch is ready: take the training devices back (their requests are aborted and resume on the inference
        engines); returns when training can start."""
        ready = self.now
        if self.lent_state == "waking":  # finish the wake-up under way, then offload again
            self.lent_epoch += 1
            ready = self.lent_ready
        elif self.lent_state == "serving":
            self._abort_and_resume(self.pool.shrink([e.idx for e in self.lent]))
            _check(not self.pool.draining([e.idx for e in self.lent]), "a lent engine still holds requests")
            for e in self.lent:
                _check(not e.load(), f"lent engine {e.idx} still runs requests after the shrink")
                e.cache.clear()  # offloaded: its prefix cache is gone
        else:
            return self.now  # not lent (the batch was ready right after the weight sync)
        self.lent_state = "idle"
        return max(ready, self.now) + self.hw.reclaim_s

    def _abort_and_resume(self, rids: list[str]) -> None:
        """Abort requests (the pool moves them): their partial output is reported, the samples resume elsewhere."""
        touched = {}
        for rid in rids:
            eng = self.req_engine[rid]
            req, gen = eng.abort(rid, self.now)
            self._report(req, gen, "abort")
            touched[eng.idx] = eng
        self.moved += len(rids)
        for eng in touched.values():
            self._kick(eng)
        self._fill()

    def _on_train_done(self) -> None:
        self.step += 1
        self.marks[self.step] = (self.now, *self._engine_busy(self.now), self.train_busy)
        if self.step == self.steps:
            return
        self.syncing = True
        for rid in self.sched.begin_update():  # partial rollout: abort, keep the prefix, resume after the update
            req, gen = self.req_engine[rid].abort(rid, self.now)
            self._report(req, gen, "abort")
        until = self.now + self.hw.weight_sync_s
        for e in self.engines:
            e.pause(self.now, until)
            self._kick(e)
        self._push(until, _SYNC_DONE, None)

    def _on_sync_done(self) -> None:
        for rid in self.sched.finish_update():  # groups too stale to train: abort what they run
            eng = self.req_engine[rid]
            req, gen = eng.abort(rid, self.now)
            _check(self._report(req, gen, "abort") is None, f"{rid} of a dropped group completed a group")
            self._kick(eng)
        for e in self.engines:
            e.version = self.sched.version
        self.syncing = self.trainer_busy = False
        self._fill()
        self._try_take()
        self._lend()  # no batch ready: the training devices would idle

    def _engine_busy(self, t: float) -> tuple[float, float]:
        """Busy device-seconds of the inference engines and of the lent engines (training devices) until t."""
        tp, n = self.hw.engine_devices, self.n_engines_infer
        return (
            sum(e.busy_until(t) for e in self.engines[:n]) * tp,
            sum(e.busy_until(t) for e in self.engines[n:]) * tp,
        )

    # ---- running ------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        self._fill()
        self._lend()
        while self.step < self.steps:
            if not self.heap:
                raise RuntimeError(f"deadlock at t={self.now:.1f}s: {self.sched.counters}")
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
            elif kind == _ENV:
                self._on_env(*arg)  # type: ignore[misc]
            elif kind == _TRAIN_DONE:
                self._on_train_done()
            elif kind == _LENT:
                self._on_lent(arg)  # type: ignore[arg-type]
            else:
                self._on_sync_done()
        return self._result()

    def _result(self) -> SimResult:
        self._check_conservation()
        end = self.measured_until()
        (t0, e0, l0, tr0), (t1, e1, l1, tr1) = self.marks[self.warmup], self.marks[end]
        window = t1 - t0
        n_steps = end - self.warmup
        eng_dev_s, lent_dev_s, train_dev_s = e1 - e0, l1 - l0, (tr1 - tr0) * self.n_train
        c = dict(self.sched.counters)
        n_samples = self.steps * self.B * self.w.group_size
        return SimResult(
            mode=self.mode.name,
            devices=self.devices,
            train_devices=self.n_train,
            infer_devices=self.n_infer,
            batch_groups=self.B,
            steps=self.steps,
            samples_per_s=n_steps * self.B * self.w.group_size / window,
            tokens_per_s=sum(self.batch_units[self.warmup : end]) * self.unit / window,
            util=(eng_dev_s + lent_dev_s + train_dev_s) / (self.devices * window),
            util_infer=eng_dev_s / (self.n_infer * window),
            util_train=train_dev_s / (self.n_train * window),
            mean_staleness=sum(self.staleness) / len(self.staleness),
            max_staleness=max(self.staleness),
            max_true_staleness=self.max_true,
            max_admission_staleness=self.max_admission,
            token_staleness=self.token_age[0] / max(1, self.token_age[1]),
            stale_groups=c["stale_groups"],
            resumed_requests=c["resumed_requests"],
            trained_samples=n_samples,
            trained_mean_len=self.units["trained"] * self.unit / n_samples,
            wasted_token_frac=c["stale_tokens"] / max(1, self.units["generated"]),  # `ignored` ones included
            sim_time=self.now,
            events=self.events,
            counters=c,
            util_lent=lent_dev_s / (self.n_train * window),
            lent_token_frac=self.units["lent_generated"] / max(1, self.units["generated"]),
            lends=self.lends,
            moved_requests=self.moved,
        )

    def measured_until(self) -> int:
        """The last step of the measured window: whole cycles of k + 1 steps after `warmup`. With the admission
        budget, the groups admitted at one version are trained together k versions later, so step times repeat
        with period k + 1 (one step waits for that version's slowest group, the k others are short): a window
        of 8 steps at k = 2 held 2 or 3 long steps depending on the phase, which overstated one order's rate by
        ~20 % (bench/RESULTS.md, 2026-12-03 later)."""
        period = self.mode.async_ratio + 1
        measured = self.steps - self.warmup
        return self.steps - (measured % period if measured >= period else 0)

    def _check_conservation(self) -> None:
        """Every generated token an engine reported is trained, in a dropped group, or still held: none lost or
        doubled (the scheduler's `stale_tokens` books the dropped ones, those of requests running at the drop too)."""
        u = self.units
        held = sum(
            len(seg.tokens)
            for g in [*self.sched.groups.values(), *self.buffer]
            for s in g.samples
            for seg in s.segments
            if seg.generated
        )
        dropped = self.sched.counters["stale_tokens"]
        _check(
            u["generated"] == u["trained_generated"] + dropped + held and u["ignored"] <= dropped,
            f"token books: {u}, dropped={dropped}, held={held}",
        )


def simulate(devices: int, workload: Workload | str = "rlvr", mode: Mode | str = "sync", **kw: object) -> SimResult:
    """Run one simulation (keyword arguments as `Simulation`)."""
    return Simulation(devices, workload, mode, **kw).run()  # type: ignore[arg-type]


def best_split(
    workload: Workload | str,
    mode: Mode | str,
    devices: int = 32,
    splits: tuple[float, ...] = SPLITS,
    **kw: object,
) -> tuple[float, dict[float, float]]:
    """The train fraction of `splits` with the most trained tokens/s on a `devices` cluster, and that rate of each
    (partial-GPU modes can use larger train shares than {1/8 .. 1/2}: their training devices also generate)."""
    rates = {f: simulate(devices, workload, mode, train_fraction=f, **kw).tokens_per_s for f in splits}
    return max(rates, key=lambda f: rates[f]), rates
