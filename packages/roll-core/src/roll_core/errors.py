"""Errors shared across roll-core that must be importable without Hydra/OmegaConf (device checks, engines)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A run config is invalid; the message names the key and, where close, the right spelling."""
