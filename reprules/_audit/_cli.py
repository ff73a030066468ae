"""``reprules audit``: the collectives each training step pays for, and why.

With no target, audits the bundled workloads on 8 fake CPU devices, side by
side with checking off vs with reprules. With ``module:callable``, audits the
user's step (or ``path/to/file.py[:callable]``; the callable defaults to ``audit_step``),
also side by side when the callable takes ``check`` (protocol in
:mod:`reprules._audit._target`). Progress goes to stderr, results to stdout
(``--json`` for machines, :data:`SCHEMA_VERSION`); ``--html FILE`` also writes
the report as one self-contained page (:mod:`reprules._audit._html`);
``--infer`` runs the reprules side under ``reprules.inference()``. Each kernel
says how it is covered (identity, name, inference or none) and, without a
rule, whether inference would cover it (:mod:`reprules._audit._coverage`).
``--strict`` exits 1 when a defensive collective, an opaque kernel without a
rule, or a ``kernel_named`` rule that matched nothing is found on the reprules
side. Errors are one paragraph (what, why, fix) without a traceback; the exit
codes are :data:`EXIT_CODES`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import shutil
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Any, TextIO

import reprules
from reprules import _environment, _mode_state, _registry
from reprules._audit import _communication, _html, _text
from reprules._report import _link_model
from reprules._demo import workloads
from reprules._audit import _target as protocol
from reprules._errors import UnsupportedJaxError

DEFAULT_DEVICES = 8
SCHEMA_VERSION = 4
"""Version of the ``--json`` document's layout; raised whenever a field changes meaning or goes away
(new fields are added within a version: ``unmatched_kernel_names``, each kernel's ``covered_by`` and
``inference``, each collective's ``dead`` and ``added_by`` and each variant's ``dead_count`` were
added in version 1; ``count``, ``bytes`` and the ``defensive_*`` figures leave dead collectives out).
Version 2: ``inference`` is the inference mode the reprules side was traced in, ``"all"``,
``"default"`` (kernels JAX would refuse) or ``"off"`` (version 1: a bool, ``--infer`` given).
Version 3: each variant's ``implicit`` and ``cheaper`` findings (with ``implicit_count``,
``implicit_bytes``, ``cheaper_count``, ``savable_bytes``), ``backend``, ``link`` and ``est_seconds``
(also on each collective), and the document's ``communication_findings`` (what
``--strict-communication`` fails on)."""

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_ENVIRONMENT = 0, 1, 2, 3
EXIT_CODES = {
    EXIT_OK: "the audit ran (with --strict: and found nothing)",
    EXIT_FINDINGS: "--strict found a defensive collective, a kernel without a rule or a kernel_named "
                   "rule that matched nothing; --strict-communication found an implicit collective or one "
                   "with a cheaper equivalent; or a step failed to trace, compile or run; or an "
                   "internal error",
    EXIT_USAGE: "usage error: bad arguments, a TARGET that cannot be loaded, or an --html FILE that "
                "cannot be written",
    EXIT_ENVIRONMENT: "environment: unsupported JAX version, or JAX already started with too few devices",
}
HELP_WIDTH = 100  # --help fits these columns (fewer on a narrower terminal)
_EXIT_HELP = "exit codes:\n" + "\n".join(
    textwrap.fill(text, HELP_WIDTH - 2, initial_indent=f"  {code}  ", subsequent_indent="     ")
    for code, text in EXIT_CODES.items())


def _formatter(prog: str) -> argparse.HelpFormatter:
    """argparse's formatter with raw description and epilog (wrapped here), at most :data:`HELP_WIDTH` wide."""
    width = min(shutil.get_terminal_size().columns, HELP_WIDTH) - 2  # argparse's own margin
    return argparse.RawDescriptionHelpFormatter(prog, width=max(width, 40))


