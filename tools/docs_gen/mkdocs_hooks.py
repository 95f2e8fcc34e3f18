"""mkdocs hooks (mkdocs.yml `hooks:`): the generated reference pages and the vendored KaTeX join the build.

on_config generates the pages (docs_gen.generate_pages) and lists the configuration pages in the nav under the
entry that points at `reference/config/index.md`; on_files adds the pages as virtual files and KaTeX's files under
`assets/katex/`. A generated page that a committed file already occupies is an error: docs/reference/ holds
nothing hand-written.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

from docs_gen import generate_pages
from docs_gen.katex import ASSETS, KatexUnavailable, katex_dist

CONFIG_INDEX = "reference/config/index.md"
_PAGES: dict[str, str] = {}


def _expand_nav(nav: list, pages: list[str]) -> bool:
    """Replace the nav entry `X: reference/config/index.md` with a section of every configuration page."""
    for i, item in enumerate(nav):
        if isinstance(item, dict):
            ((title, value),) = item.items()
            if value == CONFIG_INDEX:
                rest = [{Path(p).stem.replace("-", "/"): p} for p in pages if p != CONFIG_INDEX]
                nav[i] = {title: [{"Overview": CONFIG_INDEX}, *rest]}
                return True
            if isinstance(value, list) and _expand_nav(value, pages):
                return True
    return False


def on_config(config):
    _PAGES.clear()
    try:
        _PAGES.update(generate_pages())
    except KatexUnavailable as exc:  # one line saying what to install, not a traceback
        raise PluginError(str(exc)) from None
    if config.nav:
        _expand_nav(config.nav, sorted(p for p in _PAGES if p.startswith("reference/config/")))
    return config


def on_files(files: Files, config) -> Files:
    for path, text in _PAGES.items():
        if files.get_file_from_path(path) is not None:
            raise PluginError(f"docs/{path} is generated at build time: delete the committed file")
        files.append(File.generated(config, path, content=text))
    try:
        dist = katex_dist()
    except KatexUnavailable as exc:
        raise PluginError(str(exc)) from None
    for asset in ASSETS:
        source = dist / asset
        for item in sorted(source.rglob("*")) if source.is_dir() else [source]:
            if item.is_file():
                rel = item.relative_to(dist).as_posix()
                files.append(File.generated(config, f"assets/katex/{rel}", abs_src_path=str(item)))
    return files
