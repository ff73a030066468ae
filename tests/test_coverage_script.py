"""The coverage script (``.ci/coverage/run.py``, nox session ``coverage``) on one cheap op, so it cannot rot.

The script measures every op of the kernel libraries in its own process; here its
machinery runs in-process on JAX's Pallas ``layer_norm`` (every JAX of the matrix
has it, with ``interpret=True``), and its process handling on a hang and a crash.
"""

from __future__ import annotations

import importlib
import json
import pathlib
import sys

import pytest

COVERAGE = pathlib.Path(__file__).resolve().parent.parent / ".ci" / "coverage"
sys.path.insert(0, str(COVERAGE))

measure = importlib.import_module("measure")
run = importlib.import_module("run")
cases_jax = importlib.import_module("cases_jax")


def _layer_norm_row():
    from reprules._builtin_packs import jax_pallas_ops as pack

    try:
        case = cases_jax.CASES["layer_norm"]()
    except measure.NotAvailable as why:  # pragma: no cover - every JAX of the matrix has it
        pytest.skip(str(why))
    # The pack, as on import (conftest unregisters every rule after each test, so an
    # earlier test's import of the module does not count here).
    pack.layer_norm(importlib.import_module(_norm_module()))
    return {"library": "jax", "op": "layer_norm", **measure.measure(case)}


def _norm_module():
    for path in ("jax.experimental.pallas.ops.gpu.layer_norm", "jax.experimental.pallas.ops.layer_norm"):
        try:
            importlib.import_module(path)
            return path
        except ImportError:
            continue
    pytest.skip("this JAX has no Pallas layer_norm")


def test_layer_norm_is_measured_exact_with_its_pack():
    row = _layer_norm_row()
    modes = row["modes"]
    assert row["runs_on_cpu"] == {"yes": True}
    assert modes["off"]["fwd_vs_ref"] < 1e-5 and modes["off"]["grad_vs_ref"] < 1e-4
    for mode in ("on", "infer"):
        assert modes[mode]["outcome"]["kind"] == "exact", modes[mode]
        assert modes[mode]["defensive"] == 0, modes[mode]
    assert modes["off"]["defensive"] > 0  # replicated weight and bias: their gradients' defensive psums
    json.dumps(row)  # --json writes it

    table = run.markdown("jax", [row], "x")
    assert "| `layer_norm` | yes |" in table and "exact (Δref" in table
    assert run.summary([row]).startswith("1 ops: 1 run on CPU; checked and exact with only `import reprules`: 1;")


def test_outcomes_are_classified_from_the_measurements():
    """refused (an error where checking off ran), fails as off, wrong, exact: from the numbers only."""
    error = {"type": "MissingRuleError", "module": "reprules._errors", "reprules": True,
             "message": "no rule for 'k'", "step": "forward"}
    off = {"fwd_vs_ref": 1e-7, "grad_vs_ref": 1e-7}
    refused = measure.outcome({"off": off, "on": {"error": error}}, "on", 1e-5)
    assert refused == {"kind": "refused", "why": "MissingRuleError (reprules, forward): no rule for 'k'"}
    assert measure.cell_outcome(refused).startswith("refused: MissingRuleError")
    as_off = measure.outcome({"off": {"error": {**error, "reprules": False}}, "on": {"error": error}}, "on", 1e-5)
    assert as_off["kind"] == "fails as off"
    wrong = {"fwd_vs_ref": 0.0, "grad_vs_ref": 0.5, "fwd_vs_off": 0.0, "grad_vs_off": 0.5}
    assert measure.outcome({"off": off, "on": wrong}, "on", 1e-5)["kind"] == "wrong"
    exact = {"fwd_vs_ref": 1e-7, "grad_vs_ref": 2e-6, "fwd_vs_off": 0.0, "grad_vs_off": 1e-7}
    assert measure.cell_outcome(measure.outcome({"off": off, "on": exact}, "on", 1e-5)) == \
        "exact (Δref 1.0e-07 / 2.0e-06, Δoff 0 / 1.0e-07)"


def test_a_hang_and_a_crash_are_rows(tmp_path):
    hung = run.run_one("jax", "layer_norm", timeout=0.5)
    assert hung["runs_on_cpu"] == {"yes": False, "why": "hangs: no result in 0 s (killed)"}
    crashed = run.run_one("jax", "no such op", timeout=120)
    assert crashed["runs_on_cpu"]["why"].startswith("crashes: KeyError"), crashed
    table = run.markdown("jax", [hung, crashed], "x")
    assert "| `layer_norm` | no: hangs" in table and "| `no such op` | no: crashes: KeyError" in table
    assert "not installed" in run.markdown("ejkernel", [], None)
