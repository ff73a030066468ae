"""The rule vocabulary: how a kernel's outputs vary over the mesh axes.

A *rule* is told, for one call of a kernel inside ``shard_map``, which mesh axes
each input varies over (its "varying set"; an input replicated over every axis
has the empty set). It answers which axes each output varies over and,
optionally, which set each input should be cast up to before the call.

Casting an input up to more axes is free in the forward pass; its transpose is
the psum of the input's cotangent over exactly those axes, which is the
all-reduce the gradient needs. Nothing else is ever added.

The built-in rules are frozen dataclasses, so ``rules.same() == rules.same()``
and registering the same rule twice is harmless. Any callable matching
:class:`Rule` is a rule too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence, Set
from typing import Protocol, Union

from reprules._errors import RuleError, did_you_mean, fmt_axes

__all__ = [
    "Decision",
    "Rule",
    "RuleContext",
    "RuleLike",
    "RuleResult",
    "VaryingSet",
    "inferred",
    "invariant",
    "like",
    "same",
    "varying",
]

VaryingSet = frozenset[str]
"""The mesh axes a value varies over (``frozenset()``: replicated over every axis)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RuleContext:
    """What a rule knows about the call it decides.

    Attributes:
      kernel_name: The kernel's name, as JAX reports it.
      kernel: The registered kernel function (or primitive) itself.
      mesh_axes: The manual mesh axes of the enclosing ``shard_map``.
      num_inputs: Number of (flattened) array inputs the kernel is called with.
      num_outputs: Number of (flattened) outputs.
      jax_version: ``jax.__version__``, for messages.
    """

    kernel_name: str
    kernel: object
    mesh_axes: tuple[str, ...]
    num_inputs: int
    num_outputs: int
    jax_version: str


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """A rule's answer.

    Attributes:
      outputs: One varying set per output.
      inputs: One varying set per input, each a superset of that input's
        current set: the input is cast up to it before the call (its cotangent
        is psummed over the added axes). ``None`` passes the inputs as they are.
        From JAX 0.6 a ``pallas_call``, which JAX cannot transpose, is cast
        only where an output aliases an input; around it, a ``custom_vjp``'s
        cotangents get the same psums from reprules.
    """

    outputs: tuple[VaryingSet, ...]
    inputs: tuple[VaryingSet, ...] | None = None


RuleResult = Union[Decision, Sequence[Set[str]]]
"""What a rule returns: a :class:`Decision`, or one set of axis names per output."""


class Rule(Protocol):
    """The signature of a rule: ``rule(ctx, in_varying) -> RuleResult``.

    ``ctx`` is the :class:`RuleContext` of this call and ``in_varying`` holds
    one frozenset of mesh-axis names per input. A rule returns a
    :class:`Decision`, or simply a sequence of one set per output (inputs are
    then passed as they are).
    """

    def __call__(self, ctx: RuleContext, in_varying: tuple[VaryingSet, ...], /) -> RuleResult: ...


def _target(kernel_name: str) -> str:
    """What a pasted registration names: the kernel, where its name is a Python name."""
    name = kernel_name.split(" ")[0]
    return name if name.isidentifier() else f"<the kernel {name!r}>"


def _union(sets: Sequence[VaryingSet]) -> VaryingSet:
    return frozenset().union(*sets)


def _check_axes(rule: object, axes: tuple[str, ...], ctx: RuleContext) -> None:
    unknown = [a for a in axes if a not in ctx.mesh_axes]
    if unknown:
        raise RuleError(
            f"Rule {rule} of kernel {ctx.kernel_name!r} names mesh axes {unknown} that are "
            f"not manual axes of the enclosing shard_map (axes {fmt_axes(ctx.mesh_axes)}, "
            f"JAX {ctx.jax_version}).\n"
            "Why: a value can only vary over the manual axes of the shard_map it lives in.\n"
            "Fix: name only axes of the shard_map's mesh in the rule"
            + did_you_mean([a for a in unknown if isinstance(a, str)], ctx.mesh_axes)
        )


@dataclasses.dataclass(frozen=True, slots=True)
class same:
    """Every output varies over the union of the inputs' varying sets.

    Inputs that vary over fewer axes are cast up to that union, so the
    transpose psums their cotangents over exactly the missing axes (e.g. a
    replicated weight's gradient over ``data``). The default rule.
    """

    def __call__(self, ctx: RuleContext, in_varying: tuple[VaryingSet, ...], /) -> Decision:
        union = _union(in_varying)
        return Decision(outputs=(union,) * ctx.num_outputs, inputs=(union,) * len(in_varying))

    def __repr__(self) -> str:
        return "rules.same()"


