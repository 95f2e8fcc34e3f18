"""A LLaVA picture's placeholder count is its vision tower's feature count (roll_core.multimodal.processor): one
per patch, plus the tower's class token where it has one (CLIP: 1, SigLIP as in llava-interleave: 0), less the
first feature under the "default" strategy, as transformers' LlavaProcessor counts them. roll counted a CLS token
for every tower: a SigLIP-towered LLaVA got one placeholder more than the model's features per picture and every
prompt failed in the model ("Image features and image tokens do not match"). A tower roll does not know is a
ValueError when the processor is built. Tiny random models built from configs in tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from roll_core.multimodal import VisionProcessor, as_content


def _tiny_llava(out: Path, tower: str, strategy: str) -> None:
    """A tiny random LLaVA with a `tower` (clip | siglip) vision tower of 28x28 pictures (2x2 patches of 14)."""
    from transformers import AutoModelForImageTextToText, CLIPVisionConfig, LlamaConfig, LlavaConfig, SiglipVisionConfig
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from roll_core.models import build_tiny_tokenizer
    from roll_core.multimodal.tiny import TINY_LLAVA_CHAT_TEMPLATE

    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = TINY_LLAVA_CHAT_TEMPLATE
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14)
    vision = (CLIPVisionConfig if tower == "clip" else SiglipVisionConfig)(image_size=28, **small)
    text = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy=strategy,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(out)


@pytest.mark.parametrize(
    ("tower", "strategy", "tokens"),
    [("clip", "default", 4), ("clip", "full", 5), ("siglip", "default", 3), ("siglip", "full", 4)],
)
def test_placeholders_are_the_towers_feature_count(tmp_path: Path, tower: str, strategy: str, tokens: int) -> None:
    from transformers import AutoModelForImageTextToText

    _tiny_llava(tmp_path, tower, strategy)
    vp = VisionProcessor(tmp_path)
    pics = [Image.new("RGB", (40, 30), (200, 9, 9)), Image.new("RGB", (28, 90), (9, 9, 200))]
    ids, mm = vp.encode_messages([{"role": "user", "content": as_content("<image> and <image>?", 2)}], pics)
    assert mm is not None and mm.tokens_per_image == [tokens, tokens]
    model = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values=mm.tensors["pixel_values"]).pooler_output
        assert [int(f.shape[0]) for f in features] == mm.tokens_per_image  # what the model scatters
        logits = model(input_ids=torch.tensor([ids]), **mm.tensors).logits  # (raised on a count mismatch)
    assert logits.shape[1] == len(ids) and bool(torch.isfinite(logits).all())


def test_a_tower_roll_cannot_count_is_refused_when_the_processor_is_built(tmp_path: Path) -> None:
    from transformers import LlavaConfig

    LlavaConfig(vision_config={"model_type": "pixtral"}, text_config={"model_type": "llama"}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"LLaVA model with a 'pixtral' vision tower.*clip_vision_model"):
        VisionProcessor(tmp_path)
