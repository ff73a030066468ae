"""recurrentgemma's Pallas LRU scan (``recurrentgemma.jax.pallas.lru_pallas_scan``, what
``scan.linear_scan`` runs with ``ScanType.LINEAR_PALLAS``), one :class:`measure.Case` each.

Batch over ``data``; the sequence over ``model`` (``seq_axis="model"``: each device
scans its chunk, then the library all-gathers the chunks' last states and corrects),
or the width over ``model``. With an initial state ``h0`` (replicated over ``model``)
or without, forward and reverse; and the final state returned as the library's own
``shard_map`` returns it (out_specs replicated over the sequence axis). Reference: the
library's ``lru_linear_scan`` (``lax.scan``) on the whole arrays.

The kernel is plain Pallas (a grid, block specs, no TPU memory spaces or DMAs), run by
Pallas' HLO interpreter: ``pltpu.force_tpu_interpret_mode(True)`` makes every
``pallas_call`` traced under it ``interpret=True``. TPU interpret mode (an
``InterpretParams``) simulates each call across all devices with host callbacks, and
there the final-state op deadlocks against XLA's CPU all-reduce, checking off too
(a device waits in the all-reduce for a partner held in the simulation).
"""

from __future__ import annotations

from measure import Case, hlo_interpreter

B, T, D = 8, 64, 128  # the kernel wants a width that is a multiple of 128 on each device


def _P(*a):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*a)


def _inputs(d):
    import numpy as np

    rng = np.random.RandomState(0)
    x = rng.randn(B, T, d).astype(np.float32)
    a = (0.5 + 0.5 * rng.rand(B, T, d)).astype(np.float32)
    return x, a, rng.randn(B, d).astype(np.float32)


def _lru(layout, reverse=False, with_h0=True, final_state=False):
    def case():
        from recurrentgemma.jax import pallas, scan

        seq = layout == "sequence"

        def body(x, a, h0):
            y, h_last = pallas.lru_pallas_scan(x, a, h0 if with_h0 else None, reverse=reverse,
                                               seq_axis="model" if seq else None, min_seq_block_size=8)
            return (y, h_last) if final_state else y

        def ref(x, a, h0):
            y, h_last = scan.lru_linear_scan(x, a, h0 if with_h0 else None, reverse=reverse)
            return (y, h_last) if final_state else y

        spec = _P("data", "model", None) if seq else _P("data", None, "model")
        state = _P("data", None) if seq else _P("data", "model")
        out = (spec, state) if final_state else spec
        note = ("sequence over model" if seq else "width over model") + ("; h0 replicated over model" if with_h0
                                                                         and seq else "; h0" if with_h0 else "")
        if reverse:
            note += "; reverse"
        if final_state:
            note += "; the final state returned replicated over model, as the library's own shard_map does"
        return Case(body, _inputs(D if seq else 2 * D), (spec, spec, state), out,
                    grad_argnums=(0, 1, 2) if with_h0 else (0, 1), reference=ref, context=hlo_interpreter, tol=1e-5,
                    note=note)

    return case


CASES = {
    "lru_pallas_scan (sequence over model, h0)": _lru("sequence"),
    "lru_pallas_scan (sequence over model, h0, reverse)": _lru("sequence", reverse=True),
    "lru_pallas_scan (sequence over model, no h0)": _lru("sequence", with_h0=False),
    "lru_pallas_scan (width over model, h0)": _lru("width"),
    "lru_pallas_scan (sequence over model, final state)": _lru("sequence", final_state=True),
}
