"""End-to-end reports of ``reprules.testing`` on the (4, 2) mesh."""

import json
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import reprules
from helpers import JAX_VERSION, copy_kernel, kernel_copy, make_mesh, put, randn, shard_map
from jax.experimental import pallas as pl

from reprules import testing
from reprules._errors import ReprulesError


def _issue21855(mesh, check, constant=False):
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    w = randn(1, (8, 128))
    f = shard_map(kernel_copy, mesh, P("data", None), P("data", None), check)
    if constant:
        return jax.grad(lambda x: f(x).sum()), x
    return jax.grad(lambda x: (f(x) * w).sum()), x


def test_issue21855_checking_off_reports_one_defensive_all_reduce_over_model(mesh):
    grad, x = _issue21855(mesh, check=False)
    report = testing.collectives(grad, x)
    (c,) = report.collectives
    assert (c.kind, c.axes, c.levels) == ("all-reduce", ("model",), ("jaxpr", "stablehlo", "hlo"))
    assert (c.dtype, c.shapes, c.bytes) == ("f32", ((2, 128),), 2 * 128 * 4)
    assert c.defensive and c.replicated_axes == ("model",) and c.origin == "autodiff"
    assert c.primitive == "psum" and "transpose(" in c.op_name
    path, line = c.source.rsplit(":", 1)  # the user line that calls the shard_mapped function
    assert path.endswith("test_testing.py") and int(line) > _issue21855.__code__.co_firstlineno
    assert c.kernels_without_rule == ("copy_kernel",)
    (k,) = report.kernels
    assert (k.name, k.primitive, k.has_rule, k.count) == ("copy_kernel", "pallas_call", False, 2)
    with pytest.raises(testing.CollectivesAssertionError, match=r"(?s)1 all-reduce found in .*over model.*"
                       r"defensive.*kernel 'copy_kernel'.*@reprules.replication_rule\(\)") as info:
        testing.assert_no_all_reduce(grad, x)
    assert isinstance(info.value, AssertionError) and info.value.report.count("all-reduce") == 1


def test_issue21855_with_a_rule_has_no_collective(mesh):
    reprules.replication_rule()(copy_kernel)
    grad, x = _issue21855(mesh, check=True)
    report = testing.assert_no_all_reduce(grad, x)
    assert report.collectives == () and report.defensive == ()
    (k,) = report.kernels
    assert k.has_rule and k.rule == "rules.same()"
    assert "(no collectives)" in str(report)


def test_constant_cotangent_all_reduce_is_reported_when_xla_folds_it(mesh):
    grad, x = _issue21855(mesh, check=False, constant=True)
    report = testing.collectives(grad, x)
    (c,) = report.collectives
    assert {"jaxpr", "stablehlo"} <= set(c.levels) and c.defensive
    if JAX_VERSION >= (0, 10, 2):  # XLA:CPU folds it (JAX_INTERNALS §1.3 item 7)
        assert c.folded and "folded by XLA" in c.describe()
        testing.assert_no_all_reduce(grad, x, levels=("hlo",))
    with pytest.raises(testing.CollectivesAssertionError, match="levels checked: jaxpr, stablehlo, hlo"):
        testing.assert_no_all_reduce(grad, x)


def _data_parallel(mesh, check):
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    w = randn(2, (128, 64))
    t = randn(3, (8, 64))
    f = shard_map(lambda x, w: x @ w, mesh, (P("data", None), P()), P("data", None), check)
    return jax.grad(lambda w, x: (f(x, w) * t).sum()), (w, x)


def test_data_parallel_gradient_all_reduce_is_needed_over_data(mesh):
    grad, args = _data_parallel(mesh, check=True)
    report = testing.assert_collectives(
        grad, *args, expect={("all-reduce", "data"): {"count": 1, "bytes": 128 * 64 * 4}, "defensive": 0})
    (c,) = report.collectives
    assert c.status == "needed" and c.axes == ("data",) and set(c.levels) == {"jaxpr", "stablehlo", "hlo"}
    assert c.primitive in ("psum2", "psum_invariant")
    assert report.bytes("all-reduce", axes="data", level="hlo") == 32768


def test_data_parallel_checking_off_sums_over_model_too(mesh):
    grad, args = _data_parallel(mesh, check=False)
    report = testing.collectives(grad, *args)
    (c,) = report.collectives
    assert set(c.axes) == {"data", "model"} and c.defensive and c.replicated_axes == ("model",)
    with pytest.raises(testing.CollectivesAssertionError,
                       match=r"(?s)all-reduce over \('data',\): expected count 1, got 0.*Full report:"):
        testing.assert_collectives(grad, *args, expect={("all-reduce", ("data",)): 1})


