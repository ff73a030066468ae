"""The documentation's code runs, so the docs cannot drift from the code.

Every ```python block of ``.docs/pages/*.md``, and of README.md's Quick start,
runs: the blocks of one page in order, as one script, in a fresh interpreter
(``run`` from tests/test_examples.py). A page whose code does not set up its own
devices gets ``reprules.testing.fake_cpu_devices(8)`` first. Markers, as HTML
comments (invisible on the site and on GitHub):

* ``<!-- requires: jax >= 0.6 (why) -->`` anywhere in a page: the page is
  skipped, with that reason, on older JAX (its JAX feature does not exist there);
* ``<!-- not run: why -->`` on the line before a block: that block is not run;
* ``<!-- output -->`` on the line before a ```text block: the lines printed by
  the python block before it, exactly (``{V:data}`` and JAX 0.7's ``{data}``
  compare equal).

The site itself is built by ``python -m nox -s docs`` (``mkdocs build --strict``).
"""

import os
import pathlib
import re

import pytest

from helpers import JAX_VERSION
from test_examples import run

ROOT = pathlib.Path(__file__).parent.parent
PAGES = sorted((ROOT / ".docs" / "pages").rglob("*.md"))
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
REQUIRES = re.compile(r"<!-- requires: jax >= (\d+)\.(\d+) \((.+?)\) -->")
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->\s*\Z")
MARK = "@@reprules-docs-block@@"


def blocks(text):
    """[(python source, expected output lines or None, line number)] of a Markdown text."""
    found = []
    for m in FENCE.finditer(text):
        lang, body, before = m.group(1), m.group(2), text[:m.start()]
        line = before.count("\n") + 1
        if lang == "python":
            if NOT_RUN.search(before):
                continue
            found.append([body, None, line])
        elif lang == "text" and before.rstrip().endswith("<!-- output -->"):
            assert found and found[-1][1] is None, f"line {line}: an output block must follow a python block"
            found[-1][1] = body.splitlines()
    return found


def readme_quick_start():
    text = (ROOT / "README.md").read_text()
    start = text.index("## Quick start\n")
    return text[start:text.index("\n## ", start + 1)]


def sources():
    yield "README.md#quick-start", readme_quick_start()
    for page in PAGES:
        yield str(page.relative_to(ROOT)), page.read_text()


def script(found):
    code = [] if any("fake_cpu_devices(" in body for body, _, _ in found) else [
        "from reprules import testing as _t\n_t.fake_cpu_devices(8)\n"]
    for i, (body, _, line) in enumerate(found):
        code.append(f"# --- block {i}, line {line}\n{body}print({MARK!r})\n")
    return "\n".join(code)


def normalize(line):
    return line.replace("{V:", "{").rstrip()


SOURCES = {name: text for name, text in sources() if blocks(text)}  # pages with code to run


# One JAX per regime runs the pages (a fresh interpreter per page costs 1-2 min
# per version); REPRULES_DOCS_EVERY_JAX=1 runs them on any version.
DOCS_JAX = {(0, 4, 28), (0, 6, 2), (0, 12, 0)}


@pytest.mark.parametrize("name", list(SOURCES))
def test_page_code_runs(name, tmp_path):
    if tuple(JAX_VERSION[:3]) not in DOCS_JAX and not os.environ.get("REPRULES_DOCS_EVERY_JAX"):
        pytest.skip(f"the docs' code runs on JAX 0.4.28, 0.6.2 and 0.12.0.x (one per regime); this is "
                    f"JAX {'.'.join(map(str, JAX_VERSION))} (set REPRULES_DOCS_EVERY_JAX=1 to run it here)")
    text = SOURCES[name]
    required = REQUIRES.search(text)
    if required and JAX_VERSION[:2] < (int(required.group(1)), int(required.group(2))):
        pytest.skip(f"{name} needs JAX >= {required.group(1)}.{required.group(2)} ({required.group(3)}); "
                    f"this is JAX {'.'.join(map(str, JAX_VERSION))}")
    found = blocks(text)
    path = tmp_path / "page.py"
    path.write_text(script(found))
    outputs = run([path]).split(MARK + "\n")
    assert len(outputs) == len(found) + 1, outputs
    for (body, expected, line), printed in zip(found, outputs):
        if expected is not None:
            assert [normalize(x) for x in printed.splitlines()] == [normalize(x) for x in expected], (
                f"{name}, block at line {line}: printed\n{printed}\nexpected\n" + "\n".join(expected))


def test_getting_started_is_the_quick_start():
    """The getting-started page runs the README's Quick start, unchanged."""
    readme = [body for body, _, _ in blocks(readme_quick_start())]
    page = [body for body, _, _ in blocks((ROOT / ".docs" / "pages" / "getting-started.md").read_text())]
    assert readme and page[0] == readme[0]


def test_every_page_is_in_the_nav():
    config = (ROOT / ".docs" / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(ROOT / ".docs" / "pages")) for p in PAGES}
    assert pages == set(re.findall(r":\s*([\w/.-]+\.md)\s*$", config, re.M))


def test_why_not_annotate_is_the_readmes():
    """The JAX-compatibility page carries README's "Why not annotate `out_shape` yourself", unchanged."""
    def section(text):
        start = text.index("## Why not annotate `out_shape` yourself\n")
        end = text.find("\n## ", start + 1)
        return text[start:end if end != -1 else None].strip()

    page = (ROOT / ".docs" / "pages" / "jax-compatibility.md").read_text()
    assert section(page) == section((ROOT / "README.md").read_text())
