"""reprules owns only what it installs: another library's wrapper on the same
JAX attribute survives reprules deactivating, before or after reprules."""

import types

import jax
import numpy as np
import pytest
from helpers import make_mesh, max_err, put, randn, shard_map
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from reprules._shim.plumbing import _jax, _patches
from reprules._shim.kernels import _identity
from reprules._shim.rules import _resolve
from reprules._shim.entry_points import pallas_call


# --- the mechanism, on plain Python objects ----------------------------------------
class Target:
    def method(self, x):
        return ("method", x)


def _targets():
    module = types.ModuleType("fake_jax_module")
    module.function = lambda x: ("function", x)
    instance = Target()
    table = {"key": lambda x: ("entry", x)}
    return module, instance, table


def _wrap(fn, log, tag):
    def wrapper(*args, **kwargs):
        log.append(tag)
        return fn(*args, **kwargs)

    return wrapper


def test_patches_restore_under_a_wrapper_installed_before_them():
    module, _, _ = _targets()
    log = []
    module.function = theirs = _wrap(module.function, log, "theirs")
    patches = _patches.Patches()
    patches.setattr(module, "function", _wrap(module.function, log, "ours"))
    assert module.function(1) == ("function", 1) and log == ["ours", "theirs"]
    patches.undo_all()  # no warning: everything restored
    assert module.function is theirs
    log.clear()
    assert module.function(2) == ("function", 2) and log == ["theirs"]


@pytest.mark.parametrize("kind", ["module", "class", "instance", "dict"])
def test_patches_leave_a_later_wrapper_in_place_and_pass_calls_through(kind):
    module, instance, table = _targets()
    log = []
    patches = _patches.Patches()
    original_method = vars(Target)["method"]
    if kind == "module":  # (holder, name) of the attribute; call: how JAX would call it
        where, holder, call = "fake_jax_module.function", module, lambda: module.function(1)
        patches.setattr(module, "function", _wrap(module.function, log, "ours"))
    elif kind == "class":
        where, holder, call = "test_patches.Target.method", Target, lambda: instance.method(1)
        patches.setattr(Target, "method", _wrap(original_method, log, "ours"))
    elif kind == "instance":  # an instance attribute shadowing its class's method (Primitive.bind)
        where, holder, call = "Target.method", instance, lambda: instance.method(1)
        patches.setattr(instance, "method", _wrap(instance.method, log, "ours"))
    else:
        where, holder, call = "the table", None, lambda: table["key"](1)
        patches.setitem(table, "key", _wrap(table["key"], log, "ours"), label="the table")
    expected = call()
    try:
        # A profiler wraps reprules' hook.
        if holder is None:
            table["key"] = theirs = _wrap(table["key"], log, "theirs")
        else:
            name = "function" if kind == "module" else "method"
            setattr(holder, name, theirs := _wrap(vars(holder)[name], log, "theirs"))
        log.clear()
        assert call() == expected and log == ["theirs", "ours"]
        with pytest.warns(reprules.PatchWarning, match=rf"(?s)reprules did not restore {where} .*another library.*Fix:"):
            patches.undo_all()
        assert (table["key"] if holder is None else vars(holder)[name]) is theirs  # left in place
        log.clear()
        assert call() == expected and log == ["theirs"]  # the chain works; reprules' hook is inert
    finally:
        Target.method = original_method


def test_patch_warning_is_a_reprules_error_and_a_warning():
    assert issubclass(reprules.PatchWarning, reprules.ReprulesError)
    assert issubclass(reprules.PatchWarning, Warning)


# --- on a real JAX attribute, through the public API --------------------------------
def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def _copy(x):
    return pl.pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


def _sharded_copy():
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    return max_err(jax.jit(shard_map(_copy, mesh, P("data", None), P("data", None)))(x), x)


@pytest.fixture
def pallas_bind(dormant):
    prim = _jax.pallas_call_p()
    assert "bind" not in vars(prim)
    yield prim
    for reg in list(reprules.registered().values()):  # before the profiler goes
        reprules.unregister(reg.kernel())
    vars(prim).pop("bind", None)
    jax.clear_caches()


def test_profiler_wrapping_jax_before_reprules_is_kept(pallas_bind):
    log = []
    pallas_bind.bind = theirs = _wrap(pallas_bind.bind, log, "theirs")
    reprules.replication_rule()(copy_kernel)  # reprules wraps the profiler's bind
    assert pallas_bind.bind is not theirs
    assert _sharded_copy() == 0.0
    reprules.unregister(copy_kernel)  # restores the profiler's wrapper, silently
    assert pallas_bind.bind is theirs
    log.clear()
    x = randn(0, (8, 128))
    assert max_err(jax.jit(_copy)(x), x) == 0.0 and log == ["theirs"]


