"""Compiled HLO text as a graph: computations, instructions, their operands and users.

Pure text parsing (no JAX import), like :mod:`reprules._report._hlo`, which finds the
collectives; this module adds what the communication findings need: who uses a
collective's result (:meth:`Graph.users`), through which instructions a value
flows into a custom call, and the value of a small integer expression on each
device (:func:`evaluate`): the offset of a ``dynamic-slice``, computed from
``partition-id`` the way ``axis_index`` lowers (``shift-right-logical``,
``and``, ``divide``, ``remainder``, a table lookup...). An expression with any
other instruction is not evaluated (``None``): a finding is only made when the
offsets are known on every device.

Both HLO spellings are read: operands with their types
(``add(f32[] %a, f32[] %b)``, JAX <= 0.4.x) and without (``add(%a, %b)``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping

from reprules._report import _hlo

_COMP = re.compile(r"^\s*(ENTRY\s+)?%(?P<name>[\w.\-$]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%(?P<name>[\w.\-$]+)\s*=\s*")
_OPCODE = re.compile(r"\s*(?P<op>[a-z][\w\-]*)\(")
_NAME = re.compile(r"%([\w.\-$]+)")
_DIMS = re.compile(r"^\s*([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_NUM = re.compile(r"-?\d+")


@dataclasses.dataclass(frozen=True, slots=True)
class Instr:
    """One HLO instruction.

    Attributes:
      name: Its name, without ``%``.
      opcode: ``all-reduce``, ``fusion``, ``dynamic-slice``...
      shape: The result type as printed (``f32[8,128]{1,0}``, or a tuple).
      operands: Operand names, in order.
      args: The text between the opcode's parentheses (a constant's value).
      attrs: The text after them (``calls=``, ``dynamic_slice_sizes=``...).
      line: The whole line, stripped (as :mod:`reprules._report._hlo` records it).
    """

    name: str
    opcode: str
    shape: str
    operands: tuple[str, ...]
    args: str
    attrs: str
    line: str

    @property
    def dims(self) -> tuple[int, ...] | None:
        """The result's dimensions (None for a tuple)."""
        m = _DIMS.match(self.shape)
        return tuple(int(d) for d in m.group(2).split(",") if d) if m else None

    @property
    def dtype(self) -> str:
        m = _DIMS.match(self.shape)
        return m.group(1) if m else ""

    def attr(self, name: str) -> str | None:
        """The value of ``name=`` (braces balanced), or None."""
        return _hlo._hlo_attr(" " + self.attrs, name)

    def ints(self, name: str) -> tuple[int, ...] | None:
        value = self.attr(name)
        return None if value is None else tuple(int(v) for v in _NUM.findall(value))

    def called(self) -> str | None:
        """The computation a ``fusion`` (``calls=``) or ``call`` (``to_apply=``) runs."""
        value = self.attr("calls") if self.opcode == "fusion" else self.attr("to_apply")
        return value.lstrip("%") if value else None


@dataclasses.dataclass(slots=True)
class Computation:
    name: str
    instrs: dict[str, Instr] = dataclasses.field(default_factory=dict)
    params: dict[int, str] = dataclasses.field(default_factory=dict)
    entry: bool = False

    def users(self, name: str) -> list[tuple[Instr, int]]:
        """``(user, operand index)`` of every use of ``name`` in this computation."""
        return [(i, k) for i in self.instrs.values() for k, op in enumerate(i.operands) if op == name]


@dataclasses.dataclass(slots=True)
class Graph:
    """Every computation of one HLO module, and how many partitions it runs on."""

    computations: dict[str, Computation]
    partitions: int
    frames: dict[int, str] = dataclasses.field(default_factory=dict)

    def source(self, instr: Instr) -> str:
        """``file:line`` from the instruction's metadata, or ``""``."""
        meta = instr.attr("metadata") or ""
        fields = {k: v.strip('"') for k, v in _hlo._META_FIELD.findall(meta)}
        if "source_file" in fields:
            return f"{fields['source_file']}:{fields.get('source_line', '?')}"
        if "stack_frame_id" in fields:
            return self.frames.get(int(fields["stack_frame_id"]), "")
        return ""

    def where(self, line: str) -> tuple[Computation, Instr] | None:
        """The instruction whose stripped text is ``line`` (as a report records it)."""
        for comp in self.computations.values():
            for instr in comp.instrs.values():
                if instr.line == line:
                    return comp, instr
        return None


def _balanced(text: str, start: int) -> int:
    """The index just past the parenthesis group opening at ``text[start]``."""
    depth = 0
    for k in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[k], 0)
        if depth == 0:
            return k + 1
    return len(text)


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    rest, pos = line, m.end()
    if rest[pos:pos + 1] == "(":  # a tuple type
        end = _balanced(rest, pos)
        shape = rest[pos:end]
    else:
        end = rest.find(" ", pos)
        if end < 0:
            return None
        shape = rest[pos:end]
    op = _OPCODE.match(rest, end)
    if not op:
        return None
    open_at = op.end() - 1
    close = _balanced(rest, open_at)
    args = rest[open_at + 1:close - 1]
    return Instr(name=m.group("name"), opcode=op.group("op"), shape=shape,
                 operands=tuple(_NAME.findall(args)), args=args, attrs=rest[close:], line=line.strip())


