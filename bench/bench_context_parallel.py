"""Benchmark: activation memory and time of the megatron engine's context parallelism (`context_parallel_size`).

One long sequence (prompt + response) through `compute_gradients` (a forward and a backward, no optimizer step) of a
4-layer Qwen3-style model built from a config (hidden 256, 8 query / 2 key-value heads, a 32768-word vocabulary,
fp32), at CP=1 (one
process) and CP=2 (two processes over gloo, each rank holding half of the sequence), in the same run. What it
measures on every rank:

- activation bytes: the storages autograd saved for the backward during the forward (every tensor passed to
  `saved_tensors_hooks`, each storage counted once). With one micro-batch the whole forward's saves are alive
  when the backward starts, so this is the activation part of the peak memory. The attention scores, (S/CP) x S
  per head and layer, are what CP shrinks; keys and values are whole during each layer's attention;
- peak memory growth: the process's resident-set high-water mark during the call (reset just before it through
  `/proc/self/clear_refs`, after `malloc_trim`) minus its resident set before it. Unlike the saved activations
  this includes what lives only briefly (logits, their softmax, communication buffers); Linux only;
- wall seconds of the call (1 torch thread per process, so CP=2 uses 2 cores where CP=1 uses 1).

It prints CP=1/CP=2 ratios and checks that the two layouts' gradients agree. Usage:

    python bench/bench_context_parallel.py                   # S = 1024, 2048, 4096
    python bench/bench_context_parallel.py --lengths 512     # quicker
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rollout import cpu_name

RESPONSE = 64  # response tokens at the end of the sequence (the loss is on them; the prompt is the rest)


def build_model(folder: Path, vocab: int) -> str:
    """A 4-layer Qwen3 model from a config with a `vocab`-word vocabulary, saved as an HF folder (with the built-in
    tiny tokenizer: the engine never tokenizes here, the ids are random)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from roll_core.models import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny"))
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=16384,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def make_batch(length: int, vocab: int) -> dict[str, torch.Tensor]:
    """One row: `length - RESPONSE` prompt tokens then RESPONSE response tokens (random ids), advantage 1."""
    from roll_core.sequences import build_sequences

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (1, length - RESPONSE), generator=g)
    response = torch.randint(3, vocab, (1, RESPONSE), generator=g)
    mask = torch.ones_like(response)
    batch = build_sequences(prompt, torch.ones_like(prompt), response, mask)
    batch.update(prompts=prompt, responses=response, response_mask=mask, advantages=mask.float())
    return batch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> int:
    """Returns freed heap memory to the system (so the resident set is what is alive), then resets this process's
    resident-set high-water mark to its current size; returns that size in bytes."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS") * 1024


def _rank(rank: int, cp: int, port: int, path: str, length: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cp), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_engines.train.megatron.engine import MegatronTrainEngine

    engine = MegatronTrainEngine(
        path,
        lr=1e-3,
        micro_batch_size=1,
        context_parallel_size=cp,
        world_size=cp,
        dist_backend="gloo",
        num_threads=1,
        pack_sequences=False,
        use_distributed_optimizer=False,
    )
    batch = make_batch(length, engine.hf_config.vocab_size)
    objective = PolicyObjective(agg="token-mean")
    engine.compute_gradients(batch, objective)  # warm-up (allocations, TorchScript)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    before = _reset_peak_rss()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        grads = engine.compute_gradients(batch, objective)
    wall = time.perf_counter() - start
    peak = _status_kb("VmHWM") * 1024 - before
    result = {"saved_bytes": sum(seen.values()), "peak_bytes": peak, "wall_s": wall}
    if rank == 0:
        torch.save(grads, f"{out}.grads.pt")
    Path(f"{out}.{rank}.json").write_text(json.dumps(result))
    engine.shutdown()


def measure(cp: int, path: str, length: int, folder: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Per-rank results and rank 0's gradients of one CP layout."""
    out = str(folder / f"cp{cp}_s{length}")
    mp.spawn(_rank, args=(cp, _free_port(), path, length, out), nprocs=cp, join=True)
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(cp)]
    return ranks, torch.load(f"{out}.grads.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary size (Llama 2: 32000; Qwen: 151936)")
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}; 1 thread per process; "
          f"vocabulary {args.vocab}, response {RESPONSE} tokens")  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = build_model(folder / "model", args.vocab)
        for length in args.lengths:
            one, g1 = measure(1, path, length, folder)
            two, g2 = measure(2, path, length, folder)
            gap = max(float((g1[k] - g2[k]).abs().max() / g1[k].abs().max().clamp_min(1e-12)) for k in g1)
            mb1 = one[0]["saved_bytes"] / 2**20
            mb2 = max(r["saved_bytes"] for r in two) / 2**20
            p1 = one[0]["peak_bytes"] / 2**20
            p2 = max(r["peak_bytes"] for r in two) / 2**20
            s1, s2 = one[0]["wall_s"], max(r["wall_s"] for r in two)
            rows.append((length, mb1, mb2, p1, p2, s1, s2, gap))
            print(f"S={length}: done", flush=True)
    print()
    print("| sequence | CP=1 activations MB | CP=2 per rank | ratio | CP=1 peak growth MB | CP=2 per rank | ratio | "
          "CP=1 s | CP=2 s | ratio | largest relative gradient gap |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for length, mb1, mb2, p1, p2, s1, s2, gap in rows:
        print(f"| {length} | {mb1:.1f} | {mb2:.1f} | {mb1 / mb2:.2f}x | {p1:.1f} | {p2:.1f} | {p1 / p2:.2f}x | "
              f"{s1:.2f} | {s2:.2f} | {s1 / s2:.2f}x | {gap:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
