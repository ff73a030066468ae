"""A differential soundness fuzzer for ``reprules.inference()``.

It writes random Pallas kernels from a small grammar (local arithmetic, loads
with dynamic indices, ``pl.when`` / ``cond`` / ``fori_loop`` / ``while_loop``
with data-dependent bounds, scratch carried over grid steps,
``input_output_aliases``, scalar prefetch read *and written*, index maps that
read it, the TPU PRNG, ``pl.kernel`` with a captured ref), called as they are
or, from JAX 0.7, where code around the call hid the shard_map's manual axes
(``jax.sharding.use_abstract_mesh(AbstractMesh((), ()))``, as MaxText does on
CPU), then for each:

1. runs it inside ``shard_map`` with checking **off** on inputs that differ per
   device, and keeps every device's outputs;
2. asks JAX, with checking **on** under ``reprules.inference()``, which outputs
   are typed replicated over which mesh axis (an ``out_specs`` that claims
   replication over an axis is accepted only for such an output);
3. fails if an output typed replicated over an axis differs, bit for bit,
   across that axis, or if a refusal is anything but a reprules error.

The TPU's PRNG returns zeros in JAX's interpreters, so a CPU run cannot see
its values. A kernel that uses it is therefore run in a second form for its
values, where the generator is an explicit scratch ref that ``prng_seed``
writes and each draw reads and advances, starting from bits that differ per
device (what a core's generator holds at kernel entry). The typing is always
asked of the real kernel.

Kernels are Python source, so a counterexample prints as a program to paste
into a regression test. A long run by hand::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python tests/fuzz_kernels.py --count 5000 --seed 7
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import sys
import time
from typing import Any

R, C = 8, 128  # one block; kernels are cheap in the interpreter at this size
SHARDS = {(): 1, ("data",): 4, ("model",): 2, ("data", "model"): 8}
JAX_VERSION = tuple(int(re.match(r"\d*", p).group() or 0) for p in __import__("jax").__version__.split("."))


@dataclasses.dataclass
class Case:
    """One generated kernel: its source (real and, with the PRNG, emulated),
    the mesh axes of each input, and how many outputs it has."""

    seed: int
    index: int
    source: str  # defines `call(*inputs)` for the real kernel
    emulated: str | None  # the same with an explicit PRNG, for values; None: no PRNG
    in_axes: list[tuple[str, ...]]  # mesh axes each input is sharded over (leading dim)
    in_kinds: list[str]  # "f32" (G*R, C) block-mapped, "prefetch" int32 (S,)
    num_out: int
    uses_kernel: bool  # pl.kernel instead of pl.pallas_call
    hidden_mesh: bool = False  # called under an abstract mesh that names no manual axes

    def describe(self) -> str:
        site = ", called under use_abstract_mesh(AbstractMesh((), ()))" if self.hidden_mesh else ""
        return (f"fuzz case seed={self.seed} index={self.index} (JAX {'.'.join(map(str, JAX_VERSION))}), "
                f"inputs sharded over {self.in_axes}{site}\n{self.source}")


# -- the grammar ------------------------------------------------------------------


class _Writer:
    """Builds one kernel body as lines of Python, keeping the names in scope."""

    def __init__(self, rng: random.Random, *, grid: int, prefetch: bool, prng: bool, inputs: list[str],
                 outputs: list[str], aliased: set[int], writes_prefetch: bool = False):
        self.rng, self.grid, self.prefetch, self.prng = rng, grid, prefetch, prng
        self.writes_prefetch = writes_prefetch
        self.inputs, self.outputs, self.aliased = inputs, outputs, aliased
        self.lines: list[str] = []
        self.values: list[str] = []  # (R, C) float32 values in scope
        self.scalars: list[str] = ["i"]  # int32 scalars in scope
        self.n = 0
        self.indent = "    "

    def fresh(self, kind: str) -> str:
        self.n += 1
        return f"{kind}{self.n}"

    def emit(self, line: str) -> None:
        self.lines.append(self.indent + line)

    def value(self) -> str:
        if not self.values:
            self.load()
        return self.rng.choice(self.values)

    def scalar(self) -> str:
        return self.rng.choice(self.scalars)

    # statements ------------------------------------------------------------------
    def load(self) -> None:
        name, ref = self.fresh("v"), self.rng.choice(self.inputs)
        self.emit(f"{name} = {ref}[...]")
        self.values.append(name)

    def dynamic_load(self) -> None:
        name, ref, k = self.fresh("v"), self.rng.choice(self.inputs), self.scalar()
        self.emit(f"{name} = jnp.broadcast_to({ref}[pl.ds(jnp.abs({k}) % {R}, 1), :], ({R}, {C}))")
        self.values.append(name)

    def arith(self) -> None:
        a, b, name = self.value(), self.value(), self.fresh("v")
        expr = self.rng.choice([f"{a} + {b}", f"{a} * {b}", f"jnp.maximum({a}, {b})",
                                f"jnp.where({a} > {b}, {a}, {b})", f"jnp.sin({a}) + 1.0",
                                f"{a} * 0.0 + {self.rng.randint(1, 9)}.0",
                                f"jnp.roll({a}, 1, axis=0)", f"{a} + jnp.sum({b}, axis=0, keepdims=True)"])
        self.emit(f"{name} = {expr}")
        self.values.append(name)

    def scalar_of_value(self) -> None:
        a, name = self.value(), self.fresh("k")
        r, c = self.rng.randrange(R), self.rng.randrange(C)
        self.emit(f"{name} = (jnp.abs({a}[{r}, {c}]) * 7.0).astype(jnp.int32)")
        self.scalars.append(name)

    def scalar_arith(self) -> None:
        a, b, name = self.scalar(), self.scalar(), self.fresh("k")
        self.emit(f"{name} = {self.rng.choice([f'{a} + {b}', f'{a} * 3 + 1', f'jnp.maximum({a}, {b})'])}")
        self.scalars.append(name)

    def read_prefetch(self) -> None:
        name, j = self.fresh("k"), self.rng.choice(["0", "1", "i % 4"])
        self.emit(f"{name} = s_ref[{j}]")
        self.scalars.append(name)

    def write_prefetch(self) -> None:
        k = self.scalars[-1] if self.rng.random() < 0.5 else self.scalar()  # often one just made
        self.emit(f"s_ref[{self.rng.choice(['0', '1', 'i % 4'])}] = jnp.abs({k}) % {self.grid}")

    def scratch_write(self) -> None:
        self.emit(f"acc_ref[...] = {self.value()}")

    def scratch_read(self) -> None:
        name = self.fresh("v")
        self.emit(f"{name} = acc_ref[...]")
        self.values.append(name)

    def output_write(self) -> None:
        out = self.rng.choice(self.outputs)
        self.emit(f"{out}[...] = {self.value()}")

    def when(self) -> None:
        k, m = self.scalar(), self.rng.randint(2, 3)
        self.emit(f"@pl.when(jnp.abs({k}) % {m} == {self.rng.randrange(m)})")
        self.emit(f"def _when{self.n}():")
        saved = (self.indent, list(self.values), list(self.scalars))
        self.indent += "    "
        for _ in range(self.rng.randint(1, 2)):
            self.rng.choice(self.effects())()
        self.indent, self.values, self.scalars = saved

    def cond(self) -> None:
        k, a, b, name = self.scalar(), self.value(), self.value(), self.fresh("v")
        # Each branch mixes in the other's value: on JAX 0.8 - 0.9 a kernel body's values carry
        # their varying axes, and branches (and loop carries) must agree on them.
        self.emit(f"{name} = jax.lax.cond(jnp.abs({k}) % 2 == 0, lambda: {a} * 2.0 + {b} * 0.0, "
                  f"lambda: {b} + {a} * 0.0)")
        self.values.append(name)

    def fori(self) -> None:
        k, a, b, name = self.scalar(), self.value(), self.value(), self.fresh("v")
        # The loop-invariant value rides in the carry: JAX 0.7 - 0.8 type a kernel body's
        # closed-over values apart from its carries.
        self.emit(f"{name} = jax.lax.fori_loop(0, jnp.abs({k}) % 3, lambda j, c: (c[0] * 0.5 + c[1], c[1]), "
                  f"({a} + {b} * 0.0, {b} + {a} * 0.0))[0]")
        self.values.append(name)

    def while_loop(self) -> None:
        a, name = self.value(), self.fresh("v")
        self.emit(f"{name} = jax.lax.while_loop(lambda c: jnp.sum(c) < 50.0, lambda c: jnp.abs(c) + 1.0, {a})")
        self.values.append(name)

    def seed(self) -> None:
        self.emit(f"SEED({self.scalar()})")

    def draw(self) -> None:
        name = self.fresh("v")
        forms = [""] + (["stateful"] if FEATURES["stateful"] else [])
        forms += [f"key{self.scalar()}"] if FEATURES["pallas_key"] else []
        self.emit(f"{name} = DRAW({self.rng.choice(forms)})")
        self.values.append(name)

    def local_op(self) -> None:
        """One of Pallas' own local ops where this JAX has it (einshape, trace_value, run_state)."""
        a, k, name = self.value(), self.scalar(), self.fresh("v")
        ops = [f"{name} = pl.run_state(lambda r: r.__setitem__(Ellipsis, r[...] * 2.0))({a})"]
        if FEATURES["einshape"]:
            ops.append(f"{name} = pltpu.einshape('ab->ba', pltpu.einshape('ab->ba', {a}))")
        if FEATURES["trace_value"]:
            ops.append(f"pltpu.trace_value('k', {k})")
        line = self.rng.choice(ops)
        self.emit(line)
        if line.startswith(name):
            self.values.append(name)

    def effects(self) -> list[Any]:
        """The statements that may appear inside a ``pl.when``."""
        found = [self.scratch_write, self.output_write, self.arith]
        if self.writes_prefetch:
            found.append(self.write_prefetch)
        if self.prng:
            found += [self.seed, self.draw]
        return found

    def statement(self) -> None:
        choices = [self.load, self.dynamic_load, self.arith, self.arith, self.scalar_of_value,
                   self.scalar_arith, self.scratch_write, self.scratch_read, self.output_write,
                   self.when, self.cond]
        if FEATURES["loops"]:
            choices += [self.fori, self.while_loop]
        if FEATURES["run_state"]:
            choices.append(self.local_op)
        if self.prefetch:
            choices += [self.read_prefetch, self.read_prefetch]
        if self.writes_prefetch:
            choices += [self.write_prefetch, self.write_prefetch]
        if self.prng:
            choices += [self.seed, self.draw, self.draw]
        self.rng.choice(choices)()


