"""Each output of a derived rule is typed by the inputs *it* depends on, on every era.

A kernel returning ``(x * w, w + 1)`` with ``x`` varying over ``data`` and ``w``
replicated: output 1 depends on ``w`` alone, so it is replicated, and
``out_specs=P()`` for it is accepted. JAX 0.6+ typed it so; on the rep era
(0.4.28 - 0.5.x) reprules cast ``w`` up to ``{data}`` for output 0 before the
kernel, and JAX's check pass, deciding again from the cast ``w``, typed output 1
varying over ``data`` too: sound, but ``out_specs=P()`` was refused, and a
program written around it (``P("data")`` for output 1) got a defensive psum back.
A ``pallas_call`` has no transpose rule, so its inputs are no longer cast there
(as on the vma era): both passes decide from the inputs as given.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from helpers import count_all_reduce, max_err, psum_axes, put, randn, shard_map
from reprules import rules


def kernel(x_ref, w_ref, o_ref, p_ref):
    o_ref[...] = x_ref[...] * w_ref[...]
    p_ref[...] = w_ref[...] + 1.0


def scale_and_shift(x, w):
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(kernel, out_shape=(shape, shape), interpret=True)(x, w)


@jax.custom_vjp
def differentiable(x, w):
    return scale_and_shift(x, w)


def _fwd(x, w):
    return scale_and_shift(x, w), (x, w)


def _bwd(res, cts):
    # The tests take no gradient through output 1 (it is stop_gradient-ed, so its
    # cotangent is zero): w's cotangent is output 0's, x * g0, which varies over
    # data; JAX (or reprules' custom_vjp support on 0.6+) psums it over data.
    x, w = res
    g0, _ = cts
    out = scale_and_shift(g0, w)[0], scale_and_shift(g0, x)[0]
    return out


differentiable.defvjp(_fwd, _bwd)


@pytest.fixture
def setup(mesh):
    x = put(randn(0, (8, 128)), mesh, P("data"))  # (2, 128) per data shard
    w = put(randn(1, (2, 128)), mesh, P())  # replicated
    return mesh, x, w


def test_the_output_that_depends_on_the_replicated_input_alone_is_replicated(setup):
    mesh, x, w = setup
    step = jax.jit(shard_map(scale_and_shift, mesh, (P("data"), P()), (P("data"), P())))
    out0, out1 = step(x, w)  # before, on 0.4.28 - 0.5.x: out_specs[1] P() refused
    xn, wn = np.asarray(x), np.asarray(w)
    assert max_err(out0, xn * np.tile(wn, (4, 1))) == 0.0
    assert max_err(out1, wn + 1.0) == 0.0


def test_output_zero_still_varies_over_data(setup):
    mesh, x, w = setup
    step = jax.jit(shard_map(scale_and_shift, mesh, (P("data"), P()), (P(), P())))
    with pytest.raises(ValueError, match="out_specs"):
        step(x, w)


def test_a_declared_rule_that_unites_its_inputs_still_types_both_outputs_varying(setup):
    mesh, x, w = setup
    reprules.replication_rule(rules.same())(kernel)
    step = jax.jit(shard_map(scale_and_shift, mesh, (P("data"), P()), (P("data"), P())))
    with pytest.raises(ValueError, match="out_specs"):
        step(x, w)
    ok = jax.jit(shard_map(scale_and_shift, mesh, (P("data"), P()), (P("data"), P("data"))))
    out0, out1 = ok(x, w)
    assert max_err(out1, np.tile(np.asarray(w) + 1.0, (4, 1))) == 0.0


def _loss(mesh, t0, t1, check):
    def body(x, w, v):
        out0, out1 = differentiable(x, w)
        return out0, jax.lax.stop_gradient(out1) * v

    step = shard_map(body, mesh, (P("data"), P(), P()), (P("data"), P()), check=check)

    def loss(x, w, v):
        out0, out1 = step(x, w, v)
        return (out0 * t0).sum() + (out1 * t1).sum()

    return jax.grad(loss, argnums=(0, 1, 2))


def test_gradients_are_exact_with_only_the_needed_psum(setup):
    mesh, x, w = setup
    v = randn(2, (2, 128))
    t0, t1 = randn(3, (8, 128)), randn(4, (2, 128))
    on, off = _loss(mesh, t0, t1, check=True), _loss(mesh, t0, t1, check=False)
    # w's cotangent is psummed over data (needed); v's is replicated: no psum at all.
    assert psum_axes(on, x, w, v) == [("data",)]
    assert count_all_reduce(on, x, w, v)[0] == 1
    got, unchecked = jax.jit(on)(x, w, v), jax.jit(off)(x, w, v)
    xn, wn, vn, t0n, t1n = (np.asarray(a) for a in (x, w, v, t0, t1))
    reference = (t0n * np.tile(wn, (4, 1)), (t0n * xn).reshape(4, 2, 128).sum(0), (wn + 1.0) * t1n)
    for g, u, r in zip(got, unchecked, reference):
        assert max_err(g, r) < 1e-4
        assert max_err(g, u) < 1e-4


def test_verify_finds_the_replicated_output_replicated(setup):
    mesh, x, w = setup
    step = jax.jit(shard_map(scale_and_shift, mesh, (P("data"), P()), (P("data"), P())))
    with reprules.verify():
        out1 = step(x, w)[1]
    assert max_err(out1, np.asarray(w) + 1.0) == 0.0
