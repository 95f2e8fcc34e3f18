"""Contracts between roll-core and the packages that implement engines, tasks and rewards (typed protocols).

Each contract has a conformance suite in `roll_core.testing` that every implementation's tests subclass.
"""

from roll_core.interfaces.agentic import Env, EnvWithInstructions
from roll_core.interfaces.inference import (
    FINISH_REASONS,
    GenerateOutput,
    InferEngine,
    Request,
    RequestOutput,
    SamplingParams,
    UnsupportedSamplingError,
)
from roll_core.interfaces.tasks import DataCounts, ProblemLike, Reward, RewardResult, Task
from roll_core.interfaces.training import LossFn, TrainEngine

__all__ = [
    "FINISH_REASONS",
    "DataCounts",
    "Env",
    "EnvWithInstructions",
    "GenerateOutput",
    "InferEngine",
    "LossFn",
    "ProblemLike",
    "Request",
    "RequestOutput",
    "Reward",
    "RewardResult",
    "SamplingParams",
    "Task",
    "TrainEngine",
    "UnsupportedSamplingError",
]
