"""The jaxpr walk of the collectives report: every collective and opaque kernel, and which are defensive.

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
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from reprules._report._records import Kernel
from reprules._shim import ADDED_SCOPE, identify, pl_kernel_name

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
OPAQUE = _OPAQUE
_CASTS = ("pvary", "pbroadcast", "pcast")  # type casts: the data stays what it was


@dataclasses.dataclass(frozen=True, slots=True)
class _JaxprCollective:
    """One collective equation, before :mod:`reprules._report._levels` matches it with the lowered text."""

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
    executions: int = 1
    added_by: str = ""


@dataclasses.dataclass(slots=True)
class Walk:
    """What :func:`walk_jaxpr` found: jaxpr collectives, opaque kernels (with their shard_map), the mesh."""

    collectives: list[_JaxprCollective] = dataclasses.field(default_factory=list)
    kernels: list[tuple[Kernel, int]] = dataclasses.field(default_factory=list)
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    shard_maps: int = 0
    # The *data* analysis (:func:`walk_jaxpr` with ``data=True``): which axes a value's data
    # really varies over. A cast (pvary, pbroadcast, pcast) changes a type, not the data, and
    # an opaque kernel may read its device index: its outputs vary over every manual axis.
    data: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class _Ctx:
    manual: frozenset[str] = frozenset()
    path: str = ""
    checked: bool | None = None
    shard_map_id: int | None = None
    executions: int = 1  # per step: the product of the enclosing scans' lengths


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
    hi = params.get("_prim")  # 0.10+ call_hi_primitive: the jaxprs are the hijax primitive's own
    hi_params = getattr(hi, "params", None)  # params (jax_remat3's RematTraced: `jaxpr`, the body it
    if isinstance(hi_params, dict):  # recomputes in the backward pass; jax_custom_vjp3: `traced`)
        for key, value in hi_params.items():
            j = _as_jaxpr(value)
            j = j if j is not None else _as_jaxpr(getattr(value, "jaxpr", None))
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


def user_source(source_info: Any) -> str:
    """``file:line`` of the first frame outside JAX, jaxlib and reprules, or ``""``."""
    return _user_source(source_info)


def kernel_info(eqn: Any) -> tuple[str, str, Any]:
    """(name, source, shim Identity) of an opaque kernel equation."""
    return _kernel_info(eqn)


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

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # reprules/, not this folder
    dirs = [os.path.dirname(jax.__file__), package]
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
        name, source = pl_kernel_name(params), "" if "helpers.py" in source else source
    source = source or found.site or _user_source(eqn.source_info)
    return name, source, found


def walk_jaxpr(closed_jaxpr: Any, data: bool = False) -> Walk:
    """Finds every collective and opaque kernel in a (closed) jaxpr, recursively.

    With ``data=True``, each collective's ``replicated_axes`` are the summed axes
    its operand's data is identical over, whatever its type says (see :attr:`Walk.data`);
    the collectives come in the same order as without.
    """
    state = Walk(data=data)
    jaxpr = _as_jaxpr(closed_jaxpr)
    if jaxpr is None:
        raise TypeError(f"walk_jaxpr needs a jaxpr or closed jaxpr, got {type(closed_jaxpr).__name__}")
    _walk(jaxpr, [_UNKNOWN] * len(jaxpr.invars), _Ctx(), state)
    return state


def _walk(jaxpr: Any, in_varying: Sequence[frozenset[str]], ctx: _Ctx, state: Walk) -> list[frozenset[str]]:
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
            if state.data and name in _CASTS and len(ins) == len(eqn.outvars):
                outs = list(ins)
            else:
                outs = [union | frozenset(_axes_param(eqn.params))] * len(eqn.outvars)
        elif name == "axis_index":
            outs = [frozenset(_axes_param(eqn.params))]
        elif name in _OPAQUE:
            _record_kernel(eqn, ctx, state)
            outs = [union | ctx.manual if state.data else union] * len(eqn.outvars)
        else:
            subs = _sub_jaxprs(eqn.params)
            if subs:
                outs = _walk_subs(eqn, name, subs, ins, union, _Ctx(ctx.manual, f"{path}/{name}" if path else name,
                                                                    ctx.checked, ctx.shard_map_id, ctx.executions), state)
        if outs is None or len(outs) != len(eqn.outvars):
            outs = [union if ctx.shard_map_id is not None else _UNKNOWN] * len(eqn.outvars)
        for v, s in zip(eqn.outvars, outs):
            env[v] = s
    return [read(v) for v in jaxpr.outvars]


def _walk_subs(eqn: Any, name: str, subs: list[tuple[str, Any]], ins: list[frozenset[str]],
               union: frozenset[str], ctx: _Ctx, state: Walk) -> list[frozenset[str]]:
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
            got = _walk(body, list(bconsts) + carry, ctx, Walk(data=state.data)) if body is not None else carry
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
            got = _walk(body, list(consts) + carry + list(xs), ctx, Walk(data=state.data))
            new = [a | b for a, b in zip(carry, got[:ncarry])]
            if new == carry:
                break
            carry = new
        # The body runs `length` times per step: its collectives count that often.
        looped = dataclasses.replace(ctx, executions=ctx.executions * max(int(p.get("length", 1) or 1), 1))
        got = _walk(body, _fit(list(consts) + carry + list(xs), len(body.invars), union), looped, state)
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
                    state: Walk) -> list[frozenset[str]]:
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
                 checked=None if checked is None else bool(checked), shard_map_id=state.shard_maps,
                 executions=ctx.executions)
    if body is None:
        return [_UNKNOWN] * len(eqn.outvars)
    outs = _walk(body, _fit(in_varying, len(body.invars), frozenset(manual)), inner, state)
    return outs if len(outs) == len(eqn.outvars) else [_UNKNOWN] * len(eqn.outvars)


def _record_collective(eqn: Any, name: str, axes: tuple[str, ...], ins: list[frozenset[str]],
                       union: frozenset[str], path: str, ctx: _Ctx, state: Walk) -> None:
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
    op_name = f"{path}/{name}" if path else name
    added = added_by(op_name)
    origin = "autodiff" if "transpose(" in path or added else "program"  # reprules adds in a bwd
    defensive = bool(replicated) and origin == "autodiff"
    state.collectives.append(_JaxprCollective(
        kind=kind, primitive=name, axes=axes, dtype=dtype, shapes=shapes, bytes=nbytes,
        replicated_axes=replicated, defensive=defensive, origin=origin, op_name=op_name,
        source=_user_source(eqn.source_info), checked=ctx.checked, shard_map_id=ctx.shard_map_id,
        executions=ctx.executions, added_by=added))


def added_by(op_name: str) -> str:
    """``"reprules"`` for a collective reprules added to a ``custom_vjp`` bwd (its
    name stack has ``_source.ADDED_SCOPE``, in the jaxpr and in XLA's op_name), else ``""``."""
    return "reprules" if re.search(rf"(^|[/(]){ADDED_SCOPE}([/)]|$)", op_name) else ""


def _record_kernel(eqn: Any, ctx: _Ctx, state: Walk) -> None:
    if ctx.shard_map_id is None:
        return
    name, source, found = _kernel_info(eqn)
    reg = found.registration
    kernel = Kernel(name=name, primitive=eqn.primitive.name, source=source, has_rule=reg is not None,
                    rule=repr(reg.rule) if reg is not None else "", checked=ctx.checked,
                    identified=found.identified, candidates=found.candidates)
    state.kernels.append((kernel, ctx.shard_map_id))
