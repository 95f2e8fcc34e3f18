"""Where a role's engine runs: `device="auto"` and `dtype="auto"` resolved on the worker's own node.

Light on purpose (roll_hw is imported when called): reward workers and judges that build an engine of their own
use it without importing the cluster's roles (tensordict, torch._dynamo: seconds of import).
"""

from __future__ import annotations

import logging
from typing import Any


def resolve_device(runtime: dict[str, Any]) -> dict[str, Any]:
    """Device and dtype decided where the engine runs, not on the driver (a CPU-only head may drive GPU workers).

    `runtime["platform"]` names the platform ("auto": detect here); `device="auto"` becomes its torch device and
    `dtype="auto"` (or a dtype it cannot run fast) becomes what the platform supports.
    """
    from types import SimpleNamespace

    from roll_hw import resolve_platform, set_current_platform

    out = dict(runtime)
    name = out.pop("platform", "auto")
    try:
        platform = resolve_platform(None if name in (None, "auto") else name)
    except Exception as exc:
        import socket

        raise RuntimeError(f"{socket.gethostname()}: {exc}") from exc
    # The engines ask roll_hw.current_platform (device backends, memory): the run's platform, not a fresh detection.
    set_current_platform(platform)
    if out.get("device", "auto") == "auto":
        out["device"] = platform.torch_device()
    if "dtype" in out:
        cfg = SimpleNamespace(dtype=out["dtype"])
        changes = platform.check_and_update_config(cfg)  # only dtype lines: cfg has no dist_backend
        if out["dtype"] != "auto" and cfg.dtype != out["dtype"]:  # an explicit choice overridden: say so
            logging.getLogger(__name__).warning("%s (role %s)", "; ".join(changes), out.get("role", "?"))
        out["dtype"] = cfg.dtype
    return out
