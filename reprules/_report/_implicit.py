"""Implicit collectives: what XLA's partitioner inserts around an opaque kernel called outside ``shard_map``.

Under ``jit`` with sharded inputs (or explicit sharding), XLA's SPMD
partitioner cannot look into a custom call, so it gathers the kernel's
operands to every device and runs the whole kernel everywhere (jax#38551,
marin#6470, jax#32098). Two ways to find that:

1. **Compiled HLO** (what runs on the backend at hand): a collective found only
   in the compiled HLO (the program did not write it) whose result flows,
   through data movement only (copy, bitcast, reshape, transpose, convert,
   tuples, other collectives), into an operand of a custom call that is a
   kernel (:func:`is_kernel_target`). Its kernel, and the user's call line, are
   the opaque equation of the jaxpr outside ``shard_map`` that lowered to it.
2. **Predicted from the jaxpr**, where the backend hides it: a Pallas kernel
   (``pallas_call``, ``pl.kernel``) in interpret mode lowers to ordinary HLO
   that the partitioner splits like any other, so the CPU program has no
   gather; a TPU/GPU compile makes it a custom call and gathers every sharded
   operand. An operand's sharding comes from a per-dimension analysis of the
   jaxpr (:func:`outside_kernels`): arguments' shardings, ``with_sharding_constraint``,
   ``shard_map`` outputs, carried through elementwise ops, broadcasts,
   transposes, reductions and ``dot_general``; any other op on a sharded value
   gives "sharded, dimensions unknown".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from reprules._report import _hlo, _hlo_graph, _link_model
from reprules._report._comm import ImplicitCollective
from reprules._report._records import Collective
from reprules._report._walk import OPAQUE, kernel_info, user_source

# JAX's own primitives that lower to custom calls but are no kernel.
_INTERNAL = frozenset({
    "sharding_constraint", "pure_callback", "io_callback", "callback", "debug_callback", "cholesky", "lu",
    "qr", "householder_product", "eigh", "eig", "svd", "triangular_solve", "schur", "hessenberg",
    "tridiagonal", "tridiagonal_solve", "geqrf", "geqp3", "orgqr", "fft", "lu_pivots_to_permutation",
    "top_k", "approx_top_k", "device_put", "annotate_device_placement", "mesh_cast", "reshard",
    "optimization_barrier", "rng_bit_generator", "shard_map", "xla_pmap"})
_INTERNAL_TARGETS = ("Sharding", "SPMD", "lapack", "cu", "hip", "rocm", "ducc", "Move", "xla_python",
                     "xla_ffi_python", "xla_ffi_partitioned_python", "annotate", "X64", "mhlo.", "stablehlo.",
                     "TopK", "ApproxTopK", "AllocateBuffer", "LocalToGlobal", "GlobalToLocal",
                     "InspectSharding", "PartialReduce", "__cublas", "__cudnn", "__gpu$xla.gpu.ext")
_KERNEL_TARGETS = ("tpu_custom_call", "__gpu$xla.gpu.triton", "mosaic_gpu", "triton_kernel_call")
_PALLAS = ("pallas_call", "core_map", "mpmd_map")
_MOVES = frozenset({"copy", "bitcast", "reshape", "transpose", "convert", "get-tuple-element", "tuple",
                    "copy-start", "copy-done", "optimization-barrier", "all-gather", "all-gather-start",
                    "all-gather-done", "all-reduce", "all-reduce-start", "all-reduce-done", "all-to-all",
                    "collective-permute", "collective-permute-start", "collective-permute-done",
                    "reduce-scatter", "async-start", "async-done", "parameter", "broadcast", "slice"})

Dims = tuple[frozenset[str], ...] | None  # per-dimension mesh axes; None: sharded, dimensions unknown


@dataclasses.dataclass(frozen=True, slots=True)
class OutsideKernel:
    """An opaque kernel equation outside ``shard_map``, with its operands' shardings."""

    name: str
    primitive: str
    call_source: str
    kernel_source: str
    operands: tuple[tuple[str, tuple[int, ...], Dims], ...]  # (dtype, shape, dims)
    executions: int = 1


def is_kernel_target(target: str) -> bool:
    """Whether a custom call target is a kernel (not one of XLA's or JAX's own custom calls)."""
    if target in _KERNEL_TARGETS:
        return True
    return not target.startswith(_INTERNAL_TARGETS)


# --- the jaxpr side ---------------------------------------------------------------------


def _spec_dims(spec: Any, ndim: int, mesh: Mapping[str, int]) -> Dims:
    out = []
    for k in range(ndim):
        part = spec[k] if k < len(spec) else None
        names = part if isinstance(part, (tuple, list)) else (part,)
        out.append(frozenset(a for a in names if isinstance(a, str) and mesh.get(a, 2) > 1))
    return tuple(out)


