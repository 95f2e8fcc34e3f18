"""Three kinds of claim the documentation makes are true of the code, not only well-formed.

Read: README.md, docs/**/*.md (the generated reference excluded) and, for extras, packages/*/README.md and the
string literals of roll's sources (install hints in messages). Checked:

- a metric name in a code span (`actor/grad_norm`, `domain/<d>/accuracy`, `perf/time_*`) is one roll logs: the
  name occurs in roll's sources (`<d>` matching an f-string field or any name, `*` any suffix), or its last part is a
  string literal there (keys built from parts: `f"perf/time_{k}"` with timer `"attention_credit"`, `episode/end_`
  plus the failure kind `"env_error"`), or a word of the page's own code blocks (a counter its example reward
  returns). A renamed or invented metric fails, naming the page and line;
- an extra (`pip install 'roll-engines[megatron]'`, `roll-core[all]`) is one that package's pyproject declares;
- a default stated next to a key (`pipeline.max_empty_steps` (5), `cluster.max_concurrent` (default 1),
  `cluster.placement=colocated` (the default)) is the value the composed config has: the default composition, or,
  for a key only some options have, every option of its group that has it (a number stated for a key whose options
  disagree, or that no option has, is not checked).

tests/docs/test_doc_keys.py checks that the keys exist; this checks what the prose says about them.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_doc_keys as keys  # the composition and the groups' options (one Hydra setup per test, shared)

ROOT = keys.ROOT
_hydra_per_test = keys._hydra_per_test  # the autouse fixture: Hydra initialised per test, cleared after

pytestmark = pytest.mark.filterwarnings("ignore:The pynvml package is deprecated:FutureWarning")

PAGES = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").rglob("*.md")) if "reference" not in p.parts)]

# ---- metric names ---------------------------------------------------------------------------------------------
PREFIXES = "actor|critic|critic_<m>|reward|eval|data|async|faults|tracking|distill|episode|env|agent|perf|domain"
PREFIXES += "|reward_model|difficulty|sync|response|dpo|sft|rollout"
METRIC = re.compile(rf"`((?:{PREFIXES})/[\w<>*/.-]*[\w>*])`")
FENCED = re.compile(r"```[^\n]*\n(.*?)```", re.S)
# A literal's text between quotes (or an f-string field and a quote): the parts a key can be built from.
LITERAL = re.compile(r"""["'}/]([A-Za-z_][\w/]*)["'{]""")


@functools.cache
def source_text() -> str:
    """Every Python source of roll's packages, concatenated."""
    return "\n".join(p.read_text() for p in sorted(ROOT.glob("packages/*/src/**/*.py")))


@functools.cache
def source_literals() -> frozenset[str]:
    """The words roll's sources quote (see LITERAL)."""
    return frozenset(LITERAL.findall(source_text()))


def _name_pattern(name: str) -> re.Pattern[str]:
    """`name` as a pattern over sources: `<x>` an f-string field or a name, `*` any word suffix."""
    parts = re.split(r"(<[^<>]*>|\*)", name)
    rx = "".join(
        r"(?:\{[^}]*\}|[\w.-]+|%s)" if p.startswith("<") else r"\w*" if p == "*" else re.escape(p) for p in parts
    )
    return re.compile(rx)


def metric_is_logged(name: str, page_code: str) -> bool:
    """Whether the metric `name` a page names is one roll logs (module docstring)."""
    if _name_pattern(name).search(source_text()):
        return True
    named = [s for s in name.split("/") if s and not s.startswith("<")]
    leaf = named[-1].rstrip("*").rstrip("_") if named else ""
    if not leaf:
        return False
    if {leaf, leaf.split("_", 1)[-1]} & source_literals():
        return True
    return re.search(rf"\b{re.escape(leaf)}\b", page_code) is not None


def metric_problems(text: str, where: str) -> list[str]:
    """`where:line: name` of each metric `text` names that roll does not log."""
    code = "\n".join(FENCED.findall(text))
    return [
        f"{where}:{n}: `{m.group(1)}` is not a metric roll logs"
        for n, line in enumerate(text.splitlines(), 1)
        for m in METRIC.finditer(line)
        if not metric_is_logged(m.group(1), code)
    ]


# ---- extras ---------------------------------------------------------------------------------------------------
EXTRA = re.compile(r"\b(roll-(?:hw|algos|core|engines|envs))\[([\w,-]+)\]")


@functools.cache
def declared_extras() -> dict[str, frozenset[str]]:
    """Package name -> the extras its pyproject declares."""
    out = {}
    for path in ROOT.glob("packages/*/pyproject.toml"):
        project = tomllib.loads(path.read_text())["project"]
        out[project["name"]] = frozenset(project.get("optional-dependencies", {}))
    return out


def extra_problems(text: str, where: str) -> list[str]:
    """`where:line: ...` of each `roll-<pkg>[extra]` in `text` that the package does not declare."""
    problems = []
    for n, line in enumerate(text.splitlines(), 1):
        for pkg, names in EXTRA.findall(line):
            missing = sorted(set(names.split(",")) - declared_extras().get(pkg, frozenset()))
            if missing:
                problems.append(f"{where}:{n}: {pkg}[{names}]: {pkg} has no extra {', '.join(missing)}")
    return problems


# ---- stated defaults ------------------------------------------------------------------------------------------
_KEY = r"`((?:pipeline|algo|model|infer_engine|train_engine|cluster|env|tracking|data|reward_model)(?:\.\w+)+)"
_VALUE = r"`?([-\w.\[\],]+?)`?"
#: (pattern, whether any value is a claim; else only a number is: `key` (30 s per row) states the default, but
#: `key` (rows per forward) does not).
DEFAULT_CLAIMS = [
    (re.compile(_KEY + r"` \(default " + _VALUE + r"(?=[ ;,)])"), True),
    (re.compile(_KEY + r"=([^`]+)` \(the default\)"), True),
    (re.compile(_KEY + r"` \(" + r"(-?\d[\d.e-]*)" + r"(?=[ ;,)])"), False),
]


@functools.cache
def composed_values(overrides: tuple[str, ...]) -> dict[str, Any] | None:
    """Every leaf of the config composed with `overrides` -> its value (None: it does not compose)."""
    from hydra import compose
    from omegaconf import OmegaConf

    keys.composed(overrides)  # initialises Hydra as the key check does
    try:
        cfg = compose(config_name="rlvr", overrides=list(overrides))
    except Exception:
        return None
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for k in node.keys():
            path = f"{prefix}.{k}" if prefix else str(k)
            try:
                value = node[k]
            except Exception:  # an interpolation this composition cannot resolve
                continue
            if OmegaConf.is_dict(value):
                walk(value, path)
            else:
                flat[path] = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value

    walk(cfg, "")
    return flat


def default_of(key: str) -> tuple[bool, Any]:
    """(known, value): the default of `key` (module docstring); unknown when its group's options disagree."""
    base = composed_values(())
    if base is not None and key in base:
        return True, base[key]
    group = keys.KEY_GROUP.get(key.split(".")[0])
    found = []
    for option in keys.options(group) if group else ():
        values = composed_values((f"{group}={option}",)) or {}
        if key in values:
            found.append(values[key])
    if found and all(f == found[0] for f in found):
        return True, found[0]
    return False, None


def _same(stated: str, value: Any) -> bool:
    """Whether the doc's `stated` spells `value` (600 is 600.0, true is True, [a,b] is ['a', 'b'])."""
    if isinstance(value, bool):
        return stated.lower() == str(value).lower()
    if isinstance(value, (int, float)):
        try:
            return float(stated) == float(value)
        except ValueError:
            return False
    if isinstance(value, list):
        return [s.strip() for s in stated.strip("[]").split(",") if s.strip()] == [str(v) for v in value]
    return stated == str(value)


def default_problems(text: str, where: str) -> list[str]:
    """`where:line: ...` of each default `text` states (DEFAULT_CLAIMS) that the composed config does not have."""
    problems = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern, any_value in DEFAULT_CLAIMS:
            for key, stated in pattern.findall(line):
                if not any_value and not re.fullmatch(r"-?\d[\d.e-]*", stated):
                    continue
                known, value = default_of(key)
                if known and not _same(stated.rstrip("."), value):
                    problems.append(f"{where}:{n}: `{key}` stated default {stated}, composed default {value!r}")
    return problems


# ---- the tests ------------------------------------------------------------------------------------------------
def _where(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_where)
def test_doc_metric_names_are_logged(page: Path) -> None:
    """Every metric a page names is one roll logs."""
    assert metric_problems(page.read_text(), _where(page)) == []


def test_doc_and_message_extras_exist() -> None:
    """Every `roll-<pkg>[extra]` of the pages, the package READMEs and roll's sources is declared."""
    texts = [*PAGES, *sorted(ROOT.glob("packages/*/README.md")), *sorted(ROOT.glob("packages/*/src/**/*.py"))]
    problems = [p for path in texts for p in extra_problems(path.read_text(), _where(path))]
    assert problems == []


def test_stated_defaults_are_the_defaults() -> None:
    """Every default a page states next to a key is the composed config's."""
    problems = [p for page in PAGES for p in default_problems(page.read_text(), _where(page))]
    assert problems == []
    stated = sum(len(pat.findall(page.read_text())) for page in PAGES for pat, _ in DEFAULT_CLAIMS)
    assert stated >= 20, "the patterns find the pages' stated defaults (a broken one would pass everything)"


def test_the_checks_find_planted_false_claims() -> None:
    """A renamed metric, a missing extra and a wrong default are each reported; their true forms are not."""
    good = "`actor/grad_norm`, `perf/time_attention_credit`, `domain/<d>/accuracy`, `episode/end_env_error`"
    assert metric_problems(good, "p") == []
    bad = "logged as `actor/grad_normz` and `episode/end_nonsense_reason`"
    assert len(metric_problems(bad, "p")) == 2
    assert extra_problems("pip install 'roll-engines[megatron,lora]' roll-core[all]", "p") == []
    assert extra_problems("pip install 'roll-engines[megatrn]'", "p") == [
        "p:1: roll-engines[megatrn]: roll-engines has no extra megatrn"
    ]
    right = "`pipeline.max_empty_steps` (5) and `cluster.max_concurrent` (default 1), `cluster.placement=colocated` "
    right += "(the default), `train_engine.micro_batch_size` (rows per forward)"
    assert default_problems(right, "p") == []
    wrong = "`pipeline.max_empty_steps` (7) and `cluster.max_concurrent` (default 2), "
    wrong += "`cluster.placement=disaggregated` (the default)"
    assert len(default_problems(wrong, "p")) == 3