def test_collectives_inside_scan_cond_and_other_kinds(mesh):
    def body(x):
        def step(c, _):
            return c + jax.lax.psum(x, "model"), None

        y, _ = jax.lax.scan(step, jnp.zeros_like(x), None, length=2)
        y = jax.lax.cond(x.sum() > 0, lambda v: jax.lax.pmax(v, "data"), lambda v: v, y)
        g = jax.lax.all_gather(y, "data", tiled=True)
        p = jax.lax.ppermute(x, "data", [(i, (i + 1) % 4) for i in range(4)])
        return g[:2] + p

    f = shard_map(body, mesh, P("data", None), P("data", None), check=False)
    report = testing.collectives(f, put(randn(0, (8, 128)), mesh, P("data", None)))
    jaxpr = [(c.primitive, c.axes) for c in report.select(level="jaxpr")]
    assert jaxpr == [("psum", ("model",)), ("pmax", ("data",)), ("all_gather", ("data",)),
                     ("ppermute", ("data",))]
    gather = report.select("all-gather")[0]
    assert gather.shapes == ((8, 128),) and gather.bytes == 8 * 128 * 4
    assert report.count("collective-permute", axes="data") == 1
    assert not report.defensive  # written by the program, not by a transpose
    psum = report.select("all-reduce", axes="model")[0]  # in the scan body: runs twice per step
    assert (psum.executions, psum.step_bytes) == (2, 2 * psum.bytes)
    assert report.bytes("all-reduce", axes="model") == 2 * psum.bytes
    assert (report.select("all-gather")[0].executions, gather.step_bytes) == (1, gather.bytes)


def test_report_json_and_table(mesh):
    grad, x = _issue21855(mesh, check=False)
    report = testing.collectives(grad, x)
    doc = json.loads(report.to_json())
    assert doc["mesh"] == {"data": 4, "model": 2}
    assert doc["summary"]["defensive_count"] == 1 and doc["summary"]["by_kind"]["all-reduce"]["bytes"] == 1024
    assert doc["collectives"][0]["axes"] == ["model"] and doc["collectives"][0]["status"] == "defensive"
    assert doc["kernels"][0]["name"] == "copy_kernel"
    table = report.table()
    assert "all-reduce" in table and "defensive" in table and "kernel copy_kernel" in table


def test_bad_arguments_are_explained(mesh):
    grad, x = _issue21855(mesh, check=False)
    with pytest.raises(ValueError, match="Unknown level"):
        testing.assert_no_all_reduce(grad, x, levels=("llvm",))
    with pytest.raises(ValueError, match="unknown collective kind 'allreduce'"):
        testing.assert_collectives(grad, x, expect={"allreduce": 1})
    with pytest.raises(ValueError, match="expect key 3 is not understood"):
        testing.assert_collectives(grad, x, expect={3: 1})
    with pytest.raises(ValueError, match="give a count"):
        testing.assert_collectives(grad, x, expect={"all-reduce": "one"})
    with pytest.raises(ValueError, match="only have the keys 'count' and 'bytes'"):
        testing.assert_collectives(grad, x, expect={"all-reduce": {"size": 1}})
    report = testing.collectives(grad, x)
    with pytest.raises(ValueError, match="unknown collective kind"):
        report.count("psum")
    with pytest.raises(ValueError, match="unknown level"):
        report.count(level="mlir")


def test_jaxpr_only_dead_all_reduce_is_ignored_by_default():
    """grad w.r.t. x only: the replicated weight's psum stays in the jaxpr but is
    never lowered, so it costs nothing and assert_no_all_reduce passes."""
    import reprules
    from reprules import testing

    from jax.experimental import pallas as pl

    def mul_kernel(x_ref, w_ref, o_ref):
        o_ref[...] = x_ref[...] * w_ref[...]

    def kernel_mul(x, w):
        return pl.pallas_call(mul_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, w)

    @jax.custom_vjp
    def mul(x, w):
        return kernel_mul(x, w)

    mul.defvjp(lambda x, w: (kernel_mul(x, w), (x, w)), lambda r, g: (g * r[1], (g * r[0]).sum(0, keepdims=True)))
    reprules.replication_rule()(mul_kernel)  # the custom_vjp's weight cotangent gets psummed
    mesh = make_mesh()
    x, w = put(randn(0, (16, 32)), mesh, P("data", None)), put(randn(1, (1, 32)), mesh, P())
    f = shard_map(mul, mesh, (P("data", None), P()), P("data", None))
    grad_x = jax.grad(lambda x: f(x, w).sum())
    report = testing.assert_no_all_reduce(grad_x, x)
    assert report.select("all-reduce") == () and report.count() == 0  # dead: in no count by default
    assert [c.levels for c in report.select("all-reduce", level="jaxpr")] == [("jaxpr",)]
    assert [(c.status, c.dead) for c in report.dead_collectives] == [("dead", True)]
    with pytest.raises(testing.CollectivesAssertionError, match="all-reduce"):
        testing.assert_no_all_reduce(grad_x, x, levels=("jaxpr",))


