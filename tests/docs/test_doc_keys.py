"""Every config key and group option the documentation names exists, and a key it tells the user to add says `+`.

Read: README.md, docs/**/*.md (the generated reference excluded), conf/README.md, packages/*/README.md, examples/,
and the string literals and comments of roll's sources plus the comments of their config YAMLs (messages and
docstrings that tell the user a key to set). Checked:

- a dotted key (`algo.lr`, `infer_engine.gpu_memory_utilization`, `env.reward.url`, `hydra.sweep.dir`) is a key of
  some composed config: the default one, one with the option the same line selects (`env=file env.path=...`), or
  one with another option of the key's group; a key under a map (`cluster.call_timeouts`, `env.env_kwargs`) may be
  anything. In sources only overrides (`key=value`) are checked: `model.layers.0` is a weight's name there, and
  `key={value}` reports the run's setting (it must exist, but need not say `+`);
- an override of a key under a map that no composition has (`distill.teachers.math=...`,
  `env.env_kwargs.allow_unsandboxed_...=true`) carries Hydra's `+` (or an earlier `+...@key` on the line adds its
  node): without it Hydra refuses the override ("Could not override"), so the documented command would fail;
- `group=option` (`pipeline=`, `algo=`, `infer_engine=`, `env/reward=`, `hydra/launcher=`, ...) names an option the
  installed packages ship (a YAML file or a ConfigStore node), or one the page itself creates (`<!-- file:
  conf/env/reverse.yaml -->`: keys of that option are the page's own and are not checked).

The commands themselves are composed by test_pages_commands.py and tests/e2e/test_readme_commands.py; this catches
the keys in prose, tables, comments and messages, which no command carries. Compositions are made lazily and cached
(a key of the default config costs none), so the check takes a few seconds.
"""

from __future__ import annotations

import functools
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.filterwarnings("ignore:The pynvml package is deprecated:FutureWarning")

TOPS = "pipeline|algo|model|infer_engine|train_engine|cluster|env|tracking|data|distill|reward_model|hw|hydra"
TOPS += "|sft|dpo|rollout"
# A dotted key, `<placeholder>` segments allowed; `+`/`~` and a directly following `=` are captured.
KEY = re.compile(rf"(?<![\w./$@<-])(\+{{0,2}}|~)?((?:{TOPS})(?:\.(?:[A-Za-z_]\w*|<[^<>\s]+>))+)(=)?")
GROUPS = "pipeline|algo|model|infer_engine|train_engine|cluster|env|experiment|hw|reward_model"
GROUPS += "|env/reward|hydra/launcher|hydra/sweeper"
GROUP = re.compile(rf"(?<![\w./@-])\+?({GROUPS})=([\w.,-]+)")
# `+group@key.path=option` and `+key.path=...`: the line adds a node at key.path.
ADDED = re.compile(r"\+{1,2}(?:[\w/]+@)?([\w.]+)=")
FILE_BLOCK = re.compile(r"<!--\s*file:\s*conf/([\w/]+)/(\w+)\.yaml\s*-->")
# A file name, a Python module path or attribute, not a key.
NOT_A_KEY = re.compile(r"\.(py|ya?ml|md|json|jsonl|txt|csv|png|safetensors|toml|sh|parquet)$|^hydra\.(core|utils)\b")
#: Mentions that are not keys on purpose, with why.
ALLOWED = {
    "algo.lrr": "docs/concepts/configs.md shows the error a misspelt key gives",
    "reward_model.ground_truth": "a column of verl's prepared rows (docs/recipes/vision.md), not a config key",
    "algo=grpoo": "docs/troubleshooting.md shows the error a misspelt option gives",
    "experiment=my_experiment": "a user's own experiment (docs/recipes/containers.md)",
    "experiment=mine": "a user's own experiment (conf/README.md)",
}
#: The config group a top-level key belongs to (keys of the others are the pipeline's nodes).
KEY_GROUP = {t: t for t in ("pipeline", "algo", "model", "infer_engine", "train_engine", "cluster", "env", "hw")}
KEY_GROUP["reward_model"] = "reward_model"


def doc_files() -> list[Path]:
    """The markdown and example files a user reads."""
    docs = [p for p in sorted((ROOT / "docs").rglob("*.md")) if p.relative_to(ROOT / "docs").parts[0] != "reference"]
    examples = [p for p in sorted((ROOT / "examples").rglob("*")) if p.is_file()]
    readmes = sorted(ROOT.glob("packages/*/README.md"))
    return [ROOT / "README.md", ROOT / "conf" / "README.md", *docs, *readmes, *examples]


