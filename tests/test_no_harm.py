"""Code that registers nothing, or annotates out_shape itself, is left alone."""

import jax
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from helpers import NEW_SHARD_MAP, make_mesh, put, randn, shard_map


def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def unrelated_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


@jax.custom_vjp
def scale(x, w):
    return x * w


scale.defvjp(lambda x, w: (x * w, (x, w)), lambda r, g: (g * r[1], g * r[0]))


def _texts():
    """jaxpr and StableHLO of programs that use no rule: a check-off Pallas
    step, a checked jnp step with a custom_vjp, and an unsharded custom_vjp."""
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    w = put(randn(1, (8, 128)), mesh, P("data", None))
    t = randn(2, (8, 128))

    def copy(x):
        return pl.pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)

    pallas_body = jax.custom_vjp(copy)
    pallas_body.defvjp(lambda x: (copy(x), None), lambda _, g: (copy(g),))

    programs = [
        (jax.grad(lambda x: (shard_map(pallas_body, mesh, P("data", None), P("data", None), check=False)(x) * t).sum()), (x,)),
        (jax.grad(lambda x, w: (shard_map(scale, mesh, (P("data", None),) * 2, P("data", None))(x, w) * t).sum()), (x, w)),
        (jax.grad(lambda x, w: (scale(x, w) * t).sum()), (x, w)),
    ]
    return [(str(jax.make_jaxpr(f)(*args)), jax.jit(f).lower(*args).as_text()) for f, args in programs]


def test_programs_without_rules_lower_identically():
    before = _texts()
    reprules.replication_rule()(unrelated_kernel)  # reprules active for another kernel
    during = _texts()
    reprules.unregister(unrelated_kernel)  # last rule gone: every patch undone
    after = _texts()
    assert during == before
    assert after == before


@pytest.mark.skipif(not NEW_SHARD_MAP, reason="out_shape carries no varying axes before JAX 0.6")
def test_user_annotation_of_out_shape_wins_over_the_rule():
    reprules.replication_rule()(copy_kernel)  # same(): would type the output {data}
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    t = jax.typeof(x)  # only to pick the right keyword for this JAX
    keyword = "vma" if hasattr(t, "vma") else "manual_axis_type"

    def annotated(axes):
        if keyword == "vma":
            return jax.ShapeDtypeStruct((2, 128), x.dtype, vma=frozenset(axes))
        from jax._src.core import ManualAxisType  # test-only: building the annotation

        return jax.ShapeDtypeStruct((2, 128), x.dtype, manual_axis_type=ManualAxisType(varying=frozenset(axes)))

    def body(x):  # the user says: varies over data *and* model
        return pl.pallas_call(copy_kernel, out_shape=annotated({"data", "model"}), interpret=True)(x)

    with pytest.raises(ValueError, match="out_specs"):
        jax.jit(shard_map(body, mesh, P("data", None), P("data", None)))(x)
    out = jax.jit(shard_map(body, mesh, P("data", None), P("data", "model")))(x)
    assert out.shape == (8, 256)