def generate(seed: int, index: int) -> Case:
    """The kernel number ``index`` of the run ``seed`` (the same on every JAX)."""
    rng = random.Random(f"{seed}:{index}")
    if FEATURES["kernel"] and rng.random() < 0.2:
        case = _generate_kernel(rng, seed, index)
    else:
        case = _generate_pallas_call(rng, seed, index)
    # Drawn apart, so that the kernels of a seed are the same on every JAX.
    hidden = FEATURES["hidden_mesh"] and random.Random(f"{seed}:{index}:site").random() < 0.25
    return dataclasses.replace(case, hidden_mesh=hidden)


def call_site(case: Case, call: Any) -> Any:
    """``call`` as the case calls it: as it is, or under an abstract mesh with no axes."""
    if not case.hidden_mesh:
        return call

    def hidden(*args: Any) -> Any:
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            return call(*args)

    return hidden


def _axes(rng: random.Random) -> tuple[str, ...]:
    return rng.choice([(), ("data",), ("data",), ("model",), ("data", "model")])


def _render(lines: list[str], emulate: bool) -> list[str]:
    """The body with the PRNG statements written for the real kernel or the emulation."""
    out = []
    for line in lines:
        pad = line[:len(line) - len(line.lstrip())]
        code = line.strip()
        seed = re.fullmatch(r"SEED\((\w+)\)", code)
        draw = re.fullmatch(r"(\w+) = DRAW\((\w*)\)", code)
        if seed and not emulate:
            out.append(f"{pad}pltpu.prng_seed({seed[1]})")
        elif seed:
            out.append(f"{pad}st_ref[0] = {seed[1]}")
        elif draw and not emulate:
            form = draw[2] or "bits"
            if form == "stateful":
                out.append(f"{pad}{draw[1]} = pltpu.stateful_bits(({R}, {C})).astype(jnp.float32)")
            elif form.startswith("key"):  # jax.random.bits of a pallas_tpu key seeds, then draws
                k = form[3:]
                out.append(f"{pad}{draw[1]} = jax.random.bits(jax.random.key({k}, impl='pallas_tpu'), "
                           f"({R}, {C})).astype(jnp.float32)")
            else:
                out.append(f"{pad}{draw[1]} = pltpu.prng_random_bits(({R}, {C})).astype(jnp.float32)")
        elif draw:
            if draw[2].startswith("key"):
                out.append(f"{pad}st_ref[0] = {draw[2][3:]}")
            out.append(f"{pad}{draw[1]}_s = st_ref[0]")
            out.append(f"{pad}st_ref[0] = {draw[1]}_s * 1103515245 + 12345")
            out.append(f"{pad}{draw[1]} = (jax.lax.broadcasted_iota(jnp.int32, ({R}, {C}), 0) * 31 "
                       f"+ {draw[1]}_s).astype(jnp.float32)")
        else:
            out.append(line)
    return out


