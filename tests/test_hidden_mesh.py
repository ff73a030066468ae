"""A kernel called where code inside the ``shard_map`` hid its manual axes.

MaxText calls its mHC kernels inside ``jax.sharding.use_abstract_mesh(
AbstractMesh((), ()))`` on CPU (so that a TPU is described): the abstract mesh
then names no manual axes, yet the kernel's inputs still vary over ``data``.
Decided over that mesh, every rule typed the outputs replicated, and the
checked gradient silently missed its psum (found by the MaxText probes).
reprules now decides over the axes the inputs vary over, checks that the rule
answers the same over every axis in scope, and refuses it where it does not.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import reprules
from helpers import VARYING_OVER_DATA, copy, count_all_reduce, make_mesh, max_err, psum_axes, put, randn, shard_map
from reprules import rules, testing

pytestmark = pytest.mark.skipif(
    not hasattr(jax.sharding, "use_abstract_mesh"),
    reason=f"JAX {jax.__version__} has no public jax.sharding.use_abstract_mesh (added in 0.7)",
)


def hidden(f):
    """``f`` called as MaxText calls its kernels on CPU: under an abstract mesh with no axes."""
    def call(*args):
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            return f(*args)
    return call


@jax.custom_vjp
def hidden_copy(x):
    return hidden(copy)(x)


hidden_copy.defvjp(lambda x: (hidden(copy)(x), None), lambda _, g: (hidden(copy)(g),))


@pytest.fixture
def setup():
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data"))
    w = randn(1, (128,))  # replicated: its gradient is a psum over `data`, never over `model`
    t = randn(2, (8, 128))  # data-dependent cotangent
    return mesh, x, w, t


def grad_of(mesh, t, check=True, kernel=hidden_copy):
    f = shard_map(lambda x, w: kernel(x * w), mesh, (P("data"), P()), P("data"), check=check)
    return jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=1)


def reference(x, t):
    return (np.asarray(x) * np.asarray(t)).sum(0)  # d/dw of sum(x * w * t), unsharded


@pytest.mark.parametrize("registration", ["inferred by default", "declared"])
def test_the_weight_gradient_keeps_its_psum_over_data_and_loses_the_defensive_one(setup, registration):
    mesh, x, w, t = setup
    if registration == "declared":
        from helpers import copy_kernel
        reprules.replication_rule(rules.same())(copy_kernel)
    on, off = grad_of(mesh, t), grad_of(mesh, t, check=False)
    assert psum_axes(off, x, w) == [("data", "model")]
    assert psum_axes(on, x, w) == [("data",)]  # before: [("data",), ("data",)], the gradient 16x off
    # The one all-reduce left is the needed one, in the jaxpr, StableHLO and compiled HLO alike.
    assert count_all_reduce(on, x, w) == (1, 1, 1)
    assert testing.collectives(off, x, w).count("all-reduce", defensive=True) == 1
    assert testing.collectives(on, x, w).count("all-reduce", defensive=True) == 0
    assert max_err(jax.jit(on)(x, w), reference(x, t)) < 1e-5
    assert max_err(jax.jit(on)(x, w), jax.jit(off)(x, w)) < 1e-5


def test_the_output_is_typed_varying_over_the_axes_its_input_varies_over(setup):
    mesh, x, _, _ = setup
    seen = []

    def body(x):
        y = hidden(copy)(x)
        seen.append(str(jax.typeof(y)))
        return y

    out = jax.jit(shard_map(body, mesh, P("data"), P("data")))(x)
    assert max_err(out, x) == 0.0
    assert re.search(VARYING_OVER_DATA, seen[0]), seen
    with pytest.raises(ValueError, match="out_specs"):  # typed varying: P() is refused, as it must be
        jax.jit(shard_map(body, mesh, P("data"), P()))(x)


def test_a_rule_whose_answer_depends_on_the_hidden_axes_is_refused(setup):
    """``rules.varying("model")`` names an axis the inputs do not vary over: whether it is
    manual there cannot be seen, so neither answer is safe."""
    from helpers import copy_kernel
    mesh, x, _, _ = setup
    reprules.replication_rule(rules.varying("model"))(copy_kernel)
    f = shard_map(hidden(copy), mesh, P("data"), P("data"))
    with pytest.raises(reprules.RuleError) as err:
        jax.jit(f)(x)
    message = str(err.value)
    assert "kernel 'copy_kernel' (rule rules.varying('model'))" in message
    assert "does not name the manual axes" in message
    assert "{'data'} known from its inputs, {'data', 'model'} in scope" in message
    assert "over {'data'} it is an error" in message and "over {'data', 'model'} it is outputs varying over [['data', 'model']]" in message
    assert f"JAX {jax.__version__}" in message
    assert "Why: code around the call replaced the shard_map's abstract mesh" in message
    assert "Fix: call the kernel outside the use_abstract_mesh block" in message
    # Outside the block the same rule applies.
    out = jax.jit(shard_map(copy, mesh, P("data"), P("data", "model")))(x)
    assert out.shape == (8, 256)


def test_a_rule_that_answers_the_same_over_every_axis_in_scope_applies(setup):
    from helpers import copy_kernel
    mesh, x, _, _ = setup
    reprules.replication_rule(rules.invariant("data"))(copy_kernel)  # a (claimed) all-reduce over data
    seen = []

    def body(x):
        y = hidden(copy)(x)
        seen.append(str(jax.typeof(y)))
        return y

    jax.jit(shard_map(body, mesh, P("data"), P()))(x)  # typed replicated: P() accepted
    assert not re.search(VARYING_OVER_DATA, seen[0]), seen


def test_a_primitive_with_a_rule_casts_its_weight_up_where_the_mesh_is_hidden(setup):
    """``rules.same()`` casts the replicated weight up to ``data`` inside the block (JAX's
    ``pvary`` typed on the hidden mesh fails on 0.8 - 0.9; reprules casts on the shard_map's)."""
    from test_primitives import mul_p, prim_mul
    mesh, x, w, t = setup
    reprules.replication_rule(rules.same())(mul_p)
    f = shard_map(hidden(prim_mul), mesh, (P("data"), P()), P("data"))
    grad = jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=1)
    assert psum_axes(grad, x, w) == [("data",)]
    assert max_err(jax.jit(grad)(x, w), reference(x, t)) < 1e-5


