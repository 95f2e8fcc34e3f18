"""Edges of roll's stop handlers (roll_core.stop_signals, BuildStop in roll_core.pipelines.run_control): the
re-delivery of a stop Python dropped, the hook and handlers around the block, a rearm() that raises.

The re-delivery tests run in a child process: a stop is dropped only inside a weakref callback (or a `__del__`), and
the thread that delivers it again signals the process it runs in. A weakref callback that raises the stop stands for
torch's and transformers' callbacks while a model loads.
"""

from __future__ import annotations

import signal
import sys
import weakref
from collections.abc import Callable

import pytest

from roll_core.eval_stop import EvalStop
from roll_core.pipelines.run_control import BuildStop, StoppedWhileBuilding

#: Code shared by the child scripts, before the conftest's DROP_A_STOP (a dropped stop: the callback's
#: StoppedWhileBuilding is only "ignored" by Python, the hook keeps it and a thread delivers it again): a wait for
#: that thread's end.
PRELUDE = """
import signal, sys, threading, weakref
from roll_core.pipelines.run_control import BuildStop, StoppedWhileBuilding

def join_resend():
    for t in threading.enumerate():
        if t.name == "roll-stop-resend":
            t.join(10)
            assert not t.is_alive(), "the re-delivery did not end"
"""


def test_a_library_s_handler_gets_no_re_delivered_stop_and_the_next_ctrl_c_still_aborts(
    stop_child: Callable[[str, str], str],
) -> None:
    """A library installed its own SIGINT handler while the dropped stop waited: the re-delivery went to the library's
    handler (a signal the user never sent, 1 of 1), and roll's mark of a delivery in flight stayed set, so the
    user's next Ctrl-C (the abort of the build's cleanup) was taken for that delivery and ignored. The stop is kept
    meanwhile: delivered once roll's handler is back, else raised by the build's end (`check()`)."""
    out = stop_child(
        PRELUDE,
        """
        import time

        library = []
        roll_handler = []

        def library_handler(signum, frame):
            library.append(signum)

        b = BuildStop()
        try:
            with b:
                try:
                    drop_a_stop(after=lambda: roll_handler.append(signal.signal(signal.SIGINT, library_handler)))
                    deadline = time.monotonic() + 0.3  # the library's part of the build, its handler installed
                    while time.monotonic() < deadline:
                        pass
                    signal.signal(signal.SIGINT, roll_handler[0])  # the library puts roll's back (a pending one runs)
                    b.check()  # the build's end raises the stop kept meanwhile, if not delivered already
                    print("NOT STOPPED")
                except StoppedWhileBuilding:
                    signal.raise_signal(signal.SIGINT)  # the user's second Ctrl-C, while the build shuts down
                    print("SECOND CTRL-C IGNORED")
        except KeyboardInterrupt as exc:
            print("cleanup aborted by", type(exc).__name__)
        print("library handler calls:", len(library))
        """,
    )
    assert "library handler calls: 0" in out, out
    assert "NOT STOPPED" not in out and "SECOND CTRL-C IGNORED" not in out, out
    assert "cleanup aborted by KeyboardInterrupt" in out, out


def test_a_re_delivered_stop_inside_ray_s_connection_is_deferred_as_a_signal_there_is(
    stop_child: Callable[[str, str], str],
) -> None:
    """A first signal inside `ray.init`'s connection (the CoreWorker constructor) is raised after it: raised there, it
    left a half-made core worker and the process crashed at exit. The re-delivery of a dropped stop that lands
    there was raised there all the same."""
    out = stop_child(
        PRELUDE,
        """
        ray_worker = {"__name__": "ray._private.worker"}
        exec("def connect(step):\\n    return step()\\n", ray_worker)
        reached = []
        b = BuildStop()

        def step():
            b._lost_lock.release()  # white-box: the re-delivery waits for it, so it lands here, inside connect
            join_resend()
            signal.signal(signal.SIGINT, signal.getsignal(signal.SIGINT))  # runs a pending delivery now
            reached.append("connected")

        try:
            with b:
                b._lost_lock.acquire()
                drop_a_stop()
                ray_worker["connect"](step)
                reached.append("ray.init returned")
                b.rearm()
                reached.append("built on")
        except StoppedWhileBuilding as exc:
            print("stopped by", exc.signum)
        print("reached", reached)
        """,
    )
    assert f"stopped by {int(signal.SIGINT)}" in out, out
    assert "reached ['connected', 'ray.init returned']" in out, out


