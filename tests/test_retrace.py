"""Control flow whose branches and loop bodies hold anything: never a crash or a refused correct program.

A ``cond`` / ``switch`` on a device-varying predicate (jax#40823) is typed soundly by
reprules from JAX 0.6, and a loop whose carry starts replicated and comes out varying is
widened to a fixed point. Each program here failed before that was done at the public
entry points (JAX re-tracing the user's functions on the new types): a branch holding a
``scan``, ``fori_loop``, ``lax.map``, ``checkpoint``, ``custom_vjp``, ``jax.nn.relu``,
``jnp.linalg.solve`` or a Pallas kernel with its rule, a carry from ``jnp.zeros``. Each is
compared with checking off and with an unsharded reference (values and gradients), and
its gradient's StableHLO must hold no collective inside a branch devices take apart (a
deadlock on hardware), with no more all-reduces than checking off at the jaxpr, StableHLO
and compiled-HLO levels.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import fuzz_programs
import reprules
from helpers import NEW_SHARD_MAP, assert_no_collective_under_varying_branch, make_mesh, psum_axes, put, randn, shard_map

pytestmark = pytest.mark.skipif(not NEW_SHARD_MAP, reason="the rep era (JAX <= 0.5) rewrites control flow "
                                "in its check_rep rules (tests/test_rep_gaps.py, tests/test_rep_arming.py)")

MESH = make_mesh()
SHARDS = 4  # x's rows over "data"


def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0


@pytest.fixture(autouse=True)
def _copy_kernel_rule():
    """The kernel's declared rule in every test here (conftest clears the registry around each)."""
    reprules.replication_rule()(copy_kernel)


@jax.custom_vjp
def doubled(v):
    return pl.pallas_call(copy_kernel, jax.ShapeDtypeStruct(v.shape, v.dtype), interpret=True)(v)


doubled.defvjp(lambda v: (doubled(v), None), lambda _, g: (2.0 * g,))


@jax.custom_vjp
def scaled(v):
    return v * 2.0


scaled.defvjp(lambda v: (v * 2.0, None), lambda _, g: (g * 2.0,))


def _pred(x):
    return x.sum() > 0  # varies over "data"


# What a branch does to the replicated weight w (2, 4): each holds its own jaxpr.
BRANCHES = {
    "relu": lambda w: jax.nn.relu(w) * 3.0,
    "scan": lambda w: jax.lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(4), w)[1],
    "fori_loop": lambda w: jax.lax.fori_loop(0, 3, lambda i, c: c * 1.5 + w, w),
    "lax.map": lambda w: jax.lax.map(lambda r: r * r, w),
    "checkpoint": lambda w: jax.checkpoint(lambda v: jnp.sin(v) * v)(w),
    "custom_vjp": scaled,
    "linalg.solve": lambda w: jnp.linalg.solve(jnp.eye(2) * 3.0 + w[:, :2] @ w[:, :2].T * 0.1, w),
    "pallas_call with a rule": doubled,
    "nested cond": lambda w: jax.lax.cond(w.sum() > 0, jnp.sin, lambda v: v, w),
    "cond in scan": lambda w: jax.lax.scan(
        lambda c, r: (jax.lax.cond(r.sum() > 0, lambda: c + r, lambda: c - r), c), jnp.zeros(4), w)[1],
}


def _as_operand(branch):
    def body(x, w):
        return x + jax.lax.cond(_pred(x), branch, lambda v: v * 2.0, w).sum(0)

    return body


def _closed_over(branch):
    def body(x, w):
        return x + jax.lax.cond(_pred(x), lambda: branch(w), lambda: w * 2.0).sum(0)

    return body


def _switch(branch):
    def body(x, w):
        index = jnp.clip(jnp.floor(x[0, 0]).astype(jnp.int32), 0, 2)
        return x + jax.lax.switch(index, [lambda: branch(w), lambda: w * 2.0, lambda: jnp.cos(w)]).sum(0)

    return body


def _varying_operand_relu(x, w):
    # jax.nn.relu (a custom_jvp) on a value that already varies, next to a replicated operand.
    return x + jax.lax.cond(_pred(x), lambda a, b: jax.nn.relu(a) + b.sum(0), lambda a, b: a * 2.0, x, w)


def _scan_carry_from_zeros(x, w):
    def step(c, r):
        return jax.lax.cond(r.sum() > 0, lambda: c + r * w[0], lambda: c - r), c

    c, ys = jax.lax.scan(step, jnp.zeros(4), x)
    return ys + c


