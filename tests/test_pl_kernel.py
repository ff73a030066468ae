"""Issue 16: rules for Pallas' second entry point, ``pl.kernel`` (and ``pl.core_map``).

``pl.kernel(body, out_shape, mesh=...)`` (JAX 0.8+) binds ``core_map`` (0.8 -
0.9) or ``mpmd_map`` (0.10+), not ``pallas_call``. A rule registered on the
*body* is honoured as for ``pallas_call``: outputs typed by the rule, needed
psums kept, defensive ones gone, gradients exact. Without reprules, 0.8 - 0.9
type every output replicated (``out_specs=P()`` accepted, the #21855 step
refused by the custom_vjp type check), and 0.10+ refuse an unannotated
out_shape. The kernels run on CPU under ``pltpu.force_tpu_interpret_mode()``
(0.7+) with a one-core TensorCore mesh, copying through VMEM.

``pl.core_map`` called directly writes into refs its caller made; a rule on
the function passed to it cannot change their types and is refused inside a
checked shard_map (0.6+). On 0.4.38 - 0.5.x JAX itself refuses core_map
programs under ``check_rep`` (no replication rule for ``run_state``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from helpers import JAX_VERSION, count_all_reduce, make_mesh, max_err, psum_axes, put, randn, shard_map
from reprules import rules

try:
    from jax.experimental.pallas import tpu as pltpu
except ImportError:  # pragma: no cover - every version of the matrix has it
    pltpu = None

HAS_KERNEL = hasattr(pl, "kernel")  # 0.8+
with warnings.catch_warnings():  # 0.12 deprecates pl.core_map in favour of pl.kernel
    warnings.simplefilter("ignore", DeprecationWarning)
    core_map = getattr(pl, "core_map", None)  # 0.4.38+
CAN_INTERPRET = hasattr(pltpu, "force_tpu_interpret_mode")  # 0.7+
needs_kernel = pytest.mark.skipif(
    not (HAS_KERNEL and CAN_INTERPRET),
    reason=f"JAX {jax.__version__} has no pl.kernel (added in JAX 0.8)",
)
MPMD = JAX_VERSION >= (0, 10)  # pl.kernel over mpmd_map: lists of bodies, out_shape typed at creation


@pytest.fixture(autouse=True)
def _tpu_interpret():
    if not CAN_INTERPRET:
        yield
        return
    with pltpu.force_tpu_interpret_mode():
        yield


def tc_mesh(axis="core", num_cores=1):
    """A TensorCore mesh (the kernel's own mesh, not the shard_map's), one core by default."""
    mesh_type = getattr(pltpu, "TensorCoreMesh", None)  # 0.11+: create_tensorcore_mesh deprecated
    if mesh_type is not None and "axis_name" in inspect.signature(mesh_type).parameters:
        return mesh_type(axis_name=axis, num_cores=num_cores)
    return pltpu.create_tensorcore_mesh(axis, num_cores=num_cores)


def sds(x, varying=None):
    """``x``'s out_shape, hand-annotated with ``varying`` axes if given (0.10+ spelling)."""
    if varying is None:
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ShapeDtypeStruct(
        x.shape, x.dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=frozenset(varying))
    )


# --- kernels: copy through VMEM (scaled by 2), and a broadcast multiply ----------------------


def scale_body(x_ref, o_ref):
    def scoped(buf):
        pltpu.sync_copy(x_ref, buf)
        buf[...] = buf[...] * 2.0
        pltpu.sync_copy(buf, o_ref)

    pl.run_scoped(scoped, pltpu.VMEM(x_ref.shape, x_ref.dtype))


def mul_body(x_ref, w_ref, o_ref):
    def scoped(xb, wb):
        pltpu.sync_copy(x_ref, xb)
        pltpu.sync_copy(w_ref, wb)
        xb[...] = xb[...] * wb[...]
        pltpu.sync_copy(xb, o_ref)

    pl.run_scoped(scoped, pltpu.VMEM(x_ref.shape, x_ref.dtype), pltpu.VMEM(w_ref.shape, w_ref.dtype))


