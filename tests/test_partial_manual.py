"""A partially manual shard_map: rules see only its manual axes (issue 14, finding 5).

Manual over ``data``, automatic over ``model`` (``auto={"model"}`` on JAX <= 0.5,
``axis_names={"data"}`` from 0.6). A value cannot vary over an automatic axis,
so ``RuleContext.mesh_axes`` is ``("data",)`` and a rule naming ``model`` is
refused, on every version.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from helpers import JAX_VERSION, NEW_SHARD_MAP, make_mesh, max_err, put, randn
from reprules import rules

# XLA:CPU never finishes compiling a partially manual shard_map on 0.4.28 (even
# with a plain `x * 2` body; 0.4.38 compiles it): there, only trace.
COMPILES = JAX_VERSION >= (0, 4, 38)


def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def body(x):
    return pl.pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


def partially_manual(f, mesh):
    """``f`` in a checked shard_map, manual over ``data`` and automatic over ``model``."""
    if NEW_SHARD_MAP:
        return jax.shard_map(f, mesh=mesh, in_specs=P("data", None), out_specs=P("data", None),
                             axis_names=frozenset({"data"}), check_vma=True)
    from jax.experimental.shard_map import shard_map  # 0.4.28 - 0.5.x

    return shard_map(f, mesh, P("data", None), P("data", None), check_rep=True, auto=frozenset({"model"}))


@pytest.fixture
def setup():
    mesh = make_mesh()
    return mesh, put(randn(0, (8, 128)), mesh, P("data", None))


def test_rule_context_names_only_the_manual_axes(setup):
    mesh, x = setup
    seen = []

    def recording(ctx, in_varying):
        seen.append((ctx.mesh_axes, tuple(in_varying)))
        return rules.same()(ctx, in_varying)

    reprules.replication_rule(recording)(copy_kernel)
    step = jax.jit(partially_manual(body, mesh))
    jax.make_jaxpr(step)(x)
    assert seen and set(seen) == {(("data",), (frozenset({"data"}),))}
    if not COMPILES:
        pytest.skip("JAX 0.4.28: XLA:CPU hangs compiling a partially manual shard_map; traced only")
    assert max_err(step(x), np.asarray(x)) == 0.0


def test_rule_naming_an_automatic_axis_is_refused(setup):
    mesh, x = setup
    reprules.replication_rule(rules.varying("model"))(copy_kernel)
    with pytest.raises(reprules.RuleError, match=r"(?s)\['model'\].*not manual axes"):
        jax.make_jaxpr(jax.jit(partially_manual(body, mesh)))(x)


def test_a_rule_naming_the_manual_axis_still_works(setup):
    mesh, x = setup
    reprules.replication_rule(rules.varying("data"))(copy_kernel)
    step = jax.jit(partially_manual(lambda x: body(x) + jnp.zeros_like(x), mesh))
    jax.make_jaxpr(step)(x)
    if COMPILES:
        assert max_err(step(x), np.asarray(x)) == 0.0