def _fori_accumulator(x, w):
    # marin-levanter's fused cross-entropy backward: an accumulator from jnp.zeros.
    acc = jax.lax.fori_loop(0, x.shape[0], lambda i, acc: acc + x[i] * w[0], jnp.zeros(4))
    return x + acc


def _carry_chain(x, w):
    # c1 takes c0's old value: the carries vary one step later each (three passes to the fixed point).
    def step(c, r):
        c0, c1, c2 = c
        return (r, c0, c1 + w[1]), c2

    (c0, c1, c2), ys = jax.lax.scan(step, (jnp.zeros(4), jnp.zeros(4), jnp.zeros(4)), x)
    return ys + c0 + c1 + c2


def _while_accumulator(x, w):
    _, acc = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] + x[c[0]] * w[0]), (0, jnp.zeros(4)))
    return x + acc


PROGRAMS = {
    **{f"cond operand, {k}": _as_operand(b) for k, b in BRANCHES.items()},
    **{f"cond closure, {k}": _closed_over(b) for k, b in BRANCHES.items()},
    **{f"switch closure, {k}": _switch(b) for k, b in BRANCHES.items() if k in ("scan", "checkpoint", "custom_vjp")},
    "relu on a varying operand": _varying_operand_relu,
    "scan carry from zeros through a cond": _scan_carry_from_zeros,
    "fori_loop accumulator from zeros": _fori_accumulator,
    "scan carries widened in a chain": _carry_chain,
}


def _reference(body, x, w):
    """The program without shard_map: each data shard on its own, concatenated."""
    rows = x.shape[0] // SHARDS
    return jnp.concatenate([body(x[i * rows:(i + 1) * rows], w) for i in range(SHARDS)])


def _loss(f):
    def loss(x, w):
        out = f(x, w)
        return (out * jnp.arange(1.0, 1 + out.size).reshape(out.shape)).sum()

    return loss


def _sharded(body, check):
    return shard_map(body, MESH, (P("data"), P()), P("data"), check=check)


def _inputs():
    x = randn(0, (8, 4))
    return put(x, MESH, P("data")), put(randn(1, (2, 4)), MESH, P()), x


def _all_reduces(text):
    return len(re.findall(r"all[-_]reduce", text))


@pytest.mark.parametrize("name", PROGRAMS)
def test_exact_and_no_collective_inside_a_branch(name):
    body = PROGRAMS[name]
    x, w, x_host = _inputs()
    grad = {check: jax.jit(jax.value_and_grad(_loss(_sharded(body, check)), argnums=(0, 1))) for check in (True, False)}
    on, off = grad[True](x, w), grad[False](x, w)
    ref = jax.value_and_grad(_loss(lambda a, b: _reference(body, a, b)), argnums=(0, 1))(x_host, w)
    for got, want in [*zip(jax.tree.leaves(on), jax.tree.leaves(ref)), *zip(jax.tree.leaves(on), jax.tree.leaves(off))]:
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(np.abs(want).max()), err_msg=name)
    lowered = {check: g.lower(x, w) for check, g in grad.items()}
    under = [u for u in fuzz_programs.collectives_under_branches(lowered[True].as_text()) if "data" in u[1]]
    assert not under, f"{name}: a collective over 'data' inside a branch: {under}"
    assert len(psum_axes(jax.value_and_grad(_loss(_sharded(body, True))), x, w)) <= len(
        psum_axes(jax.value_and_grad(_loss(_sharded(body, False))), x, w))
    for level in (lambda lw: lw.as_text(), lambda lw: lw.compile().as_text()):
        assert _all_reduces(level(lowered[True])) <= _all_reduces(level(lowered[False])), name


def _while_scan(x, w):
    # A while_loop with a data-varying trip count whose body holds a scan (forward only:
    # JAX has no reverse mode for a while_loop).
    n = (x[0, 0] > 0).astype(jnp.int32) + 1

    def body(c):
        i, v = c
        return i + 1, jax.lax.scan(lambda a, r: (a * r, a), v, w)[0]

    return x + jax.lax.while_loop(lambda c: c[0] < n, body, (0, w[0]))[1]


def _while_closure_checkpoint(x, w):
    n = (x[0, 0] > 0).astype(jnp.int32) + 1
    return x + jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jax.checkpoint(jnp.sin)(c[1]) + w[0]),
                                  (0, jnp.zeros(4)))[1]


