"""A program-level differential fuzzer: checking on is never worse than checking off.

Beside the kernel fuzzer (tests/fuzz_kernels.py), which asks whether one
kernel's *typing* is sound, this one writes whole ``shard_map`` bodies from a
small grammar and asks whether the *program* computes the right values and
gradients with checking on. A program combines:

* opaque ops: Pallas kernels (``interpret=True``) with a declared rule
  (``@reprules.replication_rule()``) or none (reprules infers where JAX would
  refuse, or everywhere under ``reprules.inference()``, or nowhere under
  ``reprules.inference(False)``: the program's ``MODE``); ``ffi_call``\\ s of
  ``reprules.testing.cpu_kernels`` (a rule on the target or none); user
  primitives whose abstract eval returns ``ShapedArray(shape, dtype)`` (drops
  the varying axes; a rule or none); ``jax.pure_callback`` (no rule). Each
  is differentiable through a ``jax.custom_vjp`` whose backward pass calls the
  same op (``diff(op)``), or sits behind ``stop_gradient`` (``sg``);
* ``lax.cond`` / ``lax.switch`` / ``lax.while_loop`` / ``lax.fori_loop`` (static
  bounds, or a traced trip count) whose predicate, index or trip count may vary
  over the devices (from ``axis_index`` or from a sharded input), ``lax.scan``,
  ``lax.map``, ``jax.vmap``, ``jax.jit``, ``jax.checkpoint``, ``jax.custom_vjp``,
  ``jax.custom_jvp`` (and ``jax.nn.relu`` / ``gelu`` / ``softplus``, custom_jvp
  functions) and ``jnp.linalg.solve``. Each construct nests in any other's branch,
  loop body or while predicate, up to ``MAX_DEPTH`` (4) deep; branches take
  replicated and varying values as operands and close over them; loop carries
  start from the operand or from ``jnp.zeros`` (replicated) and accumulate
  varying values;
* ``psum`` / ``pmean`` (outside every branch) and ``axis_index`` arithmetic.

Each program runs on a (4, 2) ``("data", "model")`` mesh of 8 fake CPU devices
three ways: its forward values and the gradients of ``sum(outputs * T)`` (a
random cotangent ``T``) with checking **on** (``MODE`` around the trace), with
checking **off**, and as a plain reference: the same body with every opaque
op replaced by its ``jnp`` meaning, under ``jax.vmap`` over named axes
``"data"`` and ``"model"`` (one element per device; collectives and
``axis_index`` work there as in ``shard_map``), unsharded. The oracle:

* an output whose ``out_specs`` claims replication over an axis across which
  the reference's per-device values differ must be refused;
* otherwise the outputs and every gradient must equal the reference's;
* no collective of the forward or backward pass sits inside a cond / switch /
  while whose predicate varies over that collective's axes (issue 45; read from
  the StableHLO by ``helpers.assert_no_collective_under_varying_branch``, never
  run: it would hang);
* a refusal is a ``reprules.ReprulesError`` or any JAX error while tracing and
  lowering. It is a counterexample too (a *false refusal*) where out_specs claim
  no replication the generator's types doubt, checking off and the reference
  agree, and JAX alone (``REPRULES_SOUND_TYPES=0``: JAX's own typing of control
  flow and opaque calls) accepts the program and computes its values right. An
  error when the compiled program runs is a failure, and so is a program that
  checking off or the reference cannot run (the generator's fault).

The generator tracks, soundly, the mesh axes each value may vary over; most
``out_specs`` state exactly those, some claim more replication than that (a
claim that must be refused when the values do differ), a few less.

Programs are Python source, so a counterexample prints as a program to paste
into a regression test, and ``minimize`` shrinks one. A long run by hand::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python tests/fuzz_programs.py --count 2000 --seed 7 [--minimize]
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import re
import sys
import time
import warnings
from typing import Any

R, C = 4, 8  # each device's block of every value: small, so a program compiles fast
AXES = ("data", "model")
SIZES = {"data": 4, "model": 2}
SPECS = [(), ("data",), ("model",), ("data", "model")]  # the mesh axes an input or output is split over
JAX_VERSION = tuple(int(re.match(r"\d*", p).group() or 0) for p in __import__("jax").__version__.split("."))

# Opaque op families: their jnp meaning. Every family is linear in each operand, so its
# custom_vjp's backward pass can call the same op (`diff`).
FAMILIES = {"copy": 1, "scale": 1, "mul": 2}
FFI_FAMILIES = ("copy", "mul")  # reprules_copy, reprules_mul (w as long as x: elementwise)

# Hazards: what may make checking on lie, by the known bugs (the classes counterexamples are
# counted by). "opaque": a rule-less user primitive / ffi_call / pure_callback on a value that
# varies (JAX types its output replicated); "cond": cond/switch on a predicate or index that
# varies (jax#40823 and its value form); "while": a while_loop whose trip count varies.
HAZARDS = ("opaque", "cond", "while")

# The grammar's constructs, each a statement of its own or nested in another's branch, body or
# loop predicate (up to MAX_DEPTH deep, at depth d with chance NEST[d]); those of BLOCK_ONLY map
# over a block's rows, so they need a block (rank 2), not a row.
NESTED = ("cond", "switch", "while", "fori", "fori_dynamic", "scan", "map", "vmap", "jit", "checkpoint")
BLOCK_ONLY = ("scan", "map", "vmap")
MAX_DEPTH = 4
NEST = (0.14, 0.2, 0.2, 0.2)
STATEMENTS = {"leaf": 3, "cond": 2.5, "switch": 1, "while": 1, "fori": 0.6, "fori_dynamic": 0.6, "scan": 1,
              "map": 0.5, "vmap": 0.7, "jit": 0.7, "checkpoint": 0.6, "collective": 1.6, "axis_index": 0.7}


def _spec_text(axes: tuple[str, ...]) -> str:
    if not axes:
        return "P()"
    return f"P({axes[0]!r})" if len(axes) == 1 else f"P({tuple(axes)!r})"


def _axes_text(axes: tuple[str, ...]) -> str:
    return repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))


def _ordered(axes: Any) -> tuple[str, ...]:
    return tuple(a for a in AXES if a in axes)


@dataclasses.dataclass
class Stmt:
    """``var = text``: one statement of a body, and what the generator knows of it."""

    var: str
    text: str
    operands: list[str]  # the earlier values `text` reads (first: what replaces `var` when dropped)
    adds: frozenset[str] = frozenset()  # axes it varies over by itself (axis_index)
    removes: frozenset[str] = frozenset()  # axes it reduces over (psum / pmean)
    constructs: tuple[str, ...] = ()  # grammar constructs used, for coverage
    pred_operands: tuple[int, ...] = ()  # operands read by a cond/switch predicate or loop bound
    pred_axes: frozenset[str] = frozenset()  # axes the predicate reads by itself (axis_index)
    loops: tuple[str, ...] = ()  # "cond", "while": what its predicates steer (any nesting depth)
    opaque_ruleless: bool = False  # a rule-less prim / ffi / callback reads the operands


@dataclasses.dataclass
class Program:
    """One generated program: a ``shard_map`` body in source form, and its specs."""

    seed: int
    index: int
    mode: str  # "default", "infer" (reprules.inference()), "no_infer" (inference(False))
    prologue: list[str]  # the opaque ops it makes (and the rules it declares)
    inputs: list[tuple[str, ...]]  # mesh axes each input is split over (leading dim)
    stmts: list[Stmt]
    outputs: list[str]
    out_specs: list[tuple[str, ...]]

    @property
    def source(self) -> str:
        args = ", ".join(f"x{i}" for i in range(len(self.inputs)))
        lines = [f"MODE = {self.mode!r}",
                 f"IN_SPECS = ({', '.join(_spec_text(a) for a in self.inputs)},)",
                 f"OUT_SPECS = ({', '.join(_spec_text(a) for a in self.out_specs)},)"]
        lines += self.prologue
        lines.append(f"def body({args}):")
        lines += [f"    {s.var} = {s.text}" for s in self.stmts]
        lines.append(f"    return ({', '.join(self.outputs)},)")
        return "\n".join(lines) + "\n"

    def varying(self) -> dict[str, frozenset[str]]:
        """The axes each value may vary over (sound: a value that varies over an axis has it)."""
        vary = {f"x{i}": frozenset(a) for i, a in enumerate(self.inputs)}
        for s in self.stmts:
            got = frozenset().union(*(vary[o] for o in s.operands)) | s.adds | s.pred_axes
            vary[s.var] = got - s.removes
        return vary

    def hazards(self) -> set[str]:
        vary, found = self.varying(), set()
        for s in self.stmts:
            reads = frozenset().union(*(vary[o] for o in s.operands))
            if s.opaque_ruleless and (reads or s.adds):
                found.add("opaque")
            pred = frozenset().union(*(vary[s.operands[i]] for i in s.pred_operands)) | s.pred_axes
            if pred:
                found |= set(s.loops)
        return found

    def steering_axes(self) -> frozenset[str]:
        """The axes over which some cond / switch predicate or loop bound may vary."""
        vary, found = self.varying(), frozenset()
        for s in self.stmts:
            if s.loops:
                found |= frozenset().union(*(vary[s.operands[i]] for i in s.pred_operands)) | s.pred_axes
        return found

    def honest(self) -> bool:
        """Whether out_specs claim no replication that the generator's types say may fail."""
        vary = self.varying()
        return all(vary[v] <= set(spec) for v, spec in zip(self.outputs, self.out_specs))

    def constructs(self) -> set[str]:
        return {c for s in self.stmts for c in s.constructs} | {f"mode:{self.mode}"}

    def describe(self) -> str:
        return (f"fuzz program seed={self.seed} index={self.index} (JAX {'.'.join(map(str, JAX_VERSION))}); "
                f"replay: REPRULES_FUZZ_SEED={self.seed} python tests/fuzz_programs.py --seed {self.seed} "
                f"--start {self.index} --count 1\n{self.source}")


