"""Benchmark: seconds and bytes of one trainer -> inference weight sync, for every CPU transport.

Setup: the `hf` train engine (1 rank) and the `hf` inference engine (1 worker) on the quickstart model
(SmolLM2-135M-Instruct fp32, 538 MB of unique tensors: the tied embedding travels once), in-process (`inprocess`,
cluster=local) and as Ray actors (`object_store`, `dist` over gloo). Each transport does one warm-up sync and
`--runs` timed syncs (median). The baseline is the pre-transport path measured in the same run: the trainer's
whole state dict copied to CPU and shipped as one object through Ray (what roll did before buckets).

    python bench/bench_weight_sync.py                 # 135M model, 256 MiB buckets
    python bench/bench_weight_sync.py --bucket-mb 32
    python bench/bench_weight_sync.py --quick         # tiny model (smoke test)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench_rollout import cpu_name


def timed(fn, runs: int) -> list[float]:
    fn()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.model, args.runs = "builtin:tiny", 1
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from roll_core.cluster.group import RayOptions
    from roll_core.cluster.roles import InferGroup, InferWorker, TrainGroup, TrainWorker
    from roll_core.cluster.weight_sync import WeightSync
    from roll_core.models import resolve_model_path
    from roll_engines.config import HFInferEngineConfig, HFTrainEngineConfig
    from roll_hw.cpu import CpuPlatform

    path = resolve_model_path(args.model)
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores); model {args.model}; buckets {args.bucket_mb:g} MiB")
    train_cfg, infer_cfg = vars(HFTrainEngineConfig()), vars(HFInferEngineConfig())
    rows: list[tuple[str, float, int, int]] = []

    def measure(backend: str, transports: list[str]) -> None:
        opts = RayOptions(num_cpus=0.5) if backend == "ray" else None
        kw = {"ray_options": opts} if opts else {}
        runtime = {"model_path": path, "num_threads": 1}
        train = TrainGroup(TrainWorker, 1, backend, engine=train_cfg, runtime={**runtime, "lr": 1e-6}, **kw)
        infer = InferGroup(InferWorker, 1, backend, engine=infer_cfg, runtime=runtime, **kw)
        try:
            for name in transports:
                sync = WeightSync(
                    train, infer, transport=name, bucket_mb=args.bucket_mb, placement="colocated", platform=CpuPlatform
                )
                stats = []
                times = timed(lambda s=sync, out=stats: out.append(s.sync(full=True)), args.runs)
                rows.append((name, statistics.median(times), stats[-1].bytes, stats[-1].buckets))
            if backend == "ray":  # the old path: one whole state dict through the object store

                def whole() -> None:
                    ref = train.submit(TrainWorker.get_weights).refs[0]
                    infer.begin_weight_update()
                    infer.call(InferWorker.receive_weights_object_store, [ref])
                    infer.finish_weight_update()

                # The whole dict arrives as one "bucket" holding every tensor.
                times = timed(whole, args.runs)
                rows.append(("whole state dict (before)", statistics.median(times), stats[-1].bytes, 1))
        finally:
            train.shutdown()
            infer.shutdown()

    measure("local", ["inprocess"])
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        measure("ray", ["object_store", "dist"])
    finally:
        ray.shutdown()
    base = next(t for n, t, _, _ in rows if n.startswith("whole"))
    print(f"\n{'transport':<28} {'seconds':>8} {'MB':>8} {'buckets':>8} {'GB/s':>6} {'vs before':>10}")
    for name, t, nbytes, nb in rows:
        print(f"{name:<28} {t:8.3f} {nbytes / 1e6:8.1f} {nb:8d} {nbytes / t / 1e9:6.2f} {base / t:9.2f}x")


if __name__ == "__main__":
    main()
