"""A train engine's per-rank batch checks, agreed over its data-parallel group before any rank raises.

Each data-parallel rank checks its own rows on the host before any forward (token ids: roll_engines.train._logits;
pictures: _vision.checked_batch; structured rows the Megatron engine refuses; replayed routing). A refusal on one
rank alone let the others go on into their first collective, where they waited until the process group timed out
(NCCL: 30 minutes by default): a hang instead of an error.

Contract of `agreed(check, size, device, group)`:
- `check()` is host work only (no collective); it returns the checked batch or raises.
- `size` <= 1 (one process, or a group of one), or no process group initialised (nothing any rank could wait in):
  `check()`'s result or exception, unchanged, and no collective.
- Otherwise every rank of `group` (None: the default group) calls `agreed` at the same point. One all-reduce (MAX)
  of a length: 0 when every rank's check passed, and then each rank gets its own result. Otherwise one all-gather of
  the failing ranks' messages, and every rank raises the same error naming each failing rank (its rank in `group`)
  with its exception's type and message. The error's type is the failing ranks' when they all raised the same
  builtin exception type, ValueError otherwise; on a failing rank it is chained to its own exception.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")

#: A rank's message is cut to this many UTF-8 bytes (type name included) for the all-gather.
MAX_MESSAGE_BYTES = 4096
_SEP = "\x1f"  # between a message's exception type and its text (a padded message ends with zero bytes)


def agreed(check: Callable[[], T], size: int, device: torch.device | str = "cpu", group: Any = None) -> T:
    """`check()` on this rank; with `size` > 1 data-parallel ranks, a refusal on any rank raised on every rank of
    `group` (module docstring). `device` holds the exchanged tensors (nccl/hccl reduce device tensors only)."""
    import torch.distributed as dist

    if size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return check()  # no group to agree over (an engine told of ranks its process has no group for: tests)
    result: Any = None
    error: Exception | None = None
    try:
        result = check()
    except Exception as e:  # any refusal: the other ranks must hear of it before they reach a collective
        error = e
    mine = b"" if error is None else f"{type(error).__name__}{_SEP}{error}".encode()[:MAX_MESSAGE_BYTES]
    longest = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
    width = int(longest.item())
    if width == 0:
        return result
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[: len(mine)] = torch.tensor(list(mine), dtype=torch.uint8)
    buf = buf.to(device)
    parts = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, buf, group=group)
    failed = {}
    for rank, part in enumerate(parts):
        raw = bytes(part.cpu().tolist()).rstrip(b"\0")
        if raw:
            kind, _, text = raw.decode(errors="replace").partition(_SEP)
            failed[rank] = (kind, text)
    raise refusal(failed, len(parts)) from error


def refusal(failed: dict[int, tuple[str, str]], size: int) -> Exception:
    """The error every rank raises: `failed` maps each failing rank to (its exception's type name, its message)."""
    kinds = {kind for kind, _ in failed.values()}
    cls = getattr(builtins, kinds.pop(), None) if len(kinds) == 1 else None
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = ValueError
    ranks = ", ".join(str(r) for r in failed)
    which = f"data-parallel rank{'s' if len(failed) > 1 else ''} {ranks} of {size}"
    said = "; ".join(f"rank {r}: {kind}: {text}" for r, (kind, text) in failed.items())
    message = f"{which} refused its batch (every rank raises this; none ran a forward): {said}"
    try:
        return cls(message)
    except Exception:  # a builtin type that takes other arguments (UnicodeDecodeError, ...)
        return ValueError(message)
