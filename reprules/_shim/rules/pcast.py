"""``jax.lax.pcast(x, axes, to='varying')`` on a value reprules widened (JAX 0.8+).

A library that annotates a kernel's ``out_shape`` replicated and then casts the
output to varying itself (MaxText's megablox fork: ``varying_axes=()``, then
``pcast(out, axis, to='varying')`` for each of the activations' axes) meets the
annotation union (``_union``): the output already varies over those axes, and
JAX refuses a cast from varying to varying ("Unsupported pcast from=varying,
to='varying'"). The cast asks for a type the value already has, so for those
axes it is the identity, and so is its transpose (the cotangent of a varying
value is varying): the program computes what the library meant.

reprules adds the one entry JAX's pcast table lacks, ``('varying', 'varying')``:
the identity where every axis cast over is one reprules added to that very
value (an output of a widened kernel, or a ``jax.jit``/call output forwarding
one, found by its jaxpr variable, see ``_union.added_axes``), and otherwise
JAX's own ``ValueError``, word for word. Every cast JAX accepts goes through
JAX's entries, untouched.
"""

from __future__ import annotations

from typing import Any

from reprules._shim.plumbing import _jax
from reprules._shim.rules import _union
from reprules._shim.plumbing._patches import Patches

KEY = ("varying", "varying")


def install(patches: Patches) -> None:
    """Adds the varying-to-varying entry to JAX's pcast table (where JAX has that table)."""
    table = getattr(_jax.module("jax._src.lax.parallel"), "_pcast_funcs", None)
    if not isinstance(table, dict) or KEY in table:
        return  # no pcast here (JAX <= 0.7), or one that accepts the cast itself
    patches.setitem(table, KEY, _varying_to_varying, label="jax._src.lax.parallel._pcast_funcs[('varying', 'varying')]")


def _varying_to_varying(x: Any, axes: Any) -> Any:
    names = axes if isinstance(axes, tuple) else (axes,)
    if names and set(names) <= _union.added_axes(x):
        return x  # reprules made it vary over these axes: the cast is done already
    raise ValueError("Unsupported pcast from=varying, to='varying'")  # JAX's refusal, as JAX words it
