"""Workers and dispatch modes: how one controller call is spread over a worker group.

A worker is a plain class; each method that a group may call declares its dispatch mode with `@dispatch(...)`:
- `Dispatch.BROADCAST`: every rank gets the same arguments; the call returns the list of per-rank results.
- `Dispatch.DP`: the first argument is a `Batch`, split unevenly over the data-parallel ranks; the per-rank
  `Batch` results are concatenated back in order (other results come back as a list).
- `Dispatch.RANK0`: only rank 0 runs; its result is returned.
- `Dispatch.ONE`: the caller names the rank (`WorkerGroup.submit_to`): request-level calls routed to one engine.
A method may also declare `retry=False`: it is not rerun on a restarted worker (see `dispatch`).

Arguments and results travel by value on both backends (`by_value`): Ray serialises them, and the local backend
gives a call copies of the tensors, arrays, Batches and TensorDicts it is passed or returns, and of the lists,
tuples, dicts and sets holding them, so a worker that changes its input in place, or a caller that changes a
result or a batch it passed, sees what it would see on Ray. Other objects (a loss function, sampling parameters,
an image) are passed as they are on the local backend: neither side may count on changing them for the other.
The declaration sits next to the method; the controller names the method itself when it calls a group
(`group.call(TrainWorker.compute_values, batch)`, roll_core.cluster.group), never its name as a string, and
through typed group classes (roll_core.cluster.roles), never methods attached at run time.
"""

from __future__ import annotations

import enum
import os
import socket
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Dispatch(enum.Enum):
    BROADCAST = "broadcast"
    DP = "dp"
    RANK0 = "rank0"
    ONE = "one"


def dispatch(mode: Dispatch, *, retry: bool = True) -> Callable[[F], F]:
    """Declare how a worker-group call of this method is distributed.

    `retry=False`: when a worker dies during this call, the group restarts it (if its role may restart) but does
    not run the call again on the new worker; it raises `WorkerRestartedError` so that the caller redoes the whole
    protocol the call belongs to (a weight sync: its steps are meaningless one by one on a fresh engine).
    """

    def mark(fn: F) -> F:
        fn.__roll_dispatch__ = mode  # type: ignore[attr-defined]
        fn.__roll_retry__ = retry  # type: ignore[attr-defined]
        return fn

    return mark


def retryable(cls: type, method: str) -> bool:
    """Whether a call of `cls.method` may be rerun on a restarted worker (see `dispatch`)."""
    return bool(getattr(getattr(cls, method, None), "__roll_retry__", True))


def dispatch_mode(cls: type, method: str) -> Dispatch:
    """The declared dispatch mode of `cls.method` (error if undeclared: every remote method must say)."""
    fn = getattr(cls, method, None)
    if fn is None:
        raise AttributeError(f"{cls.__name__} has no method {method!r}")
    mode = getattr(fn, "__roll_dispatch__", None)
    if mode is None:
        raise TypeError(f"{cls.__name__}.{method} is not callable through a worker group: decorate it with @dispatch")
    return mode


#: Values a copy needs not look into.
_ATOMIC = (str, bytes, int, float, bool, complex, type(None))


def by_value(obj: Any, memo: dict[int, Any] | None = None) -> Any:
    """`obj` as a call's other side gets it over Ray, for what matters to in-place changes: tensors (cloned,
    detached), numpy arrays, Batches and TensorDicts are copied, and lists, tuples, dicts and sets are rebuilt around
    copies; anything else is returned as it is. An object reached twice is copied once (`memo`), as in a pickle."""
    if isinstance(obj, _ATOMIC):
        return obj
    memo = {} if memo is None else memo
    key = id(obj)
    if key in memo:
        return memo[key]
    out = _copy(obj, memo)
    memo[key] = out
    return out


