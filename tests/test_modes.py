"""Verify mode catches lying rules at run time; strict mode refuses silent typing."""

import jax
import pytest
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

import reprules
from helpers import NEW_SHARD_MAP, copy_kernel, kernel_copy, make_mesh, max_err, put, randn, shard_map
from reprules import rules

pytest_plugins = ["pytester"]


@pytest.fixture
def setup():
    mesh = make_mesh()
    return mesh, put(randn(0, (8, 128)), mesh, P("data", None))


LIES = {
    "invariant-data-jit": (rules.invariant("data"), P("data", None), P("data", None), "jit"),
    "invariant-data-grad": (rules.invariant("data"), P("data", None), P("data", None), "grad"),
    "invariant-model": (rules.invariant("model"), P("data", "model"), P("data", None), "jit"),
    "custom-always-replicated": (lambda ctx, v: [frozenset()], P("data", None), P(None, None), "jit"),
    "invariant-both": (rules.invariant("data", "model"), P("data", "model"), P(None, None), "jit"),
}


@pytest.mark.parametrize("lie", LIES)
def test_verify_catches_lying_rules(setup, lie):
    mesh, _ = setup
    rule, in_spec, out_spec, transform = LIES[lie]
    x = put(randn(0, (8, 128)), mesh, in_spec)
    reprules.replication_rule(rule)(copy_kernel)
    f = shard_map(kernel_copy, mesh, in_spec, out_spec)
    step = jax.jit(f) if transform == "jit" else jax.jit(jax.grad(lambda x: f(x).sum()))
    with pytest.raises(reprules.ReplicationMismatchError, match=r"(?s)output 0 of kernel 'copy_kernel' is declared replicated over mesh axis '(data|model)'.*differs across.*by up to [0-9.]+"):
        with reprules.verify():
            jax.block_until_ready(step(x))


@pytest.mark.parametrize("transform", ["jit", "grad"])
def test_verify_message_names_kernel_rule_axis_and_difference(setup, transform):
    mesh, x = setup
    reprules.replication_rule(rules.invariant("data"))(copy_kernel)  # a lie: x varies over data
    f = shard_map(kernel_copy, mesh, P("data", None), P("data", None))
    step = jax.jit(f) if transform == "jit" else jax.jit(jax.grad(lambda x: f(x).sum()))
    with pytest.raises(reprules.ReplicationMismatchError, match=r"(?s)output 0 of kernel 'copy_kernel' is declared replicated over mesh axis 'data' by its rule rules\.invariant\('data'\), but it differs across 'data' by up to [0-9.]+.*Fix:"):
        with reprules.verify():
            jax.block_until_ready(step(x))


def test_verify_passes_honest_rules_and_is_off_by_default(setup):
    mesh, x = setup
    reprules.replication_rule(rules.same())(copy_kernel)
    f = jax.jit(shard_map(kernel_copy, mesh, P("data", None), P("data", None)))
    text_off = f.lower(x).as_text()
    with reprules.verify():
        assert max_err(f(x), x) == 0.0
        text_on = f.lower(x).as_text()
    assert "callback" not in text_off and "callback" in text_on  # free when off
    assert f.lower(x).as_text() == text_off


# --- strict mode --------------------------------------------------------------
silent_p = Primitive("silent_copy")
silent_p.def_impl(lambda x: x)
silent_p.def_abstract_eval(lambda a: ShapedArray(a.shape, a.dtype))  # drops the varying axes
mlir.register_lowering(silent_p, mlir.lower_fun(lambda x: x * 1.0, multiple_results=False))


