"""NVIDIA Warp's JAX FFI targets through reprules' warp pack, on CPU.

The pack (entry point ``warp``, loaded on ``import warp``) gives every FFI
target that ``wp.jax_kernel`` / ``wp.jax_callable`` makes ``rules.same()``, and
a target built with ``has_side_effect=True`` a refusal. conftest clears rules
after each test, and Warp caches its wrappers (their targets are made once), so
a fixture registers the cached targets again, as loading the pack does; the
last test checks the pack in a fresh interpreter with only ``import reprules``.

Every call runs inside ``shard_map`` on the (4, 2) ("data", "model") mesh, rows
over ``data``, the weight replicated, with ``check_vma=True``; forward and
gradients are compared with ``check_vma=False`` and with the kernel run on the
whole arrays, and the all-reduces are counted in the jaxpr, the StableHLO and
the compiled HLO. JAX alone refuses the gradient: Warp types the adjoint
launch's weight gradient (a per-shard partial sum) varying over ``data``, which
JAX refuses as the bwd output for a replicated weight; with the pack, reprules
psums it over ``data`` once, and checking off's defensive all-reduces are gone.
"""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import count_all_reduce, make_mesh, max_err, put, randn, shard_map
from jax.sharding import PartitionSpec as P

import reprules
from reprules import testing

wp = pytest.importorskip(
    "warp", reason="Warp (PyPI `warp-lang`) is not installed; these tests run in the newest-JAX environment"
)
if not hasattr(wp, "jax_kernel"):
    pytest.skip(f"Warp {wp.__version__} has no wp.jax_kernel", allow_module_level=True)
if not hasattr(jax, "shard_map"):
    pytest.skip(f"Warp's jax_kernel needs JAX >= 0.5; the tests use jax.shard_map (JAX {jax.__version__})",
                allow_module_level=True)

wp.config.quiet = True
wp.init()

ROWS = P("data", None)


@wp.kernel
def mul_kernel(x: wp.array2d(dtype=float), w: wp.array(dtype=float), y: wp.array2d(dtype=float)):
    i, j = wp.tid()
    y[i, j] = x[i, j] * w[j]


@wp.kernel
def affine_kernel(x: wp.array2d(dtype=float), w: wp.array(dtype=float), y: wp.array2d(dtype=float),
                  z: wp.array2d(dtype=float)):
    i, j = wp.tid()
    y[i, j] = x[i, j] * w[j]
    z[i, j] = x[i, j] + w[j]


def affine_callable(x: wp.array2d(dtype=float), w: wp.array(dtype=float), y: wp.array2d(dtype=float),
                    z: wp.array2d(dtype=float)):
    wp.launch(affine_kernel, dim=x.shape, inputs=[x, w], outputs=[y, z])


@pytest.fixture
def pack():
    """The pack's registration, as on ``import warp``: the cached targets get their rules again."""
    from reprules._builtin_packs import warp as warp_pack

    warp_pack.warp(wp)


def _data(rows=16, cols=32):
    return randn(0, (rows, cols)), randn(1, (cols,)), randn(2, (rows, cols))


def _mul_step(check):
    mul = wp.jax_kernel(mul_kernel, enable_backward=True)
    f = shard_map(lambda x, w: mul(x, w)[0], make_mesh(), (ROWS, P()), ROWS, check=check)
    return f, jax.grad(lambda x, w, t: (f(x, w) * t).sum(), argnums=(0, 1))


