"""Scaled rotary embeddings on the `megatron` engine (CPU over gloo, TP=PP=1, and over two ranks at TP=2 or CP=2):
Llama 3.x's llama3 scaling, linear scaling and YaRN (with transformers' attention factor) give transformers'
per-token log-probs, padded and packed, on sequences longer than the models' original context; the same weights with
plain RoPE give clearly other log-probs (so the parity cannot come from ignoring the scaling); what Megatron cannot
compute (or build) exactly is refused."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
pytestmark = pytest.mark.usefixtures("megatron_process_group")

SCALED = {
    # original context 16 (positions here reach ~50); low/high factors other than Megatron's hard-coded 1/4
    "llama-llama3": (
        "llama",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 2.0,
            "high_freq_factor": 8.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "llama-linear": ("llama", {"rope_type": "linear", "factor": 4.0}),
    # factor = max_position_embeddings (256) / original: transformers' consistency check stays quiet
    "qwen2-yarn": ("qwen2", {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 16}),
    # untruncated ramp, own betas, attention factor from mscale / mscale_all_dim
    "qwen3-yarn-mscale": (
        "qwen3",
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 2.0,  # ramp over dimensions 0.81 .. 2.62 (rounded: 0 .. 3)
            "beta_slow": 0.25,
            "truncate": False,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    ),
}


def _models(kind: str, rope: dict, folder: Path) -> tuple[str, str]:
    """(scaled, plain): one tiny `kind` model's weights under `rope` and under plain RoPE. Its q/k projections are
    scaled up: at init the attention is nearly uniform, so positions (and their rotation) would hardly matter."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from roll_core.testing.models import tiny_model

    plain = tiny_model(kind, folder / "plain")
    (weights,) = Path(plain).glob("*.safetensors")
    tensors = load_file(weights)
    for name in tensors:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            tensors[name] = tensors[name] * 6
    save_file(tensors, weights, metadata={"format": "pt"})
    scaled = folder / "scaled"
    shutil.copytree(plain, scaled)
    cfg = AutoConfig.from_pretrained(plain)
    cfg.rope_parameters = {**cfg.rope_parameters, **rope}
    cfg.save_pretrained(scaled)
    return str(scaled), plain


def _long_batch(path: str) -> dict[str, torch.Tensor]:
    """Random prompts of 18-34 tokens (left-padded) and responses of 5-16 (right-padded), two per prompt (so
    packing shares prompts): positions reach 49, past the scaled models' original context."""
    from transformers import AutoTokenizer

    from roll_core.sequences import build_sequences, pad_left

    tok = AutoTokenizer.from_pretrained(path)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tok), (n,), generator=gen).tolist() for n in (34, 18, 27)]
    prompts = [p for p in prompts for _ in range(2)]
    lengths = torch.tensor([16, 9, 12, 5, 14, 7])
    mask = (torch.arange(16)[None] < lengths[:, None]).long()
    responses = torch.randint(3, len(tok), (6, 16), generator=gen) * mask + tok.pad_token_id * (1 - mask)
    out = build_sequences(*pad_left(prompts, tok.pad_token_id), responses, mask)
    out.update(responses=responses, response_mask=mask)
    return out


@pytest.mark.parametrize("case", list(SCALED))
def test_scaled_rope_gives_transformers_logprobs(case: str, tmp_path: Path) -> None:
    from roll_engines.train.hf import HFTrainEngine
    from roll_engines.train.megatron import MegatronTrainEngine

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path / "cache"))
    kind, rope = SCALED[case]
    scaled, plain = _models(kind, rope, tmp_path)
    batch = _long_batch(scaled)
    mask = batch["response_mask"].bool()
    want = HFTrainEngine(scaled, role="reference").compute_logprobs(batch)["logprobs"][mask]
    unscaled = HFTrainEngine(plain, role="reference").compute_logprobs(batch)["logprobs"][mask]
    # the scaling matters here (gaps of 0.04-0.2; 2000 times the tolerance): ignoring it cannot pass
    assert (want - unscaled).abs().max() > 0.02
    engine = MegatronTrainEngine(scaled, dist_backend="gloo", use_distributed_optimizer=False, micro_batch_size=4)
    for packed in (False, True):  # packed: each response rotated at its own positions (_packed.rope_at)
        engine.pack_sequences = packed
        got = engine.compute_logprobs(batch)["logprobs"][mask]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{case}, packed={packed}")


def _llama(**rope: Any) -> Any:
    from transformers import LlamaConfig

    shape = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
    return LlamaConfig(**shape, rope_parameters={"rope_theta": 10000.0, **rope})


@pytest.mark.parametrize(
    "rope, message",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_type='dynamic'"),
        (
            {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "factor": 4.0},
            "rope_type='longrope'",
        ),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 1.5},
            r"attention_factor=1\.5",
        ),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ],
)
def test_rope_megatron_cannot_compute_exactly_is_refused(rope: dict, message: str) -> None:
    from roll_engines.train.megatron._convert import check_supported

    with pytest.raises(ValueError, match=message):
        check_supported(_llama(**rope), tp=1, pp=1)


