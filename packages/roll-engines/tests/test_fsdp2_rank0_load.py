"""The fsdp2 engine over two gloo ranks reads the checkpoint on rank 0 only (the other rank builds the model on the
meta device and gets its shards broadcast): rank 1 opens no safetensors file, at construction or at a checkpoint
`load`; the weights gathered from the shards (and rank 1's buffers, e.g. rotary inv_freq, not in the checkpoint)
equal a single-process `from_pretrained` exactly, with tied and with untied embeddings (the tie survives on rank 1);
a training step equals the single-process engine's; LoRA adapters and a critic's new value head take rank 0's
seeded initialisation (the single-process engine's); a bad `load_weights` raises on both ranks, not only rank 0.
A LoRA run's resume reads `adapter/` on rank 0 only. A remote-code model (`trust_remote_code`, its code in the
checkpoint folder) loads on rank 0 only too, and rank 1 imports that code only after rank 0 has (transformers
copies it into its module cache: processes copying at once can import a half-written file)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from roll_core.testing.batches import toy_batch

SETTINGS = {"lr": 1e-2, "micro_batch_size": 2}
ROWS = ([0, 1, 2, 3], [4, 5])
LORA = {**SETTINGS, "dtype": "bfloat16"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from roll_core.models import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    for name, tie in (("tied", True), ("untied", False)):
        build_tiny_model(root / name, tie_embeddings=tie, seed=3)
    return {"tied": str(root / "tied"), "untied": str(root / "untied")}


REMOTE_CONFIG = """from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"
"""
REMOTE_MODELING = """from transformers import LlamaForCausalLM

from .configuration_tiny_remote import TinyRemoteConfig


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig
"""


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A checkpoint whose model type transformers does not know: its config and model classes are code in the
    folder (`auto_map`), loadable with trust_remote_code only; no hub access."""
    import json

    from roll_core.models import build_tiny_model

    path = tmp_path_factory.mktemp("remote") / "tiny_remote"
    build_tiny_model(path, seed=5)
    (path / "configuration_tiny_remote.py").write_text(REMOTE_CONFIG)
    (path / "modeling_tiny_remote.py").write_text(REMOTE_MODELING)
    config = json.loads((path / "config.json").read_text())
    config.update(
        model_type="tiny_remote",
        architectures=["TinyRemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
            "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM",
        },
    )
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _count_reads() -> list[str]:
    """Record every safetensors file this process opens from now on (transformers' `from_pretrained` and
    safetensors' `load_file` both open files through `safetensors.safe_open`, imported by name into modules)."""
    import sys

    import safetensors
    import safetensors.torch
    import transformers.modeling_utils  # noqa: F401  (holds its own `safe_open` name)

    opened: list[str] = []
    real = safetensors.safe_open

    def counting(filename, *args, **kwargs):
        opened.append(str(filename))
        return real(filename, *args, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, "safe_open", None) is real:
            module.safe_open = counting
    return opened


def _time_code_imports(delay: float) -> list[tuple[str, float, float]]:
    """Record (file, start, end) of every time transformers resolves a checkpoint's code (copying it into its module
    cache when missing or changed), each call first waiting `delay` seconds (rank 0's: a slow filesystem, so a rank
    that did not wait for it starts first)."""
    import transformers.dynamic_module_utils as dmu

    calls: list[tuple[str, float, float]] = []
    real = dmu.get_cached_module_file

    def timed(path, module_file, *args, **kwargs):
        start = time.monotonic()  # CLOCK_MONOTONIC: one clock for both processes
        time.sleep(delay)
        try:
            return real(path, module_file, *args, **kwargs)
        finally:
            calls.append((module_file, start, time.monotonic()))

    dmu.get_cached_module_file = timed
    return calls


