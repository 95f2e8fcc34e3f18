"""Tiny random vision-language models built from configs (`model.path=builtin:tiny-qwen2.5-vl`, `tiny-qwen2-vl`,
`tiny-qwen3-vl`, `tiny-llava`), for tests and the CPU quickstart: the tiny character-level tokenizer plus the
family's picture tokens, the family's image processor with small pictures (4 to 16 picture tokens each) and a chat
template that places pictures where the messages put them. Weights are seeded: every worker builds byte-identical
models."""

from __future__ import annotations

from pathlib import Path

#: The tiny chat template with pictures: `{"type": "image"}` items become the family's picture block.
TINY_VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def mrope_section(head_dim: int) -> list[int]:
    """Rotary pairs per (temporal, height, width) section for a head of `head_dim`: Qwen2-VL's 16:24:24 split of
    its 128-wide heads, scaled (they must sum to head_dim / 2): [2, 3, 3] at 16, [8, 12, 12] at 64."""
    return [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]


def build_tiny_qwen_vl(out: Path, *, family: str = "qwen2_5_vl", hidden: int = 64, seed: int = 0) -> None:
    """Save a seeded tiny Qwen2-VL / Qwen2.5-VL model, its tokenizer, image processor and chat template to `out`."""
    import torch
    from transformers import AutoModelForImageTextToText

    from roll_core.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": QWEN_VISION_TOKENS})
    tok.chat_template = TINY_VL_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VISION_TOKENS}
    text = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_scaling={"type": "mrope", "mrope_section": mrope_section(hidden // 4)},
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    common = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig as Config
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as Images

        vision = dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden, patch_size=14,
            spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[1], window_size=56,
        )  # fmt: skip
    elif family == "qwen2_vl":
        from transformers import Qwen2VLConfig as Config
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as Images

        vision = dict(
            depth=2, embed_dim=32, hidden_size=hidden, mlp_ratio=2, num_heads=2, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2,
        )  # fmt: skip
    else:
        raise ValueError(f"no tiny builder for family {family!r}; have qwen2_vl, qwen2_5_vl")
    config = Config(text_config=text, vision_config=vision, **common)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    images = Images(
        min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16, patch_size=14, merge_size=2, temporal_patch_size=2
    )  # 4..16 picture tokens: the smallest pictures the family takes
    model.save_pretrained(out)
    tok.save_pretrained(out)
    images.save_pretrained(out)


#: The tiny LLaVA chat template: `{"type": "image"}` items become LLaVA's `<image>` placeholder.
TINY_LLAVA_CHAT_TEMPLATE = TINY_VL_CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")


def build_tiny_llava(out: Path, *, hidden: int = 64, seed: int = 0) -> None:
    """Save a seeded tiny LLaVA (CLIP vision tower, 2-layer Llama decoder, 1D positions), its tokenizer, CLIP image
    processor (pictures resized and cropped to 28x28: 4 picture tokens each) and chat template to `out`."""
    import torch
    from transformers import AutoModelForImageTextToText, CLIPVisionConfig, LlamaConfig, LlavaConfig
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from roll_core.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = TINY_LLAVA_CHAT_TEMPLATE
    text = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",  # the CLS token dropped: (28 / 14)^2 = 4 tokens per picture
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    model.save_pretrained(out)
    tok.save_pretrained(out)
    images.save_pretrained(out)


def build_tiny_qwen3_vl(out: Path, *, hidden: int = 64, seed: int = 0) -> None:
    """Save a seeded tiny Qwen3-VL (interleaved mrope, deepstack features from vision layer 1, 16-pixel patches),
    its tokenizer, image processor (4 to 16 picture tokens per picture) and chat template to `out`."""
    import torch
    from transformers import AutoModelForImageTextToText, Qwen3VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as Images

    from roll_core.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": QWEN_VISION_TOKENS})
    tok.chat_template = TINY_VL_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VISION_TOKENS}
    text = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section(hidden // 4)},
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden, patch_size=16,
        spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64, deepstack_visual_indexes=[1],
    )  # fmt: skip
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    images = Images(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 16, patch_size=16, merge_size=2, temporal_patch_size=2)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    images.save_pretrained(out)