def test_profiler_wrapping_jax_after_reprules_is_kept_and_reprules_goes_inert(pallas_bind):
    log = []
    reprules.replication_rule()(copy_kernel)
    ours = pallas_bind.bind
    pallas_bind.bind = theirs = _wrap(ours, log, "theirs")  # a profiler wraps reprules' hook
    assert _sharded_copy() == 0.0 and "theirs" in log
    with pytest.warns(reprules.PatchWarning, match=r"reprules did not restore \w*Primitive 'pallas_call'\.bind"):
        reprules.unregister(copy_kernel)
    assert pallas_bind.bind is theirs  # left in place
    assert not reprules.registered()
    # The chain still works, and reprules' hook inside it passes calls through:
    # even a call traced as a registered kernel's is not recorded any more.
    log.clear()
    reg = reprules.Registration(rule=reprules.rules.same(), name="copy_kernel", where="test",
                                kernel_ref=lambda: copy_kernel)
    x = randn(0, (8, 128))
    with _identity.tracing(reg):
        jaxpr = jax.make_jaxpr(_copy)(x)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is pallas_bind] or [
        e for outer in jaxpr.eqns for e in outer.params["jaxpr"].jaxpr.eqns if e.primitive is pallas_bind]
    assert log == ["theirs"]
    assert _resolve.pallas_registration(eqn.params) is None
    with _identity._by_jaxpr_lock:
        assert eqn.params["jaxpr"] not in _identity._by_jaxpr
    np.testing.assert_array_equal(np.asarray(jax.jit(_copy)(x)), np.asarray(x))


def test_the_interpret_lowering_retypes_a_copy_of_the_context_as_replace_would():
    """The lowering fix rebuilds JAX's (dataclass) lowering context with new avals
    without dataclasses.replace; a dataclass it cannot rebuild in order goes through
    .replace. Either way: the same fields, the new avals, the original untouched."""
    import dataclasses

    @dataclasses.dataclass
    class Ctx:
        module_context: object
        avals_in: list
        avals_out: list
        platforms: tuple

        def replace(self, **kw):
            return dataclasses.replace(self, **kw)

    @dataclasses.dataclass
    class KeywordCtx(Ctx):
        extra: int = dataclasses.field(default=0, kw_only=True)

    for cls in (Ctx, KeywordCtx):
        ctx = cls("m", ["a"], ["b"], ("cpu",))
        new = pallas_call._retyped(ctx, ["A"], ["B"])
        assert new == ctx.replace(avals_in=["A"], avals_out=["B"])
        assert ctx.avals_in == ["a"] and ctx.avals_out == ["b"]
    assert pallas_call._rebuilders[Ctx] is not None and pallas_call._rebuilders[KeywordCtx] is None


# --- what a replaced JAX object offered, its replacement offers too ---------------
class _Cache:
    """A memoising callable like JAX's ``weakref_lru_cache`` (a C++ object)."""

    def __init__(self, fn):
        self.fn, self.entries = fn, {}

    def __call__(self, x):
        return self.entries.setdefault(x, self.fn(x))

    def cache_clear(self):
        self.entries.clear()

    def cache_info(self):
        return len(self.entries)


def test_a_patch_keeps_the_public_attributes_of_what_it_replaced():
    module = types.ModuleType("fake_jax_module")
    module.traced = original = _Cache(lambda x: ("traced", x))
    patches = _patches.Patches()
    patches.setattr(module, "traced", _wrap(original, [], "ours"))
    assert module.traced is not original
    assert module.traced(1) == ("traced", 1) and module.traced.cache_info() == 1
    module.traced.cache_clear()  # clears the original's cache, which the hook calls through
    assert original.entries == {} and module.traced.cache_info() == 0
    patches.undo_all()
    assert module.traced is original


def _kernel_tracer():
    """(module, name) of the function through which JAX traces each Pallas kernel."""
    from jax._src.pallas import pallas_call as module

    return module, "_trace_kernel_to_jaxpr" if hasattr(module, "_trace_kernel_to_jaxpr") else "_trace_to_jaxpr"


def test_jaxs_kernel_tracing_cache_stays_reachable_while_patched(dormant):
    """JAX 0.4.28 - 0.6 memoise kernel tracing in a ``weakref_lru_cache``; JAX's own
    Pallas tests import it and call ``cache_clear()`` in every ``setUp``. With a
    rule registered (the hook in place), they must still reach JAX's cache."""
    module, name = _kernel_tracer()
    original = getattr(module, name)
    public = {attr for attr in dir(original) if not attr.startswith("_")}
    reprules.replication_rule()(copy_kernel)
    patched = getattr(module, name)
    assert patched is not original
    assert {attr for attr in public if not hasattr(patched, attr)} == set()
    if "cache_clear" in public:  # 0.4.28 - 0.6
        x = randn(0, (8, 128))
        jax.jit(_copy)(x)
        assert original.cache_info().currsize > 0
        patched.cache_clear()
        assert original.cache_info().currsize == 0 and patched.cache_info().currsize == 0
    reprules.unregister(copy_kernel)
    assert getattr(module, name) is original
