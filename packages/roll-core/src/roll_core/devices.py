"""Where a role's engine runs: `device="auto"` and `dtype="auto"` resolved on the worker's own node.

Light on purpose (roll_hw is imported when called): reward workers and judges that build an engine of their own
use it without importing the cluster's roles (tensordict, torch._dynamo: seconds of import).

Under Ray's NOSET switches a worker's device index is not 0 (roll_hw.ray_devices): `resolve_device` uses the
assigned one, narrows a worker spanning several devices to them before its engine starts (`narrow_ray_worker`),
and `ray_local_rank` is the LOCAL_RANK the worker exports (roll_core.cluster.worker.Worker.setup).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from roll_hw import Platform
    from roll_hw.ray_devices import LocalDevice

log = logging.getLogger(__name__)


def resolve_device(runtime: dict[str, Any]) -> dict[str, Any]:
    """Device and dtype decided where the engine runs, not on the driver (a CPU-only head may drive GPU workers).

    `runtime["platform"]` names the platform ("auto": detect here); `device="auto"` becomes its torch device and
    `dtype="auto"` (or a dtype it cannot run fast) becomes what the platform supports.

    In a Ray actor that reserved none of the platform's devices (a reward worker's judge engine, say), the node's
    devices belong to other workers. Ray used to hide them there (CUDA_VISIBLE_DEVICES=''); it no longer does
    (RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO now defaults to off: Ray 2.60), so detection saw them and the engine took
    device 0 of the node, unreserved. There "auto" resolves to the CPU (with a warning), and a named accelerator
    platform is an error that says how to reserve one.

    In a Ray actor that reserved devices, the device is the one Ray assigned (`ray_local_device`), logged with why:
    Ray narrowed visibility to it (local index 0, `device` stays the bare type), or Ray's NOSET switch
    (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 and its ROCm/Ascend equivalents) left every device of the node
    visible, where `device` becomes `<type>:<index of the assigned id>` and that device is made current (bare
    "cuda" and `current_device()` in the engines then mean it too): device 0 there was every worker's. A worker
    assigned several devices (a tensor-parallel inference engine) is first narrowed to them under NOSET, as Ray
    would have done (`narrow_ray_worker`): its engine's own processes count devices from 0.
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
    if _reserved_in_ray_actor(platform.ray_resource) == [] and out.get("device", "auto") == "auto":
        role, key = out.get("role", "?"), platform.ray_resource
        if name not in (None, "auto"):
            raise RuntimeError(
                f"role {role}: platform {name} in a Ray worker that reserved no {key}: its engine would take device 0 "
                f"of the node, which Ray gives to other workers; give the role devices of its own or platform=cpu"
            )
        log.warning(
            "role %s: this Ray worker reserved no %s (the node's belong to other workers): runs on cpu", role, key
        )
        platform = resolve_platform("cpu")
    role, device = out.get("role", "?"), out.get("device", "auto")
    narrow_ray_worker(platform, role)
    local = ray_local_device(platform)
    if local is not None:
        from roll_hw.ray_devices import describe

        log.info("role %s: this Ray worker %s", role, describe(platform, local))
        if local.noset and device in ("auto", platform.device_type):
            platform.set_device(local.index)
            out["device"] = platform.torch_device(local.index)
    # The engines ask roll_hw.current_platform (device backends, memory): the run's platform, not a fresh detection.
    set_current_platform(platform)
    if out.get("device", "auto") == "auto":
        out["device"] = platform.torch_device()
    if "dtype" in out:
        cfg = SimpleNamespace(dtype=out["dtype"])
        changes = platform.check_and_update_config(cfg)  # only dtype lines: cfg has no dist_backend
        if out["dtype"] != "auto" and cfg.dtype != out["dtype"]:  # an explicit choice overridden: say so
            log.warning("%s (role %s)", "; ".join(changes), out.get("role", "?"))
        out["dtype"] = cfg.dtype
    return out


def ray_local_device(platform: type[Platform]) -> LocalDevice | None:
    """The device this Ray actor was assigned of `platform`'s (roll_hw.ray_devices.local_device: the assigned id's
    index, under Ray's NOSET switch too); None outside a Ray actor, for a platform without Ray-assigned devices, or
    when the actor reserved none. ValueError where the assigned device is not visible in this process."""
    ids = _reserved_in_ray_actor(platform.ray_resource)
    if not ids:
        return None
    from roll_hw.ray_devices import local_device

    return local_device(platform, ids)


