"""The communication nobody wrote (issue 37): implicit collectives and cheaper equivalents.

Each pattern is checked at the levels that matter (the jaxpr for what the program
wrote, the compiled HLO for what runs), with data-dependent inputs (XLA folds
constants), found with its bytes and the user's line, and its efficient twin not
found. ``cpu_kernels`` need JAX >= 0.4.31 and a C++ compiler.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh, max_err, put, randn, shard_map
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from reprules import testing
from reprules._report import _hlo_graph, _link_model
from reprules._demo import workloads
from reprules.testing import cpu_kernels

pytest_plugins = ["pytester"]
HERE = pathlib.Path(__file__)
NO_FFI = cpu_kernels.unavailable_reason()
needs_ffi = pytest.mark.skipif(NO_FFI is not None, reason=str(NO_FFI))


def line(marker):
    """``test_communication.py:N``, N the line of this file that ends with ``# marker``."""
    for n, text in enumerate(HERE.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# {marker}"):
            return f"{HERE.name}:{n}"
    raise AssertionError(marker)


def ends(source, marker):
    """Whether ``source`` (``/path/file.py:N``) is the line marked ``marker``; says which otherwise."""
    assert source.endswith(line(marker)), (source, line(marker))
    return True


# --- implicit collectives around opaque kernels -----------------------------------------


def ffi_copy_twice(x):
    return cpu_kernels.copy(x) * 2  # CALL-FFI


@needs_ffi
def test_an_ffi_kernel_on_a_sharded_operand_is_gathered_by_xla(mesh):
    x = put(randn(0, (8, 128)), mesh, P("data"))
    report = testing.collectives(ffi_copy_twice, x)
    assert report.count(level="jaxpr") == 0  # the program wrote no collective
    assert report.count("all-gather", level="hlo") == 1  # XLA runs one
    [c] = report.implicit
    assert (c.kind, c.axes, c.bytes, c.kernel, c.primitive, c.operand) == (
        "all-gather", ("data",), 8 * 128 * 4, "reprules_copy", "ffi_call", 0)
    assert not c.predicted and c.backend == jax.default_backend() and c.in_specs == "P('data')"
    assert ends(c.call_source, "CALL-FFI")
    assert c.seconds > 0 and "shard_map" in c.fix() and "custom_partitioning" in c.fix()
    assert c.sent == 3 * 1024  # a ring all-gather over 4 devices: each sends (4 - 1) / 4 of the 4096 B buffer
    with pytest.raises(testing.CollectivesAssertionError, match=r"1 implicit collective .*\n.*all-gather over "
                       r"data: f32\[8,128\], 4096 B buffer, 3072 B sent, into operand 0 of kernel reprules_copy"
                       ) as err:
        testing.assert_no_implicit_collectives(ffi_copy_twice, x)
    assert "in_specs=P('data')" in str(err.value) and line("CALL-FFI") in str(err.value)
    np.testing.assert_allclose(jax.jit(ffi_copy_twice)(x), 2 * np.asarray(x))


@needs_ffi
def test_the_ffi_kernel_under_shard_map_or_on_a_replicated_operand_has_none(mesh):
    x = randn(0, (8, 128))
    step = shard_map(ffi_copy_twice, mesh, P("data"), P("data"), check=False)
    report = testing.assert_no_implicit_collectives(step, put(x, mesh, P("data")))
    assert report.count() == 0
    testing.assert_no_implicit_collectives(ffi_copy_twice, put(x, mesh, P()))
    testing.assert_no_implicit_collectives(ffi_copy_twice, x)  # no sharding at all


@needs_ffi
def test_only_the_sharded_operand_of_a_two_operand_kernel_is_reported(mesh):
    x, w = put(randn(1, (8, 128)), mesh, P("data")), put(randn(2, (1, 128)), mesh, P())
    [c] = testing.collectives(lambda x, w: cpu_kernels.mul(x, w), x, w).implicit
    assert (c.operand, c.bytes, c.kernel) == (0, 4096, "reprules_mul")


def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def pallas_copy(x):
    return pl.pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),  # CALL-PALLAS
                          interpret=True)(x) * 2


