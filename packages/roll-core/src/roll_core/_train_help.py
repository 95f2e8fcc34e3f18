"""`roll-train --help`: roll's own help page, stored as the Hydra option `hydra/help=roll_train`.

Contract: `register_help()` stores the page in Hydra's ConfigStore and returns the option's name, which roll-train
(roll_core.cli.train_main) adds as `hydra/help=<name>` when `--help`/`-h` is given. The page is HELP_HEADER (usage and
examples), `help_groups()` (every config group and its options, one group a line: the installed packages' YAML
options, the user's conf folder and the options plugins store in the ConfigStore, never a `<name>_schema` nor Hydra's
own groups), the composed config, and HELP_FOOTER. roll_core.cli re-exports these names.
"""

from __future__ import annotations

HELP_HEADER = """roll-train: train a model with roll: RL from verifiable rewards (GRPO, PPO, ...), SFT, DPO,
distillation, rollout-only data generation.

Usage: roll-train [group=option ...] [key=value ...]
  roll-train experiment=quickstart                  a ready-made run (the experiment group below)
  roll-train algo=ppo model=qwen2_5 algo.lr=1e-6    pick options, set any key of the config below
  roll-train -m algo.lr=1e-6,3e-6                   a sweep: one run per value
  roll-train experiment=quickstart --cfg job        print the composed config without running
  roll-train pipeline.resume=true                   continue the latest run of the experiment
A misspelt key or option is an error naming the closest valid one (exit status 2)."""

HELP_FOOTER = """Evaluate checkpoints: roll-eval --help. Check the machine: roll-doctor.
Every key with its meaning: the documentation's config reference. Hydra's own flags: roll-train --hydra-help"""


def help_groups() -> str:
    """The config groups and their options, one group a line, as `roll-train --help` lists them: the YAML options
    of the installed packages and the user's conf folder, and the options plugins store in Hydra's ConfigStore.
    Hydra's own listing also showed each group's schema (`algo_schema`, the `<name>_schema` every option's YAML
    extends), which is no option to pick."""
    from hydra.core.config_store import ConfigStore

    from roll_core.config.search_path import config_dirs

    groups: dict[str, set[str]] = {}
    for folder in config_dirs():
        for path in folder.rglob("*.yaml"):
            groups.setdefault(path.parent.relative_to(folder).as_posix(), set()).add(path.stem)
    store = ConfigStore.instance()

    def walk(group: str) -> None:
        for name in store.list(group):
            if name.endswith(".yaml"):
                groups.setdefault(group, set()).add(name.removesuffix(".yaml"))
            else:
                walk(f"{group}/{name}" if group else name)

    walk("")
    return "\n".join(
        f"{g}: {', '.join(sorted(o for o in opts if not o.endswith('_schema')))}"
        for g, opts in sorted(groups.items())
        if g not in (".", "") and g.split("/")[0] != "hydra" and any(not o.endswith("_schema") for o in opts)
    )


def register_help() -> str:
    """Store roll-train's help page as the Hydra option `hydra/help=<name>` and return the name (Hydra's default
    page introduced the program as "cli is powered by Hydra" and said nothing of how to run it)."""
    from hydra.core.config_store import ConfigStore

    template = "\n".join(
        [
            "${hydra.help.header}",
            "",
            "== Configuration groups (group=option) ==",
            help_groups(),
            "",
            "== Config (set any key: key=value) ==",
            "$CONFIG",
            "${hydra.help.footer}",
        ]
    )
    node = {"app_name": "roll-train", "header": HELP_HEADER, "footer": HELP_FOOTER, "template": template}
    ConfigStore.instance().store(group="hydra/help", name="roll_train", node=node, provider="roll")
    return "roll_train"
