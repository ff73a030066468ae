"""JAX's own Pallas ops (``jax.experimental.pallas.ops``), one :class:`measure.Case` each.

Shapes are small (interpret mode is slow) and follow tests/test_jax_pallas_ops.py and
tests/test_jax_pallas_ops_inferred.py. A module that this JAX does not have raises
:class:`measure.NotAvailable`; nothing is imported until a case is built.
"""

from __future__ import annotations

import contextlib
import importlib

from measure import Case, NotAvailable

OPS = "jax.experimental.pallas.ops"


def _module(*paths: str):
    """The first of ``paths`` (under ``jax.experimental.pallas.ops``) this JAX has."""
    import jax

    for path in paths:
        try:
            return importlib.import_module(f"{OPS}.{path}")
        except ImportError:
            continue
    raise NotAvailable(f"JAX {jax.__version__} has no {' or '.join(paths)}")


def _tpu_interpret():
    """TPU kernels with no ``interpret`` argument: ``pltpu.force_tpu_interpret_mode`` (JAX 0.7+)."""
    import jax

    try:
        from jax.experimental.pallas import tpu as pltpu
    except ImportError:
        pltpu = None
    force = getattr(pltpu, "force_tpu_interpret_mode", None)
    if force is None:
        raise NotAvailable(f"JAX {jax.__version__} has no pltpu.force_tpu_interpret_mode (0.7+): "
                           "a TPU op with no interpret argument cannot run on CPU")
    return force


def _rn(seed, shape, scale=1.0):
    import numpy as np

    return (np.random.RandomState(seed).randn(*shape) * scale).astype(np.float32)


def _P(*a):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*a)


def _norm(op):
    def case():
        m = _module(f"gpu.{op}", op)
        fn, ref = getattr(m, op), getattr(m, f"{op}_reference")
        spec = _P("data", None, None)
        args = (_rn(0, (8, 4, 128)), 1.0 + 0.1 * _rn(1, (128,)), 0.1 * _rn(2, (128,)))
        return Case(lambda x, w, b: fn(x, w, b, interpret=True), args, (spec, _P(), _P()), spec,
                    grad_argnums=(0, 1, 2), reference=ref, tol=1e-4, note="weight and bias replicated")
    return case


def softmax():
    import jax

    m = _module("gpu.softmax", "softmax")
    spec = _P("data", "model", None)
    return Case(lambda x: m.softmax(x, axis=-1, interpret=True), (_rn(0, (8, 4, 128)),), (spec,), spec,
                reference=lambda x: jax.nn.softmax(x, axis=-1), note="no VJP")


def mha():
    m = _module("gpu.attention", "attention")
    blocks = ({"block_sizes": m.BlockSizes(16, 16, 16, 16, 16, 16)} if hasattr(m, "BlockSizes")
              else {"block_q": 16, "block_k": 16})
    spec = _P("data", None, "model", None)
    return Case(lambda q, k, v: m.mha(q, k, v, None, causal=True, interpret=True, **blocks),
                tuple(_rn(i, (4, 16, 2, 16)) for i in range(3)), (spec,) * 3, spec, grad_argnums=(0, 1, 2),
                reference=lambda q, k, v: m.mha_reference(q, k, v, None, causal=True), tol=1e-4)


def _decode(variant):
    def case():
        import numpy as np

        m = _module("gpu.decode_attention")
        if variant == "mqa":  # k/v shared by the heads: batch on data only
            q_spec, kv_spec = _P("data", "model", None), _P("data", None, None)
            q, k, v = _rn(0, (4, 8, 16)), _rn(1, (4, 32, 16)), _rn(2, (4, 32, 16))
        else:
            q_spec, kv_spec = _P("data", "model", None), _P("data", None, "model", None)
            q, k, v = _rn(0, (4, 8, 16)), _rn(1, (4, 32, 2, 16)), _rn(2, (4, 32, 2, 16))
        op, ref = getattr(m, variant), getattr(m, f"{variant}_reference")
        start, length = np.array([0, 1, 2, 3], np.int32), np.array([32, 20, 17, 9], np.int32)
        return Case(lambda q, k, v, s, n: op(q, k, v, s, n, block_h=4, block_k=16, k_splits=2, interpret=True),
                    (q, k, v, start, length), (q_spec, kv_spec, kv_spec, _P("data"), _P("data")), q_spec,
                    reference=ref, note="no VJP")
    return case


