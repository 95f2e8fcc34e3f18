"""Benchmark: a weight sync into vLLM in the GPU's process layout (engine core in its own process) on CPU.

Runs in vLLM's venv (`nox -s vllm_venv`): `.venvs/vllm/bin/python bench/bench_vllm_sync.py`. A Qwen2-style model
built from a config (~110M parameters, fp32; nothing downloaded) is served by the `vllm` adapter twice, with the
engine core in this process (the CPU default) and in its own process (`VLLM_ENABLE_V1_MULTIPROCESSING=1`, what
every GPU run does). For each, one warm-up and `--runs` timed full syncs of the model in `--bucket-mb` buckets
(median seconds), the adapter process's peak RSS growth during a sync (sampled every 5 ms), and the staging buffer
the adapter holds. The baseline, from the same run: what the adapter staged before this change, a copy of every
tensor of the model in the adapter's process (its bytes), kept until the next sync.

    .venvs/vllm/bin/python bench/bench_vllm_sync.py              # 32 MiB buckets, 3 runs
    .venvs/vllm/bin/python bench/bench_vllm_sync.py --quick      # a 4-layer model, 1 run
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench_rollout import cpu_name


def _model(folder: str, layers: int) -> None:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from roll_core.models import resolve_model_path

    config = Qwen2Config(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    import torch

    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-wide"))
    tok.save_pretrained(folder)


def _one_layout(folder: str, bucket_mb: float, runs: int) -> dict[str, float]:
    """Runs in a fresh process (the layout is read from the environment when the engine starts)."""
    import psutil
    import torch

    from roll_core.cluster.weight_sync import buckets
    from roll_engines.infer.vllm import VLLMInferEngine

    engine = VLLMInferEngine(folder, max_model_len=512, kv_cache_gb=1, max_num_seqs=8)
    from transformers import AutoModelForCausalLM

    weights = [(k, v.detach()) for k, v in AutoModelForCausalLM.from_pretrained(folder).named_parameters()]
    model_bytes = sum(v.numel() * v.element_size() for _, v in weights)
    me = psutil.Process()

    def sync() -> int:
        peak, base, done = [0], me.memory_info().rss, threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], me.memory_info().rss - base)
                time.sleep(0.005)

        t = threading.Thread(target=sample)
        t.start()
        engine.begin_weight_update()
        for bucket in buckets(weights, int(bucket_mb * 2**20)):
            engine.update_weights(bucket)
        engine.finish_weight_update()
        done.set()
        t.join()
        return peak[0]

    sync()
    seconds, peaks = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        peaks.append(sync())
        seconds.append(time.perf_counter() - t0)
    out = {
        "seconds": statistics.median(seconds),
        "rss_growth": max(peaks),
        "staging": engine.last_sync["peak_buffer_bytes"],
        "model_bytes": model_bytes,
        "out_of_process": float(os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"),
    }
    engine.shutdown()
    del torch
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bucket-mb", type=float, default=32.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        folder, bucket_mb, runs = args._child
        print("RESULT", json.dumps(_one_layout(folder, float(bucket_mb), int(runs))), flush=True)
        return
    layers, runs = (4, 1) if args.quick else (12, args.runs)
    folder = tempfile.mkdtemp(prefix="roll-vllm-sync-")
    atexit.register(shutil.rmtree, folder, True)  # the model and vLLM's cache: gone with the table printed
    os.environ.setdefault("ROLL_CACHE_DIR", os.path.join(folder, "cache"))
    _model(os.path.join(folder, "model"), layers)
    print(
        f"CPU: {cpu_name()} ({os.cpu_count()} cores); {layers}-layer Qwen2 (hidden 768), fp32, "
        f"{args.bucket_mb:g} MiB buckets, {runs} runs"
    )
    rows = []
    for mp in ("0", "1"):
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": mp}
        cmd = [sys.executable, __file__, "--_child", os.path.join(folder, "model"), str(args.bucket_mb), str(runs)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"layout MP={mp} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        rows.append(json.loads(line[len("RESULT ") :]))
    model = rows[0]["model_bytes"]
    head = f"{'engine core':<16} {'sync s':>7} {'GB/s':>6} {'staging MB':>11} {'RSS +MB':>8}"
    print(f"\n{head} {'before: staged MB':>18}")
    for r in rows:
        where = "own process" if r["out_of_process"] else "in-process"
        print(
            f"{where:<16} {r['seconds']:7.3f} {model / r['seconds'] / 1e9:6.2f} {r['staging'] / 1e6:11.1f} "
            f"{r['rss_growth'] / 1e6:8.1f} {model / 1e6:18.1f}"
        )
    print(f"staging vs before (a full copy kept in the adapter): {rows[1]['staging'] / model:.3f}x of the bytes")


if __name__ == "__main__":
    main()
