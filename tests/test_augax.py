"""augax 0.3.0's samplers (XLA FFI custom calls on CPU) with only ``import reprules``.

``augax.pg_sample`` (Pólya-Gamma draws) and ``augax.ks_sample`` (Kolmogorov scales)
inside ``shard_map`` on the (4, 2) ("data", "model") mesh with checking on, their
operands over ``data`` and one key replicated, or under ``jax.vmap`` with one key
per row (augax's batched FFI targets), rows over ``data``. augax gives its targets no
replication rule: reprules types each output by the union of its inputs' axes,
warning once per call site. Draws (no VJP): forward only, equal to checking off and
to the library on each ``data`` block of the whole arrays (a draw depends on the
whole call, so the unsharded reference is the library block by block), with no
all-reduce.

The draws vary over ``data``: with ``out_specs=P()``, JAX alone (reprules' sound
types off, or checking off) accepts and returns one device's block; reprules
refuses, naming the FFI target and the fix.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import max_err, put, shard_map
from jax.sharding import PartitionSpec as P

import reprules
from reprules import testing

augax = pytest.importorskip(
    "augax", reason="augax is not installed. To run these tests: pip install augax==0.3.0 (noxfile.py's AUGAX, as "
    "the newest-JAX tests session and the coverage session install it)")

N, ROWS, COLS, SHARDS = 32, 8, 4, 4
X = P("data")


@pytest.fixture(autouse=True)
def x64():
    """augax draws in float64 only (it refuses without jax_enable_x64): for each test, then restored."""
    with jax.enable_x64(True):
        yield


def _operands(sampler, shape):
    rng = np.random.RandomState(0)
    if sampler == "pg":  # h = 1 (the logit augmentation), z the linear predictor
        return np.ones(shape), rng.randn(*shape)
    return (rng.logistic(size=shape),)


def _per_block(fn, blocked, *rest):
    """The library on each data block of ``blocked`` (``rest`` whole), concatenated."""
    parts = [jnp.split(a, SHARDS) for a in blocked]
    return jnp.concatenate([fn(*(p[i] for p in parts), *rest) for i in range(SHARDS)])


def _setup(sampler, batched):
    op = augax.pg_sample if sampler == "pg" else augax.ks_sample
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    key = jax.random.key(0)
    if batched:  # one key per row: augax's batched FFI target
        fn = jax.vmap(op)
        args = (*_operands(sampler, (ROWS, COLS)), jax.random.split(key, ROWS))
        specs = (P("data", None),) * (len(args) - 1) + (X,)
        return fn, mesh, args, specs, P("data", None), _per_block(fn, args)
    args = (*_operands(sampler, (N,)), key)
    return op, mesh, args, (X,) * (len(args) - 1) + (P(),), X, _per_block(op, args[:-1], key)


@pytest.mark.filterwarnings("ignore::reprules.ReplicationWarning")  # its own test below
@pytest.mark.parametrize("batched", [False, True], ids=["one-key", "vmapped"])
@pytest.mark.parametrize("sampler", ["pg", "ks"])
def test_draws_equal_checking_off_and_the_library_per_block(sampler, batched):
    fn, mesh, args, specs, out, want = _setup(sampler, batched)
    sharded = [put(a, mesh, s) for a, s in zip(args, specs)]
    on, off = shard_map(fn, mesh, specs, out), shard_map(fn, mesh, specs, out, check=False)
    got = jax.jit(on)(*sharded)
    assert got.dtype == jnp.float64 and float(jnp.abs(got).max()) > 0
    assert max_err(got, jax.jit(off)(*sharded)) == 0.0
    assert max_err(got, want) == 0.0
    testing.assert_no_all_reduce(on, *sharded)


def test_a_rule_less_target_warns_naming_it_and_the_fix():
    from reprules._shim.sound_types import opaque_types

    opaque_types._warned.clear()  # one warning per target and call site, per process
    fn, mesh, args, specs, out, _ = _setup("pg", False)
    with pytest.warns(reprules.ReplicationWarning, match=r"(?s)The FFI target 'augax_pg_sample_f64' .*"
                      r"varying over \{'data'\}.*replication_rule\(rules.same\(\)\)\(reprules.ffi_target"
                      r"\('augax_pg_sample_f64'\)\)"):
        jax.jit(shard_map(fn, mesh, specs, out)).lower(*args)


@pytest.mark.filterwarnings("ignore::reprules.ReplicationWarning")
def test_varying_draws_under_replicated_out_specs_are_refused(monkeypatch):
    """out_specs=P() for draws that differ per data block: refused, saying which call varies
    and why; JAX alone accepts and returns the first block only (a quarter of the draws)."""
    fn, mesh, args, specs, _, want = _setup("pg", False)
    sharded = [put(a, mesh, s) for a, s in zip(args, specs)]
    with pytest.raises(ValueError, match=r"(?s)out_specs is P\(\).*not \{data\}.*reprules \(mesh axes "
                       r"\{'data', 'model'\}, JAX .*vary over \{'data'\} because of calls that JAX alone types "
                       r"replicated.*the FFI target 'augax_pg_sample_f64', which has no rule.*"
                       r"Fix: keep \{'data'\} in the out_specs"):
        jax.jit(shard_map(fn, mesh, specs, P()))(*sharded)
    unchecked = jax.jit(shard_map(fn, mesh, specs, P(), check=False))(*sharded)
    monkeypatch.setenv("REPRULES_SOUND_TYPES", "0")  # JAX's own typing: the hazard, accepted
    jax.clear_caches()  # the switch is read when a function is traced
    jax_alone = jax.jit(shard_map(fn, mesh, specs, P()))(*sharded)
    for got in (unchecked, jax_alone):
        assert got.shape == (N // SHARDS,) and max_err(got, want[: N // SHARDS]) == 0.0