def scale(x, body=scale_body, out_shape=None):
    """``body`` through ``pl.kernel``, the kernel object built at each call (as users do)."""
    return pl.kernel(body, out_shape if out_shape is not None else sds(x), mesh=tc_mesh())(x)


def mul(x, w):
    return pl.kernel(mul_body, sds(x), mesh=tc_mesh())(x, w)


@jax.custom_vjp
def kernel_scale(x):
    return scale(x)


kernel_scale.defvjp(lambda x: (scale(x), None), lambda _, g: (scale(g),))


@jax.custom_vjp
def kernel_mul(x, w):
    return mul(x, w)


kernel_mul.defvjp(lambda x, w: (mul(x, w), (x, w)), lambda res, g: (mul(g, res[1]), mul(g, res[0])))


@pytest.fixture
def setup():
    mesh = make_mesh()
    x = put(randn(0, (8, 128)), mesh, P("data", None))
    weights = randn(1, (8, 128))  # data-dependent cotangent
    return mesh, x, weights


def scale_loss(mesh, weights, check=True):
    f = shard_map(kernel_scale, mesh, P("data", None), P("data", None), check=check)
    return lambda x: (f(x) * weights).sum()


# --- pl.kernel with a rule ---------------------------------------------------------------------


@needs_kernel
def test_registered_kernel_is_typed_by_its_rule(setup):
    mesh, x, _ = setup
    reprules.replication_rule(rules.same())(scale_body)
    out = jax.jit(shard_map(scale, mesh, P("data", None), P("data", None)))(x)
    assert max_err(out, 2 * x) == 0.0
    # Typed varying over `data` (JAX alone, 0.8 - 0.9: replicated, and P() accepted).
    with pytest.raises(ValueError, match="out_specs"):
        jax.jit(shard_map(scale, mesh, P("data", None), P()))(x)
    # Replicated over `model`: out_specs may omit it.
    out = jax.jit(shard_map(scale, mesh, P("data", None), P("data", None)))(x)
    assert out.sharding.spec[0] == "data"


@needs_kernel
def test_21855_step_no_psum_and_exact_gradient(setup):
    mesh, x, w = setup
    reprules.replication_rule(rules.same())(scale_body)
    grad = jax.grad(scale_loss(mesh, w))
    assert psum_axes(grad, x) == []
    assert count_all_reduce(grad, x) == (0, 0, 0)
    reference = jax.grad(lambda x: (2 * x * w).sum())(jnp.asarray(x))  # unsharded
    assert max_err(jax.jit(grad)(x), reference) < 1e-6


@needs_kernel
def test_21855_step_without_a_rule_is_inferred_by_default(setup):
    """No rule and no ``inference()``: JAX would refuse the unannotated out_shape (0.10+)
    or type the output replicated (0.8 - 0.9), so the rule is derived from the body."""
    mesh, x, w = setup
    assert not reprules.registered()
    grad = jax.grad(scale_loss(mesh, w))
    assert psum_axes(grad, x) == []
    assert count_all_reduce(grad, x) == (0, 0, 0)
    reference = jax.grad(lambda x: (2 * x * w).sum())(jnp.asarray(x))  # unsharded
    assert max_err(jax.jit(grad)(x), reference) < 1e-6
    with pytest.raises(ValueError, match="out_specs"):  # typed varying over `data`, as derived
        jax.jit(shard_map(scale, mesh, P("data", None), P()))(x)


@needs_kernel
def test_check_off_keeps_jaxs_defensive_psum(setup):
    """The contrast: with checking off, the backward pass psums over `model` (x is replicated over it)."""
    mesh, x, w = setup
    grad = jax.grad(scale_loss(mesh, w, check=False))
    assert psum_axes(grad, x) == [("model",)]
    assert max_err(jax.jit(grad)(x), 2 * w) < 1e-6


