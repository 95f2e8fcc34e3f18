"""A vision-language folder's chat template is the one transformers' processor picks (roll_core.multimodal.templates):
roll, transformers' `AutoProcessor` and vLLM (which takes the processor's template) render the same prompts from the
same folder. A folder holding `chat_template.jinja` and `chat_template.json` with different templates rendered roll's
prompts with the .jinja one and transformers' with the .json one; `processor_config.json`'s template beats both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roll_core.multimodal.processor import VisionProcessor
from roll_core.multimodal.templates import processor_template
from roll_core.pipelines.template_kwargs import template_sources

JINJA = "{% for m in messages %}JINJA {{ m['content'] }}{% endfor %}"
JSON = "{% for m in messages %}JSON {{ m['content'] }}{% endfor %}"
CONFIG = "{% for m in messages %}CONFIG {{ m['content'] }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from roll_core.multimodal.tiny import build_tiny_qwen_vl

    folder = tmp_path_factory.mktemp("vl")
    build_tiny_qwen_vl(folder)
    return folder


def _transformers_template(folder: Path) -> str | None:
    """The chat template transformers' processor loads from `folder` (its own reading of the files: AutoProcessor
    itself needs torchvision for Qwen-VL's video processor)."""
    from transformers.processing_utils import ProcessorMixin

    return ProcessorMixin.get_processor_dict(str(folder))[0].get("chat_template")


def test_with_both_files_roll_renders_with_the_template_transformers_picks(vl: Path) -> None:
    (vl / "chat_template.jinja").write_text(JINJA)
    (vl / "chat_template.json").write_text(json.dumps({"chat_template": JSON}))
    assert _transformers_template(vl) == JSON
    processor = VisionProcessor(vl)
    assert processor.chat_template == JSON  # was JINJA
    assert processor.render(MESSAGES, add_generation_prompt=False) == "JSON What is 2+2?"
    # The config check reads the template that renders (template_kwargs), not the one left unused.
    assert template_sources(None, str(vl)) == [JSON]


def test_a_processor_config_template_beats_both_files(vl: Path) -> None:
    (vl / "chat_template.jinja").write_text(JINJA)
    (vl / "chat_template.json").write_text(json.dumps({"chat_template": JSON}))
    config = vl / "processor_config.json"
    before = config.read_text() if config.is_file() else None
    try:
        config.write_text(json.dumps({**(json.loads(before) if before else {}), "chat_template": CONFIG}))
        assert _transformers_template(vl) == CONFIG
        assert VisionProcessor(vl).chat_template == CONFIG
    finally:
        config.unlink()
        if before is not None:
            config.write_text(before)


def test_one_file_alone_is_the_template_and_none_falls_back_to_the_tokenizers(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text(JINJA)
    assert processor_template(tmp_path) == JINJA
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": JSON}))
    assert processor_template(tmp_path) == JSON
    (tmp_path / "chat_template.json").unlink()
    assert processor_template(tmp_path) is None
    assert processor_template("Qwen/Qwen2.5-VL-3B-Instruct") is None  # a hub id: no folder here
