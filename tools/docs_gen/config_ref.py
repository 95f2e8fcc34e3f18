"""The configuration reference: one page per config group and per typed node of the root, from what is installed.

Contract: `config_pages()` returns {path under docs/: markdown}. Sources, read at build time so the pages cannot
drift from the code:
- groups: every folder holding YAML under the installed packages' config modules (`roll.configs` entry points,
  roll_core.config.search_path) and the repository's `conf/`, plus every group of Hydra's ConfigStore that holds a
  schema; each option is listed with the first comment lines of its YAML (a ConfigStore-only option with its
  schema's docstring);
- typed nodes: the dataclasses stored in the ConfigStore by roll's packages, the nodes they nest, and every
  dataclass defined in roll_core.config's modules; each field with its doc comment, type, default and allowed
  values (schema_doc).
`include` decides which schema classes are roll's (an installed out-of-tree plugin's schemas are its own docs'
business); tests pass their own to see a new field or group appear.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from docs_gen.markdown import cell, code, inline, slug, table
from docs_gen.schema_doc import describe_schema

ROOT = Path(__file__).resolve().parents[2]
ROLL_MODULES = ("roll_hw", "roll_algos", "roll_core", "roll_engines", "roll_envs")
# Keys Hydra gives a meaning of its own; their fields carry no comment in the schemas.
HYDRA_KEYS = {
    "_target_": "The class Hydra instantiates for this node (set by the option you choose; a plugin's own class "
    "goes here).",
    "defaults": "Hydra's defaults list (which option of each group composes the run).",
}
PAGE_DIR = "reference/config"
BASE = "(base)"


def is_roll_schema(cls: type) -> bool:
    """A schema defined in one of roll's five packages."""
    return cls.__module__.split(".")[0] in ROLL_MODULES


@dataclass
class Group:
    """A config group: its YAML options (name -> (file, label of where it comes from)) and typed schemas."""

    name: str
    options: dict[str, tuple[Path, str]] = field(default_factory=dict)
    schemas: dict[str, type] = field(default_factory=dict)


def config_sources() -> list[tuple[Path, str]]:
    """Config folders in Hydra's search order with a label: the repository's `conf/`, then each package's."""
    from roll_core.config.search_path import config_packages, package_dir

    out: list[tuple[Path, str]] = []
    if (ROOT / "conf").is_dir():
        out.append((ROOT / "conf", "repository `conf/`"))
    for module in config_packages():
        folder = package_dir(module)
        if folder is not None:
            out.append((folder, f"`{module.split('.')[0].replace('_', '-')}`"))
    return out


def _store_entries() -> Iterable[tuple[str, str, object]]:
    """(group, option name, node) for every ConfigStore entry, after every package registered its configs."""
    from hydra.core.config_store import ConfigStore

    from roll_core.registry import register_all_configs

    register_all_configs()

    def walk(tree: dict, prefix: str) -> Iterable[tuple[str, str, object]]:
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}/")
            else:
                yield prefix.rstrip("/"), key.removesuffix(".yaml"), value.node

    yield from walk(ConfigStore.instance().repo, "")


def _schema_class(node: object) -> type | None:
    from omegaconf import OmegaConf

    try:
        cls = OmegaConf.get_type(node)
    except Exception:
        return None
    return cls if isinstance(cls, type) and dataclasses.is_dataclass(cls) else None


def collect_groups(
    sources: list[tuple[Path, str]] | None = None, include: Callable[[type], bool] = is_roll_schema
) -> dict[str, Group]:
    """Every config group (see the module docstring), sorted by name."""
    groups: dict[str, Group] = {}
    for folder, label in config_sources() if sources is None else sources:
        for path in sorted(folder.rglob("*.yaml")):
            rel = path.relative_to(folder)
            if len(rel.parts) < 2:
                continue  # a primary config (rlvr.yaml) is not a group option
            name = "/".join(rel.parts[:-1])
            group = groups.setdefault(name, Group(name))
            group.options.setdefault(path.stem, (path, label))  # the first folder wins, as in Hydra
    for group_name, option, node in _store_entries():
        cls = _schema_class(node)
        if group_name and cls is not None and include(cls):
            groups.setdefault(group_name, Group(group_name)).schemas[option] = cls
    return dict(sorted(groups.items()))


def yaml_summary(path: Path, lines: int = 3) -> str:
    """The first comment lines of a YAML file (directives such as `# @package` skipped)."""
    out = []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped.startswith("#"):
            break
        text = stripped.lstrip("#").strip()
        if text.startswith("@"):
            continue
        out.append(text)
        if len(out) == lines:
            break
    return " ".join(out)


