"""For ``reprules audit``: how each opaque kernel of a step got its rule, and whether inference would cover it.

``covered_by`` is one of :data:`COVERED_BY`: ``identity`` (a rule registered on
the kernel object, an FFI target, a primitive, or by a pack), ``name`` (a
``reprules.kernel_named`` rule), ``inference`` (derived from the kernel body
under ``reprules.inference()``), or ``none``. For a kernel without a rule, the
audit also says whether inference would derive one, or why it refuses (the
first equation of the body that is not provably local, with its source line).

The step is traced once more (``jax.make_jaxpr``) in the same registry state
and mode as its report, and its kernels are found as :mod:`reprules._report._walk`
finds them (inside ``shard_map`` only), keyed like the report's kernels.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from reprules._report import _walk
from reprules._registry import KernelName, Registration
from reprules._shim import InferredRule, derive_pallas_rule

COVERED_BY = ("identity", "name", "inference", "none")
PALLAS_ONLY = "is not a pallas_call: inference derives rules for Pallas kernel bodies only"


@dataclasses.dataclass(frozen=True, slots=True)
class Coverage:
    """How one kernel (as the report names it) is covered.

    Attributes:
      covered_by: One of :data:`COVERED_BY`.
      inference: For a kernel without a rule, what inference would do:
        ``{"covers": True, "rule": ...}`` or ``{"covers": False, "primitive":
        ..., "where": ..., "reason": ...}``; None for a kernel with a rule.
    """

    covered_by: str
    inference: Mapping[str, Any] | None = None


Key = tuple[str, str, str, bool]  # (name, primitive, source, has_rule), as in the report's Kernel


def covered_by(registration: Any) -> str:
    """``identity``, ``name``, ``inference`` or ``none`` for a registration (or None)."""
    if registration is None:
        return "none"
    if isinstance(registration.rule, InferredRule):
        return "inference"
    if isinstance(registration.kernel(), KernelName):
        return "name"
    return "identity"


def would_infer(primitive: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """What inference would do for one opaque equation without a rule."""
    if primitive != "pallas_call" or "jaxpr" not in params:
        return {"covers": False, "primitive": primitive, "where": "", "reason": PALLAS_ONLY}
    try:
        found = derive_pallas_rule(dict(params))
    except Exception as err:  # a report must not fail on what it only describes
        return {"covers": False, "primitive": primitive, "where": "",
                "reason": f"the analysis failed ({type(err).__name__}: {err})"}
    if isinstance(found, Registration):
        return {"covers": True, "rule": repr(found.rule)}
    return {"covers": False, "primitive": found.primitive, "where": found.where, "reason": found.reason}


def of_step(step: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[Key, Coverage]:
    """The coverage of every opaque kernel inside ``shard_map`` in ``step(*args, **kwargs)``."""
    import jax

    closed = jax.make_jaxpr(lambda *a: step(*a, **kwargs))(*args)
    found: dict[Key, Coverage] = {}
    _visit(_walk._as_jaxpr(closed), False, found)
    return found


def _visit(jaxpr: Any, in_shard_map: bool, found: dict[Key, Coverage]) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _walk._OPAQUE:
            if in_shard_map:
                kernel, source, identity = _walk._kernel_info(eqn)
                reg = identity.registration
                key = (kernel, name, source, reg is not None)
                if key not in found:
                    found[key] = Coverage(covered_by(reg),
                                          None if reg is not None else would_infer(name, eqn.params))
            continue
        inner = in_shard_map or name == "shard_map"
        for _, sub in _walk._sub_jaxprs(eqn.params):
            _visit(sub, inner, found)


def lookup(coverage: Mapping[Key, Coverage], kernel: Any) -> Coverage:
    """The coverage of a report's :class:`~reprules._report._records.Kernel`; from its record
    alone when the second trace did not see it."""
    got = coverage.get((kernel.name, kernel.primitive, kernel.source, kernel.has_rule))
    if got is not None:
        return got
    if not kernel.has_rule:
        unseen = "was not seen when the step was traced again, so reprules cannot tell"
        return Coverage("none", {"covers": False, "primitive": kernel.primitive, "where": "", "reason": unseen})
    return Coverage("inference" if kernel.rule.startswith("inferred(") else "identity")


def describe(inference: Mapping[str, Any] | None, short: bool = False) -> str:
    """One line: ``would cover it: inferred(...)`` or ``refuses: `axis_index` at f.py:3 (k) reads ...``
    (``short``: the file's name without its directory)."""
    if inference is None:
        return ""
    if inference.get("covers"):
        return f"would cover it: {inference.get('rule', '')}"
    where = str(inference.get("where") or "")
    if short and where:
        where = os.path.basename(where)
    at = f" at {where}" if where else ""
    return f"refuses: `{inference.get('primitive', '?')}`{at} {inference.get('reason', '')}".rstrip()
