"""Rules derived from kernel bodies (``reprules.inference()``), on every regime.

The kernels here are closures made anew on every call, so no rule can be
registered on them: inference is the only way they run with checking on.
Sound by construction: outputs vary over the inputs they depend on (values,
refs, aliasing, control flow), and bodies that read the device identity or
communicate are refused with a teaching error.
"""

import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    CAST_UP,
    NEW_SHARD_MAP,
    count_all_reduce,
    env_with_cpu_devices,
    max_err,
    psum_axes,
    put,
    randn,
    shard_map,
)
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from reprules import rules


def fresh_copy(x):
    """A copy kernel defined anew on every call (nobody can register it)."""

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


@jax.custom_vjp
def closure_copy(x):
    return fresh_copy(x)


closure_copy.defvjp(lambda x: (fresh_copy(x), None), lambda _, g: (fresh_copy(g),))


def fresh_mul(x, w):
    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = x_ref[...] * w_ref[...]

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, w)


@jax.custom_vjp
def closure_mul(x, w):
    return fresh_mul(x, w)


closure_mul.defvjp(
    lambda x, w: (fresh_mul(x, w), (x, w)),
    lambda res, g: (fresh_mul(g, jnp.broadcast_to(res[1], g.shape)), (g * res[0]).sum(0, keepdims=True)),
)


def two_outputs(x, w, *, guard=False):
    """out0 from x (sharded), out1 from w (replicated); with ``guard``, out1 is
    written only when x[0, 0] > 0, so it depends on x through control flow."""

    def kernel(x_ref, w_ref, o_ref, p_ref):
        o_ref[...] = x_ref[...] * 2.0
        p_ref[...] = jnp.zeros_like(p_ref)
        if guard:
            @pl.when(x_ref[0, 0] > 0)
            def _():
                p_ref[...] = w_ref[...] + 1.0
        else:
            p_ref[...] = w_ref[...] + 1.0

    shapes = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype))
    return pl.pallas_call(kernel, out_shape=shapes, interpret=True)(x, w)


def test_closure_kernel_in_21855_model_has_no_psum_and_exact_gradients(mesh):
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    weights = randn(1, (8, 128))
    f = shard_map(closure_copy, mesh, P("data", None), P("data", None))

    def loss(x):
        return (f(x) * weights).sum()

    with reprules.inference():
        grad = jax.grad(loss)
        assert count_all_reduce(grad, x) == (0, 0, 0)
        got = jax.jit(grad)(x)
    reference = jax.grad(lambda x: (x * weights).sum())(jnp.asarray(x))  # unsharded
    assert max_err(got, reference) == 0.0


def test_weight_gradient_keeps_exactly_the_needed_psum(mesh):
    x = put(randn(0, (16, 32)), mesh, P("data", None))
    w = put(randn(1, (1, 32)), mesh, P())
    t = randn(2, (16, 32))
    f = shard_map(closure_mul, mesh, (P("data", None), P()), P("data", None))

    def loss(x, w):
        return (f(x, w) * t).sum()

    with reprules.inference():
        grad = jax.grad(loss, argnums=(0, 1))
        assert psum_axes(grad, x, w) == [("data",)]  # the weight's; nothing over model
        gx, gw = jax.jit(grad)(x, w)
    xn, wn, tn = np.asarray(x), np.asarray(w), np.asarray(t)
    assert max_err(gx, tn * wn) < 1e-5
    assert max_err(gw, (tn * xn).sum(0, keepdims=True)) < 1e-4


def test_each_output_varies_only_over_what_it_depends_on(mesh):
    x = put(randn(0, (8, 16)), mesh, P("data", None))
    w = put(randn(1, (8, 16)), mesh, P())
    # out1 depends on w alone: replicated, so out_specs P() is accepted (rules.same() would refuse it).
    f = shard_map(two_outputs, mesh, (P("data", None), P()), (P("data", None), P()))
    with reprules.inference():
        out0, out1 = jax.jit(f)(x, w)
    assert max_err(out0, np.asarray(x) * 2.0) == 0.0
    assert max_err(out1, np.asarray(w) + 1.0) == 0.0


