"""QAEnv with a task reward: the reward alone decides what is an answer and whether it is correct, so the episode's
reward is the task reward's verdict on the same reply and the instructions describe what the reward reads; without a
reward the environment's own reading applies (the Env conformance suite runs in test_agentic_envs.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from roll_envs.agentic import QAEnv, ToolUseEnv
from roll_envs.rewards.base import Reward, RewardResult
from roll_envs.rewards.math import MathReward
from roll_envs.tasks import ArithmeticTask
from roll_envs.tasks.base import Problem


@pytest.fixture(scope="module")
def math_reward() -> MathReward:
    return MathReward()


def _step(env: QAEnv, reply: str) -> tuple[float, bool, bool, dict[str, Any]]:
    env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step(reply)
    return reward, terminated, truncated, info


@pytest.mark.parametrize(
    ("answer", "reply", "graded"),
    [
        # The env read the unboxed last line as the answer (its instructions said so) and passed it; MathReward
        # reads no answer in it and scored it 0.
        ("167", "100 + 67 = 167\n167", None),
        ("167", "The answer is 167.", None),
        # MathReward accepts these; the env's numeric rule marked them invalid.
        ("1000", "It costs \\boxed{1000 dollars}.", 1.0),
        ("0.5", "So \\boxed{\\frac12}", 1.0),
        ("0.5", "So \\boxed{\\frac{1}{2}}", 1.0),
        ("1000", "\\boxed{\\$1,000}", 1.0),
        ("167", "\\boxed{x + 1}", 0.0),  # a boxed non-number is an answer to the reward: wrong, not invalid
        ("167", "\\boxed{168}", 0.0),
        ("167", "\\boxed{167}", 1.0),
        ("167", "\\boxed{\\boxed{}}", None),  # only an empty box: no answer
    ],
)
def test_with_a_math_reward_the_episode_reward_is_the_rewards_verdict(
    math_reward: MathReward, answer: str, reply: str, graded: float | None
) -> None:
    env = QAEnv([("What is it?", answer)], reward=math_reward)
    reward, terminated, truncated, info = _step(env, reply)
    if graded is None:  # no answer the reward reads: invalid, the episode goes on
        assert info["invalid_action"] is True and not terminated and not truncated, reply
        assert reward == 0.0 and not info["success"]
        return
    assert math_reward.score([reply], [answer]).correct == [graded]
    assert info["invalid_action"] is False and terminated, reply
    assert reward == graded and info["success"] is (graded == 1.0)


def test_an_unboxed_reply_is_told_what_the_reward_reads_and_may_answer_again(math_reward: MathReward) -> None:
    env = QAEnv([("What is 100 + 67?", "167")], reward=math_reward, invalid_penalty=-0.5)
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step("100 + 67 = 167\n167")
    assert info["invalid_action"] and reward == -0.5 and not terminated
    assert "\\boxed{}" in obs and "What is 100 + 67?" in obs
    obs, reward, terminated, _, info = env.step("\\boxed{167}")
    assert terminated and reward == 1.0 and info["success"] and obs.startswith("Correct!")


def test_instructions_describe_what_the_reward_reads(math_reward: MathReward) -> None:
    with_reward = QAEnv([("What is 2 + 2?", "4")], reward=math_reward).instructions()
    assert "Only the last non-empty \\boxed{}" in with_reward and "without one has no answer" in with_reward
    assert "last non-empty line" not in with_reward  # what the env's own reading promises, which MathReward ignores
    own = QAEnv([("What is 2 + 2?", "4")]).instructions()
    assert "the last non-empty line of your reply is read as the action" in own
    custom = QAEnv.from_task(
        ArithmeticTask(math_reward, train_size=10, eval_size=5), answer_format="a number in \\boxed{}"
    )
    assert "Answer format: a number in \\boxed{}." in custom.instructions()


def test_without_a_reward_the_envs_own_check_applies() -> None:
    env = QAEnv([("What is 100 + 67?", "167")])
    reward, terminated, _, info = _step(env, "100 + 67 = 167\n167")
    assert terminated and reward == 1.0 and info["success"]
    reward, terminated, _, info = _step(env, "\\boxed{x + 1}")
    assert info["invalid_action"] and not terminated  # a numeric answer needs a number


class Recording(Reward):
    """Correct when the reply contains the answer; records what it was given."""

    def __init__(self, failed: bool = False) -> None:
        self.calls: list[dict[str, Any]] = []
        self.failed = failed

    def score(
        self,
        responses: Sequence[str],
        answers: Sequence[str],
        prompts: Sequence[str] | None = None,
        metadata: Sequence[dict[str, Any]] | None = None,
    ) -> RewardResult:
        self.calls.append({"responses": list(responses), "prompts": prompts, "metadata": metadata})
        correct = [float(a in r) for r, a in zip(responses, answers)]
        return RewardResult(
            scores=correct, correct=correct, formatted=[1.0] * len(correct), failed=[self.failed] * len(correct)
        )


def test_a_reward_without_extract_answer_grades_the_whole_reply_with_its_context() -> None:
    reward = Recording()
    problem = Problem(id="p1", prompt="Write the word.", answer="banana", domain="words", metadata={"k": 1})
    env = QAEnv([problem], reward=reward)
    # The env's own reading refused a last line over 200 characters ("too long") before the reward saw it.
    reply = "Here it is:\n" + "banana " * 40
    r, terminated, _, info = _step(env, reply)
    assert terminated and r == 1.0 and info["success"] and not info["invalid_action"]
    assert reward.calls == [
        {"responses": [reply], "prompts": ["Write the word."], "metadata": [{"k": 1, "domain": "words"}]}
    ]
    assert "Your whole reply is read and graded" in env.instructions()
    for blank in ("", "  \n\t", "\u200b", "**"):
        r, terminated, _, info = _step(env, blank)
        assert info["invalid_action"] and not terminated, repr(blank)
    assert len(reward.calls) == 1  # a blank reply is never scored


def test_a_reply_the_reward_failed_to_score_fails_the_step() -> None:
    """A `failed` row's score is a fallback (sandbox or judge failure), not a verdict: it was trained on as wrong."""
    env = QAEnv([("What is 2 + 2?", "4")], reward=Recording(failed=True))
    env.reset(seed=0)
    with pytest.raises(RuntimeError, match="could not score the reply"):
        env.step("4")


def test_tools_around_a_task_qa_env_answer_through_the_reward(math_reward: MathReward) -> None:
    env = ToolUseEnv(QAEnv([("What is 12*(3+4)?", "84")], reward=math_reward), tools=["calculator"])
    env.reset(seed=0)
    obs, _, terminated, _, _ = env.step("<tool>calculator: 12*(3+4)</tool>")
    assert "84" in obs and not terminated
    _, reward, terminated, _, info = env.step("84")
    assert info["invalid_action"] and not terminated
    _, reward, terminated, _, info = env.step("The tool says \\boxed{84}.")
    assert terminated and reward == 1.0 and info["success"]
