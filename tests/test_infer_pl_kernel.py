"""``reprules.inference()`` for ``pl.kernel`` bodies (issue 9), as for ``pallas_call``.

``pl.kernel`` (JAX 0.8+) binds ``core_map`` (0.8 - 0.9, inside a ``jax.jit``
closure that makes the output refs before the body is traced) or
``mpmd_map`` (0.10+). The kernels here are closures made anew on every call,
so no rule can be registered on them: inference derives one from the body,
or refuses a body that reads its device index or communicates. On 0.10+ JAX
refuses their unannotated out_shape, so a refusal is a ``MissingRuleError``;
on 0.8 - 0.9 JAX alone types every output replicated and accepts it, which
under inference would be a type nobody proved: a refused body is a
``MissingRuleError`` there too, while reprules without inference leaves the
call to JAX.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from helpers import CAST_UP, count_all_reduce, max_err, psum_axes, put, randn, shard_map
from reprules import rules
from test_pl_kernel import _tpu_interpret  # noqa: F401 - autouse fixture: pl.kernel runs in TPU interpret mode
from test_pl_kernel import CAN_INTERPRET, HAS_KERNEL, JAX_VERSION, MPMD, pltpu, sds, tc_mesh

pytestmark = pytest.mark.skipif(
    not (HAS_KERNEL and CAN_INTERPRET), reason=f"JAX {jax.__version__} has no pl.kernel (added in JAX 0.8)"
)


# --- kernels: closures, a new body on every call ----------------------------------------


def scale(x):
    def body(x_ref, o_ref):
        def scoped(buf):
            pltpu.sync_copy(x_ref, buf)
            buf[...] = buf[...] * 2.0
            pltpu.sync_copy(buf, o_ref)

        pl.run_scoped(scoped, pltpu.VMEM(x_ref.shape, x_ref.dtype))

    return pl.kernel(body, sds(x), mesh=tc_mesh())(x)


def mul(x, w):
    def body(x_ref, w_ref, o_ref):
        def scoped(xb, wb):
            pltpu.sync_copy(x_ref, xb)
            pltpu.sync_copy(w_ref, wb)
            xb[...] = xb[...] * wb[...]
            pltpu.sync_copy(xb, o_ref)

        pl.run_scoped(scoped, pltpu.VMEM(x_ref.shape, x_ref.dtype), pltpu.VMEM(w_ref.shape, w_ref.dtype))

    return pl.kernel(body, sds(x), mesh=tc_mesh())(x, w)


@jax.custom_vjp
def kernel_scale(x):
    return scale(x)


kernel_scale.defvjp(lambda x: (scale(x), None), lambda _, g: (scale(g),))


@jax.custom_vjp
def kernel_mul(x, w):
    return mul(x, w)


kernel_mul.defvjp(lambda x, w: (mul(x, w), (x, w)), lambda res, g: (mul(g, res[1]), mul(g, res[0])))


def two_outputs(x, w):
    """out0 = 2 x (varies like x), out1 = w + 1 (like w only)."""

    def body(x_ref, w_ref, o_ref, p_ref):
        def scoped(xb, wb):
            pltpu.sync_copy(x_ref, xb)
            xb[...] = xb[...] * 2.0
            pltpu.sync_copy(xb, o_ref)
            pltpu.sync_copy(w_ref, wb)
            wb[...] = wb[...] + 1.0
            pltpu.sync_copy(wb, p_ref)

        pl.run_scoped(scoped, pltpu.VMEM(x_ref.shape, x_ref.dtype), pltpu.VMEM(w_ref.shape, w_ref.dtype))

    return pl.kernel(body, (sds(x), sds(w)), mesh=tc_mesh())(x, w)


def indexed(x):
    def body(x_ref, o_ref):
        def scoped(buf):
            pltpu.sync_copy(x_ref, buf)
            buf[...] = buf[...] + jax.lax.axis_index("model").astype(jnp.float32)
            pltpu.sync_copy(buf, o_ref)

        pl.run_scoped(scoped, pltpu.VMEM(x_ref.shape, x_ref.dtype))

    return pl.kernel(body, sds(x), mesh=tc_mesh())(x)


def per_core(x, axis="core"):
    """Each of the kernel's two cores doubles its half of ``x`` and adds its core index."""
    half = x.shape[0] // 2

    def body(x_ref, o_ref):
        core = jax.lax.axis_index(axis)  # the kernel's own mesh axis

        def scoped(buf):
            pltpu.sync_copy(x_ref.at[pl.ds(core * half, half)], buf)
            buf[...] = buf[...] * 2.0 + core.astype(jnp.float32)
            pltpu.sync_copy(buf, o_ref.at[pl.ds(core * half, half)])

        pl.run_scoped(scoped, pltpu.VMEM((half, x.shape[1]), x.dtype))

    return pl.kernel(body, sds(x), mesh=tc_mesh(axis, num_cores=2))(x)