def paged_attention_gpu():
    import jax.numpy as jnp
    import numpy as np

    m = _module("gpu.paged_attention")
    batch, heads, kv_heads, dim, page, per_seq = 4, 16, 2, 16, 4, 4
    pages = batch * per_seq
    tables = np.random.RandomState(0).permutation(pages).reshape(batch, per_seq).astype(np.int32)
    args = (_rn(0, (batch, heads, dim)), _rn(1, (kv_heads, pages, page, dim)), _rn(2, (kv_heads, pages, page, dim)),
            tables, np.array([16, 11, 5, 1], np.int32))

    def op(q, kp, vp, t, n):
        return m.paged_attention(q, kp, vp, t, n, block_h=16, pages_per_compute_block=2, k_splits=2, interpret=True)

    def ref(q, kp, vp, t, n):
        k = jnp.moveaxis(kp[:, t].reshape(kv_heads, batch, -1, dim), 0, 2)
        v = jnp.moveaxis(vp[:, t].reshape(kv_heads, batch, -1, dim), 0, 2)
        return m.paged_attention_reference(q, k, v, n)

    row = _P("data", None, None)
    return Case(op, args, (row, _P(), _P(), _P("data", None), _P("data")), row, reference=ref,
                note="page pool replicated; no VJP")


def _splash(variant):
    def case():
        import inspect

        import jax

        sk = _module("tpu.splash_attention.splash_attention_kernel")
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

        if "interpret" not in inspect.signature(sk._make_splash_attention).parameters:
            raise NotAvailable(f"splash attention in JAX {jax.__version__} takes no interpret argument")
        batch, heads, seq, dim = 4, 4, 128, 128
        blocks = sk.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128,
                               block_kv_dkv=128, block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128)
        make = sk.make_splash_mha if variant == "mha" else sk.make_splash_mqa
        local = make(sm.MultiHeadMask([sm.CausalMask((seq, seq))] * (heads // 2)), head_shards=1, q_seq_shards=1,
                     block_sizes=blocks, interpret=True)
        whole = (sk.make_masked_mha_reference if variant == "mha" else sk.make_masked_mqa_reference)(
            sm.MultiHeadMask([sm.CausalMask((seq, seq))] * heads))
        kv_shape = (batch, heads, seq, dim) if variant == "mha" else (batch, seq, dim)
        q_spec = _P("data", "model", None, None)
        kv_spec = q_spec if variant == "mha" else _P("data", None, None)
        return Case(lambda q, k, v: jax.vmap(local)(q, k, v), (_rn(0, (batch, heads, seq, dim)), _rn(1, kv_shape),
                    _rn(2, kv_shape)), (q_spec, kv_spec, kv_spec), q_spec, grad_argnums=(0, 1, 2),
                    reference=jax.vmap(whole), tol=1e-4,
                    note="interpret=True, vmapped over batch" + ("; MQA's k/v head shared by the model shards"
                                                                  if variant == "mqa" else ""))
    return case


def flash_attention_tpu():
    m = _module("tpu.flash_attention")
    blocks = m.BlockSizes(block_q=128, block_k_major=128, block_k=128, block_b=1, block_q_major_dkv=128,
                          block_k_major_dkv=128, block_k_dkv=128, block_q_dkv=128, block_k_major_dq=128,
                          block_k_dq=128, block_q_dq=128)
    spec = _P("data", "model", None, None)
    return Case(lambda q, k, v: m.flash_attention(q, k, v, causal=True, block_sizes=blocks),
                tuple(_rn(i, (4, 2, 128, 128)) for i in range(3)), (spec,) * 3, spec, grad_argnums=(0, 1, 2),
                reference=lambda q, k, v: m.mha_reference(q, k, v, None, causal=True), context=_tpu_interpret(),
                tol=1e-4)


def matmul_tpu():
    m = _module("tpu.matmul")
    return Case(lambda x, y: m.matmul(x, y, block_shape=(8, 128), block_k=128), (_rn(0, (32, 256)), _rn(1, (256, 256))),
                (_P("data", None), _P(None, "model")), _P("data", "model"), reference=lambda x, y: x @ y,
                context=_tpu_interpret(), tol=1e-4, note="rows over data, columns over model; no VJP")


def example_kernel_tpu():
    m = _module("tpu.example_kernel")
    return Case(m.double, (_rn(0, (32, 128)),), (_P("data", None),), _P("data", None), reference=lambda x: 2 * x,
                context=_tpu_interpret(), note="no VJP")


def megablox_gmm():
    import jax.numpy as jnp
    import numpy as np

    m = _module("tpu.megablox")
    sizes = np.array([48, 80], np.int32)  # two groups in each data shard's 128 rows

    def op(lhs, rhs, s):
        return m.gmm(lhs, rhs, s, preferred_element_type=jnp.float32, tiling=(128, 128, 128))

    def ref(lhs, rhs, s):  # the op on the whole arrays, each data shard's rows with the same groups
        return jnp.concatenate([op(c, rhs, s) for c in jnp.split(lhs, 4)])

    return Case(op, (_rn(0, (512, 128)), _rn(1, (2, 128, 128), 0.1), sizes), (_P("data", None), _P(), _P()),
                _P("data", None), grad_argnums=(0, 1), reference=ref, context=_tpu_interpret(),
                note="weight replicated (tgmm through gmm's VJP)")


def paged_attention_tpu():
    import numpy as np

    m = _module("tpu.paged_attention")
    rng = np.random.RandomState(0)
    batch, qh, kvh, hd, page, per_seq, pages = 8, 2, 1, 128, 16, 4, 32
    args = (_rn(0, (batch, qh, hd)), _rn(1, (kvh, pages, page, hd)), _rn(2, (kvh, pages, page, hd)),
            rng.randint(1, per_seq * page + 1, batch).astype(np.int32),
            rng.randint(0, pages, (batch, per_seq)).astype(np.int32))
    return Case(lambda *a: m.paged_attention(*a, pages_per_compute_block=2), args,
                (_P("data"), _P(), _P(), _P("data"), _P("data")), _P("data"), context=_tpu_interpret(),
                note="page pool replicated; no VJP")


def ragged_paged_attention():
    import jax.numpy as jnp
    import numpy as np

    m = _module("tpu.ragged_paged_attention.kernel", "tpu.ragged_paged_attention")
    rng = np.random.RandomState(0)
    tokens, qh, kvh2, hd, page, per_seq, pages, seqs = 8, 2, 2, 128, 16, 2, 8, 2

    def shard():  # one data shard: 2 sequences of 3 and 5 query tokens
        return (rng.randn(tokens, qh, hd).astype(np.float32), rng.randn(pages, page, kvh2, hd).astype(np.float32),
                np.array([20, 30], np.int32),
                rng.permutation(pages)[: seqs * per_seq].reshape(seqs, per_seq).astype(np.int32),
                np.array([0, 3, 8], np.int32), np.array([seqs], np.int32))

    args = tuple(np.concatenate(p) for p in zip(*[shard() for _ in range(4)]))

    def op(*a):
        return m.ragged_paged_attention(*a, num_kv_pages_per_block=1, num_queries_per_block=8)

    def ref(*a):  # each data shard's batch on its own
        return jnp.concatenate([op(*(x.reshape(4, -1, *x.shape[1:])[i] for x in a)) for i in range(4)])

    return Case(op, args, (_P("data"),) * 6, _P("data"), reference=ref, context=_tpu_interpret(),
                note="a batch of sequences per data shard; no VJP")


def _prng(name):
    def case():
        import jax.numpy as jnp
        import numpy as np

        m = _module(f"tpu.random.{name}")
        _tpu_interpret()
        bits = {"threefry": lambda k: m.threefry_2x32_count(k, (8, 128), (8, 128), (8, 128)),
                "philox": lambda k: m.philox_4x32_kernel(k, (8, 128), (8, 128), block_size=(8, 128), offset=3)}[name]
        keys = np.random.RandomState(0).randint(0, 2**31, (4, 2)).astype(np.uint32)
        return Case(lambda k: bits(k[0])[None], (keys,), (_P("data"),), _P("data"),
                    reference=lambda k: jnp.stack([bits(k[i]) for i in range(4)]), context=_tpu_interpret(),
                    tol=0.0, note="a key per data shard; bits")
    return case


def all_gather_tpu():
    import jax
    import numpy as np

    m = _module("tpu.all_gather")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    return Case(lambda x: m.all_gather(x, mesh=mesh, axis_name="model"), (_rn(0, (32, 128)),),
                (_P("data", "model"),), _P("data", None), reference=lambda x: x, context=_tpu_interpret(),
                note="the op runs its own shard_map over the mesh; its kernel communicates (remote DMA)")


CASES = {
    "layer_norm": _norm("layer_norm"),
    "rms_norm": _norm("rms_norm"),
    "softmax": softmax,
    "attention.mha": mha,
    "decode_attention.mqa": _decode("mqa"),
    "decode_attention.gqa": _decode("gqa"),
    "gpu.paged_attention": paged_attention_gpu,
    "splash_attention (mha)": _splash("mha"),
    "splash_attention (mqa)": _splash("mqa"),
    "tpu.flash_attention": flash_attention_tpu,
    "tpu.matmul": matmul_tpu,
    "tpu.example_kernel": example_kernel_tpu,
    "megablox.gmm": megablox_gmm,
    "tpu.paged_attention": paged_attention_tpu,
    "ragged_paged_attention": ragged_paged_attention,
    "random.threefry_2x32_count": _prng("threefry"),
    "random.philox_4x32_kernel": _prng("philox"),
    "tpu.all_gather": all_gather_tpu,
}
