"""The HF <-> Megatron weight mapping (roll_engines.train.megatron._convert) as pure functions, no process group:
a tiny model's HF tensors go to Megatron, are split over every (TP rank, PP stage, EP rank) as load_hf splits
them, gathered back as the export gathers them (gather_tp with a simulated all-gather) and named in HF again: the
round trip gives the HF tensors back exactly, names, shapes and dtypes included. Forward equality with
transformers (and the real collectives) is tested on engines in test_megatron.py and tests/e2e."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")

from roll_engines.train.megatron import _convert as C


def _config(kind: str, **change: Any) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=101,  # odd: padded for TP
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        tie_word_embeddings=False,
    )
    moe = dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    make = {
        "llama": lambda: LlamaConfig(**common),
        "qwen2": lambda: Qwen2Config(**common),
        "qwen3": lambda: Qwen3Config(**common),
        "qwen3_moe": lambda: Qwen3MoeConfig(**common, **moe),
        "qwen2_moe": lambda: Qwen2MoeConfig(shared_expert_intermediate_size=40, **common, **moe),
    }
    cfg = make[kind]()
    for k, v in change.items():
        setattr(cfg, k, v)
    return cfg


def _hf_tensors(cfg: Any, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The state dict transformers' model of `cfg` holds, every tensor distinct random values."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    out = {}
    for k, v in model.state_dict().items():
        if cfg.tie_word_embeddings and k == "lm_head.weight":
            continue  # a tied checkpoint stores the embeddings once
        out[k] = torch.randn(v.shape).to(dtype)
    return out


class _Group:
    """Simulated TP / EP collectives: gather_tp's all-gather returns every rank's shard of the tensor being
    gathered (`self.shards`, set by the test before each call)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tp: int, ep: int = 1) -> None:
        from megatron.core import parallel_state as ps

        self.tp, self.ep, self.ep_rank, self.shards = tp, ep, 0, []
        monkeypatch.setattr(
            C,
            "dist",
            SimpleNamespace(get_world_size=lambda group: self.tp, all_gather=self._all_gather),
        )
        for f in ("get_tensor_model_parallel_group", "get_expert_tensor_parallel_group"):
            monkeypatch.setattr(ps, f, lambda: None)
        monkeypatch.setattr(ps, "get_expert_model_parallel_world_size", lambda: self.ep)
        monkeypatch.setattr(ps, "get_expert_model_parallel_rank", lambda: self.ep_rank)

    def _all_gather(self, parts: list, t: torch.Tensor, group: Any = None) -> None:
        for p, s in zip(parts, self.shards, strict=True):
            p.copy_(s)


def _round_trip(cfg: Any, hf: dict, tp: int, pp: int, ep: int, monkeypatch: pytest.MonkeyPatch) -> dict:
    """HF -> Megatron -> every rank's shards -> gathered -> HF names (per-expert names fused like _export)."""
    vocab = C.padded_vocab(cfg.vocab_size, tp)
    full = C.hf_to_mcore(hf, cfg, vocab)
    if cfg.tie_word_embeddings:
        full.pop("output_layer.weight")
    group = _Group(monkeypatch, tp, ep)
    per_stage = cfg.num_hidden_layers // pp
    out: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        offset = stage * per_stage
        experts_by_rank = []
        for ep_rank in range(ep):
            n = getattr(cfg, "num_experts", 0) // ep
            mine = range(ep_rank * n, (ep_rank + 1) * n) if C.is_moe(cfg) else range(0)
            shards = [C.shard(full, r, tp, offset, per_stage, stage == 0, stage == pp - 1, mine) for r in range(tp)]
            group.ep_rank = ep_rank
            experts: dict[str, torch.Tensor] = {}
            for name in shards[0]:
                group.shards = [s[name] for s in shards]
                hf_part = C.to_hf(name, C.gather_tp(name, shards[0][name]), cfg, offset)
                (experts if C.is_expert(name) else out).update(hf_part)
            experts_by_rank.append(experts)
        for experts in experts_by_rank:
            out.update(experts)
    return out


