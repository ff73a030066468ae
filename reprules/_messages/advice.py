"""The rule to write: the Fix of a kernel with no rule, a strict-mode refusal, a broken rule.

:func:`rule_advice` turns what the analysis of a kernel body found that is not
local (:class:`Finding`) into the rule(s) to suggest, each with the comment that
says when it is right; the messages of :class:`~reprules.MissingRuleError` and
:class:`~reprules.StrictModeError` show them as lines to paste, and
:func:`mismatch_fix` the rule a :class:`~reprules.ReplicationMismatchError` asks for.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterable, Sequence

from reprules._errors import fmt_axes


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
    function: str | None = None,
) -> str:
    """The message of :class:`~reprules.MissingRuleError`; ``jax_error`` is the text of the
    error JAX alone raises in the same situation, quoted at the end;
    ``inference`` why inference could not derive a rule (empty: inference was off); ``site``
    where the kernel is (``defined at file:line``); ``findings`` what the analysis of its
    body found that is not local (see :func:`rule_advice`; ``None``: no body analysed);
    ``function`` the name of the kernel's ``def`` where known (a ``name=`` may differ)."""
    name = kernel_name.split(" ")[0]
    axes = tuple(mesh_axes)
    if kind == "Pallas kernel":
        # A pallas_call's name= need not be the kernel's def, nor a Python name: the def's
        # name where its site is known, else a placeholder.
        fn = function or (name if name.isidentifier() else "kernel")
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


def strict_message(kind: str, name: str, index: int, in_vary: Iterable[str], missing: Iterable[str],
                   mesh_axes: Sequence[str], jax_version: str) -> str:
    """The message of :class:`~reprules.StrictModeError`: an opaque primitive with no rule whose
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


def mismatch_fix(kernel: str, rule: str, index: int, axis: str) -> str:
    """The Fix of a :class:`~reprules.ReplicationMismatchError`: ``kernel``'s rule (its repr, ``rule``)
    made to say that output ``index`` varies over ``axis``, as a line to paste."""
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
