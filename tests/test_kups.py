"""kups' custom primitives through reprules' kups pack, on CPU.

The pack (entry points ``kups.core.utils.segment`` and ``kups.core.assertion``)
gives ``kups_segment_sum`` and ``kups_segment_take`` ``rules.same()``, and
kups' runtime-assertion primitives the types their abstract evals already give.
conftest clears rules after each test, so a fixture registers them again, as
loading the pack does; the last test checks the pack in a fresh interpreter.

kups' abstract evals return ``ShapedArray(shape, dtype)``: replicated, whatever
the operands. Under JAX alone, a gather of a replicated table by ids over
``data`` is typed replicated and the table's gradient misses its psum over
``data`` (silently wrong), and ``out_specs=P()`` over a sum of data-varying
contributions is accepted (shard 0's sums). With the pack both are right: the
gradient exact with one psum over ``data`` (checking off: two defensive
all-reduces more), and ``out_specs=P()`` refused by JAX.
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import count_all_reduce, max_err, put, randn, shard_map
from jax.sharding import PartitionSpec as P

import reprules
from reprules import testing

segment = pytest.importorskip(
    "kups.core.utils.segment",
    reason="kups (PyPI `kups`, installed --no-deps with `slub`) is not installed; these tests run in the "
    "newest-JAX environment",
)
assertion = pytest.importorskip("kups.core.assertion")

ROWS = P("data", None)


@pytest.fixture
def pack():
    """The pack's registrations, as on importing kups' modules."""
    from reprules._builtin_packs import kups as kups_pack

    kups_pack.segment(segment)
    kups_pack.assertion(assertion)


def _take_case():
    table = randn(0, (5, 3))
    ids = jnp.asarray(np.random.RandomState(1).randint(0, 5, (16,)), jnp.int32)
    return table, ids, randn(2, (16, 3))


def _take_loss(check, mesh):
    """The issue's step: the table replicated, ids over ``data``, the loss psummed over ``data``."""
    def body(table, ids, t):
        return jax.lax.psum((segment.segment_take(table, ids) * t).sum(), "data")

    return jax.grad(shard_map(body, mesh, (P(), P("data"), ROWS), P(), check=check))


def test_segment_take_gradient_exact(mesh, pack):
    """dL/dtable equals checking off and the unsharded gather's, psummed over ``data`` once."""
    table, ids, t = _take_case()
    args = (put(table, mesh, P()), put(ids, mesh, P("data")), put(t, mesh, ROWS))
    on, off = _take_loss(True, mesh), _take_loss(False, mesh)
    expected = jax.grad(lambda table: (jnp.take(table, ids, axis=0) * t).sum())(table)
    g_on = jax.jit(on)(*args)
    assert max_err(g_on, jax.jit(off)(*args)) < 1e-5
    assert max_err(g_on, expected) < 1e-5
    testing.assert_collectives(on, *args, expect={("all-reduce", "data"): 1, "defensive": 0})
    assert count_all_reduce(on, *args)[1:] == (1, 1)  # StableHLO, compiled HLO (the jaxpr adds the dead loss psum)
    report = testing.collectives(off, *args)
    assert report.count("all-reduce", defensive=True) == 2


def test_segment_take_without_the_pack(mesh, monkeypatch):
    """Without the pack: JAX alone gives a wrong table gradient, with no error; reprules'
    sound types alone (the union of the inputs' axes) make it exact, with a warning."""
    for reg in list(reprules.registered().values()):  # the pack, loaded on import, registered them
        reprules.unregister(reg.kernel())
    table, ids, t = _take_case()
    args = (put(table, mesh, P()), put(ids, mesh, P("data")), put(t, mesh, ROWS))
    expected = jax.grad(lambda table: (jnp.take(table, ids, axis=0) * t).sum())(table)
    with pytest.warns(reprules.ReplicationWarning) as caught:  # the take, and the segment_sum of its transpose
        assert max_err(jax.jit(_take_loss(True, mesh))(*args), expected) < 1e-5
    assert any("primitive 'kups_segment_take'" in str(w.message) for w in caught)
    monkeypatch.setenv("REPRULES_SOUND_TYPES", "0")  # JAX's typing
    jax.clear_caches()
    assert max_err(jax.jit(_take_loss(True, mesh))(*args), expected) > 0.1
    jax.clear_caches()


