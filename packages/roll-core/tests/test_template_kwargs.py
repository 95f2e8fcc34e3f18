"""`model.chat_template_kwargs` keys are checked against the variables the chat template reads: a misspelt switch
(`enable_thinkng=false`) rendered as undefined and left Qwen3's thinking on with no word said, so it is refused; a
key the template simply lacks (the qwen3 preset's `enable_thinking` on a Qwen3 Thinking-2507 checkpoint) is a
warning, as it had trained normally before the check."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from roll_core.errors import ConfigError
from roll_core.pipelines.template_kwargs import check_template_kwargs, template_variables
from roll_core.testing.chat_templates import FAMILIES, family_tokenizer

_LOGGER = "roll_core.pipelines.template_kwargs"
_SWITCH = (  # the qwen3 family template's switch (roll_core.testing.chat_templates.QWEN3)
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
)


def _thinking_2507_tokenizer() -> object:
    """The qwen3 family's tokenizer with a Qwen3-*-Thinking-2507 style template: the generation prompt always opens
    the think block, and no `enable_thinking` switch is read."""
    tok = family_tokenizer("qwen3")
    assert _SWITCH in tok.chat_template  # the family template still has the switch this test takes out
    tok.chat_template = tok.chat_template.replace(_SWITCH, "{{- '<think>\\n' -}}")
    assert "enable_thinking" not in template_variables(tok.chat_template)
    return tok


def _unused_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == _LOGGER and r.levelno == logging.WARNING]


def test_a_key_the_template_reads_passes() -> None:
    check_template_kwargs(family_tokenizer("qwen3"), {"enable_thinking": False})


def test_a_misspelt_key_is_refused_with_a_suggestion_and_the_templates_variables() -> None:
    with pytest.raises(ConfigError) as err:
        check_template_kwargs(family_tokenizer("qwen3"), {"enable_thinkng": False})
    msg = str(err.value)
    assert "model.chat_template_kwargs.enable_thinkng" in msg
    assert "did you mean enable_thinking?" in msg
    assert "add_generation_prompt" in msg and "tools" in msg  # the variables the template reads


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "qwen3"])
def test_enable_thinking_on_a_template_without_the_switch_is_one_warning(
    family: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=_LOGGER):
        unused = check_template_kwargs(family_tokenizer(family), {"enable_thinking": False})
    assert unused == ["enable_thinking"]
    (line,) = _unused_warnings(caplog)
    assert "model.chat_template_kwargs.enable_thinking" in line
    assert "no chat template of this model reads 'enable_thinking', so it has no effect" in line


def test_the_qwen3_presets_switch_on_a_thinking_2507_template_warns_and_a_typo_is_still_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The qwen3 preset always sets enable_thinking: true; Qwen3 Thinking-2507 / Instruct-2507 and Qwen3-VL templates
    have no switch (the check refused a key the user never wrote)."""
    tok = _thinking_2507_tokenizer()
    with caplog.at_level(logging.WARNING, logger=_LOGGER):
        assert check_template_kwargs(tok, {"enable_thinking": True}) == ["enable_thinking"]
    assert len(_unused_warnings(caplog)) == 1
    with pytest.raises(
        ConfigError, match=r"chat_template_kwargs\.add_generation_promt.*did you mean add_generation_prompt"
    ):
        check_template_kwargs(tok, {"enable_thinking": True, "add_generation_promt": True})


def test_a_different_switch_name_warns_but_a_slipped_character_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    """A typo (one or two characters off) is refused; another template's name for a similar switch is not a typo."""
    tok = SimpleNamespace(chat_template="{{ messages }}{% if keep_thinking %}k{% endif %}")
    with caplog.at_level(logging.WARNING, logger=_LOGGER):
        assert check_template_kwargs(tok, {"enable_thinking": True, "thinking": True}) == [
            "enable_thinking",
            "thinking",
        ]
    assert len(_unused_warnings(caplog)) == 2
    for typo in ("keep_thinkng", "keep-thinking", "kep_thinking"):
        with pytest.raises(ConfigError, match=rf"chat_template_kwargs\.{typo}: .*did you mean keep_thinking"):
            check_template_kwargs(tok, {typo: True})


