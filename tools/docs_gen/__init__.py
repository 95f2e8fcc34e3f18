"""roll's documentation generator: the reference pages of the site, produced from the code at build time.

mkdocs runs `mkdocs_hooks.py` (mkdocs.yml `hooks:`), which asks `generate_pages()` for every generated page (path
under docs/ -> markdown) and adds them to the build as virtual files, with the KaTeX assets (docs_gen.katex):
nothing generated is ever written into docs/. `python tools/docs_gen -o DIR` writes the same pages into DIR for
inspection. Pages: the configuration reference (config_ref: one page per group and per typed node of the root),
the algorithms (algos_ref: roll-algos' docstrings with their math) and the plugins (plugins_ref: entry-point
groups and what roll registers).
"""

from __future__ import annotations

GENERATED_ROOT = "reference"


def generate_pages() -> dict[str, str]:
    """Every generated page: its path relative to docs/ -> its markdown."""
    from docs_gen.algos_ref import algorithms_page
    from docs_gen.config_ref import config_pages
    from docs_gen.plugins_ref import plugins_page

    pages = config_pages()
    pages["reference/algorithms.md"] = algorithms_page()
    pages["reference/plugins.md"] = plugins_page()
    return pages
