"""Train-engine checkpoint folders broken on purpose, for tests that a failed `load` leaves an engine as it was
(the hf/fsdp2 and Megatron engines' all-or-nothing loads): `broken_checkpoint(saved, root, how)` copies the folder
`saved` to `root / how` and breaks the copy one way (`HOW`); the original is left whole.

The folder layout is the engines' own: `model/model.safetensors` (the weights), `optimizer/*.distcp` (the optimizer
state, torch distributed checkpoint shards), `engine.pt` (hf/fsdp2: scheduler, scaler, step) and `adapter/` (LoRA).
"""

from __future__ import annotations

import shutil
from pathlib import Path

#: The ways `broken_checkpoint` breaks a copy.
HOW = (
    "no-optimizer",
    "no-engine-state",
    "no-adapter",
    "truncated-optimizer-shard",
    "missing-model-shard",
    "misshapen-tensor",
    "truncated-model-shard",
)


def broken_checkpoint(saved: Path, root: Path, how: str) -> Path:
    """A copy of the checkpoint folder `saved` at `root / how`, broken `how` (one of HOW)."""
    folder = root / how
    shutil.copytree(saved, folder)
    model = folder / "model" / "model.safetensors"
    if how == "no-optimizer":
        shutil.rmtree(folder / "optimizer")
    elif how == "no-engine-state":
        (folder / "engine.pt").unlink()
    elif how == "no-adapter":
        shutil.rmtree(folder / "adapter")
    elif how == "truncated-optimizer-shard":
        for shard in (folder / "optimizer").glob("*.distcp"):
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif how in ("missing-model-shard", "misshapen-tensor", "truncated-model-shard"):
        from safetensors.torch import load_file, save_file

        tensors = load_file(model)
        if how == "truncated-model-shard":
            model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
        elif how == "misshapen-tensor":  # the last tensor in name order one row short; the others fine
            last = sorted(tensors)[-1]
            save_file({**tensors, last: tensors[last][:-1].contiguous()}, model)
        else:  # two shards, the second lost
            names = sorted(tensors)
            save_file({k: tensors[k] for k in names[: len(names) // 2]}, model)
    else:
        raise ValueError(how)
    return folder
