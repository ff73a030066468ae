"""jax-flash-attn2's attention (PyPI ``jax-flash-attn2``), one :class:`measure.Case` each.

``create_flash_attention(backend="tpu", platform="pallas")``: the library's Pallas
platform, which repeats the KV heads (einops) and calls JAX's TPU flash attention
(``jax.experimental.pallas.ops.tpu.flash_attention``) on the transposed arrays.
Batch over ``data``, heads over ``model``; causal, non-causal, and one KV head
replicated over ``model`` (each device repeats it to its query heads, so the K/V
gradients need the psum over ``model``). The library exposes no interpret switch:
``pltpu.force_tpu_interpret_mode(True)`` here, at the test site, makes every
``pallas_call`` ``interpret=True`` (Pallas' HLO interpreter; the kernel needs no TPU
memory spaces). The library accepts the Pallas platform only with ``backend="tpu"``
(its own check), which the CPU run names explicitly. Reference: the library's
``basic_attention_refrence`` (``jnp``) on the whole arrays.

Its Triton platform needs a GPU: ``tests/test_gpu_only.py``.
"""

from __future__ import annotations

import contextlib

from measure import Case, hlo_interpreter

B, S, H, D = 4, 128, 4, 64  # each device: one sequence, two query heads


@contextlib.contextmanager
def lend_jax_core_primitive():
    """jax-flash-attn2 imports eformer 0.0.15 (its pin), whose Triton caller defines its
    primitive with ``jax.core.Primitive``, removed in JAX 0.12 (``jax.extend.core.Primitive``
    since 0.4.36): lent for the import only, then taken back."""
    import jax.core
    import jax.extend.core

    missing = "Primitive" not in vars(jax.core)
    if missing:
        jax.core.Primitive = jax.extend.core.Primitive
    try:
        yield
    finally:
        if missing:
            del jax.core.Primitive


def import_flash_attn2():
    with lend_jax_core_primitive():
        import jax_flash_attn2
    return jax_flash_attn2


def _P(*a):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*a)


def _qkv(kv_heads):
    import numpy as np

    rng = np.random.RandomState(0)
    return (rng.randn(B, S, H, D).astype(np.float32), rng.randn(B, S, kv_heads, D).astype(np.float32),
            rng.randn(B, S, kv_heads, D).astype(np.float32))


def _pallas(causal, kv_heads=H):
    def case():
        fa = import_flash_attn2()
        attn = fa.create_flash_attention(backend="tpu", platform="pallas", softmax_scale=D ** -0.5)
        heads = _P("data", None, "model", None)
        kv = heads if kv_heads == H else _P("data", None, None, None)
        note = ("causal" if causal else "non-causal") + "; batch over data, heads over model"
        if kv_heads != H:
            note += f"; {kv_heads} KV head, replicated over model"
        def reference(q, k, v):
            return fa.basic_attention_refrence(q, k, v, causal=causal)

        return Case(lambda q, k, v: attn(q, k, v, causal=causal), _qkv(kv_heads), (heads, kv, kv), heads,
                    grad_argnums=(0, 1, 2), reference=reference, context=hlo_interpreter, tol=1e-5, note=note)

    return case


CASES = {
    "pallas (causal)": _pallas(True),
    "pallas (non-causal)": _pallas(False),
    "pallas (one KV head replicated over model)": _pallas(True, kv_heads=1),
}
