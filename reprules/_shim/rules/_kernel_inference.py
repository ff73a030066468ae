"""Rules derived for ``pl.kernel`` calls at their bind (the ``core_map`` adapter's inference).

A ``pl.kernel`` body is not a ``pallas_call`` kernel jaxpr: on 0.8 - 0.9 JAX
makes the output refs before it traces the body (so reprules traces the body
itself, :func:`for_kernel_call`); from 0.10 the ``mpmd_map`` equation carries
the body jaxprs (:func:`for_mpmd_call`). Either way ``infer`` does the analysis.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Any

import jax

from reprules._registry import Registration, kernel_name
from reprules._shim.plumbing import _jax
from reprules._shim.inference import infer
from reprules._shim.rules import _resolve

# Set while reprules traces a body for inference: the adapter's hooks stand aside.
trialing: contextvars.ContextVar[bool] = contextvars.ContextVar("reprules_kernel_trial", default=False)


def for_mpmd_call(params: dict[str, Any], args: Sequence[Any]) -> Registration | infer.Refusal:
    """The rule derived from the bodies of an ``mpmd_map`` made by ``pl.kernel`` (0.10+).

    Each body takes the call's operands (the user's, then the refs it captured),
    the outputs, then its scratch buffers. An operand that is a ``Ref`` is the
    caller's own memory; any other is copied into the kernel."""
    jaxprs = tuple(params.get("jaxprs", ()))
    num_in, num_out = len(args), len(params.get("out_avals", ()))
    refs = tuple(is_ref(a) for a in args)
    aliases = {int(o): int(i) for i, o in dict(params.get("input_output_aliases") or {}).items()}
    kernel_axes = infer.own_axes(_mesh_axes(*params.get("meshes", ())))

    def derive() -> infer.InferredRule | infer.Refusal:
        if not jaxprs:
            return infer.Refusal("mpmd_map", "has no body jaxpr reprules can read", "")
        num_scratch = len(jaxprs[0].invars) - num_in - num_out
        roles = [("ref" if r else "in", i) for i, r in enumerate(refs)]
        roles += [("out", j) for j in range(num_out)] + [("scratch", 0)] * max(num_scratch, 0)
        return infer.for_kernel_bodies(jaxprs, roles, num_in, num_out, aliases, kernel_axes)

    key = ("mpmd_map", refs, num_out, tuple(sorted(aliases.items())), kernel_axes)
    return infer.kernel_registration(jaxprs, key, _resolve.kernel_name(params), derive)


# Set while reprules traces a pl.kernel body itself (0.8 - 0.9 inference): its hooks stand aside.
_trialing: contextvars.ContextVar[bool] = contextvars.ContextVar("reprules_kernel_trial", default=False)


def for_kernel_call(local: dict[str, Any], num_in: int, num_out: int) -> Registration | infer.Refusal:
    """The rule derived for a 0.8 - 0.9 ``pl.kernel`` call, from the frame of JAX's closure.

    JAX makes the output refs before it traces the body, and types the outputs by
    them, so the body is traced here first, as JAX would trace it (the same
    ``_make_kernel``, on the operands' shapes, with checking off: only the
    dataflow is read), and its ``core_map`` body is analysed."""
    helpers = _jax.module("jax._src.pallas.helpers")  # 0.8+
    body = local.get("body")
    name = kernel_name(body)
    avals = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), x.dtype),
                                   tuple(local.get("operands", ())))
    token = trialing.set(True)
    try:
        made = helpers._make_kernel(
            body, local.get("out_shape", ()), local.get("mesh"),
            scratch_shapes=local.get("scratch_shapes", ()), name=local.get("name"),
            **(local.get("mesh_kwargs") or {}),
        )
        with _jax.config._check_vma(False):
            closed = jax.make_jaxpr(made)(*avals)
    except Exception as err:  # noqa: BLE001 - the real trace will raise it again, or not
        return infer.Refusal("pl.kernel", f"could not be traced by reprules ({type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''})", "")
    finally:
        trialing.reset(token)
    jaxpr = closed.jaxpr
    while len(jaxpr.eqns) == 1 and jaxpr.eqns[0].primitive.name in ("pjit", "jit"):
        jaxpr = jaxpr.eqns[0].params["jaxpr"].jaxpr
    roles: dict[Any, tuple[str, int]] = {}
    outs = 0
    core_maps = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("new_ref", "mutable_array"):
            source = eqn.invars[0]
            if source in jaxpr.invars:
                roles[eqn.outvars[0]] = ("in", jaxpr.invars.index(source))
            else:
                roles[eqn.outvars[0]] = ("out", outs)
                outs += 1
        elif eqn.primitive.name == "core_map":
            core_maps.append(eqn)
    if len(core_maps) != 1 or outs != num_out or len(jaxpr.invars) != num_in:
        return infer.Refusal("pl.kernel", "was traced by reprules into a program it does not "
                             "recognise (one core_map over the operand and output refs)", "")
    (eqn,) = core_maps
    body_jaxpr = eqn.params["jaxpr"]
    if any(v not in roles for v in eqn.invars) or len(eqn.invars) != len(body_jaxpr.constvars):
        return infer.Refusal("pl.kernel", "closes over values from outside the kernel (pass them "
                             "as operands), which inference does not track", "")
    # The body's invars are the scratch buffers core_map allocates itself (0.9).
    operand_roles = [roles[v] for v in eqn.invars] + [("scratch", 0)] * len(body_jaxpr.invars)
    kernel_axes = infer.own_axes(_mesh_axes(eqn.params.get("mesh")))
    derived = infer.for_kernel_bodies((body_jaxpr,), operand_roles, num_in, num_out, {}, kernel_axes)
    return infer.kernel_registration((body_jaxpr,), ("core_map", kernel_axes), name, lambda: derived)


def _mesh_axes(*meshes: Any) -> list[Any]:
    """The axis names of Pallas kernel meshes (each has a ``shape`` mapping)."""
    return [name for mesh in meshes for name in dict(getattr(mesh, "shape", None) or {})]


def is_ref(x: Any) -> bool:
    return hasattr(jax.typeof(x), "inner_aval")
