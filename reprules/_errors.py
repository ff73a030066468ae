"""The exceptions reprules raises, and the messages that teach.

Every message says what happened, why, and the fix, and names the kernel, the
mesh axes and the JAX version. Exceptions also subclass the builtin type JAX
itself raises in the same situation, so existing ``except`` clauses still work.
"""

from __future__ import annotations

from collections.abc import Iterable


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


class UnsupportedJaxError(ReprulesError, RuntimeError):
    """The installed JAX is outside the range reprules supports."""


def fmt_axes(axes: Iterable[str]) -> str:
    """``{'data', 'model'}`` in a stable, readable order."""
    names = sorted(axes)
    return "{" + ", ".join(repr(n) for n in names) + "}" if names else "{} (replicated)"


def missing_rule_message(
    kernel_name: str, mesh_axes: Iterable[str], jax_version: str, kind: str = "Pallas kernel"
) -> str:
    name = kernel_name.split(" ")[0]
    if kind == "Pallas kernel":
        fix = (
            "Fix: declare it once on the kernel function, e.g.\n"
            "    @reprules.replication_rule()          # outputs vary like the union of the inputs\n"
            f"    def {name}(...): ...\n"
            "or, for a kernel you cannot edit, "
            f"`reprules.replication_rule(rules.same())({name})`."
        )
    elif kind == "FFI target":
        fix = (
            "Fix: register the target once, e.g.\n"
            f"    reprules.replication_rule(rules.same())(reprules.ffi_target({name!r}))"
        )
    else:
        fix = (
            "Fix: register it once, e.g.\n"
            f"    reprules.replication_rule(rules.same())(<the {name} {kind.split()[-1]} object>)"
        )
    return (
        f"The {kind} {name!r} has no replication rule, so it cannot run "
        f"inside a shard_map with checking on (mesh axes {fmt_axes(mesh_axes)}, "
        f"JAX {jax_version}).\n"
        f"Why: the {kind} is opaque to JAX, which therefore cannot tell over which "
        "mesh axes its outputs vary.\n" + fix
    )


class ReplicationMismatchError(ReprulesError, RuntimeError):
    """Verify mode found an output that differs across an axis its rule calls replicated."""


class StrictModeError(ReprulesError, ValueError):
    """Strict mode refused an opaque primitive that JAX would type as replicated."""
