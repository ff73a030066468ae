"""Collective bytes per training step of a tensor-parallel transformer, on paper.

The model of :mod:`reprules._demo.transformer` (pre-norm decoder layers, Megatron
tensor parallelism on ``model``: QKV and up projections column-parallel,
output and down projections row-parallel with a ``psum``; batch on ``data``)
at any size and mesh. Bytes are per device and per step, counted as
``reprules.testing.collectives`` counts them (the operand of each all-reduce),
so the 8-device figures of the benchmark check the formulas
(``tests/test_scale.py``, ``examples/benchmarks/bench.py``).

With ``T`` tokens per device (sequence x batch per ``data`` shard), width
``d``, MLP width ``f``, ``L`` layers, item size ``s`` and a ``(data, model)``
mesh, one activation is ``A = T * d * s`` bytes, and

* **needed** (reprules, and the analytical minimum): over ``model``,
  ``2L`` forward all-reduces of ``A`` (after each row-parallel projection)
  and ``2L`` backward ones (the cotangent of each layer norm's output, where it
  enters the column-parallel projections); over ``data``, every weight gradient
  once: ``L * ((4d^2 + 2df) / model + 4d) + 2d`` elements.
* **checking off, a ``shard_map`` per sublayer** (the usual way a Pallas
  kernel reaches a model; JAX #21855): all of the above, plus ``4L`` all-reduces
  of ``A`` over ``model`` that move nothing new: the transpose of each
  row-parallel ``psum`` (its cotangent is already identical across ``model``)
  and each layer norm's input cotangent at its ``shard_map`` boundary. The
  layer norms' weight and bias gradients are summed over ``data`` *and*
  ``model`` instead of ``data`` (same bytes, a larger group); the report marks
  those all-reduces defensive too. With the layers under ``jax.lax.scan`` (or
  an input that takes a gradient, e.g. an embedding) one more: the first
  layer norm's input cotangent, which an unrolled model without one drops.
* **checking off, one ``shard_map`` around the whole model**: the same bytes as
  reprules (the backward all-reduces only move from the layer norms' outputs to
  the transposes of the forward ``psum``\\ s); the report still marks one
  activation all-reduce and the final layer norm's gradients defensive.

Time: a ring all-reduce of ``B`` bytes over ``n`` devices sends and receives
``2 (n - 1) / n * B`` bytes per device; at ``bw`` bytes/s per direction it
takes at least that divided by ``bw`` (no latency term, no overlap with
compute).
"""

from __future__ import annotations

import dataclasses
from typing import Any

STRUCTURES = ("sublayer", "model")


@dataclasses.dataclass(frozen=True)
class Model:
    """A decoder-only transformer, as far as its collectives go.

    Attributes:
      layers: Decoder layers.
      d_model: Width.
      ffn: MLP hidden width.
      itemsize: Bytes per element of activations and gradients (2 for bf16).
    """

    layers: int
    d_model: int
    ffn: int
    itemsize: int = 2

    @classmethod
    def from_config(cls, cfg: Any, itemsize: int = 4) -> Model:
        """From a :class:`reprules._demo.transformer.Config` (float32 there)."""
        return cls(layers=cfg.layers, d_model=cfg.d_model, ffn=cfg.ffn, itemsize=itemsize)

    def parameters(self) -> int:
        """Parameters (no embeddings): 4d^2 + 2df + 4d per layer, 2d for the final norm."""
        d, f = self.d_model, self.ffn
        return self.layers * (4 * d * d + 2 * d * f + 4 * d) + 2 * d


@dataclasses.dataclass(frozen=True)
class Mesh:
    """A ``(data, model)`` mesh."""

    data: int
    model: int

    @property
    def devices(self) -> int:
        return self.data * self.model


@dataclasses.dataclass(frozen=True)
class Bytes:
    """Per-device bytes of one step's all-reduces, split by axis.

    Attributes:
      model_needed: Over ``model``: activations, forward and backward.
      data_needed: Over ``data``: weight gradients.
      model_extra: Over ``model``, with checking off only: bytes reprules does not move.
      flagged_defensive: What ``reprules.testing.collectives`` marks defensive with
        checking off (``model_extra`` plus the layer norms' gradients, or in the
        ``"model"`` structure one activation and the final norm's gradients).
    """

    model_needed: int
    data_needed: int
    model_extra: int
    flagged_defensive: int

    @property
    def needed(self) -> int:
        return self.model_needed + self.data_needed

    @property
    def off(self) -> int:
        """Every all-reduce with checking off."""
        return self.needed + self.model_extra


def activation_bytes(model: Model, tokens: int) -> int:
    """One activation (``tokens`` x ``d_model``) on one device."""
    return tokens * model.d_model * model.itemsize