def parse(text: str) -> Graph:
    """The computations of compiled (or unoptimized) HLO text."""
    comps: dict[str, Computation] = {}
    current: Computation | None = None
    partitions = 1
    for raw in text.splitlines():
        if raw.startswith("HloModule"):
            m = re.search(r"num_partitions=(\d+)", raw)
            partitions = int(m.group(1)) if m else 1
            continue
        head = _COMP.match(raw)
        if head:
            current = Computation(head.group("name"), entry=bool(head.group(1)))
            comps[current.name] = current
            continue
        if raw.strip() == "}":
            current = None
            continue
        if current is None:
            continue
        instr = _parse_instr(raw)
        if instr is None:
            continue
        current.instrs[instr.name] = instr
        if instr.opcode == "parameter":
            nums = _NUM.findall(instr.args)
            if nums:
                current.params[int(nums[0])] = instr.name
    return Graph(comps, partitions, _hlo._stack_tables(text) if "StackFrames" in text else {})


# --- what a device computes: small integer expressions --------------------------------

class _Unknown(Exception):
    pass


_BINARY: Mapping[str, Callable[[int, int], int]] = {
    "add": lambda a, b: a + b,
    "subtract": lambda a, b: a - b,
    "multiply": lambda a, b: a * b,
    "divide": lambda a, b: int(a / b) if b else 0,  # HLO: truncation toward zero
    "remainder": lambda a, b: (abs(a) % abs(b)) * (1 if a >= 0 else -1) if b else 0,
    "maximum": max,
    "minimum": min,
    "and": lambda a, b: a & b,
    "or": lambda a, b: a | b,
    "xor": lambda a, b: a ^ b,
    "shift-left": lambda a, b: a << b,
    "shift-right-logical": lambda a, b: a >> b,
    "shift-right-arithmetic": lambda a, b: a >> b,
}
_COMPARE: Mapping[str, Callable[[int, int], bool]] = {
    "LT": lambda a, b: a < b, "LE": lambda a, b: a <= b, "GT": lambda a, b: a > b,
    "GE": lambda a, b: a >= b, "EQ": lambda a, b: a == b, "NE": lambda a, b: a != b,
}
_PASS = ("convert", "bitcast", "reshape", "copy", "bitcast-convert")


def _scalar(v: int | tuple[int, ...]) -> int:
    if isinstance(v, tuple):
        if len(v) != 1:
            raise _Unknown
        return v[0]
    return v


def evaluate(graph: Graph, comp: Computation, name: str, device: int,
             param: Callable[[int], int | tuple[int, ...]] | None = None, depth: int = 0) -> int | None:
    """The integer value of ``name`` in ``comp`` on ``device`` (its partition id), or None.

    ``param(i)`` gives the value of the computation's ``i``-th parameter (for
    a fused computation: its caller's operand); None outside fusions.
    """
    try:
        return _scalar(_eval(graph, comp, name, device, param, depth))
    except (_Unknown, RecursionError, ValueError, KeyError, IndexError):
        return None


def _eval(graph: Graph, comp: Computation, name: str, device: int,
          param: Callable[[int], int | tuple[int, ...]] | None, depth: int) -> int | tuple[int, ...]:
    if depth > 60:
        raise _Unknown
    instr = comp.instrs[name]
    op = instr.opcode

    def sub(k: int) -> int | tuple[int, ...]:
        return _eval(graph, comp, instr.operands[k], device, param, depth + 1)

    if op == "partition-id":
        return device
    if op == "replica-id":
        return 0  # jit: one replica, num_partitions devices
    if op == "parameter":
        if param is None:
            raise _Unknown
        return param(int(_NUM.findall(instr.args)[0]))
    if op == "constant":
        text = instr.args.strip()
        if text in ("true", "false"):
            return int(text == "true")
        values = tuple(int(v) for v in _NUM.findall(text))
        if not values or re.search(r"\d\.\d|e[+-]?\d|nan|inf", text):
            raise _Unknown
        return values[0] if not text.startswith("{") else values
    if op in _PASS:
        return sub(0)
    if op in _BINARY:
        return _BINARY[op](_scalar(sub(0)), _scalar(sub(1)))
    if op == "negate":
        return -_scalar(sub(0))
    if op == "abs":
        return abs(_scalar(sub(0)))
    if op == "compare":
        direction = (instr.attr("direction") or "").strip()
        return int(_COMPARE[direction](_scalar(sub(0)), _scalar(sub(1))))
    if op == "select":
        return sub(1) if _scalar(sub(0)) else sub(2)
    if op == "clamp":
        lo, x, hi = (_scalar(sub(k)) for k in range(3))
        return min(max(x, lo), hi)
    if op == "dynamic-slice":  # a table lookup: one element of a 1-D constant
        table = sub(0)
        sizes = instr.ints("dynamic_slice_sizes")
        if not isinstance(table, tuple) or sizes != (1,):
            raise _Unknown
        i = min(max(_scalar(sub(1)), 0), len(table) - 1)
        return (table[i],)
    if op == "slice":
        table = sub(0)
        bounds = instr.ints("slice")
        if not isinstance(table, tuple) or not bounds or len(bounds) < 2:
            raise _Unknown
        step = bounds[2] if len(bounds) > 2 else 1
        return table[bounds[0]:bounds[1]:step]
    if op == "fusion":
        called = graph.computations[instr.called() or ""]
        top = root(called)

        def inner(i: int) -> int | tuple[int, ...]:
            return sub(i)

        return _eval(graph, called, top, device, inner, depth + 1)
    raise _Unknown


def root(comp: Computation) -> str:
    """The name of the computation's ``ROOT`` instruction."""
    for instr in comp.instrs.values():
        if instr.line.startswith("ROOT "):
            return instr.name
    return list(comp.instrs)[-1]
