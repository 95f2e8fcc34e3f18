"""Progress bars of the libraries a run uses (transformers, huggingface_hub, datasets), off a terminal.

Contract: `quiet_library_bars(stream)` turns those bars off when `stream` (default stderr) is not a terminal (a log
file under nohup, Slurm, a Ray job, a pipe) and leaves them alone on one, or where the user chose
(HF_HUB_DISABLE_PROGRESS_BARS or HF_DATASETS_DISABLE_PROGRESS_BARS set). It sets those variables, which the
processes the run starts inherit (Ray workers, engine subprocesses) and the libraries read at import, and turns the
bars off in the libraries this process has already imported. Each variable is the user's where it is set already
(either way): only the libraries whose variable was unset are quieted by roll (one set by hand used to stop roll
from quieting the other's: HF_DATASETS_DISABLE_PROGRESS_BARS=1 alone left transformers' bars in the log). Returns
whether it turned any off.

Without it a log file got, per model load and save, `Loading weights: 100%|...| 21/21` and `Writing model shards`
lines from every worker (tqdm's carriage-return updates, unreadable with `tail` or `grep`) among roll's own one line
per step (roll_core.pipelines._console).
"""

from __future__ import annotations

import os
import sys
from typing import Any

#: The variables that turn the libraries' bars off, read when each library is imported.
BAR_VARIABLES = ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty (a replaced stream), or a closed file
        return False


def quiet_library_bars(stream: Any = None) -> bool:
    """Turn the libraries' progress bars off when `stream` (default sys.stderr) is not a terminal (module docstring);
    True when it did."""
    if _is_terminal(sys.stderr if stream is None else stream):
        return False
    ours = [v for v in BAR_VARIABLES if os.environ.get(v) is None]  # a set one is the user's choice, either way
    for variable in ours:
        os.environ[variable] = "1"
    if "HF_HUB_DISABLE_PROGRESS_BARS" in ours:  # huggingface_hub's and transformers' bars
        hub = sys.modules.get("huggingface_hub.utils")
        if hub is not None:
            hub.disable_progress_bars()
        transformers_logging = sys.modules.get("transformers.utils.logging")
        if transformers_logging is not None:
            transformers_logging.disable_progress_bar()
    if "HF_DATASETS_DISABLE_PROGRESS_BARS" in ours:
        datasets = sys.modules.get("datasets")
        if datasets is not None and hasattr(datasets, "disable_progress_bars"):
            datasets.disable_progress_bars()
    return bool(ours)
