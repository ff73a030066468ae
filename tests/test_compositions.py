"""A registered kernel in every composition JAX users write.

The kernel is ``x * w`` (rows of ``x`` sharded over ``data``, ``w`` replicated),
with a ``custom_vjp`` whose fwd and bwd call kernels, inside ``shard_map`` with
checking on. Each composition's values and gradients equal the same program
written in ``jnp`` without ``shard_map``, and its gradient all-reduces over
``data`` only: nothing over ``model``, on which every operand is replicated.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import NEW_SHARD_MAP, make_mesh, max_err, psum_axes, put, randn, shard_map
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules


def mul_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] * w_ref[...]


def pair_kernel(x_ref, w_ref, prod_ref, sum_ref):
    prod_ref[...] = x_ref[...] * w_ref[...]
    sum_ref[...] = x_ref[...] + w_ref[...]


def kernel_mul(x, w):
    return pl.pallas_call(mul_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, w)


@jax.custom_vjp
def mul(x, w):
    return kernel_mul(x, w)


mul.defvjp(
    lambda x, w: (kernel_mul(x, w), (x, w)),
    lambda r, g: (kernel_mul(g, jnp.broadcast_to(r[1], g.shape)), kernel_mul(g, r[0]).sum(0, keepdims=True)),
)


def ref_mul(x, w):
    return x * w


def _layers(f, n=2):
    def run(x, w):
        return jax.lax.scan(lambda c, _: (f(c, w), None), x, None, length=n)[0]

    return run


def _fori(f):
    return lambda x, w: jax.lax.fori_loop(0, 2, lambda i, c: f(c, w), x)


def _cond(f):
    return lambda x, w: jax.lax.cond(True, lambda: f(x, w), lambda: x * 3.0)


def _switch(f):
    return lambda x, w: jax.lax.switch(1, [lambda: x * 3.0, lambda: f(x, w), lambda: x])


def _vmap_rows(f):
    # x: (rows, 2, cols) -> vmap over the middle dimension.
    return lambda x, w: jax.vmap(f, in_axes=(1, None), out_axes=1)(x.reshape(x.shape[0] // 2, 2, -1), w).reshape(x.shape)


def _vmap_weights(f):
    # A batch of 2 weights applied to the same rows.
    def run(x, w):
        ws = jnp.stack([w, 2.0 * w])
        return jax.vmap(f, in_axes=(None, 0))(x, ws).sum(0)

    return run


def _checkpoint(f):
    return jax.checkpoint(f)


def _jit(f):
    return jax.jit(f)


COMPOSITIONS = {
    "jit": _jit,
    "checkpoint": _checkpoint,
    "scan": _layers,
    "fori_loop": _fori,
    "cond": _cond,
    "switch": _switch,
    "vmap_rows": _vmap_rows,
    "vmap_weights": _vmap_weights,
}


def _data():
    mesh = make_mesh()
    x = put(randn(0, (16, 32)), mesh, P("data", None))
    w = put(randn(1, (1, 32)), mesh, P())
    t = randn(2, (16, 32))
    return mesh, x, w, t


def _losses(compose, mesh, t):
    sharded = shard_map(compose(mul), mesh, (P("data", None), P()), P("data", None))
    reference = compose(ref_mul)
    return (lambda x, w: (sharded(x, w) * t).sum()), (lambda x, w: (reference(x, w) * t).sum())


@pytest.mark.parametrize("name", list(COMPOSITIONS))  # cond/switch on JAX <= 0.5: tests/test_rep_gaps.py
def test_composition_values_gradients_and_collectives(name):
    reprules.replication_rule()(mul_kernel)
    mesh, x, w, t = _data()
    loss, ref_loss = _losses(COMPOSITIONS[name], mesh, t)
    xn, wn = np.asarray(x), np.asarray(w)
    assert abs(float(jax.jit(loss)(x, w)) - float(ref_loss(xn, wn))) < 1e-3
    grad = jax.grad(loss, argnums=(0, 1))
    assert max_err(jax.jit(grad)(x, w), jax.grad(ref_loss, argnums=(0, 1))(xn, wn)) < 1e-3
    axes = psum_axes(grad, x, w)
    assert axes and all(a == ("data",) for a in axes), axes  # never over 'model'


def test_forward_over_reverse():
    """A Hessian-vector product: jvp of the gradient (the bwd's kernels have JVPs)."""
    reprules.replication_rule()(mul_kernel)
    mesh, x, w, t = _data()
    loss, ref_loss = _losses(_layers, mesh, t)
    v = (randn(3, x.shape), randn(4, w.shape))
    hvp = jax.jit(lambda x, w: jax.jvp(jax.grad(loss, argnums=(0, 1)), (x, w), v)[1])
    xn, wn = np.asarray(x), np.asarray(w)
    expected = jax.jvp(jax.grad(ref_loss, argnums=(0, 1)), (xn, wn), v)[1]
    assert max_err(hvp(x, w), expected) < 1e-3


def test_jvp_of_a_kernel_without_custom_vjp():
    reprules.replication_rule()(mul_kernel)
    mesh, x, w, _ = _data()
    f = shard_map(kernel_mul, mesh, (P("data", None), P()), P("data", None))
    dx, dw = randn(3, x.shape), randn(4, w.shape)
    out, tangent = jax.jit(lambda x, w: jax.jvp(f, (x, w), (dx, dw)))(x, w)
    xn, wn = np.asarray(x), np.asarray(w)
    assert max_err(out, xn * wn) < 1e-5
    assert max_err(tangent, np.asarray(dx) * wn + xn * np.asarray(dw)) < 1e-5


def test_pytree_out_shape():
    reprules.replication_rule()(pair_kernel)
    mesh, x, w, _ = _data()

    def body(x, w):
        out = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype))
        return pl.pallas_call(pair_kernel, out_shape=out, interpret=True)(x, jnp.broadcast_to(w, x.shape))

    f = shard_map(body, mesh, (P("data", None), P()), (P("data", None), P("data", None)))
    prod, total = jax.jit(f)(x, w)
    xn, wn = np.asarray(x), np.asarray(w)
    assert max_err((prod, total), (xn * wn, xn + wn)) < 1e-6
    with pytest.raises(ValueError, match="out_specs"):  # the outputs vary over data
        jax.jit(shard_map(body, mesh, (P("data", None), P()), (P(), P())))(x, w)


