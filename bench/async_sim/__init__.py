"""A cluster simulator for asynchronous RL rollout that drives roll's real `RolloutScheduler` (a bench tool: it
lives outside the runtime wheel). `model`: workloads, hardware, modes; `engine`: a simulated continuous-batching
engine; `sim`: the discrete-event simulation and its checks. `bench/bench_async_sim.py` prints the tables."""

from async_sim.engine import Engine, Req
from async_sim.model import MODES, PRESETS, Hardware, Mode, Workload, length_stats, sample_group
from async_sim.sim import SPLITS, SimResult, Simulation, SimulationError, best_split, simulate

__all__ = [
    "MODES",
    "PRESETS",
    "SPLITS",
    "Engine",
    "Hardware",
    "Mode",
    "Req",
    "SimResult",
    "Simulation",
    "SimulationError",
    "Workload",
    "best_split",
    "length_stats",
    "sample_group",
    "simulate",
]
