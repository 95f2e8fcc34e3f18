"""Whether a checkpoint folder is one the `hf` / `fsdp2` engine can resume from, said before anything is read.

`refuse_unfit(folder, ...)` runs first in roll_engines.train._hf_checkpoint's `load` and raises, naming the folder,
what it holds, what this engine is and the ways on (resume with the settings that saved it, or start a new run from
its weights: `model.path=<folder>/model`, an HF folder every engine writes), for a folder this engine cannot load:

- none at all: a checkpoint saved by a run without this role (a GRPO checkpoint holds no `critic/`) or with fewer
  critics (AsyPPO's `critic_1/`: algo.num_critics); it said the folder "has no optimizer checkpoint: it is a
  weights-only folder";
- the `megatron` engine's (`megatron_written`: `optimizer/` a Megatron distributed checkpoint, no `engine.pt`), as
  the Megatron engine refuses an hf-family one (roll_engines.train.megatron._checkpoint.read_optimizer); it failed
  on the missing `engine.pt` with a bare FileNotFoundError;
- a full-weights one for a LoRA engine (no `adapter/`); it failed with a bare FileNotFoundError on
  `adapter/adapter_config.json`;
- a LoRA one (`adapter/`) for a training engine without LoRA, whose optimizer then failed to read with
  torch.distributed.checkpoint's "Missing key in checkpoint state_dict: optimizer.state...". An engine that trains
  nothing loads its merged `model/` as before.

The run's config check on resume (roll_core.config.resume) refuses these changes first where the checkpoint records
its config; these refusals are for one that does not (saved by an older roll) and for direct `load` calls. Local:
each rank checks the folder it was given (the engines raise a failure on every rank).
"""

from __future__ import annotations

import json
import re
from pathlib import Path


def refuse_unfit(folder: Path, engine: str, role: str, lora_rank: int, trains: bool) -> None:
    """Raise FileNotFoundError or ValueError (see the module docstring) when checkpoint `folder` cannot be resumed by
    this engine: `engine` its train_engine name, `role` actor or critic, `lora_rank` its adapter rank (0: none),
    `trains` whether it has an optimizer (and so needs the checkpoint's)."""
    weights = f"model.path={folder / 'model'}"
    if not folder.is_dir():
        raise FileNotFoundError(_no_role_folder(folder, role))
    if trains and not (folder / "engine.pt").is_file() and megatron_written(folder):
        raise ValueError(
            f"{folder} is a checkpoint of train_engine=megatron, not of train_engine={engine}: its optimizer/ is a "
            "Megatron distributed checkpoint (metadata.json, common.pt) with no engine.pt, which the hf and fsdp2 "
            "engines cannot load. Resume it with the engine that wrote it (train_engine=megatron, at any TP/PP/DP "
            f"layout), or start a new {engine} run from its weights ({weights}; Adam's moments and the LR schedule "
            "start afresh)"
        )
    adapter = folder / "adapter"
    if lora_rank and not adapter.is_dir():
        raise ValueError(
            f"{folder} holds no LoRA adapter (adapter/): it was saved training every weight "
            f"(train_engine.lora_rank=0), and this {role} trains a LoRA adapter (train_engine.lora_rank={lora_rank}). "
            f"Resume with train_engine.lora_rank=0, or start a new LoRA run from its weights ({weights})"
        )
    if not lora_rank and trains and adapter.is_dir():
        saved = _saved_rank(adapter)
        raise ValueError(
            f"{folder} is a LoRA checkpoint (adapter/, rank {saved}), and this {role} trains every weight "
            f"(train_engine.lora_rank=0): its optimizer state is the adapter's. Resume with "
            f"train_engine.lora_rank={saved} (and the saved lora_alpha), or start a new run from its merged weights "
            f"({weights})"
        )


def _no_role_folder(folder: Path, role: str) -> str:
    """Why checkpoint `folder` (a step's `actor/`, `critic/`, `critic_1/`) is not there, from what its step holds."""
    if not folder.parent.is_dir():
        return f"{folder}: no such folder (nor {folder.parent})"
    held = sorted(p.name for p in folder.parent.iterdir() if p.is_dir())
    critics = [n for n in held if re.fullmatch(r"critic(_\d+)?", n)]
    if re.fullmatch(r"critic_\d+", folder.name) and critics:
        # AsyPPO's further critics: the checkpoint has fewer of them, not none
        why = f"it was saved with algo.num_critics={len(critics)}, and this run has more critics"
    else:
        why = f"it was saved by a run without this {role} (another algorithm: a critic is trained for "
        why += "algo.adv_estimator=gae only)"
    return (
        f"{folder}: no such folder; the checkpoint {folder.parent} holds "
        f"{', '.join(f'{n}/' for n in held) or 'no engine folder'}: {why}. Resume with the settings it was saved "
        f"with, or start a new run from its policy's weights (model.path={folder.parent / 'actor' / 'model'})"
    )


def megatron_written(folder: Path) -> bool:
    """Whether the `megatron` engine wrote checkpoint `folder` (a run's `actor/`, `critic/`, ...): its `optimizer/`
    is a Megatron distributed checkpoint (`metadata.json`, which Megatron's dist_checkpointing writes and
    torch.distributed.checkpoint does not), or the run config beside it (roll_core.checkpoint's config.yaml in the
    step folder) records train_engine.name=megatron."""
    import yaml

    if (folder / "optimizer" / "metadata.json").is_file():
        return True
    for config in (folder / "config.yaml", folder.parent / "config.yaml"):
        try:
            name = (yaml.safe_load(config.read_text()) or {}).get("train_engine", {}).get("name")
        except (OSError, yaml.YAMLError, AttributeError):  # absent, unreadable or not a run's config
            continue
        if name is not None:
            return name == "megatron"
    return False


def _saved_rank(adapter: Path) -> str:
    """The rank `adapter/adapter_config.json` records, or "unknown" where it cannot be read."""
    try:
        return str(json.loads((adapter / "adapter_config.json").read_text())["r"])
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"
