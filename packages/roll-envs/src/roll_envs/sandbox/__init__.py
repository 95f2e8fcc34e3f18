"""An OS sandbox for model-written Python programs (bubblewrap), used by the code reward.

`PythonSandbox(limits).run(code, stdin) -> RunResult` runs one program on one input in a fresh sandbox: no
network, a read-only view of the interpreter and system libraries only, a private size-capped /tmp and /dev/shm,
its own PID namespace, resource limits, a wall clock and an output budget (bwrap.py, process.py and runner.py state
the contracts). Each run is pinned to `SandboxLimits.cpus` CPUs, and `os.cpu_count()` and the OpenMP/BLAS thread
variables inside say so, so pools sized by the CPU count fit in `max_processes` (runner.py, _child.py). The caller
judges the output outside the sandbox. Nothing here ever runs model text in the calling process.
`make_sandbox(limits, ...)` builds one the way the code reward and the code tool do: bubblewrap where it works, else
(only when allowed) the unsandboxed fallback, loudly logged.
"""

from roll_envs.sandbox.bwrap import find_bwrap
from roll_envs.sandbox.process import (
    OK,
    OUTPUT_LIMIT,
    RUNTIME_ERROR,
    SANDBOX_ERROR,
    STATUSES,
    TIMEOUT,
    RunResult,
    SandboxLimits,
)
from roll_envs.sandbox.runner import CHILD_MARKER, PythonSandbox, SandboxUnavailableError, make_sandbox

__all__ = [
    "CHILD_MARKER",
    "OK",
    "OUTPUT_LIMIT",
    "RUNTIME_ERROR",
    "SANDBOX_ERROR",
    "STATUSES",
    "TIMEOUT",
    "PythonSandbox",
    "RunResult",
    "SandboxLimits",
    "SandboxUnavailableError",
    "find_bwrap",
    "make_sandbox",
]
