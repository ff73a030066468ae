"""Inference's effect model: state that is not an operand (the TPU PRNG, scalar
prefetch refs the kernel writes and index maps read) reaches the outputs it
can reach, and what reprules cannot model is refused.

Each kernel here is written as the fuzzer writes kernels (tests/fuzz_kernels.py)
and checked by its oracle: an output typed replicated over an axis must not
differ across it. The first two are the issue's findings; the ``FOUND_*`` ones
are counterexamples the fuzzer found in the analysis before the effect model.
"""

import fuzz_kernels
import pytest
from fuzz_kernels import FEATURES, Case, check

needs_prng = pytest.mark.skipif(not FEATURES["prng"], reason="this JAX has no pltpu.prng_seed")
needs_kernel = pytest.mark.skipif(not FEATURES["kernel"], reason="pl.kernel over a TPU core mesh "
                                  "interprets inside shard_map from JAX 0.8")


def _case(source, in_axes, num_out=1, emulated=None, kinds=None, uses_kernel=False):
    return Case(0, 0, source, emulated, in_axes, kinds or ["f32"] * len(in_axes), num_out, uses_kernel)


def _call(kernel_params, body, args="x0", grid=4, prefetch=0, maps="lambda i, *s: (i, 0)"):
    n = len(args.split(", ")) - prefetch
    return f"""\
G = {grid}
def kernel({kernel_params}):
{body}
def call({args}):
    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((G * R, C), jnp.float32)],
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch={prefetch}, grid=(G,),
            in_specs=[{', '.join([f'pl.BlockSpec(block_shape=(R, C), index_map={maps})'] * n)}],
            out_specs=[pl.BlockSpec(block_shape=(R, C), index_map=lambda i, *s: (i, 0))],
            scratch_shapes=[pltpu.VMEM((R, C), jnp.float32)]),
        interpret=INTERPRET)({args})
"""


# -- scalar prefetch written by the kernel, read by an index map ----------------------------

PREFETCH_WRITTEN = _call(
    "s_ref, x0_ref, t_ref, o0_ref, acc_ref",
    "    @pl.when(pl.program_id(0) == 0)\n"
    "    def _():\n"
    "        s_ref[1] = (jnp.abs(x0_ref[0, 0]) * 7.0).astype(jnp.int32) % G\n"
    "    o0_ref[...] = t_ref[...]",
    args="s, x0, t", prefetch=1, maps="lambda i, s: (s[1] % G, 0)")


def test_a_prefetch_ref_the_kernel_writes_reaches_the_blocks_its_index_maps_pick(mesh):
    # x varies over data; the table t and the prefetch operand are replicated. The kernel
    # stores a value computed from x into the prefetch ref; the index maps read it, so
    # which block of t each device copies out depends on x.
    got = check(_case(PREFETCH_WRITTEN, [(), ("data",), ()], kinds=["prefetch", "f32", "f32"]), mesh)
    assert got.refused is None and not got.counterexamples
    assert got.replicated == {(0, "data"): False, (0, "model"): True}


# -- the TPU's hardware PRNG -----------------------------------------------------------------

SEED_THEN_DRAW = _call("x0_ref, o0_ref, acc_ref", """\
    pltpu.prng_seed((jnp.abs(x0_ref[0, 0]) * 7.0).astype(jnp.int32))
    o0_ref[...] = pltpu.prng_random_bits((R, C)).astype(jnp.float32)""")

SEED_ONCE_DRAW_EVERY_STEP = _call("x0_ref, o0_ref, acc_ref", """\
    @pl.when(pl.program_id(0) == 0)
    def _():
        pltpu.prng_seed((jnp.abs(x0_ref[0, 0]) * 7.0).astype(jnp.int32))
    o0_ref[...] = pltpu.prng_random_bits((R, C)).astype(jnp.float32)""")

SEED_THEN_STATEFUL = _call("x0_ref, o0_ref, acc_ref", """\
    pltpu.prng_seed((jnp.abs(x0_ref[0, 0]) * 7.0).astype(jnp.int32))
    o0_ref[...] = pltpu.stateful_uniform((R, C))""")

PALLAS_KEY_THEN_DRAW = _call("x0_ref, o0_ref, acc_ref", """\
    key = jax.random.key((jnp.abs(x0_ref[0, 0]) * 7.0).astype(jnp.int32), impl="pallas_tpu")
    first = jax.random.bits(key, (R, C)).astype(jnp.float32)
    o0_ref[...] = first * 0.0 + pltpu.prng_random_bits((R, C)).astype(jnp.float32)""")

