"""Agentic environments: every built-in passes the Env conformance suite (roll_core.testing.envs), levels are
solvable, dynamics and hints are right, tools are safe and correct, and tool use is budgeted."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from roll_core.testing.envs import EnvTestSuite
from roll_envs.agentic import (
    Calculator,
    FrozenLakeEnv,
    GuessNumberEnv,
    Level,
    PythonExpression,
    QAEnv,
    Retrieval,
    SokobanEnv,
    Tool,
    ToolMathEnv,
    ToolUseEnv,
    extract_action,
    generate_level,
    get_tool,
    make_env,
    solve,
)
from roll_envs.agentic.frozen_lake import generate_map, shortest_path
from roll_envs.agentic.sokoban import _push

# Replies in the formats the parser accepts, so the suites exercise all of them.
_FORMATS = ["\\boxed{{{m}}}", "I will move {m}.\n{m}", "\\boxed{{\\text{{{M}}}}}", "Let me push.\n**{L}**"]


def _say(moves: list[str]) -> list[str]:
    return [_FORMATS[i % 4].format(m=m, M=m.upper(), L=m[0].upper()) for i, m in enumerate(moves)]


# ---- conformance suites -----------------------------------------------------------------------------------------
class TestSokoban(EnvTestSuite):
    @classmethod
    def build_env(cls) -> SokobanEnv:
        return SokobanEnv()

    @classmethod
    def solving_actions(cls, env: Any, seed: int) -> list[str]:
        return _say(solve(env.current_level()))

    @classmethod
    def illegal_actions(cls, env: Any, seed: int) -> list[str]:
        blocked = [
            m for m in ("up", "down", "left", "right") if _push(env.level.walls, env.boxes, env.player, m) is None
        ]
        assert blocked, "a generated level always has a wall next to the player somewhere"
        return [f"\\boxed{{{m}}}" for m in blocked]


class TestSokobanTwoBoxes(TestSokoban):
    @classmethod
    def build_env(cls) -> SokobanEnv:
        return SokobanEnv(width=7, height=7, num_boxes=2, max_steps=30, step_penalty=-0.01, shaping=0.1)


class TestFrozenLake(EnvTestSuite):
    @classmethod
    def build_env(cls) -> FrozenLakeEnv:
        return FrozenLakeEnv()

    @classmethod
    def solving_actions(cls, env: Any, seed: int) -> list[str]:
        return _say(shortest_path(env.size, env.holes))

    @classmethod
    def illegal_actions(cls, env: Any, seed: int) -> list[str]:
        return ["\\boxed{up}", "left"]  # off the board from the top-left start


class TestFrozenLakeSlippery(TestFrozenLake):
    expert_always_wins = False  # a slip can drop the player into a hole

    @classmethod
    def build_env(cls) -> FrozenLakeEnv:
        return FrozenLakeEnv(size=5, slipperiness=0.3, max_steps=30)

    @classmethod
    def solving_actions(cls, env: Any, seed: int) -> list[str] | None:
        return None  # slips make any fixed sequence a gamble


class TestGuessNumber(EnvTestSuite):
    probe_actions = ("\\boxed{10}", "\\boxed{5}", "\\boxed{15}", "\\boxed{3}", "\\boxed{8}")
    min_distinct = 5

    @classmethod
    def build_env(cls) -> GuessNumberEnv:
        return GuessNumberEnv()

    @classmethod
    def solving_actions(cls, env: Any, seed: int) -> list[str]:
        lo, hi, guesses = env.low, env.high, []
        while True:  # binary search, playing the hints the environment will give
            mid = (lo + hi) // 2
            guesses.append(f"\\boxed{{{mid}}}")
            if mid == env.target:
                return guesses
            lo, hi = (mid + 1, hi) if env.target > mid else (lo, mid - 1)

    @classmethod
    def illegal_actions(cls, env: Any, seed: int) -> list[str]:
        return ["\\boxed{0}", "\\boxed{21}", "-5", "\\boxed{ten}"]


class TestToolMath(EnvTestSuite):
    @classmethod
    def build_env(cls) -> ToolMathEnv:
        return ToolMathEnv()

    @classmethod
    def solving_actions(cls, env: Any, seed: int) -> list[str]:
        return [f"<tool>calculator: {env.env.expression}</tool>", f"So the answer is \\boxed{{{env.env.answer}}}."]

    @classmethod
    def illegal_actions(cls, env: Any, seed: int) -> list[str]:
        return ["<tool>nosuchtool: 1</tool>", "<tool>calculator 1+1</tool>", "<tool>calculator: 1+1"]

    @classmethod
    def stalling_action(cls, env: Any) -> str:
        return "<tool>calculator: 1+1</tool>"  # the budget runs out, then the wrapper's step limit truncates


class TestToolUseOverSokoban(TestSokoban):
    @classmethod
    def build_env(cls) -> ToolUseEnv:  # type: ignore[override]
        return ToolUseEnv(SokobanEnv(), tools=["calculator", "python"], max_tool_calls=2)

    @classmethod
    def solving_actions(cls, env: Any, seed: int) -> list[str]:
        return ["<tool>python: max(3, 4)</tool>", *super().solving_actions(env.env, seed)]

    @classmethod
    def illegal_actions(cls, env: Any, seed: int) -> list[str]:
        return super().illegal_actions(env.env, seed)

    @classmethod
    def stalling_action(cls, env: Any) -> str:
        return "<tool>calculator: 1</tool>"  # Sokoban's own limit would end a stream of invalid moves first


class TestQAOverArithmeticTask(EnvTestSuite):
    @classmethod
    def build_env(cls) -> QAEnv:
        from roll_envs.rewards.math import MathReward
        from roll_envs.tasks import ArithmeticTask

        return QAEnv.from_task(ArithmeticTask(MathReward(), digits=2, train_size=100, eval_size=10))

    @classmethod
    def solving_actions(cls, env: Any, seed: int) -> list[str]:
        return [f"The answer is \\boxed{{{env.answer}}}."]


# ---- Sokoban ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("width", "height", "boxes", "limit"), [(6, 6, 1, 20), (7, 7, 2, 30), (8, 6, 1, 20)])
def test_sokoban_levels_are_solvable_within_the_limit(width: int, height: int, boxes: int, limit: int) -> None:
    lengths = []
    for seed in range(50):
        level, known = generate_level(random.Random(seed), width, height, boxes, limit)
        shortest = solve(level)
        assert shortest is not None, f"seed {seed}: unsolvable level\n{level.render()}"
        assert 0 < len(shortest) <= len(known) <= limit
        lengths.append(len(shortest))
        assert level.boxes != level.targets and len(level.boxes) == len(level.targets) == boxes
    assert sum(lengths) / len(lengths) >= 3, f"levels are trivial: {lengths}"


def test_sokoban_generation_is_deterministic() -> None:
    for seed in range(10):
        assert generate_level(random.Random(seed)) == generate_level(random.Random(seed))
    assert len({generate_level(random.Random(s))[0] for s in range(20)}) >= 15


def test_sokoban_rules_and_solver() -> None:
    level = Level.from_text("#####\n#P_O#\n#__X#\n#####")
    assert level.render() == "#####\n#P_O#\n#__X#\n#####"
    assert solve(level) is None, "a box in a non-target corner can never move"
    level = Level.from_text("######\n#PO_X#\n######")
    assert solve(level) == ["right", "right"]
    env = SokobanEnv(shaping=0.5, step_penalty=-0.01)
    env.reset(seed=0)
    env.level, env.player, env.boxes = level, level.player, level.boxes
    _, reward, terminated, _, info = env.step("R")
    assert reward == pytest.approx(-0.01) and not terminated and "_PO" in info["state"]
    _, reward, terminated, _, info = env.step("\\boxed{Right}")
    assert terminated and info["success"] and reward == pytest.approx(1 - 0.01 + 0.5)
    with pytest.raises(ValueError, match="unknown character"):
        Level.from_text("#P?#")


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("#####\n#P_O_\n#__X#\n#####", "row 1, column 5"),  # an open right edge
        ("#####\n#P_OX#\n#___\n#####", "row 2, column 4"),  # a row shorter than the others: its end is open
        ("#_###\n#POX#\n#####", "row -1, column 1"),  # a gap in the top wall
    ],
)
def test_a_level_whose_walls_leave_a_way_out_is_refused(text: str, where: str) -> None:
    """The player could walk off the grid of such a level (moves are unbounded): never drawn again, and the solver
    searched an unbounded plane until its state limit. Enclosed levels, generated or written, are accepted."""
    with pytest.raises(ValueError, match=f"do not enclose the player: it can leave the grid at {where}"):
        Level.from_text(text)
    assert Level.from_text("#####\n#POX#\n#####").player == (1, 1)
    for seed in range(20):
        level, _ = generate_level(random.Random(seed), 7, 7, 2)
        assert Level.from_text(level.render()) == level


def test_unseeded_resets_follow_the_constructor_seed() -> None:
    a, b = SokobanEnv(seed=7), SokobanEnv(seed=7)
    assert [a.reset()[0] for _ in range(3)] == [b.reset()[0] for _ in range(3)]


def test_step_before_reset_is_a_programming_error() -> None:
    with pytest.raises(RuntimeError, match="reset"):
        SokobanEnv().step("up")


@pytest.mark.parametrize(
    ("reply", "action"),
    [
        ("thinking...\n\\boxed{up}\nmore text", "up"),
        ("\\boxed{left} then \\boxed{ right }", "right"),
        ("first line\n\n  down  \n\n", "down"),
        ("\\boxed{\\text{Up}}", "Up"),
        ("`L`.", "L"),
        ("\\boxed{", "\\boxed{"),
        ("", None),
        ("\\boxed{}", None),
        ("I move \\boxed{right}. (Answer format: \\boxed{})", "right"),  # the instruction's empty box repeated
        # Unicode and markdown around the action: a closing fence or ** line, zero-width and no-break spaces,
        # ideographic full stops were "no action found" or an unreadable repr.
        ("```\nright\n```", "right"),
        ("My move:\nleft\n**", "left"),
        ("\u200bup\ufeff", "up"),
        ("\u00a0down\u00a0", "down"),
        ("Up\u3002", "Up"),
        ("\\boxed{right}\uff01", "right"),
        ("**Up**.", "Up"),
        ("```\n```", None),
        # A thinking model's reasoning is not the action: the text after the last </think> is read; a <think>
        # block never closed (cut off while reasoning) has no action, whatever its last box or line says.
        ("<think>\n\\boxed{left} hits a hole.\n</think>\n\nup", "up"),  # (the box in the reasoning was read)
        ("<think>\nleft would fall in.\nso\n</think>\nright", "right"),
        ("the template opened <think>\nnot left\n</think>\n\ndown", "down"),
        ("<think>\nI will go \\boxed{left}", None),
        ("<think>\nmaybe\nup", None),
        ("<think>\nup\n</think>\n\n", None),
    ],
)
def test_extract_action(reply: str, action: str | None) -> None:
    assert extract_action(reply) == action


def test_reasoning_is_neither_the_action_nor_a_tool_call() -> None:
    """The box in the reasoning of a reply was taken as the move (FrozenLake stepped left into the reasoning's
    choice), a reply cut off while reasoning moved by the reasoning's last word, and a `<tool>` block weighed in the
    reasoning ran instead of the action after it. Now: the action after </think> moves; an unclosed <think> is an
    invalid action (penalty, nothing moves, counted in info); a tool call in the reasoning is not made."""
    env = FrozenLakeEnv(hole_prob=0.0)
    env.reset(seed=0)
    start = env.player
    obs, reward, _, _, info = env.step("<think>\nI will go \\boxed{down}")
    assert info["invalid_action"] is True and env.player == start and reward == pytest.approx(-0.1)
    assert "never closed" in obs
    _, reward, _, _, info = env.step("<think>\n\\boxed{up} leaves the board\n</think>\n\\boxed{down}")
    assert info["invalid_action"] is False and env.player == (start[0] + 1, start[1]) and reward == 0
    tools = ToolUseEnv(FrozenLakeEnv(hole_prob=0.0), tools=["calculator"], max_tool_calls=2)
    tools.reset(seed=0)
    _, _, _, _, info = tools.step("<think>\n<tool>calculator: 1+1</tool>? no need\n</think>\n\\boxed{down}")
    assert info["tool_calls"] == 0 and info["invalid_action"] is False and tools.env.player == (1, 0)
    obs, _, _, _, info = tools.step("<think>\nskip it\n</think>\n<tool>calculator: 2+3</tool>")
    assert info["tool_calls"] == 1 and "5" in obs


def test_unicode_direction_replies_move() -> None:
    """Fullwidth letters (NFKC), zero-width characters and CJK punctuation around a direction are that direction."""
    for reply in ["\\boxed{\uff44\uff4f\uff57\uff4e}", "\u200bdown", "Down\u3002", "```\nD\n```"]:
        env = FrozenLakeEnv(hole_prob=0.0)
        env.reset(seed=0)
        _, reward, _, _, info = env.step(reply)
        assert info["invalid_action"] is False and env.player == (1, 0) and reward == 0, repr(reply)


# ---- FrozenLake -------------------------------------------------------------------------------------------------
def test_frozen_lake_maps_have_a_path() -> None:
    for seed in range(50):
        for size, prob in [(4, 0.2), (6, 0.35)]:
            holes = generate_map(random.Random(seed), size, prob, max_moves=20)
            path = shortest_path(size, holes)
            assert path is not None and len(path) <= 20
            assert (0, 0) not in holes and (size - 1, size - 1) not in holes


def test_frozen_lake_hole_ends_the_episode() -> None:
    env = FrozenLakeEnv()
    for seed in range(50):
        env.reset(seed=seed)
        first = next((m for m, p in [("right", (0, 1)), ("down", (1, 0))] if p in env.holes), None)
        if first:
            obs, reward, terminated, _, info = env.step(first)
            assert terminated and reward == 0 and info["success"] is False and "hole" in obs
            return
    pytest.fail("no map with a hole next to the start in 50 seeds")


def test_frozen_lake_slipperiness_moves_sideways() -> None:
    sideways = trials = 0
    for seed in range(300):
        env = FrozenLakeEnv(slipperiness=0.3, hole_prob=0.0)
        env.reset(seed=seed)
        _, _, _, _, info = env.step("down")
        trials += 1
        sideways += env.player != (1, 0)
        assert info["slipped"] == (env.player != (1, 0))
    assert 0.15 < sideways / trials < 0.45, sideways / trials
    still = FrozenLakeEnv(hole_prob=0.0)
    for seed in range(50):
        still.reset(seed=seed)
        assert still.step("down")[4]["slipped"] is False and still.player == (1, 0)
    # The map of a seed does not depend on the slipperiness.
    assert FrozenLakeEnv(slipperiness=0.5).reset(seed=3)[0] == FrozenLakeEnv().reset(seed=3)[0]


# ---- Guess the number -------------------------------------------------------------------------------------------
def test_guess_number_hints_are_right() -> None:
    env = GuessNumberEnv(low=1, high=20, max_turns=6)
    for seed in range(30):
        env.reset(seed=seed)
        guess = random.Random(seed).randint(1, 20)
        obs, reward, terminated, _, _ = env.step(f"\\boxed{{{guess}}}")
        if guess == env.target:
            assert terminated and reward == 1
        elif env.target > guess:
            assert "higher" in obs and not terminated and reward == 0
        else:
            assert "lower" in obs and not terminated and reward == 0
    with pytest.raises(ValueError, match="binary search needs 5"):
        GuessNumberEnv(low=1, high=20, max_turns=4)


def test_guess_number_reveals_the_number_at_the_limit() -> None:
    env = GuessNumberEnv(max_turns=5)
    env.reset(seed=0)
    wrong = 1 if env.target != 1 else 2
    for _ in range(5):
        obs, _, terminated, truncated, _ = env.step(str(wrong))
    assert truncated and not terminated and f"The number was {env.target}" in obs


def test_guess_number_reads_commas_only_as_thousands_separators() -> None:
    """`1,5` (a decimal comma, or two guesses) was read as the guess 15: a silently wrong, valid action."""
    env = GuessNumberEnv(low=1, high=2000, max_turns=12)
    _, info0 = env.reset(seed=0)
    for reply in ["\\boxed{1,5}", "1,2", "\\boxed{1,00}", "12,34"]:
        _, reward, _, _, info = env.step(reply)
        assert info["invalid_action"] is True and reward == pytest.approx(-0.1), reply
        assert info["state"] == info0["state"] and env.guesses == [], reply
    _, _, _, _, info = env.step("\\boxed{1,000}")
    assert info["invalid_action"] is False and env.guesses == [1000]


def test_a_raising_reward_fails_the_qa_step_instead_of_scoring_it_wrong() -> None:
    """The exception reaches roll's env manager, which counts the episode as an env_error."""
    from roll_envs.rewards.base import Reward

    class Broken(Reward):
        def score(self, responses, answers, **kw):  # type: ignore[no-untyped-def]
            raise RuntimeError("reward bug")

    env = QAEnv([("What is 2 + 2?", "4")], reward=Broken())
    env.reset(seed=0)
    with pytest.raises(RuntimeError, match="reward bug"):
        env.step("\\boxed{4}")


