"""oneDNN fp32 linears (roll_engines._onednn_linear): forward and all three gradients equal F.linear's, the kernel
really runs (a counting spy), everything outside its cover falls back to F.linear, the infer engine's last rows go
to the skinny product, and both hf engines switch their linears when roll_hw picks oneDNN and keep computing
what the MKL path computes (log-probs, gradients, generations); bf16 inference layers run on prepacked weights that
follow every weight write, in the engine too."""

from __future__ import annotations

import functools
import os
import pickle
import subprocess
import sys

import pytest
import torch

import roll_engines._onednn_linear as O
from roll_core.interfaces import SamplingParams
from roll_core.pipelines.objectives import PolicyObjective
from roll_core.protocol import build_sequences, pad_left
from roll_engines.infer._skinny_linear import skinny_forward
from roll_engines.infer.hf import HFInferEngine
from roll_engines.train.hf import HFTrainEngine

pytestmark = pytest.mark.skipif(O.onednn_linear_op() is None, reason="this torch has no oneDNN inner product")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Counts every oneDNN product (forward and backward) by the shapes it multiplies."""
    seen: list[tuple] = []
    real = O._FWD

    def spy(x, w, b, *rest):
        seen.append((tuple(x.shape), tuple(w.shape)))
        return real(x, w, b, *rest)

    monkeypatch.setattr(O, "_FWD", spy)
    return seen


def _pair(n_in: int, n_out: int, bias: bool, skinny_rows: int = 0) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(n_in, n_out, bias=bias)
    ref = torch.nn.Linear(n_in, n_out, bias=bias)
    ref.load_state_dict(lin.state_dict())
    assert O.use_onednn_linears(lin, skinny_rows=skinny_rows) == 1
    return lin, ref


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (3, 7, 48), (70, 48), (2, 33, 48)])
def test_forward_and_gradients_equal_f_linear(shape: tuple, bias: bool, calls: list) -> None:
    lin, ref = _pair(48, 80, bias)
    x = torch.randn(*shape, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = lin(x), ref(x_ref)
    assert y.shape == (*shape[:-1], 80)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(lin.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)
    rows = x.numel() // 48
    # forward, dX = dY W (W^T laid out as the kernel's weight), dW = dY^T X: three oneDNN products
    assert calls == [(shape, (80, 48)), ((rows, 80), (48, 80)), ((80, rows), (48, rows))]


def test_a_large_output_gradient_is_not_transposed(calls: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(O, "TRANSPOSE_LIMIT", 20 * 80 - 1)  # 20 rows x 80 outputs: one past the limit
    lin, ref = _pair(48, 80, False)
    # the input needs no gradient: forward and dW through oneDNN at 19 rows, the forward only at 20 (dW: MKL)
    for rows, products in ((19, 2), (20, 1)):
        calls.clear()
        lin.weight.grad = ref.weight.grad = None
        x = torch.randn(rows, 48)
        lin(x).square().sum().backward()
        ref(x).square().sum().backward()
        torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
        assert len(calls) == products


def test_only_the_gradients_asked_for(calls: list) -> None:
    lin, _ = _pair(16, 8, True)
    lin.weight.requires_grad_(False)  # a frozen base (LoRA): no dW product
    x = torch.randn(4, 16, requires_grad=True)
    lin(x).sum().backward()
    assert lin.weight.grad is None and lin.bias.grad is not None and x.grad is not None
    assert len(calls) == 2
    calls.clear()
    lin.weight.requires_grad_(True)
    lin(torch.randn(4, 16)).sum().backward()  # the input needs none: dW only
    assert len(calls) == 2 and lin.weight.grad is not None


def test_strided_inputs(calls: list) -> None:
    lin, ref = _pair(48, 80, True)
    base = torch.randn(6, 96)
    x = base[:, ::2]
    with torch.no_grad():
        torch.testing.assert_close(lin(x), ref(x), rtol=1e-5, atol=1e-5)
        xt = torch.randn(5, 3, 48).transpose(0, 1)
        torch.testing.assert_close(lin(xt), ref(xt), rtol=1e-5, atol=1e-5)
    assert len(calls) == 2


def test_outside_the_cover_f_linear_runs(calls: list) -> None:
    lin, ref = _pair(16, 8, True)
    with torch.no_grad():
        assert lin(torch.randn(0, 16)).shape == (0, 8)
        v = torch.randn(16)  # 1-D
        torch.testing.assert_close(lin(v), ref(v))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert lin(torch.randn(4, 16)).dtype == torch.bfloat16
        lin.double()  # switched while fp32, then cast
        assert lin(torch.randn(4, 16, dtype=torch.float64)).dtype == torch.float64
        lin.float()
        lin.weight = torch.nn.Parameter(lin.weight.detach().t().contiguous().t())  # a transposed view
        x = torch.randn(4, 16)
        torch.testing.assert_close(lin(x), ref(x))
        lin.weight = torch.nn.Parameter(ref.weight.detach().clone())
        lin.bias = torch.nn.Parameter(torch.randn(24)[::3])  # a strided bias: the kernel would read it as dense
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        lin.bias = ref.bias
        torch._C._set_mkldnn_enabled(False)  # what torch.backends.mkldnn.flags(enabled=False) sets
        try:
            torch.testing.assert_close(lin(x), ref(x))
        finally:
            torch._C._set_mkldnn_enabled(True)
    assert calls == []
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))

    class Sub(torch.nn.Linear):
        pass

    model.append(Sub(4, 4))
    assert O.use_onednn_linears(model) == 1 and "forward" in model[0].__dict__
    assert "forward" not in model[1].__dict__ and "forward" not in model[2].__dict__


def test_no_grad_rows_up_to_skinny_rows_take_the_skinny_product(calls: list, monkeypatch: pytest.MonkeyPatch) -> None:
    import roll_engines.infer._skinny_linear as S

    skinny: list[int] = []
    real = S.skinny_forward
    monkeypatch.setattr(S, "skinny_forward", lambda m, x: skinny.append(x.shape[0]) or real(m, x))
    lin, ref = _pair(48, 80, False, skinny_rows=4)
    with torch.no_grad():
        for rows in (1, 4, 5, 32):
            x = torch.randn(rows, 1, 48)
            torch.testing.assert_close(lin(x), ref(x), rtol=1e-5, atol=1e-5)
    assert skinny == [1, 4] and [c[0][0] for c in calls] == [5, 32]


def test_prepacked_weights_follow_every_write_and_replacement(calls: list) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 80)
    assert O.use_onednn_linears(lin, skinny_rows=4, prepack=True) == 1
    x = torch.randn(3, 7, 48)

    def check() -> None:
        with torch.no_grad():
            want = torch.nn.functional.linear(x, lin.weight, lin.bias)
            torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)

    check()
    packed = O._PACKED[lin][1]
    assert packed.is_mkldnn and calls[-1][1] == (80, 48)
    check()
    assert O._PACKED[lin][1] is packed  # reused while the weight is unchanged
    with torch.no_grad():
        lin.weight.copy_(torch.randn(80, 48))  # a weight sync writes in place
    check()
    assert O._PACKED[lin][1] is not packed
    lin.weight = torch.nn.Parameter(torch.randn(80, 48))  # or replaces the parameter
    check()
    with torch.no_grad():
        lin.weight.mul_(2)
    check()
    y = lin(x.requires_grad_(True))  # autograd never reads the packed copy
    y.sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    assert "_PACKED" not in str(lin.state_dict().keys())


def test_prepacking_stops_at_its_size_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(O, "PREPACK_MAX_BYTES", 48 * 80 * 4 - 1)
    lin = torch.nn.Linear(48, 80)
    O.use_onednn_linears(lin, prepack=True)
    assert lin.forward.keywords["prepack"] is False
    monkeypatch.setattr(O, "PREPACK_MAX_BYTES", 48 * 80 * 4)
    O.use_onednn_linears(lin, prepack=True)
    assert lin.forward.keywords["prepack"] is True


def test_a_switched_model_pickles() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    assert O.use_onednn_linears(model, skinny_rows=4, prepack=True) == 2
    with torch.no_grad():
        model(torch.randn(9, 8))  # packed copies exist; they stay out of the pickle
    again = pickle.loads(pickle.dumps(model))
    assert again[0].forward.func is O.onednn_forward and again[0].forward.args[0] is again[0]
    x = torch.randn(9, 8)
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x))


def test_an_unpickled_model_runs_in_a_fresh_process(tmp_path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    assert O.use_onednn_linears(model) == 2
    x = torch.randn(9, 8)
    with torch.no_grad():
        want = model(x)
    torch.save({"model": model, "x": x, "want": want}, tmp_path / "m.pt")
    code = (
        "import sys, torch; d = torch.load(sys.argv[1], weights_only=False); m = d['model']\n"
        "assert m[0].forward.func.__name__ == 'onednn_forward'\n"
        "with torch.no_grad(): torch.testing.assert_close(m(d['x']), d['want'])\n"
        "y = m(d['x'].requires_grad_(True)); y.sum().backward(); assert m[0].weight.grad is not None\n"
        "import roll_engines._onednn_linear as O; assert O._FWD, 'F.linear ran, not oneDNN'; print('ok')"
    )
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.pt")], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_a_second_derivative_is_refused_not_zero() -> None:
    lin, _ = _pair(6, 4, True)
    x = torch.randn(3, 6, requires_grad=True)
    (g,) = torch.autograd.grad(lin(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()


def _switched(model: torch.nn.Module) -> list[bool]:
    return [
        isinstance(m.forward, functools.partial) and m.forward.func is O.onednn_forward
        for m in model.modules()
        if type(m) is torch.nn.Linear
    ]


def test_the_hf_engines_switch_and_compute_what_mkl_computes(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLL_CPU_LINEAR", "mkl")
    infer_mkl = HFInferEngine(tiny, max_new_tokens=12, num_threads=1)
    train_mkl = HFTrainEngine(tiny, micro_batch_size=3, num_threads=1)
    assert not any(_switched(infer_mkl.model)) and not any(_switched(train_mkl.model))
    assert all(m.forward.func is skinny_forward for m in infer_mkl.model.modules() if type(m) is torch.nn.Linear)
    monkeypatch.setenv("ROLL_CPU_LINEAR", "onednn")
    infer = HFInferEngine(tiny, max_new_tokens=12, num_threads=1)
    train = HFTrainEngine(tiny, micro_batch_size=3, num_threads=1)
    for model in (infer.model, train.model):
        assert _switched(model) and all(_switched(model))
    prepacked = {m.forward.keywords["prepack"] for m in infer.model.modules() if type(m) is torch.nn.Linear}
    assert prepacked == {True}  # the rollout's weights are packed; the trainer's change every step
    assert {m.forward.keywords["prepack"] for m in train.model.modules() if type(m) is torch.nn.Linear} == {False}

    prompts = [[5, 6, 7, 8], [9, 10]]
    params = SamplingParams(max_new_tokens=12, seed=3, temperature=1.0)
    gen = infer.generate(prompts, params, n=3)

    p_ids, p_mask = pad_left([p for p in prompts for _ in range(3)], infer.pad_id)
    batch = build_sequences(p_ids, p_mask, gen.responses, gen.response_mask)
    batch.update(responses=gen.responses, response_mask=gen.response_mask, behaviour_logprobs=gen.logprobs)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(1))
    batch["advantages"] *= batch["response_mask"]
    mask = batch["response_mask"]
    # the oneDNN sampler's log-probs are what the MKL trainer and the oneDNN trainer compute on its samples
    for trainer in (train_mkl, train):
        lp = trainer.compute_logprobs(batch, temperature=1.0)["logprobs"]
        torch.testing.assert_close(lp * mask, gen.logprobs, rtol=1e-4, atol=2e-4)
    grads = train.compute_gradients(batch, PolicyObjective())
    grads_mkl = train_mkl.compute_gradients(batch, PolicyObjective())
    assert grads.keys() == grads_mkl.keys() and any(g.abs().sum() > 0 for g in grads.values())
    for name in grads:
        torch.testing.assert_close(grads[name], grads_mkl[name], rtol=1e-4, atol=1e-5, msg=name)


_GROWTH = """
import random, sys, torch
import roll_hw.cpu
if sys.argv[1] == "bound":
    roll_hw.cpu.ONEDNN_CACHE_ENTRIES = 8  # the engines' 32, smaller: fewer shapes show the same
    roll_hw.cpu.bound_onednn_caches()
