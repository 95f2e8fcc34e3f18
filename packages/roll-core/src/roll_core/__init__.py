"""roll-core: batch protocol, workers, placement, pipelines, checkpoints, tracking, config schemas and CLI."""

__version__ = "0.1.0"
