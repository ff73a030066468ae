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

and for each variant:

* ``off``: ``shard_map`` with checking off, no rules (what users do today);
* ``reprules``: rules registered (``rules.same()``, as reprules' own rule pack
  does for ``layer_norm``), checking on;
* ``hand``: checking on, no reprules, the call sites annotated by hand
  (``vma=`` / ``manual_axis_type=`` on the ``jax.ShapeDtypeStruct``, or
  ``jax.typeof(x)`` as the FFI result type, plus ``pvary``/``pcast`` casts).
  Possible on JAX >= 0.6 only, and only where the call site is the user's: not
  for ``layer_norm`` (its ``pallas_call``\\ s are inside JAX). Where JAX itself
  rejects the annotated call, the reason is recorded instead.

it measures the collective bytes per step (per device, from
``reprules.testing.collectives``: defensive vs needed, and the analytical
minimum of the needed bytes), the step time (rounds in which every variant
runs once, in a rotating order; reported as the median and interquartile
range of the per-round ratios between variants), and the trace+lower time
(``jax.jit(step).lower`` of a freshly built step, best of 3 per round;
reprules with its rules registered, the other variants with nothing
registered, i.e. JAX unpatched). It also measures ``import reprules`` on top
of ``import jax`` in fresh interpreters. It prints tables and writes JSON; it
reports against the targets of issue 5 but asserts nothing. Timings are only
as quiet as the machine: the load average is printed and recorded.

Run (8 fake CPU devices are set up by the script itself):

    python examples/benchmarks/bench.py --out bench.json
    python examples/benchmarks/bench.py --small --repeats 2 --lower-repeats 1 --lower-inner 1 --import-repeats 1
