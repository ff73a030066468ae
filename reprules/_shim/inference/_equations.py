"""What one jaxpr equation does to its operands, read from JAX's own marks: the
facts the inference analysis (``_analysis``) builds on. No taint, no rules."""

from __future__ import annotations

from typing import Any

from reprules._shim.plumbing import _jax


def is_ref(var: Any) -> bool:
    return isinstance(getattr(var, "aval", None), _jax.AbstractRef)


def is_type_cast(eqn: Any) -> bool:
    """Whether a ``pvary`` or ``reshard`` equation only changes the type of a value
    (which manual axes it is said to vary over), never the value: ``pvary``
    (0.6 - 0.9), and ``reshard`` to a mesh whose axes are all manual with a spec
    naming none (how JAX 0.10+ casts an operand up where types mix under
    checking, e.g. in a kernel body reading a replicated operand)."""
    if eqn.primitive.name == "pvary":
        return True
    target = eqn.params.get("dst_sharding")
    mesh, spec = getattr(target, "mesh", None), getattr(target, "spec", None)
    types = getattr(mesh, "axis_types", None)
    if not types or spec is None:
        return False
    return (all(getattr(kind, "name", "") == "Manual" for kind in types)
            and all(part is None for part in spec)
            and not getattr(spec, "unreduced", None) and not getattr(spec, "reduced", None))


def written_operands(eqn: Any) -> frozenset[int]:
    """The operand positions a REFS equation may write: those JAX marks with a
    Write or Accum effect, and every ref operand it marks with no effect at all
    (no mark is no proof of a read-only use)."""
    marked: dict[int, set[str]] = {}
    for effect in getattr(eqn, "effects", ()) or ():
        for index in effect_operands(eqn, effect):
            marked.setdefault(index, set()).add(type(effect).__name__)
    return frozenset(
        k for k, var in enumerate(eqn.invars)
        if is_ref(var) and (k not in marked or marked[k] & {"WriteEffect", "AccumEffect"})
    )


def effect_operands(eqn: Any, effect: Any) -> tuple[int, ...]:
    """The operand positions of ``eqn`` a JAX input effect (Read, Write, Accum) is on.

    Up to 0.9 the effect holds the position (``input_index``). From 0.10 it holds
    ``input``: the operand's ``Var`` in an equation (a position only in an abstract
    eval), so a ``dma_start`` that only reads its source is marked so. Read as a
    position, no ``Var`` matched, and every operand stayed unmarked, so written:
    sound, but a body that only copied a captured ``Ref`` out was refused."""
    index = getattr(effect, "input_index", None)  # <= 0.9
    if isinstance(index, int):
        return (index,)
    target = getattr(effect, "input", None)  # 0.10+
    if isinstance(target, int):
        return (target,)
    if target is None:
        return ()
    return tuple(k for k, var in enumerate(eqn.invars) if var is target)


def nested_jaxprs(params: dict[str, Any]) -> list[Any]:
    found = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
                found.append(item)
    return found