def _unfuse(hf: dict) -> dict:
    """transformers' fused expert tensors as per-expert checkpoint names (what to_hf names them)."""
    out = {}
    for k, v in hf.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            for e, w in enumerate(v):
                gate, up = w.chunk(2, 0)
                out[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                out[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif k.endswith("mlp.experts.down_proj"):
            for e, w in enumerate(v):
                out[k.replace("down_proj", f"{e}.down_proj.weight")] = w
        else:
            out[k] = v
    return out


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        torch.testing.assert_close(got[k], v, atol=0, rtol=0, msg=k)


DENSE = [(kind, tp, pp, 1) for kind in ("llama", "qwen2", "qwen3") for tp, pp in ((1, 1), (2, 1), (4, 2), (2, 4))]
MOE = [(kind, *layout) for kind in ("qwen3_moe", "qwen2_moe") for layout in ((1, 1, 1), (2, 2, 2), (1, 4, 4))]


@pytest.mark.parametrize(("kind", "tp", "pp", "ep"), DENSE + MOE)
def test_hf_to_megatron_and_back_is_exact_at_every_layout(kind: str, tp: int, pp: int, ep: int, monkeypatch) -> None:
    """Every tensor comes back bit for bit under its own name: q/k/v of each GQA group (4 KV heads, 2 q heads
    each) over TP ranks, Qwen2's q/k/v biases, Qwen3's q/k norms, gate/up halves, the padded vocabulary rows
    dropped, each PP stage's layers at their global index, each EP rank's experts at their global index."""
    cfg = _config(kind)
    hf = _hf_tensors(cfg, torch.bfloat16)
    _assert_same(_round_trip(cfg, hf, tp, pp, ep, monkeypatch), _unfuse(hf))


def test_tied_embeddings_export_the_embeddings_once(monkeypatch) -> None:
    cfg = _config("qwen2", tie_word_embeddings=True)
    hf = _hf_tensors(cfg)
    assert "lm_head.weight" not in hf
    _assert_same(_round_trip(cfg, hf, 2, 1, 1, monkeypatch), hf)


def test_qkv_rows_are_grouped_as_megatron_splits_them() -> None:
    """Megatron views each TP rank's linear_qkv output as (groups, [the group's q heads; k; v]): group g of
    rank r is KV head r * G/tp + g, and its q heads are HF's heads (r * G/tp + g) * Q/G ... (repeat_kv's order)."""
    cfg = _config("llama")
    nq, ng, d, tp = 8, 4, 8, 2

    def heads(n: int) -> torch.Tensor:  # each row holds its head's index
        return torch.arange(n).repeat_interleave(d).unsqueeze(1).float()

    q, k, v = heads(nq), heads(ng) + 100, heads(ng) + 200
    fused = C.qkv_to_mcore(q, k, v, cfg)
    for r, part in enumerate(fused.chunk(tp, 0)):
        groups = part.reshape(ng // tp, (nq // ng + 2) * d)
        for g, rows in enumerate(groups):
            kv = r * (ng // tp) + g
            q_heads = rows[: (nq // ng) * d].reshape(nq // ng, d)[:, 0].tolist()
            assert q_heads == [kv * (nq // ng) + j for j in range(nq // ng)]
            assert rows[(nq // ng) * d] == 100 + kv and rows[(nq // ng + 1) * d] == 200 + kv


@pytest.mark.parametrize("tensor", ["model.embed_tokens.weight", "lm_head.weight"])
def test_a_vocabulary_matrix_that_is_not_vocab_size_rows_is_refused(tensor: str) -> None:
    """A matrix one row short of `vocab_size` was padded with a zero row that trained and exported as a token's."""
    cfg = _config("llama")
    hf = _hf_tensors(cfg)
    hf[tensor] = hf[tensor][:-1]
    with pytest.raises(ValueError, match=rf"{tensor} has 100 rows; the config's vocab_size is 101"):
        C.hf_to_mcore(hf, cfg, C.padded_vocab(cfg.vocab_size, 2))


def test_an_untied_checkpoint_without_lm_head_maps_no_output_layer() -> None:
    """The embeddings stand in for lm_head only when the config ties them (load_hf refuses the untied case)."""
    cfg = _config("llama")
    hf = _hf_tensors(cfg)
    embed = hf["model.embed_tokens.weight"]
    assert torch.equal(C.hf_to_mcore(hf, cfg, 101)["output_layer.weight"], hf["lm_head.weight"])
    del hf["lm_head.weight"]
    assert "output_layer.weight" not in C.hf_to_mcore(hf, cfg, 101)
    cfg.tie_word_embeddings = True
    assert torch.equal(C.hf_to_mcore(hf, cfg, 102)["output_layer.weight"][:101], embed)