def test_control_dependence_makes_an_output_vary(mesh):
    x = put(randn(0, (8, 16)), mesh, P("data", None))
    w = put(randn(1, (8, 16)), mesh, P())

    def guarded(x, w):
        return two_outputs(x, w, guard=True)

    # out1 is written only where x[0, 0] > 0: it varies over data, so P() must be refused.
    f = shard_map(guarded, mesh, (P("data", None), P()), (P("data", None), P()))
    with reprules.inference(), pytest.raises(ValueError, match="out_specs"):
        jax.jit(f)(x, w)
    ok = shard_map(guarded, mesh, (P("data", None), P()), (P("data", None), P("data", None)))
    with reprules.inference():
        out0, out1 = jax.jit(ok)(x, w)
    xn, wn = np.asarray(x), np.asarray(w)
    expected = np.concatenate([wn + 1.0 if xn[2 * i, 0] > 0 else np.zeros_like(wn) for i in range(4)])
    assert max_err(out1, expected) == 0.0


def test_aliased_output_depends_on_its_input(mesh):
    x = put(randn(0, (8, 16)), mesh, P("data", None))
    w = put(randn(1, (2, 16)), mesh, P())

    def accumulate(x, w):
        def kernel(x_ref, w_ref, o_ref):
            o_ref[...] += w_ref[...]  # o starts as x (aliased)

        out = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return pl.pallas_call(kernel, out_shape=out, interpret=True, input_output_aliases={0: 0})(x, w)

    f = shard_map(accumulate, mesh, (P("data", None), P()), P())
    with reprules.inference(), pytest.raises(ValueError, match="out_specs"):
        jax.jit(f)(x, w)  # the output is x + w: it varies over data
    ok = shard_map(accumulate, mesh, (P("data", None), P()), P("data", None))
    with reprules.inference():
        assert max_err(jax.jit(ok)(x, w), np.asarray(x) + np.tile(np.asarray(w), (4, 1))) < 1e-6


def test_a_write_through_the_aliased_input_ref_reaches_the_output(mesh):
    """An input aliased to an output is the output's buffer on the device: a
    kernel that writes through the *input* ref (here w += x, with the output ref
    unused, as tokamax's proj_and_save_state DMAs into its aliased cache) makes
    the output depend on x. Typed by the output ref alone it would be replicated
    while it varies over data (caught by the out_specs check below). JAX's CPU
    interpreter keeps the two refs apart, so only the type is checked here."""
    x = put(randn(0, (8, 16)), mesh, P("data", None))  # (2, 16) per data shard
    w = put(randn(1, (2, 16)), mesh, P())

    def accumulate_into_w(x, w):
        def kernel(x_ref, w_ref, o_ref):
            del o_ref  # the output is w's buffer
            w_ref[...] = w_ref[...] + x_ref[...]

        out = jax.ShapeDtypeStruct(w.shape, w.dtype)
        return pl.pallas_call(kernel, out_shape=out, interpret=True, input_output_aliases={1: 0})(x, w)

    f = shard_map(accumulate_into_w, mesh, (P("data", None), P()), P())
    with reprules.inference(), pytest.raises(ValueError, match="out_specs"):
        jax.jit(f)(x, w)  # typed varying over data: not claimed replicated
    ok = shard_map(accumulate_into_w, mesh, (P("data", None), P()), P("data", None))
    with reprules.inference():
        jax.jit(ok)(x, w)


def test_an_alias_between_operands_that_are_not_both_refs_is_refused():
    """Analysed apart, a write through one would not reach the other: no guess."""
    from reprules._shim.inference import infer

    closed = jax.make_jaxpr(lambda a, b: a + b)(1.0, 2.0)  # two values, no refs
    found = infer.summarize(closed.jaxpr, (frozenset({0, 1}),))
    assert isinstance(found, infer.Refusal) and found.primitive == "input_output_aliases"
    assert "not both references" in found.reason


