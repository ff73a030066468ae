"""Registration semantics and every user-facing error, each matched by message."""

import functools

import jax
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from helpers import JAX_VERSION, copy_kernel, make_mesh, put, randn, shard_map
from reprules import rules

COPY_KERNEL = f"{copy_kernel.__module__}.copy_kernel"  # its key in reprules.registered()


def call(kernel, x, n_out=1):
    sds = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(kernel, out_shape=sds if n_out == 1 else (sds,) * n_out, interpret=True)(x)


def run_sharded(kernel, n_out=1):
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    out_specs = P("data", None) if n_out == 1 else (P("data", None),) * n_out
    return jax.jit(shard_map(lambda x: call(kernel, x, n_out), mesh, P("data", None), out_specs))(x)


def test_decorator_returns_the_kernel_and_registers_same_by_default():
    assert reprules.replication_rule()(copy_kernel) is copy_kernel
    reg = reprules.registered()[COPY_KERNEL]
    assert reg.rule == rules.same() and reg.kernel() is copy_kernel


def test_reregistering_the_same_rule_is_harmless():
    reprules.replication_rule(rules.same())(copy_kernel)
    reprules.replication_rule(rules.same())(copy_kernel)
    assert len(reprules.registered()) == 1


def test_conflicting_rule_raises_unless_override():
    reprules.replication_rule(rules.same())(copy_kernel)
    with pytest.raises(reprules.RegistrationError, match=r"(?s)already has the replication rule rules\.same\(\).*override=True"):
        reprules.replication_rule(rules.varying("model"))(copy_kernel)
    reprules.replication_rule(rules.varying("model"), override=True)(copy_kernel)
    assert reprules.registered()[COPY_KERNEL].rule == rules.varying("model")


def test_unregister_removes_the_rule_and_restores_jax(dormant):
    reprules.replication_rule()(copy_kernel)
    assert run_sharded(copy_kernel).shape == (8, 128)
    assert reprules.unregister(copy_kernel) is True
    assert reprules.unregister(copy_kernel) is False
    with pytest.raises((NotImplementedError, ValueError)) as info:
        run_sharded(copy_kernel)
    assert not isinstance(info.value, reprules.ReprulesError)  # JAX's own error again


def test_decorator_without_parentheses_is_refused():
    with pytest.raises(reprules.RegistrationError, match=r"(?s)applied directly to 'copy_kernel'.*@reprules\.replication_rule\(\)"):
        reprules.replication_rule(copy_kernel)


def test_partial_and_non_callables_are_refused():
    with pytest.raises(reprules.RegistrationError, match=r"(?s)functools.partial.*underlying function"):
        reprules.replication_rule()(functools.partial(copy_kernel))
    with pytest.raises(reprules.RegistrationError, match=r"(?s)on 42 \(int\): it is not a kernel function, a primitive, an FFI target.*Fix: register"):
        reprules.replication_rule()(42)
    with pytest.raises(reprules.RegistrationError, match=r"(?s)is 'same', which is not callable"):
        reprules.replication_rule("same")(copy_kernel)


def _imports_what_it_uses(message):
    """Issue 36: a Fix that uses `reprules.` says `import reprules`; one that uses a bare
    `rules.` says `from reprules import rules`."""
    import re

    message = message.split("Fix:", 1)[1]
    if "reprules." in message.replace("import reprules", ""):
        assert "import reprules" in message, message
    if re.search(r"(?<![\w.])rules\.\w+\(", message):
        assert "from reprules import rules" in message, message


def test_error_snippets_import_what_they_use():
    messages = []
    for bad in (lambda: reprules.replication_rule(copy_kernel), lambda: reprules.replication_rule("same")(copy_kernel),
                lambda: reprules.replication_rule(rules.inferred())(copy_kernel)):
        with pytest.raises(reprules.RegistrationError) as info:
            bad()
        messages.append(str(info.value))
    with pytest.raises(reprules.RuleError) as info:
        import types

        ctx = types.SimpleNamespace(kernel_name="copy_kernel", mesh_axes=("data",), jax_version=jax.__version__)
        rules.inferred()(ctx, ())  # a user calling the marker by hand
    messages.append(str(info.value))
    for message in messages:
        _imports_what_it_uses(message)


def test_rule_naming_an_axis_not_in_the_mesh():
    reprules.replication_rule(rules.varying("modle"))(copy_kernel)
    with pytest.raises(reprules.RuleError, match=r"(?s)names mesh axes \['modle'\].*'data', 'model'.*JAX " + jax.__version__):
        run_sharded(copy_kernel)


