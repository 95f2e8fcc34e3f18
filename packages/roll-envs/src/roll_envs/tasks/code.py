"""Code task: write a Python program that reads stdin and prints the answer; scored by running it in a sandbox.

Built-in problems (`path=None`): 24 templates of small exercises (sum the multiples of k, reverse a line,
FizzBuzz variants, primes, run-length encoding, Collatz, ...; `_code_problems.py`), `variants` seeded parameter
draws each, `num_tests` seeded tests per problem. The prompt shows the first test as an example; the others are
hidden. A problem is held out when a stable hash of its template and parameters falls below `eval_fraction`, so
the split does not depend on the seed: the seed picks the variants and the tests.

Your data (`path=...`): JSONL, Parquet or a datasets folder (as `FileTask`), one problem per row with a prompt
(`prompt_key`) and tests (`tests_key`) given as `[{"input": ..., "output": ...}, ...]`, as
`{"inputs": [...], "outputs": [...]}` (the APPS / TACO layout), or as a JSON string of either. Call-based tests
(LeetCode style: APPS / TACO's `fn_name`, LiveCodeBench's `"testtype": "functional"`) are not judged: such a row
is a bad row (a program fed the arguments as stdin, or a `class Solution` printing nothing, could never pass). So is
a row whose every test expects empty output (nothing but whitespace): a program that does nothing (`pass`) would
pass it, a reward for no work. Bad rows (not an object, empty prompt, no tests, a test without string input and
output, call-based tests, only empty expected outputs, text holding a lone surrogate: a `\\ud800` escape in the
prompt or a test, a prompt already chat-templated, as env=file checks them) are skipped, counted in `skipped` with
their row numbers and reasons, and logged; an empty result is an error. The prompt is used as written; a prompt
given as chat messages is read as env=file reads it (the last user message, the messages before it kept).
The held-out split is env=file's (base.held_out_split): `eval_path` when given, else a stable hash of the prompt
below `eval_fraction`; either way a training row that is a held-out row's problem but for whitespace in the prompt
("Q?" and "Q?\n") is left out of training, counted in `also_held_out` and logged, so a held-out problem is never
trained on. `eval_path` naming the `path` file itself is an evaluation set (every row both trains and is evaluated).
A datasets folder's split is chosen as env=file chooses it (env.split / env.eval_split; an `eval_path` folder gives
its split beside `train`: roll_envs.tasks._datasets_folder).

The ground truth of a problem is `rewards.code.encode_tests(tests)`; the reward is `CodeReward` by default.
"""

from __future__ import annotations

import functools
import json
import logging
import random
from pathlib import Path
from typing import Any

from roll_core.errors import ConfigError
from roll_envs.rewards.base import Reward
from roll_envs.rewards.code import CodeTest, encode_tests, normalize_output
from roll_envs.tasks._code_problems import TEMPLATES, param_key, reference_program
from roll_envs.tasks.base import Problem, Task, eval_file_name, stable_fraction
from roll_envs.tasks.dataset import _chat_prompt, _not_unicode, _read_rows, _templated, _text_problem, log_skipped

log = logging.getLogger(__name__)

INSTRUCTION = (
    "Write a complete Python 3 program that reads the input from standard input and prints the answer to "
    "standard output. Put the program in a ```python code block."
)


