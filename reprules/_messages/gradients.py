"""Gradients: a ``custom_vjp`` bwd whose cotangent reprules cannot make exact, a kernel under ``jax.grad``.

The message of :class:`~reprules.CotangentError`, in the terms of the user's bwd
(its name and line, the element of its returned tuple quoted from its source),
and the note added to JAX's own error where reverse mode reaches a ``pallas_call``.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterable, Sequence
from typing import Any

from reprules._errors import fmt_axes


def mixed_cotangent_message(
    function: str, input_name: str, primal_type: str, axes: Iterable[str],
    mesh_axes: Iterable[str], jax_version: str, psummed_by: str = "reprules",
    bwd: Any = None, position: int | None = None, causes: Sequence[tuple[str, str]] = (),
) -> str:
    """:class:`~reprules.CotangentError`, explained in the terms of the user's bwd: ``bwd`` (the function,
    named with its line), ``position`` (which element of its returned tuple, quoted from its
    source where it can be read), ``causes`` (``(kind, text)`` per equation of the bwd where the
    problem starts: ``"body"``, a kernel or collective that names the axes; ``"cast"``, a value
    replicated over them made varying)."""
    names = sorted(axes)
    over = ", ".join(repr(a) for a in names)
    axes_tuple = f"({over},)" if len(names) == 1 else f"({over})"
    name = _bwd_site(bwd)
    expr = _returned(bwd, position)
    primal = input_name.split("'")[1] if input_name.count("'") >= 2 else input_name
    at = f" (element {position} of what it returns, `{expr}`)" if expr else ""
    kinds = {k for k, _ in causes}
    mixes = (f"whose origin reprules cannot tell: it went through a kernel or collective that names {over}"
             if kinds == {"body"} else f"mixes in a part that was replicated over {over}")
    head = (f"The bwd rule of custom_vjp function {function!r}{f' ({name})' if name else ''} returned, for "
            f"{input_name} of type {primal_type}{at}, a cotangent that varies over {fmt_axes(names)} and "
            f"{mixes} (mesh axes {fmt_axes(mesh_axes)}, JAX {jax_version}).\n")
    why = (f"Why: {primal} is replicated over {over}, so its gradient is the sum over {over} of what each "
           f"device returns, and {psummed_by} would psum the cotangent over {over}. That is exact only if "
           "each device returns its own contribution; a part that is the same on every device would be "
           "counted once per device, a silently wrong gradient.")
    if causes:
        why += " Here " + "; and ".join(text for _, text in causes) + "."
    if kinds == {"body"}:
        why += (f" reprules cannot tell from that whether the value is each device's own contribution "
                f"(then summing it over {over} is right) or already summed over {over} (then it is not).")
    if kinds == {"body"}:
        what = f"`{expr}`" if expr else "the cotangent"
        in_place = f"`jax.lax.psum({expr}, {axes_tuple})`" if expr else f"its psum over {axes_tuple}"
        fix = (f"Fix: if {what} is each device's contribution to {primal}'s gradient (as a bwd that sees "
               f"only its own shard computes), sum it yourself: return {in_place} in its place, so the "
               f"cotangent has {primal}'s type. If it is already the same on every device along {over}, "
               f"the kernel's rule should say so: `rules.invariant({over})` (with `from reprules import rules`).")
        return head + why + "\n" + fix
    fix = (f"Fix: psum the varying part yourself in the bwd rule, e.g. "
           f"`jax.lax.psum(dw_varying, {axes_tuple}) + dw_replicated`, so the cotangent has the "
           "primal's type.")
    if expr:
        fix += (f" Here, split `{expr}` into the part each device computes from its own shard "
                f"(dw_varying, psummed over {over}) and the part that is the same on every device "
                "(dw_replicated, added after).")
    return head + why + "\n" + fix


def _bwd_site(bwd: Any) -> str:
    """```bwd` at file.py:12``` for the user's bwd function, or ``""``."""
    fn = inspect.unwrap(bwd) if callable(bwd) else None
    code = getattr(fn, "__code__", None)
    if code is None:
        return ""
    return f"`{getattr(fn, '__name__', 'bwd')}` at {code.co_filename}:{code.co_firstlineno}"


def _returned(bwd: Any, position: int | None) -> str:
    """The source of element ``position`` of the tuple the bwd returns (``return (a, b)`` or a
    lambda's body), or ``""`` where it cannot be read unambiguously (several returns, no tuple)."""
    if position is None or not callable(bwd):
        return ""
    try:
        fn = inspect.unwrap(bwd)
        code = fn.__code__
        lines, _ = inspect.findsource(fn)
        source = "".join(lines)
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, AttributeError, ValueError):
        return ""
    params = list(code.co_varnames[:code.co_argcount])
    found = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
             and code.co_firstlineno in {n.lineno, *(d.lineno for d in getattr(n, "decorator_list", ()))}
             and [a.arg for a in n.args.args] == params]
    if len(found) != 1:
        return ""
    node = found[0]
    values = [node.body] if isinstance(node, ast.Lambda) else [r.value for r in _own_returns(node)]
    if len(values) != 1 or not isinstance(values[0], (ast.Tuple, ast.List)) or position >= len(values[0].elts):
        return ""
    return " ".join((ast.get_source_segment(source, values[0].elts[position]) or "").split())


def _own_returns(node: ast.AST) -> list[ast.Return]:
    """The ``return`` statements of a function, not of the functions nested in it."""
    found: list[ast.Return] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Return):
            found.append(child)
        elif not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            found += _own_returns(child)
    return found


REVERSE_MODE_MARK = "which JAX cannot differentiate in reverse mode"


def reverse_mode_note(kernels: Sequence[str], jax_version: str) -> str:
    """Added to JAX's error where reverse-mode differentiation reaches a ``pallas_call`` ("Linearization
    failed", a bare ``AssertionError`` on 0.4.28): ``kernels`` as "'name' (defined at file:line)" each."""
    return (
        f"reprules: jax.grad (or jax.vjp, jax.linearize) reached the Pallas kernel{'s' if len(kernels) > 1 else ''} "
        f"{', '.join(kernels)}, {REVERSE_MODE_MARK} (JAX {jax_version}).\n"
        "Why: a pallas_call has no VJP rule: JAX differentiates it only forward (jax.jvp), as a second kernel "
        "that computes the outputs and their tangents together, and reverse mode cannot split that kernel into "
        "a forward pass and a backward pass. Every pallas_call under jax.grad fails so, with or without reprules.\n"
        "Fix: wrap the call in jax.custom_vjp and give it a bwd that computes the inputs' cotangents (often a "
        "second kernel), as in reprules' README example:\n"
        "    f = jax.custom_vjp(lambda x: pl.pallas_call(kernel, out_shape, ...)(x))\n"
        "    f.defvjp(lambda x: (f(x), x), lambda x, g: (dx(x, g),))  # fwd: outputs, residuals; bwd: cotangents"
    )
