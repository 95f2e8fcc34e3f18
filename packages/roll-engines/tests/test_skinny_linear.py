"""Skinny linears (roll_engines.infer._skinny_linear): the decode-time operand order computes what F.linear does,
for every row count around its padding rules, falls back to F.linear outside its range and under autograd, and
is what the hf engine runs on CPU, without changing a generation."""

from __future__ import annotations

import pytest
import torch

from roll_core.interfaces import SamplingParams
from roll_engines.infer._skinny_linear import MAX_ROWS, _padded, skinny_forward, use_skinny_linears
from roll_engines.infer.hf import HFInferEngine


def _linear(n_in: int, n_out: int, bias: bool) -> torch.nn.Linear:
    torch.manual_seed(0)
    lin = torch.nn.Linear(n_in, n_out, bias=bias)
    assert use_skinny_linears(lin) == 1  # the binding the engine gets
    return lin


def test_padding_rules() -> None:
    assert [_padded(r) for r in (1, 2, 5, 8, 9, 15, 16, 17, 31, 32)] == [2, 2, 5, 8, 16, 16, 16, 24, 32, 32]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 15, 31, 32, 33, 100])
def test_equals_f_linear(rows: int, bias: bool) -> None:
    lin = _linear(48, 80, bias)
    x = torch.randn(rows, 1, 48)  # a decode step's (B, 1, hidden)
    with torch.no_grad():
        got = lin(x)
    want = torch.nn.functional.linear(x, lin.weight, lin.bias)
    assert got.shape == (rows, 1, 80) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if rows > MAX_ROWS:  # the plain kernel itself: bit for bit
        assert torch.equal(got, want)


def test_views_and_empty_inputs() -> None:
    lin = _linear(48, 80, True)
    base = torch.randn(6, 96)
    x = base[:, ::2]  # a strided view
    with torch.no_grad():
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        assert lin(torch.randn(0, 48)).shape == (0, 80)


def test_autograd_takes_f_linear() -> None:
    lin = _linear(48, 80, True)
    x = torch.randn(4, 48, requires_grad=True)
    y = lin(x)
    assert torch.equal(y, torch.nn.functional.linear(x, lin.weight, lin.bias))
    y.sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


def test_only_plain_float32_cpu_linears_switch() -> None:
    class Sub(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Sub(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    assert use_skinny_linears(model) == 1
    assert "forward" in model[0].__dict__ and "forward" not in model[1].__dict__ and "forward" not in model[2].__dict__


def test_a_switched_model_pickles() -> None:
    import pickle

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    assert use_skinny_linears(model) == 2
    again = pickle.loads(pickle.dumps(model))
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x))
    assert again[0].forward.func is skinny_forward and again[0].forward.args[0] is again[0]


def test_the_hf_engine_runs_them_and_generates_the_same(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLL_CPU_LINEAR", "mkl")  # where oneDNN computes fp32 linears, skinny rows are its tail only
    engine = HFInferEngine(tiny, max_new_tokens=24, num_threads=1)
    linears = [m for m in engine.model.modules() if type(m) is torch.nn.Linear]
    assert linears and all(m.forward.func is skinny_forward for m in linears)
    params = SamplingParams(max_new_tokens=24, seed=3, temperature=1.0)
    prompts = [[5, 6, 7, 8], [9, 10]]
    skinny = engine.generate(prompts, params, n=5)
    for m in linears:
        del m.forward  # back to nn.Linear.forward
    plain = engine.generate(prompts, params, n=5)
    assert torch.equal(skinny.responses, plain.responses)
    torch.testing.assert_close(skinny.logprobs, plain.logprobs, rtol=0, atol=1e-4)
