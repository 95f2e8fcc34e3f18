"""LoRA adapter sync without vLLM (infer_engine.lora_sync=adapter): the trainer's adapter export, the receiving side's
peft folder, and the ConfigErrors where it cannot work. vLLM serving the adapter: test_vllm_lora.py (its venv)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from roll_core.config.lora_sync import adapter_rank, refused_targets
from roll_core.errors import ConfigError
from roll_core.models import resolve_model_path
from roll_core.pipelines.objectives import PolicyObjective
from roll_core.testing.train_engine import toy_batch
from roll_engines import config as C
from roll_engines.infer._adapters import AdapterSync, refuse_adapters, vllm_max_rank
from roll_engines.train.hf import HFTrainEngine

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> HFTrainEngine:
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    path = resolve_model_path("builtin:tiny")
    # alpha / r = 4: a receiver that missed the scaling would be 4x off.
    eng = HFTrainEngine(path, lr=1e-2, micro_batch_size=6, lora_rank=4, lora_alpha=16.0)
    eng.train_step(toy_batch(path), PolicyObjective())
    return eng


def test_the_adapter_alone_in_peft_names_reproduces_the_merged_weights(trained: HFTrainEngine) -> None:
    from peft import get_peft_model_state_dict

    adapter = dict(trained.iter_adapter())
    assert set(adapter) == set(get_peft_model_state_dict(trained.model)), "peft's saved names, nothing else"
    merged = dict(trained.iter_weights(changed_only=True))
    base = dict(HFTrainEngine(trained.path, role="reference", trainable=False).iter_weights())
    assert len(merged) == len(adapter) // 2 > 0
    for name, w in merged.items():
        module = "base_model.model." + name.removesuffix(".weight")
        a, b = adapter[f"{module}.lora_A.weight"], adapter[f"{module}.lora_B.weight"]
        assert a.shape[0] == b.shape[1] == 4
        # B carries the scaling: base + B @ A (scaling 1) is the merged weight.
        torch.testing.assert_close(base[name] + b @ a, w, atol=1e-6, rtol=1e-5)
    assert sum(v.numel() for v in adapter.values()) < 0.2 * sum(v.numel() for v in merged.values())


def test_the_receiver_writes_a_peft_folder_with_scaling_one(trained: HFTrainEngine, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    sync = AdapterSync("vllm", 4, torch.float32)
    try:
        sync.begin()
        named = list(trained.iter_adapter())
        nbytes = sum(sync.receive(named[i : i + 5]) for i in range(0, len(named), 5))  # buckets
        folder = sync.finish(1)
        assert folder is not None and folder.parent == sync.root and str(sync.root).startswith("/dev/shm")
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["r"] == config["lora_alpha"] == 4
        assert sync.last == {"bytes": nbytes, "tensors": len(named), "rank": 4}
        # Plain peft loads the folder onto the base and computes what the trainer's policy computes.
        with warnings.catch_warnings():  # peft 0.21 still asks transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trained.path), str(folder))
        ids = torch.tensor([[3, 5, 7, 9, 11]])
        with torch.no_grad():
            torch.testing.assert_close(peft(ids).logits, trained.model(ids).logits, atol=1e-5, rtol=1e-5)
        # Superseded and unused: removed and deleted; the current one stays.
        sync.begin()
        sync.receive(named)
        sync.finish(2)
        sync.current, removed = 2, []
        assert sync.retire({1}, removed.append) == [] and folder.exists()  # a running request still uses 1
        assert sync.retire(set(), removed.append) == [1] and removed == [1] and not folder.exists()
    finally:
        sync.close()
    assert not sync.root.exists()


def test_the_receiver_refuses_merged_weights_and_wrong_ranks(trained: HFTrainEngine) -> None:
    sync = AdapterSync("vllm", 2, torch.float32)
    try:
        sync.begin()
        with pytest.raises(ValueError, match=r"model.embed_tokens.weight.*merged weights"):
            sync.receive([("model.embed_tokens.weight", torch.zeros(3, 3))])
        sync.begin()
        sync.receive(trained.iter_adapter())
        with pytest.raises(ValueError, match=r"ranks \[4\]; this engine serves one rank <= 2"):
            sync.finish(1)
        sync.begin()
        sync.receive([("m.q_proj.lora_A.weight", torch.zeros(2, 8))])
        with pytest.raises(ValueError, match=r"adapter of m\.q_proj is incomplete"):
            sync.finish(1)
        assert sync.folders == {}
    finally:
        sync.close()
    assert vllm_max_rank(4) == 8 and vllm_max_rank(16) == 16
    with pytest.raises(ValueError, match="infer_engine=hf cannot serve LoRA adapters"):
        refuse_adapters("hf", 4)


def _engines(lora: int = 4, targets="all-linear", infer=C.VLLMInferEngineConfig, train=C.HFTrainEngineConfig, **ie):
    return train(lora_rank=lora, lora_target_modules=targets), infer(lora_sync="adapter", **ie)


def test_config_errors_where_adapter_sync_cannot_work() -> None:
    assert adapter_rank(*_engines()) == 4 and adapter_rank(*_engines(lora=512)) == 512
    assert adapter_rank(C.HFTrainEngineConfig(lora_rank=4), C.VLLMInferEngineConfig()) == 0  # merged: the default
    cases = {
        "set train_engine.lora_rank > 0": _engines(lora=0),
        "infer_engine=hf cannot serve LoRA adapters": _engines(infer=C.HFInferEngineConfig),
        "infer_engine=sglang cannot serve LoRA adapters": _engines(infer=C.SGLangInferEngineConfig),
        "train_engine=megatron cannot export": _engines(train=C.MegatronTrainEngineConfig),
        r"names \['lm_head'\]": _engines(targets=["q_proj", "lm_head"]),
        r"names \['embed_tokens'\]": _engines(targets=r".*\.(embed_tokens|v_proj)"),
        "sleep_level=2 discards": _engines(sleep_level=2),
        # vLLM's largest LoRA rank: refused here, not after the trainer's workers had loaded the model.
        rf"lora_rank=1024: infer_engine=vllm serves LoRA adapters up to rank {vllm_max_rank(512)}": _engines(lora=1024),
    }
    for message, (te, ie) in cases.items():
        with pytest.raises(ConfigError, match=message):
            adapter_rank(te, ie)
    assert refused_targets(["q_proj", "v_proj"]) == [] and refused_targets("all-linear") == []
    with pytest.raises(ValueError, match=r"infer_engine\.lora_sync"):
        C.VLLMInferEngineConfig(lora_sync="both")


def test_a_target_regex_reaching_an_embedding_is_refused_when_weight_sync_is_set_up(trained: HFTrainEngine) -> None:
    """A regex that reaches an (untied) embedding without naming it passes the config check, which reads names only;
    the adapter export refused it at the first weight sync, after a whole rollout and training step. The worker
    refuses it when the run's WeightSync sets the adapter format (before the first rollout), with what to change."""
    from roll_core.cluster.roles import TrainGroup, TrainWorker

    te, ie = _engines(targets=r".*(q_proj|_tokens)")
    assert adapter_rank(te, ie) == 4  # what the config can see: no name of an embedding
    train = TrainGroup(TrainWorker, 1, "local", engine=vars(te), runtime={"model_path": trained.path, "lr": 1e-3})
    try:
        assert "model.embed_tokens" in train.workers[0].engine.model.targeted_module_names
        with pytest.raises(
            ConfigError,
            match=r"lora_target_modules adapts model\.embed_tokens \(an embedding\).*"
            r"lora_sync=merged",
        ):
            train.call(TrainWorker.set_weight_format, "adapter")
        assert train.workers[0].weight_format == "merged"
    finally:
        train.shutdown()
    trained.check_adapter_sync()  # all-linear: nothing refused, and the adapter is what a sync then sends
    assert sum(1 for _ in trained.iter_adapter()) > 0


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="pid namespaces are told apart through /proc")
def test_adapter_folders_of_dead_engines_are_removed_at_the_next_engine_start(tmp_path, caplog) -> None:
    """An engine killed with LoRA serving on left its adapter folder in /dev/shm (only `close` removed it). The next
    engine's start removes the folders of dead pids (this pid namespace); a live engine's folder stays."""
    import logging
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    ns = os.stat("/proc/self/ns/pid").st_ino
    dead = tmp_path / f"roll-lora-{proc.pid}-{ns}-vllm-0-abc"
    (dead / "v3").mkdir(parents=True)
    (dead / "v3" / "adapter_model.safetensors").write_bytes(b"z" * 300)
    live = tmp_path / f"roll-lora-{os.getpid()}-{ns}-vllm-1-def"
    live.mkdir()
    staging = tmp_path / f"roll-weights-{proc.pid}-{ns}-aaaaaaaaaaaa"  # another kind: the staging files' sweep
    staging.write_bytes(b"w")
    with caplog.at_level(logging.WARNING, logger="roll_engines.infer._bucket_channel"):
        sync = AdapterSync("vllm-2", 4, torch.float32, folder=str(tmp_path))
    try:
        assert sync.root.parent == tmp_path and sync.root.name.startswith(f"roll-lora-{os.getpid()}-{ns}-vllm-2-")
        assert not dead.exists() and live.exists() and staging.exists()
        assert "removed 1 leftover roll-lora entry of dead processes (300 bytes)" in caplog.text
    finally:
        sync.close()
    assert not sync.root.exists()