@pytest.fixture
def tpu_interpret():
    from test_pl_kernel import CAN_INTERPRET, HAS_KERNEL, pltpu
    if not (HAS_KERNEL and CAN_INTERPRET):
        pytest.skip(f"JAX {jax.__version__} has no pl.kernel (added in JAX 0.8)")
    with pltpu.force_tpu_interpret_mode():
        yield


def hidden_scale_step(mesh, t, check=True):
    from test_pl_kernel import scale

    @jax.custom_vjp
    def hidden_scale(x):
        return hidden(scale)(x)

    hidden_scale.defvjp(lambda x: (hidden(scale)(x), None), lambda _, g: (hidden(scale)(g),))
    return grad_of(mesh, t, check=check, kernel=hidden_scale)


def test_pl_kernel_where_the_mesh_is_hidden(setup, tpu_interpret):
    """0.10+: exact, as for pallas_call. 0.8 - 0.9: JAX builds the pallas_call it runs the
    kernel as on the hidden mesh, where no type can vary, so reprules refuses (JAX alone
    types the output replicated, and the custom_vjp type check refuses the step)."""
    from helpers import JAX_VERSION
    mesh, x, w, t = setup
    off = hidden_scale_step(mesh, t, check=False)
    assert psum_axes(off, x, w) == [("data", "model")]
    on = hidden_scale_step(mesh, t)
    if JAX_VERSION >= (0, 10):
        assert psum_axes(on, x, w) == [("data",)]
        assert max_err(jax.jit(on)(x, w), 2 * reference(x, t)) < 1e-5
        assert max_err(jax.jit(on)(x, w), jax.jit(off)(x, w)) < 1e-5
        return
    with pytest.raises(reprules.RuleError) as err:
        jax.jit(on)(x, w)
    message = str(err.value)
    assert "pl.kernel body 'scale_body' varying over [['data']]" in message
    assert "does not name the manual axes (mesh axes {'data'} known from its inputs" in message
    assert f"JAX {jax.__version__}" in message
    assert "Fix: call the kernel outside the use_abstract_mesh block" in message and "JAX 0.10+" in message


def test_verify_checks_a_rule_where_the_mesh_is_hidden(setup):
    """``verify()``'s gathers and comparisons run on the shard_map's mesh there: a lying
    ``rules.invariant("data")`` is caught, a true rule passes."""
    from helpers import copy_kernel
    mesh, x, _, _ = setup
    with reprules.verify():
        out = jax.jit(shard_map(hidden(copy), mesh, P("data"), P("data")))(x)
    assert max_err(out, x) == 0.0
    reprules.replication_rule(rules.invariant("data"))(copy_kernel)
    with pytest.raises(reprules.ReplicationMismatchError, match=r"output 0 of kernel 'copy_kernel' is declared "
                       r"replicated over mesh axis 'data' by its rule rules.invariant\('data'\)"):
        with reprules.verify():
            jax.jit(shard_map(hidden(copy), mesh, P("data"), P()))(x)
