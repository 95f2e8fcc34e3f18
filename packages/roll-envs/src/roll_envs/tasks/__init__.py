"""Built-in verifiable tasks and user datasets."""

from roll_envs.tasks.arithmetic import ArithmeticTask
from roll_envs.tasks.base import Problem, Task
from roll_envs.tasks.code import CodeTask, load_code_problems
from roll_envs.tasks.countdown import CountdownReward, CountdownTask, evaluate_equation
from roll_envs.tasks.dataset import FileTask, load_problems
from roll_envs.tasks.visual import VisualReward, VisualTask

__all__ = [
    "ArithmeticTask",
    "CodeTask",
    "CountdownReward",
    "CountdownTask",
    "FileTask",
    "Problem",
    "Task",
    "VisualReward",
    "VisualTask",
    "evaluate_equation",
    "load_code_problems",
    "load_problems",
]
