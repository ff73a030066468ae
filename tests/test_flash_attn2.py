"""jax-flash-attn2 0.0.3's Pallas platform with only ``import reprules``, on CPU.

``create_flash_attention(backend="tpu", platform="pallas")`` (the library accepts the
Pallas platform only with that backend) repeats the KV heads and calls JAX's TPU
flash attention, whose kernels get their rules from reprules' built-in pack. Inside
``shard_map`` on the (4, 2) ("data", "model") mesh, batch over ``data``, heads over
``model``, with checking on; causal, non-causal, and one KV head replicated over
``model``. The library has no interpret switch: ``pltpu.force_tpu_interpret_mode(True)``
here makes every ``pallas_call`` ``interpret=True`` (Pallas' HLO interpreter). Forward
and gradients equal checking off and the library's own ``basic_attention_refrence``
on the whole arrays; the checked gradient has no defensive all-reduce, and its psums
are checking off's (the replicated K/V head's gradients over ``model``, nothing else).

jax-flash-attn2 imports eformer 0.0.15 (its pin), whose Triton caller defines a
primitive with ``jax.core.Primitive``, gone from JAX 0.12: the import borrows
``jax.extend.core.Primitive`` under that name and gives it back. Its Triton platform
needs a GPU: tests/test_gpu_only.py.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import coverage_cases, max_err, psum_axes, put, shard_map
from jax.sharding import PartitionSpec as P

from reprules import testing

INSTALL = ("jax-flash-attn2 is not installed. To run these tests: pip install --no-deps jax-flash-attn2==0.0.3 "
           "eformer==0.0.15, then 'reprules[triton]' chex 'einops<0.9' 'mergedeep<1.4' ray==2.42.1 'tblib<3.1' "
           "(noxfile.py's FLASH_ATTN2 and FLASH_ATTN2_IMPORTS, as the coverage session installs them)")


with coverage_cases("cases_flash_attn2").lend_jax_core_primitive():
    fa = pytest.importorskip("jax_flash_attn2", reason=INSTALL)
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

B, S, H, D = 4, 128, 4, 64  # each device: one sequence, two query heads
HEADS = P("data", None, "model", None)


@pytest.fixture(autouse=True)
def pack():
    """The pack's registration, as on ``import jax_flash_attn2`` (conftest clears rules after each test)."""
    from jax.experimental.pallas.ops.tpu import flash_attention

    from reprules._builtin_packs import jax_pallas_ops

    jax_pallas_ops.flash_attention_tpu(flash_attention)


@pytest.mark.parametrize(("causal", "kv_heads"), [(True, H), (False, H), (True, 1)],
                         ids=["causal", "non-causal", "one-kv-head-replicated"])
def test_pallas_forward_and_gradients_are_exact(mesh, causal, kv_heads):
    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(B, S, H, D), jnp.float32)
    k, v = (jnp.asarray(rng.randn(B, S, kv_heads, D), jnp.float32) for _ in range(2))
    t = jnp.asarray(rng.randn(B, S, H, D), jnp.float32)
    kv = HEADS if kv_heads == H else P("data", None, None, None)
    specs = (HEADS, kv, kv)
    attn = fa.create_flash_attention(backend="tpu", platform="pallas", softmax_scale=D ** -0.5)

    def body(q, k, v):
        return attn(q, k, v, causal=causal)

    def step(f):
        grad = jax.grad(lambda *a: (f(*a) * t).sum(), argnums=(0, 1, 2))
        return grad, jax.jit(lambda *a: (f(*a), grad(*a)))

    sharded = [put(a, mesh, s) for a, s in zip((q, k, v), specs)]
    with pltpu.force_tpu_interpret_mode(True):
        grad_on, on = step(shard_map(body, mesh, specs, HEADS))
        grad_off, off = step(shard_map(body, mesh, specs, HEADS, check=False))
        (out_on, g_on), (out_off, g_off) = on(*sharded), off(*sharded)
        out_ref, g_ref = step(lambda q, k, v: fa.basic_attention_refrence(q, k, v, causal=causal))[1](q, k, v)
        report = testing.collectives(grad_on, *sharded)
        psums_on, psums_off = psum_axes(grad_on, *sharded), psum_axes(grad_off, *sharded)
    assert float(jnp.abs(out_ref).max()) > 0
    assert max_err(out_on, out_off) == 0.0
    assert max_err(g_on, g_off) < 1e-6  # the replicated head's psum may sum in another order
    assert max_err(out_on, out_ref) < 1e-5
    assert max_err(g_on, g_ref) / max(float(jnp.abs(g).max()) for g in g_ref) < 1e-5
    assert report.count("all-reduce", defensive=True) == 0
    assert psums_on == psums_off == ([] if kv_heads == H else [("model",), ("model",)])


def test_the_pack_loads_on_import():
    """In a fresh interpreter, ``import reprules`` then ``import jax_flash_attn2``: the import of
    JAX's TPU flash attention loads reprules' pack, which gives its three kernels rules.same()."""
    import subprocess
    import sys

    code = ("import reprules, jax.core, jax.extend.core\n"
            "jax.core.Primitive = jax.extend.core.Primitive  # eformer's import (see the module docstring)\n"
            "import jax_flash_attn2\n"
            "print([p.state for p in reprules.packs() if p.name.endswith(':flash_attention_tpu')])\n"
            "print(sorted({str(r.rule) for r in reprules.registered().values()}), len(reprules.registered()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["['loaded']", "['rules.same()'] 3"]
