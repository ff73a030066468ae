"""Rules for the XLA FFI targets of NVIDIA Warp (``wp.jax_kernel``, ``wp.jax_callable``).

Warp (PyPI ``warp-lang``) runs a Warp kernel, or an annotated Python function
that launches Warp kernels, as an ``ffi_call`` of a target it registers when
``wp.jax_kernel`` / ``wp.jax_callable`` first builds the wrapper (one target per
kernel or function and settings, named ``<qualified name>_<n>``).
``jax_kernel(..., enable_backward=True)`` builds two such targets, the forward
launch and the adjoint launch, and joins them in a ``jax.custom_vjp``.

A Warp kernel reads only its operands and ``wp.tid()``, and the callback runs
it on the one device of its call frame: its outputs vary like the union of its
operands, ``rules.same()``. With that rule the targets are registered kernels,
so reprules' ``custom_vjp`` cotangent fix applies to Warp's own bwd: the
adjoint launch's per-shard partial gradient of a replicated weight (typed
varying, which JAX refuses as a bwd output) is psummed over exactly the axes it
varies over and the weight does not.

A target declared with ``has_side_effect=True`` gets a refusal instead: it may
read or write state beyond its operands, once per device, so how its outputs
vary cannot be told from its operands (the user registers a rule with
``override=True`` when they know). A ``jax_callable`` is the user's Python, and
``rules.same()`` assumes it, like a kernel, reads only its operands; one that
reads other state, or launches on other devices than its call frame's, needs
its own rule (``override=True``).

Targets are made after ``import warp``, so the pack (entry point ``warp``)
wraps the constructors of Warp's two wrapper classes to register each new
target's rule, and registers the targets that exist already. It never breaks
Warp: a failure to register is a ``PackWarning``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import warnings
from types import ModuleType
from typing import Any

import reprules
from reprules import _packs, rules
from reprules._errors import fmt_axes

FFI_MODULE = "warp._src.jax.ffi"
# Warp's wrapper classes (one FFI target each) and the caches holding those already made.
CLASSES = ("FfiKernel", "FfiCallable")
CACHES = ("_FFI_KERNEL_REGISTRY", "_FFI_CALLABLE_REGISTRY")
PACK = "reprules._builtin_packs.warp:warp"  # the entry point's value, for Registration.source


def describe(target: Any) -> str:
    """What Warp calls the wrapped kernel or function, for messages."""
    kernel = getattr(target, "kernel", None)  # FfiKernel: a wp.Kernel
    if kernel is not None:
        return f"Warp kernel {getattr(kernel, 'key', kernel)!r} (wp.jax_kernel)"
    func = getattr(target, "func", None)  # FfiCallable: a Python function
    # jax_kernel(enable_backward=True) wraps the kernel in two functions of its own.
    closure = inspect.getclosurevars(func).nonlocals if inspect.isfunction(func) else {}
    inner, name = closure.get("kernel"), getattr(func, "__name__", "")
    if inner is not None and name in ("fwd_kernel_wrapper", "bwd_kernel_wrapper"):
        launch = "forward" if name == "fwd_kernel_wrapper" else "adjoint"
        return f"Warp kernel {getattr(inner, 'key', inner)!r} ({launch} launch of wp.jax_kernel(enable_backward=True))"
    return f"Python function {getattr(func, '__qualname__', func)!r} (wp.jax_callable)"


@dataclasses.dataclass(frozen=True)
class refuse_side_effect:
    """The rule of a target declared with ``has_side_effect=True``: refused, saying why.
    Frozen, so registering it again (a test, a reload) is harmless."""

    target: str
    what: str

    def __call__(self, ctx: rules.RuleContext, in_varying: tuple[rules.VaryingSet, ...], /) -> rules.RuleResult:
        raise reprules.RuleError(
            f"Warp's FFI target {self.target!r}, {self.what}, was built with has_side_effect=True and is "
            f"called inside shard_map with checking on (operands varying over "
            f"{fmt_axes(frozenset().union(*in_varying))}, mesh axes {fmt_axes(ctx.mesh_axes)}, JAX {ctx.jax_version}).\n"
            "Why: a call with side effects may read or write state beyond its operands, once on every "
            "device, so how its outputs vary over the mesh cannot be told from its operands; typing them "
            "like the operands could call a per-device value replicated (a silently wrong result or gradient).\n"
            "Fix: if its outputs depend only on its operands, say so: reprules.replication_rule("
            f"reprules.rules.same(), override=True)(reprules.ffi_target({self.target!r})); otherwise run it "
            "in a shard_map with check_vma=False."
        )

    def __repr__(self) -> str:
        return "refused: Warp FFI target with has_side_effect=True"


def rule_for(target: Any) -> rules.RuleLike:
    """``rules.same()``, or the refusal for a target with side effects."""
    if getattr(target, "has_side_effect", False):
        return refuse_side_effect(str(target.name), describe(target))
    return rules.same()


def register(target: Any, pack: str = PACK) -> None:
    """Registers the rule of one Warp wrapper's FFI target; a rule already there (the user's) wins."""
    with _packs._as_pack(pack):  # registered later than the pack's load: still the pack's
        try:
            reprules.replication_rule(rule_for(target))(reprules.ffi_target(str(target.name)))
        except reprules.RegistrationError:
            pass  # another rule was registered for this target first: it stays


def _hooked_init(init: Any, pack: str) -> Any:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        try:
            register(self, pack)
        except Exception as err:  # a pack must never break Warp
            warnings.warn(f"reprules' Warp pack could not give FFI target {getattr(self, 'name', '?')!r} its "
                          f"rule ({type(err).__name__}: {err}); calls of it get none.",
                          _packs.PackWarning, stacklevel=2)

    __init__._reprules_warp = True  # type: ignore[attr-defined]
    return __init__


def warp(module: ModuleType) -> None:
    """Every FFI target that ``wp.jax_kernel`` / ``wp.jax_callable`` makes, now or later, gets its rule."""
    pack = _packs.current_pack() or PACK
    try:
        ffi = importlib.import_module(FFI_MODULE)
    except ImportError as err:
        ffi, missing = None, [f"{FFI_MODULE} ({err})"]
    else:
        missing = [name for name in CLASSES + CACHES if not hasattr(ffi, name)]
    if ffi is None or missing:
        raise LookupError(
            f"Warp {getattr(module, '__version__', '?')} has no {', '.join(missing)}: moved or renamed in "
            "Warp, so the FFI targets of wp.jax_kernel / wp.jax_callable get no rule from this pack.\n"
            "Fix: upgrade reprules; until then register each target yourself with "
            "reprules.replication_rule(reprules.rules.same())(reprules.ffi_target(wrapper.name))."
        )
    for name in CLASSES:
        cls = getattr(ffi, name)
        if not getattr(cls.__init__, "_reprules_warp", False):  # loaded again (a test): wrapped once
            cls.__init__ = _hooked_init(cls.__init__, pack)
    for name in CACHES:
        for target in list(getattr(ffi, name).values()):
            register(target, pack)
