"""``jax.grad`` through a ``pallas_call``: JAX's bare refusal, given the kernel, why and the fix.

A ``pallas_call`` has a JVP rule (a second kernel computing outputs and tangents
together) but no VJP: reverse mode (``jax.grad``, ``jax.vjp``, ``jax.linearize``)
cannot split that kernel into a forward and a backward pass, and JAX says only
"Linearization failed to produce known values for all output primals" (0.4.28:
a bare ``AssertionError``), naming no kernel and not the ``custom_vjp`` that
fixes it. reprules appends its note to that message (as ``out_specs_note``
appends to JAX's out_specs error), naming the kernels; the exception stays
JAX's, so nothing changes for a program that does not raise it. Where JAX
raises it:

* inside the ``pallas_call``'s own bind, where reverse mode linearizes it from
  its JVP (direct linearize: the default from 0.7, ``jax_use_direct_linearize``
  on 0.5 - 0.6): the bind hook (``_pallas_hooks``) calls :func:`explain` with
  its kernel;
* at the end of ``ad.linearize``, once the whole function was traced (JVP then
  partial eval: the default to 0.6, ``jax_use_direct_linearize=False`` on 0.7 -
  0.9; 0.10 has only direct linearize): the kernels whose JVP rule ran during
  that linearize are named. A ``jit`` whose JVP JAX cached from an earlier
  trace runs no rule, so its kernels go unnamed (and JAX's message unchanged).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from reprules._messages import gradients
from reprules._shim.kernels._identity import PallasCall
from reprules._shim.plumbing import _jax
from reprules._shim.plumbing._patches import Patches

_JAX_TEXT = "Linearization failed"
_LIMIT = 8  # kernels named in one note, at most


class _Differentiated(threading.local):
    """The calls whose JVP rule ran in the innermost running ``ad.linearize`` (None: none runs)."""

    def __init__(self) -> None:
        self.calls: list[PallasCall] | None = None


_differentiated = _Differentiated()


def described(call: PallasCall) -> str:
    """``'name' (defined at file:line)``, as the note names a kernel."""
    site = call.site_text
    return f"{call.name!r}{f' ({site})' if site else ''}"


def explain(err: BaseException, calls: Sequence[PallasCall]) -> None:
    """Appends the note to ``err`` where it is JAX's refusal of reverse mode (once)."""
    text = str(err.args[0]) if len(err.args) == 1 else ""
    if not calls or gradients.REVERSE_MODE_MARK in text:
        return
    if not (isinstance(err, ValueError) and text.startswith(_JAX_TEXT)
            or type(err) is AssertionError and not err.args):  # 0.4.28: `assert all(... is_known() ...)`
        return
    kernels = list(dict.fromkeys(described(call) for call in calls))[:_LIMIT]
    note = gradients.reverse_mode_note(kernels, _jax.JAX_VERSION)
    err.args = (f"{text}\n\n{note}" if text else note,)


def install(patches: Patches) -> None:
    """Where ``ad.linearize`` runs JVP then partial eval (0.4.28 - 0.9; ``ad.linearize`` is
    direct linearize only from 0.10, a name that kept its spelling), records the ``pallas_call``s
    it differentiates and explains its refusal. Direct linearize needs nothing here."""
    if _jax.version_tuple()[:2] >= (0, 10):
        return
    ad = _jax.module("jax._src.interpreters.ad")
    prim = _jax.pallas_call_p()
    original_jvp = ad.primitive_jvps[prim]  # after pallas_call's own JVP fix (0.7 - 0.8), which it wraps
    original_linearize = ad.linearize

    def jvp(primals: Any, tangents: Any, **params: Any) -> Any:
        calls = _differentiated.calls
        if calls is not None and len(calls) < _LIMIT:
            calls.append(PallasCall.of(params))
        return original_jvp(primals, tangents, **params)

    def linearize(*args: Any, **kwargs: Any) -> Any:
        outer, _differentiated.calls = _differentiated.calls, []
        try:
            return original_linearize(*args, **kwargs)
        except (ValueError, AssertionError) as err:
            explain(err, _differentiated.calls or [])
            raise
        finally:
            _differentiated.calls = outer

    patches.setitem(ad.primitive_jvps, prim, jvp, label="jax._src.interpreters.ad.primitive_jvps[pallas_call]")
    patches.setattr(ad, "linearize", linearize)