def per_core_reference(x):
    """``per_core`` on one shard of ``x`` (rows), in NumPy."""
    half = x.shape[0] // 2
    return np.concatenate([x[:half] * 2.0, x[half:] * 2.0 + 1.0])


def remote(x):
    def body(x_ref, o_ref):
        def scoped(send, recv):
            # A mesh device id (the default type; 0.12 deprecates naming it).
            pltpu.make_async_remote_copy(x_ref, o_ref, send, recv, device_id={"model": 0}).start()

        pl.run_scoped(scoped, pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA)

    return pl.kernel(body, sds(x), mesh=tc_mesh())(x)


# --- derived rules: values, gradients, collectives ----------------------------------------


def test_21855_step_no_psum_and_exact_gradient(mesh):
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    weights = randn(1, (8, 128))
    f = shard_map(kernel_scale, mesh, P("data", None), P("data", None))

    def loss(x):
        return (f(x) * weights).sum()

    with reprules.inference():
        grad = jax.grad(loss)
        assert count_all_reduce(grad, x) == (0, 0, 0)
        got = jax.jit(grad)(x)
    reference = jax.grad(lambda x: (2 * x * weights).sum())(jnp.asarray(x))  # unsharded
    assert max_err(got, reference) == 0.0


def test_weight_gradient_keeps_exactly_the_needed_psum(mesh):
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    w = put(randn(2, (2, 128)), mesh, P())
    weights = randn(1, (8, 128))

    def loss(x, w):
        f = shard_map(kernel_mul, mesh, (P("data", None), P()), P("data", None))
        return (f(x, w) * weights).sum()

    with reprules.inference():
        grad = jax.grad(loss, argnums=(0, 1))
        assert psum_axes(grad, x, w) == [("data",)]  # the weight's; nothing over model
        assert count_all_reduce(grad, x, w) == (1, 1, 1)
        got = jax.jit(grad)(x, w)
        out = jax.jit(shard_map(mul, mesh, (P("data", None), P()), P("data", None)))(x, w)

    def reference(x, w):
        return ((x.reshape(4, 2, 128) * w).reshape(8, 128) * weights).sum()

    assert max_err(out, np.asarray(x) * np.tile(np.asarray(w), (4, 1))) == 0.0
    assert max_err(got, jax.grad(reference, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))) < 1e-5


def test_each_output_varies_only_over_what_it_depends_on(mesh):
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    w = put(randn(1, (2, 128)), mesh, P())
    # out1 depends on w alone: replicated, so out_specs P() is accepted (rules.same() would refuse it).
    f = shard_map(two_outputs, mesh, (P("data", None), P()), (P("data", None), P()))
    with reprules.inference():
        out0, out1 = jax.jit(f)(x, w)
        with pytest.raises(ValueError, match="out_specs"):  # out0 varies over data
            jax.jit(shard_map(two_outputs, mesh, (P("data", None), P()), (P(), P())))(x, w)
    assert max_err(out0, 2 * np.asarray(x)) == 0.0
    assert max_err(out1, np.asarray(w) + 1.0) == 0.0


