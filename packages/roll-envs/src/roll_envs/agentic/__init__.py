"""Multi-turn text environments for agentic RL (the `roll_core.interfaces.Env` contract), offline and seeded.

Built-ins (every instance solvable within its step limit): `SokobanEnv`, `FrozenLakeEnv`, `GuessNumberEnv`, and
`ToolMathEnv` (arithmetic with a calculator tool). `ToolUseEnv` adds tool calls (`tools.py`: calculator, a
restricted expression evaluator, local retrieval) to any environment; `QAEnv` makes one from question/answer pairs.
`GemEnv` / `GymTextEnv` adapt GEM and Gymnasium text environments. `make_env(name, **kwargs)` builds any of them by
name. These modules are pure Python (no torch, no numpy) and cheap to import in environment workers.
"""

from roll_envs.agentic.base import IllegalAction, Outcome, TextEnv, extract_action
from roll_envs.agentic.frozen_lake import FrozenLakeEnv
from roll_envs.agentic.gem_adapter import GemEnv, GymTextEnv
from roll_envs.agentic.guess_number import GuessNumberEnv
from roll_envs.agentic.registry import available_envs, make_env
from roll_envs.agentic.sokoban import Level, SokobanEnv, generate_level, solve
from roll_envs.agentic.tool_env import QAEnv, ToolMathEnv, ToolUseEnv
from roll_envs.agentic.tools import TOOLS, Calculator, PythonExpression, Retrieval, Tool, get_tool

__all__ = [
    "TOOLS",
    "Calculator",
    "FrozenLakeEnv",
    "GemEnv",
    "GuessNumberEnv",
    "GymTextEnv",
    "IllegalAction",
    "Level",
    "Outcome",
    "PythonExpression",
    "QAEnv",
    "Retrieval",
    "SokobanEnv",
    "TextEnv",
    "Tool",
    "ToolMathEnv",
    "ToolUseEnv",
    "available_envs",
    "extract_action",
    "generate_level",
    "get_tool",
    "make_env",
    "solve",
]
