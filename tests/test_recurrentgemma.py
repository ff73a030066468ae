"""recurrentgemma 1.0.1's Pallas LRU scan through reprules' recurrentgemma pack, on CPU.

``recurrentgemma.jax.pallas.lru_pallas_scan`` (what ``scan.linear_scan`` runs with
``ScanType.LINEAR_PALLAS``) inside ``shard_map`` on the (4, 2) ("data", "model")
mesh, batch over ``data``, with checking on, run by Pallas' HLO interpreter
(``pltpu.force_tpu_interpret_mode(True)``: ``interpret=True`` for every call; the kernel
uses nothing TPU-specific, and TPU interpret mode's simulation across devices can
deadlock against XLA's CPU collectives, checking off too):

* the sequence over ``model`` (``seq_axis="model"``: each device scans its chunk,
  then ``multi_shard_correction`` all-gathers the chunks' last states), with and
  without an initial state ``h0`` (replicated over ``model``), forward and
  reverse; or the width over ``model`` (no sequence sharding);
* forward and gradients equal checking off and an unsharded reference (the
  library's own ``lru_linear_scan``), and the checked gradient has no defensive
  all-reduce. The ``h0`` cotangent, masked by the library's bwd to the device
  holding the first chunk, gets exactly the psum over ``model`` that checking
  off computes; before, reprules refused it (a ``CotangentError``);
* the final state, the same on every device along ``model``, is typed varying
  by JAX (an ``all_gather``): out_specs replicated over ``model`` are refused by
  JAX; one device's copy, psummed, is exact, gradient included.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import max_err, psum_axes, put, randn, shard_map
from jax.sharding import PartitionSpec as P

import reprules
from reprules import rules, testing

rg_pallas = pytest.importorskip(
    "recurrentgemma.jax.pallas",
    reason="recurrentgemma is not installed. To run these tests: pip install --no-deps recurrentgemma==1.0.1, "
    "then absl-py einops flax jaxtyping orbax-checkpoint sentencepiece 'typeguard<3' (noxfile.py's "
    "RECURRENTGEMMA and RECURRENTGEMMA_IMPORTS, as the coverage session installs them)",
)
from recurrentgemma.jax import scan as rg_scan  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

B, T, D = 8, 64, 128  # the kernel wants a width that is a multiple of 128 on each device
SEQ = P("data", "model", None)  # the sequence over 'model'
WIDTH = P("data", None, "model")  # the width over 'model'


@pytest.fixture(autouse=True)
def pack():
    """The pack's registration, as on ``import recurrentgemma.jax.pallas``."""
    from reprules._builtin_packs import recurrentgemma as pack

    pack.recurrentgemma(rg_pallas)


def _inputs(d=D):
    x = randn(0, (B, T, d))
    a = jnp.asarray(0.5 + 0.5 * np.random.RandomState(1).rand(B, T, d), jnp.float32)
    return x, a, randn(2, (B, d))


def _scan(layout, reverse, with_h0):
    seq_axis = "model" if layout == "seq" else None

    def body(x, a, h0):
        return rg_pallas.lru_pallas_scan(x, a, h0 if with_h0 else None, reverse=reverse, seq_axis=seq_axis,
                                         min_seq_block_size=8)[0]

    def reference(x, a, h0):
        return rg_scan.lru_linear_scan(x, a, h0 if with_h0 else None, reverse=reverse)[0]

    return body, reference


