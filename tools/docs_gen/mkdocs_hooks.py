"""mkdocs hooks (mkdocs.yml `hooks:`): add the generated reference pages and the vendored KaTeX to the build."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from docs_gen import generate_pages  # noqa: E402
from mkdocs.structure.files import File, Files  # noqa: E402

_PAGES: dict[str, str] = {}


def on_config(config):
    _PAGES.clear()
    _PAGES.update(generate_pages())
    return config


def on_files(files: Files, config) -> Files:
    for path, text in _PAGES.items():
        files.append(File.generated(config, path, content=text))
    return files
