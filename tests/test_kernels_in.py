"""``replication_rule(rules.inferred())(reprules.kernels_in("pkg"))``: every kernel
defined in a package's source gets the rule inference derives from its body,
with ``reprules.inference()`` off (what the tokamax pack registers).

The package here is written to a temporary directory: its kernels are closures
made anew on every call (nothing to register by object or name), one reads its
device index (refused), one is module-level (an identity rule on it wins).
Kernels defined outside the package are left exactly as without it.
"""

import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from helpers import count_all_reduce, max_err, psum_axes, put, randn, shard_map
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from reprules import rules

OPS = textwrap.dedent('''
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl


    def fresh_copy(x):
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...]

        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


    @jax.custom_vjp
    def closure_copy(x):
        return fresh_copy(x)


    closure_copy.defvjp(lambda x: (fresh_copy(x), None), lambda _, g: (fresh_copy(g),))


    def fresh_mul(x, w):
        def kernel(x_ref, w_ref, o_ref):
            o_ref[...] = x_ref[...] * w_ref[...]

        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, w)


    @jax.custom_vjp
    def closure_mul(x, w):
        return fresh_mul(x, w)


    closure_mul.defvjp(
        lambda x, w: (fresh_mul(x, w), (x, w)),
        lambda res, g: (fresh_mul(g, jnp.broadcast_to(res[1], g.shape)), (g * res[0]).sum(0, keepdims=True)),
    )


    def reads_device(x):
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] + jax.lax.axis_index("model").astype(x_ref.dtype)

        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


    def double_kernel(x_ref, o_ref):  # module level: a rule can be registered on it
        o_ref[...] = x_ref[...] * 2.0


    def doubled(x):
        return pl.pallas_call(double_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)
''')

PL_KERNEL_OPS = textwrap.dedent('''
    import jax
    from jax.experimental import pallas as pl
    from test_pl_kernel import pltpu, sds, tc_mesh


    def scale(x):
        def body(x_ref, o_ref):
            def scoped(buf):
                pltpu.sync_copy(x_ref, buf)
                buf[...] = buf[...] * 2.0
                pltpu.sync_copy(buf, o_ref)

            pl.run_scoped(scoped, pltpu.VMEM(x_ref.shape, x_ref.dtype))

        return pl.kernel(body, sds(x), mesh=tc_mesh())(x)


    @jax.custom_vjp
    def kernel_scale(x):
        return scale(x)


    kernel_scale.defvjp(lambda x: (scale(x), None), lambda _, g: (scale(g),))
''')


def outside_copy(x):
    """A closure kernel defined here, outside the package."""

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


