"""Kernel shapes the rules must handle: mixed inputs, several outputs, grids,
partials, ``name=``, and two same-named kernels with different rules."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import kernels_a
import kernels_b
import reprules
from helpers import JAX_VERSION, _eqns, count_all_reduce, make_mesh, max_err, psum_axes, put, randn, shard_map
from reprules import rules


# --- mixed inputs: sharded activations times a replicated weight --------------
def scale_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] * w_ref[...]


def weight_grad_kernel(g_ref, x_ref, o_ref):
    o_ref[...] = jnp.sum(g_ref[...] * x_ref[...], axis=0, keepdims=True)


def scale(x, w):
    return pl.pallas_call(scale_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, w)


@jax.custom_vjp
def kernel_scale(x, w):
    return scale(x, w)


def _scale_fwd(x, w):
    return scale(x, w), (x, w)


def _scale_bwd(res, g):
    x, w = res
    dw = pl.pallas_call(weight_grad_kernel, out_shape=jax.ShapeDtypeStruct(w.shape, w.dtype), interpret=True)(g, x)
    return scale(g, w), dw  # dw varies over `data`: it needs the psum, and only that one


kernel_scale.defvjp(_scale_fwd, _scale_bwd)


def test_mixed_inputs_only_the_weight_gradient_is_all_reduced_over_data():
    reprules.replication_rule()(scale_kernel)
    reprules.replication_rule()(weight_grad_kernel)
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    w = put(randn(1, (1, 128)), mesh, P())
    t = randn(2, (8, 128))
    sharded = shard_map(kernel_scale, mesh, (P("data", None), P()), P("data", None))

    def loss(x, w):
        return (sharded(x, w) * t).sum()

    grad = jax.grad(loss, argnums=(0, 1))
    reference = jax.grad(lambda x, w: (x * w * t).sum(), argnums=(0, 1))(np.asarray(x), np.asarray(w))
    assert max_err(jax.jit(grad)(x, w), reference) < 1e-4
    assert psum_axes(grad, x, w) == [("data",)]
    assert count_all_reduce(grad, x, w) == (1, 1, 1)

    # Checking off: the weight gradient is all-reduced over `model` as well (defensive).
    unchecked = shard_map(kernel_scale, mesh, (P("data", None), P()), P("data", None), check=False)
    grad_off = jax.grad(lambda x, w: (unchecked(x, w) * t).sum(), argnums=(0, 1))
    assert any("model" in axes for axes in psum_axes(grad_off, x, w))
    assert max_err(jax.jit(grad_off)(x, w), reference) < 1e-4


@pytest.mark.skipif(JAX_VERSION < (0, 6), reason="casts are pvary equations from JAX 0.6 (check_vma)")
def test_inputs_are_not_cast_when_no_output_aliases_one():
    """pallas_call has no transpose rule, so a cast of its inputs would only add
    equations: its outputs are typed by the rule, and a custom_vjp's cotangents
    are psummed by reprules. The forward has no pvary; the output still varies
    over `data`; the gradient is exact, with the one psum it needs."""
    reprules.replication_rule()(scale_kernel)
    reprules.replication_rule()(weight_grad_kernel)
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    w = put(randn(1, (1, 128)), mesh, P())
    t = randn(2, (8, 128))
    sharded = shard_map(kernel_scale, mesh, (P("data", None), P()), P("data", None))

    names = [e.primitive.name for e in _eqns(jax.make_jaxpr(sharded)(x, w).jaxpr)]
    assert "pallas_call" in names and "pvary" not in names and "pcast" not in names
    with pytest.raises(ValueError, match="out_specs"):  # typed as varying over `data`
        jax.jit(shard_map(kernel_scale, mesh, (P("data", None), P()), P()))(x, w)

    grad = jax.grad(lambda x, w: (sharded(x, w) * t).sum(), argnums=(0, 1))
    reference = jax.grad(lambda x, w: (x * w * t).sum(), argnums=(0, 1))(np.asarray(x), np.asarray(w))
    assert max_err(jax.jit(grad)(x, w), reference) < 1e-4
    assert psum_axes(grad, x, w) == [("data",)]


def multiply_into_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] * w_ref[...]


def test_an_output_aliasing_a_replicated_input_varies_by_the_rule():
    """JAX types an aliased output like its input: that input is cast up to what
    the rule says (here: `w`, replicated, written with `x`, which varies)."""
    reprules.replication_rule()(multiply_into_kernel)
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    w = put(randn(1, (2, 128)), mesh, P())

    def body(x, w):
        return pl.pallas_call(multiply_into_kernel, out_shape=jax.ShapeDtypeStruct(w.shape, w.dtype),
                              input_output_aliases={1: 0}, interpret=True)(x, w)

    out = jax.jit(shard_map(body, mesh, (P("data", None), P()), P("data", None)))(x, w)
    assert max_err(out, np.asarray(x) * np.tile(np.asarray(w), (4, 1))) == 0.0
    with pytest.raises(ValueError, match="out_specs"):  # not typed replicated, like `w`
        jax.jit(shard_map(body, mesh, (P("data", None), P()), P()))(x, w)


# --- several outputs, grid and BlockSpecs ---------------------------------------
def two_outputs_kernel(x_ref, plus_ref, times_ref):
    plus_ref[...] = x_ref[...] + 1.0
    times_ref[...] = x_ref[...] * 2.0


def block_spec(shape, index_map):
    if JAX_VERSION < (0, 4, 31):  # BlockSpec(index_map, block_shape) before 0.4.31
        return pl.BlockSpec(index_map, shape)
    return pl.BlockSpec(shape, index_map)


def two_outputs(x, grid):
    sds = jax.ShapeDtypeStruct(x.shape, x.dtype)
    if grid:
        spec = block_spec((x.shape[0], 64), lambda j: (0, j))
        return pl.pallas_call(
            two_outputs_kernel, out_shape=(sds, sds), grid=(x.shape[1] // 64,),
            in_specs=[spec], out_specs=(spec, spec), interpret=True,
        )(x)
    return pl.pallas_call(two_outputs_kernel, out_shape=[sds, sds], interpret=True)(x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def kernel_two_outputs(x, grid):
    return two_outputs(x, grid)


kernel_two_outputs.defvjp(
    lambda x, grid: (two_outputs(x, grid), None),
    lambda grid, _, g: (g[0] + 2.0 * g[1],),
)


@pytest.mark.parametrize("grid", [False, True], ids=["whole-array", "grid-blockspec"])
def test_several_outputs(grid):
    reprules.replication_rule()(two_outputs_kernel)
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    t1, t2 = randn(1, (8, 128)), randn(2, (8, 128))
    f = shard_map(functools.partial(_call_two, grid=grid), mesh, P("data", None), (P("data", None), P("data", None)))
    plus, times = jax.jit(f)(x)
    assert max_err((plus, times), (np.asarray(x) + 1, np.asarray(x) * 2)) == 0.0

    def loss(x):
        a, b = f(x)
        return (a * t1).sum() + (b * t2).sum()

    assert count_all_reduce(jax.grad(loss), x) == (0, 0, 0)
    assert max_err(jax.jit(jax.grad(loss))(x), t1 + 2 * t2) < 1e-5


def _call_two(x, grid):
    return kernel_two_outputs(x, grid)


# --- partials and name= ---------------------------------------------------------
def affine_kernel(x_ref, o_ref, *, a, b):
    o_ref[...] = a * x_ref[...] + b


@pytest.mark.parametrize("name", [None, "my_affine"])
def test_partial_kernel_and_name_find_the_rule(name):
    reprules.replication_rule()(affine_kernel)
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))

    def body(x):
        kernel = functools.partial(functools.partial(affine_kernel, a=3.0), b=1.0)
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name=name, interpret=True)(x)

    out = jax.jit(shard_map(body, mesh, P("data", None), P("data", None)))(x)
    assert max_err(out, 3.0 * np.asarray(x) + 1.0) < 1e-6


# --- two kernels named alike, in two modules, with different rules ---------------
def test_same_named_kernels_keep_their_own_rules():
    assert kernels_a.copy_kernel.__name__ == kernels_b.copy_kernel.__name__
    reprules.replication_rule(rules.same())(kernels_a.copy_kernel)
    reprules.replication_rule(rules.varying("model"))(kernels_b.copy_kernel)
    assert set(reprules.registered()) == {"kernels_a.copy_kernel", "kernels_b.copy_kernel"}
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))

    # a: varies over data only, so out_specs may leave `model` out.
    out = jax.jit(shard_map(kernels_a.copy, mesh, P("data", None), P("data", None)))(x)
    assert max_err(out, x) == 0.0
    # b: declared to vary over `model` too, so the same out_specs is refused by JAX.
    with pytest.raises(ValueError, match="out_specs"):
        jax.jit(shard_map(kernels_b.copy, mesh, P("data", None), P("data", None)))(x)
    out = jax.jit(shard_map(kernels_b.copy, mesh, P("data", None), P("data", "model")))(
        put(randn(0, (8, 256)), mesh, P("data", None))
    )
    assert out.shape == (8, 512)


# --- invariant(): a kernel whose outputs are replicated over an axis -------------
def test_invariant_types_outputs_as_replicated():
    def first_kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...]

    reprules.replication_rule(rules.invariant("data"))(first_kernel)
    mesh = make_mesh()
    x = put(jnp.ones((8, 128)), mesh, P(None, None))  # replicated: invariant() is honest
    y = put(randn(1, (32, 128)), mesh, P("data", None))

    def body(x, y):
        return pl.pallas_call(first_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, y)

    # Typed replicated over `data` although y varies over it, so out_specs=P() is accepted.
    out = jax.jit(shard_map(body, mesh, (P(None, None), P("data", None)), P(None, None)))(x, y)
    assert max_err(out, np.ones((8, 128))) == 0.0


def test_array_as_out_shape_is_typed_by_the_rule():
    """JAX's own ops pass an array as out_shape (attention: ``out_shape=[q]``);
    its type must come from the rule, not be read off the array and dropped."""
    def double_kernel(x_ref, o_ref):
        o_ref[...] = 2.0 * x_ref[...]

    reprules.replication_rule()(double_kernel)
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))

    def body(x):
        return pl.pallas_call(double_kernel, out_shape=x, interpret=True)(x)

    out = jax.jit(shard_map(body, mesh, P("data", None), P("data", None)))(x)
    assert max_err(out, 2.0 * np.asarray(x)) == 0.0
    with pytest.raises(ValueError, match="out_specs"):
        jax.jit(shard_map(body, mesh, P("data", None), P(None, None)))(x)
