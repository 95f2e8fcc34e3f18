"""KaTeX for the site, vendored from its npm package: the math renders with no network at view time.

Contract: `katex_dist()` returns the `dist/` folder of KaTeX `KATEX_VERSION`, fetched once with `npm pack` into
`.docs-cache/` (or taken from `$ROLL_DOCS_KATEX_DIST`, an unpacked `dist/` folder, for machines without npm), its
tarball checked against the pinned integrity hash. `ASSETS` names the files the site serves from it (under
`assets/katex/`). `check_tex(formulas)` renders every formula with that KaTeX under Node.js and returns the error
of each (None when it renders): the generator keeps a formula only if KaTeX accepts it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

KATEX_VERSION = "0.19.1"
# npm's `dist.integrity` of katex@0.19.1: the tarball is checked against it before it is unpacked.
KATEX_INTEGRITY = "sha512-jG8uKntjSEcm2EpQOh0XturpPuuC9r3Sq5HLHdsFdWZT27E672SF19QEi+of0/YeOy15lDgRhKvr5614uRrEfA=="
CACHE = Path(__file__).resolve().parents[2] / ".docs-cache"
# What the pages load (mkdocs.yml extra_javascript / extra_css) and the fonts the stylesheet names.
ASSETS = ("katex.min.js", "katex.min.css", "contrib/auto-render.min.js", "fonts")


class KatexUnavailable(RuntimeError):
    """KaTeX could not be fetched or run; the message says what to install or set."""


def _integrity(path: Path) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(path.read_bytes()).digest()).decode()


def katex_dist() -> Path:
    """The unpacked KaTeX `dist/` folder (see the module docstring).

    Raises:
        KatexUnavailable: neither `$ROLL_DOCS_KATEX_DIST` nor npm is available, or the tarball's hash is wrong.
    """
    env = os.environ.get("ROLL_DOCS_KATEX_DIST")
    if env:
        dist = Path(env)
        if not (dist / "katex.min.js").is_file():
            raise KatexUnavailable(f"ROLL_DOCS_KATEX_DIST={env} has no katex.min.js: point it at KaTeX's dist/ folder")
        return dist
    dist = CACHE / f"katex-{KATEX_VERSION}" / "package" / "dist"
    if (dist / "katex.min.js").is_file():
        return dist
    npm = shutil.which("npm")
    if npm is None:
        raise KatexUnavailable(
            "the docs vendor KaTeX from its npm package and npm is not installed: install Node.js and npm, or set "
            "ROLL_DOCS_KATEX_DIST to an unpacked katex dist/ folder"
        )
    CACHE.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        out = subprocess.run(
            [npm, "pack", f"katex@{KATEX_VERSION}", "--pack-destination", tmp, "--silent"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        tarballs = list(Path(tmp).glob("katex-*.tgz"))
        if out.returncode != 0 or not tarballs:
            raise KatexUnavailable(f"npm pack katex@{KATEX_VERSION} failed: {out.stderr.strip()[-500:]}")
        got = _integrity(tarballs[0])
        if got != KATEX_INTEGRITY:
            raise KatexUnavailable(f"katex@{KATEX_VERSION} tarball integrity {got} != pinned {KATEX_INTEGRITY}")
        unpacked = Path(tmp) / "unpacked"
        with tarfile.open(tarballs[0]) as tar:
            tar.extractall(unpacked, filter="data")
        target = CACHE / f"katex-{KATEX_VERSION}"
        shutil.rmtree(target, ignore_errors=True)
        unpacked.rename(target)  # atomic: a half-unpacked folder is never taken for a complete one
    return dist


_CHECK_SCRIPT = """
const katex = require(process.argv[1]);
const formulas = JSON.parse(require("fs").readFileSync(0, "utf8"));
const out = formulas.map((f) => {
  try { katex.renderToString(f, { throwOnError: true }); return null; } catch (e) { return String(e.message); }
});
process.stdout.write(JSON.stringify(out));
"""


def check_tex(formulas: list[str]) -> list[str | None]:
    """KaTeX's error for each formula, None where it renders (one Node.js process for all of them).

    Raises:
        KatexUnavailable: Node.js is not installed or the check did not run.
    """
    if not formulas:
        return []
    node = shutil.which("node")
    if node is None:
        raise KatexUnavailable("checking the docs' math needs Node.js (`node`): install it (the npm package does)")
    script = str(katex_dist() / "katex.js")
    out = subprocess.run(
        [node, "-e", _CHECK_SCRIPT, script], input=json.dumps(formulas), capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        raise KatexUnavailable(f"the KaTeX check failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)
