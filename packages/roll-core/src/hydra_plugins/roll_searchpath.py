"""roll-core's Hydra search-path plugin: the config groups that installed roll packages ship join Hydra's search path.

Hydra discovers this module in the `hydra_plugins` namespace package. The work is in
`roll_core.config.search_path.extend_search_path`; this module imports only Hydra, because Hydra imports every
plugin module of the environment whatever the application. Until a roll package's `register_configs()` has run in
this process (which imports `roll_core.config.search_path`), nothing is added: other Hydra applications installed
beside roll see no roll groups.
"""

from __future__ import annotations

import sys

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class RollSearchPathPlugin(SearchPathPlugin):
    """Appends `pkg://<module>` for every module registered with `roll_core.config.search_path.add_config_package`."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        registry = sys.modules.get("roll_core.config.search_path")
        if registry is not None:
            registry.extend_search_path(search_path)
