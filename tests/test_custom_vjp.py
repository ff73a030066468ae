"""custom_vjp backward rules whose cotangent varies over more axes than its primal.

A replicated weight used on sharded activations: the bwd rule returns a weight
cotangent that varies over ``data``. JAX <= 0.5 psums it under check_rep; from
0.6.2 JAX refuses it. With reprules active, every version gives the psum over
exactly those axes, and the gradient is exact.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import reprules
from helpers import JAX_VERSION, count_all_reduce, make_mesh, max_err, psum_axes, put, randn, shard_map


@jax.custom_vjp
def mul(x, w):
    return x * w


mul.defvjp(lambda x, w: (x * w, (x, w)), lambda res, g: (g * res[1], (g * res[0]).sum(0)))


def _loss(check):
    mesh = make_mesh()
    f = shard_map(mul, mesh, (P("data", None), P()), P("data", None), check=check)
    t = randn(2, (16, 32))
    return mesh, t, lambda x, w: (f(x, w) * t).sum()


def _any_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def test_weight_cotangent_is_psummed_over_exactly_data():
    reprules.replication_rule()(_any_kernel)  # activates reprules
    mesh, t, loss = _loss(check=True)
    x = put(randn(0, (16, 32)), mesh, P("data", None))
    w = put(randn(1, (32,)), mesh, P())
    grad = jax.grad(loss, argnums=(0, 1))
    expected = jax.grad(lambda x, w: (x * w * t).sum(), argnums=(0, 1))(np.asarray(x), np.asarray(w))
    assert max_err(jax.jit(grad)(x, w), expected) < 1e-4
    assert psum_axes(grad, x, w) == [("data",)]
    assert count_all_reduce(grad, x, w) == (1, 1, 1)


@pytest.mark.skipif(JAX_VERSION < (0, 6, 2), reason="JAX <= 0.5 psums such cotangents itself")
def test_without_reprules_new_jax_refuses_it():
    assert not reprules.registered()
    mesh, t, loss = _loss(check=True)
    x = put(randn(0, (16, 32)), mesh, P("data", None))
    w = put(randn(1, (32,)), mesh, P())
    with pytest.raises(Exception) as info:  # _RepError (0.6), ValueError (0.7+)
        jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    assert not isinstance(info.value, reprules.ReprulesError)
