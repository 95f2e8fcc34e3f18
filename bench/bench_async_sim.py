"""Benchmark (simulated): synchronous vs asynchronous RL training from 8 to 1024 accelerators, RLVR and agentic.

Drives the real `RolloutScheduler` (and, in partial-GPU modes, the real `EnginePool`) with simulated engines,
environments and trainer (`bench/async_sim`: its module docstrings state the model). Sync (k=0) is colocated; async
modes are disaggregated, with the train share of the devices picked per mode as the one with the most trained
tokens/s among `--splits` (default {1/8, 1/4, 3/8, 1/2}) on a `--split-devices` cluster, then used at every scale.
Partial-GPU modes ("k1 partial-gpu", ROLL's partial_gpu_mode) lend the training devices to the rollout while the
trainer would idle; their "x plain" column is the ratio to the same k without it. Rates and utilization are
measured after `--warmup` training steps. Every run asserts the staleness bound and that every trained token was
generated exactly once.

    python bench/bench_async_sim.py                       # RLVR preset, 8..1024 devices
    python bench/bench_async_sim.py --workload agentic    # multi-turn episodes with environment latency
    python bench/bench_async_sim.py --devices 8 32 --steps 8 --warmup 2   # quick look
    python bench/bench_async_sim.py --modes sync k1 "k1 partial-gpu" --splits 0.25 0.375 0.5 0.625 0.75
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from async_sim import MODES, PRESETS, SPLITS, Hardware, best_split, length_stats, simulate

PUBLISHED = (
    "Published (ROLL Flash, arXiv 2510.11345, 'Part II: ROLL Flash - Accelerating RLVR and Agentic Training with "
    "Asynchrony'): up to 2.24x on RLVR and 2.72x on agentic tasks over synchronous training with the same GPU "
    "budget. These are the paper's measured figures on real clusters, not ours; the numbers above are simulated."
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=sorted(PRESETS), default="rlvr")
    ap.add_argument("--devices", type=int, nargs="+", default=[8, 32, 128, 512, 1024])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--token-unit", type=int, default=16)
    ap.add_argument("--split-devices", type=int, default=32)
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--splits", type=float, nargs="+", default=list(SPLITS), help="train shares to pick from")
    ap.add_argument("--groups-per-device", type=float, help="override the preset's batch (groups/device/batch)")
    ap.add_argument("--switch-s", type=float, help="partial-GPU: seconds to lend and to reclaim (default 5 each)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    w, hw = PRESETS[args.workload], Hardware()
    if args.groups_per_device:
        w = dataclasses.replace(w, groups_per_device=args.groups_per_device)
    if args.switch_s is not None:
        hw = dataclasses.replace(hw, lend_s=args.switch_s, reclaim_s=args.switch_s)
    kw = {"steps": args.steps, "warmup": args.warmup, "seed": args.seed, "token_unit": args.token_unit, "hardware": hw}
    st = length_stats(w)
    turns = (
        f"; {st['turns_mean']:.1f} turns, {st['generated_mean']:.0f} generated tokens and {st['env_s_mean']:.1f} s "
        f"of environment steps per episode (median step {w.env_latency_s:g} s)"
        if w.max_turns > 1
        else ""
    )
    print(
        f"workload {w.name}: prompt ~{w.prompt_tokens} tokens, group {w.group_size}, "
        f"{w.groups_per_device:g} groups/device/batch; response tokens mean {st['mean']:.0f}, p50 {st['p50']:.0f}, "
        f"p90 {st['p90']:.0f}, p99 {st['p99']:.0f}, cap {w.max_new_tokens} ({st['at_cap']:.1%} hit it), "
        f"mean group max {st['group_max_mean']:.0f}{turns}"
    )
    print(
        f"hardware: {hw.params / 1e9:.0f}B params, {hw.flops_per_device / 1e12:.0f} TFLOP/s effective, decode "
        f"{hw.decode_base_s * 1e3:.0f} ms + {hw.decode_per_request_s * 1e3:.1f} ms x running (max {hw.max_running}), "
        f"prefill {1 / hw.prefill_s_per_token:.0f} tok/s, weight sync {hw.weight_sync_s:.0f} s, partial-GPU lend "
        f"{hw.lend_s:g} s / reclaim {hw.reclaim_s:g} s; "
        f"{args.steps} steps, measured after {args.warmup}"
    )
    async_modes = [m for m in args.modes if m != "sync"]
    splits = {}
    for m in async_modes:
        splits[m], rates = best_split(w, m, args.split_devices, tuple(args.splits), **kw)
        print(f"split {m}: train share {splits[m]:.3f} ({', '.join(f'{f:.3f}: {r:.0f}' for f, r in rates.items())})")
    results = {}
    for n in args.devices:
        results[n, "sync"] = simulate(n, w, "sync", **kw)
        for m in async_modes:
            results[n, m] = simulate(n, w, m, train_fraction=splits[m], **kw)

    print(
        f"\n### {w.name}\n| devices | mode | train/infer | trained tokens/s (x sync) | samples/s (x sync) "
        "| wasted tokens | mean trained length (vs sync) | staleness mean/max (admission max) | token staleness "
        "| util infer/train | resumed requests | x plain | train devices generating: time, tokens | moved requests |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (n, m), r in results.items():
        base = results[n, "sync"]
        plain = results.get((n, m.replace(" partial-gpu", ""))) if MODES[m].partial_gpu else None
        lent = (
            f"| {r.tokens_per_s / plain.tokens_per_s:.2f}x | {r.util_lent:.0%}, {r.lent_token_frac:.0%} "
            f"| {r.moved_requests} |"
            if plain
            else "| | | |"
        )
        print(
            f"| {n} | {m} | {r.train_devices}/{r.infer_devices} "
            f"| {r.tokens_per_s:.0f} ({r.tokens_per_s / base.tokens_per_s:.2f}x) "
            f"| {r.samples_per_s:.2f} ({r.samples_per_s / base.samples_per_s:.2f}x) | {r.wasted_token_frac:.1%} "
            f"| {r.trained_mean_len:.0f} ({r.trained_mean_len / base.trained_mean_len - 1:+.1%}) "
            f"| {r.mean_staleness:.2f}/{r.max_staleness} ({r.max_admission_staleness}) | {r.token_staleness:.2f} "
            f"| {r.util_infer:.0%}/{r.util_train:.0%} | {r.resumed_requests} {lent}"
        )
    print(f"\n{PUBLISHED}")
    print(f"wall {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
