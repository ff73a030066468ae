"""One op, measured: the machinery behind ``.ci/coverage/run.py``.

A :class:`Case` is one op on the (4, 2) ``("data", "model")`` mesh: its per-device
body, the whole input arrays, their specs, which inputs to differentiate, and
an unsharded reference (the op on the whole arrays, no ``shard_map``). The body
runs in four modes:

* ``ref``: the reference on the whole arrays (no ``shard_map``);
* ``off``: ``shard_map(check=False)``;
* ``on``: ``shard_map(check=True)``, with nothing but ``import reprules`` (packs
  load themselves when their library is imported);
* ``infer``: as ``on``, under ``reprules.inference()``.

Every mode computes the forward, the gradient of ``sum(out * t)`` (a fixed
random ``t``) w.r.t. ``grad_argnums`` where the op has a VJP, and (sharded modes)
the defensive all-reduces of that gradient (``reprules.testing.collectives``).
Errors are relative: ``max|a - b| / max|b|`` over every leaf. Nothing here
knows what a mode should give: it measures.

Only reprules' public API: this runs as a user's script would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
import traceback
import warnings
from typing import Any, Callable

MODES = ("ref", "off", "on", "infer")
OFF_TOL = 1e-6  # a checked run equals the unchecked one up to reassociation of a sum


class NotAvailable(Exception):
    """The op does not exist here (this JAX, this library version): its row says why."""


@contextlib.contextmanager
def hlo_interpreter():
    """A :attr:`Case.context`: every ``pallas_call`` traced inside runs in Pallas' HLO
    interpreter (``interpret=True``, not TPU interpret mode), for a library with no switch."""
    from jax.experimental.pallas import tpu as pltpu  # lazily, as the cases: JAX after the child's devices

    with pltpu.force_tpu_interpret_mode(True):
        yield


@dataclasses.dataclass
class Case:
    fn: Callable[..., Any]  # the per-device body
    args: tuple  # whole arrays (NumPy or JAX)
    in_specs: tuple
    out_specs: Any
    grad_argnums: tuple = ()  # () = forward only (no VJP)
    reference: Callable[..., Any] | None = None  # on whole arrays; None: ``fn`` itself
    context: Callable[[], Any] = contextlib.nullcontext  # e.g. TPU interpret mode
    tol: float = 1e-5  # vs the reference, relative (the op's dtype tolerance)
    note: str = ""


def first_line(err: BaseException, limit: int = 160) -> str:
    """The error's first line; for an error that wraps a traceback (JAX's callback errors),
    the wrapped exception's line."""
    text = [t.strip() for t in str(err).strip().splitlines() if t.strip()]
    line = text[0] if text else ""
    if "Traceback (most recent call last)" in line:
        raised = [t for t in text if re.match(r"^[\w.]+(Error|Exception)\b.*:", t)]
        line = raised[-1] if raised else line
    return (line[: limit - 1] + "…") if len(line) > limit else line


def error_text(err: BaseException) -> dict:
    import reprules

    return {"type": type(err).__name__, "module": type(err).__module__,
            "reprules": isinstance(err, reprules.ReprulesError), "message": first_line(err)}


def rel_err(a: Any, b: Any) -> float:
    """max |a - b| / max |b| over the leaves (0 for equal values, also all-zero ones)."""
    import jax
    import numpy as np

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if len(la) != len(lb):
        return float("inf")
    worst = 0.0
    for x, y in zip(la, lb):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x.shape != y.shape:
            return float("inf")
        diff = float(np.max(np.abs(x - y), initial=0.0))
        scale = float(np.max(np.abs(y), initial=0.0))
        if not np.isfinite(diff):
            return float("inf")
        worst = max(worst, diff / scale if scale else diff)
    return worst


def _mesh():
    import jax
    import numpy as np

    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))


def _cotangents(out: Any) -> Any:
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.RandomState(7)
    return [jnp.asarray(rng.randn(*o.shape), jnp.float32) if jnp.issubdtype(o.dtype, jnp.floating) else None
            for o in jax.tree.leaves(out)]


def _loss(fn: Callable[..., Any], t: list) -> Callable[..., Any]:
    import jax
    import jax.numpy as jnp

    def loss(*args):
        leaves = jax.tree.leaves(fn(*args))
        return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(leaves, t) if c is not None)

    return loss


def _run_mode(case: Case, mode: str, mesh: Any, sharded: list, t: list | None) -> dict:
    """Forward, gradient and (sharded) collectives of one mode; the first failing step stops it."""
    import jax

    import reprules
    from reprules import testing

    res: dict = {}
    jax.clear_caches()
    if mode == "ref":
        body, args = (case.reference or case.fn), case.args
    else:
        body = testing.shard_map(case.fn, mesh, case.in_specs, case.out_specs, check=(mode != "off"))
        args = sharded
    scope = reprules.inference() if mode == "infer" else contextlib.nullcontext()
    step = "forward"
    start = time.perf_counter()
    try:
        with scope, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res["out"] = jax.block_until_ready(jax.jit(body)(*args))
            if t is None:
                t = _cotangents(res["out"])
            res["t"] = t
            audited = body
            if case.grad_argnums:
                step = "gradient"
                grad = jax.grad(_loss(body, t), argnums=case.grad_argnums)
                res["grad"] = jax.block_until_ready(jax.jit(grad)(*args))
                audited = grad
            if mode != "ref":
                step = "collectives"
                report = testing.collectives(audited, *args)
                reduces = report.select("all-reduce")
                res["defensive"] = report.count("all-reduce", defensive=True)
                res["all_reduce_axes"] = sorted({",".join(c.axes) if c.axes else "?" for c in reduces})
                res["kernels"] = sorted({(k.name, k.rule) for k in report.kernels})
        res["warnings"] = sorted({f"{type(w.message).__name__}: {first_line(w.message)}" for w in caught
                                  if type(w.message).__module__.startswith("reprules")})
    except Exception as err:  # noqa: BLE001 - every failure is a measurement
        res["error"] = {**error_text(err), "step": step}
        res["traceback"] = traceback.format_exc(limit=-8)
    res["seconds"] = round(time.perf_counter() - start, 1)
    return res


