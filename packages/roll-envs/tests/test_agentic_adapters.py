"""Third-party environments behind roll's Env contract (Gymnasium, GEM, SkyRL-Gym adapters): each passes the Env
conformance suite (roll_core.testing.envs), refuses steps after the end and before reset, and keeps the caller's RNG."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from roll_core.testing.envs import MALFORMED, EnvTestSuite
from roll_envs.agentic import (
    GymTextEnv,
    make_env,
)
from roll_envs.agentic.gem_adapter import _PrivateGlobalRNG


def test_gem_needs_its_package() -> None:
    try:
        import gem  # noqa: F401

        pytest.skip("gem is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="pip install --no-deps gem-llm"):
        make_env("gem:game:GuessTheNumber-v0-easy")


class _Corridor:
    """A Gymnasium-API environment: walk right from 0 to 3 (actions 0 = left, 1 = right)."""

    def reset(self, seed: int | None = None) -> tuple[int, dict[str, Any]]:
        self.pos = 0
        return self.pos, {}

    def step(self, action: int) -> tuple[int, float, bool, bool, dict[str, Any]]:
        self.pos = max(0, self.pos + (1 if action == 1 else -1))
        return self.pos, float(self.pos == 3), self.pos == 3, False, {}


class TestGymTextEnv(EnvTestSuite):
    min_distinct = 1  # one fixed corridor

    @classmethod
    def build_env(cls) -> GymTextEnv:
        return GymTextEnv(_Corridor(), action_parser={"left": 0, "right": 1}.get)

    @classmethod
    def solving_actions(cls, env: Any, seed: int) -> list[str]:
        return ["right"] * 3


class _TimedCorridor(_Corridor):
    """The corridor under a Gymnasium-style time limit of 6 of its own steps (`spec.max_episode_steps`), which
    stays at the goal, paying it again, when stepped right past the end (as Gymnasium's FrozenLake does)."""

    spec = type("Spec", (), {"max_episode_steps": 6})()

    def reset(self, seed: int | None = None) -> tuple[int, dict[str, Any]]:
        self.elapsed = 0
        return super().reset(seed)

    def step(self, action: int) -> tuple[int, float, bool, bool, dict[str, Any]]:
        self.elapsed += 1
        self.pos = min(3, max(0, self.pos + (1 if action == 1 else -1)))
        return self.pos, float(self.pos == 3), self.pos == 3, self.elapsed >= 6 and self.pos != 3, {}


class TestGymTextEnvWithTimeLimit(TestGymTextEnv):
    """Invalid replies never reach the wrapped time limit: they were never truncated (the suite's step-limit check)."""

    @classmethod
    def build_env(cls) -> GymTextEnv:
        return GymTextEnv(_TimedCorridor(), action_parser={"left": 0, "right": 1}.get)


def test_gym_adapter_refuses_steps_after_the_end_and_before_reset() -> None:
    """A finished episode is not stepped again: the wrapped environment paid its goal reward a second time."""
    env = GymTextEnv(_TimedCorridor(), action_parser={"left": 0, "right": 1}.get)
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("right")
    env.reset(seed=0)
    rewards = [env.step("right")[1] for _ in range(3)]
    assert rewards == [0.0, 0.0, 1.0]
    obs, reward, terminated, truncated, info = env.step("right")
    assert reward == 0.0 and terminated and not truncated and info["invalid_action"] and not info["success"]
    assert obs.startswith("The episode is over") and env.env.elapsed == 3
    env.reset(seed=0)  # a new episode steps again
    assert env.step("right")[1] == 0.0 and env.env.elapsed == 1


class _GoalCorridor(_Corridor):
    """A Gymnasium goal environment: reward 0 at the goal and -1 elsewhere, success in info["is_success"]."""

    def step(self, action: int) -> tuple[int, float, bool, bool, dict[str, Any]]:
        pos, _, terminated, truncated, _ = super().step(action)
        return pos, 0.0 if terminated else -1.0, terminated, truncated, {"is_success": float(terminated)}


def test_gymnasiums_is_success_info_key_is_read_as_success() -> None:
    """The reward fallback (`reward >= success_reward`) read every success of a goal environment as a failure."""
    env = GymTextEnv(_GoalCorridor(), action_parser={"left": 0, "right": 1}.get)
    env.reset(seed=0)
    assert [env.step("right")[4]["success"] for _ in range(3)] == [False, False, True]
    env = GymTextEnv(_GoalCorridor(), action_parser={"left": 0, "right": 1}.get)
    env.env.step = lambda a: (3, 0.0, True, False, {"is_success": 1.0, "success": False})  # type: ignore[method-assign]
    env.reset(seed=0)
    assert env.step("right")[4]["success"] is False  # the wrapped "success" comes first


def test_private_global_rng_leaves_the_callers_rng_alone() -> None:
    rng = _PrivateGlobalRNG(seed=0)
    random.seed(123)
    expected = random.Random(123).random()
    with rng.active():
        random.seed(5)  # what a GEM reset does
        inside = random.random()
    assert random.random() == expected
    with rng.active():
        after = random.random()
    assert inside == random.Random(5).random() and after != inside


def test_demonstrations_are_solved_expert_games_outside_the_training_and_held_out_seeds() -> None:
    from roll_envs.agentic.task import DEMO_SEED_TOP, AgenticTask

    task = AgenticTask("guess_number", env_kwargs={"low": 1, "high": 10, "max_turns": 4}, max_turns=4, demonstrations=1)
    msgs = task.examples()
    assert [m["role"] for m in msgs] == ["user", "assistant"] * (len(msgs) // 2) and msgs
    assert msgs[0]["content"].startswith("I am thinking of an integer between 1 and 10")
    # Replaying the demonstration's replies on a fresh instance of its seed wins: it is a real, solved game.
    env = task.make_env()
    seed = DEMO_SEED_TOP
    obs, _ = env.reset(seed=seed)
    assert obs == msgs[0]["content"]
    for i, m in enumerate(msgs[1::2]):
        obs, reward, terminated, _, info = env.step(m["content"])
        assert not info["invalid_action"]
        if i + 1 < len(msgs) // 2:
            assert obs == msgs[2 * i + 2]["content"]
    assert terminated and info["success"] and reward == 1.0
    assert seed >= task.eval_seed_offset + task.eval_size  # never a training or held-out seed
    assert AgenticTask("guess_number").examples() == []
    two = AgenticTask("sokoban", demonstrations=2).examples()
    assert sum(m["content"].startswith("#") for m in two if m["role"] == "user") >= 2  # two games' first boards
    # env.eval_size may change on resume: the demonstrations must not (they were drawn after the held-out seeds)
    assert (
        AgenticTask("frozen_lake", eval_size=32, demonstrations=1).examples()
        == AgenticTask("frozen_lake", eval_size=64, demonstrations=1).examples()
    )


def test_demonstrations_need_an_expert() -> None:
    from roll_envs.agentic.task import AgenticTask

    with pytest.raises(ValueError, match="expert_reply"):
        AgenticTask("py:collections:OrderedDict", demonstrations=1)  # no expert_reply()


class TestGemGuessTheNumber(EnvTestSuite):
    """A real GEM environment by id (installed by the test session: gem-llm without its deps, plus the gem extra)."""

    probe_actions = ("\\boxed{5}", "\\boxed{2}", "\\boxed{8}")
    min_distinct = 4

    @classmethod
    def build_env(cls) -> Any:
        pytest.importorskip("gem", exc_type=ImportError)
        return make_env("gem:game:GuessTheNumber-v0-easy")

    @classmethod
    def solving_actions(cls, env: Any, seed: int) -> list[str]:
        lo, hi, guesses = 1, 10, []
        target = env.env.game_number if hasattr(env.env, "game_number") else None
        if target is None:
            return None  # type: ignore[return-value]
        while True:
            mid = (lo + hi) // 2
            guesses.append(f"\\boxed{{{mid}}}")
            if mid == target:
                return guesses
            lo, hi = (mid + 1, hi) if target > mid else (lo, mid - 1)

    def test_malformed_and_illegal_replies_are_invalid(self) -> None:
        """GEM's own rule differs from roll's built-ins: a reply without a boxed guess ends the episode at -0.1."""
        env = self.build_env()
        for reply in MALFORMED[:4]:
            env.reset(seed=0)
            _, reward, terminated, _, info = self.checked_step(env, reply)
            assert terminated and reward == pytest.approx(-0.1) and not info["success"]

    def test_step_limit_truncates(self) -> None:
        env = self.build_env()
        env.reset(seed=0)
        wrong = [g for g in range(1, 11) if g != env.env.game_number]
        ends = []
        for g in wrong[:4]:
            _, _, terminated, truncated, info = self.checked_step(env, f"\\boxed{{{g}}}")
            assert not info["success"]
            ends.append(terminated or truncated)
        assert ends == [False, False, False, True], f"GEM's 4-turn game ended at {ends}"


SKYRL_ROWS = [
    {
        "prompt": f"What is {a} + {b}? End with #### ANSWER.",
        "extras": {"reward_spec": {"ground_truth": str(a + b)}, "max_turns": 3},
    }
    for a, b in [(2, 3), (10, 7), (4, 4), (12, 30)]
]


class TestSkyRLGsm8kMultiTurn(EnvTestSuite):
    """A real SkyRL-Gym environment (gsm8k_multi_turn: 3 turns here, per-turn rewards) over hand-made rows."""

    min_distinct = 4  # one instance per row

    @classmethod
    def build_env(cls) -> Any:
        pytest.importorskip("skyrl_gym", exc_type=ImportError)
        return make_env("skyrl:gsm8k_multi_turn", rows=SKYRL_ROWS)

    @classmethod
    def solving_actions(cls, env: Any, seed: int) -> list[str]:
        return ["Let me think. #### 0", f"The sum is #### {env.env.ground_truth}"]

    def test_malformed_and_illegal_replies_are_invalid(self) -> None:
        """SkyRL-Gym has no invalid actions: a malformed reply scores 0 and the episode goes on."""
        env = self.build_env()
        for reply in MALFORMED:
            env.reset(seed=0)
            _, reward, terminated, truncated, info = self.checked_step(env, reply)
            assert reward == 0.0 and not terminated and not truncated and not info["success"]


def test_skyrl_rows_from_a_file_and_errors(tmp_path: Path) -> None:
    pytest.importorskip("skyrl_gym", exc_type=ImportError)

    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in SKYRL_ROWS[:2]))
    env = make_env("skyrl:gsm8k_multi_turn", data_file=str(data))
    assert env.reset(seed=3)[0] == SKYRL_ROWS[1]["prompt"]  # seed 3 -> row 3 % 2
    _, reward, terminated, _, info = env.step("#### 17")
    assert reward == 1.0 and terminated and info["success"]
    with pytest.raises(ValueError, match=r"unknown SkyRL-Gym environment 'gsm9k'; registered: .*gsm8k"):
        make_env("skyrl:gsm9k", rows=SKYRL_ROWS)
    with pytest.raises(ValueError, match="exactly one of rows"):
        make_env("skyrl:gsm8k")


