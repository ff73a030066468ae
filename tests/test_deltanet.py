"""deltanet-tpu 0.3.0's chunked Gated DeltaNet under checking, on CPU, on JAX 0.11.2.

``deltanet_tpu.chunk_gdn`` (scalar decay per head, one gate) and ``chunk_gdn2``
(decay, erase and write gates per channel): Pallas kernels for the forward and,
under a ``custom_vjp``, the backward (a prepass per chunk and a scan over chunks),
their out_shapes unannotated: reprules derives each kernel's rule from its body, no
pack needed. Inside ``shard_map`` on the (4, 2) ("data", "model") mesh, batch over
``data``, heads over ``model``, two chunks of 128 tokens, with checking on; the
library runs its kernels with ``interpret=True`` on a backend that is not TPU:

* forward and gradients (every input) equal checking off and the library's
  token-serial reference, and the checked gradient has no defensive all-reduce
  (nothing is replicated: no psum at all, as with checking off).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import max_err, psum_axes, put, randn, shard_map
from jax.sharding import PartitionSpec as P

from reprules import testing

deltanet_tpu = pytest.importorskip(
    "deltanet_tpu",
    reason="deltanet-tpu is not installed. To run these tests (JAX 0.11.2, Python 3.12): pip install "
    "deltanet-tpu==0.3.0 jax==0.11.2 jaxlib==0.11.2 (noxfile.py's DELTANET, as the coverage_pinned session "
    "installs it)",
)
from deltanet_tpu import reference  # noqa: E402

# The library warns, once, that off TPU its kernels run in interpret mode: what these tests ask for.
pytestmark = pytest.mark.filterwarnings("ignore:deltanet-tpu. running on non-TPU backend:UserWarning")
B, L, H, D = 4, 256, 2, 128  # head dims of 128 and chunks of 128 tokens: what the kernels take
HEADS = P("data", None, "model", None)


def _inputs(version):
    rng = np.random.RandomState(0)
    gate = (B, L, H) if version == 1 else (B, L, H, D)  # per head, or per channel
    g = -jnp.asarray(0.02 + 0.1 * rng.rand(*gate), jnp.float32)  # log decay, <= 0
    gates = [jnp.asarray(rng.rand(*gate), jnp.float32) for _ in range(version)]  # beta; or erase b, write w
    return (randn(1, (B, L, H, D)), randn(2, (B, L, H, D)), randn(3, (B, L, H, D)), g, *gates)


@pytest.mark.parametrize("version", [1, 2], ids=["chunk_gdn", "chunk_gdn2"])
def test_forward_and_gradients_are_exact(mesh, version):
    if version == 1:
        def op(*a):
            return deltanet_tpu.chunk_gdn(*a, precision="fp32", qk_l2norm=True)

        def ref(*a):
            return reference.reference_gdn(*a, qk_l2norm=True)
    else:
        def op(*a):
            return deltanet_tpu.chunk_gdn2(*a, precision="fp32", qk_l2norm=True)

        def ref(*a):
            return reference.token_serial_gdn2(*a, qk_l2norm=True)

    args = _inputs(version)
    specs = tuple(HEADS if a.ndim == 4 else P("data", None, "model") for a in args)
    sharded = [put(v, mesh, s) for v, s in zip(args, specs)]
    t = randn(9, (B, L, H, D))
    argnums = tuple(range(len(args)))

    def step(f):
        grad = jax.grad(lambda *v: (f(*v) * t).sum(), argnums=argnums)
        return grad, jax.jit(lambda *v: (f(*v), grad(*v)))

    grad_on, on = step(shard_map(op, mesh, specs, HEADS))
    grad_off, off = step(shard_map(op, mesh, specs, HEADS, check=False))
    (out_on, g_on), (out_off, g_off) = on(*sharded), off(*sharded)
    out_ref, g_ref = step(ref)[1](*args)
    report = testing.collectives(grad_on, *sharded)
    assert max_err(out_on, out_off) == 0.0
    assert max_err(g_on, g_off) == 0.0
    assert max_err(out_on, out_ref) / float(jnp.abs(out_ref).max()) < 1e-4
    for got, want in zip(g_on, g_ref):
        assert max_err(got, want) / float(jnp.abs(want).max()) < 1e-4
    assert report.count("all-reduce", defensive=True) == 0
    assert psum_axes(grad_on, *sharded) == psum_axes(grad_off, *sharded) == []
