"""Every script in examples/ runs on CPU with fake devices and says what it should."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(script):
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600,
        env={**__import__("os").environ, "XLA_FLAGS": ""},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if script.name.startswith("01_"):
        rows = {line[:28].strip(): line[28:].split() for line in result.stdout.splitlines()}
        assert rows["checking off"][:3] == ["1", "1", "1"]
        assert rows["reprules, checking on"] == ["0", "0", "0", "0.0e+00"]