def test_skyrl_held_out_seeds_use_held_out_rows_only(tmp_path: Path) -> None:
    """Held-out seeds (>= eval_seed_offset) pick from the held-out rows, training seeds from the others: the two
    never share a row; a held-out seed without held-out rows is an error, not a training row."""
    pytest.importorskip("skyrl_gym", exc_type=ImportError)

    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps(SKYRL_ROWS[3]) + "\n")
    env = make_env("skyrl:gsm8k_multi_turn", rows=SKYRL_ROWS, eval_data_file=str(held), eval_seed_offset=100)
    train_prompts = {env.reset(seed=s)[0] for s in range(20)}
    eval_prompts = {env.reset(seed=100 + s)[0] for s in range(5)}
    assert eval_prompts == {SKYRL_ROWS[3]["prompt"]} and train_prompts == {r["prompt"] for r in SKYRL_ROWS[:3]}
    split = make_env("skyrl:gsm8k_multi_turn", rows=SKYRL_ROWS, eval_fraction=0.5)
    assert not {r["prompt"] for r in split.rows} & {r["prompt"] for r in split.held_out}
    bare = make_env("skyrl:gsm8k_multi_turn", rows=SKYRL_ROWS)
    with pytest.raises(ValueError, match="held-out seed 1000000 but no held-out rows"):
        bare.reset(seed=1_000_000)


