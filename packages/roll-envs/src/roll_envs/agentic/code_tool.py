"""`code`: a tool that runs the model's Python program in roll's OS sandbox and shows it what the program printed.

Contract: `CodeTool()(program) -> str` never raises and never runs the program in the calling process. The program
(the argument of `<tool>code: ...</tool>`, optionally inside a ```python fence) runs as a fresh
`roll_envs.sandbox.PythonSandbox` run: no network, a read-only standard library, a private /tmp, its own PID
namespace, rlimits, a wall clock and an output budget (see `roll_envs.sandbox`). Nothing persists between calls:
each call is a new program, so state must be recomputed (the instructions say so).

What the model reads back: the program's stdout (cut to `max_output_chars`), and on failure a line starting with
"error:" that names the outcome (a failed program's exit status or the signal that killed it, and the last lines
of its traceback; a timeout, an output flood, a refused sandbox), so a model can fix its program (`sys.exit(3)` or
a kill by the memory limit printed nothing and read as a bare "the program failed"). Outcomes are counted per
tool in `counts` (ok / runtime_error / timeout / output_limit / sandbox_error) for logs. The output is a
`roll_envs.agentic.tools.ToolText` whose `error` is whether the program failed (or was refused): the error line
follows what the program printed, so the text's `error:` prefix does not tell (the tool env counts by `error`).

Sandbox availability: the sandbox is built on first use and shared by every `CodeTool` of the process with the
same options (building one runs a probe program). Without a working bubblewrap the constructor raises
`SandboxUnavailableError` with how to install one, so a run that asks for the tool fails at start rather than
after hours of training. `allow_unsandboxed_execution_i_understand_the_risk=True` runs programs in a bare child
process only where no sandbox works (loudly logged; the program can then read the user's files and reach the
network); a working sandbox is always used.

Concurrency: at most `parallelism` programs run at once over all the tools sharing a sandbox (episodes stepped in
many threads wait for a slot; a program's wall clock starts when it gets one).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections import Counter
from typing import ClassVar

from roll_envs.agentic.tools import ToolText
from roll_envs.rewards.code import extract_code
from roll_envs.sandbox import (
    OK,
    OUTPUT_LIMIT,
    SANDBOX_ERROR,
    TIMEOUT,
    PythonSandbox,
    SandboxLimits,
    make_sandbox,
)

log = logging.getLogger(__name__)

_SANDBOXES: dict[tuple[SandboxLimits, bool, str | None, int], PythonSandbox] = {}
_SANDBOXES_LOCK = threading.Lock()


def _shared_sandbox(
    limits: SandboxLimits, allow_unsandboxed: bool, python: str | None, parallelism: int
) -> PythonSandbox:
    """One probed sandbox per (limits, fallback allowed, interpreter, parallelism) and process: the probe costs a
    sandbox start. bubblewrap whenever it works; a bare child process only where it does not and that is allowed."""
    key = (limits, allow_unsandboxed, python, parallelism)
    with _SANDBOXES_LOCK:
        if key not in _SANDBOXES:
            _SANDBOXES[key] = make_sandbox(
                limits,
                python=python,
                max_concurrent_runs=parallelism,
                allow_unsandboxed=allow_unsandboxed,
                fallback_warning="code tool: no working sandbox (%s); running programs unsandboxed as configured",
                logger=log,
            )
        return _SANDBOXES[key]


def strip_fence(text: str) -> str:
    """The program in `text`: its last python (else untagged) fenced block, the way the code reward reads a
    response (`extract_code`), or `text` itself when it holds no fenced block; outer whitespace stripped."""
    code = extract_code(text)
    return (text if code is None else code).strip()


def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def _exit_note(returncode: int | None) -> str:
    """How a failed program ended, for its error line: ` (exit status 3)`, ` (killed by SIGKILL)`. bubblewrap
    reports a program killed by signal n as exit status 128 + n (the sandbox reads it so too)."""
    if returncode is None:
        return ""
    if returncode < 0:
        name = _signal_name(-returncode)
    elif returncode > 128:
        name = _signal_name(returncode - 128)
    else:
        name = None
    if name is None:
        return f" (exit status {returncode})"
    # SIGKILL is what the run's memory limit (a cgroup's out-of-memory kill) sends: the model can act on that.
    hint = "; the memory limit ends a program this way" if name == "SIGKILL" else ""
    return f" (killed by {name}{hint})"


class CodeTool:
    """Runs a Python program in the sandbox and returns its output; see the module docstring.

    Args:
        timeout_s: wall-clock seconds per program (from when the sandbox is up; its start has a budget of its own).
        memory_mb: address space per process of the program, MiB.
        max_processes: processes and threads the program may have.
        run_memory_mb: memory of all the program's processes together, MiB (where a cgroup can be made).
        max_output_chars: characters of stdout shown to the model (the sandbox's own output budget, 64 KiB by
            default here, kills floods long before they reach this process's memory). The default leaves room for
            the error line within `ToolUseEnv`'s 2000-character observation cut, so the model always sees it.
        max_code_chars: longer programs are refused without running.
        python: interpreter inside the sandbox; None: the one running roll (standard library only).
        parallelism: programs running at once over every tool sharing this one's sandbox (the rest wait).
        allow_unsandboxed_execution_i_understand_the_risk: run without bubblewrap when none works (only then).
    """

    name: ClassVar[str] = "code"
    description: ClassVar[str] = (
        "runs a Python 3 program in a fresh sandbox (standard library only, no network, no files kept between "
        "calls) and shows what it prints, e.g. print(sum(i * i for i in range(10)))"
    )

    def __init__(
        self,
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        max_processes: int = 8,
        run_memory_mb: int = 1024,
        max_output_chars: int = 1500,
        max_code_chars: int = 20_000,
        python: str | None = None,
        parallelism: int = 8,
        allow_unsandboxed_execution_i_understand_the_risk: bool = False,
    ) -> None:
        if max_output_chars < 1 or max_code_chars < 1 or parallelism < 1:
            raise ValueError("code tool: max_output_chars, max_code_chars and parallelism must be >= 1")
        limits = SandboxLimits(
            timeout_s=float(timeout_s),
            memory_mb=int(memory_mb),
            max_processes=int(max_processes),
            max_output_bytes=64 * 1024,
            run_memory_mb=int(run_memory_mb),
        )
        self.max_output_chars, self.max_code_chars = int(max_output_chars), int(max_code_chars)
        # Built (and probed) now: a run without a sandbox must fail at start, not at the first tool call.
        allow = bool(allow_unsandboxed_execution_i_understand_the_risk)
        self.sandbox = _shared_sandbox(limits, allow, python, int(parallelism))
        self.counts: Counter[str] = Counter()

    def __call__(self, arg: str) -> ToolText:
        program = strip_fence(str(arg))
        if not program:
            return ToolText("error: empty program; write Python code after 'code:'", error=True)
        if len(program) > self.max_code_chars:
            self.counts["refused"] += 1
            refused = f"error: the program is {len(program)} characters; the limit is {self.max_code_chars}"
            return ToolText(refused, error=True)
        result = self.sandbox.run(program + "\n")
        self.counts[result.status] += 1
        out = self._cut(result.stdout)
        if result.status == OK:  # what it printed, `error: ...` included, is a success
            shown = out if out.strip() else "(the program printed nothing; use print() to see values)"
            return ToolText(shown, error=False)
        return ToolText(self._error(result.status, result.stderr, out, result.returncode), error=True)

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        return text[: self.max_output_chars] + f"... [{len(text) - self.max_output_chars} more characters]"

    def _error(self, status: str, stderr: str, stdout: str, returncode: int | None = None) -> str:
        limits = self.sandbox.limits
        if status == TIMEOUT:
            msg = f"error: the program ran longer than {limits.timeout_s:g} s and was stopped"
        elif status == OUTPUT_LIMIT:
            msg = "error: the program printed too much and was stopped"
        elif status == SANDBOX_ERROR:
            msg = "error: the sandbox failed to start the program; try again"
        else:
            tail = [line[:200] for line in stderr.strip().splitlines() if line.strip()][-3:]
            msg = f"error: the program failed{_exit_note(returncode)}" + (":\n" + "\n".join(tail) if tail else "")
        if stdout.strip():
            msg = f"{stdout}\n{msg}"
        return msg
