"""What an environment observation may be, and its normal form.

An environment returns, from `reset` and `step`, either text (`str`) or text with pictures:
`{"text": str, "images": [picture, ...]}`, each picture anything `roll_core.multimodal.load_image` reads (a PIL
image, an (H, W, 3) uint8 array, encoded bytes, a path). `normalize` turns either into the form the rollout works
with: a `str` for text (also a dict whose `images` list is empty), else a dict whose `images` are RGB PIL images
the observation owns (copies: an environment that redraws its canvas in place never changes an earlier one).
Two conversions, documented: a real number (int, float, numpy's; not a bool) is its `str()`, and `bytes` /
`bytearray` are decoded as UTF-8 (text an environment read from a process or a socket). Anything else is a
`ValueError` raised inside the environment call, so the env manager ends that one episode as an `env_error` and
counts it, like an environment that raises: bytes that are not UTF-8, a list, tuple, set, bool, array or other
object (its repr used to reach the model as the observation's text: `b'...'`, `['a', 'b']`), a dict with a
missing or non-text `text` or keys other than `text` and `images`, `images` that is not a list, a picture that
does not load.

The pictures of a turn go into its user message where the text has `<image>` markers, else before the text
(`roll_core.multimodal.as_content`), and reach the model through the turn template (roll_core.agentic.chat).

`state_key` is the state key of an observation whose environment gives no `info["state"]` (GiGPO's anchor states):
its text plus a digest of each picture's pixels, so two states that differ only in their pictures are never one.
`info_state_key` is the key of an environment's own `info["state"]`: its text, with every array or tensor in it
(NumPy's, torch's, in nested lists, tuples and dicts too) keyed by a digest of its dtype, shape and bytes, since
printed, an array of more than 1,000 elements is summarised with "..." and different large boards shared a key.
"""

from __future__ import annotations

import hashlib
import numbers
import sys
from collections.abc import Mapping
from typing import Any

#: An observation as environments may return it, and as `normalize` returns it.
Observation = str | dict[str, Any]


def normalize(obs: Any) -> Observation:
    """`obs` as text, or as `{"text": str, "images": [RGB PIL images]}` when it holds pictures; a ValueError for
    anything the module docstring does not list (never its repr as text)."""
    if isinstance(obs, str):
        return obs
    if isinstance(obs, (bytes, bytearray)):
        try:
            return bytes(obs).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"an observation given as bytes must be UTF-8 text ({exc}); decode it in the environment"
            ) from exc
    if isinstance(obs, numbers.Real) and not isinstance(obs, bool):  # numpy's numbers too
        return str(obs)
    if not isinstance(obs, Mapping):
        raise ValueError(
            f"an observation must be a str or {{'text': str, 'images': [...]}}, got {type(obs).__name__} "
            f"{obs!r:.80}: its repr would reach the model as text; return the text the model should read"
        )
    unknown = set(obs) - {"text", "images"}
    if unknown:
        raise ValueError(f"an observation dict holds 'text' and 'images'; got also {sorted(unknown)}")
    if "text" not in obs:
        raise ValueError("an observation dict needs its 'text' (a str, '' for pictures alone)")
    text = obs["text"]
    if not isinstance(text, str):
        raise ValueError(f"an observation's 'text' must be a str, got {type(text).__name__}")
    images = obs.get("images") or []
    if not isinstance(images, (list, tuple)):
        raise ValueError(f"an observation's 'images' must be a list of pictures, got {type(images).__name__}")
    if not images:
        return text
    from roll_core.multimodal import load_image

    return {"text": text, "images": [_own(load_image(im), im) for im in images]}


def _own(picture: Any, given: Any) -> Any:
    """`picture` as a copy when it is the environment's own object (`load_image` passes an upright RGB PIL image
    through). Why: an environment may redraw one canvas in place every step, and the rollout keeps each
    observation's pictures for the whole episode (every later turn's request carries them, and vLLM processes them
    again): aliased, they would all show the latest state while the trainer's tensors hold the observed ones."""
    return picture.copy() if picture is given else picture


def text_of(obs: Observation) -> str:
    """The observation's text (the whole observation when it is text)."""
    return obs if isinstance(obs, str) else str(obs.get("text", ""))


def images_of(obs: Observation) -> list[Any]:
    """The observation's pictures (none for text)."""
    return [] if isinstance(obs, str) else list(obs.get("images") or [])


def state_key(obs: Observation) -> str:
    """The anchor-state key of a normalised observation (for an environment without `info["state"]`): its text,
    then one `[image <digest>]` line per picture (`roll_core.multimodal.digest`: mode, size and pixels).

    Why the pictures: a visual environment's text is often the same in every state ("The lake: <image>"), and a
    text-only key would make GiGPO group steps taken in different states and mix their step advantages."""
    images = images_of(obs)
    if not images:
        return text_of(obs)
    from roll_core.multimodal import digest

    return text_of(obs) + "".join(f"\n[image {digest(im)}]" for im in images)


def info_state_key(state: Any) -> str:
    """The anchor-state key of an environment's `info["state"]` (GiGPO's step groups; roll_envs' held-out boards).

    A state without arrays keys as its `str()`, as it always did (equal states share a key; a list and a tuple of
    the same values print, and key, differently). An array or tensor, alone or inside lists, tuples and dicts, keys
    by a digest of its dtype, shape and bytes instead of its text, which NumPy and torch summarise with "..." above
    1,000 elements (two boards differing only in the middle shared one key, and their steps one group)."""
    if not _holds_array(state):
        return str(state)
    return _keyed(state, top=True)


def _is_array(x: Any) -> bool:
    np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    return (np is not None and isinstance(x, np.ndarray)) or (torch is not None and isinstance(x, torch.Tensor))


def _holds_array(x: Any) -> bool:
    if _is_array(x):
        return True
    if isinstance(x, (list, tuple)):
        return any(_holds_array(v) for v in x)
    if isinstance(x, dict):
        return any(_holds_array(v) for v in x.values())
    return False


def _keyed(x: Any, top: bool = False) -> str:
    """`str(x)` with each array replaced by its digest (containers print their entries' repr, as `str` does)."""
    if _is_array(x):
        return _array_digest(x)
    if isinstance(x, list):
        return "[" + ", ".join(_keyed(v) for v in x) + "]"
    if isinstance(x, tuple):
        inner = ", ".join(_keyed(v) for v in x)
        return f"({inner},)" if len(x) == 1 else f"({inner})"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {_keyed(v)}" for k, v in x.items()) + "}"
    return str(x) if top else repr(x)


def _array_digest(a: Any) -> str:
    """`array(dtype, shape, digest)` of a NumPy array or torch tensor: equal for arrays equal in dtype, shape and
    every element's bytes (a strided view keys as its contiguous copy)."""
    import numpy as np

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        t = a.detach().cpu().contiguous()
        dtype, shape = str(t.dtype), tuple(t.shape)
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    elif a.dtype.hasobject:  # Python objects: their text (the bytes are pointers)
        dtype, shape = str(a.dtype), a.shape
        data = _keyed(a.tolist()).encode()
    else:
        dtype, shape = a.dtype.str, a.shape
        data = np.ascontiguousarray(a).tobytes()
    h = hashlib.blake2b(f"{dtype}|{shape}|".encode(), digest_size=16)
    h.update(data)
    return f"array({dtype}, {tuple(shape)}, {h.hexdigest()})"
