"""A vision-language checkpoint renders prompts as its base did, for roll and transformers alike, when the base holds
both `chat_template.jinja` and `chat_template.json` with different templates: transformers' processor (and vLLM)
take the .json one, and so do roll's prompts (roll_core.multimodal.templates) and the exported folder. roll read the
.jinja one: the run trained on prompts transformers and vLLM would not render from the same folder, and the export
kept only the .jinja one, so transformers on the checkpoint rendered otherwise than on the base."""

from __future__ import annotations

import json
from pathlib import Path

from roll_core.multimodal.processor import VisionProcessor

JINJA = "{% for m in messages %}JINJA {{ m['content'] }}{% endfor %}"
JSON = "{% for m in messages %}JSON {{ m['content'] }}{% endfor %}"


def _transformers_template(folder: Path) -> str | None:
    """The processor template transformers loads from `folder` (AutoProcessor itself needs torchvision here)."""
    from transformers.processing_utils import ProcessorMixin

    return ProcessorMixin.get_processor_dict(str(folder))[0].get("chat_template")


def test_a_checkpoint_of_a_folder_with_both_template_files_renders_as_transformers_does(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from roll_core.multimodal.tiny import build_tiny_qwen_vl
    from roll_engines.train.hf import HFTrainEngine

    base = tmp_path / "vl"
    build_tiny_qwen_vl(base)
    (base / "chat_template.jinja").write_text(JINJA)
    (base / "chat_template.json").write_text(json.dumps({"chat_template": JSON}))
    assert _transformers_template(base) == JSON
    assert VisionProcessor(base).chat_template == JSON  # the run's prompts (was JINJA)
    tokenizer_template = AutoTokenizer.from_pretrained(base).chat_template  # the tokenizer reads the .jinja file

    HFTrainEngine(str(base), lr=1e-2).save(tmp_path / "ckpt", str(base))
    folder = tmp_path / "ckpt" / "model"
    assert _transformers_template(folder) == JSON  # was JINJA: the export lost the processor's template
    assert VisionProcessor(folder).chat_template == JSON
    assert AutoTokenizer.from_pretrained(folder).chat_template == tokenizer_template  # the tokenizer's kept
