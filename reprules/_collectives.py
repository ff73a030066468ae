"""The collectives report: jaxpr walking, level matching, defensive detection.

How a collective is judged **defensive** (documented heuristic):

1. It is an all-reduce (``psum``, ``psum2``, ``psum_invariant``) inside a
   ``shard_map`` body, created by autodiff: its name stack contains
   ``transpose(`` (JAX names every equation made by a backward pass so, and
   ``shard_map``'s transpose is where the check-off psum is added).
2. Its operand is *replicated* over some of the axes it sums over. Replication
   is computed by a small forward analysis of the body, not read from JAX's
   types (which are absent with checking off): body inputs vary over the axes
   their ``in_specs`` name; most equations' outputs vary over the union of
   their inputs' axes; a psum/all-gather removes its axes, an all-to-all,
   ppermute, reduce-scatter, ``axis_index``, ``pvary``/``pbroadcast``/``pcast``
   add theirs; sub-jaxprs (pjit, custom_vjp, scan, cond, while, remat) are
   walked; an opaque kernel's outputs vary like the union of its inputs (the
   ``rules.same()`` assumption).

Summing a value that is identical across an axis only multiplies it by the
axis size, which shard_map's transpose compensates for: that all-reduce moves
bytes for nothing. The psums that reprules' rules (or JAX's own checking) add
sum cotangents over axes where they vary, so they are reported as needed. A
kernel that reads its device index without a ``rules.varying`` rule can make
the analysis call a needed psum defensive; register its rule to fix that.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from reprules import _hlo

LEVELS = ("jaxpr", "stablehlo", "hlo")

_KIND_OF_PRIMITIVE = {
    "psum": "all-reduce",
    "psum2": "all-reduce",
    "psum_invariant": "all-reduce",
    "pmax": "all-reduce",
    "pmin": "all-reduce",
    "all_gather": "all-gather",
    "all_gather_invariant": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "psum_scatter": "reduce-scatter",
    "ppermute": "collective-permute",
    "pshuffle": "collective-permute",
    "all_to_all": "all-to-all",
    "ragged_all_to_all": "all-to-all",
}
_SUMS = ("psum", "psum2", "psum_invariant")
_ADDS_AXES = ("pvary", "pbroadcast", "pcast", "ppermute", "all_to_all", "ragged_all_to_all",
              "reduce_scatter", "psum_scatter", "pshuffle")
_OPAQUE = ("pallas_call", "ffi_call", "custom_call", "triton_kernel_call", "tpu_custom_call",
           "core_map", "mpmd_map")  # the last two: pl.kernel (0.8 - 0.9, 0.10+) and pl.core_map

# --- records -------------------------------------------------------------------


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

    @property
    def status(self) -> str:
        """``"defensive"`` or ``"needed"``."""
        return "defensive" if self.defensive else "needed"

    @property
    def folded(self) -> bool:
        """In the jaxpr or StableHLO, but folded away by XLA in compiled HLO."""
        return "stablehlo" in self.levels and "hlo" not in self.levels

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
        if self.levels == ("jaxpr",):
            folded = "; not lowered: dead code or a deduplicated call"
        elif self.folded:
            folded = "; folded by XLA in compiled HLO"
        name = f" {self.primitive}" if self.primitive else ""
        return (
            f"{self.kind} over {self.axes_text()}: {self.shape_text()}, {self.bytes} B, "
            f"{self.status}{extra}{name} [{levels}{folded}] op_name={self.op_name or '?'} at {where}"
        )

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["shapes"] = [list(s) for s in self.shapes]
        d["lines"] = [list(x) for x in self.lines]
        d["status"] = self.status
        d["folded"] = self.folded
        return d


def _matches(c: Collective, kind: str | None, axes: Any, level: str | None, defensive: bool | None) -> bool:
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
    """

    function: str
    jax_version: str
    mesh: tuple[tuple[str, int], ...]
    collectives: tuple[Collective, ...]
    kernels: tuple[Kernel, ...] = ()

    def select(self, kind: str | None = None, *, axes: str | Iterable[str] | None = None,
               level: str | None = None, defensive: bool | None = None) -> tuple[Collective, ...]:
        """The collectives matching every given filter.

        Args:
          kind: E.g. ``"all-reduce"``.
          axes: A mesh axis name or names (exact set).
          level: ``"jaxpr"``, ``"stablehlo"`` or ``"hlo"``.
          defensive: Only defensive (``True``) or needed (``False``) ones.
        """
        if kind is not None and kind not in _hlo.KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; expected one of {_hlo.KINDS}")
        if level is not None and level not in LEVELS:
            raise ValueError(f"unknown level {level!r}; expected one of {LEVELS}")
        return tuple(c for c in self.collectives if _matches(c, kind, axes, level, defensive))

    def count(self, kind: str | None = None, **filters: Any) -> int:
        """How many collectives match (see :meth:`select`)."""
        return len(self.select(kind, **filters))

    def bytes(self, kind: str | None = None, **filters: Any) -> int:
        """Per-device bytes of the matching collectives, per step."""
        return sum(c.bytes for c in self.select(kind, **filters))

    @property
    def defensive(self) -> tuple[Collective, ...]:
        return self.select(defensive=True)

    @property
    def kernels_without_rule(self) -> tuple[Kernel, ...]:
        return tuple(k for k in self.kernels if not k.has_rule)

    def table(self) -> str:
        """A readable table of the collectives and kernels."""
        head = f"collectives of {self.function} (JAX {self.jax_version}, mesh " + (
            ", ".join(f"{n}={s}" for n, s in self.mesh) or "none") + ")"
        rows = [("#", "kind", "axes", "type", "bytes", "status", "J S H", "primitive", "source")]
        for i, c in enumerate(self.collectives):
            marks = " ".join("x" if lvl in c.levels else "." for lvl in LEVELS)
            rows.append((str(i), c.kind + ("*" if c.is_async else ""), c.axes_text(), c.shape_text(),
                         str(c.bytes), c.status, marks, c.primitive or c.origin, _short(c.source)))
        widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
        lines = [head]
        lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        if not self.collectives:
            lines.append("  (no collectives)")
        total = sum(c.bytes for c in self.collectives)
        d = self.defensive
        lines.append(f"  total: {len(self.collectives)} collectives, {total} B per step; "
                     f"{len(d)} defensive ({sum(c.bytes for c in d)} B)")
        if any(c.folded for c in self.collectives):
            lines.append("  (J S H = jaxpr, StableHLO, compiled HLO; '.' under H: folded away by XLA)")
        for k in self.kernels:
            lines.append(f"  kernel {k.name} ({k.primitive} x{k.count}): {k.status()}; {_short(k.source)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        return {
            "function": self.function,
            "jax_version": self.jax_version,
            "mesh": dict(self.mesh),
            "collectives": [c.to_dict() for c in self.collectives],
            "kernels": [k.to_dict() for k in self.kernels],
            "summary": {
                "count": len(self.collectives),
                "bytes": self.bytes(),
                "defensive_count": len(self.defensive),
                "defensive_bytes": sum(c.bytes for c in self.defensive),
                "by_kind": {k: {"count": self.count(k), "bytes": self.bytes(k)}
                            for k in _hlo.KINDS if self.count(k)},
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


# --- the jaxpr walk --------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _JaxprCollective:
    kind: str
    primitive: str
    axes: tuple[str, ...]
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    bytes: int
    replicated_axes: tuple[str, ...]
    defensive: bool
    origin: str
    op_name: str
    source: str
    checked: bool | None
    shard_map_id: int | None


@dataclasses.dataclass(slots=True)
class _Walk:
    collectives: list[_JaxprCollective] = dataclasses.field(default_factory=list)
    kernels: list[tuple[Kernel, int]] = dataclasses.field(default_factory=list)
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    shard_maps: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class _Ctx:
    manual: frozenset[str] = frozenset()
    path: str = ""
    checked: bool | None = None
    shard_map_id: int | None = None


_EMPTY: frozenset[str] = frozenset()
# Outside shard_map, a value's per-device varying set is unknown ("*") unless it
# is a shard_map output: then it is what the body analysis found. This is how
# residuals passed from a forward shard_map to its transpose keep their real
# set (JAX gives them specs over every axis).
_UNKNOWN: frozenset[str] = frozenset({"*"})


def _is_jaxpr(obj: Any) -> bool:
    return hasattr(obj, "eqns") and hasattr(obj, "invars") and hasattr(obj, "outvars")


def _as_jaxpr(obj: Any) -> Any | None:
    if _is_jaxpr(obj):
        return obj
    inner = getattr(obj, "jaxpr", None)
    if inner is not None and _is_jaxpr(inner) and hasattr(obj, "consts"):
        return inner
    return None


def _sub_jaxprs(params: Mapping[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for key, value in params.items():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            j = _as_jaxpr(item)
            if j is not None:
                out.append((key, j))
    return out


def _axes_param(params: Mapping[str, Any]) -> tuple[str, ...]:
    value = params.get("axes", params.get("axis_name", ()))
    if not isinstance(value, (tuple, list)):
        value = (value,)
    return tuple(a for a in value if isinstance(a, str))


def _dtype_name(aval: Any) -> str:
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return "?"
    name = str(dtype)
    return {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "bool": "pred",
            "complex64": "c64", "complex128": "c128"}.get(
        name, name.replace("uint", "u").replace("int", "s").replace("float", "f"))


def _spec_axes(entry: Any) -> frozenset[str]:
    """Axis names a PartitionSpec or an old-style ``{dim: axes}`` dict mentions."""
    names: set[str] = set()
    items = entry.values() if isinstance(entry, Mapping) else tuple(entry)
    for part in items:
        if part is None:
            continue
        for a in part if isinstance(part, (tuple, list)) else (part,):
            if isinstance(a, str):
                names.add(a)
    return frozenset(names)


def _render_name_stack(ns: Any) -> str:
    """``transpose(jvp())/name``: JAX's own rendering, keeping bare transforms.

    ``str(NameStack)`` drops transforms that wrap no scope, which is exactly
    how a shard_map transpose's name stack looks in a jaxpr.
    """
    if ns is None:
        return ""
    stack = getattr(ns, "stack", None)
    if stack is None:
        return str(ns)
    parts: list[str] = []
    transforms: list[str] = []
    for element in stack:
        name = str(getattr(element, "name", element))
        if type(element).__name__ == "Transform":
            transforms.append(name)
            continue
        for t in reversed(transforms):
            name = f"{t}({name})"
        transforms = []
        parts.append(name)
    if transforms:
        name = ""
        for t in reversed(transforms):
            name = f"{t}({name})"
        parts.append(name)
    return "/".join(parts)


def _user_source(source_info: Any) -> str:
    tb = getattr(source_info, "traceback", None)
    frames = getattr(tb, "frames", None) if tb is not None else None
    if not frames:
        return ""
    for frame in frames:
        f = frame.file_name
        if _is_library_file(f):
            continue
        return f"{f}:{frame.line_num}"
    return ""


def _library_dirs() -> tuple[str, ...]:
    import jax

    dirs = [os.path.dirname(jax.__file__), os.path.dirname(os.path.abspath(__file__))]
    try:
        import jaxlib

        dirs.append(os.path.dirname(jaxlib.__file__))
    except ImportError:  # pragma: no cover
        pass
    return tuple(d + os.sep for d in dirs)


_LIB_DIRS: tuple[str, ...] | None = None


def _is_library_file(path: str) -> bool:
    global _LIB_DIRS
    if _LIB_DIRS is None:
        _LIB_DIRS = _library_dirs()
    if path.startswith(_LIB_DIRS):
        return True
    base = os.path.basename(path)
    return base in ("contextlib.py", "functools.py", "threading.py") or path.startswith("<")


def _kernel_info(eqn: Any) -> tuple[str, str, Any]:
    """(name, source, shim Identity) of an opaque kernel equation."""
    from reprules._shim._common import identify

    params = eqn.params
    name, source = "", ""
    info = params.get("name_and_src_info")  # 0.4.31 - 0.4.38
    if info is not None:
        name = getattr(info, "name", "") or ""
        src = getattr(info, "src_info", None)
        source = str(src) if src else ""
    kernel_jaxpr = params.get("jaxpr")
    debug = getattr(kernel_jaxpr, "debug_info", None)
    src_info = getattr(debug, "func_src_info", None)  # 0.5+: "kernel at file:line"
    if isinstance(src_info, str) and src_info:
        head, _, where = src_info.partition(" at ")
        name = name or head
        source = source or where
    name = name or str(params.get("name") or params.get("target_name") or eqn.primitive.name)
    if eqn.primitive.name == "ffi_call" and params.get("target_name"):
        name = str(params["target_name"])
    found = identify(eqn.primitive, params)
    if eqn.primitive.name in ("core_map", "mpmd_map"):  # pl.kernel: named by its body
        from reprules._shim.core_map import kernel_name

        name, source = kernel_name(params), "" if "helpers.py" in source else source
    source = source or found.site or _user_source(eqn.source_info)
    return name, source, found


def walk_jaxpr(closed_jaxpr: Any) -> _Walk:
    """Finds every collective and opaque kernel in a (closed) jaxpr, recursively."""
    state = _Walk()
    jaxpr = _as_jaxpr(closed_jaxpr)
    if jaxpr is None:
        raise TypeError(f"walk_jaxpr needs a jaxpr or closed jaxpr, got {type(closed_jaxpr).__name__}")
    _walk(jaxpr, [_UNKNOWN] * len(jaxpr.invars), _Ctx(), state)
    return state


def _walk(jaxpr: Any, in_varying: Sequence[frozenset[str]], ctx: _Ctx, state: _Walk) -> list[frozenset[str]]:
    env: dict[Any, frozenset[str]] = {}
    for v, s in zip(jaxpr.invars, in_varying):
        env[v] = s

    default = _EMPTY if ctx.shard_map_id is not None else _UNKNOWN

    def read(v: Any) -> frozenset[str]:
        try:
            return env.get(v, default)
        except TypeError:  # unhashable literal
            return default

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        union = frozenset().union(*ins) if ins else _EMPTY
        name = eqn.primitive.name
        ns = _render_name_stack(getattr(eqn.source_info, "name_stack", None))
        path = "/".join(p for p in (ctx.path, ns) if p)
        outs: list[frozenset[str]] | None = None
        if name == "shard_map":
            outs = _walk_shard_map(eqn, ins, path, ctx, state)
        elif name in _KIND_OF_PRIMITIVE:
            axes = _axes_param(eqn.params)
            _record_collective(eqn, name, axes, ins, union, path, ctx, state)
            if name in _SUMS or name in ("pmax", "pmin"):
                outs = [s - frozenset(axes) for s in ins]
            elif name in ("all_gather", "all_gather_invariant"):
                outs = [union - frozenset(axes)] * len(eqn.outvars)
            else:
                outs = [union | frozenset(axes)] * len(eqn.outvars)
        elif name in _ADDS_AXES:
            outs = [union | frozenset(_axes_param(eqn.params))] * len(eqn.outvars)
        elif name == "axis_index":
            outs = [frozenset(_axes_param(eqn.params))]
        elif name in _OPAQUE:
            _record_kernel(eqn, ctx, state)
            outs = [union] * len(eqn.outvars)
        else:
            subs = _sub_jaxprs(eqn.params)
            if subs:
                outs = _walk_subs(eqn, name, subs, ins, union, _Ctx(ctx.manual, f"{path}/{name}" if path else name,
                                                                    ctx.checked, ctx.shard_map_id), state)
        if outs is None or len(outs) != len(eqn.outvars):
            outs = [union if ctx.shard_map_id is not None else _UNKNOWN] * len(eqn.outvars)
        for v, s in zip(eqn.outvars, outs):
            env[v] = s
    return [read(v) for v in jaxpr.outvars]


def _walk_subs(eqn: Any, name: str, subs: list[tuple[str, Any]], ins: list[frozenset[str]],
               union: frozenset[str], ctx: _Ctx, state: _Walk) -> list[frozenset[str]]:
    n_out = len(eqn.outvars)
    if name == "cond":
        operands = ins[1:]
        index = ins[0] if ins else _EMPTY
        result = [index] * n_out
        for _, j in subs:
            got = _walk(j, _fit(operands, len(j.invars), union), ctx, state)
            result = [a | b for a, b in zip(result, _fit(got, n_out, union))]
        return result
    if name == "while":
        p = eqn.params
        cn, bn = p.get("cond_nconsts", 0), p.get("body_nconsts", 0)
        cconsts, bconsts, carry = ins[:cn], ins[cn:cn + bn], list(ins[cn + bn:])
        body = dict(subs).get("body_jaxpr")
        for _ in range(3):  # fixpoint over the carry (axis sets only grow)
            got = _walk(body, list(bconsts) + carry, ctx, _Walk()) if body is not None else carry
            new = [a | b for a, b in zip(carry, _fit(got, len(carry), union))]
            if new == carry:
                break
            carry = new
        for key, j in subs:
            args = list(cconsts) + carry if key == "cond_jaxpr" else list(bconsts) + carry
            _walk(j, _fit(args, len(j.invars), union), ctx, state)
        return carry
    if name == "scan":
        p = eqn.params
        nc, ncarry = p.get("num_consts", 0), p.get("num_carry", 0)
        consts, carry, xs = ins[:nc], list(ins[nc:nc + ncarry]), ins[nc + ncarry:]
        body = subs[0][1]
        got = []
        for _ in range(3):
            got = _walk(body, list(consts) + carry + list(xs), ctx, _Walk())
            new = [a | b for a, b in zip(carry, got[:ncarry])]
            if new == carry:
                break
            carry = new
        got = _walk(body, _fit(list(consts) + carry + list(xs), len(body.invars), union), ctx, state)
        return carry + list(got[ncarry:])
    # pjit, closed_call, remat, custom_jvp_call, custom_vjp_call, ...: the first
    # sub-jaxpr whose arity fits is the function itself.
    function_out: list[frozenset[str]] | None = None
    for _, j in subs:
        got = _walk(j, _fit(ins, len(j.invars), union), ctx, state)
        if function_out is None and len(j.invars) == len(ins) and len(got) == n_out:
            function_out = got
    return function_out if function_out is not None else [union] * n_out


def _fit(sets: Sequence[frozenset[str]], n: int, union: frozenset[str]) -> list[frozenset[str]]:
    if len(sets) == n:
        return list(sets)
    return [union] * n


def _walk_shard_map(eqn: Any, ins: list[frozenset[str]], path: str, ctx: _Ctx,
                    state: _Walk) -> list[frozenset[str]]:
    p = eqn.params
    mesh = p.get("mesh")
    shape = dict(getattr(mesh, "shape", {}) or {})
    if shape and (not state.mesh or len(shape) > len(state.mesh)):
        state.mesh = shape
    names = tuple(shape) or tuple(getattr(mesh, "axis_names", ()))
    if "manual_axes" in p:
        manual = frozenset(p["manual_axes"])
    elif "axis_names" in p and p["axis_names"]:
        manual = frozenset(p["axis_names"])
    else:
        manual = frozenset(names) - frozenset(p.get("auto", ()) or ())
    specs = p.get("in_specs", p.get("in_names", ()))
    in_varying = [
        _spec_axes(s) & manual if "*" in outer else _spec_axes(s) & manual & outer
        for s, outer in zip(specs, list(ins) + [_UNKNOWN] * (len(specs) - len(ins)))
    ]
    checked = p.get("check_vma", p.get("check_rep"))
    state.shard_maps += 1
    body = _as_jaxpr(p.get("jaxpr"))
    inner = _Ctx(manual=manual, path=f"{path}/shard_map" if path else "shard_map",
                 checked=None if checked is None else bool(checked), shard_map_id=state.shard_maps)
    if body is None:
        return [_UNKNOWN] * len(eqn.outvars)
    outs = _walk(body, _fit(in_varying, len(body.invars), frozenset(manual)), inner, state)
    return outs if len(outs) == len(eqn.outvars) else [_UNKNOWN] * len(eqn.outvars)


def _record_collective(eqn: Any, name: str, axes: tuple[str, ...], ins: list[frozenset[str]],
                       union: frozenset[str], path: str, ctx: _Ctx, state: _Walk) -> None:
    kind = _KIND_OF_PRIMITIVE[name]
    in_avals = [getattr(v, "aval", None) for v in eqn.invars]
    out_avals = [getattr(v, "aval", None) for v in eqn.outvars]
    shapes = tuple(tuple(getattr(a, "shape", ())) for a in out_avals)
    dtype = _dtype_name(out_avals[0]) if out_avals else "?"

    def size(avals: list[Any]) -> int:
        total = 0
        for a in avals:
            n = 1
            for d in getattr(a, "shape", ()):
                n *= int(d)
            total += n * getattr(getattr(a, "dtype", None), "itemsize", 4)
        return total

    nbytes = max(size(in_avals), size(out_avals))
    replicated: tuple[str, ...] = ()
    if name in _SUMS and ctx.shard_map_id is not None:
        replicated = tuple(a for a in axes if a in ctx.manual and a not in union)
    origin = "autodiff" if "transpose(" in path else "program"
    defensive = bool(replicated) and origin == "autodiff"
    op_name = f"{path}/{name}" if path else name
    state.collectives.append(_JaxprCollective(
        kind=kind, primitive=name, axes=axes, dtype=dtype, shapes=shapes, bytes=nbytes,
        replicated_axes=replicated, defensive=defensive, origin=origin, op_name=op_name,
        source=_user_source(eqn.source_info), checked=ctx.checked, shard_map_id=ctx.shard_map_id))


def _record_kernel(eqn: Any, ctx: _Ctx, state: _Walk) -> None:
    if ctx.shard_map_id is None:
        return
    name, source, found = _kernel_info(eqn)
    reg = found.registration
    kernel = Kernel(name=name, primitive=eqn.primitive.name, source=source, has_rule=reg is not None,
                    rule=repr(reg.rule) if reg is not None else "", checked=ctx.checked,
                    identified=found.identified, candidates=found.candidates)
    state.kernels.append((kernel, ctx.shard_map_id))


# --- matching the levels -------------------------------------------------------------


def _text_axes(tc: _hlo.TextCollective, mesh: Mapping[str, int]) -> tuple[str, ...] | None:
    return _hlo.groups_to_axes(tc.groups, mesh) if mesh or tc.groups.axes is not None else None


def _text_bytes(tc: _hlo.TextCollective) -> int:
    base = _hlo.nbytes(tc.dtype, tc.shapes)
    if tc.kind == "reduce-scatter":
        return base * (tc.group_size or 1)
    return base


def _groups_text(g: _hlo.Groups) -> str:
    if g.axes is not None:
        return ",".join(g.axes)
    if g.ids is None:
        return "?"
    return "{" + ",".join("{" + ",".join(map(str, x)) + "}" for x in g.ids) + "}"


def _clean_op_name(name: str) -> str:
    import re

    return re.sub(r"\[[^\]]*\]", "", name)


def build_report(function: str, jax_version: str, walk: _Walk, stablehlo: Sequence[_hlo.TextCollective],
                 hlo: Sequence[_hlo.TextCollective], mesh: Mapping[str, int] | None = None) -> Report:
    """Merges the jaxpr walk with the collectives parsed from the two texts."""
    mesh = dict(mesh or walk.mesh)
    kernels_by_map: dict[int, list[Kernel]] = {}
    for k, sm in walk.kernels:
        kernels_by_map.setdefault(sm, []).append(k)

    entries: list[dict[str, Any]] = []
    for jc in walk.collectives:
        # Rule-less kernels of the same shard_map first, then of the whole program:
        # the transpose of a shard_map is a shard_map of its own.
        same_map = [k.name for k in kernels_by_map.get(jc.shard_map_id or -1, ()) if not k.has_rule]
        anywhere = [k.name for k, _ in walk.kernels if not k.has_rule]
        missing = tuple(dict.fromkeys(same_map + anywhere)) if jc.defensive else ()
        entries.append(dict(
            kind=jc.kind, levels=["jaxpr"], dtype=jc.dtype, shapes=jc.shapes, bytes=jc.bytes,
            axes=jc.axes, groups="", defensive=jc.defensive, replicated_axes=jc.replicated_axes,
            origin=jc.origin, primitive=jc.primitive, op_name=jc.op_name, source=jc.source,
            is_async=False, checked=jc.checked, kernels_without_rule=missing, lines=[]))

    entry: dict[str, Any] | None
    for level, found in (("stablehlo", stablehlo), ("hlo", hlo)):
        for tc in found:
            axes = _text_axes(tc, mesh)
            line = (level, tc.line)
            if len(tc.shapes) > 1 and level == "hlo":
                # XLA's combiners merge collectives into one tuple instruction.
                rest = list(tc.shapes)
                for entry in _tuple_matches(entries, tc, axes, level):
                    rest.remove(tuple(entry["shapes"])[0])
                    entry["levels"].append(level)
                    entry["lines"].append(line)
                    entry["is_async"] = entry["is_async"] or tc.is_async
                if len(rest) == len(tc.shapes):
                    entry = None
                elif not rest:
                    continue
                else:
                    tc = dataclasses.replace(tc, shapes=tuple(rest))
                    entry = None
            else:
                entry = _best_match(entries, tc, axes, level)
            if entry is None:
                entries.append(dict(
                    kind=tc.kind, levels=[level], dtype=tc.dtype, shapes=tc.shapes, bytes=_text_bytes(tc),
                    axes=axes, groups="" if axes is not None else _groups_text(tc.groups), defensive=False,
                    replicated_axes=(), origin="xla" if level == "hlo" else "program", primitive="",
                    op_name=_clean_op_name(tc.op_name), source=tc.source, is_async=tc.is_async, checked=None,
                    kernels_without_rule=(), lines=[line]))
            else:
                entry["levels"].append(level)
                entry["lines"].append(line)
                entry["is_async"] = entry["is_async"] or tc.is_async
                if not entry["source"]:
                    entry["source"] = tc.source
                if not entry["op_name"]:
                    entry["op_name"] = _clean_op_name(tc.op_name)

    collectives = tuple(
        Collective(**{**e, "levels": tuple(lv for lv in LEVELS if lv in e["levels"]), "lines": tuple(e["lines"]),
                      "axes": None if e["axes"] is None else tuple(e["axes"])})
        for e in entries)
    # Same-named kernels stay apart: merged only with the same site and status.
    merged: dict[tuple[Any, ...], Kernel] = {}
    for k, _ in walk.kernels:
        key = (k.name, k.primitive, k.source, k.has_rule, k.rule, k.identified, k.candidates)
        if key in merged:
            merged[key] = dataclasses.replace(merged[key], count=merged[key].count + 1)
        else:
            merged[key] = k
    return Report(function=function, jax_version=jax_version, mesh=tuple(mesh.items()),
                  collectives=collectives, kernels=tuple(merged.values()))


def _tuple_matches(entries: list[dict[str, Any]], tc: _hlo.TextCollective, axes: tuple[str, ...] | None,
                   level: str) -> list[dict[str, Any]]:
    rest = list(tc.shapes)
    out = []
    for e in entries:
        if (level not in e["levels"] and e["kind"] == tc.kind and len(e["shapes"]) == 1
                and tuple(e["shapes"])[0] in rest
                and (axes is None or e["axes"] is None or set(e["axes"]) == set(axes))):
            rest.remove(tuple(e["shapes"])[0])
            out.append(e)
    return out


def _best_match(entries: list[dict[str, Any]], tc: _hlo.TextCollective, axes: tuple[str, ...] | None,
                level: str) -> dict[str, Any] | None:
    """The first not-yet-matched entry of the same collective, best key first."""
    candidates = [e for e in entries if level not in e["levels"] and e["kind"] == tc.kind
                  and (axes is None or e["axes"] is None or set(e["axes"]) == set(axes))]
    if not candidates:
        return None
    op = _clean_op_name(tc.op_name)
    tail = op.rsplit("/", 1)[-1] if op else ""

    def score(e: dict[str, Any]) -> int:
        s = 0
        if tuple(e["shapes"]) == tuple(tc.shapes):
            s += 4
        if e["dtype"] == tc.dtype:
            s += 1
        if tail and e["primitive"] and tail == e["primitive"]:
            s += 2
        if op and e["op_name"] and ("transpose(" in op) == ("transpose(" in e["op_name"]):
            s += 2
        return s

    best = max(candidates, key=score)  # max keeps the first of equal scores: program order
    return best


# --- the entry point -------------------------------------------------------------------


def _function_name(fn: Callable[..., Any]) -> str:
    inner = getattr(fn, "__wrapped__", fn)
    return getattr(inner, "__name__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _stablehlo_text(lowered: Any) -> str:
    try:
        module = lowered.compiler_ir("stablehlo")
        return str(module.operation.get_asm(enable_debug_info=True, large_elements_limit=16))
    except Exception:  # older/newer MLIR bindings: fall back to the plain text
        return str(lowered.as_text())


def collectives(fn: Callable[..., Any], *args: Any, mesh: Any = None, **kwargs: Any) -> Report:
    """See :func:`reprules.testing.collectives`."""
    import jax

    def call(*a: Any) -> Any:
        return fn(*a, **kwargs)

    call.__name__ = _function_name(fn)
    closed = jax.make_jaxpr(call)(*args)
    walk = walk_jaxpr(closed)
    lowered = jax.jit(call).lower(*args)
    shlo = _hlo.parse_stablehlo(_stablehlo_text(lowered))
    compiled = lowered.compile()
    hlo = _hlo.parse_hlo(compiled.as_text() or "")  # typed Optional by JAX; always text on CPU
    mesh_shape = None
    if mesh is not None:
        mesh_shape = dict(mesh.shape)
    elif not walk.mesh:
        for leaf in jax.tree_util.tree_leaves(args):
            m = getattr(getattr(leaf, "sharding", None), "mesh", None)
            if m is not None and getattr(m, "shape", None):
                mesh_shape = dict(m.shape)
                break
    return build_report(call.__name__, jax.__version__, walk, shlo, hlo, mesh_shape)
