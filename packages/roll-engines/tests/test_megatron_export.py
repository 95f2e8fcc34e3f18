"""The `megatron` engine's weight export (roll_engines.train.megatron._export) in process at TP=PP=EP=1: weight sync
streams it, so `iter_weights` holds at most about one layer beyond the model's own tensors, in the parameters'
dtype (a bf16 model's weights leave as bf16). PP=2 and EP=2 stream on Ray (tests/e2e/test_megatron_ray.py). And
Megatron in bf16 compute: a step tracks the fp32 step, its master weights stay fp32, and its exported model folder
is bf16."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
pytestmark = pytest.mark.usefixtures("megatron_process_group")


def stream(pairs: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, dict[str, tuple[torch.Tensor, torch.dtype]]]:
    """Consume `pairs` (an export), keeping none of them: (the peak bytes, over the yields, of the tensors alive
    that the export made, i.e. of storages that no tensor had before it started; the yielded tensors' CPU fp32
    copies by name)."""

    def storages(tensors: list[torch.Tensor]) -> dict[int, int]:
        out = {}
        for t in tensors:
            if t.is_meta:
                continue
            try:
                s = t.untyped_storage()
                out[s.data_ptr()] = s.nbytes()
            except RuntimeError:
                # A tensor left by an earlier test in this process whose storage was invalidated (its memory is
                # gone): it holds no bytes and is not the export's.
                continue
        return out

    # type(), not isinstance (which trips deprecated proxies); before: every tensor (parameters too), then plain
    # ones only (what an export makes): the fastest test over the process's half a million objects.
    known = set(storages([o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]))
    peak, got = 0, {}
    for name, t in pairs:
        copy = t.detach().to("cpu", torch.float32, copy=True)
        known.add(copy.untyped_storage().data_ptr())  # the test's, not the export's
        got[name] = copy, t.dtype
        del t, copy
        live = storages([o for o in gc.get_objects() if type(o) is torch.Tensor])
        peak = max(peak, sum(n for ptr, n in live.items() if ptr not in known))
    return peak, got


def layer_bytes(weights: dict[str, tuple[torch.Tensor, torch.dtype]]) -> int:
    """Bytes of the largest layer (`model.layers.i.*`, in the exported dtype), or of the largest tensor outside."""
    groups: dict[str, int] = {}
    for name, (t, dtype) in weights.items():
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name
        groups[key] = groups.get(key, 0) + t.numel() * dtype.itemsize
    return max(groups.values())


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory: pytest.TempPathFactory) -> str:
    from roll_core.models import build_tiny_model

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    folder = tmp_path_factory.mktemp("tiny4")
    build_tiny_model(folder, layers=3)
    return str(folder)


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [
        ("llama", "float32"),
        # CI time: bf16 stays in the README test command with the critic; `nox -s full_matrix` runs this one
        pytest.param("llama", "bfloat16", marks=pytest.mark.full_matrix),
        ("qwen3_moe", "float32"),
        ("critic", "bfloat16"),
    ],
    ids=["fp32", "bf16", "moe", "critic-bf16"],
)
def test_iter_weights_streams_one_layer_at_a_time(three_layers: str, tmp_path: Path, kind: str, dtype: str) -> None:
    """Over the whole export, the tensors it made and still holds at a yield never exceed one layer's bytes (a
    3-layer model: the export that gathered every tensor first held 2.1 layers at its first yield, and 6.6 bf16
    layers in bf16, the whole model upcast to fp32); a MoE layer's experts leave fused, a critic's value head
    last. The streamed tensors are the HF model's, in the parameters' dtype (bf16: no fp32 copy), and equal the
    checkpoint's."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from roll_core.testing.models import tiny_critic, tiny_model
    from roll_engines.train.megatron import MegatronTrainEngine

    if kind == "llama":
        path = three_layers
    else:
        path = tiny_critic(tmp_path) if kind == "critic" else tiny_model(kind, tmp_path / kind)
    role = "critic" if kind == "critic" else "actor"
    engine = MegatronTrainEngine(path, role=role, dtype=dtype, dist_backend="gloo", use_distributed_optimizer=False)
    peak, got = stream(engine.iter_weights())
    assert 0 < peak <= layer_bytes(got), (peak, layer_bytes(got))
    want = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    assert {d for _, d in got.values()} == {want}
    hf_class = AutoModelForTokenClassification if kind == "critic" else AutoModelForCausalLM
    hf = dict(hf_class.from_pretrained(path, dtype=torch.float32).named_parameters())
    assert got.keys() == hf.keys()
    for name, w in hf.items():
        torch.testing.assert_close(got[name][0], w.detach().to(want).float(), atol=0, rtol=0, msg=name)
    # get_weights (tests, tools) still gives fp32 copies of the same weights.
    for name, w in engine.get_weights().items():
        assert w.dtype == torch.float32 and torch.equal(w, got[name][0]), name


