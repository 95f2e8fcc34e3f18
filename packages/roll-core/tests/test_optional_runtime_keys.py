"""A train engine written against the runtime keys before `optimizer_steps_per_step` (a plugin's) still builds: the
key is optional (roll_core.interfaces.runtime.OPTIONAL_RUNTIME_KEYS), passed only to an engine whose constructor
takes it, and an engine that does not is built without it, with one warning saying that it cannot re-base its LR
schedule on resume. Before, `check_engine_kwargs` refused the key: the plugin failed at build with a TypeError.
Other keys stay strict: an unknown one, or a catch-all `**kwargs`, is still an error."""

from __future__ import annotations

import logging
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from roll_core.cluster.roles import build_engine
from roll_core.config import load_config
from roll_core.interfaces.runtime import TRAIN_RUNTIME_KEYS
from roll_core.pipelines.wiring import optimizer_schedule

#: A plugin's train engine taking every runtime key it knew of (the schedule's, without optimizer_steps_per_step),
#: and one of a newer plugin that takes it too.
PLUGIN = """
class OldTrainEngine:
    def __init__(self, model_path, dtype, attn_implementation, trust_remote_code, seed, device, role,
                 trainable=True, lr=1e-5, weight_decay=0.0, warmup_steps=0, total_steps=1, lr_schedule="constant",
                 max_grad_norm=1.0, image_min_pixels=None, image_max_pixels=None):
        self.total_steps = total_steps


class NewTrainEngine(OldTrainEngine):
    def __init__(self, model_path, dtype, attn_implementation, trust_remote_code, seed, device, role,
                 trainable=True, lr=1e-5, weight_decay=0.0, warmup_steps=0, total_steps=1,
                 optimizer_steps_per_step=1, lr_schedule="constant", max_grad_norm=1.0, image_min_pixels=None,
                 image_max_pixels=None):
        self.total_steps, self.optimizer_steps_per_step = total_steps, optimizer_steps_per_step
"""


class _Worker:
    """What build_engine records on its worker."""


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The plugin's module name, importable for this test."""
    (tmp_path / "ckptfix_plugin_engine.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ckptfix_plugin_engine", raising=False)
    import roll_core.interfaces.runtime as runtime

    monkeypatch.setattr(runtime, "_said", set(), raising=False)  # (logged once per process: once per test here)
    return "ckptfix_plugin_engine"


def _actor_runtime() -> dict[str, Any]:
    """The actor's runtime as roll_core.pipelines.wiring.build_roles builds it: 2 mini-batches of 4 steps."""
    cfg = load_config(["model=tiny", "pipeline.max_steps=4", "algo.num_mini_batches=2"])
    common = {"model_path": "/nowhere", "attn_implementation": "eager", "trust_remote_code": False, "seed": 1}
    schedule = optimizer_schedule(cfg)
    assert schedule["optimizer_steps_per_step"] == 2
    runtime = {**common, "platform": "cpu", "device": "auto", "dtype": "float32", "role": "actor", "lr": 1e-5}
    return {**runtime, **schedule}


def test_an_engine_without_the_key_builds_and_says_once_what_it_cannot_do(
    plugin: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="roll_core.interfaces.runtime"):
        engines = [build_engine(_Worker(), {"_target_": f"{plugin}.OldTrainEngine"}, _actor_runtime()) for _ in "ab"]
    assert [e.total_steps for e in engines] == [8, 8]
    said = [r.getMessage() for r in caplog.records if "optimizer_steps_per_step" in r.getMessage()]
    assert len(said) == 1 and "cannot re-base its LR schedule on resume" in said[0], said
    assert "OldTrainEngine" in said[0]


def test_an_engine_that_takes_the_key_gets_it(plugin: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="roll_core.interfaces.runtime"):
        engine = build_engine(_Worker(), {"_target_": f"{plugin}.NewTrainEngine"}, _actor_runtime())
    assert engine.optimizer_steps_per_step == 2 and engine.total_steps == 8
    assert not caplog.records


def test_other_keys_stay_strict(plugin: str) -> None:
    from roll_core.interfaces.runtime import supported_runtime

    with pytest.raises(TypeError, match=r"OldTrainEngine does not accept the runtime key\(s\) \['bogus'\]"):
        build_engine(_Worker(), {"_target_": f"{plugin}.OldTrainEngine"}, {**_actor_runtime(), "bogus": 1})

    def swallows(model_path: str, **unused: Any) -> None: ...

    # a catch-all gets the runtime as it is, for check_engine_kwargs to refuse
    runtime = {k: 1 for k in TRAIN_RUNTIME_KEYS}
    assert supported_runtime(swallows, runtime) == runtime