def test_named_templates_pass_a_key_any_of_them_reads() -> None:
    tok = SimpleNamespace(
        chat_template={"default": FAMILIES["chatml"].template, "tool_use": FAMILIES["qwen3"].template}
    )
    check_template_kwargs(tok, {"enable_thinking": True})
    with pytest.raises(ConfigError, match="did you mean enable_thinking"):
        check_template_kwargs(tok, {"enable_thinkin": True})
    listed = SimpleNamespace(chat_template=[{"name": "default", "template": FAMILIES["qwen3"].template}])
    check_template_kwargs(listed, {"enable_thinking": True})


def test_a_vision_processors_own_template_counts(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text("{% if max_pictures %}{{ messages }}{% endif %}")
    tok = family_tokenizer("chatml")
    check_template_kwargs(tok, {"max_pictures": 2}, model_path=str(tmp_path))
    with pytest.raises(ConfigError, match="did you mean max_pictures"):
        check_template_kwargs(tok, {"max_picture": 2}, model_path=str(tmp_path))


def test_no_template_or_no_kwargs_is_not_checked() -> None:
    check_template_kwargs(SimpleNamespace(chat_template=None), {"anything": 1})
    check_template_kwargs(family_tokenizer("chatml"), {})


def test_transformers_generation_tag_parses() -> None:
    source = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}{{ extra }}"
    assert template_variables(source) == {"messages", "extra"}


def test_roll_eval_checks_the_kwargs_when_it_loads_the_tokenizer(tmp_path: Path) -> None:
    from roll_core.evaluate import tokenizer_and_sampling

    family_tokenizer("qwen3").save_pretrained(tmp_path)
    model = SimpleNamespace(
        tokenizer=str(tmp_path), trust_remote_code=False, chat_template_kwargs={"enable_thinkng": 0}
    )
    with pytest.raises(ConfigError, match=r"enable_thinkng.*did you mean enable_thinking"):
        tokenizer_and_sampling(SimpleNamespace(model=model), str(tmp_path))


def test_the_pipeline_refuses_a_misspelt_key_before_anything_is_built(tmp_path: Path) -> None:
    from roll_core.config import load_config
    from roll_core.pipelines.loop import Pipeline

    out, tok_dir = tmp_path / "run", tmp_path / "tok"
    family_tokenizer("qwen3").save_pretrained(tok_dir)  # a template that reads enable_thinking
    cfg = load_config(
        [
            "experiment=quickstart",
            "model.path=builtin:tiny",
            f"model.tokenizer={tok_dir}",
            "+model.chat_template_kwargs.enable_thinkng=false",
            f"pipeline.output_dir={out}",
            "pipeline.trackers=[]",
        ]
    )
    with pytest.raises(ConfigError, match=r"model\.chat_template_kwargs\.enable_thinkng.*did you mean enable_thinking"):
        Pipeline(cfg)
    assert sorted(p.name for p in out.iterdir()) == [".roll.lock"]  # no checkpoint, tracker or model files


def test_the_pipeline_runs_the_qwen3_preset_on_a_template_without_the_switch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """model=qwen3 (enable_thinking: true, which the user never wrote) with a Thinking-2507 style tokenizer: one
    warning, and the run goes on to build its task (the step after the check, stopped here to stay fast)."""
    from roll_core.config import load_config
    from roll_core.pipelines import loop
    from roll_core.pipelines.loop import Pipeline

    class Built(Exception):
        pass

    def build(_env: object) -> None:
        raise Built

    tok_dir = tmp_path / "tok"
    _thinking_2507_tokenizer().save_pretrained(tok_dir)
    cfg = load_config(
        [
            "experiment=quickstart",
            "model=qwen3",
            "model.path=builtin:tiny",
            f"model.tokenizer={tok_dir}",
            f"pipeline.output_dir={tmp_path / 'run'}",
            "pipeline.trackers=[]",
        ]
    )
    assert dict(cfg.model.chat_template_kwargs) == {"enable_thinking": True}  # the preset's, not the user's
    monkeypatch.setattr(loop, "build", build)
    with caplog.at_level(logging.WARNING, logger=_LOGGER), pytest.raises(Built):
        Pipeline(cfg)
    (line,) = _unused_warnings(caplog)
    assert "model.chat_template_kwargs.enable_thinking: no chat template of this model reads" in line
