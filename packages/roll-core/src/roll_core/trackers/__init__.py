"""roll-core's tracker backends, one module each, every one registered under `roll.trackers` like a plugin.

| name | module | writes | extra |
|---|---|---|---|
| `tensorboard` (default) | `trackers.tensorboard` | `<run>/tensorboard/` event files | `roll-core[track]` |
| `jsonl` | `trackers.jsonl` | nothing beyond the core files (metrics.jsonl, samples.jsonl) | none |
| `wandb` | `trackers.wandb` | a W&B run (offline files under `<run>/wandb` without an API key) | `roll-core[wandb]` |
| `mlflow` | `trackers.mlflow` | an MLflow run (a server, or SQLite in `<run>/mlflow`) | `roll-core[mlflow]` |
| `swanlab` | `trackers.swanlab` | a SwanLab experiment (local mode: `<run>/swanlog`) | `roll-core[swanlab]` |

Several run at once: `pipeline.trackers=[tensorboard,wandb]`; options: the `tracking` config node
(roll_core.config.tracking). The contract is roll_core.interfaces.tracking; the conformance suite every backend
passes is roll_core.testing.trackers. Modules import their service's package in `__init__` only (the config check
imports the module to validate the name). Each backend class has an `extra` attribute (the `roll_core.errors.Extra`
it needs, or None) that roll-doctor and the early install check read. Helpers: `replay` (the run folder's steps a
resumed backend resends), `background` (a server backend's calls off the training thread), `mlflow_keys` (MLflow
names for metric keys and params).
"""
