"""The program-level differential fuzzer (tests/fuzz_programs.py) on this JAX.

Each run checks ``REPRULES_PROGRAM_FUZZ_COUNT`` generated programs (the
noxfile asks for 200 on the newest JAX and 50 on every other; the same
defaults apply without it) from a seed that changes between runs:
``REPRULES_FUZZ_SEED`` if set (the noxfile sets and prints it), else one shared
by the run's xdist workers. A failure prints the seed, each program's index
and source; ``python tests/fuzz_programs.py --seed S --start I --count 1``
replays one (``--minimize`` shrinks it). Every counterexample the fuzzer found
is a minimized test in tests/test_program_counterexamples.py.
"""

import os
import re

import fuzz_programs
import pytest
from helpers import fuzz_seed

NEWEST = fuzz_programs.JAX_VERSION[:2] >= (0, 12)


SEED = fuzz_seed()
COUNT = int(os.environ.get("REPRULES_PROGRAM_FUZZ_COUNT") or (200 if NEWEST else 50))
CHUNK = 10

# No class is xfailed: every counterexample fails its chunk (a wrong value or gradient, an
# accepted out_specs claim, a collective inside a branch devices take apart, or a false refusal).
# Measured with the grown grammar (issue 42 item 7, issue 45) before the fixes they found: JAX
# 0.12.0.1, 8 in 530 programs (1.5%: branches differing only in their varying axes, a psum over
# axes a widened value partly varies over, a custom_vjp bwd on widened inputs, each now fixed and
# a test in tests/test_retrace.py); after them, the counts in CHANGELOG.md (stop 41's note).


@pytest.mark.parametrize("start", range(0, COUNT, CHUNK), ids=lambda s: f"programs{s}-{s + CHUNK - 1}")
def test_checking_on_is_never_worse_than_checking_off(mesh, start):
    print(f"program fuzzer: REPRULES_FUZZ_SEED={SEED}, programs {start}..{min(start + CHUNK, COUNT) - 1}")
    failures = []
    for index in range(start, min(start + CHUNK, COUNT)):
        program = fuzz_programs.generate(SEED, index)
        try:
            got = fuzz_programs.check(program, mesh)
        except Exception as err:  # the harness itself: reported like a counterexample
            failures.append(f"raised {type(err).__name__}: {str(err)[:600]}\n{program.describe()}")
            continue
        failures += [f"{error}\n{program.describe()}" for error in got.errors]
        if got.counterexamples:
            kind = fuzz_programs.classify(program)
            failures.append(f"[{kind}] " + "; ".join(got.counterexamples) + "\n" + program.describe())
    replay = (f"fuzz seed {SEED} (replay: REPRULES_FUZZ_SEED={SEED}, or python tests/fuzz_programs.py "
              f"--seed {SEED} --start N --count 1 [--minimize]):\n\n")
    assert not failures, replay + "\n\n".join(failures)


def test_the_generator_covers_its_grammar():
    """The programs of a run of 200 (as on the newest JAX) use every construct the grammar
    has on this JAX, and hold every hazard (generating them costs no JAX)."""
    programs = [fuzz_programs.generate(SEED, i) for i in range(max(COUNT, 200))]
    seen = set().union(*(p.constructs() for p in programs))
    wanted = {"leaf", "cond", "cond:operands", "switch", "while", "scan", "vmap", "jit", "collective",
              "axis_index", "nested", "custom_vjp", "diff", "stop_gradient",
              "fori", "fori_dynamic", "map", "checkpoint", "custom_jvp", "jax.nn.relu",
              "jax.nn.gelu", "jax.nn.softplus", "carry:zeros", "while:predicate_construct", "depth:4",
              "kernel:declared", "kernel:ruleless", "prim:declared", "prim:ruleless", "callback:ruleless",
              "mode:default", "mode:infer", "mode:no_infer"}
    wanted |= {f"{k}:{p}" for k in ("cond", "switch", "while", "fori") for p in ("axis_index", "value", "constant")}
    if fuzz_programs.FEATURES["ffi"]:
        wanted |= {"ffi:declared", "ffi:ruleless"}
    if fuzz_programs.FEATURES["solve"]:
        wanted |= {"linalg.solve"}
    assert sorted(wanted - seen) == []
    assert set().union(*(p.hazards() for p in programs)) == set(fuzz_programs.HAZARDS)
    # out_specs of every kind: exact, claiming replication the value may lack, claiming less.
    kinds = set()
    for p in programs:
        vary = p.varying()
        for var, spec in zip(p.outputs, p.out_specs):
            kinds.add("exact" if set(spec) == vary[var] else "claims" if set(spec) < vary[var] else "less")
    assert kinds == {"exact", "claims", "less"}
    sources = "\n".join(p.source for p in programs)
    for call in ("jax.lax.cond(", "jax.lax.switch(", "jax.lax.while_loop(", "jax.lax.scan(", "jax.vmap(",
                 "jax.jit(", "jax.lax.psum(", "jax.lax.pmean(", "jax.lax.axis_index(",
                 *(("cvjp_mulsin(",) if fuzz_programs.FEATURES["jnp_custom_vjp"] else ()),
                 "cjvp_sinmul(", "jax.lax.fori_loop(", "jax.lax.map(", "jax.checkpoint(",
                 "kernel_op(", "prim_op(", "callback_op(",
                 *(("jnp.linalg.solve(",) if fuzz_programs.FEATURES["solve"] else ())):
        assert call in sources, call