@pytest.mark.parametrize(("layout", "reverse", "with_h0"), [
    ("seq", False, True), ("seq", True, True), ("seq", False, False), ("width", False, True),
], ids=["seq-h0", "seq-h0-reverse", "seq-no-h0", "width-h0"])
def test_lru_scan_forward_and_gradients_are_exact(mesh, layout, reverse, with_h0):
    body, reference = _scan(layout, reverse, with_h0)
    spec = SEQ if layout == "seq" else WIDTH
    specs = (spec, spec, P("data", None) if layout == "seq" else P("data", "model"))
    args = _inputs(D if layout == "seq" else 2 * D)
    sharded = [put(v, mesh, s) for v, s in zip(args, specs)]
    t = randn(9, args[0].shape)
    argnums = (0, 1, 2) if with_h0 else (0, 1)

    def step(f):
        grad = jax.grad(lambda *v: (f(*v) * t).sum(), argnums=argnums)
        return grad, jax.jit(lambda *v: (f(*v), grad(*v)))

    with pltpu.force_tpu_interpret_mode(True):
        grad_on, on = step(shard_map(body, mesh, specs, spec))
        grad_off, off = step(shard_map(body, mesh, specs, spec, check=False))
        (out_on, g_on), (out_off, g_off) = on(*sharded), off(*sharded)
        out_ref, g_ref = step(reference)[1](*args)
        report = testing.collectives(grad_on, *sharded)
        psums_on, psums_off = psum_axes(grad_on, *sharded), psum_axes(grad_off, *sharded)
    assert max_err(out_on, out_off) == 0.0
    assert max_err(g_on, g_off) == 0.0
    assert max_err(out_on, out_ref) < 1e-5
    assert max_err(g_on, g_ref) / max(float(jnp.abs(g).max()) for g in g_ref) < 1e-5
    assert report.count("all-reduce", defensive=True) == 0
    assert psums_on == psums_off
    if layout == "seq" and with_h0:
        # the bwd's own psum of dh_last, and the h0 cotangent's (JAX's transpose with checking off)
        assert psums_on == [("model",), ("model",)]


def _final_state(take_one):
    def body(x, a, h0):
        y, h_last = rg_pallas.lru_pallas_scan(x, a, h0, seq_axis="model", min_seq_block_size=8)
        if take_one:  # one device's copy (all are equal), summed: typed replicated over 'model'
            last = jax.lax.axis_index("model") == jax.lax.axis_size("model") - 1
            h_last = jax.lax.psum(jnp.where(last, h_last, 0.0), "model")
        return y, h_last

    return body


def test_the_final_state_replicated_is_refused_by_jax_and_one_copy_is_exact(mesh):
    """The library's own shard_map (check_rep=False) returns h_last with out_specs
    replicated over the sequence axis; with checking on JAX refuses that, as its
    all_gather types it varying. Taking one device's copy is exact, the bwd's psum of
    dh_last included (each device's h_last depends on every chunk)."""
    args = _inputs()
    specs = (SEQ, SEQ, P("data", None))
    sharded = [put(v, mesh, s) for v, s in zip(args, specs)]
    outs = (SEQ, P("data", None))
    ty, th = randn(9, (B, T, D)), randn(10, (B, D))

    def loss(f):
        return lambda *v: (f(*v)[0] * ty).sum() + (f(*v)[1] * th).sum()

    def reference(x, a, h0):
        return rg_scan.lru_linear_scan(x, a, h0)

    with pltpu.force_tpu_interpret_mode(True):
        with pytest.raises(ValueError, match="out_specs"):
            jax.jit(shard_map(_final_state(False), mesh, specs, outs))(*sharded)
        on = shard_map(_final_state(True), mesh, specs, outs)
        off = shard_map(_final_state(False), mesh, specs, outs, check=False)
        got = jax.jit(on)(*sharded), jax.jit(jax.grad(loss(on), argnums=(0, 1, 2)))(*sharded)
        unchecked = jax.jit(off)(*sharded), jax.jit(jax.grad(loss(off), argnums=(0, 1, 2)))(*sharded)
        want = jax.jit(reference)(*args), jax.jit(jax.grad(loss(reference), argnums=(0, 1, 2)))(*args)
    assert max_err(got, unchecked) < 1e-5
    assert max_err(got[0], want[0]) < 1e-5
    assert max_err(got[1], want[1]) / max(float(jnp.abs(g).max()) for g in want[1]) < 1e-5


def test_the_pack_loads_on_import():
    """In a fresh interpreter: ``import recurrentgemma.jax.pallas`` loads the pack,
    which gives the scan kernel rules.same()."""
    import subprocess
    import sys

    code = ("import reprules\n"
            "import recurrentgemma.jax.pallas\n"
            "print([(s.name, s.state) for s in reprules.packs() if s.module == 'recurrentgemma.jax.pallas'])\n"
            "print(reprules.registered()['recurrentgemma.jax.pallas.linear_rnn_pallas_kernel'].rule)")
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines == [str([("reprules._builtin_packs.recurrentgemma:recurrentgemma", "loaded")]), repr(rules.same())]
    assert reprules.registered()  # this process: the fixture's registration
