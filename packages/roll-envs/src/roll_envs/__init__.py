"""roll-envs: verifiable rewards, built-in procedurally generated tasks, dataset loading, agentic environments."""

__version__ = "0.1.0"
