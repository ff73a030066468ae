"""Runs a rule for one call and checks its answer, whatever the JAX regime.

The built-in rules (``rules.same()``, ``like(i)``, ``varying(...)``,
``invariant(...)``), and the rules ``reprules.inference()`` derives from kernel
bodies (registered through :func:`register_pure_rule`), are frozen dataclasses whose answer depends only on the
input varying sets, the manual mesh axes and the input and output counts, so
their validated decisions are cached by exactly that key (a bounded LRU; it
holds no kernel, so it keeps nothing alive). A rule that raises is asked again
at every call. A user's rule is called at every call: nothing says it is pure.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable, Sequence, Set

from reprules import rules

from reprules._errors import RuleError, did_you_mean, fmt_axes
from reprules._registry import Registration
from reprules.rules import Decision, RuleContext, VaryingSet


CACHE_SIZE = 1024
_PURE_RULES: tuple[type, ...] = (rules.same, rules.like, rules.varying, rules.invariant)
_cache: collections.OrderedDict[Hashable, Decision] = collections.OrderedDict()
_cache_lock = threading.Lock()
_stats = {"hits": 0, "misses": 0}


def register_pure_rule(rule_type: type) -> None:
    """Lets :func:`decide` cache the decisions of rules of ``rule_type``: hashable,
    and answering from the input varying sets, mesh axes and counts alone (the
    shim registers its rules derived from kernel bodies this way)."""
    global _PURE_RULES
    if rule_type not in _PURE_RULES:
        _PURE_RULES = (*_PURE_RULES, rule_type)


def cache_info() -> dict[str, int]:
    """``{"size", "maxsize", "hits", "misses"}`` of the decision cache (for tests and benchmarks)."""
    with _cache_lock:
        return {"size": len(_cache), "maxsize": CACHE_SIZE, **_stats}


def cache_clear() -> None:
    with _cache_lock:
        _cache.clear()
        _stats.update(hits=0, misses=0)


def decide(reg: Registration, ctx: RuleContext, in_varying: tuple[VaryingSet, ...]) -> Decision:
    """Calls ``reg.rule`` and validates the answer against ``ctx`` (cached for built-in rules)."""
    return decide_call(reg, in_varying, ctx.mesh_axes, ctx.num_outputs, lambda: ctx, ctx.num_inputs)


def decide_call(reg: Registration, in_varying: tuple[VaryingSet, ...], mesh_axes: Sequence[str],
                num_outputs: int, context: Callable[[], RuleContext], num_inputs: int | None = None) -> Decision:
    """:func:`decide` for one call inside ``mesh_axes``, with ``num_inputs`` inputs (by default
    one per varying set) and ``num_outputs`` outputs. Its RuleContext is built (``context()``)
    only when the rule is asked: a cached decision needs none, and building one costs as much
    as the lookup."""
    rule = reg.rule
    if type(rule) not in _PURE_RULES:
        return _decide(reg, context(), in_varying)
    num_inputs = len(in_varying) if num_inputs is None else num_inputs
    key = (rule, tuple(in_varying), tuple(mesh_axes), num_inputs, num_outputs)
    try:
        with _cache_lock:
            found = _cache.get(key)
            if found is not None:
                _cache.move_to_end(key)
                _stats["hits"] += 1
                return found
    except TypeError:  # an unhashable varying set: not from reprules' shims, do not cache
        return _decide(reg, context(), in_varying)
    decision = _decide(reg, context(), in_varying)  # raises (and caches nothing) for a bad call
    with _cache_lock:
        _stats["misses"] += 1
        _cache[key] = decision
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return decision


def _decide(reg: Registration, ctx: RuleContext, in_varying: tuple[VaryingSet, ...]) -> Decision:
    """Calls ``reg.rule`` and validates the answer against ``ctx``."""
    where = (
        f"kernel {ctx.kernel_name!r} (rule {reg.rule!r}, mesh axes {fmt_axes(ctx.mesh_axes)}, "
        f"inputs varying over {[sorted(v) for v in in_varying]}, JAX {ctx.jax_version})"
    )
    try:
        answer = reg.rule(ctx, in_varying)
    except RuleError:
        raise
    except Exception as err:
        raise RuleError(
            f"The replication rule of {where} raised {type(err).__name__}: {err}\n"
            "Why: reprules calls the rule while JAX traces the kernel call; its exception stops the trace.\n"
            "Fix: make the rule return a Decision (or one set of axis names per output) "
            "for these inputs."
        ) from err

    raw_outputs: Sequence[object]
    raw_inputs: Sequence[object] | None
    if isinstance(answer, Decision):
        raw_outputs, raw_inputs = answer.outputs, answer.inputs
    elif isinstance(answer, (list, tuple)):
        raw_outputs, raw_inputs = answer, None
    else:
        raise RuleError(
            f"The replication rule of {where} returned {answer!r} of type "
            f"{type(answer).__name__}.\n"
            "Why: JAX needs one set of mesh axes per output to type the kernel's outputs.\n"
            "Fix: return a reprules.rules.Decision, or a list with one set of axis names "
            "per output."
        )
    outputs = tuple(_as_set(o, where, "output") for o in raw_outputs)
    if len(outputs) != ctx.num_outputs:
        raise RuleError(
            f"The replication rule of {where} returned {len(outputs)} output varying sets, "
            f"but the kernel has {ctx.num_outputs} outputs.\n"
            "Why: each output needs exactly one varying set.\n"
            "Fix: return one set per (flattened) output."
        )
    inputs = None if raw_inputs is None else tuple(_as_set(i, where, "input") for i in raw_inputs)
    if inputs is not None:
        if len(inputs) != len(in_varying):
            raise RuleError(
                f"The replication rule of {where} returned {len(inputs)} input casts, but the "
                f"kernel has {len(in_varying)} inputs.\n"
                "Why: each input is cast up to its own set before the call.\n"
                "Fix: return one set per (flattened) input, or inputs=None."
            )
        for i, (now, target) in enumerate(zip(in_varying, inputs)):
            if not now <= target:
                raise RuleError(
                    f"The replication rule of {where} casts input {i} from {fmt_axes(now)} "
                    f"down to {fmt_axes(target)}.\n"
                    "Why: making a varying value replicated needs a collective, not a cast.\n"
                    "Fix: inputs can only be cast up to more axes; do the reduction "
                    "explicitly (jax.lax.psum) before the kernel."
                )
    for s in outputs + (inputs or ()):
        unknown = s - frozenset(ctx.mesh_axes)
        if unknown:
            raise RuleError(
                f"The replication rule of {where} names axes {sorted(unknown)} that are not "
                "manual axes of the enclosing shard_map.\n"
                "Why: a value can only vary over the manual axes of the shard_map it lives in.\n"
                "Fix: name only axes of the shard_map's mesh in the rule"
                + did_you_mean(sorted(unknown), ctx.mesh_axes)
            )
    return Decision(outputs=outputs, inputs=inputs)


def _as_set(value: object, where: str, what: str) -> VaryingSet:
    if isinstance(value, str) or not isinstance(value, Set | list | tuple):
        raise RuleError(
            f"The replication rule of {where} returned {value!r} for an {what}; expected a "
            "set of mesh axis names.\n"
            "Why: a string is a sequence of letters, not of axis names.\n"
            "Fix: return e.g. frozenset({'data'}) (frozenset() for replicated)."
        )
    if not all(isinstance(a, str) for a in value):
        raise RuleError(
            f"The replication rule of {where} returned {value!r} for an {what}; axis names "
            "must be strings.\nWhy: JAX names mesh axes by strings.\nFix: use the mesh's axis names."
        )
    return frozenset(value)
