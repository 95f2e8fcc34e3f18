"""Stand-ins for third-party environments behind roll's adapters, shared by test_adapter_contract_checks.py and
test_adapter_empty_observations.py (a test module puts this folder on sys.path to import it: pytest's importlib
mode does not).

- `scripted(step, reset)`: a Gymnasium-API environment whose reset and step return what the test sets;
- `gym(step, reset)`: roll's GymTextEnv over it;
- `gem(step, reset)`: roll's GemEnv (its own reset and step) over it, without gem itself (an optional install).
"""

from __future__ import annotations

from typing import Any

from roll_envs.agentic import GymTextEnv
from roll_envs.agentic.gem_adapter import GemEnv, _Adapter, _PrivateGlobalRNG


class _Scripted:
    """A Gymnasium-API environment whose reset and step return what the test sets. Its class name is in the
    adapters' messages (GymTextEnv names the environment by it), which the tests match: keep it."""

    def __init__(self, step: Any = None, reset: Any = ("start", {})) -> None:
        self.step_result, self.reset_result = step, reset

    def reset(self, seed: int | None = None) -> Any:
        return self.reset_result

    def step(self, action: Any) -> Any:
        return self.step_result


def scripted(step: Any = None, reset: Any = ("start", {})) -> Any:
    """A Gymnasium-API environment whose `step` returns `step` and whose `reset` returns `reset`."""
    return _Scripted(step, reset)


def gym(step: Any = None, reset: Any = ("start", {})) -> GymTextEnv:
    """GymTextEnv over `scripted(step, reset)`."""
    return GymTextEnv(_Scripted(step, reset))


def gem(step: Any = None, reset: Any = ("start", {})) -> GemEnv:
    """GemEnv's own reset/step over `scripted(step, reset)` (gem itself is an optional install), as the GEM
    environment "game:Scripted-v0"."""
    env = GemEnv.__new__(GemEnv)
    _Adapter.__init__(env, _Scripted(step, reset), 1.0, None)
    env._rng, env.env_id = _PrivateGlobalRNG(0), "game:Scripted-v0"
    return env