def test_a_kernel_reading_its_device_index_is_refused(mesh):
    x = put(randn(0, (8, 16)), mesh, P("data", None))

    def indexed(x):
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] + jax.lax.axis_index("model").astype(jnp.float32)

        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)

    f = shard_map(indexed, mesh, P("data", None), P("data", None))
    with reprules.inference(), pytest.raises(reprules.MissingRuleError) as info:
        jax.jit(f)(x)
    message = str(info.value)
    assert "'kernel'" in message
    assert "`axis_index`" in message and "test_inference.py" in message  # the primitive and its line
    assert "device's identity" in message
    assert "'data', 'model'" in message and f"JAX {jax.__version__}" in message
    assert "rules.varying('model')" in message  # the fix


def stepped(x, axis="i"):
    """A kernel over a named grid axis: step ``i`` doubles block ``i`` and adds ``i``."""
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + jax.lax.axis_index(axis).astype(jnp.float32)

    block = pl.BlockSpec(block_shape=(x.shape[0] // 2, x.shape[1]), index_map=lambda i: (i, 0))
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=((axis, 2),),
                          in_specs=[block], out_specs=block, interpret=True)(x)


def _has_named_grids():
    try:  # outside any shard_map, axis_index of the grid axis is JAX's own business
        jax.make_jaxpr(stepped)(np.ones((4, 16), np.float32))
    except (TypeError, NameError):  # 0.4.28: a grid entry is a size, axis_index a pmap axis
        return False
    return True


NAMED_GRIDS = pytest.mark.skipif(not _has_named_grids(), reason=f"JAX {jax.__version__}'s pallas_call has no named grid axes")


@NAMED_GRIDS
@pytest.mark.skipif(not NEW_SHARD_MAP, reason=(
    f"JAX {jax.__version__} < 0.6: reprules cannot see the enclosing mesh, so it refuses "
    "axis_index over any axis (tested below)"))
def test_axis_index_over_a_named_grid_axis_is_local(mesh):
    # Traced and typed only: JAX's interpret mode cannot run a named grid
    # ("unbound axis name"); a pl.kernel core index runs in test_infer_pl_kernel.
    x = put(randn(0, (16, 16)), mesh, P("data", None))
    with reprules.inference():
        jax.make_jaxpr(shard_map(stepped, mesh, P("data", None), P("data", None)))(x)
        with pytest.raises(ValueError, match="out_specs"):  # x varies over data: so does the output
            jax.make_jaxpr(shard_map(stepped, mesh, P("data", None), P()))(x)
        w = put(randn(1, (8, 16)), mesh, P())
        jax.make_jaxpr(shard_map(stepped, mesh, P(), P()))(w)  # replicated in, replicated out


@NAMED_GRIDS
def test_a_grid_axis_named_like_a_mesh_axis_is_refused(mesh):
    x = put(randn(0, (16, 16)), mesh, P("data", None))
    names = ("model",) if NEW_SHARD_MAP else ("model", "i")  # < 0.6: every axis_index is refused
    for name in names:
        f = shard_map(functools.partial(stepped, axis=name), mesh, P("data", None), P("data", None))
        with reprules.inference(), pytest.raises(reprules.MissingRuleError) as info:
            jax.make_jaxpr(f)(x)
        message = str(info.value)
        assert "`axis_index`" in message and f"its index on mesh axis {name!r}" in message
        assert "'data', 'model'" in message and f"JAX {jax.__version__}" in message


try:
    from jax.experimental.pallas import tpu_sc as plsc  # SparseCore, 0.8+
except ImportError:
    plsc = None


def looped(n, x, *, carried=False):
    """Writes ``2 x[i]`` for ``i < n[0]`` in a SparseCore ``parallel_loop`` (or, ``carried``,
    sums ``x[i]`` into a loop carry and writes that)."""
    def kernel(n_ref, x_ref, o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)
        if carried:
            total = plsc.parallel_loop(0, n_ref[0], carry=jnp.zeros(x.shape[1:], x.dtype))(
                lambda i, acc: acc + x_ref[i])
            o_ref[0] = total
        else:
            @plsc.parallel_loop(0, n_ref[0])
            def _(i):
                o_ref[i] = x_ref[i] * 2.0

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(n, x)


def _why_no_parallel_loop():
    if plsc is None:
        return f"JAX {jax.__version__} has no SparseCore parallel_loop"
    try:  # outside any shard_map, without reprules' rules: JAX alone
        jax.make_jaxpr(looped)(np.array([3], np.int32), np.ones((8, 16), np.float32))
    except ValueError as err:  # 0.7: its effects name the wrong operands
        return f"JAX {jax.__version__} cannot trace a parallel_loop in a pallas_call itself: {str(err)[:80]}"
    return None


@pytest.mark.skipif(_why_no_parallel_loop() is not None, reason=_why_no_parallel_loop() or "")
@pytest.mark.parametrize("carried", [False, True], ids=["writes", "carry"])
def test_a_sparsecore_parallel_loop_is_followed(mesh, carried):
    # Traced and typed only: parallel_loop lowers to SparseCore, not to CPU.
    kernel = jax.make_jaxpr(functools.partial(looped, carried=carried))(
        np.array([3], np.int32), np.ones((8, 16), np.float32)).jaxpr.eqns[0].params["jaxpr"]
    if "parallel_loop" not in str(kernel):  # 0.10: a loop with no outputs is dropped as dead code
        pytest.skip(f"JAX {jax.__version__} drops this parallel_loop from the kernel (no outputs): "
                    "what it runs does not loop, so there is nothing to follow")
    n_rep, n_var = put(np.array([3], np.int32), mesh, P()), put(np.arange(4, dtype=np.int32), mesh, P("data"))
    x_rep, x_var = put(randn(0, (8, 16)), mesh, P()), put(randn(1, (32, 16)), mesh, P("data", None))
    body = functools.partial(looped, carried=carried)
    with reprules.inference():
        jax.make_jaxpr(shard_map(body, mesh, (P(), P()), P()))(n_rep, x_rep)  # nothing varies
        for n, x, specs in ((n_rep, x_var, (P(), P("data", None))),  # what the loop writes varies
                            (n_var, x_rep, (P("data"), P()))):  # how far the loop runs varies
            jax.make_jaxpr(shard_map(body, mesh, specs, P("data", None)))(n, x)
            with pytest.raises(ValueError, match="out_specs"):
                jax.make_jaxpr(shard_map(body, mesh, specs, P()))(n, x)


def test_a_kernel_that_communicates_is_refused(mesh):
    x = put(randn(0, (8, 16)), mesh, P("data", None))

    def reducing(x):
        def kernel(x_ref, o_ref):
            o_ref[...] = jax.lax.psum(x_ref[...], "model")

        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)

    f = shard_map(reducing, mesh, P("data", None), P("data", None))
    with reprules.inference(), pytest.raises(reprules.MissingRuleError, match=r"(?s)`psum\w*`.*communicates.*rules\.invariant\('model'\)"):
        jax.jit(f)(x)


