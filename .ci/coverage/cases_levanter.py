"""Levanter's fused cross-entropy (PyPI ``marin-levanter``), one :class:`measure.Case` each.

``levanter.kernels.pallas.fused_cross_entropy_loss``: the Pallas TPU path
(``pallas_tpu.linear_softmax_cross_entropy_loss_pallas``: a kernel for the
log-sum-exp of ``x @ w`` under a ``custom_vjp`` whose bwd is an XLA ``fori_loop``
over vocabulary blocks) and the public ``fused_cross_entropy_loss_and_logsumexp_penalty``
asking for it. Tokens over ``data`` (or over both axes), the weight replicated.
TPU interpret mode, the CPU device described as a TPU v5e, and ``jax.default_backend``
saying "tpu" (the library refuses another backend). Reference: ``jnp`` on the whole arrays.
"""

from __future__ import annotations

import contextlib

from measure import Case
from tpu_description import tpu_interpret

H, V, Z = 128, 512, 0.1  # hidden, vocabulary, the z-loss weight of the public op


@contextlib.contextmanager
def _tpu():
    from unittest import mock

    import jax

    with tpu_interpret(v5e=True), mock.patch.object(jax, "default_backend", lambda: "tpu"):
        yield


def _P(*a):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*a)


def _ce(tokens, public=False):
    def case():
        import jax
        import jax.numpy as jnp
        import numpy as np
        from levanter.kernels.pallas.fused_cross_entropy_loss import fused_cross_entropy_loss_and_logsumexp_penalty
        from levanter.kernels.pallas.fused_cross_entropy_loss.config import BlockSizes
        from levanter.kernels.pallas.fused_cross_entropy_loss.pallas_tpu import linear_softmax_cross_entropy_loss_pallas

        blocks = BlockSizes(b_block_size=128, h_block_size=128, v_block_size=128)  # multiples of 128 (TPU lanes)
        b = 128 * (8 if len(tokens) == 2 else 4)  # one block of tokens per device
        rng = np.random.RandomState(0)
        args = ((rng.randn(b, H) * 0.5).astype(np.float32), rng.randint(0, V, (b,)).astype(np.int32),
                (rng.randn(H, V) * 0.1).astype(np.float32))

        if public:
            def body(x, labels, w):
                return fused_cross_entropy_loss_and_logsumexp_penalty(
                    x, labels, w, reduction=None, logsumexp_weight=Z, block_sizes=blocks, implementation="pallas_tpu")
        else:
            def body(x, labels, w):
                return linear_softmax_cross_entropy_loss_pallas(x, labels, w, block_sizes=blocks)[0]

        def ref(x, labels, w):
            logits = x @ w
            lse = jax.nn.logsumexp(logits, -1)
            loss = lse - jnp.take_along_axis(logits, labels[:, None], 1)[:, 0]
            return loss + Z * lse**2 if public else loss

        return Case(body, args, (_P(tokens, None), _P(tokens), _P()), _P(tokens), grad_argnums=(0, 2),
                    reference=ref, context=_tpu, tol=1e-4,
                    note=f"tokens over {' and '.join(tokens)}, weight replicated"
                    + ("; reduction=None, z-loss 0.1" if public else ""))

    return case


CASES = {
    "pallas_tpu.linear_softmax_cross_entropy_loss_pallas (tokens over data)": _ce(("data",)),
    "pallas_tpu.linear_softmax_cross_entropy_loss_pallas (tokens over data, model)": _ce(("data", "model")),
    "fused_cross_entropy_loss_and_logsumexp_penalty (pallas_tpu)": _ce(("data",), public=True),
}
