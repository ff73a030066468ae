"""MaxText's kernels (``maxtext.kernels``), called as MaxText's layers call them, one
:class:`measure.Case` each.

The MoE grouped matmul (``maxtext.kernels.megablox.gmm``, what ``MoeBlock.sparse_matmul``
calls) in its three backends and two layouts (``fsdp``: weights replicated, tokens on
``data``; ``ep``: experts on ``model``), splash attention (vmapped over batch as
``attention_op.py`` does), ragged GQA decode, the tokamax-derived splash attention,
mHC (whose kernels MaxText calls under an abstract mesh with no axes on CPU), and the
ring-of-experts token sort.
TPU interpret mode, a TPU v5e description for the CPU device kind, tokamax's
``cross_compile``.
"""

from __future__ import annotations

import functools

from measure import Case
from tpu_description import tpu_interpret

CONTEXT = functools.partial(tpu_interpret, v5e=True, tokamax=True)
SIZES = (16, 48, 40, 24)
M, K, N, G = 512, 128, 128, 4


def _rn(seed, shape, scale=1.0):
    import numpy as np

    return (np.random.RandomState(seed).randn(*shape) * scale).astype(np.float32)


def _P(*a):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*a)


def _vma(x):
    """moe.py's own reading of a value's varying axes (from ``jax.typeof``'s text)."""
    import jax

    s = str(jax.typeof(x))
    if "{V:" not in s:
        return ()
    a = s.index("{V:") + 3
    return tuple(sorted(p.strip() for p in s[a:s.index("}", a)].strip("()").split(",")))


def _gmm(backend, layout):
    def case():
        import jax
        import jax.numpy as jnp
        from maxtext.kernels import megablox

        sizes = jnp.asarray(SIZES, jnp.int32)
        mb = backend == "megablox"

        def gmm(lhs, rhs, gs):
            return megablox.gmm(lhs, rhs, gs, preferred_element_type=jnp.float32, tiling=(128,) * 9,
                                use_tokamax_backend=not mb, use_gmm_v2=(backend == "tokamax_v2"),
                                lhs_vma_axes=_vma(lhs) if mb else (), rhs_vma_axes=_vma(rhs) if mb else (),
                                interpret=True)

        if layout == "fsdp":
            body, specs = (lambda lhs, rhs: gmm(lhs, rhs, sizes)), (_P("data", None), _P())
        else:
            def body(lhs, rhs):
                m = jax.lax.axis_index("model")
                local = jax.lax.dynamic_slice(sizes, (2 * m,), (2,))
                offset = jnp.sum(jnp.where(jnp.arange(G) < 2 * m, sizes, 0))
                mask = (jnp.arange(lhs.shape[0]) < local.sum())[:, None]
                x = jnp.where(mask, jnp.roll(lhs, -offset, 0), 0.0)
                y = jnp.where(mask, gmm(x, rhs, local), 0.0)
                return jax.lax.psum(jnp.roll(y, offset, 0), "model")
            specs = (_P("data", None), _P("model", None, None))

        def ref(lhs, rhs):
            return jax.lax.ragged_dot(lhs, jnp.tile(rhs, (4, 1, 1)), jnp.tile(sizes, 4),
                                      preferred_element_type=jnp.float32)

        return Case(body, (_rn(0, (M, K)), _rn(1, (G, K, N))), specs, _P("data", None), grad_argnums=(0, 1),
                    reference=ref, context=CONTEXT, tol=1e-5,
                    note=("weights replicated" if layout == "fsdp" else "experts over model")
                    + {"megablox": "; MaxText's megablox fork through qwix's pallas_call, interpret=True",
                       "tokamax": "; tokamax.ragged_dot",
                       "tokamax_v2": "; MaxText's own v2 Mosaic kernels"}[backend])
    return case


def splash():
    import jax
    import jax.numpy as jnp
    from maxtext.kernels.attention import splash_attention_kernel as sak
    from maxtext.kernels.attention.splash_attention_kernel import mask_lib

    B, H, S, D = 4, 4, 256, 128

    def body(q, k, v):
        bs = sak.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128,
                            block_kv_dkv=128, block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128)
        mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((S, S))] * q.shape[1])
        return jax.vmap(sak.make_splash_mha(mask, block_sizes=bs, head_shards=1, q_seq_shards=1))(q, k, v)

    def ref(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k)
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1), v)

    spec = _P("data", "model", None, None)
    return Case(body, tuple(_rn(i, (B, H, S, D)) for i in range(3)), (spec,) * 3, spec, grad_argnums=(0, 1, 2),
                reference=ref, context=CONTEXT, tol=1e-4, note="causal; reference: plain jnp attention")


def tokamax_splash():
    import jax
    import jax.numpy as jnp
    from maxtext.kernels.tokamax_splash_attention import splash_attention_kernel as sak
    from maxtext.kernels.tokamax_splash_attention import splash_attention_mask as mask_lib

    B, H, S, D = 4, 2, 128, 128

    def body(q, k, v):
        cfg = sak.SplashConfig(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128, block_kv_dkv=128,
                               block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128)
        return jax.vmap(sak.make_splash_mha_single_device(mask_lib.CausalMask((S, S)), config=cfg))(q, k, v)

    def ref(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k)
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1), v)

    spec = _P("data", "model", None, None)
    return Case(body, tuple(_rn(i, (B, H, S, D), 0.3) for i in range(3)), (spec,) * 3, spec, grad_argnums=(0, 1, 2),
                reference=ref, context=CONTEXT, tol=1e-4, note="causal; reference: plain jnp attention")


