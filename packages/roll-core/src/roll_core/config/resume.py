"""What a resumed run may change: compare the config a checkpoint was saved with against the run's config.

A checkpoint records the config it was saved with (`config.yaml` in its folder, roll_core.checkpoint). On resume
the loop calls `check_checkpoint(folder, cfg)` (or `check_resume(saved, current)` with two plain dicts) before it
writes the run's config.yaml or loads anything:

- a key that may change (learning rate and optimizer settings, max_steps, save/eval cadence, logging, timeouts,
  engine layouts, inference settings, ...) is returned as a line "key: old -> new" for the log, and takes effect:
  the train engines re-apply the configured optimizer settings after loading (roll_engines.train._settings);
- a key that cannot change within a run (the model, tokenizer, group size, advantage estimator, seed, the task and
  its data, the reward model, the train engine's kind and LoRA shape) raises `ConfigError` listing each with its
  saved and new value and how to proceed (set them back, or start a new run). A multi-task run's domains are tasks
  like a single one: each domain's reward weights and eval size may change, its reward class may not.

So config.yaml, rewritten by the resumed run, records what is in effect. Train engine layouts (world size, TP/PP/DP)
may change: the engines reshard their checkpoints (tests/e2e/test_megatron_ray.py, test_ray_engines.py). The train
engine's kind may change within one of SAME_CHECKPOINTS (`hf` <-> `fsdp2`: one checkpoint format, each loading the
other's at any world size), never to or from another (`megatron`). Megatron's optimizer structure is fixed too, where
this check can see it: `train_engine.use_distributed_optimizer`, and `train_engine.expert_model_parallel_size`
across 1 (SIDES: the experts' separate optimizer exists only above 1); a structure the config does not show is
refused by the engine's `load` with its own message.

May assume: both configs are plain nested dicts of the same schema family (YAML scalars, lists, dicts). Keys only
one side has (a field added by an upgrade, another group's option) are reported as changes (a changed group shows
up as a changed fixed `_target_` or name), except where they are the user's entries, not fields: a fixed key under
one of ENTRIES (a domain of env.tasks, a key of env.env_kwargs) or under a value the other side holds as `{}` or
null (env.weights `{}` -> shares) on one side only is refused.
"""

from __future__ import annotations

import fnmatch
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from roll_core.errors import ConfigError

log = logging.getLogger(__name__)

#: Keys that cannot change within a run (fnmatch patterns over dotted keys): the checkpoint's weights, sampler
#: position and advantage statistics are meaningless under other values.
FIXED = (
    "model.path",
    "model.tokenizer",
    "model.trust_remote_code",
    "algo.name",
    "algo.adv_estimator",  # PPO's critic exists (and is checkpointed) only for the estimators that need it
    "algo.group_size",
    "algo.num_critics",  # the critic folders a checkpoint holds
    "pipeline.name",
    "pipeline.seed",
    "env.*",  # the task, its data and split: the sampler's position indexes this problem list
    # The reward model is the task's reward (like env.reward's class); its running score statistics (normalize=
    # running) are in the checkpoint and mean nothing for another model, tokenizer or input template.
    "reward_model.name",
    "reward_model.path",
    "reward_model.tokenizer",
    "reward_model.template",
    "train_engine._target_",
    "train_engine.name",
    "train_engine.lora_rank",
    "train_engine.lora_alpha",
    "train_engine.lora_target_modules",
    "train_engine.use_distributed_optimizer",
    # Post-training: the rows a file-fed run indexes, the shard a rollout-only run writes, the teachers it scores with.
    "data.path",
    "data.eval_path",
    "data.eval_size",
    "data.format",
    "data.min_score",
    # A rollout file's rows are scored and paired by these: another value builds other SFT rows or preference pairs
    # from the same file (the sampler's size check misses a change that keeps the count).
    "data.correct_key",
    "data.reward_key",
    "data.group_key",
    "data.pair_margin",
    "data.pairs_per_prompt",
    "rollout.shard",
    "rollout.num_shards",
    "rollout.max_prompts",
    "rollout.samples_per_prompt",
    "rollout.output",
    "distill.teacher",
    "distill.teachers",
)

