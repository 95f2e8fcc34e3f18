"""Root conftest: skip hardware-marked tests unless the current platform matches; end the test process cleanly.

`@pytest.mark.cuda` / `rocm` / `npu` run only where `roll_hw.current_platform` is that platform;
`@pytest.mark.gpus(n)` additionally needs n devices. roll_hw is imported lazily so that packages tested alone
(without roll-hw installed, e.g. roll-algos) still collect.

The whole suite runs in one process (models, tokenizers and one Ray per module are shared for CI time), so by its
end that process holds C++ runtimes that tests started and Python no longer tracks: gloo process groups with their
TCP stores and loops, gRPC clients of finished Ray sessions, engine and writer threads. Tearing those down in the
interpreter's finalizer, in whatever order it frees modules, can crash after every result is written (CI of
2026-12-04: 2318 passed, then exit -11). So once pytest has written its report, `pytest_unconfigure` says what was
left running and leaves with pytest's exit status through `os._exit`, skipping that finalizer.
`ROLL_TEST_FINALIZE=1` keeps the ordinary interpreter exit (to debug such a crash: run with `-X faulthandler`).
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter

import pytest

# Ray refuses to start local test clusters without token auth unless told otherwise; only for tests.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# vLLM's ZeroMQ sockets go to one folder of this test process, removed at its end (pytest_unconfigure): vLLM puts
# them straight into /tmp and a process the tests end hard (Ray actors, os._exit) never removes its own, ~70 socket
# files per CI run on a shared machine. Processes the tests start inherit it (Ray's workers too).
_VLLM_RPC_DIR = None
if "VLLM_RPC_BASE_PATH" not in os.environ:
    import tempfile

    _VLLM_RPC_DIR = os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="roll-tests-vllm-")
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


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))


def _leftovers() -> str:
    """What the tests left running in this process: Python threads by name, native gloo loops, torch.distributed."""
    names = Counter(t.name.split(" ")[0].rstrip("0123456789-") or "thread" for t in threading.enumerate())
    names.pop("MainThread", None)
    native: Counter[str] = Counter()
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                native[f.read().strip()] += 1
    except OSError:  # not Linux: the Python threads alone
        pass
    gloo = native["pt_gloo_runloop"] + native["gloo_tcp_loop"]
    dist = sys.modules.get("torch.distributed")
    pg = bool(dist is not None and dist.is_available() and dist.is_initialized())
    parts = [f"{n} {name}" for name, n in names.most_common()]
    return f"threads: {', '.join(parts) or 'none'}; gloo loops: {gloo}; a default process group: {pg}"


def _remove_library_temp_dirs() -> None:
    """Remove the temporary folders libraries make at import and leave to the finalizer `os._exit` skips (wandb's
    media and artifact folders: two empty `/tmp/tmp*wandb-*` folders per test run piled up on shared machines), and
    the folder of vLLM's sockets."""
    if _VLLM_RPC_DIR is not None:
        import shutil

        shutil.rmtree(_VLLM_RPC_DIR, ignore_errors=True)
    for module, path in (
        ("wandb.sdk.data_types._private", "MEDIA_TMP"),
        ("wandb.sdk.artifacts.artifact", "Artifact._TMP_DIR"),
    ):
        obj: object = sys.modules.get(module)
        for attr in path.split(".") if obj is not None else ():
            obj = getattr(obj, attr, None)
        cleanup = getattr(obj, "cleanup", None)
        if callable(cleanup):
            try:
                cleanup()
            except OSError:
                pass


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if not _EXIT_STATUS or os.environ.get("ROLL_TEST_FINALIZE") == "1":
        return
    sys.stdout.flush()
    sys.stderr.flush()
    print(f"\nroll conftest: leaving with os._exit({_EXIT_STATUS[-1]}); left running by the tests: {_leftovers()}")
    sys.stdout.flush()
    _remove_library_temp_dirs()
    os._exit(_EXIT_STATUS[-1])
