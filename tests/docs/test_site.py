"""The documentation site builds with `mkdocs build --strict` and every page renders in headless Chromium.

One build and one browser for all pages (tools/docs_gen/site_check.py says what is checked: page status, internal
links and anchors, images, empty content, JavaScript errors, math, requests leaving the site). A second check runs
the same checker over a copy of the site broken on purpose, so a checker that reports nothing is caught too.
Under `nox -s tests` (which installs Debian's Chromium as root) a missing browser fails; elsewhere it skips.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from docs_gen.site_check import check_site  # noqa: E402

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not os.path.exists(CHROMIUM):
        message = f"{CHROMIUM} is missing (`apt-get install --no-install-recommends chromium`; nox -s tests does it)"
        if os.environ.get("ROLL_TEST_SESSION") == "tests":
            pytest.fail(message)
        pytest.skip(message)
    out = tmp_path_factory.mktemp("site")
    start = time.monotonic()
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stderr[-4000:]}"
    print(f"mkdocs build: {time.monotonic() - start:.1f} s")
    return out


def test_every_page_renders(site: Path) -> None:
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html"))
    # The layout's pages and the generated reference are all there (the nav lists each).
    for page in ("index.html", "reference/algorithms.html", "reference/plugins.html", "reference/config/algo.html"):
        assert page in pages
    assert len(pages) >= 30, pages
    algorithms = (site / "reference" / "algorithms.html").read_text()
    assert algorithms.count('class="arithmatex"') >= 10  # the math reached the page as math, not as text
    assert (site / "assets" / "katex" / "katex.min.js").is_file()
    start = time.monotonic()
    problems = check_site(site, CHROMIUM)
    print(f"rendered {len(pages)} pages in {time.monotonic() - start:.1f} s")
    assert problems == [], "\n".join(problems)


def test_checker_reports_what_is_broken(site: Path, tmp_path: Path) -> None:
    broken = tmp_path / "site"
    shutil.copytree(site, broken)
    index = broken / "index.html"
    html = index.read_text()
    html = html.replace(
        "</article>",
        '<p><a href="no-such-page.html">gone</a> <a href="reference/plugins.html#no-such-anchor">anchor</a>'
        '<img src="assets/no-such-image.png" alt="x"></p><script>notDefinedAnywhere();</script>'
        '<script src="https://cdn.example.com/katex.min.js"></script></article>',
        1,
    )
    index.write_text(html)
    algorithms = broken / "reference" / "algorithms.html"
    text = algorithms.read_text()
    assert '<span class="arithmatex">\\(' in text
    algorithms.write_text(text.replace('<span class="arithmatex">\\(', '<span class="arithmatex">\\(\\frac{', 1))
    sft = broken / "recipes" / "post-training.html"
    page = sft.read_text()
    start, end = page.index("<article"), page.index("</article>")
    sft.write_text(page[:start] + '<article class="md-content__inner md-typeset"><h1>Empty</h1>' + page[end:])

    problems = check_site(
        broken, CHROMIUM, pages=["index.html", "reference/algorithms.html", "recipes/post-training.html"]
    )
    report = "\n".join(problems)
    assert "broken link" in report and "no-such-page.html" in report, report
    assert "no #no-such-anchor" in report, report
    assert "image did not load" in report and "no-such-image.png" in report, report
    assert "notDefinedAnywhere" in report, report
    assert "index.html: request outside the site: https://cdn.example.com/katex.min.js" in report, report
    assert "reference/algorithms.html: math did not render" in report, report
    assert "recipes/post-training.html: the main content is empty" in report, report
