"""Benchmark: collectives and step time, checking off vs reprules vs hand-annotated JAX.

On 8 fake CPU devices (a (4, 2) mesh ``("data", "model")``), in one run, for
each workload:

* ``activation``: an activation-heavy step built on reprules' opaque C++ FFI
  kernels (``reprules_mul``, ``reprules_mul_rowsum``): ``x`` on ``data``, a
  stack of row-scaling layers under ``custom_vjp``, each layer its own
  ``shard_map`` around the kernel call (as in JAX #21855). XLA cannot look
  inside the kernels, so with checking off the defensive all-reduce of each
  activation cotangent over ``model`` is really executed. Needs JAX >= 0.4.31.
* ``tp_mlp``: the tensor-parallel MLP step of ``reprules audit``, its matmuls
  done by a Pallas kernel (``interpret=True``).
* ``layer_norm``: JAX's own Pallas ``layer_norm`` op, ``x`` on ``data``.
* ``transformer`` / ``transformer_scan`` (not run by default: minutes of
  tracing and compiling on CPU): a decoder of 24 layers (``--layers``),
  unrolled or under ``jax.lax.scan`` (``reprules._demo.transformer``): Pallas matmul,
  layer norm and attention kernels, each under ``custom_vjp`` with Pallas fwd
  and bwd; heads and MLP on ``model``, batch on ``data``, a ``shard_map`` per
  sublayer. ``transformer_1sm`` / ``transformer_scan_1sm``: one ``shard_map``
  around all layers. Collectives inside the scan body are
  counted once per layer; the bytes are also checked against the formulas of
  ``reprules._demo.scale``. Their trace+lower takes seconds: ``--heavy-lower-repeats``
  rounds, best of 1.

and for each variant:

* ``off``: ``shard_map`` with checking off, no rules (what users do today);
* ``reprules``: rules registered (``rules.same()``, as reprules' own rule pack
  does for ``layer_norm``), checking on;
* ``hand``: checking on, no reprules, the call sites annotated by hand
  (``vma=`` / ``manual_axis_type=`` on the ``jax.ShapeDtypeStruct``, or
  ``jax.typeof(x)`` as the FFI result type, plus ``pvary``/``pcast`` casts).
  Possible on JAX >= 0.6 only, and only where the call site is the user's: not
  for ``layer_norm`` (its ``pallas_call``\\ s are inside JAX). Where JAX itself
  rejects the annotated call, the reason is recorded instead (with
  ``interpret=True``, JAX's HLO interpreter refuses varying outputs on every
  JAX >= 0.6: so for the Pallas workloads).
* ``inference``: checking on, no rules registered, traced under
  ``reprules.inference()`` (rule inference, issue 9); recorded as unavailable
  until reprules has it.

it measures the collective bytes per step (per device, from
``reprules.testing.collectives``: defensive vs needed, and the analytical
minimum of the needed bytes), the compiled memory analysis (temp, argument
and output bytes), the step time (rounds in which every variant
runs once, in a rotating order; reported as the median and interquartile
range of the per-round ratios between variants), and the trace+lower time
(``jax.jit(step).lower`` of a freshly built step, best of 3 per round after
one untimed, wall and CPU time of this process;
reprules with its rules registered, the other variants with nothing
registered, i.e. JAX unpatched; each round at its own Python stack depth, see
``STACK_OFFSETS``). It also measures ``import reprules`` on top
of ``import jax`` in fresh interpreters. It prints tables and writes JSON; it
reports against the targets of issue 5 but asserts nothing. Timings are only
as quiet as the machine: the load average is printed and recorded.

Run (8 fake CPU devices are set up by the script itself):

    python examples/benchmarks/bench.py --out bench.json
    python examples/benchmarks/bench.py --small --repeats 2 --lower-repeats 1 --lower-inner 1 --import-repeats 1
    python examples/benchmarks/bench.py --workloads transformer,transformer_scan --repeats 20
"""

from __future__ import annotations

from reprules import testing

testing.fake_cpu_devices(8)  # first thing: 8 fake CPU devices, before JAX starts

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import reprules  # noqa: E402
from reprules._demo import transformer as _model_helpers  # noqa: E402
from reprules import rules  # noqa: E402

VARIANTS = ("off", "reprules", "hand", "inference")
RATIOS = (("reprules", "off"), ("reprules", "hand"), ("inference", "off"), ("inference", "reprules"))
MESH_SHAPE, MESH_AXES = (4, 2), ("data", "model")
TARGETS = {"step_vs_off": 0.90, "step_vs_hand": 0.02, "lower_vs_hand": 0.05, "lower_vs_off": 1.03,
           "import_ms": 50.0}
TRANSFORMERS = ("transformer", "transformer_scan", "transformer_1sm", "transformer_scan_1sm")

# --- JAX version branches (public API only) -----------------------------------------------

HAND = _model_helpers.sds_keyword()  # ShapeDtypeStruct's manual_axis_type= (0.10+), vma= (0.6 - 0.9) or None
HAND_UNAVAILABLE = _model_helpers.hand_unavailable()


# The hand-annotated variants' helpers (JAX >= 0.6), shared with the transformer workload.
varying = _model_helpers._varying  # the mesh axes a value varies over
cast = _model_helpers._cast  # a value cast up to vary over more axes (its cotangent psummed over them)
psum_extra = _model_helpers._psum_extra  # a custom_vjp cotangent summed over the axes its primal lacks


