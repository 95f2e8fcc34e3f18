"""Benchmark: rollout tokens/s of the inference engines on the quickstart model and batch, against this machine's
compute limit measured in the same run.

Workload (the quickstart's rollout): SmolLM2-135M-Instruct fp32, 4 chat-templated arithmetic prompts with one
worked example (~95 tokens) x 8 samples, temperature 1, 48 new tokens each (EOS ignored, so every engine generates
the same number of tokens). Each engine runs one warm-up call and `--runs` timed calls; the median counts.

Engines: `generate` (transformers' `model.generate` with `output_logits`, what roll's hf engine used before: the
baseline), `hf` (roll's continuous-batching engine), `vllm` (vLLM's CPU build in its own venv, run as a
subprocess with that venv's Python: `--vllm-python .venvs/vllm/bin/python`, default when that venv exists; eager,
roll's default) and `vllm-compiled` (the same with `enforce_eager=False`: vLLM compiles the model with
torch.compile at start-up, 1-2 minutes on 2 cores; ask for it with `--engines vllm,vllm-compiled`).

Limit: a decoder forward costs ~2 x params FLOPs per generated token, so limit tok/s = matmul GFLOP/s / (2 x params),
with the matmul rate measured here at a square 2048 shape (peak) and at the decode shape (32 rows x hidden into
the vocabulary, the largest matmul of a decode step), each the faster of torch's matmul (MKL in fp32) and oneDNN's
inner product (twice MKL's fp32 rate on AMD CPUs with AVX-512).

Ceiling: how fast decode could go if a step were its linear layers and nothing else. The bench loads the model,
gives it the hf engine's own kernels (roll_hw.cpu.fp32_linear_library(): oneDNN with prepacked weights, or MKL
with the skinny product) and times every nn.Linear of the model once per step, in model order, on (rows,
in_features) inputs: the weights of a real model do not fit in the caches, so each step streams them from memory
as a decode step does. No attention, KV cache, sampling or Python; an engine cannot beat it at that row count.
Usage:

    python bench/bench_rollout.py                 # all engines available here
    python bench/bench_rollout.py --quick         # tiny-wide model, 1 run (smoke test)
    python bench/bench_rollout.py --dtype bfloat16   # bf16 engines, limits from bf16 matmul rates
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from _cells import emit, run_cell

ROOT = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def matmul_gflops(
    m: int, k: int, n: int, seconds: float = 2.0, dtype: str = "float32", library: str = "torch"
) -> float:
    """GFLOP/s of an (m, k) x (k, n) product: `torch` (torch's matmul: MKL for fp32 on CPU) or `onednn` (oneDNN's
    inner product, what roll's CPU engines use for fp32 where roll_hw.cpu.fp32_linear_library() says so)."""
    import torch

    a = torch.randn(m, k, dtype=getattr(torch, dtype))
    if library == "onednn":
        w = torch.randn(n, k, dtype=a.dtype)
        op = torch.ops.mkldnn._linear_pointwise

        def product():
            return op(a, w, None, "none", [], "")
    else:
        b = torch.randn(k, n, dtype=a.dtype)

        def product():
            return a @ b

    return 2 * m * k * n * calls_per_second(product, seconds, warmup=3) / 1e9


def calls_per_second(fn, seconds: float, warmup: int) -> float:
    """How often `fn()` runs per second, over `seconds` after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        count += 1
    return count / (time.perf_counter() - t0)


def best_matmul_gflops(m: int, k: int, n: int, dtype: str = "float32") -> tuple[float, dict[str, float]]:
    """The machine's matmul rate at this shape: the faster of torch's matmul and oneDNN's inner product (on AMD
    CPUs MKL's fp32 kernels reach about half of what oneDNN does), with both rates."""

    rates = {"torch": matmul_gflops(m, k, n, dtype=dtype)}
    try:
        rates["onednn"] = matmul_gflops(m, k, n, dtype=dtype, library="onednn")
    except (AttributeError, RuntimeError) as exc:  # a torch without the op, or a dtype oneDNN lacks on this CPU
        print(f"oneDNN matmul not measured: {exc}")
    return max(rates.values()), rates


def linear_ceiling(path: str, rows: int, dtype: str, seconds: float = 2.0) -> float:
    """Generated tokens/s at `rows` rows in flight if a decode step cost only its linear layers (the module
    docstring's ceiling), with the hf engine's CPU kernels for this machine."""
    import torch
    from transformers import AutoModelForCausalLM

    from roll_engines._onednn_linear import drop_packed
    from roll_engines.infer.hf import use_cpu_kernels

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    for p in model.parameters():  # private copies, as the engine keeps (not memory-mapped from the checkpoint)
        p.data = p.data.clone()
    use_cpu_kernels(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=model.dtype) for m in linears}

    def step() -> None:
        for m in linears:
            m(inputs[m.in_features])

    with torch.no_grad():
        rate = rows * calls_per_second(step, seconds, warmup=2)
    drop_packed(model)  # free the blocked copies now, not when the collector breaks the forwards' cycle
    return rate


