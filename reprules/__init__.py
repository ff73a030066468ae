"""reprules: replication rules for opaque kernels inside ``jax.shard_map``.

Declare once how a Pallas kernel's outputs vary over the mesh axes, and
``shard_map`` checking (``check_rep=True`` on JAX <= 0.5, ``check_vma=True``
from 0.6) works on every supported JAX: no defensive all-reduces in the
backward pass, the necessary ones kept, gradients exact.

Example:
    ```python
    import reprules
    from jax.experimental import pallas as pl

    @reprules.replication_rule()          # outputs vary like the inputs' union
    def copy_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]
    ```
"""

from __future__ import annotations

import sys

import functools
import importlib.metadata
from typing import TYPE_CHECKING

from reprules import _packs, _registry
from reprules import rules as rules
from reprules._errors import CotangentError as CotangentError
from reprules._errors import MissingRuleError as MissingRuleError
from reprules._errors import PatchWarning as PatchWarning
from reprules._errors import RegistrationError as RegistrationError
from reprules._errors import ReplicationMismatchError as ReplicationMismatchError
from reprules._errors import ReplicationWarning as ReplicationWarning
from reprules._errors import ReprulesError as ReprulesError
from reprules._errors import RuleError as RuleError
from reprules._errors import StrictModeError as StrictModeError
from reprules._errors import UnsupportedJaxError as UnsupportedJaxError
from reprules._errors import VerifyWarning as VerifyWarning
from reprules._modes import inference as inference
from reprules._modes import strict as strict
from reprules._modes import verify as verify
from reprules._registry import FfiTarget as FfiTarget
from reprules._registry import KernelName as KernelName
from reprules._registry import KernelPackage as KernelPackage
from reprules._packs import PackStatus as PackStatus
from reprules._packs import PackWarning as PackWarning
from reprules._packs import packs as packs
from reprules._registry import Registration as Registration
from reprules._targets import KernelLike as KernelLike
from reprules._targets import RuleDecorator as RuleDecorator
from reprules._targets import TritonKernel as TritonKernel
from reprules.rules import RuleLike as RuleLike
from reprules.rules import RuleResult as RuleResult
from reprules.rules import VaryingSet as VaryingSet

if TYPE_CHECKING:
    from types import FrameType

    from reprules._targets import K

try:
    __version__ = importlib.metadata.version("reprules")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+unknown"

__all__ = [
    "CotangentError",
    "FfiTarget",
    "KernelLike",
    "KernelName",
    "KernelPackage",
    "MissingRuleError",
    "PackStatus",
    "PackWarning",
    "PatchWarning",
    "Registration",
    "RegistrationError",
    "ReplicationMismatchError",
    "ReplicationWarning",
    "ReprulesError",
    "RuleDecorator",
    "RuleError",
    "RuleLike",
    "RuleResult",
    "StrictModeError",
    "TritonKernel",
    "UnsupportedJaxError",
    "VaryingSet",
    "VerifyWarning",
    "ffi_target",
    "inference",
    "jax_patches",
    "kernel_named",
    "kernels_in",
    "jax_support",
    "packs",
    "registered",
    "replication_rule",
    "rules",
    "strict",
    "unregister",
    "verify",
]