def mhc():
    import itertools

    import jax.numpy as jnp
    import numpy as np
    from maxtext.kernels import mhc as mhc_lib
    from maxtext.kernels.mhc import mhc_kernels_fwd

    B, S, K, D = 8, 32, 4, 128
    shapes = dict(norm_scale=(K * D,), pre_alpha=(K * D, K), pre_bias=(K,), pre_scale=(1,), post_alpha=(K * D, K),
                  post_bias=(K,), post_scale=(1,), res_alpha=(K * D, 24), res_bias=(24,), res_scale=(1,))
    weights = tuple(_rn(10 + i, shape, 0.05 if len(shape) == 2 else 0.5) + (name == "norm_scale")
                    for i, (name, shape) in enumerate(shapes.items()))
    # A NumPy array: MaxText passes it as a custom_vjp nondiff argument, where a tracer is refused.
    perms = np.eye(K, dtype=np.float32)[np.array(list(itertools.permutations(range(K))))].astype(jnp.bfloat16)
    config = mhc_lib.MhcKernelConfig(block_size=32, bwd_block_size=32, bwd_feature_block_size=128)

    def body(x, *w):
        layer_input, ctx = mhc_kernels_fwd.pre(x.astype(jnp.bfloat16), mhc_lib.MhcWeights(*w),
                                               perms, config=config)
        out = mhc_kernels_fwd.post((layer_input * 1.5).astype(jnp.bfloat16), ctx, config=config)
        return out.astype(jnp.float32)

    return Case(body, (_rn(0, (B, S, K, D)), *weights), (_P("data"),) + (_P(),) * len(weights), _P("data"),
                grad_argnums=tuple(range(1 + len(weights))), context=CONTEXT, tol=1e-5,
                note="tokens over data, weights replicated; each kernel under an abstract mesh with no axes on CPU")


def ragged_gqa():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from maxtext.kernels.attention import ragged_attention as ra

    B, HQ, HKV, SK, D = 4, 8, 2, 512, 128

    def body(q, k, v, lengths):
        o, m, l = ra.ragged_gqa(q, k, v, lengths, block_size=128)
        return o / l

    def ref(q, k, v, lengths):
        qg = q.reshape(B, HKV, HQ // HKV, D)
        s = jnp.einsum("bgqd,bgsd->bgqs", qg, k.transpose(0, 2, 1, 3))
        s = jnp.where(jnp.arange(SK)[None, None, None, :] < lengths[:, None, None, None], s, -jnp.inf)
        return jnp.einsum("bgqs,bgsd->bgqd", jax.nn.softmax(s, -1), v.transpose(0, 2, 1, 3)).reshape(B, 1, HQ, D)

    spec = _P("data", None, "model", None)
    return Case(body, (_rn(0, (B, 1, HQ, D)), _rn(1, (B, SK, HKV, D)), _rn(2, (B, SK, HKV, D)),
                       np.array([512, 100, 300, 7], np.int32)),
                (spec, spec, spec, _P("data")), spec, reference=ref, context=CONTEXT, tol=1e-5,
                note="decode; no VJP")


def ring_ragged_sort():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from maxtext.kernels.ragged.ragged_sort import ring_ragged_sort as op

    T, H, E, TOPK, EP = 16, 128, 4, 2, 2
    rng = np.random.RandomState(3)
    topk = np.stack([rng.permutation(E)[:TOPK] for _ in range(4 * T)]).astype(np.int32)

    def body(hidden, idx):
        return op(hidden, idx, E, TOPK, "model", EP)[0]

    def ref(hidden, topk_idx):  # each data shard's tokens sorted by expert, each model shard's experts' rows
        outs = []
        for d in range(4):
            h, idx = hidden[d * T:(d + 1) * T], topk_idx[d * T:(d + 1) * T].reshape(-1)
            order = jnp.argsort(idx)
            tok = jnp.repeat(jnp.arange(T), TOPK)[order]
            offs = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(jnp.bincount(idx, length=E))])
            for m in range(EP):
                lo, hi = offs[m * E // EP], offs[(m + 1) * E // EP]
                rows = jnp.arange(T * TOPK)
                outs.append(jnp.where(((rows >= lo) & (rows < hi))[:, None], h[tok], 0.0))
        return jnp.concatenate(outs)

    return Case(body, (_rn(0, (4 * T, H)), topk), (_P("data", None), _P("data", None)), _P(("data", "model"), None),
                grad_argnums=(0,), reference=ref, context=CONTEXT, tol=1e-2,
                note="experts over model; on CPU MaxText takes its jnp fallback (no SparseCore): no Pallas kernel")


CASES = {
    "megablox.gmm (tokamax backend, fsdp)": _gmm("tokamax", "fsdp"),
    "megablox.gmm (tokamax backend, ep)": _gmm("tokamax", "ep"),
    "megablox.gmm (tokamax v2 backend, fsdp)": _gmm("tokamax_v2", "fsdp"),
    "megablox.gmm (megablox backend, fsdp)": _gmm("megablox", "fsdp"),
    "megablox.gmm (megablox backend, ep)": _gmm("megablox", "ep"),
    "attention.splash_attention_kernel (mha)": splash,
    "attention.ragged_attention.ragged_gqa": ragged_gqa,
    "tokamax_splash_attention (mha, single device)": tokamax_splash,
    "mhc.mhc_kernels_fwd (pre, post)": mhc,
    "ragged.ragged_sort.ring_ragged_sort": ring_ragged_sort,
}