@pytest.mark.parametrize("case", list(SCALED))
def test_scaled_rope_configs_are_accepted(case: str) -> None:
    from roll_engines.train.megatron._convert import check_supported

    check_supported(_llama(**SCALED[case][1]), tp=1, pp=1)


def test_frequencies_megatron_builds_otherwise_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The built model's rotary frequencies are checked against transformers' (_rope.verify): a mapping that
    configured Megatron's YaRN otherwise (here its ramp rounded, the model's is not) fails the engine's
    construction instead of training another model."""
    from roll_engines.train.megatron import MegatronTrainEngine, _rope

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path / "cache"))
    right = _rope._yarn
    monkeypatch.setattr(_rope, "_yarn", lambda cfg: {**right(cfg), "yarn_correction_range_round_to_int": True})
    scaled, _ = _models("qwen3", SCALED["qwen3-yarn-mscale"][1], tmp_path)
    with pytest.raises(RuntimeError, match="rotary embedding differs from transformers' for rope_type='yarn'"):
        MegatronTrainEngine(scaled, dist_backend="gloo", use_distributed_optimizer=False)


def _parallel_rank(rank: int, port: int, path: str, layout: dict, out: str) -> None:
    """One of two gloo ranks of a reference engine at `layout` over the scaled model at `path`: its log-probs of
    the long batch, padded and packed, saved per rank."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    import torch.distributed as dist

    from roll_engines.train.megatron import MegatronTrainEngine

    engine = MegatronTrainEngine(
        path, role="reference", dist_backend="gloo", use_distributed_optimizer=False, num_threads=1, **layout
    )
    batch = _long_batch(path)
    got = {}
    for packed in (False, True):
        engine.pack_sequences = packed
        got[packed] = engine.compute_logprobs(batch)["logprobs"]
    torch.save(got, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "case, layout",
    [
        # each TP rank rotates its own heads (2 of 4 q, 1 of 2 kv) by its own copy of the frequencies
        ("llama-llama3", {"tensor_parallel_size": 2}),
        ("qwen3-yarn-mscale", {"tensor_parallel_size": 2}),
        # each CP rank rotates its half of every sequence at its own positions, keys gathered after the rotation
        ("qwen3-yarn-mscale", {"context_parallel_size": 2}),
    ],
    ids=["llama3-tp2", "yarn-tp2", "yarn-cp2"],
)
def test_scaled_rope_parallel_gives_transformers_logprobs(case: str, layout: dict, tmp_path: Path) -> None:
    """Two gloo ranks (TP=2 or CP=2) give transformers' log-probs of the scaled model on every rank, padded and
    packed, at positions past its original context (the TP=1 test's tolerance)."""
    import multiprocessing
    import time

    import torch.multiprocessing as mp

    from roll_core.cluster.ports import free_port
    from roll_engines.train.hf import HFTrainEngine

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path / "cache"))
    kind, rope = SCALED[case]
    scaled, _ = _models(kind, rope, tmp_path)
    out = tmp_path / "logprobs"
    # A fork server that imported torch, transformers and Megatron once (two spawned ranks import them each: far
    # slower); not plain fork: this process may hold the state of this module's in-process engines.
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "transformers", "megatron.core", "roll_engines.train.megatron"]
    )
    ranks = mp.start_processes(
        _parallel_rank, args=(free_port(), scaled, layout, str(out)), nprocs=2, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + 180
    while not ranks.join(timeout=1):  # raises what a rank raised
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            pytest.fail("the two Megatron ranks did not finish in 180 s")
    batch = _long_batch(scaled)
    mask = batch["response_mask"].bool()
    want = HFTrainEngine(scaled, role="reference").compute_logprobs(batch)["logprobs"][mask]
    for rank in range(2):
        for packed, got in torch.load(f"{out}.{rank}").items():
            where = f"{case} {layout}, rank {rank}, packed={packed}"
            torch.testing.assert_close(got[mask], want, atol=1e-5, rtol=1e-5, msg=lambda m, w=where: f"{w}: {m}")


def test_yarn_context_parallel_needs_an_original_context_it_splits() -> None:
    """Megatron's YarnRotaryEmbedding views its table of the original context as 2 x CP chunks when it is built:
    an original context that does not split so is refused with the fix named (not Megatron's bare shape error at
    build); one that does is configured, and so is any at CP=1."""
    from roll_engines.train.megatron._convert import transformer_config

    yarn = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match=r"original_max_position_embeddings=34 is not a multiple of 2 x "):
        transformer_config(_llama(**yarn, original_max_position_embeddings=34), 1, 1, torch.float32, None, cp=2)
    for original, cp in ((36, 2), (33, 1)):  # without CP Megatron splits nothing
        config = transformer_config(
            _llama(**yarn, original_max_position_embeddings=original), 1, 1, torch.float32, None, cp=cp
        )
        assert config.yarn_original_max_position_embeddings == original
