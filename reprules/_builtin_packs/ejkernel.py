"""Rules for ejkernel's Pallas kernels: derived from their bodies, two refused.

ejkernel (EasyDeL's kernel library, PyPI ``ejkernel``) launches most of its
Pallas kernels through ``functools.partial``s and closures made per call, so,
as for tokamax, this pack registers ``rules.inferred()`` on every kernel
defined in ejkernel's source: each call gets the rule ``reprules.inference()``
derives from that kernel's body (or a ``MissingRuleError`` saying which
primitive stops it). Entry point ``ejkernel`` of the ``reprules.rules`` group:
loaded right after ``import ejkernel``.

Two backward kernels get a refusal instead. ejkernel's vocab-parallel
``fused_cross_entropy`` and ``fused_kl_divergence`` (``vocab_parallel_axis=``)
multiply the logits gradient by ``psum(1, axis)`` in their ``custom_vjp`` bwd,
to undo the cotangent split that ``shard_map(check_vma=False)`` applies to a
replicated output. With checking on there is no split, so the gradient comes
out ``axis size`` times too large, silently. The kernels themselves are local;
what is wrong is ejkernel's bwd around them, which no rule can correct, so the
pack refuses the backward kernel exactly when it is called as the
vocab-parallel bwd calls it: logits varying over an axis the (psummed)
log-sum-exp is replicated over. The forward pass, and the ops without
``vocab_parallel_axis``, are unaffected.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

import reprules
from reprules import rules
from reprules._errors import fmt_axes

# (module under ejkernel, kernel, index of the psummed log-sum-exp input, op) of each refused bwd kernel.
REFUSED: tuple[tuple[str, str, int, str], ...] = (
    ("kernels._pallas.tpu.fused_cross_entropy._pallas_impl_bwd", "_ce_bwd_kernel", 1, "fused_cross_entropy"),
    ("kernels._pallas.tpu.fused_kl_divergence._pallas_impl_bwd", "_kl_bwd_kernel", 2, "fused_kl_divergence"),
)


@dataclasses.dataclass(frozen=True)
class _refuse_vocab_parallel_bwd:
    """``rules.same()``, except where input 0 (the logits' local vocab shard)
    varies over an axis input ``lse`` does not: the vocab-parallel bwd, refused.
    Frozen, so the pack registering it again (a test, a reload) is harmless."""

    op: str
    lse: int

    def __call__(self, ctx: rules.RuleContext, in_varying: tuple[rules.VaryingSet, ...], /) -> rules.RuleResult:
        split = in_varying[0] - in_varying[self.lse] if len(in_varying) > self.lse else frozenset()
        if split:
            axes = fmt_axes(sorted(split))
            raise reprules.RuleError(
                f"ejkernel's {self.op}(..., vocab_parallel_axis=...) backward kernel {ctx.kernel_name!r} "
                f"is refused under check_vma=True (vocab sharded over {axes}, mesh axes "
                f"{fmt_axes(ctx.mesh_axes)}, JAX {ctx.jax_version}).\n"
                f"Why: ejkernel's custom_vjp bwd multiplies the logits gradient by psum(1, {axes}) to undo "
                "the cotangent split shard_map applies with check_vma=False. With checking on there is no "
                "split, so the gradient would be the axis size times too large, silently.\n"
                f"Fix: run this op in a shard_map with check_vma=False, or call {self.op} without "
                "vocab_parallel_axis on logits replicated over that axis (exact under checking)."
            )
        return rules.same()(ctx, in_varying)

    def __repr__(self) -> str:
        return f"rules.same(), refused for ejkernel {self.op}(vocab_parallel_axis=...) bwd"


def ejkernel(module: ModuleType) -> None:
    """Every Pallas kernel in ejkernel gets the rule derived from its body; the
    vocab-parallel bwd kernels of cross-entropy and KL divergence are refused."""
    reprules.replication_rule(rules.inferred())(reprules.kernels_in(module.__name__))
    missing = []
    for sub, name, lse, op in REFUSED:
        try:
            kernel = getattr(importlib.import_module(f"{module.__name__}.{sub}"), name)
        except (ImportError, AttributeError):
            missing.append(f"{sub}.{name}")
            continue
        reprules.replication_rule(_refuse_vocab_parallel_bwd(op, lse))(kernel)
    if missing:
        raise LookupError(
            f"ejkernel has no {', '.join(missing)}: renamed or removed, so its vocab-parallel backward "
            "is not refused (every other kernel has its inferred rule).\n"
            "Fix: upgrade reprules; until then do not use vocab_parallel_axis= under check_vma=True."
        )
