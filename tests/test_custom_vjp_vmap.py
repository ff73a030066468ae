"""A kernel's out_shape annotated with an operand's own type, under custom_vjp, vmap and shard_map.

Found by the coverage run: JAX's splash attention, MQA, vmapped over a batch
sharded on ``data`` with the query heads on ``model`` and the single k/v head
replicated over ``model``. With only ``import reprules`` (the pack's
``rules.same()`` on the splash kernels) and checking on, dk/dv had no psum over
``model`` and were off by ~0.9 relative; checking off was exact.

vmap is not the cause: the same happens without it. Splash (JAX 0.10+) types its
dkv kernel's out_shape ``jax.ShapeDtypeStruct.like(k)``, which copies k's varying
axes: ``{data}`` where k is batch-sharded (and nothing, so no annotation, where k
is replicated over every axis, as in tests/test_jax_pallas_ops.py). reprules let
a hand annotation win over a *declared* rule, so dk was typed varying over
``data`` only although the per-shard dk sums over the local query heads only:
the custom_vjp fix saw no cotangent varying over ``model`` and added no psum.
Now an annotation that claims fewer axes than the rule (declared or derived) is
widened to the union, with a ``ReplicationWarning`` (``reprules.strict()``
refuses it), and the gradient gets its psum over exactly ``model``.

The minimal kernel mimics it: ``out = q * k`` with q's heads sharded over
``model`` and k shared by them; the bwd's dk kernel sums over the local heads,
its out_shape annotated like k. Gradients are compared with checking off and
with ``jax.grad`` of the op on the whole arrays.
"""

import contextlib
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    CAST_UP,
    CUSTOM_VJP3_MODES,
    NEW_SHARD_MAP,
    count_all_reduce,
    custom_vjp3,
    make_mesh,
    max_err,
    psum_axes,
    put,
    randn,
    shard_map,
)
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules

B, H, S = 4, 4, 128  # batch over data (4), heads over model (2)
_FIELD = "manual_axis_type" if hasattr(jax.ShapeDtypeStruct((1,), jnp.float32), "manual_axis_type") else "vma"

vjp3 = pytest.mark.parametrize("vjp3", CUSTOM_VJP3_MODES, ids=lambda on: f"vjp3={'on' if on else 'off'}")
vmapped = pytest.mark.parametrize("vmap", [True, False], ids=["vmap", "no-vmap"])


@pytest.fixture(autouse=True)
def _fresh_warnings():
    from reprules._shim.rules import _union

    _union._warned.clear()  # one warning per kernel and process: each test starts afresh
    yield


def _like(x):
    """An out_shape annotated with ``x``'s own type, as ``jax.ShapeDtypeStruct.like(k)`` in
    splash attention (JAX 0.10+); no annotation where out_shape carries none (JAX <= 0.5)."""
    if not NEW_SHARD_MAP:
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, **{_FIELD: getattr(jax.typeof(x), _FIELD)})


def mul_kernel(q_ref, k_ref, o_ref):
    o_ref[...] = q_ref[...] * k_ref[...]


def dk_kernel(g_ref, q_ref, o_ref):  # the shared k's cotangent: a sum over the local heads only
    o_ref[...] = jnp.sum(g_ref[...] * q_ref[...], axis=0, keepdims=True)


def _mul(q, k):
    return pl.pallas_call(mul_kernel, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), interpret=True)(q, k)


def _op(dk_out_shape=_like):
    @jax.custom_vjp
    def mul(q, k):  # q: (heads, seq), k: (1, seq), shared by the heads
        return _mul(q, k)

    def bwd(res, g):
        q, k = res
        dk = pl.pallas_call(dk_kernel, out_shape=dk_out_shape(k), interpret=True)(g, q)
        return _mul(g, k), dk

    mul.defvjp(lambda q, k: (_mul(q, k), (q, k)), bwd)
    return mul


def _inputs(mesh):
    q = put(randn(0, (B, H, S)), mesh, P("data", "model"))
    k = put(randn(1, (B, 1, S)), mesh, P("data"))
    return q, k, randn(2, (B, H, S))


def _grad(mesh, t, vmap, op=None, check=True):
    op = op or _op()
    body = (lambda q, k: jax.vmap(op)(q, k)) if vmap else (lambda q, k: op(q[0], k[0])[None])
    f = shard_map(body, mesh, (P("data", "model"), P("data")), P("data", "model"), check=check)
    return jax.grad(lambda q, k: (f(q, k) * t).sum(), argnums=(0, 1))


def _reference(q, k, t):
    return jax.grad(lambda q, k: (q * k * t).sum(), argnums=(0, 1))(np.asarray(q), np.asarray(k))


def _widened():
    """Where JAX types out_shape annotations (0.6+), the too-small one is widened with a warning."""
    return pytest.warns(reprules.ReplicationWarning, match=r"'dk_kernel'.*replicated over \{'model'\}.*"
                        r"rules\.same\(\)") if NEW_SHARD_MAP else contextlib.nullcontext()


def _register():
    reprules.replication_rule()(mul_kernel)
    reprules.replication_rule()(dk_kernel)


@vjp3
@vmapped
def test_shared_operand_gradient_is_psummed_over_exactly_model(vjp3, vmap):
    _register()
    mesh = make_mesh()
    q, k, t = _inputs(mesh)
    with custom_vjp3(vjp3):
        grad = _grad(mesh, t, vmap)
        with _widened():
            got = jax.jit(grad)(q, k)
            psums = psum_axes(grad, q, k)
        off = jax.jit(_grad(mesh, t, vmap, check=False))(q, k)
    assert max_err(got, _reference(q, k, t)) < 1e-4
    assert max_err(got, off) < 1e-5
    assert psums == [("model",)]  # dk's, over the heads' axis only; none over data (k varies over it)
    jaxpr, stablehlo, _ = count_all_reduce(grad, q, k)
    assert (jaxpr, stablehlo) == (1, 1)


