"""Code reward and code rows against data and Markdown as they come (real bubblewrap sandbox where a program runs).

- A test input with Windows line endings ("abc\\r\\n") reached the program as is: Python does not translate `\\r`
  on stdin, so `input()` returned "abc\\r" and a right `print(len(input()))` printed 4 for 3 (score 0). Test inputs
  are now normalised to `\\n`, as judges normalise test files.
- A row whose every test expects empty output was kept: `pass` scored 1 on it. It is a counted, logged skip now.
- A fence inside a list item, indented by the item's content column (`1. Read n:` then four spaces of ```python),
  was not found: the response counted as `no_code`. Fences are found as CommonMark finds them, the item's
  indentation stripped from the program; code merely indented (an indented code block) is still no program.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from roll_envs.rewards.code import CodeReward, CodeTest, encode_tests, extract_code, parse_tests
from roll_envs.sandbox import SandboxUnavailableError
from roll_envs.tasks.code import load_code_problems

# Reads two lines: with "\r" kept, the first is one character too long, and a lone "\r" ends no line at all.
TWO_LENGTHS = "print(len(input()))\nprint(len(input()))\n"
LISTED = (
    "1. Read n and print the even numbers up to it:\n\n"
    "    ```python\n"
    "    n = int(input())\n"
    "    for i in range(1, n + 1):\n"
    "        if i % 2 == 0:\n"
    "            print(i)\n"
    "    ```\n"
    "2. Done.\n"
)


def _reward_or_skip(**kwargs: Any) -> CodeReward:
    try:
        return CodeReward(**kwargs)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")


def test_crlf_inputs_and_a_fence_in_a_list_item_are_judged_right_in_the_sandbox() -> None:
    reward = _reward_or_skip(score_mode="fraction", timeout_s=5.0, parallelism=2)
    crlf = encode_tests([CodeTest("abc\r\nde\r\n", "3\n2\n"), CodeTest("abc\rde\r", "3\n2\n")])
    evens = encode_tests([CodeTest("5\n", "2\n4\n")])
    res = reward.score([f"```python\n{TWO_LENGTHS}```", LISTED], [crlf, evens])
    assert res.scores == [1.0, 1.0], res.counters
    assert res.counters["no_code"] == 0 and res.counters["wrong_answers"] == 0, res.counters


def test_fences_are_found_as_commonmark_finds_them() -> None:
    program = "n = int(input())\nfor i in range(1, n + 1):\n    if i % 2 == 0:\n        print(i)\n"
    assert extract_code(LISTED) == program  # the item's 4 columns stripped, the program's own indentation kept
    found = {
        "3 past a bullet's column": "- Solution:\n\n     ```py\n     print(1)\n     ```",
        "3 past a 10. item's column": "10. Solution:\n       ```python\n       print(1)\n       ```",
        "on the marker's line": "1. ```python\n   print(1)\n   ```",
        "in a nested item": "1. Plan\n   - Code:\n\n       ```python\n       print(1)\n       ```",
        "after a lazy line": "1. Read n\nand print it:\n    ```python\n    print(1)\n    ```",
        "3 spaces, no list": "   ```python\n   print(1)\n   ```",
    }
    for what, response in found.items():
        assert extract_code(response) == "print(1)\n", what
    not_found = {
        "indented code": "Here:\n\n    n = int(input())\n    print(n)\n",
        "a fence in indented code": "Here:\n\n    ```python\n    print(1)\n    ```\n",
        "4 past the item's column": "1. Solution:\n\n       ```python\n       print(1)\n       ```",
        "after the item ended": "1. Solution.\n\nThen:\n\n    ```python\n    print(1)\n    ```",
        "under a 2. that cannot interrupt text": "Say\n2. x\n    ```python\n    print(1)\n    ```",
    }
    for what, response in not_found.items():
        assert extract_code(response) is None, what


def test_rows_whose_every_test_expects_empty_output_are_counted_skips(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [
        {"prompt": "kept", "tests": [{"input": "1\n", "output": ""}, {"input": "2\n", "output": "2\n"}]},
        {"prompt": "empty", "tests": [{"input": "1\n", "output": ""}, {"input": "2\n", "output": ""}]},
        {"prompt": "blank", "tests": {"inputs": ["1\n"], "outputs": [" \n\n"]}},
    ]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING):
        problems, skipped = load_code_problems(path)
    assert [p.prompt for p in problems] == ["kept"]
    assert parse_tests(problems[0].answer) == [CodeTest("1\n", ""), CodeTest("2\n", "2\n")]
    why = "bad 'tests': every test ({}) expects empty output: a program that prints nothing would pass them all"
    assert skipped == [(2, why.format(2)), (3, why.format(1))]
    assert "skipped 2 bad row(s)" in caplog.text and why.format(2) in caplog.text
