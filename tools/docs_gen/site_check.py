"""Render every page of a built site in headless Chromium and report what a reader would find broken.

Contract: `check_site(site_dir, chromium)` serves `site_dir` on 127.0.0.1 (a thread, stopped on return), opens
every HTML page in one browser (Debian's Chromium driven by Playwright; no browser is ever downloaded) and returns
one line per problem, [] when none:
- the page does not load (status other than 200);
- an internal link whose target answers other than 200, or whose `#anchor` is not an id on the target page;
- an image that did not load (`naturalWidth` 0 once the page has loaded);
- a main content (`article`) without text beyond its title;
- a JavaScript error (an uncaught exception or a console error, such as a failed resource load);
- math that did not render: an `.arithmatex` element without KaTeX's output or with a `.katex-error`, or KaTeX's
  fonts not loaded;
- any request to a host other than the local server (the site must work offline).
"""

from __future__ import annotations

import functools
import http.server
import re
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlparse

# Flags for a container without a user namespace sandbox or GPU, on a machine whose outside network is closed:
# the background services would otherwise fail DNS lookups and connections at every start.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    # Every host name but the local server fails to resolve inside the browser: a page that asks for a CDN is
    # reported (the `request` event) and nothing leaves the machine.
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]

# Run in each page once it has loaded: what the checks need, gathered in one round trip.
_PAGE_PROBE = """async () => {
  await document.fonts.ready;
  const article = document.querySelector("article");
  const title = article ? article.querySelector("h1") : null;
  const text = article ? article.innerText.trim() : "";
  const math = [...document.querySelectorAll(".arithmatex")];
  return {
    ids: [...document.querySelectorAll("[id]")].map((e) => e.id),
    links: [...document.querySelectorAll("a[href]")].map((a) => a.href),
    images: [...document.images].map((i) => ({ src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0 })),
    article: article !== null,
    body: title ? text.slice(title.innerText.trim().length).trim().length : text.length,
    math: math.length,
    unrendered: math.filter((m) => !m.querySelector(".katex") || m.querySelector(".katex-error"))
      .map((m) => m.textContent.slice(0, 80)),
    katexFont: math.length === 0 || document.fonts.check("16px KaTeX_Main"),
  };
}"""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # the checks report failures themselves
        pass


@contextmanager
def serve(directory: Path) -> Iterator[str]:
    """Serve `directory` on 127.0.0.1 (a free port) in a thread; yields the base URL; stops on exit."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _fetch(url: str) -> tuple[int, set[str]]:
    """Status of `url` and the ids its HTML declares (for the anchors of a page the browser did not open)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read().decode("utf-8", "replace")
            return response.status, set(re.findall(r"""\sid=["']([^"']+)["']""", body))
    except urllib.error.HTTPError as exc:
        return exc.code, set()


def pages_of(site_dir: Path) -> list[str]:
    """Every HTML page of the site, relative to it (the vendored assets hold none)."""
    return sorted(p.relative_to(site_dir).as_posix() for p in site_dir.rglob("*.html"))


def check_site(site_dir: Path, chromium: str = "/usr/bin/chromium", pages: list[str] | None = None) -> list[str]:
    """Problems found rendering every page of `site_dir` (or only `pages`, paths relative to it; links are followed
    from those) (see the module docstring); [] when none."""
    from playwright.sync_api import sync_playwright

    problems: list[str] = []
    page_ids: dict[str, set[str]] = {}
    links: dict[str, set[str]] = {}  # target URL (with fragment) -> pages linking to it
    with serve(site_dir) as base, sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
        host = urlparse(base).netloc
        context = pw.chromium.launch_persistent_context(
            profile, executable_path=chromium, headless=True, args=CHROMIUM_FLAGS
        )
        try:
            page = context.new_page()
            current = {"name": ""}
            page.on("pageerror", lambda exc: problems.append(f"{current['name']}: JavaScript error: {exc}"))

            def on_console(msg) -> None:
                if msg.type == "error":
                    problems.append(f"{current['name']}: console error: {msg.text} ({msg.location.get('url', '')})")

            page.on("console", on_console)

            def on_request(request) -> None:
                parsed = urlparse(request.url)
                if parsed.scheme in ("http", "https", "ws", "wss") and parsed.netloc != host:
                    problems.append(f"{current['name']}: request outside the site: {request.url}")

            page.on("request", on_request)
            for name in pages_of(site_dir) if pages is None else pages:
                current["name"] = name
                url = urljoin(base, name)
                response = page.goto(url, wait_until="load")
                if response is None or response.status != 200:
                    problems.append(f"{name}: status {response.status if response else 'none'}")
                    continue
                info = page.evaluate(_PAGE_PROBE)
                page_ids[url] = set(info["ids"])
                for link in info["links"]:
                    if urlparse(link).netloc == host:
                        links.setdefault(link, set()).add(name)
                for image in info["images"]:
                    if not image["ok"]:
                        problems.append(f"{name}: image did not load: {image['src']}")
                # The 404 page is a title alone by design.
                if name != "404.html" and (not info["article"] or info["body"] == 0):
                    problems.append(f"{name}: the main content is empty")
                for formula in info["unrendered"]:
                    problems.append(f"{name}: math did not render: {formula!r}")
                if not info["katexFont"]:
                    problems.append(f"{name}: KaTeX's fonts did not load")
        finally:
            context.close()
        for link, sources in sorted(links.items()):
            target, fragment = urldefrag(link)
            where = ", ".join(sorted(sources)[:3])
            if target not in page_ids:
                status, ids = _fetch(target)
                if status != 200:
                    problems.append(f"{where}: broken link {link} (status {status})")
                    continue
                page_ids[target] = ids
            if fragment and target in page_ids and fragment not in page_ids[target]:
                problems.append(f"{where}: link {link}: no #{fragment} on the target page")
    return problems
