"""Rules for JAX's host callbacks, registered on the host function (issue 43, item 3).

``@reprules.replication_rule(rules.same())`` above the ``def`` of the function
passed to ``jax.pure_callback`` or ``io_callback`` says how the callback's
results vary: found by the function's identity (also through
``functools.partial`` and bound methods), it types the results as a kernel's
rule types a kernel's. No ReplicationWarning, ``strict()`` accepts it, a
``custom_vjp`` around it differentiates exactly, and ``reprules.verify()``
checks it at run time. A rule-less callback's warning shows the line to add.

On JAX <= 0.5 (``check_rep``) JAX types every callback varying over every mesh
axis itself; a rule on the host function is applied there too (a callback on
replicated inputs ruled ``rules.same()`` may then be returned with
``out_specs=P()``), and verified. Warnings and strict mode are JAX 0.6+ only.
"""

import functools
import os
import re
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback
from jax.sharding import PartitionSpec as P

import reprules
from helpers import NEW_SHARD_MAP, env_with_cpu_devices, max_err, shard_map
from reprules import rules

vma_era = pytest.mark.skipif(not NEW_SHARD_MAP, reason=f"JAX {jax.__version__} (check_rep) types callbacks varying "
                             "over every mesh axis itself: no ReplicationWarning and no strict mode for them to "
                             "change; sound types and strict mode are for JAX 0.6+")


def host_sin(a):
    return np.sin(np.asarray(a))


def host_cos_times(a, g):
    return np.cos(np.asarray(a)) * np.asarray(g)


def host_full(a, k=1.0):
    """Ignores its input's values: replicated whatever the input varies over."""
    return np.full_like(np.asarray(a), k)


def host_plain(a):
    return np.asarray(a) * 2.0


class Scaler:
    def full(self, a):
        return np.full_like(np.asarray(a), 3.0)


_calls = [0]


def host_counter(a):
    """Host state: every call (one per device) returns another value, replicated inputs or not."""
    _calls[0] += 1
    return np.asarray(a) + np.float32(_calls[0])


