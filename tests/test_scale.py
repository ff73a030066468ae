"""reprules._demo.scale: the bytes-per-step formulas, checked against measured steps.

The formulas give, for the transformer of ``reprules._demo.transformer`` at any size
and mesh, the all-reduce bytes per device and step with reprules (the
analytical minimum) and with checking off. Here they are checked against
``reprules.testing.collectives`` of real steps on the (4, 2) mesh (the
program's collectives: in the jaxpr and lowered), and for consistency at 7B scale.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest

import reprules
from helpers import make_mesh
from reprules import rules
from reprules._demo import scale, transformer

SMALL = transformer.Config(layers=2, d_model=32, heads=2, ffn=64, seq=8, batch=4)
MESH = {"data": 4, "model": 2}


def _measured(cfg: transformer.Config, variant: str) -> tuple[int, int, int]:
    """(bytes, defensive bytes, count) of the step's own collectives (jaxpr, lowered),
    each counted once per layer when inside the scan over layers."""
    mesh = make_mesh()
    kernels = transformer.kernels()
    if variant == "reprules":
        for k in kernels:
            reprules.replication_rule(rules.same())(k)
    try:
        step, args = transformer.build(mesh, variant, cfg)
        report = reprules.testing.collectives(step, *args)
    finally:
        for k in kernels:
            reprules.unregister(k)
    # The program's collectives, lowered (0.4.28 keeps a dead one in the jaxpr only).
    program = [c for c in report.collectives if "jaxpr" in c.levels and "stablehlo" in c.levels]
    times = [cfg.layers if cfg.scan and "scan" in c.op_name.split("/") else 1 for c in program]
    return (sum(c.bytes * n for c, n in zip(program, times)),
            sum(c.bytes * n for c, n in zip(program, times) if c.defensive), sum(times))


@pytest.mark.parametrize("scan,variant", [(False, "off"), (False, "reprules"), (True, "off")],
                         ids=["unrolled-off", "unrolled-reprules", "scan-off"])
def test_formulas_match_measured_steps(scan, variant):
    cfg = dataclasses.replace(SMALL, scan=scan)
    expected = transformer.expected_bytes(cfg, MESH)
    total, defensive, _ = _measured(cfg, variant)
    if variant == "reprules":
        assert (total, defensive) == (expected.needed, 0)
    else:
        assert (total, defensive) == (expected.off, expected.flagged_defensive)


def test_what_checking_off_adds():
    m = scale.Model(layers=24, d_model=64, ffn=128, itemsize=4)
    act = scale.activation_bytes(m, tokens=32)
    b = scale.step_bytes(m, scale.Mesh(4, 2), tokens=32)
    assert act == 32 * 64 * 4
    assert b.model_extra == 4 * 24 * act == b.model_needed  # checking off doubles the activation traffic
    assert scale.step_bytes(m, scale.Mesh(4, 2), 32, scan=True).model_extra == (4 * 24 + 1) * act
    assert scale.step_bytes(m, scale.Mesh(4, 2), 32, structure="model").off == b.needed
    # Nothing over `model` without a model axis, nothing over `data` without a data axis.
    assert scale.step_bytes(m, scale.Mesh(8, 1), 32).model_extra == 0
    assert scale.step_bytes(m, scale.Mesh(1, 8), 32).data_needed == 0
    with pytest.raises(ValueError, match="structure"):
        scale.step_bytes(m, scale.Mesh(4, 2), 32, structure="layer")


def test_seven_b_table():
    m = scale.gpt3_6_7b()
    assert 6.4e9 < m.parameters() < 6.5e9
    rows = scale.table(m, [scale.Mesh(32, 8)], scale.GPT3_BATCH_TOKENS)
    (row,) = rows
    assert row.tokens == 65536
    assert row.extra == 4 * 32 * 65536 * 4096 * 2  # 68.7 GB per device and step
    nvlink = row.extra_seconds["H100 NVLink 4 (900 GB/s bidirectional)"]
    assert nvlink == pytest.approx(2 * 7 / 8 * row.extra / 450e9)
    assert scale.allreduce_seconds(1e9, 1, 1e9) == 0.0
    assert "| 32 x 8 | 65,536 |" in scale.markdown(rows)


def test_transformer_matches_its_reference():
    """The model itself: gradients of a 1-layer step equal the unsharded reference."""
    import numpy as np

    cfg = dataclasses.replace(SMALL, layers=1)
    mesh = make_mesh()
    for k in transformer.kernels():
        reprules.replication_rule(rules.same())(k)
    step, args = transformer.build(mesh, "reprules", cfg)
    grads = jax.jit(step)(*args)
    ref = transformer.reference_grads(cfg)
    for got, want in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