def test_bf16_compute_tracks_fp32_and_keeps_fp32_masters(tmp_path: Path) -> None:
    """Megatron with bf16 compute (model.dtype=bfloat16; the model's parameters bf16, Megatron's optimizer holding
    fp32 masters) on CPU: four steps land within 15% of the fp32 run's update from it (6% here), its masters are
    fp32, and weight sync gets bf16 tensors. The checkpoint is bf16-exact: Megatron builds the masters from the
    bf16 model, so an fp32 checkpoint's rounding (2^-9 of each weight) would dwarf lr-1e-5 updates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roll_core.models import resolve_model_path
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch
    from roll_engines.train.megatron import MegatronTrainEngine
    from roll_engines.train.megatron._checkpoint import parts

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path / "cache"))
    source, path = resolve_model_path("builtin:tiny"), str(tmp_path / "bf16-exact")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16())
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    batch = toy_batch(path)

    def masters(engine: MegatronTrainEngine) -> dict[str, torch.Tensor]:
        """The optimizer's fp32 weights by Megatron name (a bf16 parameter's master; an fp32 parameter itself)."""
        main = {}
        for opt in parts(engine.optimizer):
            groups = zip(getattr(opt, "float16_groups", []), getattr(opt, "fp32_from_float16_groups", []))
            for model_group, main_group in groups:
                main.update({id(p): m for p, m in zip(model_group, main_group)})
        return {n: main.get(id(p), p).detach().clone() for n, p in engine.model.named_parameters()}

    def run(dtype: str) -> tuple[MegatronTrainEngine, dict, dict]:
        engine = MegatronTrainEngine(
            path, dtype=dtype, lr=1e-5, micro_batch_size=6, dist_backend="gloo", use_distributed_optimizer=False
        )
        before = masters(engine)
        for _ in range(4):
            engine.train_step(batch, PolicyObjective())
        return engine, before, masters(engine)

    _, w0, ref = run("float32")
    mixed_engine, start, mixed = run("bfloat16")
    assert all(torch.equal(start[k], w0[k]) for k in w0)  # both runs start from the same weights
    assert {p.dtype for p in mixed_engine.model.parameters()} == {torch.bfloat16}
    assert {m.dtype for m in mixed.values()} == {torch.float32}, "master weights must stay fp32"
    assert {v.dtype for _, v in mixed_engine.iter_weights()} == {torch.bfloat16}

    def dist(a: dict, b: dict) -> float:
        return float(sum(((a[k].float() - b[k].float()) ** 2).sum() for k in a).sqrt())

    ratio = dist(mixed, ref) / dist(ref, w0)
    assert ratio < 0.15, f"the bf16-compute run is {ratio:.0%} of the update away from fp32"


def test_the_exported_folder_keeps_the_models_generation_config(three_layers: str, tmp_path: Path) -> None:
    """`checkpoints/step_N/actor/model` is a model folder of its own (another run's model.path, a serving engine's
    model): it carries model_path's generation_config.json, as the hf engine's save does. Built from the config
    alone, the megatron folder dropped the sampling defaults and the extra stop id below, so the exported model
    generated past the end of a turn."""
    import shutil

    from transformers import AutoModelForCausalLM, GenerationConfig

    from roll_engines.train.megatron import MegatronTrainEngine

    src = tmp_path / "src"
    shutil.copytree(three_layers, src)
    gen = GenerationConfig.from_pretrained(src)
    gen.update(do_sample=True, temperature=0.6, top_p=0.9, eos_token_id=[gen.eos_token_id, 5])
    gen.save_pretrained(src)
    engine = MegatronTrainEngine(str(src), trainable=False, dist_backend="gloo", use_distributed_optimizer=False)
    engine.save(tmp_path / "ckpt", str(src))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model").generation_config
    assert (saved.do_sample, saved.temperature, saved.top_p) == (True, 0.6, 0.9)
    assert saved.eos_token_id == [gen.eos_token_id[0], 5]


@pytest.mark.parametrize("kind", ["actor", "critic", "lora"])
def test_a_bf16_run_exports_its_model_in_bf16(tmp_path: Path, kind: str) -> None:
    """A bf16 run's `checkpoints/step_N/<role>/model` holds the weights the model computes with, in bf16 (its fp32
    masters, rounded: the optimizer checkpoint keeps the masters themselves), and config.json says bfloat16, as the
    hf engine writes its parameters in their own dtype. The folder loads with plain transformers in bf16 and gives
    the engine's log-probs (values for the critic; the merged model for LoRA). The megatron engine wrote bf16 values
    upcast to fp32: twice the size, labelled float32."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from roll_core.models import resolve_model_path
    from roll_core.pipelines.objectives import PolicyObjective, ValueObjective
    from roll_core.testing.batches import critic_batch, toy_batch
    from roll_core.testing.models import tiny_critic
    from roll_engines.train.megatron import MegatronTrainEngine

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path / "cache"))
    critic = kind == "critic"
    path = tiny_critic(tmp_path) if critic else resolve_model_path("builtin:tiny")
    batch = critic_batch(path) if critic else toy_batch(path)
    lora = {"lora_rank": 4, "lora_alpha": 8.0} if kind == "lora" else {}
    engine = MegatronTrainEngine(
        path,
        role="critic" if critic else "actor",
        dtype="bfloat16",
        lr=1e-2,  # the weights move well past bf16's rounding: the export is the trained model's
        micro_batch_size=6,
        dist_backend="gloo",
        use_distributed_optimizer=False,
        **lora,
    )
    before = engine.get_weights()
    for _ in range(2):
        engine.train_step(batch, ValueObjective(clip=0.2) if critic else PolicyObjective())
    engine.save(tmp_path / "ckpt", path)

    folder = tmp_path / "ckpt" / "model"
    saved = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    live = {k: v.detach().cpu() for k, v in engine.iter_weights()}  # what the model computes with (LoRA merged)
    assert saved.keys() == live.keys()
    moved = [k for k in live if not torch.equal(live[k].float(), before[k])]
    assert moved, "training changed no weight"
    for name, w in live.items():
        assert w.dtype == torch.bfloat16 and torch.equal(saved[name], w), name

    hf = (AutoModelForTokenClassification if critic else AutoModelForCausalLM).from_pretrained(folder).eval()
    assert hf.dtype == torch.bfloat16
    ids, mask, resp = batch["input_ids"], batch["attention_mask"], batch["responses"]
    r = resp.shape[1]
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits.float()
    if critic:
        want, got = out[:, -r - 1 : -1, 0], engine.compute_values(batch)["values"]
    else:
        want = torch.log_softmax(out[:, -r - 1 : -1], -1).gather(-1, resp[..., None])[..., 0]
        got = engine.compute_logprobs(batch)["logprobs"]
    m = batch["response_mask"].bool()
    # bf16 kernels differ between Megatron and transformers (log-probs 4e-3 apart here; values of ~16 one bf16 step,
    # 0.0625); the two steps moved the outputs by ~0.5 and more.
    torch.testing.assert_close(got[m], want[m], atol=3e-2, rtol=1e-2)
