"""Which local device a Ray worker uses, from the accelerator ids Ray assigned it (no Ray import: pure).

Contract:
- Ray assigns a worker accelerator ids (`ray.get_runtime_context().get_accelerator_ids()["GPU"]`): physical ids on
  the node, or the entries of the node's visible-devices variable where the node was started with one.
- Normally Ray narrows the worker to them (`CUDA_VISIBLE_DEVICES=<ids>`): its first assigned device is local
  device 0.
- With Ray's NOSET switch for the platform (`Platform.ray_noset_env`, e.g.
  RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1, set for CUDA IPC between workers or for a framework that manages
  devices itself) Ray leaves the variable as the node had it, and every worker sees the node's devices: its local
  device is the position of its first assigned id among the devices it sees (the id itself where the variable is
  unset). Assuming device 0 there put every worker of a node on the node's first device.
- An id the process cannot see is a `ValueError` that names the variables: never a silent fall back to device 0.
- Platforms whose devices Ray does not manage (`ray_noset_env` None: out-of-tree platforms such as the test's
  DUMMY) are narrowed by roll itself (`Cluster._bundle_envs`), always: Ray has no switch for them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from roll_hw.interface import Platform


@dataclass(frozen=True)
class LocalDevice:
    """The device a Ray worker uses: `index` is the torch index in this process ("cuda:<index>"), `ray_ids` what
    Ray assigned, `noset` whether Ray left visibility alone, `reason` one line for the worker's log."""

    index: int
    ray_ids: tuple[str, ...]
    noset: bool
    reason: str


def ray_noset(platform: type[Platform], environ: Mapping[str, str] | None = None) -> bool:
    """True when Ray's NOSET switch of `platform` is on in `environ` (default `os.environ`), read as Ray reads it
    (`ray._common.utils.env_bool`: "1" or "true", any case)."""
    env = os.environ if environ is None else environ
    name = platform.ray_noset_env
    return bool(name) and env.get(name, "").strip().lower() in ("1", "true")


def local_device(
    platform: type[Platform], ray_ids: Sequence[str | int], environ: Mapping[str, str] | None = None
) -> LocalDevice:
    """The local device of a worker Ray assigned `ray_ids` (non-empty, in Ray's order) of `platform`'s devices.

    `environ` (default `os.environ`) is the worker's environment: the NOSET switch and the visible-devices variable.
    Raises ValueError when `ray_ids` is empty, or when under NOSET the assigned device is not visible here.
    """
    env = os.environ if environ is None else environ
    ids = tuple(str(i).strip() for i in ray_ids)
    if not ids:
        raise ValueError(f"{platform.name}: no {platform.ray_resource} ids assigned: this worker reserved no device")
    var = platform.visible_devices_env
    seen = env.get(var) if var else None
    if not ray_noset(platform, env):
        # Ray set the variable to exactly `ids`, in that order: the first is local device 0.
        shown = f"{var}={seen}" if var and seen is not None else f"{var or 'visibility'} as Ray set it"
        return LocalDevice(0, ids, False, f"narrowed by Ray ({shown})")
    why = f"{platform.ray_noset_env}=1: Ray left {var} "
    if seen is None:
        # Every device of the node is visible, numbered as the driver numbers them: the id is the index.
        if not ids[0].isdigit():
            raise ValueError(
                f"{platform.name}: Ray assigned {platform.ray_resource} {ids[0]!r}, not an index, and {var} is unset "
                f"under {platform.ray_noset_env}=1: cannot tell which local device it is"
            )
        return LocalDevice(int(ids[0]), ids, True, why + "unset (every device of the node visible)")
    visible = [v.strip() for v in seen.split(",") if v.strip()]
    if ids[0] not in visible:
        raise ValueError(
            f"{platform.name}: Ray assigned {platform.ray_resource} {ids[0]} but this worker sees {var}={seen!r} "
            f"({platform.ray_noset_env}=1: Ray did not narrow it); the node's raylet and this worker disagree on "
            f"{var}: start them with the same value"
        )
    return LocalDevice(visible.index(ids[0]), ids, True, why + f"as the node had it ({var}={seen})")


def describe(platform: type[Platform], device: LocalDevice) -> str:
    """One log line: which device this worker uses, which of Ray's ids it is, and why that index."""
    own = f" (of {', '.join(device.ray_ids)})" if len(device.ray_ids) > 1 else ""
    return (
        f"uses {platform.torch_device(device.index)}: Ray's {platform.ray_resource} {device.ray_ids[0]}{own}, "
        f"{device.reason}"
    )
