"""Call-based (LeetCode-style) test rows are bad rows of the code task, not stdin tests.

LiveCodeBench stores a LeetCode problem's tests as `{"input": "[1,2,3]\\n4", "output": "5", "testtype":
"functional"}`: strings, so they were taken for stdin tests, and every response (a `class Solution` that prints
nothing, or a program fed the arguments as text) scored wrong. APPS / TACO's `fn_name` rows were skipped only by
chance (their arguments are lists), as "test 0 has no string 'input'", and were accepted where each argument list
was a string. Now both are counted, logged skips that say they are call-based; stdin rows (`"testtype": "stdin"`,
`"fn_name": null`) are kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roll_envs.rewards.code import CodeTest, parse_tests
from roll_envs.tasks.code import load_code_problems, parse_row_tests


def test_call_based_rows_are_counted_skips_and_stdin_rows_are_kept(tmp_path: Path) -> None:
    lcb_stdin = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
    lcb_functional = [{"input": "[1,2,3]\n4", "output": "5", "testtype": "functional"}]
    rows = [
        {"prompt": "LiveCodeBench AtCoder", "tests": json.dumps(lcb_stdin)},
        {"prompt": "LiveCodeBench LeetCode", "tests": json.dumps(lcb_functional)},
        {"prompt": "TACO call-based", "tests": json.dumps({"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]})},
        {"prompt": "string arguments", "tests": {"fn_name": "rev", "inputs": ["abc"], "outputs": ["cba"]}},
        {"prompt": "wrapped", "tests": {"tests": {"fn_name": "rev", "inputs": ["abc"], "outputs": ["cba"]}}},
        {"prompt": "TACO stdin", "tests": {"fn_name": None, "inputs": ["5\n"], "outputs": ["25\n"]}},
    ]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems, skipped = load_code_problems(path)
    assert [p.prompt for p in problems] == ["LiveCodeBench AtCoder", "TACO stdin"]
    assert parse_tests(problems[0].answer) == [CodeTest("1 2\n", "3\n")]
    assert parse_tests(problems[1].answer) == [CodeTest("5\n", "25\n")]
    assert [n for n, _ in skipped] == [2, 3, 4, 5]
    assert (
        skipped[0][1]
        == "bad 'tests': test 0 is call-based (testtype 'functional'); only stdin/stdout programs are judged"
    )
    assert [why for _, why in skipped[1:]] == [
        f"bad 'tests': tests are call-based (fn_name {name!r}); only stdin/stdout programs are judged"
        for name in ("add", "rev", "rev")
    ]


def test_a_functional_test_among_stdin_tests_refuses_the_row() -> None:
    tests = [
        {"input": "1\n", "output": "1\n", "testtype": "stdin"},
        {"input": "[1]", "output": "1", "testtype": "functional"},
    ]
    with pytest.raises(ValueError, match="test 1 is call-based"):
        parse_row_tests(tests)
