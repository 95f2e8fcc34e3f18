"""Root conftest: skip hardware-marked tests unless the current platform matches.

`@pytest.mark.cuda` / `rocm` / `npu` run only where `roll_hw.current_platform` is that platform;
`@pytest.mark.gpus(n)` additionally needs n devices. roll_hw is imported lazily so that packages tested alone
(without roll-hw installed, e.g. roll-algos) still collect.
"""

from __future__ import annotations

import os

import pytest

# Ray refuses to start local test clusters without token auth unless told otherwise; only for tests.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
HW_MARKERS = ("cuda", "rocm", "npu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs_hw = [it for it in items if any(it.get_closest_marker(m) for m in (*HW_MARKERS, "gpus"))]
    if not needs_hw:
        return
    try:
        import roll_hw

        platform = roll_hw.current_platform
        name, count = platform.name, platform.device_count()
    except Exception as exc:  # roll-hw absent or platform unresolvable: no device tests
        name, count = f"unknown ({exc})", 0
    for item in needs_hw:
        wanted = [m for m in HW_MARKERS if item.get_closest_marker(m)]
        if wanted and name not in wanted:
            item.add_marker(pytest.mark.skip(reason=f"needs {'/'.join(wanted)}; this machine is {name}"))
            continue
        gpus = item.get_closest_marker("gpus")
        if gpus is not None:
            n = gpus.args[0] if gpus.args else 1
            if name == "cpu" or count < n:
                item.add_marker(pytest.mark.skip(reason=f"needs {n} accelerator(s); {name} has {count}"))