def test_qa_answers_compare_numbers_exactly() -> None:
    """QAEnv's numbers: separators ignored, integers beyond 2^53 never rounded to each other."""
    from roll_envs.agentic.tool_env import _same_answer

    assert _same_answer("1,000", "1000") and _same_answer("12.50", "12.5")
    assert _same_answer("-12,345.5", "-12345.50")
    assert not _same_answer("469401340152858662", "469401340152858661")
    # A comma between anything but groups of three digits is no separator: a decimal comma or a typo was equal to
    # the digits run together (1,5 = 15, 1,00 = 100).
    assert not _same_answer("1,5", "15") and not _same_answer("1,00", "100") and not _same_answer("15", "1,5")
    assert _same_answer("1,5", "1,5")  # still equal to itself (as text)


@pytest.mark.parametrize("answer", ["U.S.A.", '"Hello"', "Stop!", "**Paris**", "\\text{Paris}."])
def test_qa_reference_answers_are_trimmed_like_the_reply(answer: str) -> None:
    """The reply's action is trimmed (quotes, markdown, trailing `.`/`!`) but the reference was not: the verbatim
    reference answer, boxed, scored 0 ("Wrong: the answer was U.S.A.")."""
    env = QAEnv([("Question?", answer)])
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step(f"\\boxed{{{answer}}}")
    assert terminated and reward == 1.0 and info["success"], answer
    env.reset(seed=0)
    assert env.step("\\boxed{Lyon}")[1] == 0.0


