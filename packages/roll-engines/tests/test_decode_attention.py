"""The hf infer engine's decode-step attention (roll_engines.infer._decode_attention): grouped query heads stacked as
rows of their key/value head for bf16/fp16 CPU decode steps without a mask; everything else is transformers' sdpa."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from roll_engines.infer._decode_attention import DECODE_SDPA, decode_sdpa_forward, use_decode_attention


def _inputs(dtype, q_len=1, b=5, heads=6, kv_heads=2, length=37, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, q_len, d, generator=g).to(dtype)
    k = torch.randn(b, kv_heads, length, d, generator=g).to(dtype)
    v = torch.randn(b, kv_heads, length, d, generator=g).to(dtype)
    return SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True), q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_fp32_attention_as_closely_as_sdpa(dtype):
    module, q, k, v = _inputs(dtype)
    scale = 16**-0.5
    ours, none = decode_sdpa_forward(module, q, k, v, None, scaling=scale, dropout=0.0)
    assert none is None and ours.shape == (5, 1, 6, 16) and ours.dtype == dtype
    theirs, _ = sdpa_attention_forward(module, q, k, v, None, scaling=scale, dropout=0.0)
    groups = module.num_key_value_groups
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), repeat_kv(k.float(), groups), repeat_kv(v.float(), groups), scale=scale
    ).transpose(1, 2)
    err_ours, err_theirs = (ours.float() - ref).abs().max(), (theirs.float() - ref).abs().max()
    assert err_ours <= 2 * err_theirs + 1e-3, (err_ours, err_theirs)  # rounding only, no other mistake
    assert err_ours < 2e-2


def test_each_query_head_reads_its_own_key_value_head():
    # Values constant per KV head (j + 1): any softmax over them returns that constant, so output head h must
    # hold exactly h // groups + 1 (outputs put back in another head order read another constant). Which query
    # feeds which output head is checked by the comparison with fp32 attention above.
    module, q, k, v = _inputs(torch.bfloat16, heads=6, kv_heads=3)
    v = (torch.arange(3, dtype=torch.bfloat16) + 1)[None, :, None, None].expand_as(v).contiguous()
    out, _ = decode_sdpa_forward(module, q, k, v, None, scaling=0.25)
    want = (torch.arange(6) // 2 + 1).to(torch.bfloat16)[None, None, :, None].expand_as(out)
    assert torch.equal(out, want)


@pytest.mark.parametrize(
    "case",
    ["float32", "prefill", "mask", "no_groups", "dropout", "expanded_keys", "value_dim", "softcap"],
)
def test_other_calls_are_sdpa_exactly(case):
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    module, q, k, v = _inputs(dtype, q_len=4 if case == "prefill" else 1, kv_heads=6 if case == "no_groups" else 2)
    mask = None
    if case == "mask":
        mask = torch.ones(5, 1, 1, 37, dtype=torch.bool)
        mask[1, ..., :9] = False
    if case == "expanded_keys":  # grouped module, keys already repeated to every query head
        k, v = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
    if case == "value_dim":  # value heads wider than query/key heads
        v = torch.cat([v, v], dim=-1)
    kw = {"scaling": 0.25, "dropout": 0.0}
    if case == "dropout":  # dropout goes to SDPA as given: seed both calls the same way
        kw["dropout"] = 0.5
    if case == "softcap":  # sdpa refuses it (transformers >= 5.2x) or ignores it (older): the same either way
        kw["softcap"] = 30.0
    torch.manual_seed(1)
    try:
        theirs, _ = sdpa_attention_forward(module, q, k, v, mask, **kw)
    except ValueError as exc:
        with pytest.raises(ValueError, match=str(exc)[:20]):
            decode_sdpa_forward(module, q, k, v, mask, **kw)
        return
    torch.manual_seed(1)
    ours, _ = decode_sdpa_forward(module, q, k, v, mask, **kw)
    assert torch.equal(ours, theirs)


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory) -> str:
    """A seeded tiny Llama with grouped-query attention (4 query heads over 2 key/value heads)."""
    from roll_core.models import build_tiny_model

    out = tmp_path_factory.mktemp("gqa")
    build_tiny_model(out, hidden=64, layers=2, heads=4, kv_heads=2)
    return str(out)


def test_engine_decodes_bf16_through_it(gqa_model, monkeypatch):
    from transformers import AutoModelForCausalLM

    from roll_core.interfaces import SamplingParams
    from roll_engines.infer.hf import HFInferEngine

    eng = HFInferEngine(gqa_model, dtype="bfloat16", max_num_seqs=8)
    assert eng.model.config._attn_implementation == DECODE_SDPA
    assert HFInferEngine(gqa_model).model.config._attn_implementation == "sdpa"  # fp32 keeps sdpa's own path
    stacked = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, *args, **kw):
        # the stacked layout with no mask: transformers' own masked path stacks too, but passes its mask
        stacked.append(
            query.shape[1] == key.shape[1]
            and query.shape[2] == 2
            and not kw.get("enable_gqa")
            and kw.get("attn_mask") is None
        )
        return sdpa(query, key, value, *args, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    prompts = [[1, 40, 41, 42, 43], [1, 50, 51, 52, 53]]  # equal lengths: no padding, so decode steps get no mask
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3, ignore_eos=True)
    out = eng.generate(prompts, params, n=2)
    monkeypatch.undo()
    assert sum(stacked) == 11 * 2  # every decode step (11 after the prefill's token) of both layers
    # The sampled tokens' log-probs are the model's own: a teacher-forced bf16 forward with transformers' sdpa.
    ref_model = AutoModelForCausalLM.from_pretrained(gqa_model, dtype=torch.bfloat16, attn_implementation="sdpa")
    for row in range(4):
        prompt = prompts[row // 2]
        ids = torch.tensor([prompt + out.responses[row].tolist()])
        with torch.no_grad():
            logits = ref_model(ids).logits[0, len(prompt) - 1 : -1].float()
        want = logits.log_softmax(-1).gather(-1, out.responses[row][:, None]).squeeze(-1)
        assert torch.allclose(out.logprobs[row], want, atol=5e-2), (out.logprobs[row] - want).abs().max()


def test_use_decode_attention_leaves_other_implementations(gqa_model, monkeypatch):
    from transformers import AutoModelForCausalLM

    import roll_engines.infer._decode_attention as DA

    eager = AutoModelForCausalLM.from_pretrained(gqa_model, attn_implementation="eager")
    assert not use_decode_attention(eager) and eager.config._attn_implementation == "eager"
    plain = AutoModelForCausalLM.from_pretrained(gqa_model, attn_implementation="sdpa")
    assert not DA._branches_on_name(plain)  # Llama's modeling code never compares the name
    assert use_decode_attention(plain) and plain.config._attn_implementation == DECODE_SDPA
    # Modeling code that branches on the implementation's name (`in ("eager", "sdpa")`) keeps sdpa.
    monkeypatch.setattr(DA.inspect, "getsource", lambda mod: 'if config._attn_implementation in ("eager", "sdpa"):')
    other = AutoModelForCausalLM.from_pretrained(gqa_model, attn_implementation="sdpa")
    assert not use_decode_attention(other) and other.config._attn_implementation == "sdpa"