@pytest.mark.skipif(not NEW_SHARD_MAP, reason="out_shape carries varying axes from JAX 0.6 (check_vma)")
@vmapped
def test_strict_refuses_it_naming_kernel_rule_axes_and_version(vmap):
    _register()
    mesh = make_mesh()
    q, k, t = _inputs(mesh)
    with reprules.strict(), pytest.raises(
        reprules.RuleError,
        match=r"(?s)Pallas kernel 'dk_kernel' annotates output 0 as replicated over \{'model'\}, but its "
              r"replication rule, rules\.same\(\) \(registered from .*test_custom_vjp_vmap\.py.*\), types it "
              r"varying over \{'model'\} \(mesh axes \{'data', 'model'\}, JAX \d.*Why:.*gradient misses its "
              r"psum.*Fix: annotate the output as varying over \{'data', 'model'\}.*" + CAST_UP,
    ):
        jax.jit(_grad(mesh, t, vmap))(q, k)


@pytest.mark.skipif(not NEW_SHARD_MAP, reason="out_shape carries varying axes from JAX 0.6 (check_vma)")
def test_an_annotation_claiming_what_the_rule_says_is_kept_without_warning():
    """dk annotated varying over data and model (the rule's union): no widening, no warning."""
    _register()
    mesh = make_mesh()
    q, k, t = _inputs(mesh)

    def both(k):
        cast_up = getattr(jax.lax, "pcast", None)  # 0.6 - 0.7: jax.lax.pvary
        return _like(cast_up(k, "model", to="varying") if cast_up else jax.lax.pvary(k, "model"))

    grad = _grad(mesh, t, vmap=True, op=_op(dk_out_shape=both))
    with warnings.catch_warnings():
        warnings.simplefilter("error", reprules.ReplicationWarning)
        got = jax.jit(grad)(q, k)
        assert psum_axes(grad, q, k) == [("model",)]
    assert max_err(got, _reference(q, k, t)) < 1e-4


@pytest.mark.skipif(not NEW_SHARD_MAP, reason="JAX <= 0.5 psums such cotangents itself")
def test_without_a_kernel_jax_decides_as_alone():
    """The same custom_vjp in jnp, vmapped: no registered kernel, so JAX's own refusal stands."""

    @jax.custom_vjp
    def mul(q, k):
        return q * k

    mul.defvjp(lambda q, k: (q * k, (q, k)), lambda res, g: (g * res[1], (g * res[0]).sum(0, keepdims=True)))
    reprules.replication_rule()(mul_kernel)  # reprules active, for another kernel
    mesh = make_mesh()
    q, k, t = _inputs(mesh)
    with pytest.raises(Exception) as info:  # _RepError (0.6), ValueError (0.7+)
        jax.jit(_grad(mesh, t, vmap=True, op=mul))(q, k)
    assert not isinstance(info.value, reprules.ReprulesError)


# --- JAX's splash attention, MQA, vmapped over the batch (the coverage case) --------------------


def _splash():
    from reprules._builtin_packs import jax_pallas_ops as pack

    sk = pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel")
    if "interpret" not in inspect.signature(sk._make_splash_attention).parameters:
        pytest.skip(f"splash attention in JAX {jax.__version__} takes no interpret argument")
    pack.splash_attention(sk)  # the pack's rules, as on import
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    return sk, sm


def test_splash_mqa_vmapped_dk_dv_are_psummed_over_model():
    sk, sm = _splash()
    batch, heads, seq, dim = 4, 4, 128, 128  # the smallest blocks splash takes
    blocks = sk.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128,
                           block_kv_dkv=128, block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128)
    local = sk.make_splash_mqa(sm.MultiHeadMask([sm.CausalMask((seq, seq))] * (heads // 2)), head_shards=1,
                               q_seq_shards=1, block_sizes=blocks, interpret=True)
    whole = jax.vmap(sk.make_masked_mqa_reference(sm.MultiHeadMask([sm.CausalMask((seq, seq))] * heads)))
    mesh = make_mesh()
    q_spec, kv_spec = P("data", "model"), P("data")  # the shared k/v head: batch-sharded, replicated over model
    q, k, v = randn(0, (batch, heads, seq, dim)), randn(1, (batch, seq, dim)), randn(2, (batch, seq, dim))
    t = randn(3, (batch, heads, seq, dim))
    args = (put(q, mesh, q_spec), put(k, mesh, kv_spec), put(v, mesh, kv_spec))

    def grad_of(check):
        f = shard_map(lambda q, k, v: jax.vmap(local)(q, k, v), mesh, (q_spec, kv_spec, kv_spec), q_spec,
                      check=check)
        return jax.grad(lambda *a: (f(*a) * t).sum(), argnums=(0, 1, 2))

    grad = grad_of(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", reprules.ReplicationWarning)
        got = jax.jit(grad)(*args)
        psums = psum_axes(grad, *args)
    expected = jax.grad(lambda *a: (whole(*a) * t).sum(), argnums=(0, 1, 2))(q, k, v)
    assert max_err(got, expected) < 1e-3
    assert max_err(got, jax.jit(grad_of(False))(*args)) < 1e-4
    assert psums == [("model",), ("model",)]  # dk and dv, over the query heads' axis only
    # 0.10+: splash annotates dk/dv like k ({data}); the union is what gives them their psum.
    for c in caught:
        assert issubclass(c.category, reprules.ReplicationWarning)
        assert "splash_mqa_dkv" in str(c.message) and "replicated over {'model'}" in str(c.message)