def source_lines() -> Iterator[tuple[Path, int, str]]:
    """(file, line, text) of every string literal and comment of roll's sources, and every comment of their YAMLs."""
    for path in sorted(ROOT.glob("packages/*/src/**/*.py")):
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type in (tokenize.STRING, tokenize.COMMENT):
                for i, line in enumerate(tok.string.splitlines()):
                    yield path, tok.start[0] + i, line
    for path in sorted(ROOT.glob("packages/*/src/*/conf/**/*.yaml")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("#"):
                yield path, n, line


# ---- the composed configs -------------------------------------------------------------------------------------
def _walk(node: DictConfig, prefix: str, keys: dict[str, bool]) -> None:
    """keys: every path of `node` -> whether it is a map (a dict whose keys the user chooses)."""
    for k in node.keys():
        child = node._get_node(k)
        path = f"{prefix}.{k}" if prefix else str(k)
        keys[path] = isinstance(child, DictConfig) and OmegaConf.get_type(child) is dict
        if isinstance(child, DictConfig):
            _walk(child, path, keys)


@pytest.fixture(autouse=True)
def _hydra_per_test() -> Iterator[None]:
    """`composed` initializes Hydra once for a test's compositions (half their cost); none outlives the test."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


@functools.cache
def composed(overrides: tuple[str, ...]) -> dict[str, bool] | None:
    """The key paths of the config composed with `overrides` (its `hydra` node included); None: it does not compose."""
    from hydra import compose, initialize_config_dir, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from roll_core.config.search_path import primary_config_path
    from roll_core.registry import register_all_configs

    if not GlobalHydra.instance().is_initialized():
        register_all_configs()
        primary = primary_config_path()
        if primary.startswith("pkg://"):
            initialize_config_module(config_module=primary.removeprefix("pkg://"), version_base=None)
        else:
            initialize_config_dir(config_dir=primary, version_base=None)
    try:
        cfg = compose(config_name="rlvr", overrides=list(overrides), return_hydra_config=True)
    except Exception:
        return None
    keys: dict[str, bool] = {}
    _walk(cfg, "", keys)
    return keys


@functools.cache
def options(group: str) -> tuple[str, ...]:
    """The options of a config group: the installed packages' YAML files and ConfigStore nodes (schemas excluded)."""
    from hydra.core.config_store import ConfigStore

    from roll_core.config.search_path import group_options
    from roll_core.registry import register_all_configs

    register_all_configs()
    names = set(group_options(group))
    try:
        stored = ConfigStore.instance().list(group)
    except OSError:
        stored = []
    names |= {n.removesuffix(".yaml") for n in stored if not n.removesuffix(".yaml").endswith("_schema")}
    if group.startswith("hydra/"):  # Hydra's own plugins' options live in their packages' ConfigStore
        names |= {"basic"}
    return tuple(sorted(names))


def _candidates(key: str, selected: list[str]) -> Iterator[tuple[str, ...]]:
    """Compositions that may hold `key`: the default, each of the line's own selections, then each option of its
    group (one override each, so the few dozen compositions are shared by every line)."""
    yield ()
    for option in selected:
        yield (option,)
    top = key.split(".")[0]
    groups = ["env/reward", "env"] if key.startswith("env.reward.") else [KEY_GROUP.get(top, "pipeline")]
    if top == "hydra":
        groups = ["hydra/launcher", "hydra/sweeper"]
    for group in groups:
        for option in options(group):
            yield (f"{group}={option}",)


def _matches(path: str, keys: dict[str, bool]) -> tuple[bool, str | None]:
    """(exists, the map it lies under when it is not itself a key). `<x>` segments stand for any name."""
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if "<" in parts[i - 1]:  # any key of an existing node (`tracking.<name>`: each backend's options)
            return True, None
        if prefix not in keys:
            return False, None
        if keys[prefix] and i < len(parts):
            child = ".".join(parts[: i + 1])
            if "<" in parts[i] or child not in keys:
                return True, prefix
    return True, None


def check_line(text: str, selected: list[str], own: set[str], overrides_only: bool) -> list[str]:
    """What is wrong with the keys of one line (`selected`: its `group=option`s; `own`: groups the page defines)."""
    problems = []
    added = [m.group(1) for m in ADDED.finditer(text)]
    for m in KEY.finditer(text):
        plus, key, eq = m.group(1) or "", m.group(2), m.group(3)
        if NOT_A_KEY.search(key) or key in ALLOWED or key.split(".")[0] in own:
            continue
        if overrides_only and not eq:
            continue  # sources: `model.layers.0` is a weight's name, `env.reset()` a method
        # In sources a value filled in from the run (`key={value}`, `key=%d`) reports a setting the user made (with
        # a `+` where it needed one): the key must exist, but the message need not say `+`.
        report = overrides_only and text[m.end() : m.end() + 1] in ("{", "%")
        exact, under_map = False, None
        for cand in _candidates(key, selected):
            keys = composed(cand)
            exists, map_node = _matches(key, keys) if keys is not None else (False, None)
            exact = exists and map_node is None
            under_map = under_map or map_node
            # A key under a map that is only named, or a `<placeholder>` one, is settled: no option has it as such.
            if exact or (map_node and (not eq or "<" in key[len(map_node) :])):
                break
        if exact:
            continue
        if under_map is None:
            problems.append(f"`{key}` is not a key of any composed config")
        elif eq and not plus and not report and not any(key == a or key.startswith(a + ".") for a in added):
            problems.append(f"`{key}=` adds a key to the map {under_map}: Hydra needs `+{key}=`")
    return problems


def check_groups(text: str, own: set[str]) -> list[str]:
    problems = []
    for m in GROUP.finditer(text):
        group, values = m.groups()
        for value in values.split(","):
            value = value.rstrip(".")
            if value and f"{group}={value}" not in ALLOWED and f"{group}={value}" not in own:
                if value not in options(group):
                    problems.append(f"`{group}={value}`: no such option (installed: {', '.join(options(group))})")
    return problems


def selections(text: str) -> list[str]:
    """The line's valid `group=option` selections (one option each: the first of a sweep)."""
    found = []
    for group, values in GROUP.findall(text):
        value = values.split(",")[0].rstrip(".")
        if value in options(group):
            found.append(f"{group}={value}")
    return found


def page_options(text: str) -> set[str]:
    """`group=option` of the config files a page tells the user to create, and those groups' top keys' names."""
    found = {f"{g}={n}" for g, n in FILE_BLOCK.findall(text)}
    return found


def doc_problems(path: Path) -> list[str]:
    text = path.read_text(errors="replace")
    own = page_options(text)
    problems = []
    for n, line in enumerate(text.splitlines(), 1):
        # A line that selects an option the page defines: its keys of that group are the page's own.
        own_groups = {o.split("=")[0] for o in own if re.search(rf"(?<![\w/]){re.escape(o)}(?!\w)", line)}
        found = check_groups(line, own) + check_line(line, selections(line), own_groups, overrides_only=False)
        problems += [f"{path.relative_to(ROOT)}:{n}: {p}" for p in found]
    return problems


# ---- the tests ------------------------------------------------------------------------------------------------
DOCS = doc_files()


def test_docs_are_read() -> None:
    """The files and the parser find what they should (a broken pattern would pass everything below)."""
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "docs/concepts/configs.md", "packages/roll-core/README.md"} <= names
    assert any(n.startswith("examples/") for n in names)
    mentions = {m.group(2) for p in DOCS for m in KEY.finditer(p.read_text())}
    assert {"algo.lr", "pipeline.max_steps", "infer_engine.sync_transport", "hydra.sweep.dir"} <= mentions
    assert len(mentions) > 150, len(mentions)


