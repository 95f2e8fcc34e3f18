"""The reward conformance suite (roll_core.testing.rewards) over roll-envs' rewards: `math`, `countdown` and `code`
(the sandboxed one skips with the reason where no bubblewrap sandbox works; two cases, one test each, to keep it
to a few sandbox runs). A test keeps the list honest: every in-tree `roll.rewards` entry point has a subclass."""

from __future__ import annotations

from roll_core import registry
from roll_core.testing import CannotRunHere
from roll_core.testing.rewards import Case, RewardTestSuite
from roll_envs.rewards.code import CodeReward, CodeTest, encode_tests
from roll_envs.rewards.ifeval import InstructionReward
from roll_envs.rewards.judge import JudgeReward
from roll_envs.rewards.math import MathReward
from roll_envs.rewards.remote import RemoteReward
from roll_envs.tasks.countdown import CountdownReward

# ifeval's suite is TestInstructionReward in test_ifeval.py; remote's runs through the HTTP protocol in
# test_remote_reward.py; judge's is TestJudgeReward in test_judge.py (a referee judge server on 127.0.0.1).
IN_TREE = {
    "math": MathReward,
    "countdown": CountdownReward,
    "code": CodeReward,
    "ifeval": InstructionReward,
    "remote": RemoteReward,
    "judge": JudgeReward,
}


class TestMathReward(RewardTestSuite):
    reward_class = MathReward
    cases = (
        Case("So the sum is \\boxed{12}.", "12", correct=True),
        Case("\\boxed{\\frac{24}{2}}", "12", correct=True),
        Case("\\boxed{\\frac{1}{2}}", "0.5", correct=True),
        Case("\\boxed{13}", "12", correct=False),
        Case("3 + 9 = 12", "12", correct=False),
    )


class TestMathRewardWithPartialCredit(TestMathReward):
    """Weights change scores, never the contract (an unboxed right number earns credit but is not correct)."""

    @classmethod
    def build_reward(cls) -> MathReward:
        return MathReward(last_number_weight=0.5, format_weight=0.1)


class TestCountdownReward(RewardTestSuite):
    reward_class = CountdownReward
    cases = (
        Case("\\boxed{(1 + 2) * 3}", "9|1,2,3", correct=True),
        Case("\\boxed{3 * (2 + 1)}", "9|3,2,1", correct=True),
        Case("\\boxed{9}", "9|1,2,3", correct=False),  # the numbers were not used
        Case("\\boxed{1 + 2 + 3}", "9|1,2,3", correct=False),
    )


class TestCodeReward(RewardTestSuite):
    cases = (
        Case("```python\nprint(int(input()) * 2)\n```", encode_tests([CodeTest("21\n", "42\n")]), correct=True),
        Case("```python\nprint(int(input()) + 2)\n```", encode_tests([CodeTest("21\n", "42\n")]), correct=False),
    )

    @classmethod
    def build_reward(cls) -> CodeReward:
        from roll_envs.sandbox import SandboxUnavailableError

        try:
            return CodeReward(parallelism=2)
        except SandboxUnavailableError as exc:
            raise CannotRunHere(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}") from exc


def test_every_in_tree_reward_has_a_suite() -> None:
    """The subclasses above cover each in-tree `roll.rewards` entry point (a new reward needs its own)."""
    installed = set(registry.available("roll.rewards"))
    assert set(IN_TREE) <= installed
    for name, cls in IN_TREE.items():
        assert registry.load("roll.rewards", name) is cls, name


def test_countdown_grades_only_the_answer_after_the_reasoning() -> None:
    """A box inside unfinished or finished reasoning is no answer; the one after `</think>` is (as the math and code
    rewards read thinking models): a response cut off mid-reasoning scored 1 on the equation in its thinking."""
    reward = CountdownReward()
    responses = [
        "<think>try \\boxed{3+4} hmm",  # cut off while reasoning
        "<think>\\boxed{3+4}</think> I give up",  # the only box is in the reasoning
        "<think>\\boxed{3*4}</think> so \\boxed{3+4}",  # the final answer after it
        "\\boxed{3+4}",  # no tags: as before
    ]
    res = reward.score(responses, ["7|3,4"] * 4)
    assert res.scores == [0.0, 0.0, 1.0, 1.0]
    assert res.counters["no_boxed"] == 2