class _Failure(Exception):
    """Ends the command with a one-paragraph message and an exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def version_text() -> str:
    """``reprules 0.1.0 (JAX 0.12.0.1, jaxlib 0.12.0.1, Python 3.12.1)``; imports no JAX."""
    py = ".".join(map(str, sys.version_info[:3]))
    return (f"reprules {_dist_version('reprules')} (JAX {_dist_version('jax')}, "
            f"jaxlib {_dist_version('jaxlib')}, Python {py})")


def _parser() -> argparse.ArgumentParser:
    raw = _formatter
    parser = argparse.ArgumentParser(
        prog="reprules", description="Replication rules for Pallas kernels inside jax.shard_map.",
        epilog=_EXIT_HELP, formatter_class=raw)
    parser.add_argument("--version", action="version", version=version_text(),
                        help="print the reprules, JAX and jaxlib versions and exit")
    sub = parser.add_subparsers(dest="command")
    audit = sub.add_parser(
        "audit", help="report the collectives of training steps: defensive vs needed",
        formatter_class=raw,
        description="Audit the collectives of training steps. With no TARGET, audits the bundled\n"
        "workloads (JAX #21855, a tensor-parallel MLP with a Pallas matmul, JAX's Pallas\n"
        "layer_norm), checking off vs reprules.",
        epilog="TARGET: `module[:callable]` or `path/to/file.py[:callable]` (callable: `audit_step`\n"
        "when left out; a file is run as a module of its own). The callable returns\n"
        "(step, args), (step, args, kwargs), or a mapping with 'step', 'args' and optional\n"
        "'kwargs', 'name', 'reference' (a zero-argument callable giving the expected output).\n"
        "If it takes a `check` argument,\n"
        "it is called with check=False (shard_map checking off) and check=True (checking on,\n"
        "rules registered) and the two steps are compared; otherwise its step is audited as\n"
        "given.\n\n" + _EXIT_HELP)
    audit.add_argument("target", nargs="?",
                       help="module[:callable] or path/to/file.py[:callable] (default callable: audit_step) "
                            "returning (step, args)")
    audit.add_argument("--json", action="store_true",
                       help=f"print one JSON document on stdout (schema_version {SCHEMA_VERSION})")
    audit.add_argument("--html", metavar="FILE",
                       help="also write the report as one self-contained HTML page (charts, tables)")
    audit.add_argument("--infer", action="store_true",
                       help="run the reprules side under reprules.inference(): kernels without a rule "
                            "get one derived from their body")
    audit.add_argument("--strict", action="store_true",
                       help="exit 1 on defensive collectives, kernels without a rule, or kernel_named "
                            "rules that matched nothing")
    _communication.add_arguments(audit)
    audit.add_argument("--devices", type=int, default=DEFAULT_DEVICES,
                       help=f"fake CPU devices to provide (default {DEFAULT_DEVICES})")
    audit.add_argument("--quiet", action="store_true", help="no progress on stderr")
    audit.add_argument("--traceback", action="store_true",
                       help="on an unexpected error, show Python's traceback (for bug reports)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``reprules`` console script; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)  # argparse itself exits 2 on bad arguments, 0 after --version
    if args.command != "audit":
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    progress = _Progress(sys.stderr, enabled=not args.quiet)
    try:
        _check_html_path(args.html)
        link = _link(args.link)
        _provide_devices(args.devices, default_run=args.target is None)
        with _link_model.using(link):
            if args.target is None:
                return _audit_default(args, progress)
            return _audit_target(args, progress)
    except _Failure as err:
        progress.end_line()
        print(f"reprules audit: error: {err}", file=sys.stderr)
        return err.code
    except UnsupportedJaxError as err:
        progress.end_line()
        print(f"reprules audit: error: {err}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    except Exception as err:
        if args.traceback:
            raise
        progress.end_line()
        print(f"reprules audit: internal error: {type(err).__name__}: {err}\n"
              "Why: this is a bug in reprules, or an environment it does not expect.\n"
              "Fix: rerun with --traceback and report the output.", file=sys.stderr)
        return EXIT_FINDINGS


def _link(text: str | None) -> _link_model.Link | None:
    """The ``--link`` interconnect, or None for the backend's default."""
    try:
        return _communication.link_arg(text)
    except ValueError as err:
        raise _Failure(f"--link: {err}.\nWhy: it names the interconnect of the time estimates.\n"
                       "Fix: e.g. --link nvlink, or --link 100 for 100 GB/s per device.", EXIT_USAGE) from None


