"""Rules for recurrentgemma's Pallas LRU scan (``recurrentgemma.jax.pallas``).

recurrentgemma (Google DeepMind's Griffin / RecurrentGemma, PyPI
``recurrentgemma``) runs its linear recurrence ``h[t] = a[t] * h[t-1] + x[t]``
in one Pallas kernel, ``linear_rnn_pallas_kernel``, under a ``custom_vjp``
(``_lru``, called by ``lru_pallas_scan`` and ``pallas_lru``). The kernel scans
its own block of the sequence and communicates nothing, so this pack (entry
point ``recurrentgemma.jax.pallas``, loaded right after that module is
imported) gives it ``rules.same()``.

With the sequence sharded (``seq_axis=``, inside ``shard_map``), each device
scans its chunk from a zero state, then ``multi_shard_correction`` all-gathers
every chunk's last state and product of ``a`` over ``seq_axis`` and adds the
missing ``prod(a) * h_in`` term. Its semantics, as the library writes them
for ``check_rep=False`` (``scan.linear_scan``'s own ``shard_map``):

* the final state ``h_last`` is computed alike on every device along
  ``seq_axis`` (out_specs replicated over it). JAX types an ``all_gather``'s
  output varying, so with checking on, out_specs replicated over ``seq_axis``
  for ``h_last`` are refused by JAX (not by reprules). To return it replicated,
  take one device's copy: ``psum(where(axis_index(seq_axis) == n - 1, h_last, 0),
  seq_axis)`` (exact, gradient included: the bwd below sums ``dh_last``);
* the bwd psums ``dh_last`` over ``seq_axis`` ("needed because of how Jax
  propagates gradients in ``shard_map``": with checking off JAX splits the
  cotangent of a replicated output across the devices). With checking on each
  device's ``h_last`` is typed varying and gets its own cotangent, and the
  psum sums them: the total, as every device's ``h_last`` is the same function
  of every chunk. Right either way;
* the ``h0`` cotangent comes out of the backward correction masked to the one
  device holding the first chunk of the sequence (``sync_h_last=False``:
  ``(axis_index == first) * dh0``), where it is the whole gradient; every other
  device returns zero. ``h0`` is replicated over ``seq_axis``, so its gradient
  is the psum of that: what checking off computes (the transpose of a
  replicated in_spec), and what reprules' ``custom_vjp`` fix adds. reprules
  proves it exact although ``dh0`` depends on the psummed ``dh_last``: a value
  masked to one device along an axis counts once in a psum over it
  (``reprules/_shim/cotangents/_taint.py``). Before, it raised a
  ``CotangentError`` there.
"""

from __future__ import annotations

from types import ModuleType

import reprules
from reprules import rules


def recurrentgemma(module: ModuleType) -> None:
    """The LRU scan kernel of ``recurrentgemma.jax.pallas`` gets ``rules.same()``."""
    kernel = getattr(module, "linear_rnn_pallas_kernel", None)
    if kernel is None:
        raise LookupError(
            f"{module.__name__} has no linear_rnn_pallas_kernel: renamed or removed, so its LRU scan "
            "kernel has no rule from this pack (inference still applies, as for any unannotated kernel).\n"
            "Fix: upgrade reprules."
        )
    reprules.replication_rule(rules.same())(kernel)
