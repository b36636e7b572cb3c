"""The docs site as a person sees it at 1280 px in headless Chromium: no page wider than the window, no block whose
content is cut off or spills out without a scrollbar, no image that does not load. (bench's and tune's HTML
reports get the same look in tests/integration/test_bench.py and test_tune.py, on reports of real runs.)
Chromium comes from tests/tools/install_chromium.sh; without it these are skipped, saying so."""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading

import pytest

from tests.support import ROOT
from tests.support.browser import assert_all_show_whole, assert_shows_whole


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A folder served over HTTP on 127.0.0.1 (as a reader's `mkdocs serve` or a web server would): its URL."""
    root = tmp_path_factory.mktemp("served")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def site(served):
    root, url = served
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--site-dir", str(root / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    return root / "site", f"{url}/site"


def docs_pages() -> list[str]:
    """Every page of the site, by its path (the nav's pages and the generated reference)."""
    import yaml

    class Loader(yaml.SafeLoader):  # mkdocs.yml names a Python function (the Mermaid fence): read it as text
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)

    def walk(entries):
        for entry in entries:
            for value in entry.values():
                yield from walk(value) if isinstance(value, list) else [value]

    return [page.removesuffix(".md").removesuffix("index") + ("/" if not page.endswith("index.md") else "")
            for page in walk(config["nav"])]  # fmt: skip


def test_every_docs_page_shows_whole_at_1280_px(site):
    _, url = site
    pages = {page.strip("/").replace("/", "-") or "index": f"{url}/{page}" for page in docs_pages()}
    assert len(pages) > 20
    assert_all_show_whole(pages, root="article.md-content__inner")


def test_the_look_finds_what_a_person_would_miss(served):
    root, url = served
    (root / "bad.html").write_text(
        '<!DOCTYPE html><html><body style="margin:0">'
        '<div style="width:200px;overflow:hidden"><span style="white-space:nowrap">' + "cut " * 80 + "</span></div>"
        '<p style="width:200px"><code style="white-space:nowrap">' + "spills" * 40 + "</code></p>"
        '<div style="width:3000px">wider than the window</div>'
        '<div style="width:200px;overflow-x:auto"><span style="white-space:nowrap">' + "scrolls " * 80 + "</span>"
        '</div><div style="width:300px;overflow-x:auto"><table><tr><th><code style="white-space:nowrap">'
        + "a long message "
        * 30
        + "</code></th><th>hidden column</th></tr></table></div>"
        '<img src="missing.png" alt="missing"></body></html>'
    )
    with pytest.raises(AssertionError) as seen:
        assert_shows_whole(f"{url}/bad.html")
    said = str(seen.value)
    assert "the page is 3000px wide" in said and "of its content cut off" in said and "spills" in said
    assert "the image missing.png did not load" in said and '"scrolls' not in said  # a scrollbar reaches it
    assert 'the table column "hidden column" starts out of sight' in said
