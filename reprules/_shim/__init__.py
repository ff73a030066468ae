"""The versioned shim: the only code in reprules that touches JAX internals.

One module per regime, chosen once by feature detection:

===========  ================  ============================================
regime       JAX               mechanism
===========  ================  ============================================
``rep``      0.4.28 - 0.5.x    check/rewrite rules (``check_rep=True``)
``vma``      0.6.x  - 0.9.x    ``vma`` in the types (``check_vma=True``)
``mat``      0.10.x - 0.12.x   ``manual_axis_type`` in the types
===========  ================  ============================================

Nothing is patched until the first rule is registered, and everything is
restored when the last one is removed, so a program that registers nothing
runs exactly as without reprules.
"""

from __future__ import annotations

import threading
from types import ModuleType

from reprules._errors import UnsupportedJaxError
from reprules._shim import _common, _source
from reprules._shim._verify import raise_if_mismatched as raise_if_mismatched
from reprules._shim._verify import take_mismatches as take_mismatches

JAX_VERSION = _common.JAX_VERSION
SUPPORTED = ((0, 4, 28), (0, 13))
SUPPORTED_TEXT = ">=0.4.28,<0.13"

_lock = threading.RLock()
lock = _lock  # held by the façade across registry changes and (de)activation
_regime: ModuleType | None = None
_patches: _common.Patches | None = None
_attached: dict[object, _common.Patches] = {}  # per hooked primitive
_strict_patches: _common.Patches | None = None


def regime() -> ModuleType:
    """The regime module for the installed JAX; raises if JAX is unsupported."""
    global _regime
    with _lock:
        if _regime is None:
            _regime = _detect()
        return _regime


def _detect(version: str = JAX_VERSION) -> ModuleType:
    low, high = SUPPORTED
    if not low <= _common.version_tuple(version) < high:
        raise UnsupportedJaxError(
            f"reprules supports JAX {SUPPORTED_TEXT}, but JAX {version} is installed.\n"
            "Why: reprules works through JAX internals that move between releases, and "
            "this release has not been tested.\n"
            f"Fix: install a supported JAX (pip install 'jax{SUPPORTED_TEXT}' with the "
            "matching jaxlib), or a reprules release that supports this JAX."
        )
    # Newest first: each later regime keeps some of the older names around.
    from reprules._shim import mat, rep, vma

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
    global _patches
    with _lock:
        if _patches is not None:
            return
        module = regime()
        patches = _common.Patches()
        try:
            _source.exclude_shim_frames(patches)  # sources name the user's code, not the shim
            module.install(patches)
        except BaseException:
            patches.undo_all()
            raise
        _patches = patches


def classify(target: object) -> str:
    """What a registration target is: "pallas", "primitive", "ffi" or "triton".

    Raises if this JAX cannot apply a rule to it.
    """
    from jax._src import core

    from reprules._errors import RegistrationError
    from reprules._registry import FfiTarget, KernelName, KernelPackage

    if isinstance(target, (KernelName, KernelPackage)):
        return "pallas"
    if isinstance(target, FfiTarget):
        if _common.ffi_call_p() is None:
            raise UnsupportedJaxError(
                f"Cannot apply a rule to FFI target {target.name!r}: JAX {JAX_VERSION} has no "
                "ffi_call (added in JAX 0.4.31).\nWhy: the rule would never be applied, and "
                "reprules does not fall back silently.\nFix: upgrade JAX to 0.4.31 or newer."
            )
        return "ffi"
    if isinstance(target, core.Primitive):
        return "primitive"
    if type(target).__module__.split(".")[0] == "triton":
        try:
            import jax_triton  # noqa: F401
        except ImportError as err:
            raise RegistrationError(
                f"Cannot apply a rule to the Triton kernel {target!r}: jax-triton is not "
                f"importable with JAX {JAX_VERSION} ({err}).\n"
                "Why: the rule is attached to jax-triton's triton_kernel_call primitive.\n"
                "Fix: pip install 'reprules[triton]' (jax-triton needs a GPU-enabled jaxlib)."
            ) from err
        return "triton"
    import jax

    wrapped = callable(target) and (isinstance(target, (jax.custom_vjp, jax.custom_jvp)) or hasattr(target, "lower"))
    if callable(target) and not isinstance(target, type) and not wrapped:
        entry = _calls_entry_point(target)
        if entry is not None:
            name = getattr(target, "__qualname__", None) or repr(target)
            raise RegistrationError(
                f"Cannot register a replication rule on {name!r}: it calls {entry}, so it is the "
                f"function that launches a kernel, not the kernel (JAX {JAX_VERSION}).\n"
                "Why: reprules finds a rule by the kernel function JAX traces; a rule on the "
                "launching function would never match, and the kernel would stay without one.\n"
                f"Fix: register the kernel function passed to {entry} (the function whose "
                "arguments are refs), e.g. `reprules.replication_rule()(my_kernel)`."
            )
        return "pallas"
    raise RegistrationError(
        f"Cannot register a replication rule on {target!r} ({type(target).__name__}): it is not "
        "a kernel function, a primitive, an FFI target or a Triton kernel"
        f"{' (a jax.jit / custom_vjp / custom_jvp wrapper)' if wrapped else ''}.\n"
        "Why: a rule describes the outputs of one opaque kernel.\n"
        "Fix: register the function passed to pl.pallas_call, a jax.extend.core.Primitive, "
        "reprules.ffi_target(name), or the Triton kernel passed to jax_triton.triton_call."
    )


