"""Why an episode collector (pipeline=agentic, pipeline=agent) left an episode out of the batch, one cause each.

Contract: every episode a training step ran is kept or dropped for exactly one cause (`CAUSES`, first match wins):

- `aborted`: the engine aborted or refused its last turn for good (or the collector closed): `Trajectory.untrained`;
- `reset_failed`: its environment failed at reset (or its first observation could not be encoded): no turn was
  asked of the policy (pipeline=agentic only; an agent program has no reset);
- `context_refused`: its first prompt left no room within the context (`max_context_length`, the engine's):
  no turn was sampled, whatever an agent program did after the refusal (a non-finite reward it then returned is no
  attempt's failure: out of agent/failed_* and eval/failed_*, this cause under either on_failure);
- `failure_dropped`: an environment step (or the agent program) failed and `env.on_failure=drop` leaves it out;
- `unsampled`: any other episode without a sampled turn to train on (its first turn sampled a picture
  placeholder and was cut; an agent program that failed, or finished, before its first request).

`drop_metrics` logs the total as data/dropped_episodes (what users and the docs read) and one count per cause:
data/aborted_episodes, data/reset_failed_episodes, data/context_refused_episodes, data/failure_dropped_episodes,
data/unsampled_episodes, which add up to it.

Outcomes (`no_attempt`): an episode whose reset failed or whose first prompt the context refused was never an
attempt of the policy: it is out of the reward and episode metrics and out of `eval/n` (counted in
eval/reset_failed_episodes, eval/context_refused_episodes), as a refused prompt is out of pipeline=rlvr's `eval/n`.
Scoring it (0.0, or env.failure_reward) pulled reward/mean and the held-out success rate down with nothing the
policy did: 3 successes and 1 failed reset read reward/mean 0.75. An `unsampled` episode did act (or its program
failed): its outcome still counts.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

log = logging.getLogger(__name__)

#: The causes, in precedence order, and their step metrics (spelled out: the docs name them).
CAUSES = {
    "aborted": "data/aborted_episodes",
    "reset_failed": "data/reset_failed_episodes",
    "context_refused": "data/context_refused_episodes",
    "failure_dropped": "data/failure_dropped_episodes",
    "unsampled": "data/unsampled_episodes",
}

#: End reasons of an episode whose environment step failed (roll_core.agentic.rollout).
ENV_FAILURES = ("env_error", "env_timeout")


def no_attempt(turns: int, end: str, env_failures: bool = True) -> str | None:
    """`reset_failed` or `context_refused` for an episode the policy never had a turn in (module docstring), else
    None. `env_failures`: whether an env_error / env_timeout end with no turn is a failed reset (pipeline=agentic;
    an agent program's failure before its first request is the program's, not a reset)."""
    if turns:
        return None
    if env_failures and end in ENV_FAILURES:
        return "reset_failed"
    if end == "max_context":
        return "context_refused"
    return None


def drop_cause(untrained: bool, turns: int, end: str, dropped_failure: bool, env_failures: bool = True) -> str | None:
    """The cause an episode is left out of the batch for (`CAUSES`), None when it is trained. `dropped_failure`: it
    failed and env.on_failure=drop."""
    if untrained:
        return "aborted"
    missed = no_attempt(turns, end, env_failures)
    if missed is not None:  # never attempted: what followed (a program's failure after the refusal) is no attempt's
        return missed
    if dropped_failure:
        return "failure_dropped"
    return None if turns else "unsampled"


def drop_metrics(causes: Iterable[str | None]) -> dict[str, int]:
    """data/dropped_episodes (the total) and one count per cause of `causes` (one entry per episode, None: kept)."""
    counts = Counter(c for c in causes if c is not None)
    unknown = set(counts) - set(CAUSES)
    if unknown:
        raise ValueError(f"unknown episode drop cause(s) {sorted(unknown)}: one of {list(CAUSES)}")
    return {"data/dropped_episodes": sum(counts.values()), **{key: counts[c] for c, key in CAUSES.items()}}


def warn_nothing_evaluated(total: int, counts: dict[str, int]) -> None:
    """The warning of an evaluation none of whose `total` held-out episodes had an outcome, naming why from
    `counts` (cause -> episodes): eval/n is 0 and no rate is logged (a 0.0 read as a model that failed them all)."""
    what = {
        "reset_failed": "environment reset(s) failed",
        "context_refused": "first prompt(s) over the context limit",
        "aborted": "refused or aborted by the inference engine",
    }
    why = ", ".join(f"{n} {what[c]}" for c, n in counts.items() if n) or "no episode was run"
    log.warning(
        "nothing evaluated: none of the %d held-out episode(s) had an outcome (%s): eval/n is 0 and no accuracy is "
        "logged; check the environment and the context limits (env.max_context_length, infer_engine.max_model_len)",
        total,
        why,
    )
