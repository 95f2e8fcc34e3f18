"""`infer_engine.structured` on a model whose generation prompt opens `<think>` is refused before any worker starts
(roll_core.pipelines.structured_thinking): the constraint applied to the reasoning, which a JSON schema never
closes, so the reward read every reply as cut off mid-reasoning. Templates that close the block (Qwen3 with
enable_thinking=false) or leave the tag to the model, and templates without thinking, still pass. Family tokenizers
of roll_core.testing.chat_templates, with the generation header patched as each model's own template writes it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.errors import ConfigError
from roll_core.pipelines.structured_thinking import refuse_structured_thinking
from roll_core.testing.chat_templates import family_tokenizer
from roll_core.thinking import header_opens_think

SCHEMA = {"json_schema": {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}}
_QWEN3_SWITCH = (  # the qwen3 family template's generation header switch (roll_core.testing.chat_templates.QWEN3)
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
)
_R1_HEADER = "{{- '<|Assistant|>' -}}{%- endif -%}"


def _qwen3(header: str | None) -> Any:
    """The qwen3 family tokenizer, its generation header's switch replaced by `header` (None: kept as Qwen3's)."""
    tok = family_tokenizer("qwen3")
    assert _QWEN3_SWITCH in tok.chat_template
    if header is not None:
        tok.chat_template = tok.chat_template.replace(_QWEN3_SWITCH, header)
    return tok


def _opening_with_switch() -> Any:
    """A template that opens <think> unless enable_thinking=false, which renders Qwen3's closed empty block."""
    return _qwen3(
        "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
        "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    )


def _thinking_2507() -> Any:
    """Qwen3-*-Thinking-2507's header: always opens the block, no switch."""
    return _qwen3("{{- '<think>\\n' -}}")


def _r1() -> Any:
    """DeepSeek-R1's current template: the generation prompt ends `<|Assistant|><think>\\n`."""
    tok = family_tokenizer("deepseek_r1")
    assert _R1_HEADER in tok.chat_template
    tok.chat_template = tok.chat_template.replace(_R1_HEADER, "{{- '<|Assistant|><think>\\n' -}}{%- endif -%}")
    return tok


def _cfg(structured: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    return SimpleNamespace(
        infer_engine=SimpleNamespace(structured=dict(SCHEMA) if structured is None else structured),
        model=SimpleNamespace(path="some/model", chat_template_kwargs=kwargs),
    )


def test_a_schema_on_a_template_that_opens_think_is_refused_naming_both_settings_and_the_switch() -> None:
    tok = _opening_with_switch()
    assert header_opens_think(tok) and not header_opens_think(tok, (), {"enable_thinking": False})
    with pytest.raises(ConfigError) as err:
        refuse_structured_thinking(tok, _cfg(enable_thinking=True))
    text = str(err.value)
    assert "infer_engine.structured=" in text and "model.chat_template_kwargs={'enable_thinking': True}" in text
    assert "+model.chat_template_kwargs.enable_thinking=false" in text  # tried: this template closes the block
    assert "remove infer_engine.structured" in text and "a JSON schema never closes" in text
    # the way out it names: the closed empty block passes
    refuse_structured_thinking(tok, _cfg(enable_thinking=False))


@pytest.mark.parametrize("make", [_thinking_2507, _r1], ids=["qwen3-thinking-2507", "deepseek-r1"])
def test_a_thinking_only_template_is_refused_and_told_it_has_no_switch(make: Any) -> None:
    with pytest.raises(ConfigError, match=r"no switch that closes the block") as err:
        refuse_structured_thinking(make(), _cfg(enable_thinking=True))
    assert "+model.chat_template_kwargs" not in str(err.value)  # no switch is offered that would not help


def test_a_switch_the_user_turned_on_is_offered_off() -> None:
    """DeepSeek-V3.1's `thinking` kwarg opens the block only when true: the refusal names it turned false."""
    tok = family_tokenizer("deepseek_r1")
    tok.chat_template = tok.chat_template.replace(
        _R1_HEADER,
        "{{- '<|Assistant|>' -}}{%- if thinking is defined and thinking -%}{{- '<think>\\n' -}}{%- endif -%}"
        "{%- endif -%}",
    )
    with pytest.raises(ConfigError, match=r"\+model\.chat_template_kwargs\.thinking=false") as err:
        refuse_structured_thinking(tok, _cfg(thinking=True))
    assert "enable_thinking=false" not in str(err.value)  # this template does not read it: no help
    refuse_structured_thinking(tok, _cfg())  # rendered without it, the header opens nothing


@pytest.mark.parametrize(
    ("family", "kwargs"),
    [
        ("qwen3", {"enable_thinking": False}),  # `<think>\n\n</think>\n\n`: closed
        ("qwen3", {"enable_thinking": True}),  # the model writes <think> itself (the constraint forbids it)
        ("qwen3", {}),
        ("chatml", {}),
        ("llama3", {}),
        ("deepseek_r1", {}),  # R1's older template: the header opens nothing
    ],
)
def test_templates_that_leave_no_block_open_pass(family: str, kwargs: dict[str, Any]) -> None:
    refuse_structured_thinking(family_tokenizer(family), _cfg(**kwargs))


def test_a_regex_passes_only_when_it_writes_the_close_itself() -> None:
    tok = _r1()
    refuse_structured_thinking(tok, _cfg({}))  # no constraint
    for regex in (r"[\s\S]*</think>\s*[0-9]+", r"[\s\S]*<\/think\>\n\n[0-9]+"):
        refuse_structured_thinking(tok, _cfg({"regex": regex}))
    with pytest.raises(ConfigError, match=r"a regex that does not spell </think> never closes"):
        refuse_structured_thinking(tok, _cfg({"regex": "[0-9]+"}))


def test_a_vision_processors_own_template_counts(tmp_path: Path) -> None:
    """A vision-language folder's prompts render with the processor's template: one that opens <think> is refused
    even where the tokenizer's does not."""
    (tmp_path / "chat_template.jinja").write_text(_thinking_2507().chat_template, encoding="utf-8")
    tok = family_tokenizer("qwen3")
    refuse_structured_thinking(tok, _cfg())
    with pytest.raises(ConfigError, match="opens a <think> block"):
        refuse_structured_thinking(tok, _cfg(), model_path=str(tmp_path))


def _load(tmp_path: Path, tok: Any, *extra: str) -> Any:
    from roll_core.config import load_config

    tok_dir = tmp_path / "tok"
    tok.save_pretrained(tok_dir)
    return load_config(
        [
            "experiment=quickstart",
            "model.path=builtin:tiny",
            f"model.tokenizer={tok_dir}",
            "+infer_engine.structured.regex='[0-9]+'",
            f"pipeline.output_dir={tmp_path / 'run'}",
            "pipeline.trackers=[]",
            *extra,
        ]
    )


def test_the_pipeline_refuses_it_before_anything_is_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused once the tokenizer is loaded, before the task, the roles or any file of the run; with the switch
    off the run goes on to build its task (the step after the check, stopped there to stay fast)."""
    from roll_core.pipelines import loop
    from roll_core.pipelines.loop import Pipeline

    class Built(Exception):
        pass

    def build(_env: object) -> None:
        raise Built

    monkeypatch.setattr(loop, "build", build)
    cfg = _load(tmp_path, _opening_with_switch())
    with pytest.raises(ConfigError, match=r"infer_engine\.structured=.*enable_thinking=false"):
        Pipeline(cfg)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".roll.lock"]
    off = _load(tmp_path, _opening_with_switch(), "+model.chat_template_kwargs.enable_thinking=false")
    with pytest.raises(Built):
        Pipeline(off)


def test_roll_eval_refuses_it_when_it_loads_the_tokenizer(tmp_path: Path) -> None:
    """roll-eval (single-turn and agentic tasks alike) before its engine starts."""
    from roll_core.evaluate import tokenizer_and_sampling

    cfg = _load(tmp_path, _r1())
    with pytest.raises(ConfigError, match=r"infer_engine\.structured=\{'regex': '\[0-9\]\+'\}"):
        tokenizer_and_sampling(cfg, cfg.model.tokenizer)
    plain = _load(tmp_path, family_tokenizer("deepseek_r1"))
    _tok, sampling = tokenizer_and_sampling(plain, plain.model.tokenizer)
    assert sampling.structured is not None and sampling.structured.regex == "[0-9]+"