@pytest.mark.parametrize("path", DOCS, ids=[p.relative_to(ROOT).as_posix() for p in DOCS])
def test_doc_keys_exist(path: Path) -> None:
    problems = doc_problems(path)
    assert not problems, "\n".join(problems)


def test_source_messages_name_real_keys() -> None:
    """Overrides that roll's messages, docstrings and config comments tell the user to set exist (and say `+`)."""
    problems = []
    for path, n, line in source_lines():
        if "=" not in line:
            continue
        found = check_line(line, selections(line), set(), overrides_only=True)
        problems += [f"{path.relative_to(ROOT)}:{n}: {p}" for p in found]
    assert not problems, "\n".join(problems)


def test_the_check_finds_wrong_mentions() -> None:
    """Each rule reports what it should (and passes what it should) on lines written wrong on purpose."""
    assert check_line("set `algo.lrate=1e-6`", [], set(), False) == ["`algo.lrate` is not a key of any composed config"]
    assert check_line("`infer_engine.gpu_memory_utilization=0.5`", [], set(), False) == []  # a vllm key
    assert check_line("`env.path=rows.jsonl` with `env=file`", ["env=file"], set(), False) == []
    assert check_line("route with distill.teachers.<domain>=<path>", [], set(), False) == [
        "`distill.teachers.<domain>=` adds a key to the map distill.teachers: Hydra needs `+distill.teachers.<domain>=`"
    ]
    assert check_line("route with +distill.teachers.<domain>=<path>", [], set(), False) == []
    assert check_line("+env@env.tasks.mine=file env.tasks.mine.path=x", ["env=multi"], set(), False) == []
    assert check_line("`cluster.call_timeouts.<role>` per role", [], set(), False) == []  # named, not set
    assert check_line("`tracking.<name>` holds a backend's options", [], set(), False) == []
    assert check_line('f"set hydra.launcher.ray.remote.num_gpus={gpus}"', [], set(), True) == []  # a report
    assert check_line('f"infer_engine.base_gpu_id={gpu} is wrong"', [], set(), True) == [
        "`infer_engine.base_gpu_id` is not a key of any composed config"
    ]
    assert check_line("`model.visual` is the vision tower", [], set(), True) == []  # sources: overrides only
    assert check_groups("roll-train infer_engine=vlm algo=grpo,ppo", set()) == [
        f"`infer_engine=vlm`: no such option (installed: {', '.join(options('infer_engine'))})"
    ]
    assert check_groups("env/reward=judge hydra/launcher=ray hydra/sweeper=optuna", set()) == []
