"""Verify mode's run-time check, inserted after each registered kernel call.

For every output and every mesh axis its type calls replicated, the kernel's
output is gathered across that axis (``all_gather``) and a host callback raises if its copies differ. Only public JAX API is used; regimes pass in how to make
a value varying so the collectives type-check (``pbroadcast`` / ``pvary``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from reprules._errors import ReplicationMismatchError
from reprules._registry import Registration
from reprules._shim import _common

_lock = threading.Lock()
# The largest difference seen per (kernel, output, axis) since the last take.
_largest: dict[tuple[str, int, str], tuple[float, str]] = {}


def insert_checks(
    reg: Registration,
    outs: Sequence[Any],
    out_varying: Sequence[frozenset[str]],
    mesh_axes: Sequence[str],
    make_varying: Callable[[Any, tuple[str, ...]], Any],
) -> None:
    for index, (out, varying) in enumerate(zip(outs, out_varying)):
        dtype = getattr(out, "dtype", None)
        if dtype is None or not (jnp.issubdtype(dtype, jnp.number) or dtype == jnp.bool_):
            continue
        value = jax.lax.stop_gradient(out)
        if dtype == jnp.bool_:
            value = value.astype(jnp.int32)
        for axis in mesh_axes:
            if axis in varying:
                continue
            # all_gather, not pmax/pmin: JAX 0.4.28 has no replication rule for pmax.
            gathered = jax.lax.all_gather(make_varying(value, (axis,)), axis)
            spread = jnp.max(jnp.abs(gathered.max(axis=0) - gathered.min(axis=0)))
            jax.debug.callback(functools.partial(_report, reg.name, repr(reg.rule), index, axis), spread)


def _report(kernel: str, rule: str, index: int, axis: str, spread: Any) -> None:
    # Runs once per device. It records rather than raises: an exception raised
    # by several devices' callbacks leaks into later executions on JAX <= 0.5.
    # reprules.verify() raises on exit (after jax.effects_barrier()).
    largest = float(np.max(np.asarray(spread)))
    if largest == 0.0:
        return
    message = (
        f"Verify mode: output {index} of kernel {kernel!r} is declared replicated over mesh axis "
        f"{axis!r} by its rule {rule}, but it differs across {axis!r} by up to {largest:.6g} "
        f"(JAX {_common.JAX_VERSION}).\n"
        "Why: the rule promises JAX a replication the kernel does not deliver; JAX then skips "
        "collectives and gradients or out_specs=P() results are silently wrong.\n"
        f"Fix: make the rule say the output varies over {axis!r} (e.g. rules.same() instead of "
        "rules.invariant(...)), or make the kernel communicate over it."
    )
    with _lock:
        key = (kernel, index, axis)
        if key not in _largest or largest > _largest[key][0]:
            _largest[key] = (largest, message)


def take_mismatches() -> list[str]:
    """Waits for pending checks, then returns and forgets what they found
    (one message per kernel output and axis, with the largest difference)."""
    jax.effects_barrier()
    with _lock:
        found = [message for _, message in _largest.values()]
        _largest.clear()
    return found


def raise_if_mismatched() -> None:
    found = take_mismatches()
    if found:
        more = f"\n({len(found) - 1} more mismatch(es): {found[1:]})" if len(found) > 1 else ""
        raise ReplicationMismatchError(found[0] + more)
