"""The pytest plugin, through ``pytester``."""

import importlib.metadata
import pathlib
import subprocess
import sys

import pytest

# Imported before any in-process inner session: pytester removes the modules an inner session
# imported, and importing Pallas TPU again registers its PRNG again, which JAX refuses (a later
# test that imports it failed, run without xdist).
from jax.experimental.pallas import tpu  # noqa: F401

pytest_plugins = ["pytester"]

# The entry point may not be installed in a stale editable install; load the
# module explicitly instead, under a name the entry point cannot clash with.
PLUGIN = ("-p", "no:reprules", "-p", "reprules._pytest_plugin")

MODEL = '''
import sys
sys.path.insert(0, %r)
import jax, jax.numpy as jnp, numpy as np, pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from helpers import copy_kernel, kernel_copy
from reprules.testing import shard_map

def model(check):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    x = jax.device_put(jnp.ones((8, 128)), NamedSharding(mesh, P("data", None)))
    w = jnp.asarray(np.random.RandomState(0).randn(8, 128), jnp.float32)
    f = shard_map(kernel_copy, mesh, P("data", None), P("data", None), check)
    return jax.grad(lambda x: (f(x) * w).sum()), x
''' % str(pathlib.Path(__file__).parent)


def test_entry_point_is_declared():
    text = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '[project.entry-points.pytest11]\nreprules = "reprules._pytest_plugin"' in text
    eps = [e for e in importlib.metadata.entry_points(group="pytest11") if e.name == "reprules"]
    if not eps:
        pytest.skip("reprules is installed without its pytest11 entry point (reinstall it)")
    assert eps[0].value == "reprules._pytest_plugin"


def test_loading_the_plugin_does_not_import_jax():
    code = "import sys, reprules._pytest_plugin; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_fixtures_in_process(pytester):
    pytester.makepyfile(model=MODEL)
    pytester.makepyfile(test_user='''
import reprules
from model import copy_kernel, model

def test_off_fails(no_all_reduce):
    no_all_reduce(*model(check=False))

def test_on_passes(no_all_reduce, collectives):
    reprules.replication_rule()(copy_kernel)
    try:
        report = no_all_reduce(*model(check=True))
        assert report.collectives == ()
        assert collectives(*model(check=True)).kernels[0].has_rule
    finally:
        reprules.unregister(copy_kernel)
''')
    result = pytester.runpytest_inprocess(*PLUGIN, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*1 all-reduce found in <lambda>*",
        "*all-reduce over model*defensive*",
        "*kernel 'copy_kernel'*",
        "*@reprules.replication_rule()*",
    ])
    result.stdout.fnmatch_lines(["reprules *; JAX *; * devices"])
    text = result.stdout.str()
    assert "During handling of the above exception" not in text  # printed once, not chained
    # Once in the failure report (the short summary may repeat it: pytest does not
    # truncate that line when CI is set).
    failures = text.split("short test summary info")[0]
    assert failures.count("Why: these are defensive all-reduces") == 1, text


def test_fixtures_skip_a_one_device_mesh(pytester):
    """Issue 36: on a mesh of one device no all-reduce can occur, so both fixtures skip
    the test (saying how to get devices) rather than let it pass vacuously."""
    pytester.makepyfile(test_one="""
import jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
from reprules.testing import shard_map

def step():
    f = shard_map(lambda x: x * 2.0, Mesh(jax.devices()[:1], "model"), P(), P())
    return jax.grad(lambda x: f(x).sum()), jnp.ones((8, 128))

def test_no_all_reduce(no_all_reduce):
    no_all_reduce(*step())

def test_collectives(collectives):
    assert collectives(*step()).count("all-reduce") == 1
""")
    result = pytester.runpytest_inprocess(*PLUGIN, "-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(skipped=2)
    # Each skip is reported at the test's line that called the fixture, not in the plugin.
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] test_one.py:10: no_all_reduce: *",
                                 "SKIPPED [[]1[]] test_one.py:13: collectives: *"], consecutive=True)
    assert "_pytest_plugin.py" not in result.stdout.str()
    text = " ".join(result.stdout.str().split())
    for fixture in ("no_all_reduce", "collectives"):
        assert f"{fixture}: <lambda> runs on a mesh of 1 device (model=1; JAX " in text, text
    assert text.count("run pytest with --reprules-cpu-devices 8") == 2, text


