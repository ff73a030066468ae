"""Checking on is never worse than checking off: sound types where JAX's are too small.

From JAX 0.6, JAX types a rule-less opaque call (a user primitive whose abstract
eval returns ``ShapedArray(shape, dtype)``, ``ffi_call`` from 0.8.2,
``jax.pure_callback``) and control flow on a device-varying predicate
(jax#40823) replicated while they differ per device: with checking on, a
gradient misses its psum and ``out_specs=P()`` returns one device's value, where
checking off is right. With ``import reprules`` only, these are exact (or
refused), checked here against checking off and an unsharded reference, with
the psums counted in the jaxpr, the StableHLO and the compiled HLO.
"""

import inspect
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir
from jax.sharding import PartitionSpec as P

import reprules
from helpers import (JAX_VERSION, NEW_SHARD_MAP, count_all_reduce, max_err, psum_axes, put,
                     shard_map)
from reprules.testing import cpu_kernels

pytestmark = pytest.mark.skipif(not NEW_SHARD_MAP, reason="JAX <= 0.5 refuses rule-less primitives and "
                                "rewrites cond itself (check_rep); sound types are for JAX 0.6+")
VERSION = re.escape(jax.__version__)


def _copy_primitive(name):
    """A user primitive whose abstract eval drops the varying axes (kups' segment ops do)."""
    from jax.core import ShapedArray

    p = Primitive(name)
    p.def_impl(lambda x: x)
    p.def_abstract_eval(lambda x: ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(p, mlir.lower_fun(lambda x: x * 1.0, multiple_results=False))
    ad.deflinear2(p, lambda ct, x: [p.bind(ct)])
    return p


copy_p = _copy_primitive("sound_types_copy")
advised_p = _copy_primitive("sound_types_advised")


def _callback(x):
    return jax.pure_callback(lambda a: np.asarray(a), jax.ShapeDtypeStruct(x.shape, x.dtype), x)


OPS = {
    "primitive": (copy_p.bind, "primitive 'sound_types_copy'"),
    "pure_callback": (_callback, "JAX callback 'pure_callback'"),
}
if cpu_kernels.unavailable_reason() is None:
    OPS["ffi_call"] = (cpu_kernels.copy, "FFI target 'reprules_copy'")


def _loss(op):
    def loss(x, w):  # data parallel: x over data, w replicated, the loss psummed over data
        return jax.lax.psum(jnp.sum(op(x) * w), "data")
    return loss


def _grad(op, mesh, check):
    return jax.jit(jax.grad(shard_map(_loss(op), mesh, (P("data", None), P()), P(), check=check), argnums=1))


@pytest.mark.parametrize("name", sorted(OPS))
def test_rule_less_opaque_call_gradient_is_exact(data, name):
    op, subject = OPS[name]
    mesh, x, w = data
    reference = jax.grad(lambda x, w: jnp.sum(x * w), argnums=1)(np.asarray(x), np.asarray(w))
    off = _grad(op, mesh, False)(x, w)
    if name == "ffi_call" and JAX_VERSION < (0, 8, 2):  # ffi_call typed its outputs by its inputs then
        with warnings.catch_warnings():
            warnings.simplefilter("error", reprules.ReplicationWarning)
            assert max_err(_grad(op, mesh, True)(x, w), reference) < 1e-4
        return
    with pytest.warns(reprules.ReplicationWarning, match=(
            rf"(?s)The {re.escape(subject)} \(called at .*test_sound_types.py.*inputs varying over \{{'data'\}}, "
            rf"but JAX typed its outputs replicated over \{{'data'\}} \(mesh axes \{{'data', 'model'\}}, JAX {VERSION}\)"
            r".*Why: .*silently.*Fix: .*REPRULES_SOUND_TYPES=0")):
        on = _grad(op, mesh, True)(x, w)
    assert max_err(off, reference) < 1e-4
    assert max_err(on, reference) < 1e-4  # was off by the other shards' rows
    if name != "pure_callback":  # a host callback's HLO cannot be compiled twice here: jaxpr only
        # dL/dw psummed over data once (the jaxpr keeps the loss's own forward psum too; compiled,
        # only the needed one is left), none over model
        grad = jax.grad(shard_map(_loss(op), mesh, (P("data", None), P()), P()), argnums=1)
        assert psum_axes(grad, x, w) == [("data",), ("data",)]
        assert count_all_reduce(grad, x, w)[1:] == (1, 1)


@pytest.mark.parametrize("name", sorted(OPS))
def test_replicated_out_specs_over_a_varying_opaque_result_is_refused(data, name):
    op, subject = OPS[name]
    mesh, x, _ = data
    note = (rf"(?s)out_specs.*check_vma=False.*reprules \(mesh axes \{{'data', 'model'\}}, JAX {VERSION}\): these values vary over \{{'data'\}}.*"
            rf"the {re.escape(subject)}, which has no rule at .*test_sound_types.py.*Fix: keep \{{'data'\}} in the "
            r"out_specs")
    if name == "ffi_call" and JAX_VERSION < (0, 8, 2):
        note = "out_specs"  # JAX typed it varying itself: its own refusal, nothing to add
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", reprules.ReplicationWarning)
        with pytest.raises(ValueError, match=note):
            jax.jit(shard_map(lambda x: op(x), mesh, P("data", None), P()))(x)  # the user's function


def test_following_the_warnings_advice_gives_the_same_exact_gradient_silently(data, monkeypatch):
    """The warning's fix, applied as printed (rules.same() on the primitive): no warning,
    the same exact gradient; REPRULES_SOUND_TYPES=0 keeps JAX's typing (the hazard)."""
    mesh, x, w = data
    with pytest.warns(reprules.ReplicationWarning) as caught:
        _grad(advised_p.bind, mesh, True)(x, w)
    # The primitive named where the user reaches it (this module's attribute), each line pasted as printed.
    fix = re.search(rf"`(from {__name__} import advised_p)`, `(import reprules)`, `(from reprules import rules)` "
                    r"and `(reprules\.replication_rule\(rules\.same\(\)\)\(advised_p\))`",
                    str(caught[0].message))
    assert fix, str(caught[0].message)
    exec("\n".join(fix.groups()), {})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", reprules.ReplicationWarning)
            jax.clear_caches()
            with reprules.verify():
                declared = _grad(advised_p.bind, mesh, True)(x, w)
        assert max_err(declared, _grad(advised_p.bind, mesh, False)(x, w)) < 1e-5
    finally:
        reprules.unregister(advised_p)
    monkeypatch.setenv("REPRULES_SOUND_TYPES", "0")
    jax.clear_caches()
    jax_typed = _grad(advised_p.bind, mesh, True)(x, w)
    assert max_err(jax_typed, _grad(advised_p.bind, mesh, False)(x, w)) > 1.0  # JAX alone: silently wrong
    jax.clear_caches()


def test_strict_still_refuses_a_rule_less_opaque_call(data):
    mesh, x, w = data
    with reprules.strict():
        with pytest.raises(reprules.StrictModeError, match="sound_types_copy"):
            _grad(copy_p.bind, mesh, True)(x, w)


def test_an_opaque_call_jax_types_soundly_is_left_alone(data):
    """A primitive whose abstract eval keeps the varying axes: no cast, no warning, the same jaxpr."""
    p = Primitive("sound_types_keeps")
    p.def_impl(lambda x: x)
    p.def_abstract_eval(lambda x: x)  # x's own type, varying axes included
    mlir.register_lowering(p, mlir.lower_fun(lambda x: x, multiple_results=False))
    mesh, x, _ = data
    f = shard_map(p.bind, mesh, P("data", None), P("data", None))
    with warnings.catch_warnings():
        warnings.simplefilter("error", reprules.ReplicationWarning)
        text = str(jax.make_jaxpr(f)(x))
    assert "pvary" not in text and "pcast" not in text, text


# --- control flow on a varying predicate (jax#40823) --------------------------------
def test_jax_40823_cond_on_axis_index_differentiates_like_checking_off():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("i",))

    def f(x):
        return jax.lax.cond(jax.lax.axis_index("i") == 0, lambda: 2 * x, lambda: 3 * x)

    def grad(check):
        return jax.grad(lambda x: shard_map(f, mesh, P(), P("i"), check=check)(x).sum())(jnp.ones(1))

    assert float(grad(False)[0]) == 5.0
    assert float(grad(True)[0]) == 5.0  # JAX alone: 4 (device 0's branch, twice)


