"""Where a kernel is called: a hidden abstract mesh, ``pl.core_map``, an MPMD ``pl.kernel``.

Calls whose outputs no rule can type: inside a ``jax.sharding.use_abstract_mesh``
block that hides the manual axes, through ``pl.core_map`` (which has no outputs),
or as an MPMD ``pl.kernel`` whose bodies' rules disagree.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from reprules._errors import fmt_axes


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
