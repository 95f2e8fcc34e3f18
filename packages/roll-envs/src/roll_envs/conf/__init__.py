"""Package data: roll-envs' Hydra config groups (env/).

A folder of YAML, not code; the `__init__.py` makes it a module that Hydra's `pkg://roll_envs.conf` source can read.
`roll_envs`'s `register_configs()` (its `roll.configs` entry point) puts it on roll's search path
(roll_core.config.search_path). Each YAML starts with what it is for and a launch command.
"""
