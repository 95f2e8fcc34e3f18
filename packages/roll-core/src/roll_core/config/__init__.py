"""Config schemas (dataclasses in Hydra's ConfigStore) and composition helpers."""

from roll_core.config.compose import ConfigError, compose, explain, find_conf_dir, load_config, to_object
from roll_core.config.schema import (
    AlgoConfig,
    ClusterConfig,
    HwConfig,
    ModelConfig,
    PipelineConfig,
    RLVRConfig,
    register_configs,
)

__all__ = [
    "AlgoConfig",
    "ClusterConfig",
    "ConfigError",
    "HwConfig",
    "ModelConfig",
    "PipelineConfig",
    "RLVRConfig",
    "compose",
    "explain",
    "find_conf_dir",
    "load_config",
    "register_configs",
    "to_object",
]
