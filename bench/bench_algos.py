"""Benchmark: roll_algos.policy_loss + aggregate vs a naive unfused implementation, same inputs, same run.

The naive version is how many trainers write it: a Python loop over rows for the masked means, separate
clip/ratio/metric passes, float masks multiplied in everywhere. Prints wall time of forward+backward for each and
the ratio naive/roll (> 1 means roll is faster). Usage: python bench/bench_algos.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch

from roll_algos.losses import aggregate, policy_loss


def naive(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = torch.max(-adv * ratio, -adv * clipped)
    per_row = []
    for i in range(loss.shape[0]):  # seq-mean-token-mean, row by row
        m = mask[i]
        per_row.append((loss[i] * m).sum() / m.sum().clamp_min(1))
    total = torch.stack(per_row).mean()
    _clipfrac = ((ratio - 1).abs() > 0.2).float().mul(mask).sum() / mask.sum()
    _kl = ((ratio - 1) - (logp - old)).mul(mask).sum() / mask.sum()
    return total


def roll(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    loss, _ = policy_loss(logp, old, adv, mask, agg="seq-mean-token-mean")
    return loss


def timeit(fn, logp0, old, adv, mask, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        logp = logp0.clone().requires_grad_()
        t = time.perf_counter()
        fn(logp, old, adv, mask).backward()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller tensors, fewer repeats (CI smoke)")
    args = parser.parse_args()
    b, t, repeats = (64, 1024, 3) if args.quick else (256, 4096, 5)
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(b, t, generator=g) * 3
    old = logp + 0.1 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    a = roll(logp.clone().requires_grad_(), old, adv, mask)
    n = naive(logp.clone().requires_grad_(), old, adv, mask)
    assert torch.allclose(a, n, atol=1e-5), (a, n)
    _ = aggregate  # the aggregation under test is inside policy_loss
    t_roll = timeit(roll, logp, old, adv, mask, repeats)
    t_naive = timeit(naive, logp, old, adv, mask, repeats)
    print(
        f"policy_loss+aggregate on ({b}, {t}): roll {t_roll * 1e3:.1f} ms, naive {t_naive * 1e3:.1f} ms, "
        f"ratio naive/roll = {t_naive / t_roll:.2f}x (fwd+bwd, best of {repeats})"
    )


if __name__ == "__main__":
    main()
