"""The versioned shim: the only code in reprules that touches JAX internals.

One module per regime, chosen once by feature detection:

===========  ================  ============================================
regime       JAX               mechanism
===========  ================  ============================================
``rep``      0.4.28 - 0.5.x    check/rewrite rules (``check_rep=True``)
``vma``      0.6.x  - 0.9.x    ``vma`` in the types (``check_vma=True``)
``mat``      0.10.x - 0.12.x   ``manual_axis_type`` in the types
===========  ================  ============================================

The shim is *armed* once ``import reprules`` and JAX's Pallas are both
imported (``REPRULES_DORMANT=1`` leaves it disarmed): its patches are installed
then, so that a kernel JAX would refuse for want of a rule gets a rule derived
from its body, or reprules' :class:`reprules.MissingRuleError`, even before any
rule exists. For code that calls no registered kernel the patches change only
what the safety page lists: a rule where JAX would refuse, and a sound type
where JAX's is provably too small (``sound_types``); everything else traces,
lowers and computes exactly as with JAX alone. Disarmed, nothing is patched
until the first rule is registered, and everything is restored when the last
one is removed.

The shim is a folder per concern, in layers: a module imports only from its
own folder, the folders below it and reprules' core (``tests/test_layering.py``
checks it, and that no folder imports in a circle). Lowest first:

================  ==========================================================
``plumbing``      JAX's internals behind one module (``_jax``), patch
                  bookkeeping, frames and source lines, each era's types
``kernels``       which kernel an equation belongs to (one lookup per bind)
``inference``     a kernel body in, a rule or a refusal out
``rules``         the rule behind an equation; annotations wider than it
``safety``        ``verify()``'s run-time check, ``strict()``'s refusals
``cotangents``    the psums a ``custom_vjp`` bwd of a kernel needs
``sound_types``   rule-less opaque calls and control flow typed soundly
``entry_points``  ``pallas_call``, ``pl.kernel``/``core_map``, primitives/FFI
``eras``          ``rep``, ``vma``, ``mat``: each installs its adapters
================  ==========================================================

This façade, on top, chooses the era and owns activation, arming and the
per-primitive hooks; the rest of reprules uses the shim through it (and
``plumbing._jax``'s version facts).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import ModuleType

import jax

from reprules import _mode_state, _registry
from reprules._errors import UnsupportedJaxError
from reprules._shim.plumbing import _jax, _source
from reprules._shim.inference import infer
from reprules._shim.rules import _resolve
from reprules._shim.cotangents import _bwd_trace
from reprules._shim.sound_types import opaque_types
from reprules._shim.eras import mat, rep, vma
from reprules._shim.plumbing._patches import Patches
from reprules._shim.rules._resolve import classify as classify
from reprules._shim.rules._resolve import identify as identify
from reprules._shim.plumbing._source import ADDED_SCOPE as ADDED_SCOPE
from reprules._shim.inference.infer import InferredRule as InferredRule
from reprules._shim.safety._verify import raise_if_mismatched as raise_if_mismatched
from reprules._shim.safety._verify import take_mismatches as take_mismatches

JAX_VERSION = _jax.JAX_VERSION
pl_kernel_name = _resolve.kernel_name  # the body's name for a pl.kernel equation (reports)
derive_pallas_rule = infer.registration  # what inference derives for a pallas_call equation (audit)
SUPPORTED = ((0, 4, 28), (0, 13))
SUPPORTED_TEXT = ">=0.4.28,<0.13"

_lock = threading.RLock()
lock = _lock  # held by the façade across registry changes and (de)activation
_regime: ModuleType | None = None
_installed: Patches | None = None
_attached: dict[object, Patches] = {}  # per hooked primitive
_strict_patches: Patches | None = None
_sound_patches: Patches | None = None
_armed = False  # held active without rules (see the module docstring)


def regime() -> ModuleType:
    """The regime module for the installed JAX; raises if JAX is unsupported."""
    global _regime
    with _lock:
        if _regime is None:
            _regime = _detect()
        return _regime


def _detect(version: str = JAX_VERSION) -> ModuleType:
    low, high = SUPPORTED
    if not low <= _jax.version_tuple(version) < high:
        raise UnsupportedJaxError(
            f"reprules supports JAX {SUPPORTED_TEXT}, but JAX {version} is installed.\n"
            "Why: reprules works through JAX internals that move between releases, and "
            "this release has not been tested.\n"
            f"Fix: install a supported JAX (pip install 'jax{SUPPORTED_TEXT}' with the "
            "matching jaxlib), or a reprules release that supports this JAX."
        )
    # Newest first: each later regime keeps some of the older names around.
    for module in (mat, vma, rep):
        if module.detect():
            return module
    raise UnsupportedJaxError(
        f"JAX {JAX_VERSION} is in reprules' supported range {SUPPORTED_TEXT}, but none of "
        "its mechanisms (check_rep rules, vma types, manual_axis_type types) was found.\n"
        "Why: this JAX build differs from the released wheels reprules was tested on.\n"
        "Fix: install the released jax and jaxlib wheels of one version."
    )


def activate() -> None:
    """Installs the regime's patches (idempotent)."""
    global _installed
    with _lock:
        if _installed is not None:
            return
        _installed = _installed_by(regime().install, exclude_frames=True)


