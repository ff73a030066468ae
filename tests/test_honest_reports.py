"""Reports tell the truth: kernels are matched by identity, registered() keeps
distinct kernels apart, strict mode exempts JAX's own primitives by identity."""

import sys
import textwrap

import jax
import kernels_a
import kernels_b
import pytest
from helpers import NEW_SHARD_MAP, make_mesh, max_err, put, randn, shard_map
from jax.core import ShapedArray
from jax.experimental import pallas as pl
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

import reprules
from reprules import testing
from reprules._audit import _cli


# --- (a) the collectives report and `reprules audit` ---------------------------
def _two_same_named(mesh):
    # Checking off: kernels_b.copy_kernel has no rule, so checking on would refuse it.
    f = shard_map(lambda x: kernels_b.copy(kernels_a.copy(x)), mesh, P("data", None), P("data", None), check=False)
    return f, put(randn(0, (8, 128)), mesh, P("data", None))


def test_collectives_report_tells_same_named_kernels_apart():
    assert kernels_a.copy_kernel.__name__ == kernels_b.copy_kernel.__name__
    reprules.replication_rule()(kernels_a.copy_kernel)
    f, x = _two_same_named(make_mesh())
    report = testing.collectives(f, x)
    by_file = {k.source.rsplit("/", 1)[-1].split(":")[0]: k for k in report.kernels}
    assert set(by_file) == {"kernels_a.py", "kernels_b.py"}, report.kernels
    a, b = by_file["kernels_a.py"], by_file["kernels_b.py"]
    assert (a.name, a.has_rule, a.rule) == ("copy_kernel", True, "rules.same()")
    assert (b.name, b.has_rule, b.rule, b.identified) == ("copy_kernel", False, "", True)
    assert report.kernels_without_rule == (b,)
    table = report.table()
    assert "NO RULE; kernels_b.py:" in table and "rule rules.same(); kernels_a.py:" in table


def test_kernel_matching_a_registered_one_by_name_only_is_not_reported_as_ruled():
    # Two kernels from one factory share name and definition site; only one has
    # a rule. Identity tells them apart where reprules saw the call; where it
    # cannot, the report says so instead of guessing from the name.
    def make(scale):
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * scale

        return kernel

    ruled, bare = make(1.0), make(2.0)
    reprules.replication_rule()(ruled)

    def call(kernel, x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)

    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    f = shard_map(lambda x: call(bare, call(ruled, x)), mesh, P("data", None), P("data", None), check=False)
    report = testing.collectives(f, x)
    reprules.unregister(ruled)  # now, while alive: a collected kernel leaves reprules active
    assert sorted(k.has_rule for k in report.kernels) == [False, True], report.kernels
    (missing,) = report.kernels_without_rule
    assert "NO RULE" in report.table() or "NOT IDENTIFIED" in report.table()
    if not missing.identified:
        assert missing.candidates == (f"{__name__}.{make.__qualname__}.<locals>.kernel",)


AUDIT_TARGET = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import kernels_a, kernels_b
    import reprules
    from reprules._demo import workloads

    reprules.replication_rule()(kernels_a.copy_kernel)  # kernels_b.copy_kernel: no rule

    def step():
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
        x = jax.device_put(jnp.ones((8, 128)), NamedSharding(mesh, P("data", None)))
        f = workloads.shard_map(lambda x: kernels_b.copy(kernels_a.copy(x)), mesh, P("data", None),
                                 P("data", None), check=False)
        return f, (x,)