# ---- tools ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("expr", "value"),
    [("12*(3+4)", "84"), ("7/2", "3.5"), ("-3 // 2", "-2"), ("2**10", "1024"), ("2^3", "8"), ("10 % 4", "2"),
     ("-(5 - 8)", "3"), ("1.5 * 4", "6"), ("(((2)))", "2"), ("123456789 * 987654321", "121932631112635269")],
)  # fmt: skip
def test_calculator_is_correct(expr: str, value: str) -> None:
    assert Calculator()(expr) == value


@pytest.mark.parametrize(
    ("expr", "why"),
    [
        ("__import__('os')", "function calls are not allowed"),
        ("2**10**10", "exponent too large"),
        ("9**99 ** 2", "exponent too large"),
        ("(10**90)**90", "result too large"),
        ("x + 1", "names are not allowed"),
        ("(1).real", "attribute access is not allowed"),
        ("[1, 2][0]", "subscripts are not allowed"),
        ("lambda: 1", "lambdas are not allowed"),
        ("'a' * 3", "only numbers"),
        ("1/0", "division by zero"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 600, "too long"),
        ("", "empty expression"),
    ],
)
def test_calculator_refuses_with_error_text(expr: str, why: str) -> None:
    out = Calculator()(expr)
    assert out.startswith("error:") and why in out, out


