"""Verify mode's run-time check, inserted after each registered kernel call.

For every output and every mesh axis its type calls replicated, the kernel's
output is gathered across that axis (``all_gather``) and a host callback records
the largest difference between its copies (``reprules.verify()`` raises on exit;
the pytest plugin fails the test). Only public JAX API is used; regimes pass in
how to make a value varying so the collectives type-check (``pbroadcast`` /
``pvary``).

Copies are compared like with like: an element is the same on every device when
it is NaN on every device, or equal (``==``) on every device, so the same
``-inf`` or ``inf`` everywhere matches too. NaN on some devices and a number on
others is a mismatch, and so is ``inf`` against a finite number.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from reprules._errors import ReplicationMismatchError, fmt_axes, mismatch_fix
from reprules._registry import Registration
from reprules import _mode_state
from reprules._shim import _jax
from reprules._shim._types import TypeField, cast_up_tuple, manual_axes, shard_map_mesh

_lock = threading.Lock()
# The largest difference seen per (kernel, output, axis) since the last take.
_largest: dict[tuple[str, int, str], tuple[tuple[float, int], str]] = {}


def check_outputs(field: TypeField, reg: Registration, outs: Sequence[Any]) -> None:
    """Under ``reprules.verify()`` (vma and mat eras): checks ``outs`` of one call of
    ``reg``'s kernel, each replicated over the manual axes its type says."""
    if _mode_state.verifying():
        varying = [field.varying(jax.typeof(o)) for o in outs]
        with shard_map_mesh():  # the checks' own casts, where code around the call hid it
            insert_checks(reg, outs, varying, manual_axes(), cast_up_tuple)


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
        if getattr(out, "size", 1) == 0:
            continue
        value = jax.lax.stop_gradient(out)
        if dtype == jnp.bool_:
            value = value.astype(jnp.int32)
        for axis in mesh_axes:
            if axis in varying:
                continue
            # all_gather, not pmax/pmin: JAX 0.4.28 has no replication rule for pmax.
            gathered = jax.lax.all_gather(make_varying(value, (axis,)), axis)
            jax.debug.callback(functools.partial(_report, reg.name, repr(reg.rule), index, axis,
                                                 tuple(mesh_axes)), *_compare(gathered))


def _compare(gathered: Any) -> tuple[Any, Any, Any]:
    """(largest difference, elements that differ, elements NaN on only some
    devices) of the copies stacked along axis 0, comparing like with like."""
    high, low = gathered.max(axis=0), gathered.min(axis=0)
    if jnp.issubdtype(gathered.dtype, jnp.inexact):
        nan = jnp.isnan(gathered)
        some_nan = nan.any(axis=0)
        nan_mismatch = jnp.sum(some_nan & ~nan.all(axis=0))
        differs = ~some_nan & (high != low)  # inf == inf: the same infinity everywhere matches
    else:
        nan_mismatch = jnp.zeros((), jnp.int32)
        differs = high != low  # exact, even where the float difference below rounds to 0
        high, low = high.astype(jnp.float32), low.astype(jnp.float32)
    size = jnp.where(differs, jnp.abs(high - low), 0)  # inf against finite (or -inf): inf
    return jnp.max(size), jnp.sum(differs), nan_mismatch


def _report(kernel: str, rule: str, index: int, axis: str, mesh_axes: tuple[str, ...], spread: Any,
            differing: Any, nan_mismatch: Any) -> None:
    # Runs once per device. It records rather than raises: an exception raised
    # by several devices' callbacks leaks into later executions on JAX <= 0.5.
    # reprules.verify() raises on exit (after jax.effects_barrier()).
    largest = float(np.max(np.asarray(spread)))
    count = int(np.max(np.asarray(differing)))
    nans = int(np.max(np.asarray(nan_mismatch)))
    if count == 0 and nans == 0:
        return
    nan_text = f"NaN on some devices and not on others at {nans} element(s)"
    if count:
        how = f" by up to {largest:.6g} at {count} element(s)" + (f", and is {nan_text}" if nans else "")
    else:
        how = f": {nan_text}"
    message = (
        f"Verify mode: output {index} of kernel {kernel!r} is declared replicated over mesh axis "
        f"{axis!r} by its rule {rule}, but it differs across {axis!r}{how} "
        f"(mesh axes {fmt_axes(mesh_axes)}, JAX {_jax.JAX_VERSION}).\n"
        "Why: the rule promises JAX a replication the kernel does not deliver; JAX then skips "
        "collectives and gradients or out_specs=P() results are silently wrong.\n"
        + mismatch_fix(kernel, rule, index, axis)
    )
    with _lock:
        key = (kernel, index, axis)
        rank = (largest, nans)
        if key not in _largest or rank > _largest[key][0]:
            _largest[key] = (rank, message)


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
