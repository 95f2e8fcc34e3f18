"""The data thread of `AsyncRollout` (roll_core.scheduling.driver, `roll-async-data`): it keeps the scheduler's budget
filled with groups drawn from the driver's `next_group`, apart from the rollout thread and without the driver's lock,
so that a data source that blocks (a slow dataloader, an environment reset) blocks none of `take`, the updates,
`shrink`, `close`, nor the collection of the results they wait for.

Contract:
- A group's budget is reserved (`RolloutScheduler.reserve`) before its draw, under the driver's lock, only while
  the driver is neither paused (an update), closed nor failed; the group is admitted as if the draw were instant.
- From the reservation to the group's start the thread holds the driver's `_data_lock` (`held` takes it first), so a
  checkpoint never sees data drawn and its group not started; `next_group` itself runs without the driver's lock.
- What `next_group` returns is checked: (payload, prompt ids) or (payload, prompt ids, pictures), the prompt ids an
  iterable of token ids; anything else is a TypeError naming the data source and what it returned (it read
  "cannot unpack non-iterable NoneType object", or a reservation was used up by a group never started).
- A draw that raises or returns something else gives the reservation back (`unreserve`) and fails the rollout with
  an error naming the data source (an exhausted iterator's bare StopIteration read "async rollout failed: "); the
  trainer's next call raises it (`AsyncRollout._raise`; the first failure of either thread is the one kept).
- Data that comes during an update starts a pending group, submitted after `finish_update` (at the new version:
  it generated nothing, so the update does not make it stale, `RolloutScheduler.finish_update`); data that comes
  after `close` starts its group too (the data position is past it: a checkpoint then lists it as pending), and the
  thread then ends.
- A draw that raises or returns something else after `close` (a dataloader torn down at shutdown) is expected: one
  line at INFO, the thread ends, the driver stays closed (later calls say closed, not failed).
- `driver._data_doing` says what the thread waits for when it is not drawing (budget, the data lock): a `close`
  that gives up on the thread says it (`_driver_timeouts.warn_stuck`).
"""

from __future__ import annotations

import logging
import reprlib
import time
from typing import TYPE_CHECKING, Any

from roll_core.scheduling._driver_timeouts import source_name

if TYPE_CHECKING:
    from roll_core.scheduling.driver import AsyncRollout

log = logging.getLogger("roll_core.scheduling.driver")  # the driver's messages, under its logger

#: What a data source's `next_group` must return (the errors of one that returns something else say it).
SHAPE = "(payload, prompt ids) or (payload, prompt ids, pictures)"


def feed(driver: AsyncRollout) -> None:
    """The data thread's loop (module docstring): start groups up to the budget until the driver is closed or has
    failed; a failure of its own is stored for the trainer (`AsyncRollout._fail`)."""
    cv, sched = driver._cv, driver.sched
    try:
        while True:
            driver._data_doing = "waiting for budget (pipeline.async_ratio) or for a weight update to end"
            with cv:
                # `_stopped` too: a close while `next_group` blocked; the groups left in the budget drew more data
                # (each call maybe blocking as long) for a closed driver.
                while driver._paused or sched.capacity() < 1:
                    if driver._stopped or driver._error is not None:
                        return
                    cv.wait(0.05)  # (a take that drops stale groups frees budget without a notify)
                if driver._stopped or driver._error is not None:
                    return
            driver._data_doing = "waiting for the driver's data lock (a held() under way: a checkpoint?)"
            with driver._data_lock:
                driver._data_doing = "waiting for the driver's lock"
                with cv:
                    if driver._stopped or driver._paused or driver._error is not None or sched.capacity() < 1:
                        continue  # changed meanwhile
                    sched.reserve()
                    driver._drawing_since = time.monotonic()
                try:
                    payload, prompt_ids, mm = draw(driver)
                    with cv:
                        driver._drawing_since = None
                        sched.start(payload, prompt_ids, mm, reserved=True)
                except BaseException:
                    with cv:
                        driver._drawing_since = None
                        sched.unreserve()  # (a `start` that raises keeps the reservation: given back here)
                    raise
    except BaseException as exc:
        if driver._stopped:  # closed meanwhile: the data source went with the shutdown (module docstring)
            log.info(
                "async rollout: the data source failed after close() (a shutdown): %s: %s", type(exc).__name__, exc
            )
            return
        log.exception("async rollout: the data source (next_group) failed")
        driver._fail(exc)  # surfaced in the trainer's thread by _raise
    finally:
        driver._data_doing = "ended"


def draw(driver: AsyncRollout) -> tuple[Any, list[Any], Any]:
    """One group's data from `driver.next_group`, checked (module docstring): (payload, prompt ids as a list,
    pictures or None). Raises a RuntimeError naming the data source if it raises, a TypeError if it returns
    something else."""
    name = source_name(driver.next_group)
    try:
        got = driver.next_group()
    except Exception as exc:
        hint = " (an exhausted data iterator?)" if isinstance(exc, StopIteration) else ""
        raise RuntimeError(f"the data source {name} raised {type(exc).__name__}: {exc}{hint}") from exc
    if not isinstance(got, (tuple, list)) or len(got) not in (2, 3):
        raise TypeError(f"the data source {name} returned {reprlib.repr(got)}: expected {SHAPE}")
    ids = got[1]
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(
            f"the data source {name} returned the prompt ids {reprlib.repr(ids)}: expected token ids, in {SHAPE}"
        )
    return got[0], list(ids), got[2] if len(got) == 3 else None