def test_switch_on_a_data_varying_index_gradient_is_exact(data):
    mesh, x, _ = data
    w = put(jnp.linspace(0.5, 2.0, 16), mesh, P())

    def body(x, w):
        i = (x.sum() > 60.0).astype(jnp.int32) + (x.sum() > 70.0).astype(jnp.int32)
        y = jax.lax.switch(i, [lambda w: 2.0 * w, lambda w: jnp.sin(w), lambda w: w * w], w)
        return jax.lax.psum(y.sum(), "data")

    def reference(x, w):  # per shard of 2 rows, as each device computes it
        total = 0.0
        for shard in jnp.split(x, 4):
            i = (shard.sum() > 60.0).astype(jnp.int32) + (shard.sum() > 70.0).astype(jnp.int32)
            total = total + jax.lax.switch(i, [lambda w: 2.0 * w, lambda w: jnp.sin(w), lambda w: w * w], w).sum()
        return total

    sums = [float(s.sum()) for s in jnp.split(np.asarray(x), 4)]
    assert len({(s > 60.0) + (s > 70.0) for s in sums}) > 1, sums  # the devices take different branches
    expected = jax.grad(reference, argnums=1)(np.asarray(x), np.asarray(w))
    f = shard_map(body, mesh, (P("data", None), P()), P())
    for check in (False, True):
        got = jax.jit(jax.grad(shard_map(body, mesh, (P("data", None), P()), P(), check=check), argnums=1))(x, w)
        assert max_err(got, expected) < 1e-4, check
    assert psum_axes(jax.grad(f, argnums=1), x, w) == [("data",), ("data",)]  # the loss's, and dL/dw's
    assert count_all_reduce(jax.grad(f, argnums=1), x, w)[1:] == (1, 1)  # compiled: dL/dw's, outside the switch


