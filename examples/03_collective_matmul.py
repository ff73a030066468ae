"""The shard_map tutorial's collective matmuls, with a Pallas local matmul and checking on.

The "collective matrix multiplication" section of JAX's shard_map tutorial on
8 devices (mesh axis ``i``), every local matmul done by a Pallas kernel
(``interpret=True``) that has a rule:

* all-gather then matmul; the all-gather overlapped with ``ppermute`` (one
  direction, then both directions at once on half-size blocks);
* matmul then ``psum_scatter``; the reduce-scatter overlapped with ``ppermute``
  (one direction, then both).

The local blocks are picked with ``axis_index``, so they vary over ``i``, and
``shard_map`` runs with checking on (``check_vma=True``; ``check_rep=True`` on
JAX <= 0.5). Each variant is checked against ``lhs @ rhs`` and its collectives
are counted; the script prints one line per variant and exits non-zero if a
check fails.

Run (8 fake CPU devices are set up by the script itself):

    python examples/03_collective_matmul.py
"""

from reprules import testing

testing.fake_cpu_devices(8)  # first thing: 8 fake CPU devices, before JAX starts

import sys  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import reprules  # noqa: E402

SIZE = 8  # devices on mesh axis `i`
M, K, N = 64, 128, 32  # lhs: (M, K), rhs: (K, N)


@reprules.replication_rule()  # the output varies like the union of the inputs
def matmul_kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)


def mm(a, b):
    """``a @ b`` by the Pallas kernel: every local matmul below."""
    out_shape = jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), jnp.float32)
    return pl.pallas_call(matmul_kernel, out_shape=out_shape, interpret=True)(a, b)


shift_up = partial(lax.ppermute, axis_name="i", perm=[(j, (j + 1) % SIZE) for j in range(SIZE)])
shift_dn = partial(lax.ppermute, axis_name="i", perm=[(j, (j - 1) % SIZE) for j in range(SIZE)])

# --- all-gather: lhs P('i', None), rhs P('i', None) -> out P('i', None) -----------------


def matmul_allgather(lhs_block, rhs_block):
    rhs = lax.all_gather(rhs_block, "i", tiled=True)
    return mm(lhs_block, rhs)


def matmul_allgather_overlapped(lhs_block, rhs_block):
    idx = lax.axis_index("i")
    b = lhs_block.shape[1] // SIZE
    lhs_blocks = lambda j: lax.dynamic_slice_in_dim(lhs_block, j * b, b, 1)  # noqa: E731

    out_block = mm(lhs_blocks(idx), rhs_block)
    for j in range(1, SIZE):
        rhs_block = shift_up(rhs_block)
        out_block += mm(lhs_blocks((idx - j) % SIZE), rhs_block)
    return out_block


def matmul_allgather_overlapped_bidi(lhs_block, rhs_block):
    idx = lax.axis_index("i")
    b = lhs_block.shape[1] // SIZE // 2  # half-size blocks
    lhs_blocks = lambda j, hi: lax.dynamic_slice_in_dim(lhs_block, (2 * j + hi) * b, b, 1)  # noqa: E731

    rhs_block_lo, rhs_block_hi = jnp.split(rhs_block, 2, axis=0)
    out_block = mm(lhs_blocks(idx, 0), rhs_block_lo)
    out_block += mm(lhs_blocks(idx, 1), rhs_block_hi)
    for j in range(1, SIZE):
        rhs_block_lo = shift_up(rhs_block_lo)
        rhs_block_hi = shift_dn(rhs_block_hi)
        out_block += mm(lhs_blocks((idx - j) % SIZE, 0), rhs_block_lo)
        out_block += mm(lhs_blocks((idx + j) % SIZE, 1), rhs_block_hi)
    return out_block


# --- reduce-scatter: lhs P(None, 'i'), rhs P('i', None) -> out P('i', None) -------------


def matmul_psumscatter(lhs_block, rhs_block):
    return lax.psum_scatter(mm(lhs_block, rhs_block), "i", tiled=True)