def test_after_the_block_a_library_s_wrapper_still_reaches_the_hook_found_on_entry() -> None:
    """A library that wrapped `sys.unraisablehook` inside the block keeps calling roll's hook after it: the exceptions
    it passed on went to Python's own hook (printed), not to the one installed before the block (pytest's, a
    user's), which saw none of them."""
    seen: list[BaseException | None] = []
    saved = sys.unraisablehook
    sys.unraisablehook = lambda info: seen.append(info.exc_value)
    try:
        with EvalStop():
            inner = sys.unraisablehook
            sys.unraisablehook = lambda info: inner(info)  # a library's wrapper, left installed
        error = ValueError("raised in a weakref callback after the block")

        class Model:
            pass

        def callback(_: object) -> None:
            raise error

        model = Model()
        ref = weakref.ref(model, callback)
        del model
    finally:
        sys.unraisablehook = saved
    assert ref() is None and seen == [error]


def test_a_rearm_that_raises_the_stop_still_takes_the_handlers_back_for_the_cleanup() -> None:
    """`rearm()` after ray.init raises a stop a library swallowed; it raised before installing roll's handlers again,
    so Ray's SIGTERM handler (an abort) took the second signal meant to abort the build's cleanup."""
    ray_calls: list[int] = []
    with pytest.raises(KeyboardInterrupt) as info:
        with BuildStop() as building:
            try:
                signal.raise_signal(signal.SIGINT)
            except BaseException:  # a library's catch-all swallows the stop
                pass
            signal.signal(signal.SIGTERM, lambda signum, frame: ray_calls.append(signum))  # ray.init's handler
            try:
                building.rearm()
            except StoppedWhileBuilding:
                signal.raise_signal(signal.SIGTERM)  # the second signal, during the build's shutdown
    assert type(info.value) is KeyboardInterrupt and ray_calls == []


def test_an_instance_entered_again_restores_the_handlers_found_the_second_time() -> None:
    """The handlers found on the first entry were restored on every exit: a handler installed between two blocks of
    one instance was replaced by the one from before the first."""
    calls: list[str] = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append("before the first block"))
    try:
        stop = EvalStop()
        with stop:
            pass
        signal.signal(signal.SIGTERM, lambda signum, frame: calls.append("between the blocks"))
        with stop:
            pass
        signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert calls == ["between the blocks"]


def test_a_stop_raised_inside_the_hook_itself_is_kept_and_raised_after_it(
    stop_child: Callable[[str, str], str],
) -> None:
    """A Ctrl-C while roll's hook passed another dropped exception to the hook found on entry (a Python one: pytest's,
    a user's): the stop was raised out of sys.unraisablehook, where Python prints `Exception ignored in
    sys.unraisablehook` and drops it, and the evaluation went on to the end."""
    out = stop_child(
        PRELUDE,
        """
        import time
        from roll_core.eval_stop import EvalStop, EvalStopped

        def entry_hook(info):  # the user's Ctrl-C arrives while it runs
            signal.raise_signal(signal.SIGINT)

        sys.unraisablehook = entry_hook

        def fail(_):
            raise ValueError("a library's callback fails")

        try:
            with EvalStop():
                o = O()
                r = weakref.ref(o, fail)
                del o
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:  # the evaluation goes on
                    pass
                print("EVALUATED TO THE END")
        except EvalStopped as exc:
            print("stopped by", exc.signum)
        """,
    )
    assert out == f"stopped by {int(signal.SIGINT)}\n", out