# -- the grammar ------------------------------------------------------------------


class _Writer:
    """Writes one program's statements, keeping the values in scope and the ops it made."""

    def __init__(self, rng: random.Random, inputs: list[tuple[str, ...]]):
        self.rng = rng
        self.names = [f"x{i}" for i in range(len(inputs))]
        self.vary = {f"x{i}": frozenset(a) for i, a in enumerate(inputs)}
        self.stmts: list[Stmt] = []
        self.prologue: list[str] = []
        self.ops: dict[str, tuple[str, str, str]] = {}  # name -> (mechanism, family, status)
        # One rule status per (mechanism, family) for primitives and FFI targets: a rule is
        # registered on the primitive / target, for every call of it in the program.
        self.status = {(m, f): rng.choice(["declared", "ruleless"]) for m in ("prim", "ffi") for f in FAMILIES}
        self.n = 0
        # Per statement being written:
        self.tags: list[str] = []
        self.ruleless = False
        self.pred_names: list[str] = []
        self.pred_axes: set[str] = set()
        self.loops: set[str] = set()
        self.lam = 0  # lambda parameters made so far
        self.adds: set[str] = set()

    # values -----------------------------------------------------------------------
    def pick(self) -> str:
        """A value in scope, the recent ones and the inputs more often."""
        if self.rng.random() < 0.3:
            return self.rng.choice(self.names[: sum(n.startswith("x") for n in self.names)])
        recent = self.names[-3:]
        return self.rng.choice(recent if self.rng.random() < 0.6 else self.names)

    # opaque ops -------------------------------------------------------------------
    def op(self, ctx: set[str]) -> tuple[str, str]:
        """A fresh or reused opaque op for this context: (its name, its family)."""
        mechanisms = ["kernel", "kernel", "prim", "prim", "callback"]
        if FEATURES["ffi"] and "vmap" not in ctx:  # ffi_call has no batching rule for them
            mechanisms += ["ffi", "ffi"]
        mech = self.rng.choice(mechanisms)
        family = self.rng.choice(FFI_FAMILIES if mech == "ffi" else list(FAMILIES))
        if mech == "kernel":  # a new kernel function each time: its own rule or none
            status = self.rng.choice(["declared", "ruleless"])
            name = self._new_op(f'kernel_op("{family}", "{status}")', "k", (mech, family, status))
        elif mech == "callback":
            status = "ruleless"
            name = self._reuse(f'callback_op("{family}")', f"cb_{family}", (mech, family, status))
        else:
            status = self.status[mech, family]
            name = self._reuse(f'{mech}_op("{family}", "{status}")', f"{mech}_{family}", (mech, family, status))
        self.tags.append(f"{mech}:{status}")
        if mech != "kernel" and status == "ruleless":
            self.ruleless = True
        return name, family

    def _new_op(self, call: str, prefix: str, what: tuple[str, str, str]) -> str:
        self.n += 1
        name = f"{prefix}{self.n}"
        self.prologue.append(f"{name} = {call}")
        self.ops[name] = what
        return name

    def _reuse(self, call: str, name: str, what: tuple[str, str, str]) -> str:
        if name not in self.ops:
            self.prologue.append(f"{name} = {call}")
            self.ops[name] = what
        return name

    # expressions over two names (values, or a lambda's parameters) --------------------
    def param(self, base: str) -> str:
        """A fresh lambda parameter name (nested lambdas never shadow an outer one)."""
        self.lam += 1
        return f"{base}{self.lam}"

    def leaf(self, a: str, b: str, ctx: set[str], depth: int = 0, rank: int = 2) -> str:
        """An expression of ``a`` and ``b`` (same shape: a block of rank 2 or, under vmap /
        scan / lax.map, a row of rank 1), at nesting ``depth``: often a nested construct."""
        if depth < MAX_DEPTH and self.rng.random() < NEST[depth]:
            kinds = [k for k in NESTED if rank == 2 or k not in BLOCK_ONLY]
            return self.construct(self.rng.choice(kinds), a, b, ctx, depth + 1, rank)
        roll = self.rng.random()
        if roll < 0.3:
            return self.rng.choice([f"{a} + {b}", f"{a} * {b}", f"jnp.sin({a}) * {b}", f"{a} * 0.5 - {b}",
                                    f"jnp.tanh({a} + {b})"])
        if roll < 0.4:
            fn = self.rng.choice(["relu", "gelu", "softplus"])
            self.tags.append(f"jax.nn.{fn}")
            return self.rng.choice([f"jax.nn.{fn}({a}) * {b}", f"jax.nn.{fn}({a} - {b})"])
        if roll < 0.46:
            self.tags.append("custom_vjp")
            return f"cvjp_mulsin({a}, {b})" if FEATURES["jnp_custom_vjp"] else f"{a} * jnp.sin({b})"
        if roll < 0.52:
            self.tags.append("custom_jvp")
            return f"cjvp_sinmul({a}, {b})"
        if roll < 0.56 and rank == 2 and FEATURES["solve"]:  # a well-conditioned (R, R) system: 4 I + tanh(.) / 2
            self.tags.append("linalg.solve")
            return f"jnp.linalg.solve(jnp.eye({R}) * 4.0 + jnp.tanh({a}[:, :{R}]) * 0.5, {b})"
        name, family = self.op(ctx)
        args = [a] if FAMILIES[family] == 1 else [a, b]
        if "while" in ctx:  # no tangent reaches a while loop's body (its inputs are stop_gradient)
            return f"{name}({', '.join(args)})"
        if self.rng.random() < 0.7:
            self.tags.append("diff")
            return f"diff({name})({', '.join(args)})"
        self.tags.append("stop_gradient")
        return f"{name}({', '.join(f'sg({x})' for x in args)})"

    def predicate(self, names: list[str], kind: str, ctx: set[str] = frozenset()) -> str:
        """A cond predicate / switch index / loop bound: from axis_index, a value, or neither.
        Never axis_index inside a while loop's predicate (XLA:CPU aborts on a PartitionId in a
        loop's condition, JAX 0.5 - 0.9), nor inside a loop's body on JAX 0.6 - 0.7 (FEATURES)."""
        roll = self.rng.random()
        in_loop = bool(ctx & {"loop", "scan", "while", "map"})
        if roll < 0.4 and "while_pred" not in ctx and (FEATURES["axis_index_in_loops"] or not in_loop):
            axis = self.rng.choice(AXES)
            self.pred_axes.add(axis)
            self.tags.append(f"{kind}:axis_index")
            index = f'jax.lax.axis_index("{axis}")'
            return {"cond": f"{index} == {self.rng.randrange(SIZES[axis])}", "switch": f"{index} % 3",
                    "while": f"{index} + 1.0", "fori": f"{index} + 1"}[kind]
        if roll < 0.75:
            p = self.rng.choice(names)
            # A lambda's parameter stands for the statement's operands: the predicate reads them all.
            self.pred_names.append(p if p in self.vary else "*")
            self.tags.append(f"{kind}:value")
            if kind == "cond":
                return f"jnp.sum({p}) > 0.0"
            if kind == "switch":
                return f"jnp.abs(jnp.sum({p})).astype(jnp.int32) % 3"
            count = f"(jnp.abs(jnp.sum(sg({p}))) * 2.0).astype(jnp.int32) % 4"
            return count if kind == "fori" else f"{count} * 1.0"
        self.tags.append(f"{kind}:constant")
        return {"cond": "True", "switch": "1", "while": "2.0", "fori": "2"}[kind]

    def branch(self, a: str, b: str, ctx: set[str], depth: int = 0, rank: int = 2) -> str:
        """A cond / switch branch: often mixing in both values (times zero), so that branches
        agree on how they vary where JAX (0.8+) asks them to, rather than being refused."""
        expr = self.leaf(a, b, ctx, depth, rank)
        if self.rng.random() < 0.6:
            self.tags.append("branch:mixed")
            return f"{expr} + ({a} + {b}) * 0.0"
        return expr

    def construct(self, kind: str, a: str, b: str, ctx: set[str], depth: int, rank: int) -> str:
        """Control flow or a transformation of ``a`` and ``b`` at nesting ``depth`` (1: a
        statement's own), whose branches and bodies are expressions (:meth:`leaf`) again."""
        self.tags.append(kind)
        if depth > 1:
            self.tags += ["nested", f"depth:{depth}"]
        rng = self.rng
        if kind == "cond":
            self.loops.add("cond")
            pred = self.predicate([a, b], "cond", ctx)
            if rng.random() < 0.5:  # the branches close over the values
                return (f"jax.lax.cond({pred}, lambda: {self.branch(a, b, ctx, depth, rank)}, "
                        f"lambda: {self.branch(b, a, ctx, depth, rank)})")
            # The values as operands, the branches closing over them too.
            self.tags.append("cond:operands")
            p, q = self.param("p"), self.param("q")
            return (f"jax.lax.cond({pred}, lambda {p}, {q}: {self.branch(p, rng.choice([q, b]), ctx, depth, rank)}, "
                    f"lambda {p}, {q}: {self.branch(q, rng.choice([p, a]), ctx, depth, rank)}, {a}, {b})")
        if kind == "switch":
            self.loops.add("cond")
            index = self.predicate([a, b], "switch", ctx)
            branches = [self.branch(*rng.sample([a, b], 2), ctx, depth, rank) for _ in range(rng.randint(2, 3))]
            return f"jax.lax.switch({index}, [{', '.join(f'lambda: {br}' for br in branches)}])"
        if kind == "while":  # a trip count that may vary: no tangent reaches it
            self.loops.add("while")
            bound = self.predicate([a, b], "while", ctx)
            c = self.param("c")
            inner = ctx | {"while"}
            step = self.leaf(f"{c}[1]", f"sg({b})", inner, depth, rank)
            test = f"{c}[0] < {c}[2]"
            if rng.random() < 0.3:  # a construct inside the loop's predicate
                self.tags.append("while:predicate_construct")
                guard = self.leaf(f"{c}[1]", f"{c}[1]", inner | {"while_pred"}, depth, rank)
                test = f"({test}) & (jnp.sum({guard}) < 1e30)"
            init = self.carry_init(f"sg({a})", a)
            # The bound rides in the carry, computed before the loop, and the counter is a float
            # derived from the operand: XLA:CPU aborts on a PartitionId inside a loop's condition
            # (JAX 0.5 - 0.9), and JAX 0.4.28 cannot partition a loop whose carry mixes an
            # unsharded counter with manual values (both with checking off).
            return (f"jax.lax.while_loop(lambda {c}: {test}, lambda {c}: ({c}[0] + 1.0, {c}[1] * 0.5 + {step}, "
                    f"{c}[2]), (jnp.sum(sg({a})) * 0.0, {init}, jnp.sum(sg({a})) * 0.0 + {bound}))[1]")
        if kind == "fori_dynamic":  # fori_loop with a traced bound: a while_loop, no tangent
            self.loops.add("while")
            bound = self.predicate([a, b], "fori", ctx)
            i, c = self.param("i"), self.param("c")
            step = self.leaf(c, f"sg({b})", ctx | {"while"}, depth, rank)
            init = self.carry_init(f"sg({a})", a)
            # Both bounds derived from the operand, as the while's counter is (GSPMD, JAX <= 0.6,
            # cannot partition a PartitionId in a loop whose counter is not a manual value).
            zero = f"(jnp.sum(sg({a})) * 0.0).astype(jnp.int32)"
            return f"jax.lax.fori_loop({zero}, {zero} + {bound}, lambda {i}, {c}: {c} * 0.5 + {step}, {init})"
        if kind == "fori":  # static bounds: a scan, differentiable
            i, c = self.param("i"), self.param("c")
            step = self.leaf(c, b, ctx | {"loop"}, depth, rank)
            return (f"jax.lax.fori_loop(0, {rng.randint(1, 3)}, lambda {i}, {c}: {c} * 0.5 + {step}, "
                    f"{self.carry_init(a, a)})")
        if kind == "scan":
            c, r = self.param("c"), self.param("r")
            step = self.leaf(f"{r}[0]", rng.choice([f"{r}[1]", c]), ctx | {"scan"}, depth, 1)
            init = rng.choice([f"jnp.zeros({a}.shape[1:])", f"{a}[0] * 0.0"])
            if init.startswith("jnp.zeros"):
                self.tags.append("carry:zeros")
            return f"jax.lax.scan(lambda {c}, {r}: ({c} * 0.5 + {step}, {c} + {r}[0]), {init}, ({a}, {b}))[1]"
        if kind == "map":
            r = self.param("r")
            return f"jax.lax.map(lambda {r}: {self.leaf(f'{r}[0]', f'{r}[1]', ctx | {'map'}, depth, 1)}, ({a}, {b}))"
        if kind == "vmap":
            p, q = self.param("p"), self.param("q")
            return f"jax.vmap(lambda {p}, {q}: {self.leaf(p, q, ctx | {'vmap'}, depth, 1)})({a}, {b})"
        fn = {"jit": "jax.jit", "checkpoint": "jax.checkpoint"}[kind]
        p, q = self.param("p"), self.param("q")
        return f"{fn}(lambda {p}, {q}: {self.leaf(p, q, ctx, depth, rank)})({a}, {b})"

    def carry_init(self, value: str, like: str) -> str:
        """A loop's initial carry: ``value``, or zeros (replicated) that accumulate."""
        if self.rng.random() < 0.5:
            self.tags.append("carry:zeros")
            return f"jnp.zeros({like}.shape)"
        return value

    # statements -------------------------------------------------------------------
    def statement(self, kind: str | None = None, of: str | None = None) -> None:
        self.tags, self.ruleless, self.pred_names, self.pred_axes, self.loops = [], False, [], set(), set()
        self.adds = set()
        removes: frozenset[str] = frozenset()
        a, b = of or self.pick(), self.pick()
        kind = kind or self.rng.choices(list(STATEMENTS), list(STATEMENTS.values()))[0]
        if kind == "leaf":
            self.tags.append(kind)
            text = self.leaf(a, b, set())
        elif kind in NESTED:
            text = self.construct(kind, a, b, set(), 1, 2)
        elif kind == "collective":
            self.tags.append(kind)
            b = a
            vary = sorted(self.vary[a])
            if vary and self.rng.random() < 0.8:  # over axes it varies over: JAX (0.10+) types the others apart
                over = _ordered(self.rng.sample(vary, self.rng.randint(1, len(vary))))
            else:
                over = _ordered(self.rng.choice([("data",), ("model",), ("data", "model")]))
            removes = frozenset(over)
            text = f"jax.lax.{self.rng.choice(['psum', 'psum', 'pmean'])}({a}, {_axes_text(over)})"
        else:  # axis_index arithmetic
            self.tags.append(kind)
            b = a
            axis = self.rng.choice(AXES)
            self.adds.add(axis)
            text = f'{a} * (1.0 + jax.lax.axis_index("{axis}"))'
        operands = list(dict.fromkeys([a, b] + [p for p in self.pred_names if p != "*"]))
        preds = set(range(len(operands))) if "*" in self.pred_names else {operands.index(p) for p in self.pred_names}
        self.n += 1
        var = f"v{self.n}"
        self.stmts.append(Stmt(
            var, text, operands, adds=frozenset(self.adds), removes=removes, constructs=tuple(self.tags),
            pred_operands=tuple(sorted(preds)), pred_axes=frozenset(self.pred_axes),
            loops=tuple(sorted(self.loops)), opaque_ruleless=self.ruleless))
        self.vary[var] = (frozenset().union(*(self.vary[o] for o in operands)) | self.adds
                          | frozenset(self.pred_axes)) - removes
        self.names.append(var)


