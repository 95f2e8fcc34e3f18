"""The `vllm` engine's CPU environment (roll_engines.infer._vllm_args.cpu_env; no vLLM needed): its OpenMP thread
count and core binding follow the cores this process may use, as the HF engines' threads do
(roll_core.models.default_num_threads), not the host's os.cpu_count() and cores 0..n-1. Each case runs in a fresh
process whose affinity mask is narrowed for real (sched_setaffinity), as taskset, Slurm or docker --cpuset-cpus do."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = """
import json, os, sys
os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(",")})
from roll_engines.infer._vllm_args import cpu_env
cpu_env(1, None, None, int(sys.argv[2]))
print(json.dumps({k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")}))
"""


def _cpu_env(cpus: list[int], tensor_parallel_size: int = 1, **extra: str) -> dict[str, str | None]:
    """What cpu_env sets in a process restricted to `cpus`."""
    drop = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "ROLL_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in drop} | extra
    cmd = [sys.executable, "-c", _PROBE, ",".join(map(str, cpus)), str(tensor_parallel_size)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _bound(binds: str) -> list[set[int]]:
    """vLLM's reading of VLLM_CPU_OMP_THREADS_BIND: one set of core ids per rank ("0-2,4|5-7")."""
    ranks = []
    for rank in binds.split("|"):
        ids: set[int] = set()
        for part in rank.split(","):
            lo, _, hi = part.partition("-")
            ids.update(range(int(lo), int(hi or lo) + 1))
        ranks.append(ids)
    return ranks


@pytest.fixture
def host_cpus() -> list[int]:
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no affinity mask on this OS")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs to narrow the mask to fewer than the host's")
    return cpus


def test_threads_follow_the_affinity_mask(host_cpus: list[int]) -> None:
    """A process allowed one CPU ran os.cpu_count() threads on it."""
    assert _cpu_env([host_cpus[-1]])["OMP_NUM_THREADS"] == "1"


def test_tensor_parallel_ranks_bind_cores_of_the_mask(host_cpus: list[int]) -> None:
    """Bound to cores 0..n-1, outside the mask: libgomp refuses such OMP_PLACES and binds nothing."""
    last = host_cpus[-1]
    env = _cpu_env([last], tensor_parallel_size=2)
    assert env["OMP_NUM_THREADS"] == "1"
    assert _bound(env["VLLM_CPU_OMP_THREADS_BIND"]) == [{last}, {last}]  # fewer cores than ranks: they share it
    two = host_cpus[-2:]
    assert _bound(_cpu_env(two, tensor_parallel_size=2)["VLLM_CPU_OMP_THREADS_BIND"]) == [{two[0]}, {two[1]}]


def test_roll_num_threads_sizes_the_vllm_engine_as_the_hf_engines(host_cpus: list[int]) -> None:
    assert _cpu_env(host_cpus, ROLL_NUM_THREADS="1")["OMP_NUM_THREADS"] == "1"


_KV_PROBE = """
import os, sys
from roll_engines.infer._vllm_args import cpu_env
seen = []
for gb in sys.argv[1:]:
    cpu_env(int(gb), None, None)
    seen.append(os.environ["VLLM_CPU_KVCACHE_SPACE"])
print(",".join(seen))
"""


@pytest.mark.parametrize("exported", [None, "7"])
def test_each_engine_gets_its_own_kv_cache_size(exported: str | None) -> None:
    """vLLM-CPU reads VLLM_CPU_KVCACHE_SPACE at every engine's config: set with setdefault, a second engine of the
    process (1 GiB, then 3) silently got the first one's size, and an exported value overrode kv_cache_gb."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    if exported is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = exported
    cmd = [sys.executable, "-c", _KV_PROBE, "1", "3"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip().splitlines()[-1] == "1,3"
    assert ("VLLM_CPU_KVCACHE_SPACE=7 in the environment is replaced" in out.stderr) == (exported is not None)
