"""Package data: roll-core's Hydra config groups, the primary `rlvr.yaml`, `algo/`, `model/`, `hw/`, `cluster/`,
`pipeline/`, `hydra/launcher/` and the product's experiments (`quickstart`, `agentic_quickstart`).

A folder of YAML, not code; the `__init__.py` makes it a module that Hydra's `pkg://roll_core.conf` source can read.
`roll_core`'s `register_configs()` (its `roll.configs` entry point) puts it on roll's search path
(roll_core.config.search_path). Each YAML starts with what it is for and a launch command.
"""
