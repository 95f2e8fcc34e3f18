"""Every `roll-train` / `roll-eval` command the documentation pages show composes, and the recipes' files work.

The commands are read from docs/**/*.md (the generated reference excluded) by the README test's parser
(tests/e2e/doc_commands.py: code spans and fenced blocks, `# +` comments, `nox -s quickstart -- ...`), so a new
command on any page is picked up without editing this file. Each is composed and validated as a typed config (a
multirun: every job of its sweep) without running anything: the pages show GPU and cluster commands that cannot run
here, and what runs on CPU is run by the tests the pages name (the README's commands, shared with the pages, run in
tests/e2e/test_readme_commands.py and are not composed twice). Hydra's own flags (`--cfg job`, `--info searchpath`)
are dropped before composing.

Recipe files: a fenced block right after `<!-- file: PATH -->` is a file the page tells the user to create. The test
writes a page's files into a folder of their own, puts it on `sys.path` and, when it has a `conf/`, makes that the
user's conf folder (`ROLL_CONF_DIR`), exactly as the page says to run them; the page's commands then compose
against them, and every `_target_` the files define is built (a task: disjoint non-empty train and held-out sets
whose answers its reward scores 1 and a wrong answer 0; a reward: the same two scores).

Troubleshooting: every message fragment docs/troubleshooting.md quotes as roll's (a `Message:` line) must occur in
roll's sources, so a reworded error cannot leave a stale entry behind.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # doc_commands: shared with the README test
import doc_commands
from doc_commands import ROOT, Command, jobs, readme_commands

# The first composition registers every plugin's configs, which imports torch.cuda: some torch builds warn there
# about the deprecated pynvml package (third-party; the README test imports torch before its tests run).
pytestmark = pytest.mark.filterwarnings("ignore:The pynvml package is deprecated:FutureWarning")

DOCS = ROOT / "docs"
# `<!-- file: conf/env/x.yaml -->` then a fenced block: its body is the file.
FILE_BLOCK = re.compile(r"<!--\s*file:\s*(\S+)\s*-->[ \t]*\n```[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
# Where roll's own error messages live (troubleshooting quotes them).
SOURCES = [*ROOT.glob("packages/*/src"), ROOT / "noxfile.py", ROOT / "tests" / "device"]


def pages() -> list[Path]:
    """The hand-written pages (docs/reference/ is generated at build time)."""
    return sorted(p for p in DOCS.rglob("*.md") if p.relative_to(DOCS).parts[0] != "reference")


def page_files(text: str) -> dict[str, str]:
    """The files a page tells the user to create: relative path -> content."""
    return {m.group(1): m.group(2) for m in FILE_BLOCK.finditer(text)}


def without_hydra_flags(cmd: Command) -> Command:
    """The command without Hydra's flags (`--cfg job` prints the config instead of running: same composition)."""
    return Command(cmd.prog, tuple(doc_commands.without_hydra_flags(cmd.args)), cmd.line, cmd.how, cmd.source)


def without_files(text: str) -> str:
    """The page with its files' contents blanked (same lines): a YAML's `# Launch: roll-train ...` comment is
    documentation of the file, not a command of the page."""
    return FILE_BLOCK.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def _collect() -> list[Command]:
    readme = {(c.prog, c.args) for c in readme_commands((ROOT / "README.md").read_text())}
    found: dict[tuple[str, tuple[str, ...]], Command] = {}
    for page in pages():
        for cmd in readme_commands(without_files(page.read_text()), source=str(page.relative_to(ROOT))):
            cmd = without_hydra_flags(cmd)
            if (cmd.prog, cmd.args) not in readme:  # composed (and run where it can) by test_readme_commands.py
                found.setdefault((cmd.prog, cmd.args), cmd)
    return list(found.values())


COMMANDS = _collect()


@contextmanager
def recipe_folder(page: Path, tmp: Path) -> Iterator[Path | None]:
    """The page's files written under `tmp`, importable and, with a conf/, the user's conf folder; None: no files."""
    files = page_files(page.read_text())
    if not files:
        yield None
        return
    folder = tmp / page.stem
    for rel, body in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(body)
    old_conf, old_path = os.environ.get("ROLL_CONF_DIR"), list(sys.path)
    if (folder / "conf").is_dir():
        os.environ["ROLL_CONF_DIR"] = str(folder / "conf")
    sys.path.insert(0, str(folder))
    # Another test may have imported a module of the same name (packages/roll-envs/tests/test_reward_node.py writes
    # its own my_rewards.py): the page's file must be the one imported.
    for stem in {Path(rel).stem for rel in files if rel.endswith(".py") and "/" not in rel}:
        sys.modules.pop(stem, None)
    importlib.invalidate_caches()
    try:
        yield folder
    finally:
        sys.path[:] = old_path
        for module in [m for m, mod in sys.modules.items() if str(folder) in str(getattr(mod, "__file__", ""))]:
            del sys.modules[module]
        if old_conf is None:
            os.environ.pop("ROLL_CONF_DIR", None)
        else:
            os.environ["ROLL_CONF_DIR"] = old_conf


