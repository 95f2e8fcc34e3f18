"""Benchmark: would a compiled decode step, or fused sibling products, make the hf engine's decode cheaper on CPU?

Issue 28 asks for "a compiled or static-cache step where it pays on CPU". Two measurements on SmolLM2-135M's real
weights (all 30 layers, so weights stream from memory as in a real step), fp32, no-grad:

1. `compiled`: one decoder layer written out in plain torch (RMSNorm, q/k/v products, rotary, the new key and
   value written into a preallocated cache, SDPA over the filled part, o product, residual, RMSNorm, SiLU-gated
   MLP), run eager and through `torch.compile(dynamic=True)` (inductor), layer after layer. The products are
   oneDNN's (the engine's fp32 kernel here) in both, as an opaque custom op: inductor's own lowering of the oneDNN
   op fails, and its plain `mm` is MKL's, half oneDNN's rate on AMD. So the ratio is what fusing everything *but*
   the products (norms, rotary, the cache write, the gating, the residuals) and dropping Python overhead gives.
2. `fused`: the seven products of a layer (q, k, v, o, gate, up, down) against four (q|k|v and gate|up as single
   products over concatenated weights, as vLLM's QKVParallelLinear and MergedColumnParallelLinear), with the
   engine's kernel choice: the skinny operand order up to 4 rows, prepacked oneDNN above.

    python bench/bench_decode_step.py                 # rows 4 and 32 compiled; 1..64 rows fused
    python bench/bench_decode_step.py --rows 8 16 --skip-fused
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from bench_rollout import cpu_name


def layer_weights(path: str) -> tuple[list[dict[str, torch.Tensor]], object]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layers = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        w = {"n1": layer.input_layernorm.weight, "n2": layer.post_attention_layernorm.weight}
        w.update(q=a.q_proj.weight, k=a.k_proj.weight, v=a.v_proj.weight, o=a.o_proj.weight)
        w.update(g=m.gate_proj.weight, u=m.up_proj.weight, d=m.down_proj.weight)
        layers.append({k: v.detach() for k, v in w.items()})
    return layers, model.config


def oneDNN_op():
    """The oneDNN product as a custom op inductor leaves alone: x (..., in), w (out, in) -> (..., out)."""
    lin = torch.ops.mkldnn._linear_pointwise

    @torch.library.custom_op("roll_bench::linear", mutates_args=())
    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return lin(x, w, None, "none", [], "")

    @linear.register_fake
    def _(x, w):
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    return linear


def compiled_vs_eager(layers, cfg, rows: int, steps: int) -> tuple[float, float, float]:
    """(eager ms/step, compiled ms/step, compile s) over all layers at `rows` rows and ~130 cached positions."""
    lin = oneDNN_op()
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // heads
    eps, half = cfg.rms_norm_eps, d // 2

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rot(x, cos, sin):
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    def layer(h, w, kb, vb, pos: int, cos, sin):
        x = rms(h, w["n1"])
        q = lin(x, w["q"]).view(rows, 1, heads, d).transpose(1, 2)
        k = lin(x, w["k"]).view(rows, 1, kv, d).transpose(1, 2)
        v = lin(x, w["v"]).view(rows, 1, kv, d).transpose(1, 2)
        q, k = rot(q, cos, sin), rot(k, cos, sin)
        kb[:, :, pos : pos + 1] = k
        vb[:, :, pos : pos + 1] = v
        o = F.scaled_dot_product_attention(q, kb[:, :, : pos + 1], vb[:, :, : pos + 1], enable_gqa=True)
        h = h + lin(o.transpose(1, 2).reshape(rows, 1, heads * d), w["o"])
        x = rms(h, w["n2"])
        return h + lin(F.silu(lin(x, w["g"])) * lin(x, w["u"]), w["d"])

    caches = [(torch.randn(rows, kv, 256, d), torch.randn(rows, kv, 256, d)) for _ in layers]
    cos, sin = torch.randn(rows, 1, 1, d), torch.randn(rows, 1, 1, d)

    def step(fn, pos: int) -> None:
        h = torch.randn(rows, 1, cfg.hidden_size)
        for w, (kb, vb) in zip(layers, caches):
            h = fn(h, w, kb, vb, pos, cos, sin)

    def ms_per_step(fn) -> float:
        for i in range(3):
            step(fn, 130 + i)
        t0 = time.perf_counter()
        for i in range(steps):
            step(fn, 130 + i % 40)
        return (time.perf_counter() - t0) / steps * 1e3

    torch._dynamo.config.cache_size_limit = 64
    compiled = torch.compile(layer, dynamic=True)
    t0 = time.perf_counter()
    step(compiled, 130)
    step(compiled, 131)
    compile_s = time.perf_counter() - t0
    eager = min(ms_per_step(layer) for _ in range(3))
    comp = min(ms_per_step(compiled) for _ in range(3))
    return eager, comp, compile_s


def fused_vs_separate(layers, rows: int, repeats: int = 10) -> tuple[float, float]:
    """(separate ms, fused ms) for every layer's products at `rows` rows, the engine's kernel per row count."""
    op = torch.ops.mkldnn._linear_pointwise
    weights = []
    for w in layers:
        ws = {n: w[n] for n in "qkvogud"}
        ws["qkv"], ws["gu"] = torch.cat([w["q"], w["k"], w["v"]]), torch.cat([w["g"], w["u"]])
        packed = {n: torch.ops.mkldnn._reorder_linear_weight(t, None) for n, t in ws.items()}
        weights.append((ws, packed))
    n = max(rows, 2)  # one row runs as two (roll_engines.infer._skinny_linear)
    x, xd = torch.randn(n, layers[0]["q"].shape[1]), torch.randn(n, layers[0]["d"].shape[1])

    def run(names: list[str]) -> None:
        for ws, packed in weights:
            for name in names:
                inp = xd if name == "d" else x
                if rows <= 4:
                    torch.mm(ws[name], inp.t()).t().contiguous()
                else:
                    op(inp, packed[name], None, "none", [], "")

    def ms(names: list[str]) -> float:
        run(names)
        t0 = time.perf_counter()
        for _ in range(repeats):
            run(names)
        return (time.perf_counter() - t0) / repeats * 1e3

    separate, fused = list("qkvogud"), ["qkv", "o", "gu", "d"]
    return min(ms(separate) for _ in range(3)), min(ms(fused) for _ in range(3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 32], help="rows for the compiled comparison")
    ap.add_argument("--fused-rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip-fused", action="store_true")
    args = ap.parse_args()
    from roll_core.models import resolve_model_path

    torch.set_grad_enabled(False)
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, fp32\n")
    layers, cfg = layer_weights(resolve_model_path(args.model))
    print("compiled decode layer (inductor, dynamic shapes) vs the same layer eager, all layers per step:")
    for rows in args.rows:
        eager, comp, compile_s = compiled_vs_eager(layers, cfg, rows, args.steps)
        print(
            f"  rows {rows:3d}: eager {eager:6.1f} ms  compiled {comp:6.1f} ms  "
            f"compiled speed-up {eager / comp:.2f}x  (compile {compile_s:.0f} s)",
            flush=True,
        )
    if args.skip_fused:
        return
    print("\nproducts per step, 7 per layer vs q|k|v and gate|up fused (4 per layer):")
    for rows in args.fused_rows:
        sep, fused = fused_vs_separate(layers, rows)
        print(f"  rows {rows:3d}: separate {sep:6.2f} ms  fused {fused:6.2f} ms  {sep / fused:.2f}x", flush=True)


if __name__ == "__main__":
    main()
