"""Benchmark: LoRA weight sync into vLLM, adapter alone (infer_engine.lora_sync=adapter) vs merged weights (default).

Runs in vLLM's venv (`nox -s vllm_venv`, with peft: roll-engines[lora]): `.venvs/vllm/bin/python
bench/bench_vllm_lora_sync.py`. For each model and mode a fresh process holds roll's hf trainer with LoRA (rank
`--rank`, alpha 2 x rank, "all-linear") and a `vllm` engine (CPU default layout: engine core in this process; fp32).
Each sync first perturbs every adapter matrix (seeded: both modes sync the same adapters), then moves what that mode
sends through the real trainer and engine calls: merged = `iter_weights(changed_only=True)` (W + scaling x B @ A of
every adapted layer, what LoRA runs sync after the first, full sync) in 32 MiB buckets into vLLM's layer-wise reload;
adapter = `iter_adapter()` into a peft folder in /dev/shm and vLLM's `add_lora`. Timed: the whole sync (trainer export,
buckets, engine load), median of `--runs` after a warm-up; bytes: what the trainer sent. Then rollout tokens/s
(16 prompts x 64 greedy tokens, median of 3; LoRA serving adds the adapter's matmuls to every step) and the greedy
log-probs of one prompt, compared across the modes (they must agree).

    .venvs/vllm/bin/python bench/bench_vllm_lora_sync.py                 # tiny-wide and SmolLM2-135M, 5 runs
    .venvs/vllm/bin/python bench/bench_vllm_lora_sync.py --quick         # tiny-wide only, 2 runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench_rollout import cpu_name


def _perturb(train: object, seed: int) -> None:
    """New adapter values (what a training step does to them), the same in every process for a seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(train.model.named_parameters()):  # type: ignore[attr-defined]
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def _one(model: str, mode: str, rank: int, runs: int) -> dict[str, float | list[float]]:
    """One model and mode in this (fresh) process."""
    import torch

    from roll_core.cluster.weight_sync import bucket_nbytes, buckets
    from roll_core.interfaces import SamplingParams
    from roll_core.models import resolve_model_path
    from roll_engines.infer.vllm import VLLMInferEngine
    from roll_engines.train.hf import HFTrainEngine

    path = resolve_model_path(model)
    train = HFTrainEngine(path, lr=1e-4, lora_rank=rank, lora_alpha=2.0 * rank)
    t0 = time.perf_counter()
    engine = VLLMInferEngine(
        path, max_model_len=512, kv_cache_gb=1, max_num_seqs=16, seed=0, lora_rank=rank if mode == "adapter" else 0
    )
    start_s = time.perf_counter() - t0
    dtype = engine.dtype

    def sync(seed: int) -> tuple[float, int]:
        _perturb(train, seed)
        t = time.perf_counter()
        named = train.iter_adapter() if mode == "adapter" else train.iter_weights(changed_only=True)
        named = ((k, v.to(dtype)) for k, v in named)  # the trainer casts to the engine's dtype (weight_buckets)
        sent = 0
        engine.begin_weight_update()
        for bucket in buckets(named, 32 * 2**20):
            sent += bucket_nbytes(bucket)
            engine.update_weights(bucket)
        engine.finish_weight_update()
        return time.perf_counter() - t, sent

    sync(0)  # warm-up
    timed = [sync(1 + i) for i in range(runs)]
    prompts = [[(7 * i + j) % 90 + 5 for j in range(24)] for i in range(16)]
    greedy = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
    engine.generate(prompts, greedy)
    rates = []
    for _ in range(3):
        out = engine.generate(prompts, greedy)
        rates.append(int(out.response_mask.sum()) / out.seconds)
    probe = engine.generate([prompts[0]], SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True))
    engine.shutdown()
    return {
        "start_s": start_s,
        "sync_s": statistics.median(s for s, _ in timed),
        "bytes": timed[0][1],
        "tok_s": statistics.median(rates),
        "logprobs": probe.logprobs[0].tolist(),
        "params": sum(p.numel() for n, p in train.model.named_parameters() if ".lora_" not in n),
        "dtype": str(dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default="builtin:tiny-wide,builtin:smollm2-135m")
    ap.add_argument("--_child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        model, mode, rank, runs = args._child
        print("RESULT", json.dumps(_one(model, mode, int(rank), int(runs))), flush=True)
        return
    models = ["builtin:tiny-wide"] if args.quick else args.models.split(",")
    runs = 2 if args.quick else args.runs
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores); LoRA rank {args.rank} all-linear, {runs} timed syncs")
    print(f"{'model':<22} {'mode':<8} {'sync s':>8} {'MB sent':>9} {'rollout tok/s':>14} {'start s':>8}")
    for model in models:
        rows = {}
        for mode in ("merged", "adapter"):
            cmd = [sys.executable, __file__, "--_child", model, mode, str(args.rank), str(runs)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{model} {mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            r = rows[mode] = json.loads(line[len("RESULT ") :])
            print(
                f"{model:<22} {mode:<8} {r['sync_s']:8.3f} {r['bytes'] / 1e6:9.2f} {r['tok_s']:14.1f} "
                f"{r['start_s']:8.1f}"
            )
        m, a = rows["merged"], rows["adapter"]
        diff = max(abs(x - y) for x, y in zip(m["logprobs"], a["logprobs"], strict=True))
        print(
            f"  {model}: {m['params'] / 1e6:.1f}M params, {m['dtype']}; adapter vs merged: sync "
            f"{m['sync_s'] / a['sync_s']:.1f}x faster, {m['bytes'] / a['bytes']:.1f}x fewer bytes, rollout "
            f"{a['tok_s'] / m['tok_s']:.2f}x tok/s; greedy log-probs max |diff| {diff:.2e}"
        )


if __name__ == "__main__":
    main()