DRAW_IN_PL_KERNEL = """\
def call(x0):
    def body(x0_ref, o0_ref):
        def scoped(xv, ov):
            pltpu.sync_copy(x0_ref, xv)
            pltpu.prng_seed((jnp.abs(xv[0, 0]) * 7.0).astype(jnp.int32))
            ov[...] = pltpu.prng_random_bits((R, C)).astype(jnp.float32)
            pltpu.sync_copy(ov, o0_ref)
        pl.run_scoped(scoped, pltpu.VMEM((R, C), jnp.float32), pltpu.VMEM((R, C), jnp.float32))
    return pl.kernel(body, [jax.ShapeDtypeStruct((R, C), jnp.float32)], mesh=KERNEL_MESH,
                     interpret=INTERPRET)(x0)
"""


@needs_prng
@pytest.mark.parametrize("source, feature", [
    (SEED_THEN_DRAW, "prng"), (SEED_THEN_STATEFUL, "stateful"), (PALLAS_KEY_THEN_DRAW, "pallas_key"),
    (DRAW_IN_PL_KERNEL, "kernel"),
], ids=["same-step", "stateful_uniform", "after-pallas_tpu-key", "pl.kernel"])
def test_random_bits_vary_like_the_seed_they_were_drawn_from(mesh, source, feature):
    if not FEATURES[feature]:
        pytest.skip(f"this JAX lacks {feature} in Pallas TPU")
    # JAX's interpreters cannot run the TPU's PRNG on CPU (zeros, or no lowering): the typing.
    got = check(_case(source, [("data",)], uses_kernel=feature == "kernel"), mesh, values=False)
    assert got.refused is None, got.refused
    # The bits are a function of the seed, which is computed from x (varying over data).
    assert got.replicated == {(0, "data"): False, (0, "model"): True}


@needs_prng
def test_a_draw_no_seed_precedes_on_every_path_is_refused(mesh):
    # Grid steps may run on another core (megacore), whose generator was never seeded.
    got = check(_case(SEED_ONCE_DRAW_EVERY_STEP, [("data",)]), mesh, values=False)
    assert got.refused is not None
    assert "MissingRuleError" in got.refused
    assert "prng_random_bits" in got.refused and "no prng_seed in this kernel precedes it" in got.refused


# -- counterexamples the fuzzer found before the effect model ------------------------------

FOUND_SEED3_55 = _call("s_ref, x0_ref, o0_ref, acc_ref", """\
    i = pl.program_id(0)
    k1 = s_ref[0]
    k2 = i + i
    v3 = pltpu.prng_random_bits((8, 128)).astype(jnp.float32)
    pltpu.prng_seed(k2)
    o0_ref[...] = v3
    v4 = v3 * v3
    o0_ref[...] = v4""", args="s, x0", grid=3, prefetch=1, maps="lambda i, s: (s[0] % G, 0)")

FOUND_SEED4_61 = _call("x0_ref, o0_ref, acc_ref", """\
    i = pl.program_id(0)
    v1 = pltpu.prng_random_bits((8, 128)).astype(jnp.float32)
    pltpu.prng_seed(i)
    o0_ref[...] = v1 + x0_ref[...] * 0.0""", grid=3)


@needs_prng
@pytest.mark.parametrize("source", [FOUND_SEED3_55, FOUND_SEED4_61], ids=["seed3-55", "seed4-61"])
def test_fuzzer_counterexamples_draw_before_a_seed(mesh, source):
    # The first step draws from whatever the core's generator held: refused, never replicated.
    in_axes = [(), ("model",)] if "s_ref" in source else [("model",)]
    kinds = ["prefetch", "f32"] if "s_ref" in source else None
    got = check(_case(source, in_axes, kinds=kinds), mesh, values=False)
    assert got.refused is not None and "hardware PRNG" in got.refused


# -- false refusals: plainly local kernels that inference now derives ----------------------

@needs_kernel
def test_a_kernel_that_only_reads_a_captured_ref_by_dma_is_derived(mesh):
    if not FEATURES["new_ref"]:
        pytest.skip("this JAX has no jax.new_ref")
    source = """\
def call(x0, w):
    w_ref = jax.new_ref(w)
    def body(x0_ref, o0_ref):
        def scoped(xv, wv, ov):
            pltpu.sync_copy(x0_ref, xv)
            pltpu.sync_copy(w_ref, wv)
            ov[...] = xv[...] * wv[...]
            pltpu.sync_copy(ov, o0_ref)
        pl.run_scoped(scoped, *[pltpu.VMEM((R, C), jnp.float32)] * 3)
    return pl.kernel(body, [jax.ShapeDtypeStruct((R, C), jnp.float32)], mesh=KERNEL_MESH,
                     interpret=INTERPRET)(x0)
"""
    got = check(_case(source, [("data",), ()], uses_kernel=True), mesh)
    if fuzz_kernels.JAX_VERSION < (0, 10):  # core_map: inference reads no body that closes over a ref
        assert got.refused is not None and got.refused.startswith("MissingRuleError")
        return
    assert got.refused is None, got.refused
    assert got.replicated == {(0, "data"): False, (0, "model"): True} and not got.counterexamples