def test_segment_sum_forward_gradient_and_refusal(mesh, pack):
    """Contributions and ids over ``data``: each shard's sums equal the unsharded op's on its rows,
    the gradient is exact with no all-reduce, and ``out_specs=P()`` over the sums is refused."""
    data, ids = randn(0, (16, 3)), jnp.asarray(np.random.RandomState(1).randint(0, 5, (16,)), jnp.int32)
    t = randn(2, (20, 3))
    args = (put(data, mesh, ROWS), put(ids, mesh, P("data")))
    op = lambda d, i: segment.segment_sum(d, i, 5)
    on, off = shard_map(op, mesh, (ROWS, P("data")), ROWS), shard_map(op, mesh, (ROWS, P("data")), ROWS, check=False)
    expected = jnp.concatenate([jax.ops.segment_sum(d, i, 5) for d, i in zip(jnp.split(data, 4), jnp.split(ids, 4))])
    assert max_err(jax.jit(on)(*args), expected) < 1e-5
    assert max_err(jax.jit(on)(*args), jax.jit(off)(*args)) == 0.0
    grad = jax.grad(lambda d, i: (on(d, i) * t).sum())
    g_ref = jax.grad(lambda d: (jnp.concatenate([
        jax.ops.segment_sum(a, i, 5) for a, i in zip(jnp.split(d, 4), jnp.split(ids, 4))]) * t).sum())(data)
    assert max_err(jax.jit(grad)(*args), g_ref) < 1e-5
    testing.assert_no_all_reduce(grad, *args)
    replicated = shard_map(op, mesh, (ROWS, P("data")), P())
    with pytest.raises(ValueError, match=r"(?s)out_specs.*\{data\}"):
        jax.jit(replicated)(*args)


def test_assertion_primitives_keep_their_types(mesh, pack):
    """kups' runtime assertion (a no-op of its operands) and check_assertions (a scalar shaped like
    its operand): outputs typed as kups' own abstract evals type them, with no warning."""
    x = randn(0, (16, 3))

    def body(x):
        assertion.runtime_assert(jnp.all(jnp.isfinite(x)), "x must be finite")
        ok = assertion.check_assertions(x)
        return x * ok

    out = jax.jit(shard_map(body, mesh, ROWS, ROWS))(put(x, mesh, ROWS))
    assert max_err(out, x) == 0.0
    whole = shard_map(lambda: assertion.check_assertions(), mesh, (), P())
    assert bool(jax.jit(whole)())


def test_pack_loads_on_import():
    """In a fresh interpreter: ``import reprules``, then kups' segment module; the pack is loaded."""
    code = ("import reprules\n"
            "assert reprules.registered() == {}\n"
            "import kups.core.utils.segment\n"
            "print([(p.name, p.state) for p in reprules.packs() if p.module == 'kups.core.utils.segment'])\n"
            "print(sorted((r.name, repr(r.rule), r.source) for r in reprules.registered().values()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    pack = "pack reprules._builtin_packs.kups:segment"
    assert out == ["[('reprules._builtin_packs.kups:segment', 'loaded')]",
                   str([("kups_segment_sum", "rules.same()", pack), ("kups_segment_take", "rules.same()", pack)])]


def test_pack_errors_say_what_and_fix():
    """A primitive kups renamed: the others are registered, then a LookupError names it; the no-op
    rule given outputs that do not pair with its operands: a RuleError."""
    import types

    from reprules._builtin_packs import kups as kups_pack

    for reg in list(reprules.registered().values()):  # the pack, loaded on import, registered them
        reprules.unregister(reg.kernel())
    renamed = types.ModuleType("kups.core.utils.segment")
    renamed.segment_sum_p = segment.segment_sum_p
    with pytest.raises(LookupError, match=r"(?s)kups\.core\.utils\.segment has no segment_take_p: renamed or "
                                          r"removed in kups.*Fix: upgrade reprules"):
        kups_pack.segment(renamed)
    assert [r.name for r in reprules.registered().values()] == ["kups_segment_sum"]
    ctx = reprules.rules.RuleContext("assertion", None, ("data", "model"), 2, 1, jax.__version__)
    with pytest.raises(reprules.RuleError, match=r"(?s)'assertion' returned 1 outputs for 2 operands \(mesh axes "
                                                  r"\['data', 'model'\], JAX .*Fix: upgrade reprules"):
        kups_pack.passthrough()(ctx, (frozenset({"data"}), frozenset()))
