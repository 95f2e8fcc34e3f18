"""`data.chat_template_kwargs` (the file-fed pipelines' rows: SFT, DPO, offline distillation) is checked as
`model.chat_template_kwargs` is (roll_core.pipelines.template_kwargs): a misspelt key is refused naming
`data.chat_template_kwargs.<key>`, one the template simply lacks is a warning. Before, it was never checked: a
misspelt `+data.chat_template_kwargs.enable_thinkng=true` rendered every row without the switch, unsaid. The model's
keys, merged into the data's by the config, are checked once, under their own name."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from roll_core.errors import ConfigError
from roll_core.pipelines.template_kwargs import check_config_template_kwargs, data_own_kwargs
from roll_core.testing.chat_templates import family_tokenizer

_LOGGER = "roll_core.pipelines.template_kwargs"


def _cfg(model: dict[str, object], data: dict[str, object]) -> SimpleNamespace:
    """A config as RLVRConfig leaves it: the model's keys merged into the data's (data's win)."""
    merged = {**model, **data}
    return SimpleNamespace(
        model=SimpleNamespace(chat_template_kwargs=model), data=SimpleNamespace(chat_template_kwargs=merged)
    )


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == _LOGGER and r.levelno == logging.WARNING]


def test_a_misspelt_data_key_is_refused_naming_data() -> None:
    with pytest.raises(ConfigError) as err:
        check_config_template_kwargs(family_tokenizer("qwen3"), _cfg({}, {"enable_thinkng": True}))
    msg = str(err.value)
    assert msg.startswith("data.chat_template_kwargs.enable_thinkng: the model's chat template reads no variable")
    assert "(did you mean enable_thinking?)" in msg and "model.chat_template_kwargs" not in msg


def test_a_data_key_the_template_lacks_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=_LOGGER):
        warned = check_config_template_kwargs(family_tokenizer("llama3"), _cfg({}, {"enable_thinking": False}))
    assert warned == ["data.chat_template_kwargs.enable_thinking"]
    (line,) = _warnings(caplog)
    assert line.startswith("data.chat_template_kwargs.enable_thinking: no chat template of this model reads")


def test_the_models_keys_merged_into_the_datas_are_checked_once_under_the_models_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger=_LOGGER):
        warned = check_config_template_kwargs(family_tokenizer("llama3"), _cfg({"enable_thinking": True}, {}))
    assert warned == ["model.chat_template_kwargs.enable_thinking"]
    assert len(_warnings(caplog)) == 1
    # a data key overriding the model's value is the data's own, and checked as such
    assert data_own_kwargs({"enable_thinking": True}, {"enable_thinking": False, "x": 1}) == {
        "enable_thinking": False,
        "x": 1,
    }
    assert data_own_kwargs({"enable_thinking": True}, {"enable_thinking": True}) == {}
    check_config_template_kwargs(family_tokenizer("qwen3"), _cfg({"enable_thinking": True}, {"enable_thinking": False}))


def test_the_data_keys_are_checked_against_the_tokenizers_templates_only(tmp_path: Path) -> None:
    """The rows render with tokenizer.apply_chat_template: a name only a processor's own template reads has no effect
    on them (a warning), while it passes for the model's keys, which the prompts' processor renders with."""
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}{{ max_pictures }}")
    tok = family_tokenizer("chatml")
    assert check_config_template_kwargs(tok, _cfg({"max_pictures": 2}, {}), model_path=str(tmp_path)) == []
    warned = check_config_template_kwargs(tok, _cfg({}, {"max_pictures": 2}), model_path=str(tmp_path))
    assert warned == ["data.chat_template_kwargs.max_pictures"]


def test_the_sft_pipeline_refuses_a_misspelt_data_key_before_anything_is_built(tmp_path: Path) -> None:
    from roll_core.config import load_config
    from roll_core.pipelines.loop import Pipeline

    out, tok_dir = tmp_path / "run", tmp_path / "tok"
    family_tokenizer("qwen3").save_pretrained(tok_dir)  # a template that reads enable_thinking
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1?", "completion": "2"}\n')
    cfg = load_config(
        [
            "experiment=quickstart",
            "pipeline=sft",
            "algo=sft",
            f"data.path={rows}",
            "model.path=builtin:tiny",
            f"model.tokenizer={tok_dir}",
            "+data.chat_template_kwargs.enable_thinkng=false",
            f"pipeline.output_dir={out}",
            "pipeline.trackers=[]",
        ]
    )
    with pytest.raises(ConfigError, match=r"data\.chat_template_kwargs\.enable_thinkng.*did you mean enable_thinking"):
        Pipeline(cfg)
    assert sorted(p.name for p in out.iterdir()) == [".roll.lock"]  # no checkpoint, tracker or model files
