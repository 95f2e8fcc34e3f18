"""roll_hw.cpu.tune_host_allocator: a large block freed and allocated again is reused, not page-faulted anew."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# In a fresh process (mallopt is process-wide): allocate, write and free a 64 MiB block three times with libc's
# own malloc, and print the minor page faults of the last two rounds (in the main thread plus in a new thread).
PROBE = """
import ctypes, resource, sys
from roll_hw.cpu import tune_host_allocator
print(int(tune_host_allocator()))
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
n = 64 << 20
def round_trip():
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
def faults():
    round_trip()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    round_trip(); round_trip()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
import threading
in_thread = []
t = threading.Thread(target=lambda: in_thread.append(faults()))  # a thread would get its own arena
t.start(); t.join()
print(faults() + in_thread[0])
"""


def _faults(tuning: str) -> tuple[bool, int]:
    env = {**os.environ, "ROLL_MALLOC_TUNING": tuning}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout
    tuned, faults = out.split()
    return tuned == "1", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_large_blocks_are_reused_without_page_faults() -> None:
    tuned, faults = _faults("1")
    plain_tuned, plain_faults = _faults("0")
    assert tuned and not plain_tuned
    pages = 4 * (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    # Untuned glibc maps each 64 MiB block afresh: every page faults again (fewer with transparent huge pages).
    assert plain_faults > pages // 600, plain_faults
    assert faults < plain_faults / 20, (faults, plain_faults)
