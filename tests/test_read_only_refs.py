"""A ``pl.kernel`` body that only *reads* a captured ``jax.new_ref`` is derived; one that
writes into it is still refused.

From JAX 0.10 a Read/Write effect on an equation names its operand by ``Var``
(``effect.input``), no longer by position (``input_index``). Inference read
positions only, so no operand of a ``pltpu.sync_copy`` looked marked, every one
counted as written, and a DMA *from* the captured ref wrote into it whatever its
destination held: a copy of it straight into the output ref, or into scratch
that held another value, was refused with "writes into operand 1" (found on
0.12.0.1). The ref holds a replicated value, so the output that reads it only is
replicated; one that reads it and ``x`` varies like ``x``.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from helpers import JAX_VERSION, count_all_reduce, max_err, psum_axes, put, randn, shard_map

pltpu = pytest.importorskip("jax.experimental.pallas.tpu")

pytestmark = pytest.mark.skipif(
    JAX_VERSION < (0, 10) or not hasattr(jax, "new_ref"),
    reason=f"JAX {jax.__version__}: a pl.kernel runs a captured jax.new_ref as an operand of its "
    "mpmd_map from 0.10 (0.8 - 0.9 make it a core_map whose body closes over the ref, which "
    "inference refuses as a closure, not as a write; before 0.8 pl.kernel does not interpret "
    "inside shard_map)",
)

R, C = 8, 128
INTERPRET = pltpu.InterpretParams() if hasattr(pltpu, "InterpretParams") else True  # 0.6+; skipped before


def _kernel_mesh():
    with warnings.catch_warnings():  # 0.12 deprecates it for pltpu.TensorCoreMesh, new there
        warnings.simplefilter("ignore", DeprecationWarning)
        return pltpu.create_tensorcore_mesh("core", num_cores=1)


def _vmem(n):
    return [pltpu.VMEM((R, C), jnp.float32)] * n


def direct(x, w):
    """Copies the captured ref straight into the output: out = w."""
    w_ref = jax.new_ref(w)

    def body(x_ref, o_ref):
        pltpu.sync_copy(w_ref, o_ref)

    return pl.kernel(body, jax.ShapeDtypeStruct((R, C), jnp.float32), mesh=_kernel_mesh(),
                     interpret=INTERPRET)(x)


def reused_scratch(x, w):
    """Copies x into a scratch buffer, reads it, then copies the captured ref into the
    same buffer (a separate read-only copy): out = x * w."""
    w_ref = jax.new_ref(w)

    def body(x_ref, o_ref):
        def scoped(buf, out):
            pltpu.sync_copy(x_ref, buf)
            xv = buf[...]
            pltpu.sync_copy(w_ref, buf)
            out[...] = xv * buf[...]
            pltpu.sync_copy(out, o_ref)

        pl.run_scoped(scoped, *_vmem(2))

    return pl.kernel(body, jax.ShapeDtypeStruct((R, C), jnp.float32), mesh=_kernel_mesh(),
                     interpret=INTERPRET)(x)


def two_outputs(x, w):
    """out0 = x * w (reads both), out1 = w (reads the captured ref only)."""
    w_ref = jax.new_ref(w)

    def body(x_ref, o_ref, p_ref):
        def scoped(buf, out):
            pltpu.sync_copy(w_ref, p_ref)
            pltpu.sync_copy(x_ref, buf)
            xv = buf[...]
            pltpu.sync_copy(w_ref, buf)
            out[...] = xv * buf[...]
            pltpu.sync_copy(out, o_ref)

        pl.run_scoped(scoped, *_vmem(2))

    shape = jax.ShapeDtypeStruct((R, C), jnp.float32)
    return pl.kernel(body, (shape, shape), mesh=_kernel_mesh(), interpret=INTERPRET)(x)


def dma_into_the_ref(x, w):
    """Writes x into the captured ref by a DMA: a real write."""
    w_ref = jax.new_ref(w)

    def body(x_ref, o_ref):
        def scoped(buf):
            pltpu.sync_copy(x_ref, buf)
            pltpu.sync_copy(buf, w_ref)
            pltpu.sync_copy(buf, o_ref)

        pl.run_scoped(scoped, *_vmem(1))

    return pl.kernel(body, jax.ShapeDtypeStruct((R, C), jnp.float32), mesh=_kernel_mesh(),
                     interpret=INTERPRET)(x)


def dma_ref_to_ref(x, w):
    """Copies the captured ref into itself through the output: reads w, then writes the
    output's contents (x) back into it."""
    w_ref = jax.new_ref(w)

    def body(x_ref, o_ref):
        pltpu.sync_copy(x_ref, o_ref)
        pltpu.sync_copy(o_ref, w_ref)

    return pl.kernel(body, jax.ShapeDtypeStruct((R, C), jnp.float32), mesh=_kernel_mesh(),
                     interpret=INTERPRET)(x)


