"""The factory of collectors fed by row files (`pipeline=sft`, `pipeline=dpo`): rows read once, before any model.

`check(cfg, task)` validates the settings (`reward_model=hf` is refused: these collectors never build it), loads the
run's tokenizer and reads and tokenises the rows, so bad data is an error before any model loads; the rows are
handed to the collector built next for the same config (read again by the collector when none was checked:
`roll-eval`, tools).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from roll_core.config.schema import RLVRConfig
from roll_core.pipelines.collectors import Collector, CollectorContext
from roll_core.posttrain.source import PostTrainData


class FileRowsFactory:
    """A `roll.collectors` factory for a collector of file rows (see the module docstring)."""

    trajectories = False

    def __init__(
        self,
        objective: str,
        check: Callable[[RLVRConfig, Any], None],
        read: Callable[[RLVRConfig, Any], PostTrainData],
        build: Callable[[CollectorContext, PostTrainData | None], Collector],
    ) -> None:
        self.objective = objective
        self._check, self._read, self._build = check, read, build
        self._checked: tuple[RLVRConfig, PostTrainData] | None = None

    def check(self, cfg: RLVRConfig, task: Any) -> None:
        """ConfigError for settings the pipeline cannot use (a reward model among them), then the rows read."""
        from roll_core.pipelines.collectors import refuse_reward_model

        name = getattr(cfg.pipeline, "name", self.objective)
        refuse_reward_model(cfg, name, "it trains on the given responses of its data files")
        self._check(cfg, task)
        from transformers import AutoTokenizer

        from roll_core.models import resolve_model_path

        model = cfg.model  # the tokenizer the pipeline loads (roll_core.pipelines.loop.Pipeline)
        tokenizer = AutoTokenizer.from_pretrained(
            model.tokenizer or resolve_model_path(model.path), trust_remote_code=model.trust_remote_code
        )
        self._checked = (cfg, self._read(cfg, tokenizer))

    def __call__(self, ctx: CollectorContext) -> Collector:
        checked, self._checked = self._checked, None  # held only from check to this build
        return self._build(ctx, checked[1] if checked is not None and checked[0] is ctx.cfg else None)
