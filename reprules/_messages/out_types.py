"""Output types JAX alone gets wrong: annotations, rule-less opaque calls, control flow.

The messages of an ``out_shape`` annotation narrower than the kernel's rule (a
:class:`~reprules.RuleError`, or the :class:`~reprules.ReplicationWarning` of
its widening), of a rule-less opaque call or varying-predicate control flow
that reprules typed soundly, and the note it adds to JAX's out_specs error.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from reprules._errors import fmt_axes
from reprules._version import version_tuple


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


def annotation_union_message(kernel: str, index: int, missing: Iterable[str], typed: Iterable[str],
                             mesh_axes: Iterable[str], jax_version: str, site: str = "",
                             rule: str | None = None) -> str:
    """:class:`~reprules.ReplicationWarning`: an annotation too small for what the body shows (or,
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
                       mesh_axes: Iterable[str], jax_version: str, target: str, importing: str = "") -> str:
    """:class:`~reprules.ReplicationWarning`: a rule-less opaque call that JAX typed replicated
    over axes its inputs vary over, typed by the union of the inputs' axes instead (``target``:
    what a rule is registered on, ``importing`` the line that imports it; callbacks have their
    own message, with the decorator)."""
    at = f" (called at {site})" if site else ""
    typed_text, short_text = fmt_axes(typed), fmt_axes(short)
    fix = (f"declare how it varies, to silence this: {f'`{importing}`, ' if importing else ''}"
           "`import reprules`, `from reprules import rules` and "
           f"`reprules.replication_rule(rules.same())({target})` if it computes each output from its "
           f"inputs' values (as typed now); `rules.invariant({sorted(short)[0]!r})` instead if it all-reduces "
           "over that axis itself (check the choice with `with reprules.verify():`)")
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


def callback_message(name: str, site: str, short: Iterable[str], typed: Iterable[str], mesh_axes: Iterable[str],
                     jax_version: str, fix: str, io: bool) -> str:
    """:class:`~reprules.ReplicationWarning`: a rule-less JAX callback typed soundly: a ``pure_callback``
    by the union of its inputs' axes, an ``io_callback`` (``io``) varying over every manual axis;
    ``fix``: the rule to declare, as the shim finds the host function."""
    at = f" (called at {site})" if site else ""
    typed_text, short_text, mesh = fmt_axes(typed), fmt_axes(short), fmt_axes(mesh_axes)
    if io:
        what = (f"runs on every device against host state, so its results may differ per device whatever its "
                f"inputs, but JAX typed them replicated over {short_text}")
        typing = f"every output varying over {typed_text}, every manual axis of the shard_map"
        keep = (" Keep the varying axes in the out_specs, or reduce the results over them (jax.lax.psum, "
                "jax.lax.all_gather).")
    else:
        what = f"has inputs varying over {typed_text}, but JAX typed its outputs replicated over {short_text}"
        typing = (f"every output varying over {typed_text}, the union of the inputs' axes (JAX's rule for its own "
                  "primitives), and cast the inputs up to it, so gradients are exact")
        keep = ""
    return (
        f"The JAX callback {name!r}{at} {what} (mesh axes {mesh}, JAX {jax_version}).\n"
        "Why: its host function has no replication rule, and a JAX callback cannot say how its results vary (it "
        "ignores the varying axes of result_shape_dtypes); JAX alone would accept out_specs that need them "
        f"replicated (returning one device's block) and a gradient through it would miss its psum over "
        f"{short_text}, silently. reprules typed {typing}.\n"
        f"Fix: {fix}; that silences this (check the choice with `with reprules.verify():`).{keep} "
        "reprules.strict() refuses such a call without a rule; REPRULES_SOUND_TYPES=0 keeps JAX's typing."
    )


def control_flow_message(what: str, site: str, axes: Sequence[str], missing: Sequence[str], inner: str,
                         mesh_axes: Iterable[str], jax_version: str, enclosing: bool = False) -> str:
    """:class:`~reprules.RuleError`: control flow on a varying predicate whose branches reprules cannot
    retype (``enclosing``: its own predicate is replicated, its operands were cast up by an enclosing one)."""
    over = fmt_axes(axes)
    cast = _cast_up("x", tuple(axes), jax_version)
    if enclosing:
        what_happened = (
            f"A {what} (called at {site}) sits in a branch of control flow whose predicate varies over {over}: "
            f"reprules cast that branch's values up to {over} (mesh axes {fmt_axes(mesh_axes)}, JAX "
            f"{jax_version}; jax#40823), so this {what.split(' ')[0]} must be typed again for them, ")
    else:
        what_happened = (
            f"A {what} (called at {site}) has a predicate that varies over {over}, so each device may take its "
            f"own branch, but JAX types its outputs replicated over {fmt_axes(missing)} (mesh axes "
            f"{fmt_axes(mesh_axes)}, JAX {jax_version}; jax#40823). reprules retypes such control flow by "
            f"casting its operands up to {over}, ")
    return (
        what_happened + f"but its branches hold a {inner} whose own jaxpr was typed for the old operands.\n"
        "Why: with JAX's types, out_specs that need those outputs replicated return one device's value, and a "
        "gradient through the branches misses its psum, silently.\n"
        f"Fix: cast every value the branches use (captured ones too) up to {over} before the "
        f"{what.split(' ')[0]}, e.g. x = {cast}; or make the predicate replicated (psum or all_gather it first). "
        "REPRULES_SOUND_TYPES=0 keeps JAX's typing."
    )


def out_specs_note(whats: Sequence[str], axes: Sequence[str], jax_version: str,
                   mesh_axes: Iterable[str] = ()) -> str:
    """Appended to JAX's out_specs replication error where reprules typed the values varying."""
    listed = "\n".join(f"  * {w}" for w in whats)
    mesh = f"mesh axes {fmt_axes(mesh_axes)}, " if mesh_axes else ""
    return (
        f"reprules ({mesh}JAX {jax_version}): these values vary over {fmt_axes(axes)} because of calls that JAX alone "
        f"types replicated while they differ per device; reprules typed them soundly:\n{listed}\n"
        "Why: JAX alone would accept these out_specs and return one device's value, and so would "
        "check_vma=False.\n"
        f"Fix: keep {fmt_axes(axes)} in the out_specs of these outputs (a leading axis, e.g. P({axes[0]!r})), "
        "or reduce them over those axes first (jax.lax.psum, jax.lax.all_gather), rather than turn checking off."
    )