def test_branches_calling_custom_jvp_functions_are_retyped_with_their_rules(data):
    """jax.nn.relu is a custom_jvp: retyped with its own JVP rule kept (its gradient at 0 is 0),
    under jax_custom_jvp3 (a hijax call) too: JAX traces the branch again on the new types."""
    mesh, x, _ = data
    _custom_jvp_branches_gradient(mesh, x, check=True, compare=True)


def _custom_jvp_branches_gradient(mesh, x, check, compare=False):
    w = put(jnp.array([-1.0, 0.0, 0.5, 2.0]), mesh, P())

    def branches(x, w):
        return jax.lax.cond(x.sum() > 70.0, lambda: jax.nn.relu(w) * 2.0, lambda: jax.nn.softplus(w))

    def body(x, w):
        return jax.lax.psum(branches(x, w).sum(), "data")

    expected = jax.grad(lambda w: sum(branches(s, w).sum() for s in jnp.split(np.asarray(x), 4)))(np.asarray(w))
    for checked in (False, True) if compare else (check,):
        got = jax.jit(jax.grad(shard_map(body, mesh, (P("data", None), P()), P(), check=checked), argnums=1))(x, w)
        assert max_err(got, expected) < 1e-5, checked


def test_replicated_out_specs_over_varying_control_flow_is_refused(data):
    mesh, x, _ = data

    def cond(x):
        return jax.lax.cond(x.sum() > 70.0, lambda: 1.0, lambda: 0.0)

    def loop(x):
        n = x.sum() / 8.0
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1.0, c[1] * 2.0), (0.0, 1.0))[1]

    for f, what in ((cond, "lax.cond"), (loop, "lax.while_loop")):
        with pytest.raises(ValueError, match=(  # JAX alone: accepted, device 0's value
                rf"(?s)out_specs.*reprules \(mesh axes \{{'data', 'model'\}}, JAX {VERSION}\): these values vary over \{{'data'\}}.*a {what} whose "
                rf"predicate varies over \['data'\] \(jax#40823\) at .*test_sound_types.py:\d+ \({f.__name__}\).*"
                r"Fix: keep \{'data'\}")):
            jax.jit(shard_map(f, mesh, P("data", None), P()))(x)
        per_device = jax.jit(shard_map(lambda x: f(x)[None], mesh, P("data", None), P("data")))(x)
        unchecked = jax.jit(shard_map(lambda x: f(x)[None], mesh, P("data", None), P("data"), check=False))(x)
        expected = [f(s) for s in jnp.split(np.asarray(x), 4)]
        assert max_err(per_device, unchecked) == 0.0 and max_err(per_device, jnp.stack(expected)) == 0.0


def test_control_flow_whose_branches_cannot_be_retyped_is_refused_with_advice_that_works(data):
    """A cond reprules meets only at its bind (``from jax.lax import cond`` run before
    ``import reprules`` keeps JAX's own function, here ``inspect.unwrap`` finds it) whose branch
    holds a scan over a captured replicated value: the scan's jaxpr cannot be retyped,
    so it refuses, naming the cond, the axes and the fix; the fix as printed (cast the
    captured value up first) gives the exact gradient. (Through ``jax.lax.cond`` the
    same program is re-traced and exact: tests/test_retrace.py.)"""
    mesh, x, w = data
    jax_cond = inspect.unwrap(jax.lax.cond)

    def body(x, w, cast):
        w = cast(w)
        y = jax_cond(x.sum() > 70.0,
                     lambda: jax.lax.scan(lambda c, _: (c * w, None), w, None, length=2)[0],
                     lambda: w)
        return jax.lax.psum(y.sum(), "data")

    with pytest.raises(reprules.RuleError, match=(
            rf"(?s)A lax.cond / lax.switch \(called at .*test_sound_types.py.*varies over \{{'data'\}}.*"
            rf"JAX {VERSION}; jax#40823.*hold a scan at .*test_sound_types.py.*Fix: cast every value the branches "
            r"use \(captured ones too\) up to \{'data'\} before the lax.cond, e.g. x = (jax\.lax\.[^\n;]+);")) as err:
        jax.jit(shard_map(lambda x, w: body(x, w, lambda v: v), mesh, (P("data", None), P()), P()))(x, w)
    cast_text = re.search(r"e\.g\. x = (jax\.lax\.[^\n;]+);", str(err.value))[1]
    cast = eval(f"lambda x: {cast_text}", {"jax": jax})
    got = jax.jit(jax.grad(shard_map(lambda x, w: body(x, w, cast), mesh, (P("data", None), P()), P()),
                           argnums=1))(x, w)
    off = jax.jit(jax.grad(shard_map(lambda x, w: body(x, w, lambda v: v), mesh, (P("data", None), P()), P(),
                                     check=False), argnums=1))(x, w)
    assert max_err(got, off) < 1e-4