''')


def test_audit_strict_fails_when_a_same_named_kernel_has_no_rule(tmp_path, monkeypatch, capsys):
    (tmp_path / "same_named_steps.py").write_text(AUDIT_TARGET)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "same_named_steps", raising=False)
    assert _cli.main(["audit", "same_named_steps:step", "--strict", "--quiet"]) == 1
    out, err = capsys.readouterr()
    lines = [line.split() for line in out.splitlines() if line.split()[:3] == ["copy_kernel", "pallas_call", "1"]]
    assert len(lines) == 2, out  # listed apart: kernel, primitive, calls, rule, source
    assert ["rules.same()"] == [line[3] for line in lines if line[-1].startswith("kernels_a.py:")], out
    assert ["NO RULE"] == [" ".join(line[3:5]) for line in lines if line[-1].startswith("kernels_b.py:")], out
    assert err == "reprules audit --strict: 1 finding:\n  step: kernel copy_kernel has no rule\n"


# --- (b) registered() ------------------------------------------------------------
def _factory():
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    return kernel


def test_registered_keeps_factory_made_kernels_apart():
    first, second = _factory(), _factory()
    reprules.replication_rule()(first)
    reprules.replication_rule(reprules.rules.varying("model"))(second)
    listed = reprules.registered()
    base = f"{__name__}._factory.<locals>.kernel"
    assert list(listed) == [base, f"{base}#2"]
    assert listed[base].kernel() is first and listed[f"{base}#2"].kernel() is second
    assert listed[f"{base}#2"].rule == reprules.rules.varying("model")
    assert listed[base].where == listed[f"{base}#2"].where == base  # messages keep the readable name
    reprules.unregister(first)
    assert list(reprules.registered()) == [base] and reprules.registered()[base].kernel() is second
    reprules.unregister(second)  # now, while alive: a collected kernel leaves reprules active


# --- (c) strict mode decides by which primitive it is ----------------------------
named_p = Primitive("named_copy")  # a user primitive with an `axis_name` parameter
named_p.def_impl(lambda x, *, axis_name: x)
named_p.def_abstract_eval(lambda a, *, axis_name: ShapedArray(a.shape, a.dtype))  # drops the varying axes
mlir.register_lowering(named_p, mlir.lower_fun(lambda x, *, axis_name: x * 1.0, multiple_results=False))


@pytest.mark.skipif(not NEW_SHARD_MAP, reason="JAX <= 0.5 refuses rule-less primitives by itself")
def test_strict_refuses_user_primitive_with_an_axis_name_parameter(monkeypatch):
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    body = lambda x: named_p.bind(x, axis_name="data")
    f = jax.jit(shard_map(body, mesh, P("data", None), P(None, None)))
    with monkeypatch.context() as env:  # JAX's typing: the hazard, accepted, one device's shard returned
        env.setenv("REPRULES_SOUND_TYPES", "0")
        jax.clear_caches()
        assert f(x).shape == (2, 128)
    jax.clear_caches()
    with reprules.strict(), pytest.raises(
            reprules.StrictModeError, match=r"(?s)Strict mode: the primitive 'named_copy' has inputs "
            r"varying over \{'data'\}.*output 0 as replicated over \{'data'\}"):
        f(x)
    reprules.replication_rule()(named_p)
    with reprules.strict():
        out = jax.jit(shard_map(body, mesh, P("data", None), P("data", None)))(x)
        assert max_err(out, x) == 0.0


@pytest.mark.skipif(not NEW_SHARD_MAP, reason="strict mode hooks JAX >= 0.6 only")
def test_strict_exempts_jax_higher_order_primitives_whose_bodies_drop_axes():
    # Each body psums over data: the outputs are replicated over an axis the
    # inputs vary over, which strict mode allows JAX's own primitives.
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    total = lambda v: jax.lax.psum(v, "data")

    @jax.custom_vjp
    def summed(v):
        return total(v)

    summed.defvjp(lambda v: (total(v), None), lambda _, g: (g,))

    def body(v):
        a = jax.jit(total)(v)
        b = jax.lax.cond(True, total, lambda u: total(u) * 2.0, v)
        _, c = jax.lax.scan(lambda carry, _: (carry, total(v)), 0.0, None, length=2)
        d = jax.checkpoint(total)(v)
        e = jax.lax.fori_loop(0, 2, lambda i, u: u + total(v), jax.numpy.zeros_like(total(v)))
        return a + b + c.sum(0) + d + e + summed(v) + jax.numpy.argmax(v, axis=1, keepdims=True)

    f = jax.jit(shard_map(body, mesh, P("data", None), P("data", None)))
    expected = f(x)
    with reprules.strict():
        assert max_err(f(x), expected) == 0.0


# --- (d) reports name the user's code; dead collectives are dead everywhere -------
def scale_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] * w_ref[...]


def _scale(x, w):
    return pl.pallas_call(scale_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, w)


@jax.custom_vjp
def scaled(x, w):
    return _scale(x, w)


def scaled_bwd(res, g):
    # w is replicated, its cotangent varies over `data`: reprules psums it (JAX >= 0.6; JAX <= 0.5 does).
    x, w = res
    return _scale(g, w), _scale(g, x).sum(0, keepdims=True)


scaled.defvjp(lambda x, w: (_scale(x, w), (x, w)), scaled_bwd)
BWD_SOURCE = f"{scaled_bwd.__code__.co_filename}:{scaled_bwd.__code__.co_firstlineno}"


def _scaled_grad(argnums):
    reprules.replication_rule()(scale_kernel)
    mesh = make_mesh()
    x, w = put(randn(0, (8, 128)), mesh, P("data", None)), put(randn(1, (1, 128)), mesh, P())
    t = randn(2, (8, 128))
    f = shard_map(scaled, mesh, (P("data", None), P()), P("data", None))
    return jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=argnums), (x, w)


def _in_shim(source):
    return "reprules/_shim/" in source.replace("\\", "/")


def test_psum_reprules_adds_in_a_bwd_names_the_bwd():
    grad, args = _scaled_grad((0, 1))
    report = testing.collectives(grad, *args)
    (psum,) = report.select("all-reduce", axes="data")  # w's cotangent, summed over data
    assert "hlo" in psum.levels and not psum.dead, psum.describe()
    assert not any(_in_shim(c.source) for c in report.collectives), report.table()
    if not NEW_SHARD_MAP:  # JAX <= 0.5 psums the cotangent itself (check_rep): not reprules'
        assert psum.added_by == "" and "reprules_added" not in psum.op_name
        return
    assert psum.added_by == "reprules" and "reprules_added" in psum.op_name, psum.describe()
    assert psum.source == BWD_SOURCE, (psum.source, BWD_SOURCE)  # the bwd's def line, at every level
    assert psum.status == "needed" and psum.status_text() == "added by reprules"
    assert "added by reprules [" in psum.describe() and psum.describe().endswith(f"at {BWD_SOURCE}")
    assert "added by reprules: needed" in report.table()
    assert psum.to_dict()["added_by"] == "reprules" and psum.to_dict()["dead"] is False


def test_dead_all_reduce_is_dead_in_every_count_and_check():
    # Only x's gradient is asked for: w's cotangent psum is traced, then dropped as dead code.
    grad, args = _scaled_grad(0)
    report = testing.collectives(grad, *args)
    (dead,) = report.select("all-reduce", dead=True)
    assert dead.levels == ("jaxpr",) and dead.dead and dead.status == "dead", dead.describe()
    assert "dead: not lowered, never runs" in dead.describe()
    if NEW_SHARD_MAP:
        assert dead.source == BWD_SOURCE, dead.source  # reprules' psum: named by the user's bwd
    assert not _in_shim(dead.source) and dead.source, dead.describe()
    live = [c for c in report.collectives if c.levels != ("jaxpr",)]
    assert report.count() == len(live) and report.bytes() == sum(c.step_bytes for c in live)
    assert dead not in report.select("all-reduce") and dead not in report.defensive
    assert dead in report.select("all-reduce", level="jaxpr") and report.dead_collectives == (dead,)
    summary = report.to_dict()["summary"]
    assert (summary["count"], summary["dead_count"]) == (len(live), 1)
    assert report.to_dict()["collectives"][report.collectives.index(dead)]["dead"] is True
    assert "1 dead (not counted)" in report.table()
    # assert_no_all_reduce: ignored at the default levels, found where the jaxpr alone is checked.
    if not report.count("all-reduce"):
        testing.assert_no_all_reduce(grad, *args)
    with pytest.raises(testing.CollectivesAssertionError, match=r"all-reduce .*: .*, dead .*\[jaxpr; dead: not "
                       r"lowered, never runs\]"):
        testing.assert_no_all_reduce(grad, *args, levels=("jaxpr",), axes=dead.axes)
    with pytest.raises(testing.CollectivesAssertionError, match=r"(?s)Why: .*dead.* never run.*\nFix: "):
        testing.assert_no_all_reduce(grad, *args, levels=("jaxpr",), axes=dead.axes)
    testing.assert_collectives(grad, *args, expect={"all-reduce": report.count("all-reduce")}, exact=False)
