"""`roll-train ... --cfg job` (roll's dry run: print the composed config without running) validates what it prints.

Contract: Hydra's `--cfg job|all` composes and prints the config without calling the task, so neither the
schemas' `__post_init__` invariants (`algo.group_size=0`) nor roll's unknown-key check (a misspelt key added with
`+`, roll_core.config.compose.check_unknown_keys) ran: an invalid config was printed with exit status 0, and the
run it previewed was refused later. `check_printed_config(argv)` composes the same overrides the way a run does
(`compose`, then `to_object`) and raises `ConfigError` naming the key, before Hydra prints anything. Left to
Hydra: `--cfg hydra` (Hydra's own node), multirun (Hydra refuses `--cfg` with it), `--help`/`--info`, a command
line Hydra's parser refuses (Hydra reports it), and `--config-path` (a folder Hydra resolves against the calling
module). A config whose interpolations cannot be resolved outside a run (`${hydra:...}`, `${oc.env:...}` set only
where it runs) is warned about and printed, as sweep jobs' are before they start (roll_core.sweep_checks), and
so is a mandatory value left to the user (`???`, experiment=sweep_tiny's env.path): what it is to set.
`command_line_clash(argv)` is the one-line reason Hydra would refuse the command's flags together (`-m` with
`--cfg job`, `--resolve` without `--cfg`): Hydra raised a ValueError past roll-train's handling, a traceback with
exit 1, where roll-train says it in one line with exit 2 (a usage error).
"""

from __future__ import annotations

import contextlib
import io
import logging
from argparse import Namespace
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["check_printed_config", "command_line_clash", "printed_config_args"]


def _hydra_args(argv: list[str]) -> Namespace | None:
    """Hydra's parse of roll-train's command line; None when Hydra's parser refuses it (Hydra reports that)."""
    from hydra._internal.utils import get_args_parser

    try:
        # Hydra parses the same line again and reports its own errors: ours would print them twice.
        with contextlib.redirect_stderr(io.StringIO()):
            args, _ = get_args_parser().parse_known_args(argv)
    except SystemExit:
        return None
    return args


def command_line_clash(argv: list[str]) -> str | None:
    """Why Hydra would refuse the flags of `roll-train <argv>` together (its _run_hydra checks, after --help and
    --hydra-help, which win), in one line; None when it would not."""
    args = _hydra_args(argv)
    if args is None or args.help or args.hydra_help:
        return None
    if args.resolve and args.cfg is None:
        return "--resolve only goes with --cfg (or --help): it resolves the interpolations of the printed config"
    given = [
        flag
        for flag, on in (
            ("-m/--multirun", args.multirun),
            (f"--cfg {args.cfg}", args.cfg is not None),
            ("-r/--run", args.run),
            ("--info", args.info is not None),
            ("--shell-completion", args.shell_completion),
        )
        if on
    ]
    if len(given) < 2:
        return None
    hint = ""
    if args.multirun and args.cfg is not None:
        hint = (
            ": a sweep has one config per job; to print one job's, leave out -m and give that job's values "
            "(roll-train --cfg job algo.lr=1e-6, not algo.lr=1e-6,3e-6)"
        )
    return f"{' and '.join(given)} cannot be used together{hint}"


def printed_config_args(argv: list[str]) -> Namespace | None:
    """Hydra's parsed command line when `argv` asks it to print the job's config (`--cfg job` or `--cfg all`, one
    run), else None."""
    args = _hydra_args(argv)
    if args is None:
        return None
    if args.cfg not in ("job", "all") or args.multirun or args.help or args.hydra_help or args.info:
        return None
    return None if args.config_path else args


def check_printed_config(argv: list[str]) -> None:
    """Validate the config `roll-train <argv>` would print (see the module docstring); nothing for other commands.

    Raises:
        ConfigError: the config a run of these overrides would refuse, with the message the run would give.
    """
    args = printed_config_args(argv)
    if args is None:
        return
    from omegaconf.errors import InterpolationResolutionError

    from roll_core.config.compose import ConfigError, compose, to_object

    cfg = compose(args.overrides, config_name=args.config_name or "rlvr", conf_dir=args.config_dir)
    missing = _fill_missing(cfg)
    if missing:  # printed as `???`: what the user is to set, not an error of what is printed
        log.warning("the config leaves %s to set (`???`): a run needs them", ", ".join(missing))
    try:
        to_object(cfg)
    except ConfigError as exc:
        # A resolver that raised (HydraConfig not set, an unset variable) is this process's lack, not the config's
        # fault; a missing key, a value of the wrong type or an unknown resolver (the subclasses) fail any run.
        if type(exc.__cause__) is not InterpolationResolutionError:
            raise
        reason = str(exc.__cause__).splitlines()[0]
        log.warning("the config's interpolations cannot be resolved outside a run (%s): a run checks them", reason)


def _fill_missing(node: Any, where: str = "") -> list[str]:
    """Fill `node`'s mandatory values (`???`: experiment=sweep_tiny's env.path, model=hf's model.path) with a
    placeholder, in place, so that the rest is validated; returns their keys. A value that takes no string stays
    `???` (and the validation then names it)."""
    from omegaconf import DictConfig, OmegaConf

    filled = []
    for key in node:
        full = f"{where}.{key}" if where else str(key)
        if OmegaConf.is_missing(node, key):
            try:
                node[key] = f"/placeholder/{full}"
            except Exception:
                continue
            filled.append(full)
        elif isinstance(node[key], DictConfig):
            filled += _fill_missing(node[key], full)
    return filled
