"""``jax.grad`` straight through a ``pallas_call`` (no ``custom_vjp``): JAX's refusal names the kernel.

JAX alone says only "Linearization failed to produce known values for all output
primals" (0.4.28: a bare AssertionError). reprules appends what happened (the
kernel and its line), why (a pallas_call has no VJP rule) and the fix (the
``custom_vjp`` of the README's example), on every path JAX raises it from, and
leaves the exception JAX's own. A kernel wrapped in ``custom_vjp``, and forward
mode, run as before.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from helpers import JAX_VERSION, make_mesh, put, shard_map


def square_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * x_ref[...]


def square(x):
    return pl.pallas_call(square_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


def _sharded(fn):
    return shard_map(fn, make_mesh(), P("data", None), P("data", None))


# Each builds its function anew: JAX caches a jit's JVP, and a cached one runs no JVP rule
# (on 0.4.28 - 0.6 the note names the kernels whose rule ran).
WAYS = {
    "grad": lambda x: jax.grad(lambda x: square(x).sum())(x),
    "grad of jit": lambda x: jax.grad(lambda x: jax.jit(lambda x: square(x))(x).sum())(x),
    "vjp": lambda x: jax.vjp(lambda x: square(x), x),
    "linearize": lambda x: jax.linearize(lambda x: square(x), x),
    "grad of shard_map": lambda x: jax.grad(lambda x: _sharded(lambda x: square(x))(x).sum())(x),
}

NOTE = (r"(?s)reprules: jax\.grad \(or jax\.vjp, jax\.linearize\) reached the Pallas kernel 'square_kernel' "
        r"\((defined|traced) at [^)]*test_reverse_mode_message\.py:\d+\), which JAX cannot differentiate in "
        rf"reverse mode \(JAX {re.escape(jax.__version__)}\)\.\n"
        r"Why: a pallas_call has no VJP rule: JAX differentiates it only forward \(jax\.jvp\).*\n"
        r"Fix: wrap the call in jax\.custom_vjp and give it a bwd.*as in reprules' README example:\n"
        r"    f = jax\.custom_vjp\(lambda x: pl\.pallas_call\(kernel, out_shape, \.\.\.\)\(x\)\)\n"
        r"    f\.defvjp\(")


@pytest.fixture(params=["default", "other"])
def linearize(request):
    """JAX's default way to linearize, and the other one where this JAX has two (0.5 - 0.9: JVP
    then partial eval, the default to 0.6, or direct linearize, the default from 0.7), each
    raising from its own place. 0.4.36 - 0.4.38's direct linearize fails on its own ("Value None
    ... is not a valid JAX type"), without reprules."""
    if request.param == "default":
        yield
        return
    if "jax_use_direct_linearize" not in jax.config.values or not (0, 5) <= JAX_VERSION < (0, 10):
        pytest.skip(f"JAX {jax.__version__} linearizes one way")
    was = jax.config.values["jax_use_direct_linearize"]
    jax.config.update("jax_use_direct_linearize", not was)
    try:
        yield
    finally:
        jax.config.update("jax_use_direct_linearize", was)


@pytest.mark.parametrize("way", WAYS)
def test_reverse_mode_through_a_pallas_call_names_the_kernel_why_and_the_fix(way, mesh, linearize):
    x = put(jnp.full((8, 128), 3.0), mesh, P("data", None))
    with pytest.raises((ValueError, AssertionError), match=NOTE) as caught:
        WAYS[way](x)
    text = str(caught.value)
    if isinstance(caught.value, ValueError):  # JAX's own message first (0.4.28: none, a bare assert)
        assert text.startswith("Linearization failed to produce known values for all output primals"), text
    assert text.count("reprules: jax.grad") == 1, text  # once, however many hooks saw it


def test_a_kernel_wrapped_in_custom_vjp_and_forward_mode_run_as_before(mesh):
    f = jax.custom_vjp(square)
    f.defvjp(lambda x: (f(x), x), lambda x, g: (2.0 * x * g,))
    x = jnp.full((8, 128), 3.0)
    np.testing.assert_allclose(jax.grad(lambda x: f(x).sum())(x), np.full((8, 128), 6.0))
    np.testing.assert_allclose(jax.jvp(square, (x,), (jnp.ones_like(x),))[1], np.full((8, 128), 6.0))
    sharded = jax.grad(lambda x: _sharded(f)(x).sum())(put(x, mesh, P("data", None)))
    np.testing.assert_allclose(sharded, np.full((8, 128), 6.0))
