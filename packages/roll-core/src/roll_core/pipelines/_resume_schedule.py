"""A resumed run whose settings change the optimizer steps a training step takes: the LR schedule is re-based.

The train engines' LR schedule (algo.warmup_steps, algo.lr_schedule over pipeline.max_steps x algo.ppo_epochs x
mini-batches optimizer steps: roll_core.pipelines.wiring.optimizer_schedule) counts optimizer steps, and a checkpoint
keeps that count with the optimizer steps per training step it was taken at (the engines' runtime key
`optimizer_steps_per_step`). A resume that changes that number (algo.num_mini_batches, algo.mini_batch_size,
algo.ppo_epochs, or pipeline.rollout_batch_size with a mini_batch_size) has every train engine, actor and critics
alike, re-base the count to as many training steps of the new plan (roll_engines.train._settings.rebased): the run
goes on where a run with the new settings from its start would be, as a changed pipeline.max_steps alone keeps the
count (a run planned with the new length). Before, the saved count was read against the new plan: 2 mini-batches ->
1 at step 5 of 10 under a cosine schedule put the schedule at its end and the remaining steps trained at LR 0.
`schedule_rebase` says so in one INFO line (from -> to, the LR it gives: roll_algos.schedules.lr_multiplier, the
engines' own rule). Adam's own step counts (its bias correction) are not re-based: they count the updates the moments
took.

The engines re-base only a count recorded with its steps per training step: a checkpoint written before they
recorded it (hf/fsdp2: `engine.pt` without `optimizer_steps_per_step`; Megatron: the optimizer checkpoint's common
state `optimizer/common.pt` without it) keeps its count, which the new plan may read as its end (LR 0). So
`log_schedule_rebase` first reads each train engine's record in the checkpoint (`recorded`: the small files, not the
weights or Adam's moments), and where one lacks it, or roll cannot tell (another engine's layout: a plugin's, which
may not take the runtime key at all: roll_core.interfaces.runtime.OPTIONAL_RUNTIME_KEYS), it logs a WARNING instead:
where the schedule goes on, the LR there (0 at the schedule's end), and the remedy (resume with the checkpoint's
settings).

May assume: `saved` is the checkpoint's config as a plain nested dict (roll_core.checkpoint.CheckpointManager
.read_config), `cfg` this run's typed config. The "from" count is an estimate: steps that skipped every optimizer
step (non-finite) or trained nothing did not advance it, so the checkpoint's count is at most `step` x its steps per
training step (the engines scale the count they hold). A checkpoint written before the engines recorded their steps
per training step keeps its count (the engines cannot tell what it was counted at).
"""

from __future__ import annotations

import json
import logging
import pickle
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from roll_algos.schedules import lr_multiplier
from roll_core.checkpoint import CheckpointManager
from roll_core.pipelines.wiring import mini_batches

log = logging.getLogger(__name__)


#: The train engines' folders in a checkpoint (roll_core.pipelines.trainer.Trainer.save): the actor, the critics.
_ENGINE_FOLDER = re.compile(r"actor|critic(_\d+)?")

#: Where an engine records its optimizer steps per training step: hf/fsdp2's engine state, Megatron's optimizer
#: checkpoint's common state (both small: the schedule, param groups, no weights or moments).
_RECORDS = ("engine.pt", "optimizer/common.pt")


def recorded(folder: Path) -> dict[str, bool | None]:
    """Each train engine folder of checkpoint `folder` (actor, critic, critic_1, ...): whether its optimizer state
    records the optimizer steps per training step its schedule's count was taken at (True: the engine re-bases the
    count on resume), does not (False: a checkpoint written before roll recorded it; the count is kept), or None when
    roll cannot tell (no `engine.pt` or Megatron `optimizer/common.pt`: another engine's layout, or a file that
    cannot be read)."""
    import torch

    out: dict[str, bool | None] = {}
    for engine in sorted(p for p in Path(folder).iterdir() if p.is_dir() and _ENGINE_FOLDER.fullmatch(p.name)):
        out[engine.name] = None
        for name in _RECORDS:
            if (engine / name).is_file():
                try:
                    state = torch.load(engine / name, map_location="cpu", weights_only=True)
                except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:  # the engine's load says why
                    log.debug("reading %s: %s", engine / name, exc)
                    break
                out[engine.name] = isinstance(state, Mapping) and "optimizer_steps_per_step" in state
                break
    return out


