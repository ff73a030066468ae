"""Rules derived from a Pallas kernel's body (``reprules.inference()``).

A jaxpr in, a rule or a refusal out. ``_analysis`` proves what each ref of a
kernel body ends up depending on (against the effect model of ``_effects``);
this module maps the kernel's operands, aliases and scalar-prefetch index maps
onto that, for each entry point: :func:`for_pallas_call` and
:func:`registration` for ``pallas_call``, :func:`for_kernel_bodies` and
:func:`kernel_registration` for ``pl.kernel``. Output ``i`` depends on the
taint of its output ref, its aliased input (``input_output_aliases``), and
every scalar-prefetch operand an index map reads (which block is read depends
on it). Registrations are cached per kernel jaxpr (weakly).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from reprules import _decide
from reprules._errors import fmt_axes
from reprules._messages.advice import Finding
from reprules._registry import Registration
from reprules._shim.plumbing import _jax
from reprules._shim.kernels import _identity
from reprules._shim.inference._analysis import Refusal, index_map_reads, summarize
from reprules.rules import Decision, RuleContext, VaryingSet

__all__ = ["InferredRule", "Refusal", "findings", "for_kernel_bodies", "for_pallas_call", "kernel_registration",
           "own_axes", "refusal_text", "registration", "rule_operands_start"]


# -- results -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class InferredRule:
    """The rule derived for one kernel: output ``i`` varies over the union of
    the varying sets of the inputs in ``depends_on[i]``.

    The rule is given every operand of the ``pallas_call``: first those JAX
    passes before the user's inputs (dynamic grid bounds, on which every
    output depends, since they decide which grid steps run), then the
    ``num_user`` user inputs that ``depends_on`` indexes. Inputs are cast up
    only as far as the outputs that depend on them vary (so a replicated
    weight feeding a data-varying output is cast to ``{data}``, whose
    transpose is the psum its gradient needs).
    """

    depends_on: tuple[frozenset[int], ...]
    num_user: int

    def __call__(self, ctx: RuleContext, in_varying: tuple[VaryingSet, ...], /) -> Decision:
        lead = len(in_varying) - self.num_user
        leading = frozenset().union(*in_varying[:lead])
        outputs = tuple(
            leading.union(*(in_varying[lead + j] for j in deps)) for deps in self.depends_on
        )
        inputs = in_varying[:lead] + tuple(
            vary.union(*(out for out, deps in zip(outputs, self.depends_on) if j in deps))
            for j, vary in enumerate(in_varying[lead:])
        )
        return Decision(outputs=outputs, inputs=inputs)

    def __repr__(self) -> str:
        parts = [f"out{i} <- {sorted(d) if d else 'none'}" for i, d in enumerate(self.depends_on)]
        return f"inferred({'; '.join(parts)})"


_decide.register_pure_rule(InferredRule)  # its decisions join the bounded decision cache


def rule_operands_start(reg: Any, first_user: int) -> int:
    """Where the operands a rule is given start: every operand for a derived
    rule (see :class:`InferredRule`), the user's inputs for a registered one."""
    return 0 if isinstance(reg.rule, InferredRule) else first_user


def own_axes(names: Iterable[Any]) -> frozenset[str]:
    """The axes among ``names`` (a kernel's own mesh or grid axes) whose
    ``axis_index`` inference may read as local: the kernel's cores or grid
    steps, which run alike on every device. An axis that shares its name with
    an axis of the enclosing mesh is left out (``axis_index`` of it is refused),
    and so is every axis on JAX < 0.6, where reprules cannot see that mesh."""
    names = frozenset(n for n in names if isinstance(n, str))
    if not names or _jax.version_tuple()[:2] < (0, 6):
        return frozenset()
    return names - frozenset(_jax.mesh_lib.get_abstract_mesh().axis_names)


# -- a pallas_call ---------------------------------------------------------------


