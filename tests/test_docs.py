"""The documentation's code runs, so the docs cannot drift from the code.

Every ```python block of ``.docs/pages/*.md`` runs: the blocks of one page in
order, as one script, in a fresh interpreter (``run`` from
tests/test_examples.py). A page whose code does not set up its own devices
gets ``reprules.testing.fake_cpu_devices(8)`` first. Markers, as HTML comments
(invisible on the site and on GitHub):

* ``<!-- requires: jax >= 0.6 (why) -->`` anywhere in a page: the page is
  skipped, with that reason, on older JAX (its JAX feature does not exist there);
* ``<!-- not run: why -->`` on the line before a block: that block is not run;
* ``<!-- output -->`` on the line before a ```text block: the lines printed by
  the python block before it, exactly (``{V:data}`` and JAX 0.7's ``{data}``
  compare equal).

README.md's ```python blocks, in order, are one pytest file (its example, then
the pytest plugin's): it passes under pytest with the plugin, on every JAX the
tests run on. The README stays short (at most 200 lines, an example of at
most 15), its links point at files that exist, and its example and JAX table
are the site's.

The site itself is built by ``python -m nox -s docs`` (``mkdocs build --strict``),
which then runs tests/test_docs_site.py on it in a headless browser.
"""

import os
import pathlib
import re
import subprocess
import sys

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


README = ROOT / "README.md"


def sources():
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


def readme_python():
    """README.md's ```python blocks, in order (none is marked ``not run``)."""
    return [body for body, _, _ in blocks(README.read_text())]


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move details to .docs/pages/"
    example = readme_python()[0].splitlines()
    assert len(example) <= 15, f"README.md's example has {len(example)} lines"
    assert any("@reprules.replication_rule(" in line for line in example)
    assert any(line.startswith("def test_") for line in example)  # and a test using a fixture


def test_readme_runs_under_pytest(tmp_path):
    """README.md's python blocks, as one test file, pass under pytest and the plugin."""
    code = readme_python()
    tests = sum(body.count("\ndef test_") + body.startswith("def test_") for body in code)
    path = tmp_path / "test_readme.py"
    path.write_text("\n\n".join(code))
    # As a user runs it: in their own directory (not this repository's pytest settings).
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "--reprules-cpu-devices", "8", path.name],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert f"{tests} passed" in out and "skipped" not in out, out[-4000:]


def test_readme_example_skips_on_one_device_saying_how_to_get_more(tmp_path):
    """Issue 36: run without --reprules-cpu-devices, the README's test passed on a mesh of one
    device, where no all-reduce can occur. The fixtures skip it, saying how to get devices."""
    path = tmp_path / "test_copy.py"
    path.write_text(readme_python()[0])
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", path.name],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "1 skipped" in out and "passed" not in out, out[-4000:]
    assert re.search(r"no_all_reduce: \S+ runs on a mesh of 1 device \(model=1;.*run pytest with\s+"
                     r"--reprules-cpu-devices 8", " ".join(out.split())), out[-4000:]


def test_readme_example_is_the_sites():
    """The site's home page shows the README's example, unchanged."""
    index = (ROOT / ".docs" / "pages" / "index.md").read_text()
    page = [m.group(2) for m in FENCE.finditer(index) if m.group(1) == "python"]  # marked "not run"
    assert page == [readme_python()[0]]


def test_readme_links_resolve():
    """Every relative link of README.md points at a file of this repository."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert any(link.endswith("performance.md") for link in local)
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing
    for page in ("rules", "inference", "packs", "safety", "audit", "performance", "jax-compatibility"):
        assert f".docs/pages/{page}.md" in local, page


def compatibility_table(text):
    """The Markdown table whose header starts with ``| JAX | regime |``."""
    start = text.index("| JAX | regime |")
    end = text.find("\n\n", start)
    return text[start:end if end != -1 else None].strip()


def test_compatibility_table_is_the_sites():
    """README.md's JAX-compatibility table is the compatibility page's, unchanged."""
    page = (ROOT / ".docs" / "pages" / "jax-compatibility.md").read_text()
    assert compatibility_table(README.read_text()) == compatibility_table(page)


def test_every_page_is_in_the_nav():
    config = (ROOT / ".docs" / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(ROOT / ".docs" / "pages")) for p in PAGES}
    assert pages == set(re.findall(r":\s*([\w/.-]+\.md)\s*$", config, re.M))


# The docs' effect-model table names each class by these words (first column).
EFFECT_CLASS_WORDS = {"pure": "pure", "refs": "refs", "fresh": "fresh", "observe": "observe",
                      "seed": "PRNG seed", "draw": "PRNG draw", "keyed": "keyed"}


def test_the_effect_model_page_has_every_class_the_code_uses():
    """Every class ``effect_table()`` gives a primitive on this JAX is a row of the docs' table,
    and every row is a class the code has (the code's table and the page say the same)."""
    from reprules._shim.inference import _effects

    page = (pathlib.Path(__file__).parent.parent / ".docs" / "pages" / "inference.md").read_text()
    table = page[page.index("## The effect model"):]
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    used = {part.split(" ")[0] for kind in _effects.effect_table().values() for part in kind.split("|")}
    assert used <= set(EFFECT_CLASS_WORDS), used - set(EFFECT_CLASS_WORDS)
    for kind in EFFECT_CLASS_WORDS.values():
        assert any(row.startswith(kind) for row in rows[1:]), f"no row for {kind!r} in the docs' table"
    assert len(rows) - 1 == len(EFFECT_CLASS_WORDS)  # the header row aside: no class the code lacks
