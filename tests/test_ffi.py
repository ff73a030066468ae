"""ffi_call targets with a rule, on the real opaque C++ CPU kernels.

XLA cannot see through the custom call, so the check-off defensive all-reduce
stays in the compiled HLO: compiled counts here are never constant-folded.
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
from jax.sharding import PartitionSpec as P

import reprules
from reprules import rules
from reprules.testing import cpu_kernels as kernels

pytestmark = pytest.mark.skipif(kernels.unavailable_reason() is not None, reason=str(kernels.unavailable_reason()))


@jax.custom_vjp
def ffi_copy(x):
    return kernels.copy(x)


ffi_copy.defvjp(lambda x: (kernels.copy(x), None), lambda _, g: (kernels.copy(g),))


@jax.custom_vjp
def ffi_mul(x, w):
    return kernels.mul(x, w)


ffi_mul.defvjp(
    lambda x, w: (kernels.mul(x, w), (x, w)),
    lambda r, g: (kernels.mul(g, r[1]), kernels.mul_rowsum(g, r[0], r[1].shape)),
)


@pytest.fixture
def data():
    mesh = make_mesh()
    return mesh, put(randn(0, (8, 128)), mesh, P("data", None)), put(randn(1, (128,)), mesh, P()), randn(2, (8, 128))


def test_ffi_copy_with_rule_drops_the_defensive_all_reduce(data):
    mesh, x, _, t = data
    off = jax.grad(lambda x: (shard_map(ffi_copy, mesh, P("data", None), P("data", None), check=False)(x) * t).sum())
    assert count_all_reduce(off, x) == (1, 1, 1)  # opaque: XLA cannot fold it
    reprules.replication_rule(rules.same())(reprules.ffi_target("reprules_copy"))
    assert "ffi_target:reprules_copy" in reprules.registered()
    on = jax.grad(lambda x: (shard_map(ffi_copy, mesh, P("data", None), P("data", None))(x) * t).sum())
    assert count_all_reduce(on, x) == (0, 0, 0)
    assert max_err(jax.jit(on)(x), t) == 0.0
    assert max_err(jax.jit(on)(x), jax.jit(off)(x)) < 1e-6


def test_ffi_output_type_varies_and_replicated_out_specs_is_refused(data):
    mesh, x, _, _ = data
    reprules.replication_rule(rules.same())(reprules.ffi_target("reprules_copy"))
    if NEW_SHARD_MAP:
        text = str(jax.make_jaxpr(shard_map(kernels.copy, mesh, P("data", None), P("data", None)))(x))
        assert re.search(VARYING_OVER_DATA, text.split("ffi_call")[0].splitlines()[-1])
    with pytest.raises(ValueError, match="out_specs"):
        jax.jit(shard_map(kernels.copy, mesh, P("data", None), P(None, None)))(x)


def test_ffi_mixed_inputs_only_the_weight_gradient_over_data(data):
    mesh, x, w, t = data
    reprules.replication_rule(rules.same())(reprules.ffi_target("reprules_mul"))
    reprules.replication_rule(rules.same())(reprules.ffi_target("reprules_mul_rowsum"))
    sharded = shard_map(ffi_mul, mesh, (P("data", None), P()), P("data", None))
    grad = jax.grad(lambda x, w: (sharded(x, w) * t).sum(), argnums=(0, 1))
    expected = jax.grad(lambda x, w: (x * w * t).sum(), argnums=(0, 1))(np.asarray(x), np.asarray(w))
    assert max_err(jax.jit(grad)(x, w), expected) < 1e-4
    assert psum_axes(grad, x, w) == [("data",)]
    assert count_all_reduce(grad, x, w) == (1, 1, 1)