def test_a_registered_rule_wins(mesh):
    x = put(randn(0, (8, 16)), mesh, P("data", None))

    def scale_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 3.0

    def scale(x):
        return pl.pallas_call(scale_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)

    f = shard_map(scale, mesh, P("data", None), P("data", None))
    with reprules.inference():
        assert max_err(jax.jit(f)(x), np.asarray(x) * 3.0) < 1e-6  # inferred: varies over data
        reprules.replication_rule(rules.varying("model"))(scale_kernel)  # declared: over model too
        with pytest.raises(ValueError, match="out_specs"):
            jax.jit(f)(x)


def test_off_by_default_and_nothing_stays_patched(mesh, dormant):
    x = put(randn(0, (8, 16)), mesh, P("data", None))
    f = shard_map(fresh_copy, mesh, P("data", None), P("data", None))
    with reprules.inference():
        jax.jit(f)(x)
    from reprules import _shim

    assert not _shim.active()  # dormant, nothing registered: every patch undone on exit
    with pytest.raises((NotImplementedError, ValueError)) as info:  # JAX's own refusal
        jax.jit(f)(x)
    assert not isinstance(info.value, reprules.ReprulesError)


def test_after_inference_an_armed_reprules_names_the_missing_rule(mesh):
    x = put(randn(0, (8, 16)), mesh, P("data", None))
    f = shard_map(fresh_copy, mesh, P("data", None), P("data", None))
    with reprules.inference():
        jax.jit(f)(x)
    assert max_err(jax.jit(f)(x), x) == 0.0  # by default: JAX would refuse it, so inferred
    with reprules.inference(False), pytest.raises(
            reprules.MissingRuleError, match=r"(?s)has no replication rule.*inference is off here") as info:
        jax.jit(f)(x)
    assert isinstance(info.value, (NotImplementedError, ValueError))  # what JAX alone raises
    with reprules.inference(), reprules.inference(False), pytest.raises(reprules.MissingRuleError):
        jax.jit(f)(x)  # inference(False) wins


