"""Importing Megatron-Core in an engine process.

Contract: `import_megatron()` imports `megatron.core` once, quietly (its first import trips torch's own deprecation
warnings), with `wandb` hidden while it loads: megatron.core's inference context imports wandb for its own logging,
which roll never uses there, and wandb's import makes two temporary folders (`/tmp/tmp*wandb-media`,
`-artifacts`) that a Ray worker killed at shutdown never removes: every Megatron rank of every run left a pair
behind (and paid ~0.8 s for the import). A wandb already imported in the process is left alone, and so is a later
`import wandb` (roll's W&B tracker): only megatron's own modules see it missing.
"""

from __future__ import annotations

import sys
import warnings


def import_megatron() -> None:
    """Import megatron.core (see the module docstring); ImportError when it is not installed."""
    if "megatron.core" in sys.modules:
        return
    hidden = "wandb" not in sys.modules
    if hidden:
        sys.modules["wandb"] = None  # type: ignore[assignment]  # `import wandb` raises ImportError meanwhile
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core  # noqa: F401
    finally:
        if hidden and "wandb" in sys.modules and sys.modules["wandb"] is None:
            del sys.modules["wandb"]