from roll_engines._onednn_linear import OneDNNLinear
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
w = torch.randn(1536, 576, requires_grad=True)
random.seed(0)
OneDNNLinear.apply(torch.randn(64, 576), w, None).sum().backward()
before = rss()
for _ in range(40):  # micro-batches of new token counts: a new shape for every product
    x = torch.randn(random.randint(300, 1500), 576, requires_grad=True)
    OneDNNLinear.apply(x, w, None).sum().backward()
print(rss() - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set from /proc")
def test_bounded_caches_keep_memory_flat_over_new_shapes() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}

    def growth(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", _GROWTH, mode], env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        return int(run.stdout.split()[-1])

    bound, default = growth("bound"), growth("default")
    # the default capacities keep every shape's buffers; 8 entries keep a few
    assert default > 3 * max(bound, 16 * 2**20), (bound, default)


def _native_bf16() -> bool:
    from roll_hw.cpu import cpu_bf16_instructions

    return cpu_bf16_instructions() is not None


@pytest.mark.skipif(not _native_bf16(), reason="bf16 is emulated on this CPU (no AMX or AVX512-BF16)")
def test_bf16_inference_linears_run_on_packed_weights_and_follow_writes(calls: list) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 80), torch.nn.ReLU(), torch.nn.Linear(80, 8, bias=False))
    assert O.use_packed_bf16_linears(model) == 0  # fp32 layers are not this switch's
    model = model.to(torch.bfloat16)
    assert O.use_packed_bf16_linears(model) == 2
    lin = model[0]
    x = torch.randn(5, 48).to(torch.bfloat16)

    def check() -> None:
        with torch.no_grad():
            want = torch.nn.functional.linear(x, lin.weight, lin.bias)
            got = lin(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want)  # bf16 tolerances; equal in every case measured

    check()
    assert calls[-1] == ((5, 48), (80, 48)) and O._PACKED[lin][1].is_mkldnn
    packed = O._PACKED[lin][1]
    with torch.no_grad():
        lin.weight.copy_(torch.randn(80, 48))  # a weight sync
    check()
    assert O._PACKED[lin][1] is not packed
    n = len(calls)
    w = lin.weight.detach().clone().requires_grad_(True)
    lin.weight = torch.nn.Parameter(w)  # a trainable weight: autograd through F.linear, not the packed copy
    y = lin(x)
    y.float().sum().backward()
    assert len(calls) == n and lin.weight.grad is not None
    with torch.no_grad():  # outside the cover (fp32 input): F.linear's dtype error, as an unswitched layer gives
        with pytest.raises(RuntimeError):
            lin(x.float())


