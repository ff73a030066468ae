"""Verify mode compares like with like: equal non-finite values are equal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh, put, shard_map
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import reprules
from reprules import rules


def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def copy(x):
    return pl.pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


def _run(mesh, x, spec):
    return jax.block_until_ready(jax.jit(shard_map(copy, mesh, spec, spec))(x))


@pytest.mark.parametrize("value", [-np.inf, np.inf, np.nan], ids=["-inf", "+inf", "nan"])
def test_same_non_finite_value_on_every_device_is_not_a_mismatch(value):
    # rules.same(): the copy of x (sharded over data) is replicated over model,
    # and every model replica holds the same non-finite values.
    reprules.replication_rule(rules.same())(copy_kernel)
    mesh = make_mesh()
    host = np.full((8, 128), value, np.float32)
    host[:, :3] = 1.0  # finite elements alongside
    with reprules.verify():
        out = _run(mesh, put(jnp.asarray(host), mesh, P("data", None)), P("data", None))
    np.testing.assert_array_equal(np.asarray(out), host)


def _one_shard(value):
    """Rows of data shard 0 hold ``value``, the other shards 0."""
    host = np.zeros((8, 128), np.float32)
    host[:2] = value
    return jnp.asarray(host)


def test_nan_on_one_device_only_is_a_mismatch():
    reprules.replication_rule(rules.invariant("data"))(copy_kernel)  # a lie: x varies over data
    mesh = make_mesh()
    x = put(_one_shard(np.nan), mesh, P("data", None))
    with pytest.raises(reprules.ReplicationMismatchError,
                       match=r"(?s)output 0 of kernel 'copy_kernel' is declared replicated over mesh axis 'data'.*"
                             r"differs across 'data': NaN on some devices and not on others at 256 element\(s\)"), \
            reprules.verify():
        _run(mesh, x, P("data", None))


@pytest.mark.parametrize("value", [np.inf, -np.inf], ids=["+inf", "-inf"])
def test_inf_against_finite_is_a_mismatch(value):
    reprules.replication_rule(rules.invariant("data"))(copy_kernel)
    mesh = make_mesh()
    x = put(_one_shard(value), mesh, P("data", None))
    with pytest.raises(reprules.ReplicationMismatchError,
                       match=r"(?s)output 0 of kernel 'copy_kernel' is declared replicated over mesh axis 'data'.*"
                             r"differs across 'data' by up to inf at 256 element\(s\)"), \
            reprules.verify():
        _run(mesh, x, P("data", None))