def test_environments_that_run_the_models_code_outside_the_sandbox_are_refused(tmp_path: Path) -> None:
    """Model-written code runs only in roll's sandbox: SkyRL-Gym's `lcb` ran a reply's program in a fork of this
    process (it read /etc/passwd and wrote a host file), `searchcode` with `python -c`, and GEM's code environments
    through GEM's own runner. They are refused unless the run says it accepts the risk."""
    pytest.importorskip("skyrl_gym", exc_type=ImportError)
    tests = [{"input": "1\n", "output": "1\n", "testtype": "stdin"}]
    rows = [{"prompt": "Echo the input.", "extras": {"reward_spec": {"ground_truth": json.dumps(tests)}}}]
    for env_id in ("lcb", "searchcode"):
        with pytest.raises(ValueError, match=f"'{env_id}' runs the model's code outside roll's sandbox"):
            make_env(f"skyrl:{env_id}", rows=rows)
    # Accepted when asked for (built only: nothing runs the model's code here).
    make_env("skyrl:lcb", rows=rows, allow_unsandboxed_execution_i_understand_the_risk=True)
    make_env("skyrl:gsm8k_multi_turn", rows=SKYRL_ROWS)  # environments that run no code are unaffected
    pytest.importorskip("gem", exc_type=ImportError)
    with pytest.raises(ValueError, match="'code:CodeContest' runs the model's code outside roll's sandbox"):
        make_env("gem:code:CodeContest")  # refused before GEM loads its dataset


