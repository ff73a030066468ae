"""No growth: tracing many fresh functions that call the same registered kernels
keeps reprules' tables bounded, and a kernel nobody references is collected.

reprules' tables (registry, decision cache, the per-thread out_shape hand-off,
the out_shape leaves JAX refused, the patch bookkeeping) must not grow with the
number of traced functions. Its two weak tables (kernel jaxpr -> kernel, and the
set of kernel jaxprs traced straight from a kernel) may only hold what JAX's own
caches keep alive: JAX 0.4.28 and 0.12 trace a kernel once per shape, 0.6.2
keeps a kernel jaxpr per call site in its bounded ``weakref_lru_cache``. So
after ``jax.clear_caches()`` they must be empty again, and they must empty when
the kernel dies.
"""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from helpers import make_mesh, shard_map
from reprules import _decide, _registry, rules
from reprules._shim.kernels import _identity

FRESH_FUNCTIONS = 240  # each traced once: forward only, every 4th one with its gradient
SHAPES = ((8, 16), (8, 32))


def _make_kernel():
    def scale_kernel(x_ref, w_ref, o_ref):
        o_ref[...] = x_ref[...] * w_ref[...]

    return scale_kernel


def _pending_out_shapes() -> int:
    from reprules._shim.entry_points import pallas_call

    return len(pallas_call._unannotated.items)  # filled on the vma and mat eras only


def _refused_out_shapes() -> int:
    from reprules._shim.entry_points import pallas_call

    return len(pallas_call._refused._items)  # filled on the vma and mat eras only


def _sizes(kernel=None) -> dict[str, int]:
    """reprules' table sizes; the weak tables counted for ``kernel`` only when given (other
    tests' kernels may still sit in JAX's caches, and so in these tables)."""
    from reprules import _shim

    def mine(ref) -> bool:
        return kernel is None or ref() is kernel

    with _identity._by_jaxpr_lock:
        by_jaxpr = [(j, ref) for j, ref in _identity._by_jaxpr.items() if mine(ref)]
        direct = sum(1 for j, _ in by_jaxpr if j in _identity._direct)
    return {
        "registry": len(_registry._rules) + len(_registry._targets),
        "decisions": _decide.cache_info()["size"],
        "pending_out_shapes": _pending_out_shapes(),
        "refused_out_shapes": _refused_out_shapes(),
        "patched_primitives": len(_shim._attached),
        "kernel_jaxprs": len(by_jaxpr),
        "direct_jaxprs": direct if kernel is not None else len(_identity._direct),
    }


