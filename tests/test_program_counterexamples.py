"""The counterexamples the program fuzzer (tests/fuzz_programs.py) found, minimized.

Each is a program that checking on must either run exactly (values and
gradients equal to checking off and to the program's meaning) or refuse (a
``reprules.ReprulesError``, or a JAX error while tracing); each test accepts
both. Where checking on silently computes something else today, the test is a
strict xfail naming the bug, on the JAX versions where it shows, until the bug
is fixed. A program that would hang (a collective inside a branch that devices
take apart) is never run: its lowered StableHLO is inspected instead.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fuzz_programs import JAX_VERSION, collectives_under_branches
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

import reprules
from reprules.testing import cpu_kernels, shard_map

VMA = JAX_VERSION >= (0, 6)  # JAX types varying axes itself (vma / mat regimes)
# Where each bug shows, measured on the matrix (0.4.28 refuses these programs: check_rep has no
# rule for them).
AFTER_0_4_28 = JAX_VERSION > (0, 4, 28)
FFI_TYPED = JAX_VERSION >= (0, 8)  # ffi_call's output typed replicated (0.6 - 0.7 type it right)

BUG_OPAQUE = ("a rule-less user primitive / ffi_call / pure_callback whose output varies is typed "
              "replicated by JAX (its abstract eval drops the varying axes): the gradient of a replicated "
              "input that multiplies it is one device's, not the sum")
BUG_40823 = ("jax#40823: lax.cond on axis_index with replicated branches; the backward pass puts the psum "
             "of the closed-over replicated input inside each branch, and devices that take different "
             "branches pair their psums: gradient 4 instead of 5")
BUG_COND_VALUE = ("lax.cond / switch on a predicate that varies over 'data' with replicated branches is typed "
                  "replicated: out_specs=P() is accepted and returns device 0's value")
BUG_COND_HANG = ("lax.cond on a predicate that varies over 'data', one branch multiplying by a replicated "
                 "input: the backward pass psums its cotangent inside that branch only, so devices that take "
                 "the other branch never join the all-reduce (the CPU runtime aborts after 40 s)")
BUG_WHILE = ("a while_loop whose trip count varies over 'data' (its carry otherwise replicated) is typed "
             "replicated: out_specs=P() is accepted and returns device 0's value")


def _run(f, *args, steered=()):
    """("refused", error) if tracing raises; ("hangs", collectives) without running it if a
    collective over an axis in ``steered`` (the axes the program's predicates vary over) sits
    inside a branch; else ("ran", value)."""
    try:
        lowered = jax.jit(f).lower(*args)
    except reprules.ReprulesError as err:
        return "refused", err
    except (TypeError, ValueError, NotImplementedError) as err:  # JAX refused while tracing
        return "refused", err
    hangs = [u for u in collectives_under_branches(lowered.as_text()) if u[1] & set(steered)]
    if hangs:
        return "hangs", hangs
    return "ran", lowered.compile()(*args)


def _x(rows=16, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, 8)).astype(np.float32)


# -- (a) rule-less opaque ops typed replicated -------------------------------------------------


def _prim():
    p = Primitive("counterexample_scale")
    p.def_impl(lambda x: x * 2.0)
    p.def_abstract_eval(lambda x: ShapedArray(x.shape, x.dtype))  # drops the varying axes
    mlir.register_lowering(p, mlir.lower_fun(lambda x: x * 2.0, multiple_results=False))
    return p


_SCALE_P = _prim()


def _callback(x):
    host = lambda a: np.asarray(a) * np.float32(2.0)  # noqa: E731
    return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x, **(
        {"vmap_method": "broadcast_all"} if JAX_VERSION >= (0, 4, 34) else {"vectorized": True}))


def _ffi(x):
    return cpu_kernels.mul(x, jnp.full_like(x, 2.0))


OPS = {"primitive": _SCALE_P.bind, "pure_callback": _callback, "ffi_call": _ffi}


@pytest.mark.filterwarnings("ignore::reprules.ReplicationWarning")  # the sound typing's: tests/test_sound_types.py
@pytest.mark.parametrize("op", [
    "ffi_call", "primitive", "pure_callback",  # were BUG_OPAQUE on 0.6+ (ffi_call: 0.8+); fixed
])
def test_gradient_through_a_rule_less_opaque_op_is_the_sum_over_devices(mesh, op):
    """loss = psum(sum(op(x) * w), "data"), x over data, w replicated: dL/dw is
    sum over devices of op(x_d) = 2 * (column sums of x)."""
    if op == "ffi_call" and cpu_kernels.unavailable_reason():
        pytest.skip(cpu_kernels.unavailable_reason())
    body = lambda x, w: jax.lax.psum(jnp.sum(OPS[op](x) * w), "data")  # noqa: E731
    x, w = _x(), _x(4, 1)
    loss = shard_map(body, mesh, (P("data"), P()), P())
    outcome, grad = _run(jax.grad(loss, argnums=1), x, w, steered=["data"])
    if outcome == "ran":
        want = 2.0 * x.reshape(4, 4, 8).sum(0)
        np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-5, atol=1e-5)


# -- (b) cond / switch on a varying predicate --------------------------------------------------


def test_cond_on_axis_index_gradient_is_the_sum_of_both_branches(mesh):
    """jax#40823: psum(cond(axis_index("model") == 0, 2x, 3x), "model") = 5x, so d/dx = 5."""
    body = lambda x: jax.lax.psum(  # noqa: E731
        jax.lax.cond(jax.lax.axis_index("model") == 0, lambda: 2.0 * x, lambda: 3.0 * x), "model")
    loss = shard_map(body, mesh, (P(),), P())
    outcome, grad = _run(jax.grad(lambda x: loss(x).sum()), jnp.ones(()), steered=["model"])
    assert outcome != "hangs", grad
    if outcome == "ran":
        assert float(grad) == 5.0


@pytest.mark.parametrize("form", ["cond", "switch"])
def test_cond_on_a_data_varying_predicate_is_not_replicated(mesh, form):
    """cond(sum(x_d) > 0, 2w, 3w) differs across 'data' (x over data, w replicated):
    out_specs=P() must be refused."""
    def body(x, w):
        if form == "cond":
            return jax.lax.cond(jnp.sum(x) > 0.0, lambda: 2.0 * w, lambda: 3.0 * w)
        return jax.lax.switch((jnp.sum(x) > 0.0).astype(jnp.int32), [lambda: 2.0 * w, lambda: 3.0 * w])

    x = _x()
    x[:4] = np.abs(x[:4])  # device (0, *): positive, device (1, *): negative
    x[4:8] = -np.abs(x[4:8])
    outcome, _ = _run(shard_map(body, mesh, (P("data"), P()), P()), x, _x(4, 1), steered=["data"])
    assert outcome == "refused"


def test_cond_on_a_varying_predicate_puts_no_collective_inside_a_branch(mesh):
    """cond(axis_index("data") == 0, x * w, x * 2): the gradient of w (replicated) needs a
    psum over 'data', which must not sit inside the branch only device 0 takes. Not run:
    its StableHLO is read."""
    body = lambda x, w: jax.lax.cond(  # noqa: E731
        jax.lax.axis_index("data") == 0, lambda: x * w, lambda: x * 2.0)
    f = shard_map(body, mesh, (P("data"), P()), P("data"))
    grad = jax.grad(lambda x, w: (f(x, w) * x).sum(), argnums=(0, 1))
    try:
        text = jax.jit(grad).lower(_x(), _x(4, 1)).as_text()
    except (reprules.ReprulesError, TypeError, ValueError, NotImplementedError):
        return  # refused: fine
    assert [u for u in collectives_under_branches(text) if "data" in u[1]] == []


# -- (while) a while_loop whose trip count varies ----------------------------------------------


def test_while_loop_with_a_data_varying_trip_count_is_not_replicated(mesh):
    """w halved axis_index("data") + 1 times differs across 'data': out_specs=P() must be refused."""
    def body(w):
        n = jax.lax.axis_index("data") + 1.0
        k = jnp.sum(w) * 0.0
        return jax.lax.while_loop(lambda c: c[0] < c[2], lambda c: (c[0] + 1.0, c[1] * 0.5, c[2]), (k, w, k + n))[1]

    outcome, _ = _run(shard_map(body, mesh, (P(),), P()), _x(4, 1), steered=["data"])
    assert outcome == "refused"


# -- the grown grammar (issue 42 item 7, issue 45): control flow holding anything ---------------
# Each was a counterexample of the fuzzer's hang check, not of reprules: the check read a
# lambda's collectives (JAX names its function @"<lambda>_0", quoted) as the function's before
# it, and took every while loop (a scan's too) for one whose trip count varies. It reads the
# StableHLO's own predicates now (helpers.collectives_under_varying_branches); each program
# runs through the fuzzer's whole oracle: values, gradients, no collective under a branch.


def _fuzz_program(inputs, lines, outputs, out_specs, preds, prologue=()):
    """A fuzz_programs.Program from its statements; ``preds``: var -> (operands its predicate
    reads, axes it reads by itself)."""
    import re

    import fuzz_programs

    stmts = []
    for line in lines:
        var, text = line.split(" = ", 1)
        operands = list(dict.fromkeys(re.findall(r"\b[xv]\d+\b", text)))
        reads, axes = preds.get(var, ((), ()))
        stmts.append(fuzz_programs.Stmt(var, text, operands, loops=("cond",) if var in preds else (),
                                        pred_operands=tuple(operands.index(o) for o in reads),
                                        pred_axes=frozenset(axes)))
    return fuzz_programs.Program(0, 0, "default", list(prologue), inputs, stmts, outputs, out_specs)


GROWN = {
    # seed 7 program 8 (JAX 0.12.0.1): jnp.linalg.solve in a branch on axis_index("model").
    "solve in a cond on axis_index": _fuzz_program(
        [(), ("data",)],
        ["v1 = jax.lax.cond(jax.lax.axis_index('model') == 1, lambda p1, q2: p1 * 0.5 - q2, lambda p1, q2: "
         "jnp.linalg.solve(jnp.eye(4) * 4.0 + jnp.tanh(q2[:, :4]) * 0.5, x0), x0, x1)",
         "v4 = jax.jit(lambda p3, q4: p3 * 0.5 - q4)(x1, v1)",
         "v5 = jax.lax.psum(v4, ('data', 'model'))"],
        ["v5", "x0"], [(), ()], {"v1": ((), ("model",))}),
    # seed 1234 program 124 (JAX 0.12.0.1): nested conds, a custom_jvp, lax.map (a while loop).
    "nested conds and lax.map": _fuzz_program(
        [("data",), ()],
        ["v1 = jax.lax.cond(jnp.sum(x0) > 0.0, lambda: x0 * x1, lambda: jax.lax.cond(jax.lax.axis_index('data') "
         "== 3, lambda: x1 + x0 + (x1 + x0) * 0.0, lambda: cjvp_sinmul(x0, x1) + (x0 + x1) * 0.0))",
         "v2 = jax.lax.map(lambda r1: jax.nn.gelu(r1[0]) * r1[1], (x1, x0))",
         "v3 = jax.lax.psum(v2, 'data')"],
        ["v3", "v1"], [("data",), ("data",)], {"v1": (("x0",), ("data",))}),
    # (JAX 0.6.2 and 0.7.2) a custom_vjp around a rule-less primitive: sound types typed its output
    # varying over 'data', so the bwd's cotangent of the replicated x1 varied over 'data' and JAX's
    # transpose refused it with a bare _RepError (0.6) / an out_specs error (0.7). It is psummed now,
    # as for a kernel with a rule (JAX >= 0.8 alone refuses the bwd's type; reprules computes it).
    "custom_vjp around a rule-less primitive": _fuzz_program(
        [("data",), ()],
        ["v2 = diff(prim_mul)(x0, x1)"],
        ["v2"], [("data",)], {}, prologue=['prim_mul = prim_op("mul", "ruleless")']),
    # seed 1128 program 491 (JAX 0.12.0.1), minimized: under grad, a callback's output of stop_gradient-ed
    # inputs has no tangent, so it stays in the trace below linearize's; closed over by a branch on a
    # 'data'-varying predicate it was left uncast, and the bind-level retyping refused the custom_vjp in
    # the loop's body.
    "a callback's output closed over by a branch under grad": _fuzz_program(
        [(), ("data",)],
        ["v2 = cb_mul(sg(x0), sg(x0))",
         "v4 = jax.lax.cond(jnp.sum(x1) > 0, lambda: jax.lax.fori_loop(0, (jnp.abs(jnp.sum(sg(v2))) * 2.0)"
         ".astype(jnp.int32) % 4, lambda i5, c6: c6 * 0.5 + cvjp_mulsin(c6, sg(v2)), sg(x1)), lambda: x1 + v2)"],
        ["v4"], [("data",)], {"v4": (("x1",), ())}, prologue=['cb_mul = callback_op("mul")']),
}


@pytest.mark.parametrize("name", GROWN)
def test_grown_grammar_program_is_exact(mesh, name):
    import fuzz_programs

    got = fuzz_programs.check(GROWN[name], mesh)
    assert (got.counterexamples, got.errors) == ([], []), GROWN[name].source


# -- a constant switch in a scan in a varying cond ------------------------------------------------


def test_a_constant_switch_in_a_scan_in_a_varying_cond_is_exact_under_grad(mesh):
    """Seed 2815 program 23 on JAX 0.7.2, minimized (JAX 0.6 - 0.11 refused it): JAX's partial
    evaluation of the cond returns the switch's index as an int32 residual typed replicated; the
    bind-level retyping cast it up with the other outputs, and the cond that reads it (its other
    half, then its transpose) holds the scan, which cannot be typed again. Integer values have
    no cotangent and only JAX's own halves read such residuals: left as JAX types them."""
    import fuzz_programs

    program = _fuzz_program(
        [(), ("data",)],
        ["v3 = jax.lax.cond(jax.lax.axis_index('data') == 0, lambda: jax.lax.scan(lambda c2, r3: (c2 * 0.5 + "
         "jax.lax.switch(1, [lambda: c2 + r3[0], lambda: r3[0] * jnp.sin(c2)]), c2 + r3[0]), "
         "jnp.zeros(x0.shape[1:]), (x0, x0))[1], lambda: x0 * 2.0)"],
        ["v3"], [("data",)], {"v3": ((), ("data",))})
    got = fuzz_programs.check(program, mesh)
    assert (got.counterexamples, got.errors) == ([], []), program.source
