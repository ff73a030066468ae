"""Bad input beyond tests/test_registration.py, each error matched by its message.

test_registration.py covers Pallas kernels: an axis not in the mesh, the wrong
number of outputs, the wrong type, a raising rule, casting down, ``like`` out
of range or dishonest, non-kernels, partials, conflicts, a rule changed after
tracing and an unsupported JAX. Here: the same rule errors on every kind of
target (Pallas kernel, user primitive, FFI target), rule answers with
non-string axis names, unknown axes or the wrong number of input casts, a
conflicting registration on a primitive or an FFI target, FFI targets on a JAX
without ``ffi_call``, classes, Triton-looking objects without jax-triton, and
registering a primitive's rule after a function using it was traced.

Every message names the kernel and the JAX version and says how to fix it.
"""

from __future__ import annotations

import sys

import jax
import pytest
from jax.core import ShapedArray
from jax.experimental import pallas as pl
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

import reprules
from helpers import NEW_SHARD_MAP, make_mesh, put, randn, shard_map
from reprules import rules

JAX = jax.__version__.replace(".", r"\.")


# --- one target of each kind, all copying their input --------------------------------


def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def _primitive(name):
    p = Primitive(name)
    p.def_impl(lambda x: x * 1.0)
    p.def_abstract_eval(lambda a: ShapedArray(a.shape, a.dtype))  # drops the varying axes
    mlir.register_lowering(p, mlir.lower_fun(lambda x: x * 1.0, multiple_results=False))
    return p


copy_p = _primitive("bad_input_copy")
FFI_NAME = "reprules_bad_input_copy"  # traced only, never lowered: no C++ target needed


def _ffi_module():
    ffi = getattr(jax, "ffi", None)  # 0.5+
    if ffi is None or not hasattr(ffi, "ffi_call"):
        try:
            from jax.extend import ffi  # 0.4.31 - 0.4.38
        except ImportError:
            return None
    return ffi if hasattr(ffi, "ffi_call") else None


HAS_FFI = _ffi_module() is not None


def _pallas(x):
    return pl.pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