FORWARD = {"while_loop on a varying trip count holding a scan": _while_scan,
           "while_loop on a varying trip count, checkpoint and a closure": _while_closure_checkpoint,
           "while_loop accumulator from zeros": _while_accumulator}


@pytest.mark.parametrize("name", FORWARD)
def test_forward_exact(name):
    body = FORWARD[name]
    x, w, x_host = _inputs()
    on = jax.jit(_sharded(body, True))(x, w)
    np.testing.assert_allclose(on, jax.jit(_sharded(body, False))(x, w), rtol=1e-6)
    np.testing.assert_allclose(on, _reference(body, x_host, w), rtol=1e-5)


def test_a_replicated_carry_is_widened_outside_the_loop():
    """The fixed point casts the initial carry up before the loop (one cast, outside):
    its cotangent's psum over 'data' sits after the loop, never in its body."""
    x, w, _ = _inputs()
    lowered = jax.jit(jax.grad(_loss(_sharded(_fori_accumulator, True)), argnums=1)).lower(x, w).as_text()
    assert not [u for u in fuzz_programs.collectives_under_branches(lowered) if "data" in u[1]]
    jaxpr = jax.make_jaxpr(_sharded(_fori_accumulator, True))(x, w)
    text = str(jaxpr)
    assert re.search(r"(pvary|pcast)", text), text


def test_switched_off_jax_refuses_the_replicated_carry(monkeypatch):
    """With REPRULES_SOUND_TYPES=0 the carry is JAX's own: its carry-type refusal."""
    monkeypatch.setenv("REPRULES_SOUND_TYPES", "0")
    x, w, _ = _inputs()
    with pytest.raises(TypeError, match="carry input and carry output must have equal types"):
        jax.jit(_sharded(_fori_accumulator, True)).lower(x, w)


# Found by the program fuzzer: a widened value meeting JAX's own checks (x: P(), 8 devices).
def _replicated_switch_over_a_widened_loop(x):
    # The fori_loop's trip count varies over "data": its carry is widened, the other branch's
    # output is not; on a replicated index both are cast up to their union.
    return jax.lax.psum(jax.lax.switch(jnp.abs(jnp.sum(x)).astype(jnp.int32) % 2, [
        lambda: jax.lax.fori_loop(0, jax.lax.axis_index("data") + 1, lambda i, c: c * 0.5 + x, jnp.zeros(x.shape)),
        lambda: x * 2.0]), "data")


def _replicated_cond_over_a_varying_switch(x):
    return jax.lax.cond(jnp.sum(x) > 0.0, lambda: jax.lax.switch(jax.lax.axis_index("data") % 3, [
        lambda: x * 2.0, lambda: x * 3.0]), lambda: x)


def _psum_over_axes_a_widened_value_partly_varies_over(x):
    k = jnp.sum(x) * 0.0
    v = jax.lax.while_loop(lambda c: c[0] < c[2], lambda c: (c[0] + 1.0, c[1] * 0.5, c[2]),
                           (k, x, k + jax.lax.axis_index("data") + 1.0))[1]
    return jax.lax.psum(v, ("data", "model"))


WIDENED = {"replicated switch over a widened loop": (_replicated_switch_over_a_widened_loop, P()),
           "replicated cond over a varying switch": (_replicated_cond_over_a_varying_switch, P("data")),
           "psum over axes a widened value partly varies over": (_psum_over_axes_a_widened_value_partly_varies_over, P())}


@pytest.mark.parametrize("name", WIDENED)
def test_widened_values_meet_jax_checks_as_checking_off(name):
    body, out_specs = WIDENED[name]
    x = put(randn(2, (4,)), MESH, P())
    on, off = (jax.jit(shard_map(body, MESH, P(), out_specs, check=check))(x) for check in (True, False))
    np.testing.assert_allclose(on, off, rtol=1e-6)


@jax.custom_vjp
def _mulsin(a, b):
    return a * jnp.sin(b)


_mulsin.defvjp(lambda a, b: (a * jnp.sin(b), (a, b)), lambda r, g: (g * jnp.sin(r[1]), g * r[0] * jnp.cos(r[1])))


