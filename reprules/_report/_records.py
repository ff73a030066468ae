"""The collectives report's records and their rendering: :class:`Kernel`, :class:`Collective`, :class:`Report`.

What :func:`reprules.testing.collectives` returns. Built by
:mod:`reprules._report._levels` from the jaxpr walk (:mod:`reprules._report._walk`) and the
StableHLO/HLO text (:mod:`reprules._report._hlo`); how a collective is judged
defensive is documented in :mod:`reprules._report._walk`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable
from typing import Any

from reprules._report import _hlo, _link_model
from reprules._report._comm import CheaperCollective, ImplicitCollective, table_lines

LEVELS = ("jaxpr", "stablehlo", "hlo")
COST_CONVENTION = ("buffer B: the operand per device (an all-gather's result); sent B: what each device sends "
                   "per step, ring algorithms: all-reduce 2(n-1)/n x buffer, all-gather, reduce-scatter and "
                   "all-to-all (n-1)/n x buffer, collective-permute the buffer")
ADDED_TEXT = "added by reprules"
ADDED_MEANING = ("needed: a psum reprules added to a custom_vjp bwd's cotangent, exact as it varies over the "
                 "axes summed; source: that bwd")


@dataclasses.dataclass(frozen=True, slots=True)
class Kernel:
    """An opaque kernel (Pallas call, FFI call...) found under ``shard_map``.

    Attributes:
      name: The kernel's name (the kernel function's ``__name__`` for Pallas).
      primitive: The JAX primitive (``pallas_call``, ``ffi_call``...).
      source: ``file:line`` of the kernel definition (on JAX 0.4.28, of its
        first traced line) or of the call, if known.
      has_rule: Whether a reprules replication rule is registered for it,
        found by identity (the kernel object, the FFI target, the primitive)
        as the checking finds it, never by a name another kernel shares.
      rule: The rule's ``repr``, or ``""``.
      checked: Whether its ``shard_map`` runs with checking on.
      count: How many calls of it the program has.
      identified: False when reprules did not see this kernel's call (traced
        before its rule was registered, or through a ``pallas_call`` made
        before reprules activated) and a registered kernel could be it:
        ``has_rule`` is then False, as no rule was found, but the kernel may
        be one of ``candidates``.
      candidates: ``module.qualname`` of the registered kernels it could be.
    """

    name: str
    primitive: str
    source: str
    has_rule: bool
    rule: str
    checked: bool | None
    count: int = 1
    identified: bool = True
    candidates: tuple[str, ...] = ()

    def status(self) -> str:
        """``rule rules.same()``, ``NO RULE`` or ``NOT IDENTIFIED (...)``."""
        if self.has_rule:
            return f"rule {self.rule}"
        if self.identified:
            return "NO RULE"
        return (f"NOT IDENTIFIED (reprules did not see this call; it may be {', '.join(self.candidates)}, "
                "which has a rule: trace it after registering)")

    def decorator(self) -> str:
        """The line that gives this kernel a rule."""
        return f"@reprules.replication_rule()  # above `def {self.name}`"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True, slots=True)
class Collective:
    """One collective of a program, matched across the three levels.

    Attributes:
      kind: ``all-reduce``, ``all-gather``, ``reduce-scatter``,
        ``collective-permute`` or ``all-to-all``.
      levels: Where it appears: a subset of ``("jaxpr", "stablehlo", "hlo")``.
      dtype: Element type (HLO spelling: ``f32``, ``bf16``...).
      shapes: Per-device result shape(s).
      bytes: Per-device bytes moved: the larger of the operand and the result
        (the result for an all-gather, the operand for a reduce-scatter).
      axes: Mesh axes it runs over, or ``None`` when the groups match none.
      groups: The replica groups as printed, when ``axes`` is ``None``.
      defensive: A transpose all-reduce over axes where its operand is
        replicated (see the module docstring).
      replicated_axes: The summed axes over which the operand was replicated.
      origin: ``"autodiff"`` (made by a backward pass), ``"program"``, or
        ``"xla"`` (only in compiled HLO: added by the SPMD partitioner).
      primitive: The jaxpr primitive (``psum``, ``psum_invariant``...), or ``""``.
      op_name: JAX's name stack for it (``transpose(jvp())/shard_map/psum``).
      source: ``file:line`` of the user code that made it, if known.
      is_async: Compiled as an asynchronous start/done pair (counted once).
      checked: Whether its ``shard_map`` runs with checking on (``None``
        outside ``shard_map``).
      kernels_without_rule: Opaque kernels without a rule in the same
        ``shard_map``: the likely reason checking is off.
      lines: ``(level, text)`` of the matched StableHLO/HLO instructions.
      executions: How often it runs per step: the trip count of the ``scan``s
        around it (1 outside any; a ``while`` loop's count is unknown: 1).
      added_by: ``"reprules"`` for a psum reprules added to a ``custom_vjp``
        bwd's cotangent (or the transpose of a cast it added there): its
        ``source`` is then that bwd's ``def`` line (for a bwd inside a library,
        the user's call of the ``custom_vjp`` function); else ``""``.
      sizes: The mesh size of each of ``axes``.
      group: Devices per replica group, where ``axes`` is ``None`` (read from the groups).

    **Cost** (one model for every figure of a report, :mod:`reprules._report._link_model`):
    ``bytes`` is the buffer ``S``; :attr:`sent_bytes` what each device sends for the ring
    algorithm over :attr:`group_size` devices (all-reduce ``2(n-1)/n*S``, all-gather,
    reduce-scatter and all-to-all ``(n-1)/n*S``, collective-permute ``S``). A defensive
    all-reduce over more axes than its operand varies over splits into a **needed** part (the
    same all-reduce over :attr:`needed_axes` only) and a **defensive** part (the rest):
    :attr:`needed_sent_bytes` and :attr:`defensive_sent_bytes`, per step.

    A collective found only in the jaxpr is **dead** (:attr:`dead`): lowering
    dropped it as dead code (e.g. the all-reduce of a gradient nothing uses),
    so it never runs and moves no bytes. Reports show it as ``dead`` and leave
    it out of every count, total and check, unless the jaxpr is the only level
    asked for (``level="jaxpr"``, ``assert_no_all_reduce(levels=("jaxpr",))``)
    or dead ones are asked for (``dead=True``).
    """

    kind: str
    levels: tuple[str, ...]
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    bytes: int
    axes: tuple[str, ...] | None
    groups: str = ""
    defensive: bool = False
    replicated_axes: tuple[str, ...] = ()
    origin: str = "program"
    primitive: str = ""
    op_name: str = ""
    source: str = ""
    is_async: bool = False
    checked: bool | None = None
    kernels_without_rule: tuple[str, ...] = ()
    lines: tuple[tuple[str, str], ...] = ()
    executions: int = 1
    added_by: str = ""
    sizes: tuple[int, ...] = ()
    group: int = 0

    @property
    def step_bytes(self) -> int:
        """Per-device buffer bytes per step: ``bytes`` times ``executions``."""
        return self.bytes * self.executions

    @property
    def group_size(self) -> int:
        """Devices per replica group (0: unknown)."""
        if self.axes is not None and len(self.sizes) == len(self.axes):
            return math.prod(self.sizes)
        return self.group

    @property
    def needed_axes(self) -> tuple[str, ...] | None:
        """The axes its operand varies over (all of ``axes`` unless defensive)."""
        if self.axes is None or not self.defensive:
            return self.axes
        return tuple(a for a in self.axes if a not in self.replicated_axes)

    @property
    def needed_group_size(self) -> int | None:
        """Devices per group of the same collective over :attr:`needed_axes` only (None: unknown)."""
        if self.axes is None or len(self.sizes) != len(self.axes):
            return None
        return math.prod(n for a, n in zip(self.axes, self.sizes) if a not in self.replicated_axes)

    @property
    def sent_bytes(self) -> int:
        """Bytes each device sends per step (the ring algorithm over :attr:`group_size` devices)."""
        return _link_model.sent(self.kind, self.bytes, self.group_size) * self.executions

    @property
    def needed_sent_bytes(self) -> int:
        """Of :attr:`sent_bytes`, what the same collective over :attr:`needed_axes` only sends."""
        if self.dead:
            return 0
        group = self.needed_group_size
        if not self.defensive or group is None:
            return 0 if self.defensive else self.sent_bytes
        return _link_model.sent(self.kind, self.bytes, group) * self.executions

    @property
    def defensive_sent_bytes(self) -> int:
        """Of :attr:`sent_bytes`, the part over axes its operand is replicated over."""
        return 0 if self.dead else self.sent_bytes - self.needed_sent_bytes

    @property
    def split(self) -> bool:
        """Defensive over some of its axes, needed over the others."""
        return self.defensive and bool(self.needed_axes)

    @property
    def dead(self) -> bool:
        """Only in the jaxpr: dropped by lowering as dead code, so it never runs."""
        return self.levels == ("jaxpr",)

    @property
    def status(self) -> str:
        """``"dead"`` (see :attr:`dead`), ``"defensive"`` or ``"needed"``."""
        if self.dead:
            return "dead"
        return "defensive" if self.defensive else "needed"

    @property
    def folded(self) -> bool:
        """In the jaxpr or StableHLO, but folded away by XLA in compiled HLO."""
        return "stablehlo" in self.levels and "hlo" not in self.levels

    def status_text(self, axes: bool = False) -> str:
        """The status as reports print it: ``dead``, ``defensive`` (with ``axes``:
        ``defensive (A)``, the replicated axes summed over; ``needed+defensive (A)``
        for one also summing over axes its operand varies over), :data:`ADDED_TEXT` for a needed one reprules added, or ``needed``."""
        if self.dead:
            return "dead"
        if self.defensive:
            if not axes:
                return "defensive"
            defensive = f"defensive ({','.join(self.replicated_axes)})"
            return f"needed+{defensive}" if self.split else defensive
        return ADDED_TEXT if self.added_by == "reprules" else "needed"

    def axes_text(self) -> str:
        if self.axes is None:
            return self.groups or "?"
        return ",".join(self.axes) if self.axes else "-"

    def shape_text(self) -> str:
        return " ".join(f"{self.dtype}[{','.join(map(str, s))}]" for s in self.shapes)

    def describe(self) -> str:
        """One line: kind, axes, type, bytes, status and where it came from."""
        where = self.source or "?"
        levels = "+".join(self.levels)
        extra = f" (operand replicated over {','.join(self.replicated_axes)})" if self.defensive else ""
        folded = ""
        if self.dead:
            folded = "; dead: not lowered, never runs"
        elif self.folded:
            folded = "; folded by XLA in compiled HLO"
        name = f" {self.primitive}" if self.primitive else ""
        added = f" added by {self.added_by}" if self.added_by else ""
        return (
            f"{self.kind} over {self.axes_text()}: {self.shape_text()}, {self.bytes} B"
            f"{f' x{self.executions}' if self.executions > 1 else ''}, "
            f"{self.status}{extra}{name}{added} [{levels}{folded}] op_name={self.op_name or '?'} at {where}"
        )

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["shapes"] = [list(s) for s in self.shapes]
        d["lines"] = [list(x) for x in self.lines]
        d["status"] = self.status
        d["dead"] = self.dead
        d["folded"] = self.folded
        d["step_bytes"] = self.step_bytes
        d["group_size"] = self.group_size
        d["needed_axes"] = self.needed_axes
        d["sent_bytes"] = self.sent_bytes
        d["needed_sent_bytes"] = self.needed_sent_bytes
        d["defensive_sent_bytes"] = self.defensive_sent_bytes
        return d


def _matches(c: Collective, kind: str | None, axes: Any, level: str | None, defensive: bool | None,
             dead: bool | None) -> bool:
    if dead is None:  # dead ones count only where the jaxpr is the level asked for
        dead = None if level == "jaxpr" else False
    if dead is not None and c.dead != dead:
        return False
    if kind is not None and c.kind != kind:
        return False
    if axes is not None:
        want = (axes,) if isinstance(axes, str) else tuple(axes)
        if c.axes is None or set(c.axes) != set(want):
            return False
    if level is not None and level not in c.levels:
        return False
    if defensive is not None and c.defensive != defensive:
        return False
    return True


@dataclasses.dataclass(frozen=True, slots=True)
class Report:
    """Every collective of one program, at the three levels.

    Attributes:
      function: The audited function's name.
      jax_version: ``jax.__version__``.
      mesh: ``((axis name, size), ...)`` of the mesh used to name axes.
      collectives: One :class:`Collective` per collective.
      kernels: Opaque kernels found under ``shard_map``.
      implicit: Collectives XLA's partitioner inserted around opaque kernels
        called outside ``shard_map`` (:class:`ImplicitCollective`), found in
        the compiled HLO or predicted from the jaxpr where the backend hides them.
      cheaper: Collectives of the compiled program with a cheaper equivalent
        (:class:`CheaperCollective`).
      backend: The backend that compiled the program (``cpu``, ``gpu``, ``tpu``).
      link: The link model's interconnect used for the time estimates.
    """

    function: str
    jax_version: str
    mesh: tuple[tuple[str, int], ...]
    collectives: tuple[Collective, ...]
    kernels: tuple[Kernel, ...] = ()
    implicit: tuple[ImplicitCollective, ...] = ()
    cheaper: tuple[CheaperCollective, ...] = ()
    backend: str = ""
    link: _link_model.Link | None = None

    def seconds(self, c: Collective | None = None) -> float:
        """Estimated time per step (link model, :mod:`reprules._report._link_model`) of ``c``, or of every
        live collective when ``c`` is None."""
        link = self.link or _link_model.current(self.backend or "cpu")
        if c is None:
            return sum(self.seconds(x) for x in self.select())
        return _link_model.seconds(c.kind, c.bytes, self._group(c), link) * c.executions

    def _group(self, c: Collective) -> int:
        if c.group_size:
            return c.group_size
        sizes = dict(self.mesh)  # groups unread: the whole mesh, as the most it can span
        return max(math.prod(sizes.values()) if sizes else 2, 2)

    def defensive_seconds(self) -> float:
        """Of :meth:`seconds`, the defensive parts' (each collective's time less that of the same
        collective over its needed axes only)."""
        link = self.link or _link_model.current(self.backend or "cpu")
        total = 0.0
        for c in self.select():
            needed = c.needed_group_size
            if c.defensive and needed is not None:
                total += self.seconds(c) - _link_model.seconds(c.kind, c.bytes, needed, link) * c.executions
        return total

    def sent_bytes(self, kind: str | None = None, **filters: Any) -> int:
        """Bytes each device sends per step for the matching collectives (see :meth:`select`)."""
        return sum(c.sent_bytes for c in self.select(kind, **filters))

    @property
    def needed_sent_total(self) -> int:
        """Of :meth:`sent_bytes`, the needed parts (a split collective's needed axes included)."""
        return sum(c.needed_sent_bytes for c in self.select())

    @property
    def defensive_sent_total(self) -> int:
        """Of :meth:`sent_bytes`, the defensive parts (axes the operand is replicated over)."""
        return sum(c.defensive_sent_bytes for c in self.select())

    @property
    def with_needed_part(self) -> tuple[Collective, ...]:
        """The live collectives that are needed over at least one of their axes."""
        return tuple(c for c in self.select() if not c.defensive or c.split)

    @property
    def savable_bytes(self) -> int:
        """Per-device bytes per step that the cheaper equivalents would save."""
        return sum(c.saved_bytes for c in self.cheaper)

    @property
    def implicit_sent_bytes(self) -> int:
        """Bytes each device sends per step for the implicit collectives."""
        return sum(c.step_sent for c in self.implicit)

    @property
    def implicit_bytes(self) -> int:
        """Per-device bytes per step of the implicit collectives."""
        return sum(c.step_bytes for c in self.implicit)

    def select(self, kind: str | None = None, *, axes: str | Iterable[str] | None = None,
               level: str | None = None, defensive: bool | None = None,
               dead: bool | None = None) -> tuple[Collective, ...]:
        """The collectives matching every given filter.

        Args:
          kind: E.g. ``"all-reduce"``.
          axes: A mesh axis name or names (exact set).
          level: ``"jaxpr"``, ``"stablehlo"`` or ``"hlo"``.
          defensive: Only defensive (``True``) or needed (``False``) ones.
          dead: Only dead ones (``True``), only live ones (``False``). By
            default dead ones (see :class:`Collective`) are left out, unless
            ``level="jaxpr"``: they never run.
        """
        if kind is not None and kind not in _hlo.KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; expected one of {_hlo.KINDS}")
        if level is not None and level not in LEVELS:
            raise ValueError(f"unknown level {level!r}; expected one of {LEVELS}")
        return tuple(c for c in self.collectives if _matches(c, kind, axes, level, defensive, dead))

    def count(self, kind: str | None = None, **filters: Any) -> int:
        """How many collectives match (see :meth:`select`; dead ones are left out by default)."""
        return len(self.select(kind, **filters))

    def bytes(self, kind: str | None = None, **filters: Any) -> int:
        """Per-device bytes of the matching collectives, per step (see :meth:`select`)."""
        return sum(c.step_bytes for c in self.select(kind, **filters))

    @property
    def defensive(self) -> tuple[Collective, ...]:
        return self.select(defensive=True)

    @property
    def dead_collectives(self) -> tuple[Collective, ...]:
        """The collectives only in the jaxpr: dropped by lowering, they never run."""
        return self.select(dead=True)

    @property
    def kernels_without_rule(self) -> tuple[Kernel, ...]:
        return tuple(k for k in self.kernels if not k.has_rule)

    def table(self) -> str:
        """A readable table of the collectives and kernels."""
        head = f"collectives of {self.function} (JAX {self.jax_version}, mesh " + (
            ", ".join(f"{n}={s}" for n, s in self.mesh) or "none") + ")"
        rows = [("#", "kind", "axes", "type", "buffer B", "sent B", "status", "J S H", "primitive", "source")]
        for i, c in enumerate(self.collectives):
            marks = " ".join("x" if lvl in c.levels else "." for lvl in LEVELS)
            rows.append((str(i), c.kind + ("*" if c.is_async else ""), c.axes_text(), c.shape_text(),
                         str(c.bytes) + (f" x{c.executions}" if c.executions > 1 else ""), str(c.sent_bytes),
                         c.status_text(axes=True), marks, c.primitive or c.origin, _short(c.source)))
        widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
        lines = [head]
        lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        if not self.collectives:
            lines.append("  (no collectives)")
        live, d, dead = self.select(), self.defensive, self.dead_collectives
        lines.append(f"  total: {len(live)} collectives, {self.sent_bytes()} B sent per device per step; "
                     f"{len(d)} defensive ({self.defensive_sent_total} B of it)"
                     + (f"; {len(dead)} dead (not counted)" if dead else ""))
        lines.append(f"  ({COST_CONVENTION})")
        if dead or any(c.folded for c in self.collectives):
            lines.append("  (J S H = jaxpr, StableHLO, compiled HLO; '.' under H: folded away by XLA; "
                         "dead: only in the jaxpr, never runs)")
        if any(c.status_text() == ADDED_TEXT for c in self.collectives):
            lines.append(f"  ({ADDED_TEXT}: {ADDED_MEANING})")
        for k in self.kernels:
            lines.append(f"  kernel {k.name} ({k.primitive} x{k.count}): {k.status()}; {_short(k.source)}")
        lines += table_lines(self.implicit, self.cheaper, self.backend or "?")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        return {
            "function": self.function,
            "jax_version": self.jax_version,
            "mesh": dict(self.mesh),
            "collectives": [{**c.to_dict(), "est_seconds": self.seconds(c)} for c in self.collectives],
            "kernels": [k.to_dict() for k in self.kernels],
            "backend": self.backend,
            "link": self.link.to_dict() if self.link is not None else None,
            "implicit": [c.to_dict() for c in self.implicit],
            "cheaper": [c.to_dict() for c in self.cheaper],
            "summary": {
                "count": len(self.select()),
                "bytes": self.bytes(),
                "dead_count": len(self.dead_collectives),
                "defensive_count": len(self.defensive),
                "defensive_bytes": sum(c.step_bytes for c in self.defensive),
                "sent_bytes": self.sent_bytes(),
                "needed_count": len(self.with_needed_part),
                "needed_sent_bytes": self.needed_sent_total,
                "defensive_sent_bytes": self.defensive_sent_total,
                "defensive_est_seconds": self.defensive_seconds(),
                "by_kind": {k: {"count": self.count(k), "bytes": self.bytes(k)}
                            for k in _hlo.KINDS if self.count(k)},
                "implicit_count": len(self.implicit),
                "implicit_bytes": self.implicit_bytes,
                "implicit_sent_bytes": self.implicit_sent_bytes,
                "cheaper_count": len(self.cheaper),
                "savable_bytes": self.savable_bytes,
                "est_seconds": self.seconds(),
            },
        }

    def to_json(self, **kwargs: Any) -> str:
        """The report as JSON (``json.dumps`` keyword arguments pass through)."""
        kwargs.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **kwargs)


def _short(source: str) -> str:
    if not source:
        return ""
    path, _, line = source.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else source

