"""tokamax's Pallas TPU ops, one :class:`measure.Case` each.

Mosaic TPU kernels on CPU: TPU interpret mode, ``tokamax.config.cross_compile(True)``,
an explicit ``implementation=`` (the default picks XLA on CPU) and, for the ops that
ask ``get_tpu_info()``, a TPU v5e description for the CPU device kind
(``tpu_description.py``). Shapes follow tests/test_tokamax.py.
"""

from __future__ import annotations

import functools

from measure import Case
from tpu_description import tpu_interpret

CONTEXT = functools.partial(tpu_interpret, v5e=True, tokamax=True)
SIZES = (16, 48, 40, 24)  # four experts' rows in each data shard of 128 rows
M, K, N, G = 512, 128, 128, 4


def _rn(seed, shape, scale=1.0):
    import numpy as np

    return (np.random.RandomState(seed).randn(*shape) * scale).astype(np.float32)


def _P(*a):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*a)


def _ragged_reference(lhs, rhs):
    """Each data shard's rows grouped by SIZES: ``jax.lax.ragged_dot`` on the whole arrays."""
    import jax
    import jax.numpy as jnp

    return jax.lax.ragged_dot(lhs, jnp.tile(rhs, (4, 1, 1)), jnp.tile(jnp.asarray(SIZES, jnp.int32), 4),
                              preferred_element_type=jnp.float32)


def _tk(implementation):
    import jax.numpy as jnp
    import tokamax

    return lambda lhs, rhs, sizes: tokamax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32,
                                                      implementation=implementation)


def _ragged_dot(layout, implementation="mosaic_tpu"):
    def case():
        import jax
        import jax.numpy as jnp

        op = _tk(implementation)
        sizes = jnp.asarray(SIZES, jnp.int32)
        if layout == "ep":  # experts over model: each model shard multiplies its 2 experts' rows
            def body(lhs, rhs):
                m = jax.lax.axis_index("model")
                local = jax.lax.dynamic_slice(sizes, (2 * m,), (2,))
                offset = jnp.sum(jnp.where(jnp.arange(G) < 2 * m, sizes, 0))
                mask = (jnp.arange(lhs.shape[0]) < local.sum())[:, None]
                x = jnp.where(mask, jnp.roll(lhs, -offset, 0), 0.0)  # rows past the groups: left unset
                y = jnp.where(mask, op(x, rhs, local), 0.0)
                return jax.lax.psum(jnp.roll(y, offset, 0), "model")
            specs, out, note = (_P("data", None), _P("model", None, None)), _P("data", None), "experts over model"
            rhs = _rn(1, (G, K, N))
        else:
            body = lambda lhs, rhs: op(lhs, rhs, sizes)  # noqa: E731
            if layout == "dp":
                specs, out, note = (_P("data", None), _P()), _P("data", None), "weight replicated"
                rhs = _rn(1, (G, K, N))
            else:  # tp: the weight's N over model
                specs, out, note = (_P("data", None), _P(None, None, "model")), _P("data", "model"), "weight's N over model"
                rhs = _rn(1, (G, K, 2 * N))
        return Case(body, (_rn(0, (M, K)), rhs), specs, out, grad_argnums=(0, 1), reference=_ragged_reference,
                    context=CONTEXT, tol=1e-5, note=note + f"; implementation={implementation!r}")
    return case


def router_topk():
    import jax
    from tokamax._src.ops.router_topk.api import router_topk as op

    spec = _P("data", None)
    return Case(lambda s: op(s, 2, implementation="mosaic_tpu"), (_rn(0, (512, 128)),), (spec,), (spec, spec),
                reference=lambda s: jax.lax.top_k(s, 2), context=CONTEXT, tol=0.0, note="no VJP")


def dot_product_attention():
    import tokamax

    spec = _P("data", None, "model", None)  # (batch, seq, heads, dim)
    return Case(lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True, implementation="mosaic"),
                tuple(_rn(i, (4, 128, 2, 128)) for i in range(3)), (spec,) * 3, spec, grad_argnums=(0, 1, 2),
                reference=lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
                context=CONTEXT, tol=1e-4, note="reference: tokamax's XLA implementation")


CASES = {
    "ragged_dot (mosaic_tpu, weight replicated)": _ragged_dot("dp"),
    "ragged_dot (mosaic_tpu, weight N over model)": _ragged_dot("tp"),
    "ragged_dot (mosaic_tpu, experts over model)": _ragged_dot("ep"),
    "ragged_dot (mosaic_tpu_v2)": _ragged_dot("dp", "mosaic_tpu_v2"),
    "router_topk (mosaic_tpu)": router_topk,
    "dot_product_attention (mosaic)": dot_product_attention,
}
