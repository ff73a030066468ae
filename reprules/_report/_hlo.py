"""Collectives in StableHLO and compiled-HLO text, and their replica groups.

Pure text parsing (no JAX import), so it is tested on recorded texts. XLA
prints the devices a collective runs over in several syntaxes, all handled by
:func:`parse_groups`:

=========================================  ===================================
``{{0,1},{2,3}}``                          explicit groups (HLO)
``{}``                                     one group of every device (HLO)
``[2,2]<=[4]``                             iota groups (HLO)
``[2,4]<=[4,2]T(1,0)``                     transposed iota groups (HLO)
``mesh['data'=4,'model'=2] {'model'}``     mesh axes (HLO, JAX >= 0.12)
``mesh['axis_0'=4,'axis_3'=2] {'axis_0'}``  XLA's own mesh, read as device groups (HLO)
``dense<[[0, 2], [1, 3]]> : tensor<2x2xi64>``  explicit groups (StableHLO)
``#stablehlo.replica_group_mesh_axes<...>``    mesh axes (StableHLO, JAX >= 0.12)
=========================================  ===================================

Asynchronous pairs (``all-reduce-start`` / ``all-reduce-done``) are reported
once, at the ``-start``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Mapping, Sequence

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

_ITEMSIZE = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}


@dataclasses.dataclass(frozen=True, slots=True)
class Groups:
    """The devices a collective runs over, as printed.

    Exactly one of ``ids`` and ``axes`` is set: explicit device groups
    (logical ids, i.e. positions in the mesh's row-major order), or mesh axis
    names when XLA printed them directly. ``ids == ()`` means one group of
    every device.
    """

    ids: tuple[tuple[int, ...], ...] | None = None
    axes: tuple[str, ...] | None = None
    pairs: bool = False  # ids are collective-permute (source, target) pairs
    # With ``axes``: the printed mesh, ``(name, size)`` in order. XLA may print a
    # mesh of its own (``'axis_0'=4, ...``) when it combines collectives.
    mesh: tuple[tuple[str, int], ...] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class TextCollective:
    """One collective found in StableHLO or HLO text.

    Attributes:
      kind: One of :data:`KINDS`.
      level: ``"stablehlo"`` or ``"hlo"``.
      dtype: Element type in HLO spelling (``f32``, ``bf16``, ``s32``...).
      shapes: Per-device result shapes (several for a tuple collective).
      groups: The replica groups or mesh axes, as printed.
      op_name: The ``op_name`` metadata (JAX's name stack), or ``""``.
      source: ``file:line`` from the metadata, or ``""``.
      line: The instruction's first line of text.
      is_async: Whether it is the ``-start`` of an asynchronous pair.
    """

    kind: str
    level: str
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    groups: Groups
    op_name: str = ""
    source: str = ""
    line: str = ""
    is_async: bool = False

    @property
    def group_size(self) -> int | None:
        if self.groups.ids and not self.groups.pairs:
            return len(self.groups.ids[0])
        return None


def itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype, 4)


def nbytes(dtype: str, shapes: Sequence[Sequence[int]]) -> int:
    return sum(math.prod(s) for s in shapes) * itemsize(dtype)


# --- replica groups ------------------------------------------------------------

_IOTA = re.compile(r"\[([\d,\s]*)\]\s*<=\s*\[([\d,\s]*)\](?:\s*T\(([\d,\s]*)\))?")
_HLO_MESH = re.compile(r"mesh\[[^\]]*\]\s*\{([^}]*)\}")
_HLO_MESH_AXIS = re.compile(r"'([^']+)'\s*=\s*(\d+)")
_SHLO_MESH_AXIS = re.compile(r'axis_ref<\s*name\s*=\s*"([^"]+)"')
_DENSE = re.compile(r"dense<(.*?)>\s*:\s*tensor<([\dx]*)x?i\d+>", re.S)


def _ints(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"-?\d+", text)]


def _iota_groups(shape: list[int], dims: list[int], perm: list[int] | None) -> tuple[tuple[int, ...], ...]:
    ids = list(range(math.prod(dims)))
    # Reshape to dims, transpose by perm, flatten: pure Python, no numpy.
    if perm:
        strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]
        new_dims = [dims[p] for p in perm]
        ids = [
            sum(idx[k] * strides[perm[k]] for k in range(len(perm)))
            for idx in itertools.product(*(range(d) for d in new_dims))
        ]
    rows, cols = (shape[0], math.prod(shape[1:])) if len(shape) > 1 else (1, shape[0] if shape else 1)
    return tuple(tuple(ids[r * cols : (r + 1) * cols]) for r in range(rows))


def parse_groups(text: str, *, pairs: bool = False) -> Groups:
    """Parses a replica-group (or source-target-pair) attribute value.

    Args:
      text: The attribute value as printed, e.g. ``{{0,1},{2,3}}``,
        ``[2,4]<=[4,2]T(1,0)``, ``mesh['data'=4,'model'=2] {'model'}`` or
        ``dense<[[0, 2], [1, 3]]> : tensor<2x2xi64>``.
      pairs: The value lists collective-permute pairs, not groups.

    Returns:
      The :class:`Groups`.

    Raises:
      ValueError: the text is in none of the known syntaxes.
    """
    text = text.strip()
    m = _HLO_MESH.search(text)
    if m and text.startswith("mesh"):
        sizes = tuple((name, int(size)) for name, size in _HLO_MESH_AXIS.findall(m.group(0)))
        return Groups(axes=tuple(re.findall(r"'([^']+)'", m.group(1))), mesh=sizes or None)
    if "replica_group_mesh_axes" in text:
        return Groups(axes=tuple(_SHLO_MESH_AXIS.findall(text)))
    m = _DENSE.search(text)
    if m:
        body, shape_text = m.group(1).strip(), m.group(2)
        shape = [int(d) for d in shape_text.split("x") if d]
        values = _ints(body)
        if not body.startswith("[") and len(values) == 1:  # splat
            values = values * math.prod(shape)
        width = shape[-1] if shape else len(values)
        rows = [tuple(values[i : i + width]) for i in range(0, len(values), width)] if width else []
        return Groups(ids=tuple(rows), pairs=pairs)
    m = _IOTA.match(text)
    if m:
        shape, dims = _ints(m.group(1)), _ints(m.group(2))
        perm = _ints(m.group(3)) if m.group(3) is not None else None
        return Groups(ids=_iota_groups(shape, dims, perm), pairs=pairs)
    if text.startswith("{"):
        inner = text[1:-1].strip() if text.endswith("}") else text[1:]
        return Groups(ids=tuple(tuple(_ints(g)) for g in re.findall(r"\{([^{}]*)\}", inner)), pairs=pairs)
    raise ValueError(f"unrecognised replica groups: {text!r}")


def groups_to_axes(groups: Groups, mesh_shape: Mapping[str, int]) -> tuple[str, ...] | None:
    """The mesh axes whose devices form ``groups``, or ``None`` if none do.

    Device ids are logical: positions in the mesh's row-major order, which is
    how JAX numbers devices in the collectives it lowers.
    """
    names = list(mesh_shape)
    sizes = [mesh_shape[n] for n in names]
    total = math.prod(sizes)
    if groups.axes is not None and groups.mesh is not None and not set(groups.axes) <= set(names):
        # XLA's own mesh (a combined collective): its devices in row-major order, as
        # the mesh's; read back as groups of ids, then matched against this mesh.
        if math.prod(size for _, size in groups.mesh) != total:
            return None
        return groups_to_axes(_mesh_groups(groups.mesh, groups.axes), mesh_shape)
    if groups.axes is not None:
        return tuple(a for a in names if a in groups.axes) + tuple(a for a in groups.axes if a not in names)
    if groups.ids is None:
        return None
    if groups.ids == () or groups.ids == ((),):
        return tuple(names)
    coords = {i: _unravel(i, sizes) for i in range(total)}
    if groups.pairs:
        differ: set[str] = set()
        for pair in groups.ids:
            if len(pair) != 2 or any(p not in coords for p in pair):
                return None
            a, b = coords[pair[0]], coords[pair[1]]
            differ.update(n for n, x, y in zip(names, a, b) if x != y)
        return tuple(n for n in names if n in differ)
    found = {frozenset(g) for g in groups.ids}
    for r in range(1, len(names) + 1):
        for subset in itertools.combinations(range(len(names)), r):
            expected: dict[tuple[int, ...], set[int]] = {}
            for i, c in coords.items():
                key = tuple(c[k] for k in range(len(names)) if k not in subset)
                expected.setdefault(key, set()).add(i)
            if {frozenset(v) for v in expected.values()} == found:
                return tuple(names[k] for k in subset)
    return None


def _mesh_groups(mesh: Sequence[tuple[str, int]], axes: Sequence[str]) -> Groups:
    """The device groups of a collective over ``axes`` of a row-major ``mesh``."""
    sizes = [size for _, size in mesh]
    reduced = [name in axes for name, _ in mesh]
    by_rest: dict[tuple[int, ...], list[int]] = {}
    for i in range(math.prod(sizes)):
        coords = _unravel(i, sizes)
        by_rest.setdefault(tuple(c for c, r in zip(coords, reduced) if not r), []).append(i)
    return Groups(ids=tuple(tuple(g) for g in by_rest.values()))


def _unravel(i: int, sizes: Sequence[int]) -> tuple[int, ...]:
    out = []
    for s in reversed(sizes):
        out.append(i % s)
        i //= s
    return tuple(reversed(out))


# --- compiled HLO ----------------------------------------------------------------

_HLO_OP = re.compile(
    r"=\s*(?P<shape>.*?)\s(?P<op>all-reduce|all-gather|reduce-scatter|collective-permute|"
    r"all-to-all|ragged-all-to-all)(?P<start>-start)?\("
)
_HLO_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_META_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\d+)')


def _hlo_attr(line: str, name: str) -> str | None:
    """The value of ``name=...`` in an HLO instruction, braces balanced."""
    i = line.find(f" {name}=")
    if i < 0:
        i = line.find(f",{name}=")
        if i < 0:
            return None
    j = i + len(name) + 2
    if line.startswith("mesh[", j):
        m = _HLO_MESH.match(line, j)
        return m.group(0) if m else None
    if j < len(line) and line[j] == "{":
        depth = 0
        for k in range(j, len(line)):
            depth += {"{": 1, "}": -1}.get(line[k], 0)
            if depth == 0:
                return line[j : k + 1]
        return line[j:]
    m = _IOTA.match(line, j)
    if m:
        return m.group(0)
    end = line.find(",", j)
    return line[j : end if end >= 0 else len(line)]


def _stack_tables(text: str) -> dict[int, str]:
    """``stack_frame_id -> "file:line"`` from the tables newer XLA appends."""
    files: dict[int, str] = {}
    locations: dict[int, tuple[int, int]] = {}
    frames: dict[int, int] = {}
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if not line or not line[0].isdigit():
            if line and not line[0].isdigit():
                section = None if line.startswith(("HloModule", "ENTRY", "%", "ROOT")) else section
            continue
        key_text, _, rest = line.partition(" ")
        key = int(key_text)
        if section == "FileNames":
            files[key] = rest.strip().strip('"')
        elif section == "FileLocations":
            f = re.search(r"file_name_id=(\d+)", rest)
            ln = re.search(r"\bline=(\d+)", rest)
            if f and ln:
                locations[key] = (int(f.group(1)), int(ln.group(1)))
        elif section == "StackFrames":
            loc = re.search(r"file_location_id=(\d+)", rest)
            if loc:
                frames[key] = int(loc.group(1))
    out = {}
    for frame, loc_id in frames.items():
        if loc_id in locations:
            file_id, line_no = locations[loc_id]
            out[frame] = f"{files.get(file_id, '?')}:{line_no}"
    return out


def parse_hlo(text: str) -> list[TextCollective]:
    """Every collective in compiled (or unoptimized) HLO text, in order."""
    frames = _stack_tables(text) if "StackFrames" in text else {}
    found = []
    for raw in text.splitlines():
        m = _HLO_OP.search(raw)
        if not m:
            continue
        kind = "all-to-all" if m.group("op") == "ragged-all-to-all" else m.group("op")
        is_async = bool(m.group("start"))
        shapes = [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _HLO_SHAPE.findall(m.group("shape"))]
        if is_async and len(shapes) >= 2 and kind != "all-reduce":
            # (operand, result[, contexts]): keep the result.
            shapes = [shapes[1]]
        if not shapes:
            continue
        dtype = shapes[0][0]
        if kind == "collective-permute":
            attr = _hlo_attr(raw, "source_target_pairs") or "{}"
            groups = parse_groups(attr, pairs=True)
        else:
            groups_attr = _hlo_attr(raw, "replica_groups")
            groups = parse_groups(groups_attr) if groups_attr else Groups(ids=())
        op_name = source = ""
        meta = _hlo_attr(raw, "metadata")
        if meta:
            fields = {k: v.strip('"') for k, v in _META_FIELD.findall(meta)}
            op_name = fields.get("op_name", "").replace("\\'", "'").replace("\\\\", "\\")
            if "source_file" in fields:
                source = f"{fields['source_file']}:{fields.get('source_line', '?')}"
            elif "stack_frame_id" in fields:
                source = frames.get(int(fields["stack_frame_id"]), "")
        found.append(
            TextCollective(
                kind=kind,
                level="hlo",
                dtype=dtype,
                shapes=tuple(s for _, s in shapes),
                groups=groups,
                op_name=op_name,
                source=source,
                line=raw.strip(),
                is_async=is_async,
            )
        )
    return found


# --- StableHLO ---------------------------------------------------------------------

_SHLO_OP = re.compile(
    r'"?stablehlo\.(all_reduce|all_gather|reduce_scatter|collective_permute|all_to_all)"?[\s(]'
)
_SHLO_SIG = re.compile(r"\)\s*->\s*(.*?)(?:\s+loc\((#?[^)]*)\))?\s*$")
_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]+\d*(?:E\d+M\d+\w*)?)>")
_LOC_DEF = re.compile(r"^(#loc\d*)\s*=\s*loc\((.*)\)\s*$")
_MLIR_DTYPE = {"i1": "pred", "i8": "s8", "i16": "s16", "i32": "s32", "i64": "s64",
               "ui8": "u8", "ui16": "u16", "ui32": "u32", "ui64": "u64"}


def _resolve_loc(ref: str, defs: Mapping[str, str], depth: int = 0) -> tuple[str, str]:
    """(name, "file:line") of an MLIR location, following ``#locN`` aliases."""
    if depth > 20:
        return "", ""
    ref = ref.strip()
    if ref.startswith("#loc"):
        return _resolve_loc(defs.get(ref, ""), defs, depth + 1)
    if ref.startswith("callsite("):
        inner = ref[len("callsite(") : -1] if ref.endswith(")") else ref[len("callsite(") :]
        return _resolve_loc(inner.split(" at ")[0], defs, depth + 1)
    if ref.startswith("fused"):
        names, src = [], ""
        for part in re.findall(r"#loc\d*", ref):
            n, s = _resolve_loc(part, defs, depth + 1)
            names.append(n)
            src = src or s
        return next((n for n in names if n), ""), src
    m = re.match(r'"((?:[^"\\]|\\.)*)"(?::(\d+))?', ref)
    if not m:
        return "", ""
    text, line_no = m.group(1), m.group(2)
    if line_no is not None:  # a file location
        return "", f"{text}:{line_no}"
    rest = ref[m.end() :].strip()
    _, src = _resolve_loc(rest[1:-1], defs, depth + 1) if rest.startswith("(") else ("", "")
    return re.sub(r"\[.*$", "", text).rstrip(":"), src


def parse_stablehlo(text: str) -> list[TextCollective]:
    """Every collective in StableHLO text (with or without debug locations)."""
    lines = text.splitlines()
    defs = {}
    for line in lines:
        m = _LOC_DEF.match(line.strip())
        if m:
            defs[m.group(1)] = m.group(2)
    found = []
    for i, raw in enumerate(lines):
        m = _SHLO_OP.search(raw)
        if not m or "=" not in raw[: m.start()]:
            continue
        kind = m.group(1).replace("_", "-")
        attrs, sig = raw, None
        for j in range(i, min(i + 200, len(lines))):
            if j > i:
                attrs += "\n" + lines[j]
            s = _SHLO_SIG.search(lines[j])
            if s and (j == i or lines[j].lstrip().startswith("})") or "->" in lines[j]):
                sig = s
                break
        if sig is None:
            continue
        tensors = _TENSOR.findall(sig.group(1))
        if not tensors:
            continue
        shapes = tuple(tuple(int(d) for d in dims.split("x") if d) for dims, _ in tensors)
        dtype = _MLIR_DTYPE.get(tensors[0][1], tensors[0][1].lower())
        if kind == "collective-permute":
            g = re.search(r"source_target_pairs\s*=\s*(dense<.*?>\s*:\s*tensor<[^>]*>)", attrs, re.S)
            groups = parse_groups(g.group(1), pairs=True) if g else Groups(ids=())
        else:
            g = re.search(
                r"replica_groups\s*=\s*(dense<.*?>\s*:\s*tensor<[^>]*>|#stablehlo\.replica_group_mesh_axes<.*?\]>)",
                attrs,
                re.S,
            )
            groups = parse_groups(g.group(1)) if g else Groups(ids=())
        op_name, source = _resolve_loc(sig.group(2), defs) if sig.group(2) else ("", "")
        found.append(
            TextCollective(
                kind=kind,
                level="stablehlo",
                dtype=dtype,
                shapes=shapes,
                groups=groups,
                op_name=op_name,
                source=source,
                line=raw.strip(),
            )
        )
    return found
