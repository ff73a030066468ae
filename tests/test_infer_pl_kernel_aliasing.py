"""``reprules.inference()`` and aliasing in the ``pl.kernel`` family (``for_kernel_bodies``).

An input aliased to an output is the output's buffer: a write through the
input ref reaches the output (tests/test_inference.py checks this for
``pallas_call``). ``pl.kernel`` passes no ``input_output_aliases`` on any
JAX, but the one public program that gives inference an aliased kernel is a
``pl.core_map`` over refs the caller made with ``jax.new_ref``: JAX
discharges its ``core_map`` when the program is lowered, still inside the
checked ``shard_map``, into a kernel that aliases each ref it writes to an
output. On 0.9 and 0.10 that is an ``mpmd_map`` built by ``mpmd._mpmd_map``
(derived by ``infer.for_kernel_bodies``; on 0.9 reprules checks it as JAX
re-binds it, under inference only); on 0.8 a ``pallas_call`` (derived by
``infer.for_pallas_call``). The discharged body writes through the aliased
*input* ref and never touches its output ref, so the output depends on what
was written only through the alias.

JAX types a ``core_map``'s refs by the values they were made from and does
not check what its body writes into them: a body adding ``x`` (varying over
``data``) into a ref made from a replicated ``w`` leaves the ref typed
replicated, and JAX alone accepts ``out_specs=P()`` and returns device 0's
sum. With the alias, inference sees the output depend on ``x`` and refuses
the discharged kernel's replicated out type when the program is compiled.

JAX 0.11+ bind ``mpmd_map`` with no aliases and refuse refs varying over
manual axes, so no public path reaches aliasing there.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from helpers import JAX_VERSION, max_err, put, randn, shard_map
from test_pl_kernel import _tpu_interpret  # noqa: F401 - autouse fixture: pl.kernel runs in TPU interpret mode
from test_pl_kernel import CAN_INTERPRET, HAS_KERNEL, core_map, pltpu, tc_mesh


def _why_not() -> str | None:
    """Why this JAX gives inference no aliased ``pl.kernel``-family call (None: it does)."""
    version = jax.__version__
    if not (HAS_KERNEL and CAN_INTERPRET) or core_map is None:
        return f"JAX {version} has no pl.kernel (added in JAX 0.8)"
    if JAX_VERSION[:2] >= (0, 11):
        return (f"JAX {version}: pl.kernel and pl.core_map bind mpmd_map with no input_output_aliases "
                "(JAX's discharge re-binds it), and mpmd_map refuses refs varying over manual axes: "
                "no public path gives inference an aliased kernel")
    return None  # 0.8: discharged into a pallas_call; 0.9 - 0.10: into an mpmd_map from mpmd._mpmd_map


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


def add_into(w_ref, x_ref):
    """``w += x`` through VMEM: a write through the ref the caller reads back."""

    def scoped(xb, wb):
        pltpu.sync_copy(x_ref, xb)
        pltpu.sync_copy(w_ref, wb)
        wb[...] = wb[...] + xb[...]
        pltpu.sync_copy(wb, w_ref)

    pl.run_scoped(scoped, pltpu.VMEM(x_ref.shape, x_ref.dtype), pltpu.VMEM(w_ref.shape, w_ref.dtype))


def varying(aval):
    """The mesh axes a type varies over (``.vma`` to 0.9, ``.mat.varying`` from 0.10)."""
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else aval.vma)


def accumulator(seen, cast_up):
    """``w + x`` per shard: a ``pl.core_map`` adds ``x`` into a ref made from ``w``
    (cast up to vary over ``data`` first if ``cast_up``); records the result's type."""

    def accumulate(x, w):
        x_ref = jax.new_ref(x)
        w_ref = jax.new_ref(jax.lax.pcast(w, ("data",), to="varying") if cast_up else w)

        @core_map(tc_mesh())
        def add_x():
            add_into(w_ref, x_ref)

        out = w_ref[...]
        seen.append(varying(jax.typeof(out)))
        return out

    return accumulate


def test_a_write_through_the_aliased_ref_is_refused_into_a_replicated_output(mesh):
    """The discharged kernel's output is typed replicated (as JAX typed ``w``'s ref),
    but the body wrote ``x`` into it through the aliased input ref: refused. Without
    the alias the output ref looks untouched, and the per-device sums would pass as
    replicated, as they do with JAX alone."""
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    w = put(randn(1, (2, 128)), mesh, P())
    seen = []
    f = shard_map(accumulator(seen, cast_up=False), mesh, (P("data", None), P()), P())

    alone = jax.jit(f)(x, w)  # JAX alone: typed replicated, device 0's sum returned
    assert seen == [frozenset()]
    assert alone.shape == (2, 128)
    assert max_err(alone, np.asarray(w) + np.asarray(x)[:2]) == 0.0
    assert max_err(alone, np.asarray(w) + np.asarray(x)[2:4]) > 0.0  # other shards differ

    with reprules.inference():
        jax.make_jaxpr(f)(x, w)  # traced as JAX types it: the core_map is discharged when lowered
        with pytest.raises(reprules.RuleError) as refused:
            jax.jit(f)(x, w)
    # Named by the user's body (not JAX's discharge wrapper), and about the ref, not an out_shape.
    assert re.match(
        r"(?s)Output 0 of (Pallas kernel|pl\.kernel \(or pl\.core_map\) body) 'add_x' is the buffer of "
        r"its input 1 .* replicated over \{'data'\}; but its body .* writes into it values that vary over "
        rf"\{{'data'\}} \(mesh axes \{{'data', 'model'\}}, JAX {re.escape(jax.__version__)}\)\.\n"
        r"Why: .*\nFix: cast the array behind input 1 up before the kernel \(before jax\.new_ref, .*"
        r"jax\.lax\.pcast\(w, \('data',\), to='varying'\)",
        str(refused.value),
    ), str(refused.value)


def test_a_write_through_the_aliased_ref_cast_up_runs_exactly(mesh):
    """The same program with ``w`` cast up to vary over ``data`` first: the analysis
    through the alias agrees with JAX's type, and the values are exact."""
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    w = put(randn(1, (2, 128)), mesh, P())
    seen = []
    f = shard_map(accumulator(seen, cast_up=True), mesh, (P("data", None), P()), P("data", None))
    with reprules.inference():
        got = jax.jit(f)(x, w)
        with pytest.raises(ValueError, match="out_specs"):  # varies over data: not claimed replicated
            jax.jit(shard_map(accumulator([], cast_up=True), mesh, (P("data", None), P()), P()))(x, w)
    assert seen == [frozenset({"data"})]
    expected = np.tile(np.asarray(w), (4, 1)) + np.asarray(x)  # unsharded: w + x, per data shard
    assert max_err(got, expected) == 0.0
