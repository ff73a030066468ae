"""See the collectives of a program, and assert on them (no pytest needed).

``collectives(fn, *args)`` jits, lowers and compiles ``fn`` and reports every
collective at three levels: the jaxpr (``shard_map``, ``custom_vjp``, ``scan``,
``cond``, ``pjit`` bodies included), the lowered StableHLO and the compiled
HLO. Checking all three matters: from JAX 0.10.2, XLA:CPU folds an all-reduce
of a constant cotangent away, while the jaxpr and StableHLO still have it.

It also finds the communication nobody wrote: collectives XLA's partitioner
inserted around opaque kernels called outside ``shard_map`` (``report.implicit``,
``assert_no_implicit_collectives``) and collectives with a cheaper equivalent
still in the compiled program (``report.cheaper``, ``assert_no_cheaper_collectives``),
with a link model's time estimates (``report.seconds()``).

Two helpers set up what such tests and scripts need on every supported JAX:
``fake_cpu_devices(n)`` (before JAX starts) and ``shard_map(..., check=True)``.
``cpu_kernels`` holds opaque C++ FFI kernels for CPU (``copy``, ``mul``,
``mul_rowsum``; compiled on first use, cached under ``$REPRULES_CACHE``, else
``$XDG_CACHE_HOME/reprules``, else ``~/.cache/reprules``): XLA cannot see
through them, so the defensive all-reduces around them are never folded away.

Example:
    ```python
    from reprules import testing

    report = testing.collectives(jax.grad(loss), x)
    print(report)                                   # a table
    assert report.count("all-reduce", axes="data") == 1
    testing.assert_no_all_reduce(jax.grad(loss_fsdp_free), x)
    ```
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Union

from reprules import _cpu_kernels as cpu_kernels
from reprules import _environment
from reprules._errors import ReprulesError
from reprules._report._comm import CheaperCollective as CheaperCollective
from reprules._report._comm import ImplicitCollective as ImplicitCollective
from reprules._report._hlo import KINDS as KINDS
from reprules._report._records import LEVELS as LEVELS
from reprules._report._records import Collective as Collective
from reprules._report._records import Kernel as Kernel
from reprules._report._records import Report as Report

__all__ = [
    "KINDS",
    "LEVELS",
    "CheaperCollective",
    "Collective",
    "CollectivesAssertionError",
    "ImplicitCollective",
    "Kernel",
    "Report",
    "assert_collectives",
    "assert_no_all_reduce",
    "assert_no_cheaper_collectives",
    "assert_no_implicit_collectives",
    "collectives",
    "cpu_kernels",
    "fake_cpu_devices",
    "shard_map",
    "tpu_on_cpu",
]

ExpectKey = Union[str, tuple[str, Union[str, tuple[str, ...]]]]
ExpectValue = Union[int, Mapping[str, int]]


class CollectivesAssertionError(ReprulesError, AssertionError):
    """A program's collectives differ from what a test expected.

    Attributes:
      report: The full :class:`Report`.
    """

    def __init__(self, message: str, report: Report):
        super().__init__(message)
        self.report = report


def collectives(fn: Callable[..., Any], *args: Any, mesh: Any = None, **kwargs: Any) -> Report:
    """Every collective of ``jax.jit(fn)(*args, **kwargs)``, at three levels.

    Args:
      fn: The function (a training step, ``jax.grad(loss)``...). It is traced,
        lowered and compiled, not run.
      *args: Example arguments (arrays with their shardings, or
        ``jax.ShapeDtypeStruct``).
      mesh: The mesh used to name replica groups; by default the mesh of the
        first ``shard_map`` in ``fn``, else of the first sharded argument.
      **kwargs: Passed to ``fn`` (closed over, not traced).

    Returns:
      A :class:`Report`: ``print`` it for a table, ``.to_json()`` for machines,
      ``.count(kind, axes=..., level=..., defensive=...)`` and ``.bytes(...)``
      to assert on.
    """
    from reprules._report import _collectives  # lazy: imports JAX

    return _collectives.collectives(fn, *args, mesh=mesh, **kwargs)


def assert_no_all_reduce(fn: Callable[..., Any], *args: Any, levels: Iterable[str] = LEVELS,
                         axes: str | Iterable[str] | None = None, **kwargs: Any) -> Report:
    """Fails if ``fn`` has an all-reduce at any of ``levels``.

    Args:
      fn: The function to check (traced, lowered and compiled, not run).
      *args: Example arguments.
      levels: Levels to look at; all three by default, so an all-reduce that
        XLA folded away on CPU is still caught in the jaxpr and StableHLO. A
        *dead* all-reduce (only in the jaxpr: dead code that lowering dropped,
        e.g. the unused gradient of a replicated custom_vjp input; see
        :attr:`Collective.dead`) never runs and is ignored, as in every count
        of the report, unless ``levels=("jaxpr",)``.
      axes: Only all-reduces over exactly these mesh axes count.
      **kwargs: Passed to ``fn``.

    Returns:
      The :class:`Report`, when the check passes.

    Raises:
      CollectivesAssertionError: with each offending all-reduce, its
        provenance and, when an opaque kernel without a rule is why checking
        is off, the kernel and the decorator to add.
    """
    levels = _check_levels(levels)
    report = collectives(fn, *args, **kwargs)
    # Dead ones (only in the jaxpr) count only where the jaxpr alone is checked, as in report.count.
    only_jaxpr = levels == ("jaxpr",)
    bad = [c for c in report.select("all-reduce", axes=axes, level="jaxpr" if only_jaxpr else None)
           if set(c.levels) & set(levels)]
    if bad:
        over = f" over {_axes_text(axes)}" if axes is not None else ""
        raise CollectivesAssertionError(
            f"{len(bad)} all-reduce{'s' if len(bad) > 1 else ''}{over} found in {report.function} "
            f"(levels checked: {', '.join(levels)}; JAX {report.jax_version}):\n"
            + _offending(bad) + _why_and_fix(bad, report), report)
    return report


def assert_collectives(fn: Callable[..., Any], *args: Any, expect: Mapping[ExpectKey, ExpectValue],
                       level: str | None = None, exact: bool = True, **kwargs: Any) -> Report:
    """Fails unless ``fn``'s collectives match ``expect``.

    Args:
      fn: The function to check (traced, lowered and compiled, not run).
      *args: Example arguments.
      expect: Expected figures, keyed by kind (``"all-reduce"``), by
        ``(kind, axes)`` (``("all-reduce", "data")``, ``("all-gather",
        ("data", "model"))``) or ``"defensive"``. A value is a count, or a
        mapping with ``"count"`` and/or ``"bytes"`` (per-device bytes per
        step).
      level: Count only collectives present at this level (``"jaxpr"``,
        ``"stablehlo"``, ``"hlo"``); by default, present at any level. Dead
        ones (only in the jaxpr, never run) count only with ``level="jaxpr"``.
      exact: Kinds not named in ``expect`` must be absent.
      **kwargs: Passed to ``fn``.

    Returns:
      The :class:`Report`, when the check passes.

    Raises:
      CollectivesAssertionError: listing each expectation that failed and
        the collectives it counted.
      ValueError: ``expect`` names an unknown kind or has a malformed value.

    Example:
        ```python
        assert_collectives(jax.grad(loss), w, x,
                           expect={("all-reduce", "data"): {"count": 1, "bytes": 32768},
                                   "defensive": 0})
        ```
    """
    if level is not None:
        _check_levels((level,))
    checks = [_parse_expectation(k, v) for k, v in expect.items()]
    report = collectives(fn, *args, **kwargs)
    failures = []
    for label, kind, axes, defensive, want in checks:
        found = report.select(kind, axes=axes, level=level, defensive=defensive)
        got = {"count": len(found), "bytes": sum(c.step_bytes for c in found)}
        for what, value in want.items():
            if got[what] != value:
                failures.append((f"{label}: expected {what} {value}, got {got[what]}", found))
    if exact:
        named = {kind for _, kind, _, _, _ in checks if kind is not None}
        for kind in KINDS:
            if kind not in named and report.count(kind, level=level):
                found = report.select(kind, level=level)
                failures.append((f"{kind}: expected none (not named in expect), got {len(found)}", found))
    if failures:
        lines = []
        for text, found in failures:
            lines.append(f"- {text}")
            lines.extend("    " + c.describe() for c in found)
        shown = [c for _, found in failures for c in found]
        raise CollectivesAssertionError(
            f"The collectives of {report.function} differ from the expectation "
            f"(JAX {report.jax_version}, counted at {level or 'any level'}):\n"
            + "\n".join(lines) + "\n" + _why_and_fix(shown, report) + "\nFull report:\n" + report.table(),
            report)
    return report


def assert_no_implicit_collectives(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Report:
    """Fails if XLA's partitioner inserted collectives around an opaque kernel of ``fn``.

    An opaque kernel (``pallas_call``, ``pl.kernel``, ``ffi_call``, ``triton_call``,
    a user primitive) called outside ``shard_map`` on sharded operands is a
    custom call XLA cannot look into: the partitioner gathers its operands to
    every device and runs the whole kernel everywhere. Found in the compiled
    HLO; where the backend at hand hides it (Pallas interpret mode on CPU lowers
    to ordinary HLO), predicted from the jaxpr for a TPU/GPU compile.

    Args:
      fn: The function to check (traced, lowered and compiled, not run).
      *args: Example arguments, with their shardings (a sharded ``jax.Array``
        or a ``jax.ShapeDtypeStruct`` with ``sharding=``).
      **kwargs: Passed to ``fn``.

    Returns:
      The :class:`Report`, when the check passes.

    Raises:
      CollectivesAssertionError: listing each implicit collective (kind, bytes,
        the kernel, the user's call line) and the fix.

    Example:
        ```python
        x = jax.device_put(x, NamedSharding(mesh, P("data")))
        testing.assert_no_implicit_collectives(lambda x: cpu_kernels.copy(x) * 2, x)  # fails
        ```
    """
    report = collectives(fn, *args, **kwargs)
    if report.implicit:
        n = len(report.implicit)
        lines = [f"{n} implicit collective{'s' if n > 1 else ''} around opaque kernels in {report.function} "
                 f"({report.implicit_sent_bytes} B sent per device per step; backend {report.backend}, JAX "
                 f"{report.jax_version}):"]
        for c in report.implicit:
            lines.append(f"  - {c.describe()}")
            if c.line:
                lines.append(f"      hlo: {c.line[:220]}")
        lines.append("Why: outside shard_map, XLA's SPMD partitioner cannot look into a custom call, so it "
                     "gathers the kernel's sharded operands to every device and runs the whole kernel on "
                     "each (the program never wrote these collectives).")
        lines.append("Fix:")
        lines += [f"  - {c.fix()}" for c in report.implicit]
        raise CollectivesAssertionError("\n".join(lines) + "\n", report)
    return report


def assert_no_cheaper_collectives(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Report:
    """Fails if a collective of ``fn``'s compiled program has a cheaper equivalent.

    An all-reduce whose result each device only slices its own part of (a
    reduce-scatter sends half the bytes), an all-gather of which each device
    keeps only its own shard (no collective needed), or a psum of a value
    already replicated over the axes (a multiplication). Only what survives
    compilation on the backend at hand counts: what XLA rewrites itself is
    not reported.

    Args:
      fn: The function to check (traced, lowered and compiled, not run).
      *args: Example arguments.
      **kwargs: Passed to ``fn``.

    Returns:
      The :class:`Report`, when the check passes.

    Raises:
      CollectivesAssertionError: listing each collective with its bytes now and
        after, the user's source line and the rewrite.
    """
    report = collectives(fn, *args, **kwargs)
    if report.cheaper:
        n = len(report.cheaper)
        lines = [f"{n} collective{'s' if n > 1 else ''} with a cheaper equivalent in {report.function} "
                 f"({report.savable_bytes} B sent per device per step could be saved; compiled for "
                 f"{report.backend}, JAX {report.jax_version}):"]
        for c in report.cheaper:
            lines.append(f"  - {c.describe()}")
            lines.append(f"      rewrite: {c.rewrite}")
        lines.append("Why: each is still in the compiled program, and the same result needs less "
                     "communication.")
        raise CollectivesAssertionError("\n".join(lines) + "\n", report)
    return report


def fake_cpu_devices(n: int) -> None:
    """Makes JAX start with ``n`` CPU devices: call it before anything starts JAX.

    Sets ``--xla_force_host_platform_device_count=n`` in ``XLA_FLAGS`` (replacing
    a count already there) and makes CPU JAX's platform unless ``JAX_PLATFORMS``
    says otherwise. ``import jax`` before it is fine; creating an array or
    calling ``jax.devices()`` before it is not: the count is fixed when JAX's
    backend starts. The pytest plugin's ``--reprules-cpu-devices N`` does the
    same for a test run.

    Args:
      n: How many devices (at least 1).

    Raises:
      ReprulesError: ``n`` is below 1, or a JAX backend already started with
        another number of CPU devices.

    Example:
        ```python
        from reprules import testing

        testing.fake_cpu_devices(8)         # first thing in a script
        import jax

        assert jax.device_count() == 8
        ```
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ReprulesError(f"fake_cpu_devices needs a device count of at least 1, got {n!r}.")
    if _environment.backend_started():
        import jax

        have = len(jax.devices("cpu"))
        if have != n:
            raise ReprulesError(
                f"fake_cpu_devices({n}): a JAX backend already started with {have} CPU devices.\n"
                "Why: the number of fake CPU devices is fixed when JAX's backend starts, and "
                "something (an array, jax.devices()) started it before this call.\n"
                "Fix: call fake_cpu_devices first thing, before any JAX computation, or set "
                f"XLA_FLAGS={_environment.FLAG}={n} in the environment.")
        return
    _environment.request_cpu_devices(n)


@contextlib.contextmanager
def tpu_on_cpu(chip: str = "v5e", cores: int = 1) -> Iterator[None]:
    """Runs Mosaic TPU Pallas kernels on CPU: TPU interpret mode, with the CPU
    device described as a TPU ``chip`` for kernels that ask which TPU they run on.

    Inside it, ``pltpu.force_tpu_interpret_mode()`` holds, and JAX's
    ``get_tpu_info()`` (read by ``pltpu.emit_pipeline`` and by many kernels'
    block-size logic: tokamax's and ejkernel's grouped matmuls, MaxText's tokamax
    backend) describes the CPU device as that chip instead of raising
    "Unsupported TPU device kind: cpu". Both are undone on exit.

    Args:
      chip: The TPU generation, as JAX's ``pltpu.ChipVersion`` names it without
        ``TPU_``: ``"v5e"``, ``"v5p"``, ``"v6e"``, ``"7x"``...
      cores: Tensor cores per logical device.

    Raises:
      ReprulesError: This JAX cannot describe a TPU for the CPU device (before
        0.9), or ``chip`` is not one it knows.

    Example:
        ```python
        with reprules.testing.tpu_on_cpu("v5e"):
            out = jax.jit(step)(x)     # tokamax's ragged_dot, on CPU
        ```
    """
    import jax
    from jax.experimental.pallas import tpu as pltpu

    from reprules._shim.plumbing import _jax  # lazy: imports JAX

    chips = getattr(pltpu, "ChipVersion", None)
    describe = getattr(pltpu, "get_tpu_info_for_chip", None)
    if _jax.tpu_info_module() is None or chips is None or describe is None:
        raise ReprulesError(
            f"tpu_on_cpu({chip!r}): JAX {jax.__version__} cannot describe a TPU for the CPU device.\n"
            "Why: JAX keeps TPU descriptions by device kind only from 0.9 on.\n"
            "Fix: use JAX 0.9 or newer, or plain pltpu.force_tpu_interpret_mode() for kernels that "
            "do not ask which TPU they run on.")
    known = {name.removeprefix("TPU_").lower(): member for name, member in chips.__members__.items()}
    version = known.get(str(chip).lower().removeprefix("tpu_").removeprefix("tpu"))
    if version is None:
        raise ReprulesError(
            f"tpu_on_cpu({chip!r}): JAX {jax.__version__} knows no such TPU.\n"
            "Why: the chip names JAX's pltpu.ChipVersion.\n"
            f"Fix: one of {', '.join(repr(k) for k in known)}.")
    with _jax.cpu_tpu_info(lambda: describe(version, cores)), pltpu.force_tpu_interpret_mode():
        yield


def shard_map(f: Callable[..., Any], mesh: Any, in_specs: Any, out_specs: Any,
              check: bool = True) -> Callable[..., Any]:
    """``shard_map`` with checking on (or off), on every supported JAX.

    ``jax.shard_map(..., check_vma=check)`` from JAX 0.6, and
    ``jax.experimental.shard_map.shard_map(..., check_rep=check)`` on JAX <= 0.5.

    Args:
      f: The per-device function.
      mesh: The ``jax.sharding.Mesh``.
      in_specs: ``PartitionSpec`` (or pytree of them) per argument.
      out_specs: ``PartitionSpec`` (or pytree of them) of the result.
      check: Whether JAX checks and tracks replication (``check_vma`` /
        ``check_rep``); reprules' rules make opaque kernels pass it.

    Returns:
      The ``shard_map``-ed function.
    """
    import jax

    new_shard_map = getattr(jax, "shard_map", None)
    mapped: Callable[..., Any]
    if new_shard_map is not None:  # 0.6+: jax.shard_map, check_vma
        mapped = new_shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    else:  # 0.4.28 - 0.5.x: jax.experimental.shard_map, check_rep
        from jax.experimental.shard_map import shard_map as old_shard_map

        mapped = old_shard_map(f, mesh, in_specs, out_specs, check_rep=check)
    return mapped


# --- helpers ---------------------------------------------------------------------------


def _check_levels(levels: Iterable[str]) -> tuple[str, ...]:
    levels = tuple(levels)
    unknown = [lv for lv in levels if lv not in LEVELS]
    if unknown or not levels:
        raise ValueError(
            f"Unknown level(s) {unknown or levels!r}.\n"
            f"Fix: use levels among {LEVELS} (jaxpr, lowered StableHLO, compiled HLO).")
    return levels


def _axes_text(axes: str | Iterable[str]) -> str:
    return repr(axes) if isinstance(axes, str) else repr(tuple(axes))


def _parse_expectation(key: Any, value: Any) -> tuple[str, str | None, Any, bool | None, dict[str, int]]:
    kind: str | None
    axes: Any = None
    defensive = None
    if key == "defensive":
        kind, defensive = None, True
    elif isinstance(key, str):
        kind = key
    elif isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str):
        kind, axes = key
    else:
        raise ValueError(
            f"expect key {key!r} is not understood.\n"
            f"Fix: use a kind ({', '.join(KINDS)}), a (kind, axes) pair such as "
            "('all-reduce', 'data'), or 'defensive'.")
    if kind is not None and kind not in KINDS:
        raise ValueError(
            f"expect key {key!r} names the unknown collective kind {kind!r}.\n"
            f"Fix: use one of {', '.join(KINDS)} (HLO spelling, with a hyphen).")
    if isinstance(value, bool) or not isinstance(value, (int, Mapping)):
        raise ValueError(
            f"expect[{key!r}] is {value!r}.\n"
            "Fix: give a count (an int) or a mapping with 'count' and/or 'bytes'.")
    want: dict[str, int] = {"count": value} if isinstance(value, int) else dict(value)
    if not want or set(want) - {"count", "bytes"}:
        raise ValueError(
            f"expect[{key!r}] is {value!r}.\n"
            "Fix: a mapping value may only have the keys 'count' and 'bytes'.")
    label = "defensive" if kind is None else (kind if axes is None else f"{kind} over {_axes_text(axes)}")
    return label, kind, axes, defensive, want