def log_schedule_rebase(folder: Path, cfg: Any) -> str | None:
    """Log and return `schedule_rebase`'s message for a resume from checkpoint `folder` under `cfg`: INFO when every
    train engine's state records its optimizer steps per training step (`recorded`: the engines re-base the
    schedule), else a WARNING saying where the schedule goes on instead. None (nothing logged) when the schedule
    keeps its place or the checkpoint records no config (an older roll's)."""
    saved = CheckpointManager.read_config(Path(folder))
    if saved is None:
        return None
    step = int(json.loads((Path(folder) / "state.json").read_text())["step"])
    if schedule_rebase(saved, cfg, step) is None:  # (nothing to re-base: the engines' files are not read)
        return None
    records = recorded(Path(folder))
    missing = [name for name, has in records.items() if has is False]
    unknown = [name for name, has in records.items() if has is None] or ([] if records else ["its train engines"])
    message = schedule_rebase(saved, cfg, step, missing=missing, unknown=unknown)
    if message is not None:
        log.log(logging.WARNING if missing or unknown else logging.INFO, "%s", message)
    return message


def optimizer_steps_per_step(cfg: Any) -> int:
    """Optimizer steps the schedule plans per training step: algo.ppo_epochs x mini-batches (`cfg`: a typed config
    or one whose groups are attribute namespaces)."""
    return int(cfg.algo.ppo_epochs) * mini_batches(cfg)


def schedule_rebase(
    saved: Mapping[str, Any],
    cfg: Any,
    step: int,
    missing: Sequence[str] = (),
    unknown: Sequence[str] = (),
) -> str | None:
    """A line saying where the LR schedule goes on when resuming at checkpoint `step` under `cfg`: re-based from the
    checkpoint's optimizer-step count to `step` x this run's optimizer steps per training step (see the module
    docstring); None when the count stays (same optimizer steps per training step, or a config of another shape).
    With engines that cannot re-base it (`missing` or `unknown`), a warning instead: where the kept count puts the
    schedule and its LR, and what to do; None when the LR is the same either way (a constant schedule past its
    warm-up).

    Args:
        saved: the checkpoint's config (a plain nested dict).
        cfg: this run's typed config.
        step: the checkpoint's training step.
        missing: the checkpoint's engine folders whose state does not record its steps per training step.
        unknown: those where roll cannot tell (`recorded`'s None).
    """
    try:
        old = optimizer_steps_per_step(_namespace(saved))
    except (AttributeError, KeyError, TypeError, ValueError):  # a config of another shape (an older roll's)
        return None
    new = optimizer_steps_per_step(cfg)
    if old == new:
        return None
    algo = cfg.algo
    done, planned = step * old, step * new  # the checkpoint's count (at most), a run planned so from the start
    total = int(cfg.pipeline.max_steps) * new
    warmup = int(algo.warmup_steps)
    lr = lr_multiplier(algo.lr_schedule, warmup, total, planned)
    head = (
        f"resumed at step {step} with {new} optimizer steps per training step (algo.ppo_epochs x mini-batches), "
        f"the checkpoint's {old}"
    )
    if not missing and not unknown:
        return (
            f"{head}: the train engines re-base the LR schedule (algo.lr_schedule={algo.lr_schedule}, "
            f"algo.warmup_steps={warmup}) from the checkpoint's optimizer step {done} to {planned} of {total}, where "
            f"a run with these settings from the start would be (LR {lr:.3g} x algo.lr); Adam's step counts are kept"
        )
    if algo.lr_schedule == "constant" and min(done, planned) >= warmup:
        return None  # the LR is algo.lr at either position
    why = []
    if missing:
        why.append(
            f"the checkpoint's {', '.join(missing)} state records no optimizer steps per training step (written "
            "before roll recorded them)"
        )
    if unknown:
        why.append(
            f"roll cannot tell whether {', '.join(unknown)} recorded them (no engine.pt or Megatron "
            "optimizer/common.pt: another engine's layout)"
        )
    lr_now = lr_multiplier(algo.lr_schedule, warmup, total, done)
    ended = algo.lr_schedule != "constant" and done >= total and total > warmup
    return (
        f"{head}, but {'; '.join(why)}: such an engine cannot re-base the LR schedule (algo.lr_schedule="
        f"{algo.lr_schedule}, algo.warmup_steps={warmup}), which goes on from the checkpoint's count, up to {done} "
        f"of {total}, where a run with these settings from the start would be at {planned}: the LR is {lr_now:.3g} "
        f"x algo.lr instead of {lr:.3g} x"
        + ("; the schedule has ended, so the remaining steps train at LR 0" if ended else "")
        + " (resume with the checkpoint's algo.num_mini_batches, algo.mini_batch_size, algo.ppo_epochs and "
        "pipeline.rollout_batch_size to keep the schedule)"
    )


def _namespace(node: Any) -> Any:
    """A nested dict as attribute namespaces (what `mini_batches` reads)."""
    if isinstance(node, Mapping):
        return SimpleNamespace(**{str(k): _namespace(v) for k, v in node.items()})
    return node