@needs_kernel
def test_needed_psum_kept_for_a_replicated_weight(setup):
    """``mul(x, w)`` with ``w`` replicated: the rule casts ``w`` up; its gradient is the psum over `data`."""
    mesh, x, wts = setup
    reprules.replication_rule(rules.same())(mul_body)
    w = put(randn(2, (2, 128)), mesh, P())

    def loss(x, w):
        f = shard_map(kernel_mul, mesh, (P("data", None), P()), P("data", None))
        return (f(x, w) * wts).sum()

    grad = jax.grad(loss, argnums=(0, 1))
    assert psum_axes(grad, x, w) == [("data",)]  # needed; none over `model`
    jaxpr_psums, _, _ = count_all_reduce(grad, x, w)
    assert jaxpr_psums == 1

    def reference(x, w):
        return ((x.reshape(4, 2, 128) * w).reshape(8, 128) * wts).sum()

    want = jax.grad(reference, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    assert max_err(jax.jit(grad)(x, w), want) < 1e-5


@needs_kernel
def test_kernel_built_before_the_rule_is_registered(setup):
    """A pl.kernel object made before reprules activated and before the rule: typed at trace time."""
    mesh, x, _ = setup
    block = jax.ShapeDtypeStruct((2, 128), x.dtype)
    early = pl.kernel(scale_body, block, mesh=tc_mesh())  # outside shard_map, no rule yet
    assert not reprules.registered()
    reprules.replication_rule(rules.same())(scale_body)
    assert "test_pl_kernel.scale_body" in reprules.registered()
    f = shard_map(lambda x: early(x), mesh, P("data", None), P("data", None))
    assert max_err(jax.jit(f)(x), 2 * x) == 0.0
    with pytest.raises(ValueError, match="out_specs"):
        jax.jit(shard_map(lambda x: early(x), mesh, P("data", None), P()))(x)


@needs_kernel
def test_invariant_rule_allows_replicated_out_specs(setup):
    """``rules.invariant("data")`` (a kernel communicating over it) types the output replicated."""
    mesh, _, _ = setup
    reprules.replication_rule(rules.invariant("data"))(scale_body)
    x = put(randn(0, (2, 128)), mesh, P())
    y = jax.jit(shard_map(lambda x: scale(jax.lax.pcast(x, "data", to="varying")), mesh, P(), P()))(x)
    assert max_err(y, 2 * x) == 0.0


# --- safety modes, reports, no harm ---------------------------------------------------------


@needs_kernel
def test_rule_less_kernel_returned_replicated_is_refused_by_strict_mode(setup, no_inference):
    mesh, x, _ = setup

    def other(x_ref, o_ref):
        pltpu.sync_copy(x_ref, o_ref)

    reprules.replication_rule(rules.same())(other)  # reprules active, scale_body has no rule
    # 0.10+ refuse an unannotated out_shape themselves; annotated replicated, JAX accepts it.
    out_shape = jax.ShapeDtypeStruct((2, 128), x.dtype) if not MPMD else sds(jnp.zeros((2, 128)), ())
    f = shard_map(lambda x: scale(x, out_shape=out_shape), mesh, P("data", None), P())
    with reprules.strict(), pytest.raises(reprules.StrictModeError, match="scale_body"):
        jax.jit(f)(x)


@needs_kernel
def test_strict_mode_accepts_registered_kernels(setup):
    """Strict mode refuses rule-less kernels only: a registered body typed replicated passes."""
    mesh, _, _ = setup
    reprules.replication_rule(rules.invariant("data"))(scale_body)
    x = put(randn(0, (2, 128)), mesh, P())
    f = shard_map(lambda x: scale(jax.lax.pcast(x, "data", to="varying")), mesh, P(), P())
    with reprules.strict():
        assert max_err(jax.jit(f)(x), 2 * x) == 0.0


@needs_kernel
def test_lying_rule_is_caught_by_verify(setup):
    mesh, x, _ = setup
    reprules.replication_rule(rules.invariant("data"))(scale_body)  # but it varies over data
    f = jax.jit(shard_map(scale, mesh, P("data", None), P()))
    with pytest.raises(reprules.ReplicationMismatchError, match="'scale_body'.*'data'"), reprules.verify():
        f(x).block_until_ready()


@needs_kernel
def test_collectives_report_names_the_body(setup):
    mesh, x, w = setup
    reprules.replication_rule(rules.same())(scale_body)
    report = reprules.testing.collectives(jax.grad(scale_loss(mesh, w)), x)
    names = {k.name: k for k in report.kernels}
    assert set(names) == {"scale_body"}, report.kernels
    kernel = names["scale_body"]
    assert kernel.has_rule and kernel.rule == "rules.same()" and kernel.identified
    assert report.count("all-reduce") == 0


@needs_kernel
def test_rule_less_kernel_is_unchanged_by_reprules(setup, no_inference):
    """Same jaxpr, or the same JAX error, with and without reprules active elsewhere."""
    mesh, x, _ = setup

    def outcome(out_specs):
        f = shard_map(scale, mesh, P("data", None), out_specs)
        try:
            return "ok", str(jax.make_jaxpr(f)(x))
        except Exception as err:  # noqa: BLE001 - JAX's own error is the outcome compared
            return type(err).__name__, str(err)

    before = [outcome(P("data", None)), outcome(P())]
    assert not reprules.registered()

    def other(x_ref, o_ref):
        pltpu.sync_copy(x_ref, o_ref)

    reprules.replication_rule(rules.same())(other)
    assert [outcome(P("data", None)), outcome(P())] == before
    if not MPMD:  # 0.8 - 0.9: JAX types the rule-less output replicated and accepts P()
        assert before[1][0] == "ok"
    else:  # 0.10+: JAX refuses the unannotated out_shape
        assert "manual_axis_type" in before[0][1]


@pytest.mark.skipif(not MPMD, reason="hand annotation of a pl.kernel out_shape is used by JAX 0.10+ only")
def test_hand_annotation_wins_over_the_rule(setup):
    mesh, x, _ = setup
    reprules.replication_rule(rules.same())(scale_body)
    block = jnp.zeros((2, 128))
    annotated = shard_map(lambda x: scale(x, out_shape=sds(block, ("data", "model"))), mesh,
                          P("data", None), P("data", "model"))
    assert jax.jit(annotated)(x).shape == (8, 256)  # typed as annotated: varying over model too


# --- MPMD: a list of bodies (0.10+) ------------------------------------------------------------


def copy_a(x_ref, o_ref):
    pltpu.sync_copy(x_ref, o_ref)


def copy_b(x_ref, o_ref):
    pltpu.sync_copy(x_ref, o_ref)


def mpmd_copy(x):
    # Two core types do not trace on CPU (a SparseCore mesh needs a TPU), and JAX refuses two
    # TensorCore meshes: a test-only TensorCore mesh compatible with its twin stands in.
    mesh = tc_mesh()

    class Twin(type(mesh)):
        def check_is_compatible_with(self, other_mesh):
            return True

    fields = {f.name: getattr(mesh, f.name) for f in dataclasses.fields(mesh) if f.init}
    return pl.kernel([copy_a, copy_b], sds(x), mesh=[Twin(**fields), Twin(**fields)])(x)


@pytest.mark.skipif(not MPMD, reason="pl.kernel takes a list of bodies from JAX 0.10")
def test_mpmd_registered_bodies_must_agree(setup):
    mesh, x, _ = setup
    reprules.replication_rule(rules.same())(copy_a)
    reprules.replication_rule(rules.invariant("data"))(copy_b)
    f = shard_map(mpmd_copy, mesh, P("data", None), P("data", None))
    with pytest.raises(reprules.RuleError, match=r"(?s)disagree.*copy_a.*copy_b"):
        jax.make_jaxpr(f)(x)


@pytest.mark.skipif(not MPMD, reason="pl.kernel takes a list of bodies from JAX 0.10")
def test_mpmd_agreeing_rule_types_the_kernel(setup):
    mesh, x, _ = setup
    reprules.replication_rule(rules.same())(copy_a)  # copy_b has none: covered by copy_a's rule
    jax.make_jaxpr(shard_map(mpmd_copy, mesh, P("data", None), P("data", None)))(x)
    with pytest.raises(ValueError, match="out_specs"):
        jax.make_jaxpr(shard_map(mpmd_copy, mesh, P("data", None), P()))(x)


# --- pl.core_map called directly ---------------------------------------------------------------


def _core_map_program(fn):
    def call(x):
        def stateful(refs):
            x_ref, o_ref = refs
            core_map(tc_mesh())(lambda: fn(x_ref, o_ref))

        return pl.run_state(stateful)((x, jnp.zeros_like(x)))[1]

    return call


@pytest.mark.skipif(not CAN_INTERPRET or not (0, 8) <= JAX_VERSION < (0, 11), reason=(
    "pl.core_map on varying refs runs under check_vma on JAX 0.8 - 0.10 only (0.5 - 0.6: the "
    "TPU-mesh interpreter leaves outputs unwritten on CPU; 0.7: JAX refuses its discharged "
    "pallas_call; 0.11+: mpmd_map refuses Refs with varying manual axis types)"))
def test_core_map_is_typed_by_its_refs_without_a_rule(setup):
    mesh, x, _ = setup
    reprules.replication_rule(rules.same())(scale_body)  # the body, called inside the core_map
    f = jax.jit(shard_map(_core_map_program(scale_body), mesh, P("data", None), P("data", None)))
    assert max_err(f(x), 2 * x) == 0.0


def copy_into(x_ref, o_ref):
    scale_body(x_ref, o_ref)


@pytest.mark.skipif(core_map is None or JAX_VERSION < (0, 6), reason=(
    "JAX <= 0.5 (check_rep) refuses core_map programs itself: see the next test"))
def test_registered_core_map_function_is_refused(setup):
    mesh, x, _ = setup
    reprules.replication_rule(rules.same())(copy_into)

    def program(x):
        def stateful(refs):
            mapped = functools.update_wrapper(functools.partial(copy_into, *refs), copy_into)
            core_map(tc_mesh())(mapped)  # the mapped function has a rule (found through the partial)

        return pl.run_state(stateful)((x, jnp.zeros_like(x)))[1]

    f = shard_map(program, mesh, P("data", None), P("data", None))
    with pytest.raises(reprules.RuleError, match=r"(?s)copy_into.*pl\.core_map.*pl\.kernel"):
        jax.make_jaxpr(f)(x)


def plain_copy_into(x_ref, o_ref):
    o_ref[...] = x_ref[...]


@pytest.mark.skipif(core_map is None or JAX_VERSION >= (0, 6), reason="check_rep regime only (JAX <= 0.5)")
def test_core_map_under_check_rep_is_refused_by_jax(setup):
    """0.4.38 - 0.5.x: JAX has no replication rule for run_state (which makes core_map's refs),
    so a core_map program under check_rep is refused by JAX itself, rule or not."""
    import numpy as np
    from jax._src.pallas.mosaic import core as tpu_core  # test-only: create_tensorcore_mesh needs a TPU

    mesh, x, _ = setup
    tensorcores = tpu_core.TensorCoreMesh(np.array([tpu_core.TensorCore(0)]), ["core"])
    reprules.replication_rule(rules.same())(plain_copy_into)

    def program(x):
        def stateful(refs):
            core_map(tensorcores)(functools.update_wrapper(functools.partial(plain_copy_into, *refs),
                                                           plain_copy_into))

        return pl.run_state(stateful)((x, jnp.zeros_like(x)))[1]

    f = shard_map(program, mesh, P("data", None), P("data", None))
    with pytest.raises(NotImplementedError, match="No replication rule for run_state") as info:
        jax.make_jaxpr(f)(x)
    assert not isinstance(info.value, reprules.ReprulesError)