def test_control_dependence_makes_an_output_vary(mesh):
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    w = put(randn(1, (2, 128)), mesh, P())

    def guarded(x, w):
        def body(x_ref, w_ref, p_ref):
            def scoped(xb, wb):
                pltpu.sync_copy(x_ref, xb)
                pltpu.sync_copy(w_ref, wb)
                wb[...] = wb[...] + 1.0

                @pl.when(xb[0, 0] <= 0)  # a store under a branch on x: p depends on x
                def _():
                    wb[...] = jnp.zeros_like(wb)

                pltpu.sync_copy(wb, p_ref)

            pl.run_scoped(scoped, pltpu.VMEM(x_ref.shape, x_ref.dtype), pltpu.VMEM(w_ref.shape, w_ref.dtype))

        return pl.kernel(body, sds(w), mesh=tc_mesh())(x, w)

    with reprules.inference():
        with pytest.raises(ValueError, match="out_specs"):  # p varies over data (through x's sign)
            jax.jit(shard_map(guarded, mesh, (P("data", None), P()), P()))(x, w)
        got = jax.jit(shard_map(guarded, mesh, (P("data", None), P()), P("data", None)))(x, w)
    xn, wn = np.asarray(x), np.asarray(w)
    expected = np.concatenate([wn + 1.0 if xn[2 * i, 0] > 0 else np.zeros_like(wn) for i in range(4)])
    assert max_err(got, expected) == 0.0


def test_scratch_buffers_are_tracked(mesh):
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    w = put(randn(1, (2, 128)), mesh, P())

    def with_scratch(x, w):
        def body(x_ref, w_ref, o_ref, p_ref, buf):  # buf: the kernel's own VMEM (scratch)
            pltpu.sync_copy(x_ref, buf)
            buf[...] = buf[...] * 3.0
            pltpu.sync_copy(buf, o_ref)
            pltpu.sync_copy(w_ref, buf)
            pltpu.sync_copy(buf, p_ref)

        import inspect

        scratch = [pltpu.VMEM(x.shape, x.dtype)]
        keyword = "scratch_types" if "scratch_types" in inspect.signature(pl.kernel).parameters else "scratch_shapes"
        return pl.kernel(body, (sds(x), sds(w)), mesh=tc_mesh(), **{keyword: scratch})(x, w)

    f = shard_map(with_scratch, mesh, (P("data", None), P()), (P("data", None), P("data", None)))
    with reprules.inference():
        out, copied = jax.jit(f)(x, w)
        rule = reprules.testing.collectives(jax.jit(f), x, w).kernels[0].rule  # inferred, on 0.9 too
    assert max_err(out, 3 * np.asarray(x)) == 0.0
    assert max_err(copied, np.tile(np.asarray(w), (4, 1))) == 0.0
    # Sound, not exact: the scratch buffer is one ref, analysed as if the body ran again and
    # again (as a grid does), so both outputs may depend on both operands through it.
    assert rule == "inferred(out0 <- [0, 1]; out1 <- [0, 1])"


def test_reports_show_inferred_rules(mesh):
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    with reprules.inference():
        report = reprules.testing.collectives(jax.jit(shard_map(scale, mesh, P("data", None), P("data", None))), x)
    (kernel,) = report.kernels
    assert kernel.name == "body" and kernel.has_rule and kernel.rule == "inferred(out0 <- [0])"