def test_rule_returning_the_wrong_number_of_outputs():
    reprules.replication_rule(lambda ctx, in_varying: [frozenset({"data"})] * 3)(copy_kernel)
    with pytest.raises(reprules.RuleError, match=r"(?s)returned 3 output varying sets, but the kernel has 1 outputs"):
        run_sharded(copy_kernel)


def test_rule_returning_the_wrong_type():
    reprules.replication_rule(lambda ctx, in_varying: "data")(copy_kernel)
    with pytest.raises(reprules.RuleError, match=r"(?s)returned 'data' of type str"):
        run_sharded(copy_kernel)
    reprules.replication_rule(lambda ctx, in_varying: ["data"], override=True)(copy_kernel)
    with pytest.raises(reprules.RuleError, match=r"(?s)expected a set of mesh axis names"):
        run_sharded(copy_kernel)


def test_rule_raising_inside():
    def broken(ctx, in_varying):
        raise KeyError("boom")

    reprules.replication_rule(broken)(copy_kernel)
    with pytest.raises(reprules.RuleError, match=r"(?s)rule of kernel 'copy_kernel'.*raised KeyError: 'boom'") as info:
        run_sharded(copy_kernel)
    chain, err = [], info.value
    while err is not None:  # JAX may interpose its own traceback-filtering frames
        chain.append(type(err))
        err = err.__cause__ or err.__context__
    assert KeyError in chain


def test_rule_casting_an_input_down_is_refused():
    reprules.replication_rule(
        lambda ctx, in_varying: rules.Decision(outputs=(frozenset(),), inputs=(frozenset(),))
    )(copy_kernel)
    with pytest.raises(reprules.RuleError, match=r"(?s)casts input 0 from {'data'} down to.*needs a collective"):
        run_sharded(copy_kernel)


def test_like_out_of_range_and_dishonest_like():
    reprules.replication_rule(rules.like(3))(copy_kernel)
    with pytest.raises(reprules.RuleError, match=r"(?s)refers to input 3, but the kernel was called with 1 inputs"):
        run_sharded(copy_kernel)

    def two_in_kernel(x_ref, w_ref, o_ref):
        o_ref[...] = x_ref[...] * w_ref[...]

    reprules.replication_rule(rules.like(1))(two_in_kernel)
    mesh = make_mesh()
    x, w = put(randn(0, (8, 128)), mesh, P("data", None)), put(randn(1, (1, 128)), mesh, P())

    def body(x, w):
        return pl.pallas_call(two_in_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, w)

    with pytest.raises(reprules.RuleError, match=r"(?s)vary like input 1 .* but input 0 varies over {'data'}.*rules\.same\(\)"):
        jax.jit(shard_map(body, mesh, (P("data", None), P()), P("data", None)))(x, w)


def test_custom_rule_gets_a_context():
    seen = []

    def rule(ctx, in_varying):
        seen.append((ctx.kernel_name, ctx.kernel, set(ctx.mesh_axes), ctx.num_inputs, ctx.num_outputs, in_varying))
        return [in_varying[0]] * ctx.num_outputs

    reprules.replication_rule(rule)(copy_kernel)
    run_sharded(copy_kernel)
    assert seen[0] == ("copy_kernel", copy_kernel, {"data", "model"}, 1, 1, (frozenset({"data"}),))


def test_unsupported_jax_version_is_refused():
    from reprules import _shim

    with pytest.raises(reprules.UnsupportedJaxError, match=r"(?s)supports JAX >=0\.4\.28,<0\.13, but JAX 0\.4\.20 is installed.*Fix: install"):
        _shim._detect("0.4.20")
    with pytest.raises(reprules.UnsupportedJaxError, match=r"(?s)JAX 0.13.0 is installed"):
        _shim._detect("0.13.0")


def _expected_regime():
    if JAX_VERSION < (0, 6):
        return "rep", "check_rep"  # 0.4.28 - 0.5.x
    if JAX_VERSION < (0, 10):
        return "vma", "check_vma"  # 0.6.x - 0.9.x
    return "mat", "check_vma"  # 0.10.x - 0.12.x


def test_jax_support_names_the_regime_of_the_installed_jax():
    support = reprules.jax_support()
    regime, check_flag = _expected_regime()
    assert support["jax"] == jax.__version__
    assert (support["regime"], support["check_flag"]) == (regime, check_flag), support


def test_changing_a_rule_after_tracing_is_not_stale():
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    reprules.replication_rule(rules.same())(copy_kernel)
    step = jax.jit(shard_map(lambda x: call(copy_kernel, x), mesh, P("data", None), P("data", None)))
    assert step(x).shape == (8, 128)  # traced and cached under rules.same()
    reprules.replication_rule(rules.varying("model"), override=True)(copy_kernel)
    with pytest.raises(ValueError, match="out_specs"):  # the new rule applies to the same jitted step
        step(x)
