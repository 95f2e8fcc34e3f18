"""SamplingParams' edges: temperatures below GREEDY_TEMPERATURE are greedy, a NaN/inf temperature is refused at
construction, and a run's sampling temperature (the trainer's divisor) must not be one the engines read as greedy."""

from __future__ import annotations

import math

import pytest

from roll_core.config.engines import InferEngineConfig
from roll_core.config.generation import GenerationConfig
from roll_core.interfaces.inference import GREEDY_TEMPERATURE, SamplingParams


@pytest.mark.parametrize("t", [0.0, -0.0, 1e-45, 1e-38, 1e-30, 1e-6, 9.99e-6])
def test_a_temperature_below_the_threshold_is_greedy(t: float) -> None:
    """Only 0 was greedy: 1e-38 divided fp32 logits into inf (NaN log-probs, a garbage token, no error)."""
    assert SamplingParams(temperature=t).greedy


@pytest.mark.parametrize("t", [GREEDY_TEMPERATURE, 0.01, 0.7, 1.0, 5.0])
def test_a_temperature_at_or_above_the_threshold_samples(t: float) -> None:
    assert not SamplingParams(temperature=t).greedy


@pytest.mark.parametrize("t", [math.nan, math.inf, -math.inf, -1e-9, -1.0])
def test_a_temperature_that_is_no_number_or_negative_is_refused(t: float) -> None:
    """NaN passed `temperature < 0` (NaN logits); inf sampled uniformly from any model."""
    with pytest.raises(ValueError, match="temperature="):
        SamplingParams(temperature=t)


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan), ("top_p", -0.1), ("top_k", -1), ("max_new_tokens", 0)],
)
def test_other_fields_out_of_range_are_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"{field}="):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("t", [1e-6, 1e-38])
def test_a_run_temperature_the_engines_read_as_greedy_is_refused(t: float) -> None:
    """The engines decode greedily below the threshold (log-probs log_softmax(logits)), while the trainer would divide
    the logits by the configured temperature: a 1e-6 passed `> 0` and the trainer's log-probs were another model's."""
    with pytest.raises(ValueError, match=r"infer_engine\.temperature"):
        InferEngineConfig(_target_="x", name="hf", temperature=t)
    with pytest.raises(ValueError, match=r"model\.generation\.temperature"):
        GenerationConfig(temperature=t)
    InferEngineConfig(_target_="x", name="hf", temperature=GREEDY_TEMPERATURE)
    GenerationConfig(temperature=GREEDY_TEMPERATURE)
