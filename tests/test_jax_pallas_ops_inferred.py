"""JAX's TPU Pallas ops with nested kernels, through the pack alone (no ``reprules.inference()``).

``tpu.megablox``, ``tpu.paged_attention``, ``tpu.ragged_paged_attention`` and
``tpu.random`` make their kernels anew on every call; their pack functions
register ``rules.inferred()`` on ``kernels_in(module)``, so with only
``import reprules`` they run with ``check_vma=True``. The workloads and their
limits are those of tests/test_infer_jax_pallas_ops.py and test_inference.py
(JAX 0.7 - 0.10's TPU interpreter hangs running megablox and paged_attention
inside shard_map: those run from 0.11).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import JAX_VERSION, max_err, megablox_in_own_process, psum_axes, put, randn, shard_map
from reprules import testing
from reprules._builtin_packs import jax_pallas_ops as pack

pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
if not hasattr(pltpu, "force_tpu_interpret_mode"):
    pytest.skip(f"JAX {jax.__version__} has no force_tpu_interpret_mode (0.7+)", allow_module_level=True)

OPS = "jax.experimental.pallas.ops.tpu"
PACKS = {"megablox": "megablox", "paged_attention": "paged_attention_tpu",
         "ragged_paged_attention": "ragged_paged_attention_tpu", "random": "random_tpu"}


def _loaded(name):
    try:
        module = importlib.import_module(f"{OPS}.{name}")
    except ImportError as err:
        pytest.skip(f"JAX {jax.__version__} has no tpu.{name} ({err})")
    getattr(pack, PACKS[name])(module)  # as the entry point does on import
    return module


@pytest.mark.parametrize("name", ["threefry", "philox"])
def test_prng_kernels_with_the_pack_alone(mesh, name):
    _loaded("random")
    mod = importlib.import_module(f"{OPS}.random.{name}")
    bits = {"threefry": lambda k: mod.threefry_2x32_count(k, (8, 128), (8, 128), (8, 128)),
            "philox": lambda k: mod.philox_4x32_kernel(k, (8, 128), (8, 128), block_size=(8, 128), offset=3)}[name]
    keys = jnp.asarray(np.random.RandomState(0).randint(0, 2**31, (4, 2)), jnp.uint32)
    f = shard_map(lambda k: bits(k[0])[None], mesh, P("data"), P("data"))
    with pltpu.force_tpu_interpret_mode():
        out = jax.jit(f)(put(keys, mesh, P("data")))
        testing.assert_no_all_reduce(f, put(keys, mesh, P("data")))
        expected = np.stack([np.asarray(jax.jit(bits)(keys[i])) for i in range(4)])
    assert np.array_equal(np.asarray(out), expected)


@pytest.mark.skipif(JAX_VERSION < (0, 11), reason="JAX 0.7 - 0.10's TPU interpreter hangs on megablox in shard_map")
def test_megablox_gmm_with_the_pack_alone(mesh):
    if os.environ.get(_INNER) != "1":
        return megablox_in_own_process(__file__, "test_megablox_gmm_with_the_pack_alone", {_INNER: "1"})
    _loaded("megablox")
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    sizes = jnp.array([48, 80], jnp.int32)
    op = lambda l, r: gmm(l, r, sizes, preferred_element_type=jnp.float32, tiling=(128, 128, 128))
    ref = lambda l, r: jnp.concatenate([op(c, r) for c in jnp.split(l, 4)])
    lhs, rhs, t = randn(0, (512, 128)), 0.1 * randn(1, (2, 128, 128)), randn(2, (512, 128))
    args = (put(lhs, mesh, P("data", None)), put(rhs, mesh, P()))
    on = shard_map(op, mesh, (P("data", None), P()), P("data", None))
    off = shard_map(op, mesh, (P("data", None), P()), P("data", None), check=False)
    grad = lambda f: jax.grad(lambda l, r: (f(l, r) * t).sum(), argnums=(0, 1))
    with pltpu.force_tpu_interpret_mode():
        out, g_on = jax.jit(on)(*args), jax.jit(grad(on))(*args)
        g_off, g_ref = jax.jit(grad(off))(*args), jax.jit(grad(ref))(lhs, rhs)
        psums = psum_axes(grad(on), *args)
        report = testing.collectives(grad(on), *args)
        expected = jax.jit(ref)(lhs, rhs)
    assert max_err(out, expected) == 0.0
    scale = float(np.abs(np.asarray(g_ref[1])).max())
    assert max_err(g_on, g_ref) / scale < 1e-6 and max_err(g_on, g_off) / scale < 1e-6
    assert psums == [("data",)] and report.count("all-reduce", defensive=True) == 0


def test_the_packs_load_on_import():
    code = ("import reprules\n"
            + "".join(f"import {OPS}.{name}\n" for name in PACKS)
            + "print(sorted(p.name.split(':')[1] for p in reprules.packs() if p.state == 'loaded' "
              "and p.module.startswith('jax.experimental.pallas.ops.tpu.') and 'splash' not in p.module))\n"
              "print(sorted(k for k in reprules.registered() if k.startswith('kernels_in:')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        str(sorted(PACKS.values())),
        str(sorted(f"kernels_in:{OPS}.{name}" for name in PACKS)),
    ]


_INNER = "REPRULES_PACK_GMM_INNER"