def _generate_pallas_call(rng: random.Random, seed: int, index: int) -> Case:
    grid = rng.randint(2, 4)
    n_in, n_out = rng.randint(1, 3), rng.randint(1, 2)
    prefetch = rng.random() < 0.5
    # A kernel that writes its prefetch refs keeps its output index maps off them: a
    # block placed by a value that changed mid-grid could be revisited, which JAX refuses.
    writes_prefetch = prefetch and rng.random() < 0.5
    prng = FEATURES["prng"] and rng.random() < 0.25
    inputs = [f"x{j}_ref" for j in range(n_in)]
    outputs = [f"o{j}_ref" for j in range(n_out)]
    aliased = {0} if rng.random() < 0.2 and (FEATURES["alias_with_prefetch"] or not prefetch) else set()
    w = _Writer(rng, grid=grid, prefetch=prefetch, prng=prng, inputs=inputs, outputs=outputs, aliased=aliased,
                writes_prefetch=writes_prefetch)
    w.emit("i = pl.program_id(0)")
    if writes_prefetch and rng.random() < 0.7:  # the pattern that escaped inference once
        w.scalar_of_value()
        w.write_prefetch()
    for _ in range(rng.randint(3, 9)):
        w.statement()
    for out in outputs:  # most kernels write every output at the end
        if not (int(out[1]) in aliased and rng.random() < 0.5) and rng.random() < 0.85:
            w.emit(f"{out}[...] = {w.value()}")

    def index_map(is_output: bool) -> str:
        if not prefetch or rng.random() < 0.5 or (is_output and writes_prefetch):
            return "lambda i, *s: (i, 0)"
        if is_output:  # a rotation: every block is still written once
            return f"lambda i, s: ((i + s[{rng.choice('01')}]) % G, 0)"
        j = rng.choice(["0", "1", "i % 4"])
        return f"lambda i, s: (s[{j}] % G, 0)"

    in_maps = [index_map(False) for _ in inputs]
    out_maps = [index_map(True) for _ in outputs]
    in_axes = ([rng.choice([(), (), ("data",)])] if prefetch else []) + [_axes(rng) for _ in inputs]
    in_kinds = (["prefetch"] if prefetch else []) + ["f32"] * n_in

    def source(emulate: bool) -> str:
        refs = (["s_ref"] if prefetch else []) + inputs + (["e_ref"] if emulate else []) + outputs
        refs += ["acc_ref"] + (["st_ref"] if emulate else [])
        maps = in_maps + (["lambda i, *s: (0, 0)"] if emulate else [])
        scratch = ["pltpu.VMEM((R, C), jnp.float32)"] + (["pltpu.SMEM((1,), jnp.int32)"] if emulate else [])
        args = (["s"] if prefetch else []) + [f"x{j}" for j in range(n_in)] + (["e"] if emulate else [])
        aliases = {int(prefetch): 0} if aliased else {}  # positions count the prefetch operand
        lines = [f"G = {grid}", f"def kernel({', '.join(refs)}):"]
        if emulate:  # at kernel entry the generator holds what differs per device
            lines += ["    @pl.when(pl.program_id(0) == 0)", "    def _():",
                      "        st_ref[0] = e_ref[0, 0].astype(jnp.int32)"]
        lines += _render(w.lines, emulate)
        lines += [
            f"def call({', '.join(args)}):",
            "    return pl.pallas_call(",
            "        kernel,",
            f"        out_shape=[{', '.join('jax.ShapeDtypeStruct((G * R, C), jnp.float32)' for _ in outputs)}],",
            f"        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch={int(prefetch)}, grid=(G,),",
            f"            in_specs=[{', '.join(f'pl.BlockSpec(block_shape=(R, C), index_map={m})' for m in maps)}],",
            f"            out_specs=[{', '.join(f'pl.BlockSpec(block_shape=(R, C), index_map={m})' for m in out_maps)}],",
            f"            scratch_shapes=[{', '.join(scratch)}]),",
            f"        input_output_aliases={aliases}, interpret=INTERPRET)({', '.join(args)})",
        ]
        return "\n".join(lines) + "\n"

    return Case(seed, index, source(False), source(True) if prng else None,
                in_axes, in_kinds, n_out, uses_kernel=False)