def test_cpu_devices_option_and_marker_in_a_fresh_process(pytester):
    pytester.makepyfile(test_devices='''
import jax, pytest

@pytest.mark.reprules_devices(4)
def test_four():
    assert jax.device_count() == 4

@pytest.mark.reprules_devices(16)
def test_sixteen():
    pass
''')
    result = pytester.runpytest_subprocess(*PLUGIN, "--reprules-cpu-devices", "4", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines([
        "reprules *; JAX *; 4 cpu devices",
        # Reported at the test (its decorator's line), not in the plugin.
        "SKIPPED [[]1[]] test_devices.py:7: needs 16 JAX devices, found 4; run pytest with --reprules-cpu-devices 16*",
    ])


DEVICE_COUNT_TEST = """
import jax

def test_count():
    print("device_count", jax.device_count())
"""


def test_cpu_devices_ini_setting_in_a_fresh_process(pytester):
    pytester.makeini("[pytest]\nreprules_cpu_devices = 4\n")
    pytester.makepyfile(test_count=DEVICE_COUNT_TEST)
    result = pytester.runpytest_subprocess(*PLUGIN, "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["reprules *; JAX *; 4 cpu devices", "*device_count 4*"])


def test_cpu_devices_option_overrides_the_ini_setting(pytester):
    pytester.makeini("[pytest]\nreprules_cpu_devices = 4\n")
    pytester.makepyfile(test_count=DEVICE_COUNT_TEST)
    result = pytester.runpytest_subprocess(*PLUGIN, "-s", "--reprules-cpu-devices", "2")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*device_count 2*"])


@pytest.mark.parametrize("value, message", [
    ("eight", "*reprules_cpu_devices = eight (in *tox.ini) is not a whole number.*"),
    ("0", "*reprules_cpu_devices = 0: the number of fake CPU devices must be at least 1, got 0.*"),
])
def test_bad_cpu_devices_ini_setting_is_a_usage_error(pytester, value, message):
    pytester.makefile(".ini", tox=f"[pytest]\nreprules_cpu_devices = {value}\n")
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess(*PLUGIN)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert "Traceback" not in result.stderr.str()


def test_cpu_devices_option_fails_loudly_when_a_backend_already_started(pytester):
    # A plugin that starts JAX before reprules can set XLA_FLAGS.
    pytester.makepyfile(startjax="import jax\njax.devices()\n")
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "startjax", *PLUGIN, "--reprules-cpu-devices", "3")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--reprules-cpu-devices 3: a JAX backend already started with * devices*"])


def test_bad_marker_argument_is_a_usage_error(pytester):
    pytester.makepyfile(test_bad='''
import pytest

@pytest.mark.reprules_devices("eight")
def test_bad():
    pass
''')
    result = pytester.runpytest_inprocess(*PLUGIN, "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*reprules_devices takes one positive int*"])
    assert result.ret != 0


INFER_TEST = '''
import sys
sys.path.insert(0, %r)
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P
import reprules
from helpers import make_mesh, put, randn, shard_map, copy_kernel

def closure_copy(x):
    def kernel(x_ref, o_ref):  # a new function on every call: nothing to register a rule on
        o_ref[...] = x_ref[...]

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)

def test_closure_kernel():
    reprules.replication_rule()(copy_kernel)  # another kernel: reprules is active either way
    mesh = make_mesh()
    x = put(randn(0, (8, 16)), mesh, P("data", None))
    out = jax.jit(shard_map(closure_copy, mesh, P("data", None), P("data", None)))(x)
    assert float(abs(out - x).max()) < 1e-30
''' % str(pathlib.Path(__file__).parent)


@pytest.mark.parametrize("how", ["option", "ini", "default", "off"])
def test_infer_option_runs_the_session_under_inference(pytester, monkeypatch, how):
    pytester.makepyfile(test_infer=INFER_TEST)
    args = [*PLUGIN, "--reprules-cpu-devices", "8", "-p", "no:cacheprovider"]
    if how == "option":
        args.append("--reprules-infer")
    elif how == "ini":
        pytester.makeini("[pytest]\nreprules_infer = true\n")
    elif how == "off":  # inference off, even where JAX would refuse the kernel (on by default)
        monkeypatch.setenv("REPRULES_INFER", "0")
    result = pytester.runpytest_subprocess(*args)
    if how == "off":
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines([
            "*MissingRuleError: The Pallas kernel 'kernel' (* at *test_infer.py:*) has no replication rule*",
            "*inference is off here (`REPRULES_INFER=0` or `reprules.inference(False)`)*",
        ])
    else:
        result.assert_outcomes(passed=1)
        on = "inference where JAX would refuse" if how == "default" else "inference on"
        result.stdout.fnmatch_lines([f"reprules *; JAX *; {on}; 8 cpu devices"])