def test_skyrl_environments_are_closed_when_replaced_and_at_close(monkeypatch: pytest.MonkeyPatch) -> None:
    """SkyRLEnv.reset replaced its SkyRL-Gym environment without closing it, and the probe built to read the turn
    limit was dropped too (a connection or process per episode stayed open for the run). Replaced ones are closed
    (one whose close raises: logged and counted, the new episode goes on), the current one at close()."""
    skyrl_gym = pytest.importorskip("skyrl_gym", exc_type=ImportError)
    from skyrl_gym.envs.base_text_env import BaseTextEnv

    closed: list[int] = []

    class Recording(BaseTextEnv):
        made = 0

        def __init__(self, env_config: Any = None, extras: Any = None) -> None:
            super().__init__()
            self.number, Recording.made = Recording.made, Recording.made + 1
            self.max_turns = 2

        def step(self, action: str) -> Any:
            return {"observations": [], "reward": 1.0, "done": True, "metadata": {}}

        def close(self) -> None:
            closed.append(self.number)
            if self.number == 2:
                raise OSError("close broke")

    registration = skyrl_gym.envs.registration
    monkeypatch.setattr(registration, "registry", dict(registration.registry))  # the test's env is removed after
    skyrl_gym.register(id="roll_test_recording", entry_point=Recording)
    env = make_env("skyrl:roll_test_recording", rows=SKYRL_ROWS)
    assert closed == [0]  # the probe
    env.reset(seed=0)
    env.reset(seed=1)
    assert closed == [0, 1] and env.close_errors == 0
    env.reset(seed=2)  # environment 2's close raises: counted, the episode goes on
    assert closed == [0, 1, 2] and env.close_errors == 1 and env.step("x")[1] == 1.0
    env.close()
    assert closed == [0, 1, 2, 3]
    env.close()  # nothing left to close
    assert closed == [0, 1, 2, 3]