def matmul_psumscatter_overlapped(lhs_block, rhs_block):
    idx = lax.axis_index("i")
    b = lhs_block.shape[0] // SIZE
    lhs_blocks = lambda j: lax.dynamic_slice_in_dim(lhs_block, j * b, b, 0)  # noqa: E731

    out_summand = mm(lhs_blocks((idx + 1) % SIZE), rhs_block)
    for j in range(1, SIZE):
        out_summand = shift_dn(out_summand)
        out_summand += mm(lhs_blocks((idx + j + 1) % SIZE), rhs_block)
    return out_summand


def matmul_psumscatter_overlapped_bidi(lhs_block, rhs_block):
    idx = lax.axis_index("i")
    b = lhs_block.shape[0] // SIZE // 2  # half-size blocks
    lhs_blocks = lambda j, hi: lax.dynamic_slice_in_dim(lhs_block, (2 * j + hi) * b, b, 0)  # noqa: E731

    out_summand_lo = mm(lhs_blocks((idx - 1) % SIZE, 0), rhs_block)
    out_summand_hi = mm(lhs_blocks((idx + 1) % SIZE, 1), rhs_block)
    for j in range(1, SIZE):
        out_summand_lo = shift_up(out_summand_lo)
        out_summand_hi = shift_dn(out_summand_hi)
        out_summand_lo += mm(lhs_blocks((idx - j - 1) % SIZE, 0), rhs_block)
        out_summand_hi += mm(lhs_blocks((idx + j + 1) % SIZE, 1), rhs_block)
    return jnp.concatenate([out_summand_lo, out_summand_hi])


VARIANTS = (
    # name, body, lhs spec, expected (all-gather, reduce-scatter, collective-permute) counts
    ("all-gather", matmul_allgather, P("i", None), (1, 0, 0)),
    ("all-gather, overlapped", matmul_allgather_overlapped, P("i", None), (0, 0, SIZE - 1)),
    ("all-gather, bidirectional", matmul_allgather_overlapped_bidi, P("i", None), (0, 0, 2 * (SIZE - 1))),
    ("psum_scatter", matmul_psumscatter, P(None, "i"), (0, 1, 0)),
    ("psum_scatter, overlapped", matmul_psumscatter_overlapped, P(None, "i"), (0, 0, SIZE - 1)),
    ("psum_scatter, bidirectional", matmul_psumscatter_overlapped_bidi, P(None, "i"), (0, 0, 2 * (SIZE - 1))),
)


def main():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:SIZE]), ("i",))
    rng = np.random.RandomState(0)
    lhs_host, rhs_host = rng.randn(M, K).astype(np.float32), rng.randn(K, N).astype(np.float32)
    expected = lhs_host.astype(np.float64) @ rhs_host.astype(np.float64)
    rhs = jax.device_put(rhs_host, NamedSharding(mesh, P("i", None)))

    print(f"JAX {jax.__version__}, mesh ('i': {SIZE}), lhs ({M}, {K}) @ rhs ({K}, {N}), Pallas local matmul, "
          "checking on")
    print(f"{'variant':30}{'all-gather':>11}{'reduce-scatter':>15}{'ppermute':>9}{'all-reduce':>11}"
          f"{'max |out - lhs @ rhs|':>23}")
    failed = []
    for name, body, lhs_spec, want in VARIANTS:
        lhs = jax.device_put(lhs_host, NamedSharding(mesh, lhs_spec))
        f = jax.jit(testing.shard_map(body, mesh, in_specs=(lhs_spec, P("i", None)), out_specs=P("i", None)))
        error = float(np.max(np.abs(np.asarray(f(lhs, rhs), np.float64) - expected)))
        report = testing.collectives(f, lhs, rhs)
        got = tuple(report.count(kind, level="jaxpr") for kind in ("all-gather", "reduce-scatter",
                                                                   "collective-permute"))
        all_reduce = report.count("all-reduce")
        print(f"{name:30}{got[0]:>11}{got[1]:>15}{got[2]:>9}{all_reduce:>11}{error:>23.1e}")
        if error > 1e-3 or got != want or all_reduce:
            failed.append(name)
    if failed:
        print("FAILED: " + "; ".join(failed))
        sys.exit(1)
    print("OK: every variant equals lhs @ rhs")


if __name__ == "__main__":
    main()
