"""The differential soundness fuzzer (tests/fuzz_kernels.py) on this JAX.

Each run checks ``REPRULES_FUZZ_COUNT`` generated kernels (the noxfile asks for
150 on the newest JAX and 40 on every other) from a seed that changes between
runs: ``REPRULES_FUZZ_SEED`` if set (the noxfile sets and prints it), else one
shared by the run's xdist workers. A failure prints the seed, the kernel's
index and its source; ``python tests/fuzz_kernels.py --seed S --start I
--count 1`` replays it. Every counterexample the fuzzer ever found is a fixed
test in tests/test_infer_effects.py.
"""

import os

import fuzz_kernels
import pytest
from helpers import fuzz_seed

import reprules
from reprules import rules


SEED = fuzz_seed()
COUNT = int(os.environ.get("REPRULES_FUZZ_COUNT", "100"))
CHUNK = 10


@pytest.mark.parametrize("start", range(0, COUNT, CHUNK), ids=lambda s: f"kernels{s}-{s + CHUNK - 1}")
def test_no_output_typed_replicated_differs_across_devices(mesh, start):
    failures = []
    for index in range(start, min(start + CHUNK, COUNT)):
        case = fuzz_kernels.generate(SEED, index)
        try:
            got = fuzz_kernels.check(case, mesh)
        except Exception as err:  # a refusal must be a reprules error, never a raw one
            failures.append(f"raised {type(err).__name__}: {str(err)[:600]}\n{case.describe()}")
            continue
        failures += [f"{wrong}\n{case.describe()}" for wrong in got.counterexamples]
    assert not failures, (f"fuzz seed {SEED} (replay: REPRULES_FUZZ_SEED={SEED}, or "
                          f"python tests/fuzz_kernels.py --seed {SEED} --start N --count 1):\n\n"
                          + "\n\n".join(failures))


def test_the_oracle_sees_a_lying_rule(mesh):
    """The fuzzer's oracle is not blind: a rule that types every output replicated
    (a lie for a kernel whose output is its data-varying input) is caught."""
    case = fuzz_kernels.Case(
        seed=0, index=0, source=_COPY, emulated=None, in_axes=[("data",)], in_kinds=["f32"], num_out=1,
        uses_kernel=False)
    got = fuzz_kernels.check(case, mesh)
    assert got.replicated == {(0, "data"): False, (0, "model"): True} and not got.counterexamples
    lying = fuzz_kernels.compile_source(_COPY)
    reprules.replication_rule(rules.invariant("data", "model"))(lying.__globals__["kernel"])
    got = fuzz_kernels.check(case, mesh, call=lying)
    assert got.replicated[0, "data"] is True
    assert got.counterexamples == ["output 0 is typed replicated over 'data' but differs across it"]


def test_the_generator_covers_its_grammar():
    """The kernels of a run of 300 (twice CI's share on the newest JAX) use every construct the grammar
    has on this JAX (generating them costs no JAX)."""
    sources = "\n".join(fuzz_kernels.generate(SEED, i).source for i in range(max(COUNT, 300)))
    wanted = ["pl.when(", "jax.lax.cond(", "pl.ds(", "acc_ref[...] =", "s_ref[", "lambda i, s: (s[",
              "input_output_aliases={0: 0}"]
    for feature, constructs in _CONSTRUCTS.items():
        if fuzz_kernels.FEATURES[feature]:
            wanted += constructs
    assert [w for w in wanted if w not in sources] == []
    cases = [fuzz_kernels.generate(SEED, i) for i in range(max(COUNT, 300))]
    if fuzz_kernels.FEATURES["hidden_mesh"]:  # both call sites, both entry points
        assert {(c.hidden_mesh, c.uses_kernel) for c in cases} >= {
            (h, k) for h in (False, True) for k in ((False, True) if fuzz_kernels.FEATURES["kernel"] else (False,))}
    else:
        assert not any(c.hidden_mesh for c in cases)


# What a kernel of each feature writes, where this JAX has the feature.
_CONSTRUCTS = {
    "loops": ["jax.lax.fori_loop(", "jax.lax.while_loop("],
    "alias_with_prefetch": ["input_output_aliases={1: 0}"],
    "prng": ["pltpu.prng_seed(", "pltpu.prng_random_bits("],
    "stateful": ["pltpu.stateful_bits("],
    "pallas_key": ["impl='pallas_tpu'"],
    "kernel": ["pl.kernel("],
    "run_state": ["pl.run_state("],
    "einshape": ["pltpu.einshape("],
    "trace_value": ["pltpu.trace_value("],
    "new_ref": ["pltpu.sync_copy(w_ref, acc_ref)"],
}

_COPY = """\
G = 2
def kernel(x0_ref, o0_ref, acc_ref):
    o0_ref[...] = x0_ref[...]
def call(x0):
    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((G * R, C), jnp.float32)],
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=0, grid=(G,),
            in_specs=[pl.BlockSpec(block_shape=(R, C), index_map=lambda i, *s: (i, 0))],
            out_specs=[pl.BlockSpec(block_shape=(R, C), index_map=lambda i, *s: (i, 0))],
            scratch_shapes=[pltpu.VMEM((R, C), jnp.float32)]),
        interpret=INTERPRET)(x0)
"""