# --- the setup helpers: fake_cpu_devices and shard_map -------------------------------------


def test_xla_flags_keep_one_device_count():
    from reprules._environment import with_device_count

    flags = "--xla_cpu_foo=1 --xla_force_host_platform_device_count=2 --xla_bar"
    assert with_device_count(flags, 8) == "--xla_cpu_foo=1 --xla_bar --xla_force_host_platform_device_count=8"
    assert with_device_count("", 4) == "--xla_force_host_platform_device_count=4"


def test_fake_cpu_devices_after_the_backend_started():
    testing.fake_cpu_devices(8)  # the count the backend started with (tests/conftest.py): nothing to do
    with pytest.raises(reprules.ReprulesError,
                       match=r"(?s)fake_cpu_devices\(4\): a JAX backend already started with 8 CPU devices.*Fix:"):
        testing.fake_cpu_devices(4)
    with pytest.raises(reprules.ReprulesError, match="at least 1, got 0"):
        testing.fake_cpu_devices(0)


def test_the_tests_helpers_agree_with_reprules_testing():
    """tests/helpers.py keeps its own copies (it must not import reprules); same rules."""
    import helpers
    from reprules._environment import jax_version, version_tuple

    assert helpers.JAX_VERSION == jax_version()
    assert version_tuple("0.5.0rc1") == (0, 5, 0) and version_tuple("0.12.0.1") > version_tuple("0.12.0")
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    for check in (True, False):
        ours = jax.make_jaxpr(testing.shard_map(jnp.sin, mesh, P("data", None), P("data", None), check=check))(x)
        theirs = jax.make_jaxpr(helpers.shard_map(jnp.sin, mesh, P("data", None), P("data", None), check=check))(x)
        assert str(ours) == str(theirs)


TPU_INFO = JAX_VERSION >= (0, 9)  # JAX keeps TPU descriptions by device kind from 0.9


@pytest.mark.skipif(not TPU_INFO, reason=f"JAX {jax.__version__} cannot describe a TPU for the CPU device")
def test_tpu_on_cpu_describes_the_cpu_device_as_that_tpu_and_undoes_it():
    from jax.experimental.pallas import tpu as pltpu

    def vmem(x_ref, o_ref):  # a kernel that asks which TPU it runs on
        o_ref[...] = x_ref[...] + pltpu.get_tpu_info().vmem_capacity_bytes

    x = jnp.zeros((8, 128), jnp.float32)

    def call(x):  # built inside the context, as interpret mode needs
        return pl.pallas_call(vmem, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    with testing.tpu_on_cpu("v5e"):
        v5e = float(call(x)[0, 0])
    with testing.tpu_on_cpu("v6e"):
        v6e = float(call(x)[0, 0])
    expected = [pltpu.get_tpu_info_for_chip(getattr(pltpu.ChipVersion, c), 1).vmem_capacity_bytes
                for c in ("TPU_V5E", "TPU_V6E")]
    assert [v5e, v6e] == [float(e) for e in expected]
    with pytest.raises(Exception, match="(?i)unsupported TPU device kind|cpu"):  # undone: JAX's own refusal again
        pltpu.get_tpu_info()


@pytest.mark.skipif(not TPU_INFO, reason=f"JAX {jax.__version__} cannot describe a TPU for the CPU device")
def test_tpu_on_cpu_refuses_a_chip_jax_does_not_know():
    with pytest.raises(ReprulesError, match=r"(?s)tpu_on_cpu\('v99'\): JAX \S+ knows no such TPU\..*Why: .*"
                       r"Fix: one of 'v2', .*'v5e'"):
        with testing.tpu_on_cpu("v99"):
            pass


@pytest.mark.skipif(TPU_INFO, reason="JAX 0.9+ can describe a TPU for the CPU device")
def test_tpu_on_cpu_says_this_jax_cannot():
    with pytest.raises(ReprulesError, match=rf"(?s)JAX {re.escape(jax.__version__)} cannot describe a TPU "
                       r"for the CPU device\..*Why: .*from 0\.9 on\..*Fix: use JAX 0\.9 or newer"):
        with testing.tpu_on_cpu():
            pass
