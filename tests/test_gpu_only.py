"""Triton kernel libraries that run only on a CUDA GPU: kvax 0.1.0 and jax-flash-attn2 0.0.3's
Triton platform (jax-triton's own ``triton_call``: tests/test_triton.py).

On a GPU machine run them with the CPU kept as JAX's default platform (conftest's 8 fake
CPU devices) and the GPUs reachable as ``jax.devices("gpu")``::

    JAX_PLATFORMS=cpu,cuda python -m pytest tests/test_gpu_only.py tests/test_triton.py

Elsewhere they skip, saying so. Each runs on a ("data", "model") mesh of the GPUs (every
GPU on ``data``; ``model`` of size 1, so that a KV head replicated over it is still typed
so and its gradient still needs the psum), batch over ``data``, heads over ``model``:
forward and gradients with checking on equal checking off and an unsharded reference
(``jnp`` attention on the whole arrays), and the checked gradient has no defensive
all-reduce.

* jax-flash-attn2: ``create_flash_attention(backend="gpu", platform="triton")`` inside
  ``shard_map``; its kernels go through eformer's own ``triton_kernel_call`` primitive
  (not jax-triton's), which has no rule: reprules types it by the union of its inputs
  (a ``ReplicationWarning``). That typing, and the gradient's psums, are checked on CPU
  too (tracing needs no GPU).
* kvax: its public ``create_attention_mask`` and ``flash_attention`` (under
  ``attention_specs``, ``mesh=``), which shard_map themselves with ``check_rep=False``
  hard-coded (``kvax.utils.sharding``); checking on is that shard_map with checking on,
  switched here at the test site. kvax 0.1.0 imports ``jax.experimental.shard_map.Specs``,
  gone from JAX 0.8: it runs with JAX <= 0.7.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import coverage_cases, max_err, psum_axes, put, shard_map
from jax.sharding import PartitionSpec as P

from reprules import testing


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU backend (or JAX_PLATFORMS leaves it out)
        return []


needs_gpu = pytest.mark.skipif(
    not _gpus(), reason="needs a CUDA GPU (jax.devices('gpu') is empty): on a GPU machine run "
    "JAX_PLATFORMS=cpu,cuda python -m pytest tests/test_gpu_only.py (the CPU stays JAX's default platform, "
    "with conftest's 8 fake devices)")

B_PER_GPU, S, H, D = 2, 256, 4, 64
HEADS = P("data", None, "model", None)


def _gpu_mesh():
    gpus = _gpus()
    return jax.sharding.Mesh(np.array(gpus).reshape(len(gpus), 1), ("data", "model"))


def _qkv(batch, kv_heads, dtype):
    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(batch, S, H, D), dtype)
    k, v = (jnp.asarray(rng.randn(batch, S, kv_heads, D), dtype) for _ in range(2))
    return q, k, v, jnp.asarray(rng.randn(batch, S, H, D), jnp.float32)


def _reference(q, k, v, causal=True):
    """Attention in float32 on the whole arrays, the KV heads repeated to the query heads."""
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    k, v = (jnp.repeat(a, q.shape[2] // a.shape[2], axis=2) for a in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _check(make, reference, args, t, tol):
    """``make(check)`` -> the attention on sharded ``args``: forward and gradients with checking
    on equal checking off and ``reference`` on the whole arrays; no defensive all-reduce."""
    def loss(f):
        return lambda *a: (f(*a).astype(jnp.float32) * t).sum()

    def run(f, *a):
        grad = jax.grad(loss(f), argnums=(0, 1, 2))
        return jax.jit(f)(*a), jax.jit(grad)(*a), grad

    whole = [np.asarray(a) for a in args]
    out_on, g_on, grad_on = run(make(True), *args)
    out_off, g_off, grad_off = run(make(False), *args)
    out_ref, g_ref, _ = run(reference, *whole)
    scale = lambda tree: max(float(jnp.abs(x.astype(jnp.float32)).max()) for x in jax.tree.leaves(tree))  # noqa: E731
    # the same kernels (a replicated head's psum may sum in another order): equal but for a
    # half-precision rounding; a missing psum or one device's block would be off by O(1)
    assert max_err(out_on, out_off) <= 1e-2 * scale(out_off)
    assert max_err(g_on, g_off) <= 1e-2 * scale(g_off)
    assert max_err(out_on, out_ref) <= tol * scale(out_ref)
    assert max_err(g_on, g_ref) <= tol * scale(g_ref)
    report = testing.collectives(grad_on, *args)
    assert report.count("all-reduce", defensive=True) == 0, report
    return grad_on, grad_off


# --- jax-flash-attn2's Triton platform -------------------------------------------------------------

@pytest.fixture
def flash_attn2():
    with coverage_cases("cases_flash_attn2").lend_jax_core_primitive():
        return pytest.importorskip("jax_flash_attn2", reason=(
            "jax-flash-attn2 is not installed: pip install --no-deps jax-flash-attn2==0.0.3 eformer==0.0.15, then "
            "'reprules[triton]' chex 'einops<0.9' 'mergedeep<1.4' ray==2.42.1 'tblib<3.1' (noxfile.py's FLASH_ATTN2)"))


def _fa2_triton(fa, mesh, kv_heads):
    attn = fa.create_flash_attention(backend="gpu", platform="triton", softmax_scale=D ** -0.5)
    kv = HEADS if kv_heads == H else P("data", None, None, None)
    return lambda check: shard_map(functools.partial(attn, causal=True), mesh, (HEADS, kv, kv), HEADS, check=check)


@pytest.mark.filterwarnings("ignore::reprules.ReplicationWarning")  # eformer's rule-less primitive
@pytest.mark.parametrize("kv_heads", [H, 1], ids=["heads-over-model", "one-kv-head-replicated"])
def test_flash_attn2_triton_is_typed_soundly_on_cpu(mesh, flash_attn2, kv_heads):
    """Tracing only (Triton lowers on a GPU): the kernel calls typed varying over both axes,
    and the checked gradient's psums are checking off's (the replicated head's, over ``model``)."""
    q, k, v, t = _qkv(4, kv_heads, jnp.float16)
    make = _fa2_triton(flash_attn2, mesh, kv_heads)
    grads = [jax.grad(lambda *a, f=make(c): (f(*a).astype(jnp.float32) * t).sum(), argnums=(0, 1, 2))
             for c in (True, False)]
    text = str(jax.make_jaxpr(make(True))(q, k, v))
    calls = [ln for ln in text.splitlines() if "= triton_kernel_call[" in ln]
    assert calls and all("{V:(data,model)}" in ln.split("=")[0] for ln in calls), calls
    assert psum_axes(grads[0], q, k, v) == psum_axes(grads[1], q, k, v) == (
        [] if kv_heads == H else [("model",), ("model",)])


@needs_gpu
@pytest.mark.filterwarnings("ignore::reprules.ReplicationWarning")
@pytest.mark.parametrize("kv_heads", [H, 1], ids=["heads-over-model", "one-kv-head-replicated"])
def test_flash_attn2_triton_on_gpu(flash_attn2, kv_heads):
    mesh = _gpu_mesh()
    q, k, v, t = _qkv(B_PER_GPU * len(_gpus()), kv_heads, jnp.float16)  # its kernels take fp16/bf16 only
    kv = HEADS if kv_heads == H else P("data", None, None, None)
    args = [put(a, mesh, s) for a, s in zip((q, k, v), (HEADS, kv, kv))]
    _check(_fa2_triton(flash_attn2, mesh, kv_heads), _reference, args, put(t, mesh, HEADS), tol=2e-2)  # float16


# --- kvax ----------------------------------------------------------------------------------------------

@pytest.fixture
def kvax():
    try:
        import kvax
    except ImportError as err:  # not installed, or jax-triton without a GPU jaxlib (before JAX 0.11)
        pytest.skip(f"kvax does not import ({err}): pip install kvax==0.1.0 (it brings jax-triton and triton)")
    except AttributeError as err:  # a JAX without what kvax 0.1.0 imports
        pytest.skip(f"kvax 0.1.0 does not import on JAX {jax.__version__} ({err}: it imports "
                    "jax.experimental.shard_map.Specs, gone from JAX 0.8); run with JAX <= 0.7")
    return kvax


@contextlib.contextmanager
def _kvax_shard_map_checking(kvax, check):
    """kvax's own shard_map (kvax.utils.sharding) hard-codes check_rep=False: with ``check``,
    the same shard_map with checking on."""
    sharding = kvax.utils.sharding
    original = sharding.jax_shard_map
    sharding.jax_shard_map = lambda f, **kw: original(f, **{**kw, "check_rep": check})
    try:
        yield
    finally:
        sharding.jax_shard_map = original


@needs_gpu
@pytest.mark.filterwarnings("ignore::reprules.ReplicationWarning")  # kvax gives its Triton kernels no rule
@pytest.mark.parametrize("kv_heads", [H, 1], ids=["heads-over-model", "one-kv-head-replicated"])
def test_kvax_flash_attention_on_gpu(kvax, kv_heads):
    """kvax's documented use: the masks from ``create_attention_mask``, then ``flash_attention``
    with positions and segment ids (one causal document per sequence), under ``attention_specs``."""
    from kvax.ops import create_attention_mask, flash_attention
    from kvax.utils import FlashAttentionParamsConfig, attention_specs

    mesh = _gpu_mesh()
    batch = B_PER_GPU * len(_gpus())
    q, k, v, t = _qkv(batch, kv_heads, jnp.bfloat16)
    positions = jnp.tile(jnp.arange(S, dtype=jnp.int32), (batch, 1))
    segments = jnp.zeros((batch, S), jnp.int32)
    kv_specs = ("data", None, "model" if kv_heads == H else None, None)
    # The masks' blocks must be the kernels': one config, passed to both (create_attention_mask
    # also needs bwd_params given with calc_bwd_mask=True).
    params = dict(fwd_params=FlashAttentionParamsConfig(), bwd_params=FlashAttentionParamsConfig())

    def make(check):
        def attention(q, k, v):
            with _kvax_shard_map_checking(kvax, check):
                masks = create_attention_mask(positions, segments, positions, segments, calc_bwd_mask=True,
                                              mesh=mesh, **params)
                return flash_attention(q, k, v, positions, segments, positions, segments, masks, scale=D ** -0.5,
                                       mesh=mesh, **params)
        return attention

    kv = P(*kv_specs)
    with attention_specs(query_specs=("data", None, "model", None), kv_specs=kv_specs):
        args = [put(a, mesh, s) for a, s in zip((q, k, v), (HEADS, kv, kv))]
        _check(make, _reference, args, put(t, mesh, HEADS), tol=5e-2)  # bfloat16
