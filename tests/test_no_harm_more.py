"""No harm when unused, beyond tests/test_no_harm.py: more kinds of programs.

Programs that register nothing (a user primitive, an ``ffi_call``, JAX's own
collectives, an unregistered Pallas kernel, ``scan``/``cond`` bodies) have the
same jaxpr, StableHLO and compiled HLO

* without reprules imported at all and after ``import reprules`` (in a fresh
  process: this module imports no reprules at module level for that);
* before any rule, while reprules is active for an unrelated kernel, and after
  the last rule is removed (in this process);

and every JAX object reprules patches is the very same object again once the
last rule is removed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.experimental import pallas as pl
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

from helpers import NEW_SHARD_MAP, env_with_cpu_devices, make_mesh, put, randn, shard_map

HERE = os.path.dirname(os.path.abspath(__file__))


def unrelated_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def plain_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0


def _primitive():
    p = Primitive("no_harm_scale")
    p.def_impl(lambda x: x * 3.0)
    p.def_abstract_eval(lambda a: ShapedArray(a.shape, a.dtype))
    mlir.register_lowering(p, mlir.lower_fun(lambda x: x * 3.0, multiple_results=False))
    return p


scale_p = _primitive()


def _ffi_call(x):
    ffi = getattr(jax, "ffi", None)  # 0.5+
    if ffi is None or not hasattr(ffi, "ffi_call"):
        from jax.extend import ffi  # 0.4.31 - 0.4.38
    return ffi.ffi_call("no_harm_target", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def _has_ffi():
    try:
        from jax.extend import ffi as old
    except ImportError:
        old = None
    return hasattr(getattr(jax, "ffi", None), "ffi_call") or hasattr(old, "ffi_call")


def programs():
    """(name, function, args, compile?) of programs that use no rule."""
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    w = put(randn(1, (2, 128)), mesh, P())
    t = randn(2, (8, 128))

    @jax.custom_vjp
    def prim(x):
        return scale_p.bind(x)

    prim.defvjp(lambda x: (scale_p.bind(x), None), lambda _, g: (scale_p.bind(g),))

    def pallas(x):
        return pl.pallas_call(plain_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)

    kernel = jax.custom_vjp(pallas)
    kernel.defvjp(lambda x: (pallas(x), None), lambda _, g: (pallas(g),))

    def collectives(x, w):
        y = x * w
        s = jax.lax.psum(y, "data")
        g = jax.lax.all_gather(y, "data", tiled=True)[:2]
        perm = [(i, (i + 1) % 4) for i in range(4)]
        r = jax.lax.ppermute(y, "data", perm)
        m = jax.lax.psum_scatter(jnp.tile(y, (2, 1)), "data", tiled=True)
        idx = jax.lax.axis_index("data").astype(y.dtype)
        return s + g + r + m + idx

    def loops(x, w):
        def body(c, _):
            return jax.lax.cond(w.sum() > 0, lambda c: c * w, lambda c: c - w, c), None

        return jax.lax.scan(body, x, None, length=3)[0]

    sm_prim = shard_map(prim, mesh, P("data", None), P("data", None), check=False)
    sm_coll = shard_map(collectives, mesh, (P("data", None), P()), P("data", None))
    # JAX <= 0.5's check_rep refuses this cond ("mismatched replication types").
    sm_loop = shard_map(loops, mesh, (P("data", None), P()), P("data", None), check=NEW_SHARD_MAP)
    sm_pallas = shard_map(kernel, mesh, P("data", None), P("data", None), check=False)
    progs = [
        ("primitive_in_shard_map_grad", jax.grad(lambda x: (sm_prim(x) * t).sum()), (x,), True),
        ("primitive_unsharded_grad", jax.grad(lambda x: (prim(x) * t).sum()), (np.asarray(x),), True),
        ("collectives_grad", jax.grad(lambda x, w: (sm_coll(x, w) * t).sum(), argnums=(0, 1)), (x, w), True),
        ("scan_cond_grad", jax.grad(lambda x, w: (sm_loop(x, w) * t).sum(), argnums=(0, 1)), (x, w), True),
        ("pallas_check_off_grad", jax.grad(lambda x: (sm_pallas(x) * t).sum()), (x,), True),
        ("pallas_unsharded", jax.jit(pallas), (np.asarray(x),), True),
    ]
    if _has_ffi():  # lowered only: the target exists nowhere
        sm_ffi = shard_map(_ffi_call, mesh, P("data", None), P("data", None), check=False)
        progs.append(("ffi_call_in_shard_map", sm_ffi, (x,), False))
        progs.append(("ffi_call_unsharded", _ffi_call, (np.asarray(x),), False))
    return progs


def texts():
    """{name: [jaxpr, StableHLO, compiled HLO or ""]} of every program.

    The compiled HLO records the Python stack of each op, callers included:
    compare only texts computed from the same line (see ``texts_after``).
    """
    out = {}
    for name, fn, args, compile_it in programs():
        lowered = jax.jit(fn).lower(*args)
        out[name] = [str(jax.make_jaxpr(fn)(*args)), lowered.as_text(),
                     lowered.compile().as_text() if compile_it else ""]
    return out


def texts_after(*actions):
    """The texts after each action, all computed from this one line."""
    out = []
    for action in actions:
        action()
        out.append(texts())
    return out


_DEBUG_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def without_debug_info(hlo):
    """Compiled HLO without its Python stack-frame tables and op metadata."""
    blocks = [b for b in hlo.split("\n\n") if b.strip().split("\n")[0] not in _DEBUG_SECTIONS]
    return re.sub(r",? metadata=\{[^}]*\}", "", "\n\n".join(blocks))


def _differences(a, b, debug_info=True):
    def parts(t):
        return t if debug_info else (t[0], t[1], without_debug_info(t[2]))

    return [f"{name}: {('jaxpr', 'stablehlo', 'hlo')[i]}" for name in a for i in range(3)
            if parts(a[name])[i] != parts(b[name])[i]]


def test_import_reprules_changes_nothing():
    """In a fresh process: the texts before ``import reprules``, and after it
    (with reprules.testing and the pytest plugin module) are identical."""
    env = env_with_cpu_devices(8)
    result = subprocess.run([sys.executable, os.path.abspath(__file__)], cwd=HERE, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["reprules_imported_by_jax"] is False
    assert report["programs"] >= 6
    assert report["differences"] == []


def test_programs_lower_identically_before_during_and_after_reprules_is_active():
    import reprules

    before, during, after = texts_after(
        lambda: None,
        lambda: reprules.replication_rule()(unrelated_kernel),  # active, for another kernel
        lambda: reprules.unregister(unrelated_kernel),  # the last rule: every patch undone
    )
    # While active, ops traced inside an unregistered pallas_call have reprules'
    # wrapper frame in their compiled-HLO stack traces: debug info only.
    assert _differences(before, during, debug_info=False) == []
    assert _differences(before, after) == []


def _jax_state():
    """Every attribute of the JAX objects reprules may patch, by identity."""
    from jax._src import custom_derivatives
    from jax._src.interpreters import mlir as mlir_internal
    from jax._src import core
    from jax._src.pallas import core as pallas_core_mod
    from jax._src.pallas import pallas_call as pallas_call_mod
    from jax.experimental import pallas as pl_mod

    from reprules._shim.plumbing import _jax

    objects = {"pallas_call_p": _jax.pallas_call_p(), "scale_p": scale_p,
               "pallas_call module": pallas_call_mod, "pallas module": pl_mod,
               "pallas core module": pallas_core_mod, "custom_derivatives": custom_derivatives}
    ffi_p = _jax.ffi_call_p()
    if ffi_p is not None:
        objects["ffi_call_p"] = ffi_p
    state = {name: {k: id(v) for k, v in vars(obj).items()} for name, obj in objects.items()}
    state["mlir lowerings"] = {repr(k): id(v) for k, v in mlir_internal._lowerings.items()}
    try:
        from jax.experimental import shard_map as sm  # 0.4.28 - 0.5.x: the rule tables
    except ImportError:
        sm = None
    for table in ("_check_rules", "_rewrite_rules"):
        if sm is not None and hasattr(sm, table):
            state[table] = {repr(k): id(v) for k, v in getattr(sm, table).items()}
    if sm is not None and hasattr(sm, "shard_map_p"):
        state["shard_map_p"] = {k: id(v) for k, v in vars(sm.shard_map_p).items()}
    state["custom typechecks"] = {repr(k): id(v) for k, v in core.custom_typechecks.items()}
    return state


def test_every_patched_jax_object_is_restored():
    import reprules
    from reprules import rules

    before = _jax_state()
    reprules.replication_rule()(unrelated_kernel)
    reprules.replication_rule(rules.same())(scale_p)  # a primitive: per-primitive hooks too
    if _has_ffi():
        reprules.replication_rule()(reprules.ffi_target("no_harm_target"))
    assert _jax_state() != before  # something was patched
    for reg in list(reprules.registered().values()):
        reprules.unregister(reg.kernel())
    after = _jax_state()
    changed = {name: sorted(k for k in set(before[name]) | set(after.get(name, {}))
                            if before[name].get(k) != after.get(name, {}).get(k))
               for name in before}
    assert {name: keys for name, keys in changed.items() if keys} == {}


if __name__ == "__main__":  # the fresh process of test_import_reprules_changes_nothing
    assert "reprules" not in sys.modules

    seen = {}

    def import_reprules():
        seen["imported_by_jax"] = "reprules" in sys.modules  # after the first texts, before the import
        import reprules  # noqa: F401
        import reprules._pytest_plugin  # noqa: F401
        import reprules.testing  # noqa: F401

    first, second = texts_after(lambda: None, import_reprules)
    print(json.dumps({"reprules_imported_by_jax": seen["imported_by_jax"], "programs": len(first),
                      "differences": _differences(first, second)}))