@pytest.mark.skipif(not NEW_SHARD_MAP, reason="jax.shard_map(axis_names=...) arrived in JAX 0.6")
def test_partially_manual_shard_map():
    """Manual over 'data' only; 'model' stays automatic and is never named."""
    reprules.replication_rule()(mul_kernel)
    mesh, x, w, t = _data()
    sharded = jax.shard_map(mul, mesh=mesh, in_specs=(P("data", None), P()), out_specs=P("data", None),
                            axis_names={"data"}, check_vma=True)
    loss = lambda x, w: (sharded(x, w) * t).sum()
    grad = jax.grad(loss, argnums=(0, 1))
    xn, wn = np.asarray(x), np.asarray(w)
    assert max_err(jax.jit(grad)(x, w), jax.grad(lambda x, w: (x * w * t).sum(), argnums=(0, 1))(xn, wn)) < 1e-3
    assert psum_axes(grad, x, w) == [("data",)]


@jax.custom_vjp
def mul_and_double(x, w):
    return kernel_mul(x, w), 2.0 * w


def _mixed_bwd(res, g):  # dw adds the replicated 2 * g_z to the data-varying (g_y * x).sum(0)
    x, w = res
    g_y, g_z = g
    return g_y * w, (g_y * x).sum(0, keepdims=True) + 2.0 * g_z


mul_and_double.defvjp(lambda x, w: (mul_and_double(x, w), (x, w)), _mixed_bwd)


def _mul_plus_double(x, w):
    y, z = mul_and_double(x, w)
    return y + z


@pytest.mark.parametrize("name", ["plain", "jit", "checkpoint", "scan", "vmap_rows"])
def test_mixed_cotangent_is_refused_in_every_composition(name):
    """Every version, every regime (JAX <= 0.5 alone would psum it and count
    ``2 * g_z`` once per device): a CotangentError, never a wrong gradient."""
    reprules.replication_rule()(mul_kernel)
    mesh, x, w, t = _data()
    compose = COMPOSITIONS.get(name, lambda f: f)
    f = shard_map(compose(_mul_plus_double), mesh, (P("data", None), P()), P("data", None))
    grad = jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=(0, 1))
    with pytest.raises(reprules.CotangentError, match=(
            r"(?s)custom_vjp function 'mul_and_double'.*input 1 \('w'\).*replicated over 'data'.*"
            r"JAX \d+\.\d+.*Fix: psum the varying part yourself")):
        jax.jit(grad)(x, w)