def test_control_flow_retyped_by_an_enclosing_one_is_refused_naming_the_enclosing_axes(data):
    """The same, one level down: a cond on a replicated predicate inside one on a varying
    predicate, both met only at their binds. The outer one casts its branch's values up; the
    inner one, holding a scan, cannot be typed again for them: the refusal says so (its own
    predicate varies over nothing) and names the enclosing axes."""
    mesh, x, w = data
    jax_cond = inspect.unwrap(jax.lax.cond)

    def body(x, w):
        def inner():  # its predicate replicated (a constant): only the enclosing cond's cast retypes it
            return jax_cond(jnp.ones(()) > 0.0,
                            lambda: jax.lax.scan(lambda c, _: (c * w, None), w, None, length=2)[0], lambda: w)

        return jax.lax.psum(jax_cond(x.sum() > 70.0, inner, lambda: w).sum(), "data")

    with pytest.raises(reprules.RuleError, match=(
            rf"(?s)A lax.cond / lax.switch \(called at .*test_sound_types.py.*sits in a branch of control flow whose "
            rf"predicate varies over \{{'data'\}}: reprules cast that branch's values up to \{{'data'\}}.*JAX {VERSION}; "
            r"jax#40823.*hold a scan at .*Fix: cast every value")):
        jax.jit(shard_map(body, mesh, (P("data", None), P()), P()))(x, w)


def test_control_flow_on_a_replicated_predicate_is_left_as_jax_types_it(data, monkeypatch):
    mesh, x, w = data

    def body(x, w):
        y = jax.lax.cond(w.sum() > 0, lambda: x * w, lambda: x - w)  # replicated predicate
        return jax.lax.while_loop(lambda c: c.sum() < 1e3, lambda c: c * 2.0 + 1.0, y)

    f = shard_map(body, mesh, (P("data", None), P()), P("data", None))
    ours = str(jax.make_jaxpr(f)(x, w))
    monkeypatch.setenv("REPRULES_SOUND_TYPES", "0")
    jax.clear_caches()
    assert str(jax.make_jaxpr(f)(x, w)) == ours
    jax.clear_caches()


def test_the_switch_is_documented_and_read_at_trace_time(monkeypatch):
    from reprules import _mode_state

    assert _mode_state.sound_types()
    monkeypatch.setenv("REPRULES_SOUND_TYPES", "0")
    assert not _mode_state.sound_types()


def test_a_jit_inside_shard_map_differentiates_as_with_jax_alone(data):
    """JAX 0.12 makes an ad.VJPNode primitive per jit under vjp (not a module global): it is JAX's,
    never an opaque call; its psummed output stays replicated (the parity run found it widened)."""
    mesh, x, _ = data

    @jax.jit
    def inner(x):
        return jax.lax.psum(jnp.sin(x), "data")

    f = shard_map(lambda x: inner(x), mesh, P("data", None), P())
    with warnings.catch_warnings():
        warnings.simplefilter("error", reprules.ReplicationWarning)
        got = jax.grad(lambda x: f(x).sum())(x)
    off = jax.grad(lambda x: shard_map(lambda x: inner(x), mesh, P("data", None), P(), check=False)(x).sum())(x)
    assert max_err(got, jnp.cos(np.asarray(x))) < 1e-5 and max_err(got, off) < 1e-5


def test_sound_types_are_armed_when_the_shim_imports_jax_first():
    """`reprules.jax_support()` before `import jax`: the shim's own import of JAX runs the arming
    hook while the shim is half loaded; it arms at the shim's end (it was left off, silently)."""
    import subprocess
    import sys

    code = ("import warnings; warnings.simplefilter('error')\n"
            "import reprules; reprules.jax_support()\n"
            "assert 'jax._src.core.Primitive.bind' in [p for p, _ in reprules.jax_patches()]\n")
    subprocess.run([sys.executable, "-c", code], check=True)