def _sharding_dims(sharding: Any, ndim: int, mesh: dict[str, int]) -> Dims:
    if sharding is None:
        return tuple(frozenset() for _ in range(ndim))
    m = getattr(sharding, "mesh", None)
    spec = getattr(sharding, "spec", None)
    if m is not None and spec is not None and getattr(m, "shape", None):
        mesh.update(dict(m.shape))
        return _spec_dims(tuple(spec), ndim, mesh)
    if getattr(sharding, "is_fully_replicated", True):
        return tuple(frozenset() for _ in range(ndim))
    return None


def _sharded(d: Dims) -> bool:
    return d is None or any(d)


def outside_kernels(closed_jaxpr: Any, args: Sequence[Any], custom_names: frozenset[str] = frozenset()
                    ) -> tuple[list[OutsideKernel], dict[str, int]]:
    """The opaque kernels outside ``shard_map`` (and the mesh of the shardings seen).

    ``custom_names`` adds primitives that lowered to a kernel custom call (user primitives).
    """
    import jax  # lazy: this module parses text at import; JAX only for the jaxpr walk

    mesh: dict[str, int] = {}
    leaves = jax.tree_util.tree_leaves(args)
    jaxpr = closed_jaxpr.jaxpr
    dims: list[Dims] = []
    for k, v in enumerate(jaxpr.invars):
        ndim = len(getattr(v.aval, "shape", ()))
        leaf = leaves[k] if k < len(leaves) and len(leaves) == len(jaxpr.invars) else None
        dims.append(_sharding_dims(getattr(leaf, "sharding", None), ndim, mesh))
    found: list[OutsideKernel] = []
    _walk(jaxpr, dims, 1, mesh, frozenset(OPAQUE) | (custom_names - _INTERNAL), found)
    return found, mesh


def _walk(jaxpr: Any, in_dims: Sequence[Dims], executions: int, mesh: dict[str, int],
          kernels: frozenset[str], found: list[OutsideKernel]) -> list[Dims]:
    env: dict[Any, Dims] = {}
    for v, d in zip(jaxpr.invars, in_dims):
        env[v] = d

    def read(v: Any) -> Dims:
        if hasattr(v, "val"):  # a literal
            return tuple(frozenset() for _ in getattr(getattr(v, "aval", None), "shape", ()))
        return env.get(v, tuple(frozenset() for _ in getattr(v.aval, "shape", ())))

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _eqn(eqn, ins, executions, mesh, kernels, found)
        for v, d in zip(eqn.outvars, outs):
            env[v] = d
    return [read(v) for v in jaxpr.outvars]


def _ndim(v: Any) -> int:
    return len(getattr(getattr(v, "aval", None), "shape", ()))


def _replicated(v: Any) -> Dims:
    return tuple(frozenset() for _ in range(_ndim(v)))