def _first_line(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    return " ".join(doc.split("\n\n")[0].split())


def root_schema() -> type:
    from roll_core.config.schema import RLVRConfig

    return RLVRConfig


def module_dataclasses(package: str = "roll_core.config") -> list[type]:
    """Every dataclass defined in the modules of `package` (roll_core.config: the typed nodes of the root)."""
    pkg = importlib.import_module(package)
    found = []
    for info in pkgutil.iter_modules(pkg.__path__, f"{package}."):
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__:
                found.append(obj)
    return found


def _nested(cls: type, seen: set[type]) -> list[type]:
    """`cls` and the dataclasses its fields hold, depth first, each once."""
    if cls in seen:
        return []
    seen.add(cls)
    out = [cls]
    for f in describe_schema(cls):
        if f.nested is not None:
            out += _nested(f.nested, seen)
    return out


def _anchor(cls: type) -> str:
    return slug(cls.__name__)


def schema_section(cls: type, level: int, links: dict[type, str]) -> str:
    """A heading, the docstring and the options table of one typed node."""
    lines = [f"{'#' * level} {cls.__name__} {{ #{_anchor(cls)} }}", ""]
    doc = inspect.getdoc(cls)
    if doc:
        lines += [inline(" ".join(doc.split())), ""]
    lines.append(f"Defined in `{cls.__module__}`.\n")
    rows = []
    for f in describe_schema(cls):
        doc_text = f.doc or HYDRA_KEYS.get(f.name, "")
        if f.nested is not None:
            target = links.get(f.nested, f"#{_anchor(f.nested)}")
            doc_text = doc_text or _first_line(f.nested)
            type_cell = f"[{f.nested.__name__}]({target})"
            default_cell = "its defaults"
        else:
            type_cell = code(f.type)
            default_cell = code(f.default)
        description = cell(doc_text)
        if f.allowed:  # what __post_init__ accepts, as computed in this build
            allowed = ", ".join(code(v) if not v.startswith("`") else v for v in f.allowed)
            description = f"{description}<br>**Allowed:** {allowed}" if description else f"**Allowed:** {allowed}"
        rows.append([code(f.name), type_cell, default_cell, description or "&nbsp;"])
    lines.append(table(["Option", "Type", "Default", "Description"], rows))
    return "\n".join(lines)


def _page_of_group(name: str) -> str:
    return f"{PAGE_DIR}/{slug(name)}.md"


def group_page(group: Group, root_key: str | None, links: dict[type, str]) -> str:
    """The page of one group: its options, then each typed schema with its nested nodes."""
    key = root_key or group.name.replace("/", ".")
    lines = [f"# `{group.name}`", ""]
    if group.name == "experiment":
        lines.append("An experiment sets several groups and keys at once: `roll-train experiment=<name>`.\n")
    elif group.name.startswith("hydra/"):
        lines.append(f"Hydra's own `{group.name}` group, with roll's options: `roll-train {group.name}=<name>`.\n")
    else:
        lines.append(
            f"Choose an option with `roll-train {group.name}=<name>`; set one key with `{key}.<option>=<value>`.\n"
        )
    if group.options:
        lines += ["## Options", ""]
        rows = [[code(n), label, cell(yaml_summary(p)) or "&nbsp;"] for n, (p, label) in group.options.items()]
        lines.append(table(["Name", "From", "What it is"], rows))
    if group.schemas:
        lines += ["## Typed schemas", ""]
        lines.append(
            "Each option above extends one of these schemas (its `defaults:` names it): an unknown key or a wrong "
            "type fails at composition with the key's name.\n"
        )
        seen: set[type] = set()
        for option, cls in group.schemas.items():
            for nested in _nested(cls, seen):
                if nested is cls and option == BASE:
                    lines.append(f"The keys every option of `{group.name}` has (the root's type for the group).\n")
                elif nested is cls:
                    lines.append(f"Stored as `{group.name}/{option}`.\n")
                lines.append(schema_section(nested, 3, links))
    return "\n".join(lines)


def node_page(key: str, cls: type, links: dict[type, str]) -> str:
    """The page of a typed node of the root that is not a group (`tracking`, `data`, `sft`, ...)."""
    lines = [f"# `{key}`", "", f"Set its keys with `{key}.<option>=<value>`.\n"]
    for nested in _nested(cls, set()):
        lines.append(schema_section(nested, 2, links))
    return "\n".join(lines)


def config_pages(
    sources: list[tuple[Path, str]] | None = None, include: Callable[[type], bool] = is_roll_schema
) -> dict[str, str]:
    """Every page of the configuration reference (see the module docstring)."""
    groups = collect_groups(sources, include)
    root = root_schema()
    root_fields = describe_schema(root)
    pages: dict[str, str] = {}
    # Where each typed node is documented, for the links of the tables.
    links: dict[type, str] = {}
    node_keys: dict[str, type] = {}
    for f in root_fields:
        # The root types a group by a shared base (TrainEngineConfig): its page documents the base first.
        if f.name in groups and f.nested is not None and f.nested not in groups[f.name].schemas.values():
            groups[f.name].schemas = {BASE: f.nested, **groups[f.name].schemas}
    for f in root_fields:
        if f.nested is not None and f.name not in groups:
            node_keys[f.name] = f.nested
            for nested in _nested(f.nested, set()):
                links.setdefault(nested, f"{slug(f.name)}.md#{_anchor(nested)}")
    for group in groups.values():
        for cls in group.schemas.values():
            for nested in _nested(cls, set()):
                links.setdefault(nested, f"{slug(group.name)}.md#{_anchor(nested)}")
    # A dataclass of roll_core.config that neither a group nor the root reaches still gets documented.
    orphans = [c for c in module_dataclasses() if c not in links and c is not root and include(c)]

    root_keys = {f.name for f in root_fields}
    # Pages link each other relative to their folder (all in reference/config/).
    for group in groups.values():
        key = group.name if group.name in root_keys else None
        pages[_page_of_group(group.name)] = group_page(group, key, _relative(links, slug(group.name)))
    for key, cls in node_keys.items():
        pages[f"{PAGE_DIR}/{slug(key)}.md"] = node_page(key, cls, _relative(links, slug(key)))
    if orphans:
        body = ["# Other typed nodes", "", "Dataclasses of `roll_core.config` that sit inside the nodes above.\n"]
        body += [schema_section(c, 2, _relative(links, "other")) for c in orphans]
        pages[f"{PAGE_DIR}/other.md"] = "\n".join(body)
    pages[f"{PAGE_DIR}/index.md"] = index_page(root, root_fields, groups, node_keys, bool(orphans))
    return pages


def _relative(links: dict[type, str], page: str) -> dict[type, str]:
    """Links from `page`: an anchor alone for a node on the same page."""
    own = f"{page}.md#"
    return {cls: target.removeprefix(own[:-1]) if target.startswith(own) else target for cls, target in links.items()}


def index_page(
    root: type, root_fields: list, groups: dict[str, Group], node_keys: dict[str, type], orphans: bool
) -> str:
    """The entry page: the root's keys, each linked to its page, and every group."""
    primary = ROOT / "packages" / "roll-core" / "src" / "roll_core" / "conf" / "rlvr.yaml"
    lines = ["# Configuration reference", ""]
    lines.append(
        "Generated from the code at build time: the schemas' dataclasses (`roll_core.config` and the engine and "
        "environment packages' `roll.configs` entry points) and the YAML of every config group. Every option of "
        "a run is one of these keys; an unknown key is an error at composition.\n"
    )
    if primary.is_file():
        lines.append(f"The primary config, `rlvr.yaml`: {inline(yaml_summary(primary))}\n")
    lines += ["## The root", ""]
    rows = []
    for f in root_fields:
        if f.name in groups:
            target, kind = f"[`{f.name}`]({slug(f.name)}.md)", "group"
        elif f.name in node_keys:
            target, kind = f"[`{f.name}`]({slug(f.name)}.md)", "node"
        else:
            target, kind = code(f.name), "key"
        doc = f.doc or HYDRA_KEYS.get(f.name, "") or (_first_line(f.nested) if f.nested else "")
        doc = doc or (f"An option of the `{f.name}` group." if f.name in groups else "")
        default = "its defaults" if f.nested is not None else code(f.default)
        rows.append([target, kind, default, cell(doc) or "&nbsp;"])
    lines.append(table(["Key", "Kind", "Default", "Description"], rows))
    lines += ["## Groups", ""]
    rows = [
        [f"[`{g.name}`]({slug(g.name)}.md)", ", ".join(code(o) for o in g.options) or "&nbsp;"] for g in groups.values()
    ]
    lines.append(table(["Group", "Options"], rows))
    if orphans:
        lines.append("Nested dataclasses that are not reached from the root: [other typed nodes](other.md).\n")
    return "\n".join(lines)