def _installed_by(install: Callable[[Patches], None], exclude_frames: bool = False) -> Patches:
    """New patches that ``install`` filled; all undone if it raised."""
    patches = Patches()
    try:
        if exclude_frames:
            _source.exclude_shim_frames(patches)  # sources name the user's code, not the shim
        install(patches)
    except BaseException:
        patches.undo_all()
        raise
    return patches


def attach(target: object) -> None:
    """Installs the per-primitive hooks a registration target needs."""
    with _lock:
        activate()
        kind = classify(target)
        if kind == "primitive":
            op = _resolve.primitive_opaque(target)
        elif kind == "triton":
            op = _resolve.triton_opaque()
        else:
            return  # Pallas kernels and FFI targets use the hooks of activate()
        if op.prim in _attached or opaque_types.hooked(op.prim):
            return  # hooked already (a rule-less opaque call met under checking: the same hooks)
        _attached[op.prim] = _installed_by(lambda patches: regime().attach(op, patches))


def detach(prim: object) -> None:
    with _lock:
        patches = _attached.pop(prim, None)
        if patches is not None:
            patches.undo_all()
            opaque_types.forget(prim)  # rule-less again: classified again at its next bind


def deactivate() -> None:
    """Restores every patched JAX object (idempotent)."""
    global _installed
    with _lock:
        pending = [_attached.pop(prim) for prim in list(_attached)][::-1]  # newest first
        if _installed is not None:
            pending.append(_installed)
            _installed = None
        _undo_each(pending)


def _undo_each(pending: list[Patches]) -> None:
    """Undoes every one, even if a PatchWarning is raised as an error (``-W error``)."""
    try:
        if pending:
            pending[0].undo_all()
    finally:
        if len(pending) > 1:
            _undo_each(pending[1:])


def sync_strict() -> None:
    """Installs or removes strict mode's hook to match ``_mode_state.strict_on()``.

    Only the vma and mat regimes need it: JAX <= 0.5 refuses rule-less primitives itself.
    """
    global _strict_patches
    with _lock:
        module = regime()
        want = _mode_state.strict_on() and hasattr(module, "install_strict")
        if want and _strict_patches is None:
            _strict_patches = Patches()
            module.install_strict(_strict_patches)
        elif not want and _strict_patches is not None:
            patches, _strict_patches = _strict_patches, None
            patches.undo_all()


def arm_sound_types() -> None:
    """Installs the sound typing of rule-less opaque calls and of control flow on a
    varying predicate (vma and mat eras; the rep era, where JAX refuses rule-less calls
    itself: its ``cond`` / ``while_loop`` / ``pmax`` rules, ``eras.rep_gaps``). Held while
    reprules is imported: it changes only types JAX has provably too small (and, on the rep
    era, programs JAX would refuse)."""
    global _sound_patches
    with _lock:
        module = regime()
        if _sound_patches is None and hasattr(module, "install_sound_types"):
            _sound_patches = _installed_by(module.install_sound_types, exclude_frames=True)


def disarm_sound_types() -> None:
    global _sound_patches
    with _lock:
        if _sound_patches is not None:
            patches, _sound_patches = _sound_patches, None
            patches.undo_all()


def active() -> bool:
    return _installed is not None


def arm() -> None:
    """Installs the patches and keeps them while reprules is imported (not only
    while rules are registered)."""
    global _armed
    with _lock:
        activate()
        _armed = True


def disarm() -> None:
    """Back to installing patches only while rules (or inference) need them."""
    global _armed
    with _lock:
        _armed = False
        release()


def armed() -> bool:
    return _armed


def release() -> None:
    """Undoes every patch unless something still needs them: the shim is armed,
    a rule is registered, or inference is on."""
    with _lock:
        if not _armed and _registry.is_empty() and not _mode_state.inferring():
            deactivate()


def held_patches() -> list[tuple[str, bool]]:
    """``(what JAX object, still in place)`` for every live reprules patch."""
    with _lock:
        groups = [p for p in (_installed, _strict_patches, _sound_patches, *_attached.values()) if p is not None]
        return [entry for patches in groups for entry in patches.held()]


def clear_jax_caches() -> None:
    """``jax.clear_caches()``, safe against threads that trace meanwhile.

    JAX iterates a WeakSet of its caches while clearing; a thread that creates
    a cache at that moment makes it raise "Set changed size during iteration"
    (seen on 0.6.2). Clearing is idempotent, so it is simply done again."""
    _bwd_trace.clear_traces()
    for attempt in range(8):
        try:
            jax.clear_caches()
            return
        except RuntimeError as err:
            if "changed size during iteration" not in str(err) or attempt == 7:
                raise


if _mode_state.sound_types_pending:  # JAX was first imported by this module's own imports
    _mode_state.sound_types_pending = False
    arm_sound_types()