def generate(seed: int, index: int) -> Program:
    """The program number ``index`` of the run ``seed``."""
    rng = random.Random(f"{seed}:{index}")
    mode = rng.choices(["default", "infer", "no_infer"], [6, 3, 1])[0]
    n_in = rng.randint(2, 3)
    inputs = [("data",), ()] + [rng.choice(SPECS) for _ in range(n_in - 2)]
    if rng.random() < 0.3:
        inputs[0] = rng.choice(SPECS)
    rng.shuffle(inputs)
    w = _Writer(rng, inputs)
    for _ in range(rng.randint(2, 3)):
        w.statement()
    if rng.random() < 0.5:  # often ends in a reduction: outputs typed replicated, the known bugs' ground
        w.statement("collective", of=w.names[-1])
    outputs = [w.stmts[-1].var]
    if rng.random() < 0.3:
        other = rng.choice(w.names)
        if other not in outputs:
            outputs.append(other)
    out_specs = []
    for out in outputs:
        vary = w.vary[out]
        roll = rng.random()
        if roll < 0.25 and vary:  # claims replication over an axis the value may vary over
            drop = rng.choice(sorted(vary))
            out_specs.append(_ordered(vary - {drop}))
        elif roll < 0.35 and len(vary) < 2:  # claims less replication than it has
            out_specs.append(_ordered(vary | {rng.choice([a for a in AXES if a not in vary])}))
        else:
            out_specs.append(_ordered(vary))
    return Program(seed, index, mode, w.prologue, inputs, w.stmts, outputs, out_specs)