def for_pallas_call(params: dict[str, Any], kernel_axes: frozenset[str] = frozenset()) -> InferredRule | Refusal:
    """The rule derived for one ``pallas_call_p`` equation, or why there is none.
    ``kernel_axes``: :func:`own_axes` of its named grid axes."""
    gm = params.get("grid_mapping")
    num_user, num_out = _identity.pallas_counts(params)
    jaxpr = params["jaxpr"]
    if getattr(jaxpr, "constvars", ()):
        return Refusal("pallas_call", "has a kernel jaxpr with constants, which inference does not track", "")
    aliases = {int(o): int(i) for i, o in params.get("input_output_aliases", ())}
    num_scratch = int(getattr(gm, "num_scratch_operands", 0) or 0)
    num_index = int(getattr(gm, "num_index_operands", 0) or 0)
    if len(jaxpr.invars) != num_user + num_out + num_scratch:
        return Refusal("pallas_call", f"has a kernel with {len(jaxpr.invars)} operands where reprules "
                       f"expects {num_user} inputs, {num_out} outputs and {num_scratch} scratch "
                       "buffers (captured references?), which inference does not track", "")
    # Block mapping b picks the block of kernel operand num_index + b; its index map
    # takes the grid indices, then the scalar-prefetch refs (kernel operands 0 ..).
    block_reads: list[tuple[int, frozenset[int]]] = []
    num_grid = len(getattr(gm, "grid", ()) or ())
    for b, bm in enumerate(getattr(gm, "block_mappings", ()) or ()):
        index_map = getattr(bm, "index_map_jaxpr", None)
        if index_map is None:
            continue
        read = index_map_reads(index_map, kernel_axes, num_grid)
        if isinstance(read, Refusal):
            return read
        if read and num_index:
            block_reads.append((num_index + b, frozenset(p for p in read if p < num_index)))
    # An aliased input and its output are one buffer: the kernel may write either ref.
    summary = summarize(jaxpr, tuple(frozenset({i, num_user + o}) for o, i in sorted(aliases.items())),
                        kernel_axes, tuple(block_reads))
    if isinstance(summary, Refusal):
        return summary
    depends: list[frozenset[int]] = []
    for i in range(num_out):
        tokens = summary.ref_depends[num_user + i]
        if tokens is None:  # an output that is not a ref: the layout is not what we think
            return Refusal("pallas_call", "has a kernel whose outputs are not references", "")
        deps: set[int] = set()
        for k in tokens:
            if k < num_user:
                deps.add(k)
            elif k < num_user + num_out and (k - num_user) in aliases:
                deps.add(aliases[k - num_user])  # the output starts as its aliased input
            # scratch and unaliased outputs start undefined: nothing to depend on
        depends.append(frozenset(deps))
    return InferredRule(tuple(depends), num_user)


def registration(params: dict[str, Any]) -> Registration | Refusal:
    """A registration carrying the rule derived for a ``pallas_call_p``
    equation (the same object for every call of one kernel jaxpr), or why none."""
    jaxpr = params.get("jaxpr")
    kernel_axes = own_axes(getattr(params.get("grid_mapping"), "grid_names", None) or ())
    key = (params.get("input_output_aliases"), id(params.get("grid_mapping")), kernel_axes)
    with _lock:
        try:
            for known_key, grid_mapping, known in _registrations.get(jaxpr, ()):
                if known_key == key and grid_mapping is params.get("grid_mapping"):
                    return known
        except TypeError:  # not weak-referenceable
            pass
    derived = for_pallas_call(params, kernel_axes)
    result: Registration | Refusal
    if isinstance(derived, Refusal):
        result = derived
    else:
        name = _identity.kernel_name_from_params(params)
        result = Registration(
            rule=derived, name=name, where=f"{name} (inferred)", kernel_ref=_identity.no_kernel,
            source="inferred from the kernel body",
        )
    with _lock:
        try:
            _registrations.setdefault(jaxpr, []).append((key, params.get("grid_mapping"), result))
        except TypeError:
            pass
    return result


# -- a pl.kernel body (core_map on JAX 0.8 - 0.9, mpmd_map from 0.10) ---------------------