def test_a_pallas_kernel_in_interpret_mode_is_predicted_from_the_jaxpr(mesh):
    x = put(randn(3, (16, 128)), mesh, P("data", "model"))
    report = testing.collectives(pallas_copy, x)
    assert report.count(level="hlo") == 0  # interpret mode: ordinary HLO, partitioned; CPU hides it
    [c] = report.implicit
    assert c.predicted and (c.kind, c.axes, c.bytes, c.operand) == ("all-gather", ("data", "model"), 16 * 128 * 4, 0)
    assert "copy_kernel" in c.kernel and c.primitive == "pallas_call" and c.in_specs == "P('data', 'model')"
    assert line("CALL-PALLAS") in c.call_source or c.call_source.endswith(
        f"{HERE.name}:{int(line('CALL-PALLAS').rsplit(':')[1]) + 1}"), c.call_source
    with pytest.raises(testing.CollectivesAssertionError, match="predicted for a TPU/GPU compile"):
        testing.assert_no_implicit_collectives(pallas_copy, x)


def test_the_pallas_kernel_under_shard_map_or_replicated_is_not_predicted(mesh):
    x = randn(3, (16, 128))
    testing.assert_no_implicit_collectives(shard_map(pallas_copy, mesh, P("data"), P("data")), put(x, mesh, P("data")))
    testing.assert_no_implicit_collectives(pallas_copy, put(x, mesh, P()))
    # Summed over the sharded dimension first: the kernel's operand is replicated.
    testing.assert_no_implicit_collectives(lambda x: pallas_copy(x.sum(0, keepdims=True)), put(x, mesh, P("data")))


# --- cheaper equivalents ------------------------------------------------------------------


def psum_then_own_slice(x):
    total = jax.lax.psum(x, "data")  # PSUM
    i = jax.lax.axis_index("data")
    return jax.lax.dynamic_slice_in_dim(total, i * 2, 2)  # OWN-SLICE


def psum_scatter_twin(x):
    return jax.lax.psum_scatter(x, "data", scatter_dimension=0, tiled=True)


def psum_then_neighbour_slice(x):
    total = jax.lax.psum(x, "data")
    i = (jax.lax.axis_index("data") + 1) % 4
    return jax.lax.dynamic_slice_in_dim(total, i * 2, 2)


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_an_all_reduce_then_the_own_slice_is_a_reduce_scatter(mesh, check):
    x = put(randn(4, (32, 128)), mesh, P("data"))
    step = shard_map(psum_then_own_slice, mesh, P("data"), P("data"), check=check)
    report = testing.collectives(step, x)
    assert report.count("all-reduce", level="jaxpr") == report.count("all-reduce", level="hlo") == 1
    [c] = report.cheaper
    assert (c.pattern, c.kind, c.cheaper, c.axes) == ("own-slice", "all-reduce", "reduce-scatter", ("data",))
    # The 4096 B buffer over 4 devices: a ring all-reduce sends 2 * 3/4 of it, a reduce-scatter 3/4.
    assert (c.bytes, c.sent, c.bytes_after, c.sent_after, c.saved_bytes) == (4096, 6144, 4096, 3072, 3072)
    assert ends(c.source, "PSUM") and ends(c.slice_source, "OWN-SLICE")
    assert "jax.lax.psum_scatter(x, 'data', scatter_dimension=0, tiled=True)" in c.rewrite
    assert c.backend == jax.default_backend() and c.seconds_after < c.seconds
    twin = shard_map(psum_scatter_twin, mesh, P("data"), P("data"), check=check)
    assert max_err(jax.jit(step)(x), jax.jit(twin)(x)) < 1e-5  # the rewrite computes the same
    after = testing.assert_no_cheaper_collectives(twin, x)
    assert after.count("reduce-scatter") == 1
    assert report.sent_bytes() - after.sent_bytes() == c.saved_bytes  # the fix moves the row by the saving
    other = shard_map(psum_then_neighbour_slice, mesh, P("data"), P("data"), check=check)
    testing.assert_no_cheaper_collectives(other, x)  # another device's part: the all-reduce is needed


def all_gather_then_own_shard(x):
    full = jax.lax.all_gather(x, "data", tiled=True)  # GATHER
    i = jax.lax.axis_index("data")
    return jax.lax.dynamic_slice_in_dim(full, i * 2, 2) * 3


