"""Commands shown in markdown (README.md, the documentation pages): found, then composed without running anything.

Shared by tests/e2e/test_readme_commands.py (which also runs the README's commands, shortened) and
tests/docs/test_pages_commands.py (which composes every command of docs/). `readme_commands(text)` reads every
`roll-train` / `roll-eval` command of a markdown text: code spans (also ones wrapped over lines) and fenced code
blocks, shell comments included (`# or: roll-train ...` is a command, `# + k=v ...` lists overrides to add, which
makes a second command; `nox -s quickstart [-- args]` is the `roll-train` command noxfile.py runs). `jobs(cmd)`
lists the overrides of every job a command launches (a multirun: every job of its sweep, Optuna's search space
included), with stand-ins for its `<placeholders>`; `first_job(cmd)` composes the first one with its `hydra` node.
A roll-eval command's own options are told apart from its overrides with roll-eval's argparse parser itself
(`roll_eval_options`, from roll_core.cli.eval_parser: which options take a value, which are flags), so a flag may
sit anywhere in a command.
"""

from __future__ import annotations

import functools
import itertools
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
# Placeholders commands may show (`<checkpoint>`, `<rm>`); compositions get a stand-in for them (stand_ins).
PLACEHOLDER = re.compile(r"<[^<>\s]+>")
#: Hydra's command-line flags a roll-train command may carry: flag -> how many values follow it.
HYDRA_FLAGS = {"--cfg": 1, "-c": 1, "--info": 1, "-i": 1, "--package": 1, "-p": 1, "--resolve": 0, "--help": 0}


# ---- reading the commands out of README.md --------------------------------------------------------------------
@dataclass(frozen=True)
class Command:
    prog: str  # roll-train | roll-eval
    args: tuple[str, ...]
    line: int  # README line it starts on
    how: str = ""  # how it was found, when not plainly
    source: str = "README.md"  # the markdown file it was read from

    @property
    def text(self) -> str:
        return " ".join((self.prog, *self.args))

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}{f', {self.how}' if self.how else ''}"

    @property
    def multirun(self) -> bool:
        return self.prog == "roll-train" and bool({"-m", "--multirun"} & set(self.args))

    @property
    def overrides(self) -> list[str]:
        """Hydra overrides (roll-eval: its key=value arguments, not its models nor its own options and their values,
        a flag such as `--overwrite` taking none: roll_eval_options)."""
        args = [a for a in self.args if a not in ("-m", "--multirun")]
        if self.prog != "roll-eval":  # Hydra's own flags (`--cfg hydra`) are not overrides
            return without_hydra_flags(args)
        out, values = [], 0
        for a in args:
            if values:  # a value of the option before it
                values -= 1
            elif a.startswith("-"):
                # `--n 4`: its value comes next (`--n=4` holds it); `--overwrite`: none (roll-eval's parser says which)
                values = 0 if "=" in a else roll_eval_option(a, self.where)
            elif "=" in a or a.startswith("~"):
                out.append(a)
        return out


@functools.cache
def roll_eval_options() -> dict[str, int]:
    """roll-eval's options -> how many values each takes (0 for a flag: `--overwrite`, `--help`), read from its
    argparse parser (`roll_core.cli.eval_parser`), so a new option or flag is known here without a list to keep in
    step."""
    from roll_core.cli import eval_parser

    options: dict[str, int] = {}
    for action in eval_parser()._actions:  # argparse keeps no public list of them
        takes = action.nargs if isinstance(action.nargs, int) else 1  # None (one value); ?/*/+: roll-eval has none
        options.update(dict.fromkeys(action.option_strings, takes))
    return options


def roll_eval_option(arg: str, where: str = "") -> int:
    """How many values follow roll-eval's option `arg` (`--n`: 1, `--overwrite`: 0). An unambiguous prefix is the
    option it starts, as argparse reads it (`--over`); an unknown or ambiguous one is a ValueError naming the
    command's place (roll-eval itself would refuse it)."""
    options = roll_eval_options()
    if arg in options:
        return options[arg]
    matches = sorted(o for o in options if o.startswith("--") and arg.startswith("--") and o.startswith(arg))
    if len(matches) == 1:
        return options[matches[0]]
    if matches:
        raise ValueError(f"{where}: {arg} is ambiguous: {', '.join(matches)} (roll-eval refuses it)")
    raise ValueError(f"{where}: {arg} is not one of roll-eval's options ({', '.join(sorted(options))})")


def without_hydra_flags(args: Sequence[str]) -> list[str]:
    """`args` without Hydra's flags and their values (`--cfg job` prints the config instead of running it)."""
    out, skip = [], 0
    for a in args:
        if skip:
            skip -= 1
        elif a in HYDRA_FLAGS:
            skip = HYDRA_FLAGS[a]
        else:
            out.append(a)
    return out