def _generate_kernel(rng: random.Random, seed: int, index: int) -> Case:
    """``pl.kernel`` on a one-core mesh: the body runs once, copies its inputs (and a
    captured ``jax.new_ref``) into VMEM by local DMAs, computes, and copies out."""
    n_in, n_out = rng.randint(1, 2), rng.randint(1, 2)
    vin = [f"x{j}v" for j in range(n_in)]
    vout = [f"o{j}v" for j in range(n_out)]
    w = _Writer(rng, grid=1, prefetch=False, prng=False, inputs=vin, outputs=vout, aliased=set())
    w.indent = " " * 12  # call > body > scoped
    w.emit("i = jnp.int32(0)")
    for j in range(n_in):
        w.emit(f"pltpu.sync_copy(x{j}_ref, x{j}v)")
    if FEATURES["new_ref"] and rng.random() < 0.7:
        w.emit("pltpu.sync_copy(w_ref, acc_ref)")  # a local DMA that only reads the captured ref
        w.emit("v0 = acc_ref[...]")
        w.values.append("v0")
    for _ in range(rng.randint(2, 7)):
        w.statement()
    for j, out in enumerate(vout):
        w.emit(f"{out}[...] = {w.value()}")
        w.emit(f"pltpu.sync_copy({out}, o{j}_ref)")
    args = [f"x{j}" for j in range(n_in)] + (["w"] if FEATURES["new_ref"] else [])
    refs = [f"x{j}_ref" for j in range(n_in)] + [f"o{j}_ref" for j in range(n_out)]
    lines = [f"def call({', '.join(args)}):"]
    if FEATURES["new_ref"]:
        lines.append("    w_ref = jax.new_ref(w)")
    scratch = ", ".join(["pltpu.VMEM((R, C), jnp.float32)"] * (n_in + n_out + 1))
    lines += [f"    def body({', '.join(refs)}):", f"        def scoped({', '.join(vin + vout)}, acc_ref):",
              *w.lines, f"        pl.run_scoped(scoped, {scratch})",
              f"    out_shape = [{', '.join('jax.ShapeDtypeStruct((R, C), jnp.float32)' for _ in vout)}]",
              "    return pl.kernel(body, out_shape, mesh=KERNEL_MESH, interpret=INTERPRET)"
              f"({', '.join(args[:n_in])})"]
    # The captured ref holds a replicated value: JAX refuses Refs that vary in a kernel.
    in_axes = [_axes(rng) for _ in args[:n_in]] + [()] * FEATURES["new_ref"]
    return Case(seed, index, "\n".join(lines) + "\n", None, in_axes, ["block"] * len(args), n_out,
                uses_kernel=True)


