"""JAX's own TPU Pallas ops whose kernels are nested functions, under ``reprules.inference()``.

No rule is registered for ``tpu.random`` (threefry, philox), ``tpu.paged_attention``
or ``tpu.ragged_paged_attention``: their kernels are made anew on every call.
They run on CPU under ``pltpu.force_tpu_interpret_mode()`` (JAX 0.7+) where JAX's
TPU interpreter supports them; each test says what it can check:

* the PRNG kernels (``threefry_2x32_count``, ``philox_4x32_kernel``): keys
  sharded over ``data`` (or replicated), bits equal to the same kernel run
  unsharded, no collective. Through ``jax.random`` (the ``pallas_threefry2x32``
  / ``pallas_philox4x32`` PRNG impls) they do not run under ``jit`` on CPU,
  with or without ``shard_map``: JAX's lowering of ``random_bits`` loses the TPU
  interpreter's ordered-effect token (``KeyError: OrderedIOEffect``).
* ``paged_attention``: batch sharded over ``data``, page pool replicated;
  equal to the op run unsharded, no collective (0.11+: JAX 0.7 - 0.10's TPU
  interpreter hangs running it inside shard_map, with or without reprules).
* ``ragged_paged_attention``: JAX's TPU interpreter cannot run it on CPU, even
  unsharded (``'ReshapeTransform' object has no attribute 'indices'``): the
  rule is derived and the program traced, lowered and compiled with no
  collective (traced only on 0.6, which has no TPU interpreter).
"""

from __future__ import annotations

import contextlib
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import reprules
from helpers import JAX_VERSION, count_all_reduce, max_err, psum_axes, put, shard_map

try:
    from jax.experimental.pallas import tpu as pltpu
except ImportError:  # pragma: no cover - every version of the matrix has it
    pltpu = None

CAN_INTERPRET = hasattr(pltpu, "force_tpu_interpret_mode")  # 0.7+


def _op(path, run=True):
    """The op module under ``jax.experimental.pallas.ops.tpu``; skips where it is absent, or
    cannot run on CPU when ``run``."""
    try:
        module = importlib.import_module(f"jax.experimental.pallas.ops.tpu.{path}")
    except ImportError as err:
        pytest.skip(f"JAX {jax.__version__} has no tpu.{path} ({err})")
    if run and not CAN_INTERPRET:
        pytest.skip(f"tpu.{path} takes no interpret argument; JAX {jax.__version__} has no "
                    "pltpu.force_tpu_interpret_mode (0.7+) to run it on CPU")
    return module


def _kernels_inferred(fn, *args):
    """The Pallas kernels of ``fn(*args)`` in the collectives report: all inferred."""
    report = reprules.testing.collectives(jax.jit(fn), *args)
    assert report.kernels and all(k.has_rule and k.rule.startswith("inferred(") for k in report.kernels)
    return report


# --- tpu.random ------------------------------------------------------------------------------


def _prng_kernels():
    threefry = _op("random.threefry")
    philox = _op("random.philox")
    return {
        "threefry": lambda key: threefry.threefry_2x32_count(key, (8, 128), (8, 128), (8, 128)),
        "philox": lambda key: philox.philox_4x32_kernel(key, (8, 128), (8, 128), block_size=(8, 128), offset=3),
    }


@pytest.mark.parametrize("name", ["threefry", "philox"])
def test_prng_kernels_per_shard_keys_are_exact(mesh, name):
    bits = _prng_kernels()[name]
    keys = jnp.asarray(np.random.RandomState(0).randint(0, 2**31, (4, 2)), jnp.uint32)
    f = shard_map(lambda k: bits(k[0])[None], mesh, P("data"), P("data"))
    with pltpu.force_tpu_interpret_mode():
        with reprules.inference():
            out = jax.jit(f)(put(keys, mesh, P("data")))
            assert count_all_reduce(f, put(keys, mesh, P("data"))) == (0, 0, 0)
            _kernels_inferred(f, put(keys, mesh, P("data")))
            with pytest.raises(ValueError, match="out_specs"):  # the bits vary with the key
                jax.jit(shard_map(lambda k: bits(k[0]), mesh, P("data"), P()))(put(keys, mesh, P("data")))
        expected = np.stack([np.asarray(jax.jit(bits)(keys[i])) for i in range(4)])  # unsharded
    assert np.array_equal(np.asarray(out), expected)