def test_each_kernel_body_is_analysed_once(mesh, monkeypatch):
    from reprules._shim.inference import _analysis

    calls = []
    original = _analysis._summarize
    monkeypatch.setattr(_analysis, "_summarize", lambda jaxpr, *rest: calls.append(jaxpr) or original(jaxpr, *rest))
    x = put(randn(0, (8, 16)), mesh, P("data", None))

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((2, 16), jnp.float32), interpret=True)

    def twice(x):
        return call(call(x))

    with reprules.inference():
        jax.jit(shard_map(twice, mesh, P("data", None), P("data", None)))(x)
    assert len(calls) == len({id(j) for j in calls})  # never the same jaxpr twice


def test_inferred_decisions_join_the_decision_cache(mesh):
    from reprules import _decide

    _decide.cache_clear()
    x = put(randn(0, (8, 16)), mesh, P("data", None))
    with reprules.inference():
        for _ in range(2):  # two programs, two kernel bodies, one derived rule
            jax.make_jaxpr(shard_map(lambda x: fresh_copy(x), mesh, P("data", None), P("data", None)))(x)
    info = _decide.cache_info()
    assert info["misses"] == 1 and info["hits"] >= 1 and info["size"] == 1  # rep asks twice per trace


def test_verify_checks_inferred_rules(mesh, monkeypatch):
    from reprules._shim.inference import infer

    # A wrong derivation (impossible by construction, so forced here) must be caught.
    monkeypatch.setattr(infer, "for_pallas_call", lambda params, *axes: infer.InferredRule((frozenset(),), 1))
    x = put(randn(0, (8, 16)), mesh, P("data", None))
    f = shard_map(fresh_copy, mesh, P("data", None), P())
    with pytest.raises(reprules.ReplicationMismatchError, match="'data'"):
        with reprules.inference(), reprules.verify():
            jax.block_until_ready(jax.jit(f)(x))


def test_whole_process_switch_env_variable():
    code = (
        "import jax, jax.numpy as jnp\n"
        "from jax.sharding import PartitionSpec as P\n"
        "import reprules\n"
        "from helpers import make_mesh, put, randn, shard_map\n"
        "from test_inference import fresh_copy\n"
        "mesh = make_mesh()\n"
        "x = put(randn(0, (8, 16)), mesh, P('data', None))\n"
        "out = jax.jit(shard_map(fresh_copy, mesh, P('data', None), P('data', None)))(x)\n"
        "print('ok', float(abs(out - x).max()))\n"
    )
    env = env_with_cpu_devices(8, {**os.environ, "REPRULES_INFER": "1"})
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    status, error = done.stdout.split()
    assert status == "ok" and float(error) < 1e-30  # 0.4.28 leaves ~1e-38 (mb_div)


# --- JAX's own megablox gmm: nested kernels, a dynamic grid, scalar prefetch, custom_vjp ---


def _megablox():
    try:
        from jax.experimental.pallas.ops.tpu.megablox import gmm
    except ImportError as err:
        pytest.skip(f"JAX {jax.__version__} has no megablox gmm ({err})")
    import contextlib
    import inspect

    from jax.experimental.pallas import tpu as pltpu

    if "interpret" in inspect.signature(gmm).parameters:  # JAX <= 0.x: an argument
        return functools.partial(gmm, interpret=True), contextlib.nullcontext
    if hasattr(pltpu, "force_tpu_interpret_mode"):
        return gmm, pltpu.force_tpu_interpret_mode
    pytest.skip(f"megablox gmm of JAX {jax.__version__} has no CPU interpret mode")


