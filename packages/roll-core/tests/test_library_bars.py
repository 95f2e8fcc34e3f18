"""roll_core.library_bars: each library's progress-bar variable is the user's where set, roll's where not.

One variable set by hand (HF_DATASETS_DISABLE_PROGRESS_BARS=1, or left behind by a run started in the same process)
made roll leave the other libraries' bars on: transformers' `Loading weights` bars filled a log file.
"""

from __future__ import annotations

import io
import os

import pytest

from roll_core.library_bars import BAR_VARIABLES, quiet_library_bars


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The libraries' disable calls quiet_library_bars makes, recorded instead of made (no global bar state changes:
    huggingface_hub refuses to turn bars back on once its variable is set)."""
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as transformers_logging

    made: list[str] = []
    monkeypatch.setattr(hub_utils, "disable_progress_bars", lambda *a, **k: made.append("hub"))
    monkeypatch.setattr(transformers_logging, "disable_progress_bar", lambda: made.append("transformers"))
    for variable in BAR_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    return made


def test_one_variable_set_by_hand_still_quiets_the_others(calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "0")  # the user's: kept as it is
    assert quiet_library_bars(io.StringIO()) is True
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "0"
    assert calls == ["hub", "transformers"]


def test_every_variable_set_by_hand_or_a_terminal_changes_nothing(
    calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in BAR_VARIABLES:
        monkeypatch.setenv(variable, "0")
    assert quiet_library_bars(io.StringIO()) is False and calls == []

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for variable in BAR_VARIABLES:
        monkeypatch.delenv(variable)
    assert quiet_library_bars(Terminal()) is False and calls == []
    assert all(os.environ.get(v) is None for v in BAR_VARIABLES)