def all_gather_then_neighbour_shard(x):
    full = jax.lax.all_gather(x, "data", tiled=True)
    i = (jax.lax.axis_index("data") + 3) % 4
    return jax.lax.dynamic_slice_in_dim(full, i * 2, 2) * 3


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_an_all_gather_then_the_own_shard_needs_no_collective(mesh, check):
    x = put(randn(5, (8, 128)), mesh, P("data"))
    step = shard_map(all_gather_then_own_shard, mesh, P("data"), P("data"), check=check)
    report = testing.collectives(step, x)
    assert report.count("all-gather", level="jaxpr") == report.count("all-gather", level="hlo") == 1
    [c] = report.cheaper
    assert (c.pattern, c.cheaper, c.bytes, c.bytes_after, c.saved_bytes) == ("own-shard", "none", 4096, 0, 3072)
    assert ends(c.source, "GATHER")
    with pytest.raises(testing.CollectivesAssertionError, match=r"1 collective with a cheaper equivalent.*\n"
                       r".*all-gather over data: f32\[8,128\], 3072 B sent -> none 0 B sent"):
        testing.assert_no_cheaper_collectives(step, x)
    np.testing.assert_allclose(jax.jit(step)(x), 3 * np.asarray(x), rtol=1e-6)
    twin = shard_map(lambda x: x * 3, mesh, P("data"), P("data"), check=check)
    after = testing.assert_no_cheaper_collectives(twin, x)
    assert after.count() == 0 and report.sent_bytes() - after.sent_bytes() == c.saved_bytes
    other = shard_map(all_gather_then_neighbour_shard, mesh, P("data"), P("data"), check=check)
    testing.assert_no_cheaper_collectives(other, x)


def scale_by_summed_weight(x, w):
    return x * jax.lax.psum(w, "data")  # REPLICATED-PSUM


@pytest.mark.parametrize("check", [
    pytest.param(True, id="checked", marks=pytest.mark.skipif(
        not hasattr(jax, "shard_map"), reason="JAX <= 0.5's check_rep refuses a psum of a replicated value: "
        "the pattern exists there with checking off only")),
    pytest.param(False, id="unchecked")])
def test_a_psum_of_a_replicated_value_is_a_multiplication(mesh, check):
    x, w = put(randn(6, (8, 128)), mesh, P("data")), randn(7, (1, 128))
    step = shard_map(scale_by_summed_weight, mesh, (P("data"), P()), P("data"), check=check)
    report = testing.collectives(step, x, w)
    assert report.count("all-reduce", level="jaxpr") == report.count("all-reduce", level="hlo") == 1
    [c] = report.cheaper
    assert (c.pattern, c.cheaper, c.bytes, c.bytes_after, c.saved_bytes) == ("replicated-sum", "multiplication",
                                                                              512, 0, 768)
    assert ends(c.source, "REPLICATED-PSUM") and "x * 4" in c.rewrite
    np.testing.assert_allclose(jax.jit(step)(x, w), np.asarray(x) * 4 * np.asarray(w), rtol=1e-5)
    rewritten = shard_map(lambda x, w: x * (w * 4), mesh, (P("data"), P()), P("data"), check=check)
    after = testing.assert_no_cheaper_collectives(rewritten, x, w)  # the fix applied: the row moves by the saving
    assert report.sent_bytes() - after.sent_bytes() == c.saved_bytes
    # The efficient twin: the weight sharded over data, so the psum sums different values.
    twin = shard_map(scale_by_summed_weight, mesh, (P("data"), P("data")), P("data"), check=check)
    testing.assert_no_cheaper_collectives(twin, x, randn(7, (4, 128)))


def test_a_defensive_all_reduce_is_reported_once_not_as_cheaper(mesh):
    case = next(c for c in workloads.DEFAULT_CASES if c.name == "issue21855")
    built = case.build(mesh, False)
    report = testing.collectives(built.step, *built.args)
    assert report.defensive and not report.cheaper and not report.implicit


@pytest.mark.parametrize("case", workloads.DEFAULT_CASES, ids=lambda c: c.name)
def test_no_false_alarm_on_the_bundled_workloads(mesh, case):
    import reprules

    for check in (False, True):
        kernels = case.kernels() if check else ()
        for k in kernels:
            reprules.replication_rule()(k)
        try:
            built = case.build(mesh, check)
            report = testing.collectives(built.step, *built.args)
        finally:
            for k in kernels:
                reprules.unregister(k)
        assert not report.implicit and not report.cheaper, report


# --- the link model -----------------------------------------------------------------------


def test_the_link_model_is_the_ring_model():
    link = _link_model.Link("test", 1e9, 0.0)
    assert _link_model.sent_bytes("all-reduce", 800, 4) == 1200  # 2(n-1)/n
    assert _link_model.sent_bytes("all-gather", 800, 4) == _link_model.sent_bytes("reduce-scatter", 800, 4) == 600
    assert _link_model.seconds("all-reduce", 1e9, 2, link) == pytest.approx(1.0)
    assert _link_model.seconds("all-gather", 1e9, 1, link) == 0.0
    assert _link_model.parse("200").bandwidth == 200e9 and _link_model.parse("nvlink").name == "nvlink"
    with pytest.raises(ValueError, match="unknown link 'warp-drive'"):
        _link_model.parse("warp-drive")


