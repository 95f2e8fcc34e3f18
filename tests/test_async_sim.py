"""The cluster simulator (bench/async_sim) drives the real RolloutScheduler: the default take order (and order
"deadline") trains every generated token at its true length within the staleness bound, the old order drops long
groups, episodes keep every turn and observation, and the simulator's own checks catch a broken scheduler."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the simulator is a bench tool, not a package

from async_sim import (
    PRESETS,
    Engine,
    Hardware,
    Mode,
    Req,
    Simulation,
    SimulationError,
    length_stats,
    simulate,
)

FAST = {"steps": 8, "warmup": 2}


def test_engine_timing_matches_the_decode_model():
    hw = Hardware(decode_base_s=0.01, decode_per_request_s=0.001, prefill_s_per_token=1e-4)
    eng = Engine(0, hw, unit=1)
    eng.submit(Req("a", None, 0, 100, 50, "stop", key=(0, 0)), 0.0)
    eng.submit(Req("b", None, 0, 40, 50, "stop"), 0.0)
    prefill = 2 * 50 * 1e-4
    t_b = eng.next_time()  # 40 steps with two running
    assert t_b == pytest.approx(prefill + 40 * 0.012)
    assert [r.rid for r in eng.pop_finished(t_b)] == ["b"]
    assert eng.next_time() == pytest.approx(t_b + 60 * 0.011)  # the rest alone
    # an abort mid-step keeps the tokens of completed steps only
    _, gen = eng.abort("a", t_b + 10.5 * 0.011)
    assert gen == 50  # 40 + 10 steps
    assert eng.next_time() is None
    # the next turn of sample (0, 0) prefills only its new tokens (50 prompt + 50 generated are cached)
    t = t_b + 11 * 0.011
    eng.submit(Req("a2", None, 50, 60, 130, "stop", key=(0, 0)), t)
    assert eng.prefilled == 100 + 30
    eng.version = 1  # new weights: the cache no longer holds
    eng.submit(Req("a3", None, 0, 10, 40, "stop", key=(0, 1)), t)
    assert eng.prefilled == 100 + 30 + 40


def test_length_distributions():
    st = length_stats(PRESETS["rlvr"])
    assert st["p99"] > 5 * st["p50"] and 0 < st["at_cap"] < 0.05 and st["mean"] > st["p50"]
    ag = length_stats(PRESETS["agentic"])
    assert 4 < ag["turns_mean"] < 8 and ag["env_s_mean"] > 5 and ag["generated_mean"] < ag["mean"]


@pytest.mark.parametrize("workload", ["rlvr", "agentic"])
def test_in_order_async_wastes_nothing_and_keeps_lengths_at_a_speed_up(workload):
    """The issue's goal at k=1: < 5 % waste, mean trained length within 5 % of sync, faster than sync; in start
    order and in deadline order (which trains the same groups, the first k + 1 batches reordered)."""
    sync = simulate(32, workload, "sync", **FAST)
    for mode in ("k1", "k1 deadline"):
        k1 = simulate(32, workload, mode, train_fraction=0.5, **FAST)
        assert k1.wasted_token_frac == 0 and k1.stale_groups == 0
        assert k1.trained_mean_len == sync.trained_mean_len  # the same groups, at full length
        assert k1.tokens_per_s > 1.5 * sync.tokens_per_s and k1.util_infer > sync.util_infer
        assert k1.max_staleness == k1.max_admission_staleness == 1  # it runs ahead, within the bound


def test_the_old_order_drops_long_groups():
    sync = simulate(32, "rlvr", "sync", **FAST)
    ready = simulate(32, "rlvr", "k1 ready", train_fraction=0.5, **FAST)
    assert ready.wasted_token_frac > 0.2 and ready.trained_mean_len < 0.85 * sync.trained_mean_len


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("order", ["start", "deadline", "ready"])
def test_staleness_bound_never_exceeded(k, order):
    r = simulate(32, "rlvr", Mode(f"k{k}", k, partial=True, order=order), **FAST)
    assert r.max_staleness <= k and r.max_true_staleness <= k  # also asserted per batch inside the simulator
    if k and order == "ready":
        assert r.max_staleness == k and r.stale_groups > 0  # the bound is reached and the filter is exercised
    if order == "deadline":
        assert r.stale_groups == 0 and r.wasted_token_frac == 0 and r.max_admission_staleness == k


def test_rates_are_measured_over_whole_cycles_of_k_plus_1_steps():
    """At k = 2 one step in three waits for a version's slowest group (at 128 devices: ~185 s, then two of ~22 s):
    a window of 8 steps would hold 2 or 3 of them depending on the phase. The window is cut to whole cycles."""
    sim = Simulation(16, "rlvr", "k2", steps=9, warmup=1)
    r = sim.run()
    assert sim.measured_until() == 7  # 6 steps = 2 cycles; steps 8-9 are not measured
    times = [sim.marks[i][0] for i in range(10)]
    assert r.samples_per_s == pytest.approx(6 * sim.B * sim.w.group_size / (times[7] - times[1]))
    assert r.tokens_per_s == pytest.approx(sum(sim.batch_units[1:7]) * sim.unit / (times[7] - times[1]))
    assert Simulation(16, "rlvr", "k1", steps=8, warmup=2).measured_until() == 8


def test_sync_trains_only_the_current_version():
    r = simulate(32, "agentic", "sync", **FAST)
    assert (r.max_staleness, r.max_true_staleness, r.stale_groups, r.resumed_requests) == (0, 0, 0, 0)
    assert r.train_devices == r.infer_devices == 32  # colocated


@pytest.mark.parametrize("workload", ["rlvr", "agentic"])
def test_partial_rollout_resumes_and_keeps_every_token_once(workload):
    sim = Simulation(16, workload, "k1+partial", token_unit=1, **FAST)
    r = sim.run()  # checks every trained sample's tokens == range(its length), its mask, and the token books
    assert r.resumed_requests > 0
    assert r.token_staleness < simulate(16, workload, "k1", token_unit=1, **FAST).token_staleness
    u = sim.units
    assert u["trained"] == sum(sim.batch_units) == round(r.trained_mean_len * r.trained_samples)


def test_deterministic_for_a_seed():
    a = dataclasses.asdict(simulate(16, "agentic", "k1+partial", seed=3, **FAST))
    assert a == dataclasses.asdict(simulate(16, "agentic", "k1+partial", seed=3, **FAST))
    assert a != dataclasses.asdict(simulate(16, "agentic", "k1+partial", seed=4, **FAST))


# ---- the checks catch a broken scheduler (mutations) ----------------------------------------------------------
def test_a_scheduler_without_the_staleness_filter_is_caught():
    sim = Simulation(32, "rlvr", "k1 ready", **FAST)
    sim.sched._stale = lambda g: False  # type: ignore[method-assign]
    with pytest.raises(SimulationError, match="staleness"):
        sim.run()


@pytest.mark.parametrize("mode", ["k1", "k1 deadline", "k1 ready"])
def test_a_bumped_budget_is_caught(mode):
    sim = Simulation(32, "rlvr", mode, **FAST)
    sim.sched.k = 2  # runs (and filters) one batch further ahead than the driver's k=1
    with pytest.raises(SimulationError, match="staleness"):
        sim.run()


def test_duplicated_abort_tokens_are_caught():
    sim = Simulation(16, "rlvr", "k1+partial", **FAST)
    on_result = sim.sched.on_result

    def doubled(rid, tokens, logprobs, finish, **kw):
        if finish == "abort" and tokens:
            tokens, logprobs = tokens + tokens[-1:], logprobs + logprobs[-1:]
        return on_result(rid, tokens, logprobs, finish, **kw)

    sim.sched.on_result = doubled  # type: ignore[method-assign]
    with pytest.raises(SimulationError, match="lost or duplicated"):
        sim.run()


def test_an_observation_booked_as_generated_is_caught():
    sim = Simulation(16, "agentic", "k1", **FAST)
    observe = sim.sched.observe

    def unmasked(sample, tokens, *, done):
        group = observe(sample, tokens, done=done)
        if tokens and sample.segments:
            sample.segments[-1].generated = True
        return group

    sim.sched.observe = unmasked  # type: ignore[method-assign]
    with pytest.raises(SimulationError, match=r"mask|token books"):
        sim.run()