def _eqn(eqn: Any, ins: list[Dims], executions: int, mesh: dict[str, int], kernels: frozenset[str],
         found: list[OutsideKernel]) -> list[Dims]:
    name, p, outvars = eqn.primitive.name, eqn.params, eqn.outvars
    if name == "shard_map":
        specs = p.get("out_specs", p.get("out_names", ()))
        m = p.get("mesh")
        if m is not None and getattr(m, "shape", None):
            mesh.update(dict(m.shape))
        out = []
        for v, s in zip(outvars, list(specs) + [None] * len(outvars)):
            if isinstance(s, Mapping):  # 0.4.x out_names: {dim: axes}
                s = tuple(s.get(k) for k in range(_ndim(v)))
            out.append(_spec_dims(tuple(s), _ndim(v), mesh) if s is not None else None)
        return out
    if name in kernels:
        kname, ksource, _ = kernel_info(eqn)
        operands = tuple((str(getattr(v.aval, "dtype", "?")), tuple(getattr(v.aval, "shape", ())), d)
                         for v, d in zip(eqn.invars, ins))
        found.append(OutsideKernel(kname, name, user_source(eqn.source_info), ksource, operands, executions))
        return [_replicated(v) for v in outvars]  # the partitioner runs it whole: replicated results
    if name == "sharding_constraint":
        return [_sharding_dims(p.get("sharding"), _ndim(outvars[0]), mesh)]
    if name == "broadcast_in_dim" and ins[0] is not None:
        dims: list[frozenset[str]] = [frozenset() for _ in range(_ndim(outvars[0]))]
        for src, dst in enumerate(p.get("broadcast_dimensions", ())):
            dims[dst] = ins[0][src]
        return [tuple(dims)]
    if name == "transpose" and ins[0] is not None:
        return [tuple(ins[0][k] for k in p.get("permutation", ()))]
    if name.startswith(("reduce_", "argmax", "argmin")) and "axes" in p and ins[0] is not None:
        return [tuple(d for k, d in enumerate(ins[0]) if k not in tuple(p["axes"]))]
    if name == "squeeze" and ins[0] is not None:
        return [tuple(d for k, d in enumerate(ins[0]) if k not in tuple(p.get("dimensions", ())))]
    if name == "dot_general" and ins[0] is not None and ins[1] is not None:
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        lhs, rhs = ins[0], ins[1]
        batch = [lhs[a] | rhs[b] for a, b in zip(lb, rb)]
        free = [lhs[k] for k in range(len(lhs)) if k not in lc and k not in lb]
        free += [rhs[k] for k in range(len(rhs)) if k not in rc and k not in rb]
        return [tuple(batch + free)]
    subs = _subs(p)
    if subs and name not in ("scan", "while", "cond"):
        j = subs[0]
        if len(j.invars) == len(ins):
            got = _walk(j, ins, executions, mesh, kernels, found)
            if len(got) == len(outvars):
                return got
        for j in subs:
            _walk(j, [None if any(_sharded(d) for d in ins) else _replicated(v) for v in j.invars],
                  executions, mesh, kernels, found)
    elif subs:
        length = int(p.get("length", 1) or 1) if name == "scan" else 1
        for j in subs:
            guess = [None if any(_sharded(d) for d in ins) else _replicated(v) for v in j.invars]
            _walk(j, guess, executions * max(length, 1), mesh, kernels, found)
    # Elementwise and everything else: same-shaped inputs' axes per dimension, else unknown.
    out = []
    for v in outvars:
        shape = tuple(getattr(getattr(v, "aval", None), "shape", ()))
        same = [d for d, iv in zip(ins, eqn.invars)
                if tuple(getattr(getattr(iv, "aval", None), "shape", ())) == shape]
        if not any(_sharded(d) for d in ins):
            out.append(_replicated(v))
        elif same and all(d is not None for d in same) and not any(
                _sharded(d) for d, iv in zip(ins, eqn.invars) if _ndim(iv) and d not in same):
            out.append(tuple(frozenset().union(*(d[k] for d in same if d is not None)) for k in range(len(shape))))
        else:
            out.append(None)
    return out


def _subs(params: Mapping[str, Any]) -> list[Any]:
    out = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            j = getattr(item, "jaxpr", item)
            if hasattr(j, "eqns") and hasattr(j, "invars"):
                out.append(j)
    return out


def spec_text(dims: Dims, mesh: Mapping[str, int]) -> str:
    """``P('data', None)`` for per-dimension axes (``""`` when unknown)."""
    if dims is None:
        return ""
    order = list(mesh)
    parts = []
    for d in dims:
        names = sorted(d, key=lambda a: order.index(a) if a in order else len(order))
        parts.append("None" if not names else repr(names[0]) if len(names) == 1 else repr(tuple(names)))
    while parts and parts[-1] == "None":
        parts.pop()
    return f"P({', '.join(parts)})"


# --- the HLO side -----------------------------------------------------------------------


def _target(instr: _hlo_graph.Instr) -> str:
    return (instr.attr("custom_call_target") or "").strip().strip('"')


def _op_tail(instr: _hlo_graph.Instr) -> str:
    meta = instr.attr("metadata") or ""
    start = meta.find('op_name="')
    if start < 0:
        return ""
    name = meta[start + 9:meta.find('"', start + 9)]
    tail = name.rsplit("/", 1)[-1]
    return tail.split("[", 1)[0]


def custom_call_names(graph: _hlo_graph.Graph) -> frozenset[str]:
    """The jaxpr primitives (``op_name`` tails) that lowered to a kernel custom call."""
    return frozenset(_op_tail(i) for c in graph.computations.values() for i in c.instrs.values()
                     if i.opcode == "custom-call" and is_kernel_target(_target(i)))


def _is_move_fusion(graph: _hlo_graph.Graph, instr: _hlo_graph.Instr) -> bool:
    called = graph.computations.get(instr.called() or "")
    return called is not None and all(i.opcode in _MOVES for i in called.instrs.values())


def _feeds(graph: _hlo_graph.Graph, comp: _hlo_graph.Computation,
           start: _hlo_graph.Instr) -> Iterator[tuple[_hlo_graph.Instr, int]]:
    """``(custom call, operand index)`` that ``start``'s result reaches through data movement only."""
    seen, todo = {start.name}, [start.name]
    while todo:
        for user, k in comp.users(todo.pop()):
            if user.opcode == "custom-call":
                if is_kernel_target(_target(user)):
                    yield user, k
            elif (user.opcode in _MOVES or (user.opcode == "fusion" and _is_move_fusion(graph, user))) \
                    and user.name not in seen:
                seen.add(user.name)
                todo.append(user.name)