def for_kernel_bodies(jaxprs: Sequence[Any], roles: Sequence[tuple[str, int]], num_in: int,
                      num_out: int, aliases: dict[int, int],
                      kernel_axes: frozenset[str] = frozenset()) -> InferredRule | Refusal:
    """The rule derived for a ``pl.kernel`` call whose bodies (one, or several for
    MPMD: they all run, so an output depends on what any of them writes) take
    their operands in one layout: ``roles[k]`` says what operand ``k`` of every
    body is (its constvars, then its invars):

    * ``("in", i)``: a copy of the call's operand ``i``, private to the kernel;
    * ``("ref", i)``: operand ``i`` is a reference the caller sees after the
      call (a ``Ref`` passed in or captured): its type was fixed outside, so the
      body may only write into it what it already held;
    * ``("out", j)``: output ``j``, starting as operand ``aliases[j]`` if aliased,
      else undefined;
    * ``("scratch", 0)``: memory of the kernel's own.

    Output ``j`` then varies over the operands its final contents depend on.
    ``kernel_axes``: :func:`own_axes` of the kernel's mesh axes.
    """
    depends: list[set[int]] = [set() for _ in range(num_out)]
    position = {role: k for k, role in enumerate(roles)}
    # An operand aliased to an output is that output's buffer: the body may write either ref.
    same_memory = tuple(
        frozenset({position[kind, i], position["out", j]})
        for j, i in sorted(aliases.items())
        for kind in ("in", "ref") if (kind, i) in position and ("out", j) in position
    )
    for jaxpr in jaxprs:
        summary = summarize(jaxpr, same_memory, kernel_axes)
        if isinstance(summary, Refusal):
            return summary
        if len(summary.ref_depends) != len(roles):
            return Refusal("pl.kernel", f"has a body with {len(summary.ref_depends)} operands where "
                           f"reprules expects {len(roles)}, which inference does not track", "")
        for k, ((role, index), tokens) in enumerate(zip(roles, summary.ref_depends)):
            if role == "ref" and tokens is not None and tokens - {k}:
                return Refusal("pl.kernel", f"writes into operand {index}, a reference that outlives "
                               "the kernel and whose type JAX fixed outside it, which inference does "
                               "not track", "")
            if role != "out":
                continue
            if tokens is None:
                return Refusal("pl.kernel", "has a body whose outputs are not references", "")
            for t in tokens:
                kind, source = roles[t]
                if kind in ("in", "ref"):
                    depends[index].add(source)
                elif kind == "out" and source in aliases:
                    depends[index].add(aliases[source])  # the output starts as its aliased input
    return InferredRule(tuple(frozenset(d) for d in depends), num_in)


def kernel_registration(jaxprs: Sequence[Any], key: Any, name: str,
                        derive: Any) -> Registration | Refusal:
    """A registration carrying the rule ``derive()`` gives for a ``pl.kernel`` call
    (the same object for every call of its first body jaxpr with ``key``), or why none."""
    first = jaxprs[0] if jaxprs else None
    with _lock:
        try:
            for known_key, known in _kernel_registrations.get(first, ()):
                if known_key == key:
                    return known
        except TypeError:  # not weak-referenceable
            pass
    derived = derive()
    result: Registration | Refusal = derived if isinstance(derived, Refusal) else Registration(
        rule=derived, name=name, where=f"{name} (inferred)", kernel_ref=_identity.no_kernel,
        source="inferred from the kernel body",
    )
    with _lock:
        try:
            _kernel_registrations.setdefault(first, []).append((key, result))
        except TypeError:
            pass
    return result


_kernel_registrations: weakref.WeakKeyDictionary[Any, list[tuple[Any, Registration | Refusal]]] = (
    weakref.WeakKeyDictionary()
)


_registrations: weakref.WeakKeyDictionary[Any, list[tuple[Any, Any, Registration | Refusal]]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def findings(refusal: Refusal) -> tuple[Finding, ...]:
    """The equations ``refusal`` found not local (its survey, or itself), for an error's advice."""
    return tuple(dict.fromkeys(Finding(r.kind, r.axes, f"`{r.primitive}`") for r in refusal.survey or (refusal,)))


def refusal_text(refusal: Refusal, kernel: str, axes: Sequence[str], jax_version: str) -> str:
    """The paragraph a MissingRuleError adds when inference refused ``kernel``."""
    return (
        f"Inference (reprules.inference()) could not derive a rule for {kernel!r}: "
        f"{refusal.describe()} (mesh axes {fmt_axes(axes)}, JAX {jax_version}). "
        "A derived rule must be sound, so reprules refuses when the body is not provably local."
    )