# -- the ops: real (opaque) and reference (jnp) ------------------------------------

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import reprules  # noqa: E402
from reprules import rules  # noqa: E402
from reprules.testing import cpu_kernels  # noqa: E402
from helpers import (  # noqa: E402  (tests/helpers.py: the StableHLO invariant, shared)
    assert_no_collective_under_varying_branch,
    collectives_under_branches,
    collectives_under_varying_branches,
)


def _features() -> dict[str, bool]:
    import inspect

    vma_0_6_to_0_7 = (0, 6) <= JAX_VERSION[:2] < (0, 8)  # where JAX's own limits below show
    return {
        "ffi": cpu_kernels.unavailable_reason() is None,  # JAX 0.4.31+ and a C++ compiler
        "vmap_method": "vmap_method" in inspect.signature(jax.pure_callback).parameters,  # 0.4.34+
        # JAX 0.6 - 0.7's own bug: the gradient of jnp.linalg.solve(replicated matrix, a value varying
        # over both axes) applies pvary to the already varying value, with JAX alone too (measured
        # on 0.6.2; 0.8.3 and 0.12.0.1 compute it). Where reprules types a value soundly as varying
        # that JAX alone types replicated, the program meets it: JAX's limit, not a false refusal.
        "solve": not vma_0_6_to_0_7,
        # JAX 0.6 - 0.7's XLA:CPU aborts ("Legacy XLA:CPU runtime does not support collective
        # execution", a PartitionId) on axis_index inside a loop's body in some nestings, with JAX
        # alone (measured on 0.6.2 and 0.7.2, checking off: a cond on axis_index in a static
        # fori_loop; axis_index in a lax.map inside one; seed 2812 program 291). 0.8+ runs them.
        "axis_index_in_loops": not vma_0_6_to_0_7,
        # JAX 0.6 - 0.7 check no custom_vjp bwd's output type: a pure-jnp custom_vjp on a replicated and
        # a varying operand returns the replicated one's cotangent unsummed, a gradient silently wrong
        # with JAX alone (measured on 0.6.2 without reprules: off by 3.6, seed 2812 program 482, the
        # operand made by a scan; 0.8+ refuses the bwd). reprules leaves a custom_vjp that involves no
        # kernel as JAX has it (the no-harm page), so the fuzzer writes its meaning there instead.
        "jnp_custom_vjp": not vma_0_6_to_0_7,
    }