# -- running one case -------------------------------------------------------------

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def _features() -> dict[str, bool]:
    try:
        jax.random.key(0, impl="pallas_tpu")
        pallas_key = hasattr(pltpu, "prng_seed")
    except Exception:
        pallas_key = False
    return {
        "prng": hasattr(pltpu, "prng_seed"),
        "stateful": hasattr(pltpu, "stateful_bits"),
        "pallas_key": pallas_key,
        # pl.kernel over a TPU core mesh, interpreted on CPU: JAX 0.8+ (0.7 has pl.kernel,
        # but its core_map refuses interpretation inside shard_map).
        "kernel": hasattr(pl, "kernel") and JAX_VERSION >= (0, 8),
        "hidden_mesh": hasattr(jax.sharding, "use_abstract_mesh"),  # public from 0.7
        "new_ref": hasattr(jax, "new_ref") and JAX_VERSION >= (0, 8),
        # Loops that compute: not on JAX 0.7 - 0.8, which type a loop body inside a kernel
        # apart from its carries (`c[0] + c[1]` loses the carry's varying axes), so JAX's own
        # carry check refuses it under check_vma, with or without reprules.
        "loops": not ((0, 7) <= JAX_VERSION < (0, 9)),
        "run_state": hasattr(pl, "run_state") and JAX_VERSION >= (0, 9),
        "einshape": hasattr(pltpu, "einshape"),
        "trace_value": hasattr(pltpu, "trace_value") and JAX_VERSION >= (0, 12),  # before: no CPU lowering
        # JAX 0.6's TPU interpreter miscounts input_output_aliases past scalar prefetch
        # (IndexError in interpret_pallas_call, checking off): not reprules'.
        "alias_with_prefetch": not (hasattr(pltpu, "InterpretParams") and JAX_VERSION < (0, 7)),
    }


