"""A stop roll kept (roll_core.stop_signals) reaches the run: delivered once roll's handler is back, said when the
block ends first; a Ctrl-C inside `ray.init`'s connection while a stop is kept aborts at once; a handler installed
outside Python does not break the block's exit.

The re-delivery tests run in a child process: a stop is dropped only inside a weakref callback (or a `__del__`), and
the thread that delivers it again signals the process it runs in.
"""

from __future__ import annotations

import logging
import signal
import sys
import weakref
from collections.abc import Callable

import pytest

from roll_core.eval_stop import EvalStop, EvalStopped

#: The child scripts' common part, before the conftest's DROP_A_STOP (a stop dropped by Python, `after` run inside
#: the callback): a busy wait.
PRELUDE = """
import os, signal, sys, threading, time, weakref

def busy(seconds):  # stands for the run's work (an evaluation, Ray's connection), polled, not slept
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass
"""


def test_a_stop_kept_while_a_library_s_handler_is_installed_is_raised_once_roll_s_is_back(
    stop_child: Callable[[str, str], str],
) -> None:
    """A Ctrl-C dropped in a weakref callback while a library's handler got installed: the re-delivery gave up (not to
    the library's handler) and nothing raised the stop later; the evaluation ran to its end (5 s of 5 s here) and
    roll-eval exited 0."""
    out = stop_child(
        PRELUDE,
        """
        from roll_core.eval_stop import EvalStop, EvalStopped

        library, saved = [], []
        try:
            with EvalStop():
                drop_a_stop(after=lambda: saved.append(signal.signal(signal.SIGINT, lambda s, f: library.append(s))))
                busy(0.3)  # the library's part of the work
                signal.signal(signal.SIGINT, saved[0])  # the library puts roll's handler back
                back = time.monotonic()
                busy(5)
                print("EVALUATED TO THE END")
        except EvalStopped as exc:
            print("stopped by", exc.signum, "late", time.monotonic() - back < 2)
        print("library handler calls:", len(library))
        """,
    )
    assert out == f"stopped by {int(signal.SIGINT)} late True\nlibrary handler calls: 0\n", out


def test_a_stop_still_kept_when_the_block_ends_is_said(caplog: pytest.LogCaptureFixture) -> None:
    """A library's handler installed to the block's end: the kept stop could not be raised (what it would stop is
    over) and went without a word."""
    library: list[int] = []
    saved = signal.getsignal(signal.SIGINT)

    class Model:
        pass

    def callback(_: object) -> None:
        try:
            signal.raise_signal(signal.SIGINT)  # EvalStop's handler raises EvalStopped here; Python drops it
        finally:
            signal.signal(signal.SIGINT, lambda signum, frame: library.append(signum))  # a library's, left

    with caplog.at_level(logging.WARNING, logger="roll_core.stop_signals"):
        try:
            with EvalStop():
                model = Model()
                ref = weakref.ref(model, callback)
                del model
        finally:
            signal.signal(signal.SIGINT, saved)
    assert ref() is None and library == []
    assert "a stop signal's EvalStopped, dropped by Python" in caplog.text
    assert "was not raised again before EvalStop ended" in caplog.text


def test_a_second_ctrl_c_inside_a_hung_ray_connection_with_a_kept_stop_aborts_at_once(
    stop_child: Callable[[str, str], str],
) -> None:
    """A dropped stop re-delivered inside `ray.init`'s connection is kept for the rearm() after it; the user's next
    Ctrl-C there was kept too (and every one after it): a connection to a cluster that does not answer ran on, 4.8 s
    of its 5 s here, minutes for Ray's."""
    out = stop_child(
        PRELUDE,
        """
        from roll_core.pipelines.run_control import BuildStop

        ray_worker = {"__name__": "ray._private.worker", "busy": busy}
        exec("def connect(step):\\n    step()\\n    busy(5)\\n", ray_worker)  # Ray's connection, hung
        b = BuildStop()
        sent = []

        def step():
            b._lost_lock.release()  # white-box: the re-delivery waits for it, so it lands here, inside connect
            for t in threading.enumerate():
                if t.name == "roll-stop-resend":
                    t.join(10)
            signal.signal(signal.SIGINT, signal.getsignal(signal.SIGINT))  # runs the pending delivery: kept

            def press():  # the user's second Ctrl-C
                sent.append(time.monotonic())
                os.kill(os.getpid(), signal.SIGINT)

            threading.Timer(0.2, press).start()

        try:
            with b:
                b._lost_lock.acquire()
                drop_a_stop()
                ray_worker["connect"](step)
                print("CONNECTED")
        except KeyboardInterrupt as exc:
            print(type(exc).__name__, "at once", time.monotonic() - sent[0] < 2)
        """,
    )
    assert out == "KeyboardInterrupt at once True\n", out


def test_a_handler_installed_outside_python_does_not_break_the_block_s_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """`signal.signal` returns None for a handler installed outside Python (a C library, an embedding program): the
    exit's `signal.signal(sig, None)` raised TypeError, in place of the block's own exception, and left roll's handler
    and hook installed after the block."""
    install = signal.signal
    found_outside = {signal.SIGTERM}

    def signal_found_outside(sig: int, handler: object) -> object:
        old = install(sig, handler)
        if sig in found_outside:  # the first install finds the outside handler
            found_outside.discard(sig)
            return None
        return old

    saved_term, saved_hook = signal.getsignal(signal.SIGTERM), sys.unraisablehook
    monkeypatch.setattr(signal, "signal", signal_found_outside)
    try:
        with pytest.raises(EvalStopped):
            with EvalStop():
                raise EvalStopped(signal.SIGINT)  # the block's own exception reaches the caller
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and sys.unraisablehook is saved_hook
    finally:
        install(signal.SIGTERM, saved_term)
        sys.unraisablehook = saved_hook
