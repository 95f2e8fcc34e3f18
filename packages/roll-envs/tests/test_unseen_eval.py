"""env.unseen_eval (roll_envs.agentic.task): held-out boards are never trained on. Without it the built-in games'
small board spaces put held-out boards into training (the module docstring's measurement); with it no training
seed's board is a held-out one, seeds stay deterministic per step, and a space too small for the held-out set is a
clear error rather than an endless draw."""

from __future__ import annotations

import pytest

from roll_envs.agentic.task import AgenticTask


def _boards(task: AgenticTask, seeds: list[int]) -> set[str]:
    return {task._board(s) for s in seeds}


@pytest.mark.parametrize("env", ["sokoban", "frozen_lake"])
def test_held_out_boards_are_trained_on_unless_unseen_eval(env: str) -> None:
    plain = AgenticTask(env, eval_seed_offset=100_000, eval_size=32)
    held_out = _boards(plain, plain.eval_seeds())
    trained = [s for step in range(20) for s in plain.train_seeds(16, step)]
    assert _boards(plain, trained) & held_out, "the default split shares boards (what unseen_eval is for)"

    task = AgenticTask(env, eval_seed_offset=100_000, eval_size=32, unseen_eval=True)
    steps = [task.train_seeds(16, step) for step in range(20)]
    assert all(len(set(seeds)) == 16 and max(seeds) < 100_000 for seeds in steps)
    assert not _boards(task, [s for seeds in steps for s in seeds]) & held_out
    assert task.train_seeds(16, 7) == steps[7]  # the same step draws the same seeds


def test_guess_numbers_board_is_its_hidden_number() -> None:
    """Every guess_number episode starts from the same visible state; its board is the number (board_key)."""
    task = AgenticTask(
        "guess_number", env_kwargs={"low": 1, "high": 1000, "max_turns": 10}, eval_size=16, unseen_eval=True
    )
    held_out = {task._board(s) for s in task.eval_seeds()}
    assert len(held_out) > 1
    trained = {task._board(s) for step in range(10) for s in task.train_seeds(8, step)}
    assert trained and not trained & held_out


def test_too_few_boards_for_the_held_out_set_is_an_error() -> None:
    """guess_number over 1..8: 32 held-out seeds take all 8 numbers."""
    task = AgenticTask("guess_number", env_kwargs={"low": 1, "high": 8}, eval_size=32, unseen_eval=True)
    assert len(task._held_out) == 8
    with pytest.raises(ValueError, match=r"env.unseen_eval: .* too few boards .* env.eval_size"):
        task.train_seeds(8, 0)


def test_the_env_config_passes_unseen_eval() -> None:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from roll_envs.config import AgenticEnvConfig

    cfg = OmegaConf.structured(AgenticEnvConfig(env="sokoban", eval_size=4, unseen_eval=True))
    task = instantiate(cfg)
    assert task._held_out and len(task._held_out) <= 4
