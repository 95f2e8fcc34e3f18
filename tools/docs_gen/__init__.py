"""roll's documentation generator: the reference pages of the site, produced from the code at build time.

mkdocs runs `mkdocs_hooks.py` (mkdocs.yml `hooks:`), which asks `generate_pages()` for every generated page (path
under docs/ -> markdown) and adds them to the build as virtual files: nothing generated is ever written into docs/.
`python tools/docs_gen -o DIR` writes the same pages into DIR for inspection.
"""

from __future__ import annotations

GENERATED_ROOT = "reference"


def generate_pages() -> dict[str, str]:
    """Every generated page: its path relative to docs/ -> its markdown."""
    return {
        "reference/config/index.md": "# Configuration reference\n\nGenerated at build time.\n",
        "reference/algorithms.md": "# Algorithms\n\nGenerated at build time.\n",
        "reference/plugins.md": "# Plugins\n\nGenerated at build time.\n",
    }
