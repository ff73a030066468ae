"""Opt-in modes: verify (catch lying rules), strict (no silent typing) and
inference (rules derived from kernel bodies).

Each is read when a function is *traced*; switching one drops JAX's cached
traces so the next call is traced again in the new mode: a context on entry and
exit, an environment variable (``REPRULES_VERIFY``, ``REPRULES_STRICT``,
``REPRULES_INFER``, ``REPRULES_SOUND_TYPES``) at the first trace after it changed.
Each is free when off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from reprules import _mode_state
from reprules._mode_state import (
    DORMANT_ENV, INFER_ENV, STRICT_ENV, VERIFY_ENV, dormant, enter, inferring, inferring_by_default, leave,
    strict_on, verifying,
)

__all__ = ["DORMANT_ENV", "INFER_ENV", "STRICT_ENV", "VERIFY_ENV", "dormant", "inference", "inferring",
           "inferring_by_default", "strict", "strict_on", "verify", "verifying"]


def _retrace() -> None:
    from reprules import _shim  # lazy: imports JAX, only when a mode is switched

    _shim.clear_jax_caches()


def _env_changed() -> None:
    """A mode's environment variable changed since the last trace (``_mode_state.notice_env``):
    strict mode's hook follows it, and no trace of the old mode is reused."""
    from reprules import _shim  # lazy: imports JAX (imported already: a trace is starting)

    _shim.sync_strict()
    _shim.clear_jax_caches()


_mode_state.env_changed = _env_changed


@contextlib.contextmanager
def verify() -> Iterator[None]:
    """Checks at run time that outputs declared replicated really are.

    Inside this context (or for a whole run with ``REPRULES_VERIFY=1``), every
    output that a rule declares replicated over a mesh axis is compared across
    that axis when the step runs; a difference raises
    :class:`reprules.ReplicationMismatchError` naming the kernel, the rule, the
    axis and the largest difference (copies compare like with like: the same
    NaN, ``inf`` or ``-inf`` on every device is no mismatch, NaN against a
    number is), when the context exits (checks run on the
    devices; the context waits for them with ``jax.effects_barrier()``). With
    the environment variable, reprules' pytest plugin fails the test instead.
    Each output costs an ``all_gather`` over every axis its rule declares it
    replicated over, plus a host callback, so use it in tests, not in
    production. Works under ``jit``, ``grad`` and ``shard_map``.

    Example:
        ```python
        with reprules.verify():
            jax.jit(step)(params, batch)
        ```
    """
    from reprules import _shim  # lazy: imports JAX

    _shim.take_mismatches()  # forget anything found before this context
    enter("verify")
    _retrace()
    try:
        yield
    finally:
        leave("verify")
        _retrace()
    _shim.raise_if_mismatched()  # only when the body itself did not raise


@contextlib.contextmanager
def strict() -> Iterator[None]:
    """Refuses opaque primitives that JAX would silently type as replicated.

    From JAX 0.6, an opaque primitive without a rule (``ffi_call`` from 0.8.2,
    jax-triton's ``triton_call``, a user primitive whose abstract eval drops the
    varying axes, ``jax.pure_callback`` and ``io_callback``) gets outputs typed
    *replicated* even when its inputs vary (an ``io_callback``'s may differ per
    device whatever its inputs): ``out_specs=P()`` is then accepted and returns
    one device's shard. Inside this context (or with ``REPRULES_STRICT=1``), such
    a call raises :class:`reprules.StrictModeError` while tracing (the callbacks
    JAX's Pallas interpreters bind for themselves are JAX's, and left alone; a
    callback whose host function has a rule is typed by it, and accepted).
    JAX <= 0.5 already refuses primitives without a rule, and types both
    callbacks' results varying over every mesh axis, so there this mode changes
    nothing.
    """
    from reprules import _shim  # lazy: imports JAX

    enter("strict")
    _shim.sync_strict()
    _retrace()
    try:
        yield
    finally:
        leave("strict")
        _shim.sync_strict()
        _retrace()


@contextlib.contextmanager
def inference(enabled: bool = True) -> Iterator[None]:
    """Derives a rule for every Pallas kernel that has none, from its body.

    **By default** (no context needed), reprules already does this for a kernel
    that JAX itself would refuse under checking: a ``pallas_call`` or ``pl.kernel``
    whose ``out_shape`` does not say how its outputs vary (and, on JAX 0.4.28 - 0.5,
    every ``pallas_call``, which ``check_rep`` refuses; on 0.8 - 0.9, a ``pl.kernel``
    that JAX would type replicated). A program JAX accepts is left as it is.

    Inside ``inference()`` (or for a whole run with ``REPRULES_INFER=1``), every
    ``pallas_call`` whose kernel has no registered rule gets one derived from its
    kernel jaxpr, on every JAX regime, its hand annotations checked against it
    too: each output varies over the axes of the inputs it depends on (through
    values, refs, aliasing, scalar prefetch and control flow), and inputs are cast
    up only as far as those outputs vary. A registered rule always wins.

    ``inference(False)`` (or ``REPRULES_INFER=0`` for a whole run) turns both
    off, and wins over ``inference()``: a rule-less kernel then gets the
    :class:`reprules.MissingRuleError` that teaches what to register.

    The derivation is sound or refuses: it succeeds only when every equation
    of the body (through ``cond``, loops, ``run_scoped`` and calls) is known to
    be local. A body that reads the device's identity (``axis_index``),
    communicates (collectives, a DMA or semaphore with a ``device_id``) or holds
    a primitive reprules does not know is refused with a
    :class:`reprules.MissingRuleError` naming the primitive and its source line,
    where JAX itself would refuse the kernel; elsewhere it is left to JAX.

    Example:
        ```python
        with reprules.inference():
            grads = jax.jit(step)(params, batch)   # hand annotations checked too

        with reprules.inference(False):
            grads = jax.jit(step)(params, batch)   # MissingRuleError for a rule-less kernel
        ```
    """
    from reprules import _shim  # lazy: imports JAX

    mode = "infer" if enabled else "no_infer"
    with _shim.lock:
        enter(mode)
        try:
            if enabled:
                _shim.activate()
        except BaseException:
            leave(mode)
            raise
    _retrace()
    try:
        yield
    finally:
        with _shim.lock:
            leave(mode)
            _shim.release()
        _retrace()