def parse_row_tests(value: Any) -> list[CodeTest]:
    """Tests of one data row in any accepted layout (see the module docstring); ValueError says what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tests are a string but not JSON ({exc.msg})") from exc
        except RecursionError:  # (nested past the recursion limit: a bare RecursionError named no row)
            raise ValueError("tests are a string but not JSON (nested too deeply)") from None
    _refuse_call_based(value)
    if isinstance(value, dict) and "tests" in value:
        value = value["tests"]
        _refuse_call_based(value)
    if isinstance(value, dict):
        inputs, outputs = value.get("inputs"), value.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            raise ValueError("tests as an object need 'inputs' and 'outputs' lists of equal length")
        value = [{"input": i, "output": o} for i, o in zip(inputs, outputs)]
    if not isinstance(value, list) or not value:
        raise ValueError("no tests")
    tests = []
    for i, test in enumerate(value):
        if isinstance(test, dict) and test.get("testtype") == "functional":  # LiveCodeBench: input = the arguments
            raise ValueError(f"test {i} is call-based (testtype 'functional'); {_STDIN_ONLY}")
        if not isinstance(test, dict) or not isinstance(test.get("input"), str):
            raise ValueError(f"test {i} has no string 'input'")
        if not isinstance(test.get("output"), str):
            raise ValueError(f"test {i} has no string 'output'")
        # A `\ud800` escape (in the row, or in tests given as JSON text, as a Parquet column holds them) is no
        # Unicode text: the sandbox fed the program `?` for it, and no program prints such an expected output.
        for key in ("input", "output"):
            if (bad := _not_unicode(test[key])) is not None:
                raise ValueError(f"test {i} {key!r} {bad}")
        tests.append(CodeTest(test["input"], test["output"]))
    # Compared as the reward compares (trailing whitespace and blank lines dropped): `pass` would score 1.
    if not any(normalize_output(t.output) for t in tests):
        raise ValueError(
            f"every test ({len(tests)}) expects empty output: a program that prints nothing would pass them all"
        )
    return tests


_STDIN_ONLY = "only stdin/stdout programs are judged"


def _refuse_call_based(value: Any) -> None:
    """ValueError for APPS / TACO call-based tests (`fn_name`): their inputs are a function's arguments, which a
    stdin program would be fed as text (and a `class Solution` prints nothing): every response scored wrong."""
    if isinstance(value, dict) and value.get("fn_name"):
        raise ValueError(f"tests are call-based (fn_name {value['fn_name']!r}); {_STDIN_ONLY}")


def load_code_problems(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    tests_key: str = "tests",
    name: str = "code",
    split: str | None = None,
    key: str | None = None,
    held: bool = False,
) -> tuple[list[Problem], list[tuple[int, str]]]:
    """Read code problems from a file or folder; returns (problems, skipped) with skipped = [(row number, reason)].
    `split` (set by the config key `key`) and `held` choose a datasets folder's split as env=file does
    (roll_envs.tasks._datasets_folder; a split other than a lone one or `train` is named in the row ids)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"data file {path} does not exist: check env.path / env.eval_path")
    rows, skipped, label = _read_rows(path, split, key, held=held)
    problems = []
    for lineno, row in rows:
        if not isinstance(row, dict):
            skipped.append((lineno, f"row is {type(row).__name__}, not an object"))
            continue
        # (Chat-message prompts were skipped as "missing or empty", which they are not.)
        prompt, context, why = _chat_prompt(prompt_key, row.get(prompt_key))
        why = why or _text_problem(prompt_key, prompt, numbers=False) or _templated(prompt_key, prompt, context)
        if why is not None:
            skipped.append((lineno, why))
            continue
        if tests_key not in row:
            skipped.append((lineno, f"missing {tests_key!r}"))
            continue
        try:
            tests = parse_row_tests(row[tests_key])
        except ValueError as exc:
            skipped.append((lineno, f"bad {tests_key!r}: {exc}"))
            continue
        problems.append(
            Problem(
                id=f"{name}:{path.name}{label}:{lineno}",
                prompt=prompt,
                answer=encode_tests(tests),
                domain="code",
                context=context,
            )
        )
    skipped.sort()
    log_skipped(path, skipped)
    if not problems:
        raise ConfigError(
            f"{path}: no usable rows ({len(skipped)} skipped); expected keys {prompt_key!r}, {tests_key!r}: fix the "
            "rows or set env.prompt_key / env.tests_key"
        )
    return problems, skipped


