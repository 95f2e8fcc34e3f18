"""QAEnv with a reward whose `extract_answer` reads the row's `choices` (the visual reward): whether a reply has an
answer is read with the problem's choices, as the reward's `score` grades it with the row's metadata.

QAEnv called `extract_answer(reply)` without them: the visual reward's reading without choices is the reply's last
word, so a reply naming no choice ("I cannot tell") had an answer ("tell"), ended the episode and scored 0, where
the reward itself finds no answer in it (formatted 0): it is an invalid action and the episode goes on.
"""

from __future__ import annotations

from roll_envs.agentic import QAEnv
from roll_envs.tasks.base import Problem
from roll_envs.tasks.visual import VisualReward

CHOICES = ["red", "green", "blue"]


def _env() -> QAEnv:
    problem = Problem(
        id="visual:colour:1",
        prompt="Picture 1: Which colour covers most of the picture? Answer with one of: red, green, blue.",
        answer="red",
        domain="colour",
        metadata={"choices": CHOICES},
    )
    return QAEnv([problem], reward=VisualReward(), invalid_penalty=-0.5, max_steps=3)


def test_a_reply_naming_no_choice_has_no_answer_and_the_episode_goes_on() -> None:
    reward = VisualReward()
    # What the reward reads: with the row's choices "I cannot tell" names none (no answer, not formatted).
    graded = reward.score(["I cannot tell", "red, surely"], ["red", "red"], metadata=[{"choices": CHOICES}] * 2)
    assert graded.formatted == [0.0, 1.0] and graded.correct == [0.0, 1.0]
    assert reward.extract_answer("I cannot tell") == "tell"  # the reading without choices QAEnv used

    env = _env()
    env.reset(seed=0)
    _, r, terminated, truncated, info = env.step("I cannot tell")
    assert info["invalid_action"] is True and not terminated and not truncated
    assert r == -0.5 and not info["success"]
    # the next reply names a choice (the last named one is the answer): graded right, the episode ends
    _, r, terminated, _, info = env.step("Not green: red, surely")
    assert info["invalid_action"] is False and terminated
    assert r == 1.0 and info["success"]


def test_a_reply_naming_a_wrong_choice_is_an_answer_graded_wrong() -> None:
    env = _env()
    env.reset(seed=0)
    _, r, terminated, _, info = env.step("It is blue.")
    assert info["invalid_action"] is False and terminated and r == 0.0 and not info["success"]