@dataclasses.dataclass(frozen=True, slots=True)
class like:
    """Every output varies exactly like input ``index``.

    Other inputs are cast up to input ``index``'s set. An input that varies over
    an axis input ``index`` does not vary over is an error: the outputs would
    then depend on it while claiming to be replicated; use :class:`same` or
    :class:`invariant` instead.
    """

    index: int

    def __call__(self, ctx: RuleContext, in_varying: tuple[VaryingSet, ...], /) -> Decision:
        if not -len(in_varying) <= self.index < len(in_varying):
            raise RuleError(
                f"Rule {self} of kernel {ctx.kernel_name!r} refers to input {self.index}, but the "
                f"kernel was called with {len(in_varying)} inputs (mesh axes "
                f"{fmt_axes(ctx.mesh_axes)}, JAX {ctx.jax_version}).\n"
                "Why: like(i) copies the varying axes of input i, which this call does not have.\n"
                "Fix: use the index of an input of this call."
            )
        target = in_varying[self.index]
        for i, v in enumerate(in_varying):
            if not v <= target:
                raise RuleError(
                    f"Rule {self} of kernel {ctx.kernel_name!r} says the outputs vary like input "
                    f"{self.index} (over {fmt_axes(target)}), but input {i} varies over "
                    f"{fmt_axes(v)} (mesh axes {fmt_axes(ctx.mesh_axes)}, JAX {ctx.jax_version}).\n"
                    "Why: the outputs would depend on values that differ across those axes while "
                    "being typed as replicated over them.\n"
                    "Fix: type the outputs by every input (sound for a kernel that computes locally; "
                    "check it with reprules.verify()):\n    import reprules\n    from reprules import rules\n"
                    f"    reprules.replication_rule(rules.same(), override=True)({_target(ctx.kernel_name)})"
                )
        return Decision(outputs=(target,) * ctx.num_outputs, inputs=(target,) * len(in_varying))

    def __repr__(self) -> str:
        return f"rules.like({self.index})"


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class varying:
    """Outputs vary over the inputs' union *and* over ``axes``.

    For kernels whose outputs differ across devices even for replicated inputs,
    e.g. a kernel that reads its device index or a per-device random seed.
    """

    axes: tuple[str, ...]

    def __init__(self, *axes: str):
        object.__setattr__(self, "axes", tuple(axes))

    def __call__(self, ctx: RuleContext, in_varying: tuple[VaryingSet, ...], /) -> Decision:
        _check_axes(self, self.axes, ctx)
        union = _union(in_varying)
        return Decision(
            outputs=(union | frozenset(self.axes),) * ctx.num_outputs,
            inputs=(union,) * len(in_varying),
        )

    def __repr__(self) -> str:
        return f"rules.varying({', '.join(map(repr, self.axes))})"


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class invariant:
    """Outputs are replicated over ``axes``; otherwise like :class:`same`.

    For kernels that communicate internally (all-reduce or all-gather over
    ``axes``), so their outputs are identical across those axes.
    """

    axes: tuple[str, ...]

    def __init__(self, *axes: str):
        object.__setattr__(self, "axes", tuple(axes))

    def __call__(self, ctx: RuleContext, in_varying: tuple[VaryingSet, ...], /) -> Decision:
        _check_axes(self, self.axes, ctx)
        union = _union(in_varying)
        return Decision(
            outputs=(union - frozenset(self.axes),) * ctx.num_outputs,
            inputs=(union,) * len(in_varying),
        )

    def __repr__(self) -> str:
        return f"rules.invariant({', '.join(map(repr, self.axes))})"


@dataclasses.dataclass(frozen=True, slots=True)
class inferred:
    """Derive each kernel's rule from its body, as ``reprules.inference()`` does,
    for every kernel of a package: ``replication_rule(rules.inferred())(
    reprules.kernels_in("pkg"))``. Sound or refused: a kernel whose body reads
    its device index, communicates or holds a primitive reprules does not know
    gets no rule, and a :class:`reprules.MissingRuleError` says why.

    It is a marker, not a rule of its own: the shim replaces it, call by call,
    with the rule derived from that call's kernel.
    """

    def __call__(self, ctx: RuleContext, in_varying: tuple[VaryingSet, ...], /) -> Decision:
        raise RuleError(  # reprules never calls it; a user calling it by hand learns why
            f"rules.inferred() was called for kernel {ctx.kernel_name!r} (mesh axes "
            f"{fmt_axes(ctx.mesh_axes)}, JAX {ctx.jax_version}).\n"
            "Why: it marks a package whose kernels get rules derived from their bodies; it has no "
            "answer of its own.\n"
            "Fix: register it on reprules.kernels_in(\"pkg\"), and give a single kernel a rule such as "
            "reprules.rules.same() (with `import reprules`)."
        )

    def __repr__(self) -> str:
        return "rules.inferred()"


RuleLike = Union[Rule, Callable[[RuleContext, tuple[VaryingSet, ...]], RuleResult]]
"""A rule: one of this module's rules (``same()``, ``like(i)``, ...) or any
``rule(ctx, in_varying)`` callable returning a :data:`RuleResult`."""
