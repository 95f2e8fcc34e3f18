"""Verifiable rewards: each scores a batch of (response, ground truth) pairs and reports counted failures."""

from roll_envs.rewards.base import Reward, RewardResult
from roll_envs.rewards.code import CodeReward, extract_code
from roll_envs.rewards.math import MathReward, extract_boxed, last_number

__all__ = ["CodeReward", "MathReward", "Reward", "RewardResult", "extract_boxed", "extract_code", "last_number"]