def _check_html_path(path: str | None) -> None:
    """Fails before the audit runs when ``--html FILE`` cannot be written."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    problem = ""
    if os.path.isdir(path):
        problem = "it is a directory"
    elif not os.path.isdir(folder):
        problem = f"the directory {folder} does not exist"
    elif not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        problem = "it is not writable"
    if problem:
        raise _Failure(f"Cannot write the HTML report to {path!r}: {problem}.\n"
                       "Why: --html writes one file, and the audit checks it can before it runs.\n"
                       "Fix: pass a file path in an existing, writable directory, e.g. --html audit.html.",
                       EXIT_USAGE)


def _inferring(on: bool) -> contextlib.AbstractContextManager[None]:
    return reprules.inference() if on else contextlib.nullcontext()


def _provide_devices(n: int, *, default_run: bool) -> None:
    """Sets XLA_FLAGS for ``n`` CPU devices, or checks a started backend has them."""
    if n < 1:
        raise _Failure(f"--devices must be at least 1, got {n}.\nWhy: JAX needs at least one device.\n"
                       "Fix: pass e.g. --devices 8.", EXIT_USAGE)
    if _environment.backend_started():
        import jax

        if default_run and jax.device_count() < n:
            raise _Failure(
                f"JAX already started with {jax.device_count()} devices; the audit needs {n}.\n"
                "Why: the number of fake CPU devices is fixed when JAX's backend starts.\n"
                "Fix: run `reprules audit` in a fresh process (python -m reprules audit).",
                EXIT_ENVIRONMENT)
        return
    _environment.request_cpu_devices(n, cpu_only=default_run)


class _Progress:
    def __init__(self, stream: TextIO, enabled: bool):
        self.stream, self.enabled, self.open = stream, enabled, False

    def __call__(self, text: str, end: str = "\n") -> None:
        if self.enabled:
            print(text, end=end, file=self.stream, flush=True)
            self.open = end != "\n"

    def end_line(self) -> None:
        """Ends a progress line left open, so an error starts on its own line."""
        if self.open:
            self("")


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

    from reprules import testing  # lazy: imports JAX
    from reprules._audit import _coverage

    report = testing.collectives(step, *args, **kwargs)
    coverage = _coverage.of_step(step, args, kwargs)  # same registry state and mode as the report
    error = None
    if reference is not None:
        out = jax.jit(lambda *a: step(*a, **kwargs))(*args)
        error = _max_error(out, reference)
    return {"report": report, "max_error": error, "inference": _mode_state.inference_mode(),
            "coverage": tuple(_coverage.lookup(coverage, k) for k in report.kernels)}


def _kernel_dict(kernel: Any, coverage: Any) -> dict[str, Any]:
    return {**kernel.to_dict(), "covered_by": coverage.covered_by,
            "inference": None if coverage.inference is None else dict(coverage.inference)}


def _summary(v: dict[str, Any]) -> dict[str, Any]:
    report = v["report"]
    return {
        "function": report.function,
        "mesh": dict(report.mesh),
        "collectives": [c.to_dict() for c in report.collectives],
        "kernels": [_kernel_dict(k, c) for k, c in zip(report.kernels, v["coverage"])],
        "count": len(report.select()),  # dead ones (only in the jaxpr: they never run) left out
        "bytes": report.bytes(),
        "defensive_count": len(report.defensive),
        "defensive_bytes": sum(c.step_bytes for c in report.defensive),
        # Schema 4: bytes each device sends (ring algorithms), split into needed and defensive parts.
        "sent_bytes": report.sent_bytes(),
        "needed_count": len(report.with_needed_part),
        "needed_sent_bytes": report.needed_sent_total,
        "defensive_sent_bytes": report.defensive_sent_total,
        "dead_count": len(report.dead_collectives),
        "kernels_with_rules": sum(1 for k in report.kernels if k.has_rule),
        "kernels_total": len(report.kernels),
        "max_error": v["max_error"],
        **_communication.summary(report),  # implicit and cheaper collectives, time estimates (schema 3)
    }


def _no_rule_text(kernel: Any) -> str:
    return "has no rule" if kernel.identified else f"was not identified ({kernel.status()})"


def _unmatched_names() -> list[dict[str, str]]:
    """``kernel_named`` rules that no kernel traced so far has matched."""
    out = []
    for reg in _registry.unmatched_names():
        kernel = reg.kernel()
        out.append({"name": getattr(kernel, "qualified", reg.where), "rule": repr(reg.rule), "source": reg.source})
    return out


def _strict_findings(entries: list[dict[str, Any]], unmatched: list[dict[str, str]]) -> list[str]:
    """Defensive collectives and rule-less kernels on the reprules side (or the one given step), and
    ``kernel_named`` rules, other than a pack's, that matched no kernel."""
    found = []
    for e in entries:
        v = e.get("on") or e.get("given")
        if v is not None:
            rep = v["report"]
            found += [f"{e['name']}: {c.describe()}" for c in rep.defensive]
            found += [f"{e['name']}: kernel {k.name} {_no_rule_text(k)}" for k in rep.kernels_without_rule]
    found += [f"kernel_named({u['name']!r}) matched no kernel ({_text.short_source(u['source'])})"
              for u in unmatched if not u["source"].startswith("pack ")]
    return found