def test_text2sql_runs_the_models_sql_on_a_read_write_database_and_is_refused(tmp_path: Path) -> None:
    """SkyRL-Gym's text2sql runs the model's SQL with sqlite3 on the user's database files, opened read-write (each
    statement is rolled back, but ATTACH creates a file anywhere: seen below through SkyRL's own SQL tool). Roll
    cannot open them read-only (SkyRL connects), so it is refused like the code-running environments."""
    pytest.importorskip("skyrl_gym", exc_type=ImportError)
    import sqlite3

    from skyrl_gym.tools.sql import SQLCodeExecutorToolGroup

    db = tmp_path / "spider" / "database" / "shop"
    db.mkdir(parents=True)
    with sqlite3.connect(db / "shop.sqlite") as conn:
        conn.execute("CREATE TABLE t(x)")
    made = tmp_path / "made_by_the_model.db"
    SQLCodeExecutorToolGroup(str(db.parent)).sql("shop", f"ATTACH DATABASE '{made}' AS x", 3)
    assert made.exists()  # the model's SQL wrote a host file outside the database
    extras = {"db_id": "shop", "data": "spider", "reward_spec": {"ground_truth": "SELECT 1"}}
    rows = [{"prompt": "How many rows?", "extras": extras}]
    with pytest.raises(ValueError, match=r"'text2sql' runs the model's code outside roll's sandbox \(.*read-write"):
        make_env("skyrl:text2sql", rows=rows, env_config={"db_path": str(tmp_path)})