_ENTRY_POINTS = ("pallas_call", "core_map", "triton_call", "ffi_call")


def _calls_entry_point(fn: object) -> str | None:
    """The kernel entry point (``pallas_call`` ...) that ``fn``'s code names, if any:
    a kernel body never launches a kernel, so such a function is a wrapper."""
    code = _common.code_of(fn)
    pending = [code] if code is not None else []
    while pending:
        code = pending.pop()
        for name in code.co_names:
            if name in _ENTRY_POINTS:
                return f"pl.{name}" if name in ("pallas_call", "core_map") else name
        pending.extend(c for c in code.co_consts if hasattr(c, "co_names"))
    return None


def attach(target: object) -> None:
    """Installs the per-primitive hooks a registration target needs."""
    with _lock:
        activate()
        kind = classify(target)
        if kind == "primitive":
            op = _common.primitive_opaque(target)
        elif kind == "triton":
            op = _common.triton_opaque()
        else:
            return  # Pallas kernels and FFI targets use the hooks of activate()
        if op.prim in _attached:
            return
        patches = _common.Patches()
        try:
            regime().attach(op, patches)
        except BaseException:
            patches.undo_all()
            raise
        _attached[op.prim] = patches


def detach(prim: object) -> None:
    with _lock:
        patches = _attached.pop(prim, None)
        if patches is not None:
            patches.undo_all()


def deactivate() -> None:
    """Restores every patched JAX object (idempotent)."""
    global _patches
    with _lock:
        pending = [_attached.pop(prim) for prim in list(_attached)][::-1]  # newest first
        if _patches is not None:
            pending.append(_patches)
            _patches = None
        _undo_each(pending)


def _undo_each(pending: list[_common.Patches]) -> None:
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
    from reprules import _mode_state

    with _lock:
        module = regime()
        want = _mode_state.strict_on() and hasattr(module, "install_strict")
        if want and _strict_patches is None:
            _strict_patches = _common.Patches()
            module.install_strict(_strict_patches)
        elif not want and _strict_patches is not None:
            patches, _strict_patches = _strict_patches, None
            patches.undo_all()


def active() -> bool:
    return _patches is not None


def clear_jax_caches() -> None:
    """``jax.clear_caches()``, safe against threads that trace meanwhile.

    JAX iterates a WeakSet of its caches while clearing; a thread that creates
    a cache at that moment makes it raise "Set changed size during iteration"
    (seen on 0.6.2). Clearing is idempotent, so it is simply done again."""
    import jax

    from reprules._shim import custom_vjp

    custom_vjp.clear_traces()
    for attempt in range(8):
        try:
            jax.clear_caches()
            return
        except RuntimeError as err:
            if "changed size during iteration" not in str(err) or attempt == 7:
                raise
