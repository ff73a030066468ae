"""JAX's megablox ``gmm`` with per-shard group sizes, in TPU interpret mode, under inference.

An MoE layer shards its tokens *and* their group sizes over ``data``: each
shard has its own groups, so megablox's dynamic grid bound (the number of
active tiles, from the scalar-prefetched group sizes) varies per device. JAX's
TPU interpreter then compares program ids derived from it with invariant
constants (``pl.when(k_i == 0)``), which ``check_vma`` refuses at lowering
(``Primitive eq requires varying manual axes to match``) unless reprules'
interpret lowering fix covers TPU interpret mode (issue 30). Replicated group
sizes never hit this: tests/test_inference.py runs those with ``interpret=True``.

Both ways into JAX's TPU interpreter are run: ``interpret=pltpu.InterpretParams()``
(JAX 0.6+) and ``pltpu.force_tpu_interpret_mode()`` (0.7+). The reference is
``jax.lax.ragged_dot`` run unsharded on each shard's rows and group sizes
(0.11+: JAX 0.6 - 0.10's TPU interpreter hangs running megablox inside
shard_map). A copy kernel with a scalar-prefetched, per-device grid size runs
the same fix on every JAX with check_vma (0.6+), and shows it is scoped: a
kernel with no rule keeps JAX's own error.
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from helpers import JAX_VERSION, NEW_SHARD_MAP, max_err, megablox_in_own_process, psum_axes, put, randn, shard_map

pytestmark = pytest.mark.skipif(not NEW_SHARD_MAP, reason=(
    f"JAX {jax.__version__} has no check_vma (0.6+) and no public TPU interpreter "
    "(pltpu.InterpretParams, 0.6+); its own check_rep rule for scan refuses megablox's "
    "metadata loop anyway (tests/test_inference.py)"))

M, K, N = 128, 128, 128  # per data shard: one 128-row tile, so the grid is set by the groups
# Each shard's own group sizes (two groups summing to its M rows): empty groups and a
# split tile give each shard a different number of active tiles, hence grid size.
SIZES = np.array([[48, 80], [128, 0], [0, 128], [100, 28]], np.int32)


def _tpu_interpret(mode):
    """``gmm``'s keyword arguments and the context that run it in JAX's TPU interpreter."""
    from jax.experimental.pallas import tpu as pltpu

    if mode == "InterpretParams":
        return {"interpret": pltpu.InterpretParams()}, contextlib.nullcontext()
    if not hasattr(pltpu, "force_tpu_interpret_mode"):
        pytest.skip(f"JAX {jax.__version__} has no pltpu.force_tpu_interpret_mode (0.7+)")
    return {}, pltpu.force_tpu_interpret_mode()


def _gmm():
    try:
        from jax.experimental.pallas.ops.tpu.megablox import gmm
    except ImportError as err:  # pragma: no cover - every version of the matrix has it
        pytest.skip(f"JAX {jax.__version__} has no megablox gmm ({err})")
    return gmm


def _reference(lhs, rhs, t):
    """Output, lhs and rhs gradients of ``sum(ragged_dot(lhs, rhs, sizes) * t)``, per shard."""

    def loss(lhs, rhs, sizes, t):
        return (jax.lax.ragged_dot(lhs, rhs, sizes) * t).sum()

    outs, glhs, grhs = [], [], []
    for i, sizes in enumerate(SIZES):
        rows = slice(i * M, (i + 1) * M)
        outs.append(jax.lax.ragged_dot(lhs[rows], rhs, jnp.asarray(sizes)))
        gl, gr = jax.grad(loss, argnums=(0, 1))(lhs[rows], rhs, jnp.asarray(sizes), t[rows])
        glhs.append(gl)
        grhs.append(gr)
    # rhs is replicated: its gradient is the sum of every shard's.
    return np.concatenate(outs), np.concatenate(glhs), np.sum(grhs, axis=0)


@pytest.mark.skipif(JAX_VERSION < (0, 11), reason=(
    "JAX 0.6 - 0.10's TPU interpreter hangs running megablox gmm inside shard_map on 8 CPU "
    "devices, JAX alone too (check_vma=False, no reprules, replicated group sizes; seen on 0.6.2, "
    "0.7.2, 0.8.3, 0.9.2, 0.10.2: its _barrier and _allocate_buffer callbacks deadlock), and "
    "0.6 - 0.7's jnp.searchsorted (megablox's make_group_metadata) refuses per-shard group "
    "sizes under check_vma; the dynamic-grid test below covers the fix there"))
@pytest.mark.parametrize("mode", ["InterpretParams", "force_tpu_interpret_mode"])
def test_gmm_with_group_sizes_sharded_over_data_equals_ragged_dot_per_shard(mesh, mode):
    if os.environ.get(_INNER) != mode:
        return megablox_in_own_process(
            __file__, f"test_gmm_with_group_sizes_sharded_over_data_equals_ragged_dot_per_shard[{mode}]", {_INNER: mode})
    gmm = _gmm()
    kwargs, interpret = _tpu_interpret(mode)
    lhs, rhs, t = randn(0, (4 * M, K)), randn(1, (len(SIZES[0]), K, N)), randn(2, (4 * M, N))

    def grouped(lhs, rhs, sizes):
        return gmm(lhs, rhs, sizes, preferred_element_type=jnp.float32, tiling=(128, 128, 128), **kwargs)

    specs = (P("data", None), P(), P("data"))
    f = shard_map(grouped, mesh, specs, P("data", None))

    def loss(lhs, rhs, sizes):
        return (f(lhs, rhs, sizes) * t).sum()

    args = [put(a, mesh, s) for a, s in zip((lhs, rhs, jnp.asarray(SIZES.reshape(-1))), specs)]
    grad = jax.grad(loss, argnums=(0, 1))
    with interpret, reprules.inference():
        out = jax.jit(f)(*args)
        glhs, grhs = jax.jit(grad)(*args)
        psums = psum_axes(grad, *args)
    expected, expected_lhs, expected_rhs = _reference(lhs, rhs, t)
    assert max_err(out, expected) < 1e-4
    assert max_err(glhs, expected_lhs) < 1e-4
    assert max_err(grhs, expected_rhs) / np.abs(expected_rhs).max() < 1e-5
    assert psums == [("data",)]  # the replicated rhs's gradient; nothing over 'model'


_INNER = "REPRULES_MEGABLOX_MODE"


def _first_step_copy(n_ref, x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)  # a program id of a per-device grid against a constant
    def _():
        o_ref[...] = x_ref[...]


def _dynamic_grid_copy(n, x):
    """A copy whose grid size is ``n[0]`` (scalar-prefetched, as megablox's), out_shape
    annotated by hand like ``x`` (no rule needed), in TPU interpret mode."""
    from jax.experimental.pallas import tpu as pltpu

    t = jax.typeof(x)
    if hasattr(t, "vma"):  # 0.6 - 0.9
        out = jax.ShapeDtypeStruct(x.shape, x.dtype, vma=t.vma)
    else:  # 0.10+
        out = jax.ShapeDtypeStruct(x.shape, x.dtype, manual_axis_type=t.mat)
    block = pl.BlockSpec((8, 128), lambda i, n_ref: (0, 0))
    return pl.pallas_call(_first_step_copy, out_shape=out, interpret=pltpu.InterpretParams(),
                          grid_spec=pltpu.PrefetchScalarGridSpec(
                              num_scalar_prefetch=1, grid=(n[0],), in_specs=[block], out_specs=block))(n, x)


def _unrelated_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def test_tpu_interpret_fix_is_only_for_kernels_with_a_rule(mesh):
    """A per-device grid bound in JAX's TPU interpreter: JAX alone refuses it. With
    reprules active for another kernel the call has no rule, and JAX's own error
    stands; under inference the call has a rule, and the fix runs it."""
    n = put(jnp.array([1, 2, 3, 4], jnp.int32), mesh, P("data"))
    x = put(randn(0, (32, 128)), mesh, P("data", None))
    f = jax.jit(shard_map(_dynamic_grid_copy, mesh, (P("data"), P("data", None)), P("data", None)))

    def outcome():
        try:
            return np.asarray(f(n, x))
        except ValueError as err:
            return str(err).splitlines()[0]

    alone = outcome()
    reprules.replication_rule()(_unrelated_kernel)
    during = outcome()
    reprules.unregister(_unrelated_kernel)
    with reprules.inference():
        fixed = outcome()
    assert isinstance(alone, str) and "varying manual axes to match" in alone  # JAX's own refusal
    assert during == alone
    assert not isinstance(fixed, str), fixed
    assert max_err(fixed, x) == 0.0