def replication_rule(rule: RuleLike | None = None, *, override: bool = False) -> RuleDecorator:
    """Declares how a kernel's outputs vary over the mesh axes.

    Decorate the kernel function passed to ``pl.pallas_call`` (or apply the
    result to a kernel you cannot edit). Calls of that kernel, also through
    ``functools.partial`` or with ``name=``, then work inside ``shard_map``
    with checking on, with no change at the call site. The same decorator
    takes a ``jax.extend.core.Primitive``, ``reprules.ffi_target(name)``, a
    jax-triton kernel (see :data:`KernelLike`), or the host function passed to
    ``jax.pure_callback`` / ``io_callback`` (then the callback's rule, also
    through ``functools.partial`` and bound methods).

    Args:
      rule: One of :mod:`reprules.rules` or any :class:`reprules.rules.Rule`
        callable. Defaults to ``rules.same()``.
      override: Replace a different rule already registered for this kernel.

    Returns:
      A decorator that registers the rule and returns the kernel unchanged
      (typed as given).

    Raises:
      RegistrationError: the kernel already has a different rule and
        ``override`` is false, or the target is not a kernel function.
      UnsupportedJaxError: the installed JAX is outside the supported range.

    Example:
        ```python
        @replication_rule(rules.invariant("model"))  # the kernel all-reduces over "model"
        def allreduce_kernel(x_ref, o_ref): ...

        replication_rule()(layer_norm.layer_norm_forward_kernel)  # someone else's kernel

        @replication_rule(rules.same())  # jax.pure_callback(host_topk, ...): a function of its inputs
        def host_topk(x): ...
        ```
    """
    from reprules import _shim  # lazy: imports JAX

    if isinstance(rule, type):
        raise RegistrationError(
            f"replication_rule was given the class {rule.__qualname__}, not a rule.\n"
            "Why: a rule is an instance (rules.same() holds its settings) or a function.\n"
            f"Fix: write replication_rule(rules.{rule.__qualname__}()) with parentheses."
        )
    chosen: RuleLike = rules.same() if rule is None else rule

    def register(kernel: K) -> K:
        if isinstance(chosen, rules.inferred) != isinstance(kernel, KernelPackage):
            raise RegistrationError(_inferred_only_on_packages(kernel, chosen))
        if not isinstance(kernel, functools.partial):
            _shim.classify(kernel)  # not a kernel, or unsupported here: raise before registering
        with _shim.lock:  # registry and JAX patches change together
            return _register(kernel)

    def _register(kernel: K) -> K:
        before = _registry.lookup(kernel)
        pack = _packs.current_pack()
        source = f"pack {pack}" if pack else _caller()
        reg = _registry.register(kernel, chosen, override=override, source=source)
        try:
            _shim.attach(kernel)
        except BaseException:
            _registry.unregister(kernel)
            _shim.release()
            raise
        if before is None or before.rule != reg.rule:
            _forget_traces()
        return kernel

    if _looks_like_kernel(rule):
        raise RegistrationError(
            f"replication_rule was applied directly to {getattr(rule, '__name__', rule)!r}.\n"
            "Why: replication_rule takes a rule and returns a decorator.\n"
            "Fix: write `@reprules.replication_rule()` (with parentheses) or, with `import reprules`, "
            "`@reprules.replication_rule(reprules.rules.same())`."
        )
    return register


def _inferred_only_on_packages(kernel: object, rule: RuleLike) -> str:
    if isinstance(kernel, KernelPackage):
        return (
            f"reprules.kernels_in({kernel.package!r}) takes only rules.inferred(), not {rule!r}.\n"
            "Why: one fixed rule for every kernel of a package would type a kernel that "
            "communicates as if it did not (a silently wrong gradient); a derived rule is proven "
            "kernel by kernel, or refused.\n"
            f"Fix: reprules.replication_rule(reprules.rules.inferred())(reprules.kernels_in({kernel.package!r})), "
            "and an explicit rule on each kernel that needs another one (it wins)."
        )
    return (
        f"rules.inferred() was given for {_registry.kernel_name(kernel)!r}; it applies only to "
        "reprules.kernels_in(package).\n"
        "Why: it derives the rules of a package's kernels from their bodies; one kernel gets a "
        "rule of its own, or its rule derived under reprules.inference().\n"
        "Fix: give the kernel a rule such as reprules.rules.same() (with `import reprules`), wrap the calls in "
        "reprules.inference(), or register reprules.rules.inferred() on reprules.kernels_in(\"pkg\")."
    )


