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
"""

from __future__ import annotations

import numbers
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