def shape_of(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def pure(host, x):
    return jax.pure_callback(host, shape_of(x), x)


def io(host, x):
    return io_callback(host, shape_of(x), x)


def register(host, rule):
    reprules.replication_rule(rule)(host)


@pytest.fixture
def no_replication_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", reprules.ReplicationWarning)
        yield


# --- a rule on the host function types the callback --------------------------------------------
@pytest.mark.parametrize("call", [pure, io], ids=["pure_callback", "io_callback"])
def test_a_ruled_callback_gives_the_reference_without_a_warning(data, call, no_replication_warning):
    mesh, x, _ = data
    register(host_sin, rules.same())
    out = jax.jit(shard_map(lambda x: call(host_sin, x), mesh, P("data", None), P("data", None)))(x)
    assert max_err(out, np.sin(np.asarray(x))) < 1e-6


@pytest.mark.parametrize("call", [pure, io], ids=["pure_callback", "io_callback"])
def test_same_on_replicated_inputs_allows_replicated_out_specs(data, call, no_replication_warning):
    """rules.same(): replicated inputs give replicated results, so out_specs=P() is accepted
    (JAX <= 0.5 alone refuses it: its rules type callbacks varying over every axis)."""
    mesh, _, w = data
    register(host_sin, rules.same())
    out = jax.jit(shard_map(lambda w: call(host_sin, w), mesh, P(), P()))(w)
    assert max_err(out, np.sin(np.asarray(w))) < 1e-6


def test_a_rule_less_io_callback_on_replicated_inputs_keeps_varying(data):
    mesh, _, w = data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", reprules.ReplicationWarning)
        with pytest.raises(ValueError, match="out_specs"):
            jax.jit(shard_map(lambda w: io(host_sin, w), mesh, P(), P()))(w)


def test_an_io_callback_is_typed_by_its_rule(data, no_replication_warning):
    """Without a rule it varies over every manual axis ('model' too); rules.same() types it
    like its input, over 'data' only, so P('data', None) is accepted."""
    mesh, x, _ = data
    register(host_sin, rules.same())
    f = shard_map(lambda x: io(host_sin, x), mesh, P("data", None), P("data", None))
    assert max_err(jax.jit(f)(x), np.sin(np.asarray(x))) < 1e-6
    reprules.replication_rule(rules.varying("model"), override=True)(host_sin)
    with pytest.raises(ValueError, match="out_specs"):  # now declared varying over 'model' too
        jax.jit(shard_map(lambda x: io(host_sin, x), mesh, P("data", None), P("data", None)))(x)


@pytest.mark.parametrize("how", ["partial", "bound_method"])
def test_a_partial_or_a_bound_method_finds_the_functions_rule(data, how, no_replication_warning):
    """rules.invariant('data') on a host function that ignores its input's values (true): the
    result may leave with out_specs=P() only if the rule was found."""
    mesh, x, _ = data
    if how == "partial":
        register(host_full, rules.invariant("data"))
        host, want = functools.partial(host_full, k=2.0), 2.0
    else:
        register(Scaler.full, rules.invariant("data"))
        host, want = Scaler().full, 3.0
    out = jax.jit(shard_map(lambda x: pure(host, x), mesh, P("data", None), P()))(x)
    assert out.shape == (2, 16) and max_err(out, np.full((2, 16), want)) == 0.0


DORMANT = textwrap.dedent('''
    import warnings
    warnings.simplefilter("error")
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    import reprules
    from reprules import rules
    from helpers import make_mesh, put, randn, shard_map

    @reprules.replication_rule(rules.same())
    def host_double(a):
        return np.asarray(a) * 2.0

    mesh = make_mesh()
    x = put(randn(0, (8, 16)), mesh, P("data", None))
    def call(x):
        return jax.pure_callback(host_double, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    try:  # typed varying over data by its rule (JAX alone: replicated, P() accepted)
        jax.jit(shard_map(call, mesh, P("data", None), P()))(x)
        print("accepted")
    except ValueError as err:
        print("refused" if "out_specs" in str(err) else err)
    print(float(np.abs(jax.jit(shard_map(call, mesh, P("data", None), P("data", None)))(x) - 2.0 * x).max()))
''')


def test_the_rule_applies_when_reprules_patches_only_for_rules():
    """REPRULES_DORMANT=1 in a fresh interpreter: no sound types; registering the host
    function's rule installs the callbacks' hooks (as for an FFI target's)."""
    env = env_with_cpu_devices(8, {**os.environ, "REPRULES_DORMANT": "1",
                                   "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.getcwd()])})
    done = subprocess.run([sys.executable, "-c", DORMANT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-2:] == ["refused", "0.0"], done.stdout


# --- a custom_vjp around ruled callbacks differentiates exactly ---------------------------------
@jax.custom_vjp
def sin_cb(x):
    return pure(host_sin, x)


def _sin_fwd(x):
    return pure(host_sin, x), x


def _sin_bwd(x, g):
    return (jax.pure_callback(host_cos_times, shape_of(x), x, g),)


sin_cb.defvjp(_sin_fwd, _sin_bwd)


LOSSES = {  # x over data, w replicated; each loss psummed over data
    "callback_of_varying": (lambda x, w: jax.lax.psum(jnp.sum(sin_cb(x) * w), "data"),
                            lambda x, w: jnp.sum(jnp.sin(x) * w)),
    # sin_cb(w) typed replicated by its rule: its cotangent varies over data, psummed exactly
    "callback_of_replicated": (lambda x, w: jax.lax.psum(jnp.sum(x * sin_cb(w)), "data"),
                               lambda x, w: jnp.sum(x * jnp.sin(w))),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_gradient_through_a_custom_vjp_of_ruled_callbacks_is_exact(data, name, no_replication_warning):
    mesh, x, w = data
    register(host_sin, rules.same())
    register(host_cos_times, rules.same())
    loss, reference = LOSSES[name]
    f = shard_map(loss, mesh, (P("data", None), P()), P())
    got = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)
    want = jax.grad(reference, argnums=(0, 1))(np.asarray(x), np.asarray(w))
    assert max_err(got, want) < 1e-4


# --- verify() checks a callback's rule as a kernel's ---------------------------------------------
def test_verify_catches_a_lying_rule_on_a_pure_callback(data):
    mesh, x, _ = data
    register(host_sin, rules.invariant("data"))  # a lie: sin of data-varying rows varies over data
    f = jax.jit(shard_map(lambda x: pure(host_sin, x), mesh, P("data", None), P()))
    with pytest.raises(reprules.ReplicationMismatchError, match=r"(?s)output 0 of kernel 'host_sin' is declared "
                       r"replicated over mesh axis 'data' by its rule rules\.invariant\('data'\), but it differs "
                       r"across 'data'.*Fix: make the rule say the output varies over 'data'"):
        with reprules.verify():
            f(x)


def test_verify_catches_rules_same_on_an_io_callback_that_reads_host_state(data):
    mesh, _, w = data
    register(host_counter, rules.same())  # a lie: each device's call returns another value
    f = jax.jit(shard_map(lambda w: io(host_counter, w), mesh, P(), P()))
    with pytest.raises(reprules.ReplicationMismatchError, match=r"output 0 of kernel 'host_counter' is declared "
                       r"replicated over mesh axis '(data|model)' by its rule rules\.same\(\)"):
        with reprules.verify():
            f(w)


def test_verify_passes_a_true_rule(data):
    mesh, x, _ = data
    register(host_sin, rules.same())
    with reprules.verify():
        out = jax.jit(shard_map(lambda x: pure(host_sin, x), mesh, P("data", None), P("data", None)))(x)
    assert max_err(out, np.sin(np.asarray(x))) < 1e-6


# --- the rule-less warning shows the line to add --------------------------------------------------
@vma_era
def test_the_rule_less_warning_shows_the_decorator_line_and_following_it_silences_it(data):
    mesh, x, _ = data  # the callback called here: one warning per call site
    f = shard_map(lambda x: jax.pure_callback(host_plain, shape_of(x), x), mesh, P("data", None), P("data", None))
    with pytest.warns(reprules.ReplicationWarning, match=(
            r"(?s)The JAX callback 'pure_callback' .*has inputs varying over \{'data'\}.*Fix: declare how its "
            r"results vary, with `import reprules` and `from reprules import rules`: "
            r"`@reprules\.replication_rule\(rules\.same\(\)\)  # above def host_plain` if the host function "
            r"computes each result from its inputs' values alone.*`rules\.varying\('data', 'model'\)` in it if its "
            r"results differ per device.*`reprules\.replication_rule\(rule\)\(host_plain\)` for a function you "
            r"cannot edit")) as caught:
        before = jax.jit(f)(x)
    line = re.search(r"`@(reprules\.replication_rule\(rules\.same\(\)\))  # above def (\w+)`", str(caught[0].message))
    exec(f"{line[1]}({line[2]})", {"reprules": reprules, "rules": rules, "host_plain": host_plain})
    with warnings.catch_warnings():
        warnings.simplefilter("error", reprules.ReplicationWarning)
        after = jax.jit(shard_map(lambda x: pure(host_plain, x), mesh, P("data", None), P("data", None)))(x)
    assert max_err(before, after) == 0.0 and max_err(after, 2.0 * np.asarray(x)) == 0.0


@vma_era
def test_the_rule_less_io_callback_warning_shows_how_to_say_it_differs_per_device(data):
    mesh, _, w = data
    f = shard_map(lambda w: io_callback(host_plain, shape_of(w), w), mesh, P(), P(("data", "model")))
    with pytest.warns(reprules.ReplicationWarning, match=(
            r"(?s)The JAX callback 'io_callback' .*runs on every device against host state.*Fix: declare how its "
            r"results vary.*`@reprules\.replication_rule\(rules\.varying\('data', 'model'\)\)  # above def "
            r"host_plain` if they differ per device \(this typing, declared\); `rules\.same\(\)` in it instead")):
        jax.make_jaxpr(f)(w)
    register(host_plain, rules.varying("data", "model"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", reprules.ReplicationWarning)
        text = str(jax.make_jaxpr(shard_map(lambda w: io(host_plain, w), mesh, P(), P(("data", "model"))))(w))
    assert re.search(r"f32\[16\]\{(?:V:)?\(?(data, ?model|model, ?data)\)?\} = io_callback", text), text


# --- strict mode ------------------------------------------------------------------------------------
@vma_era
@pytest.mark.parametrize("call", [pure, io], ids=["pure_callback", "io_callback"])
def test_strict_accepts_a_ruled_callback_and_refuses_a_rule_less_one(data, call):
    mesh, x, w = data
    register(host_sin, rules.same())

    def loss(x, w):
        return jax.lax.psum(jnp.sum(call(host_sin, x) * w), "data")

    with reprules.strict():
        out = jax.jit(shard_map(loss, mesh, (P("data", None), P()), P()))(x, w)
        assert max_err(out, np.sum(np.sin(np.asarray(x)) * np.asarray(w))) < 1e-3
        with pytest.raises(reprules.StrictModeError, match=(
                rf"(?s)Strict mode: the JAX callback '{call.__name__}_callback'.*its host function has no replication "
                r"rule.*Fix: declare how its results vary.*# above def host_plain")):
            jax.make_jaxpr(shard_map(lambda x: call(host_plain, x), mesh, P("data", None), P("data", None)))(x)
