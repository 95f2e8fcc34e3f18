"""A `megatron` engine checkpoint starts no process that outlives it: Megatron's torch_dist save spawned a
multiprocessing Manager server (~270 MB) on the first save of every process and kept it for the process's life,
orphaned when a trainer was killed (roll_engines.train.megatron._checkpoint.in_process_write_results). One rank,
in-process over gloo."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.usefixtures("megatron_process_group")


def _children() -> dict[int, str]:
    """This process's live descendants: pid -> command line."""
    found = {}
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.status() != psutil.STATUS_ZOMBIE:
                found[child.pid] = " ".join(child.cmdline())
    return found


def test_save_and_load_leave_no_process_behind(tiny: str, tmp_path: Path) -> None:
    """Step, save, load into a fresh engine: no child process of this one is left after the save (Megatron's
    writer processes are forked and joined during it) nor after the load, Megatron's results-queue global is
    as it was, and the load resumes the saved step and Adam state."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch
    from roll_engines.train.megatron import MegatronTrainEngine
    from roll_engines.train.megatron._checkpoint import optimizer_state_bytes, parts

    settings = {"dist_backend": "gloo", "micro_batch_size": 3, "lr": 1e-2}
    engine = MegatronTrainEngine(tiny, **settings)
    engine.train_step(toy_batch(tiny), PolicyObjective())
    before, queue_before = _children(), filesystem_async._results_queue

    engine.save(tmp_path / "ckpt", tiny)
    left = {pid: cmd for pid, cmd in _children().items() if pid not in before}
    assert left == {}, f"the save left processes behind: {left}"
    assert filesystem_async._results_queue is queue_before

    resumed = MegatronTrainEngine(tiny, **settings)
    resumed.load(tmp_path / "ckpt")
    left = {pid: cmd for pid, cmd in _children().items() if pid not in before}
    assert left == {}, f"the load left processes behind: {left}"
    assert resumed._step == engine._step == 1
    assert optimizer_state_bytes(resumed.optimizer) == optimizer_state_bytes(engine.optimizer) > 0
    saved = [s for opt in parts(engine.optimizer) for s in opt.optimizer.state.values()]
    loaded = [s for opt in parts(resumed.optimizer) for s in opt.optimizer.state.values()]
    for want, got in zip(saved, loaded, strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(got[key], want[key], atol=0, rtol=0, msg=key)


def test_the_results_queue_is_in_process_and_restored_after_a_failed_save() -> None:
    """Inside the block Megatron's global results queue is a fresh in-process queue (put then get_nowait at
    once, as its finalize does); after it, even when the save raised, the global is what it was before."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from roll_engines.train.megatron._checkpoint import in_process_write_results

    previous, sentinel = filesystem_async._results_queue, object()
    filesystem_async._results_queue = sentinel
    try:
        with pytest.raises(RuntimeError, match="write failed"), in_process_write_results():
            results = filesystem_async._get_write_results_queue()
            assert isinstance(results, queue.Queue)
            results.put({0: ["written"]})
            assert results.get_nowait() == {0: ["written"]}
            raise RuntimeError("write failed")
        assert filesystem_async._results_queue is sentinel
    finally:
        filesystem_async._results_queue = previous
