"""What the cluster simulator simulates: workloads (prompts, responses, episodes), hardware costs, scheduling modes.

Response lengths are long-tailed: log L = log(median) + sigma_prompt * z_group + sigma_sample * z_sample (a
per-prompt difficulty shared by the group, plus per-sample noise). An agentic workload is an episode of several
turns: each turn is one request whose length follows the same law, then the environment takes `env_latency_s`
(log-normal, median and sigma) and answers with an observation (`obs_tokens`, uniform in [0.5, 1.5] x); the episode
ends after its last turn's environment step. The number of turns is log-normal too (median `median_turns`, harder
prompts take more turns), at most `max_turns`. A sample's response (every turn and observation) is capped at
`max_new_tokens`: a turn that reaches the cap ends the episode with finish="length".

A *plan* is what one sample will do: a list of turns (gen_start, gen_end, obs_end, env_latency_s) in response
positions (token units); a single-turn RLVR plan is [(0, L, L, 0.0)].
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

Turn = tuple[int, int, int, float]  # (gen_start, gen_end, obs_end, env latency s)


@dataclass(frozen=True)
class Workload:
    """Prompts and response lengths (tokens) of one RL task; `max_turns` > 1 makes it agentic (episodes)."""

    name: str
    prompt_tokens: int  # mean; uniform in [0.75, 1.25] x this
    median_response: float  # per turn
    sigma_prompt: float  # log-length spread shared by a group (prompt difficulty)
    sigma_sample: float  # log-length spread within a group (and between turns)
    max_new_tokens: int  # cap on a sample's response (all turns and observations)
    group_size: int
    groups_per_device: float  # batch = groups_per_device * devices groups (weak scaling)
    max_turns: int = 1
    median_turns: float = 1.0
    sigma_turns: float = 0.0  # log spread of the number of turns (half shared by the group)
    obs_tokens: int = 0  # mean observation tokens after a turn
    env_latency_s: float = 0.0  # median environment step latency
    env_latency_sigma: float = 0.0


PRESETS: dict[str, Workload] = {
    # Math RLVR (ROLL Flash's throughput-scaling runs use Qwen3-8B models): GRPO groups of 16, a 16k cap,
    # median 2k tokens, p99 ~15k, 0.7% truncated (our choice of parameters, not the paper's data).
    "rlvr": Workload("rlvr", 512, 2048.0, 0.6, 0.6, 16384, 16, 0.5),
    # Multi-turn agentic episodes at the settings ROLL documents for its asynchronous agentic examples (group of
    # 8 episodes per environment seed, sequence length 8192, async ratio 1; a 7-8B model): a 1k-token prompt,
    # 1-15 turns (median 6) of ~384 tokens (thinking + action), ~256-token observations, and an environment step
    # of ~2 s median with a heavy tail (p99 ~20 s). The turn and latency laws are our choice, not the paper's data.
    "agentic": Workload(
        name="agentic",
        prompt_tokens=1024,
        median_response=384.0,
        sigma_prompt=0.4,
        sigma_sample=0.6,
        max_new_tokens=7168,  # sequence length 8192 - the prompt
        group_size=8,
        groups_per_device=0.5,
        max_turns=15,
        median_turns=6.0,
        sigma_turns=0.5,
        obs_tokens=256,
        env_latency_s=2.0,
        env_latency_sigma=1.0,
    ),
}


@dataclass(frozen=True)
class Hardware:
    """Costs of one accelerator (defaults: an 8B model on an H100-class device)."""

    params: float = 8e9
    flops_per_device: float = 1.5e14  # 989 TFLOP/s bf16 x 25% MFU x 6/10 (old + ref log-prob forwards)
    decode_base_s: float = 0.010  # a: weights read once per step
    decode_per_request_s: float = 0.0002  # b: KV reads and sampling per running request
    prefill_s_per_token: float = 5e-5  # ~20k prompt tokens/s
    max_running: int = 128
    engine_devices: int = 1  # tensor-parallel size of one engine
    weight_sync_s: float = 5.0
    # Partial-GPU mode (ROLL's partial_gpu_mode): the training devices lend themselves to the rollout while the
    # trainer waits. Lending offloads the train states to host memory and wakes an engine at the current weights;
    # reclaiming offloads the engine and reloads the train states. ROLL documents "several seconds" per transition.
    lend_s: float = 5.0
    reclaim_s: float = 5.0


@dataclass(frozen=True)
class Mode:
    """A scheduling policy: async ratio k, partial rollout, the scheduler's take order, tail groups (fraction of B),
    and partial-GPU mode (the training devices serve rollout while the trainer would idle; `async_sim.sim`)."""

    name: str
    async_ratio: int
    partial: bool = False
    order: str = "start"
    tail_fraction: float = 0.0
    partial_gpu: bool = False


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("sync", 0),
        Mode("k1", 1),
        Mode("k2", 2),
        Mode("k1+partial", 1, partial=True),
        Mode("k1 deadline", 1, order="deadline"),  # due groups waited for, the rest skips ahead; nothing dropped
        Mode("k2 deadline", 2, order="deadline"),
        Mode("k1 ready", 1, order="ready"),  # the policy before 2026-12: skip ahead, drop what goes stale
        Mode("k1 ready+tail", 1, order="ready", tail_fraction=0.25),
        Mode("k1 partial-gpu", 1, partial_gpu=True),  # ROLL's partial_gpu_mode on top of plain disaggregation
        Mode("k2 partial-gpu", 2, partial_gpu=True),
    )
}


def _lognormal_int(median: float, z: float, sigma: float, unit: int) -> int:
    return max(1, math.ceil(median * math.exp(sigma * z) / unit))


def sample_group(w: Workload, rng: random.Random, unit: int = 1) -> tuple[int, list[list[Turn]]]:
    """(prompt units, one plan per sample) of one group; lengths in units of `unit` tokens."""
    prompt = math.ceil(w.prompt_tokens * rng.uniform(0.75, 1.25) / unit)
    cap = w.max_new_tokens // unit
    zg = rng.gauss(0.0, 1.0)
    zt = rng.gauss(0.0, 1.0) if w.max_turns > 1 else 0.0
    plans = []
    for _ in range(w.group_size):
        if w.max_turns == 1:
            n_turns = 1
        else:
            z = (zt + rng.gauss(0.0, 1.0)) / math.sqrt(2.0)
            n_turns = min(w.max_turns, max(1, round(w.median_turns * math.exp(w.sigma_turns * z))))
        plan: list[Turn] = []
        pos = 0
        for t in range(n_turns):
            z = w.sigma_prompt * zg + w.sigma_sample * rng.gauss(0.0, 1.0)
            gen_end = min(cap, pos + max(1, math.ceil(math.exp(math.log(w.median_response) + z) / unit)))
            last = t == n_turns - 1 or gen_end >= cap
            obs = 0 if last else math.ceil(w.obs_tokens * rng.uniform(0.5, 1.5) / unit)
            if gen_end + obs >= cap:  # the observation would not fit: the episode ends after this turn
                obs, last = 0, True
            latency = w.env_latency_s * math.exp(w.env_latency_sigma * rng.gauss(0.0, 1.0)) if w.env_latency_s else 0.0
            plan.append((pos, gen_end, gen_end + obs, latency))
            pos = gen_end + obs
            if last:
                break
        plans.append(plan)
    return prompt, plans


def length_stats(w: Workload, n_groups: int = 4000, seed: int = 0) -> dict[str, float]:
    """Response statistics (tokens) of a preset: mean, p50/p90/p99, share at the cap, mean group max, mean turns,
    mean generated tokens per sample, and the mean environment time per sample."""
    rng = random.Random(seed)
    groups = [sample_group(w, rng)[1] for _ in range(n_groups)]
    flat = sorted(p[-1][2] for g in groups for p in g)
    plans = [p for g in groups for p in g]
    q = lambda p: float(flat[min(len(flat) - 1, int(p * len(flat)))])
    return {
        "mean": sum(flat) / len(flat),
        "p50": q(0.5),
        "p90": q(0.9),
        "p99": q(0.99),
        "at_cap": sum(x >= w.max_new_tokens for x in flat) / len(flat),
        "group_max_mean": sum(max(p[-1][2] for p in g) for g in groups) / len(groups),
        "turns_mean": sum(len(p) for p in plans) / len(plans),
        "generated_mean": sum(t[1] - t[0] for p in plans for t in p) / len(plans),
        "env_s_mean": sum(t[3] for p in plans for t in p) / len(plans),
    }
