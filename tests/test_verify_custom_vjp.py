"""``reprules.verify()`` names a lying rule on a kernel called only in a
``custom_vjp`` bwd (issue 30).

The rule types the kernel's output replicated over ``data``; the kernel's
output (the cotangent of a primal varying over ``data``) in fact varies.
From JAX 0.8, JAX checks a bwd's output types and refused the cotangent typed
replicated ("Custom VJP bwd rule must produce an output with the same type as
the args tuple ..."), naming neither the kernel nor its rule, before verify
mode could run the check it inserted after the kernel. reprules now casts such
a cotangent up to its primal's type when a kernel with a rule is involved (a
cast that keeps every device's values, as it did already for a kernel in the
fwd), so the program runs and verify mode reports the kernel, its rule, the
axis, the mesh axes and the JAX version, on every JAX (0.4.28 - 0.5: JAX's own
check_rep rewrite; 0.6 - 0.7: JAX did not check bwd types).
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from helpers import CUSTOM_VJP3_MODES, custom_vjp3, make_mesh, max_err, put, randn, shard_map
from reprules import rules

vjp3 = pytest.mark.parametrize("vjp3", CUSTOM_VJP3_MODES, ids=lambda on: f"vjp3={'on' if on else 'off'}")


def double_kernel(g_ref, o_ref):
    o_ref[...] = g_ref[...] * 2.0


def kernel_double(g):
    return pl.pallas_call(double_kernel, out_shape=jax.ShapeDtypeStruct(g.shape, g.dtype), interpret=True)(g)


jitted_kernel_double = jax.jit(kernel_double)


def doubled(bwd_kernel):
    """``2 x`` by jnp in the fwd; the bwd doubles the cotangent with ``bwd_kernel`` only."""

    @jax.custom_vjp
    def f(x):
        return x * 2.0

    f.defvjp(lambda x: (x * 2.0, None), lambda _, g: (bwd_kernel(g),))
    return f


def cached(x):
    """The bwd's kernel through a jitted function traced already for the same
    types: the bwd reuses that trace and traces no kernel."""
    warm = jitted_kernel_double(jax.lax.stop_gradient(x))
    return doubled(jitted_kernel_double)(x) + 0.0 * warm


WAYS = {"direct": lambda x: doubled(kernel_double)(x), "cached-jit": cached}


def _grad(way, mesh, t, check=True):
    f = shard_map(WAYS[way], mesh, P("data", None), P("data", None), check=check)
    return jax.jit(jax.grad(lambda x: (f(x) * t).sum()))


@vjp3
@pytest.mark.parametrize("way", sorted(WAYS))
def test_verify_names_a_lying_rule_on_a_kernel_only_in_the_bwd(vjp3, way):
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    t = randn(1, (8, 128))
    reprules.replication_rule(rules.invariant("data"))(double_kernel)  # a lie: g varies over data
    with custom_vjp3(vjp3):
        with pytest.raises(reprules.ReplicationMismatchError) as lie:
            with reprules.verify():
                jax.block_until_ready(_grad(way, mesh, t)(x))
    assert re.match(
        r"Verify mode: output 0 of kernel 'double_kernel' is declared replicated over mesh axis 'data' by its "
        r"rule rules\.invariant\('data'\), but it differs across 'data' by up to [0-9.]+ at [0-9]+ element\(s\) "
        rf"\(mesh axes \{{'data', 'model'\}}, JAX {re.escape(jax.__version__)}\)\.\n"
        r"Why: .*\nFix: make the rule say the output varies over 'data'",
        str(lie.value),
    ), str(lie.value)


@vjp3
@pytest.mark.parametrize("way", sorted(WAYS))
def test_an_honest_rule_on_a_kernel_only_in_the_bwd_gives_the_exact_gradient(vjp3, way):
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    t = randn(1, (8, 128))
    reprules.replication_rule(rules.same())(double_kernel)
    with custom_vjp3(vjp3):
        with reprules.verify():
            got = _grad(way, mesh, t)(x)
        unchecked = _grad(way, mesh, t, check=False)(x)
    assert max_err(got, 2.0 * np.asarray(t)) == 0.0  # d/dx of (2x * t).sum()
    assert max_err(got, unchecked) == 0.0


def summed():
    """``psum(x, 'data') * 2w``: its bwd returns for ``x`` (varying over data) the
    cotangent ``g * 2w`` made by the kernel from replicated values, so replicated,
    and typed so by an honest rule (the VJP of a psum is that cotangent on every
    device)."""

    @jax.custom_vjp
    def f(x, w):
        return jax.lax.psum(x, "data") * (2.0 * w)

    f.defvjp(lambda x, w: (f(x, w), w), lambda w, g: (g * kernel_double(w), None))
    return f


@vjp3
def test_a_replicated_cotangent_from_a_kernel_is_cast_up_exactly(vjp3):
    """A kernel typed replicated by an honest rule gives the cotangent of a varying
    input: cast up to its type, every device's value kept (JAX >= 0.8 alone
    refuses the type; reprules did this already with a kernel in the fwd)."""
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    w = put(randn(1, (2, 128)), mesh, P())
    t = randn(2, (2, 128))
    reprules.replication_rule(rules.same())(double_kernel)
    with custom_vjp3(vjp3):
        f = shard_map(summed(), mesh, (P("data", None), P()), P())
        with reprules.verify():
            got = jax.jit(jax.grad(lambda x: (f(x, w) * t).sum()))(x)

    def reference(x):  # unsharded
        return ((x.reshape(4, 2, 128).sum(0) * 2.0 * w) * t).sum()

    assert max_err(got, jax.grad(reference)(np.asarray(x))) < 1e-5
