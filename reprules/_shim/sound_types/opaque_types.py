"""Sound types for rule-less opaque calls (vma and mat eras).

From JAX 0.6 a primitive's abstract eval *is* its replication rule. JAX's own
primitives follow ``standard_vma_rule`` (outputs vary over the union of the
inputs' axes), but an opaque call is typed by whoever wrote it: a user
``Primitive`` whose abstract eval returns ``ShapedArray(shape, dtype)``,
``ffi_call`` from 0.8.2, ``jax.pure_callback`` and ``io_callback`` (their
result shapes, replicated whatever they say), jax-triton's ``triton_call``.
Such an output is typed replicated while it differs per device:
``out_specs=P()`` returns one device's block, and a gradient through it
misses its psum, silently, where checking off is right.

Where such a call has no rule and an output is typed with fewer axes than its
inputs vary over, reprules types every output by the union of the inputs'
axes (JAX's rule for its ordinary primitives, and what NVIDIA Warp chose,
warp#1860), casts the inputs up to that union first (the casts' transposes
psum the cotangents of replicated inputs, so gradients are exact), and warns
once per call site. ``io_callback`` runs on every device against host state,
so its results may differ per device even from replicated inputs: they are
typed varying over every manual axis of the ``shard_map`` (it has no JVP or
transpose: nothing to cast), with the same warning; one JAX binds for its own
machinery (its Pallas interpreters simulate kernels through it) is JAX's
(``strict.jax_own``). A rule (a callback's is registered on its host function:
``rules/callbacks.py``), ``reprules.strict()`` (which refuses) and
``REPRULES_SOUND_TYPES=0`` (which keeps JAX's typing) each leave it alone; the
warning shows the decorator line that declares the rule.

"Opaque" is decided once per primitive object: JAX's FFI and callback
primitives, and every primitive no ``jax`` module defines. JAX's own
collectives and higher-order primitives type their outputs from what they
compute and are never touched.

The mode is read per trace: JAX caches traces and abstract evals by its own
config only, so where a trace may start (every bind, every ``jit`` call that
goes through Python) a change of a mode's environment variable since the last
look drops JAX's caches (``_mode_state.notice_env``). A ``jit`` function JAX
dispatches from its C++ cache (compiled already, no host callback in it) runs
no Python: it keeps its program until the next trace anywhere drops that cache.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

from reprules import _errors, _mode_state
from reprules._messages import out_types
from reprules._shim.plumbing import _frames, _jax
from reprules._shim.kernels import _identity
from reprules._shim.rules import _resolve, callbacks
from reprules._shim.safety import strict
from reprules._shim.sound_types import out_specs_note
from reprules._shim.plumbing._patches import Patches
from reprules._shim.rules._resolve import Opaque
from reprules._shim.plumbing._types import (TypeField, call_axes, checking, hidden_axes, in_checked_shard_map,
                                            manual_axes)

_lock = threading.RLock()
_seen: set[Any] = set()  # every primitive bound under checking since install: classified once
_implicit: dict[Any, Patches] = {}  # rule-less opaque primitives hooked by this module
_warned: set[tuple[str, str]] = set()  # (primitive, site): one warning per call site
_jax_defined: set[int] = set()  # ids of the primitives some jax module defines (refreshed on a miss)
_jax_bind: Callable[..., Any] | None = None  # JAX's Primitive.bind, while the class hook holds its place

# JAX's own primitives whose outputs are typed by the caller's result shapes.
_JAX_FFI = (
    ("jax._src.ffi", "ffi_call_p"),  # 0.5+ (reprules hooks it at activation too)
    ("jax._src.extend.ffi", "ffi_call_p"),  # 0.4.31 - 0.4.38
)


@functools.cache
def _jax_opaque() -> frozenset[Any]:
    return _jax.primitives(_JAX_FFI) | callbacks.callbacks()


def widening_on() -> bool:
    """Sound types apply: not switched off, and strict mode (which refuses) is off."""
    return _mode_state.sound_types() and not _mode_state.strict_on()


def install(field: TypeField, patches: Patches, attach: Callable[[TypeField, Opaque, Patches], None]) -> None:
    """Hooks ``Primitive.bind`` so that the first bind of each primitive under
    checking classifies it; a rule-less opaque one gets ``attach``'s hooks
    (the same as a registered primitive's, whose rule lookup then finds none)."""
    global _jax_bind
    original: Callable[..., Any] = _jax.core.Primitive.bind
    _jax_bind = original

    def bind(prim: Any, *args: Any, **params: Any) -> Any:
        _mode_state.notice_env()  # a mode switched by its environment variable: JAX's caches dropped
        hooked: Any = prim.__dict__.get("bind")
        if hooked is not None and getattr(hooked, "reprules_opaque_hook", False):
            # reprules' per-primitive hook, reached through `prim.bind` looked up before it was
            # installed (a bound method kept at import): its casts must not be skipped.
            return hooked(*args, **params)
        if prim in _seen or not checking() or _jax_kind(prim):
            return original(prim, *args, **params)
        with _lock:
            _seen.add(prim)
            hook = "bind" not in vars(prim) and _opaque(prim)  # an instance hook: attached already
            if hook:
                own = Patches()
                attach_callback(field, _resolve.describe(prim), own, attach)
                _implicit[prim] = own
        return prim.bind(*args, **params) if hook else original(prim, *args, **params)

    patches.setattr(_jax.core.Primitive, "bind", bind)
    patches.on_undo(_forget_all)
    _notice_at_jit(patches)


def _notice_at_jit(patches: Patches) -> None:
    """Every ``jit`` call that goes through Python (a trace at the top, any ``jit`` inside one,
    ``.trace``, ``make_jaxpr``) looks for a mode switched by its environment variable before
    JAX looks up its cached trace (``pjit._infer_params``, 0.6 - 0.12)."""
    pjit = _jax.module("jax._src.pjit")
    infer_params: Callable[..., Any] | None = getattr(pjit, "_infer_params", None)
    if infer_params is None:
        return

    def _infer_params(*args: Any, **kwargs: Any) -> Any:
        _mode_state.notice_env()
        return infer_params(*args, **kwargs)

    patches.setattr(pjit, "_infer_params", _infer_params)


def jax_bind(prim: Any) -> Callable[..., Any]:
    """What a per-primitive hook calls to bind ``prim``: its own ``bind`` where something
    set one, else JAX's (never the class hook, which sends calls to the per-primitive hook)."""
    if "bind" not in vars(prim) and _jax_bind is not None:
        return functools.partial(_jax_bind, prim)
    bind: Callable[..., Any] = prim.bind
    return bind


def hooked(prim: Any) -> bool:
    """Whether this module already gave ``prim`` the per-primitive hooks."""
    return prim in _implicit


def forget(prim: Any) -> None:
    """Classify ``prim`` again at its next bind (its registered hooks were removed)."""
    with _lock:
        _seen.discard(prim)


def _forget_all() -> None:
    global _jax_bind
    with _lock:
        _jax_bind = None
        pending = list(_implicit.values())
        _implicit.clear()
        _seen.clear()
    for patches in reversed(pending):
        patches.undo_all()


def _jax_kind(prim: Any) -> bool:
    """A primitive of one of JAX's own subclasses (``ad.VJPNode``, made anew for each
    ``jit`` under ``vjp``; hijax's): JAX's, never opaque, and not kept in ``_seen``."""
    kind = type(prim)
    return kind is not _jax.core.Primitive and kind.__module__.startswith("jax.")


def _opaque(prim: Any) -> bool:
    if prim in _jax_opaque():
        return True
    if id(prim) in _jax_defined:
        return False
    _jax_defined.update(_jax.defined_primitives())  # a jax module imported since: look again
    return id(prim) not in _jax_defined


def widening(field: TypeField, in_avals: Sequence[Any], out_avals: Sequence[Any]) -> frozenset[str] | None:
    """The union of the inputs' varying axes, where an output (with a shape) is
    typed with fewer; None where JAX's types already hold them all."""
    union = frozenset().union(*(field.varying(a) for a in in_avals))
    if not union:
        return None
    short = any(hasattr(o, "shape") and union - field.varying(o) for o in out_avals)
    return union if short else None


def axes_here(field: TypeField, in_avals: Sequence[Any]) -> tuple[str, ...]:
    """The manual axes of this call (those known, where code hid the mesh)."""
    hidden = hidden_axes([field.varying(a) for a in in_avals])
    return hidden.known if hidden is not None else manual_axes()


def retype(field: TypeField, in_avals: Sequence[Any], out_avals: Sequence[Any]) -> list[Any]:
    """Each output typed varying over the union of its axes and the inputs'."""
    union = widening(field, in_avals, out_avals)
    if union is None:
        return list(out_avals)
    with call_axes(axes_here(field, in_avals), in_avals):
        return [field.retype(o, field.varying(o) | union) if hasattr(o, "shape") else o for o in out_avals]


def warn(op: Opaque, params: dict[str, Any], union: frozenset[str], out_avals: Sequence[Any],
         field: TypeField) -> None:
    """One :class:`reprules.ReplicationWarning` per primitive and call site."""
    name = op.name(params)
    user = _frames.user_frame()
    key = (name, f"{user.f_code.co_filename}:{user.f_lineno}" if user is not None else "")
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    site = _frames.annotation_site(depth=2)
    short = sorted({a for o in out_avals if hasattr(o, "shape") for a in union - field.varying(o)})
    if op.prim in callbacks.io_callbacks():
        message = _io_callback_message(name, params, site, short, union)
    elif op.prim in callbacks.callbacks():
        message = _pure_callback_message(name, params, site, short, union)
    else:
        target, importing = _rule_target(op, name)
        message = out_types.sound_type_message(
            op.kind, name, site, short, union, manual_axes(), _jax.JAX_VERSION, target=target, importing=importing)
    if user is None:
        warnings.warn(message, _errors.ReplicationWarning, stacklevel=3)
    else:  # attributed to the user's line, as warnings filters and pytest report it
        warnings.warn_explicit(message, _errors.ReplicationWarning, user.f_code.co_filename, user.f_lineno,
                               module=str(user.f_globals.get("__name__")),
                               registry=user.f_globals.setdefault("__warningregistry__", {}))


def _pure_callback_message(name: str, params: dict[str, Any], site: str, short: Sequence[str],
                           typed: frozenset[str]) -> str:
    """:class:`ReplicationWarning` for a rule-less ``pure_callback`` typed by the union of its inputs' axes."""
    return out_types.callback_message(name, site, short, typed, manual_axes(), _jax.JAX_VERSION,
                                      callbacks.rule_fix(params, False, manual_axes()), io=False)


def _io_callback_message(name: str, params: dict[str, Any], site: str, short: Sequence[str],
                         typed: frozenset[str]) -> str:
    """:class:`ReplicationWarning` for a rule-less ``io_callback`` typed varying over every manual axis."""
    return out_types.callback_message(name, site, short, typed, manual_axes(), _jax.JAX_VERSION,
                                      callbacks.rule_fix(params, True, manual_axes()), io=True)


def _rule_target(op: Opaque, name: str) -> tuple[str, str]:
    """What a rule for this call is registered on, as the user writes it, and the line that
    imports it ("" for none)."""
    if op.kind == "FFI target":
        return f"reprules.ffi_target({name!r})", ""
    if op.kind == "Triton kernel":
        return name, ""  # registered on the @triton.jit function itself
    found = _module_attribute(op.prim)
    if found is None:
        return f"<the {name!r} primitive>", ""
    # `from m import a`, not `m.a`: a package may shadow its module with a function of the same
    # name (eformer.callib.triton_call), which the attribute path would reach instead.
    module, attribute = found
    return attribute, "" if module == "__main__" else f"from {module} import {attribute}"


def _module_attribute(obj: Any) -> tuple[str, str] | None:
    """(module, attribute) holding ``obj`` at module level, or None: where the user reaches a
    library's primitive to register its rule. The user's script first, then public modules,
    then the shortest name. A scan of every module's namespace: run once per warning."""
    found = []
    for module_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attribute, value in list(namespace.items()):
            if value is obj and not attribute.startswith("__"):
                private = any(part.startswith("_") for part in module_name.split(".")) or attribute.startswith("_")
                found.append((module_name != "__main__", private, len(module_name), module_name, attribute))
    return min(found)[3:] if found else None


def attach_callback(field: TypeField, op: Opaque, patches: Patches,
                    attach: Callable[[TypeField, Opaque, Patches], None]) -> None:
    """The hooks of any opaque primitive: ``attach``'s (a rule, else the union of the inputs'
    axes), or for ``io_callback`` :func:`_attach_io_callback`'s around them."""
    if op.prim in callbacks.io_callbacks():
        _attach_io_callback(field, op, patches, attach)
    else:
        attach(field, op, patches)


def _attach_io_callback(field: TypeField, op: Opaque, patches: Patches,
                        attach: Callable[[TypeField, Opaque, Patches], None]) -> None:
    """``io_callback``: a call whose host function has a rule is typed by it (``attach``'s hooks,
    as a user primitive's); each output of any other typed varying over every manual axis (and
    the call site warned about once), unless JAX bound it for itself or the mode keeps JAX's typing."""
    prim = op.prim
    original_abstract_eval = prim.abstract_eval
    original_bind = jax_bind(prim)
    attach(field, op, patches)
    ruled_abstract_eval, ruled_bind = prim.abstract_eval, prim.bind

    def sound_here(params: dict[str, Any]) -> bool:
        return widening_on() and in_checked_shard_map() and not strict.jax_own(params)

    def abstract_eval(*avals: Any, **params: Any) -> Any:
        if op.lookup(params) is not None:
            return ruled_abstract_eval(*avals, **params)
        out, effects = original_abstract_eval(*avals, **params)
        if not sound_here(params):
            return out, effects
        axes = axes_here(field, avals)
        with call_axes(axes, avals):
            return [field.retype(o, field.varying(o) | frozenset(axes)) if hasattr(o, "shape") else o
                    for o in out], effects

    def bind(*args: Any, **params: Any) -> Any:
        if op.lookup(params) is not None:
            return ruled_bind(*args, **params)
        if sound_here(params):
            avals = [jax.typeof(a) for a in args]
            outs = original_abstract_eval(*avals, **params)[0]
            axes = frozenset(axes_here(field, avals))
            if any(hasattr(o, "shape") and axes - field.varying(o) for o in outs):
                # Typed as by a rule: a custom_vjp around it gets reprules' exact psum of a cotangent
                # varying over axes its primal does not (JAX would refuse the pass-through bwd).
                _identity.note_registered_call()
                warn(op, params, axes, outs, field)
                out_specs_note.record(f"the JAX callback {prim.name!r}, which runs on every device", axes)
        return original_bind(*args, **params)

    bind.reprules_opaque_hook = True  # type: ignore[attr-defined]  # the class hook sends stale binds here
    patches.setattr(prim, "abstract_eval", abstract_eval)
    patches.setattr(prim, "bind", bind)