def test_jax_kernel_gradient_exact_no_defensive_all_reduce(mesh, pack):
    """y = x * w, x over ``data``, w replicated: forward and both gradients equal checking off
    and the unsharded kernel; w's gradient psummed over ``data`` once, nothing else (checking
    off: also over ``model``, and x's gradient over ``model``)."""
    x, w, t = _data()
    args = (put(x, mesh, ROWS), put(w, mesh, P()), put(t, mesh, ROWS))
    (f_on, g_on), (f_off, g_off) = _mul_step(True), _mul_step(False)
    mul = wp.jax_kernel(mul_kernel, enable_backward=True)
    expected = jax.jit(lambda x, w: mul(x, w)[0])(x, w)
    g_ref = jax.jit(jax.grad(lambda x, w, t: (mul(x, w)[0] * t).sum(), argnums=(0, 1)))(x, w, t)
    assert max_err(jax.jit(f_on)(*args[:2]), jax.jit(f_off)(*args[:2])) == 0.0
    assert max_err(jax.jit(f_on)(*args[:2]), expected) == 0.0
    grads_on, grads_off = jax.jit(g_on)(*args), jax.jit(g_off)(*args)
    assert max_err(grads_on, grads_off) < 1e-5
    assert max_err(grads_on, g_ref) < 1e-5
    assert max_err(grads_on, (w * t, (x * t).sum(0))) < 1e-5  # the analytic gradient

    report = testing.assert_collectives(g_on, *args, expect={("all-reduce", "data"): 1, "defensive": 0})
    assert [c.shapes for c in report.select("all-reduce")] == [((32,),)]  # w's gradient, nothing else
    assert count_all_reduce(g_on, *args) == (1, 1, 1)  # jaxpr, StableHLO, compiled HLO
    off = testing.collectives(g_off, *args)
    assert off.count("all-reduce", defensive=True) == 2 and count_all_reduce(g_off, *args) == (2, 2, 2)


def test_jax_alone_refuses_the_gradient(mesh):
    """Before the pack: Warp types the weight gradient varying over ``data`` for a replicated w."""
    x, w, t = _data()
    _, g_on = _mul_step(True)  # (Warp makes its targets here, and the pack, armed on import, registers them)
    for reg in list(reprules.registered().values()):
        reprules.unregister(reg.kernel())
    # JAX's words differ with jax_custom_vjp3 ("the bwd rule attached to ... produced an output of type")
    with pytest.raises(ValueError, match=r"(Custom VJP bwd rule|bwd rule attached to) .* float32\[32\]\{V:data\}"):
        jax.jit(g_on)(put(x, mesh, ROWS), put(w, mesh, P()), put(t, mesh, ROWS))


def test_registered_targets_and_their_source(pack):
    """The forward and adjoint targets of ``jax_kernel(enable_backward=True)`` have rules.same(), from the pack.
    (Warp makes both anew on every such call: its wrappers are new closures, cached by function.)"""
    wp.jax_kernel(mul_kernel, enable_backward=True)
    from reprules._builtin_packs import warp as warp_pack

    ffi = sys.modules[warp_pack.FFI_MODULE]
    names = {t.name: warp_pack.describe(t) for t in ffi._FFI_CALLABLE_REGISTRY.values()
             if "mul_kernel" in warp_pack.describe(t)}
    assert sorted(set(names.values())) == [
        "Warp kernel 'mul_kernel' (adjoint launch of wp.jax_kernel(enable_backward=True))",
        "Warp kernel 'mul_kernel' (forward launch of wp.jax_kernel(enable_backward=True))",
    ]
    regs = {r.name: r for r in reprules.registered().values()}
    for name in names:
        assert regs[name].rule == reprules.rules.same() and regs[name].source == f"pack {warp_pack.PACK}"


@pytest.mark.parametrize("kind", ["jax_kernel", "jax_callable"])
def test_two_outputs_forward(mesh, pack, kind):
    """A two-output kernel (and a jax_callable launching it): rows over ``data`` give outputs
    varying over ``data``, equal to checking off and unsharded, no all-reduce; replicated
    operands give replicated outputs (``out_specs=P()`` exact); varying outputs with
    ``out_specs=P()`` are refused by JAX."""
    call = (wp.jax_kernel(affine_kernel, num_outputs=2) if kind == "jax_kernel"
            else wp.jax_callable(affine_callable, num_outputs=2))
    x, w, _ = _data()
    args = (put(x, mesh, ROWS), put(w, mesh, P()))
    on = shard_map(lambda x, w: tuple(call(x, w)), mesh, (ROWS, P()), (ROWS, ROWS))
    off = shard_map(lambda x, w: tuple(call(x, w)), mesh, (ROWS, P()), (ROWS, ROWS), check=False)
    out = jax.jit(on)(*args)
    assert max_err(out, jax.jit(off)(*args)) == 0.0
    assert max_err(out, (x * w, x + w)) == 0.0
    testing.assert_no_all_reduce(on, *args)
    whole = shard_map(lambda x, w: tuple(call(x, w)), mesh, (P(), P()), (P(), P()))
    assert max_err(jax.jit(whole)(x, w), (x * w, x + w)) == 0.0
    refused = shard_map(lambda x, w: tuple(call(x, w)), mesh, (ROWS, P()), (P(), P()))
    with pytest.raises(ValueError, match=r"out_specs.*varying.*\{data\}|\{data\}.*out_specs"):
        jax.jit(refused)(*args)


