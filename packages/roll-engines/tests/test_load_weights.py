"""`load_weights(full state dict)` on the train engines: the fsdp2 engine shards it over its ranks (its parameters are
DTensors: `nn.Module.load_state_dict` raised "got mixed torch.Tensor and DTensor" on every rank), and every engine
takes back what its own `get_weights` gives (a tied LM head, sent once under the embedding's name, was "missing").
Also: a scoring pass that raises leaves the policy in train mode."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from roll_core.testing.batches import toy_batch
from roll_engines.train.hf import HFTrainEngine


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from roll_core.models import resolve_model_path

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    return resolve_model_path("builtin:tiny")


def _shifted(path: str) -> dict[str, torch.Tensor]:
    """The model's weights, each moved by seeded noise (the same on every rank)."""
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(7)
    state = AutoModelForCausalLM.from_pretrained(path).state_dict()
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in sorted(state.items())}


def _fsdp2_rank(rank: int, port: int, path: str, out: str) -> None:
    """One of two gloo ranks: load full weights, report the shard shape, the gathered weights and the log-probs."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    import torch.distributed as dist

    from roll_engines.train.fsdp2 import FSDP2TrainEngine

    engine = FSDP2TrainEngine(path, dist_backend="gloo", lr=1e-3, num_threads=1)
    engine.load_weights(_shifted(path))
    local = engine.model.model.embed_tokens.weight.to_local().shape
    gathered = engine.get_weights()
    scored = engine.compute_logprobs(toy_batch(path))["logprobs"]
    if rank == 0:
        torch.save({"local": tuple(local), "weights": gathered, "logprobs": scored}, out)
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp2_load_weights_shards_a_full_state_dict_over_two_ranks(path: str, tmp_path: Path) -> None:
    import multiprocessing

    import torch.multiprocessing as mp

    from roll_core.cluster.ports import free_port

    out = tmp_path / "rank0.pt"
    # From a fork server that imported torch and transformers once (spawned ranks import them each: slower).
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "transformers"])
    ranks = mp.start_processes(
        _fsdp2_rank, args=(free_port(), path, str(out)), nprocs=2, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + 180
    while not ranks.join(timeout=2):  # raises what a rank raised
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            pytest.fail("the two fsdp2 ranks did not finish in 180 s")
    got = torch.load(out, weights_only=False)
    want = _shifted(path)
    vocab, hidden = want["model.embed_tokens.weight"].shape
    assert got["local"] == ((vocab + 1) // 2, hidden)  # rank 0 holds its shard, not the full tensor
    assert got["weights"].keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got["weights"][name], w, atol=0, rtol=0, msg=name)
    single = HFTrainEngine(path, lr=1e-3)
    single.load_weights(want)
    torch.testing.assert_close(got["logprobs"], single.compute_logprobs(toy_batch(path))["logprobs"])


def test_load_weights_takes_get_weights_of_a_tied_model(tmp_path: Path) -> None:
    from roll_core.models import build_tiny_model

    build_tiny_model(tmp_path / "tied", tie_embeddings=True)
    engine = HFTrainEngine(str(tmp_path / "tied"), lr=1e-3)
    weights = {k: v + 0.5 for k, v in engine.get_weights().items()}
    assert "lm_head.weight" not in weights  # sent once, under the embedding's name
    engine.load_weights(weights)
    got = engine.get_weights()
    assert all(torch.equal(got[k], w) for k, w in weights.items())
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight


def _tied_vision_language_model(folder: Path) -> str:
    """A tiny Qwen2.5-VL with tied embeddings (as Qwen2.5-VL-3B, Qwen2-VL-2B, Qwen3-VL-2B/4B): its embedding is
    `model.language_model.embed_tokens`, its checkpoint holds no `lm_head.weight`."""
    import json

    from safetensors.torch import load_file, save_file

    from roll_core.multimodal.tiny import build_tiny_qwen_vl

    build_tiny_qwen_vl(folder)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(config))
    (shard,) = folder.glob("*.safetensors")
    state = load_file(shard)
    del state["lm_head.weight"]
    save_file(state, shard, metadata={"format": "pt"})
    return str(folder)


@pytest.mark.parametrize("kind", ["hf", "fsdp2"])
def test_a_tied_vision_language_model_takes_back_its_weights_and_its_checkpoint(kind: str, tmp_path: Path) -> None:
    """The tie is read from the model: the name rule (lm_head filled by `model.embed_tokens.weight`) refused a tied
    vision-language model's own `get_weights` and checkpoint ("missing ['lm_head.weight']"), so it could not resume."""
    import torch.distributed as dist

    from roll_engines.train.fsdp2 import FSDP2TrainEngine

    path = _tied_vision_language_model(tmp_path / "tied-vl")
    make = (lambda: FSDP2TrainEngine.conformance_engine(path, lr=1e-3)) if kind == "fsdp2" else None
    make = make or (lambda: HFTrainEngine(path, lr=1e-3))
    try:
        engine = make()
        inner = engine.model
        assert inner.lm_head.weight is inner.model.language_model.embed_tokens.weight
        weights = {k: v + 0.5 for k, v in engine.get_weights().items()}
        assert "lm_head.weight" not in weights  # sent once, under the embedding's name
        engine.load_weights(weights)
        got = engine.get_weights()
        assert all(torch.equal(got[k], w) for k, w in weights.items())
        assert inner.lm_head.weight is inner.model.language_model.embed_tokens.weight
        engine.save(tmp_path / "ckpt", path)
        fresh = make()
        fresh.load(tmp_path / "ckpt")
        resumed = fresh.get_weights()
        assert all(torch.equal(resumed[k], w) for k, w in weights.items())
    finally:
        if kind == "fsdp2" and dist.is_initialized():
            dist.destroy_process_group()


def test_an_untied_head_left_out_is_refused(path: str) -> None:
    """An untied LM head is its own tensor: a state dict without it leaves the head at its old weights, so it is
    refused (the name rule let it through whenever the embedding was there)."""
    engine = HFTrainEngine(path, lr=1e-3)
    assert engine.model.lm_head.weight is not engine.model.model.embed_tokens.weight
    weights = engine.get_weights()
    del weights["lm_head.weight"]
    with pytest.raises(RuntimeError, match=r"checkpoint mismatch: missing \['lm_head\.weight'\]"):
        engine.load_weights(weights)


def test_load_weights_refuses_an_incomplete_or_foreign_state_dict(path: str) -> None:
    engine = HFTrainEngine(path, lr=1e-3)
    weights = engine.get_weights()
    weights.pop("model.norm.weight")
    with pytest.raises(RuntimeError, match=r"checkpoint mismatch: missing \['model\.norm\.weight'\]"):
        engine.load_weights(weights)
    with pytest.raises(RuntimeError, match=r"unexpected \['bogus'\]"):
        engine.load_weights({**engine.get_weights(), "bogus": torch.zeros(1)})


def test_a_failed_scoring_pass_leaves_the_policy_in_train_mode(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scoring runs in eval mode; a pass that raised left the model there, and later training steps ran in eval mode
    (transformers' gradient checkpointing only acts in train mode)."""
    engine = HFTrainEngine(path, lr=1e-3)
    assert engine.model.training

    def boom(*args, **kwargs):
        raise RuntimeError("a bad chunk")

    monkeypatch.setattr(engine, "_forward", boom)
    with pytest.raises(RuntimeError, match="a bad chunk"):
        engine.compute_logprobs(toy_batch(path))
    assert engine.model.training