@pytest.mark.skipif(not NEW_SHARD_MAP, reason="JAX <= 0.5 refuses rule-less primitives by itself")
def test_strict_refuses_silently_replicated_primitive(setup, monkeypatch):
    mesh, x = setup
    f = jax.jit(shard_map(silent_p.bind, mesh, P("data", None), P(None, None)))
    with monkeypatch.context() as env:  # JAX's typing: the hazard, accepted, one device's shard returned
        env.setenv("REPRULES_SOUND_TYPES", "0")
        assert f(x).shape == (2, 128)
    jax.clear_caches()  # the switch is read when a function is traced
    with pytest.warns(reprules.ReplicationWarning, match="primitive 'silent_copy'"):  # sound types: refused
        with pytest.raises(ValueError, match="out_specs"):
            jax.jit(shard_map(silent_p.bind, mesh, P("data", None), P(None, None)))(x)
    with reprules.strict():
        with pytest.raises(reprules.StrictModeError, match=r"(?s)Strict mode: the primitive 'silent_copy' has inputs varying over \{'data'\}.*output 0 as replicated over \{'data'\}.*JAX " + jax.__version__ + r".*Fix: reprules cannot see what it computes.*reprules\.verify\(\).*"
                           r"reprules\.replication_rule\(rules\.varying\('data', 'model'\)\)\(silent_copy\)"):
            f(x)
    reprules.replication_rule()(silent_p)
    with reprules.strict():  # with a rule: typed right, so JAX itself refuses out_specs=P()
        with pytest.raises(ValueError, match="out_specs"):
            jax.jit(shard_map(silent_p.bind, mesh, P("data", None), P(None, None)))(x)
        out = jax.jit(shard_map(silent_p.bind, mesh, P("data", None), P("data", None)))(x)
        assert max_err(out, x) == 0.0


@pytest.mark.skipif(not NEW_SHARD_MAP, reason="JAX <= 0.5 refuses rule-less primitives by itself")
def test_strict_leaves_jax_programs_alone(setup):
    mesh, x = setup
    w = put(randn(1, (128,)), mesh, P())

    def body(x, w):
        y = jax.nn.relu(x * w) + jax.lax.psum(x, "data").sum() + jax.lax.axis_index("data")
        total = jax.lax.psum(y, "data")
        return jax.lax.cond(y.sum() > 0, lambda: y, lambda: -y), total

    f = shard_map(body, mesh, (P("data", None), P()), (P("data", None), P()))
    loss = lambda x, w: f(x, w)[0].sum() + f(x, w)[1].sum()  # noqa: E731
    expected = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    with reprules.strict():
        assert max_err(jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w), expected) == 0.0


def test_verify_environment_variable_fails_the_test_through_the_plugin(pytester):
    pytester.makepyfile(
        test_lie="""
        import sys
        sys.path.insert(0, %r)
        import jax
        from jax.sharding import PartitionSpec as P
        import reprules
        from reprules import rules
        from helpers import copy, copy_kernel, make_mesh, put, randn, shard_map

        def test_lie():
            reprules.replication_rule(rules.invariant("data"))(copy_kernel)
            mesh = make_mesh()
            x = put(randn(0, (8, 128)), mesh, P("data", None))
            jax.block_until_ready(jax.jit(shard_map(copy, mesh, P("data", None), P("data", None)))(x))
        """ % str(__import__("pathlib").Path(__file__).parent)
    )
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("REPRULES_VERIFY", "1")
    try:
        result = pytester.runpytest_subprocess("--reprules-cpu-devices", "8")
    finally:
        monkeypatch.undo()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*output 0 of kernel 'copy_kernel' is declared replicated over mesh axis 'data'*"])
    # Reported once: an old-style hookwrapper that fails after its yield printed the whole
    # message again in a PluggyTeardownRaisedWarning (issue 43).
    # Counted in the failures section: with CI set, pytest's short summary repeats the whole
    # message (it truncates it to the terminal width only off CI).
    text = result.stdout.str()
    assert "PluggyTeardownRaisedWarning" not in text, text
    failures = text.split("short test summary info")[0]
    assert failures.count("Why: the rule promises JAX a replication the kernel does not deliver") == 1, text
