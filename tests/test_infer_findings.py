"""Findings of issue 30 under ``reprules.inference()``: a ``Ref`` operand of
``pl.kernel``, and the state a failed trace must not leave behind.

* ``pl.kernel(body, ...)(x, jax.new_ref(w))``: on JAX 0.8 - 0.9, ``pl.kernel``
  is a ``jax.jit`` closure that wraps each operand in ``new_ref``, and reprules'
  hook on ``new_ref`` cast each operand up as the derived rule said, a
  ``pvary`` on a ``Ref`` (``TypeError: AbstractRef.update() got an unexpected
  keyword argument 'sharding'`` on 0.8.3). A Ref keeps the type JAX gave it.
* One failed program must not change how the next one is judged. reprules
  carries which out_shape leaves were left unannotated from JAX's conversion
  of them to the ``pallas_call`` bind of the same call; a call that raised in
  between (a ``Ref`` operand JAX rejects, a kernel that fails to trace) left
  its types behind, and JAX interns types: a later call's *annotated*
  replicated out_shape was then taken as unannotated and typed by the rule,
  so reprules' refusal of the false annotation became JAX's out_specs error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from helpers import NEW_SHARD_MAP, max_err, put, randn, shard_map
from test_pl_kernel import _tpu_interpret  # noqa: F401 - autouse fixture: pl.kernel runs in TPU interpret mode
from test_pl_kernel import CAN_INTERPRET, HAS_KERNEL, pltpu, sds, tc_mesh

HAS_NEW_REF = hasattr(jax, "new_ref")  # 0.7+


# --- a Ref passed to pl.kernel ---------------------------------------------------------


def mul_by_ref(x, w):
    """``x * w`` by a ``pl.kernel`` given ``w`` as a Ref made by the caller."""

    def body(x_ref, w_ref, o_ref):
        def scoped(xb, wb):
            pltpu.sync_copy(x_ref, xb)
            pltpu.sync_copy(w_ref, wb)
            xb[...] = xb[...] * wb[...]
            pltpu.sync_copy(xb, o_ref)

        pl.run_scoped(scoped, pltpu.VMEM(x_ref.shape, x_ref.dtype), pltpu.VMEM(w_ref.shape, w_ref.dtype))

    return pl.kernel(body, sds(x), mesh=tc_mesh())(x, jax.new_ref(w))


@pytest.mark.skipif(not (HAS_KERNEL and CAN_INTERPRET and HAS_NEW_REF),
                    reason=f"JAX {jax.__version__} has no pl.kernel (added in JAX 0.8)")
def test_a_ref_operand_of_pl_kernel_runs_and_is_exact(mesh):
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    w = put(randn(1, (2, 128)), mesh, P())
    specs = ((P("data", None), P()), P("data", None))
    unchecked = jax.jit(shard_map(mul_by_ref, mesh, *specs, check=False))(x, w)
    with reprules.inference():
        got = jax.jit(shard_map(mul_by_ref, mesh, *specs))(x, w)
        # The output depends on x: typed varying over data when traced, so P() is refused.
        with pytest.raises(ValueError, match="out_specs"):
            jax.make_jaxpr(shard_map(mul_by_ref, mesh, specs[0], P()))(x, w)
    expected = np.asarray(x) * np.tile(np.asarray(w), (4, 1))  # unsharded
    assert max_err(got, expected) == 0.0
    assert max_err(got, unchecked) == 0.0


# --- a failed trace, then a refusal ----------------------------------------------------


def replicated_claim(x):
    """Doubles ``x`` but annotates its out_shape replicated: refused under inference."""

    def claim_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    if hasattr(jax.ShapeDtypeStruct((1,), jnp.float32), "manual_axis_type"):  # 0.10+
        out = jax.ShapeDtypeStruct(
            x.shape, x.dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=frozenset())
        )
    else:  # 0.6 - 0.9
        out = jax.ShapeDtypeStruct(x.shape, x.dtype, vma=frozenset())
    return pl.pallas_call(claim_kernel, out_shape=out, interpret=True)(x)


def ref_operand(x, w):
    """JAX rejects a Ref as a pallas_call operand, after it converted the out_shape."""

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = x_ref[...] * w_ref[...]

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(
        x, jax.new_ref(w)
    )


class Boom(Exception):
    pass


def failing_kernel(x, w):
    """A kernel that raises while JAX traces it (after the out_shape conversion)."""

    def kernel(x_ref, w_ref, o_ref):
        raise Boom("the kernel failed to trace")

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, w)


FAILURES = {
    "ref_operand": (ref_operand, (TypeError, ValueError)),
    "kernel_raises": (failing_kernel, Boom),
}


@pytest.mark.skipif(not NEW_SHARD_MAP, reason=f"JAX {jax.__version__}: out_shape carries no varying axes "
                    "before JAX 0.6 (check_vma), so there is no annotation to refuse")
@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_failed_program_leaves_no_state_for_the_next(mesh, failure):
    program, raised = FAILURES[failure]
    if failure == "ref_operand" and not HAS_NEW_REF:
        pytest.skip(f"JAX {jax.__version__} has no jax.new_ref (added in JAX 0.7)")
    # Same shapes and dtype in both programs: JAX interns their output types.
    x = put(randn(0, (8, 16)), mesh, P("data", None))
    w = put(randn(1, (2, 16)), mesh, P())
    with reprules.inference():
        with pytest.raises(raised):
            jax.jit(shard_map(program, mesh, (P("data", None), P()), P("data", None)))(x, w)
        with reprules.strict(), pytest.raises(reprules.RuleError) as refused:  # strict: refused, not widened
            jax.jit(shard_map(replicated_claim, mesh, P("data", None), P()))(x)
    message = str(refused.value)
    assert message.startswith(
        "The out_shape of Pallas kernel 'claim_kernel' annotates output 0 as replicated over {'data'}, "
        "but its body (analysed by reprules.inference()) makes it depend on inputs that vary over "
        f"{{'data'}} (mesh axes {{'data', 'model'}}, JAX {jax.__version__})"
    ), message
    assert "\nFix: annotate the output as varying over {'data'}" in message