@pytest.mark.parametrize("name", ["threefry", "philox"])
def test_prng_kernels_replicated_key_gives_replicated_bits(mesh, name):
    bits = _prng_kernels()[name]
    key = jnp.asarray([7, 11], jnp.uint32)
    f = shard_map(bits, mesh, P(), P())  # the bits depend on the key alone: replicated
    with pltpu.force_tpu_interpret_mode():
        with reprules.inference():
            out = jax.jit(f)(put(key, mesh, P()))
        expected = jax.jit(bits)(key)
    assert np.array_equal(np.asarray(out), np.asarray(expected))


# --- tpu.paged_attention ---------------------------------------------------------------------


@pytest.mark.skipif(JAX_VERSION < (0, 11), reason=(
    "JAX 0.7 - 0.10's TPU interpreter hangs running paged_attention inside shard_map on 8 CPU "
    "devices, with check_vma=False and without reprules too (seen on 0.7.2, 0.8.3, 0.10.2)"))
def test_paged_attention_equals_the_unsharded_op(mesh):
    module = _op("paged_attention")
    rng = np.random.RandomState(0)
    batch, q_heads, kv_heads, head_dim, page, per_seq, pages = 8, 2, 1, 128, 16, 4, 32
    q = jnp.asarray(rng.randn(batch, q_heads, head_dim), jnp.float32)
    k_pages = jnp.asarray(rng.randn(kv_heads, pages, page, head_dim), jnp.float32)
    v_pages = jnp.asarray(rng.randn(kv_heads, pages, page, head_dim), jnp.float32)
    lengths = jnp.asarray(rng.randint(1, per_seq * page + 1, batch), jnp.int32)
    indices = jnp.asarray(rng.randint(0, pages, (batch, per_seq)), jnp.int32)

    def attend(q, k, v, lengths, indices):
        return module.paged_attention(q, k, v, lengths, indices, pages_per_compute_block=2)

    specs = (P("data"), P(), P(), P("data"), P("data"))  # the page pool replicated
    args = [put(a, mesh, s) for a, s in zip((q, k_pages, v_pages, lengths, indices), specs)]
    f = shard_map(attend, mesh, specs, P("data"))
    with pltpu.force_tpu_interpret_mode():
        with reprules.inference():
            out = jax.jit(f)(*args)
            assert count_all_reduce(f, *args) == (0, 0, 0)
            _kernels_inferred(f, *args)
        expected = jax.jit(attend)(q, k_pages, v_pages, lengths, indices)
    assert max_err(out, expected) == 0.0


# --- tpu.ragged_paged_attention ------------------------------------------------------------------


def test_ragged_paged_attention_is_inferred_without_collectives(mesh):
    module = _op("ragged_paged_attention.kernel", run=False)
    rng = np.random.RandomState(0)
    tokens, q_heads, kv_heads2, head_dim, page, per_seq, pages, seqs = 8, 2, 2, 128, 16, 2, 8, 2

    def shard():  # one data shard's batch: 2 sequences of 3 and 5 query tokens
        return (
            rng.randn(tokens, q_heads, head_dim).astype(np.float32),
            rng.randn(pages, page, kv_heads2, head_dim).astype(np.float32),
            np.array([20, 30], np.int32),
            rng.permutation(pages)[: seqs * per_seq].reshape(seqs, per_seq).astype(np.int32),
            np.array([0, 3, 8], np.int32),
            np.array([seqs], np.int32),
        )

    shards = [shard() for _ in range(4)]
    args = [put(jnp.asarray(np.concatenate(parts)), mesh, P("data")) for parts in zip(*shards)]

    def attend(*a):
        return module.ragged_paged_attention(*a, num_kv_pages_per_block=1, num_queries_per_block=8)

    f = shard_map(attend, mesh, (P("data"),) * 6, P("data"))
    interpret = pltpu.force_tpu_interpret_mode() if CAN_INTERPRET else contextlib.nullcontext()
    with interpret, reprules.inference():
        if CAN_INTERPRET:  # lowering on CPU needs the TPU interpreter (0.7+)
            assert count_all_reduce(f, *args) == (0, 0, 0)  # traced, lowered and compiled
            _kernels_inferred(f, *args)
        else:
            assert psum_axes(f, *args) == []
        with pytest.raises(ValueError, match="out_specs"):  # the output varies over data
            jax.make_jaxpr(shard_map(attend, mesh, (P("data"),) * 6, P()))(*args)
