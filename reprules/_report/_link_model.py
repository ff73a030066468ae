"""A simple link model: the time a collective takes, from its bytes and the interconnect.

Assumptions (a first-order estimate, not a measurement):

* **Ring algorithms**, bandwidth-bound. For a collective over ``n`` devices on
  a buffer of ``S`` bytes per device (the unsharded size: an all-reduce's
  operand, an all-gather's result, a reduce-scatter's operand), each device
  sends: all-reduce ``2(n-1)/n * S`` (a reduce-scatter then an all-gather);
  all-gather, reduce-scatter and all-to-all ``(n-1)/n * S``; a
  collective-permute ``S``.
* **One link speed per collective**: ``time = steps * latency + sent / bandwidth``,
  with ``steps`` the ring's ``2(n-1)`` (all-reduce), ``n-1`` (all-gather,
  reduce-scatter, all-to-all) or 1 (collective-permute). No overlap with
  compute, no contention between collectives, no topology (a 2-D torus or a
  hierarchy is one ring here), no compression.
* **Bandwidth per device, one direction**, from :data:`LINKS`; the default
  link follows the backend (:data:`DEFAULT_LINK`). ``REPRULES_LINK`` picks
  another (a name in :data:`LINKS`, or a bandwidth in GB/s such as ``"200"``),
  and ``reprules audit --link`` does the same.

Fake CPU devices share one host, so their "link" is memory copies: the CPU
figure keeps estimates comparable between runs, not predictive of a cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

ENV = "REPRULES_LINK"


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """One interconnect: name, bandwidth (bytes/s per device, one direction), latency per ring step (s)."""

    name: str
    bandwidth: float
    latency: float
    note: str = ""

    def describe(self) -> str:
        return f"{self.name}: {self.bandwidth / 1e9:g} GB/s per device, {self.latency * 1e6:g} us per ring step"

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "bandwidth_bytes_per_s": self.bandwidth, "latency_s": self.latency,
                "note": self.note}


LINKS = {
    "cpu": Link("cpu", 10e9, 2e-6, "fake CPU devices on one host: memory copies"),
    "tpu-ici": Link("tpu-ici", 45e9, 1e-6, "one TPU ICI link (v5e: 400 Gb/s per direction)"),
    "nvlink": Link("nvlink", 350e9, 5e-6, "NVLink 4 through NVSwitch (H100 SXM), ring bus bandwidth"),
    "pcie": Link("pcie", 25e9, 10e-6, "PCIe 4.0 x16"),
    "infiniband": Link("infiniband", 50e9, 10e-6, "one 400 Gb/s NDR port per device"),
    "dcn": Link("dcn", 12.5e9, 20e-6, "data-center network between TPU slices, 100 Gb/s per host"),
}
DEFAULT_LINK = {"cpu": "cpu", "tpu": "tpu-ici", "gpu": "nvlink", "cuda": "nvlink", "rocm": "nvlink"}
_override: Link | None = None


def parse(text: str) -> Link:
    """A link from its name in :data:`LINKS`, or from a bandwidth in GB/s (``"200"``).

    Raises:
      ValueError: neither a known name nor a positive number.
    """
    text = text.strip()
    if text in LINKS:
        return LINKS[text]
    try:
        gbps = float(text)
    except ValueError:
        gbps = -1.0
    if gbps <= 0:
        raise ValueError(f"unknown link {text!r}: use one of {', '.join(LINKS)} or a bandwidth in GB/s "
                         "(e.g. 200)")
    return Link(f"{gbps:g} GB/s", gbps * 1e9, 0.0, "bandwidth given by the user, no latency")


def current(backend: str) -> Link:
    """The link used for ``backend``: :func:`using`'s, else ``$REPRULES_LINK``'s, else the backend's default."""
    if _override is not None:
        return _override
    env = os.environ.get(ENV, "").strip()
    if env:
        return parse(env)
    return LINKS[DEFAULT_LINK.get(backend, "cpu")]


@contextlib.contextmanager
def using(link: Link | None) -> Iterator[None]:
    """Estimates made inside use ``link`` (None: no change)."""
    global _override
    before = _override
    if link is not None:
        _override = link
    try:
        yield
    finally:
        _override = before


def sent_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device sends for a collective of ``kind`` on ``nbytes`` (unsharded) over ``n`` devices."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n * nbytes
    if kind == "collective-permute":
        return float(nbytes)
    return (n - 1) / n * nbytes


def sent(kind: str, nbytes: int, n: int) -> int:
    """:func:`sent_bytes` rounded to whole bytes: what reports print and add up."""
    return round(sent_bytes(kind, nbytes, n))


def steps(kind: str, n: int) -> int:
    if n <= 1:
        return 0
    if kind == "all-reduce":
        return 2 * (n - 1)
    if kind == "collective-permute":
        return 1
    return n - 1


def seconds(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Estimated time of one collective (see the module docstring for the assumptions)."""
    return steps(kind, n) * link.latency + sent_bytes(kind, nbytes, n) / link.bandwidth


def time_text(s: float) -> str:
    """``12.3 us``, ``4.56 ms``, ``1.2 s``."""
    if s < 1e-3:
        return f"{s * 1e6:.3g} us"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s"
