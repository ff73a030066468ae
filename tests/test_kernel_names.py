"""Rules by qualified name (``reprules.kernel_named("module:qualname")``), for
nested kernels that are new function objects on every call."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import JAX_VERSION, count_all_reduce, make_mesh, max_err, put, randn, shard_map
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from reprules import rules

NAME = f"{__name__}:nested_scale.<locals>.kernel"


def nested_scale(x):
    def kernel(x_ref, o_ref):  # a new object on every call: only its name is stable
        o_ref[...] = x_ref[...] * 2.0

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


@jax.custom_vjp
def scale(x):
    return nested_scale(x)


scale.defvjp(lambda x: (nested_scale(x), None), lambda _, g: (nested_scale(g),))


def module_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0


def module_scale(x):
    return pl.pallas_call(module_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


@pytest.fixture
def setup():
    mesh = make_mesh()
    return mesh, put(randn(0, (8, 128)), mesh, P("data", None)), randn(1, (8, 128))


def test_a_nested_kernel_gets_its_rule_by_name(setup):
    mesh, x, w = setup
    reprules.replication_rule(rules.same())(reprules.kernel_named(NAME))
    f = shard_map(scale, mesh, P("data", None), P("data", None))
    grad = jax.grad(lambda x: (f(x) * w).sum())
    assert count_all_reduce(grad, x) == (0, 0, 0)
    assert max_err(jax.jit(grad)(x), 2.0 * np.asarray(w)) < 1e-6
    assert f"kernel_named:{NAME}" in reprules.registered()


def test_a_rule_on_the_object_wins_over_a_name(setup):
    mesh, x, _ = setup
    reprules.replication_rule(rules.varying("model"))(reprules.kernel_named(f"{__name__}:module_kernel"))
    f = jax.jit(shard_map(module_scale, mesh, P("data", None), P("data", None)))
    with pytest.raises(ValueError, match="out_specs"):  # the name's rule: varies over model too
        f(x)
    reprules.replication_rule(rules.same())(module_kernel)  # the object's rule wins
    assert max_err(f(x), 2.0 * np.asarray(x)) < 1e-6


def test_unregistering_a_name_removes_its_rule(setup, no_inference):
    mesh, x, _ = setup
    target = reprules.kernel_named(NAME)
    reprules.replication_rule()(target)
    f = shard_map(nested_scale, mesh, P("data", None), P("data", None))
    jax.jit(f)(x)
    reprules.replication_rule()(module_kernel)  # keeps reprules active
    assert reprules.unregister(target)
    with pytest.raises(reprules.MissingRuleError, match="'kernel'"):
        jax.jit(f)(x)


@pytest.mark.parametrize("bad", ["kernel", "a:b:c", ":kernel", "mod:", 3])
def test_a_malformed_name_is_refused(bad):
    with pytest.raises(reprules.RegistrationError, match=r"(?s)kernel_named needs \"module:qualname\".*Why:.*Fix:"):
        reprules.kernel_named(bad)


def test_a_name_no_kernel_matched_is_reported():
    from reprules import _registry

    reprules.replication_rule()(reprules.kernel_named("nowhere:typo.<locals>.kernel"))
    assert [r.where for r in _registry.unmatched_names()] == ["kernel_named:nowhere:typo.<locals>.kernel"]


@pytest.mark.parametrize("name", ["fused-moe-e_4", "copy_bn_128_rhs_transpose_False"])
def test_a_missing_rule_fix_names_a_python_function(setup, no_inference, name):
    """A ``pallas_call``'s ``name=`` need not be a Python name, nor the kernel's: the fix
    shows valid code, decorating the kernel's ``def`` where JAX records its site (0.4.31+)."""
    mesh, x, _ = setup
    reprules.replication_rule()(module_kernel)  # reprules active; copy has no rule

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def call(x):
        out = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return pl.pallas_call(copy, out_shape=out, interpret=True, name=name)(x)

    with pytest.raises(reprules.MissingRuleError) as info:
        jax.jit(shard_map(call, mesh, P("data", None), P("data", None)))(x)
    message = str(info.value)
    defined = re.findall(r"def (\S+)\(\.\.\.\)", message)
    called = re.findall(r"replication_rule\(rules\.same\(\)\)\((\S+)\)", message)
    assert defined and called and all(n.isidentifier() for n in defined + called), message
    assert f"JAX {jax.__version__}" in message and "'data', 'model'" in message
    if JAX_VERSION >= (0, 4, 31):  # 0.4.28 records no site for the kernel
        assert set(defined + called) == {"copy"}, message
        assert f"(`copy`: the function JAX runs as {name!r})" in message, message