def workload(model: str) -> tuple[str, list[list[int]]]:
    from transformers import AutoTokenizer

    from roll_core.models import resolve_model_path
    from roll_envs.rewards.math import MathReward
    from roll_envs.tasks import ArithmeticTask

    path = resolve_model_path(model)
    tok = AutoTokenizer.from_pretrained(path)
    task = ArithmeticTask(MathReward(), digits=1, examples=1, train_size=100, eval_size=10, seed=0)
    prompts = []
    for p in task.train_set()[:4]:
        ids = tok.apply_chat_template(task.messages(p), add_generation_prompt=True, tokenize=True, return_dict=False)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return path, prompts


def time_calls(fn, runs: int) -> list[float]:
    fn()  # warm-up (allocations, lazy init)
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def run_generate(path: str, prompts: list[list[int]], n: int, max_new: int, runs: int, dtype: str) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    for p in model.parameters():  # resident copies, as roll's engine keeps them (see notes/cpu-engines.md)
        p.data = p.data.clone()
    rows = [p for p in prompts for _ in range(n)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    attn = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])

    def call() -> None:
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=attn,
                do_sample=True,
                temperature=1.0,
                top_k=None,
                top_p=1.0,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )

    return time_calls(call, runs)


def run_hf(path: str, prompts: list[list[int]], n: int, max_new: int, runs: int, dtype: str) -> list[float]:
    from roll_core.interfaces import SamplingParams
    from roll_engines.infer.hf import HFInferEngine

    engine = HFInferEngine(path, max_num_seqs=len(prompts) * n, dtype=dtype)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, ignore_eos=True, seed=0)
    return time_calls(lambda: engine.generate(prompts, params, n=n), runs)


def run_vllm(
    path: str, prompts: list[list[int]], n: int, max_new: int, runs: int, dtype: str, compiled: bool = False
) -> list[float]:
    from roll_core.interfaces import SamplingParams
    from roll_engines.infer.vllm import VLLMInferEngine

    engine = VLLMInferEngine(
        path,
        max_num_seqs=len(prompts) * n,
        max_model_len=512,
        cache_root=tempfile.mkdtemp(),
        dtype=dtype,
        enforce_eager=not compiled,  # compiled: vLLM's torch.compile of the model (inductor on CPU)
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, ignore_eos=True, seed=0)
    try:
        return time_calls(lambda: engine.generate(prompts, params, n=n), runs)
    finally:
        engine.shutdown()


