"""Coverage, reproducible: every op of the kernel libraries reprules has packs for, measured on CPU.

    python .ci/coverage/run.py                         # every library installed; Markdown to stdout
    python .ci/coverage/run.py jax ejkernel --json coverage.json
    python .ci/coverage/run.py jax --op layer_norm     # one op (repeatable)
    python -m nox -s coverage                          # the same, in its own environment
    python -m nox -s coverage_pinned                   # tpu_inference and deltanet (they pin JAX 0.11.2)

Setting: 8 fake CPU devices, a (4, 2) ``("data", "model")`` mesh, batch/tokens on
``data``, heads or experts on ``model``, weights replicated; TPU kernels in TPU
interpret mode (``pltpu.force_tpu_interpret_mode()``) or the op's own
``interpret=True``. Each op runs in its own process (a timeout catches the
interpreter's hangs), in four modes (``measure.py``): unsharded reference,
``check=False``, ``check=True`` with only ``import reprules``, and under
``reprules.inference()``. The table's columns:

* runs on CPU: the op ran unsharded or with checking off (else the first line of its error);
* off vs reference: relative error ``max|a - b| / max|b|`` of the forward / gradients;
* import reprules only, under inference(): ``exact`` (the reference within the op's
  tolerance, checking off within 1e-6), ``refused`` (an error where checking off ran:
  its type, who raised it, where, why), ``fails as off`` (the same error as checking
  off), ``wrong`` (ran, values differ); Δref / Δoff are the errors (forward / gradients);
* defensive all-reduces: in the checked gradient (or forward), checking off → on.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
LIBRARIES = {  # name -> (case module, import name that says it is installed, title)
    "jax": ("cases_jax", "jax", "JAX's Pallas ops (`jax.experimental.pallas.ops`)"),
    "ejkernel": ("cases_ejkernel", "ejkernel", "ejkernel (`ejkernel.kernels._pallas.tpu`)"),
    "tokamax": ("cases_tokamax", "tokamax", "tokamax"),
    "maxtext": ("cases_maxtext", "maxtext", "MaxText's kernels (`maxtext.kernels`)"),
    "warp": ("cases_warp", "warp", "NVIDIA Warp (`wp.jax_kernel`, `wp.jax_callable`)"),
    "kups": ("cases_kups", "kups", "kups (`kups.core.utils.segment`)"),
    "recurrentgemma": ("cases_recurrentgemma", "recurrentgemma", "recurrentgemma (`recurrentgemma.jax.pallas`)"),
    "levanter": ("cases_levanter", "levanter", "Levanter (`levanter.kernels.pallas.fused_cross_entropy_loss`)"),
    # These two pin JAX 0.11.2: nox session coverage_pinned.
    "tpu_inference": ("cases_tpu_inference", "tpu_inference", "tpu-inference (`tpu_inference.kernels`)"),
    "deltanet": ("cases_deltanet", "deltanet_tpu", "deltanet-tpu (`deltanet_tpu`)"),
    "flash_attn2": ("cases_flash_attn2", "jax_flash_attn2", "jax-flash-attn2 (`create_flash_attention`, Pallas platform)"),
    "augax": ("cases_augax", "augax", "augax (`pg_sample`, `ks_sample`: XLA FFI)"),
}
DISTRIBUTIONS = {"warp": "warp-lang", "levanter": "marin-levanter", "tpu_inference": "tpu-inference",
                 "deltanet_tpu": "deltanet-tpu", "jax_flash_attn2": "jax-flash-attn2"}  # import name -> distribution, where they differ
TIMEOUT_S = 300


def _cases_module(library: str):
    sys.path.insert(0, str(HERE))
    return importlib.import_module(LIBRARIES[library][0])


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


# --- the child: one op, one process ---------------------------------------------------------------


def child(library: str, op: str, out: str) -> None:
    import reprules.testing

    reprules.testing.fake_cpu_devices(8)  # before JAX starts
    import reprules  # the only line a user writes: packs load themselves

    import measure

    cases = _cases_module(library)
    row: dict = {"library": library, "op": op}
    start = time.perf_counter()
    try:
        case = cases.CASES[op]()
    except measure.NotAvailable as why:
        row["unavailable"] = str(why)
    else:
        row.update(measure.measure(case))
    row["packs"] = sorted(f"{p.name} ({p.state})" for p in reprules.packs() if p.state != "waiting")
    row["seconds"] = round(time.perf_counter() - start, 1)
    pathlib.Path(out).write_text(json.dumps(row, default=str))


# --- the parent: every op in its own process --------------------------------------------------------


def _crash_reason(stderr: str, code: int) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("Fatal Python error") or (":" in ln and ln.split(":")[0].endswith(("Error", "Exception"))):
            return ln[:160]
    return f"exit code {code}" + (f" (signal {-code})" if code < 0 else "")


def run_one(library: str, op: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp, "row.json")
        start = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, str(HERE / "run.py"), "--child", library, op, str(out)],
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"library": library, "op": op, "seconds": round(time.perf_counter() - start, 1),
                    "runs_on_cpu": {"yes": False, "why": f"hangs: no result in {timeout:.0f} s (killed)"}}
        if out.exists():
            return json.loads(out.read_text())
        return {"library": library, "op": op, "seconds": round(time.perf_counter() - start, 1),
                "runs_on_cpu": {"yes": False, "why": "crashes: " + _crash_reason(done.stderr, done.returncode)},
                "stderr_tail": done.stderr[-3000:]}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _short_warning(text: str) -> str:
    """``ReplicationWarning on 'kernel'`` (the JSON has the whole first line)."""
    import re

    found = re.match(r"^(\w+): .*?'([^']+)'", text)
    return f"{found.group(1)} on '{found.group(2)}'" if found else text[:100]


def markdown(library: str, rows: list, version: str | None) -> str:
    import measure

    title = LIBRARIES[library][2]
    head = f"### {title}" + (f" {version}" if version and library != "jax" else "")
    if version is None:
        return f"{head}\n\nnot installed: its ops were not run.\n"
    lines = [head, "",
             "| op | runs on CPU | off vs reference (fwd / grad) | import reprules only | under inference() "
             "| defensive all-reduces off → on (inference) | notes |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "unavailable" in r:
            lines.append(f"| `{r['op']}` | – | – | – | – | – | not in this version: {_cell(r['unavailable'])} |")
            continue
        modes = r.get("modes", {})
        runs = r["runs_on_cpu"]
        runs_cell = "yes" if runs["yes"] else f"no: {runs['why']}"
        off = modes.get("off", {})
        off_cell = (measure.fmt_pair(off.get("fwd_vs_ref"), off.get("grad_vs_ref"))
                    if "fwd_vs_ref" in off else "–")
        on, inf = modes.get("on", {}), modes.get("infer", {})
        d = lambda m: "–" if "defensive" not in m else str(m["defensive"])  # noqa: E731
        defensive = f"{d(off)} → {d(on)} ({d(inf)})" if modes else "–"
        notes = [r.get("note", "")] + sorted({_short_warning(w) for w in on.get("warnings", []) + inf.get("warnings", [])})
        if modes.get("ref", {}).get("error"):
            e = modes["ref"]["error"]
            notes.append(f"unsharded reference fails: {e['type']}: {e['message']}")

        def result(m):  # where the op does not run, "fails as off" without repeating the why
            o = m.get("outcome")
            return "fails as off" if not runs["yes"] and o and o["kind"] == "fails as off" else measure.cell_outcome(o)

        lines.append("| " + " | ".join(_cell(c) for c in (
            f"`{r['op']}`", runs_cell, off_cell, result(on), result(inf),
            defensive, "; ".join(n for n in notes if n))) + " |")
    return "\n".join(lines) + "\n"


def _kind(row: dict, mode: str) -> str:
    return row.get("modes", {}).get(mode, {}).get("outcome", {}).get("kind", "")


def overview(rows: list) -> str:
    """One line per library: the README's table."""
    lines = ["| library | ops tried | run on CPU | exact, only `import reprules` | exact, under `inference()` "
             "| refused | fails as with checking off | wrong |", "|---|---|---|---|---|---|---|---|"]
    for library in LIBRARIES:
        mine = [r for r in rows if r.get("library") == library and "unavailable" not in r and "runs_on_cpu" in r]
        if not mine:
            continue
        on_cpu = [r for r in mine if r["runs_on_cpu"]["yes"]]
        count = lambda mode, kind: sum(1 for r in on_cpu if _kind(r, mode).startswith(kind))  # noqa: E731
        lines.append(f"| {library} | {len(mine)} | {len(on_cpu)} | {count('on', 'exact')} | {count('infer', 'exact')} "
                     f"| {count('on', 'refused')} | {count('on', 'fails as off')} | {count('on', 'wrong')} |")
    return "\n".join(lines) + "\n"