def step_bytes(model: Model, mesh: Mesh, tokens: int, structure: str = "sublayer", scan: bool = False) -> Bytes:
    """All-reduce bytes per device and step.

    Args:
      model: The transformer.
      mesh: The ``(data, model)`` mesh.
      tokens: Sequence x batch per ``data`` shard (tokens each device holds).
      structure: ``"sublayer"`` (a ``shard_map`` per layer norm and per attention
        and MLP block) or ``"model"`` (one ``shard_map`` around every layer).
      scan: Layers under ``jax.lax.scan``, or an input cotangent computed (see above).
    """
    if structure not in STRUCTURES:
        raise ValueError(f"structure must be one of {STRUCTURES}, not {structure!r}")
    L, d, f, s = model.layers, model.d_model, model.ffn, model.itemsize
    act = activation_bytes(model, tokens)
    tp, dp = mesh.model > 1, mesh.data > 1
    model_needed = 4 * L * act if tp else 0
    weights = L * ((4 * d * d + 2 * d * f) // mesh.model + 4 * d) + 2 * d
    data_needed = weights * s if dp else 0
    norms = (2 * L + 1) * 2 * d * s  # every layer norm's weight and bias gradient
    if structure == "sublayer":
        extra = (4 * L + int(scan)) * act if tp else 0
        flagged = extra + (norms if tp else 0)
    else:
        extra = 0
        flagged = (act + 2 * d * s) if tp else 0
    return Bytes(model_needed=model_needed, data_needed=data_needed, model_extra=extra, flagged_defensive=flagged)


def needed_bytes(model: Model, mesh: Mesh, tokens: int) -> int:
    """The analytical minimum of all-reduce bytes per device and step."""
    return step_bytes(model, mesh, tokens).needed


def allreduce_seconds(nbytes: float, devices: int, bandwidth: float) -> float:
    """Lower bound of a ring all-reduce of ``nbytes`` per device over ``devices`` at
    ``bandwidth`` bytes/s per direction."""
    if devices <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * (devices - 1) / devices * nbytes / bandwidth


# Published per-device interconnect figures (bytes/s per direction: half the
# bidirectional figure where one is published). Sources in the README.
INTERCONNECTS: dict[str, float] = {
    "TPU v5e ICI (400 GB/s bidirectional)": 200e9,
    "H100 NVLink 4 (900 GB/s bidirectional)": 450e9,
    "InfiniBand NDR (400 Gb/s per GPU)": 50e9,
}


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of :func:`table`."""

    mesh: Mesh
    tokens: int
    needed: int
    extra: int
    extra_seconds: dict[str, float]


def table(model: Model, meshes: list[Mesh], global_tokens: int,
          interconnects: dict[str, float] | None = None) -> list[Row]:
    """Per mesh: bytes per device and step (``"sublayer"`` structure), for a global
    batch of ``global_tokens`` split over ``data``, and the time the bytes checking off
    adds take at each bandwidth."""
    bws = INTERCONNECTS if interconnects is None else interconnects
    rows = []
    for mesh in meshes:
        t = global_tokens // mesh.data
        b = step_bytes(model, mesh, t)
        rows.append(Row(mesh=mesh, tokens=t, needed=b.needed, extra=b.model_extra,
                        extra_seconds={k: allreduce_seconds(b.model_extra, mesh.model, bw) for k, bw in bws.items()}))
    return rows


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def markdown(rows: list[Row]) -> str:
    """The README table."""
    names = list(rows[0].extra_seconds) if rows else []
    head = ["mesh (data x model)", "tokens per device", "needed", "added by checking off"] + names
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r.mesh.data} x {r.mesh.model}", f"{r.tokens:,}", _fmt_bytes(r.needed), _fmt_bytes(r.extra)]
        cells += [f"{r.extra_seconds[n]:.2f} s" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gpt3_6_7b() -> Model:
    """A 7B-class model: GPT-3 6.7B's shapes (32 layers, d 4096, MLP 16384), bf16."""
    return Model(layers=32, d_model=4096, ffn=16384, itemsize=2)


GPT3_BATCH_TOKENS = 2 * 1024 * 1024  # GPT-3 6.7B's batch: 2M tokens (Brown et al. 2020, table 2.1)


def main() -> None:
    """``python -m reprules._demo.scale``: the README table."""
    m = gpt3_6_7b()
    print(f"{m.parameters() / 1e9:.2f} B parameters (no embeddings), batch {GPT3_BATCH_TOKENS:,} tokens")
    print(markdown(table(m, [Mesh(256, 1), Mesh(64, 4), Mesh(32, 8), Mesh(16, 16)], GPT3_BATCH_TOKENS)))


if __name__ == "__main__":
    main()