#: Train engines that write one checkpoint format (roll_engines.train._hf_checkpoint: `model/` an HF folder,
#: `optimizer/` a torch.distributed.checkpoint keyed by parameter name, `engine.pt` the schedule and loss scaler, LoRA
#: `adapter/` in peft's format), each loading the others' at any world size (roll-engines' test_fsdp2_checkpoints.py,
#: tests/e2e/test_ray_engines.py, test_resume_engine_switch.py): a resume may switch among them (an hf run resumed on
#: fsdp2 over two GPUs), `train_engine._target_` -> `train_engine.name` of each.
SAME_CHECKPOINTS: tuple[dict[str, str], ...] = (
    {"roll_engines.train.hf.HFTrainEngine": "hf", "roll_engines.train.fsdp2.FSDP2TrainEngine": "fsdp2"},
)

#: Settings that may change within a run only on the same side of a bound: key -> (bound, why, each side's way out).
#: Megatron builds a MoE model's expert parameters an optimizer of their own at expert_model_parallel_size > 1 and
#: keeps them in the one optimizer at 1; its checkpoint loads into the same structure only (the engine's `load`
#: refuses another: roll_engines.train.megatron._checkpoint.read_optimizer, after Ray and the inference engines
#: started). Any size on the saved side (2 -> 4) reshards.
SIDES: dict[str, tuple[int, str, tuple[str, str]]] = {
    "train_engine.expert_model_parallel_size": (
        1,
        "Megatron keeps the experts' optimizer state apart above 1 and with the other parameters' at 1: the "
        "checkpoint's optimizer loads into the structure that saved it only",
        (
            "resume with train_engine.expert_model_parallel_size=1",
            "resume with train_engine.expert_model_parallel_size > 1 (any size that divides the data-parallel size)",
        ),
    ),
}

#: Fixed settings compared whole (a mapping whose entries may be added or removed: an entry on one side only is a
#: change too, where a key present on one side only is otherwise taken as a setting this version added).
FIXED_WHOLE = ("distill.teachers",)

#: Mappings of the user's entries (a multi-task run's domains, an environment's keyword arguments, the domains'
#: shares): an entry on one side only is a change of the task, never a field added by an upgrade.
ENTRIES = (
    "env.tasks",
    "env.rewards",
    "env.weights",
    "env.counts",
    "env.advantage_scale",
    "env.env_kwargs",
)

#: Exceptions to FIXED: settings under a fixed prefix that only change how the task runs, not what it is.
CHANGEABLE = (
    "env.reward.*",  # reward weights and limits (its class is fixed: see below)
    # A multi-task run's domains: the same weights, limits and eval size as a single task's.
    "env.tasks.*.reward.*",
    "env.tasks.*.eval_size",
    "env.rewards.*",
    "env.eval_size",
    "env.step_timeout_s",
    "env.on_failure",  # how a failed episode is trained (agentic and agent envs), like the reward's weights
    "env.failure_reward",
    "env.env_threads",
    "env.num_workers",
)
#: Fixed again inside CHANGEABLE.
FIXED_AGAIN = ("env.reward._target_", "env.tasks.*.reward._target_", "env.rewards.*._target_")

#: Keys never compared: they say how this launch finds the run, not how the run trains.
IGNORED = ("defaults", "pipeline.resume", "pipeline.resume_from")


def is_fixed(key: str) -> bool:
    """Whether `key` (dotted) cannot change when a run is resumed."""
    if _matches(key, FIXED_AGAIN):
        return True
    if _matches(key, CHANGEABLE):
        return False
    return _matches(key, FIXED)