def test_a_registered_rule_wins(mesh):
    x = put(randn(0, (8, 128)), mesh, P("data", None))

    def body(x_ref, o_ref):
        pltpu.sync_copy(x_ref, o_ref)

    def call(x):
        return pl.kernel(body, sds(x), mesh=tc_mesh())(x)

    f = shard_map(call, mesh, P("data", None), P("data", None))
    with reprules.inference():
        assert max_err(jax.jit(f)(x), x) == 0.0  # inferred: varies over data only
        reprules.replication_rule(rules.varying("model"))(body)  # declared: over model too
        with pytest.raises(ValueError, match="out_specs"):
            jax.jit(f)(x)


def test_verify_checks_inferred_rules(mesh, monkeypatch):
    from reprules._shim.inference import infer

    from reprules._shim.kernels import _identity

    # A wrong derivation (impossible by construction, so forced here) must be caught. Forced
    # for the pallas_call JAX 0.8 discharges the body into too, so that both levels agree.
    monkeypatch.setattr(infer, "for_kernel_bodies", lambda *a: infer.InferredRule((frozenset(),), 1))
    monkeypatch.setattr(infer, "for_pallas_call", lambda params, *axes: infer.InferredRule(
        (frozenset(),) * _identity.pallas_counts(params)[1], _identity.pallas_counts(params)[0]))
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    f = shard_map(scale, mesh, P("data", None), P())
    with pytest.raises(reprules.ReplicationMismatchError, match="'body'.*'data'"):
        with reprules.inference(), reprules.verify():
            jax.block_until_ready(jax.jit(f)(x))


# --- refusals ------------------------------------------------------------------------------------


def _refusal(f, x):
    """The MissingRuleError of ``f(x)`` under inference."""
    with reprules.inference():
        with pytest.raises(reprules.MissingRuleError) as info:
            jax.jit(f)(x)
    return str(info.value)


def test_a_body_reading_its_device_index_is_refused(mesh):
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    message = _refusal(shard_map(indexed, mesh, P("data", None), P("data", None)), x)
    assert "'body'" in message
    assert "`axis_index`" in message and "test_infer_pl_kernel.py" in message  # the primitive and its line
    assert "device's identity" in message
    assert "'data', 'model'" in message and f"JAX {jax.__version__}" in message
    assert "rules.varying('model')" in message  # the fix


def test_a_body_that_communicates_is_refused(mesh):
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    message = _refusal(shard_map(remote, mesh, P("data", None), P("data", None)), x)
    assert "'body'" in message and "`dma_start`" in message and "test_infer_pl_kernel.py" in message
    assert "communicates with another device (it has a device_id)" in message
    assert "rules.invariant('model')" in message and f"JAX {jax.__version__}" in message


OWN_AXIS_INDEX = pytest.mark.skipif(HAS_KERNEL and not MPMD, reason=(
    f"JAX {jax.__version__}: its own check_vma fails on axis_index of a pl.kernel's core axis "
    "(AssertionError in pvary, with or without reprules); it works from JAX 0.10"))


@OWN_AXIS_INDEX
def test_a_body_reading_its_own_core_index_is_local(mesh):
    x = put(randn(0, (16, 128)), mesh, P("data", None))
    with reprules.inference():
        y = jax.jit(shard_map(per_core, mesh, P("data", None), P("data", None)))(x)
        with pytest.raises(ValueError, match="out_specs"):  # x varies over data: so does the output
            jax.make_jaxpr(shard_map(per_core, mesh, P("data", None), P()))(x)
    shards = np.asarray(x).reshape(4, 4, 128)
    assert max_err(y, np.concatenate([per_core_reference(s) for s in shards])) == 0.0

    w = put(randn(1, (8, 128)), mesh, P())  # replicated in: the core index keeps it replicated
    with reprules.inference():
        z = jax.jit(shard_map(per_core, mesh, P(), P()))(w)
    assert max_err(z, per_core_reference(np.asarray(w))) == 0.0