def test_python_tool_is_a_restricted_evaluator() -> None:
    py = get_tool("python")
    assert isinstance(py, PythonExpression) and isinstance(py, Tool)
    assert py("sum([1, 2, 3]) * 2") == "12" and py("max(3, 9, 4)") == "9" and py("round(3.14159, 2)") == "3.14"
    assert py("abs(-4) + min([5, 2])") == "6"
    for code in ["__import__('os').system('true')", "open('/etc/passwd')", "[1] * 10**9", "print(1)", "sum([1])[0]"]:
        assert py(code).startswith("error:"), code


def test_retrieval_finds_the_relevant_document(tmp_path: Path) -> None:
    docs = [
        "Paris is the capital and largest city of France.",
        "The mitochondrion is the powerhouse of the cell.",
        "Mount Everest is Earth's highest mountain above sea level.",
        "Python is a programming language; its reference implementation is CPython.",
    ]
    tool = Retrieval(docs, k=2)
    assert tool("what is the capital of France?").startswith("[1] Paris is the capital")
    assert "Everest" in tool("highest mountain").splitlines()[0]
    assert tool("zzzz qqqq") == "no results" and tool("  ?! ").startswith("error:")
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert "mitochondrion" in get_tool("retrieval", path=str(path), k=1)("powerhouse cell")
    with pytest.raises(ValueError, match="unknown tool 'shell'; available: calculator, code, python, retrieval"):
        get_tool("shell")