@pytest.fixture(scope="module")
def kpkg(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    (root / "kpkg").mkdir()
    (root / "kpkg" / "__init__.py").write_text("")
    (root / "kpkg" / "ops.py").write_text(OPS)
    (root / "kpkg" / "tpu_ops.py").write_text(PL_KERNEL_OPS)
    sys.path.insert(0, str(root))
    import kpkg.ops

    yield kpkg.ops
    sys.path.remove(str(root))
    for name in ("kpkg", "kpkg.ops", "kpkg.tpu_ops"):
        sys.modules.pop(name, None)


@pytest.fixture
def inferred(kpkg):
    """The package's kernels get derived rules (what a pack would register)."""
    reprules.replication_rule(rules.inferred())(reprules.kernels_in("kpkg"))
    return kpkg


def test_closure_kernel_in_21855_model_has_no_psum_and_exact_gradients(inferred, mesh):
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    weights = randn(1, (8, 128))
    f = shard_map(inferred.closure_copy, mesh, P("data", None), P("data", None))
    grad = jax.grad(lambda x: (f(x) * weights).sum())
    assert count_all_reduce(grad, x) == (0, 0, 0)  # jaxpr, StableHLO, compiled HLO
    got = jax.jit(grad)(x)
    assert max_err(got, weights) == 0.0  # the unsharded gradient of sum(x * weights)


def test_weight_gradient_keeps_exactly_the_needed_psum(inferred, mesh):
    x = put(randn(0, (16, 32)), mesh, P("data", None))
    w = put(randn(1, (1, 32)), mesh, P())
    t = randn(2, (16, 32))
    f = shard_map(inferred.closure_mul, mesh, (P("data", None), P()), P("data", None))

    def loss(x, w):
        return (f(x, w) * t).sum()

    grad = jax.grad(loss, argnums=(0, 1))
    assert psum_axes(grad, x, w) == [("data",)]  # the weight's, over data only
    gx, gw = jax.jit(grad)(x, w)
    rx, rw = jax.grad(lambda x, w: ((x * w) * t).sum(), argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    assert max_err(gx, rx) < 1e-5 and max_err(gw, rw) < 1e-4


def test_pl_kernel_body_in_the_package(inferred, mesh):
    from test_pl_kernel import CAN_INTERPRET, HAS_KERNEL, pltpu

    if not (HAS_KERNEL and CAN_INTERPRET):
        pytest.skip(f"JAX {jax.__version__} has no pl.kernel (added in JAX 0.8)")
    import kpkg.tpu_ops

    x = put(randn(0, (8, 128)), mesh, P("data", None))
    weights = randn(1, (8, 128))
    f = shard_map(kpkg.tpu_ops.kernel_scale, mesh, P("data", None), P("data", None))
    with pltpu.force_tpu_interpret_mode():
        grad = jax.grad(lambda x: (f(x) * weights).sum())
        assert psum_axes(grad, x) == []
        got = jax.jit(grad)(x)
    assert max_err(got, 2.0 * weights) == 0.0


def test_a_package_kernel_that_reads_its_device_index_is_refused(inferred, mesh):
    x = put(randn(0, (8, 16)), mesh, P("data", None))
    f = shard_map(inferred.reads_device, mesh, P("data", None), P("data", None))
    with pytest.raises(reprules.MissingRuleError) as info:
        jax.jit(f)(x)
    message = str(info.value)
    assert "`axis_index`" in message and "kpkg/ops.py" in message  # the primitive and its line
    assert "'data', 'model'" in message and f"JAX {jax.__version__}" in message
    assert "rules.varying('model')" in message  # the fix


def test_kernels_outside_the_package_are_left_as_they_were(inferred, mesh, no_inference):
    """The same closure kernel, defined in this file: no derived rule. It fails
    exactly as with a rule registered for another kernel instead of the package
    (reprules active, nothing for this kernel), and runs only under inference()."""
    x = put(randn(0, (8, 16)), mesh, P("data", None))
    f = shard_map(outside_copy, mesh, P("data", None), P("data", None))
    with pytest.raises(Exception) as with_package:
        jax.jit(f)(x)
    reprules.unregister(reprules.kernels_in("kpkg"))
    reprules.replication_rule()(inferred.double_kernel)
    with pytest.raises(Exception) as without:
        jax.jit(f)(x)
    assert type(with_package.value) is type(without.value)
    assert str(with_package.value) == str(without.value)
    assert "inference" not in str(with_package.value).split("Fix:")[0]
    reprules.unregister(inferred.double_kernel)


def test_kernels_outside_the_package_run_by_default(inferred, mesh):
    """Outside inference(False), the same kernel gets its rule by default (JAX refuses it)."""
    x = put(randn(0, (8, 16)), mesh, P("data", None))
    assert max_err(jax.jit(shard_map(outside_copy, mesh, P("data", None), P("data", None)))(x), x) == 0.0


def test_a_rule_on_the_kernel_object_wins(inferred, mesh):
    x = put(randn(0, (8, 16)), mesh, P("data", None))
    f = shard_map(inferred.doubled, mesh, P("data", None), P("data", None))
    assert max_err(jax.jit(f)(x), 2.0 * jnp.asarray(x)) == 0.0  # derived: varies like x
    reprules.replication_rule(rules.varying("model"))(inferred.double_kernel)
    with pytest.raises(Exception, match="model"):  # declared: varies over 'model' too, not in out_specs
        jax.jit(f)(x)


def test_listed_and_removed_like_any_rule(inferred, mesh, no_inference):
    reg = reprules.registered()["kernels_in:kpkg"]
    assert reg.rule == rules.inferred() and reg.name == "kpkg.*"
    assert reprules.unregister(reprules.kernels_in("kpkg")) is True
    assert "kernels_in:kpkg" not in reprules.registered()
    x = put(randn(0, (8, 16)), mesh, P("data", None))
    with pytest.raises(Exception):  # no rule any more: checking refuses the kernel again
        jax.jit(shard_map(inferred.fresh_copy, mesh, P("data", None), P("data", None)))(x)


# --- errors ---------------------------------------------------------------------------------


def test_inferred_on_a_single_kernel_is_refused(kpkg):
    with pytest.raises(reprules.RegistrationError, match=r"(?s)rules\.inferred\(\) was given for 'double_kernel'.*"
                       r"Fix: give the kernel a rule such as reprules\.rules\.same\(\) \(with `import reprules`\), wrap the calls in "
                       r"reprules\.inference\(\)"):
        reprules.replication_rule(rules.inferred())(kpkg.double_kernel)


@pytest.mark.parametrize("rule", [None, rules.same(), rules.invariant("model")], ids=["default", "same", "invariant"])
def test_a_fixed_rule_on_a_package_is_refused(kpkg, rule):
    with pytest.raises(reprules.RegistrationError,
                       match=r"(?s)kernels_in\('kpkg'\) takes only rules\.inferred\(\).*silently wrong gradient.*"
                       r"Fix: reprules\.replication_rule\(reprules\.rules\.inferred\(\)\)\(reprules\.kernels_in\('kpkg'\)\)"):
        reprules.replication_rule(rule)(reprules.kernels_in("kpkg"))
    assert reprules.registered() == {}


def test_a_package_that_is_not_installed_is_refused():
    with pytest.raises(reprules.RegistrationError,
                       match=r"(?s)kernels_in\('no_such_pkg_xyz'\): no installed package.*Fix: install it"):
        reprules.kernels_in("no_such_pkg_xyz")


@pytest.mark.parametrize("name", ["", "pkg ops", "pkg..ops", 3])
def test_a_bad_package_name_is_refused(name):
    with pytest.raises(reprules.RegistrationError, match=r"(?s)kernels_in needs a dotted package or module name"):
        reprules.kernels_in(name)


def test_inferred_is_not_a_rule_of_its_own():
    ctx = rules.RuleContext(kernel_name="k", kernel=None, mesh_axes=("data", "model"), num_inputs=1,
                            num_outputs=1, jax_version=jax.__version__)
    with pytest.raises(reprules.RuleError, match=r"(?s)rules\.inferred\(\) was called for kernel 'k' \(mesh axes "
                       r"\{'data', 'model'\}, JAX .*Fix: register it on reprules\.kernels_in"):
        rules.inferred()(ctx, (frozenset(),))
