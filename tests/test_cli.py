"""``reprules audit``: the default workloads, a user target (off vs on), --json, --html, --infer, --strict,
how each kernel is covered, exit codes."""

import json
import re
import subprocess
import sys
import textwrap

import jax
import pytest
from helpers import BWD_STEPS, NEW_SHARD_MAP

import reprules
from reprules._audit import _cli, _text

TARGET = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental import pallas as pl
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import reprules
    from reprules.testing import shard_map

    def user_copy_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def _copy(x):
        return pl.pallas_call(user_copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)

    @jax.custom_vjp
    def kernel_copy(x):
        return _copy(x)

    kernel_copy.defvjp(lambda x: (_copy(x), None), lambda _, g: (_copy(g),))

    def ruled_copy_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    reprules.replication_rule()(ruled_copy_kernel)  # registered when the module is imported

    def _ruled_copy(x):
        return pl.pallas_call(ruled_copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              interpret=True)(x)

    @jax.custom_vjp
    def ruled_copy(x):
        return _ruled_copy(x)

    ruled_copy.defvjp(lambda x: (_ruled_copy(x), None), lambda _, g: (_ruled_copy(g),))
    W = jnp.asarray(np.random.RandomState(0).randn(8, 128), jnp.float32)

    def audit_step():
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
        x = jax.device_put(jnp.ones((8, 128)), NamedSharding(mesh, P("data", None)))
        f = shard_map(kernel_copy, mesh, P("data", None), P("data", None), check=False)
        return {"step": jax.grad(lambda x: (f(x) * W).sum()), "args": (x,), "reference": lambda: W}

    def data_parallel():
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
        x = jax.device_put(jnp.ones((8, 128)), NamedSharding(mesh, P("data", None)))
        f = shard_map(lambda x, w: x @ w, mesh, (P("data", None), P()), P("data", None), check=True)
        return jax.grad(lambda w, x: (f(x, w) * 2.0).sum()), (jnp.ones((128, 4)), x)

    def _step(copy, check):
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
        x = jax.device_put(jnp.ones((8, 128)), NamedSharding(mesh, P("data", None)))
        f = shard_map(copy, mesh, P("data", None), P("data", None), check=check)
        return {"step": jax.grad(lambda x: (f(x) * W).sum()), "args": (x,), "reference": lambda: W,
                "name": "copy_step"}

    def compared(check=True):
        return _step(ruled_copy, check)

    def unruled(check=True):
        return _step(kernel_copy, check)

    def not_a_step():
        return 42

    def needs_an_argument(batch_size):
        return _step(kernel_copy, False)

    def raises(check=True):
        raise RuntimeError("no such dataset")
''')

# Registers rules by name when imported: one that matches a nested kernel, one that matches nothing.
NAMED = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental import pallas as pl
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import reprules
    from reprules.testing import shard_map

    reprules.replication_rule()(reprules.kernel_named("named_steps:named.<locals>.nested_kernel"))
    reprules.replication_rule()(reprules.kernel_named("named_steps:nowhere.<locals>.kernel"))

    def _mesh_and_x():
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
        return mesh, jax.device_put(jnp.ones((8, 128)), NamedSharding(mesh, P("data", None)))

    def _run(kernel, mesh, x, check):
        call = lambda x: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                        interpret=True)(x)
        f = shard_map(call, mesh, P("data", None), P("data", None), check=check)
        return jax.jit(lambda x: f(x).sum())

    def named(check=True):
        def nested_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 2.0
        mesh, x = _mesh_and_x()
        return {"step": _run(nested_kernel, mesh, x, check), "args": (x,), "name": "named_step"}

    def device_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + jax.lax.axis_index("data").astype(jnp.float32)

    def reads_device():
        mesh, x = _mesh_and_x()
        return _run(device_kernel, mesh, x, False), (x,)
''')