def narrow_ray_worker(platform: type[Platform], role: str = "?") -> dict[str, str]:
    """Under `platform`'s NOSET switch, narrow a Ray actor that reserved several of its devices to them: set its
    visible-devices variable to the assigned ids, as Ray would have (roll_hw.ray_devices.noset_narrowing), so the
    processes its engine starts (vLLM's tensor-parallel workers, SGLang's schedulers), which count devices from 0,
    use the worker's devices rather than the node's first ones, other workers'. Returns what it set ({} where
    nothing was to be set: one device, the switch off, outside a Ray actor, already narrowed).

    It must run before this process starts the device runtime, which reads the variable once: RuntimeError where
    it has (this process and its engine's would number the devices differently, and a CUDA IPC handle's device
    index would name another GPU in the receiver), or where the platform does not count exactly the assigned
    devices after it (the runtime fixed its visibility without saying so); the variable is then put back.
    """
    ids = _reserved_in_ray_actor(platform.ray_resource)
    if not ids:
        return {}
    from roll_hw.ray_devices import noset_narrowing

    setting = noset_narrowing(platform, ids)
    if not setting:
        return {}
    ((var, value),) = setting.items()
    what = (
        f"role {role}: this Ray worker spans {platform.ray_resource}s {', '.join(ids)} under {platform.ray_noset_env}=1"
    )
    if _device_runtime_started(platform):
        raise RuntimeError(
            f"{what}, and must narrow {var} to {value} for its engine's processes, but {platform.device_type} is "
            "already initialised in this process (it would keep numbering the node's devices, its engine's "
            "processes the worker's): build the engine before anything touches the device, or unset "
            f"{platform.ray_noset_env} for this role"
        )
    before = os.environ.get(var)
    os.environ[var] = value
    count = platform.device_count()
    if count != len(ids):
        if before is None:
            del os.environ[var]
        else:
            os.environ[var] = before
        raise RuntimeError(
            f"{what}: narrowed {var} to {value}, but {platform.name} then counted {count} devices here, not "
            f"{len(ids)}: its runtime read the visible devices before (as torch does where NVML is missing); "
            f"unset {platform.ray_noset_env} for this role"
        )
    log.info(
        "%s: %s=%s set for it and its engine's processes, as Ray would have (they count devices from 0)",
        what,
        var,
        value,
    )
    return setting


def ray_local_rank(platform: type[Platform] | None = None) -> int:
    """The LOCAL_RANK this process exports as a Ray worker: its device's local index under a NOSET switch of the
    CUDA, ROCm or Ascend platform (roll_hw.ray_devices.local_rank; 0 for a worker spanning several devices, which
    `narrow_ray_worker` narrows), else 0: Ray narrowed visibility, the worker reserved no device, or this is no
    Ray actor. Out-of-tree platforms are narrowed by roll always (no NOSET switch), so 0 is their index too.

    `platform` is the one this worker runs; by default, where the switches of several platforms apply, the one
    `resolve_device` would resolve here for platform auto ($ROLL_PLATFORM, else detection). Only its switch counts
    then: an AMD node whose image sets Ray's CUDA switch beside the HIP one was refused, though
    CUDA_VISIBLE_DEVICES numbers nothing there. ValueError where the assigned device is not visible
    (roll_hw.ray_devices.local_device), or where the platform cannot be told and the switches give different
    indices."""
    ids = _accelerator_ids_in_ray_actor()
    if not ids:
        return 0
    from roll_hw.cuda import CudaPlatform
    from roll_hw.npu import NpuPlatform
    from roll_hw.ray_devices import local_rank, ray_noset
    from roll_hw.rocm import RocmPlatform

    builtins = (CudaPlatform, RocmPlatform, NpuPlatform)
    failed = None
    # Detection only where switches of several platforms apply: one alone (or none: Ray narrowed) decides as is.
    if platform is None and sum(bool(ids.get(p.ray_resource or "")) and ray_noset(p) for p in builtins) > 1:
        from roll_hw import resolve_platform

        try:
            platform = resolve_platform()
        except Exception as exc:  # a broken plugin, say: the switches may still agree
            failed = f"{type(exc).__name__}: {exc}"
    try:
        return local_rank(builtins, ids, in_use=platform)
    except ValueError as exc:
        if failed is None:
            raise
        raise ValueError(f"{exc} (detecting the platform here failed: {failed})") from exc


def _device_runtime_started(platform: type[Platform]) -> bool:
    """Whether this process has initialised `platform`'s torch device runtime (`torch.cuda.is_initialized()`, or
    `torch.npu`'s); False where torch is not imported (nothing can have started it)."""
    torch = sys.modules.get("torch")
    started = getattr(getattr(torch, platform.device_type, None), "is_initialized", None) if torch else None
    return bool(started()) if callable(started) else False


def _reserved_in_ray_actor(resource: str | None) -> list[str] | None:
    """The ids of Ray resource `resource` ("GPU", "NPU") this process's Ray actor reserved; None outside a Ray
    actor (a driver, cluster=local) or for a resource Ray does not assign ids to (CPU, a plugin's custom resource).
    Imports nothing: a process that has not imported ray is no Ray worker."""
    if resource is None:
        return None
    ids = _accelerator_ids_in_ray_actor()
    return None if ids is None else (list(ids[resource]) if resource in ids else None)


def _accelerator_ids_in_ray_actor() -> dict[str, list[str]] | None:
    """Ray's `get_accelerator_ids()` of this process's actor ({"GPU": [...], "NPU": [...], ...}); None outside a
    Ray actor. Imports nothing."""
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        if not ray.is_initialized():
            return None
        context = ray.get_runtime_context()
        if context.get_actor_id() is None:
            return None
        ids = context.get_accelerator_ids()
    except Exception:  # a partly imported or stubbed ray: not a Ray worker we can ask
        return None
    return {str(k): [str(i) for i in v] for k, v in dict(ids).items()}
