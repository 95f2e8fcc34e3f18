"""Code reward: the model's last ```python block runs on each test's stdin in a sandbox; stdout is compared outside.

The program (`extract_code`): the last complete fenced block tagged python/py/python3 (the first word of the info
string, any case), else the last complete untagged block, else none (`no_code`). Fences are Markdown's (CommonMark,
`roll_envs.rewards._fences` has the details): an opening fence is a line of up to 3 spaces past the content column
of the list item it is in (`1. ` puts it at 3, so a fence under it may be indented 3 to 6 spaces), N >= 3 backticks
and an info string without backticks; the block ends at the next line holding only spaces (as many), >= N backticks
and whitespace. A line indented 4 spaces past its container is an indented code block, which is text: code merely
indented, or a fence inside such a block, is no program. A ``` elsewhere (in a string literal, after code on a
line) is part of the program. An unclosed block (a truncated response) runs to the end of the response and is not
a program; complete blocks before it still count. Up to as many spaces as the opening fence is indented are
removed from each line of the program (a fence inside a list item).

Reasoning: the program is read from the answer only, the text after the last `</think>` (roll_envs.rewards.judge's
`final_text`, as the ifeval reward reads it): a block inside a thinking model's reasoning is no program. A response
whose `<think>` block is never closed (cut off while reasoning) has no program (`no_code`). A response without
think tags is read whole. (`extract_code` itself reads the text it is given.)

Ground truth (a problem's `answer`) is JSON: `{"tests": [{"input": "...", "output": "..."}, ...]}` (`encode_tests`
writes it, `parse_tests` reads it). A test's input reaches the program with its line endings made `\\n` (`\\r\\n`
and a lone `\\r` alike, as judges normalise test files): Python does not translate them on stdin, and `input()` kept
the `\\r` of a Windows-edited test ("abc\\r\\n" read as "abc\\r"). A test passes when the program exits 0 and its
stdout equals the expected output up to trailing whitespace on each line and trailing blank lines; letter case,
leading whitespace and the whitespace between tokens count ("YES" is not "yes"; "1 2" is neither "1  2" nor the two
lines "1" and "2"). With `float_tolerance` (off by default), outputs are compared token by token instead: the
whitespace between tokens and the number of tokens must be equal, and two decimal numbers at least one of which has
a fraction or exponent match when `math.isclose` with that relative and absolute tolerance says so (two integers,
and anything else, must be equal as text). Each test runs in a fresh sandbox (`roll_envs.sandbox.PythonSandbox`) and
the comparison happens here, outside it: a program that exits early (`sys.exit(0)`, `os._exit(0)`), patches builtins
or kills its parent prints nothing right and scores 0.

Scoring (per response):
- `score_mode="all_pass"`: `score` = 1 when every test passes, else 0; the first failing test stops the run.
- `score_mode="fraction"`: `score` = passed / tests (every test runs).
- `correct` = 1 when every test passes; `formatted` = 1 when a code block was found; `format_weight` is added to
  the score of a response with a code block.

Counters (responses, each at most once per kind): `no_code` (no fenced block), `wrong_answers`, `runtime_errors`
(non-zero exit, exception, memory exhausted), `program_timeouts` (the program ran past `timeout_s` or its CPU
seconds; not `timeouts`, which roll's reward guard counts when the reward call itself hung: a dashboard must tell a
model's slow programs from an overloaded reward), `output_limits`, `sandbox_errors` (the sandbox itself failed, or
could not be started: an OSError such as EAGAIN from fork; a broken installation shows up here, not as wrong
answers; the first one's cause is logged), `bad_answers` (malformed ground truth) and `unfinished` (the call's
`time_budget_s` ran out first).
A response with a sandbox error, a malformed ground truth or an unfinished run is not judged: `RewardResult.failed`
marks it (roll's reward guard counts it in `failed_unscored`, and a step where every row failed counts toward the
run's failure budget) instead of it being trained on as a wrong answer. A test whose expected output plus the
newline a program prints after it is longer than `max_output_bytes` counts as a malformed ground truth too (logged):
the program that prints it would be killed at the output budget, so no answer could pass it.

Time budget: roll's reward guard gives `score` its `time_budget_s` and cuts the call off after its batch timeout,
which lost every score of a batch slower than that (hanging programs: rows x timeout_s / parallelism) and rescored
it row by row, one sandbox at a time, until it gave up on the rest. With the budget, a test starts only when its
program clock (`timeout_s`) plus a second for the sandbox's start ends before it, so the call returns in time with
the rows judged so far; the others are `unfinished`, but for a row whose program ran out its own clock on a test
already (`program_timeouts`, fraction mode), which is judged, the tests it did not run counting as failed: a
program must not dodge its score by hanging (one that hung on every test had its row `failed`, never trained on as
wrong). Only its own timeout judges it: the budget is the batch's, so a row started late by the pool with one fast
wrong test behind it would otherwise be scored on the tests it had no time for (0.0 where 0.9 was right). A program
wrong and slow just under its clock is still `unfinished`. Not bounded by it: a start
slower than that second (its own clock allows 10 s) and a wait for a sandbox slot held by another concurrent call;
the guard's cut-off then applies.

Covers: stdin/stdout programs in the interpreter's standard library, floating-point answers (`float_tolerance`).
Does not cover: function-call tests, special judges (several right outputs), ~~~ fences, third-party packages
unless the configured `python` (e.g. a virtual environment's) has them in its site-packages.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from roll_envs.rewards._fences import fenced_blocks
from roll_envs.rewards.base import Reward, RewardResult
from roll_envs.rewards.judge import final_text
from roll_envs.sandbox import (
    OK,
    OUTPUT_LIMIT,
    RUNTIME_ERROR,
    SANDBOX_ERROR,
    TIMEOUT,
    PythonSandbox,
    RunResult,
    SandboxLimits,
    make_sandbox,
)

log = logging.getLogger(__name__)

SCORE_MODES = ("all_pass", "fraction")
_PYTHON_TAGS = {"python", "py", "python3"}
# Decimal numbers only: float() also takes "nan", "inf", "1_000" and surrounding spaces, and ASCII digits only: a
# Unicode \d and float() take any script's digits (a program printing a fullwidth "０.５" passed for 0.5).
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)
_INTEGER = re.compile(r"[+-]?\d+", re.ASCII)
_SEPARATOR = re.compile(r"(\s+)")
# Sandbox status -> counter of the response.
_COUNTER = {
    RUNTIME_ERROR: "runtime_errors",
    TIMEOUT: "program_timeouts",  # not the guard's `timeouts` (the reward call itself hung)
    OUTPUT_LIMIT: "output_limits",
    SANDBOX_ERROR: "sandbox_errors",
}
COUNTERS = ("no_code", "wrong_answers", *_COUNTER.values(), "bad_answers", "unfinished")
#: Seconds a sandbox start is allowed before a test under a time budget (starts take ~0.1 s; the start clock's 10 s
#: would leave a small budget, the guard's row-by-row 27 s, room for one test).
_START_ALLOWANCE_S = 1.0
#: Kinds that say nothing about the response: its row is `failed`, not wrong.
_UNJUDGED = {"sandbox_errors", "bad_answers", "unfinished"}


@dataclass(frozen=True)
class CodeTest:
    """One test: the program's stdin and the stdout it must print."""

    input: str
    output: str