@pytest.mark.xfail(
    not NEW_SHARD_MAP, strict=True, raises=Exception,
    reason="JAX <= 0.5's own check_rep rule for scan refuses megablox's metadata loop (literal "
    "carry): 'Scan carry input and output got mismatched replication types [None, None]'",
)
def test_megablox_gmm_forward_and_gradients_equal_the_reference(mesh):
    gmm, interpret = _megablox()
    m, k, n = 512, 128, 128
    lhs = put(randn(0, (m, k)), mesh, P("data", None))
    rhs = put(randn(1, (2, k, n)), mesh, P())
    sizes = jnp.array([48, 80], jnp.int32)  # per data shard of 128 rows: two ragged groups

    def grouped(lhs, rhs):
        return gmm(lhs, rhs, sizes, preferred_element_type=jnp.float32, tiling=(128, 128, 128))

    f = shard_map(grouped, mesh, (P("data", None), P()), P("data", None))
    t = randn(2, (m, n))

    def loss(lhs, rhs):
        return (f(lhs, rhs) * t).sum()

    with interpret(), reprules.inference():
        out = jax.jit(f)(lhs, rhs)
        grad = jax.grad(loss, argnums=(0, 1))
        psums = psum_axes(grad, lhs, rhs)
        glhs, grhs = jax.jit(grad)(lhs, rhs)
    # Reference, unsharded, in NumPy: rows of group g (within each shard) times rhs[g].
    ln, rn, tn = (np.asarray(a, np.float64) for a in (lhs, rhs, t))
    group = np.tile(np.repeat([0, 1], [48, 80]), 4)
    expected = np.einsum("mk,mkn->mn", ln, rn[group])
    assert max_err(out, expected) < 1e-3
    assert max_err(glhs, np.einsum("mn,mkn->mk", tn, rn[group])) < 1e-3
    expected_rhs = np.stack([ln[group == g].T @ tn[group == g] for g in (0, 1)])
    assert max_err(grhs, expected_rhs) / np.abs(expected_rhs).max() < 1e-5
    assert psums == [("data",)]  # the weight gradient's psum; nothing over 'model'


def test_reports_show_inferred_rules(mesh):
    from reprules import testing

    x = put(randn(0, (8, 16)), mesh, P("data", None))
    f = shard_map(fresh_copy, mesh, P("data", None), P("data", None))
    with reprules.inference():
        report = testing.collectives(jax.jit(f), x)
    (kernel,) = [k for k in report.kernels if k.name == "kernel"]
    assert kernel.has_rule and kernel.rule.startswith("inferred(") and kernel.status().startswith("rule inferred")


@pytest.mark.skipif(not NEW_SHARD_MAP, reason="out_shape carries varying axes from JAX 0.6 (check_vma)")
def test_a_hand_annotation_that_contradicts_the_body_is_refused(mesh):
    x = put(randn(0, (8, 16)), mesh, P("data", None))
    field = "manual_axis_type" if hasattr(jax.ShapeDtypeStruct((1,), jnp.float32), "manual_axis_type") else "vma"

    def replicated_claim(x):
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 2.0

        if field == "vma":
            out = jax.ShapeDtypeStruct(x.shape, x.dtype, vma=frozenset())
        else:
            from jax._src import core  # the type JAX >= 0.10 takes; tokamax annotates like this

            out = jax.ShapeDtypeStruct(x.shape, x.dtype, manual_axis_type=core.ManualAxisType(varying=frozenset()))
        return pl.pallas_call(kernel, out_shape=out, interpret=True)(x)

    f = shard_map(replicated_claim, mesh, P("data", None), P())  # P(): one shard as "the" value
    with reprules.inference(), reprules.strict(), pytest.raises(  # strict keeps the refusal (else: the union)
            reprules.RuleError, match=r"(?s)annotates output 0 as replicated over \{'data'\}.*" + CAST_UP):
        jax.jit(f)(x)


# --- A kernel JAX types itself (out_shape like an operand) run by JAX's HLO interpreter ---