@pytest.fixture
def setup(mesh):
    x = put(randn(0, (4 * R, C)), mesh, P("data"))  # (R, C) per data shard
    w = put(randn(1, (R, C)), mesh, P())  # replicated
    return mesh, x, w


@pytest.mark.parametrize("call", [direct, reused_scratch], ids=["into-the-output", "into-reused-scratch"])
def test_a_body_that_only_reads_the_captured_ref_is_derived(setup, call):
    mesh, x, w = setup
    wn = np.tile(np.asarray(w), (4, 1))
    want = wn if call is direct else np.asarray(x) * wn
    with reprules.inference():  # before: MissingRuleError, "writes into operand 1"
        got = jax.jit(shard_map(call, mesh, (P("data"), P()), P("data")))(x, w)
    assert max_err(got, want) == 0.0


def test_an_output_that_reads_only_the_captured_ref_is_replicated(setup):
    mesh, x, w = setup
    step = jax.jit(shard_map(two_outputs, mesh, (P("data"), P()), (P("data"), P())))
    with reprules.inference(), reprules.verify():
        out0, out1 = step(x, w)
    assert max_err(out0, np.asarray(x) * np.tile(np.asarray(w), (4, 1))) == 0.0
    assert max_err(out1, np.asarray(w)) == 0.0
    bad = jax.jit(shard_map(two_outputs, mesh, (P("data"), P()), (P(), P())))
    with reprules.inference(), pytest.raises(ValueError, match="out_specs"):
        bad(x, w)  # out0 reads x: it varies over data, and P() is refused


@pytest.mark.parametrize("call", [dma_into_the_ref, dma_ref_to_ref], ids=["dma-from-scratch", "dma-from-output"])
def test_a_body_that_writes_into_the_captured_ref_is_still_refused(setup, call):
    mesh, x, w = setup
    step = jax.jit(shard_map(call, mesh, (P("data"), P()), P("data")))
    with reprules.inference(), pytest.raises(reprules.MissingRuleError, match="writes into operand 1"):
        step(x, w)


# -- gradients: a custom_vjp around the kernel (Pallas has none) ---------------------


@jax.custom_vjp
def scaled(x, w):
    return reused_scratch(x, w)


def _fwd(x, w):
    return reused_scratch(x, w), (x, w)


def _bwd(res, g):
    x, w = res
    return reused_scratch(g, w), g * x  # w's cotangent varies over data: psummed over it


scaled.defvjp(_fwd, _bwd)


def _grad(mesh, t, check):
    step = shard_map(scaled, mesh, (P("data"), P()), P("data"), check=check)
    return jax.grad(lambda x, w: (step(x, w) * t).sum(), argnums=(0, 1))


def test_gradients_are_exact_with_only_the_needed_psum(setup):
    mesh, x, w = setup
    t = randn(2, (4 * R, C))
    with reprules.inference():
        on = _grad(mesh, t, check=True)
        assert psum_axes(on, x, w) == [("data",)]  # w's, and nothing over model
        assert count_all_reduce(on, x, w)[:2] == (1, 1)
        got = jax.jit(on)(x, w)
    off = jax.jit(_grad(mesh, t, check=False))(x, w)
    xn, wn, tn = np.asarray(x), np.asarray(w), np.asarray(t)
    reference = (tn * np.tile(wn, (4, 1)), (tn * xn).reshape(4, R, C).sum(0))
    for g, u, r in zip(got, off, reference):
        assert max_err(g, r) < 1e-4
        assert max_err(g, u) < 1e-4