def _copy(obj: Any, memo: dict[int, Any]) -> Any:
    import sys

    torch = sys.modules.get("torch")  # no tensor can be here without torch imported: a worker need not import it
    if torch is not None and isinstance(obj, torch.Tensor):
        copied = obj.detach().clone()
        if isinstance(obj, torch.nn.Parameter):
            return torch.nn.Parameter(copied, requires_grad=obj.requires_grad)
        return copied.requires_grad_(obj.requires_grad) if obj.requires_grad and obj.is_leaf else copied
    if type(obj) in (list, tuple, set, frozenset):
        if all(isinstance(x, _ATOMIC) for x in obj):  # rows of token ids: a shallow copy is a copy
            return obj if type(obj) in (tuple, frozenset) else type(obj)(obj)
        return type(obj)(by_value(x, memo) for x in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a NamedTuple
        return type(obj)(*(by_value(x, memo) for x in obj))
    if type(obj) is dict:
        return {k: by_value(v, memo) for k, v in obj.items()}
    from roll_core.protocol import Batch

    if isinstance(obj, Batch):
        fields = {k: by_value(v, memo) for k, v in obj.fields.items()}
        return Batch(obj.td.clone(), fields, by_value(obj.meta, memo))
    td = sys.modules.get("tensordict")
    if td is not None and isinstance(obj, td.TensorDictBase):
        return obj.clone()
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        return obj.copy()
    return obj


def node_address() -> str:
    """This node's address as Ray knows it (127.0.0.1 outside Ray): where a rank hosts a rendezvous."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    return "127.0.0.1"


#: torch.distributed launch variables a Ray worker drops before its set-up exports its own (a rank of one exports
#: none: its engine starts a group of one); torchrun and PyTorchJob set them in the environment Ray workers inherit.
INHERITED_LAUNCH_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
)


class Worker:
    """Base of role workers: knows its rank, the group size and the distributed rendezvous."""

    def __init__(self, rank: int = 0, world_size: int = 1, **_: Any) -> None:
        self.rank, self.world_size = rank, world_size
        self.rendezvous: tuple[str, int, int] | None = None  # (address, port, pid of the rank that chose them)
        self._port_reservation: socket.socket | None = None  # rank 0's rendezvous port, held until set-up

    @dispatch(Dispatch.RANK0)
    def rendezvous_endpoint(self) -> tuple[str, int, int]:
        """This node's address, a port free on it and this pid: rank 0 hosts the torch.distributed store, so the
        endpoint must be rank 0's, not the driver's (which may be another node, or a CPU-only head)."""
        from roll_core.cluster.ports import reserve_port

        host = node_address()
        # Held until this rank's set-up has started the store on it (see `setup`).
        self._port_reservation = reserve_port("" if host != "127.0.0.1" else host)
        return host, int(self._port_reservation.getsockname()[1]), os.getpid()

    @dispatch(Dispatch.BROADCAST)
    def setup(self, master_addr: str, master_port: int, chosen_by: int = 0, export_env: bool = True) -> None:
        """Second start-up phase, once every rank exists: the rendezvous, then `on_setup()` (engines).

        `export_env=False` for in-process (local) groups: their ranks share the controller's environment, and
        torch.distributed variables left there would make a later process group wait for ranks that never come.
        A Ray worker first drops the torch.distributed launch variables it inherited (`INHERITED_LAUNCH_ENV`): a rank
        of one exports none. LOCAL_RANK is this worker's local device index (roll_core.devices.ray_local_rank): 0,
        except under Ray's NOSET switch, where it is the index of the device Ray assigned among the node's.
        """
        self.rendezvous = (master_addr, master_port, chosen_by)
        if export_env:
            # A Ray worker inherits the environment of the driver or of `ray start` (a driver under torchrun, a
            # PyTorchJob pod): a rank of one saw RANK=3 WORLD_SIZE=8 there and its engine's process group waited for
            # ranks that never come, and torchrun's agent-store switch kept rank 0 from hosting the store.
            for var in INHERITED_LAUNCH_ENV:
                os.environ.pop(var, None)
        # torch.distributed reads these; set before any engine initialises a process group.
        if self.world_size > 1 and export_env:
            from roll_core.devices import ray_local_rank

            os.environ.update(
                {
                    "RANK": str(self.rank),
                    "WORLD_SIZE": str(self.world_size),
                    # The worker's device index, which libraries that follow torch.distributed's launch conventions
                    # (DeepSpeed, accelerate, some vLLM/Megatron paths) make current: 0 where Ray narrowed
                    # visibility, the index of the GPU Ray assigned under its NOSET switch, where every worker of
                    # the node sees all its GPUs and 0 put them all on the first.
                    "LOCAL_RANK": str(ray_local_rank()),
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(master_port),
                }
            )
        try:
            self.on_setup()
        finally:
            if self._port_reservation is not None:
                self._port_reservation.close()
                self._port_reservation = None

    def on_setup(self) -> None:
        """Subclasses build what needs the rendezvous (engines) here."""

    def teardown(self) -> None:
        """Release what `on_setup` built (an engine's background threads and memory) when the group shuts down.
        The local backend calls it; a Ray worker's process ends instead. Default: the engine's `shutdown()`."""
        shutdown = getattr(getattr(self, "engine", None), "shutdown", None)
        if callable(shutdown):
            shutdown()

    @dispatch(Dispatch.BROADCAST)
    def ping(self) -> tuple[int, int, int]:
        """(rank, world size, pid): for tests and health checks."""
        return self.rank, self.world_size, os.getpid()

    def node_id(self) -> str:
        """Ray node id of this worker (the host name outside Ray)."""
        try:
            import ray

            if ray.is_initialized():
                return str(ray.get_runtime_context().get_node_id())
        except ImportError:
            pass
        return socket.gethostname()

    @dispatch(Dispatch.BROADCAST)
    def node_info(self, platform: str | None = None) -> dict[str, Any]:
        """Where this worker runs: node id (Ray) and the visible-devices variables it sees; with a platform name,
        also `device`, the local device it uses of that platform's (roll_core.devices.ray_local_device, as a dict;
        None where it reserved none)."""
        info: dict[str, Any] = {"rank": self.rank, "pid": os.getpid(), "rendezvous": self.rendezvous}
        try:
            import ray

            if ray.is_initialized():
                ctx = ray.get_runtime_context()
                info["node_id"] = ctx.get_node_id()
                info["resources"] = ctx.get_assigned_resources()
        except ImportError:
            pass
        for var, value in os.environ.items():
            if var.endswith("_VISIBLE_DEVICES"):
                info[var] = value
        if platform is not None:
            import dataclasses

            from roll_core.devices import ray_local_device
            from roll_hw import get_platform_class

            local = ray_local_device(get_platform_class(platform))
            info["device"] = None if local is None else dataclasses.asdict(local)
        return info
