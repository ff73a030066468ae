"""Rules for JAX's host callbacks: found on the host function the callback calls.

``jax.pure_callback`` and ``jax.experimental.io_callback`` type their results by
``result_shape_dtypes`` with the varying axes dropped (replicated, JAX 0.6 -
0.12), and JAX <= 0.5's ``check_rep`` types them varying over every mesh axis.
Neither can be told what the user knows. A rule registered on the *host
function* (``@reprules.replication_rule(rules.same())`` above its ``def``) is
the callback's rule: found by the function's identity, as a Pallas kernel's is,
also through ``functools.partial`` (the registry looks through partials) and
bound methods (their ``__func__``).

Where JAX keeps it: every callback equation's ``params["callback"]`` is a
``jax._src.callback._FlatCallback`` whose ``callback_func`` is the function the
user passed, unwrapped (measured on 0.4.38, 0.5.3, 0.6.2, 0.8.3, 0.10.2 and
0.12.0.1, also under ``vmap`` with every ``vmap_method``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from reprules._registry import Registration, lookup
from reprules._shim.plumbing import _jax

# JAX's callbacks: their outputs are typed by the user's result shapes, replicated whatever those
# say (0.6 - 0.12); varying over every mesh axis by check_rep's own rules (0.4 - 0.5).
_CALLBACKS = (("jax._src.callback", "pure_callback_p"), ("jax._src.callback", "io_callback_p"))


@functools.cache
def callbacks() -> frozenset[Any]:
    """``jax.pure_callback``'s and ``io_callback``'s primitives."""
    return _jax.primitives(_CALLBACKS)


@functools.cache
def io_callbacks() -> frozenset[Any]:
    """``io_callback``'s primitive: it runs on every device against host state."""
    return _jax.primitives(_CALLBACKS[1:])


def host_function(params: dict[str, Any]) -> Any:
    """The function the user passed to the callback of an equation (a partial or a bound
    method as given), or None where JAX kept it elsewhere."""
    return getattr(params.get("callback"), "callback_func", None)  # _FlatCallback, 0.4.28 - 0.12


def registration(params: dict[str, Any]) -> Registration | None:
    """The rule registered on a callback equation's host function (through partials and
    bound methods), or None."""
    function = host_function(params)
    if function is None:
        return None
    reg = lookup(function)  # the function, or the one a chain of partials wraps
    if reg is not None:
        return reg
    while isinstance(function, functools.partial):
        function = function.func
    method = getattr(function, "__func__", None)  # a bound method: its function's rule
    return lookup(method) if method is not None else None


def host_name(params: dict[str, Any]) -> str:
    """The host function's name as its ``def`` spells it (``C.method``), or ``""`` where it has
    none a decorator can go above (a lambda, a callable object)."""
    function = host_function(params)
    while isinstance(function, functools.partial):
        function = function.func
    function = getattr(function, "__func__", function)
    name = getattr(function, "__qualname__", None)
    if not isinstance(name, str) or "<lambda>" in name or not hasattr(function, "__code__"):
        return ""
    return name.rsplit("<locals>.", 1)[-1]


def decorator_line(params: dict[str, Any], rule: str) -> str:
    """The line that declares a callback's rule, where the user writes it."""
    name = host_name(params)
    line = f"@reprules.replication_rule({rule})"
    if not name:
        return f"`{line}` above a `def` of the host function (a lambda takes no decorator)"
    return f"`{line}  # above def {name.rsplit('.', 1)[-1]}`"


def rule_fix(params: dict[str, Any], io: bool, mesh_axes: Iterable[str]) -> str:
    """How to declare the rule of a rule-less callback, for warnings and strict mode's errors."""
    varying = f"`rules.varying({', '.join(repr(a) for a in sorted(mesh_axes))})`"
    name = host_name(params)
    elsewhere = f"; `reprules.replication_rule(rule)({name})` for a function you cannot edit" if name else ""
    if io:
        return (f"declare how its results vary, with `import reprules` and `from reprules import rules`: "
                f"{decorator_line(params, varying.strip('`'))} if they differ per device (this typing, declared); "
                "`rules.same()` in it instead if the host function computes each result from its inputs' values "
                f"alone (no host state), so that replicated inputs give replicated results{elsewhere}")
    return (f"declare how its results vary, with `import reprules` and `from reprules import rules`: "
            f"{decorator_line(params, 'rules.same()')} if the host function computes each result from its inputs' "
            f"values alone (as typed now); {varying} in it if its results differ per device even for replicated "
            f"inputs (host state, a clock, a random source){elsewhere}")
