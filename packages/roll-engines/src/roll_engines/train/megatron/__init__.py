"""The `megatron` training engine (Megatron-Core). Importing this package does not import megatron."""

from roll_engines.train.megatron.engine import MegatronTrainEngine

__all__ = ["MegatronTrainEngine"]
