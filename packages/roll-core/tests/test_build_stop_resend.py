"""A stop a library swallowed during the build is raised once, not twice (roll_core.pipelines.run_control.BuildStop).

A signal whose exception Python drops (raised inside a weakref callback or a `__del__`) is kept by the hook and
delivered once more by a thread (roll_core.stop_signals). When the build raises that stop itself first (`check()` at
its end, `rearm()`), the thread's delivery must not follow: it used to land in the build's `except BaseException`
shutdown, the code that gives back Ray, placement groups and the run lock, and cut it short. Runs in a child process:
the test sends SIGINT to the process it runs in.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time, weakref
    from roll_core.pipelines.run_control import BuildStop, StoppedWhileBuilding

    class O:
        pass

    for attempt in range(5):
        b = BuildStop()
        try:
            with b:
                try:
                    o = O()

                    def cb(_):
                        os.kill(os.getpid(), signal.SIGINT)
                        for _ in range(1000):  # the handler runs here: its exception is only 'ignored'
                            pass

                    r = weakref.ref(o, cb)
                    del o
                    b.check()  # the build's end raises the stop
                    print("NOT STOPPED", flush=True)
                except StoppedWhileBuilding:
                    end = time.monotonic() + 0.3
                    try:
                        while time.monotonic() < end:  # stands for the build's shutdown
                            pass
                    except BaseException as exc:
                        print("SHUTDOWN INTERRUPTED", type(exc).__name__, flush=True)
                        raise
                    raise
        except StoppedWhileBuilding:
            print("stopped once", flush=True)
    print("hook restored", sys.unraisablehook is sys.__unraisablehook__, flush=True)
    """
)


def test_a_swallowed_stop_raised_by_check_is_not_delivered_again_into_the_shutdown() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    out = proc.stdout
    assert proc.returncode == 0, (out, proc.stderr[-2000:])
    assert "SHUTDOWN INTERRUPTED" not in out and "NOT STOPPED" not in out, out
    assert out.count("stopped once") == 5 and "hook restored True" in out, out
    assert "Exception ignored" not in proc.stderr, proc.stderr[-2000:]