def find(graph: _hlo_graph.Graph, collectives: Sequence[Collective], outside: Sequence[OutsideKernel],
         mesh: Mapping[str, int], backend: str, link: _link_model.Link) -> tuple[ImplicitCollective, ...]:
    """The implicit collectives: in the compiled HLO, and predicted where the backend hides them."""
    customs = [i for c in graph.computations.values() for i in c.instrs.values()
               if i.opcode == "custom-call" and is_kernel_target(_target(i))]
    matched = _match(customs, outside)
    found: list[ImplicitCollective] = []
    for c in collectives:
        if c.levels != ("hlo",):  # written by the program (in the jaxpr or StableHLO)
            continue
        line = next((text for level, text in c.lines if level == "hlo"), "")
        where = graph.where(line)
        if where is None:
            continue
        comp, instr = where
        for custom, k in _feeds(graph, comp, instr):
            ok = matched.get(custom.name)
            dims = ok.operands[k][2] if ok is not None and k < len(ok.operands) else None
            n = _group_size(c, mesh)
            found.append(ImplicitCollective(
                kind=c.kind, axes=c.axes, dtype=c.dtype, shape=c.shapes[0] if c.shapes else (), bytes=c.bytes,
                seconds=_link_model.seconds(c.kind, c.bytes, n, link), sent=_link_model.sent(c.kind, c.bytes, n),
                kernel=ok.name if ok is not None else _target(custom),
                primitive=ok.primitive if ok is not None else (_op_tail(custom) or "custom-call"), operand=k,
                call_source=ok.call_source if ok is not None else _hlo_source(custom, graph),
                kernel_source=ok.kernel_source if ok is not None else "",
                in_specs=spec_text(dims, mesh) or _gather_spec(instr, c, dims), backend=backend, line=line,
                executions=ok.executions if ok is not None else c.executions))
    used = {id(ok) for ok in matched.values()}
    for ok in outside:
        if id(ok) in used or ok.primitive not in _PALLAS:
            continue
        for k, (dtype, shape, dims) in enumerate(ok.operands):
            if not _sharded(dims):
                continue
            axes = tuple(a for a in mesh if dims is None or any(a in d for d in dims))
            n = math.prod(mesh.get(a, 1) for a in axes) if axes else 2
            nbytes = math.prod(shape) * _hlo.itemsize(_hlo_dtype(dtype))
            found.append(ImplicitCollective(
                kind="all-gather", axes=axes if dims is not None else None, dtype=_hlo_dtype(dtype), shape=shape,
                bytes=nbytes, seconds=_link_model.seconds("all-gather", nbytes, n, link),
                sent=_link_model.sent("all-gather", nbytes, n), kernel=ok.name,
                primitive=ok.primitive, operand=k, call_source=ok.call_source, kernel_source=ok.kernel_source,
                in_specs=spec_text(dims, mesh), predicted=True, backend=backend, executions=ok.executions))
    return tuple(found)


def _match(customs: Sequence[_hlo_graph.Instr], outside: Sequence[OutsideKernel]) -> dict[str, OutsideKernel]:
    """Each kernel custom call's jaxpr equation: by FFI target, else by primitive, in program order."""
    left = list(outside)
    out: dict[str, OutsideKernel] = {}
    for keyed in (lambda i, ok: ok.name == _target(i), lambda i, ok: ok.primitive == _op_tail(i),
                  lambda i, ok: _target(i) in _KERNEL_TARGETS and ok.primitive in _PALLAS):
        for instr in customs:
            if instr.name in out:
                continue
            ok = next((o for o in left if keyed(instr, o)), None)
            if ok is not None:
                out[instr.name] = ok
                left.remove(ok)
    return out


def _group_size(c: Collective, mesh: Mapping[str, int]) -> int:
    if c.axes:
        return math.prod(mesh.get(a, 1) for a in c.axes)
    return max(math.prod(mesh.values()) if mesh else 2, 2)


def _gather_spec(instr: _hlo_graph.Instr, c: Collective, dims: Any) -> str:
    """``P(...)`` from an all-gather's dimension and axes, when the jaxpr gave none."""
    gathered = instr.ints("dimensions")
    if c.kind != "all-gather" or not gathered or not c.axes or not c.shapes:
        return ""
    parts = ["None"] * len(c.shapes[0])
    parts[gathered[0]] = repr(c.axes[0]) if len(c.axes) == 1 else repr(tuple(c.axes))
    while parts and parts[-1] == "None":
        parts.pop()
    return f"P({', '.join(parts)})"


def _hlo_source(instr: _hlo_graph.Instr, graph: _hlo_graph.Graph) -> str:
    return graph.source(instr)


def _hlo_dtype(dtype: str) -> str:
    return {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "bool": "pred"}.get(
        dtype, dtype.replace("uint", "u").replace("int", "s").replace("float", "f"))