FEATURES = _features()

_MEANING = {"copy": lambda x: x, "scale": lambda x: x * 2.0, "mul": lambda x, y: x * y}


def _kernel_body(family: str) -> Any:
    """A new kernel function (its own object: a rule registered on it is its own)."""
    if family == "copy":
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...]
    elif family == "scale":
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 2.0
    else:
        def kernel(x_ref, y_ref, o_ref):
            o_ref[...] = x_ref[...] * y_ref[...]
    return kernel


def _primitive(family: str) -> Any:
    """A user primitive whose abstract eval drops the varying axes, as third-party ones do."""
    from jax.core import ShapedArray
    from jax.extend.core import Primitive
    from jax.interpreters import batching, mlir

    fn = _MEANING[family]
    p = Primitive(f"fuzz_{family}")
    p.def_impl(fn)
    p.def_abstract_eval(lambda *avals: ShapedArray(avals[0].shape, avals[0].dtype))
    mlir.register_lowering(p, mlir.lower_fun(fn, multiple_results=False))

    def batch(args: Any, dims: Any) -> Any:
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        moved = [jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size, *a.shape))
                 for a, d in zip(args, dims)]
        return p.bind(*moved), 0

    batching.primitive_batchers[p] = batch
    return p


PRIMITIVES = {family: _primitive(family) for family in FAMILIES}


def _callback(family: str) -> Any:
    fn = _MEANING[family]

    def host(*args: Any) -> Any:
        return np.asarray(fn(*(np.asarray(a) for a in args)), np.float32)

    def call(*args: Any) -> Any:
        result = jax.ShapeDtypeStruct(jnp.broadcast_shapes(*(a.shape for a in args)), jnp.float32)
        if FEATURES["vmap_method"]:
            return jax.pure_callback(host, result, *args, vmap_method="broadcast_all")
        return jax.pure_callback(host, result, *args, vectorized=True)  # 0.4.28 - 0.4.33

    call.family = family
    return call


def _diff(op: Any) -> Any:
    """``op`` differentiable: a custom_vjp whose backward pass calls ``op`` again."""
    if FAMILIES[op.family] == 2:
        f = jax.custom_vjp(lambda x, y: op(x, y))
        f.defvjp(lambda x, y: (op(x, y), (x, y)), lambda res, g: (op(g, res[1]), op(g, res[0])))
    else:
        f = jax.custom_vjp(lambda x: op(x))
        f.defvjp(lambda x: (op(x), None), lambda _, g: (op(g),))
    return f


@jax.custom_vjp
def _cvjp_mulsin(a: Any, b: Any) -> Any:
    return a * jnp.sin(b)


_cvjp_mulsin.defvjp(lambda a, b: (a * jnp.sin(b), (a, b)),
                    lambda res, g: (g * jnp.sin(res[1]), g * res[0] * jnp.cos(res[1])))


@jax.custom_jvp
def _cjvp_sinmul(a: Any, b: Any) -> Any:
    return jnp.sin(a) * b


@_cjvp_sinmul.defjvp
def _cjvp_sinmul_jvp(primals: Any, tangents: Any) -> Any:
    (a, b), (ta, tb) = primals, tangents
    return jnp.sin(a) * b, jnp.cos(a) * b * ta + jnp.sin(a) * tb