FEATURES = _features()
# TPU interpret mode where JAX has it (0.6+): it runs index maps on prefetch refs
# the body wrote, as a TPU does; the HLO interpreter before it.
INTERPRET: Any = pltpu.InterpretParams() if hasattr(pltpu, "InterpretParams") else True


def _namespace() -> dict[str, Any]:
    ns = {"jax": jax, "jnp": jnp, "pl": pl, "pltpu": pltpu, "R": R, "C": C, "INTERPRET": INTERPRET}
    if FEATURES["kernel"]:
        import warnings

        with warnings.catch_warnings():  # 0.12 deprecates it for pltpu.TensorCoreMesh, new there
            warnings.simplefilter("ignore", DeprecationWarning)
            ns["KERNEL_MESH"] = pltpu.create_tensorcore_mesh("core", num_cores=1)
    return ns


def compile_source(source: str) -> Any:
    ns = _namespace()
    exec(compile(source, "<fuzz kernel>", "exec"), ns)  # noqa: S102 - our own generated code
    return ns["call"]


@dataclasses.dataclass
class Outcome:
    refused: str | None  # the reprules error that refused the kernel, if it did
    replicated: dict[tuple[int, str], bool]  # (output, axis): typed replicated over it
    counterexamples: list[str]  # what differs although typed replicated


def inputs_for(case: Case, rng: np.random.Generator, emulate: bool) -> list[Any]:
    """Global arrays: each device's block differs from every other device's."""
    arrays = []
    for axes, kind in zip(case.in_axes, case.in_kinds):
        n = SHARDS[axes]
        if kind == "prefetch":
            arrays.append(jnp.asarray(rng.integers(0, 4, size=(4 * n,)), jnp.int32))
        else:
            rows = (R if case.uses_kernel else 4 * R) * n  # a grid of up to 4 blocks per device
            arrays.append(jnp.asarray(rng.standard_normal((rows, C)), jnp.float32))
    if emulate:  # what each device's generator holds at kernel entry
        arrays.append(jnp.asarray(rng.integers(1, 1 << 20, size=(8 * R, C)), jnp.float32))
    return arrays


def _specs(case: Case, emulate: bool) -> tuple[Any, ...]:
    specs = tuple(P(axes if len(axes) > 1 else axes[0]) if axes else P() for axes in case.in_axes)
    return specs + ((P(("data", "model")),) if emulate else ())


def _fit(case: Case, arrays: list[Any]) -> list[Any]:
    """Trims a pallas_call's f32 inputs to the kernel's grid (G blocks per device)."""
    grid = int(re.search(r"^G = (\d+)$", case.source, re.M)[1]) if not case.uses_kernel else 1
    fitted = []
    for a, axes, kind in zip(arrays, case.in_axes + [("data", "model")], case.in_kinds + ["f32"]):
        if kind == "f32" and not case.uses_kernel:
            n = SHARDS[axes]
            a = a.reshape(n, -1, C)[:, : grid * R].reshape(-1, C)
        fitted.append(a)
    return fitted


def per_device(case: Case, mesh: Any, arrays: list[Any], call: Any) -> list[np.ndarray]:
    """Each output's blocks, one per device (checking off), as uint32 bits, shape (4, 2, ...)."""
    from reprules.testing import shard_map

    emulate = case.emulated is not None
    if emulate:
        call = compile_source(case.emulated)
    stacked = P(("data", "model"))

    call = call_site(case, call)

    def body(*args: Any) -> Any:
        return [y[None] for y in call(*args)]

    f = shard_map(body, mesh, _specs(case, emulate), [stacked] * case.num_out, check=False)
    outs = jax.jit(f)(*arrays)
    return [np.asarray(y).view(np.uint32).reshape(4, 2, *y.shape[1:]) for y in outs]


