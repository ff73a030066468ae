"""JAX's host callbacks under checking: typed soundly, refused by strict mode, the switch per trace.

``jax.pure_callback`` and ``jax.experimental.io_callback`` type their results by
``result_shape_dtypes`` with the varying axes dropped: from JAX 0.6, replicated
whatever the inputs (issue 42). A pure callback's results are typed by the union
of its inputs' axes (``test_sound_types.py``); an ``io_callback`` runs on every
device against host state, so its results may differ per device even from
replicated inputs: they are typed varying over every manual axis of the
``shard_map``, with one ReplicationWarning per call site. ``reprules.strict()``
refuses both. (A rule on the host function types either: ``test_callback_rules.py``.) ``REPRULES_SOUND_TYPES`` (and every mode's variable) is read per
trace: JAX caches traces by its own config only, so a change drops its caches.
JAX's own callbacks (its Pallas TPU interpreter simulates kernels through
``io_callback``) are left to JAX. On JAX <= 0.5 (``check_rep``), JAX's own rules
type both callbacks' results varying over every mesh axis: the last test.
"""

import functools
import inspect
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback
from jax.sharding import PartitionSpec as P

import reprules
from helpers import JAX_VERSION, NEW_SHARD_MAP, max_err, put, randn, shard_map

vma_era = pytest.mark.skipif(not NEW_SHARD_MAP, reason="JAX <= 0.5 types callbacks varying over every mesh axis "
                             "itself (check_rep rules); sound types and strict mode are for JAX 0.6+")
VERSION = re.escape(jax.__version__)
MESH_AXES = r"\(mesh axes \{'data', 'model'\}, JAX " + VERSION + r"\)"


def host_copy(a):
    return np.asarray(a)


