"""Partial-GPU mode in the cluster simulator (bench/async_sim, ROLL's partial_gpu_mode): the training devices join
the rollout while the trainer would idle and are taken back before it trains, through the real EnginePool. The
simulator's checks (staleness bound, every trained token generated exactly once, token books) hold; the training
devices never generate and train at once; a pool that forgets a request of a removed engine is caught."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the simulator is a bench tool, not a package

from async_sim import PRESETS, Mode, Simulation, SimulationError, simulate

FAST = {"steps": 8, "warmup": 2}


@pytest.mark.parametrize("workload", ["rlvr", "agentic"])
def test_training_devices_generate_while_the_trainer_waits_and_nothing_is_lost(workload):
    plain = simulate(16, workload, "k1", train_fraction=0.5, **FAST)
    sim = Simulation(16, workload, "k1 partial-gpu", train_fraction=0.5, **FAST)
    r = sim.run()  # raises SimulationError on a stale batch, a lost or doubled token, a wrong mask or token books
    assert r.lends >= sim.steps // 2 and r.moved_requests > 0 and 0.1 < r.lent_token_frac < 0.9
    assert 0 < r.util_lent and r.util_train + r.util_lent <= 1.0  # a training device does one thing at a time
    assert r.util > plain.util and r.wasted_token_frac == 0 and r.stale_groups == 0
    assert r.max_staleness == r.max_admission_staleness == 1
    assert r.trained_mean_len == plain.trained_mean_len  # the same groups trained, at full length
    assert sim.pool.counters["shrinks"] == r.lends  # every lend was taken back before training
    assert all(not e.load() for e in sim.lent) or sim.lent_state == "serving"


def test_lent_devices_make_up_for_a_small_inference_group_under_load():
    """A heavier batch (4 groups/device) with 3/4 of the devices training: plain disaggregation starves the rollout;
    lending the training devices recovers most of it (the simulated numbers in bench/RESULTS.md)."""
    w = dataclasses.replace(PRESETS["rlvr"], groups_per_device=4.0)
    plain = simulate(8, w, "k1", train_fraction=0.75, **FAST)
    lent = simulate(8, w, "k1 partial-gpu", train_fraction=0.75, **FAST)
    assert lent.tokens_per_s > 1.2 * plain.tokens_per_s


def test_partial_gpu_needs_a_disaggregated_cluster():
    with pytest.raises(ValueError, match="colocated"):
        Simulation(16, "rlvr", Mode("k0 lent", 0, partial_gpu=True))


def test_a_pool_that_forgets_a_request_of_a_removed_engine_is_caught():
    sim = Simulation(16, "rlvr", "k1 partial-gpu", train_fraction=0.5, **FAST)
    shrink = sim.pool.shrink
    sim.pool.shrink = lambda engines: shrink(engines)[1:]  # type: ignore[method-assign]
    with pytest.raises(SimulationError, match="still holds requests"):
        sim.run()


def test_a_lent_engine_that_keeps_running_an_aborted_request_is_caught():
    """Its partial output is reported (and resumed elsewhere) but it keeps generating: the tokens would be doubled."""
    sim = Simulation(16, "rlvr", "k1 partial-gpu", train_fraction=0.5, **FAST)
    for eng in sim.lent:
        real = eng.abort

        def leaky(rid, t, real=real, eng=eng):
            req = eng.running.get(rid)
            out = real(rid, t)
            if req is not None:
                eng.running[rid] = req  # still running there
            return out

        eng.abort = leaky  # type: ignore[method-assign]
    with pytest.raises(SimulationError, match="still runs requests"):
        sim.run()
