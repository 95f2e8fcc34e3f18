"""LoRA keys set while `train_engine.lora_rank=0` are warned about once at composition (roll_core.config.engines.
warn_ignored_lora_keys): the run fine-tunes every weight and ignored them without a word. Not an error: a sweep
over lora_rank=0,8 that shares its targets is legitimate."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from roll_core.config import load_config

WARNED = "train_engine.lora_rank=0 fine-tunes every weight"


def _warnings(caplog: pytest.LogCaptureFixture, overrides: list[str]) -> tuple[object, list[str]]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="roll_core.config.engines"):
        cfg = load_config(overrides)
    return cfg, [r.getMessage() for r in caplog.records if WARNED in r.getMessage()]


def test_lora_keys_set_without_a_rank_are_warned_about_once_by_name(caplog: pytest.LogCaptureFixture) -> None:
    cfg, warned = _warnings(caplog, ["train_engine.lora_target_modules=[q_proj,v_proj]", "train_engine.lora_alpha=32"])
    assert cfg.train_engine.lora_rank == 0
    assert len(warned) == 1
    assert "train_engine.lora_alpha=32" in warned[0] and "lora_target_modules=['q_proj', 'v_proj']" in warned[0]
    assert "lora_dropout" not in warned[0]  # at its default: not named


@pytest.mark.parametrize(
    "overrides",
    [
        [],  # every LoRA key at its default
        ["train_engine.lora_target_modules=all-linear", "train_engine.lora_alpha=16"],  # set, but to the defaults
        ["train_engine.lora_rank=8", "train_engine.lora_target_modules=[q_proj,v_proj]", "train_engine.lora_alpha=32"],
    ],
)
def test_no_warning_where_nothing_is_ignored(caplog: pytest.LogCaptureFixture, overrides: list[str]) -> None:
    cfg, warned = _warnings(caplog, overrides)
    assert warned == []
    # The wiring copies a LoRA policy's config with lora_rank=0 for the reference and critic: not a user's setting.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="roll_core.config.engines"):
        dataclasses.replace(cfg.train_engine, lora_rank=0)
    assert not [r for r in caplog.records if WARNED in r.getMessage()]