def check_resume(saved: Mapping[str, Any], current: Mapping[str, Any], where: str = "the checkpoint") -> list[str]:
    """Compare the config a checkpoint was saved with (`saved`) with this run's (`current`).

    Args:
        saved: the checkpoint's config as a plain nested dict (`CheckpointManager.read_config`).
        current: this run's config, the same form (`config_dict(cfg)`).
        where: the checkpoint, named in the error.

    Returns:
        One line "key: old -> new" per changed key that may change (sorted by key), for the log.

    Raises:
        ConfigError: some keys that cannot change within a run differ; the message lists each with both values.
    """
    old, new = _flatten(saved), _flatten(current)
    lines, refused = [], []
    switch = _engine_switch(saved, current)  # hf <-> fsdp2: the engine's kind may change (SAME_CHECKPOINTS)
    for key in sorted(old.keys() | new.keys()):
        if _matches(key, IGNORED):
            continue
        a, b = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if _same(a, b):
            continue
        line = f"{key}: {_show(a)} -> {_show(b)}"
        crossed = _crossed(key, a, b)
        if crossed is not None:
            refused.append(f"{line} ({crossed})")
        elif not is_fixed(key) or (switch and key in _ENGINE_KIND):
            lines.append(line)
        elif a is not _ABSENT and b is not _ABSENT:
            refused.append(line)
        else:
            # One side lacks the key: a field one version has (reported), or a value that changed shape (an entry
            # added or removed, `{}` -> entries): refused, shown where the two sides part.
            point = _divergence(saved, current, key)
            if point is None:
                lines.append(line)
            else:
                line = f"{point}: {_brief(_get(saved, point))} -> {_brief(_get(current, point))}"
                if line not in refused:
                    refused.append(line)
    for key in FIXED_WHOLE:
        a, b = _lookup(saved, key), _lookup(current, key)
        if not _same(_flatten(a or {}), _flatten(b or {})):
            line = f"{key}: {_show(a)} -> {_show(b)}"
            if line not in refused:
                refused.append(line)
            lines = [x for x in lines if not x.startswith(f"{key}.") and not x.startswith(f"{key}:")]
    if refused:
        shown = "\n  ".join(refused)
        raise ConfigError(
            f"cannot resume from {where}: these settings differ from the ones it was saved with and cannot change "
            f"within a run (saved -> now):\n  {shown}\nSet them back to the saved values to continue the run, or "
            "start a new run with them (pipeline.resume=false and another pipeline.output_dir, or "
            "model.path=<checkpoint>/actor/model to start from its weights)"
        )
    return lines


def check_checkpoint(folder: str | Path, current: Any) -> list[str]:
    """`check_resume` against the config recorded in checkpoint `folder`; `current` is the typed run config (or a
    plain dict). A checkpoint that records no config (saved by an older roll) is not compared: one line says so."""
    from roll_core.checkpoint import CheckpointManager

    saved = CheckpointManager.read_config(Path(folder))
    if saved is None:
        # Nothing refuses another algorithm here: a PPO checkpoint resumed as GRPO dropped its critic with only
        # this INFO line, and the engines cannot see a folder no role loads.
        now = config_dict(current)
        unloaded = _critics_not_loaded(Path(folder), now)
        if unloaded:
            log.warning(
                "%s records no config (saved by an older roll) and holds %s, which this run does not load (its "
                "algo.adv_estimator=%s, algo.num_critics=%s): the saved critic state is dropped and the run goes "
                "on without it. Resume with the saved algorithm (algo.adv_estimator=gae, as many critics) to keep it",
                folder,
                ", ".join(f"{n}/" for n in unloaded),
                _lookup(now, "algo.adv_estimator"),
                _lookup(now, "algo.num_critics"),
            )
        return [f"{folder} records no config (saved by an older roll): the settings were not compared"]
    return check_resume(saved, config_dict(current), where=str(folder))