def sds(shape: tuple[int, ...], dtype: Any, axes: frozenset[str]) -> jax.ShapeDtypeStruct:
    """An out_shape typed as varying over ``axes``: the hand annotation."""
    out: jax.ShapeDtypeStruct = _model_helpers._sds(shape, dtype, axes)
    return out


def randn(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> Any:
    return jnp.asarray(scale * np.random.RandomState(seed).randn(*shape), jnp.float32)


# --- workloads -----------------------------------------------------------------------------


@dataclasses.dataclass
class Workload:
    """One benchmark workload.

    ``build(variant)`` returns the step function (a fresh one each call);
    ``args(mesh)`` its arguments; ``targets()`` what reprules registers;
    ``minimum`` the analytical minimum of needed collective bytes per step.
    """

    name: str
    title: str
    build: Callable[[Any, str], Callable[..., Any]]
    args: Callable[[Any], tuple[Any, ...]]
    targets: Callable[[], Sequence[Any]]
    minimum: int
    minimum_text: str
    unavailable: Callable[[], str | None] = lambda: None
    hand_unavailable: Callable[[], str | None] = lambda: HAND_UNAVAILABLE
    heavy: bool = False  # trace+lower takes seconds: fewer rounds (--heavy-lower-repeats), best of 1
    repeat: Callable[[Any], int] | None = None  # times a collective runs per step (scan bodies: L)
    expected: Any = None  # reprules._demo.scale.Bytes: the formulas' figures, checked against the measured ones
    reference: Callable[[], Any] | None = None  # the unsharded result of the step (gradients)


# 1. activation-heavy, opaque FFI kernels


def _ffi_call(target: str, result: Any, *args: Any) -> Any:
    ffi = getattr(jax, "ffi", None)
    if ffi is None or not hasattr(ffi, "ffi_call"):  # 0.4.31 - 0.4.38
        from jax.extend import ffi
    return ffi.ffi_call(target, result)(*args)


def activation_workload(small: bool) -> Workload:
    from reprules import _cpu_kernels as cpu_kernels  # reprules' own opaque C++ kernels

    batch, d, layers = (64, 128, 2) if small else (4096, 1024, 2)

    def build(mesh: Any, variant: str) -> Callable[..., Any]:
        if variant == "hand":  # result types carry the varying axes: jax.typeof(...)
            cpu_kernels.load()

            def mul(x: Any, w: Any) -> Any:
                return _ffi_call("reprules_mul", jax.typeof(x), x, w)

            def mul_rowsum(g: Any, x: Any, w: Any) -> Any:
                return _ffi_call("reprules_mul_rowsum", jax.typeof(w), g, x)
        else:
            mul = cpu_kernels.mul

            def mul_rowsum(g: Any, x: Any, w: Any) -> Any:
                return cpu_kernels.mul_rowsum(g, x, w.shape)

        @jax.custom_vjp
        def layer(x: Any, w: Any) -> Any:
            return mul(x, w)

        layer.defvjp(lambda x, w: (mul(x, w), (x, w)),
                     lambda res, g: (mul(g, res[1]), mul_rowsum(g, res[0], res[1])))

        def body(x: Any, w: Any) -> Any:
            if variant == "hand":
                w = cast(w, varying(x))  # by hand: w's gradient is psummed over `data`
            return layer(x, w)

        # Each layer is its own shard_map around the kernel call, as in JAX #21855.
        f = testing.shard_map(body, mesh, (P("data", None), P()), P("data", None), variant != "off")

        def loss(x: Any, ws: Any, t: Any) -> Any:
            for w in ws:
                x = f(x, w)
            return (x * t).sum()

        return jax.grad(loss, argnums=(0, 1))

    def args(mesh: Any) -> tuple[Any, ...]:
        put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
        ws = tuple(put(1.0 + 0.1 * randn(2 + i, (d,)), P()) for i in range(layers))
        return put(randn(0, (batch, d)), P("data", None)), ws, put(randn(1, (batch, d)), P("data", None))

    return Workload(
        name="activation",
        title=f"activation-heavy, FFI kernels: x ({batch}, {d}) on data, {layers} layers, a shard_map each",
        build=build, args=args,
        targets=lambda: [reprules.ffi_target("reprules_mul"), reprules.ffi_target("reprules_mul_rowsum")],
        minimum=layers * d * 4, minimum_text=f"{layers} weight gradients ({d} f32) over data",
        unavailable=cpu_kernels.unavailable_reason)


# 2. tensor-parallel MLP, Pallas matmul


def matmul_kernel(a_ref: Any, b_ref: Any, o_ref: Any) -> None:
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)