class _ReferenceLax:
    """``jax.lax`` for the reference, with ``cond`` / ``switch`` as selects: their meaning,
    without JAX's batching of a cond (under the reference's vmap its predicate is batched),
    which on JAX <= 0.5 fails on a custom_vjp inside a branch under grad."""

    def __getattr__(self, name: str) -> Any:
        return getattr(jax.lax, name)

    @staticmethod
    def cond(pred: Any, true_fun: Any, false_fun: Any, *operands: Any) -> Any:
        return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), true_fun(*operands), false_fun(*operands))

    @staticmethod
    def switch(index: Any, branches: Any, *operands: Any) -> Any:
        index = jnp.clip(index, 0, len(branches) - 1)
        outs = [branch(*operands) for branch in branches]
        return jax.tree_util.tree_map(lambda *xs: jnp.select([index == k for k in range(len(xs))], xs), *outs)


class _ReferenceJax:
    lax = _ReferenceLax()

    @staticmethod
    def checkpoint(fun: Any, **_: Any) -> Any:
        """Its meaning: ``fun``. JAX 0.4.28's batching of a remat holding ``axis_index``
        under the reference's two vmaps leaks a tracer (measured, seed 12 program 18)."""
        return fun

    def __getattr__(self, name: str) -> Any:
        return getattr(jax, name)


class Namespace(dict):
    """What a program's source runs in: the real ops (registering the rules it declares,
    undone by ``close``) or their jnp meaning (``real=False``)."""

    def __init__(self, real: bool):
        super().__init__(jax=jax, jnp=jnp, P=P, sg=jax.lax.stop_gradient, cvjp_mulsin=_cvjp_mulsin,
                         cjvp_sinmul=_cjvp_sinmul)
        self.real = real
        if not real:
            self["jax"] = _ReferenceJax()
        self.registered: list[Any] = []
        self.update(kernel_op=self.kernel_op, prim_op=self.prim_op, ffi_op=self.ffi_op,
                    callback_op=self.callback_op, diff=_diff if real else (lambda op: op))

    def _meaning(self, family: str) -> Any:
        fn = _MEANING[family]
        call = (lambda x: fn(x)) if FAMILIES[family] == 1 else (lambda x, y: fn(x, y))
        call.family = family
        return call

    def _declare(self, target: Any, status: str) -> None:
        if status == "declared":
            reprules.replication_rule(rules.same())(target)
            self.registered.append(target)

    def kernel_op(self, family: str, status: str) -> Any:
        if not self.real:
            return self._meaning(family)
        kernel = _kernel_body(family)
        self._declare(kernel, status)

        def call(*args: Any) -> Any:
            out = jax.ShapeDtypeStruct(args[0].shape, args[0].dtype)
            return pl.pallas_call(kernel, out_shape=out, interpret=True)(*args)

        call.family = family
        return call

    def prim_op(self, family: str, status: str) -> Any:
        if not self.real:
            return self._meaning(family)
        p = PRIMITIVES[family]
        self._declare(p, status)
        call = (lambda x: p.bind(x)) if FAMILIES[family] == 1 else (lambda x, y: p.bind(x, y))
        call.family = family
        return call

    def ffi_op(self, family: str, status: str) -> Any:
        if not self.real:
            return self._meaning(family)
        self._declare(reprules.ffi_target(f"reprules_{family}"), status)
        call = cpu_kernels.copy if family == "copy" else cpu_kernels.mul
        wrapped = (lambda x: call(x)) if family == "copy" else (lambda x, y: call(x, y))
        wrapped.family = family
        return wrapped

    def callback_op(self, family: str) -> Any:
        return _callback(family) if self.real else self._meaning(family)

    def close(self) -> None:
        for target in self.registered:
            reprules.unregister(target)
        self.registered.clear()


@contextlib.contextmanager
def namespace(program: Program, real: bool) -> Any:
    ns = Namespace(real)
    try:
        exec(compile(program.source, f"<fuzz program {program.seed}:{program.index}>", "exec"), ns)  # noqa: S102
        yield ns
    finally:
        ns.close()


# -- running one program ------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    refused: str | None = None  # who refused with checking on, and why (first line)
    refused_by: str | None = None  # "reprules" or "jax"
    counterexamples: list[str] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)  # the program itself is at fault, or a raw error
    off_wrong: list[str] = dataclasses.field(default_factory=list)  # checking off differs from the reference


def make_mesh() -> Any:
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), AXES)


def _global_shape(axes: tuple[str, ...]) -> tuple[int, int]:
    return (R * int(np.prod([SIZES[a] for a in axes])), C)


def inputs_for(program: Program) -> tuple[list[Any], list[Any]]:
    """Global inputs (every device's block differs) and the outputs' cotangents."""
    rng = np.random.default_rng([program.seed, program.index])
    xs = [rng.standard_normal(_global_shape(a)).astype(np.float32) for a in program.inputs]
    ts = [rng.standard_normal(_global_shape(a)).astype(np.float32) for a in program.out_specs]
    return xs, ts


def _per_device_in(x: Any, axes: tuple[str, ...]) -> Any:
    if axes == ("data", "model"):
        return x.reshape(4, 2, R, C)
    return x.reshape(SIZES[axes[0]], R, C) if axes else x


def _assemble(y: Any, axes: tuple[str, ...]) -> Any:
    """The global output from every device's block (4, 2, ...): blocks along the
    sharded axes, the mean along the others (the value itself, where replicated)."""
    if axes == ("data", "model"):
        return y.reshape(8 * R, *y.shape[3:])
    if axes == ("data",):
        return y.mean(1).reshape(4 * R, *y.shape[3:])
    if axes == ("model",):
        return y.mean(0).reshape(2 * R, *y.shape[3:])
    return y.mean((0, 1))


def reference(program: Program, body: Any, xs: list[Any], ts: list[Any]) -> tuple[list[Any], list[Any], list[Any]]:
    """Outputs, gradients and every device's outputs (4, 2, R, C) of the jnp program,
    one vmap element per device over the named axes, unsharded."""
    inner_axes = [0 if "model" in a else None for a in program.inputs]
    outer_axes = [0 if "data" in a else None for a in program.inputs]

    def per_device(*xs: Any) -> Any:
        locals_ = [_per_device_in(x, a) for x, a in zip(xs, program.inputs)]
        inner = jax.vmap(lambda *a: tuple(body(*a)), in_axes=inner_axes, out_axes=0, axis_name="model",
                         axis_size=2)
        outer = jax.vmap(inner, in_axes=outer_axes, out_axes=0, axis_name="data", axis_size=4)
        outs = outer(*locals_)
        outs = tuple(jnp.broadcast_to(o, (4, 2, R, C)) for o in outs)
        return tuple(_assemble(o, a) for o, a in zip(outs, program.out_specs)), outs

    def run(*xs: Any) -> Any:
        outs, pull, devices = jax.vjp(per_device, *xs, has_aux=True)
        return outs, pull(tuple(ts)), devices

    outs, grads, devices = jax.jit(run)(*xs)
    return list(outs), list(grads), list(devices)


