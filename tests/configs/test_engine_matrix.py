"""Every experiment composes with every engine of each kind: experiment x infer_engine x train_engine.

An experiment may only set the knobs every engine of a kind shares (roll_core.config.schema.InferEngineConfig:
`max_num_seqs`, `max_model_len`, sampling, ...), so `roll-train experiment=quickstart infer_engine=sglang` composes
whether or not SGLang is installed here. Nothing is built: tests/e2e/test_engine_matrix.py runs a tiny step of
each combination this machine can run. A combination that cannot work must fail with an error naming the key
(INCOMPATIBLE below), never at a random place.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
from omegaconf import OmegaConf

from roll_core.config import ConfigError, compose, to_object
from roll_core.config.schema import InferEngineConfig
from roll_core.config.search_path import group_options
from roll_core.testing import fill_missing

EXPERIMENT_FILES = group_options("experiment")  # the packaged experiments and the repository's conf/experiment
EXPERIMENTS = sorted(EXPERIMENT_FILES)
INFER = sorted(group_options("infer_engine"))
TRAIN = sorted(group_options("train_engine"))
MATRIX = list(itertools.product(EXPERIMENTS, INFER, TRAIN))

#: (experiment, infer_engine, train_engine) that cannot compose, and the error naming the key. None today: every
#: experiment sets only shared knobs. Add an entry only for a setting an engine refuses (e.g. SGLang and top_p < 1).
INCOMPATIBLE: dict[tuple[str, str, str], str] = {}


def test_matrix_covers_every_option() -> None:
    assert {"quickstart", "agentic_quickstart"} <= set(EXPERIMENTS)
    assert {"hf", "vllm", "sglang"} <= set(INFER) and {"hf", "fsdp2", "megatron"} <= set(TRAIN)


@pytest.mark.parametrize(("experiment", "infer", "train"), MATRIX, ids=["-".join(c) for c in MATRIX])
def test_experiment_composes_with_every_engine(experiment: str, infer: str, train: str) -> None:
    overrides = [f"experiment={experiment}", f"infer_engine={infer}", f"train_engine={train}"]
    expected = INCOMPATIBLE.get((experiment, infer, train))
    if expected is not None:
        with pytest.raises(ConfigError, match=expected):
            cfg = compose(overrides)
            fill_missing(cfg)
            to_object(cfg)
        return
    cfg = compose(overrides)
    fill_missing(cfg)
    typed = to_object(cfg)  # every group's __post_init__ and the cross-group invariants
    assert typed.infer_engine.name == infer and typed.train_engine.name == train
    assert isinstance(typed.infer_engine, InferEngineConfig)
    # Shared knobs keep the experiment's value whatever the engine (quickstart: 64 sequences at once).
    experiment_ie = OmegaConf.load(EXPERIMENT_FILES[experiment]).get("infer_engine") or {}
    for key, value in experiment_ie.items():
        assert getattr(typed.infer_engine, key) == value, f"infer_engine.{key} of experiment={experiment} lost"


def test_experiment_infer_keys_are_shared_by_every_engine() -> None:
    """What an experiment may set under infer_engine: keys of the engine-neutral base schema only."""
    shared = {f.name for f in dataclasses.fields(InferEngineConfig) if not f.name.startswith("_")}
    for experiment in EXPERIMENTS:
        keys = set((OmegaConf.load(EXPERIMENT_FILES[experiment]).get("infer_engine") or {}).keys())
        assert keys <= shared, f"experiment={experiment} sets engine-specific infer_engine keys {keys - shared}"


def test_shared_knobs_have_one_name_in_every_engine() -> None:
    """max_num_seqs / max_model_len are the base schema's; no engine spells them its own way in the config."""
    for infer in INFER:
        node = compose([f"infer_engine={infer}"]).infer_engine
        assert "max_num_seqs" in node and "max_model_len" in node, infer
        assert "max_running_requests" not in node and "context_length" not in node, infer
    # The old SGLang spelling is refused with the key's name (the engine maps max_num_seqs to it).
    with pytest.raises(ConfigError, match=r"max_running_requests"):
        compose(["infer_engine=sglang", "infer_engine.max_running_requests=8"])


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_engine_that_refuses_a_sampling_setting_names_the_key(experiment: str) -> None:
    """SGLang reports log-probs before top-p truncation: an experiment run with top_p < 1 on it fails at config
    time with a message naming the keys, not inside the engine."""
    with pytest.raises(ConfigError, match=r"infer_engine=sglang .* set top_p=1, top_k=0"):
        cfg = compose([f"experiment={experiment}", "infer_engine=sglang", "infer_engine.top_p=0.9"])
        fill_missing(cfg)
        to_object(cfg)
    with pytest.raises(ConfigError, match=re.escape("infer_engine.max_num_seqs=0 must be >= 1")):
        to_object(compose(["infer_engine=sglang", "infer_engine.max_num_seqs=0"]))
