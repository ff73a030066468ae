"""tokamax's Pallas TPU kernels through reprules' tokamax pack, on CPU (TPU interpret mode).

The pack (entry point ``tokamax``, loaded on ``import tokamax``) registers
``rules.inferred()`` on ``reprules.kernels_in("tokamax")``: every rule is
derived from a kernel body, with ``reprules.inference()`` off. Running
tokamax's Mosaic TPU kernels on CPU needs three things besides
``pltpu.force_tpu_interpret_mode()``:

* ``tokamax.config.cross_compile(True)``: tokamax refuses TPU ops on a CPU
  device otherwise ("Not supported on cpu"), and its VJPs build new ops that do
  not inherit ``bypass_device_check``.
* A TPU description for the CPU device kind: ``pltpu.emit_pipeline`` (used by
  tokamax's gmm) and the interpreter ask ``get_tpu_info()``, which raises
  "Unsupported TPU device kind: cpu". The fixture below registers a v5e under
  "cpu" in JAX's (private) ``jax._src.tpu_info.registry`` and removes it after.
* An explicit implementation (``implementation="mosaic_tpu"``); the default
  picks XLA on CPU.

Found along the way (see the report): tokamax's ragged_dot VJP types the weight
gradient by the weight's *own* type (``jax.typeof(rhs).manual_axis_type
.to_ct_mat()``, an explicit ``out_shape`` annotation, which wins over any rule).
A replicated weight next to data-sharded activations therefore gets a gradient
typed replicated: no psum over 'data', a silently wrong weight gradient. Casting
the weight to varying over 'data' before the call (``jax.lax.pcast``) gives the
correct gradient and exactly the one psum it needs.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import max_err, pack_state_on_import, psum_axes, put, randn, shard_map
from jax.sharding import PartitionSpec as P

import reprules
from reprules import testing

tokamax = pytest.importorskip(
    "tokamax", reason="tokamax (PyPI `tokamax`, needs JAX >= 0.11.1) is not installed; these tests run "
    "in a separate environment with it"
)
pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
if not hasattr(pltpu, "force_tpu_interpret_mode"):
    pytest.skip(f"JAX {jax.__version__} has no force_tpu_interpret_mode", allow_module_level=True)

SIZES = (48, 80)  # two ragged groups in each data shard of 128 rows
M, K, N = 512, 128, 128  # tokamax's TPU gmm wants every non-group dimension >= 128


@pytest.fixture(autouse=True)
def pack():
    """The pack's registration, as on ``import tokamax`` (conftest clears rules after each test)."""
    from reprules._builtin_packs import tokamax as tokamax_pack

    tokamax_pack.tokamax(tokamax)


@pytest.fixture
def cpu_as_tpu():
    """Run tokamax's Mosaic TPU kernels on CPU: interpret mode, the CPU device
    described as a TPU v5e, and no device check (tokamax's cross_compile)."""

    @contextlib.contextmanager
    def ctx():
        with testing.tpu_on_cpu("v5e"), tokamax.config.cross_compile(True):
            yield

    return ctx


def _ragged_inputs(mesh):
    lhs = put(randn(0, (M, K)), mesh, P("data", None))
    rhs = put(randn(1, (len(SIZES), K, N)), mesh, P())
    t = randn(2, (M, N))
    return lhs, rhs, t


def _ragged_reference(lhs, rhs, t):
    """Unsharded NumPy: rows of group g (within each data shard) times rhs[g], and its gradients."""
    ln, rn, tn = (np.asarray(a, np.float64) for a in (lhs, rhs, t))
    group = np.tile(np.repeat(np.arange(len(SIZES)), SIZES), 4)
    out = np.einsum("mk,mkn->mn", ln, rn[group])
    glhs = np.einsum("mn,mkn->mk", tn, rn[group])
    grhs = np.stack([ln[group == g].T @ tn[group == g] for g in range(len(SIZES))])
    return out, glhs, grhs


def _ragged_dot(cast_weight):
    sizes = jnp.array(SIZES, jnp.int32)

    def grouped(lhs, rhs):
        if cast_weight:  # the weight's cotangent is typed like the weight: make it varying over data
            rhs = jax.lax.pcast(rhs, "data", to="varying")
        return tokamax.ragged_dot(
            lhs, rhs, sizes, preferred_element_type=jnp.float32, implementation="mosaic_tpu"
        )

    return grouped


@pytest.mark.skipif(not hasattr(jax.lax, "pcast"), reason=f"JAX {jax.__version__} has no jax.lax.pcast")
def test_ragged_dot_forward_and_gradients_equal_the_reference(mesh, cpu_as_tpu):
    lhs, rhs, t = _ragged_inputs(mesh)
    f = shard_map(_ragged_dot(cast_weight=True), mesh, (P("data", None), P()), P("data", None))

    def loss(lhs, rhs):
        return (f(lhs, rhs) * t).sum()

    with cpu_as_tpu():
        out = jax.jit(f)(lhs, rhs)
        grad = jax.grad(loss, argnums=(0, 1))
        psums = psum_axes(grad, lhs, rhs)
        glhs, grhs = jax.jit(grad)(lhs, rhs)
    expected, expected_lhs, expected_rhs = _ragged_reference(lhs, rhs, t)
    assert max_err(out, expected) < 1e-3
    assert max_err(glhs, expected_lhs) < 1e-3
    assert max_err(grhs, expected_rhs) / np.abs(expected_rhs).max() < 1e-5
    assert psums == [("data",)]  # the weight gradient's psum; nothing over 'model'