def _spec(axes: tuple[str, ...]) -> Any:
    return P(axes if len(axes) > 1 else axes[0]) if axes else P()


def shard_map_for(program: Program, body: Any, mesh: Any, check: bool) -> Any:
    from reprules.testing import shard_map

    return shard_map(lambda *a: tuple(body(*a)), mesh, tuple(_spec(a) for a in program.inputs),
                     tuple(_spec(a) for a in program.out_specs), check=check)


def _sharded(program: Program, body: Any, mesh: Any, ts: list[Any], check: bool) -> Any:
    f = shard_map_for(program, body, mesh, check)

    def run(*xs: Any) -> Any:
        outs, pull = jax.vjp(f, *xs)
        return outs, pull(tuple(ts))

    return jax.jit(run)


def _mode(mode: str) -> Any:
    if mode == "infer":
        return reprules.inference()
    if mode == "no_infer":
        return reprules.inference(False)
    return contextlib.nullcontext()


def _close(got: Any, want: Any) -> bool:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = 1.0 + float(np.max(np.abs(want), initial=0.0))
    return got.shape == want.shape and bool(np.all(np.abs(got - want) <= 1e-4 * scale))


def _differs_across(y: np.ndarray, axis: str) -> bool:
    y = np.asarray(y, np.float64)
    first = y[:1] if axis == "data" else y[:, :1]
    scale = 1.0 + float(np.max(np.abs(y), initial=0.0))
    return bool(np.any(np.abs(y - first) > 1e-4 * scale))


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


SOUND_TYPES_OFF = "REPRULES_SOUND_TYPES=0"  # how the fuzzer models JAX alone: JAX's own typing of
# control flow and opaque calls (reprules' rules for kernels and targets still apply)


def _jax_alone(program: Program, body: Any, mesh: Any, xs: list[Any], ts: list[Any],
               steered: frozenset[str]) -> Any:
    """The forward outputs of the program (forward and backward passes, as checking on runs
    it) with reprules' sound types off, or None where that refuses it or would put a collective
    inside a branch devices take apart (then it is not run)."""
    name, value = SOUND_TYPES_OFF.split("=")
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        with _mode(program.mode):
            lowered = _sharded(program, body, mesh, ts, check=True).lower(*xs)
    except Exception:
        return None
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
    if collectives_under_varying_branches(lowered.as_text(), steered):
        return None
    try:
        return lowered.compile()(*xs)[0]
    except Exception:
        return None