def _trace_fresh(kernel, mesh, i: int, check: bool = True) -> None:
    """A new function (new closure, new custom_vjp, new shard_map) calling ``kernel``."""

    def call(x, w):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, w)

    @jax.custom_vjp
    def f(x, w):
        return call(x, w)

    f.defvjp(lambda x, w: (call(x, w), (x, w)), lambda res, g: (call(g, res[1]), call(g, res[0])))
    scale = float(i)
    shape = SHAPES[i % len(SHAPES)]
    sm = shard_map(lambda x, w: f(x, w) * scale, mesh, (P("data", None), P()), P("data", None), check)
    x, w = jnp.ones(shape), jnp.ones((shape[0] // 4, shape[1]))
    if i % 4 == 0:
        return jax.make_jaxpr(jax.grad(lambda x, w: sm(x, w).sum(), argnums=(0, 1)))(x, w)
    return jax.make_jaxpr(sm)(x, w)


def test_tables_stay_bounded_and_hold_only_what_jax_keeps():
    mesh = make_mesh()
    jax.clear_caches()  # whatever earlier tests left in JAX's caches (and so in the weak tables)
    gc.collect()
    before = _sizes()
    kernel = reprules.replication_rule(rules.same())(_make_kernel())
    _decide.cache_clear()
    early = kept = None
    for i in range(FRESH_FUNCTIONS):
        kept = _trace_fresh(kernel, mesh, i)  # the last jaxpr stays alive (JAX 0.7 caches none)
        if i == 3 * len(SHAPES) * 4:  # every shape, with and without gradient, traced
            gc.collect()
            early = _sizes(kernel)
    gc.collect()
    late = _sizes(kernel)
    # reprules' own tables: exactly as large after many functions as after a few.
    for table in ("registry", "decisions", "pending_out_shapes", "refused_out_shapes", "patched_primitives"):
        assert late[table] == early[table], (table, early, late)
    assert late["registry"] == before["registry"] + 1 and late["pending_out_shapes"] == 0, (before, late)
    assert late["kernel_jaxprs"] > 0 and late["direct_jaxprs"] > 0, late  # `kept` holds one
    # The weak tables: nothing of this kernel once JAX forgets its traces, though the kernel lives on.
    del kept
    jax.clear_caches()
    gc.collect()
    cleared = _sizes(kernel)
    assert cleared["kernel_jaxprs"] == 0 and cleared["direct_jaxprs"] == 0, (late, cleared)
    assert cleared["registry"] == before["registry"] + 1
    # And the kernel still works after JAX forgot its traces.
    kept = _trace_fresh(kernel, mesh, 0)
    assert _sizes(kernel)["kernel_jaxprs"] > 0
    del kept
    reprules.unregister(kernel)


def test_dropped_kernel_is_collected():
    """A registered kernel lives no longer than the same kernel without reprules
    (JAX 0.4.28 - 0.6 keep traced kernels in their caches until jax.clear_caches();
    0.12 does not), and reprules' tables forget it with it."""
    mesh = make_mesh()
    jax.clear_caches()  # whatever earlier tests left in JAX's caches (and so in the weak tables)
    gc.collect()
    before = _sizes()
    kernel = reprules.replication_rule(rules.same())(_make_kernel())
    control = _make_kernel()  # no rule, checking off: JAX alone
    for i in range(8):
        _trace_fresh(kernel, mesh, i)
        _trace_fresh(control, mesh, i, check=False)
    ref, control_ref = weakref.ref(kernel), weakref.ref(control)
    del kernel, control
    gc.collect()
    if control_ref() is None:
        assert ref() is None, "reprules keeps a dropped kernel alive where JAX alone does not"
    jax.clear_caches()
    gc.collect()
    assert ref() is None, "a dropped kernel outlives jax.clear_caches()"
    sizes = _sizes()  # back to what they were before this kernel existed
    assert sizes["registry"] == before["registry"], (before, sizes)
    assert sizes["kernel_jaxprs"] <= before["kernel_jaxprs"] and sizes["direct_jaxprs"] <= before["direct_jaxprs"], (
        before, sizes)
    assert all(reg.kernel() is not None for reg in reprules.registered().values())


def _reprules_frames_in_garbage(fn) -> list[str]:
    """The frames of reprules' own code that ``fn()`` leaves for the garbage
    collector (reference cycles), by function name."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        fn()
        gc.collect()
        frames = [o for o in gc.garbage if type(o).__name__ == "frame"]
        return sorted(f.f_code.co_name for f in frames if "/reprules/" in f.f_code.co_filename.replace("\\", "/"))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def test_tracing_leaves_no_frames_to_the_garbage_collector():
    """A kernel call JAX refuses unannotated (vma/mat) and reprules types: the
    refusal reprules keeps for its error must not keep the frames of the trace
    (and their tracers) alive in a reference cycle. It did: 157 frames per
    tp_mlp trace+lower on 0.12, every one waiting for the collector."""
    mesh = make_mesh()
    kernel = reprules.replication_rule(rules.same())(_make_kernel())
    try:
        _trace_fresh(kernel, mesh, 0)  # JAX's caches warm
        assert _reprules_frames_in_garbage(lambda: [_trace_fresh(kernel, mesh, i) for i in range(4)]) == []
    finally:
        reprules.unregister(kernel)


def test_decision_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(_decide, "CACHE_SIZE", 16)
    _decide.cache_clear()
    kernel = _make_kernel()
    reg = _registry.Registration(rule=rules.same(), name="k", where="k", kernel_ref=weakref.ref(kernel))
    for n in range(100):  # 100 distinct keys
        axes = tuple(f"a{j}" for j in range(n % 10 + 1)) + (f"b{n}",)
        ctx = rules.RuleContext(kernel_name="k", kernel=kernel, mesh_axes=axes, num_inputs=1, num_outputs=1,
                                jax_version=jax.__version__)
        decision = _decide.decide(reg, ctx, (frozenset({axes[0]}),))
        assert decision.outputs == (frozenset({axes[0]}),)
        assert _decide.cache_info()["size"] <= 16
    again = _decide.decide(reg, ctx, (frozenset({axes[0]}),))
    assert again is decision and _decide.cache_info()["hits"] == 1


@pytest.mark.parametrize("rule", [rules.same(), rules.like(0), rules.varying("model"), rules.invariant("model")])
def test_cached_decisions_equal_fresh_ones(rule):
    kernel = _make_kernel()
    reg = _registry.Registration(rule=rule, name="k", where="k", kernel_ref=weakref.ref(kernel))
    ctx = rules.RuleContext(kernel_name="k", kernel=kernel, mesh_axes=("data", "model"), num_inputs=2,
                            num_outputs=2, jax_version=jax.__version__)
    for in_varying in [(frozenset({"data"}), frozenset()), (frozenset({"data", "model"}), frozenset({"data"}))]:
        if isinstance(rule, rules.like) and not in_varying[1] <= in_varying[0]:
            continue
        first = _decide.decide(reg, ctx, in_varying)
        assert _decide.decide(reg, ctx, in_varying) == first == _decide._decide(reg, ctx, in_varying)


def test_rule_errors_are_not_cached():
    kernel = _make_kernel()
    reg = _registry.Registration(rule=rules.like(0), name="k", where="k", kernel_ref=weakref.ref(kernel))
    ctx = rules.RuleContext(kernel_name="k", kernel=kernel, mesh_axes=("data", "model"), num_inputs=2,
                            num_outputs=1, jax_version=jax.__version__)
    for _ in range(2):  # input 1 varies over more than input 0: like(0) refuses, every time
        with pytest.raises(reprules.RuleError, match="says the outputs vary like input 0"):
            _decide.decide(reg, ctx, (frozenset(), frozenset({"data"})))


def test_user_rules_are_called_every_time():
    calls = []

    def rule(ctx, in_varying):
        calls.append(in_varying)
        return [in_varying[0]]

    kernel = _make_kernel()
    reg = _registry.Registration(rule=rule, name="k", where="k", kernel_ref=weakref.ref(kernel))
    ctx = rules.RuleContext(kernel_name="k", kernel=kernel, mesh_axes=("data",), num_inputs=1, num_outputs=1,
                            jax_version=jax.__version__)
    for _ in range(3):
        _decide.decide(reg, ctx, (frozenset({"data"}),))
    assert len(calls) == 3
