"""User primitives with a rule: typed by the rule on every regime.

The primitive's abstract eval builds ``ShapedArray(shape, dtype)``, dropping
the varying axes (as third-party primitives do): without reprules, JAX >= 0.6
silently types its output replicated, accepts ``out_specs=P()`` and returns one
device's shard (see the strict mode for catching that).
"""

import re

import jax
import numpy as np
import pytest
from helpers import (
    NEW_SHARD_MAP,
    VARYING_OVER_DATA,
    count_all_reduce,
    make_mesh,
    max_err,
    psum_axes,
    put,
    randn,
    shard_map,
)
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

import reprules
from reprules import rules


def _elementwise(name, fn, n_in):
    p = Primitive(name)
    p.def_impl(fn)
    p.def_abstract_eval(lambda *avals: ShapedArray(avals[0].shape, avals[0].dtype))  # drops vma
    mlir.register_lowering(p, mlir.lower_fun(fn, multiple_results=False))
    return p


copy_p = _elementwise("my_copy", lambda x: x * 1.0, 1)
mul_p = _elementwise("my_mul", lambda x, w: x * w, 2)


@jax.custom_vjp
def prim_mul(x, w):
    return mul_p.bind(x, w)


prim_mul.defvjp(lambda x, w: (mul_p.bind(x, w), (x, w)), lambda r, g: (mul_p.bind(g, r[1]), (g * r[0]).sum(0)))


@jax.custom_vjp
def prim_copy(x):
    return copy_p.bind(x)


prim_copy.defvjp(lambda x: (copy_p.bind(x), None), lambda _, g: (copy_p.bind(g),))


def test_primitive_with_rule_no_defensive_all_reduce_and_exact_gradients():
    reprules.replication_rule(rules.same())(copy_p)
    assert "Primitive:my_copy" in reprules.registered()
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    t = randn(1, (8, 128))
    on = jax.grad(lambda x: (shard_map(prim_copy, mesh, P("data", None), P("data", None))(x) * t).sum())
    off = jax.grad(lambda x: (shard_map(prim_copy, mesh, P("data", None), P("data", None), check=False)(x) * t).sum())
    assert count_all_reduce(off, x) == (1, 1, 1)
    assert count_all_reduce(on, x) == (0, 0, 0)
    assert max_err(jax.jit(on)(x), t) < 1e-6


def test_primitive_output_type_shows_the_varying_axes():
    reprules.replication_rule(rules.same())(copy_p)
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    text = str(jax.make_jaxpr(shard_map(copy_p.bind, mesh, P("data", None), P("data", None)))(x))
    if NEW_SHARD_MAP:
        assert "my_copy" in text and re.search(VARYING_OVER_DATA, text.split("my_copy")[0].splitlines()[-1])
    # The output really varies: out_specs=P() must be refused by JAX, not accepted.
    with pytest.raises(ValueError, match="out_specs"):
        jax.jit(shard_map(copy_p.bind, mesh, P("data", None), P(None, None)))(x)


def test_primitive_mixed_inputs_cast_then_weight_gradient_over_data():
    reprules.replication_rule()(mul_p)
    mesh = make_mesh()
    x, w = put(randn(0, (8, 128)), mesh, P("data", None)), put(randn(1, (128,)), mesh, P())
    t = randn(2, (8, 128))
    grad = jax.grad(lambda x, w: (shard_map(prim_mul, mesh, (P("data", None), P()), P("data", None))(x, w) * t).sum(), argnums=(0, 1))
    expected = jax.grad(lambda x, w: (x * w * t).sum(), argnums=(0, 1))(np.asarray(x), np.asarray(w))
    assert max_err(jax.jit(grad)(x, w), expected) < 1e-4
    assert psum_axes(grad, x, w) == [("data",)]


def test_passing_mixed_inputs_as_they_are():
    """A rule that does not cast: the kernel takes mixed inputs, and the weight
    gradient is still psummed over exactly `data` (by the custom_vjp fix)."""
    def as_they_are(ctx, in_varying):
        return rules.Decision(outputs=(frozenset().union(*in_varying),), inputs=None)

    reprules.replication_rule(as_they_are)(mul_p)
    mesh = make_mesh()
    x, w = put(randn(0, (8, 128)), mesh, P("data", None)), put(randn(1, (128,)), mesh, P())
    t = randn(2, (8, 128))
    grad = jax.grad(lambda x, w: (shard_map(prim_mul, mesh, (P("data", None), P()), P("data", None))(x, w) * t).sum(), argnums=(0, 1))
    expected = jax.grad(lambda x, w: (x * w * t).sum(), argnums=(0, 1))(np.asarray(x), np.asarray(w))
    assert max_err(jax.jit(grad)(x, w), expected) < 1e-4
    assert psum_axes(grad, x, w) == [("data",)]


def test_unregister_primitive_restores_it():
    before = (copy_p.bind, copy_p.abstract_eval)
    reprules.replication_rule()(copy_p)
    reprules.replication_rule()(mul_p)
    reprules.unregister(copy_p)  # mul_p keeps reprules active
    assert (copy_p.bind, copy_p.abstract_eval) == before