def test_the_oracle_sees_a_wrong_value_and_a_wrong_gradient(mesh):
    """The oracle is not blind: a primitive declared replicated (a lying rule) while it
    returns each device's data, claimed replicated in out_specs, is a counterexample; so is
    a wrong gradient: the same primitive, reduced, with its output typed replicated."""
    import reprules
    from reprules import rules

    lying = _program(["v1 = prim_copy(sg(x0))"], ["v1"], [()])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fuzz_programs.Namespace, "_declare", _lie)
        got = fuzz_programs.check(lying, mesh)
    assert got.refused is None and got.counterexamples == [
        "output 0 (v1) differs across 'data', yet checking on accepted out_specs P() "
        "(it returns one device's value)"]
    honest = _program(["v1 = prim_copy(sg(x0))"], ["v1"], [("data",)])
    assert fuzz_programs.check(honest, mesh).counterexamples == []  # the rule `same` is honest
    del reprules, rules


def _lie(self, target, status):
    import reprules
    from reprules import rules

    reprules.replication_rule(rules.invariant("data", "model"))(target)
    self.registered.append(target)


def _program(lines, outputs, out_specs):
    stmts = []
    for line in lines:
        var, text = line.split(" = ", 1)
        operands = [n for n in re.findall(r"\b[xv]\d+\b", text)]
        stmts.append(fuzz_programs.Stmt(var, text, list(dict.fromkeys(operands))))
    return fuzz_programs.Program(0, 0, "default", ['prim_copy = prim_op("copy", "declared")'],
                                 [("data",), ()], stmts, outputs, out_specs)


def test_the_hang_detector_sees_a_collective_inside_a_branch():
    """A collective inside a case region, directly or through a call, is found;
    one outside (or a case without one) is not."""
    text = """\
module @jit_f {
  func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
    %0 = "stablehlo.all_reduce"(%arg0) <{replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>}> ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) : (tensor<4xf32>) -> tensor<4xf32>
    %1 = "stablehlo.case"(%i) ({
      %2 = func.call @inner(%0) : (tensor<4xf32>) -> tensor<4xf32>
      stablehlo.return %2 : tensor<4xf32>
    }, {
      stablehlo.return %0 : tensor<4xf32>
    }) : (tensor<i32>) -> tensor<4xf32>
    return %1 : tensor<4xf32>
  }
  func.func private @inner(%arg0: tensor<4xf32>) -> tensor<4xf32> {
    %0 = "stablehlo.all_reduce"(%arg0) <{replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>}> ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) : (tensor<4xf32>) -> tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
"""
    assert fuzz_programs.collectives_under_branches(text) == [("call @inner", frozenset({"model"}))]
    assert fuzz_programs.collectives_under_branches(text.replace("func.call @inner", "func.call @other")) == []


def test_the_hang_detector_reads_quoted_function_names():
    """JAX names a lambda's function with quotes (@"<lambda>_0"): its collectives are its own,
    not the function before it (seed 7 program 8 on 0.12: a psum over 'model' in a lambda was
    taken for one inside jnp.linalg.solve, called from a branch on a 'model'-varying predicate)."""
    from helpers import assert_no_collective_under_varying_branch

    text = """\
module @jit_f {
  func.func public @main(%arg0: tensor<4xf32>, %i: tensor<i32>) -> tensor<4xf32> {
    %1 = "stablehlo.case"(%i) ({
      %2 = func.call @solve(%arg0) : (tensor<4xf32>) -> tensor<4xf32>
      stablehlo.return %2 : tensor<4xf32>
    }, {
      %3 = func.call @"<lambda>_1"(%arg0) : (tensor<4xf32>) -> tensor<4xf32>
      stablehlo.return %3 : tensor<4xf32>
    }) : (tensor<i32>) -> tensor<4xf32>
    %4 = func.call @"<lambda>_0"(%1) : (tensor<4xf32>) -> tensor<4xf32>
    return %4 : tensor<4xf32>
  }
  func.func private @solve(%arg0: tensor<4xf32>) -> tensor<4xf32> {
    return %arg0 : tensor<4xf32>
  }
  func.func private @"<lambda>_0"(%arg0: tensor<4xf32>) -> tensor<4xf32> {
    %0 = "stablehlo.all_reduce"(%arg0) <{replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>}> ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) : (tensor<4xf32>) -> tensor<4xf32>
    return %0 : tensor<4xf32>
  }
  func.func private @"<lambda>_1"(%arg0: tensor<4xf32>) -> tensor<4xf32> {
    %0 = "stablehlo.all_reduce"(%arg0) <{replica_groups = dense<[[0, 2, 4, 6]]> : tensor<1x4xi64>}> ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) : (tensor<4xf32>) -> tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
"""
    assert fuzz_programs.collectives_under_branches(text) == [("call @<lambda>_1", frozenset({"data"}))]
    assert_no_collective_under_varying_branch(text, {"model"})  # the 'data' psum: devices agree there
    with pytest.raises(AssertionError, match=r"<lambda>_1 over \['data'\]"):
        assert_no_collective_under_varying_branch(text, {"data"})