# ---- tool use ---------------------------------------------------------------------------------------------------
def test_tool_budget_is_enforced() -> None:
    def boom(arg: str) -> str:
        raise RuntimeError("bug")

    boom.name, boom.description = "boom", "always fails"  # type: ignore[attr-defined]
    env = ToolUseEnv(GuessNumberEnv(), tools=["calculator", boom], max_tool_calls=2, max_output_chars=50)
    env.reset(seed=0)
    obs, reward, _, _, info = env.step("<tool>calculator: 10**40</tool>")
    assert "1" + "0" * 40 in obs and "[truncated" not in obs and info["tool_calls"] == 1 and reward == 0
    obs, _, _, _, info = env.step("Let me check. <tool>boom: x</tool>")
    assert "error: the tool failed (RuntimeError)" in obs and info["tool_calls"] == 1
    assert info["tool_calls_total"] == 2
    obs, reward, terminated, truncated, info = env.step("<tool>calculator: 1+1</tool>")
    assert "budget exhausted" in obs and info["invalid_action"] and info["tool_calls"] == 0 and reward == -0.1
    assert not terminated and not truncated
    _, _, _, _, info = env.step(f"\\boxed{{{env.env.target}}}")
    assert info["success"] and info["tool_calls"] == 0 and info["tool_calls_total"] == 2
    long = ToolUseEnv(GuessNumberEnv(), tools=["python"], max_output_chars=10)
    long.reset(seed=0)
    assert "2951266543... [truncated: 85 more characters]" in long.step("<tool>python: 9**99</tool>")[0]


