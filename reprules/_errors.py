"""The exceptions and warnings reprules raises, and the formatting their messages share.

Every message says what happened, why, and the fix, and names the kernel, the
mesh axes and the JAX version. The messages are built in ``reprules/_messages/``,
one module per concern (its ``__init__`` lists them); PatchWarning's, about
reprules itself rather than a kernel, is here beside it. Exceptions also
subclass the builtin type JAX itself raises in the same situation, so existing
``except`` clauses still work.
"""

from __future__ import annotations

import difflib
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


class CotangentError(ReprulesError, ValueError):
    """A ``custom_vjp`` that involves a registered kernel returned a cotangent
    that reprules cannot make exact (a replicated part mixed into a varying one)."""


class UnsupportedJaxError(ReprulesError, RuntimeError):
    """The installed JAX is outside the range reprules supports."""


class ReplicationMismatchError(ReprulesError, RuntimeError):
    """Verify mode found an output that differs across an axis its rule calls replicated."""


class StrictModeError(ReprulesError, ValueError):
    """Strict mode refused an opaque primitive that JAX would type as replicated."""


class ReplicationWarning(UserWarning):
    """A hand-written ``out_shape`` annotation said an output is replicated over
    an axis the kernel's body makes it depend on (or its registered rule types it
    varying over); reprules typed the output by the union of the annotation and
    the derived varying axes (more varying is always sound) rather than refuse
    it. ``reprules.strict()`` refuses instead."""


class VerifyWarning(UserWarning):
    """``reprules.verify()`` skipped a check JAX cannot lower where the kernel runs (a
    ``vmap`` with ``spmd_axis_name``, a nested ``shard_map`` on JAX 0.6 - 0.9, a partially
    manual one on 0.4): the program runs as without verify, the rule unchecked there."""


class PatchWarning(ReprulesError, RuntimeWarning):
    """reprules left a JAX attribute that another library wrapped after it in place."""


def patch_left_message(where: list[str], jax_version: str) -> str:
    """The message of :class:`PatchWarning`: ``where`` names the JAX attributes left wrapped."""
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