def test_the_hf_infer_engine_packs_bf16_weights_where_the_cpu_runs_bf16(tiny: str) -> None:
    eng = HFInferEngine(tiny, dtype="bfloat16", max_new_tokens=8, num_threads=1)
    switched = {getattr(m.forward, "func", None) for m in eng.model.modules() if type(m) is torch.nn.Linear}
    assert switched == ({O.packed_bf16_forward} if _native_bf16() else {None})
    prompts = [[5, 6, 7, 8], [9, 10]]
    params = SamplingParams(max_new_tokens=8, seed=3, temperature=1.0)
    before = eng.generate(prompts, params, n=2)
    # A weight update (what a sync writes) must reach the packed copies: the engine then samples as an engine
    # loaded with the new weights does.
    new = {k: v * 1.5 for k, v in eng.model.state_dict().items()}
    eng.load_weights(new)
    after = eng.generate(prompts, params, n=2)
    fresh = HFInferEngine(tiny, dtype="bfloat16", max_new_tokens=8, num_threads=1)
    fresh.model.load_state_dict(new)
    want = fresh.generate(prompts, params, n=2)
    assert torch.equal(after.responses, want.responses) and torch.equal(after.logprobs, want.logprobs)
    assert not torch.equal(before.logprobs, after.logprobs)