ENGINES = {
    "generate": run_generate,
    "hf": run_hf,
    "vllm": run_vllm,
    "vllm-compiled": functools.partial(run_vllm, compiled=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--engines", default="generate,hf,vllm")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venvs" / "vllm" / "bin" / "python"))
    ap.add_argument("--quick", action="store_true", help="tiny-wide model, one timed run")
    # bfloat16: the engines' weights and the limits' matmul rates in bf16 (native on AMX / AVX512-BF16 CPUs only).
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # run one engine and print JSON (subprocess mode)
    ap.add_argument("--workload", help=argparse.SUPPRESS)  # JSON file with the model path and prompts
    args = ap.parse_args()
    if args.quick:
        args.model, args.runs = "builtin:tiny-wide", 1
    if args.worker:  # in the engine's venv, which need not have roll-envs: the parent wrote the prompts
        spec = json.loads(Path(args.workload).read_text())
        times = ENGINES[args.worker](spec["path"], spec["prompts"], args.n, args.max_new, args.runs, args.dtype)
        emit(times)
        return
    from roll_hw.cpu import bound_onednn_caches

    # As roll's engine processes run, set before this process's first oneDNN product (the peak below); vLLM's
    # cells get the environment without it (roll's vLLM engine does not set it in vLLM's processes).
    capped = bound_onednn_caches()
    vllm_env = {k: v for k, v in os.environ.items() if k not in capped}
    path, prompts = workload(args.model)
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    tokens = len(prompts) * args.n * args.max_new
    peak, peaks = best_matmul_gflops(2048, 2048, 2048, dtype=args.dtype)
    # The decode step's largest matmul: every running row's hidden state into the vocabulary.
    decode, decodes = best_matmul_gflops(len(prompts) * args.n, cfg.hidden_size, cfg.vocab_size, dtype=args.dtype)
    print(
        f"CPU: {cpu_name()} ({os.cpu_count()} cores), torch {torch.__version__}, "
        f"model {args.model} ({params / 1e6:.1f} M params)"
    )
    if args.dtype != "float32":
        from roll_hw.cpu import cpu_bf16_instructions

        fp32 = best_matmul_gflops(2048, 2048, 2048)[0]
        print(f"bf16 instructions: {cpu_bf16_instructions() or 'none (emulated)'}; fp32 peak {fp32:.1f} GFLOP/s")
    print(
        f"matmul {args.dtype}: {peak:.1f} GFLOP/s at 2048^3, {decode:.1f} GFLOP/s at decode shape (the faster library)"
    )
    for lib in peaks:
        print(f"  {lib:>6}: {peaks[lib]:.1f} GFLOP/s at 2048^3, {decodes[lib]:.1f} at decode shape")
    print(f"workload: {len(prompts)} prompts x {args.n} samples x {args.max_new} tokens = {tokens} tokens per call")
    limit_peak, limit_decode = peak * 1e9 / (2 * params), decode * 1e9 / (2 * params)
    print(f"limit: {limit_peak:.0f} tok/s at peak, {limit_decode:.0f} tok/s at the decode-shape rate")
    rows = len(prompts) * args.n
    ceiling = linear_ceiling(path, rows, args.dtype)
    print(
        f"ceiling: {ceiling:.0f} tok/s = {ceiling / limit_peak:.1%} of the peak limit: the linear layers alone at "
        f"{rows} rows, weights streamed from memory (the engine's kernels; no attention, sampling or Python)\n"
    )
    results = {}
    for name in args.engines.split(","):
        if name.startswith("vllm"):
            if not Path(args.vllm_python).exists():
                print(f"{name}: skipped ({args.vllm_python} missing: build it with `nox -s vllm_venv`)")
                continue
            spec = Path(tempfile.mkdtemp()) / "workload.json"
            spec.write_text(json.dumps({"path": path, "prompts": prompts}))
            cmd = [args.vllm_python, __file__, "--worker", name, "--workload", str(spec), "--n", str(args.n)]
            cmd += ["--max-new", str(args.max_new), "--runs", str(args.runs), "--dtype", args.dtype]
            times, why = run_cell(cmd, tail=2000, env=vllm_env)
            if times is None:
                print(f"{name}: {why}")
                continue
        else:
            times = ENGINES[name](path, prompts, args.n, args.max_new, args.runs, args.dtype)
        results[name] = tokens / statistics.median(times)
    base = results.get("generate")
    print(
        f"{'engine':<14} {'tok/s':>8} {'vs generate':>12} {'of peak limit':>14} {'of decode limit':>16} "
        f"{'of ceiling':>11}"
    )
    for name, rate in results.items():
        ratio = f"{rate / base:.2f}x" if base else "-"
        print(
            f"{name:<14} {rate:8.1f} {ratio:>12} {rate / limit_peak:14.1%} {rate / limit_decode:16.1%} "
            f"{rate / ceiling:11.1%}"
        )


if __name__ == "__main__":
    main()
