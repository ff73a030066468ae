"""Levanter's fused cross-entropy (PyPI ``marin-levanter``) under checking, on CPU.

``levanter.kernels.pallas.fused_cross_entropy_loss.pallas_tpu``'s
``linear_softmax_cross_entropy_loss_pallas``: a Pallas TPU kernel for the
log-sum-exp of ``x @ w`` (its out_shape unannotated: reprules derives its rule
from its body, no pack needed) under a ``custom_vjp`` whose bwd is plain XLA, a
``fori_loop`` over vocabulary blocks that accumulates ``dw`` from ``jnp.zeros``
(replicated) with values varying over the batch axes. Inside ``shard_map`` on the
(4, 2) ("data", "model") mesh, tokens over ``data`` (or over both axes), the
weight replicated, with checking on, in TPU interpret mode (the library refuses
a backend that is not TPU, so ``jax.default_backend`` is made to say "tpu"):

* JAX alone refuses the forward (the kernel's out_shape has no varying axes);
  reprules types it, widens the bwd loop's carry (it starts replicated and meets
  varying values: JAX's carry type check), proves the weight cotangent a
  per-device partial sum (the loop followed to a fixed point; before, the loop
  was judged as one equation and the cotangent refused) and psums it;
* forward and gradients equal checking off and a plain ``jnp`` reference, and the
  checked gradient has no defensive all-reduce.
"""

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import max_err, psum_axes, put, randn, shard_map
from jax.sharding import PartitionSpec as P

from reprules import testing

lce = pytest.importorskip(
    "levanter.kernels.pallas.fused_cross_entropy_loss.pallas_tpu",
    reason="levanter is not installed. To run these tests: pip install --no-deps marin-levanter marin-haliax "
    "marin-rigging marin-finestore (one version), then what its fused cross-entropy imports (noxfile.py's "
    "LEVANTER and LEVANTER_IMPORTS, as the coverage session installs them)",
)
from levanter.kernels.pallas.fused_cross_entropy_loss.config import BlockSizes  # noqa: E402

H, V = 128, 512
BLOCKS = BlockSizes(b_block_size=128, h_block_size=128, v_block_size=128)  # multiples of 128 (TPU lanes)


@contextlib.contextmanager
def _tpu_on_cpu():
    with testing.tpu_on_cpu("v5e"), mock.patch.object(jax, "default_backend", lambda: "tpu"):
        yield


def _loss(x, labels, w):
    return lce.linear_softmax_cross_entropy_loss_pallas(x, labels, w, block_sizes=BLOCKS)[0]


def _reference(x, labels, w):
    logits = x @ w
    return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[:, None], 1)[:, 0]


@pytest.mark.parametrize("tokens", [("data",), ("data", "model")], ids=["data", "data+model"])
def test_fused_cross_entropy_forward_and_gradients_are_exact(mesh, tokens):
    b = 128 * int(np.prod([mesh.shape[a] for a in tokens]))  # one block of tokens per device
    rng = np.random.RandomState(0)
    args = (randn(0, (b, H)) * 0.5, jnp.asarray(rng.randint(0, V, (b,)), jnp.int32), randn(1, (H, V)) * 0.1)
    specs = (P(tokens, None), P(tokens), P())
    sharded = [put(v, mesh, s) for v, s in zip(args, specs)]
    t = randn(9, (b,))

    def step(f):
        grad = jax.grad(lambda x, labels, w: (f(x, labels, w) * t).sum(), argnums=(0, 2))
        return grad, jax.jit(lambda *v: (f(*v), grad(*v)))

    with _tpu_on_cpu():
        grad_on, on = step(shard_map(_loss, mesh, specs, P(tokens)))
        _, off = step(shard_map(_loss, mesh, specs, P(tokens), check=False))
        (out_on, g_on), (out_off, g_off) = on(*sharded), off(*sharded)
        report = testing.collectives(grad_on, *sharded)
        psums = psum_axes(grad_on, *sharded)
    out_ref, g_ref = step(_reference)[1](*args)
    assert max_err(out_on, out_off) == 0.0
    assert max_err(g_on, g_off) < 1e-6
    assert max_err(out_on, out_ref) < 1e-4
    assert max_err(g_on, g_ref) / max(float(jnp.abs(g).max()) for g in g_ref) < 1e-5
    assert report.count("all-reduce", defensive=True) == 0
    assert psums == [tuple(sorted(tokens))]  # the weight gradient's, over the token axes only
