"""Rules for MaxText's Pallas kernels, and for every kernel launched through qwix.

MaxText (PyPI ``maxtext``) keeps its kernels in ``maxtext.kernels``: attention
(splash attention, ragged GQA decode), and the MoE grouped matmuls of
``maxtext.kernels.megablox`` (a fork of JAX's megablox plus tokamax-derived
``gmm_v2`` kernels). Like tokamax's, they are nested functions made per call,
so the ``maxtext`` pack (entry point ``maxtext``, loaded right after
``import maxtext``) registers ``rules.inferred()`` on ``kernels_in`` of those
two subpackages: each call gets the rule ``reprules.inference()`` derives from
the kernel's body, or a ``MissingRuleError`` that says why not. The other
subpackages (``ragged``, ``mhc``, ``gather_reduce_*``, ``tokamax_splash_attention``)
need no entry: their kernels leave ``out_shape`` unannotated, so JAX refuses
them under checking and inference applies by default (the same rule, with or
without a pack entry: measured), or they hold no Pallas kernel.

The megablox fork does not call ``pl.pallas_call`` itself: it calls
``qwix.pallas.pallas_call`` (``qpl``), which hands JAX a ``lambda`` defined in
qwix's source that calls the kernel. JAX, and so reprules, sees that lambda as
the kernel, which no ``kernels_in("maxtext...")`` matches. That is qwix's
business, not MaxText's (every kernel any library launches through
``qpl.pallas_call`` is the same lambda), so the qwix pack covers it
(``reprules/_builtin_packs/qwix.py``, loaded on ``import qwix.pallas``).

What the rules change for MaxText: its megablox fork annotates every
``out_shape`` by hand (``varying_axes``), and annotates the weight gradient
``tgmm`` like the weight, replicated over the token axes it is a partial sum
over. JAX believes the annotation: under ``check_vma=True`` the weight gradient
silently misses its psum. With the rule, reprules types the output by the union
(a ``ReplicationWarning``) and the psum is added; the forward's replicated
annotation is widened too, and MaxText's ``pcast(out, axis, to='varying')``
right after the kernel is then an identity (see ``reprules/_shim/rules/pcast.py``).
"""

from __future__ import annotations

from types import ModuleType

import reprules
from reprules import rules

# The subpackages of maxtext whose kernels get rules.inferred().
SUBPACKAGES: tuple[str, ...] = ("kernels.attention", "kernels.megablox")


def maxtext(module: ModuleType) -> None:
    """Every Pallas kernel in MaxText's attention and megablox kernels gets the rule derived from its body."""
    for sub in SUBPACKAGES:
        reprules.replication_rule(rules.inferred())(reprules.kernels_in(f"{module.__name__}.{sub}"))

