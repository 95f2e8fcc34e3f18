"""Reading the *.safetensors files of a checkpoint or model folder, with an error that names the broken one.

safetensors' own error for a truncated or corrupt file ("Error while deserializing header: invalid header length")
names no file: a resume from a checkpoint whose write was cut short failed without saying which file of which folder
was broken. `read_safetensors` (and `read_safetensors_folder`, every file of an HF folder) raises the same exception
type (SafetensorError: callers and tests catch it), its message naming the file and saying the folder is incomplete
or corrupt, chained to safetensors' own."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor


def read_safetensors(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of the safetensors file at `path` (on the CPU); SafetensorError naming `path` if it cannot be
    read (a truncated or corrupt file)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except SafetensorError as exc:
        raise SafetensorError(
            f"{path}: cannot read this safetensors file ({exc}): the checkpoint or model folder is incomplete or "
            "corrupt (a write cut short, a partial copy): save or copy it again"
        ) from exc


def read_safetensors_folder(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of the *.safetensors files of an HF folder (`read_safetensors`); FileNotFoundError if it has
    none."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    out: dict[str, Tensor] = {}
    for f in files:
        out.update(read_safetensors(f))
    return out
