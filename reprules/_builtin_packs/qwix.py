"""Rules for every Pallas kernel launched through qwix (``qwix.pallas.pallas_call``).

qwix (Google's JAX quantization library) lets a Pallas kernel take quantized
arrays: ``qpl.pallas_call(kernel, ...)`` adjusts the block specs and hands JAX
``lambda *kernel_args: kernel(...)``, a lambda defined in qwix's own source.
JAX, and so reprules, sees that lambda as the kernel: a pack for the library
that wrote the kernel (MaxText's megablox fork is one) never matches it, and
the kernel stays without a rule. Where its out_shape is annotated by hand JAX
believes the annotation, right or wrong; where it is not, JAX refuses it.

This pack (entry point ``qwix.pallas``, the module users import as ``qpl``,
loaded right after it) registers ``rules.inferred()`` on the module that
defines ``qpl.pallas_call``, so every kernel launched through it gets the rule
``reprules.inference()`` derives from the traced body, which is the wrapped
kernel's own (or a ``MissingRuleError`` that says why not). It is a pack of its
own, not part of the MaxText pack, because any library that launches kernels
through qwix benefits, MaxText imported or not. qwix's own example kernels
(``qwix.contrib.kernels``) call ``pl.pallas_call`` directly and are not covered.
"""

from __future__ import annotations

from types import ModuleType

import reprules
from reprules import rules


def qwix(module: ModuleType) -> None:
    """Every kernel launched through ``qwix.pallas.pallas_call`` (seen by JAX as
    qwix's own lambda) gets the rule derived from its body."""
    call = getattr(module, "pallas_call", None)
    where = getattr(call, "__module__", None)
    if not callable(call) or not isinstance(where, str) or not where.startswith("qwix"):
        raise LookupError(
            f"{module.__name__} has no pallas_call defined in qwix (found {call!r}): qwix moved it, "
            "so kernels launched through qwix.pallas.pallas_call get no rule from this pack.\n"
            "Why: qwix hands JAX its own lambda as the kernel, defined where pallas_call is; the "
            "pack registers the kernels of that module.\n"
            "Fix: upgrade reprules; until then register them yourself with "
            "reprules.replication_rule(reprules.rules.inferred())(reprules.kernels_in('<qwix module "
            "that defines pallas_call>'))."
        )
    reprules.replication_rule(rules.inferred())(reprules.kernels_in(where))
