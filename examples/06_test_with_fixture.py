"""A user's test file: reprules' pytest fixtures guard a training step's collectives.

reprules installs a pytest plugin (no ``conftest.py`` needed) with:

* the ``no_all_reduce`` fixture: ``no_all_reduce(fn, *args)`` fails the test
  if ``jax.jit(fn)`` has an all-reduce in its jaxpr, StableHLO or compiled HLO,
  naming the offending lines and, for a defensive one, the kernel without a rule;
* the ``collectives`` fixture: ``reprules.testing.collectives``, a report to
  assert on (``report.count("all-reduce", axes="data")``, ``report.defensive``);
* ``--reprules-cpu-devices N``: N fake CPU devices, set before JAX starts, and
  the marker ``@pytest.mark.reprules_devices(n)``, which skips a test when
  fewer devices exist.

This file is itself a pytest file. Run (needs pytest: ``pip install pytest``, or
``pip install '.[examples]'`` in the reprules clone):

    pytest examples/06_test_with_fixture.py --reprules-cpu-devices 8
    python examples/06_test_with_fixture.py        # the same, through pytest.main
    reprules audit examples/06_test_with_fixture.py   # its audit_step: the tests' step
"""

import sys

try:
    import pytest
except ModuleNotFoundError as err:
    if err.name != "pytest":
        raise
    sys.exit("06_test_with_fixture.py needs pytest: pip install pytest (or pip install '.[examples]' in the "
             "reprules clone; reprules is not on PyPI)")

pytestmark = pytest.mark.reprules_devices(8)


def _setup():
    """The model: a Pallas scale kernel under custom_vjp, on a (4, 2) mesh ``("data", "model")``.

    Built inside the tests, so that JAX starts after the plugin set the devices.
    """
    import jax
    import numpy as np
    from jax.experimental import pallas as pl
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import reprules
    from reprules.testing import shard_map  # check_vma= from JAX 0.6, check_rep= before

    @reprules.replication_rule()  # outputs vary like the union of the inputs
    def scale_kernel(x_ref, w_ref, o_ref):
        o_ref[...] = x_ref[...] * w_ref[...]

    def scale(x, w):
        return pl.pallas_call(scale_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, w)

    @jax.custom_vjp
    def layer(x, w):
        return scale(x, w)

    layer.defvjp(lambda x, w: (scale(x, w), (x, w)), lambda res, g: (scale(g, res[1]), (g * res[0]).sum(0)))

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    rng = np.random.RandomState(0)
    x = jax.device_put(rng.randn(16, 128).astype(np.float32), NamedSharding(mesh, P("data", None)))
    w = jax.device_put(rng.randn(128).astype(np.float32), NamedSharding(mesh, P()))
    t = rng.randn(16, 128).astype(np.float32)

    def loss(check):
        f = shard_map(layer, mesh, (P("data", None), P()), P("data", None), check)
        return lambda x, w: (f(x, w) * t).sum()

    return jax, loss, x, w


def test_input_gradient_needs_no_all_reduce(no_all_reduce):
    """x is sharded over `data` and replicated over `model`: its gradient needs no all-reduce."""
    jax, loss, x, w = _setup()
    f = loss(check=True)
    # w is held fixed. The custom_vjp's backward still computes w's (unused) cotangent, with
    # its psum over `data`, in the jaxpr; it is dead code, never lowered or run, so the default
    # levels ignore it (levels=("jaxpr",) would find it).
    no_all_reduce(jax.grad(lambda x: f(x, w)), x)


def test_weight_gradient_is_summed_over_data_only(collectives):
    """w is replicated: its gradient needs one all-reduce, over `data`, and nothing defensive."""
    jax, loss, x, w = _setup()
    report = collectives(jax.grad(loss(check=True), argnums=(0, 1)), x, w)
    assert report.count("all-reduce", axes="data") == 1, report
    assert report.count("all-reduce") == 1, report
    assert not report.defensive, report


def test_checking_off_is_caught(no_all_reduce):
    """What the fixture reports when shard_map runs with checking off: a defensive all-reduce."""
    jax, loss, x, w = _setup()
    f = loss(check=False)
    with pytest.raises(pytest.fail.Exception, match="defensive") as failure:
        no_all_reduce(jax.grad(lambda x: f(x, w)), x)
    assert "all-reduce over model" in str(failure.value)


def audit_step(check=True):
    """The target of ``reprules audit examples/06_test_with_fixture.py``: the tests' step,
    the gradients of x and w, with checking off or on."""
    jax, loss, x, w = _setup()
    return jax.grad(loss(check), argnums=(0, 1)), (x, w)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "--reprules-cpu-devices", "8", "-q", "-p", "no:cacheprovider"]))