def _inference_mode(entries: list[dict[str, Any]], infer: bool) -> str:
    """The inference mode of the reprules side (or the step as given), as its trace saw it: the one
    source of the mode line of the text, JSON and HTML reports, and of each kernel's ``covered by``."""
    for e in entries:
        v = e.get("on") or e.get("given")
        if v is not None:
            return str(v["inference"])
    return "all" if infer else _mode_state.inference_mode()  # that side failed before it was traced


def _document(support: dict[str, str], devices: int, target: str | None, mesh: dict[str, int] | None,
              entries: list[dict[str, Any]], findings: list[str], infer: bool,
              unmatched: list[dict[str, str]]) -> dict[str, Any]:
    """The ``--json`` document (layout :data:`SCHEMA_VERSION`)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "reprules": reprules.__version__, "jax": support["jax"], "regime": support["regime"],
        "devices": devices, "target": target, "mesh": mesh, "inference": _inference_mode(entries, infer),
        "workloads": [
            {"name": e["name"], "title": e["title"], "error": e.get("error"),
             **{k: _summary(e[k]) for k in ("off", "on", "given") if k in e}}
            for e in entries],
        "unmatched_kernel_names": unmatched,
        "strict_findings": findings,
    }


def _finish(args: argparse.Namespace, text: str, doc: dict[str, Any], failed: bool,
            findings: list[str], progress: _Progress) -> int:
    doc["communication_findings"] = _communication.findings(doc)
    if args.html is not None:
        try:
            with open(args.html, "w", encoding="utf-8") as page:
                page.write(_html.render(doc))
        except OSError as err:
            raise _Failure(f"Cannot write the HTML report to {args.html!r}: {err}.\n"
                           "Why: --html writes the whole report to that file.\n"
                           "Fix: pass a file path in an existing, writable directory.", EXIT_USAGE) from None
        progress(f"wrote {args.html}")
    print(json.dumps(doc, indent=2) if args.json else text)
    if failed:
        return EXIT_FINDINGS
    communication = args.strict_communication and doc["communication_findings"]
    if communication:
        found = doc["communication_findings"]
        print(f"reprules audit --strict-communication: {len(found)} finding{'s' if len(found) > 1 else ''}:",
              file=sys.stderr)
        for f in found:
            print(f"  {_text.clip(f, _text.WIDTH - 2)}", file=sys.stderr)
    if args.strict and findings:
        print(f"reprules audit --strict: {len(findings)} finding{'s' if len(findings) > 1 else ''}:",
              file=sys.stderr)
        for f in findings:
            print(f"  {_text.clip(f, _text.WIDTH - 2)}", file=sys.stderr)
        return EXIT_FINDINGS
    return EXIT_FINDINGS if communication else EXIT_OK


def _header(support: dict[str, str], devices: int, what: str, infer: bool, mode: str) -> list[str]:
    lines = [f"reprules audit of {what}: JAX {support['jax']} ({support['regime']} regime), {devices} devices",
             f"mode: {_mode_state.INFERENCE_TEXT[mode]}",
             "collectives per training step, bytes per device (full detail: --json, --html)"]
    if infer:
        lines.append("--infer: the reprules side runs under reprules.inference() (rules derived from kernel bodies)")
    return lines


def _audit_default(args: argparse.Namespace, progress: _Progress) -> int:
    import jax


    support = reprules.jax_support()
    progress(f"reprules {reprules.__version__} audit: JAX {support['jax']} ({support['regime']} regime), "
             f"{jax.device_count()} {jax.default_backend().upper()} devices, mesh "
             f"{workloads.MESH_SHAPE} {workloads.MESH_AXES}")
    mesh = workloads.make_mesh()
    results, failed = [], False
    cases = workloads.DEFAULT_CASES
    for i, case in enumerate(cases, 1):
        start = time.perf_counter()
        progress(f"[{i}/{len(cases)}] {case.name}: ", end="")
        entry: dict[str, Any] = {"name": case.name, "title": case.title}
        try:
            kernels = case.kernels()
            reference = case.reference()
            before = {k: reg.rule for k in kernels if (reg := _registry.lookup(k)) is not None}  # packs
            for k in kernels:  # "off" is what users run today: no rules
                reprules.unregister(k)
            progress("checking off ... ", end="")
            built = case.build(mesh, False)
            entry["off"] = _variant(built.step, built.args, {}, reference)
            progress("reprules ... ", end="")
            for k in kernels:  # with --infer, only the rules that were there: inference does the rest
                if k in before or not args.infer:
                    reprules.replication_rule(before.get(k))(k)
            try:
                with _inferring(args.infer):
                    built = case.build(mesh, True)
                    entry["on"] = _variant(built.step, built.args, {}, reference)
            finally:
                for k in kernels:
                    if k not in before:
                        reprules.unregister(k)
            progress(f"done ({time.perf_counter() - start:.1f} s)")
        except reprules.UnsupportedJaxError:
            raise
        except Exception as err:  # one broken workload must not hide the others
            failed = True
            entry["error"] = f"{type(err).__name__}: {err}"
            progress(f"FAILED ({type(err).__name__})")
        results.append(entry)

    unmatched = _unmatched_names()
    findings = _strict_findings(results, unmatched)
    devices = jax.device_count()
    doc = _document(support, devices, None, dict(zip(workloads.MESH_AXES, workloads.MESH_SHAPE)),
                    results, findings, args.infer, unmatched)
    text = "" if args.json else _text.render(
        _header(support, devices, "the bundled workloads", args.infer, doc["inference"]), results,
        notes=_text.unmatched_notes(unmatched))
    return _finish(args, text, doc, failed, findings, progress)


def _audit_target(args: argparse.Namespace, progress: _Progress) -> int:
    import jax

    support = reprules.jax_support()
    sys.path.insert(0, os.getcwd())
    progress(f"reprules {reprules.__version__} audit of {args.target}: JAX {jax.__version__}, "
             f"{jax.device_count()} devices")
    progress("loading target ... ", end="")
    try:
        factory = protocol.resolve(args.target)
    except protocol.TargetError as err:
        raise _Failure(str(err), EXIT_USAGE) from None
    variants: list[tuple[str, bool | None]] = [("off", False), ("on", True)] if factory.takes_check \
        else [("given", None)]
    entry: dict[str, Any] = {"name": factory.name, "title": args.target}
    failed = False
    for i, (key, check) in enumerate(variants):
        progress(("; " if i else "") + f"{_text.LABELS[key]} ... ", end="")
        start = time.perf_counter()
        try:
            target = protocol.build(factory, check)
        except protocol.TargetError as err:
            raise _Failure(str(err), EXIT_USAGE) from None
        except reprules.UnsupportedJaxError:
            raise
        except Exception as err:
            raise _Failure(f"{args.target}{'' if check is None else f'(check={check})'} raised "
                           f"{type(err).__name__}: {err}\n"
                           "Why: the audit calls it to build the step.\n"
                           "Fix: make it return the step without raising (try it in Python).",
                           EXIT_FINDINGS) from None
        entry["name"] = target.name
        try:
            reference = target.reference() if target.reference is not None else None
            with _inferring(args.infer and key != "off"):
                entry[key] = _variant(target.step, target.args, dict(target.kwargs), reference)
            progress(f"done ({time.perf_counter() - start:.1f} s)", end="")
        except reprules.UnsupportedJaxError:
            raise
        except Exception as err:
            failed = True
            entry["error"] = f"{_text.LABELS[key]}: {type(err).__name__}: {err}"
            progress(f"FAILED ({type(err).__name__})", end="")
            break
    progress("")

    unmatched = _unmatched_names()
    findings = _strict_findings([entry], unmatched)
    devices = jax.device_count()
    doc = _document(support, devices, args.target, None, [entry], findings, args.infer, unmatched)
    text = ""
    if not args.json:
        notes = _text.unmatched_notes(unmatched)
        if not factory.takes_check:
            notes.append(f"note: {args.target} takes no `check` argument, so its step was audited as "
                         "given. To compare checking off with reprules, let it take one "
                         f"(`def {factory.name.rsplit('.', 1)[-1]}(check=True)`) and pass it to "
                         "shard_map (check_vma, or check_rep on JAX <= 0.5).")
        last = entry.get("on") or entry.get("given") or entry.get("off")  # "off" when "on" failed
        text = _text.render(_header(support, devices, args.target, args.infer, doc["inference"]), [entry], notes,
                                  fixes=last["report"] if last else None)
    if failed:  # the report (text or JSON) has the whole message
        print(f"reprules audit: error: {args.target}: the step failed, {entry['error'].split(chr(10))[0]}",
              file=sys.stderr)
    return _finish(args, text, doc, failed, findings, progress)