def _ffi(x):
    return _ffi_module().ffi_call(FFI_NAME, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


TARGETS = {
    "pallas": (lambda: copy_kernel, _pallas, "copy_kernel"),
    "primitive": (lambda: copy_p, copy_p.bind, "bad_input_copy"),
    "ffi": (lambda: reprules.ffi_target(FFI_NAME), _ffi, FFI_NAME),
}
TARGET_IDS = [
    pytest.param(name, marks=pytest.mark.skipif(name == "ffi" and not HAS_FFI, reason="no ffi_call before JAX 0.4.31"))
    for name in TARGETS
]


def _trace(call):
    """Traces ``call`` inside a checked shard_map, x varying over data."""
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    return jax.make_jaxpr(shard_map(call, mesh, P("data", None), P("data", None)))(x)


def _clean():
    assert not reprules.registered()
    from reprules import _shim

    assert _shim.active() == _shim.armed()  # no patch beyond arming


# --- rule answers that cannot be applied, on every kind of target ----------------------


def _raising(ctx, in_varying):
    raise ZeroDivisionError("boom")


BAD_RULES = {
    "axis_not_in_mesh": (rules.varying("modle"),
                         r"names mesh axes \['modle'\] that are not manual axes of the enclosing shard_map "
                         r"\(axes \{'data', 'model'\}.*Fix: name only axes of the shard_map's mesh in the rule: "
                         r"did you mean 'model' \(not 'modle'\)\?(\n|$)"),
    "axis_typo_in_invariant": (rules.invariant("modle", "dta"),
                               r"names mesh axes \['modle', 'dta'\].*did you mean 'model' \(not 'modle'\) and "
                               r"'data' \(not 'dta'\)\?(\n|$)"),
    "axis_far_from_mesh": (rules.invariant("pipeline"),  # nothing close: no guess
                           r"names mesh axes \['pipeline'\].*Fix: name only axes of the shard_map's mesh in the "
                           r"rule\.(\n|$)"),
    "custom_rule_unknown_axis": (lambda ctx, v: [frozenset({"modle"})],
                                 r"names axes \['modle'\] that are not manual axes.*Fix: name only axes.*"
                                 r"did you mean 'model' \(not 'modle'\)\?(\n|$)"),
    "like_out_of_range": (rules.like(3),
                          r"refers to input 3, but the kernel was called with 1 inputs.*Fix: use the index"),
    "too_many_outputs": (lambda ctx, v: [frozenset({"data"})] * 2,
                         r"returned 2 output varying sets, but the kernel has 1 outputs.*Fix: return one set per"),
    "non_string_axis": (lambda ctx, v: [frozenset({0})],
                        r"returned frozenset\(\{0\}\) for an output; axis names must be strings.*Fix: use the mesh"),
    "none": (lambda ctx, v: None,
             r"returned None of type NoneType.*Fix: return a reprules.rules.Decision"),
    "too_many_input_casts": (lambda ctx, v: rules.Decision(outputs=(frozenset({"data"}),),
                                                           inputs=(frozenset({"data"}),) * 2),
                             r"returned 2 input casts, but the kernel has 1 inputs.*Fix: return one set per"),
    "cast_down": (lambda ctx, v: rules.Decision(outputs=(frozenset(),), inputs=(frozenset(),)),
                  r"casts input 0 from \{'data'\} down to.*Why: making a varying value replicated.*Fix:"),
    "raising": (_raising, r"raised ZeroDivisionError: boom.*Fix: make the rule return"),
    "list_instead_of_axes": (rules.varying(["data", "model"]),
                             r"names mesh axes \[\['data', 'model'\]\] that are not manual axes"),
}


@pytest.mark.parametrize("target", TARGET_IDS)
@pytest.mark.parametrize("case", sorted(BAD_RULES))
def test_bad_rule_answers_on_every_kind_of_target(target, case):
    make, call, name = TARGETS[target]
    rule, message = BAD_RULES[case]
    reprules.replication_rule(rule)(make())
    with pytest.raises(reprules.RuleError, match=r"(?s)" + message) as info:
        _trace(call)
    text = str(info.value)
    assert repr(name) in text, text  # names the kernel ...
    assert f"JAX {jax.__version__}" in text, text  # ... and the JAX version
    assert "Fix:" in text
    assert isinstance(info.value, ValueError)  # existing `except ValueError` clauses still catch it


def test_raising_rule_keeps_the_original_exception_as_cause():
    reprules.replication_rule(_raising)(copy_p)
    with pytest.raises(reprules.RuleError) as info:
        _trace(copy_p.bind)
    chain, err = [], info.value
    while err is not None:
        chain.append(type(err))
        err = err.__cause__ or err.__context__
    assert ZeroDivisionError in chain


# --- registration ------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGET_IDS)
def test_conflicting_registration_names_the_target(target):
    make, _, name = TARGETS[target]
    where = {"pallas": rf"{__name__}\.copy_kernel", "primitive": "Primitive:bad_input_copy",
             "ffi": f"ffi_target:{FFI_NAME}"}[target]
    reprules.replication_rule(rules.same())(make())
    reprules.replication_rule(rules.same())(make())  # the same rule again: harmless
    with pytest.raises(reprules.RegistrationError,
                       match=rf"(?s)Kernel '{where}' already has the replication rule rules\.same\(\); refusing "
                             r"to replace it with rules\.like\(0\).*Why:.*Fix: pass override=True"):
        reprules.replication_rule(rules.like(0))(make())
    reprules.replication_rule(rules.like(0), override=True)(make())
    assert [r.rule for r in reprules.registered().values()] == [rules.like(0)]


@pytest.mark.skipif(HAS_FFI, reason="this JAX has ffi_call")
def test_ffi_target_on_a_jax_without_ffi_call():
    with pytest.raises(reprules.UnsupportedJaxError,
                       match=rf"(?s)Cannot apply a rule to FFI target 'my_target': JAX {JAX} has no ffi_call "
                             r"\(added in JAX 0\.4\.31\).*Fix: upgrade JAX to 0\.4\.31"):
        reprules.replication_rule()(reprules.ffi_target("my_target"))
    _clean()  # nothing registered, nothing patched


class NotAKernel:
    def __call__(self, x_ref, o_ref):
        o_ref[...] = x_ref[...]


@pytest.mark.parametrize("target", [NotAKernel, object(), None, "copy_kernel"], ids=["class", "object", "None", "str"])
def test_classes_and_other_objects_are_refused(target):
    kind = type(target).__name__
    with pytest.raises(reprules.RegistrationError,
                       match=rf"(?s)Cannot register a replication rule on .* \({kind}\): it is not a kernel "
                             r"function, a primitive, an FFI target or a Triton kernel\.\nWhy: .*\nFix: register "
                             r"the function passed to pl\.pallas_call"):
        reprules.replication_rule()(target)
    _clean()


def _triton_looking():
    """An object whose type lives in the ``triton`` package, like ``triton.JITFunction``."""
    cls = type("JITFunction", (), {"__module__": "triton.runtime.jit", "__call__": lambda self, *a: None})
    return cls()


def test_triton_kernel_without_jax_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax_triton", None)  # `import jax_triton` raises ImportError
    with pytest.raises(reprules.RegistrationError,
                       match=rf"(?s)Cannot apply a rule to the Triton kernel .*: jax-triton is not importable with "
                             rf"JAX {JAX} .*Fix: pip install 'reprules\[triton\]'") as info:
        reprules.replication_rule()(_triton_looking())
    assert isinstance(info.value.__cause__, ImportError)
    _clean()


# --- registering after tracing ----------------------------------------------------------


@pytest.mark.skipif(not NEW_SHARD_MAP, reason="JAX <= 0.5 refuses a rule-less primitive under check_rep")
def test_registering_a_primitive_rule_after_tracing_is_not_stale(monkeypatch):
    """Without a rule and with JAX's typing (``REPRULES_SOUND_TYPES=0``), JAX >= 0.6
    types the primitive's output replicated and accepts ``out_specs=P()`` (returning
    one device's shard); the jitted step is cached so. Registering the rule must
    retype the *same* jitted step."""
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    step = jax.jit(shard_map(copy_p.bind, mesh, P("data", None), P(None, None)))
    monkeypatch.setenv("REPRULES_SOUND_TYPES", "0")
    jax.clear_caches()
    assert step(x).shape == (2, 128)  # the hazard: silently one shard
    monkeypatch.delenv("REPRULES_SOUND_TYPES")
    reprules.replication_rule()(copy_p)
    with pytest.raises(ValueError, match="out_specs"):
        step(x)


# --- gaps found while writing these tests (library behaviour to fix) --------------------


def test_per_output_rule_on_a_multiple_results_primitive():
    two_p = Primitive("bad_input_two")
    two_p.multiple_results = True
    two_p.def_impl(lambda x: [x * 1.0, x * 2.0])
    two_p.def_abstract_eval(lambda a: [ShapedArray(a.shape, a.dtype)] * 2)
    mlir.register_lowering(two_p, mlir.lower_fun(lambda x: [x * 1.0, x * 2.0], multiple_results=True))
    seen = []

    def per_output(ctx, in_varying):  # output 0 like the input; output 1 also over model
        seen.append(ctx.num_outputs)
        union = frozenset().union(*in_varying)
        return [union, union | {"model"}]

    reprules.replication_rule(per_output)(two_p)
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    f = shard_map(lambda x: tuple(two_p.bind(x)), mesh, P("data", None), (P("data", None), P("data", "model")))
    a, b = jax.jit(f)(x)
    assert (a.shape, b.shape) == ((8, 128), (8, 256))
    assert set(seen) == {2}


def test_rule_class_instead_of_a_rule_is_refused_at_registration():
    with pytest.raises(reprules.RegistrationError, match=r"rules\.same\(\)"):
        reprules.replication_rule(rules.same)(copy_kernel)


@pytest.mark.parametrize("wrap", [jax.jit, jax.custom_vjp], ids=["jit", "custom_vjp"])
def test_transformed_functions_are_refused(wrap):
    with pytest.raises(reprules.RegistrationError, match="not a kernel"):
        reprules.replication_rule()(wrap(copy_kernel))


@pytest.mark.skipif(not HAS_FFI, reason="no ffi_call before JAX 0.4.31")
def test_ffi_target_name_must_be_a_string():
    with pytest.raises(reprules.RegistrationError, match="(?s)name as a non-empty string, got 42.*Fix:"):
        reprules.replication_rule()(reprules.ffi_target(42))


def test_rule_on_the_function_that_launches_the_kernel_is_refused():
    """A silent mistake made loud: a rule on the wrapper would never match."""

    def launch(x):
        return pl.pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)

    with pytest.raises(reprules.RegistrationError, match=(
            r"(?s)'.*launch': it calls pl\.pallas_call, so it is the function that launches a kernel.*"
            r"JAX \d+\.\d+.*Fix: register the kernel function passed to pl\.pallas_call")):
        reprules.replication_rule()(launch)
    assert not reprules.registered()
    reprules.replication_rule()(copy_kernel)  # the kernel itself is fine
