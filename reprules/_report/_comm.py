"""The records of the communication findings: implicit collectives and cheaper equivalents.

* :class:`ImplicitCollective`: a collective XLA's SPMD partitioner inserted
  around an opaque kernel (``pallas_call``, ``pl.kernel``, ``ffi_call``,
  ``triton_call``, a user primitive) called outside ``shard_map`` on sharded
  operands. It cannot look into the custom call, so it gathers the operands
  and runs the whole kernel on every device. Found in the compiled HLO
  (:mod:`reprules._report._implicit`), or *predicted* from the jaxpr where the backend
  at hand hides it (Pallas interpret mode on CPU lowers to ordinary HLO).
* :class:`CheaperCollective`: a collective that survives compilation on the
  backend at hand and has a cheaper equivalent (:mod:`reprules._report._cheaper`).

Costs follow the report's one model (:mod:`reprules._report._link_model`): ``bytes``
is the buffer per device, ``sent`` what each device sends for the ring algorithm
(a reduce-scatter sends half of what an all-reduce of the same buffer sends), and
``seconds`` the link model's estimate. A finding's saving is the difference of
``sent``: what the collectives rows of the report move by once the fix is applied.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

PATTERNS = {
    "own-slice": "an all-reduce of which each device keeps only its own slice: a reduce-scatter",
    "own-shard": "an all-gather of which each device keeps only its own shard: no collective",
    "replicated-sum": "an all-reduce of a value already replicated over the axes: a multiplication",
}


def short(source: str) -> str:
    if not source:
        return "?"
    path, _, line = source.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else source


def _axes(axes: tuple[str, ...] | None) -> str:
    return "?" if axes is None else (",".join(axes) or "-")


@dataclasses.dataclass(frozen=True, slots=True)
class ImplicitCollective:
    """A collective the partitioner inserted around an opaque kernel; the program did not write it.

    Attributes:
      kind: ``all-gather`` (an operand gathered), ``all-reduce``, ...
      axes: Mesh axes it runs over (``None``: groups matching no axes).
      dtype: Element type (HLO spelling).
      shape: The gathered (unsharded) operand's shape.
      bytes: Per-device buffer bytes (the unsharded operand).
      seconds: Estimated time per step (link model).
      kernel: The kernel's name (the FFI target, the Pallas kernel function...).
      primitive: ``pallas_call``, ``ffi_call``, ``core_map``, a user primitive...
      operand: Which operand of the kernel it feeds.
      call_source: ``file:line`` of the user's call of the kernel.
      kernel_source: ``file:line`` of the kernel's definition, if known.
      in_specs: The ``PartitionSpec`` the operand arrives with (``P('data', None)``),
        for the fix, or ``""`` if unknown.
      predicted: True when the backend at hand hides it (no custom call in
        its compiled HLO: Pallas interpret mode on CPU); what a TPU/GPU
        compile would do, from the jaxpr.
      backend: The backend that compiled the program.
      line: The HLO instruction (empty when predicted).
      executions: How often it runs per step (scans around the kernel).
    """

    kind: str
    axes: tuple[str, ...] | None
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    seconds: float
    kernel: str
    primitive: str
    operand: int
    call_source: str
    kernel_source: str = ""
    in_specs: str = ""
    predicted: bool = False
    backend: str = ""
    line: str = ""
    executions: int = 1
    sent: int = 0  # bytes each device sends per execution (ring algorithm)

    @property
    def step_bytes(self) -> int:
        return self.bytes * self.executions

    @property
    def step_sent(self) -> int:
        """Bytes each device sends per step."""
        return self.sent * self.executions

    def fix(self) -> str:
        """What to do: run the kernel under shard_map, or give it a sharding rule."""
        specs = self.in_specs or "P(...)  # the operand's sharding"
        return (f"call {self.kernel} inside jax.shard_map with in_specs={specs} for operand {self.operand} "
                "(each device runs the kernel on its own shard; give the kernel a replication rule), "
                "or give it a sharding rule (jax.experimental.custom_partitioning)")

    def describe(self) -> str:
        how = ("predicted for a TPU/GPU compile (the " + (self.backend or "backend")
               + " compile hides it: interpret mode)") if self.predicted else f"in the {self.backend} HLO"
        return (f"{self.kind} over {_axes(self.axes)}: {self.dtype}[{','.join(map(str, self.shape))}], "
                f"{self.bytes} B buffer, {self.sent} B sent{f' x{self.executions}' if self.executions > 1 else ''}, "
                f"into operand "
                f"{self.operand} of kernel {self.kernel} ({self.primitive}) called at "
                f"{self.call_source or '?'}; {how}")

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["shape"] = list(self.shape)
        d["step_bytes"] = self.step_bytes
        d["step_sent"] = self.step_sent
        d["fix"] = self.fix()
        return d


@dataclasses.dataclass(frozen=True, slots=True)
class CheaperCollective:
    """A collective in the compiled program with a cheaper equivalent.

    Attributes:
      pattern: One of :data:`PATTERNS`: ``own-slice``, ``own-shard``, ``replicated-sum``.
      kind: The collective as it runs (``all-reduce``, ``all-gather``).
      cheaper: What it could be: ``reduce-scatter``, ``none`` or ``multiplication``.
      axes: Mesh axes it runs over.
      dtype: Element type.
      shape: Its per-device result shape.
      bytes: Per-device buffer bytes now.
      bytes_after: Per-device buffer bytes of the cheaper equivalent (0: no collective).
      seconds: Estimated time now (link model).
      seconds_after: Estimated time of the cheaper equivalent.
      source: ``file:line`` of the user's line that wrote the collective.
      slice_source: ``file:line`` of the slice that keeps the own part, if any.
      rewrite: The rewrite, as code.
      backend: The backend whose compiled program still has it.
      line: The HLO instruction.
      executions: How often it runs per step.
    """

    pattern: str
    kind: str
    cheaper: str
    axes: tuple[str, ...] | None
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    bytes_after: int
    seconds: float
    seconds_after: float
    source: str
    rewrite: str
    slice_source: str = ""
    backend: str = ""
    line: str = ""
    executions: int = 1
    sent: int = 0  # bytes each device sends per execution, now
    sent_after: int = 0  # ... and with the cheaper equivalent

    @property
    def saved_bytes(self) -> int:
        """Bytes each device sends per step that the rewrite saves."""
        return (self.sent - self.sent_after) * self.executions

    @property
    def saved_seconds(self) -> float:
        return (self.seconds - self.seconds_after) * self.executions

    def describe(self) -> str:
        return (f"{self.kind} over {_axes(self.axes)}: {self.dtype}[{','.join(map(str, self.shape))}], "
                f"{self.sent} B sent -> {self.cheaper} {self.sent_after} B sent"
                f"{f' x{self.executions}' if self.executions > 1 else ''} ({PATTERNS[self.pattern]}) "
                f"at {self.source or '?'}"
                + (f", sliced at {self.slice_source}" if self.slice_source else "")
                + f"; still in the compiled {self.backend} HLO; rewrite: {self.rewrite}")

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["shape"] = list(self.shape)
        d["saved_bytes"] = self.saved_bytes
        d["saved_seconds"] = self.saved_seconds
        d["meaning"] = PATTERNS[self.pattern]
        return d


def table_lines(implicit: tuple[ImplicitCollective, ...], cheaper: tuple[CheaperCollective, ...],
                backend: str) -> list[str]:
    """The two sections of a report's table (nothing when both are empty)."""
    lines: list[str] = []
    if implicit:
        lines.append(f"  implicit collectives (inserted by XLA around opaque kernels; backend {backend}):")
        for c in implicit:
            lines.append(f"    - {c.describe()}")
            lines.append(f"      fix: {c.fix()}")
    if cheaper:
        lines.append(f"  collectives with a cheaper equivalent (still in the compiled {backend} HLO):")
        for ch in cheaper:
            lines.append(f"    - {ch.kind} over {_axes(ch.axes)} at {short(ch.source)}: {ch.sent} B sent -> "
                         f"{ch.cheaper} {ch.sent_after} B sent; rewrite: {ch.rewrite}")
    return lines