"""

from __future__ import annotations

from reprules import testing

testing.fake_cpu_devices(8)  # first thing: 8 fake CPU devices, before JAX starts

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
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
from reprules import rules  # noqa: E402

VARIANTS = ("off", "reprules", "hand")
MESH_SHAPE, MESH_AXES = (4, 2), ("data", "model")
TARGETS = {"step_vs_off": 0.90, "step_vs_hand": 0.02, "lower_vs_hand": 0.05, "import_ms": 50.0}

# --- JAX version branches (public API only) -----------------------------------------------

_SDS_PARAMS = inspect.signature(jax.ShapeDtypeStruct.__init__).parameters
if "manual_axis_type" in _SDS_PARAMS:  # 0.10+: ShapeDtypeStruct(manual_axis_type=ManualAxisType(...))
    HAND = "manual_axis_type"
elif "vma" in _SDS_PARAMS:  # 0.6 - 0.9: ShapeDtypeStruct(vma=frozenset)
    HAND = "vma"
else:  # <= 0.5: no way to type a kernel's output as varying
    HAND = None
HAND_UNAVAILABLE = None if HAND else (
    f"JAX {jax.__version__} has no vma=/manual_axis_type= on jax.ShapeDtypeStruct (added in JAX 0.6)")


def varying(x: Any) -> frozenset[str]:
    """The mesh axes ``x`` varies over (hand-annotated variants, JAX >= 0.6)."""
    t = jax.typeof(x)
    if HAND == "vma":
        return frozenset(t.vma)
    return frozenset(t.mat.varying)


def cast(x: Any, axes: frozenset[str]) -> Any:
    """``x`` cast up to vary over ``axes`` (its cotangent is psummed over the added ones)."""
    missing = tuple(sorted(axes - varying(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):  # 0.8+
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # 0.6 - 0.7


def sds(shape: tuple[int, ...], dtype: Any, axes: frozenset[str]) -> jax.ShapeDtypeStruct:
    """An out_shape typed as varying over ``axes``: the hand annotation."""
    if HAND == "manual_axis_type":
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=axes))
    return jax.ShapeDtypeStruct(shape, dtype, vma=axes)


def psum_extra(ct: Any, primal_axes: frozenset[str]) -> Any:
    """Sums a custom_vjp cotangent over the axes its primal does not vary over."""
    extra = tuple(sorted(varying(ct) - primal_axes))
    return jax.lax.psum(ct, extra) if extra else ct


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


# --- measuring ---------------------------------------------------------------------------------


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
    text = " ".join([line.strip() for line in str(err).splitlines() if line.strip()][:n])
    return f"{type(err).__name__}: {text[:400]}"


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
            lower_inner: int) -> dict[str, Any]:
    result: dict[str, Any] = {"title": w.title, "minimum_needed_bytes": w.minimum, "minimum": w.minimum_text,
                              "unavailable": {}, "collectives": {}}
    reason = w.unavailable()
    if reason:
        result["skipped"] = reason
        return result
    clear_rules()  # e.g. reprules' own pack registered layer_norm's kernels when JAX's op was imported
    args = w.args(mesh)
    hand_reason = w.hand_unavailable()
    variants = [v for v in VARIANTS if v != "hand" or hand_reason is None]
    if hand_reason:
        result["unavailable"]["hand"] = hand_reason

    # Compile each variant; reprules' with its rules registered, the others with JAX unpatched.
    compiled: dict[str, Any] = {}
    for v in list(variants):
        if v == "reprules":
            register(w.targets())
        try:
            step = w.build(mesh, v)
            compiled[v] = jax.jit(step).lower(*args).compile()
            report = testing.collectives(w.build(mesh, v), *args)
        except Exception as err:  # noqa: BLE001: JAX rejects a hand-annotated call: record why
            if v != "hand":
                raise
            result["unavailable"]["hand"] = f"JAX rejects the hand-annotated call: {first_lines(err)}"
            variants.remove(v)
            continue
        finally:
            if v == "reprules":
                unregister(w.targets())
        result["collectives"][v] = {
            "count": len(report.collectives), "bytes": report.bytes(),
            "defensive_count": len(report.defensive), "defensive_bytes": report.bytes(defensive=True),
            "needed_bytes": report.bytes(defensive=False),
            "lines": [c.describe() for c in report.collectives],
        }
    result["variants"] = variants

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
    result["step_ratio"] = {f"reprules/{v}": paired_ratio(times["reprules"], times[v]) for v in variants
                            if v != "reprules"}

    # Trace+lower: a freshly built step each time (no jit cache hit), best of `lower_inner`
    # per round and variant; one warm-up round.
    lower: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(lower_repeats + 1):
        for v in rotations(variants, r):
            if v == "reprules":
                register(w.targets())
            try:
                best = float("inf")
                for _ in range(lower_inner):
                    step = w.build(mesh, v)
                    with no_gc():
                        t0 = time.perf_counter()
                        jax.jit(step).lower(*args)
                        best = min(best, time.perf_counter() - t0)
            finally:
                if v == "reprules":
                    unregister(w.targets())
            if r:
                lower[v].append(best)
    result["lower_s"] = {v: stats(t) for v, t in lower.items()}
    result["lower_ratio"] = {f"reprules/{v}": paired_ratio(lower["reprules"], lower[v]) for v in variants
                             if v != "reprules"}
    return result


def import_time(repeats: int) -> dict[str, Any]:
    """``import reprules`` after ``import jax``, in fresh interpreters."""
    code = ("import time; t0 = time.perf_counter(); import jax; t1 = time.perf_counter(); import reprules; "
            "t2 = time.perf_counter(); print(t1 - t0, t2 - t1)")
    jax_s, reprules_s = [], []
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
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
    ms = results["import"]["reprules_on_top_of_jax_s"]["median"] * 1e3
    out.append({"target": f"import reprules < {TARGETS['import_ms']:.0f} ms on top of import jax", "value": ms,
                "met": ms < TARGETS["import_ms"]})
    return out


def print_report(results: dict[str, Any]) -> None:
    cfg = results["config"]
    print(f"reprules benchmark: JAX {results['jax']} ({results['regime']} regime), {results['devices']} CPU "
          f"devices, mesh {MESH_SHAPE} {MESH_AXES}")
    load = ", ".join(f"{a:.1f}" for a in results["load_average_before"][:1] + results["load_average_after"][:1])
    print(f"{os.cpu_count()} CPU cores; 1-minute load average before, after: {load} (other processes skew timings)")
    print(f"step time: {cfg['repeats']} paired rounds after {cfg['warmup']} warm-up runs, variants interleaved; "
          f"trace+lower: {cfg['lower_repeats']} rounds, best of {cfg['lower_inner']}")
    print("ratios: median [p25, p75] of the per-round ratios")
    print("\ncollectives per step (per-device bytes, any level)")
    print(f"  {'workload':12}{'variant':10}{'count':>6}{'bytes':>10}{'defensive B':>13}{'needed B':>10}"
          f"{'minimum B':>11}")
    for name, r in results["workloads"].items():
        if "skipped" in r:
            print(f"  {name:12}skipped: {r['skipped']}")
            continue
        for v in VARIANTS:
            c = r["collectives"].get(v)
            if c is None:
                print(f"  {name:12}{v:10}n/a: {r['unavailable'].get(v, '')}")
                continue
            print(f"  {name:12}{v:10}{c['count']:>6}{c['bytes']:>10}{c['defensive_bytes']:>13}{c['needed_bytes']:>10}"
                  f"{r['minimum_needed_bytes']:>11}")
    print("\nratios (reprules / other variant; < 1 is faster with reprules)")
    print(f"  {'workload':12}{'step vs off':>20}{'step vs hand':>20}{'trace+lower vs off':>21}"
          f"{'trace+lower vs hand':>21}")
    for name, r in results["workloads"].items():
        if "skipped" in r:
            continue
        sr, lr = r["step_ratio"], r["lower_ratio"]
        print(f"  {name:12}{fmt_ratio(sr.get('reprules/off')):>20}{fmt_ratio(sr.get('reprules/hand')):>20}"
              f"{fmt_ratio(lr.get('reprules/off')):>21}{fmt_ratio(lr.get('reprules/hand')):>21}")
    imp = results["import"]["reprules_on_top_of_jax_s"]
    print(f"\nimport reprules on top of import jax: {imp['median'] * 1e3:.1f} ms "
          f"[{imp['p25'] * 1e3:.1f}, {imp['p75'] * 1e3:.1f}] over {imp['n']} fresh interpreters")
    print("\ntargets (reported, not asserted)")
    for t in results["targets"]:
        met = {True: "met", False: "NOT met", None: "n/a"}[t["met"]]
        value = t["value"]
        if isinstance(value, float):
            value = f"{value:.3g}"
        print(f"  {met:8}{t['target']}: {value}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50, help="timed rounds per workload (default 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs per variant first (default 5)")
    parser.add_argument("--lower-repeats", type=int, default=20, help="trace+lower rounds (default 20)")
    parser.add_argument("--lower-inner", type=int, default=3, help="trace+lower: best of N per round (default 3)")
    parser.add_argument("--import-repeats", type=int, default=10, help="fresh interpreters for import time")
    parser.add_argument("--workloads", default="activation,tp_mlp,layer_norm", help="comma-separated subset")
    parser.add_argument("--small", action="store_true", help="tiny shapes (a smoke test, not a benchmark)")
    parser.add_argument("--out", default=None, help="write the results as JSON to this path")
    opts = parser.parse_args(argv)

    if jax.device_count() < 8:
        print(f"bench needs 8 devices, found {jax.device_count()} (was a JAX backend started before XLA_FLAGS "
              "was set?)", file=sys.stderr)
        return 2
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(MESH_SHAPE), MESH_AXES)
    builders = {"activation": activation_workload, "tp_mlp": tp_mlp_workload, "layer_norm": layer_norm_workload}
    names = [n.strip() for n in opts.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in builders]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(builders)}")

    results: dict[str, Any] = {
        "jax": jax.__version__, "regime": reprules.jax_support()["regime"], "devices": jax.device_count(),
        "mesh": dict(zip(MESH_AXES, MESH_SHAPE)), "hand_annotation": HAND,
        "config": {"repeats": opts.repeats, "warmup": opts.warmup, "lower_repeats": opts.lower_repeats,
                   "lower_inner": opts.lower_inner,
                   "import_repeats": opts.import_repeats, "small": opts.small},
        "workloads": {},
    }
    results["load_average_before"] = list(os.getloadavg())  # other processes skew timings
    for name in names:
        results["workloads"][name] = measure(builders[name](opts.small), mesh, opts.repeats, opts.warmup,
                                             opts.lower_repeats, opts.lower_inner)
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
