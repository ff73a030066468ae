"""ejkernel's Pallas TPU ops (``ejkernel.kernels._pallas.tpu``), one :class:`measure.Case` each.

Tokens / batch on ``data``, heads (and the page pool's kv heads) on ``model``, weights
replicated; the ``[vocab_parallel]`` rows put the vocabulary on ``model``
(``vocab_parallel_axis="model"``). TPU interpret mode throughout. Shapes follow
tests/test_ejkernel.py.
"""

from __future__ import annotations

import functools

from measure import Case
from tpu_description import tpu_interpret


def _ek():
    import ejkernel.kernels._pallas.tpu as ek

    return ek


def _rn(seed, shape, scale=1.0):
    import numpy as np

    return (np.random.RandomState(seed).randn(*shape) * scale).astype(np.float32)


def _P(*a):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*a)


INTERPRET = tpu_interpret
V5E = functools.partial(tpu_interpret, v5e=True)


def _gmm(name, v5e=False):
    def case():
        import jax.numpy as jnp
        import numpy as np

        op = getattr(_ek(), name)
        sizes = np.array([48, 80], np.int32)  # two groups in each data shard's 128 rows
        f = lambda lhs, rhs, s: op(lhs, rhs, s, interpret=True)  # noqa: E731
        ref = lambda lhs, rhs, s: jnp.concatenate([f(c, rhs, s) for c in jnp.split(lhs, 4)])  # noqa: E731
        return Case(f, (_rn(0, (512, 128)), _rn(1, (2, 128, 128), 0.1), sizes), (_P("data", None), _P(), _P()),
                    _P("data", None), grad_argnums=(0, 1), reference=ref, context=V5E if v5e else INTERPRET,
                    note="weight replicated" + ("; a TPU v5e description for the CPU device" if v5e else ""))
    return case


def _loss(name, vocab_parallel):
    def case():
        import numpy as np

        ek = _ek()
        T, V = 64, 256
        kw = {"vocab_parallel_axis": "model"} if vocab_parallel else {}
        logits = _rn(0, (T, V))
        if name == "fused_cross_entropy":
            other = np.random.RandomState(1).randint(0, V, (T,)).astype(np.int32)
            op = lambda kw: lambda a, b: ek.fused_cross_entropy(a, b, reduction="none", **kw)[0]  # noqa: E731
            other_spec = _P("data")
        else:
            other = _rn(1, (T, V))
            op = lambda kw: lambda a, b: ek.fused_kl_divergence(a, b, reduction="none", **kw)  # noqa: E731
            other_spec = _P("data", "model") if vocab_parallel else _P("data", None)
        spec = _P("data", "model") if vocab_parallel else _P("data", None)
        return Case(op(kw), (logits, other), (spec, other_spec), _P("data"), grad_argnums=(0,), reference=op({}),
                    context=INTERPRET, tol=1e-5,
                    note="vocabulary over model" if vocab_parallel else "vocabulary whole on each device")
    return case


def flash_attention():
    spec = _P("data", None, "model", None)
    return Case(lambda q, k, v: _ek().flash_attention(q, k, v, causal=True),
                tuple(_rn(i, (4, 128, 2, 128)) for i in range(3)), (spec,) * 3, spec, grad_argnums=(0, 1, 2),
                context=INTERPRET, tol=1e-4)


def blocksparse_attention():
    spec = _P("data", "model", None, None)
    return Case(lambda q, k, v: _ek().blocksparse_attention(q, k, v, causal=True),
                tuple(_rn(i, (4, 2, 128, 128)) for i in range(3)), (spec,) * 3, spec, grad_argnums=(0, 1, 2),
                context=INTERPRET, tol=1e-4)


def ring_attention():
    import jax

    spec = _P("data", "model", None, None)  # sequence over model: the ring
    return Case(lambda q, k, v: _ek().ring_attention(q, k, v, axis_name="model"),
                tuple(_rn(i, (4, 256, 2, 128)) for i in range(3)), (spec,) * 3, spec, grad_argnums=(0, 1, 2),
                reference=lambda q, k, v: _ek().ring_attention(q, k, v), context=INTERPRET, tol=1e-4,
                note="sequence over model, the ring's axis; communicates")


def all_gather_matmul():
    return Case(lambda x, y: _ek().all_gather_matmul(x, y, "model"), (_rn(0, (256, 128)), _rn(1, (128, 256))),
                (_P("model", None), _P(None, "model")), _P(None, "model"), grad_argnums=(0, 1),
                reference=lambda x, y: x @ y, context=INTERPRET, tol=1e-4,
                note="x rows over model, gathered by the kernel (remote DMA); communicates")


