"""The run's stop tokens in a checkpoint's exported model folder (`checkpoints/step_N/actor/model`).

Contract: `add_stop_tokens(folder, names)` appends the ids of `model.stop_tokens` (each one token of the folder's own
tokenizer, as the run looked them up: roll_core.config.generation.stop_token_ids) to the `eos_token_id` list of the
folder's `generation_config.json`, after the base model's eos ids, in their order, none twice. The run's inference
engines stopped on them (SamplingParams.stop_token_ids) besides the checkpoint's eos, and the policy learned to end
its turns there: an export whose generation config named only the base's eos made plain `model.generate()` (and a
vLLM server, which stops on the generation config's eos ids) run past the end of every turn to the length limit.

Everything else in the file stays as the engine wrote it (the base's sampling defaults), but for the
`_from_model_config` flag, dropped (false in a file built anew): the file is no longer config.json's defaults. A
folder without a generation config (an architecture that saves none) gets one built from its config.json, as
`from_pretrained` would build it. Stop strings (`infer_engine.stop`) are not written: transformers'
`GenerationConfig.stop_strings` makes a plain `model.generate(ids)` without `tokenizer=` raise, and vLLM does not
read them from the folder (docs/concepts/trainer-and-collectors.md).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"


def export_stop_tokens(folder: str | Path, names: Sequence[str], trust_remote_code: bool = False) -> list[int] | None:
    """`add_stop_tokens` for a checkpoint being saved: a failure (the folder's tokenizer not loadable where the
    driver runs: a trust_remote_code module it lacks; an unreadable file) is one WARNING naming the folder and the
    remedy, not an error: the weights are written, and a checkpoint must not end the run over its generation
    config's eos list."""
    try:
        return add_stop_tokens(folder, names, trust_remote_code)
    except Exception as exc:  # any failure here leaves the checkpoint usable (docstring)
        log.warning(
            "%s: could not add model.stop_tokens %s to %s's eos_token_id (%s: %s); the checkpoint is saved, but "
            "plain generate() on it stops only on the base's eos ids: add their ids there by hand",
            folder,
            list(names),
            GENERATION_CONFIG,
            type(exc).__name__,
            exc,
        )
        return None


def merged_eos(base: int | Sequence[int] | None, extra: Sequence[int]) -> list[int]:
    """`base` (a generation config's eos_token_id: an id, a list or None) as a list, then the ids of `extra` it lacks,
    in order, each once."""
    ids = [] if base is None else [int(base)] if isinstance(base, int) else [int(i) for i in base]
    for i in extra:
        if int(i) not in ids:
            ids.append(int(i))
    return ids


def add_stop_tokens(folder: str | Path, names: Sequence[str], trust_remote_code: bool = False) -> list[int] | None:
    """Add the ids of the stop tokens `names` to the eos ids of the exported model `folder`'s generation config
    (module docstring); returns the eos ids it wrote, or None when nothing changed (no names, no model folder,
    or every id already an eos id).

    Raises:
        ConfigError: a name the folder's tokenizer does not hold as one token (stop_token_ids).
    """
    folder = Path(folder)
    if not names or not (folder / "config.json").is_file():
        return None
    from transformers import AutoTokenizer

    from roll_core.config.generation import stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    ids = stop_token_ids(tokenizer, names)
    path = folder / GENERATION_CONFIG
    if not path.is_file():
        return _write_new(folder, ids)
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    base = data.get("eos_token_id")
    eos = merged_eos(base, ids)
    if eos == merged_eos(base, ()):
        return None
    data["eos_token_id"] = eos
    # No longer the model config's defaults: transformers 4 rebuilt a generation config flagged so from config.json
    # at generate time (when config.json sets generation values), which dropped the stop ids again.
    data.pop("_from_model_config", None)
    # transformers' own layout (GenerationConfig.to_json_string): sorted keys, two spaces, a final newline.
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return eos


def _write_new(folder: Path, ids: Sequence[int]) -> list[int]:
    """A generation config for a folder that has none: the one `from_pretrained` builds from config.json, with the
    stop ids after its eos."""
    from transformers import GenerationConfig

    config = GenerationConfig.from_pretrained(folder, config_file_name="config.json", _from_model_config=True)
    eos = merged_eos(config.eos_token_id, ids)
    config.eos_token_id = eos
    config._from_model_config = False  # (as add_stop_tokens drops it)
    config.save_pretrained(folder)
    return eos