OBSERVING = {
    "debug_check": "    pl.debug_check(jnp.all(x0_ref[...] > -1e9), 'finite')\n    o0_ref[...] = x0_ref[...]",
    "trace_value": "    pltpu.trace_value('x00', x0_ref[0, 0])\n    o0_ref[...] = x0_ref[...]",
    "run_state": ("    def twice(ref):\n        ref[...] = ref[...] * 2.0\n"
                  "    o0_ref[...] = pl.run_state(twice)(x0_ref[...])"),
    "einshape": "    o0_ref[...] = pltpu.einshape('ab->ba', pltpu.einshape('ab->ba', x0_ref[...]))",
}


@pytest.mark.parametrize("name", sorted(OBSERVING))
def test_local_primitives_inference_used_to_refuse(mesh, name):
    module = fuzz_kernels.pltpu if name in ("trace_value", "einshape") else fuzz_kernels.pl
    if not hasattr(module, name):
        pytest.skip(f"this JAX has no {module.__name__}.{name}")
    # JAX < 0.12 cannot lower trace_value on CPU: its typing only there.
    values = name != "trace_value" or FEATURES["trace_value"]
    got = check(_case(_call("x0_ref, o0_ref, acc_ref", OBSERVING[name]), [("data",)]), mesh, values=values)
    assert got.refused is None, got.refused
    assert got.replicated == {(0, "data"): False, (0, "model"): True} and not got.counterexamples


FOUND_053_SEED5_13 = """\
G = 2
def kernel(s_ref, x0_ref, o0_ref, o1_ref, acc_ref):
    o0_ref[...] = x0_ref[...]
def call(s, x0):
    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((G * R, C), jnp.float32)] * 2,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(G,),
            in_specs=[pl.BlockSpec(block_shape=(R, C), index_map=lambda i, s: (s[0] % G, 0))],
            out_specs=[pl.BlockSpec(block_shape=(R, C), index_map=lambda i, *s: (i, 0)),
                       pl.BlockSpec(block_shape=(R, C), index_map=lambda i, s: ((i + s[1]) % G, 0))],
            scratch_shapes=[pltpu.VMEM((R, C), jnp.float32)]),
        interpret=INTERPRET)(s, x0)
"""


def test_an_input_cast_up_for_one_output_types_the_other_alike(mesh):
    """Found by the fuzzer on JAX 0.5.3: both outputs depend on the prefetch operand,
    which the rule casts up for output 0; JAX <= 0.5 decides again from the cast
    inputs, and raised its own internal error when the two decisions disagreed."""
    got = check(_case(FOUND_053_SEED5_13, [(), ("data", "model")], num_out=2, kinds=["prefetch", "f32"]), mesh)
    assert got.refused is None and not got.counterexamples
    assert got.replicated[0, "data"] is False and got.replicated[0, "model"] is False


@needs_kernel
def test_a_kernel_with_a_captured_ref_is_typed_by_what_it_reads(mesh):
    """Found by the fuzzer on JAX 0.8.3: a pl.kernel that captures a jax.new_ref and
    copies its data-varying input out was typed replicated over data. Inference
    refuses a body that closes over a ref there, and JAX 0.8 - 0.9 alone type every
    output of a pl.kernel replicated: reprules let that stand. Under inference a
    refusal is now a MissingRuleError on every version."""
    source = """\
def call(x0, w):
    w_ref = jax.new_ref(w)
    def body(x0_ref, o0_ref):
        def scoped(xv, ov, wv):
            pltpu.sync_copy(x0_ref, xv)
            pltpu.sync_copy(w_ref, wv)
            ov[...] = xv[...]
            pltpu.sync_copy(ov, o0_ref)
        pl.run_scoped(scoped, *[pltpu.VMEM((R, C), jnp.float32)] * 3)
    return pl.kernel(body, [jax.ShapeDtypeStruct((R, C), jnp.float32)], mesh=KERNEL_MESH,
                     interpret=INTERPRET)(x0)
"""
    got = check(_case(source, [("data",), ()], uses_kernel=True), mesh)
    assert not got.counterexamples
    assert got.refused is not None or got.replicated[0, "data"] is False
    if got.refused is not None:  # 0.8 - 0.9: inference reads no body that closes over a ref
        assert got.refused.startswith("MissingRuleError") and "`pl.kernel`" in got.refused