def _offending(found: Iterable[Collective]) -> str:
    out = []
    for c in found:
        out.append(f"  - {c.describe()}")
        for level, line in c.lines:
            out.append(f"      {level}: {line[:220]}")
    return "\n".join(out) + "\n"


def _why_and_fix(found: Iterable[Collective], report: Report) -> str:
    found = list(found)
    if found and all(c.dead for c in found):
        return ("Why: these are dead: only in the jaxpr, dropped by lowering as dead code (e.g. the "
                "all-reduce of a gradient nothing uses), so they never run.\n"
                "Fix: check only the levels that run (the default levels ignore dead collectives), or "
                "stop computing the unused value.\n")
    defensive = [c for c in found if c.defensive and not c.dead]
    named = {n for c in defensive for n in c.kernels_without_rule}
    culprits = [k for k in report.kernels_without_rule if k.name in named]  # same-named ones too
    if culprits:
        lines = [
            "Why: these are defensive all-reduces: shard_map runs with checking off, so its "
            "transpose sums cotangents over axes where they are replicated. Checking is off "
            "because of opaque kernels without a replication rule:"]
        for k in culprits:
            unknown = "" if k.identified else f"; {k.status()}"
            lines.append(f"  - kernel {k.name!r} ({k.primitive}, defined at {k.source or '?'}){unknown}")
        lines.append("Fix: give each a rule and turn checking on (check_vma=True; check_rep=True on "
                     "JAX <= 0.5):")
        for k in culprits:
            lines.append(f"    @reprules.replication_rule()      # above `def {k.name}(...)`, or for a kernel "
                         f"you cannot edit: reprules.replication_rule()({k.name})")
        return "\n".join(lines) + "\n"
    if defensive:
        return ("Why: these are defensive all-reduces: shard_map's transpose sums cotangents over "
                "axes where they are replicated, because checking is off.\n"
                "Fix: run shard_map with checking on (check_vma=True; check_rep=True on JAX <= 0.5); "
                "give any opaque kernel a rule with @reprules.replication_rule().\n")
    return ("Why: the program needs these collectives (their operands vary over the axes they run "
            "over), or they were written explicitly.\n"
            "Fix: if they are unexpected, check the shardings (in_specs/out_specs) and the "
            "source lines above.\n")