def kernels_in(package: str) -> KernelPackage:
    """Every Pallas kernel (``pallas_call`` or ``pl.kernel`` body) defined in the
    source files of an installed package or module, for
    ``replication_rule(rules.inferred())``: each gets the rule
    ``reprules.inference()`` would derive from its body, with inference off
    elsewhere. A kernel inference refuses (it reads its device index,
    communicates, or holds a primitive reprules does not know) raises
    :class:`MissingRuleError` where JAX would refuse it; rules on a kernel object
    or name win. Packs use it for libraries whose kernels are nested functions.

    Example:
        ```python
        reprules.replication_rule(reprules.rules.inferred())(reprules.kernels_in("tokamax"))
        ```
    """
    if not isinstance(package, str) or not all(part.isidentifier() for part in package.split(".")):
        raise RegistrationError(
            f"kernels_in needs a dotted package or module name, got {package!r}.\n"
            "Why: kernels are matched by the source files of that installed package.\n"
            "Fix: e.g. reprules.kernels_in(\"tokamax\") or reprules.kernels_in(\"pkg.ops\")."
        )
    if not _registry.package_roots(package):
        raise RegistrationError(
            f"kernels_in({package!r}): no installed package or module has that name.\n"
            "Why: its kernels are found by where its source files lie, and there are none.\n"
            f"Fix: install it, or check the spelling (python -c \"import {package}\")."
        )
    return KernelPackage(package)


def _caller() -> str:
    """``file:line`` of the first frame outside reprules (who registered)."""
    import sys

    frame: FrameType | None = sys._getframe(1)
    package_dir = __file__.rsplit("/", 1)[0]
    while frame is not None and frame.f_code.co_filename.startswith(package_dir):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame else "?"


def _looks_like_kernel(obj: object) -> bool:
    """A plain function whose first parameter is a ref, not a RuleContext."""
    import inspect

    if not inspect.isfunction(obj):
        return False
    try:
        params = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0] != "ctx" and params[0].endswith("_ref")


def ffi_target(name: str) -> FfiTarget:
    """The XLA FFI target ``name``, to register a rule for every ``ffi_call`` of it.

    Example:
        ```python
        reprules.replication_rule(rules.same())(reprules.ffi_target("my_scale_add"))
        ```
    """
    if not isinstance(name, str) or not name:
        raise RegistrationError(
            f"ffi_target needs the target's name as a non-empty string, got {name!r}.\n"
            "Why: rules for FFI targets are matched by the name jax.ffi.ffi_call is called with.\n"
            "Fix: pass the same string as to jax.ffi.ffi_call / register_ffi_target."
        )
    return FfiTarget(name)


def kernel_named(qualified: str) -> KernelName:
    """A Pallas kernel by where it is defined, to register a rule for every
    function of that ``"module:qualname"``: nested kernels made anew on each
    call, which have no object to register. A rule registered on the function
    object itself wins. ``reprules audit`` reports names no kernel matched.

    Example:
        ```python
        # def gmm(...):            # in module pkg.ops
        #     def kernel(...): ...  # a new function object on every call
        reprules.replication_rule(rules.same())(reprules.kernel_named("pkg.ops:gmm.<locals>.kernel"))
        ```
    """
    if not isinstance(qualified, str) or qualified.count(":") != 1 or not all(qualified.split(":")):
        raise RegistrationError(
            f"kernel_named needs \"module:qualname\", got {qualified!r}.\n"
            "Why: a kernel is matched by its function's __module__ and __qualname__, "
            "joined by one colon.\n"
            "Fix: e.g. reprules.kernel_named(\"pkg.ops:gmm.<locals>.kernel\"); print "
            "f\"{kernel.__module__}:{kernel.__qualname__}\" of the kernel to see its name."
        )
    return KernelName(qualified)


def unregister(kernel: KernelLike) -> bool:
    """Removes the rule of ``kernel`` (for tests); returns whether it had one.

    When the last rule is removed and reprules is not armed (``REPRULES_DORMANT=1``),
    every JAX patch is undone.
    """
    from reprules import _shim  # lazy: imports JAX

    with _shim.lock:  # registry and JAX patches change together
        removed = _registry.unregister(kernel)
        if removed and _shim.active() and _shim.classify(kernel) == "primitive":
            _shim.detach(kernel)
        _shim.release()
    if removed:
        _forget_traces()
    return removed