def test_tools_around_a_visual_environment_are_refused_not_shown_as_a_dict_repr() -> None:
    """str() of a picture observation showed the model "{'text': ..., 'images': [<PIL.Image ...>]}" and lost the
    picture: a silent wrong observation. It is a ValueError (the env manager fails that episode, counted); a dict
    observation without pictures is its text."""
    pytest.importorskip("PIL")
    from roll_envs.agentic.visual import VisualFrozenLakeEnv

    with pytest.raises(ValueError, match=r"ToolUseEnv wraps text environments: VisualFrozenLakeEnv .* 1 picture"):
        ToolUseEnv(VisualFrozenLakeEnv()).reset(seed=0)
    env = ToolUseEnv(VisualFrozenLakeEnv())
    env.env.reset = lambda seed=None: ({"text": "plain", "images": []}, {})  # type: ignore[method-assign]
    assert env.reset(seed=0)[0] == "plain"


def test_tool_use_step_before_reset_is_refused_without_running_the_tool() -> None:
    """A tool call before reset ran the model's argument (the code tool: a sandbox run) against no episode."""
    calls: list[str] = []

    def record(arg: str) -> str:
        calls.append(arg)
        return "ran"

    record.name, record.description = "record", "records its argument"  # type: ignore[attr-defined]
    env = ToolUseEnv(GuessNumberEnv(), tools=[record])
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("<tool>record: 1+1</tool>")
    assert calls == []
    env.reset(seed=0)
    assert "ran" in env.step("<tool>record: 1+1</tool>")[0] and calls == ["1+1"]


