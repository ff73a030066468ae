"""JAX issue #21855: a Pallas copy kernel under custom_vjp inside shard_map.

With checking off, the backward pass gains a defensive all-reduce over
``model`` (``x`` is already replicated over it). With a rule and checking on:
no psum in the grad jaxpr, no all-reduce in StableHLO nor in compiled HLO, and
gradients equal to the check-off run and to the unsharded reference.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import reprules
from helpers import copy_kernel, count_all_reduce, kernel_copy, make_mesh, max_err, put, randn, shard_map


def make_loss(mesh, weights, check):
    f = shard_map(kernel_copy, mesh, P("data", None), P("data", None), check=check)
    return lambda x: (f(x) * weights).sum()  # data-dependent cotangent


@pytest.fixture
def setup():
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    weights = randn(1, (8, 128))
    return mesh, x, weights


def test_check_off_has_the_defensive_all_reduce(setup):
    mesh, x, w = setup
    grad = jax.grad(make_loss(mesh, w, check=False))
    assert count_all_reduce(grad, x) == (1, 1, 1)
    assert max_err(grad(x), w) < 1e-6  # 0.4.x: mb_div/psum leave ~1e-38


def test_with_rule_no_all_reduce_and_exact_gradients(setup):
    mesh, x, w = setup
    reprules.replication_rule()(copy_kernel)
    grad_on = jax.grad(make_loss(mesh, w, check=True))
    grad_off = jax.grad(make_loss(mesh, w, check=False))
    assert count_all_reduce(grad_on, x) == (0, 0, 0)
    reference = jax.grad(lambda x: (x * w).sum())(jnp.asarray(x))  # unsharded
    assert max_err(jax.jit(grad_on)(x), reference) < 1e-6
    assert max_err(jax.jit(grad_on)(x), jax.jit(grad_off)(x)) < 1e-6


def test_forward_output_varies_over_data_only(setup):
    mesh, x, w = setup
    reprules.replication_rule()(copy_kernel)
    out = jax.jit(shard_map(kernel_copy, mesh, P("data", None), P("data", None)))(x)
    assert max_err(out, x) == 0.0
    # The output is typed replicated over `model`, so out_specs may omit it; it is
    # typed varying over `data`, so out_specs=P() is rejected by JAX itself.
    with pytest.raises(ValueError, match="out_specs"):
        jax.jit(shard_map(kernel_copy, mesh, P("data", None), P(None, None)))(x)


def test_without_rule_checking_fails_with_a_teaching_error(setup, no_inference):
    mesh, x, w = setup

    def other_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    reprules.replication_rule()(other_kernel)  # reprules active, copy_kernel not registered
    with pytest.raises(reprules.MissingRuleError) as info:
        jax.grad(make_loss(mesh, w, check=True))(x)
    message = str(info.value)
    assert "'copy_kernel'" in message
    assert "'data', 'model'" in message
    assert f"JAX {jax.__version__}" in message
    assert "@reprules.replication_rule()" in message


def test_missing_rule_error_is_the_same_at_every_call(setup, no_inference):
    """The out_shape JAX refused at a kernel's first call is not asked about again
    (reprules keeps JAX's refusal): later calls raise the same error, and a call of
    the same out_shape with a rule in between changes nothing for one without."""
    mesh, x, w = setup

    def other_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    reprules.replication_rule()(other_kernel)  # reprules active, copy_kernel not registered

    def error() -> reprules.MissingRuleError:
        with pytest.raises(reprules.MissingRuleError) as info:
            jax.grad(make_loss(mesh, w, check=True))(x)
        return info.value

    first, second = error(), error()
    assert str(first) == str(second) and "'copy_kernel'" in str(first)
    assert type(first.__cause__) is type(second.__cause__), (first.__cause__, second.__cause__)
    reprules.replication_rule()(copy_kernel)  # the same out_shape, now typed by a rule
    assert max_err(jax.jit(jax.grad(make_loss(mesh, w, check=True)))(x), w) < 1e-6
    reprules.unregister(copy_kernel)
    assert str(error()) == str(first)


def test_without_any_registration_the_rule_is_inferred_by_default(setup):
    """No decorator and no ``inference()``: JAX would refuse the rule-less kernel under
    checking, so reprules derives its rule from the body. No defensive all-reduce at
    any level, gradients exact, and the report says the rule was inferred."""
    from reprules import testing

    mesh, x, w = setup
    assert not reprules.registered()
    grad_on = jax.grad(make_loss(mesh, w, check=True))
    assert count_all_reduce(grad_on, x) == (0, 0, 0)
    reference = jax.grad(lambda x: (x * w).sum())(jnp.asarray(x))  # unsharded
    assert max_err(jax.jit(grad_on)(x), reference) < 1e-6
    assert max_err(jax.jit(grad_on)(x), jax.jit(jax.grad(make_loss(mesh, w, check=False)))(x)) < 1e-6
    (kernel,) = testing.collectives(grad_on, x).kernels
    assert kernel.name == "copy_kernel" and kernel.has_rule and kernel.rule.startswith("inferred("), kernel
    assert not reprules.registered()  # derived, not registered


def test_without_any_registration_reprules_names_the_missing_rule(setup, no_inference):
    """No first-use trap: with nothing registered, the kernel JAX refuses gets
    reprules' error (the decorator to add), JAX's own text and exception type kept."""
    mesh, x, w = setup
    assert not reprules.registered()
    with pytest.raises(reprules.MissingRuleError, match=r"(?s)has no replication rule.*@reprules\.replication_rule"
                       r".*JAX's own error: .*(check_rep|check_vma)") as info:
        jax.grad(make_loss(mesh, w, check=True))(x)
    assert isinstance(info.value, (NotImplementedError, ValueError))
    code = copy_kernel.__code__
    site = f"at {code.co_filename}:{code.co_firstlineno}"  # the def line; 0.4.28: a line of its body
    assert f"(defined {site})" in str(info.value) or f"(traced at {code.co_filename}:" in str(info.value)


def test_dormant_without_any_registration_jax_error_is_untouched(setup, dormant):
    mesh, x, w = setup
    assert not reprules.registered()
    with pytest.raises((NotImplementedError, ValueError)) as info:
        jax.grad(make_loss(mesh, w, check=True))(x)
    assert not isinstance(info.value, reprules.ReprulesError)
