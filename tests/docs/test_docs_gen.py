"""The generated reference covers what the code defines: every config group and option file, every field of every
typed node (with its comment, default and allowed values), every roll-algos function, every entry point.

A field, a schema and a group added here (not in roll's code) must appear on the pages, which is what makes the
reference impossible to drift: it is read from the code at each build.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
import typing
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from docs_gen import ascii_math, config_ref  # noqa: E402
from docs_gen.algos_ref import MODULES, algorithms_page  # noqa: E402
from docs_gen.plugins_ref import ROLL_DISTRIBUTIONS, plugins_page  # noqa: E402
from docs_gen.schema_doc import describe_schema  # noqa: E402

from roll_core.config.checks import one_of  # noqa: E402
from roll_core.config.schema import AlgoConfig  # noqa: E402


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return config_ref.config_pages()


def _section(pages: dict[str, str], cls: type) -> str:
    """The text of the section documenting `cls` (from its heading to the next one of any level)."""
    anchor = "{ #" + config_ref.slug(cls.__name__) + " }"
    for text in pages.values():
        if anchor in text:
            start = text.index(anchor)
            nxt = re.search(r"\n#{1,3} ", text[start:])
            return text[start : start + nxt.start()] if nxt else text[start:]
    raise AssertionError(f"{cls.__module__}.{cls.__name__} has no section on any configuration page")


def _row(section: str, name: str) -> list[str]:
    for line in section.splitlines():
        if line.startswith(f"| `{name}` |"):
            return [c.strip() for c in re.split(r"(?<!\\)\|(?![^`]*`\s*\|)", line.strip().strip("|"))]
    raise AssertionError(f"no row for {name!r} in:\n{section[:400]}")


def _reachable(cls: type) -> set[type]:
    """The dataclasses that `cls`'s fields hold, at any depth (found here, not with the generator's own walk)."""
    found: set[type] = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        for hint in (hints[f.name], *typing.get_args(hints[f.name])):
            if isinstance(hint, type) and dataclasses.is_dataclass(hint) and hint not in found:
                found |= {hint, *_reachable(hint)}
    return found


def test_every_field_of_every_typed_node_is_documented(pages: dict[str, str]) -> None:
    groups = config_ref.collect_groups()
    classes: set[type] = set(config_ref.module_dataclasses())
    for group in groups.values():
        classes.update(group.schemas.values())
    for f in describe_schema(config_ref.root_schema()):
        if f.nested is not None:
            classes.add(f.nested)
    for cls in list(classes):
        classes.update(_reachable(cls))
    from roll_core.config.tracking import WandbConfig

    assert WandbConfig in classes  # nested in the root's `tracking` node: documented on that node's page
    assert "{ #wandbconfig }" in pages["reference/config/tracking.md"]
    assert len(classes) > 30  # roll-core's, the engines' and the environments' schemas
    rows = 0
    for cls in classes - {config_ref.root_schema()}:
        section = _section(pages, cls)
        for f in dataclasses.fields(cls):
            _row(section, f.name)
            rows += 1
    assert rows > 300


def test_field_docs_defaults_and_allowed_values_come_from_the_source(pages: dict[str, str]) -> None:
    algo = _section(pages, AlgoConfig)
    # `# LR schedule after warm-up: ...` above the field, its default, and the tuple its __post_init__ checks.
    row = " ".join(_row(algo, "lr_schedule"))
    assert "LR schedule after warm-up" in row and "`constant`" in row and "`cosine`, `linear`" in row
    # Allowed values computed in this build: the installed estimators and losses (entry points).
    estimators = sorted(ep.name for ep in entry_points(group="roll.algorithms"))
    row = " ".join(_row(algo, "adv_estimator"))
    assert all(f"`{name}`" in row for name in estimators), row
    # A default that is omegaconf's MISSING reads "required"; null is spelled as in YAML.
    from roll_core.config.schema import ModelConfig

    assert "`required`" in _row(_section(pages, ModelConfig), "path")
    assert "`null`" in _row(algo, "dual_clip")
    # An engine schema that only changes a base field's default keeps the base's text.
    from roll_engines.config import VLLMInferEngineConfig

    row = " ".join(_row(_section(pages, VLLMInferEngineConfig), "sync_bucket_mb"))
    assert "bucket size in MiB" in row


def test_every_group_and_option_file_has_its_page(pages: dict[str, str]) -> None:
    files = 0
    for folder, _ in config_ref.config_sources():
        for path in folder.rglob("*.yaml"):
            rel = path.relative_to(folder)
            if len(rel.parts) < 2:
                continue
            group = "/".join(rel.parts[:-1])
            page = pages[f"reference/config/{config_ref.slug(group)}.md"]
            assert f"| `{path.stem}` |" in page, (group, path.stem)
            files += 1
    assert files > 40
    # The first comment line of an option's YAML is its description.
    assert "GRPO: group-normalised advantages" in pages["reference/config/algo.md"]
    index = pages["reference/config/index.md"]
    for group in ("algo", "model", "train_engine", "infer_engine", "env", "env/reward", "experiment", "hw"):
        assert f"[`{group}`]({config_ref.slug(group)}.md)" in index


# --- a field, a schema and a group that roll does not have --------------------------------------------------


@dataclass
class ProbeAlgoConfig(AlgoConfig):
    """An algorithm schema that exists only in this test."""

    # Knob that the documentation test adds; picks a flavour.
    probe_flavour: str = "sweet"
    probe_sizes: list[int] = field(default_factory=lambda: [1, 2])  # Sizes, as a trailing comment.

    def __post_init__(self) -> None:
        super().__post_init__()
        one_of("algo.probe_flavour", self.probe_flavour, ("sweet", "sour"))


@pytest.fixture
def probe_schema():
    from hydra.core.config_store import ConfigStore

    config_ref.collect_groups()  # every package registered first
    ConfigStore.instance().store(group="algo", name="probe_schema", node=ProbeAlgoConfig)
    yield ProbeAlgoConfig
    ConfigStore.instance().repo["algo"].pop("probe_schema.yaml")


def test_a_new_field_schema_and_group_appear(probe_schema: type, tmp_path: Path) -> None:
    group = tmp_path / "probe_group"
    group.mkdir()
    (group / "first.yaml").write_text("# @package _global_\n# The first probe option.\n# Launch: nothing\nx: 1\n")
    sources = [*config_ref.config_sources(), (tmp_path, "a test folder")]
    pages = config_ref.config_pages(sources, include=lambda c: config_ref.is_roll_schema(c) or c is probe_schema)

    algo = pages["reference/config/algo.md"]
    assert "Stored as `algo/probe_schema`." in algo
    section = _section({"algo": algo}, probe_schema)
    row = " ".join(_row(section, "probe_flavour"))
    assert "Knob that the documentation test adds; picks a flavour." in row
    assert "`sweet`" in row and "`sweet`, `sour`" in row
    assert "Sizes, as a trailing comment." in " ".join(_row(section, "probe_sizes"))
    assert "`[1, 2]`" in " ".join(_row(section, "probe_sizes"))
    # Inherited fields are documented on the subclass too, with the base's comments.
    assert "Samples per prompt" in " ".join(_row(section, "group_size"))

    page = pages["reference/config/probe_group.md"]
    assert "| `first` | a test folder | The first probe option. Launch: nothing |" in page
    assert "[`probe_group`](probe_group.md)" in pages["reference/config/index.md"]


# --- algorithms and plugins -----------------------------------------------------------------------------------


def test_every_roll_algos_function_is_on_the_algorithms_page() -> None:
    page = algorithms_page()
    names = 0
    for name in MODULES:
        module = importlib.import_module(f"roll_algos.{name}")
        assert f"## `roll_algos.{name}`" in page
        for public in module.__all__:
            obj = getattr(module, public)
            if callable(obj) and getattr(obj, "__module__", None) == module.__name__:
                assert f"### `{public}`" in page, public
                names += 1
    assert names > 30
    # Formulas became math (arithmatex's inline form) and KaTeX accepted each: none is left as a placeholder.
    assert page.count("\\(") >= 15 and "\x00" not in page
    assert r"\(G_{t} = r_{t} + \gamma \cdot G_{\text{next valid t}}\)" in page


def test_plain_text_formulas_become_tex_and_prose_stays_text() -> None:
    text = "Reward-to-go G_t = r_t + gamma * G_{next valid t}, over valid tokens only."
    ((start, end, tex),) = ascii_math.find_formulas(text)
    assert text[start:end] == "G_t = r_t + gamma * G_{next valid t}"
    assert tex == r"G_{t} = r_{t} + \gamma \cdot G_{\text{next valid t}}"
    named = "- `ppo`: max(-A r, -A clip(r, 1-clip_low, 1+clip_high)); dual clip when set."
    ((_, _, tex),) = ascii_math.find_formulas(named)
    assert tex.startswith(r"\max ( - A \, r") and r"\mathrm{clip\_low}" in tex
    # An equation whose right side holds prose is left alone (no half-converted sentence).
    assert ascii_math.find_formulas("so x = the number of valid tokens in the row") == []
    assert ascii_math.to_tex("clip(r, 1") is None  # unbalanced


def test_plugins_page_lists_every_group_and_roll_entry_point() -> None:
    from roll_core.registry import GROUPS

    page = plugins_page()
    for group in GROUPS:
        assert f"## `{group}`" in page
        for ep in entry_points(group=group):
            dist = ep.dist.name if ep.dist is not None else ""
            if dist.replace("_", "-").lower() in ROLL_DISTRIBUTIONS:
                assert f"| `{ep.name}` | `{ep.value}` | `{dist}` |" in page, (group, ep.name)
    # Test plugins installed in this venv are not roll's: not listed.
    assert "roll_dummy" not in page