@pytest.fixture
def target(tmp_path, monkeypatch):
    (tmp_path / "user_steps.py").write_text(TARGET)
    (tmp_path / "broken_steps.py").write_text("raise ValueError('bad config')\n")
    (tmp_path / "named_steps.py").write_text(NAMED)
    (tmp_path / "exits.py").write_text("import sys\nsys.exit('needs equinox')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_steps"
    sys.modules.pop("user_steps", None)  # its rule is registered again when the next test imports it
    sys.modules.pop("broken_steps", None)
    sys.modules.pop("named_steps", None)


def _lines_fit(text):
    long = [line for line in text.splitlines() if len(line) > _text.WIDTH]
    assert not long, long


def _block(text, name):
    (block,) = [b for b in text.split("\n== ") if b.startswith(name + ":")]
    return block


def test_default_audit_side_by_side(capsys):
    assert _cli.main(["audit", "--strict"]) == 0  # the reprules side is clean
    out, err = capsys.readouterr()
    assert "[1/3] issue21855: checking off ... reprules ... done" in err
    assert "[3/3] layer_norm:" in err
    _lines_fit(out)
    assert len(out.split("\n== ")) == 4
    issue = _block(out, "issue21855")
    assert re.search(r"\n +checking off +reprules \(checking on\)\n", issue)
    assert re.search(r"\n +defensive +1 \(1024 B\) +0 \(0 B\)\n", issue)
    assert re.search(r"\n +kernels with rules +0/1 +1/1\n", issue)
    assert re.search(r"kernels, reprules \(checking on\):\n +kernel +primitive +calls +rule +covered by +source\n"
                     r" +copy_kernel +pallas_call +\d+ +rules.same\(\) +identity +workloads.py:\d+\n", issue)
    # (over 'model', 2 devices: a ring all-reduce sends 2 * 1/2 of its 1024 B buffer)
    assert re.search(r"collectives, checking off:\n.*\n +1 +all-reduce +model +f32\[2,128\] +1024 +1024 +"
                     r"defensive \(model\)", issue)
    assert "collectives, reprules (checking on): none" in issue
    ln = _block(out, "layer_norm")
    # JAX >= 0.6: reprules psums the bwd's cotangents, named by JAX's layer_norm bwd; before, JAX does.
    status = "added by reprules +layer_norm.py:" if NEW_SHARD_MAP else r"needed +(?!custom_vjp)\S+\.py:"
    assert re.search(rf"all-reduce +data +f32\[128\] +512 +768 +{status}\d+\n", ln), ln  # 2 * 3/4 * 512 sent
    # Checking off sums the weight's gradient over (data, model): needed over data, defensive over model.
    assert re.search(r"all-reduce +data,model +f32\[128\] +512 +896 +needed\+defensive \(model\)", ln), ln
    assert re.search(r"\n +\d: needed over data \(768 B sent\), defensive over model \(128 B\)\n", ln), ln
    mlp = _block(out, "tp_mlp").split("collectives, reprules (checking on):")[1]
    assert "custom_vjp" not in mlp and "?" not in mlp.split("legend:")[0], mlp  # never the shim, never unknown


def test_default_audit_json(capsys):
    assert _cli.main(["audit", "--json", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    doc = json.loads(out)
    assert doc["schema_version"] == _cli.SCHEMA_VERSION == 4
    assert doc["target"] is None and doc["jax"] == jax.__version__ and doc["reprules"] == reprules.__version__
    assert doc["inference"] == "default" and doc["unmatched_kernel_names"] == []
    assert doc["devices"] == 8 and doc["mesh"] == {"data": 4, "model": 2}
    by = {w["name"]: w for w in doc["workloads"]}
    assert set(by) == {"issue21855", "tp_mlp", "layer_norm"}
    assert all(w["error"] is None for w in by.values())
    issue = by["issue21855"]
    assert (issue["off"]["defensive_count"], issue["off"]["defensive_bytes"]) == (1, 1024)
    assert (issue["on"]["count"], issue["on"]["kernels_with_rules"]) == (0, 1)
    for w in by.values():
        assert w["on"]["defensive_count"] == 0
        assert w["off"]["defensive_count"] >= 1
        assert w["on"]["max_error"] < 1e-4 and w["off"]["max_error"] < 1e-4
    for w in by.values():  # a rule by identity on the reprules side; off, no rule, and inference would cover it
        assert all((k["covered_by"], k["inference"]) == ("identity", None) for k in w["on"]["kernels"])
        for k in w["off"]["kernels"]:
            assert k["covered_by"] == "none" and isinstance(k["inference"]["covers"], bool)
            if w["name"] != "layer_norm":  # JAX's layer_norm: refused on 0.4.x (its `for` loop primitive)
                assert k["inference"]["covers"] is True
                assert k["inference"]["rule"].startswith("inferred(out0 <- [")
    mlp = by["tp_mlp"]["on"]
    assert sorted(tuple(c["axes"]) for c in mlp["collectives"]) == [("data",), ("data",), ("model",), ("model",)]
    assert all(c["source"].endswith(".py:" + c["source"].rsplit(":", 1)[1]) for c in mlp["collectives"])
    assert doc["strict_findings"] == []


def test_user_target_off_vs_on(target, capsys):
    assert _cli.main(["audit", f"{target}:compared", "--strict"]) == 0
    out, err = capsys.readouterr()
    assert "checking off ... done" in err and "reprules (checking on) ... done" in err
    _lines_fit(out)
    assert out.startswith(f"reprules audit of {target}:compared: JAX {jax.__version__}")
    block = _block(out, "copy_step")
    assert re.search(r"\n +defensive +1 \(1024 B\) +0 \(0 B\)\n", block)
    assert re.search(r"\n +kernels with rules +1/1 +1/1\n", block)  # the rule is registered; checking is off
    assert re.search(r"\n +max error vs reference +0.00e\+00 +0.00e\+00\n", block)
    assert "collectives, reprules (checking on): none" in block
    assert "audited as given" not in out


def test_user_target_off_vs_on_json(target, capsys):
    assert _cli.main(["audit", f"{target}:compared", "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 4 and doc["target"] == f"{target}:compared"
    (w,) = doc["workloads"]
    assert w["name"] == "copy_step" and w["error"] is None and "given" not in w
    assert (w["off"]["count"], w["off"]["defensive_count"], w["off"]["defensive_bytes"]) == (1, 1, 1024)
    assert (w["on"]["count"], w["on"]["kernels_with_rules"], w["on"]["max_error"]) == (0, 1, 0.0)
    assert w["on"]["mesh"] == {"data": 4, "model": 2}
    assert doc["strict_findings"] == []


def test_infer_covers_the_unruled_target(target, capsys, tmp_path):
    page = tmp_path / "report.html"
    assert _cli.main(["audit", f"{target}:unruled", "--infer", "--strict", "--html", str(page)]) == 0
    out, err = capsys.readouterr()
    assert f"wrote {page}" in err
    _lines_fit(out)
    assert "\n--infer: the reprules side runs under reprules.inference()" in out
    block = _block(out, "copy_step")
    assert re.search(r"\n +defensive +1 \(1024 B\) +0 \(0 B\)\n", block)
    assert re.search(r"\n +user_copy_kernel +pallas_call +2 +inferred\(out0 <- \[0\]\) +inference +user_steps.py:\d+\n",
                     block)
    html = page.read_text()
    assert "user_copy_kernel" in html and "b-inference" in html and "reprules side under reprules.inference()" in html
    assert _cli.main(["audit", f"{target}:unruled", "--infer", "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (w,) = doc["workloads"]
    assert doc["inference"] == "all" and w["error"] is None
    (off,), (on,) = w["off"]["kernels"], w["on"]["kernels"]
    assert (off["covered_by"], off["inference"]) == ("none", {"covers": True, "rule": "inferred(out0 <- [0])"})
    assert (on["covered_by"], on["has_rule"], on["inference"]) == ("inference", True, None)
    assert w["on"]["max_error"] == 0.0


@pytest.mark.parametrize("mode", ["default", "off"])
def test_mode_line_json_html_and_rows_agree(target, capsys, tmp_path, mode):
    """Issue 36: the header said `inference off` and the JSON `false` while a row said `covered by
    inference`. One source: the mode the reprules side was traced in, in text, JSON and HTML."""
    import contextlib

    text = {"default": "inference where JAX would refuse", "off": "inference off"}[mode]
    page = tmp_path / "report.html"
    with reprules.inference(False) if mode == "off" else contextlib.nullcontext():
        code = _cli.main(["audit", f"{target}:unruled", "--quiet", "--html", str(page)])
        out = capsys.readouterr().out
        assert _cli.main(["audit", f"{target}:unruled", "--json", "--quiet"]) == code
        doc = json.loads(capsys.readouterr().out)
    assert out.splitlines()[1] == f"mode: {text}", out
    assert doc["inference"] == mode and f"{text} · " not in page.read_text() and f"· {text}" in page.read_text()
    (w,) = doc["workloads"]
    if mode == "default":  # JAX would refuse the rule-less kernel: inference covers it, and says so
        assert code == 0 and [k["covered_by"] for k in w["on"]["kernels"]] == ["inference"]
        assert re.search(r"\n +user_copy_kernel +pallas_call +2 +inferred\(out0 <- \[0\]\) +inference ", out), out
    else:  # no inference anywhere: the checked step fails, and no row says `inference`
        assert code == 1 and "MissingRuleError" in w["error"] and "on" not in w
        assert [k["covered_by"] for k in w["off"]["kernels"]] == ["none"]


def test_rules_by_name_and_names_that_match_nothing(target, capsys):
    assert _cli.main(["audit", "named_steps:named", "--strict", "--quiet"]) == 1
    out, err = capsys.readouterr()
    _lines_fit(out)
    assert re.search(r"\n +nested_kernel +pallas_call +1 +rules.same\(\) +name +named_steps.py:\d+\n", out)
    assert re.search(r"(?s)kernel_named rules that matched no traced kernel: "
                     r"'named_steps:nowhere.<locals>.kernel' \(from\s+named_steps.py:\d+\)", out)
    assert "named_steps:named.<locals>.nested_kernel" not in out.split("matched no traced kernel")[1]
    assert re.fullmatch(r"reprules audit --strict: 1 finding:\n  kernel_named\('named_steps:nowhere.<locals>.kernel'\) "
                        r"matched no kernel \(named_steps.py:\d+\)\n", err), err
    assert _cli.main(["audit", "named_steps:named", "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (u,) = doc["unmatched_kernel_names"]
    assert (u["name"], u["rule"]) == ("named_steps:nowhere.<locals>.kernel", "rules.same()")
    assert re.fullmatch(r".*named_steps.py:\d+", u["source"])
    assert [k["covered_by"] for v in ("off", "on") for k in doc["workloads"][0][v]["kernels"]] == ["name", "name"]


def test_inference_refusal_is_reported_with_primitive_and_line(target, capsys):
    assert _cli.main(["audit", "named_steps:reads_device", "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (k,) = doc["workloads"][0]["given"]["kernels"]
    assert (k["name"], k["covered_by"], k["has_rule"]) == ("device_kernel", "none", False)
    inference = k["inference"]
    assert (inference["covers"], inference["primitive"]) == (False, "axis_index")
    assert re.match(r".*named_steps.py:\d+", inference["where"]) and "device_kernel" in inference["where"]
    assert inference["reason"].startswith("reads the device's identity")
    assert _cli.main(["audit", "named_steps:reads_device", "--quiet"]) == 0
    out = capsys.readouterr().out
    _lines_fit(out)
    assert re.search(r"(?s)\n     device_kernel: inference refuses: `axis_index` at named_steps.py:\d+.*"
                     r"reads\s+the\s+device's identity", out), out


@pytest.mark.parametrize("where, problem", [("missing_dir/r.html", "does not exist"), (".", "it is a directory")])
def test_html_path_that_cannot_be_written_is_a_usage_error(target, capsys, where, problem):
    assert _cli.main(["audit", f"{target}:compared", "--html", where, "--quiet"]) == _cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert re.fullmatch(rf"reprules audit: error: Cannot write the HTML report to '{re.escape(where)}': [^\n]*"
                        rf"{problem}[^\n]*\.\nWhy: [^\n]*\nFix: [^\n]*\n", err), err


def test_user_target_whose_checked_step_fails(target, capsys, no_inference):
    assert _cli.main(["audit", f"{target}:unruled", "--quiet"]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert re.fullmatch(
        re.escape(f"reprules audit: error: {target}:unruled: the step failed, reprules (checking on): "
                  "MissingRuleError: The Pallas kernel 'user_copy_kernel' (")
        + r"(defined|traced) at \S+user_steps\.py:\d+" + re.escape(") has no replication rule, so it cannot run inside a shard_map "
                                            "with checking on (mesh axes {'data', 'model'}, "
                                            f"JAX {jax.__version__}).\n"), err)
    _lines_fit(out)
    block = _block(out, "copy_step")
    assert re.search(r"\n +defensive +1 \(1024 B\)\n", block)  # "off" is still shown
    assert re.search(r"kernels, checking off:\n.*\n +user_copy_kernel +pallas_call +2 +NO RULE ", block)
    assert re.search(r"(?s)\n   FAILED:\n     reprules \(checking on\): MissingRuleError: The Pallas kernel "
                     r"'user_copy_kernel' \((defined|traced) at\s.*has\s+no\s.*\n     Fix: declare it once", block)
    assert "@reprules.replication_rule()   # above `def user_copy_kernel(...)`" in out


def test_user_target_as_given_strict_reports_kernel_and_decorator(target, capsys):
    assert _cli.main(["audit", f"{target}:audit_step", "--strict", "--quiet"]) == 1
    out, err = capsys.readouterr()
    _lines_fit(out)
    block = _block(out, "audit_step")
    assert re.search(r"\n +as given\n", block)
    assert re.search(r"kernels, as given:\n.*\n +user_copy_kernel +pallas_call +2 +NO RULE +none +user_steps.py:\d+\n"
                     r" +user_copy_kernel: inference would cover it: inferred\(out0 <- \[0\]\) \(audit --infer uses it\)\n",
                     block)
    assert re.search(r"\n +defensive +1 \(1024 B\)\n", block)
    assert "user_copy_kernel (pallas_call x2), defined at" in out
    assert "@reprules.replication_rule()   # above `def user_copy_kernel(...)`" in out
    assert re.search(r"\n +max error vs reference +0.00e\+00\n", block)
    assert "takes no `check` argument, so its step was audited as given" in out
    assert err.startswith("reprules audit --strict: 2 findings:\n  audit_step: all-reduce over model")
    assert "audit_step: kernel user_copy_kernel has no rule" in err


def test_user_target_json_and_needed_all_reduce(target, capsys):
    assert _cli.main(["audit", f"{target}:data_parallel", "--json", "--strict", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (w,) = doc["workloads"]
    (c,) = w["given"]["collectives"]
    assert (c["kind"], c["axes"], c["status"], c["bytes"]) == ("all-reduce", ["data"], "needed", 128 * 4 * 4)
    assert doc["strict_findings"] == []


@pytest.mark.parametrize(
    "spec, message",
    [
        ("named_steps", r"(?s)Module 'named_steps' has no attribute 'audit_step' \(the default, as the target "
                        r"names none\).*Fix: .*named_steps:my_step.*def audit_step\(check=True\)"),
        ("missing_steps.py", r"(?s)no file 'missing_steps.py'.*Fix: check the path"),
        ("broken_steps.py:f", r"(?s)Running file 'broken_steps.py' of target 'broken_steps.py:f' raised ValueError: "
                              r"bad config.*Fix: run `python broken_steps.py`"),
        ("exits.py", r"(?s)Running file 'exits.py' .* raised SystemExit: needs equinox"),
        ("no_such_module_xyz:f", "Cannot import module 'no_such_module_xyz'"),
        ("broken_steps:f", r"(?s)Importing module 'broken_steps' of target 'broken_steps:f' raised ValueError: "
                           r"bad config.*Fix: run `python -c 'import broken_steps'`"),
        ("user_steps:missing", "has no attribute 'missing'"),
        ("user_steps:W", "not callable"),
        ("user_steps:not_a_step", r"returned int"),
        ("user_steps:needs_an_argument", r"(?s)takes the required argument 'batch_size'.*Fix: give 'batch_size' a "
                                         r"default"),
    ],
)
def test_bad_targets_are_usage_errors(target, capsys, spec, message):
    assert _cli.main(["audit", spec, "--quiet"]) == _cli.EXIT_USAGE == 2
    err = capsys.readouterr().err
    assert err.startswith("reprules audit: error:")
    assert "Traceback" not in err
    assert re.search(message, err)


def test_a_file_target_named_with_a_digit_and_the_default_callable(target, capsys, tmp_path):
    """Issue 36: `reprules audit examples/01_issue21855.py` said `is not of the form module:callable`.
    A path (its file name need not be a module name) and a module each take `:callable` or
    default to `audit_step`."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "01_steps.py").write_text(TARGET)
    assert _cli.main(["audit", "sub/01_steps.py:compared", "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (w,) = doc["workloads"]
    assert doc["target"] == "sub/01_steps.py:compared" and w["name"] == "copy_step" and w["error"] is None
    assert (w["off"]["defensive_count"], w["on"]["defensive_count"], w["on"]["max_error"]) == (1, 0, 0.0)
    assert w["on"]["kernels"][0]["source"].endswith("01_steps.py:" + w["on"]["kernels"][0]["source"].split(":")[-1])
    for spec in (str(tmp_path / "sub" / "01_steps.py"), "user_steps"):  # no callable: audit_step
        assert _cli.main(["audit", spec, "--quiet"]) == 0
        out = capsys.readouterr().out
        flat = " ".join(out.split())  # the header wraps a long path onto its own line
        assert flat.startswith(f"reprules audit of {spec}:") and "audited as given" in flat, out


def test_a_target_that_raises_is_a_failure_without_traceback(target, capsys):
    assert _cli.main(["audit", "user_steps:raises"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"(?s)\nreprules audit: error: user_steps:raises\(check=False\) raised RuntimeError: "
                     r"no such dataset\nWhy: .*\nFix: ", err)
    assert "Traceback" not in err


def test_unsupported_jax_exits_3_without_traceback(monkeypatch, capsys):
    from reprules import _shim

    monkeypatch.setattr(_shim, "regime", lambda: _shim._detect("0.99.0"))
    assert _cli.main(["audit", "--quiet"]) == _cli.EXIT_ENVIRONMENT == 3
    err = capsys.readouterr().err
    assert re.fullmatch(r"reprules audit: error: reprules supports JAX >=0\.4\.28,<0\.13, but JAX 0\.99\.0 is "
                        r"installed\.\nWhy: [^\n]*\nFix: install a supported JAX[^\n]*\n", err), err


def test_internal_error_is_one_paragraph_unless_traceback_is_asked(target, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise KeyError("oops")

    monkeypatch.setattr(_text, "render", broken)
    assert _cli.main(["audit", f"{target}:data_parallel", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(r"reprules audit: internal error: KeyError: 'oops'\nWhy: [^\n]*\n"
                        r"Fix: rerun with --traceback and report the output\.\n", err), err
    with pytest.raises(KeyError, match="oops"):
        _cli.main(["audit", f"{target}:data_parallel", "--quiet", "--traceback"])


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        _cli.main(["--version"])
    assert info.value.code == 0
    assert re.fullmatch(rf"reprules {re.escape(reprules.__version__)} \(JAX {re.escape(jax.__version__)}, "
                        r"jaxlib \S+, Python 3\.\d+\.\d+\)\n", capsys.readouterr().out)


def test_version_from_the_console_imports_no_jax():
    code = ("import sys; from reprules._audit._cli import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit as e:\n    print(e.code, 'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "0 False"


@pytest.mark.parametrize("columns", ["200", "100", "60"])
@pytest.mark.parametrize("argv", [["--help"], ["audit", "--help"]])
def test_help_lists_the_exit_codes(argv, columns, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", columns)  # argparse sizes help to the terminal: at most 100 columns here
    with pytest.raises(SystemExit):
        _cli.main(argv)
    out = capsys.readouterr().out
    assert "exit codes:" in out
    widest = max(map(len, out.splitlines()))
    assert widest <= _cli.HELP_WIDTH, [line for line in out.splitlines() if len(line) > _cli.HELP_WIDTH]
    flat = " ".join(out.split())  # wrapped, never cut: every word of every exit code's text is there
    for code, text in _cli.EXIT_CODES.items():
        assert f" {code} {text}" in flat


def test_no_command_prints_help(capsys):
    assert _cli.main([]) == 2
    assert "audit" in capsys.readouterr().err


def test_bad_device_count_is_a_usage_error(capsys):
    assert _cli.main(["audit", "--devices", "0", "--quiet"]) == 2
    assert "--devices must be at least 1" in capsys.readouterr().err


def test_too_few_started_devices_is_an_environment_error(capsys):
    assert _cli.main(["audit", "--devices", "64", "--quiet"]) == 3
    assert "JAX already started with 8 devices; the audit needs 64" in capsys.readouterr().err


def test_text_helpers_fit_the_width():
    assert _text.clip("x" * 120) == "x" * 97 + "..."
    assert _text.clip_left("/very/long/path/" * 10 + "file.py:3", 30).endswith("file.py:3")
    rows = [("a" * 60, "b" * 60, "c")] * 2
    assert all(len(line) <= 100 for line in _text.table(rows, "   "))




@pytest.fixture
def bwd_steps(tmp_path, monkeypatch):
    (tmp_path / "bwd_steps.py").write_text(BWD_STEPS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield str(tmp_path / "bwd_steps.py")
    sys.modules.pop("bwd_steps", None)


def _rows(block, header):
    """The rows of the table under ``header`` in an audit block, split on 2+ spaces."""
    lines = block[block.index(header):].splitlines()[2:]
    return [re.split(r"  +", line.strip()) for line in lines if re.match(r" +\d+  ", line)]


def test_audit_names_the_bwd_for_the_psum_reprules_adds(bwd_steps, capsys):
    assert _cli.main(["audit", "bwd_steps:both", "--quiet"]) == 0
    out = capsys.readouterr().out
    _lines_fit(out)
    rows = _rows(out, "collectives, reprules (checking on):")
    (row,) = [r for r in rows if r[2] == "data"]  # w's cotangent, summed over data
    bwd_line = BWD_STEPS.splitlines().index("def scaled_bwd(res, g):") + 1
    assert "custom_vjp" not in out.split("legend:")[0].replace("jax.custom_vjp", "")  # no shim file named
    if NEW_SHARD_MAP:  # reprules adds it (JAX <= 0.5 psums the cotangent itself)
        assert row[6:] == ["added by reprules", f"bwd_steps.py:{bwd_line}"], row  # (every level: no column)
        assert "added by reprules: needed: a psum reprules added to a custom_vjp bwd's cotangent" in \
            " ".join(out.split())
    assert _cli.main(["audit", "bwd_steps:both", "--quiet", "--json"]) == 0
    on = json.loads(capsys.readouterr().out)["workloads"][0]["on"]
    (c,) = [c for c in on["collectives"] if c["axes"] == ["data"]]
    assert c["dead"] is False and c["added_by"] == ("reprules" if NEW_SHARD_MAP else "")
    if NEW_SHARD_MAP:
        assert c["source"] == f"{bwd_steps}:{bwd_line}"


def test_audit_dead_all_reduce_is_dead_in_text_json_and_counts(bwd_steps, capsys):
    assert _cli.main(["audit", "bwd_steps:only_x", "--quiet", "--strict"]) == 0
    out = capsys.readouterr().out
    _lines_fit(out)
    (row,) = [r for r in _rows(out, "collectives, reprules (checking on):") if r[2] == "data"]
    assert row[6:8] == ["dead", "J.."] and row[8] != "?", row
    assert re.search(r"\n +collectives \(B sent\) +\d+ \(\d+ B\) +0 \(0 B\)\n", out), out  # not counted as needed
    assert re.search(r"\n +needed +\d+ \(\d+ B\) +0 \(0 B\)\n", out), out
    # Checking off has the same dead all-reduce on JAX <= 0.4 (its transpose, not reprules').
    assert re.search(r"\n +dead \(not counted\) +[01] \((0|768) B\) +1 \(768 B\)\n", out), out
    assert "dead: only in the jaxpr (levels J..): lowering dropped it as dead code" in " ".join(out.split())
    assert _cli.main(["audit", "bwd_steps:only_x", "--quiet", "--json"]) == 0
    on = json.loads(capsys.readouterr().out)["workloads"][0]["on"]
    dead = [c for c in on["collectives"] if c["dead"]]
    assert len(dead) == 1 and dead[0]["status"] == "dead" and dead[0]["levels"] == ["jaxpr"]
    assert (on["count"], on["dead_count"], on["bytes"]) == (len(on["collectives"]) - 1, 1, 0)


def test_text_legend_explains_every_column(bwd_steps, capsys):
    assert _cli.main(["audit", "bwd_steps:both", "--quiet"]) == 0
    out = capsys.readouterr().out
    body, legend = out.split("\nlegend:\n")
    legend = " ".join(legend.split())
    headers = [line.strip() for line in body.splitlines() if line.strip().startswith(("#  kind", "kernel  "))]
    assert len(headers) >= 3, body  # kernels, collectives off, collectives on
    columns = {c for h in headers for c in re.split(r"  +", h)}
    assert {"bytes", "sent", "source", "status", "covered by"} <= columns
    for column in columns:
        assert re.search(rf"(^|[;:] ){re.escape(column)}[:( ]", legend), (column, legend)
    statuses = {r[6] for r in _rows(body, "collectives, checking off:") + _rows(body, "collectives, reprules")}
    assert len(statuses) >= 2 and any(s.startswith("defensive (") for s in statuses), statuses
    for status in statuses:
        assert re.search(rf"(^| ){re.escape(status.split(' (')[0])}( \([A-Z]\))?: ", legend), (status, legend)