def extract_code(response: str) -> str | None:
    """The last complete fenced block tagged python/py/python3, else the last complete untagged block, else None.

    An unclosed fence (a truncated response) is not a program. Fences follow CommonMark (module docstring).
    """
    blocks = fenced_blocks(response)
    for wanted in (_PYTHON_TAGS, {""}):
        for tag, body in reversed(blocks):
            if tag in wanted and body.strip():
                return body
    return None


def normalize_output(text: str) -> str:
    """Line endings unified, trailing whitespace of each line and trailing blank lines removed."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def _tokens_match(got: str, expected: str, tolerance: float) -> bool:
    if got == expected:
        return True
    if not (_NUMBER.fullmatch(got) and _NUMBER.fullmatch(expected)):
        return False
    # Two integers are compared exactly: a relative tolerance would pass 1000000 for 1000001.
    if _INTEGER.fullmatch(got) and _INTEGER.fullmatch(expected):
        return False
    a, b = float(got), float(expected)
    # Overflowed literals (1e999) are inf: isclose(inf, inf) would pass any two of them.
    return math.isfinite(a) and math.isfinite(b) and math.isclose(a, b, rel_tol=tolerance, abs_tol=tolerance)


def outputs_match(got: str, expected: str, float_tolerance: float | None = None) -> bool:
    """Whether a program's stdout equals the expected output (see `normalize_output`); with `float_tolerance`,
    token by token with numbers compared within it (module docstring)."""
    got, expected = normalize_output(got), normalize_output(expected)
    if float_tolerance is None or got == expected:
        return got == expected
    got_parts, expected_parts = _SEPARATOR.split(got), _SEPARATOR.split(expected)
    if len(got_parts) != len(expected_parts):
        return False
    # re.split with a group alternates token, separator, token, ...: separators (odd) must be equal.
    return all(
        g == e if k % 2 else _tokens_match(g, e, float_tolerance)
        for k, (g, e) in enumerate(zip(got_parts, expected_parts, strict=True))
    )


def encode_tests(tests: Sequence[CodeTest]) -> str:
    """The ground-truth string of a problem with these tests."""
    return json.dumps({"tests": [{"input": t.input, "output": t.output} for t in tests]}, ensure_ascii=False)


def parse_tests(answer: str) -> list[CodeTest]:
    """Tests from a ground-truth string; ValueError (saying what is wrong) for anything malformed."""
    try:
        data = json.loads(answer)
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"ground truth is not JSON: {exc}") from exc
    tests = data.get("tests") if isinstance(data, dict) else None
    if not isinstance(tests, list) or not tests:
        raise ValueError('ground truth must be {"tests": [{"input": ..., "output": ...}, ...]} with >= 1 test')
    out = []
    for i, t in enumerate(tests):
        if not isinstance(t, dict) or not isinstance(t.get("input"), str) or not isinstance(t.get("output"), str):
            raise ValueError(f"test {i} must be an object with string 'input' and 'output'")
        out.append(CodeTest(t["input"], t["output"]))
    return out


class CodeReward(Reward):
    """Runs the response's program against the problem's tests in a sandbox (see the module docstring).

    Args:
        score_mode: `all_pass` (1 only when every test passes) or `fraction` (share of tests passed).
        timeout_s: wall-clock seconds of the program per test, from the moment its sandbox is up (a slower start
            than the sandbox's start budget is a `sandbox_errors` row, not a timeout).
        memory_mb: address space per process, MiB.
        max_processes: processes and threads the program may run at once.
        run_memory_mb: memory of all the program's processes together, MiB (where a cgroup can be made).
        max_output_bytes: stdout + stderr bytes per test before the program is killed.
        parallelism: sandboxes running at once (threads each waiting on one sandbox process), also over `score`
            calls made concurrently (a reward service's threads): the sandbox holds the cap.
        max_tests: run at most this many tests per problem (the first ones); None: all.
        format_weight: bonus for a response with a code block.
        float_tolerance: compare outputs token by token, numbers within this relative and absolute tolerance
            (e.g. 1e-6; module docstring); None: exact comparison.
        python: interpreter inside the sandbox (a virtual environment's `bin/python` brings its site-packages);
            None: the one running roll (standard library only).
        allow_unsandboxed_execution_i_understand_the_risk: when no sandbox works here, run programs in plain
            child processes (resource limits only: they can read your files and reach the network) instead of
            refusing to start. A working sandbox is always used.
    """

    def __init__(
        self,
        score_mode: str = "all_pass",
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        max_processes: int = 8,
        run_memory_mb: int = 1024,
        max_output_bytes: int = 1 << 20,
        parallelism: int = 4,
        max_tests: int | None = None,
        format_weight: float = 0.0,
        float_tolerance: float | None = None,
        python: str | None = None,
        allow_unsandboxed_execution_i_understand_the_risk: bool = False,
    ) -> None:
        if score_mode not in SCORE_MODES:
            raise ValueError(f"score_mode must be one of {SCORE_MODES}, got {score_mode!r}")
        if parallelism < 1:
            raise ValueError(f"parallelism must be >= 1, got {parallelism}")
        if max_tests is not None and max_tests < 1:
            raise ValueError(f"max_tests must be >= 1 or null, got {max_tests}")
        if float_tolerance is not None and not 0 < float_tolerance < 1:  # NaN fails too
            raise ValueError(f"float_tolerance must be > 0 and < 1 (e.g. 1e-6) or null, got {float_tolerance}")
        self.score_mode, self.parallelism, self.max_tests = score_mode, parallelism, max_tests
        self.format_weight, self.float_tolerance = format_weight, float_tolerance
        self._warned_output = self._warned_sandbox = False
        limits = SandboxLimits(
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            max_processes=max_processes,
            max_output_bytes=max_output_bytes,
            run_memory_mb=run_memory_mb,
        )
        self.sandbox: PythonSandbox = make_sandbox(
            limits,
            python=python,
            max_concurrent_runs=parallelism,
            allow_unsandboxed=allow_unsandboxed_execution_i_understand_the_risk,
            logger=log,
        )

    def score(
        self, responses: Sequence[str], answers: Sequence[str], *, time_budget_s: float | None = None
    ) -> RewardResult:
        """Scores of `responses[i]` run against the tests of `answers[i]` (module docstring). `time_budget_s`
        (roll's reward guard gives it): no test starts unless its program clock and a second for the start fit
        before then, and rows not judged by then are `unfinished` (module docstring), the finished ones kept."""
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        counters = dict.fromkeys(COUNTERS, 0)
        if not responses:
            return RewardResult(scores=[], correct=[], formatted=[], counters=counters)
        deadline = None if time_budget_s is None else time.monotonic() + time_budget_s
        with ThreadPoolExecutor(max_workers=min(self.parallelism, len(responses))) as pool:
            results = list(pool.map(self._score_one, responses, answers, [deadline] * len(responses)))
        scores, correct, formatted, failed = [], [], [], []
        for score, ok, has_code, kinds in results:
            scores.append(score)
            correct.append(float(ok))
            formatted.append(float(has_code))
            failed.append(bool(kinds & _UNJUDGED))
            for kind in kinds:
                counters[kind] += 1
        return RewardResult(scores=scores, correct=correct, formatted=formatted, counters=counters, failed=failed)

    def _score_one(
        self, response: str, answer: str, deadline: float | None = None
    ) -> tuple[float, bool, bool, set[str]]:
        """(score, all passed, has code, counter kinds) of one response; `unfinished` when a test would not end
        before `deadline` (a monotonic time) and the program has not timed out on one yet (module docstring)."""
        answer_text = final_text(response) if isinstance(response, str) else None  # after the reasoning
        code = extract_code(answer_text) if answer_text is not None else None
        if code is None:
            return 0.0, False, False, {"no_code"}
        bonus = self.format_weight
        try:
            tests = parse_tests(answer)
        except ValueError:
            return bonus, False, True, {"bad_answers"}
        tests = tests[: self.max_tests] if self.max_tests else tests
        budget = self.sandbox.limits.max_output_bytes
        # What a right program prints at least: the expected output and the newline print() ends it with.
        longest = max(len(normalize_output(t.output).encode("utf-8", "replace")) + 1 for t in tests)
        if longest > budget:
            if not self._warned_output:  # once: every sample of such a problem would log it again
                self._warned_output = True
                log.warning(
                    "code reward: a test expects %d bytes of output (its final newline included), over "
                    "max_output_bytes=%d: no program can pass it, so its rows are not judged (counted in "
                    "bad_answers); raise max_output_bytes",
                    longest,
                    budget,
                )
            return bonus, False, True, {"bad_answers"}
        passed, kinds = 0, set()
        limits = self.sandbox.limits
        for test in tests:
            if deadline is not None and time.monotonic() + _START_ALLOWANCE_S + limits.timeout_s > deadline:
                if _COUNTER[TIMEOUT] not in kinds:  # the batch's time ran out, not this program's (docstring)
                    return bonus, False, True, {"unfinished"}
                # It hung on a test already (fraction mode): judged, the tests not run count as failed. Unjudged, a
                # program that hangs on every test dodged its score: its row was `failed`, never trained as wrong.
                break
            res = self._run(code, test.input)
            if res.status == OK and outputs_match(res.stdout, test.output, self.float_tolerance):
                passed += 1
                continue
            if res.status == SANDBOX_ERROR:
                self._log_sandbox_error(res)
            kinds.add("wrong_answers" if res.status == OK else _COUNTER[res.status])
            if self.score_mode == "all_pass":
                break
        all_passed = passed == len(tests)
        score = float(all_passed) if self.score_mode == "all_pass" else passed / len(tests)
        return score + bonus, all_passed, True, kinds

    def _run(self, code: str, stdin: str) -> RunResult:
        """One sandbox run on `stdin` with its line endings made `\\n` (module docstring); an OSError setting it up
        (EMFILE for its pipes, EAGAIN from fork) is this row's sandbox error: raised out of `score`, it failed the
        whole batch, which the guard rescored row by row as `errors`."""
        # Python reads stdin without newline translation on POSIX: input() of "abc\r\n" is "abc\r", so a right
        # program printing len(input()) printed 4 for 3. Judges normalise test files; so do we.
        stdin = stdin.replace("\r\n", "\n").replace("\r", "\n")
        start = time.monotonic()
        try:
            return self.sandbox.run(code, stdin)
        except OSError as exc:
            seconds = time.monotonic() - start
            return RunResult(SANDBOX_ERROR, "", f"could not start the sandbox: {exc!r}", None, seconds)

    def _log_sandbox_error(self, res: RunResult) -> None:
        """Log the first sandbox error's cause (the counter alone never said why: a bind bwrap refused, a start past
        its clock); later ones are only counted."""
        if self._warned_sandbox:
            return
        self._warned_sandbox = True
        log.warning(
            "code reward: the sandbox failed (exit %s after %.1fs, stderr: %s); its row is not judged (counted in "
            "sandbox_errors; later ones are only counted)",
            res.returncode,
            res.seconds,
            " | ".join(res.stderr.strip().splitlines()[-3:]) or "none",
        )
