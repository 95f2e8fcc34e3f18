"""A saved `datasets` folder as a file task reads it (roll_envs.tasks.dataset, FileTask): `load_folder` loads it
and picks its split, `encoded_rows` gives its rows with their pictures left encoded.

Which split `load_folder(path, named, key, held=...)` reads (`pick_split`):
- a split named by the user (`key`: env.split for env.path, env.eval_split for env.eval_path) is read; a name the
  folder does not hold is a ConfigError listing its splits, and so is naming a split of a folder saved as one
  dataset (it has none);
- nothing named: a folder saved as one dataset, or holding one split, is read whole;
- nothing named, several splits, training data: its `train` split, with a warning naming the others (never
  read). Without a `train` split it is a ConfigError naming the splits and the key: it trained on whichever split
  was saved first (a `validation` split, say) with only a warning, a wrong answer no metric shows;
- nothing named, several splits, held-out data (`held`): the one split beside `train` (as post-training's
  data.eval_path reads it, roll_core.posttrain.rows); none or several beside it is a ConfigError naming the splits
  and the key. It read `train` there: the held-out accuracy was measured on training rows.
`key` None (a task without such a setting) makes the errors say to point the path at one split's own folder.
The second value returned is the part of a row id naming the split (`/<split>`, or '' for the `train` split of
several, a lone split or a folder without splits): rows of two splits of one folder got the same ids
(`data:ds:1`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from roll_core.errors import ConfigError

log = logging.getLogger(__name__)


def _how(key: str | None, splits: list[str], setting: str) -> str:
    """How to name the split: the setting, or (without one) the split's own folder."""
    if key is not None:
        return f"name the one to read with {key}=<split> (e.g. {key}={splits[0]})"
    return f"save the one to read to its own folder (ds['<split>'].save_to_disk(...)) and point {setting} at it"


def load_folder(path: Path, named: str | None, key: str | None, *, held: bool = False) -> tuple[Any, str]:
    """(the dataset of the split to read, its label in row ids) of the datasets folder `path` (module docstring)."""
    from roll_envs.config import DATASETS

    DATASETS.require()
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # a folder that is not a saved dataset: its message does not name the setting
        setting = "env.eval_path" if held else "env.path"
        raise ConfigError(
            f"{path}: cannot read it as a datasets folder ({exc}); check the folder or {setting}"
        ) from exc
    return pick_split(ds, path, named, key, held=held)


def pick_split(ds: Any, path: Path, named: str | None, key: str | None, *, held: bool = False) -> tuple[Any, str]:
    """(the dataset to read, its label in row ids): see the module docstring."""
    import datasets

    setting = "env.eval_path" if held else "env.path"
    if not isinstance(ds, datasets.DatasetDict):
        if named is not None:
            raise ConfigError(
                f"{key}={named!r}: {path} ({setting}) was saved as one dataset, without splits: drop {key}"
            )
        return ds, ""
    splits = list(ds)
    if named is not None:
        if named not in ds:
            raise ConfigError(f"{key}={named!r}: {path} ({setting}) holds the splits {splits}: name one of them")
        return ds[named], _label(splits, named)
    if len(splits) == 1:
        return ds[splits[0]], ""
    if held:
        beside = [s for s in splits if s != "train"]
        if len(beside) != 1:
            raise ConfigError(
                f"{path} ({setting}) holds the splits {splits}, not one held-out split beside 'train': "
                + _how(key, beside or splits, setting)
            )
        return ds[beside[0]], _label(splits, beside[0])
    if "train" not in ds:
        raise ConfigError(
            f"{path} ({setting}) holds the splits {splits} and none is 'train': " + _how(key, splits, setting)
        )
    how = (
        f"{key}=<split> reads another; env.eval_path naming this folder holds out a split beside 'train' (the "
        "only one, or the one env.eval_split names)"
        if key is not None
        else "save a split to its own folder to give it as env.eval_path"
    )
    log.warning("%s holds the splits %s: reading 'train' only (%s)", path, sorted(ds), how)
    return ds["train"], ""


def _label(splits: list[str], split: str) -> str:
    """The split in a row id: '' for a lone split or `train`, else `/<split>`."""
    return "" if split == "train" or len(splits) < 2 else f"/{split}"


def encoded_rows(ds: Any) -> Any:
    """The rows of a `datasets` dataset, pictures (Image features) left encoded as `{"bytes", "path"}` dicts, as
    Parquet rows hold them: they are decoded one prompt at a time when prompts are built. Iterating the dataset
    itself decodes every picture at load and keeps them all (a few hundred thousand photos: hundreds of gigabytes
    of pixels, and minutes of decoding before the first step). Rows are read as Arrow (what a decodable feature
    stores), in the dataset's order."""
    from datasets.features.features import require_decoding

    if not ds.features or not require_decoding(ds.features):
        return ds
    return (row for table in ds.with_format("arrow").iter(batch_size=1000) for row in table.to_pylist())
