"""`model.chat_template_kwargs` keys are checked against the variables the chat template reads: a misspelt switch
(`enable_thinkng=false`) rendered as undefined and left Qwen3's thinking on with no word said."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from roll_core.errors import ConfigError
from roll_core.pipelines.template_kwargs import check_template_kwargs, template_variables
from roll_core.testing.chat_templates import FAMILIES, family_tokenizer


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
def test_enable_thinking_is_refused_by_a_template_without_thinking(family: str) -> None:
    with pytest.raises(ConfigError, match=r"model\.chat_template_kwargs\.enable_thinking"):
        check_template_kwargs(family_tokenizer(family), {"enable_thinking": False})


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

    out = tmp_path / "run"
    cfg = load_config(
        [
            "experiment=quickstart",
            "model.path=builtin:tiny",
            "+model.chat_template_kwargs.enable_thinkng=false",
            f"pipeline.output_dir={out}",
            "pipeline.trackers=[]",
        ]
    )
    with pytest.raises(ConfigError, match=r"model\.chat_template_kwargs\.enable_thinkng"):
        Pipeline(cfg)
    assert sorted(p.name for p in out.iterdir()) == [".roll.lock"]  # no checkpoint, tracker or model files