class CodeTask(Task):
    """Python stdin/stdout problems: built-in templates, or rows of a file (see the module docstring)."""

    def __init__(
        self,
        reward: Reward,
        name: str = "code",
        path: str | None = None,
        eval_path: str | None = None,
        prompt_key: str = "prompt",
        tests_key: str = "tests",
        variants: int = 2,
        num_tests: int = 5,
        eval_fraction: float = 0.2,
        eval_size: int = 100,
        seed: int = 0,
        instruction: str = INSTRUCTION,
        system_prompt: str | None = None,
        split: str | None = None,
        eval_split: str | None = None,
    ) -> None:
        super().__init__(reward)
        if variants < 1 or num_tests < 1 or eval_size < 1:
            raise ValueError(
                f"variants, num_tests and eval_size must be >= 1, got {variants}, {num_tests}, {eval_size}"
            )
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        self.name, self.system_prompt, self.instruction = name, system_prompt, instruction
        self._solutions: dict[str, str] = {}
        if eval_split is not None and not eval_path:  # (it would be ignored unsaid)
            raise ConfigError(f"env.eval_split={eval_split!r} names a split of env.eval_path, which is not set")
        if path is None:
            if eval_path is not None or split is not None:
                what = "eval_path" if eval_path is not None else "split"
                raise ValueError(f"{what} needs path: the built-in problems have their own held-out split")
            problems = self._builtin(random.Random(seed), variants, num_tests)
            train = [p for p in problems if stable_fraction(p.id.split(":", 1)[1]) >= eval_fraction]
            held = [p for p in problems if stable_fraction(p.id.split(":", 1)[1]) < eval_fraction]
        else:
            keys = dict(prompt_key=prompt_key, tests_key=tests_key)
            problems, skipped = load_code_problems(path, name=name, split=split, key="env.split", **keys)
            self.skipped = [(str(path), n, why) for n, why in skipped]
            file_held = None
            if eval_path:
                held_name = eval_file_name(name, path, eval_path)
                file_held, eval_skipped = load_code_problems(
                    eval_path, name=held_name, split=eval_split, key="env.eval_split", held=True, **keys
                )
                self.skipped += [(str(eval_path), n, why) for n, why in eval_skipped]
            # env=file's rule: a training row that is a held-out row's problem but for whitespace in the prompt is
            # left out and counted (an exact-prompt check trained on "Q?\n" while evaluating "Q?").
            train, held = self.split_held_out(
                problems,
                file_held,
                eval_fraction=eval_fraction,
                eval_size=eval_size,
                path=path,
                eval_path=eval_path,
            )
        self._train, self._eval = train, held[:eval_size]
        if not self._train or not self._eval:
            raise ValueError(
                f"{name}: {len(self._train)} training and {len(self._eval)} held-out problems; both must be "
                "non-empty (change eval_fraction, variants or the data)"
            )

    def reference_solution(self, problem: Problem) -> str | None:
        """A correct program for a built-in problem (None for problems from files)."""
        return self._solutions.get(problem.id)

    @classmethod
    def conformance_task(cls, seed: int, workdir: Path) -> CodeTask:
        """The built-in problems judged in the sandbox, for roll_core.testing.tasks' suite; raises CannotRunHere
        where no sandbox works (the suite skips). The instances share one reward (its sandbox is probed once)."""
        from roll_core.testing import CannotRunHere
        from roll_envs.sandbox import SandboxUnavailableError

        try:
            reward = _conformance_reward()
        except SandboxUnavailableError as exc:
            raise CannotRunHere(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}") from exc
        return cls(reward, seed=seed)

    def conformance_response(self, problem: Problem) -> str:
        """The reference program of a built-in problem in a ```python block, for roll_core.testing.tasks' suite."""
        return f"Here is my program.\n```python\n{self.reference_solution(problem) or ''}```\nIt reads stdin."

    def _builtin(self, rng: random.Random, variants: int, num_tests: int) -> list[Problem]:
        problems = []
        for template in TEMPLATES:
            keys: set[str] = set()
            for _ in range(20 * variants):  # templates with few parameter values yield fewer distinct variants
                if len(keys) == variants:
                    break
                params = template.params(rng)
                key = f"{template.name}:{param_key(params)}"
                if key in keys:
                    continue
                keys.add(key)
                inputs = [template.make_input(rng, params) for _ in range(num_tests)]
                tests = [CodeTest(i, template.solve(params, i)) for i in inputs]
                problem = Problem(
                    id=f"{self.name}:{key}",
                    prompt=self._prompt(template.statement(params), tests[0]),
                    answer=encode_tests(tests),
                    domain="code",
                )
                problems.append(problem)
                self._solutions[problem.id] = reference_program(template, params)
        return problems

    def _prompt(self, statement: str, example: CodeTest) -> str:
        return (
            f"{statement}\n\nExample input:\n```\n{example.input.rstrip()}\n```\nExample output:\n```\n"
            f"{example.output.rstrip()}\n```\n\n{self.instruction}"
        ).rstrip()


@functools.cache
def _conformance_reward() -> Reward:
    from roll_envs.rewards.code import CodeReward

    return CodeReward(parallelism=4)