def tp_mlp_workload(small: bool) -> Workload:
    batch, d, h = (16, 32, 64) if small else (256, 256, 512)

    def build(mesh: Any, variant: str) -> Callable[..., Any]:
        hand = variant == "hand"

        def matmul(a: Any, b: Any) -> Any:
            shape = (a.shape[0], b.shape[1])
            if hand:  # by hand: cast both up to the union, type the output as varying over it
                axes = varying(a) | varying(b)
                a, b = cast(a, axes), cast(b, axes)
                out = sds(shape, jnp.float32, axes)
            else:
                out = jax.ShapeDtypeStruct(shape, jnp.float32)
            return pl.pallas_call(matmul_kernel, out_shape=out, interpret=True)(a, b)

        @jax.custom_vjp
        def mm(a: Any, b: Any) -> Any:
            return matmul(a, b)

        def bwd(res: Any, g: Any) -> Any:
            a, b = res
            da, db = matmul(g, b.T), matmul(a.T, g)
            if hand:  # by hand: a custom_vjp cotangent must vary like its primal
                da, db = psum_extra(da, varying(a)), psum_extra(db, varying(b))
            return da, db

        mm.defvjp(lambda a, b: (matmul(a, b), (a, b)), bwd)

        def body(x: Any, w1: Any, w2: Any) -> Any:
            hidden = jax.nn.relu(mm(x, w1))  # columns of w1 on `model`
            return jax.lax.psum(mm(hidden, w2), "model")  # rows of w2 on `model`: partial sums

        f = testing.shard_map(body, mesh, (P("data", None), P(None, "model"), P("model", None)), P("data", None),
                              variant != "off")

        def loss(w1: Any, w2: Any, x: Any, t: Any) -> Any:
            return jnp.mean((f(x, w1, w2) - t) ** 2)

        return jax.grad(loss, argnums=(0, 1, 2))

    def args(mesh: Any) -> tuple[Any, ...]:
        put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
        return (put(randn(11, (d, h), 0.1), P(None, "model")), put(randn(12, (h, d), 0.1), P("model", None)),
                put(randn(10, (batch, d)), P("data", None)), put(randn(13, (batch, d)), P("data", None)))

    rows = batch // MESH_SHAPE[0]
    return Workload(
        name="tp_mlp", title=f"tensor-parallel MLP, Pallas matmul: batch {batch}, d {d}, h {h}",
        build=build, args=args, targets=lambda: [matmul_kernel],
        minimum=4 * (2 * rows * d + 2 * d * (h // MESH_SHAPE[1])),
        minimum_text="output and x-gradient over model, w1/w2 gradients over data")


# 3. JAX's Pallas layer_norm


def layer_norm_module() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 0.12: "use tokamax.layer_norm"
        try:
            from jax.experimental.pallas.ops.gpu import layer_norm  # 0.4.31+
        except ImportError:
            from jax.experimental.pallas.ops import layer_norm  # 0.4.28 - 0.4.30
    return layer_norm


def layer_norm_workload(small: bool) -> Workload:
    shape = (8, 4, 128) if small else (16, 16, 256)
    ln = layer_norm_module()

    def build(mesh: Any, variant: str) -> Callable[..., Any]:
        def body(x: Any, w: Any, b: Any) -> Any:
            return ln.layer_norm(x, w, b, interpret=True)

        f = testing.shard_map(body, mesh, (P("data", None, None), P(), P()), P("data", None, None), variant != "off")

        def loss(x: Any, w: Any, b: Any, t: Any) -> Any:
            return (f(x, w, b) * t).sum()

        return jax.grad(loss, argnums=(0, 1, 2))

    def args(mesh: Any) -> tuple[Any, ...]:
        put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
        d = shape[-1]
        return (put(randn(20, shape), P("data", None, None)), put(1.0 + randn(21, (d,), 0.1), P()),
                put(randn(22, (d,), 0.1), P()), put(randn(23, shape), P("data", None, None)))

    return Workload(
        name="layer_norm", title=f"JAX's Pallas layer_norm (interpret=True): x {shape} on data",
        build=build, args=args,
        targets=lambda: [ln.layer_norm_forward_kernel, ln.layer_norm_backward_kernel_dx,
                         ln.layer_norm_backward_kernel_dw_db],
        minimum=2 * shape[-1] * 4, minimum_text="weight and bias gradients over data",
        hand_unavailable=lambda: HAND_UNAVAILABLE or (
            "the pallas_calls are inside JAX's layer_norm op: no call site to annotate"))


# 4. a decoder-only transformer: Pallas matmul, layer norm and attention kernels


def transformer_workload(small: bool, scan: bool = False, structure: str = "sublayer",
                         layers: int | None = None) -> Workload:
    """``reprules._demo.transformer``: L decoder layers (24; 2 with --small), heads and MLP on
    ``model``, batch on ``data``, every kernel under ``custom_vjp`` with Pallas fwd and bwd."""
    from reprules._demo import transformer as model

    cfg = model.Config(layers=layers or (2 if small else 24), scan=scan, shard_map=structure)
    expected = model.expected_bytes(cfg, dict(zip(MESH_AXES, MESH_SHAPE)))
    name = "transformer" + ("_scan" if scan else "") + ("" if structure == "sublayer" else "_1sm")

    def in_scan_body(c: Any) -> int:  # a collective inside the scan over layers runs L times a step
        return cfg.layers if "scan" in c.op_name.split("/") else 1

    return Workload(
        name=name, title=f"decoder: {cfg.describe()}",
        build=lambda mesh, variant: model.make_step(mesh, variant, cfg),
        args=lambda mesh: model.place(mesh, cfg), targets=model.kernels,
        minimum=expected.needed,
        minimum_text=(f"{4 * cfg.layers} activations over model (2 a layer forward, 2 backward), "
                      "every weight gradient over data"),
        hand_unavailable=model.hand_unavailable, heavy=True, repeat=in_scan_body if scan else None,
        expected=expected, reference=lambda: model.reference_grads(cfg))


# --- measuring ---------------------------------------------------------------------------------

# CPython 3.11+ keeps frames on a stack of 16 KiB chunks and frees a chunk as soon
# as the stack falls back below it: a call that JAX makes thousands of times while
# tracing, and that happens to cross a chunk boundary, maps and unmaps memory each
# time (a page fault each). Measured here, tp_mlp's trace+lower with checking off
# costs 1.0x to 1.5x depending only on how deep the program calls jax.jit, and
# reprules' few extra frames move where the boundaries fall. So the rounds cycle
# through 64 stack depths 256 bytes apart, one chunk in all (every variant of a round
# at the same one): the ratios are then those of a program calling jax.jit at an
# arbitrary depth. The faults change within 1 KiB of depth: with 16 depths 1 KiB
# apart, one lowering averaged 532 faults with checking off and 551 with reprules;
# with these 64, 605.0 and 604.8.
STACK_OFFSETS = 64
STACK_STEP_BYTES = 256


def _stack_padder(nbytes: int) -> Callable[[Callable[[], Any]], Any]:
    """``pad(fn)`` calls ``fn()`` from a frame holding about ``nbytes`` of local variables."""
    n = max(nbytes // 8, 1)  # one 8-byte slot per local variable
    names = ", ".join(f"_{i}" for i in range(n))
    namespace: dict[str, Any] = {}
    exec(f"def pad(fn):\n    {names}, = (None,) * {n}\n    return fn()\n", namespace)  # noqa: S102
    return namespace["pad"]  # type: ignore[no-any-return]


_PADDERS = [_stack_padder(i * STACK_STEP_BYTES) for i in range(STACK_OFFSETS)]


def inference_unavailable() -> str | None:
    if hasattr(reprules, "inference"):
        return None
    return "reprules.inference() is not in this reprules yet (rule inference, issue 9)"


@contextlib.contextmanager
def variant_scope(w: Workload, variant: str) -> Any:
    """What a variant traces under: reprules' rules registered, or rule inference on."""
    if variant == "reprules":
        register(w.targets())
    try:
        if variant == "inference":
            with reprules.inference():  # type: ignore[attr-defined]  # issue 9: not there yet
                yield
        else:
            yield
    finally:
        if variant == "reprules":
            unregister(w.targets())


def memory(compiled: Any) -> dict[str, int] | None:
    """The compiled step's memory analysis (bytes per device), where JAX reports one."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001: not every backend/version has it
        return None
    if m is None:
        return None
    fields = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "generated_code_size_in_bytes")
    out = {f.replace("_size_in_bytes", ""): int(getattr(m, f, 0) or 0) for f in fields}
    # JAX 0.4 on CPU: zero buffers (only the code size), i.e. not reported
    return out if out["temp"] or out["argument"] or out["output"] else None


def collective_summary(report: Any, repeat: Callable[[Any], int] | None) -> dict[str, Any]:
    """Counts and bytes per step: as compiled (``static``) and as executed (scan bodies x L);
    collectives only in the jaxpr (dead code XLA never sees) are left out."""
    times = repeat or (lambda c: 1)
    cs = [c for c in report.collectives if not c.dead]  # only in the jaxpr: dead code, never run
    executed = {
        "count": sum(times(c) for c in cs), "bytes": sum(c.bytes * times(c) for c in cs),
        "defensive_count": sum(times(c) for c in cs if c.defensive),
        "defensive_bytes": sum(c.bytes * times(c) for c in cs if c.defensive),
        "needed_bytes": sum(c.bytes * times(c) for c in cs if not c.defensive),
        # What each device sends (the report's cost model: ring algorithms over each group), a
        # collective defensive over some of its axes split into its needed and defensive parts.
        "sent_bytes": sum(c.sent_bytes // c.executions * times(c) for c in cs),
        "defensive_sent_bytes": sum(c.defensive_sent_bytes // c.executions * times(c) for c in cs),
        "needed_sent_bytes": sum(c.needed_sent_bytes // c.executions * times(c) for c in cs),
    }
    # The program's own all-reduces (traced and lowered), what reprules._demo.scale's formulas
    # count; the rest are XLA's (e.g. JAX 0.6's SPMD partitioner resharding around a scan).
    program = [c for c in cs if "jaxpr" in c.levels and "stablehlo" in c.levels]
    executed["program"] = {
        "count": sum(times(c) for c in program), "bytes": sum(c.bytes * times(c) for c in program),
        "defensive_bytes": sum(c.bytes * times(c) for c in program if c.defensive),
        "needed_bytes": sum(c.bytes * times(c) for c in program if not c.defensive),
    }
    executed["compiler_added_bytes"] = executed["bytes"] - executed["program"]["bytes"]
    static = {"count": len(cs), "bytes": sum(c.bytes for c in cs),
              "defensive_count": sum(1 for c in cs if c.defensive),
              "defensive_bytes": sum(c.bytes for c in cs if c.defensive),
              "needed_bytes": sum(c.bytes for c in cs if not c.defensive),
              "not_lowered": len(report.collectives) - len(cs)}
    return {**executed, "static": static, "lines": [c.describe() for c in cs]}


def register(targets: Sequence[Any]) -> None:
    for t in targets:
        reprules.replication_rule(rules.same())(t)


def unregister(targets: Sequence[Any]) -> None:
    for t in targets:
        reprules.unregister(t)


def clear_rules() -> None:
    """Removes every rule, also those a rule pack registered (JAX is then unpatched)."""
    for reg in list(reprules.registered().values()):
        kernel = reg.kernel()
        if kernel is not None:
            reprules.unregister(kernel)


def stats(values: Sequence[float]) -> dict[str, float]:
    a = np.asarray(values, np.float64)
    return {"median": float(np.median(a)), "p25": float(np.percentile(a, 25)), "p75": float(np.percentile(a, 75)),
            "min": float(a.min()), "max": float(a.max()), "n": int(a.size)}


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> dict[str, float]:
    return stats([a / b for a, b in zip(num, den)])


def first_lines(err: BaseException, n: int = 2) -> str:
    """The error's first ``n`` lines (what happened and why), whole: the report wraps them."""
    text = " ".join([line.strip() for line in str(err).splitlines() if line.strip()][:n])
    return f"{type(err).__name__}: {text}"


WIDTH = 100  # every line of the printed report fits these columns


def short_paths(text: str) -> str:
    """Installed files from their package's folder on (``jax/...``): a path is one word,
    which wrapping cannot break, and a virtual environment's prefix can be long."""
    return re.sub(r"\S*/site-packages/", "", text)


def say(text: str, indent: str = "", hang: str = "    ", file: Any = None) -> None:
    """Prints ``text`` wrapped to :data:`WIDTH` columns (never cut), continuation lines indented by ``hang``."""
    for line in short_paths(text).split("\n"):
        print(textwrap.fill(line, WIDTH, initial_indent=indent, subsequent_indent=indent + hang,
                            break_long_words=False, break_on_hyphens=False) or line, file=file)


def row(base: str, extra: str) -> None:
    """A table row, and its note after it where both fit, else on the lines below."""
    base, extra = short_paths(base), short_paths(extra)
    if len(base) + len(extra) <= WIDTH:
        print(base + extra)
    else:
        print(base)
        say(extra.strip(), indent=" " * 20, hang="  ")


@contextlib.contextmanager
def no_gc() -> Any:
    """No garbage collection inside a timed region (as ``timeit`` does)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def rotations(names: Sequence[str], r: int) -> list[str]:
    k = r % len(names)
    return list(names[k:]) + list(names[:k])


def measure(w: Workload, mesh: Any, repeats: int, warmup: int, lower_repeats: int,
            lower_inner: int, heavy_lower_repeats: int) -> dict[str, Any]:
    result: dict[str, Any] = {"title": w.title, "minimum_needed_bytes": w.minimum, "minimum": w.minimum_text,
                              "unavailable": {}, "collectives": {}, "memory": {}}
    reason = w.unavailable()
    if reason:
        result["skipped"] = reason
        return result
    clear_rules()  # e.g. reprules' own pack registered layer_norm's kernels when JAX's op was imported
    args = w.args(mesh)
    variants = []
    for v in VARIANTS:
        why = {"hand": w.hand_unavailable, "inference": inference_unavailable}.get(v, lambda: None)()
        if why:
            result["unavailable"][v] = why
        else:
            variants.append(v)

    # Compile each variant; reprules' with its rules registered, the others with JAX unpatched.
    compiled: dict[str, Any] = {}
    for v in list(variants):
        try:
            with variant_scope(w, v):
                t0 = time.perf_counter()
                compiled[v] = jax.jit(w.build(mesh, v)).lower(*args).compile()
                result.setdefault("first_compile_s", {})[v] = time.perf_counter() - t0
                report = testing.collectives(w.build(mesh, v), *args)
        except Exception as err:  # noqa: BLE001: JAX rejects a hand-annotated call: record why
            if v not in ("hand", "inference"):
                raise
            who = "JAX rejects the hand-annotated call" if v == "hand" else "inference failed"
            result["unavailable"][v] = f"{who}: {first_lines(err)}"
            variants.remove(v)
            continue
        result["collectives"][v] = collective_summary(report, w.repeat)
        result["memory"][v] = memory(compiled[v])
    result["variants"] = variants
    if w.reference is not None:  # every variant's gradients against the unsharded reference
        want = jax.tree_util.tree_leaves(w.reference())
        result["max_error"] = {}
        for v in variants:
            got = jax.tree_util.tree_leaves(compiled[v](*args))
            result["max_error"][v] = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                                         for a, b in zip(got, want))
    if w.expected is not None:
        e = w.expected
        result["expected"] = {"needed": e.needed, "off": e.off, "model_extra": e.model_extra,
                              "flagged_defensive": e.flagged_defensive}

    # Step time: warm-up, then rounds in which every variant runs once, in a rotating order.
    for v in variants:
        for _ in range(warmup):
            jax.block_until_ready(compiled[v](*args))
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(repeats):
        for v in rotations(variants, r):
            with no_gc():
                t0 = time.perf_counter()
                jax.block_until_ready(compiled[v](*args))
                times[v].append(time.perf_counter() - t0)
    result["step_s"] = {v: stats(t) for v, t in times.items()}
    result["step_ratio"] = {f"{a}/{b}": paired_ratio(times[a], times[b]) for a, b in RATIOS
                            if a in variants and b in variants}

    # Trace+lower: a freshly built step each time (no jit cache hit), best of `lower_inner`
    # per round and variant; one warm-up round. Wall time and this process's CPU time
    # (less disturbed by other processes on a shared machine). Registering or removing
    # reprules' rules empties JAX's caches (kernel traces included), so each variant's
    # turn starts with one untimed trace+lower: every timed one then runs warm, whichever
    # variant ran before it (else reprules' rounds, which always follow a registration,
    # would be a best of 2 warm ones where checking off often gets a best of 3).
    if w.heavy:
        lower_repeats, lower_inner = min(lower_repeats, heavy_lower_repeats), 1
    result["lower_config"] = {"rounds": lower_repeats, "best_of": lower_inner, "warm_first": True,
                              "stack_offsets": STACK_OFFSETS, "stack_step_bytes": STACK_STEP_BYTES}
    lower: dict[str, list[float]] = {v: [] for v in variants}
    lower_cpu: dict[str, list[float]] = {v: [] for v in variants}
    depths: list[int] = []  # the stack offset of each timed round
    for r in range(lower_repeats + 1):
        offset = r % STACK_OFFSETS
        pad = _PADDERS[offset]
        if r:
            depths.append(offset)
        for v in rotations(variants, r):
            with variant_scope(w, v):
                warm = w.build(mesh, v)
                pad(lambda: jax.jit(warm).lower(*args))  # noqa: B023: called at once
                best = best_cpu = float("inf")
                for _ in range(lower_inner):
                    step = w.build(mesh, v)
                    with no_gc():
                        t0, c0 = time.perf_counter(), time.process_time()
                        pad(lambda: jax.jit(step).lower(*args))  # noqa: B023: called at once
                        best = min(best, time.perf_counter() - t0)
                        best_cpu = min(best_cpu, time.process_time() - c0)
            if r:
                lower[v].append(best)
                lower_cpu[v].append(best_cpu)
        gc.collect()
    result["lower_rounds_s"] = lower  # per timed round, for re-analysis (its stack offset: `depths`)
    result["lower_s"] = {v: stats(t) for v, t in lower.items()}
    result["lower_cpu_s"] = {v: stats(t) for v, t in lower_cpu.items()}
    result["lower_ratio"] = {f"{a}/{b}": paired_ratio(lower[a], lower[b]) for a, b in RATIOS
                             if a in variants and b in variants}
    result["lower_cpu_ratio"] = {f"{a}/{b}": paired_ratio(lower_cpu[a], lower_cpu[b]) for a, b in RATIOS
                                 if a in variants and b in variants}
    result["lower_ratio_by_depth"] = {f"{a}/{b}": ratio_by_depth(lower[a], lower[b], depths) for a, b in RATIOS
                                      if a in variants and b in variants}
    return result


def ratio_by_depth(num: Sequence[float], den: Sequence[float], depths: Sequence[int]) -> list[float]:
    """Per stack depth, the ratio of the median times of its rounds (the depth moves
    where CPython's frame chunks are mapped and unmapped: see STACK_OFFSETS)."""
    n, d, at = np.asarray(num), np.asarray(den), np.asarray(depths)
    return [float(np.median(n[at == k]) / np.median(d[at == k])) for k in sorted(set(depths))]


def import_time(repeats: int) -> dict[str, Any]:
    """``import reprules`` after ``import jax``, in fresh interpreters."""
    code = ("import time; t0 = time.perf_counter(); import jax; t1 = time.perf_counter(); import reprules; "
            "t2 = time.perf_counter(); print(t1 - t0, t2 - t1)")
    import tempfile

    jax_s, reprules_s = [], []
    # As installed: from bytecode (PYTHONDONTWRITEBYTECODE would compile every module
    # each time), kept out of the source tree; one unmeasured interpreter writes it.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONDONTWRITEBYTECODE")}
    env["PYTHONPYCACHEPREFIX"] = os.path.join(tempfile.gettempdir(), "reprules-bench-pycache")
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
        a, b = map(float, out.stdout.split())
        jax_s.append(a)
        reprules_s.append(b)
    return {"jax_s": stats(jax_s), "reprules_on_top_of_jax_s": stats(reprules_s)}


# --- report ------------------------------------------------------------------------------------


def fmt_ratio(s: dict[str, float] | None) -> str:
    if not s:
        return "n/a"
    return f"{s['median']:.2f} [{s['p25']:.2f}, {s['p75']:.2f}]"


def targets_summary(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    work = results["workloads"]
    measured = {n: r for n, r in work.items() if "skipped" not in r}
    defensive = {n: r["collectives"]["reprules"]["defensive_bytes"] for n, r in measured.items()}
    out.append({"target": "defensive bytes per step with reprules = 0 (every workload)", "value": defensive,
                "met": all(v == 0 for v in defensive.values()) if defensive else None})
    needed = {n: (r["collectives"]["reprules"]["needed_bytes"], r["minimum_needed_bytes"]) for n, r in measured.items()}
    out.append({"target": "needed bytes with reprules = analytical minimum", "value": needed,
                "met": all(a == b for a, b in needed.values()) if needed else None})
    act = measured.get("activation")
    off = act["step_ratio"].get("reprules/off") if act else None
    out.append({"target": f"step time reprules/off <= {TARGETS['step_vs_off']} (activation)",
                "value": off and off["median"], "met": off["median"] <= TARGETS["step_vs_off"] if off else None})
    hand = act["step_ratio"].get("reprules/hand") if act else None
    out.append({"target": f"step time reprules/hand within {TARGETS['step_vs_hand']:.0%} (activation)",
                "value": hand and hand["median"],
                "met": abs(hand["median"] - 1) <= TARGETS["step_vs_hand"] if hand else None})
    lowers = {n: r["lower_ratio"]["reprules/hand"]["median"] for n, r in measured.items()
              if "reprules/hand" in r.get("lower_ratio", {})}
    out.append({"target": f"trace+lower reprules/hand <= {1 + TARGETS['lower_vs_hand']:.2f}", "value": lowers,
                "met": all(v <= 1 + TARGETS["lower_vs_hand"] for v in lowers.values()) if lowers else None})
    lowers_off = {n: r["lower_ratio"]["reprules/off"]["median"] for n, r in measured.items()
                  if "reprules/off" in r.get("lower_ratio", {}) and n in ("tp_mlp",) + TRANSFORMERS}
    out.append({"target": f"trace+lower reprules/off <= {TARGETS['lower_vs_off']:.2f} (tp_mlp, transformer)",
                "value": lowers_off,
                "met": all(v <= TARGETS["lower_vs_off"] for v in lowers_off.values()) if lowers_off else None})
    formulas = {n: (r["collectives"]["reprules"]["program"]["needed_bytes"],
                    r["collectives"]["off"]["program"]["bytes"],
                    r["collectives"]["off"]["program"]["defensive_bytes"], r["expected"]["needed"],
                    r["expected"]["off"], r["expected"]["flagged_defensive"])
                for n, r in measured.items() if "expected" in r}
    out.append({"target": "reprules._demo.scale formulas = the program's measured bytes (needed, off total, off "
                          "defensive; traced and lowered, before XLA adds any)",
                "value": formulas, "met": all(v[:3] == v[3:] for v in formulas.values()) if formulas else None})
    ms = results["import"]["reprules_on_top_of_jax_s"]["median"] * 1e3
    out.append({"target": f"import reprules < {TARGETS['import_ms']:.0f} ms on top of import jax", "value": ms,
                "met": ms < TARGETS["import_ms"]})
    return out


def print_report(results: dict[str, Any]) -> None:
    cfg = results["config"]
    say(f"reprules benchmark: JAX {results['jax']} ({results['regime']} regime), {results['devices']} CPU "
        f"devices, mesh {MESH_SHAPE} {MESH_AXES}")
    load = ", ".join(f"{a:.1f}" for a in results["load_average_before"][:1] + results["load_average_after"][:1])
    say(f"{os.cpu_count()} CPU cores; 1-minute load average before, after: {load} (other processes skew timings)")
    say(f"step time: {cfg['repeats']} paired rounds after {cfg['warmup']} warm-up runs, variants interleaved; "
        f"trace+lower: {cfg['lower_repeats']} rounds, best of {cfg['lower_inner']} "
        f"(transformers: {cfg['heavy_lower_repeats']} rounds, best of 1), each after an untimed one, "
        f"over {STACK_OFFSETS} stack depths")
    say("ratios: median [p25, p75] of the per-round ratios")
    say("\ncollectives per step (per-device bytes, any level; a scan body's collectives counted once per "
        "layer; formula: reprules._demo.scale's off total, off defensive and needed bytes)")
    print(f"  {'workload':18}{'variant':10}{'count':>6}{'bytes':>10}{'defensive B':>13}{'needed B':>10}"
          f"{'minimum B':>11}")
    for name, r in results["workloads"].items():
        if "skipped" in r:
            say(f"  {name:18}skipped: {r['skipped']}", hang=" " * 20)
            continue
        for v in VARIANTS:
            c = r["collectives"].get(v)
            if c is None:
                say(f"  {name:18}{v:10}n/a: {r['unavailable'].get(v, '')}", hang=" " * 28)
                continue
            static = "" if c["static"]["count"] == c["count"] else f"  ({c['static']['count']} in the program)"
            added = c.get("compiler_added_bytes", 0)
            added = f"  ({added} B added by XLA)" if added else ""
            row(f"  {name:18}{v:10}{c['count']:>6}{c['bytes']:>10}{c['defensive_bytes']:>13}{c['needed_bytes']:>10}"
                f"{r['minimum_needed_bytes']:>11}", f"{static}{added}")
        e = r.get("expected")
        if e:
            print(f"  {name:18}{'formula':10}{'':>6}{e['off']:>10}{e['flagged_defensive']:>13}{e['needed']:>10}")
    say("\nbytes each device sends per step (ring algorithms: all-reduce 2(n-1)/n of its buffer, all-gather "
        "and reduce-scatter (n-1)/n; an all-reduce over more axes than its operand varies over split into its "
        "needed and defensive parts)")
    print(f"  {'workload':18}{'variant':10}{'sent B':>10}{'defensive B':>13}{'needed B':>10}")
    for name, r in results["workloads"].items():
        for v in VARIANTS:
            c = r.get("collectives", {}).get(v)
            if c is not None:
                print(f"  {name:18}{v:10}{c['sent_bytes']:>10}{c['defensive_sent_bytes']:>13}"
                      f"{c['needed_sent_bytes']:>10}")
    errors = {n: r["max_error"] for n, r in results["workloads"].items() if r.get("max_error")}
    if errors:
        print("\ngradients: max abs error against the unsharded reference")
        for name, e in errors.items():
            print(f"  {name:18}" + ", ".join(f"{v} {x:.1e}" for v, x in e.items()))
    print("\ncompiled memory analysis (bytes per device)")
    print(f"  {'workload':18}{'variant':10}{'temp':>12}{'argument':>12}{'output':>12}")
    for name, r in results["workloads"].items():
        for v, m in r.get("memory", {}).items():
            if m:
                print(f"  {name:18}{v:10}{m['temp']:>12}{m['argument']:>12}{m['output']:>12}")
    say("\nratios (< 1 is faster with reprules)")
    print(f"  {'workload':18}{'step vs off':>19}{'step vs hand':>19}")
    ran = {name: r for name, r in results["workloads"].items() if "skipped" not in r}
    for name, r in ran.items():
        sr = r["step_ratio"]
        print(f"  {name:18}{fmt_ratio(sr.get('reprules/off')):>19}{fmt_ratio(sr.get('reprules/hand')):>19}")
        if "inference/off" in sr:
            say(f"  {'':18}inference: step vs off {fmt_ratio(sr.get('inference/off'))}", hang="  ")
    say("\ntrace+lower ratios (also as this process's CPU time)")
    print(f"  {'workload':18}{'vs off':>19}{'vs off, CPU time':>19}{'vs hand':>19}")
    for name, r in ran.items():
        lr, lc = r["lower_ratio"], r["lower_cpu_ratio"]
        print(f"  {name:18}{fmt_ratio(lr.get('reprules/off')):>19}{fmt_ratio(lc.get('reprules/off')):>19}"
              f"{fmt_ratio(lr.get('reprules/hand')):>19}")
        if "inference/off" in lr:
            say(f"  {'':18}inference: vs off {fmt_ratio(lr.get('inference/off'))}, vs reprules "
                f"{fmt_ratio(lr.get('inference/reprules'))}", hang="  ")
    say("\ntrace+lower seconds (median wall, median CPU)")
    for name, r in ran.items():
        say(f"  {name:18}" + ", ".join(f"{v} {r['lower_s'][v]['median']:.3f} / {r['lower_cpu_s'][v]['median']:.3f}"
                                       for v in r["lower_s"]), hang=" " * 18)
        depth = r.get("lower_ratio_by_depth", {}).get("reprules/off")
        if depth and len(depth) > 1:
            say(f"  {'':18}reprules vs off by stack depth ({len(depth)} depths, ratio of medians): "
                f"min {min(depth):.3f}, median {float(np.median(depth)):.3f}, max {max(depth):.3f}", hang="  ")
    imp = results["import"]["reprules_on_top_of_jax_s"]
    say(f"\nimport reprules on top of import jax: {imp['median'] * 1e3:.1f} ms "
        f"[{imp['p25'] * 1e3:.1f}, {imp['p75'] * 1e3:.1f}] over {imp['n']} fresh interpreters")
    say("\ntargets (reported, not asserted)")
    for t in results["targets"]:
        met = {True: "met", False: "NOT met", None: "n/a"}[t["met"]]
        value = t["value"]
        if isinstance(value, float):
            value = f"{value:.3g}"
        say(f"  {met:8}{t['target']}: {value}", hang=" " * 8)


def main(argv: Sequence[str] | None = None) -> int:
    width = min(shutil.get_terminal_size().columns, WIDTH) - 2  # argparse's own margin
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=lambda prog: argparse.HelpFormatter(prog, width=width))
    parser.add_argument("--repeats", type=int, default=50, help="timed rounds per workload (default 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs per variant first (default 5)")
    parser.add_argument("--lower-repeats", type=int, default=20, help="trace+lower rounds (default 20)")
    parser.add_argument("--lower-inner", type=int, default=3, help="trace+lower: best of N per round (default 3)")
    parser.add_argument("--import-repeats", type=int, default=10, help="fresh interpreters for import time")
    parser.add_argument("--heavy-lower-repeats", type=int, default=5,
                        help="trace+lower rounds of the transformers, best of 1 (default 5)")
    parser.add_argument("--layers", type=int, default=None,
                        help="transformer layers (default 24; 2 with --small)")
    parser.add_argument("--workloads", default="activation,tp_mlp,layer_norm",
                        help="comma-separated, from: " + ", ".join(("activation", "tp_mlp", "layer_norm")
                                                                  + TRANSFORMERS)
                        + "; or `all` (default: activation,tp_mlp,layer_norm; the transformers take minutes)")
    parser.add_argument("--small", action="store_true", help="tiny shapes (a smoke test, not a benchmark)")
    parser.add_argument("--out", default=None, help="write the results as JSON to this path")
    opts = parser.parse_args(argv)

    if jax.device_count() < 8:
        say(f"bench needs 8 devices, found {jax.device_count()} (was a JAX backend started before XLA_FLAGS "
            "was set?)", file=sys.stderr)
        return 2
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(MESH_SHAPE), MESH_AXES)
    builders: dict[str, Callable[[bool], Workload]] = {
        "activation": activation_workload, "tp_mlp": tp_mlp_workload, "layer_norm": layer_norm_workload,
        "transformer": lambda small: transformer_workload(small, layers=opts.layers),
        "transformer_scan": lambda small: transformer_workload(small, scan=True, layers=opts.layers),
        "transformer_1sm": lambda small: transformer_workload(small, structure="model", layers=opts.layers),
        "transformer_scan_1sm": lambda small: transformer_workload(small, scan=True, structure="model",
                                                                   layers=opts.layers),
    }
    names = [n.strip() for n in opts.workloads.split(",") if n.strip()]
    if names == ["all"]:
        names = list(builders)
    unknown = [n for n in names if n not in builders]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(builders)}")

    results: dict[str, Any] = {
        "jax": jax.__version__, "regime": reprules.jax_support()["regime"], "devices": jax.device_count(),
        "mesh": dict(zip(MESH_AXES, MESH_SHAPE)), "hand_annotation": HAND,
        "config": {"repeats": opts.repeats, "warmup": opts.warmup, "lower_repeats": opts.lower_repeats,
                   "lower_inner": opts.lower_inner, "heavy_lower_repeats": opts.heavy_lower_repeats,
                   "layers": opts.layers, "import_repeats": opts.import_repeats, "small": opts.small},
        "workloads": {},
    }
    results["load_average_before"] = list(os.getloadavg())  # other processes skew timings
    for name in names:
        results["workloads"][name] = measure(builders[name](opts.small), mesh, opts.repeats, opts.warmup,
                                             opts.lower_repeats, opts.lower_inner, opts.heavy_lower_repeats)
    results["import"] = import_time(opts.import_repeats)
    results["load_average_after"] = list(os.getloadavg())
    results["targets"] = targets_summary(results)
    print_report(results)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