def typing(case: Case, mesh: Any, arrays: list[Any], call: Any) -> tuple[str | None, dict[tuple[int, str], bool]]:
    """Whether reprules refused the kernel (its error), else per (output, axis)
    whether JAX, checking, accepts an ``out_specs`` that claims replication."""
    import reprules
    from reprules.testing import shard_map

    stacked = P(("data", "model"))
    call = call_site(case, call)

    def trace(out_specs: list[Any]) -> None:
        body = lambda *args: [y[None] for y in call(*args)]  # noqa: E731
        with reprules.inference():
            jax.make_jaxpr(shard_map(body, mesh, _specs(case, False), out_specs, check=True))(*arrays)

    try:
        trace([stacked] * case.num_out)
    except reprules.ReprulesError as err:
        return f"{type(err).__name__}: {err}", {}
    replicated = {}
    for j in range(case.num_out):
        for axis, other in (("data", "model"), ("model", "data")):
            specs = [stacked] * case.num_out
            specs[j] = P(other)
            try:
                trace(specs)
                replicated[j, axis] = True
            except Exception as err:  # JAX refuses a claim of replication it cannot prove
                if isinstance(err, reprules.ReprulesError) or not _is_out_specs_refusal(err):
                    raise
                replicated[j, axis] = False
    return None, replicated


def _is_out_specs_refusal(err: Exception) -> bool:
    text = str(err)
    return "out_specs" in text and ("replicat" in text or "vary" in text or "varying" in text)


def check(case: Case, mesh: Any, call: Any = None, values: bool = True) -> Outcome:
    """Runs ``case`` (or ``call``, the compiled form of its source) and compares;
    ``values=False``: the typing only (a kernel CPU cannot run, e.g. its real PRNG)."""
    call = compile_source(case.source) if call is None else call
    rng = np.random.default_rng([case.seed, case.index])
    full = inputs_for(case, rng, emulate=case.emulated is not None)
    real = _fit(case, full[: len(case.in_axes)])
    refused, replicated = typing(case, mesh, real, call)
    if refused is not None or not values:
        return Outcome(refused, replicated, [])
    blocks = per_device(case, mesh, _fit(case, full), call)
    wrong = []
    for (j, axis), is_replicated in replicated.items():
        if not is_replicated:
            continue
        v = blocks[j]
        same = (v == v[:, :1]).all() if axis == "model" else (v == v[:1]).all()
        if not same:
            wrong.append(f"output {j} is typed replicated over {axis!r} but differs across it")
    return Outcome(None, replicated, wrong)


def run(seed: int, count: int, start: int = 0, out: Any = sys.stdout) -> dict[str, int]:
    """Checks ``count`` cases; prints each counterexample; returns counts."""
    from reprules.testing import fake_cpu_devices  # noqa: F401 - the devices are set by the caller

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    counts = {"kernels": 0, "refused": 0, "typed_replicated": 0, "counterexamples": 0, "errors": 0}
    for index in range(start, start + count):
        case = generate(seed, index)
        counts["kernels"] += 1
        try:
            got = check(case, mesh)
        except Exception as err:  # a raw error: reported like a counterexample
            counts["errors"] += 1
            print(f"RAW ERROR {type(err).__name__}: {str(err)[:400]}\n{case.describe()}", file=out)
            continue
        counts["refused"] += got.refused is not None
        counts["typed_replicated"] += sum(got.replicated.values())
        if got.counterexamples:
            counts["counterexamples"] += 1
            print(f"COUNTEREXAMPLE {got.counterexamples}\n{case.describe()}", file=out)
    return counts


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--start", type=int, default=0)
    options = parser.parse_args()
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        sys.exit("set XLA_FLAGS=--xla_force_host_platform_device_count=8 first")
    began = time.time()
    print(f"JAX {jax.__version__}, seed {options.seed}, kernels {options.start}..{options.start + options.count - 1}")
    counts = run(options.seed, options.count, options.start)
    print(f"{counts} in {time.time() - began:.0f} s")
