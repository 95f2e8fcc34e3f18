"""KL estimators between the policy and a reference policy, and KL coefficient controllers.

Estimators are per token, from log-probs of the *sampled* tokens (Schulman's k1/k2/k3). With
log_ratio = logp - ref_logp:

| kind | formula | notes |
|---|---|---|
| `k1` | log_ratio | unbiased, high variance, can be negative |
| `k2` (`mse`) | 0.5 * log_ratio^2 | biased, low variance, >= 0 |
| `k3` (`low_var_kl`) | exp(-log_ratio) + log_ratio - 1 | unbiased (before its clamp), >= 0, clamped to [0, 10] |
| `abs` | abs(log_ratio) | >= 0 |

The caller applies the mask (zero the masked positions or aggregate with `roll_algos.losses.aggregate`).

"Unbiased" above is about the value (what `actor/kl_to_ref` logs, and the penalty `algo.kl_in_reward` subtracts
from the rewards). As a loss (KL loss, `algo.kl_in_reward=false`) what counts is the expected gradient over tokens
sampled from pi, E_pi[grad k] (the loss carries no score-function term for the sampling):
- `k1`: E_pi[grad log pi] = 0: no signal in expectation, only noise;
- `k2`: E_pi[(log pi - log ref) grad log pi] = grad KL(pi || ref): the exact gradient of the KL it estimates;
- `k3`: E_pi[(1 - ref/pi) grad log pi] = -E_ref[grad log pi] = grad KL(ref || pi): the gradient of the reverse
  (mass-covering) KL, not of KL(pi || ref) (GRPO's and verl's default all the same); it is 0 on tokens where the
  clamp at 10 acts (ref/pi above ~13.6) or the exponent clamp does.
So k2 is the loss whose gradient is that of KL(pi || ref); k3 regularises toward ref in the other direction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["KL_KINDS", "AdaptiveKLController", "FixedKLController", "kl_estimate"]

KL_KINDS = ("k1", "k2", "mse", "k3", "low_var_kl", "abs")


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL(pi || ref) estimate.

    Args:
        logp: (B, T) log-probs of sampled tokens under the policy.
        ref_logp: (B, T) log-probs of the same tokens under the reference.
        kind: one of `KL_KINDS`.
    Returns:
        (B, T) estimates; not masked; float32 for half-precision inputs (k3's exp(x) - 1 - x of a small log ratio
        is far below bf16's resolution at x: computed in bf16 it is rounding noise).
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ in shape")
    if logp.dtype in (torch.float16, torch.bfloat16) or ref_logp.dtype in (torch.float16, torch.bfloat16):
        logp, ref_logp = logp.float(), ref_logp.float()
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind in ("k2", "mse"):
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        # Clamp the exponent first: exp(20+) overflows in fp32 long before the final clamp would act.
        neg = torch.clamp(-log_ratio, min=-20.0, max=20.0)
        # expm1 avoids the cancellation of exp(x) - 1 near 0; the lower clamp at 0 removes the last rounding
        # residue (k3 >= 0 exactly in real arithmetic), the upper one is the usual low_var_kl bound.
        return torch.clamp(torch.expm1(neg) - neg, min=0.0, max=10.0)
    if kind == "abs":
        return log_ratio.abs()
    raise ValueError(f"unknown KL kind {kind!r}; choose one of {', '.join(KL_KINDS)}")


@dataclass
class FixedKLController:
    """A constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> float:
        """No-op; returns the coefficient."""
        return self.value


class AdaptiveKLController:
    """Proportional controller from Ziegler et al. (2019), as in PPO-RLHF.

    error = clip(current_kl / target - 1, -0.2, 0.2); coef *= 1 + error * n_steps / horizon.
    """

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target ({target}) and horizon ({horizon}) must be > 0")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Update from the KL measured over `n_steps` samples; returns the new coefficient. A non-finite KL (one
        token whose log-probs are both -inf) leaves it unchanged: min/max pass NaN through, and a NaN coefficient
        stayed NaN for the rest of the run (the KL term then silently dropped: `coef > 0` is False for NaN)."""
        if not math.isfinite(current_kl):
            return self.value
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        """For checkpoints."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore from `state_dict()`; a non-finite saved value (a checkpoint written before updates skipped NaN) is
        a ValueError, not a run without KL."""
        value = float(state["value"])
        if not math.isfinite(value):
            raise ValueError(f"the adaptive KL controller's saved coefficient is {value}: set algo.kl_coef and resume")
        self.value = value
