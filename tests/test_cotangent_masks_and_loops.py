"""custom_vjp cotangents that reprules now proves exact: masked to one device, or
accumulated in a loop.

reprules psums a bwd's cotangent over the axes it varies over and its primal does
not, unless a part of it that depends on the incoming cotangents was replicated
over such an axis and made varying (it would be counted once per device). Two
shapes of bwd were refused although that psum is exact:

* a part masked to one device along the axis (``where(axis_index(a) == c, u, 0)``,
  ``(axis_index(a) == c) * u``): it counts once in the psum, whatever it went
  through before (recurrentgemma's sequence-sharded LRU scan masks its ``h0``
  cotangent so, after psumming ``dh_last``);
* a ``fori_loop`` / ``while_loop`` accumulating a partial gradient from zeros: the
  loop was judged as one equation, and the casts in its body of values that do
  not depend on the cotangents (reprules' widening of the carry, the loop's own
  constants) were taken for collectives (levanter's fused cross-entropy bwd).

Each is now exact (vs the closed form and vs checking off), and each still
refuses its near miss: a mask that is not one-hot, a loop adding a replicated
cotangent part on every device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import NEW_SHARD_MAP, make_mesh, max_err, psum_axes, put, randn, shard_map
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules

pytestmark = pytest.mark.skipif(not NEW_SHARD_MAP, reason="JAX <= 0.5 psums such cotangents itself (check_rep)")


def mul_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] * w_ref[...]


def kernel_mul(x, w):
    return pl.pallas_call(mul_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, w)


@pytest.fixture(autouse=True)
def rule():
    reprules.replication_rule()(mul_kernel)


def _data():
    mesh = make_mesh()
    x = put(randn(0, (16, 32)), mesh, P("data", None))
    w = put(randn(1, (1, 32)), mesh, P())
    return mesh, x, w, randn(2, (16, 32))


def _grad(bwd, mesh, t, check=True):
    @jax.custom_vjp
    def mul(x, w):
        return kernel_mul(x, w)

    mul.defvjp(lambda x, w: (kernel_mul(x, w), (x, w)), bwd)
    f = shard_map(mul, mesh, (P("data", None), P()), P("data", None), check=check)
    return jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=(0, 1))


def _expected(x, w, t):
    x, w, t = np.asarray(x), np.asarray(w), np.asarray(t)
    return t * w, (t * x).sum(0, keepdims=True)


# --- masked to one device --------------------------------------------------------
def _masked(mask):
    """The weight cotangent summed over 'data' in the bwd (replicated), then given
    to one device along 'data' (the others return zero), as recurrentgemma does."""

    def bwd(res, g):
        x, w = res
        total = jax.lax.psum((g * x).sum(0, keepdims=True), "data")
        first = jax.lax.axis_index("data") == 0
        if mask == "where":
            dw = jnp.where(first, total, 0.0)
        elif mask == "mul":
            dw = first.astype(total.dtype) * total
        else:  # "every device": a mask true everywhere, so total would be counted 4 times
            dw = (jax.lax.axis_index("data") == jax.lax.axis_index("data")).astype(total.dtype) * total
        return g * w, dw

    return bwd


@pytest.mark.parametrize("mask", ["where", "mul"])
def test_a_cotangent_masked_to_one_device_is_psummed_exactly(mask):
    mesh, x, w, t = _data()
    grad = _grad(_masked(mask), mesh, t)
    got = jax.jit(grad)(x, w)
    assert max_err(got, _expected(x, w, t)) < 1e-4
    assert max_err(got, jax.jit(_grad(_masked(mask), mesh, t, check=False))(x, w)) == 0.0
    assert psum_axes(grad, x, w) == [("data",), ("data",)]  # the bwd's own, and reprules'


def test_a_mask_true_on_every_device_is_still_refused():
    mesh, x, w, t = _data()
    with pytest.raises(reprules.CotangentError, match=r"(?s)input 1 \('w'\).*varies over \{'data'\}"):
        jax.jit(_grad(_masked("every device"), mesh, t))(x, w)


# --- accumulated in a loop ---------------------------------------------------------
def _looped(loop, replicated_part=False):
    """The weight cotangent accumulated row by row from ``jnp.zeros`` (a carry that
    starts replicated and meets 'data'-varying values: reprules widens it)."""

    def bwd(res, g):
        x, w = res
        extra = jax.lax.psum(g.sum(), "data") if replicated_part else 0.0  # the same on every device

        def add(i, acc):
            return acc + jax.lax.dynamic_slice_in_dim(g * x, i, 1, 0) + extra

        n = x.shape[0]
        if loop == "fori_loop":
            dw = jax.lax.fori_loop(0, n, add, jnp.zeros_like(w))
        else:
            dw = jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, add(c[0], c[1])),
                                    (0, jnp.zeros_like(w)))[1]
        return g * w, dw

    return bwd


@pytest.mark.parametrize("loop", ["fori_loop", "while_loop"])
def test_a_cotangent_accumulated_in_a_loop_is_psummed_exactly(loop):
    mesh, x, w, t = _data()
    grad = _grad(_looped(loop), mesh, t)
    got = jax.jit(grad)(x, w)
    assert max_err(got, _expected(x, w, t)) < 1e-4
    assert max_err(got, jax.jit(_grad(_looped(loop), mesh, t, check=False))(x, w)) < 1e-5
    assert psum_axes(grad, x, w) == [("data",)]


@pytest.mark.parametrize("loop", ["fori_loop", "while_loop"])
def test_a_loop_adding_a_replicated_part_is_still_refused(loop):
    mesh, x, w, t = _data()
    with pytest.raises(reprules.CotangentError, match=r"(?s)input 1 \('w'\).*varies over \{'data'\}"):
        jax.jit(_grad(_looped(loop, replicated_part=True), mesh, t))(x, w)