def _like(x):
    """``x``'s type as an out_shape, varying axes included (``jax.ShapeDtypeStruct.like``
    on 0.12, as JAX's TPU flash attention annotates its dq kernel)."""
    t = jax.typeof(x)
    if hasattr(t, "vma"):  # 0.6 - 0.9
        return jax.ShapeDtypeStruct(x.shape, x.dtype, vma=t.vma)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, manual_axis_type=t.mat)


def _mul_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] * w_ref[...]


def _mul_grad_kernel(g_ref, w_ref, o_ref):
    o_ref[...] = g_ref[...] * w_ref[...]


@jax.custom_vjp
def mul_annotated_bwd(x, w):
    """Flash attention's shape: the forward kernel's out_shape says nothing (JAX refuses
    it under checking), the backward's is annotated like its operand (JAX accepts it)."""
    return pl.pallas_call(_mul_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, w)


def _mul_bwd(res, g):
    x, w = res
    dx = pl.pallas_call(_mul_grad_kernel, out_shape=_like(g), interpret=True)(g, w)
    return dx, g * x


mul_annotated_bwd.defvjp(lambda x, w: (mul_annotated_bwd(x, w), (x, w)), _mul_bwd)


@pytest.mark.skipif(not NEW_SHARD_MAP, reason="out_shape carries varying axes from JAX 0.6 (check_vma)")
def test_a_kernel_jax_types_itself_still_runs_once_its_rule_is_unregistered(mesh):
    """JAX's HLO interpreter (``interpret=True``, ``force_tpu_interpret_mode(True)``) refuses
    under checking a call with a varying operand, out_shape annotated or not. The
    annotated kernel ran while a rule covered it (a pack's); once unregistered, inference
    by default left it to JAX, and the gradient failed in JAX's interpreter."""
    x = put(randn(0, (8, 16)), mesh, P("data", None))
    w = put(randn(1, (2, 16)), mesh, P())  # one block, replicated
    t = randn(2, (8, 16))

    def programs(check):
        f = shard_map(mul_annotated_bwd, mesh, (P("data", None), P()), P("data", None), check=check)
        grad = jax.grad(lambda x, w: (f(x, w) * t).sum(), argnums=(0, 1))
        return jax.jit(f)(x, w), jax.jit(grad)(x, w)  # traced anew on every call

    out_off, (dx_off, dw_off) = programs(check=False)
    for kernel in (_mul_kernel, _mul_grad_kernel):
        reprules.replication_rule(rules.same())(kernel)
    ran = [programs(check=True)]
    for kernel in (_mul_kernel, _mul_grad_kernel):
        reprules.unregister(kernel)
    ran.append(programs(check=True))  # both kernels' rules derived by default
    for out, (dx, dw) in ran:
        assert max_err(out, out_off) == 0.0
        assert max_err(dx, dx_off) == 0.0 and max_err(dw, dw_off) < 1e-5


@pytest.mark.skipif(not NEW_SHARD_MAP, reason="out_shape carries varying axes from JAX 0.6 (check_vma)")
def test_an_annotated_kernel_the_interpreter_refuses_is_a_missing_rule_without_inference(mesh, no_inference):
    """The same annotated kernel with inference off: JAX alone fails at lowering, advising
    check_vma=False; reprules says which kernel, why, and the rule to declare."""
    x = put(randn(0, (8, 16)), mesh, P("data", None))
    w = put(randn(1, (2, 16)), mesh, P())

    def f(x, w):
        return pl.pallas_call(_mul_grad_kernel, out_shape=_like(x), interpret=True)(x, w)

    with pytest.raises(reprules.MissingRuleError, match=(
            r"(?s)The Pallas kernel '_mul_grad_kernel' \(defined at .*test_inference.py:\d+\) has no replication "
            rf"rule.*mesh axes \{{'data', 'model'\}}, JAX {re.escape(jax.__version__)}\).*"
            r"reprules\.replication_rule\(rules\.same\(\)\)\(_mul_grad_kernel\).*inference is off here.*"
            r"JAX's own error: none at this call; at lowering, its HLO interpreter \(interpret=True\) fails")):
        jax.jit(shard_map(f, mesh, (P("data", None), P()), P("data", None)))(x, w)