_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_SPAN = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)*)`(?!`)")  # a code span may wrap (not over a blank line)
_PROG = re.compile(r"(?:(?<=\s)|(?<=^)|(?<=:))(?:\S*/)?(roll-(?:train|eval))(?=\s|$)")
_NOX_QUICKSTART = re.compile(r"\bnox\s+-s\s+quickstart\b(?:\s+--\s+([^&;|]*))?")


def _commands_in(code: str, line: int, source: str) -> list[Command]:
    """The commands of one code span or code-block line. A command ends at a shell comment, `&&`, `;` or `|`."""
    found: list[Command] = []
    for m in _PROG.finditer(code):
        rest = code[m.end() :]
        comment = re.search(r"(?:^|\s)#\s*", rest)
        args_text, note = (rest[: comment.start()], rest[comment.end() :]) if comment else (rest, "")
        args = tuple(shlex.split(re.split(r"&&|;|\|", args_text)[0]))
        found.append(Command(m.group(1), args, line, source=source))
        if note.startswith("+"):
            found.append(
                Command(m.group(1), args + tuple(shlex.split(note[1:])), line, "with its '# +' comment", source)
            )
    # noxfile.py's quickstart session runs `roll-train experiment=quickstart`, unless its posargs name an experiment.
    for m in _NOX_QUICKSTART.finditer(code.split("#", 1)[0]):
        posargs = tuple(shlex.split(m.group(1) or ""))
        default = () if any(a.startswith("experiment=") for a in posargs) else ("experiment=quickstart",)
        found.append(Command("roll-train", default + posargs, line, "what `nox -s quickstart` runs", source))
    return found


def readme_commands(text: str, source: str = "README.md") -> list[Command]:
    """Every command markdown `text` (the file `source`) shows, once each, in order of first appearance."""
    found: list[Command] = []
    prose = text
    for block in _FENCE.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        for i, code in enumerate(block.group(1).splitlines()):
            found += _commands_in(code, first + i, source)
        # Blank the block out of the prose (same offsets and newlines, so spans keep their line numbers).
        prose = prose[: block.start()] + re.sub(r"[^\n]", " ", block.group(0)) + prose[block.end() :]
    for span in _SPAN.finditer(prose):
        found += _commands_in(" ".join(span.group(1).split()), text.count("\n", 0, span.start()) + 1, source)
    unique: dict[tuple[str, tuple[str, ...]], Command] = {}
    for cmd in sorted(found, key=lambda c: c.line):
        unique.setdefault((cmd.prog, cmd.args), cmd)
    return list(unique.values())


# ---- composing ------------------------------------------------------------------------------------------------
def _sweep_values(override: Any) -> list[str]:
    """The values a (sweep) override takes; an interval: its two ends."""
    from hydra.core.override_parser.types import IntervalSweep

    if not override.is_sweep_override():
        return [override.get_value_element_as_str()]
    value = override.value()
    if isinstance(value, IntervalSweep):
        return [str(value.start), str(value.end)]
    return list(override.sweep_string_iterator())


def _axes(overrides: list[str]) -> list[list[str]]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [[f"{o.get_key_element()}={v}" for v in _sweep_values(o)] for o in parsed]


def smallest_sweep(overrides: list[str]) -> list[str]:
    """Every swept parameter at its first value."""
    return [axis[0] for axis in _axes(overrides)]


def stand_ins(cmd: Command) -> list[str]:
    """The command's overrides with stand-ins a composition accepts for its placeholders (nothing reads them)."""
    overrides = [PLACEHOLDER.sub("placeholder", a) for a in cmd.overrides if a != "..."]
    return [*overrides, "model.path=/placeholder/checkpoint"] if cmd.prog == "roll-eval" else overrides


def _compose_with_hydra(overrides: list[str]) -> Any:
    """The composed config with its `hydra` node (launcher, sweeper) kept."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from roll_core.registry import register_all_configs

    register_all_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            return compose(config_name="rlvr", overrides=overrides, return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


@functools.cache
def first_job(cmd: Command) -> Any:
    """The composed config (`hydra` node included) of the command's first job; None when it does not compose
    (test_readme_command_composes says why)."""
    try:
        return _compose_with_hydra(smallest_sweep(stand_ins(cmd)))
    except Exception:
        return None


def jobs(cmd: Command) -> list[list[str]]:
    """The overrides of every job of a multirun (an Optuna sweep: every choice and both ends of every interval
    of `hydra.sweeper.params`); a single run's overrides."""
    overrides = stand_ins(cmd)
    if not cmd.multirun:
        return [overrides]
    combos = [list(job) for job in itertools.product(*_axes(overrides))]
    cfg = first_job(cmd)
    params = (cfg.hydra.sweeper.get("params") or {}) if cfg is not None else {}
    space = list(itertools.product(*_axes([f"{k}={v}" for k, v in params.items()])))
    return [job + list(point) for job in combos for point in space]


def _is_ray_launcher(cfg: Any) -> bool:
    return str(cfg.hydra.launcher.get("_target_", "")).endswith(".RayLauncher")