def test_side_effect_target_is_refused(mesh, pack):
    """``has_side_effect=True``: a RuleError naming the kernel, the target and the fix."""
    mul = wp.jax_kernel(mul_kernel, has_side_effect=True)
    x, w, _ = _data()
    f = shard_map(lambda x, w: mul(x, w)[0], mesh, (ROWS, P()), ROWS)
    with pytest.raises(reprules.RuleError, match=r"(?s)'mul_kernel'.*has_side_effect=True.*"
                                                  r"\{'data'\}.*mesh axes \{'data', 'model'\}, JAX .*"
                                                  r"override=True.*check_vma=False"):
        jax.jit(f)(put(x, mesh, ROWS), put(w, mesh, P()))
    # Checking off is untouched.
    off = shard_map(lambda x, w: mul(x, w)[0], mesh, (ROWS, P()), ROWS, check=False)
    assert max_err(jax.jit(off)(put(x, mesh, ROWS), put(w, mesh, P())), x * w) == 0.0


def test_user_rule_first_wins(mesh, pack):
    """A rule registered for a target before the pack's stays (the pack never raises into Warp)."""
    from reprules._builtin_packs import warp as warp_pack

    mul = wp.jax_kernel(mul_kernel, has_side_effect=True)
    ffi = sys.modules[warp_pack.FFI_MODULE]
    (target,) = [t for t in ffi._FFI_KERNEL_REGISTRY.values() if t.has_side_effect and "mul_kernel" in t.name]
    reprules.unregister(reprules.ffi_target(target.name))
    reprules.replication_rule(reprules.rules.same())(reprules.ffi_target(target.name))
    warp_pack.warp(wp)  # the pack registering its cached targets again keeps the user's rule
    x, w, _ = _data()
    f = shard_map(lambda x, w: mul(x, w)[0], mesh, (ROWS, P()), ROWS)
    assert max_err(jax.jit(f)(put(x, mesh, ROWS), put(w, mesh, P())), x * w) == 0.0


def test_pack_loads_on_import(tmp_path):
    """In a fresh interpreter: ``import reprules``, ``import warp``; the pack is loaded, and a
    target made afterwards has the pack's rule."""
    (tmp_path / "warp_user.py").write_text(textwrap.dedent("""
        import reprules
        assert reprules.registered() == {}
        import warp as wp
        print([(p.name, p.state) for p in reprules.packs() if p.module == "warp"])
        wp.config.quiet = True

        @wp.kernel
        def k(x: wp.array(dtype=float), y: wp.array(dtype=float)):
            y[wp.tid()] = 2.0 * x[wp.tid()]

        call = wp.jax_kernel(k)
        print([(r.rule, r.source) for r in reprules.registered().values()])
    """))
    out = subprocess.run([sys.executable, str(tmp_path / "warp_user.py")], capture_output=True, text=True,
                         check=True, cwd=tmp_path).stdout.splitlines()
    assert out == ["[('reprules._builtin_packs.warp:warp', 'loaded')]",
                   "[(rules.same(), 'pack reprules._builtin_packs.warp:warp')]"]


def test_pack_error_when_warp_moves_its_ffi_module(monkeypatch):
    """A Warp without the classes the pack hooks: a LookupError naming them and the fix."""
    from reprules._builtin_packs import warp as warp_pack

    monkeypatch.setattr(warp_pack, "CLASSES", ("FfiKernel", "FfiKernelRenamed"))
    with pytest.raises(LookupError, match=r"(?s)Warp .* has no FfiKernelRenamed: moved or renamed in Warp.*"
                                          r"Fix: upgrade reprules.*reprules\.ffi_target\(wrapper\.name\)"):
        warp_pack.warp(wp)