def test_packed_copies_count_as_weights_and_go_when_the_engine_sleeps(
    tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLL_CPU_LINEAR", "onednn")
    eng = HFInferEngine(tiny, max_new_tokens=6, num_threads=1)
    params = sum(p.numel() * 4 for p in eng.model.parameters())
    linears = sum(m.weight.numel() * 4 for m in eng.model.modules() if type(m) is torch.nn.Linear)
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    before = eng.generate([[5, 6, 7, 8, 9]], greedy).responses  # 5 rows > SKINNY_ROWS: the prefill packs
    assert O.packed_bytes(eng.model) > 0
    assert eng.memory_bytes()["weights"] >= params + O.packed_bytes(eng.model)
    assert O.packed_bytes(eng.model) <= linears
    state = {k: v.clone() for k, v in eng.model.state_dict().items()}
    eng.load_weights(state)  # a sync: the copies are dropped, packed afresh at the next product
    assert O.packed_bytes(eng.model) == 0
    assert torch.equal(eng.generate([[5, 6, 7, 8, 9]], greedy).responses, before)
    assert O.packed_bytes(eng.model) > 0
    eng.sleep(level=2)
    assert O.packed_bytes(eng.model) == 0 and eng.memory_bytes()["weights"] < params / 10
    eng.wake_up()
    eng.load_weights(state)
    assert torch.equal(eng.generate([[5, 6, 7, 8, 9]], greedy).responses, before)


def test_shutdown_frees_the_packed_copies(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLL_CPU_LINEAR", "onednn")
    eng = HFInferEngine(tiny, max_new_tokens=4, num_threads=1)
    eng.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_new_tokens=4))
    assert O.packed_bytes(eng.model) > 0
    eng.shutdown()
    assert O.packed_bytes(eng.model) == 0
