"""The code task and reward: seeded built-in problems, the file loader, code extraction, scoring and refusal.

Tests that run programs need a working bubblewrap (`roll-envs[code]`); they skip with the reason otherwise.
The sandbox's containment is tested in test_sandbox_escapes.py.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from roll_core.errors import ConfigError
from roll_envs.config import CodeEnvConfig, CodeRewardConfig
from roll_envs.rewards.code import (
    COUNTERS,
    CodeReward,
    CodeTest,
    encode_tests,
    extract_code,
    outputs_match,
    parse_tests,
)
from roll_envs.rewards.math import MathReward
from roll_envs.sandbox import SandboxUnavailableError
from roll_envs.sandbox import bwrap as bwrap_module
from roll_envs.tasks._code_problems import TEMPLATES
from roll_envs.tasks.code import INSTRUCTION, CodeTask, load_code_problems, parse_row_tests


def _reward_or_skip(**kwargs: Any) -> CodeReward:
    try:
        return CodeReward(**kwargs)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")


@pytest.fixture(scope="module")
def reward() -> CodeReward:
    return _reward_or_skip(timeout_s=5.0, parallelism=4)


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my program.\n```{tag}\n{code}```\nIt reads stdin."


# ---- built-in problems ---------------------------------------------------------------------------------------


def test_builtin_problems_are_seeded_disjoint_and_distinct() -> None:
    a, b, c = CodeTask(MathReward(), seed=0), CodeTask(MathReward(), seed=0), CodeTask(MathReward(), seed=1)
    assert a.train_set() == b.train_set() and a.eval_set() == b.eval_set()
    assert [p.answer for p in a.train_set()] != [p.answer for p in c.train_set()]  # other tests, other variants
    everything = a.train_set() + a.eval_set()
    assert len(TEMPLATES) == 24 and 40 <= len(everything) <= 48
    assert len({p.id for p in everything}) == len(everything) and len({p.prompt for p in everything}) == len(everything)
    held_ids = {p.id for p in a.eval_set()} | {p.id for p in c.eval_set()}
    assert not ({p.id for p in a.train_set()} | {p.id for p in c.train_set()}) & held_ids
    for p in everything:
        tests = parse_tests(p.answer)
        assert len(tests) == 5 and p.domain == "code" and p.prompt.endswith(INSTRUCTION)
        assert tests[0].input.strip() in p.prompt and tests[0].output.strip() in p.prompt  # the shown example
        assert a.reference_solution(p) is not None


def test_builtin_options_and_bad_config() -> None:
    task = CodeTask(MathReward(), variants=1, num_tests=2, eval_fraction=0.3)
    assert len(task.train_set()) + len(task.eval_set()) == len(TEMPLATES)
    assert all(len(parse_tests(p.answer)) == 2 for p in task.train_set())
    with pytest.raises(ValueError, match="eval_fraction"):
        CodeTask(MathReward(), eval_fraction=1.5)
    with pytest.raises(ValueError, match="eval_path needs path"):
        CodeTask(MathReward(), eval_path="x.jsonl")


def test_config_schema_matches_the_task() -> None:
    assert CodeEnvConfig().instruction == INSTRUCTION
    assert CodeRewardConfig().allow_unsandboxed_execution_i_understand_the_risk is False
    assert CodeRewardConfig().float_tolerance is None  # exact comparison unless asked for


def test_float_tolerance_reaches_the_reward_through_the_schema() -> None:
    import inspect

    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    fields = {f for f in CodeRewardConfig.__dataclass_fields__ if f != "_target_"}
    assert fields <= set(inspect.signature(CodeReward).parameters)
    node = OmegaConf.structured(CodeRewardConfig(float_tolerance=1e-6, parallelism=1))
    try:
        built = instantiate(node)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")
    assert isinstance(built, CodeReward) and built.float_tolerance == 1e-6
    for bad in [0.0, -1e-6, 1.0, float("nan")]:
        with pytest.raises(ValueError, match="float_tolerance"):
            CodeReward(float_tolerance=bad)


# ---- file loader ---------------------------------------------------------------------------------------------


def test_loader_accepts_three_layouts_and_reports_bad_rows(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good = [{"input": "1 2\n", "output": "3\n"}]
    rows: list[Any] = [{"prompt": f"Add the two numbers ({i}).", "tests": good} for i in range(30)]
    rows[1] = {"prompt": "APPS layout", "tests": {"inputs": ["1\n", "2\n"], "outputs": ["1\n", "4\n"]}}
    rows[2] = {"prompt": "JSON string", "tests": json.dumps(good)}
    rows[4] = {"prompt": "no tests"}
    rows[5] = {"prompt": "empty tests", "tests": []}
    rows[6] = {"prompt": "int output", "tests": [{"input": "1", "output": 1}]}
    rows[7] = {"prompt": "", "tests": good}
    rows[8] = ["not", "an", "object"]
    rows[9] = {"prompt": "bad json string", "tests": "[{"}
    rows[10] = {"prompt": "unequal", "tests": {"inputs": ["1"], "outputs": []}}
    lines = [json.dumps(r) for r in rows]
    lines[3] = "{not json"
    path = tmp_path / "code.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        task = CodeTask(MathReward(), path=str(path), eval_fraction=0.3)
    reasons = [(n, why) for _, n, why in task.skipped]
    assert [n for n, _ in reasons] == [4, 5, 6, 7, 8, 9, 10, 11]
    assert reasons[1] == (5, "missing 'tests'") and reasons[2] == (6, "bad 'tests': no tests")
    assert reasons[3] == (7, "bad 'tests': test 0 has no string 'output'")
    assert reasons[4] == (8, "missing or empty 'prompt'") and "not an object" in reasons[5][1]
    assert "not JSON" in reasons[6][1] and "equal length" in reasons[7][1] and reasons[0][1].startswith("invalid JSON")
    assert "skipped 8 bad row(s)" in caplog.text
    problems = task.train_set() + task.eval_set()
    assert len(problems) == 22 and not {p.id for p in task.train_set()} & {p.id for p in task.eval_set()}
    apps = next(p for p in problems if p.prompt == "APPS layout")
    assert parse_tests(apps.answer) == [CodeTest("1\n", "1\n"), CodeTest("2\n", "4\n")]
    assert task.reference_solution(apps) is None


def test_loader_eval_path_parquet_and_no_usable_rows(tmp_path: Path) -> None:
    rows = [{"q": f"Problem {i}", "cases": [{"input": "", "output": str(i)}]} for i in range(6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "held.jsonl").write_text(json.dumps(rows[0]) + "\n")
    task = CodeTask(
        MathReward(),
        path=str(tmp_path / "train.jsonl"),
        eval_path=str(tmp_path / "held.jsonl"),
        prompt_key="q",
        tests_key="cases",
    )
    # The held-out problem is not trained on (the sets never share a problem); the training row is counted.
    assert len(task.train_set()) == 5 and len(task.eval_set()) == 1
    assert task.eval_set()[0].prompt not in {p.prompt for p in task.train_set()}
    with pytest.raises(ValueError, match="no usable rows"):
        load_code_problems(tmp_path / "held.jsonl")  # default keys: prompt, tests
    with pytest.raises(ConfigError, match="does not exist"):
        load_code_problems(tmp_path / "missing.jsonl")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = [{"prompt": r["q"], "tests": json.dumps(r["cases"])} for r in rows]
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "d.parquet")
    problems, skipped = load_code_problems(tmp_path / "d.parquet")
    assert len(problems) == 6 and not skipped


def test_rows_with_lone_surrogates_in_tests_or_a_templated_prompt_are_counted_skips(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As env=file reads rows: a `\\ud800` escape in a test's input or output (in the row, or in tests given as
    JSON text, as a Parquet column holds them) loaded silently, and the sandbox fed the program `?` for it or no
    program could print the expected output: a wrong score with no row named. A prompt already chat-templated was
    templated again. Both are counted skips naming the line."""
    good = [{"input": "1\n", "output": "1\n"}]
    rows: list[Any] = [{"prompt": f"Echo the number ({i}).", "tests": good} for i in range(6)]
    rows[1] = {"prompt": "Bad input", "tests": [{"input": "1\n", "output": "1\n"}, {"input": "a\ud800", "output": "a"}]}
    rows[2] = {"prompt": "Bad output", "tests": json.dumps({"inputs": ["x"], "outputs": ["y\udc80"]})}
    rows[3] = {"prompt": "<|im_start|>user\nEcho it.<|im_end|>\n<|im_start|>assistant\n", "tests": good}
    rows[4] = {"prompt": [{"role": "system", "content": "[INST] Be brief."}, {"role": "user", "content": "Echo."}]}
    rows[4]["tests"] = good
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # (json.dumps writes the \ud800 escapes)
    with caplog.at_level(logging.WARNING):
        problems, skipped = load_code_problems(path)
    assert [p.id for p in problems] == ["code:code.jsonl:1", "code:code.jsonl:6"]
    escape = "is not valid Unicode text (a lone surrogate \\u{} at character {}, a broken \\u escape)"
    fix = "and would be templated again: give the raw user text, or chat messages as a list of {role, content}"
    assert skipped == [
        (2, f"bad 'tests': test 1 'input' {escape.format('d800', 1)}"),
        (3, f"bad 'tests': test 0 'output' {escape.format('dc80', 1)}"),
        (4, f"'prompt' is already chat-templated (it opens with '<|im_start|>') {fix}"),
        (5, f"message 0 of 'prompt' is already chat-templated (it opens with '[INST]') {fix}"),
    ]
    assert "skipped 4 bad row(s): line 2: bad 'tests': test 1 'input'" in caplog.text
    for p in problems:
        p.answer.encode("utf-8")  # (what the sandbox and any remote reward do with it)


