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
# Every temporary file the processes the tests start make (subprocesses, Ray's workers, pytest-xdist's workers)
# goes to one folder of this test session, removed at its end (pytest_unconfigure): a process the tests end hard
# (a killed run, a Ray actor, os._exit) never removes its own, and on a shared machine they piled up in /tmp at
# every CI run (multiprocessing's pymp-* listener folders, wandb's media and table folders, vLLM's ZeroMQ sockets,
# a sandbox's work folder). This process keeps the /tmp it already resolved, so pytest's tmp_path folders stay
# where pytest rotates them; what it makes itself is removed by _remove_own_temp_dirs.
import tempfile

tempfile.gettempdir()
_TEST_TMP = None
if "ROLL_TEST_TMPDIR" not in os.environ:  # the first pytest process of the session (xdist's workers inherit it)
    _TEST_TMP = os.environ["ROLL_TEST_TMPDIR"] = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="roll-tests-")
    # vLLM puts its sockets straight into /tmp unless told (~70 socket files per CI run before this).
    os.makedirs(os.path.join(_TEST_TMP, "vllm"))
    os.environ.setdefault("VLLM_RPC_BASE_PATH", os.path.join(_TEST_TMP, "vllm"))
    # transformers copies a trust_remote_code checkpoint's code into its module cache (~/.cache/huggingface/modules
    # by default): the tests' models are written per session, so their code goes with the session's files.
    os.environ.setdefault("HF_MODULES_CACHE", os.path.join(_TEST_TMP, "hf_modules"))
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


#: The process-group rendezvous and device-visibility variables. A test that leaves RANK=1 behind makes every later
#: engine of the same test process wait in its rendezvous for a rank 0 that never comes, and one that leaves
#: CUDA_VISIBLE_DEVICES=2,3 makes a Ray cluster started later in it hand out GPUs "2" and "3" (CI of 2026-12-06: a
#: Megatron test hung in `init_process_group`, three multi-node tests failed): each test gets back the values it
#: started with.
_RENDEZVOUS_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "ASCEND_RT_VISIBLE_DEVICES",
)


@pytest.fixture(autouse=True)
def _rendezvous_env_restored():
    before = {name: os.environ.get(name) for name in _RENDEZVOUS_VARS}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


#: How much longer than its pytest-timeout a test may run before the watchdog below ends its process.
WATCHDOG_GRACE_S = float(os.environ.get("ROLL_TEST_WATCHDOG_GRACE_S", "120"))
#: How long a pytest process may take from its last test to its exit (reports, fixture teardown, unconfigure).
WATCHDOG_FINISH_S = 600


def _timeout_of(item: pytest.Item) -> float:
    """The test's pytest-timeout limit in seconds (its `timeout` marker, else the command line's or the ini's); 0:
    none (or pytest-timeout absent)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and (marker.args or "timeout" in marker.kwargs):
        value = marker.args[0] if marker.args else marker.kwargs["timeout"]
    else:
        value = item.config.getoption("timeout", None)
        if value is None:
            try:
                value = item.config.getini("timeout")
            except ValueError:  # pytest-timeout not installed: no limit to watch
                value = 0
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        return 0.0


def _stderr_fd(config: pytest.Config) -> int:
    """The process's real stderr: pytest's copy made before output capture (fd 2 goes to a capture file while a test
    runs, and that file is lost when the watchdog ends the process)."""
    try:
        from _pytest.faulthandler import fault_handler_stderr_fd_key

        return config.stash[fault_handler_stderr_fd_key]
    except (ImportError, KeyError):  # another pytest, or its faulthandler plugin off
        return sys.__stderr__.fileno() if sys.__stderr__ is not None else 2


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """A watchdog over each test that pytest-timeout cannot miss. Its `signal` method raises in the main thread,
    which only happens when that thread returns to Python: a test blocked inside C code (a collective, a native
    wait that retries on EINTR) outlives it, and the CI run of 2026-12-07 hung from 98 % to its 90-minute limit
    with nothing printed. faulthandler's thread needs no GIL: past the limit plus WATCHDOG_GRACE_S it writes every
    thread's stack to stderr and ends the process (exit 1; xdist reports the test failed and starts a new worker)."""
    import faulthandler

    limit = _timeout_of(item)
    if limit > 0:  # replaces an earlier one (there is one per process)
        faulthandler.dump_traceback_later(limit + WATCHDOG_GRACE_S, exit=True, file=_stderr_fd(item.config))
    try:
        yield
    finally:
        if limit > 0:
            faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`--dist loadfile` that survives a crashed worker (tests/xdist_loadfile.py: xdist 3.8's deadlocked)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "xdist_loadfile.py")
    spec = importlib.util.spec_from_file_location("roll_xdist_loadfile", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_scheduler(config, log)


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))
    # The same watchdog over the process's way out (a fixture teardown or a finalizer that hangs would keep an
    # xdist worker, and so the whole run, from ending).
    __import__("faulthandler").dump_traceback_later(WATCHDOG_FINISH_S, exit=True, file=_stderr_fd(session.config))


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


def _remove_session_tmp() -> None:
    """Remove the session's temporary folder (above), in the process that made it."""
    if _TEST_TMP is not None:
        import shutil

        shutil.rmtree(_TEST_TMP, ignore_errors=True)


def _remove_own_temp_dirs() -> None:
    """Remove the session's temporary folder (above) and the temporary folders this process made and left to the
    finalizers `os._exit` skips: every `tempfile.TemporaryDirectory` still alive (wandb's media and artifact folders
    made at import, the folder of each W&B table logged) and multiprocessing's `pymp-*` folder."""
    import shutil
    import weakref

    _remove_session_tmp()
    cleanup = getattr(tempfile.TemporaryDirectory, "_cleanup", None)
    for fin, info in list(getattr(weakref.finalize, "_registry", {}).items()):
        if getattr(info.func, "__func__", None) is getattr(cleanup, "__func__", object()):
            try:
                fin()
            except OSError:
                pass
    mp = sys.modules.get("multiprocessing.process")
    folder = mp.current_process()._config.get("tempdir") if mp is not None else None
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if not _EXIT_STATUS or os.environ.get("ROLL_TEST_FINALIZE") == "1":
        _remove_session_tmp()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    print(f"\nroll conftest: leaving with os._exit({_EXIT_STATUS[-1]}); left running by the tests: {_leftovers()}")
    sys.stdout.flush()
    _remove_own_temp_dirs()
    os._exit(_EXIT_STATUS[-1])