class _Guesser:
    """A GEM-style environment that parses replies itself (its last `\\boxed{...}` is the guess, 7 wins), recording
    the text it was given; 3 turns."""

    max_turns = 3

    def __init__(self) -> None:
        self.seen: list[str] = []

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.seen = []
        return "Guess a number from 1 to 10.", {}

    def step(self, text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        import re

        self.seen.append(text)
        guesses = re.findall(r"\\boxed\{(\d+)\}", text)
        win = bool(guesses) and guesses[-1] == "7"
        return "Right." if win else "Wrong.", float(win), win, len(self.seen) >= self.max_turns, {}


def test_outside_environments_read_the_reply_after_its_reasoning() -> None:
    """GEM and Gymnasium environments get the reply after its last `</think>`: a move weighed in the reasoning
    ("\\boxed{3}? no") was read as the move (GEM takes the last box of the whole reply). A reply whose `<think>` is
    never closed is an invalid action that never reaches the environment (-0.1, counted towards the step limit)."""
    from roll_envs.agentic.gem_adapter import GemEnv, _Adapter

    gem = GemEnv.__new__(GemEnv)  # GemEnv's own step over a stand-in (gem itself is an optional install)
    _Adapter.__init__(gem, _Guesser(), 1.0, _Guesser.max_turns)
    gem._rng = _PrivateGlobalRNG(0)
    gem.reset(seed=0)
    _, reward, terminated, _, info = gem.step("<think>\\boxed{7} or \\boxed{3}?</think>\n\\boxed{7}")
    assert gem.env.seen == ["\n\\boxed{7}"] and (reward, terminated, info["success"]) == (1.0, True, True)
    gem.reset(seed=0)
    assert gem.step("<think>is it \\boxed{7}?</think>No idea.")[1] == 0.0  # the reasoning's box is no guess (was 1.0)
    gem.reset(seed=0)
    replies = ["<think>surely \\boxed{7}", "<think>a</think>\\boxed{2}", "<think>\\boxed{7} is it"]
    steps = [gem.step(r) for r in replies]
    assert gem.env.seen == ["\\boxed{2}"]  # the unclosed ones never reached it
    assert [(s[1], s[2], s[3], s[4]["invalid_action"]) for s in steps] == [
        (-0.1, False, False, True),
        (0.0, False, False, False),
        (-0.1, False, True, True),  # the third step: GEM's 3-turn limit, though GEM itself saw one turn
    ]
    assert steps[0][0].startswith("Invalid action: the reply's <think> block is never closed")
    assert gem.step("\\boxed{7}")[4]["invalid_action"]  # over: never stepped again

    env = GymTextEnv(_Corridor(), action_parser={"left": 0, "right": 1}.get)
    env.reset(seed=0)
    assert env.step("<think>left? no.</think>right")[0] == "1"  # the parser reads "right", not the whole reply
    _, reward, _, _, info = env.step("<think>right")
    assert (reward, info["invalid_action"], env.env.pos) == (-0.1, True, 1)


def test_skyrl_environments_read_the_reply_after_its_reasoning(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SkyRL-Gym environment gets the reply after its last `</think>` (gsm8k reads the last "#### N" of what it
    is given: the reasoning's "#### 5" was read as the answer); an unclosed `<think>` is an invalid action scoring 0,
    never stepped, and counts towards the turn limit."""
    skyrl_gym = pytest.importorskip("skyrl_gym", exc_type=ImportError)
    from skyrl_gym.envs.base_text_env import BaseTextEnv

    seen: list[str] = []

    class Recording(BaseTextEnv):
        def __init__(self, env_config: Any = None, extras: Any = None) -> None:
            super().__init__()
            self.max_turns = 2

        def step(self, action: str) -> Any:
            seen.append(action)
            self.turns += 1
            done = action.strip().endswith("#### 5") or self.turns >= self.max_turns
            return {"observations": [], "reward": float("#### 5" in action), "done": done, "metadata": {}}

    registration = skyrl_gym.envs.registration
    monkeypatch.setattr(registration, "registry", dict(registration.registry))
    skyrl_gym.register(id="roll_test_thinking", entry_point=Recording)
    env = make_env("skyrl:roll_test_thinking", rows=SKYRL_ROWS)
    env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step("<think>#### 5? no</think> #### 6")
    assert seen == [" #### 6"] and (reward, terminated, truncated, info["invalid_action"]) == (0.0, False, False, False)
    env.reset(seed=0)
    steps = [env.step("<think>#### 5"), env.step("<think>still #### 5")]
    assert seen == [" #### 6"]  # never stepped
    assert [(s[1], s[2], s[3], s[4]["invalid_action"]) for s in steps] == [
        (0.0, False, False, True),
        (0.0, False, True, True),
    ]
    assert env.step("#### 5")[0].startswith("The episode is over")


def test_skyrl_system_messages_reach_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The observation text dropped system messages: a row's system prompt and a notice a SkyRL-Gym environment adds
    mid-episode as a system message never reached the policy (roll gives it the observation as the turn's user
    message). Every message's content is kept, in order; empty ones are skipped."""
    skyrl_gym = pytest.importorskip("skyrl_gym", exc_type=ImportError)
    from skyrl_gym.envs.base_text_env import BaseTextEnv

    class Notices(BaseTextEnv):
        def __init__(self, env_config: Any = None, extras: Any = None) -> None:
            super().__init__()
            self.max_turns = 3

        def step(self, action: str) -> Any:
            self.turns += 1
            observations = [
                {"role": "user", "content": "Wrong, try again."},
                {"role": "system", "content": f"{self.max_turns - self.turns} turns left."},
                {"role": "user", "content": ""},
            ]
            return {"observations": observations, "reward": 0.0, "done": False, "metadata": {}}

    registration = skyrl_gym.envs.registration
    monkeypatch.setattr(registration, "registry", dict(registration.registry))
    skyrl_gym.register(id="roll_test_notices", entry_point=Notices)
    rows = [{"prompt": [{"role": "system", "content": "Answer with #### N."}, {"role": "user", "content": "2 + 3?"}]}]
    env = make_env("skyrl:roll_test_notices", rows=rows)
    obs, _ = env.reset(seed=0)
    assert obs == "Answer with #### N.\n\n2 + 3?"
    obs, reward, terminated, truncated, _ = env.step("#### 6")
    assert (obs, reward, terminated, truncated) == ("Wrong, try again.\n\n2 turns left.", 0.0, False, False)
