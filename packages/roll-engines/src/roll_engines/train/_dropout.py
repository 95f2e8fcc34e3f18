"""Dropout off everywhere in a training engine's model (roll_engines.train.hf `_load`; the fsdp2 engine too).

Contract: after `disable_dropout(model)` a forward in training mode computes what the same forward computes in eval
mode (the log-probs and values a step trains on are those its scoring passes computed: the PPO ratio of unchanged
weights is exactly 1). Three kinds of dropout are zeroed:
- dropout modules (`torch.nn.Dropout` and its 1d/2d/3d/alpha siblings): their `p`;
- float attributes of any module whose name holds "drop" (`attention_dropout`, `dropout_p`, `resid_pdrop`,
  `drop_path_rate`, ...): transformers' attention layers pass `dropout=0.0 if not self.training else
  self.attention_dropout` to their kernels, so a checkpoint with `attention_dropout: 0.1` (zeroing the modules
  alone missed it) trained on log-probs 0.16 off the scoring passes' on the tiny model;
- the same float fields of the model's config and its nested configs (Falcon reads `config.hidden_dropout` in its
  forward). The checkpoint's saved config then says 0: the policy was trained without dropout.
"""

from __future__ import annotations

import logging

import torch
from torch.nn.modules.dropout import _DropoutNd

log = logging.getLogger(__name__)


def _is_rate(name: str, value: object) -> bool:
    return "drop" in name.lower() and isinstance(value, float) and not isinstance(value, bool) and value != 0.0


def _zero_config(config: object, seen: set[int]) -> list[str]:
    """Zero the dropout rates of a transformers config and its nested configs; the names zeroed."""
    from transformers import PretrainedConfig

    if id(config) in seen:
        return []
    seen.add(id(config))
    zeroed = []
    for name, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            zeroed += [f"{name}.{z}" for z in _zero_config(value, seen)]
        elif _is_rate(name, value):
            setattr(config, name, 0.0)
            zeroed.append(name)
    return zeroed


def disable_dropout(model: torch.nn.Module) -> list[str]:
    """Set every dropout rate of `model` (modules, float attributes, config fields: module docstring) to 0; returns
    the names of what was nonzero (logged)."""
    zeroed: list[str] = []
    for mname, module in model.named_modules():
        if isinstance(module, _DropoutNd):
            if module.p:
                zeroed.append(f"{mname}.p")
            module.p = 0.0
            continue
        for name, value in list(vars(module).items()):
            if _is_rate(name, value):
                setattr(module, name, 0.0)
                zeroed.append(f"{mname}.{name}" if mname else name)
    config = getattr(model, "config", None)
    if config is not None:
        zeroed += [f"config.{z}" for z in _zero_config(config, set())]
    if zeroed:
        log.info(
            "dropout set to 0 (the engines train without it): %s%s", ", ".join(zeroed[:4]), ", ..." * (len(zeroed) > 4)
        )
    return zeroed
