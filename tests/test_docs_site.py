"""The documentation site, opened in a real headless Chromium 1280 px wide.

On every page nothing scrolls sideways: the document is no wider than the
window, no code block (``<pre>``) is wider than its box or scrolls inside it,
and no table scrolls inside its wrapper. No page shows a heading twice, and
the API page lists ``replication_rule``, ``rules``, ``inference`` and
``testing`` first.

The site is ``$REPRULES_DOCS_SITE`` where set (``python -m nox -s docs`` builds
``.docs/site/`` and then runs this file on it), else it is built here with
mkdocs into a temporary directory. The test skips, saying why, where mkdocs
(and its plugins) or Chromium is missing. The browser is driven as in
tests/test_audit_html.py.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from test_audit_html import browser  # noqa: F401 - the same headless Chromium, one per module

ROOT = pathlib.Path(__file__).parent.parent
WIDTH = 1280
DOCS_TOOLS = ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python", "material")

MEASURE = r"""
(() => {
  const root = document.documentElement;
  const text = e => e.innerText.replace(/\s+/g, ' ').replace(/¶/g, '').trim();
  const visible = e => e.getClientRects().length > 0;
  return {
    document: [root.scrollWidth, root.clientWidth],
    pres: [...document.querySelectorAll('pre')].filter(visible).map(pre => {
      const code = pre.querySelector('code') || pre;
      const widest = code.innerText.split('\n').reduce((a, b) => (b.length > a.length ? b : a), '');
      return {scroll: code.scrollWidth, client: code.clientWidth,
              width: pre.getBoundingClientRect().width,
              box: pre.parentElement.getBoundingClientRect().width, widest};
    }),
    tables: [...document.querySelectorAll('.md-typeset__scrollwrap')].filter(visible).map(wrap => ({
      scroll: wrap.scrollWidth, client: wrap.clientWidth,
      header: text(wrap.querySelector('tr') || wrap).slice(0, 80)})),
    headings: [...document.querySelectorAll('article h1, article h2, article h3, article h4')]
      .filter(visible).map(h => ({level: h.tagName, text: text(h)})),
  };
})()
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    given = os.environ.get("REPRULES_DOCS_SITE")
    if given:
        path = (ROOT / given).resolve()
        assert (path / "index.html").is_file(), f"REPRULES_DOCS_SITE={given}: no index.html there"
        return path
    missing = [name for name in DOCS_TOOLS if importlib.util.find_spec(name.split(".")[0]) is None]
    if missing:
        pytest.skip(f"the docs tools are not installed here ({', '.join(missing)}); "
                    "`python -m nox -s docs` builds the site and runs this test on it")
    path = tmp_path_factory.mktemp("docs_site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", ".docs/mkdocs.yml",
         "--site-dir", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return path


@pytest.fixture(scope="module")
def pages(site, browser):
    """{page path: what it measures} for every page of the site, at 1280 px."""
    found = {}
    for page in sorted(site.rglob("*.html")):
        name = str(page.relative_to(site))
        if name == "404.html" or name.startswith("search"):
            continue
        browser.open(page.resolve().as_uri(), width=WIDTH)
        found[name] = browser.evaluate(MEASURE)
    return found


def test_every_page_was_measured(pages):
    guide = {p.with_suffix(".html").name for p in (ROOT / ".docs" / "pages").glob("*.md")}
    assert guide <= set(pages) and {"api/reprules.html", "api/rules.html", "api/testing.html"} <= set(pages)


def test_nothing_scrolls_sideways(pages):
    wide = {}
    for name, seen in pages.items():
        scroll, client = seen["document"]
        problems = [f"the page is {scroll} px wide in a {client} px window"] if scroll > client else []
        problems += [f"code block scrolls ({pre['scroll']} px in {pre['client']} px): {pre['widest']!r}"
                     for pre in seen["pres"] if pre["scroll"] > pre["client"]]
        problems += [f"code block {pre['width']:.0f} px wide in a {pre['box']:.0f} px box"
                     for pre in seen["pres"] if pre["width"] > pre["box"] + 0.5]
        problems += [f"table scrolls ({t['scroll']} px in {t['client']} px): {t['header']!r}"
                     for t in seen["tables"] if t["scroll"] > t["client"]]
        if problems:
            wide[name] = problems
    assert not wide, wide


def test_no_heading_twice(pages):
    for name, seen in pages.items():
        texts = [h["text"] for h in seen["headings"]]
        assert len(texts) == len(set(texts)), (name, texts)


def test_api_page_starts_with_the_essentials(pages):
    headings = pages["api/reprules.html"]["headings"]
    assert [h["text"] for h in headings if h["level"] == "H1"] == ["reprules"]
    first = [h["text"] for h in headings if h["level"] == "H2"][:4]
    assert [t.split("(")[0] for t in first] == [
        "reprules.replication_rule", "reprules.rules", "reprules.inference", "reprules.testing"], first