def _rank(rank: int, port: int, models: dict[str, str], remote: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    import torch.distributed as dist

    from roll_core.pipelines.objectives import PolicyObjective
    from roll_engines.train.fsdp2 import FSDP2TrainEngine

    opened = _count_reads()
    got: dict = {}
    engines = {}
    for kind, path in models.items():
        engines[kind] = engine = FSDP2TrainEngine(path, dist_backend="gloo", num_threads=1, **SETTINGS)
        inner = engine.model
        got[kind] = {
            "loaded_on": sorted(engine.loaded_on),
            "tied": inner.lm_head.weight is inner.model.embed_tokens.weight,
            "weights": engine.get_weights(),
            "buffers": {n: b.clone() for n, b in inner.named_buffers()},
            "opened": len(opened),
        }
    # A training step of the tied model (rows split unevenly over the ranks), then a checkpoint round trip.
    batch, engine = toy_batch(models["tied"]), engines["tied"]
    got["metrics"] = engine.train_step({k: v[ROWS[rank]] for k, v in batch.items()}, PolicyObjective())
    got["stepped"] = engine.get_weights()
    ckpt = Path(out) / "ckpt"
    engine.save(ckpt, models["tied"])
    before = len(opened)
    fresh = FSDP2TrainEngine(models["tied"], dist_backend="gloo", num_threads=1, **SETTINGS)
    constructed = len(opened)
    fresh.load(ckpt)
    got["resume_opened"] = (constructed - before, len(opened) - constructed)
    got["resumed"] = fresh.get_weights()
    try:  # rank 0 finds the key; rank 1 must raise as well (not wait for a broadcast that never comes)
        fresh.load_weights({**got["resumed"], "bogus": torch.zeros(1)})
        got["bad_load"] = None
    except RuntimeError as e:
        got["bad_load"] = str(e)
    # LoRA on a bf16 base (the adapters in fp32): rank 1 builds both dtypes on meta.
    lora = FSDP2TrainEngine(models["untied"], dist_backend="gloo", num_threads=1, lora_rank=4, **LORA)
    got["adapter"], got["merged"] = dict(lora.iter_adapter()), lora.get_weights()
    # Resume: the adapter, changed so that it differs from a fresh engine's, comes back from rank 0's read alone.
    with torch.no_grad():
        for name, p in lora.model.named_parameters():
            if ".lora_" in name:
                p.add_(0.25)
    lora.save(Path(out) / "lora_ckpt", models["untied"])
    got["lora_saved"] = dict(lora.iter_adapter())
    resumed = FSDP2TrainEngine(models["untied"], dist_backend="gloo", num_threads=1, lora_rank=4, **LORA)
    before = len(opened)
    resumed.load(Path(out) / "lora_ckpt")
    got["lora_opened"] = [f for f in opened[before:] if "adapter" in f]
    got["lora_resumed"] = dict(resumed.iter_adapter())
    critic = FSDP2TrainEngine(models["untied"], dist_backend="gloo", num_threads=1, role="critic", **SETTINGS)
    got["critic"] = critic.get_weights()
    # A remote-code model: rank 1 builds it on meta from the folder's code, imported only after rank 0 imported it.
    code = _time_code_imports(0.2 if rank == 0 else 0.0)
    before = len(opened)
    engine = FSDP2TrainEngine(remote, dist_backend="gloo", num_threads=1, trust_remote_code=True, **SETTINGS)
    got["remote"] = {
        "opened": [f for f in opened[before:] if f.startswith(remote)],
        "loaded_on": sorted(engine.loaded_on),
        "class": type(engine.model).__name__,
        "weights": engine.get_weights(),
        "code": code,
    }
    # The same step on the every-rank-reads path (kept for models that cannot be built on meta): the same numbers.
    from roll_engines.train import _fsdp2_load

    _fsdp2_load.meta_refusal = lambda config: "this test's"
    old = FSDP2TrainEngine(models["tied"], dist_backend="gloo", num_threads=1, **SETTINGS)
    got["old_metrics"] = old.train_step({k: v[ROWS[rank]] for k, v in batch.items()}, PolicyObjective())
    got["old_stepped"] = old.get_weights()
    torch.save(got, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(models: dict[str, str], remote: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """What each of the two gloo ranks recorded (`_rank`): one pair of processes serves every test below."""
    import multiprocessing

    import torch.multiprocessing as mp

    from roll_core.cluster.ports import free_port

    out = tmp_path_factory.mktemp("ranks")
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "transformers"])
    procs = mp.start_processes(
        _rank, args=(free_port(), models, remote, str(out)), nprocs=2, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + 300
    while not procs.join(timeout=2):  # raises what a rank raised
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            pytest.fail("the two fsdp2 ranks did not finish in 300 s")
    r0, r1 = (torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    return r0, r1


def test_only_rank_0_reads_the_checkpoint_and_every_rank_gets_its_weights(
    models: dict[str, str], ranks: tuple[dict, dict]
) -> None:
    from transformers import AutoModelForCausalLM

    from roll_core.pipelines.objectives import PolicyObjective
    from roll_engines.train.hf import HFTrainEngine

    r0, r1 = ranks
    # Rank 0 read both checkpoints (the counter sees reads); rank 1 none, and held no full model anywhere.
    assert r0["tied"]["opened"] >= 1 and r0["untied"]["opened"] >= 2
    assert r1["tied"]["opened"] == r1["untied"]["opened"] == 0
    assert r0["resume_opened"][0] >= 1 and r0["resume_opened"][1] >= 1  # construction, then load's model/
    assert r1["resume_opened"] == (0, 0)
    assert r0["tied"]["loaded_on"] == ["cpu"] and r1["tied"]["loaded_on"] == ["meta"]

    for kind, path in models.items():
        reference = AutoModelForCausalLM.from_pretrained(path)
        want = reference.state_dict()
        for got in (r0[kind], r1[kind]):
            assert got["tied"] == (kind == "tied")
            assert set(got["weights"]) == set(want) - ({"lm_head.weight"} if kind == "tied" else set())
            for name, w in got["weights"].items():
                torch.testing.assert_close(w, want[name], atol=0, rtol=0, msg=f"{kind} {name}")
            buffers = dict(reference.named_buffers())
            assert set(got["buffers"]) == set(buffers) and any("inv_freq" in n for n in buffers)
            for name, b in got["buffers"].items():
                torch.testing.assert_close(b, buffers[name], atol=0, rtol=0, msg=f"{kind} {name}")

    # The step equals the every-rank-reads path's exactly, and the single-process engine's gradient norm.
    metrics = HFTrainEngine(models["tied"], **SETTINGS).train_step(toy_batch(models["tied"]), PolicyObjective())
    assert r0["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
    for got in (r0, r1):  # loss, grad_norm, ... (all but the timings)
        timed = {k for k in got["metrics"] if k.endswith("seconds")}
        assert {k: v for k, v in got["metrics"].items() if k not in timed} == {
            k: v for k, v in got["old_metrics"].items() if k not in timed
        }
    for got in (r0, r1):
        assert set(got["stepped"]) == set(got["old_stepped"])
        for name, w in got["old_stepped"].items():
            torch.testing.assert_close(got["stepped"][name], w, atol=0, rtol=0, msg=name)
            torch.testing.assert_close(got["resumed"][name], w, atol=0, rtol=0, msg=name)
        assert got["bad_load"] is not None and "unexpected ['bogus']" in got["bad_load"]

    single_lora = HFTrainEngine(models["untied"], lora_rank=4, **LORA)
    lora, merged = dict(single_lora.iter_adapter()), single_lora.get_weights()
    critic = HFTrainEngine(models["untied"], role="critic", **SETTINGS).get_weights()
    for got in (r0, r1):
        assert set(got["adapter"]) == set(lora) and any("lora_A" in n for n in lora)
        for name, w in lora.items():
            torch.testing.assert_close(got["adapter"][name], w, atol=0, rtol=0, msg=name)
        assert set(got["merged"]) == set(merged) and merged["model.norm.weight"].dtype == torch.bfloat16
        for name, w in merged.items():
            torch.testing.assert_close(got["merged"][name], w, atol=0, rtol=0, msg=name)
        assert set(got["critic"]) == set(critic) and "score.weight" in critic
        for name, w in critic.items():
            torch.testing.assert_close(got["critic"][name], w, atol=0, rtol=0, msg=name)


def test_a_lora_resume_reads_the_adapter_on_rank_0_only(ranks: tuple[dict, dict]) -> None:
    """Every rank read `adapter/adapter_model.safetensors` (N reads of a shared filesystem); rank 0 reads it now and
    broadcasts it, and both ranks' adapters come back exactly as saved."""
    r0, r1 = ranks
    assert [f.rsplit("/", 2)[-2:] for f in r0["lora_opened"]] == [["adapter", "adapter_model.safetensors"]]
    assert r1["lora_opened"] == []
    for got in (r0, r1):
        saved = got["lora_saved"]
        assert set(got["lora_resumed"]) == set(saved) and any("lora_B" in n for n in saved)
        for name, w in saved.items():
            assert not torch.equal(w, got["adapter"][name])  # changed since construction: the load is seen
            torch.testing.assert_close(got["lora_resumed"][name], w, atol=0, rtol=0, msg=name)


def test_a_remote_code_model_loads_on_rank_0_only_after_rank_0_imported_its_code(
    remote: str, ranks: tuple[dict, dict]
) -> None:
    """trust_remote_code takes the meta build (from_config with the folder's class): rank 1 opens no safetensors
    file and gets from_pretrained's weights; its first use of each code file starts after rank 0's first ended
    (rank 0 slowed down by 0.2 s a call: on the old code both ranks resolved the code at once)."""
    from transformers import AutoModelForCausalLM

    r0, r1 = ranks
    assert len(r0["remote"]["opened"]) >= 1 and r1["remote"]["opened"] == []
    assert r0["remote"]["loaded_on"] == ["cpu"] and r1["remote"]["loaded_on"] == ["meta"]
    want = AutoModelForCausalLM.from_pretrained(remote, trust_remote_code=True).state_dict()
    for got in (r0["remote"], r1["remote"]):
        assert got["class"] == "FSDPTinyRemoteForCausalLM"
        assert set(got["weights"]) == set(want)
        for name, w in got["weights"].items():
            torch.testing.assert_close(w, want[name], atol=0, rtol=0, msg=name)
    files = {f for f, _, _ in r0["remote"]["code"]}
    assert files == {"configuration_tiny_remote.py", "modeling_tiny_remote.py"}
    for f in files:
        rank0_done = min(end for name, _, end in r0["remote"]["code"] if name == f)
        rank1_start = min(start for name, start, _ in r1["remote"]["code"] if name == f)
        assert rank1_start > rank0_done, f"rank 1 resolved {f} before rank 0 had ({rank1_start} <= {rank0_done})"


def _fallback_rank(rank: int, port: int, out: str) -> None:
    """The meta build's failure paths on two gloo ranks (plain modules: no checkpoint needed)."""
    import torch.distributed as dist

    from roll_engines.train import _fsdp2_load as L

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cpu, got = torch.device("cpu"), {}

    def loaded() -> torch.nn.Module:
        return torch.nn.Linear(3, 2)

    def fails() -> torch.nn.Module:
        raise ValueError("no meta here")

    with torch.device("meta"):
        meta, other = torch.nn.Linear(3, 2), torch.nn.Linear(3, 4)
    model, on_meta = L.instantiate(loaded, lambda: meta, cpu, "ckpt")
    got["meta"] = (model is meta, on_meta) if rank else (model.weight.is_meta, on_meta)
    for name, build in (("fails", fails), ("differs", lambda: other)):  # rank 1 reads the checkpoint itself
        model, on_meta = L.instantiate(loaded, build, cpu, "ckpt")
        got[name] = (model.weight.is_meta, on_meta)
    try:  # rank 0's failure reaches rank 1 (which would otherwise wait for rank 0's broadcast)
        L.instantiate(fails if rank == 0 else loaded, lambda: meta, cpu, "ckpt")
    except Exception as e:
        got["rank0_fails"] = f"{type(e).__name__}: {e}"
    try:
        L.check_same_structure(other if rank else torch.nn.Linear(3, 2), cpu)
    except RuntimeError as e:
        got["structure"] = str(e)
    torch.save(got, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_a_rank_that_cannot_build_on_meta_reads_itself_and_failures_reach_every_rank(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from roll_core.cluster.ports import free_port

    ranks = mp.start_processes(_fallback_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not ranks.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            pytest.fail("the two ranks did not finish in 120 s (a rank waits for a collective the other skipped)")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["meta"] == (False, False) and r1["meta"] == (True, True)
    assert r1["fails"] == r1["differs"] == (False, False)  # rank 1 loaded the checkpoint itself
    assert r0["rank0_fails"] == "ValueError: no meta here"
    assert r1["rank0_fails"] == "RuntimeError: rank 0 could not load ckpt: ValueError: no meta here"
    assert "this rank's model differs from rank 0's" in r1["structure"]
    assert "another rank's model differs" in r0["structure"]


def test_fsdp2_load_weights_refuses_missing_tensors(models: dict[str, str]) -> None:
    """A state dict without a tensor raises, naming it (torch's full-state-dict load filled missing keys with the
    model's own tensors, so fsdp2 kept that layer's old weights silently)."""
    import torch.distributed as dist

    from roll_engines.train.fsdp2 import FSDP2TrainEngine

    try:
        engine = FSDP2TrainEngine.conformance_engine(models["untied"], lr=1e-3)
        weights = engine.get_weights()
        weights.pop("model.norm.weight")
        with pytest.raises(RuntimeError, match=r"checkpoint mismatch: missing \['model\.norm\.weight'\]"):
            engine.load_weights(weights)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