def test_the_report_estimates_time_with_the_chosen_link(mesh, monkeypatch):
    x = put(randn(8, (8, 128)), mesh, P("data"))
    step = shard_map(all_gather_then_own_shard, mesh, P("data"), P("data"))
    monkeypatch.setenv(_link_model.ENV, "1")  # 1 GB/s, no latency
    report = testing.collectives(step, x)
    assert report.link.bandwidth == 1e9
    assert report.seconds() == pytest.approx(3 / 4 * 4096 / 1e9)
    assert report.to_dict()["summary"]["est_seconds"] == pytest.approx(report.seconds())
    assert report.to_dict()["collectives"][0]["est_seconds"] == pytest.approx(report.seconds())
    with _link_model.using(_link_model.LINKS["nvlink"]):
        assert testing.collectives(step, x).link.name == "nvlink"


# --- the HLO evaluator --------------------------------------------------------------------

HLO = """HloModule m, num_partitions=8

%fused (param_0: f32[8,128], param_1: u32[]) -> f32[2,128] {
  %param_0 = f32[8,128]{1,0} parameter(0)
  %param_1 = u32[] parameter(1)
  %table = s32[8]{0} constant({0, 0, 1, 1, 2, 2, 3, 3})
  %ds = s32[1]{0} dynamic-slice(s32[8]{0} %table, u32[] %param_1), dynamic_slice_sizes={1}
  %i = s32[] reshape(s32[1]{0} %ds)
  %two = s32[] constant(2)
  %off = s32[] multiply(s32[] %i, s32[] %two)
  %zero = s32[] constant(0)
  ROOT %slice = f32[2,128]{1,0} dynamic-slice(f32[8,128]{1,0} %param_0, s32[] %off, s32[] %zero), dynamic_slice_sizes={2,128}
}

ENTRY %main (p: f32[8,128]) -> f32[2,128] {
  %p = f32[8,128]{1,0} parameter(0)
  %pid = u32[] partition-id()
  ROOT %f = f32[2,128]{1,0} fusion(f32[8,128]{1,0} %p, u32[] %pid), kind=kLoop, calls=%fused
}
"""


def test_the_evaluator_reads_a_table_lookup_of_the_partition_id():
    graph = _hlo_graph.parse(HLO)
    fused, main = graph.computations["fused"], graph.computations["main"]
    assert graph.partitions == 8 and main.entry and fused.params == {0: "param_0", 1: "param_1"}
    assert [u.name for u, _ in main.users("pid")] == ["f"]

    def param(device):
        return lambda i: _hlo_graph.evaluate(graph, main, main.instrs["f"].operands[i], device)

    assert [_hlo_graph.evaluate(graph, fused, "off", d, param(d)) for d in range(8)] == [0, 0, 2, 2, 4, 4, 6, 6]
    assert _hlo_graph.evaluate(graph, fused, "slice", 0, param(0)) is None  # not an integer expression


# --- the pytest fixtures ------------------------------------------------------------------


def test_the_fixtures(pytester):
    pytester.makepyfile(test_user='''
import sys
sys.path.insert(0, %r)
import jax
from jax.sharding import PartitionSpec as P
from helpers import make_mesh, put, randn, shard_map
from test_communication import all_gather_then_own_shard, pallas_copy

def test_cheaper_fails(no_cheaper_collectives):
    mesh = make_mesh()
    no_cheaper_collectives(shard_map(all_gather_then_own_shard, mesh, P("data"), P("data")),
                           put(randn(0, (8, 128)), mesh, P("data")))

def test_implicit_fails(no_implicit_collectives):
    mesh = make_mesh()
    no_implicit_collectives(pallas_copy, put(randn(0, (8, 128)), mesh, P("data")))

def test_twins_pass(no_cheaper_collectives, no_implicit_collectives):
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data"))
    assert no_cheaper_collectives(shard_map(lambda x: x * 3, mesh, P("data"), P("data")), x).cheaper == ()
    assert no_implicit_collectives(shard_map(pallas_copy, mesh, P("data"), P("data")), x).implicit == ()
''' % str(HERE.parent))
    result = pytester.runpytest_inprocess("-p", "no:reprules", "-p", "reprules._pytest_plugin",
                                          "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*1 collective with a cheaper equivalent in all_gather_then_own_shard*",
                                 "*rewrite: x  # each device's own shard*"])
    result.stdout.fnmatch_lines(["*1 implicit collective around opaque kernels in pallas_copy*",
                                 "*Fix:*", "*in_specs=P('data')*"])
