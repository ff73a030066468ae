"""Hooks on what every ``pallas_call`` goes through when it is traced (every era).

See ``_identity`` for how a rule reaches a ``pallas_call`` whenever its call
object was built. The eras decide what the bind does (:data:`BindHook`); the
vma and mat eras also convert out_shape leaves (``pallas_call``): the
conversion, which runs before the kernel is known, lets an unannotated
out_shape through and leaves the decision (type by the rule, or JAX's own
refusal as a MissingRuleError) to the bind.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from reprules import _registry
from reprules._errors import UnsupportedJaxError
from reprules._registry import Registration, lookup
from reprules._shim.plumbing import _frames, _jax
from reprules._shim.kernels import _identity
from reprules._shim.rules import _resolve
from reprules._shim.entry_points import pallas_grad
from reprules._shim.kernels._identity import PallasCall
from reprules._shim.plumbing._patches import Patches


BindHook = Callable[[Callable[..., Any], tuple[Any, ...], PallasCall, "Registration | None"], Any]
"""``on_bind(bind, args, call, reg)``: binds one ``pallas_call_p`` equation.
``call`` is its kernel, looked up once for the whole bind (its params, and
``call.direct``: whether its jaxpr was traced straight from that kernel);
``reg`` the kernel's current registration (None: no rule)."""


def traced_bind(bind: Callable[..., Any], args: tuple[Any, ...], call: PallasCall,
                reg: Registration | None) -> Any:
    """The plain :data:`BindHook`: a registered kernel's bind runs under :func:`tracing`."""
    if reg is None:
        return bind(*args, **call.params)
    with _identity.tracing(reg):
        return bind(*args, **call.params)


def install_pallas_hooks(
    patches: Patches,
    on_bind: BindHook = traced_bind,
    convert_out_shape: Callable[[Callable[[Any], Any], Any], Any] | None = None,
) -> None:
    """Hooks what every ``pallas_call`` goes through when it is traced.

    These are module globals and a primitive method, looked up when a call is
    traced, so a call object built at any time (at import, before reprules was
    imported or the rule registered) is covered, and nothing else is.

    Args:
      patches: Where the patches are recorded (undone when the last rule goes).
      on_bind: Binds each ``pallas_call_p`` equation (see :data:`BindHook`).
      convert_out_shape: If given, ``convert_out_shape(original, leaf)``
        replaces JAX's conversion of each out_shape leaf of a ``pallas_call``
        to a type (vma/mat: where JAX refuses an unannotated out_shape).
    """
    pallas_call_mod = _jax.module("jax._src.pallas.pallas_call")
    # 1. Kernel tracing: where the kernel object is known.
    # Both return a tuple holding the jaxpr that the bind gets: 0.4.28
    # (grid_mapping, jaxpr, consts, out_tree), 0.4.31 (grid_mapping, jaxpr,
    # consts), 0.4.35 - 0.12 (jaxpr, consts).
    if hasattr(pallas_call_mod, "_trace_kernel_to_jaxpr"):  # 0.4.31 - 0.12
        trace_name = "_trace_kernel_to_jaxpr"
    elif hasattr(pallas_call_mod, "_trace_to_jaxpr"):  # 0.4.28 - 0.4.30
        trace_name = "_trace_to_jaxpr"
    else:
        raise UnsupportedJaxError(
            f"JAX {_jax.JAX_VERSION}'s pallas_call traces kernels through neither "
            "_trace_kernel_to_jaxpr nor _trace_to_jaxpr.\n"
            "Why: reprules finds the kernel of each pallas_call where JAX traces it.\n"
            "Fix: install a JAX release reprules was tested with (0.4.28 - 0.12)."
        )
    original_trace = getattr(pallas_call_mod, trace_name)

    def trace_kernel(fun: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_trace(fun, *args, **kwargs)
        reg = lookup(fun)  # None for unregistered kernels and index maps
        ref = reg.kernel_ref if reg is not None else None
        if ref is None and _registry.has_packages() and _resolve.in_inferred_package(fun):
            # A kernels_in(...) kernel: its jaxpr may lose its source file (0.4.28 keeps
            # none on equations rebuilt by transformations), so remember its function.
            ref = _identity.weak_or_strong(fun)
        if ref is not None:
            for item in result:
                if hasattr(item, "eqns"):  # the kernel jaxpr (or a closed one, and its .jaxpr)
                    for jaxpr in (item, getattr(item, "jaxpr", None)):
                        if hasattr(jaxpr, "eqns"):
                            _identity.remember(jaxpr, ref, direct=True)
        return result

    patches.setattr(pallas_call_mod, trace_name, trace_kernel)

    # 2. The bind: the kernel found again by its jaxpr.
    prim = _jax.pallas_call_p()
    original_bind = functools.partial(type(prim).bind, prim)

    def bind(*args: Any, **params: Any) -> Any:
        call = PallasCall.of(params, binding=True)  # the one lookup of this bind
        kernel = call.kernel()
        reg = lookup(kernel) if kernel is not None else None
        if reg is None:  # a registered rule always wins; else perhaps a derived one
            reg = _resolve.inferred_registration(call)
            call.direct = call.direct or reg is not None  # derived from this very jaxpr
        try:
            return on_bind(original_bind, args, call, reg)
        except ValueError as err:  # direct linearize (see pallas_grad): reverse mode refused this call
            pallas_grad.explain(err, [call])
            raise

    patches.setattr(prim, "bind", bind)
    pallas_grad.install(patches)

    # 3. The out_shape conversion (vma/mat), which runs before the kernel is traced.
    if convert_out_shape is None:
        return
    pallas_core = _jax.module("jax._src.pallas.core")
    # 0.6 - 0.8: a pallas_call global; 0.9+: pallas core's, also used by mpmd.
    owner = pallas_call_mod if hasattr(pallas_call_mod, "_convert_out_shape_to_aval") else pallas_core
    original_convert = owner._convert_out_shape_to_aval

    def convert(out_shape: Any) -> Any:
        if _frames.caller_module() != pallas_call_mod.__name__:  # 0.9+: mpmd's calls stay JAX's
            return original_convert(out_shape)
        return convert_out_shape(original_convert, out_shape)

    patches.setattr(owner, "_convert_out_shape_to_aval", convert)
