"""Near-duplicate keys: when two prompts are one problem to a model though their text differs (a trailing newline,
a doubled space). One definition for every held-out split, so that a problem is never trained on and evaluated as
two: the RL tasks' (roll_envs.tasks.base `held_out_split`, which imports `loose_key` and `image_key` from here) and
the post-training rows' (roll_core.posttrain: `loose_text` of each text run of a tokenised prompt).

- `loose_text(text)`: the text with its whitespace collapsed (runs of spaces, tabs and newlines to one space, none
  at the ends).
- `loose_key(problem)`: a problem's `prompt` as `loose_text`, and its pictures (`images`) by `image_key`.
- `image_key(image)`: a stable text id of a picture as a row holds it, without decoding it.
- `stable_fraction(key)`: a number in [0, 1) from a key alone, the side of the hash splits both use.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

__all__ = ["image_key", "loose_key", "loose_text", "stable_fraction"]


def loose_text(text: str) -> str:
    """`text` with runs of whitespace collapsed to one space and none at the ends: "Q?\\n" and " Q?" are "Q?"."""
    return " ".join(text.split())


def loose_key(problem: Any) -> str:
    """A problem's prompt as `loose_text`, with its pictures (`images`, by `image_key`): rows equal under it are one
    problem to a model (a trailing newline, a doubled space), so a training row is never one of these of a held-out
    row. Not what decides a side: the exact prompt does (roll_envs.tasks.base `split_key`), so that splits stay as
    they were for prompts without such twins (a resumed run keeps its split)."""
    images = getattr(problem, "images", None) or ()
    return loose_text(problem.prompt) + "".join("\x00" + image_key(im) for im in images)


def image_key(image: Any) -> str:
    """A stable text id of a picture as a row holds it, without decoding it: the hash of its bytes, its path, or
    its pixels (PIL images, arrays)."""
    if isinstance(image, dict):
        image = image.get("bytes") if image.get("bytes") is not None else image.get("path")
    if isinstance(image, (bytes, bytearray, memoryview)):
        return hashlib.blake2b(bytes(image), digest_size=8).hexdigest()
    if isinstance(image, (str, Path)):
        return str(image)
    data = image.tobytes() if hasattr(image, "tobytes") else repr(image).encode()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def stable_fraction(key: str) -> float:
    """A number in [0, 1) derived from `key` alone (same on every machine and Python run)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64
