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
- A worker Ray assigned several devices (an inference engine spanning N devices, whose own processes, such as
  vLLM's tensor-parallel workers, count devices from 0) is narrowed under NOSET too, by roll, to exactly its ids,
  as Ray would have done (`noset_narrowing`): those processes inherit the variable, and count the worker's devices
  from 0 instead of the node's first N devices, other workers'. NOSET's point, one device numbering for the
  processes that share memory through CUDA IPC, is not lost: roll's cross-worker CUDA IPC (`sync_transport=
  cuda_ipc`) needs colocated roles, which are refused a multi-device worker, and within the worker the engine's
  processes all inherit the narrowed variable, so a handle's device index means the same GPU in each. The worker
  must narrow before its own process starts the device runtime (roll_core.devices checks it).
- `local_rank`: the LOCAL_RANK a Ray worker exports, its local device index as above (0 where Ray or roll
  narrowed): torch.distributed launch conventions, and libraries that pick their device from it (DeepSpeed,
  accelerate, some vLLM/Megatron paths), then land on the worker's device, not device 0 of the node. The switch
  of the platform in use decides (a node may carry Ray's switches of several); only switches that disagree with
  that platform unknown are an error.
- An id the process cannot see is a `ValueError` that names the variables: never a silent fall back to device 0.
- Platforms whose devices Ray does not manage (`ray_noset_env` None: out-of-tree platforms such as the test's
  DUMMY) are narrowed by roll itself (`Cluster._bundle_envs`), always: Ray has no switch for them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
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
    visible = _entries(platform, seen)
    if len(ids) > 1 and visible == list(ids):
        # noset_narrowing's result (or a node whose list is exactly this worker's devices): the first is 0.
        return LocalDevice(
            0,
            ids,
            True,
            why + f"to roll, narrowed to this worker's {len(ids)} devices ({var}={seen}: its engine's processes "
            "count them from 0)",
        )
    if ids[0] not in visible:
        raise ValueError(
            f"{platform.name}: Ray assigned {platform.ray_resource} {ids[0]} but this worker sees {var}={seen!r}"
            f"{_read_as(platform, seen, visible)} ({platform.ray_noset_env}=1: Ray did not narrow it); "
            f"{_advice(platform, seen, visible)}"
        )
    return LocalDevice(visible.index(ids[0]), ids, True, why + f"as the node had it ({var}={seen})")


def noset_narrowing(
    platform: type[Platform], ray_ids: Sequence[str | int], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The visible-devices setting a worker Ray assigned several devices (`ray_ids`, in Ray's order) of `platform`'s
    must take under NOSET: `{visible_devices_env: "<id>,<id>,..."}`, what Ray would have set without the switch;
    `{}` where there is nothing to set (one device, the switch off, no variable, or already narrowed to them).

    Every id must be visible in `environ` (default `os.environ`): an id the node's variable hides, or a non-index
    id with the variable unset, is a ValueError, as in `local_device`.
    """
    env = os.environ if environ is None else environ
    ids = tuple(str(i).strip() for i in ray_ids)
    var = platform.visible_devices_env
    if len(ids) < 2 or not var or not ray_noset(platform, env):
        return {}
    seen = env.get(var)
    if seen is None:
        odd = [i for i in ids if not i.isdigit()]
        if odd:
            raise ValueError(
                f"{platform.name}: Ray assigned {platform.ray_resource} {', '.join(odd)}, not indices, and {var} is "
                f"unset under {platform.ray_noset_env}=1: cannot narrow this worker to its devices"
            )
    else:
        visible = _entries(platform, seen)
        if visible == list(ids):
            return {}
        hidden = [i for i in ids if i not in visible]
        if hidden:
            raise ValueError(
                f"{platform.name}: Ray assigned {platform.ray_resource} {', '.join(ids)} but this worker sees "
                f"{var}={seen!r}{_read_as(platform, seen, visible)}, without {', '.join(hidden)} "
                f"({platform.ray_noset_env}=1: Ray did not narrow it); {_advice(platform, seen, visible)}"
            )
    return {var: ",".join(ids)}


def local_rank(
    platforms: Iterable[type[Platform]],
    accelerator_ids: Mapping[str, Sequence[str | int]],
    environ: Mapping[str, str] | None = None,
    in_use: type[Platform] | None = None,
) -> int:
    """LOCAL_RANK of a Ray worker: the local index of its device (`local_device`, as after `noset_narrowing`) for
    the platforms among `platforms` whose NOSET switch is on in `environ` and whose `ray_resource` it was assigned
    ids of in `accelerator_ids` (Ray's `get_accelerator_ids()`); 0 where none is (Ray narrowed visibility, or the
    worker holds no device: its first visible device is its own, or it has none).

    `in_use`: the platform this worker runs, when known. Only its switch counts then: another platform's switch
    (a node image that sets both Ray's CUDA and HIP switches) names a variable this node's runtime does not number
    its devices by. A platform in use that is not among `platforms` (CPU, a plugin that roll narrows itself) is 0.

    ValueError where the platform in use is not known and the switches that are on disagree (visible-devices
    variables that number the device differently: a real ambiguity), or as `local_device` where the device is not
    visible.
    """
    env = dict(os.environ if environ is None else environ)
    candidates = list(platforms)
    if in_use is not None:
        candidates = [p for p in candidates if p.name == in_use.name]
    found: dict[str, int] = {}
    for platform in candidates:
        ids = accelerator_ids.get(platform.ray_resource or "") or ()
        if not ids or not ray_noset(platform, env):
            continue
        view = {**env, **noset_narrowing(platform, ids, env)}
        found[platform.name] = local_device(platform, ids, view).index
    if len(set(found.values())) > 1:
        switches = ", ".join(f"{p.ray_noset_env}=1" for p in candidates if p.name in found)
        raise ValueError(
            f"Ray's NOSET switches of {', '.join(found)} are all on ({switches}) and give this worker different "
            f"device indices ({found}), and which platform it runs is not known: set only the switch of this "
            "node's accelerator, or name the platform (ROLL_PLATFORM, hw.platform)"
        )
    return next(iter(found.values()), 0)


def _entries(platform: type[Platform], value: str) -> list[str]:
    """The entries of a visible-devices variable that name devices, as `platform`'s runtime reads them.

    CUDA and ROCm (torch's `device_type` "cuda"; the drivers' rule, which torch's `_parse_visible_devices` copies):
    the entries up to the first that names no device (a negative index such as -1, text that does not start with
    digits, in a `GPU-`/`MIG-` UUID list an entry without that prefix), and none at all where an entry repeats.
    Ray splits the variable at every comma, so under NOSET it can assign an entry past the cut ("0,1,-1,2": Ray
    counts 4 GPUs, CUDA sees 2): its place in the full list was a device index the worker does not have. Other
    runtimes: every non-empty entry.
    """
    if platform.device_type != "cuda":
        return _split(value)
    entries = [v.strip() for v in value.split(",")]
    prefix = next((p for p in ("GPU-", "MIG-") if entries[0].startswith(p)), None)
    out: list[str] = []
    seen: set[object] = set()
    for entry in entries:
        key: object = entry
        if prefix is not None:
            if not entry.startswith(prefix):
                break
        else:
            found = re.match(r"[+-]?\d+", entry)  # read as strtoul reads it: "1gpu" is device 1
            if found is None or int(found.group()) < 0:
                break
            key = int(found.group())
        if key in seen:
            return []
        seen.add(key)
        out.append(entry)
    return out


def _read_as(platform: type[Platform], value: str, visible: list[str]) -> str:
    """ ", which <runtime> reads as ..." where `platform`'s runtime reads fewer entries than the commas separate."""
    if visible == _split(value):
        return ""
    shown = ",".join(visible) or "no device"
    return (
        f", which {platform.name} reads as {shown} (it stops at the first entry naming no device, and a repeated "
        "entry hides all)"
    )


def _split(value: str) -> list[str]:
    """Every non-empty entry between the commas of a visible-devices variable (how Ray reads it, stripped)."""
    return [v.strip() for v in value.split(",") if v.strip()]


def _advice(platform: type[Platform], value: str, visible: list[str]) -> str:
    """What to do about an assigned device this worker does not see: a variable the runtime reads short is the
    node's to fix (Ray made a device of every entry); otherwise the raylet and this worker were started apart."""
    var = platform.visible_devices_env
    if visible != _split(value):
        return f"set {var} where the node's raylet starts to a list of this node's devices without repeats"
    return f"the node's raylet and this worker disagree on {var}: start them with the same value"


def describe(platform: type[Platform], device: LocalDevice) -> str:
    """One log line: which device this worker uses, which of Ray's ids it is, and why that index."""
    own = f" (of {', '.join(device.ray_ids)})" if len(device.ray_ids) > 1 else ""
    return (
        f"uses {platform.torch_device(device.index)}: Ray's {platform.ray_resource} {device.ray_ids[0]}{own}, "
        f"{device.reason}"
    )