def test_a_custom_vjp_on_widened_inputs_gets_checking_offs_gradient():
    """Found by the program fuzzer: a switch on a "model"-varying index makes ``v`` vary over
    "model"; a custom_vjp's bwd then returns x's cotangent varying over "model" where x does
    not. JAX alone types ``v`` replicated and gets a wrong gradient; JAX refuses the bwd's
    cotangent once ``v`` is typed soundly. reprules psums it over "model", as checking off does
    (its exactness judged as for a kernel's custom_vjp)."""

    def body(x):
        v = jax.lax.switch(jax.lax.axis_index("model") % 2, [lambda: x * 2.0, lambda: x * 3.0])
        return jax.lax.psum(_mulsin(v, x), "model")

    x = put(randn(3, (8, 4)), MESH, P("data"))
    grads = {check: jax.jit(jax.grad(_loss(lambda x, _: shard_map(body, MESH, P("data"), P("data"), check=check)(x))))(
        x, None) for check in (True, False)}
    np.testing.assert_allclose(grads[True], grads[False], rtol=1e-5)


def _opaque_double():
    """A rule-less user primitive whose abstract eval drops the varying axes (typed on no mesh)."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    prim = Primitive("reprules_test_retrace_double")
    prim.def_impl(lambda x: x * 2.0)
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(lambda x: x * 2.0, multiple_results=False))
    return prim


OPAQUE_DOUBLE = _opaque_double()


def test_a_closed_over_opaque_output_reaches_a_loop_in_a_branch():
    """Found by the program fuzzer (seed 31, program 115): a rule-less primitive's output (its
    type on no mesh) closed over by a while_loop holding a Pallas kernel, in a branch on a
    varying predicate. It is cast up outside the cond like any value made where the cond is
    called (before: left to the bind hook, which cannot retype the kernel: a false refusal)."""

    def body(x, w):
        v = OPAQUE_DOUBLE.bind(w)
        looped = lambda: jax.lax.while_loop(  # noqa: E731
            lambda c: c[0] < 3.0, lambda c: (c[0] + 1.0, c[1] * 0.5 + doubled(v)), (jnp.sum(v) * 0.0, jnp.zeros(v.shape)))[1]
        return x + jax.lax.cond(_pred(x), looped, lambda: v).sum(0)

    x, w, _ = _inputs()
    on = jax.jit(_sharded(body, True))(x, w)
    np.testing.assert_allclose(on, jax.jit(_sharded(body, False))(x, w), rtol=1e-6)


def test_two_vmapped_arguments_over_one_array_closed_over_by_a_branch():
    """Found by the program fuzzer (seed 2026, program 264): under ``vmap`` two arguments are
    batches of the same array; both are cast before either's type is swapped (a cast made
    after the other's swap saw the shared array as varying already, and JAX refused it)."""

    def body(x, w):
        return x + jax.vmap(lambda p, q: jax.lax.cond(_pred(x), lambda: jnp.sin(p) * q, lambda: p - q))(w, w).sum(0)

    x, w, x_host = _inputs()
    grads = {check: jax.jit(jax.grad(_loss(_sharded(body, check)), argnums=(0, 1)))(x, w) for check in (True, False)}
    for got, want in zip(jax.tree.leaves(grads[True]), jax.tree.leaves(grads[False])):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(np.abs(want).max()))


def test_a_value_closed_over_by_nested_conds_on_different_axes():
    """Found by the program fuzzer (seed 9001, program 41): a replicated value used in a switch
    on a "model"-varying index inside a cond on a "data"-varying predicate. The inner switch
    casts the outer cond's cast of it (typed over "data" there), not the value itself (a cast
    of the replicated value typed over both axes: JAX's transpose refused its cotangent)."""

    def body(x, w):
        inner = lambda: jax.lax.switch(jax.lax.axis_index("model"), [lambda: w * 2.0, lambda: jnp.sin(w)])  # noqa: E731
        return jax.lax.pmean(x + jax.lax.cond(_pred(x), inner, lambda: w * 3.0).sum(0), "model")

    x, w, _ = _inputs()
    grads = {check: jax.jit(jax.grad(_loss(_sharded(body, check)), argnums=(0, 1)))(x, w) for check in (True, False)}
    for got, want in zip(jax.tree.leaves(grads[True]), jax.tree.leaves(grads[False])):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(np.abs(want).max()))
    text = jax.jit(jax.grad(_loss(_sharded(body, True)), argnums=1)).lower(x, w).as_text()
    # (a collective over "model" may sit in the branch of the cond on "data": a model group takes it together)
    assert_no_collective_under_varying_branch(text, {"data", "model"})