def pure(x):
    return jax.pure_callback(host_copy, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def io(x, ordered=False):
    return io_callback(host_copy, jax.ShapeDtypeStruct(x.shape, x.dtype), x, ordered=ordered)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def io_vjp(x, ordered):
    """An io_callback JAX can differentiate: a custom_vjp whose bwd passes the cotangent through."""
    return io(x, ordered)


io_vjp.defvjp(lambda x, ordered: (io(x, ordered), None), lambda ordered, _, g: (g,))


def reference(x, w):
    """The unsharded gradient of sum(x * w) in both arguments (the callbacks copy)."""
    return jax.grad(lambda x, w: jnp.sum(x * w), argnums=(0, 1))(np.asarray(x), np.asarray(w))


def io_loss(ordered):
    def loss(x, w):  # x over data, w replicated; the io_callback's result may vary over model too
        return jax.lax.pmean(jax.lax.psum(jnp.sum(io_vjp(x, ordered) * w), "data"), "model")
    return loss


def io_grad(mesh, ordered=False, check=True):
    f = shard_map(io_loss(ordered), mesh, (P("data", None), P()), P(), check=check)
    return jax.jit(jax.grad(f, argnums=(0, 1)))


def io_warning():
    return (rf"(?s)The JAX callback 'io_callback' \(called at .*test_callbacks_sound.py.*runs on every device "
            r"against host state, so its results may differ per device whatever its inputs, but JAX typed them "
            rf"replicated over \{{'data', 'model'\}} {MESH_AXES}.*Why: .*silently.*varying over "
            r"\{'data', 'model'\}, every manual axis of the shard_map.*Fix: .*REPRULES_SOUND_TYPES=0")


# --- io_callback typed varying over every manual axis --------------------------------------------
@vma_era
@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
def test_io_callback_gradient_through_a_custom_vjp_is_exact(data, ordered):
    """Its result typed varying over model too, the pass-through bwd's cotangent for x is psummed
    over model (as for a kernel's rule); JAX alone: silently wrong on 0.6, refused from 0.8."""
    mesh, x, w = data
    with warnings.catch_warnings():  # the warning: once per call site (the one in io()), tested below
        warnings.simplefilter("ignore", reprules.ReplicationWarning)
        got = io_grad(mesh, ordered)(x, w)
    assert max_err(got, reference(x, w)) < 1e-4


@vma_era
def test_io_callback_on_replicated_inputs_is_typed_varying_over_every_axis(data):
    """Its inputs are replicated, yet each device runs it against its own host state."""
    mesh, _, w = data
    f = shard_map(lambda w: io_callback(host_copy, jax.ShapeDtypeStruct(w.shape, w.dtype), w), mesh, P(),
                  P(("data", "model")))
    with pytest.warns(reprules.ReplicationWarning, match=io_warning()) as caught:
        text = str(jax.make_jaxpr(f)(w))
        jax.make_jaxpr(f)(w)  # one warning per call site
    assert len([c for c in caught if c.category is reprules.ReplicationWarning]) == 1
    assert re.search(r"f32\[16\]\{(?:V:)?\(?(data, ?model|model, ?data)\)?\} = io_callback", text), text
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", reprules.ReplicationWarning)
        out = jax.jit(f)(w)
    assert out.shape == (128,) and max_err(out, np.tile(np.asarray(w), 8)) == 0.0


@vma_era
@pytest.mark.parametrize("name", ["pure_callback", "io_callback", "io_callback_ordered"])
def test_replicated_out_specs_over_a_callback_result_is_refused(data, name):
    mesh, x, _ = data
    op = {"pure_callback": pure, "io_callback": io, "io_callback_ordered": functools.partial(io, ordered=True)}[name]
    what = ("the JAX callback 'pure_callback', which has no rule" if name == "pure_callback"
            else "the JAX callback 'io_callback', which runs on every device")
    note = (rf"(?s)out_specs.*reprules \(mesh axes \{{'data', 'model'\}}, JAX {VERSION}\): these values vary over .*{what} at "
            r".*test_callbacks_sound.py.*Fix: keep .* in the out_specs")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", reprules.ReplicationWarning)
        with pytest.raises(ValueError, match=note):
            jax.jit(shard_map(lambda x: op(x), mesh, P("data", None), P()))(x)


@vma_era
def test_io_callback_keeps_jax_typing_with_sound_types_off(data, monkeypatch):
    """REPRULES_SOUND_TYPES=0: JAX's replicated typing, P() accepted, no warning (the hazard)."""
    mesh, x, _ = data
    monkeypatch.setenv("REPRULES_SOUND_TYPES", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error", reprules.ReplicationWarning)
        out = jax.jit(shard_map(lambda x: io(x), mesh, P("data", None), P()))(x)
    assert out.shape == (2, 16)  # one device's block


# --- strict mode refuses every rule-less callback -------------------------------------------------
def strict_error(name, why, typed):
    return (rf"(?s)Strict mode: the JAX callback '{name}' \(called at [^ ]*test_callbacks_sound.py:\d+ .*"
            rf"test_callbacks_sound.py:\d+ \(<lambda>\)\): {why}, but JAX typed its output 0 replicated over "
            rf"{typed} {MESH_AXES}.*"
            r"Why: a JAX callback cannot say how its results vary.*its host function has no replication rule.*"
            r"Fix: declare how its results vary.*`@reprules\.replication_rule\(.*\)  # above def host_copy`.*"
            r"Or call it outside reprules.strict\(\).*or outside the shard_map")


@vma_era
@pytest.mark.parametrize("name", ["pure_callback", "io_callback", "io_callback_ordered"])
def test_strict_refuses_a_rule_less_callback_naming_it(data, name):
    mesh, x, w = data
    op = {"pure_callback": pure, "io_callback": io, "io_callback_ordered": functools.partial(io, ordered=True)}[name]
    if name == "pure_callback":
        match = strict_error("pure_callback", r"its inputs vary over \{'data'\}, so its results may too",
                             r"\{'data'\}")
    else:
        match = strict_error("io_callback", "it runs on every device against host state, so its results may "
                             "differ per device whatever its inputs", r"\{'data', 'model'\}")
    f = shard_map(lambda x, w: jax.lax.psum(jnp.sum(op(x) * w), ("data", "model")), mesh, (P("data", None), P()), P())
    with reprules.strict():
        with pytest.raises(reprules.StrictModeError, match=match):
            jax.jit(jax.grad(f, argnums=1))(x, w)  # JAX's typing kept: off by the other shards' rows


@vma_era
def test_strict_refuses_an_io_callback_on_replicated_inputs(data):
    mesh, _, w = data
    with reprules.strict():
        with pytest.raises(reprules.StrictModeError, match=r"(?s)'io_callback'.*whatever its inputs.*replicated over "
                           r"\{'data', 'model'\}"):
            jax.make_jaxpr(shard_map(lambda w: io(w), mesh, P(), P()))(w)


@vma_era
def test_strict_through_its_environment_variable_refuses_callbacks_per_trace(data, monkeypatch):
    """REPRULES_STRICT=1 set after a trace: the next trace refuses; unset again, it is accepted."""
    mesh, x, _ = data

    def body(x):
        return pure(x)

    f = shard_map(body, mesh, P("data", None), P("data", None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", reprules.ReplicationWarning)
        jax.make_jaxpr(f)(x)
        monkeypatch.setenv("REPRULES_STRICT", "1")
        with pytest.raises(reprules.StrictModeError, match="'pure_callback'"):
            jax.make_jaxpr(f)(x)
        monkeypatch.delenv("REPRULES_STRICT")
        jax.make_jaxpr(f)(x)


@vma_era
def test_the_inference_switch_is_honoured_per_trace(data, monkeypatch):
    """REPRULES_INFER=0 set after a rule-less kernel was traced with a derived rule: the next
    trace of the same function gets the MissingRuleError; unset again, the derived rule."""
    from helpers import copy

    mesh, x, _ = data
    f = shard_map(copy, mesh, P("data", None), P("data", None))
    jax.make_jaxpr(f)(x)
    monkeypatch.setenv("REPRULES_INFER", "0")
    with pytest.raises(reprules.MissingRuleError, match="copy_kernel"):
        jax.make_jaxpr(f)(x)
    monkeypatch.delenv("REPRULES_INFER")
    assert max_err(jax.jit(f)(x), x) == 0.0


# --- the switch is honoured per trace ---------------------------------------------------------------
@jax.jit
def inner_pure(x):
    """Cached by JAX per function: its trace must not outlive a mode switch."""
    return pure(x)


def pure_loss(x, w):
    return jax.lax.psum(jnp.sum(inner_pure(x) * w), "data")


def _grads(mesh, x, w):
    """Three new traces of the same user functions: w's gradient under a new jit and an eager
    grad, and whether the jaxpr types the callback's result varying over data."""
    f = shard_map(pure_loss, mesh, (P("data", None), P()), P())
    jitted = jax.jit(jax.grad(f, argnums=1))(x, w)
    eager = jax.grad(f, argnums=1)(x, w)
    text = str(jax.make_jaxpr(shard_map(lambda x: inner_pure(x), mesh, P("data", None), P("data", None)))(x))
    return jitted, eager, re.search(r"f32\[2,16\](\{(?:V:)?\(?data\)?\})? = pure_callback", text)[1] is not None


@vma_era
@pytest.mark.parametrize("order", [("1", "0"), ("0", "1")], ids=["on_then_off", "off_then_on"])
def test_the_sound_types_switch_is_honoured_per_trace(data, monkeypatch, order):
    mesh, x, w = data
    want = reference(x, w)[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", reprules.ReplicationWarning)
        for mode in [*order, order[0]]:
            monkeypatch.setenv("REPRULES_SOUND_TYPES", mode)
            jitted, eager, typed_varying = _grads(mesh, x, w)
            if mode == "1":  # sound: exact
                assert typed_varying and max_err(jitted, want) < 1e-4 and max_err(eager, want) < 1e-4
            else:  # JAX's typing: the psum over data is missed
                assert not typed_varying and max_err(jitted, want) > 1.0 and max_err(eager, want) > 1.0


@vma_era
def test_the_switch_is_honoured_for_io_callback(data, monkeypatch):
    mesh, x, w = data
    want = reference(x, w)
    f = shard_map(lambda x: io(x), mesh, P("data", None), P())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", reprules.ReplicationWarning)
        assert max_err(io_grad(mesh)(x, w), want) < 1e-4
        monkeypatch.setenv("REPRULES_SOUND_TYPES", "0")  # JAX's typing: P() accepted (one device's block)
        assert jax.jit(f)(x).shape == (2, 16)
        try:  # and the gradient silently wrong (0.6), or the pass-through bwd refused (0.8+)
            assert max_err(io_grad(mesh)(x, w), want) > 1.0
        except ValueError as err:
            assert re.search(r"Custom VJP bwd rule|the bwd rule attached to", str(err)), err  # (jax_custom_vjp3's)
        monkeypatch.setenv("REPRULES_SOUND_TYPES", "1")
        with pytest.raises(ValueError, match="out_specs"):
            jax.jit(f)(x)
        assert max_err(io_grad(mesh)(x, w), want) < 1e-4


# --- JAX's own callbacks: its Pallas TPU interpreter ---------------------------------------------
@pytest.mark.skipif(JAX_VERSION < (0, 8), reason="pl.kernel under force_tpu_interpret_mode: JAX 0.8+")
def test_the_pallas_tpu_interpreters_callbacks_are_left_to_jax(data):
    """pl.kernel in TPU interpret mode binds io_callbacks in the checked trace (its buffers, DMAs
    and semaphores): no warning, no strict refusal, the rule's types, the exact result."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def body(x_ref, o_ref):
        def scoped(buf):
            pltpu.sync_copy(x_ref, buf)
            buf[...] = buf[...] * 2.0
            pltpu.sync_copy(buf, o_ref)

        pl.run_scoped(scoped, pltpu.VMEM(x_ref.shape, x_ref.dtype))

    mesh, _, _ = data
    x = put(randn(2, (8, 128)), mesh, P("data", None))
    reprules.replication_rule(reprules.rules.same())(body)
    make = getattr(pltpu, "TensorCoreMesh", None)  # 0.11+: create_tensorcore_mesh deprecated
    if make is not None and "axis_name" in inspect.signature(make).parameters:
        core = make(axis_name="core", num_cores=1)
    else:
        core = pltpu.create_tensorcore_mesh("core", num_cores=1)
    f = jax.jit(shard_map(lambda x: pl.kernel(body, jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=core)(x), mesh,
                          P("data", None), P("data", None)))
    with pltpu.force_tpu_interpret_mode(), warnings.catch_warnings():
        warnings.simplefilter("error", reprules.ReplicationWarning)
        assert max_err(f(x), 2 * np.asarray(x)) == 0.0
        jax.clear_caches()
        with reprules.strict():
            assert max_err(f(x), 2 * np.asarray(x)) == 0.0


# --- JAX <= 0.5: its own check_rep rules ------------------------------------------------------------
@pytest.mark.skipif(NEW_SHARD_MAP, reason="check_rep's own callback rules: JAX <= 0.5")
@pytest.mark.parametrize("name", ["pure_callback", "io_callback"])
def test_rep_era_jax_types_callbacks_varying_over_every_axis(data, name):
    """check_rep's rules type a callback's results replicated over no axis: out_specs=P() is
    refused by JAX itself, and the gradient through a custom_vjp is exact (JAX psums the
    cotangent itself); reprules.strict() changes nothing there."""
    mesh, x, w = data
    op = pure if name == "pure_callback" else io
    with reprules.strict(), pytest.raises(ValueError, match="out_specs"):
        jax.jit(shard_map(lambda x: op(x), mesh, P("data", None), P()))(x)
    if name == "io_callback":
        assert max_err(io_grad(mesh)(x, w), reference(x, w)) < 1e-4
