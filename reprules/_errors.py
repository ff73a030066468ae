"""The exceptions reprules raises, and the messages that teach.

Every message says what happened, why, and the fix, and names the kernel, the
mesh axes and the JAX version. Exceptions also subclass the builtin type JAX
itself raises in the same situation, so existing ``except`` clauses still work.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
from collections.abc import Iterable, Sequence
from typing import Any

from reprules._version import version_tuple


class ReprulesError(Exception):
    """Base class of every error raised by reprules."""


class RegistrationError(ReprulesError, ValueError):
    """A rule could not be registered (conflict, or not a kernel)."""


class RuleError(ReprulesError, ValueError):
    """A rule gave an answer that cannot be applied to this call."""


class MissingRuleError(ReprulesError, NotImplementedError, ValueError):
    """An opaque kernel reached a checked ``shard_map`` without a rule.

    Subclasses both ``NotImplementedError`` (what JAX <= 0.5 raises) and
    ``ValueError`` (what JAX >= 0.6 raises) for the same situation.
    """


class CotangentError(ReprulesError, ValueError):
    """A ``custom_vjp`` that involves a registered kernel returned a cotangent
    that reprules cannot make exact (a replicated part mixed into a varying one)."""


class UnsupportedJaxError(ReprulesError, RuntimeError):
    """The installed JAX is outside the range reprules supports."""


def fmt_axes(axes: Iterable[str]) -> str:
    """``{'data', 'model'}`` in a stable, readable order."""
    names = sorted(axes)
    return "{" + ", ".join(repr(n) for n in names) + "}" if names else "{} (replicated)"


def did_you_mean(unknown: Iterable[str], known: Iterable[str]) -> str:
    """``": did you mean 'model' (not 'modle')?"`` for the unknown names close to a known one, else ``""``."""
    choices = sorted(known)
    pairs = []
    for name in unknown:
        close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
        if close:
            pairs.append(f"{close[0]!r} (not {name!r})")
    return f": did you mean {' and '.join(pairs)}?" if pairs else "."


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    """One equation of a kernel body that is not local, as the advice of an error sees it.

    Attributes:
      kind: ``"identity"`` (reads the device's index), ``"communication"``, ``"callback"``
        (to the host), ``"prng"`` (draws from a generator whose state differs per device)
        or ``"unknown"`` (anything inference cannot see through).
      axes: The mesh axes it names; ``None`` where they are not known (any of them).
      what: The primitive, for the message (``"`psum`"``).
    """

    kind: str
    axes: tuple[str, ...] | None = None
    what: str = ""


_VERIFY = ("check the choice by running the program once under `with reprules.verify():`, which raises "
           "ReplicationMismatchError where an output differs across an axis its rule calls replicated")


def rule_advice(findings: Sequence[Finding] | None, mesh_axes: Sequence[str]) -> tuple[list[tuple[str, str]], str]:
    """The rules to suggest, each with the comment that says when it is right, and why.

    ``findings``: what the analysis of the body found that is not local (empty: the
    body is local), or ``None`` where no body was analysed. A single rule is the
    answer (follow it); several are candidates, the first always sound, for the
    user to choose among and check with ``reprules.verify()``."""
    axes = tuple(mesh_axes)
    every = f"rules.varying({', '.join(map(repr, axes))})"
    if findings is not None and not findings:
        return ([("rules.same()", "outputs vary over the union of the inputs' axes")],
                "reprules analysed its body: it only computes on each device's own blocks, so "
                "the default rule is sound")
    known = findings is not None and all(f.axes is not None and set(f.axes) <= set(axes) for f in findings)
    named = tuple(a for a in axes if known and any(a in (f.axes or ()) for f in findings or ()))
    kinds = {f.kind for f in findings or ()}
    whats = ", ".join(dict.fromkeys(f.what for f in findings or () if f.what))
    if findings is not None and kinds <= {"identity", "prng"}:
        over = named if known and "prng" not in kinds else axes
        rule = f"rules.varying({', '.join(map(repr, over))})"
        why = (f"it reads the device's index on {fmt_axes(over)}" if "prng" not in kinds else
               "it draws from a PRNG whose state differs per device")
        return [(rule, f"outputs vary over the inputs' axes and {fmt_axes(over)}")], (
            f"{why} ({whats}), so its outputs differ across {fmt_axes(over)} even for equal inputs")
    sound = f"rules.varying({', '.join(map(repr, named))})" if known and named else every
    over_text = fmt_axes(named) if known and named else "every mesh axis"
    found = [(sound, f"always sound: outputs may differ over {over_text}, what checking off assumes")]
    if findings is not None and kinds == {"communication"}:
        for group in [named] if known and named else [(a,) for a in axes]:
            found.append((f"rules.invariant({', '.join(map(repr, group))})",
                          f"if every device along {fmt_axes(group)} ends with the same outputs "
                          "(it all-reduces or all-gathers over them)"))
    if findings is None or kinds & {"unknown", "callback"}:
        found.append(("rules.same()", "if it only computes on each device's own values"))
    if findings is None:
        return found, "reprules cannot see what it computes, so no rule can be known from it"
    if len(found) == 1:
        return found, (f"its body holds {whats or 'equations that are not local'}, so its outputs may differ "
                       f"over {over_text}, and no tighter rule can be known from it")
    return found, (f"no rule can be known from its body: {whats or 'it'} may make outputs differ per device "
                   "or keep them equal")


def _advice_block(findings: Sequence[Finding] | None, mesh_axes: Sequence[str], target: str,
                  decorate: str = "") -> str:
    """The Fix paragraph: the rule(s) of :func:`rule_advice` as lines to paste, registering
    them on ``target`` (``decorate``: the function to show a decorator on, if any)."""
    found, why = rule_advice(findings, mesh_axes)
    imports = "    import reprules\n    from reprules import rules\n"
    width = max(len(r) for r, _ in found) + len(target)
    lines = "".join(f"    reprules.replication_rule({r})({target}){' ' * (width - len(r) - len(target))}"
                    f"  # {c}\n" for r, c in found)
    if len(found) == 1:
        rule, comment = found[0]
        shown = "" if rule == "rules.same()" else rule
        if decorate:
            return (f"Fix: declare it once on the kernel function ({why}):\n{imports}"
                    f"    @reprules.replication_rule({shown})  # {comment}\n    def {decorate}(...): ...\n"
                    f"or, for a kernel you cannot edit:\n{lines.rstrip()}")
        return f"Fix: register it once ({why}):\n{imports}{lines.rstrip()}"
    also = (f"\n(or as a decorator on the kernel: @reprules.replication_rule(...) above `def {decorate}(...)`)"
            if decorate else "")
    return (f"Fix: {why}. Choose the rule that says what it does, register it, and {_VERIFY}:\n"
            f"{imports}{lines.rstrip()}{also}")


def missing_rule_message(
    kernel_name: str, mesh_axes: Iterable[str], jax_version: str, kind: str = "Pallas kernel",
    jax_error: str = "", inference: str = "", site: str = "", findings: Sequence[Finding] | None = None,
) -> str:
    """The message of :class:`MissingRuleError`; ``jax_error`` is the text of the
    error JAX alone raises in the same situation, quoted at the end;
    ``inference`` why inference could not derive a rule (empty: inference was off); ``site``
    where the kernel is (``defined at file:line``); ``findings`` what the analysis of its
    body found that is not local (see :func:`rule_advice`; ``None``: no body analysed)."""
    name = kernel_name.split(" ")[0]
    axes = tuple(mesh_axes)
    if kind == "Pallas kernel":
        # A pallas_call's name= need not be a Python name: then show a placeholder.
        fn = name if name.isidentifier() else "kernel"
        fix = _advice_block(findings, axes, fn, decorate=fn)
        if fn != name:
            fix += f"\n(`{fn}`: the function JAX runs as {name!r})"
        if not inference and not findings:
            # Inference refused nothing here: it was off (it is on by default).
            fix += ("\nOr let reprules derive the rule from the kernel body, as it does by default for "
                    "kernels that only compute locally: inference is off here (`REPRULES_INFER=0` or "
                    "`reprules.inference(False)`).")
    elif kind == "FFI target":
        fix = _advice_block(findings, axes, f"reprules.ffi_target({name!r})")
    else:
        target = name if name.isidentifier() else f"<the {name!r} {kind.split()[-1]} object>"
        fix = _advice_block(findings, axes, target) + (
            f"\n(`{target}`: the {kind} object itself)" if target == name else "")
    return (
        f"The {kind} {name!r}{f' ({site})' if site else ''} has no replication rule, so it cannot run "
        f"inside a shard_map with checking on (mesh axes {fmt_axes(axes)}, "
        f"JAX {jax_version}).\n"
        f"Why: the {kind} is opaque to JAX, which therefore cannot tell over which "
        "mesh axes its outputs vary."
        + (f" {inference}" if inference else "") + "\n" + fix
        + (f"\nJAX's own error: {jax_error}" if jax_error else "")
    )


def _cast_up(value: str, axes: tuple[str, ...], jax_version: str) -> str:
    """How to cast ``value`` up to vary over ``axes`` on this JAX: ``jax.lax.pcast`` from
    0.8 (``pvary`` deprecated from 0.9), ``jax.lax.pvary`` on 0.6 - 0.7, which have no pcast."""
    old = version_tuple(jax_version)[:2] < (0, 8)
    shown = repr(axes) if axes else "axes"
    return f"jax.lax.pvary({value}, {shown})" if old else f"jax.lax.pcast({value}, {shown}, to='varying')"


def _needs(rule: str | None, over: str) -> str:
    """Why output needs to vary over ``over``: the body inference analysed (``rule`` None),
    or the kernel's registered rule (``rule``: its repr and where it was registered)."""
    if rule is None:
        return f"its body (analysed by reprules.inference()) makes it depend on inputs that vary over {over}"
    return f"its replication rule, {rule}, types it varying over {over}"


def annotation_message(
    kernel: str, index: int, missing: Iterable[str], needed: Iterable[str],
    mesh_axes: Iterable[str], jax_version: str, aliased_input: int | None = None,
    rule: str | None = None,
) -> str:
    """Output ``index`` needs axes its type says it is replicated over: by what inference
    found in its body, or (``rule``) by the kernel's registered rule.

    ``kernel`` reads like "Pallas kernel 'name'". ``aliased_input``: the input whose
    buffer the output is; JAX types the output like it, so the user never wrote
    the type they need to change."""
    over = tuple(sorted(missing))
    where = f"(mesh axes {fmt_axes(mesh_axes)}, JAX {jax_version})"
    why = ("Why: JAX believes that type, so per-device values would be treated as replicated: "
           "out_specs that drop the axis pass, and a gradient misses its psum.\n")
    cast = _cast_up("w", over, jax_version)
    if aliased_input is None:
        return (
            f"The out_shape of {kernel} annotates output {index} as replicated over {fmt_axes(over)}, "
            f"but {_needs(rule, fmt_axes(over))} {where}.\n{why}"
            f"Fix: annotate the output as varying over {fmt_axes(needed)} (or leave it unannotated "
            f"and let {'inference' if rule is None else 'the rule'} type it); if the annotation comes "
            f"from a library, cast the input it derives its type from up first, e.g. {cast}."
        )
    return (
        f"Output {index} of {kernel} is the buffer of its input {aliased_input} (aliased: "
        "input_output_aliases, or a ref that a pl.core_map body writes into), so JAX types it like "
        f"that input, replicated over {fmt_axes(over)}; but "
        + (f"its body (analysed by reprules.inference()) writes into it values that vary over {fmt_axes(over)}"
           if rule is None else _needs(rule, fmt_axes(over)))
        + f" {where}.\n"
        f"{why}"
        f"Fix: cast the array behind input {aliased_input} up before the kernel (before "
        f"jax.new_ref, for a ref), e.g. {cast}; the output is "
        f"then typed varying over {fmt_axes(needed)}."
    )


class ReplicationWarning(UserWarning):
    """A hand-written ``out_shape`` annotation said an output is replicated over
    an axis the kernel's body makes it depend on (or its registered rule types it
    varying over); reprules typed the output by the union of the annotation and
    the derived varying axes (more varying is always sound) rather than refuse
    it. ``reprules.strict()`` refuses instead."""


def annotation_union_message(kernel: str, index: int, missing: Iterable[str], typed: Iterable[str],
                             mesh_axes: Iterable[str], jax_version: str, site: str = "",
                             rule: str | None = None) -> str:
    """:class:`ReplicationWarning`: an annotation too small for what the body shows (or,
    with ``rule``, for what the kernel's registered rule says), widened."""
    over = fmt_axes(missing)
    at = f" (the out_shape was passed at {site})" if site else ""
    return (
        f"The out_shape of {kernel}{at} annotates output {index} as replicated over {over}, but "
        f"{_needs(rule, over)} "
        f"(mesh axes {fmt_axes(mesh_axes)}, JAX {jax_version}). reprules typed the output varying over "
        f"{fmt_axes(typed)}, the union of the annotation and the {'body' if rule is None else 'rule'}; "
        "a gradient that needs it gets its "
        f"psum over {over}. JAX alone believes the annotation: where it runs the kernel, that gradient is "
        "silently wrong. Fix the annotation "
        f"at its source, or cast the input it derives its type from up first "
        f"({_cast_up('...', (), jax_version)}), to silence this; reprules.strict() refuses such an "
        "annotation instead."
    )


def sound_type_message(kind: str, name: str, site: str, short: Iterable[str], typed: Iterable[str],
                       mesh_axes: Iterable[str], jax_version: str, target: str = "") -> str:
    """:class:`ReplicationWarning`: a rule-less opaque call that JAX typed replicated
    over axes its inputs vary over, typed by the union of the inputs' axes instead."""
    at = f" (called at {site})" if site else ""
    typed_text, short_text = fmt_axes(typed), fmt_axes(short)
    if target:
        fix = (f"declare how it varies, to silence this: `import reprules`, `from reprules import rules` and "
               f"`reprules.replication_rule(rules.same())({target})` if it computes each output from its "
               f"inputs' values (as typed now); `rules.invariant({sorted(short)[0]!r})` instead if it all-reduces "
               "over that axis itself (check the choice with `with reprules.verify():`)")
    else:  # measured on 0.6 - 0.12: pure_callback drops the varying axes of result_shape_dtypes
        fix = ("nothing to change in your code: a JAX callback cannot say how its results vary (it ignores the "
               "varying axes of result_shape_dtypes), so this typing is the fix; silence the warning with "
               "`warnings.filterwarnings('ignore', category=reprules.ReplicationWarning)`")
    return (
        f"The {kind} {name!r}{at} has inputs varying over {typed_text}, but JAX typed its outputs replicated "
        f"over {short_text} (mesh axes {fmt_axes(mesh_axes)}, JAX {jax_version}).\n"
        f"Why: it has no replication rule, and its abstract eval does not say how its outputs vary; JAX alone "
        f"would accept out_specs that need them replicated (returning one device's block) and a gradient "
        f"through it would miss its psum over {short_text}, silently. reprules typed every output varying "
        f"over {typed_text}, the union of the inputs' axes (JAX's rule for its own primitives), and cast the "
        "inputs up to it, so gradients are exact.\n"
        f"Fix: {fix}. reprules.strict() refuses such a call instead; REPRULES_SOUND_TYPES=0 keeps JAX's typing."
    )


def control_flow_message(what: str, site: str, axes: Sequence[str], missing: Sequence[str], inner: str,
                         mesh_axes: Iterable[str], jax_version: str) -> str:
    """:class:`RuleError`: control flow on a varying predicate whose branches reprules cannot retype."""
    over = fmt_axes(axes)
    cast = _cast_up("x", tuple(axes), jax_version)
    return (
        f"A {what} (called at {site}) has a predicate that varies over {over}, so each device may take its own "
        f"branch, but JAX types its outputs replicated over {fmt_axes(missing)} (mesh axes {fmt_axes(mesh_axes)}, "
        f"JAX {jax_version}; jax#40823). reprules retypes such control flow by casting its operands up to {over}, "
        f"but its branches hold a {inner} whose own jaxpr was typed for the old operands.\n"
        "Why: with JAX's types, out_specs that need those outputs replicated return one device's value, and a "
        "gradient through the branches misses its psum, silently.\n"
        f"Fix: cast every value the branches use (captured ones too) up to {over} before the "
        f"{what.split(' ')[0]}, e.g. x = {cast}; or make the predicate replicated (psum or all_gather it first). "
        "REPRULES_SOUND_TYPES=0 keeps JAX's typing."
    )


def out_specs_note(whats: Sequence[str], axes: Sequence[str], jax_version: str) -> str:
    """Appended to JAX's out_specs replication error where reprules typed the values varying."""
    listed = "\n".join(f"  * {w}" for w in whats)
    return (
        f"reprules (JAX {jax_version}): these values vary over {fmt_axes(axes)} because of calls that JAX alone "
        f"types replicated while they differ per device; reprules typed them soundly:\n{listed}\n"
        "Why: JAX alone would accept these out_specs and return one device's value, and so would "
        "check_vma=False.\n"
        f"Fix: keep {fmt_axes(axes)} in the out_specs of these outputs (a leading axis, e.g. P({axes[0]!r})), "
        "or reduce them over those axes first (jax.lax.psum, jax.lax.all_gather), rather than turn checking off."
    )


class ReplicationMismatchError(ReprulesError, RuntimeError):
    """Verify mode found an output that differs across an axis its rule calls replicated."""


def mismatch_fix(kernel: str, rule: str, index: int, axis: str) -> str:
    """The Fix of a :class:`ReplicationMismatchError`: ``kernel``'s rule (its repr, ``rule``)
    made to say that output ``index`` varies over ``axis``, as a line to paste."""
    import ast
    import re

    found = re.fullmatch(r"rules\.(same|like|varying|invariant)\((.*)\)", rule)
    try:
        args = ast.literal_eval(f"({found.group(2)},)") if found and found.group(2) else ()
    except (SyntaxError, ValueError):
        found = None
    if found is None:  # the user's own rule (or a derived one, which should never get here)
        how = (f"make the rule return a set with {axis!r} for output {index}"
               + (" (a derived rule should never differ: please report it)" if rule.startswith("inferred(") else "")
               + f"; or register `reprules.replication_rule(reprules.rules.varying({axis!r}), override=True)`"
               f"({kernel})`, the sound rule for what the check saw")
        return f"Fix: {how}, or make the kernel communicate over {axis!r}."
    if found.group(1) == "invariant":
        rest = [a for a in args if a != axis]
        new = f"rules.invariant({', '.join(map(repr, rest))})" if rest else "rules.same()"
    else:  # same() and like(i) type outputs by the inputs; varying(...) adds axes
        more = [a for a in args if isinstance(a, str)] if found.group(1) == "varying" else []
        new = f"rules.varying({', '.join(map(repr, [*more, axis]))})"
    target = kernel if kernel.isidentifier() else f"<the kernel {kernel!r}>"
    return (f"Fix: make the rule say the output varies over {axis!r} (or make the kernel communicate "
            f"over it):\n    import reprules\n    from reprules import rules\n"
            f"    reprules.replication_rule({new}, override=True)({target})")


def strict_message(kind: str, name: str, index: int, in_vary: Iterable[str], missing: Iterable[str],
                   mesh_axes: Sequence[str], jax_version: str) -> str:
    """The message of :class:`StrictModeError`: an opaque primitive with no rule whose
    abstract eval typed output ``index`` replicated over axes its inputs vary over."""
    if kind == "FFI target":
        target = f"reprules.ffi_target({name!r})"
    else:
        target = name if name.isidentifier() else f"<the {name!r} {kind.split()[-1]} object>"
    return (
        f"Strict mode: the {kind} {name!r} has inputs varying over {fmt_axes(in_vary)}, "
        f"but JAX typed its output {index} as replicated over {fmt_axes(missing)} "
        f"(mesh axes {fmt_axes(mesh_axes)}, JAX {jax_version}).\n"
        "Why: it has no replication rule, and its abstract eval drops the varying axes; JAX "
        "would then accept out_specs that need replication and return one device's shard.\n"
        + _advice_block(None, tuple(mesh_axes), target)
        + (f"\n(`{target}`: the {kind} object itself)" if target == name else "")
    )


class VerifyWarning(UserWarning):
    """``reprules.verify()`` skipped a check JAX cannot lower where the kernel runs (a
    ``vmap`` with ``spmd_axis_name``, a nested ``shard_map`` on JAX 0.6 - 0.9, a partially
    manual one on 0.4): the program runs as without verify, the rule unchecked there."""


class PatchWarning(ReprulesError, RuntimeWarning):
    """reprules left a JAX attribute that another library wrapped after it in place."""


def patch_left_message(where: list[str], jax_version: str) -> str:
    names = ", ".join(where)
    return (
        f"reprules did not restore {names} (JAX {jax_version}): another library (a profiler, "
        "another shim) replaced it after reprules patched it, so its wrapper is left in place and "
        "reprules' own hook inside it now passes every call through unchanged.\n"
        "Why: restoring JAX's original would silently drop the other library's wrapper.\n"
        "Fix: nothing is needed for correctness; to leave no reprules frame behind, remove the "
        "other library's patch before reprules deactivates (before the last rule is unregistered "
        "or strict mode ends)."
    )


class StrictModeError(ReprulesError, ValueError):
    """Strict mode refused an opaque primitive that JAX would type as replicated."""


def mixed_cotangent_message(
    function: str, input_name: str, primal_type: str, axes: Iterable[str],
    mesh_axes: Iterable[str], jax_version: str, psummed_by: str = "reprules",
    bwd: Any = None, position: int | None = None, causes: Sequence[tuple[str, str]] = (),
) -> str:
    """:class:`CotangentError`, explained in the terms of the user's bwd: ``bwd`` (the function,
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


def hidden_mesh_message(kernel: str, rule: str, known: Sequence[str], in_scope: Sequence[str],
                        at_known: str, at_scope: str, jax_version: str) -> str:
    """A kernel called where code replaced the shard_map's abstract mesh, and its rule's answer depends on it."""
    return (
        f"reprules cannot type the outputs of {kernel} (rule {rule}): it is called inside a checked "
        "shard_map where the abstract mesh does not name the manual axes "
        f"(mesh axes {fmt_axes(known)} known from its inputs, {fmt_axes(in_scope)} in scope, JAX {jax_version}).\n"
        "Why: code around the call replaced the shard_map's abstract mesh (jax.sharding.use_abstract_mesh), "
        "so reprules cannot see which axes are manual there, and the rule's answer depends on them: "
        f"over {fmt_axes(known)} it is {at_known}, over {fmt_axes(in_scope)} it is {at_scope}. Typing the "
        "outputs by either could make them replicated where they differ per device.\n"
        "Fix: call the kernel outside the use_abstract_mesh block (or enter it with the shard_map's "
        "manual axes), or turn checking off for this shard_map (check_vma=False)."
    )


def hidden_mesh_core_map_message(kernel: str, outputs: Sequence[Iterable[str]], known: Sequence[str],
                                 jax_version: str) -> str:
    """A 0.8 - 0.9 ``pl.kernel`` with varying outputs called where the abstract mesh hides the manual axes."""
    return (
        f"reprules cannot type the outputs of pl.kernel body {kernel!r} varying over "
        f"{[sorted(o) for o in outputs]}: it is called inside a checked shard_map where the abstract mesh does "
        f"not name the manual axes (mesh axes {fmt_axes(known)} known from its inputs, JAX {jax_version}).\n"
        f"Why: JAX {jax_version} runs a pl.kernel as a pallas_call it builds when the kernel is traced, "
        "typing its outputs on the current abstract mesh, and a type on a mesh with no manual axes "
        "cannot vary (JAX alone types them replicated, whatever the body writes).\n"
        "Fix: call the kernel outside the use_abstract_mesh block (or enter it with the shard_map's "
        "manual axes), or upgrade to JAX 0.10+, where pl.kernel's outputs are typed at the call."
    )


def core_map_rule_message(where: str, rule: str, name: str, mesh_axes: Sequence[str], jax_version: str) -> str:
    """A rule registered on a function passed to ``pl.core_map``, which no rule can type."""
    return (
        f"The function {where!r} passed to pl.core_map has the replication rule {rule}, "
        "but reprules cannot apply a rule to pl.core_map "
        f"(mesh axes {fmt_axes(mesh_axes)}, JAX {jax_version}).\n"
        "Why: pl.core_map has no outputs. It writes into refs its caller made, and JAX types them "
        "by the values they were made from; a rule cannot change those types, and ignoring it "
        "silently could hide a wrong one.\n"
        "Fix: call the body through pl.kernel(body, out_shape=..., mesh=...) (JAX 0.8+), with the "
        "rule on the body, or make the output refs from values that vary as the outputs do "
        "(cast them up with jax.lax.pvary / jax.lax.pcast(..., to='varying') before "
        f"jax.new_ref) and remove the rule: reprules.unregister({name})."
    )


def mpmd_disagreement_message(answers: Sequence[tuple[str, str, Any, Any]], num_bodies: int,
                              mesh_axes: Sequence[str], jax_version: str) -> str:
    """Bodies of one MPMD ``pl.kernel`` whose rules disagree: ``(where, rule, outputs, inputs)`` each."""
    lines = "\n".join(
        f"  - {where!r} (rule {rule}): outputs vary over {[sorted(o) for o in outputs]}, inputs cast to "
        f"{'as they are' if inputs is None else [sorted(i) for i in inputs]}"
        for where, rule, outputs, inputs in answers
    )
    return (
        f"The MPMD pl.kernel with {num_bodies} bodies has registered bodies whose replication "
        f"rules disagree (mesh axes {fmt_axes(mesh_axes)}, JAX {jax_version}):\n"
        f"{lines}\n"
        "Why: the bodies run as one kernel with one set of outputs, so reprules types them by "
        "the rule of its registered bodies, which must give the same answer.\n"
        "Fix: register the same rule on every body (or on one of them)."
    )