def check(program: Program, mesh: Any, thorough: bool = False) -> Outcome:
    """Runs ``program`` three ways and compares (see the module's docstring).

    Checking on is traced first: a program it refuses is not run (``thorough``:
    its reference and checking off still are, to check the generator). The
    ``ReplicationWarning`` of a rule-less op reprules typed soundly is expected
    here, never a refusal (pytest's ``filterwarnings = error`` would make it one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", reprules.ReplicationWarning)
        return _check(program, mesh, thorough)


def _check(program: Program, mesh: Any, thorough: bool) -> Outcome:
    out = Outcome()
    xs, ts = inputs_for(program)
    with namespace(program, real=True) as ns:
        body = ns["body"]
        try:
            with _mode(program.mode):
                on = _sharded(program, body, mesh, ts, check=True).lower(*xs)
        except reprules.ReprulesError as err:
            out.refused, out.refused_by = _first_line(err), "reprules"
        except Exception as err:  # JAX refused while tracing or lowering
            out.refused, out.refused_by = _first_line(err), "jax"
        honest = program.honest()
        if out.refused is not None and not (thorough or honest):
            return out  # out_specs claim replication the generator's types say may be false: refusing is right
        try:
            with namespace(program, real=False) as reference_ns:
                want, want_grads, devices = reference(program, reference_ns["body"], xs, ts)
        except Exception as err:
            out.errors.append(f"the reference cannot run it: {_first_line(err)}")
            return out
        claims = []  # (output, axis): out_specs claims replication over an axis where the values differ
        vary = program.varying()
        for j, (axes, var) in enumerate(zip(program.out_specs, program.outputs)):
            for axis in AXES:
                if axis not in axes and _differs_across(devices[j], axis):
                    claims.append((j, axis))
                    if axis not in vary[var]:  # the generator's typing is unsound: its fault
                        out.errors.append(f"output {j} varies over {axis!r}, which the generator missed")
        if out.errors:
            return out
        for j, axis in claims:
            if out.refused is None:
                out.counterexamples.append(
                    f"output {j} ({program.outputs[j]}) differs across {axis!r}, yet checking on accepted "
                    f"out_specs {_spec_text(program.out_specs[j])} (it returns one device's value)")
        if claims and not thorough:  # gradients of nothing well defined: nothing more to compare
            return out
        steered = program.steering_axes()
        try:
            off = _sharded(program, body, mesh, ts, check=False).lower(*xs)
            if collectives_under_varying_branches(off.as_text(), steered):
                out.errors.append("checking off puts a collective inside a branch: the generator's fault")
                return out
            off_outs, off_grads = off.compile()(*xs)
        except Exception as err:
            out.errors.append(f"checking off cannot run it: {_first_line(err)}")
            return out
        if out.refused is not None:
            # A false refusal: checking off and the reference agree, the generator's types say
            # out_specs are honest, and JAX alone (reprules' sound types off) accepts the program
            # and computes its values right. Checking on must then run it, not refuse it.
            if not claims and honest and all(_close(off_outs[j], y) for j, y in enumerate(want)):
                alone = _jax_alone(program, body, mesh, xs, ts, steered)
                if alone is not None and all(_close(alone[j], y) for j, y in enumerate(want)):
                    out.counterexamples.append(
                        f"false refusal: checking on refused it ({out.refused_by}: {out.refused}), yet checking "
                        f"off and the reference agree and JAX alone ({SOUND_TYPES_OFF}) accepts it with the "
                        "right values")
            return out
        if claims:
            return out
        try:  # issue 45's invariant, on the forward and backward passes together
            assert_no_collective_under_varying_branch(on.as_text(), steered)
        except AssertionError as err:  # not run: it would hang
            out.counterexamples.append(f"checking on puts {err}")
            return out
        try:
            on_outs, on_grads = on.compile()(*xs)
        except reprules.ReprulesError as err:  # e.g. REPRULES_VERIFY=1: a kernel broke its rule
            out.refused, out.refused_by = _first_line(err), "reprules"
            return out
        except Exception as err:
            out.errors.append(f"checking on accepted it, then raised {_first_line(err)}")
            return out
    for j, y in enumerate(want):
        if not _close(off_outs[j], y):
            out.off_wrong.append(f"output {j} with checking off")
        if not _close(on_outs[j], y):
            out.counterexamples.append(f"output {j} ({program.outputs[j]}) differs from the reference")
    for i, g in enumerate(want_grads):
        if not _close(off_grads[i], g):
            out.off_wrong.append(f"gradient of x{i} with checking off")
        if not _close(on_grads[i], g):
            agrees = " (checking off agrees with the reference)" if _close(off_grads[i], g) else ""
            out.counterexamples.append(
                f"gradient of x{i} ({_spec_text(program.inputs[i])}) differs from the reference{agrees}: "
                f"max error {float(np.max(np.abs(np.asarray(on_grads[i]) - np.asarray(g)))):.3g}")
    return out


# -- minimizing a counterexample ------------------------------------------------------


def _drop(program: Program, k: int) -> Program | None:
    """``program`` without statement ``k``: its value replaced by its first operand."""
    stmt = program.stmts[k]
    old, new = stmt.var, stmt.operands[0]
    stmts = []
    for s in program.stmts[:k] + program.stmts[k + 1:]:
        ops = list(dict.fromkeys(new if o == old else o for o in s.operands))
        preds = tuple(ops.index(new if s.operands[i] == old else s.operands[i]) for i in s.pred_operands)
        stmts.append(dataclasses.replace(s, text=re.sub(rf"\b{old}\b", new, s.text), operands=ops,
                                         pred_operands=preds))
    outputs = [new if o == old else o for o in program.outputs]
    if len(set(outputs)) < len(outputs):
        return None
    return dataclasses.replace(program, stmts=stmts, outputs=outputs)


def _prune(program: Program) -> Program:
    """Drops statements and prologue ops nothing reads."""
    live = set(program.outputs)
    kept = []
    for s in reversed(program.stmts):
        if s.var in live:
            kept.append(s)
            live |= set(s.operands)
    kept.reverse()
    text = "\n".join(s.text for s in kept)
    prologue = [line for line in program.prologue if re.search(rf"\b{line.split(' = ')[0]}\b", text)]
    return dataclasses.replace(program, stmts=kept, prologue=prologue)


def minimize(program: Program, mesh: Any, budget: int = 60) -> Program:
    """A smaller program that still has a counterexample (greedy, at most ``budget`` checks)."""
    def kinds(found: list[str]) -> set[str]:  # "output", "gradient", "collective", "false": what went wrong
        return {c.split()[0] if not c.startswith("checking") else "collective" for c in found}

    def bad(p: Program) -> bool:
        nonlocal budget
        budget -= 1
        try:
            return bool(kinds(check(p, mesh).counterexamples) & wanted)
        except Exception:
            return False

    wanted = kinds(check(program, mesh).counterexamples)  # the same kind of counterexample, smaller
    pruned = _prune(program)  # rechecked like every other step: pruning alone may lose it
    if pruned != program and bad(pruned):
        program = pruned
    changed = True
    while changed and budget > 0:
        changed = False
        candidates = []
        for j in range(len(program.outputs)):  # fewer outputs
            if len(program.outputs) > 1:
                candidates.append(dataclasses.replace(
                    program, outputs=program.outputs[:j] + program.outputs[j + 1:],
                    out_specs=program.out_specs[:j] + program.out_specs[j + 1:]))
        for k in range(len(program.stmts)):  # fewer statements
            dropped = _drop(program, k)
            if dropped is not None:
                candidates.append(dropped)
        if program.mode != "default":
            candidates.append(dataclasses.replace(program, mode="default"))
        for candidate in candidates:
            candidate = _prune(candidate)
            if budget > 0 and bad(candidate):
                program, changed = candidate, True
                break
    return program


def classify(program: Program) -> str:
    """The known-bug class a counterexample belongs to, by the hazards of its program
    (minimized first, for a fair count): one of HAZARDS, "+"-joined, or "other"."""
    found = program.hazards()
    return "+".join(h for h in HAZARDS if h in found) or "other"


# -- a run ------------------------------------------------------------------------------


def run(seed: int, count: int, start: int = 0, out: Any = sys.stdout, shrink: bool = False,
        verbose: bool = False, thorough: bool = False) -> dict[str, Any]:
    """Checks ``count`` programs; prints each counterexample and error; returns counts."""
    mesh = make_mesh()
    counts: dict[str, Any] = {"programs": 0, "refused_reprules": 0, "refused_jax": 0, "accepted": 0,
                              "counterexamples": 0, "errors": 0, "off_wrong": 0, "classes": {}}
    for index in range(start, start + count):
        program = generate(seed, index)
        counts["programs"] += 1
        try:
            got = check(program, mesh, thorough=thorough)
        except Exception as err:  # a raw error in the harness: reported like a counterexample
            got = Outcome(errors=[f"raised {_first_line(err)}"])
        if got.errors:
            counts["errors"] += 1
            print(f"ERROR {got.errors}\n{program.describe()}", file=out)
            continue
        if verbose and got.refused:
            print(f"REFUSED [{index}] by {got.refused_by}: {got.refused}", file=out)
        counts["refused_reprules"] += got.refused_by == "reprules"
        counts["refused_jax"] += got.refused_by == "jax"
        counts["accepted"] += got.refused is None
        counts["off_wrong"] += bool(got.off_wrong)
        if got.counterexamples:
            counts["counterexamples"] += 1
            small = minimize(program, mesh) if shrink else program
            kind = classify(small)
            counts["classes"][kind] = counts["classes"].get(kind, 0) + 1
            shrunk = f"minimized to:\n{small.source}" if shrink else ""
            print(f"COUNTEREXAMPLE [{kind}] {got.counterexamples}\n{program.describe()}{shrunk}", file=out)
    return counts


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--minimize", action="store_true", help="shrink each counterexample before classifying it")
    parser.add_argument("--verbose", action="store_true", help="print every refusal too")
    parser.add_argument("--thorough", action="store_true",
                        help="run the reference and checking off of refused programs too (checks the generator)")
    options = parser.parse_args()
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        sys.exit("set XLA_FLAGS=--xla_force_host_platform_device_count=8 first")
    began = time.time()
    print(f"JAX {jax.__version__}, seed {options.seed}, programs {options.start}..{options.start + options.count - 1}")
    counts = run(options.seed, options.count, options.start, shrink=options.minimize, verbose=options.verbose,
                 thorough=options.thorough)
    print(f"{counts} in {time.time() - began:.0f} s")
