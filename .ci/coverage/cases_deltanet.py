"""deltanet-tpu's chunked Gated DeltaNet (PyPI ``deltanet-tpu``, which pins JAX 0.11.2), one :class:`measure.Case` each.

``deltanet_tpu.chunk_gdn`` (scalar decay per head, one gate) and ``chunk_gdn2`` (decay,
erase and write gates per channel): Pallas TPU kernels for the forward and, under a
``custom_vjp``, the backward (a prepass per chunk, a scan over chunks). Batch over
``data``, heads over ``model``; two chunks of 128 tokens, q and k L2-normalized in the
kernel, f32 matmuls. The library runs its kernels with ``interpret=True`` (Pallas' HLO
interpreter) on a backend that is not TPU: no context needed. Reference: the library's
token-serial recurrences (``deltanet_tpu.reference``) on the whole arrays.
"""

from __future__ import annotations

from measure import Case

B, L, H, D = 4, 256, 2, 128  # the kernels want head dims of 128 and chunks of 128 tokens


def _P(*a):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*a)


def _gdn(version):
    def case():
        import numpy as np

        import deltanet_tpu
        from deltanet_tpu import reference

        rng = np.random.RandomState(0)
        q, k, v = (rng.randn(B, L, H, D).astype(np.float32) for _ in range(3))
        gate = (B, L, H) if version == 1 else (B, L, H, D)  # per head, or per channel
        g = -(0.02 + 0.1 * rng.rand(*gate)).astype(np.float32)  # log decay, <= 0
        gates = [rng.rand(*gate).astype(np.float32) for _ in range(version)]  # beta; or erase b and write w
        opts = dict(qk_l2norm=True)
        if version == 1:
            body = lambda *a: deltanet_tpu.chunk_gdn(*a, precision="fp32", **opts)  # noqa: E731
            ref = lambda *a: reference.reference_gdn(*a, **opts)  # noqa: E731
        else:
            body = lambda *a: deltanet_tpu.chunk_gdn2(*a, precision="fp32", **opts)  # noqa: E731
            ref = lambda *a: reference.token_serial_gdn2(*a, **opts)  # noqa: E731
        args = (q, k, v, g, *gates)
        spec = _P("data", None, "model", None)
        specs = tuple(spec if a.ndim == 4 else _P("data", None, "model") for a in args)
        return Case(body, args, specs, spec, grad_argnums=tuple(range(len(args))), reference=ref, tol=1e-4,
                    note="batch over data, heads over model; 2 chunks; "
                    + ("decay and gate per head" if version == 1 else "decay, erase and write gates per channel"))

    return case


CASES = {
    "chunk_gdn": _gdn(1),
    "chunk_gdn2": _gdn(2),
}
