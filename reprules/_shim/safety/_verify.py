"""Verify mode's run-time check, inserted after each registered kernel call.

For every output and every mesh axis its type calls replicated, the kernel's
output is gathered across that axis (``all_gather``) and a host callback records
the largest difference between its copies (``reprules.verify()`` raises on exit;
the pytest plugin fails the test). Only public JAX API is used; regimes pass in
how to make a value varying so the collectives type-check (``pbroadcast`` /
``pvary``).

Where JAX cannot lower a check, it is skipped with a :class:`reprules.VerifyWarning`
(once per kernel, axes and reason) that says why, so that ``verify()`` never
breaks a program that runs without it (:func:`plan`): axes of a ``vmap`` with
``spmd_axis_name`` (JAX refuses the cast: the batched values vary over them); a
``shard_map`` nested in another on JAX 0.6 - 0.9 (the host callback does not
lower there); a partially manual one on 0.4 (XLA aborts on the callback). On
0.5 - 0.6, where XLA aborts on an ``all_gather`` in a partially manual
``shard_map``, copies are compared by ``pmax``/``pmin`` instead.

Copies are compared like with like: an element is the same on every device when
it is NaN on every device, or equal (``==``) on every device, so the same
``-inf`` or ``inf`` everywhere matches too. NaN on some devices and a number on
others is a mismatch, and so is ``inf`` against a finite number.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from reprules._errors import ReplicationMismatchError, VerifyWarning, fmt_axes
from reprules._messages.advice import mismatch_fix
from reprules._registry import Registration
from reprules import _mode_state
from reprules._shim.plumbing import _jax
from reprules._shim.plumbing._types import TypeField, cast_up_tuple, manual_axes, shard_map_mesh

_VERSION = _jax.version_tuple()[:2]

_lock = threading.Lock()
# The largest difference seen per (kernel, output, axis) since the last take.
_largest: dict[tuple[str, int, str], tuple[tuple[float, int], str]] = {}


def check_outputs(field: TypeField, reg: Registration, outs: Sequence[Any]) -> None:
    """Under ``reprules.verify()`` (vma and mat eras): checks ``outs`` of one call of
    ``reg``'s kernel, each replicated over the manual axes its type says."""
    if _mode_state.verifying():
        varying = [field.varying(jax.typeof(o)) for o in outs]
        with shard_map_mesh():  # the checks' own casts, where code around the call hid it
            mesh = _jax.mesh_lib.get_abstract_mesh()
            axes = manual_axes()
            partial = any(getattr(t, "name", "Manual") != "Manual" for t in getattr(mesh, "axis_types", ()))
            spmd = frozenset(getattr(_jax.core.get_axis_env(), "spmd_axis_names", ()) or ())
            insert_checks(reg, outs, varying, axes, cast_up_tuple, partial=partial, spmd=spmd,
                          nested=(0, 6) <= _VERSION < (0, 10) and _staging_depth() > 1)


# Why a check is skipped, and how to have it: (why, fix), by reason.
_SKIPS = {
    "spmd": ("the kernel runs under jax.vmap(..., spmd_axis_name=...) naming these axes: JAX types "
             "every batched value varying over them, so it refuses the check's cast of the output "
             "over them (pvary), and a gather over them would not compare like with like",
             "verify the kernel outside that vmap (on one batch element), or without spmd_axis_name"),
    "nested": ("the kernel runs in a shard_map nested in another one, where this JAX cannot lower the "
               "host callback the check reports through ('Cannot lower jaxpr with verifier errors', "
               "'Unhandled OpSharding type', or a crash; JAX 0.10 lowers it)",
               "verify the kernel in a shard_map of its own (not nested), or on JAX 0.10+"),
    "partial": ("the shard_map is partially manual (auto=...): XLA in this JAX aborts the process on a "
                "host callback there",
                "verify the kernel in a shard_map manual over every mesh axis, or on JAX 0.5+"),
}
_skipped: set[tuple[str, tuple[str, ...], str]] = set()  # warned once per (kernel, axes, reason)


def plan(mesh_axes: Sequence[str], *, partial: bool, spmd: frozenset[str],
         nested: bool) -> tuple[dict[str, str], bool]:
    """``({axis: why its checks are skipped}, whether to compare by pmax/pmin)`` where
    the kernel runs: a check JAX cannot lower is skipped, never attempted (a failed
    lowering, or an XLA abort, would break a program that runs without verify()).
    ``partial``: the shard_map leaves some mesh axes automatic; ``spmd``: the
    ``spmd_axis_name`` axes of the enclosing vmaps; ``nested``: a shard_map in another."""
    if nested or (partial and _VERSION < (0, 5)):
        return dict.fromkeys(mesh_axes, "nested" if nested else "partial"), False
    # 0.5 - 0.6: XLA aborts on an all_gather in a partially manual shard_map, not on pmax.
    return {a: "spmd" for a in mesh_axes if a in spmd}, partial and _VERSION < (0, 7)