def _forget_traces() -> None:
    """Drops JAX's cached traces and compilations after a rule changed.

    JAX caches the jaxpr of a function by its identity; a function traced before
    the change would otherwise keep the old typing (stale, and silently so).
    """
    from reprules import _shim  # lazy: imports JAX

    _shim.clear_jax_caches()


def registered() -> dict[str, Registration]:
    """Every registered kernel, keyed by ``module.qualname``, with its rule.

    Distinct kernels sharing a ``module.qualname`` (two kernels made by one
    factory, two primitives of one name) get one entry each: the first
    registered keeps the plain key, the others get ``#2``, ``#3``... in
    registration order (so a key can change when an earlier namesake is
    unregistered). ``Registration.where`` is always the plain name.
    """
    return _registry.registered()


def jax_patches() -> list[tuple[str, bool]]:
    """What reprules has changed in JAX right now: ``(object, in place)`` per patch.

    Empty while reprules is inactive. ``object`` names the JAX attribute or
    table entry (``"jax._src.pallas.pallas_call._trace_kernel_to_jaxpr"``);
    ``in place`` is False where another library replaced reprules' hook since
    (reprules' hook then passes every call through, and a
    :class:`PatchWarning` names it when reprules lets go).
    """
    from reprules import _shim  # lazy: imports JAX

    return _shim.held_patches()


def jax_support() -> dict[str, str]:
    """The installed JAX version and the mechanism reprules uses for it."""
    from reprules import _shim  # lazy: imports JAX

    module = _shim.regime()
    return {
        "jax": _shim.JAX_VERSION,
        "regime": module.NAME,
        "versions": module.VERSIONS,
        "mechanism": module.MECHANISM,
        "check_flag": module.CHECK_FLAG,
    }


from reprules import _mode_state, _modes  # noqa: E402

_packs.discover()  # cheap: reads entry-point names, loads nothing until needed



def _arm(pallas_call_module: object) -> None:
    """Arms the shim once Pallas is imported: a rule-less kernel then gets reprules'
    MissingRuleError, not JAX's advice to turn checking off. Never breaks the import."""
    from reprules import _shim  # lazy: imports JAX (imported already: Pallas just was)

    try:
        _shim.arm()
    except Exception as err:  # e.g. an unsupported JAX: registering a rule says so
        import warnings

        warnings.warn(f"reprules could not arm its checks on JAX's Pallas ({type(err).__name__}: "
                      f"{str(err).splitlines()[0]}); they install when a rule is registered.",
                      PatchWarning, stacklevel=2)


def _arm_sound_types(jax_module: object) -> None:
    """Types rule-less opaque calls and control flow on a varying predicate soundly
    (JAX 0.6+; on JAX <= 0.5 the cond / while_loop / pmax rules), from the moment JAX is
    imported. Never breaks the import."""
    shim = sys.modules.get("reprules._shim")
    if shim is not None and not hasattr(shim, "arm_sound_types"):
        _mode_state.sound_types_pending = True  # the shim imported JAX: it arms at its own end
        return
    from reprules import _shim  # lazy: imports JAX (imported already)

    try:
        _shim.arm_sound_types()
    except Exception as err:  # e.g. an unsupported JAX: registering a rule says so
        import warnings

        warnings.warn(f"reprules could not install its sound types ({type(err).__name__}: "
                      f"{str(err).splitlines()[0]}).", PatchWarning, stacklevel=2)


if not _modes.dormant():  # REPRULES_DORMANT=1: nothing patched until a rule is registered
    _packs.after_import("jax", _arm_sound_types)
    _packs.after_import("jax.experimental.pallas", _arm)

if _modes.inferring():  # REPRULES_INFER=1 for a whole run
    from reprules import _shim as _shim_for_inference

    _shim_for_inference.activate()

if _modes.strict_on():  # REPRULES_STRICT=1 for a whole run
    from reprules import _shim as _shim_for_strict

    _shim_for_strict.sync_strict()