def _fmt(x: float | None) -> str:
    if x is None:
        return "–"
    if x == 0:
        return "0"
    return "inf" if x == float("inf") else f"{x:.1e}"


def measure(case: Case, modes: tuple = MODES) -> dict:
    """Every mode of ``case``: a JSON-able dict (errors, outcomes, collectives, timings)."""
    import jax
    from jax.sharding import NamedSharding

    mesh = _mesh()
    results: dict = {}
    with case.context():
        sharded = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(case.args, case.in_specs)]
        t = None
        for mode in modes:
            results[mode] = _run_mode(case, mode, mesh, sharded, t)
            t = t or results[mode].get("t")
    return summarize(case, results)


def summarize(case: Case, results: dict) -> dict:
    row: dict = {"note": case.note, "tol": case.tol, "modes": {}}
    ref = results.get("ref", {})
    off = results.get("off", {})
    for mode, res in results.items():
        entry = {k: res[k] for k in ("error", "defensive", "all_reduce_axes", "warnings", "seconds") if k in res}
        entry["kernels"] = [list(k) for k in res.get("kernels", ())]
        for name, other in (("ref", ref), ("off", off)):
            if mode == name or "out" not in res or "out" not in other:
                continue
            entry[f"fwd_vs_{name}"] = rel_err(res["out"], other["out"])
            if "grad" in res and "grad" in other:
                entry[f"grad_vs_{name}"] = rel_err(res["grad"], other["grad"])
        row["modes"][mode] = entry
    row["runs_on_cpu"] = runs_on_cpu(row["modes"])
    for mode in ("on", "infer"):
        if mode in row["modes"]:
            row["modes"][mode]["outcome"] = outcome(row["modes"], mode, case.tol)
    if "off" in row["modes"] and "error" not in row["modes"]["off"]:
        m = row["modes"]["off"]
        ok = all(m.get(k, 0) <= case.tol for k in ("fwd_vs_ref", "grad_vs_ref"))
        row["modes"]["off"]["outcome"] = "matches reference" if ok else "differs from reference"
    return row


def runs_on_cpu(modes: dict) -> dict:
    """Runs on CPU: the op's forward ran inside shard_map with checking off; else its error."""
    off = modes.get("off", {"error": {"type": "?", "message": "not run", "step": "forward"}})
    if off.get("error", {}).get("step") != "forward":
        return {"yes": True}
    err = off["error"]
    return {"yes": False, "why": f"{err['type']}: {err['message']}"}


def outcome(modes: dict, mode: str, tol: float) -> dict:
    """exact / refused (an error where checking off ran) / fails as off / wrong, with the numbers."""
    m, off = modes[mode], modes.get("off", {})
    if "error" in m:
        e = m["error"]
        off_e = off.get("error")
        if off_e and off_e["step"] == e["step"] and off_e["type"] == e["type"]:
            return {"kind": "fails as off", "why": f"{e['type']} ({e['step']}): {e['message']}"}
        who = "reprules, " if e["reprules"] else ""
        return {"kind": "refused", "why": f"{e['type']} ({who}{e['step']}): {e['message']}"}
    vs_ref = [m[k] for k in ("fwd_vs_ref", "grad_vs_ref") if k in m]
    vs_off = [m[k] for k in ("fwd_vs_off", "grad_vs_off") if k in m]
    ok_ref = all(x <= tol for x in vs_ref)
    ok_off = all(x <= OFF_TOL for x in vs_off)
    if ok_ref and (ok_off or not vs_off) and (vs_ref or vs_off):
        kind = "exact"
    elif ok_ref and vs_ref:
        kind = "exact (off differs)"
    elif not vs_ref and not vs_off:
        kind = "ran (nothing to compare)"
    else:
        kind = "wrong"
    return {"kind": kind, "ref": [m.get("fwd_vs_ref"), m.get("grad_vs_ref")],
            "off": [m.get("fwd_vs_off"), m.get("grad_vs_off")]}


def cell_outcome(o: dict | None) -> str:
    if not o:
        return "–"
    if "why" in o:
        return f"{o['kind']}: {o['why']}"
    nums = []
    for name in ("ref", "off"):
        fwd, grad = o.get(name, [None, None])
        if fwd is not None:
            nums.append(f"Δ{name} {_fmt(fwd)}" + (f" / {_fmt(grad)}" if grad is not None else ""))
    return o["kind"] + (f" ({', '.join(nums)})" if nums else "")


def fmt_pair(fwd: float | None, grad: float | None) -> str:
    return _fmt(fwd) + (f" / {_fmt(grad)}" if grad is not None else "")