def test_ragged_dot_forward_without_the_cast(mesh, cpu_as_tpu):
    lhs, rhs, t = _ragged_inputs(mesh)
    f = shard_map(_ragged_dot(cast_weight=False), mesh, (P("data", None), P()), P("data", None))
    with cpu_as_tpu():
        out = jax.jit(f)(lhs, rhs)
    assert max_err(out, _ragged_reference(lhs, rhs, t)[0]) < 1e-3


def test_ragged_dot_weight_gradient_without_the_cast_is_widened_and_exact(mesh, cpu_as_tpu):
    """tokamax's ragged_dot VJP annotates the weight gradient's out_shape with the
    weight's own (replicated) type, although it is a per-shard partial sum: JAX
    alone would skip its psum over 'data' and return a wrong gradient. Inference
    sees the body depends on data-varying inputs: the output is typed by the
    union (varying over 'data'), with a ReplicationWarning, and reprules'
    custom_vjp fix adds exactly the psum over 'data'."""
    from reprules._shim.rules import _union

    _union._warned.clear()
    lhs, rhs, t = _ragged_inputs(mesh)
    f = shard_map(_ragged_dot(cast_weight=False), mesh, (P("data", None), P()), P("data", None))
    grad = jax.grad(lambda lhs, rhs: (f(lhs, rhs) * t).sum(), argnums=(0, 1))

    with cpu_as_tpu(), pytest.warns(reprules.ReplicationWarning, match=r"(?s)'pallas_tpu_ragged_dot_tgmm'.*silently wrong"):
        psums = psum_axes(grad, lhs, rhs)
        glhs, grhs = jax.jit(grad)(lhs, rhs)
    _, expected_lhs, expected_rhs = _ragged_reference(lhs, rhs, t)
    assert max_err(glhs, expected_lhs) < 1e-3
    assert max_err(grhs, expected_rhs) / np.abs(expected_rhs).max() < 1e-5
    assert psums == [("data",)]  # the weight gradient's psum; nothing over 'model'


def test_router_topk_forward_equals_lax_top_k(mesh, cpu_as_tpu):
    from tokamax._src.ops.router_topk.api import router_topk

    scores = put(randn(0, (512, 128)), mesh, P("data", None))
    f = shard_map(
        lambda s: router_topk(s, 2, implementation="mosaic_tpu"),
        mesh, P("data", None), (P("data", None), P("data", None)),
    )
    with cpu_as_tpu():
        weights, experts = jax.jit(f)(scores)
    ref_weights, ref_experts = jax.lax.top_k(jnp.asarray(scores), 2)
    assert max_err(weights, ref_weights) == 0.0
    assert np.array_equal(np.asarray(experts), np.asarray(ref_experts))


def test_the_pack_loads_on_import_tokamax():
    assert pack_state_on_import("tokamax") == [
        "True",
        "[('reprules._builtin_packs.tokamax:tokamax', 'loaded')]",
        "rules.inferred() pack reprules._builtin_packs.tokamax:tokamax",
    ]


def test_without_the_pack_jax_refuses_the_kernel(mesh, cpu_as_tpu, no_inference):
    reprules.unregister(reprules.kernels_in("tokamax"))
    lhs, rhs, t = _ragged_inputs(mesh)
    f = shard_map(_ragged_dot(cast_weight=False), mesh, (P("data", None), P()), P("data", None))
    with cpu_as_tpu(), pytest.raises(ValueError, match="manual_axis_type"):
        jax.jit(f)(lhs, rhs)


@pytest.mark.filterwarnings("ignore:pltpu.create_tensorcore_mesh is deprecated:DeprecationWarning")  # tokamax's
def test_fused_fp8_matmul_gradients_equal_its_reference_with_checking_off(mesh, cpu_as_tpu, monkeypatch):
    """tokamax's fused_fp8_matmul: a ``pl.kernel`` under a ``custom_vjp`` whose bwd
    calls further ``custom_vjp`` and ``custom_vmap`` ops. The cotangent check
    follows those calls, so the weight's per-shard gradient is psummed over
    'data' once. fp8 quantisation scales come from each shard's values, so the
    reference is tokamax's own XLA op on the same shards, with checking off."""
    from jax._src.pallas.mosaic import core as tpu_core
    from tokamax._src.ops.experimental.fused_fp8_matmul import base, pallas_mosaic_tpu

    monkeypatch.setattr(tpu_core, "_get_default_num_cores", lambda: 1)  # a CPU device reports None; a v5e has 1

    lhs = put(randn(0, (4 * 256, 256)), mesh, P("data", None)).astype(jnp.bfloat16)
    rhs = put(randn(1, (256, 256)) * 0.02, mesh, P()).astype(jnp.bfloat16)
    t = put(randn(2, (4 * 256, 256)), mesh, P("data", None))

    def grads(op, check):
        f = shard_map(lambda a, b: op(a, b), mesh, (P("data", None), P()), P("data", None), check=check)
        grad = jax.grad(lambda a, b: (f(a, b).astype(jnp.float32) * t).sum(), argnums=(0, 1))
        return grad

    with cpu_as_tpu():
        grad = grads(pallas_mosaic_tpu.PallasMosaicTpuFusedFp8Matmul(), check=True)
        psums = psum_axes(grad, lhs, rhs)
        glhs, grhs = jax.jit(grad)(lhs, rhs)
        ref_lhs, ref_rhs = jax.jit(grads(base.FusedFp8Matmul(), check=False))(lhs, rhs)
    assert max_err(glhs, ref_lhs) == 0.0
    assert max_err(grhs, ref_rhs) / np.abs(np.asarray(ref_rhs, np.float32)).max() < 1e-2  # bf16 psum order
    assert psums == [("data",)]
