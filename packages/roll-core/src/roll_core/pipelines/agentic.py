"""The agentic pipeline: multi-turn episodes against environments, trajectory-level advantages, the RLVR update.

Reads top to bottom like RLVR (roll_core.pipelines.rlvr), whose roles, update, weight sync, checkpoints and
tracking it reuses; only collection and advantages differ:
1. draw `pipeline.rollout_batch_size` training seeds; every seed runs `algo.group_size` episodes (a group shares its
   environment seed, so group-relative estimators compare like with like);
2. run all episodes concurrently, token-in-token-out (roll_core.agentic.rollout), each turn one request to the
   inference engines;
3. build the trajectory batch: the first prompt is the prompt, everything after it the response, with a loss mask
   that is 1 on generated tokens only (holes at observations);
4. advantages from roll_algos.trajectories: episode-level grpo / rloo / dr_grpo / reinforce_pp, gigpo
   (episode-level plus step-level advantages over identical environment states), or turn_grpo (per-turn rewards:
   each turn's discounted return relative to the group's turns);
5. the RLVR update (reference and old log-probs, KL, actor update, weight sync).

Metrics: success rate, mean turns, invalid-action rate, environment errors and timeouts, why episodes ended.
Evaluation: one episode per held-out seed (greedy unless pipeline.eval_temperature says otherwise).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch

from roll_algos import trajectories as T
from roll_core.agentic.env_manager import EnvManager
from roll_core.agentic.rollout import AgenticRollout, task_turns
from roll_core.agentic.trajectory import Trajectory, to_tensors
from roll_core.errors import ConfigError
from roll_core.pipelines.metrics import timer
from roll_core.pipelines.rlvr import RLVRPipeline
from roll_core.protocol import Batch

log = logging.getLogger(__name__)

#: Estimators of agentic runs (algo.adv_estimator).
AGENTIC_ESTIMATORS = ("grpo", "rloo", "dr_grpo", "reinforce_pp", "gigpo", "turn_grpo")


class _StepSeeds:
    """Training seeds depend on (run seed, step) only: nothing to checkpoint beyond the step."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class AgenticPipeline(RLVRPipeline):
    """Multi-turn RL on an `env` group whose config builds a roll_envs.agentic.AgenticTask."""

    PLOT_KEYS = (
        "episode/success_rate",
        "eval/success_rate",
        "episode/turns_mean",
        "episode/invalid_action_rate",
        "reward/mean",
    )

    # ---- set-up hooks -------------------------------------------------------------------------------------
    def _setup_data(self) -> None:
        if not getattr(self.task, "is_agentic", False):
            raise ConfigError(
                f"pipeline=agentic needs an agentic env (env=sokoban, frozen_lake, guess_number, tool_math, ...), "
                f"got {type(self.task).__name__}"
            )
        self.eval_seeds = self.task.eval_seeds()
        self.sampler = _StepSeeds()
        task = self.task
        workers = int(getattr(task, "num_workers", 0))
        if workers > 0:  # environments on their own workers (Ray actors on cluster=ray)
            from roll_core.agentic.env_workers import EnvGroup, RemoteEnvManager
            from roll_core.config.build import as_dict

            group = self.cluster.group(
                EnvGroup, "env", workers, max_concurrency=max(2, task.env_threads), env=as_dict(self.cfg.env)
            )
            self.envs: EnvManager | RemoteEnvManager = RemoteEnvManager(group)
        else:
            self.envs = EnvManager.for_task(task)
        self.turns, self.limits = task_turns(task, self.tokenizer)

    def _setup_reward(self) -> None:
        return None  # rewards come from the environments

    def _setup_estimator(self) -> Any:
        if self.cfg.algo.adv_estimator not in AGENTIC_ESTIMATORS:
            raise ConfigError(
                f"algo.adv_estimator={self.cfg.algo.adv_estimator} has no trajectory form: use one of "
                f"{', '.join(AGENTIC_ESTIMATORS)} with pipeline=agentic"
            )
        return None

    @property
    def rollout(self) -> AgenticRollout:
        return AgenticRollout(self.actor_infer, self.envs, self.turns, self.tokenizer, self.limits)

    # ---- collection ---------------------------------------------------------------------------------------
    def collect(
        self, step: int, metrics: dict[str, Any], timers: dict[str, float]
    ) -> tuple[Batch, torch.Tensor] | None:
        algo, pipe = self.cfg.algo, self.cfg.pipeline
        seeds = self.task.train_seeds(pipe.rollout_batch_size, pipe.seed * 7919 + step)
        runs = [s for s in seeds for _ in range(algo.group_size)]
        groups = [g for g in range(len(seeds)) for _ in range(algo.group_size)]
        params = self.sampling.replace(seed=pipe.seed * 100_003 + step)
        before = self.envs.counters()
        with timer(timers, "generate"):
            trajs = self.rollout.run(runs, groups, params)
        self._sleep_engines()
        metrics.update(_episode_metrics(trajs, before, self.envs.counters()))
        self._log_episodes(step, trajs)
        kept = [t for t in trajs if t.turns > 0]  # an environment that failed at reset gives nothing to train on
        metrics["data/dropped_episodes"] = len(trajs) - len(kept)
        if not kept:
            return None
        tensors = to_tensors(kept, self.tokenizer.pad_token_id or 0)
        fields = {"state_keys": tensors.pop("state_keys"), "env_seed": [t.env_seed for t in kept]}
        batch = Batch(tensors, fields)
        gen_tokens = float(batch["response_mask"].sum())
        metrics["perf/rollout_tokens_per_s"] = gen_tokens / max(timers["generate"], 1e-9)
        return batch, batch["episode_rewards"].clone()

    def _advantages(
        self,
        batch: Batch,
        scores: torch.Tensor,
        token_rewards: torch.Tensor,
        mask: torch.Tensor,
        values: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        algo = self.cfg.algo
        if algo.adv_estimator == "gigpo":
            adv = T.gigpo_advantages(
                scores,
                batch["turn_rewards"],
                batch["turn_mask"],
                batch["group_ids"],
                batch["state_keys"],
                batch["turn_ids"],
                mask,
                gamma=algo.gamma,
            )
        elif algo.adv_estimator == "turn_grpo":  # per-turn rewards: discounted returns, relative within the group
            adv = T.turn_group_advantages(
                batch["turn_rewards"],
                batch["turn_mask"],
                batch["group_ids"],
                batch["turn_ids"],
                mask,
                gamma=algo.gamma,
            )
        elif algo.adv_estimator == "reinforce_pp":
            adv = T.reinforce_pp_trajectories(scores, mask)
        else:
            adv = T.episode_group_advantages(scores, batch["group_ids"], mask, estimator=algo.adv_estimator)
        return adv, None

    def _log_episodes(self, step: int, trajs: list[Trajectory], k: int = 2) -> None:
        self.tracker.samples(
            step,
            [
                {
                    "env_seed": t.env_seed,
                    "turns": t.turns,
                    "success": t.success,
                    "end": t.end,
                    "reward": t.reward,
                    "responses": t.texts,
                }
                for t in trajs[:k]
            ],
        )

    # ---- evaluation ---------------------------------------------------------------------------------------
    def evaluate(self, step: int) -> dict[str, float]:
        """One episode per held-out seed at the eval temperature (0: greedy)."""
        import time

        t0 = time.perf_counter()
        params = self.sampling.replace(temperature=self.eval_temperature, seed=self.cfg.pipeline.seed + 17)
        seeds = self.eval_seeds
        trajs = self.rollout.run(seeds, list(range(len(seeds))), params)
        m = _episode_metrics(trajs, None, None)
        return {
            "eval/accuracy": m["reward/accuracy"],  # = success rate (the summary and plots read it)
            "eval/success_rate": m["reward/accuracy"],
            "eval/reward": m["reward/mean"],
            "eval/mean_turns": m["episode/turns_mean"],
            "eval/invalid_action_rate": m["episode/invalid_action_rate"],
            "eval/seconds": time.perf_counter() - t0,
        }

    def shutdown(self) -> None:
        self.envs.close()
        super().shutdown()


def _episode_metrics(
    trajs: list[Trajectory], before: dict[str, int] | None, after: dict[str, int] | None
) -> dict[str, float]:
    n = max(len(trajs), 1)
    turns = sum(t.turns for t in trajs)
    rewards = torch.tensor([t.reward for t in trajs] or [0.0])
    out = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(trajs) > 1 else 0.0,
        "reward/accuracy": sum(t.success for t in trajs) / n,
        "episode/success_rate": sum(t.success for t in trajs) / n,
        "episode/turns_mean": turns / n,
        "episode/invalid_action_rate": sum(t.invalid_actions for t in trajs) / max(turns, 1),
        "episode/tool_calls_mean": sum(t.tool_calls for t in trajs) / n,
        "episode/cut_turn_rate": sum(t.cut_turns for t in trajs) / max(turns, 1),
        "episode/length_mean": sum(t.length for t in trajs) / n,
        "response/length_mean": sum(sum(t.mask) for t in trajs) / max(turns, 1),  # generated tokens per turn
    }
    for reason, count in Counter(t.end for t in trajs).items():
        out[f"episode/end_{reason}"] = count / n
    if before is not None and after is not None:
        for k in after:
            out[f"env/{k}"] = float(after[k] - before.get(k, 0))
    return out