@OWN_AXIS_INDEX
def test_a_kernel_axis_named_like_a_mesh_axis_is_refused(mesh):
    x = put(randn(0, (16, 128)), mesh, P("data", None))
    f = shard_map(lambda x: per_core(x, axis="model"), mesh, P("data", None), P("data", None))
    message = _refusal(f, x)  # which 'model' it reads cannot be told apart: cautious
    assert "`axis_index`" in message and "its index on mesh axis 'model'" in message
    assert "'data', 'model'" in message and f"JAX {jax.__version__}" in message


@pytest.mark.skipif(MPMD, reason="JAX 0.10+ refuses a rule-less pl.kernel itself")
def test_a_refused_body_is_refused_under_inference_and_left_to_jax_without(mesh):
    # JAX 0.8 - 0.9 alone type the output replicated although it varies over 'data' and
    # 'model' (the body reads its index on 'model'): under inference that is refused ...
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    f = shard_map(indexed, mesh, P("data", None), P())
    message = _refusal(f, x)
    assert "types every output of a pl.kernel replicated, whatever its body writes" in message
    assert "`axis_index`" in message and f"JAX {jax.__version__}" in message

    # ... and with reprules active but not inferring, JAX's own program is unchanged.
    def other(x_ref, o_ref):
        pltpu.sync_copy(x_ref, o_ref)

    reprules.replication_rule()(other)
    with_rule = str(jax.make_jaxpr(f)(x))
    reprules.unregister(other)
    assert "core_map" in with_rule and str(jax.make_jaxpr(f)(x)) == with_rule


@pytest.mark.skipif(not MPMD, reason="hand annotation of a pl.kernel out_shape is used by JAX 0.10+ only")
def test_a_hand_annotation_that_contradicts_the_body_is_refused(mesh):
    x = put(randn(0, (8, 128)), mesh, P("data", None))

    def claim(x):
        def body(x_ref, o_ref):
            pltpu.sync_copy(x_ref, o_ref)

        return pl.kernel(body, sds(x, ()), mesh=tc_mesh())(x)  # annotated replicated

    f = shard_map(claim, mesh, P("data", None), P())
    with reprules.inference(), reprules.strict(), pytest.raises(  # strict keeps the refusal (else: the union)
        reprules.RuleError, match=r"(?s)'body' annotates output 0 as replicated over \{'data'\}.*" + CAST_UP
    ):
        jax.jit(f)(x)


# --- MPMD: a list of bodies (0.10+) -------------------------------------------------------------


@pytest.mark.skipif(not MPMD, reason="pl.kernel takes a list of bodies from JAX 0.10")
def test_mpmd_bodies_are_inferred_together(mesh):
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    w = put(randn(1, (2, 128)), mesh, P())

    def body_a(x_ref, w_ref, o_ref):
        pltpu.sync_copy(w_ref, o_ref)

    def body_b(x_ref, w_ref, o_ref):
        pltpu.sync_copy(x_ref, o_ref)  # the other body writes x: the output depends on both

    def both(x, w):
        tc = tc_mesh()

        class Twin(type(tc)):  # see test_pl_kernel.mpmd_copy
            def check_is_compatible_with(self, other_mesh):
                return True

        fields = {f.name: getattr(tc, f.name) for f in dataclasses.fields(tc) if f.init}
        return pl.kernel([body_a, body_b], sds(x), mesh=[Twin(**fields), Twin(**fields)])(x, w)

    with reprules.inference():
        jax.make_jaxpr(shard_map(both, mesh, (P("data", None), P()), P("data", None)))(x, w)
        with pytest.raises(ValueError, match="out_specs"):
            jax.make_jaxpr(shard_map(both, mesh, (P("data", None), P()), P()))(x, w)


def test_inference_changes_nothing_outside_checking(mesh):
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    f = shard_map(scale, mesh, P("data", None), P("data", None), check=False)
    before = str(jax.make_jaxpr(f)(x))
    with reprules.inference():
        assert str(jax.make_jaxpr(f)(x)) == before
        assert max_err(jax.jit(f)(x), 2 * np.asarray(x)) == 0.0