def summary(rows: list) -> str:
    ran = [r for r in rows if "unavailable" not in r and "runs_on_cpu" in r]
    on_cpu = [r for r in ran if r["runs_on_cpu"]["yes"]]
    exact = lambda mode: sum(  # noqa: E731
        1 for r in on_cpu if r["modes"].get(mode, {}).get("outcome", {}).get("kind", "").startswith("exact"))
    return (f"{len(ran)} ops: {len(on_cpu)} run on CPU; checked and exact with only `import reprules`: "
            f"{exact('on')}; under `reprules.inference()`: {exact('infer')}.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("libraries", nargs="*", metavar="LIBRARY",
                        help=f"libraries to cover: {', '.join(LIBRARIES)} (default: all)")
    parser.add_argument("--except", dest="excluded", action="append", default=[], metavar="LIBRARY",
                        help="not this library (repeatable; the coverage session leaves coverage_pinned's to it)")
    parser.add_argument("--op", action="append", help="only this op (repeatable)")
    parser.add_argument("--json", metavar="FILE", help="write every row, with all numbers, to FILE")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per op (default %(default)s)")
    parser.add_argument("--render", metavar="FILE", help="print the tables of a --json FILE, running nothing")
    parser.add_argument("--child", nargs=3, metavar=("LIBRARY", "OP", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    if args.render:
        data = json.loads(pathlib.Path(args.render).read_text())
        print(render(data["setting"], data["rows"], data.get("versions", {}), data.get("seconds")))
        return 0
    unknown = [lib for lib in [*args.libraries, *args.excluded] if lib not in LIBRARIES]
    if unknown:
        parser.error(f"unknown libraries {unknown}: choose from {list(LIBRARIES)}")
    sys.path.insert(0, str(HERE))
    libraries = [lib for lib in args.libraries or LIBRARIES if lib not in args.excluded]
    all_rows = []
    start = time.perf_counter()
    header = (f"JAX {_version('jax')}, jaxlib {_version('jaxlib')}, reprules {_version('reprules')}, "
              f"Python {platform.python_version()}, CPU ({platform.machine()}), 8 fake devices, "
              f"(4, 2) mesh (\"data\", \"model\")")
    versions = {}
    for library in libraries:
        package = LIBRARIES[library][1]
        installed = importlib.util.find_spec(package) is not None
        # Warp's distribution is warp-lang, imported as warp.
        versions[library] = _version(DISTRIBUTIONS.get(package, package)) if installed else None
        if not installed:
            continue
        for op in _cases_module(library).CASES:
            if args.op and op not in args.op:
                continue
            print(f"[coverage] {library} {op} ...", file=sys.stderr, flush=True)
            row = run_one(library, op, args.timeout)
            print(f"[coverage]   {row.get('seconds', '?')} s", file=sys.stderr, flush=True)
            all_rows.append({**row, "library": library})
    seconds = round(time.perf_counter() - start)
    print(render(header, all_rows, versions, seconds))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"setting": header, "versions": versions, "seconds": seconds, "rows": all_rows}, indent=1, default=str))
    return 0


def render(header: str, rows: list, versions: dict, seconds: float | None) -> str:
    import measure

    for r in rows:  # from the measurements (a --json file from an older script included)
        if r.get("modes"):
            r["runs_on_cpu"] = measure.runs_on_cpu(r["modes"])
            for mode in ("on", "infer"):
                if mode in r["modes"]:
                    r["modes"][mode]["outcome"] = measure.outcome(r["modes"], mode, r["tol"])
    out = [f"Coverage: {header}\n", overview(rows)]
    libraries = list(versions) or list(dict.fromkeys(r["library"] for r in rows))
    for library in libraries:
        version = versions.get(library, "")
        out.append(markdown(library, [r for r in rows if r.get("library") == library], version))
    out.append(summary(rows))
    if seconds is not None:
        out.append(f"\n(whole run: {seconds:.0f} s)")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
