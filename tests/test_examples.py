"""Every script in examples/ runs on CPU with fake devices and says what it should.

Each example runs in a fresh interpreter (the same one as the tests), sets up
its own 8 fake CPU devices (``reprules.testing.fake_cpu_devices``, replacing
another count given in ``XLA_FLAGS``) and exits non-zero when its own check
fails; here we also check what it printed. ``06_test_with_fixture.py`` is a
pytest file and is run with pytest. The benchmark gets a smoke run (tiny
shapes, two rounds): its collective figures are checked, its timings are not.
An example that cannot run here (an Equinox too old for this JAX) prints
``SKIPPED: <why>`` and the test is skipped with that reason. An example whose
optional dependency (the extra ``reprules[examples]``) is not installed says
what to install, in one line, and exits 1: checked here with the import
blocked.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from helpers import JAX_VERSION

ROOT = pathlib.Path(__file__).parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("[0-9][0-9]_*.py"))
HAS_FFI = JAX_VERSION >= (0, 4, 31)


def run(args, timeout=600):
    # Each script provides its own 8 devices, replacing the count it inherits.
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    result = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                            cwd=ROOT, env=env)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


# The examples that need an optional dependency, and the module each needs.
OPTIONAL = {"04_equinox.py": "equinox", "06_test_with_fixture.py": "pytest"}


@pytest.mark.parametrize("script", sorted(OPTIONAL))
def test_missing_dependency_is_one_line(script):
    """Without its optional dependency an example says what to install: one line, no traceback, exit 1."""
    path, module = ROOT / "examples" / script, OPTIONAL[script]
    # sys.modules[name] = None makes `import name` raise ModuleNotFoundError, as if not installed.
    block = (f"import runpy, sys; sys.modules[{module!r}] = None; sys.argv = [{str(path)!r}]; "
             f"runpy.run_path({str(path)!r}, run_name='__main__')")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    result = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=600,
                            cwd=ROOT, env=env)
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 1, lines
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith(f"{script} needs ") and f"pip install {module} " in lines[0], lines
    # reprules is not on PyPI: the extra is installed from the clone
    assert "pip install '.[examples]' in the reprules clone" in lines[0] and "reprules[" not in lines[0], lines


# The examples with a training step, each an audit target (`audit_step(check=True)`); 03 has none.
AUDITED = ["01_issue21855.py", "02_mlp_three_ways.py", "04_equinox.py", "05_primitive_and_ffi.py",
           "06_test_with_fixture.py"]


def test_every_example_with_a_training_step_is_an_audit_target():
    for path in EXAMPLES:
        assert ("def audit_step(check=True" in path.read_text()) == (path.name in AUDITED), path.name
        if path.name in AUDITED:
            assert f"reprules audit examples/{path.name}" in path.read_text(), path.name


@pytest.mark.parametrize("script", AUDITED)
def test_reprules_audit_of_the_example(script, capsys):
    """Issue 36: `reprules audit examples/01_issue21855.py` works; checking off pays a defensive
    all-reduce, reprules none, with the same gradients."""
    from reprules._audit import _cli

    if script == "04_equinox.py":
        eqx = pytest.importorskip("equinox", exc_type=Exception)
        if not hasattr(eqx, "filter_shard"):
            pytest.skip("equinox has no filter_shard (added in 0.11)")
    path = f"examples/{script}"
    old = os.getcwd()
    os.chdir(ROOT)
    try:
        code = _cli.main(["audit", path, "--json", "--quiet"])
    finally:
        os.chdir(old)
    out, err = capsys.readouterr()
    assert code == 0, err
    (w,) = json.loads(out)["workloads"]
    assert w["error"] is None, w["error"]
    assert w["off"]["defensive_count"] >= 1 and w["on"]["defensive_count"] == 0, w
    assert w["on"]["max_error"] is None or w["on"]["max_error"] < 1e-4
    if script == "01_issue21855.py":
        # The replicated weight's gradient: one all-reduce over (data, model) with checking off,
        # needed over data, defensive over model; with reprules, the same all-reduce over data alone.
        (split,) = [c for c in w["off"]["collectives"] if c["needed_axes"] and c["defensive"]]
        (alone,) = [c for c in w["on"]["collectives"] if c["axes"] == ["data"] and not c["dead"]]
        assert sorted(split["axes"]) == ["data", "model"] and split["replicated_axes"] == ["model"], split
        assert split["needed_sent_bytes"] == alone["sent_bytes"] == 1536  # 2 * 3/4 * the 1024 B buffer
        assert split["defensive_sent_bytes"] == split["sent_bytes"] - 1536 == 256  # 2 * 7/8 * 1024 - 1536
        assert w["off"]["defensive_sent_bytes"] == 1024 + 256  # x's all-reduce over 'model', then w's part


def rows(stdout, names):
    """{name: the tokens after it} for output lines that start with one of ``names``."""
    found = {}
    for line in stdout.splitlines():
        for name in names:
            if line.startswith(name) and line[len(name):len(name) + 1] in (" ", ""):
                found[name] = line[len(name):].split()
    missing = [n for n in names if n not in found]
    assert not missing, f"no output line for {missing}:\n{stdout}"
    return found


def test_every_example_is_checked():
    assert {p.name[:2] for p in EXAMPLES} == {"01", "02", "03", "04", "05", "06"}


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(script):
    if script.name.startswith("06_"):  # a pytest file: run it as a user would
        out = run(["-m", "pytest", script, "-q", "-p", "no:cacheprovider", "--reprules-cpu-devices", "8"])
        assert "3 passed" in out, out
        return
    out = run([script])
    if out.startswith("SKIPPED:"):
        assert script.name.startswith("04_") and out.startswith("SKIPPED: equinox"), out  # only for Equinox
        pytest.skip(f"{script.name}: {out.strip()}")
    check = CHECKS.get(script.name[:2])
    assert check is not None, f"{script.name} has no output check in tests/test_examples.py"
    check(out)


def check_01(out):
    r = rows(out, ["checking off", "reprules inferred, checking on", "reprules, checking on"])
    assert r["checking off"][:3] == ["1", "1", "1"]
    assert r["reprules inferred, checking on"] == ["0", "0", "0", "0.0e+00"]
    assert r["reprules, checking on"] == ["0", "0", "0", "0.0e+00"]


def check_02(out):
    r = rows(out, ["data parallel", "FSDP", "tensor parallel"])
    for way, tokens in r.items():
        defensive, grad_err, param_err = tokens[-3:]
        assert defensive == "0", (way, out)
        assert float(grad_err) < 1e-4 and float(param_err) < 1e-4, (way, out)
    # 3 layers x (W, b) forward + W again backward; under jax_remat3 the backward pass recomputes
    # the forward pass of the layers before the last, b's gathers with it (these tests' process
    # and the example's share the environment, so the flag)
    gathers = 11 if getattr(jax.config, "jax_remat3", False) else 9
    assert f"{gathers} all-gather" in " ".join(r["FSDP"]), out
    assert "reduce-scatter" in " ".join(r["tensor parallel"]), out
    assert "OK:" in out


def check_03(out):
    names = ["all-gather", "all-gather, overlapped", "all-gather, bidirectional", "psum_scatter",
             "psum_scatter, overlapped", "psum_scatter, bidirectional"]
    r = rows(out, names)
    ppermutes = {name: int(r[name][-3]) for name in names}
    assert ppermutes == {"all-gather": 0, "all-gather, overlapped": 7, "all-gather, bidirectional": 14,
                         "psum_scatter": 0, "psum_scatter, overlapped": 7, "psum_scatter, bidirectional": 14}
    assert all(float(r[n][-1]) < 1e-3 and r[n][-2] == "0" for n in names), out
    assert "OK: every variant equals lhs @ rhs" in out


def check_04(out):
    r = rows(out, ["checking off", "reprules, checking on"])
    assert int(r["checking off"][2]) > 0, out  # defensive bytes: gradients summed over `model` too
    on_data, on_both, defensive, error = r["reprules, checking on"]
    assert int(on_data) > 0 and on_both == "0" and defensive == "0" and float(error) < 1e-4, out
    assert "trained 3 steps with checking on" in out and "OK:" in out


def check_05(out):
    names = ["user primitive, checking off", "user primitive, rule, checking on"]
    if HAS_FFI:
        names += ["FFI kernel, checking off", "FFI kernel, rule, checking on"]
    else:
        assert "FFI kernel: SKIPPED (JAX" in out and "ffi_call" in out, out
    r = rows(out, names)
    for kernel in ("user primitive", "FFI kernel") if HAS_FFI else ("user primitive",):
        assert r[f"{kernel}, checking off"][:2] == ["data,model;", "model"], out
        assert r[f"{kernel}, rule, checking on"][:2] == ["data", "0"], out
    assert "OK:" in out


CHECKS = {"01": check_01, "02": check_02, "03": check_03, "04": check_04, "05": check_05}


def test_benchmark_smoke(tmp_path):
    """The benchmark runs end to end; its collective figures are right (timings are not checked)."""
    out_json = tmp_path / "bench.json"
    out = run([ROOT / "examples" / "benchmarks" / "bench.py", "--small", "--repeats", "2", "--warmup", "1",
               "--lower-repeats", "1", "--lower-inner", "1", "--import-repeats", "1", "--heavy-lower-repeats", "1",
               "--workloads", "activation,tp_mlp,layer_norm,transformer", "--layers", "1", "--out", out_json])
    assert "collectives per step" in out and "targets (reported, not asserted)" in out, out
    assert max(map(len, out.splitlines())) <= 100, [line for line in out.splitlines() if len(line) > 100]
    results = json.loads(out_json.read_text())
    assert results["jax"] == jax.__version__ and results["devices"] == 8
    work = results["workloads"]
    assert set(work) == {"activation", "tp_mlp", "layer_norm", "transformer"}
    # The transformer (1 layer): the formulas of reprules._demo.scale equal the measured
    # bytes, every variant's gradients equal the unsharded reference, inference as reprules.
    formulas = next(t for t in results["targets"] if t["target"].startswith("reprules._demo.scale formulas"))
    assert formulas["met"] is True and set(formulas["value"]) == {"transformer"}, formulas
    tf = work["transformer"]
    assert tf["lower_config"] == {"rounds": 1, "best_of": 1, "warm_first": True, "stack_offsets": 64, "stack_step_bytes": 256}
    assert max(tf["max_error"].values()) < 1e-5, tf["max_error"]
    assert tf["memory"]["reprules"] is None or tf["memory"]["reprules"]["argument"] > 0
    if "inference" in tf["variants"]:
        assert tf["collectives"]["inference"]["bytes"] == tf["collectives"]["reprules"]["bytes"]
    if not HAS_FFI:
        assert "ffi_call" in work["activation"]["skipped"]
    for name, w in work.items():
        if "skipped" in w:
            continue
        c = w["collectives"]
        assert c["reprules"]["defensive_bytes"] == 0, (name, c["reprules"])
        assert c["reprules"]["needed_bytes"] == w["minimum_needed_bytes"], (name, c["reprules"])
        assert c["off"]["defensive_bytes"] > 0, (name, c["off"])
        assert c["reprules"]["defensive_sent_bytes"] == 0 < c["off"]["defensive_sent_bytes"], (name, c)
        assert c["off"]["sent_bytes"] == c["off"]["needed_sent_bytes"] + c["off"]["defensive_sent_bytes"]
        assert set(w["step_s"]) == set(w["variants"]) and w["step_s"]["off"]["n"] == 2
        assert "reprules/off" in w["step_ratio"] and "reprules/off" in w["lower_ratio"]
        # One round (at stack depth 1): its raw times, and its ratio as the one depth's.
        rounds = w["lower_rounds_s"]
        assert set(rounds) == set(w["variants"]) and all(len(t) == 1 for t in rounds.values()), rounds
        assert w["lower_ratio_by_depth"]["reprules/off"] == [rounds["reprules"][0] / rounds["off"][0]]
        if "hand" in w["variants"]:
            assert c["hand"]["defensive_bytes"] == 0 and "reprules/hand" in w["step_ratio"]
        else:
            assert w["unavailable"]["hand"]
    if JAX_VERSION >= (0, 6) and HAS_FFI:  # the FFI call site can be annotated by hand from 0.6
        assert "hand" in work["activation"]["variants"], work["activation"]["unavailable"]
    assert results["import"]["reprules_on_top_of_jax_s"]["n"] == 1


def test_benchmark_wraps_long_lines_and_never_cuts_an_error(capsys):
    """The benchmark's report fits 100 columns; an error is wrapped whole, never cut mid-sentence."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reprules_bench", ROOT / "examples" / "benchmarks" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up
    try:
        spec.loader.exec_module(bench)  # its fake_cpu_devices(8) matches the tests' devices
    finally:
        sys.modules.pop(spec.name, None)
    err = ValueError("Custom VJP bwd rule must produce an output " * 12 + "of the right type.\nWhy: END.\nthird")
    text = bench.first_lines(err)
    assert text.endswith("Why: END.") and "third" not in text, text  # what and why, whole
    bench.say(f"  {'activation':18}{'inference':10}n/a: inference failed: {text}", hang=" " * 28)
    bench.row(f"  {'tp_mlp':18}{'reprules':10}" + "9" * 60, "  (4 in the program)  (512 B added by XLA)")
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= bench.WIDTH == 100, out
    assert " ".join(out.split()).startswith(f"activation inference n/a: inference failed: {text}"), out
    assert out.rstrip().endswith("(4 in the program) (512 B added by XLA)") or \
        " ".join(out.split()).endswith("(4 in the program) (512 B added by XLA)"), out
