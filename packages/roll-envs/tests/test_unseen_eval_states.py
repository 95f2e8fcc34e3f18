"""env.unseen_eval's boards from reset's info["state"] (roll_envs.agentic.task): a state of None is no state (the
rollout's rule, roll_core.agentic.step_values.checked_info), and an array state is keyed by its bytes
(roll_core.agentic.observation.info_state_key). Read as text, None made every board the board "None" (every training
seed's board a held-out one: `train_seeds` refused the run), and NumPy's "..." summary of arrays above 1,000 cells
made every large board one board."""

from __future__ import annotations

from typing import Any

import numpy as np

from roll_envs.agentic.task import AgenticTask


class NoStateEnv:
    """Fifty boards, told apart by the observation only; info["state"] is None (the env does not track one)."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return f"board {int(seed or 0) % 50}", {"state": None}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "done", 0.0, True, False, {"state": None}


class BigBoardEnv:
    """Fifty 2,000-cell boards that differ in their middle cell; the observation is the same for all."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        board = np.zeros(2000, dtype=np.int64)
        board[1000] = int(seed or 0) % 50
        return "the board", {"state": board}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "done", 0.0, True, False, {}


def _task(env: type) -> AgenticTask:
    return AgenticTask(f"py:{__name__}:{env.__name__}", eval_seed_offset=1000, eval_size=4, unseen_eval=True)


def test_a_none_state_is_no_board_key() -> None:
    task = _task(NoStateEnv)
    assert len(task._held_out) == 4  # old: 1 (the board "None")
    seeds = task.train_seeds(8, 0)  # old: ValueError, every training seed's board "None" was held out
    assert len(set(seeds)) == 8 and not {s % 50 for s in seeds} & {0, 1, 2, 3}


def test_large_array_states_are_different_boards() -> None:
    task = _task(BigBoardEnv)
    assert len(task._held_out) == 4  # old: 1 ("[0 0 0 ... 0 0 0]")
    seeds = task.train_seeds(8, 0)
    assert len(set(seeds)) == 8 and not {s % 50 for s in seeds} & {0, 1, 2, 3}
