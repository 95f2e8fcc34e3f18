"""Two data-parallel gloo ranks on CPU, each its own process, for tests that a batch refused on one rank is refused
on both (roll_engines.train._agree) instead of leaving the other waiting in a collective.

- `join_gloo_group(rank, port, timeout_s)`: in a rank's process, join the two-rank gloo group at 127.0.0.1:`port`
  (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set for the engines), whose collectives time out after
  `timeout_s` (not 30 minutes).
- `run_two_ranks(rank, engine, path, out, preload, deadline_s)`: start `rank(r, engine, port, path, out)` for r = 0,
  1 (forkserver, `preload` imported once in the server) and wait up to `deadline_s` for both; each rank records what
  it got with torch.save in `{out}.{r}`. Returns the two records ({} where a rank wrote none); a rank that raised
  outside its records, or that did not finish in time (then killed), fails the test with what both recorded.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch

__all__ = ["join_gloo_group", "run_two_ranks"]


def join_gloo_group(rank: int, port: int, timeout_s: float) -> None:
    """Join the two-rank gloo process group as `rank` (the engines built after it use it)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))


def run_two_ranks(
    rank: Callable[[int, str, int, str, str], None],
    engine: str,
    path: str,
    out: Path,
    preload: list[str],
    deadline_s: float,
) -> list[dict]:
    """Both ranks' records (see the module's docstring); AssertionError where they failed or hung."""
    import multiprocessing

    import torch.multiprocessing as mp

    from roll_core.cluster.ports import free_port

    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    ranks = mp.start_processes(
        rank, args=(engine, free_port(), path, str(out)), nprocs=2, join=False, start_method="forkserver"
    )
    deadline, failure = time.monotonic() + deadline_s, None
    try:
        while not ranks.join(timeout=1):  # raises what a rank raised outside its records (a collective timed out)
            if time.monotonic() > deadline:
                failure = f"did not finish in {deadline_s} s"
                break
    except Exception as e:
        failure = f"failed: {e}"
    for p in ranks.processes:
        if p.is_alive():
            p.kill()
    got = [torch.load(f"{out}.{r}", weights_only=False) if Path(f"{out}.{r}").exists() else {} for r in (0, 1)]
    assert failure is None, f"the two {engine} ranks {failure}\nthey recorded {got}"
    return got