def test_the_hang_detector_joins_loop_carries_from_the_bottom_up():
    """A backward pass's loop reads a residual the forward pass computed from ``axis_index('model')``;
    a branch on it psums over 'data', where devices agree (seed 9001 program 0 on JAX 0.6.2: the
    call's operands stood for its results until the callee's were known, and the loop carry kept
    them: the index looked 'data'-varying). The same index from ``axis_index('data')`` is flagged."""
    from helpers import assert_no_collective_under_varying_branch, collectives_under_varying_branches

    text = """\
module @jit_f {
  func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
    %0 = call @fwd(%arg0) : (tensor<4xf32>) -> tensor<i32>
    %1 = call @bwd(%0, %arg0) : (tensor<i32>, tensor<4xf32>) -> tensor<4xf32>
    return %1 : tensor<4xf32>
  }
  func.func private @fwd(%arg0: tensor<4xf32>) -> tensor<i32> {
    %c = stablehlo.constant dense<DIVISOR> : tensor<ui32>
    %c_0 = stablehlo.constant dense<2> : tensor<ui32>
    %0 = stablehlo.partition_id : tensor<ui32>
    %1 = stablehlo.divide %0, %c : tensor<ui32>
    %2 = stablehlo.remainder %1, %c_0 : tensor<ui32>
    %3 = stablehlo.convert %2 : (tensor<ui32>) -> tensor<i32>
    return %3 : tensor<i32>
  }
  func.func private @bwd(%arg0: tensor<i32>, %arg1: tensor<4xf32>) -> tensor<4xf32> {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %0:3 = stablehlo.while(%iterArg = %arg0, %iterArg_1 = %arg1, %iterArg_2 = %c) : tensor<i32>, tensor<4xf32>, tensor<i32>
     cond {
      %c_3 = stablehlo.constant dense<4> : tensor<i32>
      %1 = stablehlo.compare  LT, %iterArg_2, %c_3,  SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %1 : tensor<i1>
    } do {
      %1 = func.call @branch(%iterArg, %iterArg_1) : (tensor<i32>, tensor<4xf32>) -> tensor<4xf32>
      %c_3 = stablehlo.constant dense<1> : tensor<i32>
      %2 = stablehlo.add %iterArg_2, %c_3 : tensor<i32>
      stablehlo.return %iterArg, %1, %2 : tensor<i32>, tensor<4xf32>, tensor<i32>
    }
    return %0#1 : tensor<4xf32>
  }
  func.func private @branch(%arg0: tensor<i32>, %arg1: tensor<4xf32>) -> tensor<4xf32> {
    %0 = "stablehlo.case"(%arg0) ({
      %1 = "stablehlo.all_reduce"(%arg1) <{replica_groups = dense<[[0, 2, 4, 6], [1, 3, 5, 7]]> : tensor<2x4xi64>}> ({
      ^bb0(%a: tensor<f32>, %b: tensor<f32>):
        %s = stablehlo.add %a, %b : tensor<f32>
        stablehlo.return %s : tensor<f32>
      }) : (tensor<4xf32>) -> tensor<4xf32>
      stablehlo.return %1 : tensor<4xf32>
    }, {
      stablehlo.return %arg1 : tensor<4xf32>
    }) : (tensor<i32>) -> tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
"""
    assert_no_collective_under_varying_branch(text.replace("DIVISOR", "1"), {"data", "model"})  # axis_index('model')
    flagged = collectives_under_varying_branches(text.replace("DIVISOR", "2"))  # axis_index('data') % 2
    assert [axes for _, axes in flagged] == [frozenset({"data"})], flagged
