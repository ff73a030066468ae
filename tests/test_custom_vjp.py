"""custom_vjp backward rules of registered kernels whose cotangent varies over
more axes than its primal.

A replicated weight used on sharded activations: the bwd returns a weight
cotangent that varies over ``data``. JAX <= 0.5 psums it under check_rep; from
0.6.2 JAX refuses it. With a registered kernel in the custom_vjp, every version
gives the psum over exactly those axes and the exact gradient; a cotangent that
mixes in a replicated part is refused (JAX >= 0.6), never silently wrong. Each
test runs with ``jax_custom_vjp3`` off and on where the release has the flag.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    CUSTOM_VJP3_MODES,
    NEW_SHARD_MAP,
    count_all_reduce,
    custom_vjp3,
    make_mesh,
    max_err,
    psum_axes,
    put,
    randn,
    shard_map,
)
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules

vjp3 = pytest.mark.parametrize("vjp3", CUSTOM_VJP3_MODES, ids=lambda on: f"vjp3={'on' if on else 'off'}")


def mul_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] * w_ref[...]


def kernel_mul(x, w):
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(mul_kernel, out_shape=out, interpret=True)(x, w)


def _data():
    mesh = make_mesh()
    x = put(randn(0, (16, 32)), mesh, P("data", None))
    w = put(randn(1, (1, 32)), mesh, P())
    t = randn(2, (16, 32))
    return mesh, x, w, t


def _expected(x, w, t, extra=0.0):
    x, w, t = np.asarray(x), np.asarray(w), np.asarray(t)
    return t * w, (t * x).sum(0, keepdims=True) + extra


def _mul_in_fwd():
    """The kernel in the fwd; a jnp bwd whose weight cotangent varies over data."""

    @jax.custom_vjp
    def mul(x, w):
        return kernel_mul(x, w)

    mul.defvjp(lambda x, w: (kernel_mul(x, w), (x, w)),
               lambda res, g: (g * res[1], (g * res[0]).sum(0, keepdims=True)))
    return mul


def _mul_in_bwd():
    """A jnp fwd; the kernel in the bwd."""

    @jax.custom_vjp
    def mul(x, w):
        return x * w

    mul.defvjp(lambda x, w: (x * w, (x, w)),
               lambda res, g: (kernel_mul(g, res[1]), (g * res[0]).sum(0, keepdims=True)))
    return mul


jitted_kernel_mul = jax.jit(kernel_mul)


def _mul_in_bwd_cached():
    """The kernel only in the bwd, through a jitted function already traced
    for the same types, so the bwd reuses a cached trace and traces no kernel."""

    @jax.custom_vjp
    def mul(x, w):
        return x * w

    mul.defvjp(lambda x, w: (x * w, (x, w)),
               lambda res, g: (jitted_kernel_mul(g, res[1]), (g * res[0]).sum(0, keepdims=True)))

    def warmed(x, w):
        warm = jitted_kernel_mul(jax.lax.stop_gradient(x), jax.lax.stop_gradient(w))  # fills the cache
        return mul(x, w) + 0.0 * warm

    return warmed


@vjp3
@pytest.mark.parametrize(
    "make", [_mul_in_fwd, _mul_in_bwd, _mul_in_bwd_cached], ids=["kernel-in-fwd", "kernel-in-bwd", "cached-kernel-in-bwd"]
)
def test_weight_cotangent_is_psummed_over_exactly_data(vjp3, make):
    reprules.replication_rule()(mul_kernel)
    mesh, x, w, t = _data()
    with custom_vjp3(vjp3):
        f = shard_map(make(), mesh, (P("data", None), P()), P("data", None))
        grad = jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=(0, 1))
        assert max_err(jax.jit(grad)(x, w), _expected(x, w, t)) < 1e-4
        assert psum_axes(grad, x, w) == [("data",)]
        assert count_all_reduce(grad, x, w) == (1, 1, 1)


def _mixed(psum_inside):
    """Returns the kernel output and a replicated ``2 * w``; the bwd adds the
    replicated ``2 * g_z`` to the varying ``(g_y * x).sum(0)``."""

    @jax.custom_vjp
    def f(x, w):
        return kernel_mul(x, w), 2.0 * w

    def bwd(res, g):
        x, w = res
        g_y, g_z = g
        dw = (g_y * x).sum(0, keepdims=True)
        if psum_inside:  # the fix the error names
            dw = jax.lax.psum(dw, "data")
        return g_y * w, dw + 2.0 * g_z

    f.defvjp(lambda x, w: (f(x, w), (x, w)), bwd)
    return f


def _mixed_loss(mesh, t, psum_inside):
    f = shard_map(_mixed(psum_inside), mesh, (P("data", None), P()), (P("data", None), P()))

    def loss(x, w):
        y, z = f(x, w)
        return (y * t).sum() + (z * 3.0).sum()

    return loss


@vjp3
def test_mixed_replicated_and_varying_cotangent_is_refused(vjp3):
    reprules.replication_rule()(mul_kernel)
    mesh, x, w, t = _data()
    with custom_vjp3(vjp3):
        grad = jax.grad(_mixed_loss(mesh, t, psum_inside=False), argnums=(0, 1))
        with pytest.raises(
            reprules.CotangentError,
            match=r"(?s)custom_vjp function '_mixed.<locals>.f'.*input 1 \('w'\).*varies over \{'data'\}.*"
            r"replicated over 'data'.*JAX \d.*Why:.*(reprules|JAX \(check_rep\)) would psum.*"
            r"Fix: psum the varying part yourself",
        ):
            jax.jit(grad)(x, w)


@vjp3
def test_mixed_cotangent_psummed_in_the_bwd_is_exact(vjp3):
    reprules.replication_rule()(mul_kernel)
    mesh, x, w, t = _data()
    with custom_vjp3(vjp3):
        grad = jax.grad(_mixed_loss(mesh, t, psum_inside=True), argnums=(0, 1))
        assert max_err(jax.jit(grad)(x, w), _expected(x, w, t, extra=6.0)) < 1e-4
        assert psum_axes(grad, x, w) == [("data",)]


def _colsum():
    """A library op with a custom_vjp of its own: JAX casts its replicated ones up
    (a ``pvary`` over ``data`` inside its body) to multiply the varying input."""

    @jax.custom_vjp
    def colsum(a):
        return (a * jnp.ones((1, a.shape[1]), a.dtype)).sum(0, keepdims=True)

    colsum.defvjp(lambda a: (colsum(a), a.shape), lambda shape, g: (jnp.broadcast_to(g, shape),))
    return colsum


@vjp3
def test_a_custom_vjp_inside_the_bwd_is_followed_not_taken_as_a_collective(vjp3):
    """The weight cotangent comes from a custom_vjp call whose body casts a value
    that does not depend on the cotangents: followed inside, it taints nothing, so
    the cotangent is psummed over exactly data and the gradient is exact."""
    reprules.replication_rule()(mul_kernel)
    mesh, x, w, t = _data()
    colsum = _colsum()
    with custom_vjp3(vjp3):

        @jax.custom_vjp
        def mul(x, w):
            return kernel_mul(x, w)

        mul.defvjp(lambda x, w: (kernel_mul(x, w), (x, w)), lambda res, g: (g * res[1], colsum(g * res[0])))
        f = shard_map(mul, mesh, (P("data", None), P()), P("data", None))
        grad = jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=(0, 1))
        assert max_err(jax.jit(grad)(x, w), _expected(x, w, t)) < 1e-4
        assert psum_axes(grad, x, w) == [("data",)]


@vjp3
def test_a_mixed_cotangent_inside_a_custom_vjp_of_the_bwd_is_still_refused(vjp3):
    """Followed inside, a custom_vjp call that mixes a replicated cotangent part into
    a varying one is found as before."""
    reprules.replication_rule()(mul_kernel)
    mesh, x, w, t = _data()

    @jax.custom_vjp
    def mix(dw, g_z):
        return dw + 2.0 * g_z

    mix.defvjp(lambda dw, g_z: (mix(dw, g_z), None), lambda _, g: (g, 2.0 * g))
    with custom_vjp3(vjp3):

        @jax.custom_vjp
        def f(x, w):
            return kernel_mul(x, w), 2.0 * w

        def bwd(res, g):
            x, w = res
            g_y, g_z = g
            return g_y * w, mix((g_y * x).sum(0, keepdims=True), g_z)

        f.defvjp(lambda x, w: (f(x, w), (x, w)), bwd)
        sharded = shard_map(f, mesh, (P("data", None), P()), (P("data", None), P()))

        def loss(x, w):
            y, z = sharded(x, w)
            return (y * t).sum() + (z * 3.0).sum()

        with pytest.raises(reprules.CotangentError, match=r"(?s)input 1 \('w'\).*replicated over 'data'"):
            jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)


# --- the three ways a bwd runs (JAX >= 0.6) ---------------------------------------
#
# The first call of a bwd for given input types runs straight into the jaxpr being
# staged, and reprules reads the equations it added there; a second call traces the
# bwd to a jaxpr of its own, which it and every later call replay. Each must give
# the same exact gradient, and each must refuse a mixed cotangent.


def _count_bwd_runs(monkeypatch):
    from reprules._shim.cotangents import _bwd_trace as impl

    runs = {"straight": 0, "traced": 0, "replayed": 0}

    def spy(name, fn):
        def counted(*args, **kwargs):
            runs[name] += 1
            return fn(*args, **kwargs)

        return counted

    monkeypatch.setattr(impl.Staged, "taints", spy("straight", impl.Staged.taints))
    monkeypatch.setattr(impl, "trace", spy("traced", impl.trace))
    monkeypatch.setattr(impl, "replay", spy("replayed", impl.replay))
    return runs


@pytest.mark.skipif(not NEW_SHARD_MAP, reason="JAX <= 0.5 psums such cotangents itself")
@vjp3
def test_a_bwd_gives_the_exact_gradient_however_it_runs(vjp3, monkeypatch):
    """Three layers call one custom_vjp with the same types: its bwd runs
    straight (layer 3, transposed first), is traced (layer 2) and is replayed
    (layers 2 and 1); every weight cotangent gets its psum over data."""
    reprules.replication_rule()(mul_kernel)
    runs = _count_bwd_runs(monkeypatch)
    mesh, x, w, t = _data()
    mul = _mul_in_fwd()
    with custom_vjp3(vjp3):
        f = shard_map(lambda x, w: mul(mul(mul(x, w), w), w), mesh, (P("data", None), P()), P("data", None))
        grad = jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=(0, 1))
        got = jax.jit(grad)(x, w)
        assert runs == {"straight": 1, "traced": 1, "replayed": 2}
        xn, wn, tn = np.asarray(x), np.asarray(w), np.asarray(t)
        assert max_err(got, (tn * wn**3, (3 * tn * xn * wn**2).sum(0, keepdims=True))) < 1e-4
        assert psum_axes(grad, x, w) == [("data",)] * 3
        jaxpr, stablehlo, compiled = count_all_reduce(grad, x, w)
        assert (jaxpr, stablehlo) == (3, 3) and 1 <= compiled <= 3  # XLA may combine the three


@pytest.mark.skipif(not NEW_SHARD_MAP, reason="JAX <= 0.5 psums such cotangents itself")
@vjp3
def test_a_mixed_cotangent_is_refused_however_its_bwd_runs(vjp3, monkeypatch):
    """One bwd function, three attempts (a fresh custom_vjp and fwd each: the fwd
    binds the kernel each time, which tells the bwd that a rule is involved)."""
    reprules.replication_rule()(mul_kernel)
    runs = _count_bwd_runs(monkeypatch)
    mesh, x, w, t = _data()
    bwd = _mixed(psum_inside=False).bwd
    expected = [{"straight": 1, "traced": 0, "replayed": 0}, {"straight": 1, "traced": 1, "replayed": 1},
                {"straight": 1, "traced": 1, "replayed": 2}]
    with custom_vjp3(vjp3):
        for want in expected:

            @jax.custom_vjp
            def f(x, w):
                return kernel_mul(x, w), 2.0 * w

            f.defvjp(lambda x, w: ((kernel_mul(x, w), 2.0 * w), (x, w)), bwd)  # the kernel bound in the fwd
            g = shard_map(f, mesh, (P("data", None), P()), (P("data", None), P()))

            def loss(x, w, g=g):
                y, z = g(x, w)
                return (y * t).sum() + (z * 3.0).sum()

            with pytest.raises(reprules.CotangentError, match=r"(?s)input 1 \('w'\).*replicated over 'data'"):
                jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
            assert runs == want


@pytest.mark.skipif(not NEW_SHARD_MAP, reason="JAX <= 0.5 psums such cotangents itself")
@vjp3
def test_without_a_registered_kernel_new_jax_refuses_it(vjp3):
    """Another kernel's rule is registered, but this custom_vjp calls none: JAX decides."""

    def other_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    reprules.replication_rule()(other_kernel)
    mesh, x, w, t = _data()
    with custom_vjp3(vjp3):

        @jax.custom_vjp
        def mul(x, w):
            return x * w

        mul.defvjp(lambda x, w: (x * w, (x, w)), lambda r, g: (g * r[1], (g * r[0]).sum(0, keepdims=True)))
        f = shard_map(mul, mesh, (P("data", None), P()), P("data", None))
        with pytest.raises(Exception) as info:  # _RepError (0.6), ValueError (0.7+)
            jax.jit(jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=(0, 1)))(x, w)
    assert not isinstance(info.value, reprules.ReprulesError)