# ---- the tests ------------------------------------------------------------------------------------------------
def test_pages_show_commands() -> None:
    """The parser finds the pages' commands (a broken parser or a renamed folder would pass every test below)."""
    where = {Path(c.source).parent.name for c in COMMANDS}
    assert {"quickstart", "recipes", "concepts"} <= where, sorted(where)
    assert len(COMMANDS) >= 30, [c.text for c in COMMANDS]
    assert all(c.source.startswith("docs/") for c in COMMANDS)


def test_hydra_flags_are_dropped() -> None:
    cmd = Command("roll-train", ("experiment=quickstart", "--cfg", "job", "algo=ppo"), 1)
    assert without_hydra_flags(cmd).args == ("experiment=quickstart", "algo=ppo")


@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{c.source}:{c.line}:{c.text}" for c in COMMANDS])
def test_page_command_composes(cmd: Command, tmp_path: Path) -> None:
    """The command composes to a valid typed config (a multirun: every job), with its page's files in place."""
    from roll_core.config import compose, to_object

    with recipe_folder(ROOT / cmd.source, tmp_path):
        for overrides in jobs(cmd):
            try:
                cfg = to_object(compose(overrides))
            except Exception as exc:
                pytest.fail(f"{cmd.where}: `{cmd.text}` does not compose: {type(exc).__name__}: {exc}")
            assert cfg.pipeline.max_steps > 0


RECIPES = [p for p in pages() if page_files(p.read_text())]


@pytest.mark.parametrize("page", RECIPES, ids=[str(p.relative_to(DOCS)) for p in RECIPES])
def test_recipe_files_work(page: Path, tmp_path: Path) -> None:
    """Every task and reward the page's files define builds from the page's command and scores right and wrong."""
    from roll_core.config import compose, to_object
    from roll_core.config.build import build

    cmds = [c for c in COMMANDS if c.source == str(page.relative_to(ROOT))]
    assert cmds, f"{page}: files but no command that uses them"
    with recipe_folder(page, tmp_path) as folder:
        modules = {p.stem for p in folder.glob("*.py")}
        checked = 0
        for cmd in cmds:
            cfg = to_object(compose(jobs(cmd)[0]))
            env, reward = cfg.env, getattr(cfg.env, "reward", None)
            target = env["_target_"] if isinstance(env, dict) else env._target_
            if target.split(".")[0] in modules:
                task = build(env)
                train, held_out = task.train_set(), task.eval_set()
                assert train and held_out and not {p.id for p in train} & {p.id for p in held_out}, cmd.text
                _check_scores(task.reward, [p.answer for p in train[:4]], cmd)
                assert task.messages(train[0])[-1]["content"], cmd.text
                checked += 1
            reward_target = reward["_target_"] if isinstance(reward, dict) else getattr(reward, "_target_", "")
            if reward_target.split(".")[0] in modules:
                _check_scores(build(reward), ["7", "cab"], cmd)
                checked += 1
        assert checked, f"{page}: no command builds the page's classes ({sorted(modules)})"


def _check_scores(reward: Any, answers: list[str], cmd: Command) -> None:
    right = [f"So the answer is \\boxed{{{a}}}." for a in answers]
    wrong = ["I do not know." for _ in answers]
    res = reward.score(right + wrong, answers + answers)
    n = len(answers)
    assert res.correct == [1.0] * n + [0.0] * n, f"{cmd.text}: correct={res.correct}"
    assert all(s > w for s, w in zip(res.scores[:n], res.scores[n:])), f"{cmd.text}: scores={res.scores}"


def _messages(text: str) -> list[str]:
    """Fragments troubleshooting.md quotes as roll's messages: `Message: \\`...\\`` lines."""
    return re.findall(r"^Message: `([^`]+)`", text, re.M)


def test_troubleshooting_quotes_real_messages() -> None:
    text = (DOCS / "troubleshooting.md").read_text()
    quoted = _messages(text)
    assert len(quoted) >= 15, quoted
    sources = "\n".join(
        p.read_text(errors="replace")
        for root in SOURCES
        for p in ([root] if root.is_file() else root.rglob("*.py"))
        if "__pycache__" not in p.parts
    )
    missing = [q for q in quoted if q not in sources]
    assert not missing, f"troubleshooting.md quotes messages roll's code does not have: {missing}"