def test_a_malformed_first_tool_block_is_invalid_even_with_a_later_good_one() -> None:
    """The first `<tool>` block is the call (module docstring): a search for the first well-formed block ran the
    later `calculator: 2+2` after a malformed `<tool>oops</tool>`, uncounted as invalid."""
    env = ToolMathEnv(invalid_penalty=-0.5)
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step("<tool>oops</tool> then <tool>calculator: 2+2</tool>")
    assert obs.startswith("Invalid tool call: write exactly") and "<tool_output>" not in obs
    assert reward == -0.5 and not terminated and info["invalid_action"]
    assert info["tool_calls"] == 0 and info["tool_calls_total"] == 0
    obs, _, _, _, info = env.step("<tool>calculator: 2+2</tool> and <tool>oops</tool>")
    assert "<tool_output>\n4\n" in obs and not info["invalid_action"] and info["tool_calls_total"] == 1


def test_wrappers_close_the_environment_they_wrap() -> None:
    """roll's env manager closes the instance it holds: ToolUseEnv and the Gymnasium/GEM adapters had no close(),
    so the wrapped environment's close() was never called."""
    from roll_envs.agentic import GymTextEnv

    class Recording(GuessNumberEnv):
        closed = 0

        def close(self) -> None:
            self.closed += 1

    tools = ToolUseEnv(Recording())
    tools.close()
    gym = GymTextEnv(Recording())
    gym.close()
    assert tools.env.closed == 1 and gym.env.closed == 1
    ToolUseEnv(GuessNumberEnv()).close()  # a wrapped environment without close(): nothing to do


def test_tool_math_is_solved_with_the_calculator() -> None:
    env = ToolMathEnv()
    for seed in range(20):
        obs, _ = env.reset(seed=seed)
        expression = obs.removeprefix("What is ").split("?")[0]
        obs, reward, terminated, _, info = env.step(f"I'll compute it. <tool>calculator: {expression}</tool>")
        assert not terminated and reward == 0 and info["tool_calls"] == 1
        result = obs.split("<tool_output>\n")[1].split("\n")[0]
        _, reward, terminated, _, info = env.step(f"\\boxed{{{result}}}")
        assert terminated and reward == 1 and info["success"] and info["tool_calls_total"] == 1
        env.reset(seed=seed)
        _, reward, terminated, _, info = env.step(f"\\boxed{{{int(result) + 1}}}")
        assert terminated and reward == 0 and info["success"] is False


# ---- registry and adapters --------------------------------------------------------------------------------------
def test_make_env() -> None:
    assert isinstance(make_env("sokoban", width=7), SokobanEnv)
    assert isinstance(make_env("tool_math", max_tool_calls=1), ToolMathEnv)
    # Names are the installed roll.agentic_envs entry points (roll-envs' own included), sorted, then the prefixes.
    with pytest.raises(ValueError, match=r"unknown environment 'chess'; available: .*frozen_lake, .*sokoban, .*gem:"):
        make_env("chess")
    with pytest.raises(ValueError, match="Did you mean 'sokoban'"):
        make_env("sokobn")
    with pytest.raises(ValueError, match="gem:<id>"):
        make_env("gem:")
