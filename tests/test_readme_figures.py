"""The README's figures come from what ships (issue 43): its audit excerpt is regenerated
from ``reprules audit examples/01_issue21855.py`` and compared, and its kernel-library
table's rows add up."""

import contextlib
import io
import os
import re

import jax
import pytest
from test_docs import README, ROOT

from reprules._audit import _cli

NEWEST = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)


def _audit_excerpt() -> str:
    """The lines the README quotes: example 01's summary rows and both collectives tables."""
    out = io.StringIO()
    old = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            assert _cli.main(["audit", "examples/01_issue21855.py", "--quiet"]) == 0
    finally:
        os.chdir(old)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("   collectives (B sent)"))
    tables = next(i for i, line in enumerate(lines) if line.startswith("   collectives, checking off:"))
    end = next(i for i, line in enumerate(lines) if line.startswith("   implicit collectives"))
    return "\n".join(lines[start - 1:start + 3] + lines[tables:end])


@pytest.mark.skipif(not NEWEST, reason=f"the README quotes the audit on JAX 0.12 (this is {jax.__version__})")
def test_the_audit_excerpt_is_what_example_01_prints():
    quoted = re.search(r"reprules audit examples/01_issue21855\.py.*?```text\n(.*?)\n```", README.read_text(),
                       re.S)
    assert quoted, "README.md: no audit excerpt after `reprules audit examples/01_issue21855.py`"
    assert quoted[1] == _audit_excerpt()


def test_the_kernel_library_table_adds_up():
    text = README.read_text()
    head = "| library | ops tried | run on CPU | exact, checking on | refused, saying why | fails as with checking off " \
           "| wrong |"
    assert head in text
    rows = [line for line in text[text.index(head):].splitlines()[2:] if line.startswith("|")]
    assert len(rows) >= 6, rows
    for row in rows:
        name, tried, ran, exact, refused, fails, wrong = [c.strip() for c in row.strip("|").split("|")]
        tried, ran, exact, refused, fails, wrong = map(int, (tried, ran, exact, refused, fails, wrong))
        assert ran <= tried and exact + refused + fails + wrong == ran, row
        assert ran > 0 or "(GPU only)" in name, f"a row with no op run on CPU must say it is GPU only: {row}"
