"""Rules for tokamax's Pallas kernels: derived from their bodies.

tokamax (JAX's successor to ``jax.experimental.pallas.ops``) defines most of its
kernels as functions nested in the op that launches them, made anew on every
call, and several of them communicate (its fused MoE reduce-scatter, ragged
gathers across devices). No fixed rule fits all of them, and no object can be
named ahead of time, so this pack registers ``rules.inferred()`` on every kernel
defined in tokamax's source: each call gets the rule ``reprules.inference()``
derives from that kernel's body, or, for a kernel that reads its device index,
communicates or holds a primitive reprules does not know, a
``MissingRuleError`` that says which and where. Entry point ``tokamax`` of the
``reprules.rules`` group: loaded right after ``import tokamax``.
"""

from __future__ import annotations

from types import ModuleType

import reprules
from reprules import rules


def tokamax(module: ModuleType) -> None:
    """Every Pallas kernel in tokamax gets the rule derived from its body."""
    reprules.replication_rule(rules.inferred())(reprules.kernels_in(module.__name__))