def _critics_not_loaded(folder: Path, current: Mapping[str, Any]) -> list[str]:
    """The critic folders (`critic/`, AsyPPO's `critic_1/`, ...) checkpoint `folder` holds that a run of config
    `current` does not load (roll_core.pipelines.trainer restores `critic`, `critic_1`, ... up to algo.num_critics,
    for algo.adv_estimator=gae only). A config without `algo` is not judged: []. With a recorded config the fixed
    algo.adv_estimator and algo.num_critics refuse this change instead."""
    import re

    algo = current.get("algo")
    if not isinstance(algo, Mapping) or not folder.is_dir():
        return []
    count = int(algo.get("num_critics") or 1) if algo.get("adv_estimator") == "gae" else 0
    loaded = {"critic" if m == 0 else f"critic_{m}" for m in range(count)}
    held = (p.name for p in folder.iterdir() if p.is_dir() and re.fullmatch(r"critic(_\d+)?", p.name))
    return sorted((n for n in held if n not in loaded), key=lambda n: (len(n), n))


_ENGINE_KIND = ("train_engine._target_", "train_engine.name")


def _engine_switch(saved: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
    """Whether both configs' train engines are of one of SAME_CHECKPOINTS (their `_target_` and `name`, where
    given, agree with the group's entry): their kind may then change."""
    for group in SAME_CHECKPOINTS:
        sides = [_lookup(cfg, "train_engine") for cfg in (saved, current)]
        if all(isinstance(side, Mapping) and _in_group(side, group) for side in sides):
            return True
    return False


def _in_group(engine: Mapping[str, Any], group: Mapping[str, str]) -> bool:
    target, name = engine.get("_target_"), engine.get("name")
    if target is None:
        return name is not None and name in group.values()
    return target in group and name in (None, group[target])


def _crossed(key: str, a: Any, b: Any) -> str | None:
    """Why a change of `key` from `a` to `b` is refused (with the way out), where `key` is one of SIDES and the two
    values lie on either side of its bound; None otherwise (absent or non-numeric values are not compared)."""
    if key not in SIDES or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)):
        return None
    bound, why, ways = SIDES[key]
    if (a > bound) == (b > bound):
        return None
    return f"{why}: {ways[a > bound]}, or start a new run"


def config_dict(cfg: Any) -> dict[str, Any]:
    """A typed run config (dataclasses), DictConfig or mapping as the plain nested dict a checkpoint records."""
    import dataclasses

    from omegaconf import DictConfig, OmegaConf

    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        cfg = OmegaConf.structured(cfg)
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return dict(cfg)


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


_ABSENT: Any = _Absent()


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key == p or fnmatch.fnmatchcase(key, p) for p in patterns)


def _lookup(node: Any, key: str) -> Any:
    """The value at dotted `key` of a nested mapping, or None where any part is missing."""
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _get(node: Any, key: str) -> Any:
    """The value at dotted `key` of a nested mapping, or _ABSENT where any part is missing."""
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _divergence(saved: Any, current: Any, key: str) -> str | None:
    """Where the two configs part on the way to `key`, which one side lacks: the dotted key of an entry one side
    only has (under ENTRIES) or of a value the other side holds as a mapping (`{}` or null -> entries); None when the
    key is a field of a non-empty mapping only one side has (a field added or removed by a version: a report)."""
    parts = key.split(".")
    a, b = saved, current
    for i, part in enumerate(parts):
        parent, here = ".".join(parts[:i]), ".".join(parts[: i + 1])
        if not (_is_branch(a) and _is_branch(b)):  # a leaf (`{}`, null, a scalar) on one side, a mapping on the other
            return parent or None
        if part not in a or part not in b:
            return here if _matches(parent, ENTRIES) else None
        a, b = a[part], b[part]
    return key  # both sides hold it, one as a leaf (`{}`, null), the other as a mapping


def _is_branch(node: Any) -> bool:
    return isinstance(node, Mapping) and bool(node)


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of the leaves (lists are leaves); an empty dict is a leaf too (so `{}` vs absent shows)."""
    if isinstance(node, Mapping) and node:
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node} if prefix else {}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)  # YAML may write 1e-4 back as 0.0001 or an int field as 1.0
    return a == b


def _show(value: Any) -> str:
    if value is _ABSENT:
        return "(absent)"
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def _brief(value: Any, limit: int = 160) -> str:
    """`_show`, cut to `limit` characters: a whole task's settings would fill a screen."""
    shown = _show(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."
