"""The annotation union: an out_shape annotated by hand that says an output is
replicated over an axis the kernel's body (analysed by inference) makes it
depend on.

JAX believes an annotation, so such an output would be typed replicated and a
gradient through it would miss its psum (silently wrong under JAX alone:
tokamax's ragged_dot VJP types the weight gradient like the weight). More
varying is always sound, so reprules types the output by the *union* of the
annotation and the derived axes, warns once per kernel
(:class:`reprules.ReplicationWarning`), and a ``custom_vjp`` around the kernel
gets the psum from ``custom_vjp``. ``reprules.strict()`` keeps the refusal
(:class:`reprules.RuleError`), and so does an output JAX types like an aliased
input (widening it would need the input cast up, which is the user's to do).
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Sequence
from types import FrameType
from typing import Any

from reprules import _errors
from reprules._mode_state import strict_on
from reprules._shim import _jax
from reprules._shim._types import TypeField, manual_axes

_warned: set[tuple[str, str]] = set()  # (kernel, site): one warning per kernel
_lock = threading.Lock()
_SKIP = ("jax.", "jaxlib.", "reprules.", "contextlib", "functools")


def annotation_site(depth: int = 5) -> str:
    """Where the kernel was called from, outside JAX and reprules: the innermost
    frames, where its out_shape (and so the annotation) was built or passed."""
    frame: FrameType | None = sys._getframe(1)
    found: list[str] = []
    while frame is not None and len(found) < depth:
        module = str(frame.f_globals.get("__name__", ""))
        if not module.startswith(_SKIP) and module != "jax":
            found.append(f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})")
        frame = frame.f_back
    return " <- ".join(found)


def widen(field: TypeField, kernel: str, site: str, out_avals: Sequence[Any],
          derived: Sequence[frozenset[str]], kept: Sequence[bool], aliased: dict[int, int],
          can_widen: bool = True) -> dict[int, Any]:
    """``{output index: type}`` for each kept (hand-annotated) output that the
    body needs to vary over more axes than its annotation says: the union.
    Raises :class:`reprules.RuleError` instead under ``reprules.strict()``, for
    an aliased output, or where the caller cannot retype (``can_widen``)."""
    widened: dict[int, Any] = {}
    for i, (aval, needed, keep) in enumerate(zip(out_avals, derived, kept)):
        have = field.varying(aval)
        missing = needed - have
        if not (keep and missing):
            continue
        if strict_on() or i in aliased or not can_widen:
            raise _errors.RuleError(_errors.annotation_message(
                kernel, i, missing, needed, manual_axes(), _jax.JAX_VERSION, aliased.get(i)))
        widened[i] = field.retype(aval, have | needed)
        with _lock:
            first = (kernel, site) not in _warned
            _warned.add((kernel, site))
        if first:
            warnings.warn(_errors.annotation_union_message(
                kernel, i, missing, have | needed, manual_axes(), _jax.JAX_VERSION, annotation_site()),
                _errors.ReplicationWarning, stacklevel=2)
    return widened
