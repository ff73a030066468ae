"""``reprules audit``: the collectives each training step pays for, and why.

With no target, audits the bundled workloads on 8 fake CPU devices, side by
side with checking off vs with reprules. With ``module:callable``, audits the
user's step (protocol in :mod:`reprules._workloads`). Progress goes to
stderr, results to stdout (``--json`` for machines); ``--strict`` exits 1
when a defensive collective or an opaque kernel without a rule is found.

Exit codes: 0 clean, 1 findings under ``--strict`` or a workload failed,
2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

DEFAULT_DEVICES = 8


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reprules", description="Replication rules for Pallas kernels inside jax.shard_map.")
    sub = parser.add_subparsers(dest="command")
    audit = sub.add_parser(
        "audit", help="report the collectives of training steps: defensive vs needed",
        description="Audit the collectives of training steps. With no TARGET, audits the bundled "
        "workloads (JAX #21855, a tensor-parallel MLP with a Pallas matmul, JAX's Pallas layer_norm), "
        "checking off vs reprules.",
        epilog="TARGET protocol: `module:callable`; the callable takes no arguments and returns "
        "(step, args), (step, args, kwargs), or a mapping with 'step', 'args' and optional "
        "'kwargs', 'name', 'reference' (a zero-argument callable giving the expected output).")
    audit.add_argument("target", nargs="?", help="module:callable returning (step, args)")
    audit.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    audit.add_argument("--strict", action="store_true",
                       help="exit 1 on defensive collectives or kernels without a rule")
    audit.add_argument("--devices", type=int, default=DEFAULT_DEVICES,
                       help=f"fake CPU devices to provide (default {DEFAULT_DEVICES})")
    audit.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``reprules`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command != "audit":
        parser.print_help(sys.stderr)
        return 2
    progress = _Progress(sys.stderr, enabled=not args.quiet)
    try:
        _provide_devices(args.devices, default_run=args.target is None)
    except _UsageError as err:
        print(f"reprules audit: error: {err}", file=sys.stderr)
        return 2
    if args.target is None:
        return _audit_default(args, progress)
    return _audit_target(args, progress)


class _UsageError(Exception):
    pass


def _provide_devices(n: int, *, default_run: bool) -> None:
    """Sets XLA_FLAGS for ``n`` CPU devices, or checks a started backend has them."""
    if n < 1:
        raise _UsageError(f"--devices must be at least 1, got {n}.")
    from reprules import _environment

    if _environment.backend_started():
        import jax

        if default_run and jax.device_count() < n:
            raise _UsageError(
                f"JAX already started with {jax.device_count()} devices; the audit needs {n}.\n"
                "Why: the number of fake CPU devices is fixed when JAX's backend starts.\n"
                "Fix: run `reprules audit` in a fresh process (python -m reprules audit).")
        return
    _environment.request_cpu_devices(n, cpu_only=default_run)


class _Progress:
    def __init__(self, stream: TextIO, enabled: bool):
        self.stream, self.enabled = stream, enabled

    def __call__(self, text: str, end: str = "\n") -> None:
        if self.enabled:
            print(text, end=end, file=self.stream, flush=True)


# --- one audit -------------------------------------------------------------------------


def _max_error(got: Any, expected: Any) -> float:
    import jax
    import numpy as np

    a, b = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)
    if len(a) != len(b):
        return float("nan")
    return max((float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b)), default=0.0)


def _variant(step: Any, args: tuple[Any, ...], kwargs: dict[str, Any], reference: Any) -> dict[str, Any]:
    import jax

    from reprules import testing

    report = testing.collectives(step, *args, **kwargs)
    error = None
    if reference is not None:
        out = jax.jit(lambda *a: step(*a, **kwargs))(*args)
        error = _max_error(out, reference)
    return {"report": report, "max_error": error}


def _summary(v: dict[str, Any]) -> dict[str, Any]:
    report = v["report"]
    return {
        "collectives": [c.to_dict() for c in report.collectives],
        "kernels": [k.to_dict() for k in report.kernels],
        "count": len(report.collectives),
        "bytes": report.bytes(),
        "defensive_count": len(report.defensive),
        "defensive_bytes": sum(c.bytes for c in report.defensive),
        "kernels_with_rules": sum(1 for k in report.kernels if k.has_rule),
        "kernels_total": len(report.kernels),
        "max_error": v["max_error"],
    }


def _audit_default(args: argparse.Namespace, progress: _Progress) -> int:
    import jax

    import reprules
    from reprules import _registry, _workloads

    support = reprules.jax_support()
    progress(f"reprules {reprules.__version__} audit: JAX {support['jax']} ({support['regime']} regime), "
             f"{jax.device_count()} {jax.default_backend().upper()} devices, mesh "
             f"{_workloads.MESH_SHAPE} {_workloads.MESH_AXES}")
    mesh = _workloads.make_mesh()
    results, failed = [], False
    cases = _workloads.DEFAULT_CASES
    for i, case in enumerate(cases, 1):
        start = time.perf_counter()
        progress(f"[{i}/{len(cases)}] {case.name}: ", end="")
        entry: dict[str, Any] = {"name": case.name, "title": case.title}
        try:
            kernels = case.kernels()
            reference = case.reference()
            ours = [k for k in kernels if _registry.lookup(k) is None]
            for k in kernels:  # "off" is what users run today: no rules
                reprules.unregister(k)
            progress("checking off ... ", end="")
            built = case.build(mesh, False)
            entry["off"] = _variant(built.step, built.args, {}, reference)
            progress("reprules ... ", end="")
            for k in kernels:
                reprules.replication_rule()(k)
            try:
                built = case.build(mesh, True)
                entry["on"] = _variant(built.step, built.args, {}, reference)
            finally:
                for k in ours:
                    reprules.unregister(k)
            progress(f"done ({time.perf_counter() - start:.1f} s)")
        except Exception as err:  # one broken workload must not hide the others
            failed = True
            entry["error"] = f"{type(err).__name__}: {err}"
            progress(f"FAILED ({type(err).__name__})")
        results.append(entry)

    strict_findings = []
    for e in results:
        on = e.get("on")
        if on is not None:
            rep = on["report"]
            strict_findings += [f"{e['name']}: {c.describe()}" for c in rep.defensive]
            strict_findings += [f"{e['name']}: kernel {k.name} {_no_rule_text(k)}" for k in rep.kernels_without_rule]

    if args.json:
        doc = {
            "reprules": reprules.__version__, "jax": support["jax"], "regime": support["regime"],
            "devices": jax.device_count(), "mesh": dict(zip(_workloads.MESH_AXES, _workloads.MESH_SHAPE)),
            "workloads": [
                {"name": e["name"], "title": e["title"], "error": e.get("error"),
                 **{k: _summary(e[k]) for k in ("off", "on") if k in e}}
                for e in results],
            "strict_findings": strict_findings,
        }
        print(json.dumps(doc, indent=2))
    else:
        print(_render_default(results, support, jax.device_count()))
    if failed:
        return 1
    if args.strict and strict_findings:
        print("reprules audit --strict: " + "; ".join(strict_findings), file=sys.stderr)
        return 1
    return 0


def _no_rule_text(kernel: Any) -> str:
    return "has no rule" if kernel.identified else f"was not identified ({kernel.status()})"


def _fmt_collectives(report: Any, defensive: bool) -> str:
    found = report.select(defensive=defensive)
    if not found:
        return "0"
    by: dict[tuple[str, str], list[int]] = {}
    for c in found:
        by.setdefault((c.kind, c.axes_text()), []).append(c.bytes)
    return ", ".join(f"{len(b)} {k} over {a} ({sum(b)} B)" for (k, a), b in by.items())


def _fmt_kernels(report: Any) -> str:
    if not report.kernels:
        return "none"
    have = sum(1 for k in report.kernels if k.has_rule)
    missing = [k.name for k in report.kernels if not k.has_rule]
    return f"{have}/{len(report.kernels)}" + (f" (no rule: {', '.join(missing)})" if missing else "")


def _fmt_error(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2e}"


def _render_default(results: list[dict[str, Any]], support: dict[str, str], devices: int) -> str:
    lines = [f"reprules audit: JAX {support['jax']} ({support['regime']} regime), {devices} devices, "
             "collectives per training step (per-device bytes)"]
    for e in results:
        lines.append("")
        lines.append(f"== {e['name']}: {e['title']}")
        if "error" in e:
            lines.append(f"   FAILED: {e['error'][:500]}")
            continue
        off, on = e["off"], e["on"]
        ro, rn = off["report"], on["report"]
        rows = [
            ("", "checking off", "reprules (checking on)"),
            ("collectives", f"{len(ro.collectives)} ({ro.bytes()} B)", f"{len(rn.collectives)} ({rn.bytes()} B)"),
            ("  defensive", _fmt_collectives(ro, True), _fmt_collectives(rn, True)),
            ("  needed", _fmt_collectives(ro, False), _fmt_collectives(rn, False)),
            ("kernels with rules", _fmt_kernels(ro), _fmt_kernels(rn)),
            ("grad max error", _fmt_error(off["max_error"]), _fmt_error(on["max_error"])),
        ]
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        lines += ["   " + f"{a.ljust(w0)}  {b.ljust(w1)}  {c}".rstrip() for a, b, c in rows]
        for label, rep in (("off", ro), ("reprules", rn)):
            for c in rep.collectives:
                lines.append(f"   [{label}] {c.describe()}")
    return "\n".join(lines)


def _audit_target(args: argparse.Namespace, progress: _Progress) -> int:
    import jax

    import reprules
    from reprules import _workloads

    sys.path.insert(0, os.getcwd())
    progress(f"reprules {reprules.__version__} audit of {args.target}: JAX {jax.__version__}, "
             f"{jax.device_count()} devices")
    try:
        progress("loading target ... ", end="")
        target = _workloads.load_target(args.target)
    except _workloads.TargetError as err:
        progress("")
        print(f"reprules audit: error: {err}", file=sys.stderr)
        return 2
    progress("compiling ... ", end="")
    start = time.perf_counter()
    try:
        reference = target.reference() if target.reference is not None else None
        result = _variant(target.step, target.args, dict(target.kwargs), reference)
    except reprules.MissingRuleError as err:
        progress("failed")
        print(f"reprules audit: {args.target}: {err}", file=sys.stderr)
        return 1
    progress(f"done ({time.perf_counter() - start:.1f} s)")
    report = result["report"]
    findings = [c for c in report.defensive]
    missing = report.kernels_without_rule
    if args.json:
        doc = {"target": args.target, "name": target.name, "jax": jax.__version__,
               "report": report.to_dict(), "max_error": result["max_error"],
               "strict_findings": [c.describe() for c in findings]
               + [f"kernel {k.name} {_no_rule_text(k)}" for k in missing]}
        print(json.dumps(doc, indent=2))
    else:
        print(_render_target(target.name, report, result["max_error"]))
    if args.strict and (findings or missing):
        unknown = sum(1 for k in missing if not k.identified)
        print(f"reprules audit --strict: {len(findings)} defensive collectives, "
              f"{len(missing)} kernels without a rule" + (f" ({unknown} not identified)" if unknown else ""),
              file=sys.stderr)
        return 1
    return 0


def _render_target(name: str, report: Any, error: float | None) -> str:
    lines = [report.table(), ""]
    if report.kernels:
        lines.append("opaque kernels under shard_map:")
        for k in report.kernels:
            lines.append(f"  {k.name} ({k.primitive} x{k.count}) at {k.source or '?'}: {k.status()}")
    else:
        lines.append("opaque kernels under shard_map: none")
    d = report.defensive
    lines.append(f"defensive collectives: {len(d)} ({sum(c.bytes for c in d)} B per step)")
    for c in d:
        lines.append(f"  {c.describe()}")
    missing = report.kernels_without_rule
    if missing:
        lines.append("to remove them, give each kernel a rule and turn shard_map checking on:")
        for k in missing:
            lines.append(f"  {k.source or '?'}: @reprules.replication_rule()   # above `def {k.name}(...)`")
    if error is not None:
        lines.append(f"max error against the reference: {error:.2e}")
    return "\n".join(lines)
