"""What the docs say happens without the decorator is what happens (issue 36, item 1).

The home page and getting started once said that JAX refuses a rule-less kernel
under checking, which stopped being true when inference became the default:
a newcomer's rule-less copy kernel runs. Here the getting-started program and
the README's test run without their decorator, and with ``REPRULES_INFER=0``,
and each sentence the pages say about it is asserted on what they print.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from helpers import JAX_VERSION
from test_docs import README, blocks, normalize, readme_python

ROOT = pathlib.Path(__file__).parent.parent
PAGES = ROOT / ".docs" / "pages"
DECORATOR = "@reprules.replication_rule()"
# What the docs said before inference was the default, and must not say again.
STALE = re.compile(r"[Ww]ithout (it|the decorator),? JAX refuses")


def _run(path, cwd, *args, infer=None, devices=8):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    env.pop("REPRULES_INFER", None)
    if infer is not None:
        env["REPRULES_INFER"] = infer
    return subprocess.run([sys.executable, *args, str(path)], capture_output=True, text=True, timeout=600,
                          cwd=cwd, env=env)


def _without_decorator(code):
    assert code.count(DECORATOR) == 1, code
    return code.replace(DECORATOR, "", 1)  # leaves the line's comment: still valid Python


def _one_line(text):
    return " ".join(text.split())


def test_no_page_says_jax_refuses_a_rule_less_kernel():
    for page in [README, *sorted(PAGES.rglob("*.md"))]:
        found = STALE.search(page.read_text())
        assert found is None, f"{page.name}: {found.group(0)!r}: with inference by default, reprules runs it"


@pytest.mark.skipif(JAX_VERSION < (0, 6), reason="the page's program needs JAX >= 0.6 (jax.shard_map, jax.typeof)")
def test_getting_started_without_the_decorator(tmp_path):
    text = (PAGES / "getting-started.md").read_text()
    claims = _one_line(text)
    assert "Without the decorator, the program prints the same two lines" in claims
    assert ("Run with `REPRULES_INFER=0` and the checked step raises `reprules.MissingRuleError` instead, naming "
            "`copy_kernel`, its source line and the decorator to add") in claims
    (body, expected, _), *_ = blocks(text)
    path = tmp_path / "getting_started.py"
    path.write_text(_without_decorator(body))

    result = _run(path, tmp_path)  # the same two lines: inference derived the rule
    assert result.returncode == 0, result.stderr[-3000:]
    assert [normalize(x) for x in result.stdout.splitlines()] == [normalize(x) for x in expected], result.stdout

    result = _run(path, tmp_path, infer="0")  # no inference: the teaching error
    assert result.returncode != 0, result.stdout
    error = _one_line(result.stderr)
    assert "reprules._errors.MissingRuleError: The Pallas kernel 'copy_kernel'" in error, result.stderr[-3000:]
    assert re.search(r"getting_started\.py:\d+", error) and DECORATOR in error, result.stderr[-3000:]


def test_readme_test_without_the_decorator(tmp_path):
    """The README's test, as the home page says: it passes without the decorator
    (inference) and fails, naming the kernel and the decorator, with ``REPRULES_INFER=0``."""
    claims = _one_line((PAGES / "index.md").read_text())
    assert "Without it the test passes too" in claims
    assert "with `REPRULES_INFER=0` the test fails with `MissingRuleError`, naming the kernel and this decorator" in claims
    path = tmp_path / "test_copy.py"
    path.write_text(_without_decorator(readme_python()[0]))
    args = ("-m", "pytest", "-q", "-p", "no:cacheprovider", "--reprules-cpu-devices", "8")

    result = _run(path.name, tmp_path, *args)
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout[-3000:]

    result = _run(path.name, tmp_path, *args, infer="0")
    out = _one_line(result.stdout)
    assert result.returncode == 1 and "1 failed" in out, result.stdout[-3000:]
    assert "MissingRuleError: The Pallas kernel 'copy_kernel'" in out and DECORATOR in out, result.stdout[-3000:]