def test_rows_with_deeply_nested_json_tests_are_counted_skips(tmp_path: Path) -> None:
    """Tests given as JSON text nested past Python's recursion limit ended the load in a bare RecursionError
    naming no row."""
    rows = [{"prompt": f"Echo ({i}).", "tests": [{"input": "1", "output": "1"}]} for i in range(2)]
    rows.append({"prompt": "Deep", "tests": "[" * 100_000 + "]" * 100_000})
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems, skipped = load_code_problems(path)
    assert len(problems) == 2 and skipped == [(3, "bad 'tests': tests are a string but not JSON (nested too deeply)")]


def _code_rows(path: Path, prompts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": q, "tests": [{"input": "", "output": "1"}]}) + "\n" for q in prompts))
    return str(path)


def test_a_held_out_problem_differing_only_in_whitespace_is_not_trained_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With env.eval_path a training row was left out only when its prompt equalled a held-out one exactly: "Print
    1." held out and "Print 1.\n" (or a doubled space) trained on, so the held-out score measured memory. The code
    task now uses env=file's rule (base.held_out_split): left out, counted in also_held_out, logged. split-nesting"""
    train_prompts = [f"Print {i}." for i in range(2, 8)] + ["Print 1.\n", "Print  0."]
    train = _code_rows(tmp_path / "train.jsonl", train_prompts)
    held = _code_rows(tmp_path / "held.jsonl", ["Print 0.", "Print 1."])
    with caplog.at_level(logging.WARNING):
        task = CodeTask(MathReward(), path=train, eval_path=held)
    assert [p.prompt for p in task.train_set()] == [f"Print {i}." for i in range(2, 8)]
    assert [p.prompt for p in task.eval_set()] == ["Print 0.", "Print 1."]
    assert task.also_held_out == 2 and "2 of its 8 rows are also in env.eval_path" in caplog.text
    # The same file as both is an evaluation set (roll-eval --data), as for env=file: it left nothing to train on.
    same = CodeTask(MathReward(), path=train, eval_path=train)
    assert len(same.train_set()) == 8 and len(same.eval_set()) == 8 and same.also_held_out == 0


def test_the_hash_split_leaves_out_whitespace_twins_of_held_out_problems(tmp_path: Path) -> None:
    """Without env.eval_path the split hashes the raw prompt: "Print 3." and "Print 3.\n" fell on different sides
    and a held-out problem was trained on. Such twins are left out of training and counted (the split of other rows
    is unchanged). split-nesting"""
    from roll_envs.tasks.base import stable_fraction

    base = [f"Print {i}." for i in range(40)]
    prompts = base + [q + "\n" for q in base]
    crossed = [q for q in base if (stable_fraction(q) < 0.5) != (stable_fraction(q + "\n") < 0.5)]
    assert crossed  # (some twins do fall on different sides)
    task = CodeTask(MathReward(), path=_code_rows(tmp_path / "code.jsonl", prompts), eval_fraction=0.5)
    held = {" ".join(p.prompt.split()) for p in task.eval_set()}
    trained = [p.prompt for p in task.train_set()]
    assert not held & {" ".join(q.split()) for q in trained}
    assert task.also_held_out == len(crossed) and len(trained) + len(task.eval_set()) == 80 - len(crossed)
    # Rows without a held-out twin keep their side: the split of a resumed run is unchanged.
    assert trained == [q for q in prompts if stable_fraction(q) >= 0.5 and q.strip() not in crossed]


def test_parse_row_tests_errors() -> None:
    assert parse_row_tests({"tests": [{"input": "a", "output": "b"}]}) == [CodeTest("a", "b")]
    for bad, match in [(None, "no tests"), ([{"input": 1, "output": "x"}], "no string 'input'"), ("{", "not JSON")]:
        with pytest.raises(ValueError, match=match):
            parse_row_tests(bad)


# ---- extraction and comparison --------------------------------------------------------------------------------


def test_extract_code_takes_the_last_python_block() -> None:
    assert extract_code(fenced("print(1)\n")) == "print(1)\n"
    two = "```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```\n```\nplain\n```"
    assert extract_code(two) == "print(2)\n"  # a tagged block wins over a later untagged one
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("```bash\nls\n```") is None
    assert extract_code("```python\nprint(1)\n") is None  # unclosed (truncated response)
    assert extract_code("no code at all") is None and extract_code("```python\n\n```") is None


def test_extract_code_ends_a_block_only_at_a_closing_fence_line() -> None:
    """A ``` inside the program (a string literal, a docstring) cut it there: the right program was truncated
    (a syntax error, scored 0) or a fragment of another ran. A block ends only at a line that is a closing fence."""
    prints_fence = 'print("```")\nprint(1)\n'
    assert extract_code(fenced(prints_fence)) == prints_fence
    documented = 'def f():\n    """Use it like this:\n    ```python\n    f()\n    ```\n    """\n    return 1\n'
    documented += "print(f())\n"
    assert extract_code(fenced(documented)) == documented
    # The last python block, though an earlier one is complete and the last one quotes a fence.
    two = f"```python\nprint(0)\n```\nBetter:\n```python3\n{prints_fence}```\n"
    assert extract_code(two) == prints_fence
    # Closing: alone on its line, whitespace after it allowed; code before or text after it is not a fence.
    assert extract_code("```py\nx = 1  # ``` \nprint(x)\n```  \t\nbye") == "x = 1  # ``` \nprint(x)\n"
    assert extract_code("```python\nprint(1)\n``` see\nprint(2)\n```") == "print(1)\n``` see\nprint(2)\n"
    assert extract_code("```python\nprint(1)```") is None  # never closed: no program
    # A fence of N backticks closes with >= N; an info string after the tag is allowed, the tag in any case.
    four = "````Python title=main.py\ns = '''\n```\n'''\nprint(s)\n`````\n"
    assert extract_code(four) == "s = '''\n```\n'''\nprint(s)\n"
    # Inline code in prose (backticks in the info string) opens nothing.
    assert extract_code("Write ```python``` blocks.\n```python\nprint(2)\n```") == "print(2)\n"
    # A fence indented in a list item: the program loses that indentation, as Markdown renders it.
    listed = "1. The program:\n   ```python\n   n = 1\n   if n:\n       print(n)\n   ```\n2. Done."
    assert extract_code(listed) == "n = 1\nif n:\n    print(n)\n"


def test_extract_code_ignores_an_unclosed_last_block() -> None:
    """A truncated response: its unclosed block is no program, complete blocks before it still are, and a fence
    line inside the unclosed block does not open a new one."""
    assert extract_code("```python\nprint(1)\n```\nNow faster:\n```python\nprint(2") == "print(1)\n"
    assert extract_code("```python\nprint(1)\n```\n````python\ns = '''\n```\nprint(3)\n```\n") == "print(1)\n"
    assert extract_code("```python\nprint('```')\n") is None


def test_outputs_match_within_a_float_tolerance() -> None:
    assert not outputs_match("0.33333333333\n", "0.3333333333")  # exact by default
    assert outputs_match("0.33333333333\n", "0.3333333333\n", float_tolerance=1e-6)
    assert outputs_match("x 2 -0.5000001 \n1e-9\n\n", "x 2 -0.5\n0", float_tolerance=1e-6)
    assert outputs_match("2\n", "2.0\n", float_tolerance=1e-6) and outputs_match("1E3", "1000.0000001", 1e-6)
    for got, expected in [
        ("0.3334", "0.3333"),  # outside the tolerance
        ("0.5 0.5", "0.5"),  # token count
        ("0.5  0.5", "0.5 0.5"),  # whitespace between tokens stays exact
        ("0.5\n0.5", "0.5 0.5"),
        ("1000000", "1000001"),  # two integers compare exactly
        ("YES 0.5", "yes 0.5"),  # non-numbers compare exactly
        ("1e999", "2e999"),  # overflowed: not comparable
        ("nan", "0.5"),
        ("1_000.0", "1000.0"),  # float() reads this; a judge does not
        ("", "0.0"),
    ]:
        assert not outputs_match(got, expected, float_tolerance=1e-6), (got, expected)


def test_outputs_match_ignores_trailing_whitespace_only() -> None:
    assert outputs_match("1 2 \r\n3\n\n", "1 2\n3")
    assert not outputs_match("1  2\n", "1 2\n") and not outputs_match(" 1\n", "1\n") and not outputs_match("", "0")


def test_parse_tests_rejects_malformed_ground_truth() -> None:
    assert parse_tests(encode_tests([CodeTest("1", "2")])) == [CodeTest("1", "2")]
    for bad in ["", "not json", "[]", '{"tests": []}', '{"tests": [{"input": "1"}]}']:
        with pytest.raises(ValueError):
            parse_tests(bad)


# ---- scoring (runs programs: needs the sandbox) --------------------------------------------------------------


def test_reference_solutions_score_1_and_wrong_programs_0(reward: CodeReward) -> None:
    task = CodeTask(reward)
    problems = task.train_set()[:6] + task.eval_set()[:2]
    right = [fenced(task.reference_solution(p) or "") for p in problems]
    res = task.score(right, problems)
    assert res.correct == [1.0] * len(problems) and res.scores == [1.0] * len(problems), res
    assert res.formatted == [1.0] * len(problems) and not any(res.counters.values())
    wrong = [fenced("print(42)\n"), fenced("import sys\nsys.exit(0)\n"), fenced("raise SystemExit(3)\n"), "none"]
    res = task.score(wrong, problems[:4])
    assert res.scores == [0.0] * 4 and res.correct == [0.0] * 4 and res.formatted == [1.0, 1.0, 1.0, 0.0]
    assert res.counters["wrong_answers"] == 2 and res.counters["runtime_errors"] == 1
    assert res.counters["no_code"] == 1 and set(res.counters) == set(COUNTERS)


def test_a_program_quoting_a_fence_and_a_float_answer_score_1(reward: CodeReward) -> None:
    """End to end: the program printing ``` ran whole (it was cut to `print("` and scored 0), and a float printed
    with more digits than the expected output passes with `float_tolerance` only."""
    fence = encode_tests([CodeTest("", "```\n3\n")])
    third = encode_tests([CodeTest("3\n", "0.3333333333\n")])
    quoting, precise = fenced('print("```")\nprint(3)\n'), fenced("print(f'{1 / int(input()):.11f}')\n")
    res = reward.score([quoting, precise], [fence, third])
    assert res.scores == [1.0, 0.0] and res.counters["wrong_answers"] == 1, res
    tolerant = _reward_or_skip(float_tolerance=1e-6, parallelism=1)
    assert tolerant.score([precise, fenced("print(0.3334)\n")], [third, third]).scores == [1.0, 0.0]


def test_only_a_program_after_the_reasoning_runs(reward: CodeReward) -> None:
    """A thinking model's block inside its `<think>` block is no program: a reply cut off while reasoning has
    none (`no_code`; its draft ran and passed), and a right draft in the reasoning does not pass for a wrong final
    program. Without think tags the response is read whole, as before."""
    answer = encode_tests([CodeTest("3\n", "9\n")])
    square, wrong = fenced("print(int(input()) ** 2)\n"), fenced("print(0)\n")
    cut = "<think>\nDraft:\n" + square + "\nNow check the edge cases"
    draft_right = "<think>\n" + square + "\n</think>\n" + wrong
    final_right = "<think>\n" + wrong + "\n</think>\n" + square
    res = reward.score([cut, draft_right, final_right, wrong + square], [answer] * 4)
    assert res.scores == [0.0, 0.0, 1.0, 1.0] and res.formatted == [0.0, 1.0, 1.0, 1.0], res
    assert res.counters["no_code"] == 1 and res.counters["wrong_answers"] == 1


def test_fraction_mode_format_weight_and_bad_answers() -> None:
    reward = _reward_or_skip(score_mode="fraction", format_weight=0.1, parallelism=2, timeout_s=1.5)
    answer = encode_tests(
        [CodeTest("1\n", "1\n"), CodeTest("2\n", "4\n"), CodeTest("3\n", "9\n"), CodeTest("4\n", "4\n")]
    )
    square_until_3 = fenced("n = int(input())\nprint(n * n if n < 4 else n)\n")
    only_ones = fenced("print(1)\n")
    loops = fenced("n = int(input())\nwhile n == 2:\n    pass\nprint(n * n)\n")
    res = reward.score([square_until_3, only_ones, loops, fenced("print(1)\n"), "no code"], [answer] * 4 + [answer])
    assert res.scores[0] == pytest.approx(1.1) and res.correct[0] == 1.0
    assert res.scores[1] == pytest.approx(0.35) and res.correct[1] == 0.0  # test 1 of 4 passes
    # times out on the second test, still scored on the others.
    assert res.scores[2] == pytest.approx(0.6) and res.counters["program_timeouts"] == 1
    assert res.failed == [False] * 5  # wrong, timed out or without code: judged
    bad = reward.score([fenced("print(1)\n")], ["not json"])
    assert bad.scores == [pytest.approx(0.1)] and bad.counters["bad_answers"] == 1
    assert bad.failed == [True]  # malformed ground truth: not a verdict on the response


def test_a_sandbox_that_fails_leaves_its_rows_failed_not_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sandbox cannot start within its wall clock: a right program's rows are failed (the guard counts them,
    and a step where all fail counts toward the failure budget), not trained on as wrong answers."""
    from roll_core.cluster.reward_guard import GuardedReward, all_rows_failed
    from roll_envs.sandbox import SandboxLimits, runner

    reward = _reward_or_skip(score_mode="fraction", timeout_s=5.0)
    # A start that takes 3 s against a 0.2 s budget (a bare 5 ms budget was met under load: a trainer descheduled past
    # it finds the ready byte already there, and that start counts as in time).
    slow = runner.CHILD_SOURCE.replace(
        "def main() -> None:\n", "def main() -> None:\n    __import__('time').sleep(3)\n"
    )
    assert slow != runner.CHILD_SOURCE
    monkeypatch.setattr(runner, "CHILD_SOURCE", slow)
    reward.sandbox.limits = SandboxLimits(timeout_s=5.0, start_timeout_s=0.2)
    add = fenced("a, b = map(int, input().split())\nprint(a + b)\n")
    res = GuardedReward(reward, isolation="inline").score([add] * 2, [encode_tests([CodeTest("1 2\n", "3\n")])] * 2)
    assert res.counters["sandbox_errors"] == 2 and res.failed == [True, True]
    assert res.counters["failed_unscored"] == 2 and all_rows_failed(res.counters)
    with pytest.raises(ValueError, match="score_mode"):
        CodeReward(score_mode="some")


def test_an_expected_output_over_the_output_budget_is_not_judged(caplog: pytest.LogCaptureFixture) -> None:
    """A test expecting more output than max_output_bytes: the right program was killed at the output budget and
    scored 0 (an output_limit, a wrong answer), so every sample of such a problem trained as wrong. Now its rows are
    unjudged (failed, counted in bad_answers, logged once) and a test within the budget still passes."""
    reward = _reward_or_skip(max_output_bytes=1000, parallelism=1, timeout_s=10.0)
    prints = fenced("print('x' * int(input()))\n")
    over, within = encode_tests([CodeTest("2000\n", "x" * 2000 + "\n")]), encode_tests([CodeTest("900\n", "x" * 900)])
    with caplog.at_level(logging.WARNING, logger="roll_envs.rewards.code"):
        res = reward.score([prints, prints, prints], [over, within, over])
    assert res.failed == [True, False, True] and res.correct == [0.0, 1.0, 0.0], res
    assert res.counters["bad_answers"] == 2 and res.counters["output_limits"] == 0
    assert caplog.text.count("over max_output_bytes=1000") == 1, caplog.text
    # Trailing whitespace the comparison ignores does not count against the budget.
    padded = encode_tests([CodeTest("900\n", "x" * 900 + " " * 500 + "\n" * 500)])
    assert reward.score([prints], [padded]).correct == [1.0]


def test_reward_refuses_without_bubblewrap(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_bwrap(explicit: str | None = None) -> str:
        raise FileNotFoundError("no usable bubblewrap (bwrap >= 0.8)")

    monkeypatch.setattr(bwrap_module, "find_bwrap", no_bwrap)
    with pytest.raises(SandboxUnavailableError) as info:
        CodeReward()
    message = str(info.value)
    assert "pip install 'roll-envs[code]'" in message and "apt install bubblewrap" in message
    assert "allow_unsandboxed_execution_i_understand_the_risk" in message


def test_unsandboxed_mode_runs_in_a_child_process(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_bwrap(explicit: str | None = None) -> str:
        raise FileNotFoundError("no bwrap")

    monkeypatch.setattr(bwrap_module, "find_bwrap", no_bwrap)
    with caplog.at_level(logging.WARNING):
        reward = CodeReward(allow_unsandboxed_execution_i_understand_the_risk=True, parallelism=1, timeout_s=1.5)
    assert reward.sandbox.mode == "unsandboxed" and "UNSANDBOXED CODE EXECUTION" in caplog.text
    me = os.getpid()
    answer = encode_tests([CodeTest("", "child\n")])
    res = reward.score(
        [fenced(f"import os\nprint('child' if os.getpid() != {me} else 'in-process')\n"), fenced("while True: pass\n")],
        [answer, answer],
    )
    assert res.correct == [1.0, 0.0] and res.counters["program_timeouts"] == 1


def test_parallelism_holds_over_concurrent_score_calls(running_programs: Callable[[], int]) -> None:
    """A reward service scores requests in several threads: `parallelism` caps the sandboxes of all of them
    together (it capped each call alone: three concurrent calls ran 3 x parallelism sandboxes)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    reward = _reward_or_skip(parallelism=2, timeout_s=30.0)
    answer = encode_tests([CodeTest("", "done\n")])
    responses = [fenced("import time\ntime.sleep(1)\nprint('done')\n")] * 2
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], running_programs())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda _: reward.score(responses, [answer] * 2), range(3)))
    finally:
        stop.set()
        sampler.join()
    assert all(r.correct == [1.0, 1.0] for r in results), results
    assert 1 <= peak[0] <= 2, f"{peak[0]} sandboxed programs at once with parallelism=2"