def _staging_depth() -> int:
    """How many shard_map bodies (JAX 0.6 - 0.9 ``_shard_map_staging``) are being traced
    around this point: JAX's abstract mesh is the same inside a nested shard_map as
    inside one manual over every axis, so the frames are what tells them apart."""
    staging = getattr(_jax.module("jax._src.shard_map"), "_shard_map_staging", None)
    code = getattr(staging, "__code__", None)
    depth = 0
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and code is not None:
        depth += frame.f_code is code
        frame = frame.f_back
    return depth


def _warn_skipped(reg: Registration, skipped: dict[str, str], mesh_axes: Sequence[str]) -> None:
    for reason in sorted(set(skipped.values())):
        axes = tuple(sorted(a for a, r in skipped.items() if r == reason))
        key = (reg.name, axes, reason)
        with _lock:
            if key in _skipped:
                continue
            _skipped.add(key)
        why, fix = _SKIPS[reason]
        warnings.warn(
            f"reprules.verify() skipped its check of kernel {reg.name!r} (rule {reg.rule!r}) over mesh "
            f"{'axis' if len(axes) == 1 else 'axes'} {fmt_axes(axes)} (mesh axes {fmt_axes(mesh_axes)}, "
            f"JAX {_jax.JAX_VERSION}): JAX cannot lower that check here; the program runs as without "
            f"verify(), the rule taken on trust over {fmt_axes(axes)}.\nWhy: {why}.\nFix: {fix}.",
            VerifyWarning, stacklevel=3)


def insert_checks(
    reg: Registration,
    outs: Sequence[Any],
    out_varying: Sequence[frozenset[str]],
    mesh_axes: Sequence[str],
    make_varying: Callable[[Any, tuple[str, ...]], Any],
    *,
    partial: bool = False,
    spmd: frozenset[str] = frozenset(),
    nested: bool = False,
) -> None:
    skipped, reduce = plan(mesh_axes, partial=partial, spmd=spmd, nested=nested)
    checked = [a for a in mesh_axes if a not in skipped]
    wanted = {a for a in mesh_axes for v in out_varying if a not in v}  # the axes a check would run over
    if skipped.keys() & wanted:
        _warn_skipped(reg, {a: r for a, r in skipped.items() if a in wanted}, mesh_axes)
    for index, (out, varying) in enumerate(zip(outs, out_varying)):
        dtype = getattr(out, "dtype", None)
        if dtype is None or not (jnp.issubdtype(dtype, jnp.number) or dtype == jnp.bool_):
            continue
        if getattr(out, "size", 1) == 0:
            continue
        value = jax.lax.stop_gradient(out)
        if dtype == jnp.bool_:
            value = value.astype(jnp.int32)
        for axis in checked:
            if axis in varying:
                continue
            copies = make_varying(value, (axis,))
            # all_gather, not pmax/pmin: JAX 0.4.28 has no replication rule for pmax.
            compared = _compare_reduced(copies, axis) if reduce else _compare(jax.lax.all_gather(copies, axis))
            jax.debug.callback(functools.partial(_report, reg.name, repr(reg.rule), index, axis,
                                                 tuple(mesh_axes)), *compared)


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


def _compare_reduced(copies: Any, axis: str) -> tuple[Any, Any, Any]:
    """:func:`_compare` of each device's copy along ``axis``, by ``pmax``/``pmin``
    rather than a gather (see the module docstring)."""
    high, low = jax.lax.pmax(copies, axis), jax.lax.pmin(copies, axis)
    if jnp.issubdtype(copies.dtype, jnp.inexact):
        nan = jnp.isnan(copies).astype(jnp.int32)
        some_nan, all_nan = jax.lax.pmax(nan, axis) > 0, jax.lax.pmin(nan, axis) > 0
        nan_mismatch = jnp.sum(some_nan & ~all_nan)
        differs = ~some_nan & (high != low)
    else:
        nan_mismatch = jnp.zeros((), jnp.int32)
        differs = high != low
        high, low = high.astype(jnp.float32), low.astype(jnp.float32)
    size = jnp.where(differs, jnp.abs(high - low), 0)
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