def ragged_decode_attention():
    import jax.numpy as jnp
    import numpy as np

    B, S, H, D = 4, 256, 2, 128
    start, end = np.zeros(B, np.int32), np.array([100, 256, 17, 200], np.int32)
    f = lambda q, k, v, s, e: _ek().ragged_decode_attention(q, k, v, s, e)  # noqa: E731
    kv = _P("data", None, "model", None)
    return Case(f, (_rn(0, (B, H, D)), _rn(1, (B, S, H, D)), _rn(2, (B, S, H, D)), start, end),
                (_P("data", "model", None), kv, kv, _P("data"), _P("data")), _P("data", "model", None),
                reference=lambda *a: jnp.concatenate([f(*(x[i:i + 1] for x in a)) for i in range(B)]),
                context=INTERPRET, note="no VJP; reference: the op per batch element (whole batch: see Δ)")


def page_attention():
    import numpy as np

    B, H, D, KVH, PAGES, PS, MAXB = 4, 2, 128, 2, 16, 16, 4
    tables = np.arange(B * MAXB, dtype=np.int32).reshape(B, MAXB) % PAGES
    return Case(lambda q, kc, vc, n, t: _ek().page_attention(q, kc, vc, n, t),
                (_rn(0, (B, H, D)), _rn(1, (KVH, PAGES, PS, D)), _rn(2, (KVH, PAGES, PS, D)),
                 np.array([10, 64, 33, 50], np.int32), tables),
                (_P("data", "model", None), _P("model"), _P("model"), _P("data"), _P("data", None)),
                _P("data", "model", None), context=INTERPRET, note="kv heads of the page pool over model; no VJP")


def gated_delta_rule_decode():
    B, H, D = 4, 2, 128
    spec, s3, state = _P("data", None, "model", None), _P("data", None, "model"), _P("data", "model", None, None)
    import numpy as np

    beta = (1 / (1 + np.exp(-_rn(3, (B, 1, H))))).astype(np.float32)
    return Case(lambda q, k, v, b, d, h: _ek().gated_delta_rule(q, k, v, b, d, initial_state=h),
                (_rn(0, (B, 1, H, D)), _rn(1, (B, 1, H, D)), _rn(2, (B, 1, H, D)), beta,
                 -np.abs(_rn(4, (B, 1, H), 0.1)), _rn(5, (B, H, D, D), 0.1)),
                (spec, spec, spec, s3, s3, state), (spec, state), context=INTERPRET,
                note="one token with a state: the Pallas decode kernel; no VJP")


def gated_delta_rule():
    import numpy as np

    B, S, H, D = 4, 64, 2, 128
    spec, s3 = _P("data", None, "model", None), _P("data", None, "model")
    beta = (1 / (1 + np.exp(-_rn(3, (B, S, H))))).astype(np.float32)
    return Case(lambda q, k, v, b, d: _ek().gated_delta_rule(q, k, v, b, d, chunk_size=64)[0],
                (_rn(0, (B, S, H, D)), _rn(1, (B, S, H, D)), _rn(2, (B, S, H, D)), beta, -np.abs(_rn(4, (B, S, H), 0.1))),
                (spec, spec, spec, s3, s3), spec, grad_argnums=(0, 1, 2, 3, 4), context=INTERPRET, tol=1e-4,
                note="many tokens: ejkernel's XLA scan, no Pallas kernel")


CASES = {
    "grouped_matmul": _gmm("grouped_matmul"),
    "grouped_matmulv2": _gmm("grouped_matmulv2", v5e=True),
    "grouped_matmulv3": _gmm("grouped_matmulv3", v5e=True),
    "fused_cross_entropy": _loss("fused_cross_entropy", False),
    "fused_cross_entropy [vocab_parallel]": _loss("fused_cross_entropy", True),
    "fused_kl_divergence": _loss("fused_kl_divergence", False),
    "fused_kl_divergence [vocab_parallel]": _loss("fused_kl_divergence", True),
    "ragged_decode_attention": ragged_decode_attention,
    "page_attention": page_attention,
    "gated_delta_rule [decode]": gated_delta_rule_decode,
    "gated_delta_rule": gated_delta_rule,
    "flash_attention": flash_attention,
    "blocksparse_attention": blocksparse_attention,
    "ring_attention": ring_attention,
    "all_gather_matmul": all_gather_matmul,
}
